"""Turns each sequence's last logits into its next token, in one batched pass on the device.

Split in two (as mini-sglang): `prepare_sampling` (runner/sampling_inputs.py) gathers each
row's parameters on the host into `SamplingTensors`, the batch's pipeline of logits processors
(layers/logits_processors.py: bias, bans, penalties, then temperature, then min_p, top_k, top_p),
and `Sampler` does the work on the device and never sees a sequence. Greedy rows (temperature 0)
take the argmax of the adjusted logits and never see the random draw. Sampled rows draw with the
platform's draw (platform/): torch's exponential race (`race_draw`), or on the CPU an inverse
transform of one uniform per row (`inverse_transform_draw`). A row with a seed draws from its own
generator, so its tokens do not depend on what else is in the batch. Logprobs are the model's raw
log-softmax, before any of that processing.

This is the torch pipeline, the reference; the platforms with a race kernel subclass it
(platform/sampling.py RaceSampler), and the CPU's may take tokens from the LM head without the
logits (`head_tokens`, platform/cpu/sampling.py).

No NaN or infinity reaches a draw or a logprob: SamplingParams bounds every parameter (a
temperature below 1e-5 is greedy, penalties in range), and the logits go through `finite_logits`
before any processing, so a model that emits inf or NaN in a row still yields a token id in the
vocabulary and finite logprobs.
"""
from typing import Callable, NamedTuple

import torch
from torch import nn

from nanovllm.layers.logits_processors import SamplingTensors, divide_by_temperature, finite_logits
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


def race_draw(weights: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row with probability proportional to `weights` [rows, vocab] (>= 0, not
    necessarily normalised) by the race: argmax of w / E, E ~ Exp(1), which needs no sort, scan
    or host sync. Seeded rows draw from their own generator."""
    noise = exponential_noise(weights, t)
    return (weights / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def inverse_transform_draw(weights: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """race_draw's distribution by inverse transform: one uniform per row against the row's
    cumulative sums (torch sums float32 in double on the CPU; the first token whose sum exceeds
    the draw, so never one of weight 0): ~2 ms on the CPU at 64 rows x 32k tokens, where the
    race's Exp(1) noise for every token took ~40 ms on its own."""
    cdf = weights.float().cumsum(dim=-1)
    u = uniforms(weights.size(0), t, weights.device).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max_(weights.size(-1) - 1)


def race_from_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row drawn from softmax(logits) by the race (compiled with the softmax)."""
    return exponential_race(logits, exponential_noise(logits, t))


def inverse_transform_from_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token per row drawn from softmax(logits) by inverse transform."""
    return inverse_transform_draw(torch.softmax(logits, dim=-1), t)


class Sampler(nn.Module):
    uses_philox = False  # whether SamplingTensors must carry Philox keys (a race kernel's noise)

    def __init__(self, draw_from_logits: Callable[[torch.Tensor, SamplingTensors], torch.Tensor] | None) -> None:
        super().__init__()
        # The platform's race_from_logits or inverse_transform_from_logits (None: a subclass draws)
        self.draw_from_logits = draw_from_logits

    def takes_head_draw(self, seqs: list) -> bool:
        """Whether a step of these sequences (only their sampling_params read) should ask
        head_tokens first; answered without a pass over them where it never does."""
        return False

    def head_tokens(self, hidden_states: torch.Tensor, draw=None) -> torch.Tensor | None:
        """Per row of the LM head's input, the token draw() would take from its logits, where the
        platform finds it without them (a runner/step_inputs.py HeadDraw gives sampled rows'
        temperatures and keys); None: the caller computes the logits."""
        return None

    def forward(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        tokens, logprobs = self.draw(logits, t)
        return SamplerOutput(tokens.tolist(), logprobs)  # the step's one host sync

    def draw(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """The tokens left on the device ([batch] int64, no host sync) and each row's logprobs
        (which do sync, for the rows that asked; None for the others)."""
        # logits: [batch, vocab]
        raw_logits = finite_logits(logits)
        adjusted = t.adjust(raw_logits)
        tokens = adjusted.argmax(dim=-1)
        if not t.all_greedy:
            tokens = torch.where(t.temperatures > 0,
                                 self.draw_from_logits(t.filter(adjusted, scale_by_temperature), t), tokens)
        return tokens, self._logprobs(raw_logits, tokens, t.num_logprobs)

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
