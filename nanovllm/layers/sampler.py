"""Turns each sequence's last logits into its next token, in one batched pass on the device.

Split in two (as mini-sglang): `prepare_sampling` (runner/sampling_inputs.py) gathers each
row's parameters on the host into `SamplingTensors`, `Sampler` does the work on the device and
never sees a sequence. Each row has its own parameters, applied in vLLM's order: penalties
(repetition over prompt and output, presence and frequency over the output), min_tokens bans,
then for sampled rows temperature, min_p, top_k, top_p. Greedy rows (temperature 0) take the
argmax and never see the random draw. A row with a seed draws its noise from its own
generator, so its tokens do not depend on what else is in the batch. Logprobs are the model's
raw log-softmax, before any of that processing.

With Triton kernels chosen (`enable_triton`, by the model runner) the draw is
kernels/sampling.py's race, its noise Philox keyed per row (SamplingTensors.philox: a seeded row's
seed and the index of the token it draws, so its stream is its own; for the others a fresh key per
step). A batch that needs nothing but temperatures is one kernel over the logits as the LM head
wrote them; otherwise the filters run in torch first and the same kernel races the filtered
logits, so a seeded row draws the same token on either path.

No NaN or infinity reaches a draw or a logprob: SamplingParams bounds every parameter (a
temperature below 1e-5 is greedy, penalties in range), and the logits go through `finite_logits`
before any processing, so a model that emits inf or NaN in a row still yields a token id in the
vocabulary and finite logprobs. (The Triton race alone over raw logits, the temperature-only
fast path, is not guarded: its argmax returns an index of the row whatever the values.)
"""
from typing import Callable, NamedTuple

import torch
from torch import nn

from nanovllm.utils.compile import compilable


# Logits are kept within +-LOGIT_LIMIT: far inside float32 (3.4e38), so dividing by the smallest
# temperature (1e-5) or repetition penalty (0.01), or subtracting two logits, stays finite.
LOGIT_LIMIT = 1e30


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN as the least likely value and infinities and beyond-range values
    clamped to +-LOGIT_LIMIT. One elementwise pass, on the sampler's general path only."""
    return torch.nan_to_num(logits.float(), nan=-LOGIT_LIMIT, posinf=LOGIT_LIMIT,
                            neginf=-LOGIT_LIMIT).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)


class SamplingTensors(NamedTuple):
    temperatures: torch.Tensor  # [batch] float32, 0 = greedy
    all_greedy: bool
    # Only present when some row needs them (the common case skips the work entirely).
    top_k: torch.Tensor | None  # [batch] int64, vocab size = off
    top_p: torch.Tensor | None  # [batch] float32, 1 = off
    min_p: torch.Tensor | None  # [batch] float32, 0 = off
    penalties: tuple[torch.Tensor, ...] | None  # repetition, presence, frequency [batch]; prompt mask, output counts [batch, vocab]
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) that min_tokens forbids
    generators: list[tuple[int, torch.Generator]]  # (row, generator) for seeded rows
    num_logprobs: int  # the largest top-N asked for; -1 = no row wants logprobs
    # [2, batch] int64: each row's Philox key (row 0) and counter (row 1), for the Triton race; None
    # on the torch path, whose seeded rows use `generators`.
    philox: torch.Tensor | None = None

    @property
    def needs_only_temperature(self) -> bool:
        """No filter, penalty, ban or logprobs: the race over the raw logits is all there is."""
        return (self.top_k is None and self.top_p is None and self.min_p is None and self.penalties is None
                and self.banned is None and self.num_logprobs < 0)


class TokenLogprobs(NamedTuple):
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]  # the N most likely tokens -> their logprob


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # Sequences (index into the step's) whose sampling inputs raised: no real token; the engine
    # fails their requests alone. None: every row sampled.
    failed: dict[int, Exception] | None = None


def apply_penalties(logits: torch.Tensor, repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                    prompt_mask: torch.Tensor, output_counts: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits, prompt_mask, output_counts: [batch, vocab]; penalties: [batch]."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * (output_counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k most likely tokens, then the smallest set whose probability reaches
    top_p (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).clamp(0, logits.size(1) - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        # top_p = 1 keeps everything, even where float rounding takes the running sum to 1.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False  # the most likely token, even when a tiny top_p rounds to 0 in float32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


@compilable
def scale_by_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    return logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)


@compilable
def exponential_race(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) with E ~ Exp(1) draws a token from p = softmax(logits), with no host sync."""
    probs = torch.softmax(logits, dim=-1)
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


class Sampler(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.race_kernel: Callable[..., torch.Tensor] | None = None  # set by enable_triton

    def enable_triton(self) -> None:
        from nanovllm.kernels.sampling import sample_tokens  # lazy: triton only when chosen
        self.race_kernel = sample_tokens

    @property
    def uses_philox(self) -> bool:
        """Whether SamplingTensors must carry Philox keys (prepare_sampling's `philox`)."""
        return self.race_kernel is not None

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        tokens, logprobs = self.draw(logits, t)
        return SamplerOutput(tokens.tolist(), logprobs)  # the step's one host sync

    def draw(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """The tokens left on the device ([batch] int64, no host sync) and each row's logprobs
        (which do sync, for the rows that asked; None for the others)."""
        # logits: [batch, vocab]
        if self.race_kernel is not None:
            return self._draw_triton(logits, t)
        raw_logits, logits = self._penalised(logits, t)
        tokens = logits.argmax(dim=-1)
        if not t.all_greedy:
            tokens = torch.where(t.temperatures > 0, self._sample(logits, t), tokens)
        return tokens, self._logprobs(raw_logits, tokens, t.num_logprobs)

    def _draw_triton(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, list]:
        seeds, counters = t.philox
        if t.needs_only_temperature:  # the common case: one pass over the logits in their own dtype
            return self.race_kernel(logits, t.temperatures, seeds, counters), [None] * logits.size(0)
        # Filters in torch as above (no torch.compile: nothing may compile after start-up), then
        # the kernel races the filtered logits: already scaled for sampled rows (temperature 1
        # divides exactly), raw for greedy ones (temperature 0: argmax).
        raw_logits, logits = self._penalised(logits, t)
        temperatures = t.temperatures
        if not t.all_greedy:
            sampled = t.temperatures > 0
            scaled = logits / torch.where(sampled, t.temperatures, 1.0).unsqueeze(1)
            if t.min_p is not None:
                scaled = apply_min_p(scaled, t.min_p)
            if t.top_k is not None or t.top_p is not None:
                scaled = apply_top_k_top_p(scaled, t.top_k, t.top_p)
            logits = torch.where(sampled.unsqueeze(1), scaled, logits)
            temperatures = sampled.float()
        tokens = self.race_kernel(logits, temperatures, seeds, counters)
        return tokens, self._logprobs(raw_logits, tokens, t.num_logprobs)

    @staticmethod
    def _penalised(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits in float32 (logprobs are taken from these), and the same after the penalties
        and min_tokens bans (what the argmax and the draw see)."""
        raw_logits = logits = finite_logits(logits)
        if t.penalties is not None:
            logits = apply_penalties(logits, *t.penalties)
        if t.banned is not None:
            logits = logits.index_put((t.banned[0], t.banned[1]), torch.full((), float("-inf"), device=logits.device))
        return raw_logits, logits

    @staticmethod
    def _sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        logits = scale_by_temperature(logits, t.temperatures)
        if t.min_p is not None:
            logits = apply_min_p(logits, t.min_p)
        if t.top_k is not None or t.top_p is not None:
            logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
        noise = torch.empty_like(logits).exponential_()
        for row, generator in t.generators:  # seeded rows draw from their own generator
            noise[row].exponential_(generator=generator)
        return exponential_race(logits, noise)

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
