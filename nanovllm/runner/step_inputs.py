"""One step's inputs, built in two stages that every tensor-parallel rank shares.

1. `StepMessage.of(seqs, is_prefill)` (rank 0) takes what the forward pass needs of the scheduled
   sequences as plain lists: the step's new token ids, where each sequence's new tokens start and
   end, its length and its block table, and the step's swap copies (KV blocks to move between the
   device cache and host memory before the forward pass). No sampling fields and no other tokens,
   so a decode step costs the same at any sequence length. It is also the tensor-parallel wire
   format: rank 0 pickles it once per step for the workers, and each rank swaps its own shard.
2. `prefill_inputs` (here) and `DecodeInputs.fill` (decode_inputs.py) turn a message into
   `StepInputs`: the forward pass's tensors and attention metadata, and which rows sample.
Every rank builds its tensors from the same message by the same code, so no two can disagree.
The slot helpers map a block table to flat cache slots (block_id * block_size + offset).
"""
from typing import NamedTuple

import torch

from nanovllm.platform.device import device_platform
from nanovllm.scheduling.block_manager import NO_COPIES, BlockCopies
from nanovllm.scheduling.sequence import Sequence
from nanovllm.runner.prompt_logprobs import PromptTargets, prompt_targets
from nanovllm.runner.sampling_inputs import philox_keys
from nanovllm.utils.context import AttentionMetadata
from nanovllm.utils.math_utils import cdiv


class HeadDraw(NamedTuple):
    """How each sequence of a step draws its token where the LM head may choose it without the
    logits (every sequence needs only its temperature and seed: ModelRunner.launch): its temperature
    (0 = greedy) and, unless all are greedy, its noise's key and counter (sampling_inputs.philox_keys,
    as the sampler's race would take them)."""
    temperatures: list[float]
    keys: list[int]  # empty when every temperature is 0
    counters: list[int]

    @classmethod
    def of(cls, seqs: list[Sequence]) -> "HeadDraw":
        temperatures = [seq.sampling_params.temperature for seq in seqs]
        return cls(temperatures, *philox_keys(seqs)) if any(temperatures) else cls(temperatures, [], [])

    def rows(self, indices: list[int]) -> "HeadDraw":
        return HeadDraw(*([column[i] for i in indices] if column else column for column in self))


class StepMessage(NamedTuple):
    is_prefill: bool
    token_ids: list[int]  # the step's new tokens, sequence after sequence (a decode step: each one's newest)
    starts: list[int]  # per sequence: the position of its first new token (its num_computed_tokens)
    ends: list[int]  # per sequence: its tokens with K/V once the step is done (start + its new tokens)
    lengths: list[int]  # per sequence: all its tokens; it samples in this step iff its end is its length
    block_tables: list[list[int]]  # per sequence; empty for the warm-up, which has no cache
    swap_out: BlockCopies = NO_COPIES  # device -> host block copies, made first
    swap_in: BlockCopies = NO_COPIES  # host -> device block copies, made next (then the forward pass)
    # Speculative decoding: per sequence, the proposed tokens after its newest one that this step
    # verifies (they are among its new tokens and counted in its end and length); empty: none.
    num_proposed: list[int] | tuple[()] = ()
    # Prompt logprobs: per sequence, the prompt tokens its rows score in this step, or None
    # (runner/prompt_logprobs.py); empty when no sequence of the step scores any.
    prompt_targets: list[PromptTargets | None] | tuple[()] = ()
    # Set where the step may leave its tokens instead of logits (the LM head chooses them:
    # StepLogits.tokens; the caller samples through ModelRunner.sample_pending); None: logits.
    head_draw: HeadDraw | None = None

    @classmethod
    def of(cls, seqs: list[Sequence], is_prefill: bool, swap_out: BlockCopies = NO_COPIES,
           swap_in: BlockCopies = NO_COPIES, proposals: list[list[int]] | None = None,
           head_draw: HeadDraw | None = None) -> "StepMessage":
        """The message of a scheduled batch: each sequence's num_scheduled_tokens new tokens from
        num_computed_tokens on (a prefill chunk, or a decode step's one newest token). A prefill
        step may hold decode rows too (a mixed batch): one new token over the cached rest. With
        `proposals` (a varlen step), each sequence's proposed tokens follow its new ones."""
        lengths = [len(seq) for seq in seqs]
        tables = [seq.block_table for seq in seqs]
        if not is_prefill:  # one new token each, the newest: its context is the whole sequence
            return cls(False, [seq.last_token for seq in seqs], [n - 1 for n in lengths], lengths, lengths, tables,
                       swap_out, swap_in, head_draw=head_draw)
        token_ids, starts, ends, targets = [], [], [], []
        for i, seq in enumerate(seqs):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            token_ids.extend(seq.token_ids[start:end])
            targets.append(prompt_targets(seq, start, end))
            if proposals:
                token_ids.extend(proposals[i])
                end += len(proposals[i])
                lengths[i] += len(proposals[i])
            starts.append(start)
            ends.append(end)
        num_proposed = [len(p) for p in proposals] if proposals else ()
        if not any(targets):
            targets = ()
        return cls(True, token_ids, starts, ends, lengths, tables, swap_out, swap_in, num_proposed, targets,
                   None if proposals or targets else head_draw)

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64; a graph's decode step pads it to its batch size
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_indices: list[int]  # the sequences that sample in this step (index into the step's sequences)
    # Their rows among the forward pass's outputs (the last new token of each): an index tensor,
    # or a slice when they are the first rows in order (a decode step).
    sample_rows: torch.Tensor | slice
    # A prefill's rows whose final hidden state is computed at all (models/base.py): the sampling
    # rows, or the last row when none samples (a chunk inside a prompt: nothing is read, and no
    # zero-row tensors reach the kernels); None: every row (a decode step, or a prefill with
    # prompt logprobs, which read every row).
    keep_rows: torch.Tensor | None = None


def token_slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat cache slots (block_id * block_size + offset) of token positions start..end-1."""
    slots = []
    for i in range(start // block_size, cdiv(end, block_size)):
        base = block_table[i] * block_size
        slots.extend(range(base + max(start - i * block_size, 0), base + min(end - i * block_size, block_size)))
    return slots


def decode_slot(block_table: list[int], block_size: int, num_tokens: int) -> int:
    """Slot of a decoding sequence's newest token, the one at position num_tokens - 1."""
    position = num_tokens - 1
    return block_table[position // block_size] * block_size + position % block_size


def prefill_inputs(step: StepMessage, block_size: int, device: torch.device, attend_from_cache: bool = False
                   ) -> StepInputs:
    """A prefill step's inputs: every sequence's new tokens back to back. A sequence samples when
    this chunk completes its prompt, from the row of its last new token; one with proposed
    tokens from the rows of its newest token and of each proposed one (speculative decoding).
    Attention reads the keys from the paged cache when a prefix is cached, and always with
    `attend_from_cache` (a quantised cache: every query then sees the same fp8 K/V, whether its
    prefix was cached, swapped in, recomputed or computed in this very step)."""
    positions, slot_mapping = [], []
    cu_q, cu_k = [0], [0]  # prefix sums of new (q) and total (k) tokens per sequence
    for start, end, table in zip(step.starts, step.ends, step.block_tables):
        positions.extend(range(start, end))
        if table:  # the warm-up has no cache
            slot_mapping.extend(token_slots(table, block_size, start, end))
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
    seqlens_q = [end - start for start, end in zip(step.starts, step.ends)]
    has_prefix = cu_k[-1] > cu_q[-1]  # some sequence attends to K/V cached before this step
    paged = has_prefix or (attend_from_cache and bool(slot_mapping))  # the warm-up has no cache
    upload = device_platform(device).upload
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=upload(slot_mapping, torch.int64),
        cu_seqlens_q=upload(cu_q, torch.int32),
        cu_seqlens_k=upload(cu_k, torch.int32),
        max_seqlen_q=max(seqlens_q),
        max_seqlen_k=max(step.ends),
        block_tables=upload(padded_tables(step.block_tables), torch.int32) if paged else None,
        seqlens_q=seqlens_q,
        seqlens_k=list(step.ends),
    )
    sample_indices = [i for i, (end, length) in enumerate(zip(step.ends, step.lengths)) if end == length]
    if step.num_proposed:
        rows = [r for i in sample_indices for r in range(cu_q[i + 1] - 1 - step.num_proposed[i], cu_q[i + 1])]
    else:
        rows = [cu_q[i + 1] - 1 for i in sample_indices]
    sample_rows = upload(rows, torch.int64)
    if step.prompt_targets:
        keep_rows = None
    else:
        keep_rows = sample_rows if rows else upload([cu_q[-1] - 1], torch.int64)
    return StepInputs(upload(step.token_ids, torch.int64), upload(positions, torch.int64), meta, sample_indices,
                      sample_rows, keep_rows)


def padded_tables(tables: list[list[int]]) -> list[list[int]]:
    """[batch, longest table], padded with -1."""
    width = max(len(table) for table in tables)
    return [table + [-1] * (width - len(table)) for table in tables]
