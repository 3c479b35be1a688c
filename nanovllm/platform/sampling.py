"""The sampler of a platform with a race kernel (Triton's kernels/sampling.py, the CPU's
cpu_fused.cpp race_rows): the draw is the kernel's race over the logits, its noise keyed per row
(SamplingTensors.philox: a seeded row's seed and the index of the token it draws, so its stream is
its own; for the others a fresh key per step). A batch that needs nothing but temperatures is one
kernel over the logits as the LM head wrote them; otherwise the pipeline runs in torch first and
the same kernel races its result, so a seeded row draws the same token on either path. (The race
alone over raw logits, the temperature-only fast path, is not guarded by finite_logits: its argmax
returns an index of the row whatever the values.)
"""
from typing import Callable

import torch

from nanovllm.layers.logits_processors import SamplingTensors, finite_logits
from nanovllm.layers.sampler import Sampler, TokenLogprobs

# (logits [rows, vocab], temperatures [rows] float32, seeds, counters [rows] int64) -> [rows] int64
RaceKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RaceSampler(Sampler):
    uses_philox = True

    def __init__(self, race_kernel: RaceKernel) -> None:
        super().__init__(None)
        self.race_kernel = race_kernel

    def draw(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        seeds, counters = t.philox
        if t.needs_only_temperature:  # the common case: one pass over the logits in their own dtype
            return self.race_kernel(logits, t.temperatures, seeds, counters), [None] * logits.size(0)
        # The pipeline in torch as the reference's (eager: nothing may compile after start-up), then
        # the kernel races the result: already scaled for sampled rows (temperature 1 divides
        # exactly), the adjusted logits for greedy ones (temperature 0: argmax).
        raw_logits = finite_logits(logits)
        logits = t.adjust(raw_logits)
        temperatures = t.temperatures
        if not t.all_greedy:
            sampled = t.temperatures > 0
            logits = torch.where(sampled.unsqueeze(1), t.filter(logits), logits)
            temperatures = sampled.float()
        tokens = self.race_kernel(logits, temperatures, seeds, counters)
        return tokens, self._logprobs(raw_logits, tokens, t.num_logprobs)
