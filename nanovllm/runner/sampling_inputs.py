"""Builds the sampler's input from the sequences that sample in a step: `SamplingTensors`.

The host side of sampling (as mini-sglang's `prepare`): the batch's pipeline of logits
processors (layers/logits_processors.py), built from the rows' parameters and tokens only when
some row needs one (the common temperature-only case is one copy), with the tokens min_tokens
forbids as scheduling/stop_checker.py decides them; and each seeded row's own generator (made on the
sampling device at its first use), or with `philox` (a race kernel: Triton's, or the CPU's) each
row's noise key and counter instead. The device side is
`layers/sampler.py`, which knows nothing of sequences.
"""
import torch

from nanovllm.scheduling.sequence import Sequence
from nanovllm.scheduling.stop_checker import banned_token_ids
from nanovllm.layers.logits_processors import RowsView, SamplingTensors
from nanovllm.platform.device import device_platform

INT64_SPAN = 1 << 64  # seeds run over int64 and uint64 (SamplingParams); a key is their 64 bits


def philox_keys(seqs: list[Sequence]) -> list[list[int]]:
    """[keys, counters] for a race kernel's noise (Triton's Philox, the CPU's hash; and the CPU head's
    draw, runner/step_inputs.py HeadDraw), one entry per row. A seeded row that
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


def prepare_sampling(seqs: list[Sequence], vocab_size: int, eos: int, device: torch.device,
                     philox: bool = False, drafts: list[list[int]] | None = None) -> SamplingTensors:
    """`drafts`: per row, the proposed tokens it comes after (speculative decoding; RowsView)."""
    params = [seq.sampling_params for seq in seqs]
    column = device_platform(device).upload  # a list as a device tensor, from pinned memory without blocking

    temperatures = [p.temperature for p in params]  # 0 for greedy (SamplingParams stores it so)
    keys = column(philox_keys(seqs), torch.int64) if philox else None  # [2, batch]
    # The common case, one small copy (two with race keys), and the race kernel's single pass.
    if all(p.needs_only_temperature_and_seed if philox else p.needs_only_temperature for p in params):
        return SamplingTensors(column(temperatures, torch.float32), all_greedy=not any(temperatures), philox=keys)
    before, after = SamplingTensors.pipeline(RowsView(seqs, params, lambda seq: banned_token_ids(seq, eos), column,
                                                      device, vocab_size, drafts))
    generators = []
    for row, seq in enumerate(seqs if not philox else []):  # Philox keys replace generators
        if seq.sampling_params.seed is not None and not seq.sampling_params.greedy:
            if seq.generator is None:
                seq.generator = torch.Generator(device).manual_seed(seq.seed)
            generators.append((row, seq.generator))
    return SamplingTensors(
        temperatures=column(temperatures, torch.float32),
        all_greedy=not any(temperatures),
        before_temperature=before,
        after_temperature=after,
        generators=tuple(generators),
        num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        philox=keys,
    )
