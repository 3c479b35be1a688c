"""The one sampling pipeline: the ordered logits processors that every way of sampling applies.

A batch's `SamplingTensors` carry the processors its rows need, in vLLM's order:

1. before temperature, on every row (a greedy row's argmax sees them too):
   logit bias → min_tokens bans → penalties (repetition, presence, frequency);
2. temperature (0 = greedy: the row takes the argmax of step 1's logits);
3. after temperature, on sampled rows only: min_p → top_k / top_p.

`runner/sampling_inputs.py` builds them once per batch from the rows' `SamplingParams` (a
processor is there only when some row needs it, as `SamplingParams.processors` names them). The
torch sampler, the Triton race (layers/sampler.py) and speculative verification and drafting
(layers/rejection_sampler.py) all apply them through `SamplingTensors.adjust` and `.filter`, and
the race kernel's single pass over the raw logits is taken exactly when there is none
(`needs_only_temperature`). Adding a sampling option is a field (and its name in `processors`)
in SamplingParams, a processor class here and its builder in runner/sampling_inputs.py.

Processors never modify their input (the raw logits are kept for logprobs) and never see a
sequence: they hold per-row tensors, one row per sampling row of the batch.
"""
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


class LogitsProcessor:
    """One step of the pipeline: [batch, vocab] float32 logits in, new logits of the same shape out."""

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a value added to chosen tokens' logits, per row."""
    rows: torch.Tensor  # [n] int64
    token_ids: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] float32

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put((self.rows, self.token_ids), self.values, accumulate=True)


@dataclass(frozen=True)
class TokenBans(LogitsProcessor):
    """Tokens a row may not take now (min_tokens: end-of-text and stop tokens before it is reached)."""
    rows: torch.Tensor  # [n] int64
    token_ids: torch.Tensor  # [n] int64

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put((self.rows, self.token_ids), torch.full((), float("-inf"), device=logits.device))


@dataclass(frozen=True)
class Penalties(LogitsProcessor):
    """vLLM's penalties: repetition over prompt and output, presence and frequency over the output."""
    repetition: torch.Tensor  # [batch] float32, 1 = off
    presence: torch.Tensor  # [batch] float32, 0 = off
    frequency: torch.Tensor  # [batch] float32, 0 = off
    prompt_mask: torch.Tensor  # [batch, vocab] bool: the token occurs in the prompt
    output_counts: torch.Tensor  # [batch, vocab] float32: occurrences in the output so far

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.repetition, self.presence, self.frequency, self.prompt_mask,
                               self.output_counts)


@dataclass(frozen=True)
class MinP(LogitsProcessor):
    min_p: torch.Tensor  # [batch] float32, 0 = off

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_min_p(logits, self.min_p)


@dataclass(frozen=True)
class TopKTopP(LogitsProcessor):
    top_k: torch.Tensor | None  # [batch] int64, vocab size = off; None: no row uses it
    top_p: torch.Tensor | None  # [batch] float32, 1 = off; None: no row uses it

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_top_k_top_p(logits, self.top_k, self.top_p)


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
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def divide_by_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Step 2: sampled rows divided by their temperature; greedy rows (0) left as they are."""
    return logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)


class SamplingTensors(NamedTuple):
    """A batch's sampling pipeline and what its draw needs, one row per sampling row."""
    temperatures: torch.Tensor  # [batch] float32, 0 = greedy
    all_greedy: bool
    before_temperature: tuple[LogitsProcessor, ...] = ()  # step 1, in order
    after_temperature: tuple[LogitsProcessor, ...] = ()  # step 3, in order
    generators: tuple[tuple[int, torch.Generator], ...] = ()  # (row, generator) for seeded rows
    num_logprobs: int = -1  # the largest top-N asked for; -1 = no row wants logprobs
    # [2, batch] int64: each row's Philox key (row 0) and counter (row 1), for the Triton race; None
    # on the torch path, whose seeded rows use `generators`.
    philox: torch.Tensor | None = None

    @property
    def needs_only_temperature(self) -> bool:
        """No processor and no logprobs: the race over the raw logits is all there is (the fast path)."""
        return not self.before_temperature and not self.after_temperature and self.num_logprobs < 0

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """Step 1 on every row: the logits in float32 with bias, bans and penalties applied (what a
        greedy row's argmax and every later step see)."""
        logits = logits.float()
        for processor in self.before_temperature:
            logits = processor(logits)
        return logits

    def filter(self, adjusted: torch.Tensor,
               scale: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = divide_by_temperature) -> torch.Tensor:
        """Steps 2 and 3 on adjusted logits: what a sampled row draws from (a greedy row's result
        is meaningless). `scale` may be a compiled version of divide_by_temperature."""
        logits = scale(adjusted, self.temperatures)
        for processor in self.after_temperature:
            logits = processor(logits)
        return logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32: the distribution each sampled row draws from, raw logits in."""
        return torch.softmax(self.filter(self.adjust(logits)), dim=-1)
