"""The one sampling pipeline: the ordered logits processors that every way of sampling applies.

A batch's `SamplingTensors` carry the processors its rows need, in vLLM's order:

1. before temperature, on every row (a greedy row's argmax sees them too):
   grammar mask (structured outputs) → logit bias → min_tokens bans → penalties (repetition,
   presence, frequency);
2. temperature (0 = greedy: the row takes the argmax of step 1's logits);
3. after temperature, on sampled rows only: min_p → top_k / top_p.

`runner/sampling_inputs.py` builds them once per batch, each processor class from the rows'
parameters (`build`: None when no row needs it, as `SamplingParams.processors` names them). The
torch sampler, the Triton race (layers/sampler.py) and speculative verification and drafting
(layers/rejection_sampler.py) all apply them through `SamplingTensors.adjust` and `.filter`, and
the race kernel's single pass over the raw logits is taken exactly when there is none
(`needs_only_temperature`). Adding a sampling option is a field (and its name in `processors`)
in SamplingParams and a processor class here, placed in BEFORE_TEMPERATURE or AFTER_TEMPERATURE.

Processors never modify their input (the raw logits are kept for logprobs) and never see a
sequence: they hold per-row tensors, one row per sampling row of the batch, built from a
`RowsView` of the rows.
"""
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import torch

from nanovllm.platform.base import bitmask_backend
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.math_utils import cdiv


class SamplingRow(Protocol):
    """What a processor may read of a row (scheduling/sequence.py's Sequence, which this module does not import)."""
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    grammar: "GrammarRow | None"  # its structured_outputs matcher (structured_outputs/state.py)


class GrammarRow(Protocol):
    """What the grammar mask reads of a row's matcher (structured_outputs/state.py, GrammarState)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None: ...


class RowsView(NamedTuple):
    """What a processor is built from: the sampling rows, read only where a processor needs them."""
    rows: list[SamplingRow]
    params: list[SamplingParams]
    banned_token_ids: Callable[[SamplingRow], list[int]]  # what a row may not take now (min_tokens)
    column: Callable[[list, torch.dtype], torch.Tensor]  # values -> a [len] tensor on the sampling device
    device: torch.device
    vocab_size: int
    # Per row, proposed tokens it comes after that its sequence does not hold yet (speculative
    # verification and drafting); None: every row is its sequence's next token.
    drafts: list[list[int]] | None = None


class LogitsProcessor:
    """One step of the pipeline: [batch, vocab] float32 logits in, new logits of the same shape out."""

    @classmethod
    def build(cls, rows: RowsView) -> "LogitsProcessor | None":
        """The processor for these rows, or None when none of them needs it."""
        raise NotImplementedError

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


BITS_PER_WORD = 32  # xgrammar's token bitmask: int32 words, token i is bit i % 32 of word i // 32


@dataclass(frozen=True)
class GrammarMask(LogitsProcessor):
    """Structured outputs: a constrained row keeps only the tokens its grammar allows next (the
    others get -inf), from its matcher's token bitmask. First in the pipeline, so every later
    processor and every sampling mode sees only allowed tokens."""
    bitmask: torch.Tensor  # [batch, ceil(vocab / 32)] int32 on the logits' device; a set bit = allowed
    rows: list[int]  # the constrained rows (the others' words are all ones, and skipped)

    @classmethod
    def build(cls, rows: RowsView) -> "GrammarMask | None":
        constrained = [row for row, r in enumerate(rows.rows) if r.grammar is not None]
        if not constrained:
            return None
        # Filled on the CPU, where xgrammar writes, then copied once.
        bitmask = torch.full((len(rows.rows), cdiv(rows.vocab_size, BITS_PER_WORD)), -1, dtype=torch.int32)
        for row in constrained:
            rows.rows[row].grammar.fill_bitmask(bitmask, row, rows.drafts[row] if rows.drafts else ())
        return cls(bitmask.to(rows.device, non_blocking=True), constrained)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        # Imported here, where a grammar exists, so xgrammar is installed and wanted.
        from xgrammar import apply_token_bitmask_inplace
        masked = logits.clone()
        apply_token_bitmask_inplace(masked, self.bitmask, vocab_size=logits.size(-1), indices=self.rows,
                                    backend=bitmask_backend(logits.device))
        return masked


@dataclass(frozen=True)
class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a value added to chosen tokens' logits, per row."""
    rows: torch.Tensor  # [n] int64
    token_ids: torch.Tensor  # [n] int64
    values: torch.Tensor  # [n] float32

    @classmethod
    def build(cls, rows: RowsView) -> "LogitBias | None":
        entries = [(row, token_id, bias) for row, p in enumerate(rows.params) for token_id, bias in
                   (p.logit_bias or {}).items()]
        if not entries:
            return None
        row_ids, token_ids, values = zip(*entries)
        return cls(rows.column(row_ids, torch.int64), rows.column(token_ids, torch.int64),
                   rows.column(values, torch.float32))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put((self.rows, self.token_ids), self.values, accumulate=True)


@dataclass(frozen=True)
class TokenBans(LogitsProcessor):
    """Tokens a row may not take now (min_tokens: end-of-text and stop tokens before it is reached)."""
    rows: torch.Tensor  # [n] int64
    token_ids: torch.Tensor  # [n] int64

    @classmethod
    def build(cls, rows: RowsView) -> "TokenBans | None":
        entries = [(row, token_id) for row, seq in enumerate(rows.rows) for token_id in rows.banned_token_ids(seq)]
        if not entries:
            return None
        row_ids, token_ids = zip(*entries)
        return cls(rows.column(row_ids, torch.int64), rows.column(token_ids, torch.int64))

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

    @classmethod
    def build(cls, rows: RowsView) -> "Penalties | None":
        params, column = rows.params, rows.column
        if not any(p.has_penalties for p in params):
            return None
        return cls(column([p.repetition_penalty for p in params], torch.float32),
                   column([p.presence_penalty for p in params], torch.float32),
                   column([p.frequency_penalty for p in params], torch.float32),
                   token_counts([r.prompt_token_ids for r in rows.rows], rows.vocab_size, rows.device) > 0,
                   token_counts([r.completion_token_ids for r in rows.rows], rows.vocab_size, rows.device))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.repetition, self.presence, self.frequency, self.prompt_mask,
                               self.output_counts)


@dataclass(frozen=True)
class MinP(LogitsProcessor):
    min_p: torch.Tensor  # [batch] float32, 0 = off

    @classmethod
    def build(cls, rows: RowsView) -> "MinP | None":
        if not any(p.min_p > 0 for p in rows.params if not p.greedy):
            return None
        return cls(rows.column([p.min_p for p in rows.params], torch.float32))

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_min_p(logits, self.min_p)


@dataclass(frozen=True)
class TopKTopP(LogitsProcessor):
    top_k: torch.Tensor | None  # [batch] int64, vocab size = off; None: no row uses it
    top_p: torch.Tensor | None  # [batch] float32, 1 = off; None: no row uses it

    @classmethod
    def build(cls, rows: RowsView) -> "TopKTopP | None":
        params, column, vocab_size = rows.params, rows.column, rows.vocab_size
        sampled = [p for p in params if not p.greedy]
        top_k = column([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], torch.int64) \
            if any(p.top_k > 0 for p in sampled) else None
        top_p = column([p.top_p for p in params], torch.float32) if any(p.top_p < 1 for p in sampled) else None
        return cls(top_k, top_p) if top_k is not None or top_p is not None else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_top_k_top_p(logits, self.top_k, self.top_p)


# The pipeline, in order: steps 1 and 3 (see the module's docstring).
BEFORE_TEMPERATURE: tuple[type[LogitsProcessor], ...] = (GrammarMask, LogitBias, TokenBans, Penalties)
AFTER_TEMPERATURE: tuple[type[LogitsProcessor], ...] = (MinP, TopKTopP)


def token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[batch, vocab] float32 counts of each token id per row."""
    width = max(1, max(map(len, rows)))
    # Pad with an extra column (vocab_size) that is dropped after counting.
    ids = torch.tensor([r + [vocab_size] * (width - len(r)) for r in rows], dtype=torch.int64)
    counts = torch.zeros(len(rows), vocab_size + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size].to(device, non_blocking=True)


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


# Logits are kept within +-LOGIT_LIMIT: far inside float32 (3.4e38), so dividing by the smallest
# temperature (1e-5) or repetition penalty (0.01), or subtracting two logits, stays finite.
LOGIT_LIMIT = 1e30


def finite_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN as the least likely value and infinities and beyond-range values
    clamped to +-LOGIT_LIMIT: what the pipeline and the logprobs start from (not the race
    kernel's fast path, whose argmax returns an index of the row whatever the values)."""
    return torch.nan_to_num(logits.float(), nan=-LOGIT_LIMIT, posinf=LOGIT_LIMIT,
                            neginf=-LOGIT_LIMIT).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)


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

    @staticmethod
    def pipeline(rows: RowsView) -> tuple[tuple[LogitsProcessor, ...], tuple[LogitsProcessor, ...]]:
        """The processors these rows need: (before temperature, after temperature), each in order."""
        before = tuple(p for cls in BEFORE_TEMPERATURE if (p := cls.build(rows)) is not None)
        after = tuple(p for cls in AFTER_TEMPERATURE if (p := cls.build(rows)) is not None)
        return before, after

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32: the distribution each sampled row draws from, raw logits in."""
        return torch.softmax(self.filter(self.adjust(logits)), dim=-1)
