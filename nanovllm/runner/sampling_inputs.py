"""Builds the sampler's input from the sequences that sample in a step: `SamplingTensors`.

The host side of sampling (as mini-sglang's `prepare`): the batch's pipeline of logits
processors (layers/logits_processors.py), one builder per processor, in the pipeline's order,
each gathering its rows' parameters into small tensors only when some row needs it (the common
temperature-only case is one copy): logit bias, the tokens min_tokens forbids, the prompt and
output token counts for penalties, min_p, top_k/top_p; and each seeded
row's own generator (made on the sampling device at its first use), or with `philox` (the
Triton sampler) each row's Philox key and counter instead. The device side is
`layers/sampler.py`, which knows nothing of sequences.
"""
from typing import Callable, NamedTuple

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stop_checker import banned_token_ids
from nanovllm.layers.logits_processors import LogitBias, MinP, Penalties, SamplingTensors, TokenBans, TopKTopP
from nanovllm.sampling_params import SamplingParams



class Batch(NamedTuple):
    """What a processor's builder reads: the batch's rows and how to make a column of them."""
    seqs: list[Sequence]
    params: list[SamplingParams]
    column: Callable[[list, torch.dtype], torch.Tensor]  # values -> a [len] tensor on the sampling device
    device: torch.device
    vocab_size: int
    eos: int


def _token_matrix(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[batch, vocab] float32 counts of each token id per row."""
    width = max(1, max(map(len, rows)))
    # Pad with an extra column (vocab_size) that is dropped after counting.
    ids = torch.tensor([r + [vocab_size] * (width - len(r)) for r in rows], dtype=torch.int64)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size].to(device, non_blocking=True)


INT64_SPAN = 1 << 64  # seeds run over int64 and uint64 (SamplingParams); a key is their 64 bits


def philox_keys(seqs: list[Sequence]) -> list[list[int]]:
    """[keys, counters] for the Triton sampler's Philox noise, one entry per row. A seeded row that
    samples: its seed (as int64 bits) and the index of the token it draws, so its noise depends on
    nothing else (not the batch, nor a preemption that recomputes it). Every other row: one key
    drawn per step from torch's default generator (torch.manual_seed makes runs repeat), and its
    row as the counter."""
    step_key = None
    keys, counters = [], []
    for row, seq in enumerate(seqs):
        if seq.seed is not None and not seq.sampling_params.greedy:
            key, counter = seq.seed, seq.num_completion_tokens
            key = key - INT64_SPAN if key >= INT64_SPAN // 2 else key
        else:
            if step_key is None:
                step_key = int(torch.empty((), dtype=torch.int64).random_())
            key, counter = step_key, row
        keys.append(key)
        counters.append(counter)
    return [keys, counters]


def _logit_bias(batch: Batch) -> LogitBias | None:
    rows, ids, values = [], [], []
    for row, p in enumerate(batch.params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(row)
            ids.append(token_id)
            values.append(bias)
    if not rows:
        return None
    column = batch.column
    return LogitBias(column(rows, torch.int64), column(ids, torch.int64), column(values, torch.float32))


def _token_bans(batch: Batch) -> TokenBans | None:
    rows, ids = [], []
    for row, seq in enumerate(batch.seqs):  # min_tokens, as the stop checker applies it
        banned = banned_token_ids(seq, batch.eos)
        rows += [row] * len(banned)
        ids += banned
    return TokenBans(batch.column(rows, torch.int64), batch.column(ids, torch.int64)) if rows else None


def _penalties(batch: Batch) -> Penalties | None:
    params, column = batch.params, batch.column
    if not any(p.has_penalties for p in params):
        return None
    return Penalties(column([p.repetition_penalty for p in params], torch.float32),
                     column([p.presence_penalty for p in params], torch.float32),
                     column([p.frequency_penalty for p in params], torch.float32),
                     _token_matrix([s.prompt_token_ids for s in batch.seqs], batch.vocab_size, batch.device) > 0,
                     _token_matrix([s.completion_token_ids for s in batch.seqs], batch.vocab_size, batch.device))


def _min_p(batch: Batch) -> MinP | None:
    if not any(p.min_p > 0 for p in batch.params if not p.greedy):
        return None
    return MinP(batch.column([p.min_p for p in batch.params], torch.float32))


def _top_k_top_p(batch: Batch) -> TopKTopP | None:
    params, column, vocab_size = batch.params, batch.column, batch.vocab_size
    sampled = [p for p in params if not p.greedy]
    top_k = column([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.int64) \
        if any(p.top_k > 0 for p in sampled) else None
    top_p = column([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in sampled) else None
    return TopKTopP(top_k, top_p) if top_k is not None or top_p is not None else None


# The pipeline's builders in its order (layers/logits_processors.py); each returns None when no
# row of the batch needs its processor.
BEFORE_TEMPERATURE = (_logit_bias, _token_bans, _penalties)
AFTER_TEMPERATURE = (_min_p, _top_k_top_p)


def prepare_sampling(seqs: list[Sequence], vocab_size: int, eos: int, device: torch.device,
                     philox: bool = False) -> SamplingTensors:
    params = [seq.sampling_params for seq in seqs]

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:  # from pinned memory, without blocking
        return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)

    temperatures = [0.0 if p.greedy else p.temperature for p in params]
    keys = column(philox_keys(seqs), torch.int64) if philox else None  # [2, batch]
    # The common case, one small copy (two with Philox keys), and the Triton sampler's single pass.
    if all(p.needs_only_temperature_and_seed if philox else p.needs_only_temperature for p in params):
        return SamplingTensors(column(temperatures, torch.float32), all_greedy=not any(temperatures), philox=keys)
    batch = Batch(seqs, params, column, device, vocab_size, eos)
    before = tuple(proc for build in BEFORE_TEMPERATURE if (proc := build(batch)) is not None)
    after = tuple(proc for build in AFTER_TEMPERATURE if (proc := build(batch)) is not None)
    generators = []
    for row, seq in enumerate(seqs if not philox else []):  # Philox keys replace generators
        if seq.sampling_params.seed is not None and not seq.sampling_params.greedy:
            if seq.generator is None:
                seq.generator = torch.Generator(device).manual_seed(seq.seed)
            generators.append((row, seq.generator))
    return SamplingTensors(
        temperatures=column(temperatures, torch.float32),
        all_greedy=all(p.greedy for p in params),
        before_temperature=before,
        after_temperature=after,
        generators=tuple(generators),
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        philox=keys,
    )
