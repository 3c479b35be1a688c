"""Turns each sequence's last logits into its next token, in one batched pass on the device.

Split in two (as mini-sglang): `prepare_sampling` (runner/sampling_inputs.py) gathers each
row's parameters on the host into `SamplingTensors`, the batch's pipeline of logits processors
(layers/logits_processors.py: bias, bans, penalties, then temperature, then min_p, top_k, top_p),
and `Sampler` does the work on the device and never sees a sequence. Greedy rows (temperature 0)
take the argmax of the adjusted logits and never see the random draw: a race over the
vocabulary (below), or where no race kernel is enabled, on the CPU an inverse transform of one
uniform per row (`draw`), elsewhere torch's exponential race. A row with a seed draws from its own
noise (a race kernel's keys) or generator, so its tokens do not depend on what else is in the batch.
Logprobs are the model's raw log-softmax, before any of that processing.

With Triton kernels chosen (`enable_triton`, by the model runner) the draw is
kernels/sampling.py's race, its noise Philox keyed per row (SamplingTensors.philox: a seeded row's
seed and the index of the token it draws, so its stream is its own; for the others a fresh key per
step). On the CPU with its kernels built (`enable_cpu`) the race is kernels/cpu_fused.cpp's, the
same keys driving a cheaper hash (cpu_kernels.h gumbel64), and a float32 LM head may draw the
same tokens without the logits (kernels/cpu_build.py GreedyHead, ModelRunner.forward). A batch
that needs nothing but temperatures is one kernel over the logits as the LM head wrote them;
otherwise the pipeline runs in torch first and the same kernel races its result, so a seeded
row draws the same token on either path.

No NaN or infinity reaches a draw or a logprob: SamplingParams bounds every parameter (a
temperature below 1e-5 is greedy, penalties in range), and the logits go through `finite_logits`
before any processing, so a model that emits inf or NaN in a row still yields a token id in the
vocabulary and finite logprobs. (The Triton race alone over raw logits, the temperature-only
fast path, is not guarded: its argmax returns an index of the row whatever the values.)
"""
import functools
from typing import Callable, NamedTuple

import torch
from torch import nn

from nanovllm.layers.logits_processors import LOGIT_LIMIT, SamplingTensors, divide_by_temperature, finite_logits
from nanovllm.utils.compile import compilable


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]  # the N most likely tokens -> their logprob


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


# The pipeline's temperature step, compiled with the engine's compile mode (the torch path only:
# the Triton path must compile nothing after start-up).
scale_by_temperature = compilable(divide_by_temperature)


@compilable
def exponential_race(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) draws a token from p = softmax(logits), with no host sync."""
    probs = torch.softmax(logits, dim=-1)
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def uniforms(rows: int, t: SamplingTensors, device: torch.device) -> torch.Tensor:
    """[rows] float32 in [0, 1); seeded rows from their own generator."""
    u = torch.rand(rows, device=device)
    for row, generator in t.generators:
        u[row] = torch.rand((), generator=generator, device=device)
    return u


def exponential_noise(like: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Exp(1) noise shaped like `like`; seeded rows draw theirs from their own generator."""
    noise = torch.empty_like(like).exponential_()
    for row, generator in t.generators:
        noise[row].exponential_(generator=generator)
    return noise


def draw(weights: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row with probability proportional to `weights` [rows, vocab] (>= 0, not
    necessarily normalised); seeded rows draw from their own generator. On the CPU by inverse
    transform: one uniform per row against the row's cumulative sums (torch sums float32 in
    double there; the first token whose sum exceeds the draw, so never one of weight 0): ~2 ms at
    64 rows x 32k tokens, where the race's Exp(1) noise for every token took ~40 ms on its own.
    Elsewhere the race (argmax of w / E, E ~ Exp(1)), which needs no sort, scan or host sync."""
    if weights.device.type == "cpu":
        cdf = weights.float().cumsum(dim=-1)
        u = uniforms(weights.size(0), t, weights.device).unsqueeze(1) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max_(weights.size(-1) - 1)
    noise = exponential_noise(weights, t)
    return (weights / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def cpu_race(kernels, logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
             counters: torch.Tensor) -> torch.Tensor:
    """The CPU's race (FusedKernels.race_tokens) with the Triton race's signature."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return kernels.race_tokens(logits, temperatures.contiguous(), seeds.contiguous(), counters.contiguous(),
                               LOGIT_LIMIT)


class Sampler(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.race_kernel: Callable[..., torch.Tensor] | None = None  # set by enable_triton
        self.greedy_kernel: Callable[[torch.Tensor, float], torch.Tensor] | None = None  # set by enable_cpu

    def enable_triton(self) -> None:
        from nanovllm.kernels.sampling import sample_tokens  # lazy: triton only when chosen
        self.race_kernel = sample_tokens

    def enable_cpu(self, kernels) -> None:
        """Greedy steps with nothing but argmax to do (no processor, no logprobs) take the CPU's
        one-pass argmax of the finite logits (kernels/cpu_fused.cpp) where it is vectorised; every
        other step the CPU's race (kernels/cpu_fused.cpp race_rows)."""
        if kernels.greedy_vectorised:
            self.greedy_kernel = kernels.greedy_tokens
        self.race_kernel = functools.partial(cpu_race, kernels)

    @property
    def uses_philox(self) -> bool:
        """Whether SamplingTensors must carry Philox keys (prepare_sampling's `philox`; the CPU's
        race takes the same keys)."""
        return self.race_kernel is not None

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        tokens, logprobs = self.draw(logits, t)
        return SamplerOutput(tokens.tolist(), logprobs)  # the step's one host sync

    def draw(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """The tokens left on the device ([batch] int64, no host sync) and each row's logprobs
        (which do sync, for the rows that asked; None for the others)."""
        # logits: [batch, vocab]
        if self.greedy_kernel is not None and t.all_greedy and t.needs_only_temperature and logits.stride(-1) == 1:
            return self.greedy_kernel(logits, LOGIT_LIMIT), [None] * logits.size(0)
        if self.race_kernel is not None:
            return self._draw_race(logits, t)
        raw_logits = finite_logits(logits)
        adjusted = t.adjust(raw_logits)
        tokens = adjusted.argmax(dim=-1)
        if not t.all_greedy:
            tokens = torch.where(t.temperatures > 0, self._race(t.filter(adjusted, scale_by_temperature), t), tokens)
        return tokens, self._logprobs(raw_logits, tokens, t.num_logprobs)

    def _draw_race(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, list]:
        seeds, counters = t.philox
        if t.needs_only_temperature:  # the common case: one pass over the logits in their own dtype
            return self.race_kernel(logits, t.temperatures, seeds, counters), [None] * logits.size(0)
        # The pipeline in torch as above (eager: nothing may compile after start-up), then the
        # kernel races the result: already scaled for sampled rows (temperature 1 divides
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

    @staticmethod
    def _race(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """One token per row drawn from softmax(logits); seeded rows draw from their own generator."""
        if logits.device.type == "cpu":
            return draw(torch.softmax(logits, dim=-1), t)
        return exponential_race(logits, exponential_noise(logits, t))

    @staticmethod
    def _logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[TokenLogprobs | None]:
        if n < 0:
            return [None] * tokens.size(0)
        logprobs = torch.log_softmax(raw_logits, dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top_values, top_ids = logprobs.topk(max(n, 1), dim=-1)
        top_values, top_ids = top_values[:, :n].tolist(), top_ids[:, :n].tolist()
        return [TokenLogprobs(tok, lp, dict(zip(ids, vals)))
                for tok, lp, ids, vals in zip(tokens.tolist(), chosen, top_ids, top_values)]
