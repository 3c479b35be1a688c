"""Speculative decoding's settings: `LLM(path, speculative_config={...})`, checked before any work.

Two ways to propose the tokens the target model then verifies in one forward pass:
- "ngram" (prompt lookup): the tokens that followed the most recent earlier occurrence of the
  sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min). No second model.
- "draft_model": a small model sharing the target's vocabulary proposes them one by one; it has
  its own paged KV cache, with the same block ids as the target's, sized from the same budget.
This module owns the checks and the resolved settings (`SpeculativeConfig`); the proposers live
in scheduling/ngram_proposer.py and runner/speculative.py. It knows nothing of how either runs.
"""
from dataclasses import dataclass

from nanovllm.utils.validation import ParamError, is_int, require

NGRAM, DRAFT_MODEL = "ngram", "draft_model"
SPECULATIVE_METHODS = (NGRAM, DRAFT_MODEL)
# Each proposed token is one more row of the verification pass and, for a draft model, one more
# draft forward pass; past this the chance that every one is accepted is too small to pay for it.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's prompt-lookup defaults when only one bound is given are the other bound; with neither,
# these: a match of up to 4 tokens, down to a single token.
DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX = 1, 4
_KEYS = {NGRAM: {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"},
         DRAFT_MODEL: {"method", "num_speculative_tokens", "model"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # most tokens proposed per sequence per step (k)
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # ngram: shortest suffix matched
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # ngram: longest suffix matched (tried first)
    model: str | None = None  # draft_model: the draft checkpoint's directory

    @classmethod
    def from_dict(cls, value: object) -> "SpeculativeConfig":
        """Check a user's speculative_config dict; ParamError naming what is wrong and what is allowed."""
        require(isinstance(value, dict), "speculative_config", value,
                f"None or a dict with 'method' (one of {SPECULATIVE_METHODS}) and 'num_speculative_tokens'")
        method = value.get("method")
        require(method in SPECULATIVE_METHODS, "speculative_config['method']", method,
                f"one of {SPECULATIVE_METHODS}")
        unknown = sorted(set(value) - _KEYS[method])
        if unknown:
            raise ParamError("speculative_config", f"speculative_config has unknown key(s) {unknown} for method {method!r}; "
                             f"allowed keys: {sorted(_KEYS[method])}")
        k = value.get("num_speculative_tokens")
        require(is_int(k) and 1 <= k <= MAX_SPECULATIVE_TOKENS, "speculative_config['num_speculative_tokens']", k,
                f"an integer in 1..{MAX_SPECULATIVE_TOKENS}")
        if method == DRAFT_MODEL:
            model = value.get("model")
            require(isinstance(model, str) and model != "", "speculative_config['model']", model,
                    "the draft checkpoint's directory (a str)")
            return cls(method, k, model=model)
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low, high = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        low, high = (high if low is None else low), (low if high is None else high)
        require(is_int(low) and low >= 1, "speculative_config['prompt_lookup_min']", low, "an integer >= 1")
        require(is_int(high) and high >= low, "speculative_config['prompt_lookup_max']", high,
                f"an integer >= prompt_lookup_min ({low})")
        return cls(method, k, prompt_lookup_min=low, prompt_lookup_max=high)
