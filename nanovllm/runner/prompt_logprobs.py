"""Prompt logprobs (SamplingParams.prompt_logprobs): the model's log-softmax at every prompt
position of the requests that ask, computed in the prefill pass that computes those positions.

The row of position p scores the prompt token at p + 1. `prompt_targets` says, per sequence of a
prefill chunk, which of its rows score a prompt token it has no logprob for yet (so a chunked
prefill gathers them chunk by chunk, and a recomputed prompt computes none twice);
`StepMessage` carries them to every tensor-parallel rank, since the LM head over those rows is a
collective. `compute_prompt_logprobs` runs the LM head over exactly those rows, apart from the
sampling rows, so a step without such requests does no extra work. Rank 0 gets, per position,
the prompt token's logprob and rank (1 + the tokens more likely than it, as vLLM) and the top-N.
It knows nothing of requests or output formats (engine/request.py shapes them).
"""
from typing import NamedTuple

import torch
from torch import nn

from nanovllm.scheduling.sequence import Sequence

# Rows of [rows, vocab] float32 logits made at once: a long prompt's positions go through the LM
# head in slices of this many, so its memory stays bounded (2048 x 152k vocab x 4 B = 1.2 GB).
ROWS_PER_PASS = 512


class PromptTargets(NamedTuple):
    """What one sequence's rows of a step must score: positions first, first + 1, ... (each the
    row of that position) against the prompt tokens that follow them."""
    first: int  # the first position (its row is the chunk's row first - start)
    token_ids: list[int]  # the prompt tokens at positions first + 1, first + 2, ...
    num_top: int  # top-N alternatives per position (SamplingParams.prompt_logprobs)


class PromptTokenLogprobs(NamedTuple):
    token_id: int  # the prompt token
    logprob: float
    rank: int  # 1 + the number of tokens more likely than it
    top_logprobs: dict[int, float]  # the N most likely tokens (ranks 1..N, in order) -> their logprob


class PromptLogprobs(NamedTuple):
    """One sequence's prompt logprobs from one step: for prompt tokens first + 1, first + 2, ...
    (so they are entries first, first + 1, ... of Sequence.prompt_logprobs)."""
    first: int
    entries: list[PromptTokenLogprobs]


def prompt_targets(seq: Sequence, start: int, end: int) -> PromptTargets | None:
    """The prompt tokens a chunk computing positions start..end-1 of `seq` scores, or None: those
    whose position is in the chunk, is not the prompt's last (its row samples) and has no
    logprob yet."""
    if seq.prompt_logprobs is None:
        return None
    first, last = max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptTargets(first, seq.token_ids[first + 1:last + 1], seq.sampling_params.prompt_logprobs)


def compute_prompt_logprobs(model: nn.Module, hidden_states: torch.Tensor, starts: list[int], ends: list[int],
                            targets: list[PromptTargets | None]) -> list[PromptLogprobs | None] | None:
    """Per sequence of the step, its prompt logprobs (None where it has no targets), on rank 0;
    None on the other ranks, which join the LM head's collective. hidden_states: [rows, hidden],
    each sequence's new tokens' rows back to back (ends - starts of them)."""
    rows, first_row = [], 0
    for start, end, target in zip(starts, ends, targets):
        if target is not None:
            row = first_row + target.first - start
            rows.extend(range(row, row + len(target.token_ids)))
        first_row += end - start
    token_ids = torch.tensor([t for target in targets if target is not None for t in target.token_ids],
                             device=hidden_states.device)
    num_top = max(target.num_top for target in targets if target is not None)
    row_index = torch.tensor(rows, device=hidden_states.device)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for begin in range(0, len(rows), ROWS_PER_PASS):
        logits = model.compute_logits(hidden_states[row_index[begin:begin + ROWS_PER_PASS]])  # [n, vocab]
        if logits is None:  # another rank's share of the collective
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        own = logprobs.gather(1, token_ids[begin:begin + ROWS_PER_PASS].unsqueeze(1))  # [n, 1]
        chosen.append(own.squeeze(1))
        ranks.append((logprobs > own).sum(dim=-1) + 1)
        values, ids = logprobs.topk(max(num_top, 1), dim=-1)
        top_values.append(values[:, :num_top])
        top_ids.append(ids[:, :num_top])
    if not chosen:
        return None
    chosen_list, ranks_list = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    top_values_list, top_ids_list = torch.cat(top_values).tolist(), torch.cat(top_ids).tolist()
    out: list[PromptLogprobs | None] = []
    j = 0
    for target in targets:
        if target is None:
            out.append(None)
            continue
        entries = []
        for token_id in target.token_ids:
            n = target.num_top
            entries.append(PromptTokenLogprobs(token_id, chosen_list[j], ranks_list[j],
                                               dict(zip(top_ids_list[j][:n], top_values_list[j][:n]))))
            j += 1
        out.append(PromptLogprobs(target.first, entries))
    return out
