"""Per-request sampling settings with vLLM's names and defaults, validated when they are made.

temperature 0 means greedy (argmax); nano-vllm forbids it, vLLM users expect it. The order
the sampler applies them in (as vLLM): penalties, temperature, min_p, top_k, top_p.
"""
import math
from dataclasses import dataclass, field

# vLLM's limits: penalties beyond +-2 make no useful distribution; 20 top logprobs is what
# the OpenAI API allows and what the sampler is sized for.
MAX_ABS_PENALTY = 2.0
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed; {name} must be {allowed}")


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # keep the fewest most likely tokens whose probabilities sum to top_p; in (0, 1]
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; in [0, 1]
    seed: int | None = None  # per-request seed for reproducible sampling (sample i uses seed + i)
    stop: str | list[str] | None = None  # strings that end generation when they appear in the text
    stop_token_ids: list[int] | None = None  # token ids that end generation
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    min_tokens: int = 0  # tokens to generate before end-of-text, a stop token or stop string may end it
    max_tokens: int = 64  # most tokens to generate
    ignore_eos: bool = False  # keep generating past the end-of-text token
    logprobs: int | None = None  # top-N logprobs per generated token (the chosen token's too)
    repetition_penalty: float = 1.0  # > 0 (1 = off): penalise tokens already in the prompt or output
    presence_penalty: float = 0.0  # in [-2, 2] (0 = off): subtracted from tokens already generated
    frequency_penalty: float = 0.0  # in [-2, 2] (0 = off): subtracted per occurrence of tokens already generated
    skip_special_tokens: bool = True  # leave special tokens out of the text
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "a finite number >= 0 (0 means greedy)")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k", self.top_k,
               "an integer >= 1, or 0 or -1 for off")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "None or an integer")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        _check(stop is None or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)),
               "stop", self.stop, "None, a non-empty string or a list of non-empty strings")
        self.stop_strings = tuple(stop or ())
        ids = self.stop_token_ids
        _check(ids is None or (isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids)),
               "stop_token_ids", ids, "None or a list of token ids >= 0")
        self.stop_token_ids = list(ids or [])
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"an integer in [0, max_tokens={self.max_tokens}]")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "a number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and abs(value) <= MAX_ABS_PENALTY, name, value,
                   f"a number in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}] (0 = off)")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        self.temperature = float(self.temperature)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_only_temperature(self) -> bool:
        """True when sampling this request needs nothing beyond its temperature (the fast path)."""
        return (self.top_k <= 0 and self.top_p == 1.0 and self.min_p == 0.0 and self.seed is None
                and self.min_tokens == 0 and self.logprobs is None and not self.has_penalties)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
