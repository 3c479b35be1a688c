"""The CPU's sampler: the race of kernels/cpu_fused.cpp (the Triton race's keys driving a cheaper
hash, cpu_kernels.h gumbel64), greedy steps with nothing but the argmax to do in its one-pass argmax
of the finite logits (where the build vectorises it), and steps that need only their tokens taken
from the LM head without every logit (kernels/cpu_build.py GreedyHead / AmxGreedyHead).
"""
import functools

import torch

from nanovllm.kernels.cpu_build import FusedKernels
from nanovllm.layers.logits_processors import LOGIT_LIMIT, SamplingTensors
from nanovllm.layers.sampler import TokenLogprobs
from nanovllm.platform.sampling import RaceSampler


def cpu_race(kernels: FusedKernels, logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
             counters: torch.Tensor) -> torch.Tensor:
    """The CPU's race (FusedKernels.race_tokens) with the Triton race's signature."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return kernels.race_tokens(logits, temperatures.contiguous(), seeds.contiguous(), counters.contiguous(),
                               LOGIT_LIMIT)


class CpuSampler(RaceSampler):

    def __init__(self, kernels: FusedKernels, head=None) -> None:
        super().__init__(functools.partial(cpu_race, kernels))
        self.greedy_kernel = kernels.greedy_tokens if kernels.greedy_vectorised else None
        # Rows (and a HeadDraw, or None: greedy) -> their tokens without every logit, or None where
        # the logits must decide (platform/cpu/__init__.py greedy_head_of); None: no such head.
        self.head = head

    def takes_head_draw(self, seqs: list) -> bool:
        return (self.head is not None and all(seq.sampling_params.needs_only_temperature_and_seed for seq in seqs)
                and (self.head.samples or not any(seq.sampling_params.temperature for seq in seqs)))

    def head_tokens(self, hidden_states: torch.Tensor, draw=None) -> torch.Tensor | None:
        return self.head(hidden_states, draw)

    def draw(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        if self.greedy_kernel is not None and t.all_greedy and t.needs_only_temperature and logits.stride(-1) == 1:
            return self.greedy_kernel(logits, LOGIT_LIMIT), [None] * logits.size(0)
        return super().draw(logits, t)
