"""Per-request sampling settings with vLLM's names and defaults, validated when they are made.

temperature 0 means greedy (argmax); nano-vllm forbids it, vLLM users expect it. The order
the sampler applies them in (as vLLM): penalties, temperature, min_p, top_k, top_p.

Every field is bounded here (docs/reliability.md has the table): counts to named caps, floats
finite and in range, strings valid Unicode, so nothing a caller can pass overflows a tensor or
turns the logits into NaN. What depends on the model (top_k and stop_token_ids against the
vocabulary, max_tokens against the KV cache) is checked again when the engine builds the request.
A temperature below SAMPLING_EPS is stored as 0: greedy, as vLLM treats it (dividing by
1e-38 overflows float32).

A SamplingParams is immutable: it is checked once, when it is made, so a later assignment
could skip every check; a changed copy is a new one (`dataclasses.replace(params, top_k=5)`),
checked again. Lists given for `stop` and `stop_token_ids` are kept as tuples, so the caller's
own list cannot change them afterwards either.

`structured_outputs` (a StructuredOutputsParams, or a dict of its fields) constrains the output
to a JSON schema, a regex, a choice or a grammar: its shape is checked here, the constraint itself
when the engine compiles it as it builds the request (nanovllm/structured_outputs/).
"""
import json
from dataclasses import FrozenInstanceError, dataclass, fields
from functools import cached_property

from nanovllm.utils.validation import ParamError, first_surrogate, is_int, is_number, require, shown

# vLLM's limits: penalties beyond +-2 make no useful distribution; 20 top logprobs is what
# the OpenAI API allows and what the sampler is sized for.
MAX_ABS_PENALTY = 2.0
MAX_LOGPROBS = 20
# OpenAI's range for a logit_bias value: -100 bans a token in effect, 100 all but forces it.
MAX_ABS_LOGIT_BIAS = 100.0
# repetition_penalty divides (or multiplies) a seen token's logit: beyond these a logit is scaled
# by over 100x one way or 2x the other, which no use needs, and the float32 logits stay finite.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 2.0
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-38 overflow float32.
SAMPLING_EPS = 1e-5
# Past it every token is equally likely anyway; it keeps 1 / temperature a normal float32.
MAX_TEMPERATURE = 1e4
# Samples per prompt: each is a sequence with its own blocks; more than any client needs.
MAX_N = 128
# max_tokens: past every model's context (the engine caps by the context anyway), and small
# enough that every token count stays exact in float32 (the penalties count tokens in float32).
MAX_TOKENS_CAP = 1 << 24
# top_k and token ids travel as int64 tensors; the engine also refuses ids and a top_k past the
# vocabulary. This bound holds for a SamplingParams made outside an engine too.
MAX_TOKEN_ID = 2**31 - 1
# Stop strings are searched in every new piece of text, each up to its length back: a few dozen
# short strings cover every real use, and keep the per-token search small.
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = 1024  # min_tokens bans every one of them in every step
# What torch.Generator.manual_seed accepts (an int64 or a uint64); sample i of a request is
# seeded with seed + i, so all n of them must fall in this range.
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1
# Strings a `choice` constraint may list: each becomes one alternative of its grammar.
MAX_CHOICES = 1024


def _explain_frozen(cls: type) -> type:
    """A frozen dataclass's assignment error says only "cannot assign to field 'x'"; this one
    also says why and what to do instead. (dataclass refuses a __setattr__ written in a frozen
    class's own body, so it is put in place here, after the class is made.)"""
    def __setattr__(self, name: str, value) -> None:
        names = [f.name for f in fields(cls)]
        if name not in names:
            raise AttributeError(f"{cls.__name__} has no field {name!r}; its fields are {names}")
        raise FrozenInstanceError(f"{cls.__name__} cannot be changed after it is made (it is checked once, then): "
                                  f"{name}={value!r} refused; make a new one instead, e.g. "
                                  f"dataclasses.replace(params, {name}=...)")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"{cls.__name__} cannot be changed after it is made: deleting {name} refused")
    cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__
    return cls


@_explain_frozen
@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's StructuredOutputsParams): exactly one of json,
    regex, choice, grammar and json_object. The output then matches it token by token, and ends
    (finish_reason "stop") once the constraint is complete and the model emits end-of-text."""
    json: str | dict | None = None  # a JSON schema (a dict, or its JSON text): the output is JSON valid under it
    regex: str | None = None  # the output matches this regular expression
    choice: list[str] | tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF (GBNF) grammar with a `root` rule, as xgrammar reads it
    json_object: bool | None = None  # True: the output is a JSON object, any object (OpenAI's json_object)
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (no runs of blanks)

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        require(len(given) == 1, "structured_outputs", {name: getattr(self, name) for name in given} or None,
                f"exactly one of {', '.join(CONSTRAINTS)}")
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ParamError("structured_outputs", f"structured_outputs.json={shown(self.json)} is not JSON ({exc}); it must be "
                                 "a JSON schema, as a dict or its JSON text") from None
        require(schema is None or isinstance(schema, dict), "structured_outputs.json", self.json,
                "a JSON schema: a dict (JSON object) or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and value and first_surrogate(value) is None),
                    f"structured_outputs.{name}", value, "a non-empty string of valid Unicode")
        choice = self.choice
        require(choice is None or (isinstance(choice, (list, tuple)) and 0 < len(choice) <= MAX_CHOICES and all(
            isinstance(c, str) and c and first_surrogate(c) is None for c in choice)), "structured_outputs.choice",
            choice, f"a list of 1 to {MAX_CHOICES} non-empty strings")
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            require(value is None or isinstance(value, bool), f"structured_outputs.{name}", value, "True or False")
        # Kept as the engine reads them: the schema as canonical JSON text (one text per schema,
        # so equal schemas share a compiled grammar), the choices as a tuple.
        for name, value in (("json", None if schema is None else json.dumps(schema, sort_keys=True)),
                            ("choice", None if choice is None else tuple(choice))):
            object.__setattr__(self, name, value)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))


# The constraints a StructuredOutputsParams holds exactly one of.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@_explain_frozen
@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS, stored as 0) means greedy (argmax)
    top_p: float = 1.0  # keep the fewest most likely tokens whose probabilities sum to top_p; in (0, 1]
    top_k: int = 0  # 0 or -1: off; at most the vocabulary size
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; in [0, 1]
    seed: int | None = None  # per-request seed for reproducible sampling (sample i uses seed + i)
    stop: str | list[str] | tuple[str, ...] | None = None  # strings that end generation; kept as a tuple
    stop_token_ids: list[int] | tuple[int, ...] | None = None  # token ids that end generation; kept as a tuple
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    min_tokens: int = 0  # tokens to generate before end-of-text, a stop token or stop string may end it
    max_tokens: int = 64  # most tokens to generate
    ignore_eos: bool = False  # keep generating past the end-of-text token
    logprobs: int | None = None  # top-N logprobs per generated token (the chosen token's too)
    repetition_penalty: float = 1.0  # in [0.01, 2] (1 = off): penalise tokens already in the prompt or output
    presence_penalty: float = 0.0  # in [-2, 2] (0 = off): subtracted from tokens already generated
    frequency_penalty: float = 0.0  # in [-2, 2] (0 = off): subtracted per occurrence of tokens already generated
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # token id -> a value in [-100, 100] added to its logit before anything else (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    # top-N logprobs of every prompt token after the first (the token's own too, with its rank), as
    # vLLM's prompt_logprobs; the prompt then computes in full (no prefix-cache hit) until they are all in
    prompt_logprobs: int | None = None
    # the output matches a JSON schema, regex, choice or grammar (a StructuredOutputsParams, or a dict of its fields)
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        require(is_int(self.n) and 1 <= self.n <= MAX_N, "n", self.n, f"an integer in [1, {MAX_N}]")
        require(is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
                self.temperature, f"a finite number in [0, {MAX_TEMPERATURE:g}] (below {SAMPLING_EPS:g} means greedy)")
        require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        require(is_int(self.top_k) and -1 <= self.top_k <= MAX_TOKEN_ID, "top_k", self.top_k,
                "an integer >= 1 (at most the vocabulary size), or 0 or -1 for off")
        require(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        require(self.seed is None or is_int(self.seed), "seed", self.seed, "None or an integer")
        if self.seed is not None and not (MIN_SEED <= self.seed and self.seed + self.n - 1 <= MAX_SEED):
            raise ParamError("seed", f"seed={self.seed} is not allowed with n={self.n}: sample i is seeded with seed + i and "
                             f"torch.Generator takes seeds in [-2**63, 2**64 - 1], so with n={self.n} seed must be in "
                             f"[{MIN_SEED}, {MAX_SEED - self.n + 1}]")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        require(stop is None or (isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_STRINGS and all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop)), "stop", self.stop,
            f"None, a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
            f"{MAX_STOP_STRING_CHARS} characters")
        for s in stop or ():
            bad = first_surrogate(s)
            require(bad is None, "stop", self.stop, f"valid Unicode text (stop string {s!r:.40} has a lone surrogate "
                    f"at index {bad})")
        ids = self.stop_token_ids
        require(ids is None or (isinstance(ids, (list, tuple)) and len(ids) <= MAX_STOP_TOKEN_IDS and all(
            is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in ids)), "stop_token_ids", ids,
            f"None or a list of at most {MAX_STOP_TOKEN_IDS} token ids in the vocabulary")
        require(is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_CAP, "max_tokens", self.max_tokens,
                f"an integer in [1, {MAX_TOKENS_CAP}]")
        require(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                f"an integer in [0, max_tokens={self.max_tokens}]")
        require(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                "logprobs", self.logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        require(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and
                                                 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                "prompt_logprobs", self.prompt_logprobs, f"None or an integer in [0, {MAX_LOGPROBS}]")
        require(is_number(self.repetition_penalty) and
                MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
                self.repetition_penalty, f"a number in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}] (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(is_number(value) and abs(value) <= MAX_ABS_PENALTY, name, value,
                    f"a number in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}] (0 = off)")
        bias = self.logit_bias
        require(bias is None or (isinstance(bias, dict) and all(
            is_int(t) and 0 <= t <= MAX_TOKEN_ID and is_number(b) and abs(b) <= MAX_ABS_LOGIT_BIAS
            for t, b in bias.items())), "logit_bias", bias,
            f"None or a dict of token ids >= 0 to numbers in [-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}]")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            require(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        structured = self.structured_outputs
        if isinstance(structured, dict):
            unknown = sorted(set(structured) - {f.name for f in fields(StructuredOutputsParams)})
            require(not unknown, "structured_outputs", structured, "a dict of StructuredOutputsParams fields "
                    f"({', '.join(f.name for f in fields(StructuredOutputsParams))}); unknown: {unknown}")
            structured = StructuredOutputsParams(**structured)
        require(structured is None or isinstance(structured, StructuredOutputsParams), "structured_outputs",
                structured, "None, a StructuredOutputsParams or a dict of its fields")
        # The grammar decides where the output may end; min_tokens would forbid end-of-text where
        # the grammar demands it, leaving no token to take.
        require(structured is None or self.min_tokens == 0, "min_tokens", self.min_tokens,
                "0 with structured_outputs (the constraint decides where the output ends)")
        # The one place a field is stored after __init__: the checked values in the form they are
        # kept in (tuples, which the caller cannot change later; a float temperature). Written as a
        # frozen dataclass's own __init__ writes its fields, past the __setattr__ that refuses changes.
        for name, value in (("stop", tuple(stop or ())), ("stop_token_ids", tuple(ids or ())),
                            ("temperature", 0.0 if self.temperature < SAMPLING_EPS else float(self.temperature)),
                            ("logit_bias", None if not bias else FrozenDict({t: float(b) for t, b in bias.items()})),
                            ("structured_outputs", structured)):
            object.__setattr__(self, name, value)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids outside a model's vocabulary and a top_k past it (ParamError naming the
        field), once the engine knows the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ())):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise ParamError(name, f"{name} has token id {bad}, outside the vocabulary; ids must be in [0, {vocab_size})")
        if self.top_k > vocab_size:  # refused, not clamped: a top_k past the vocabulary is a mistake
            raise ParamError("top_k", f"top_k={self.top_k} is larger than the vocabulary ({vocab_size} tokens); top_k must "
                             f"be in [1, {vocab_size}], or 0 or -1 for off")

    @cached_property
    def processors(self) -> tuple[str, ...]:
        """The logits processors this request needs, by name, in the sampling pipeline's order
        (layers/logits_processors.py; temperature is not one: every row has it). A greedy request
        needs none of those that only shape a draw. The one source of every fast-path decision."""
        sampled = not self.greedy
        needed = (("structured_outputs", self.structured_outputs is not None), ("logit_bias", bool(self.logit_bias)), ("min_tokens", self.min_tokens > 0),
                  ("penalties", self.has_penalties), ("min_p", sampled and self.min_p > 0),
                  ("top_k_top_p", sampled and (self.top_k > 0 or self.top_p < 1)))
        return tuple(name for name, on in needed if on)

    @property
    def needs_only_temperature(self) -> bool:
        """True when sampling this request needs nothing beyond its temperature (the fast path)."""
        return self.seed is None and self.needs_only_temperature_and_seed

    @property
    def needs_only_temperature_and_seed(self) -> bool:
        """True when its temperature and seed are all it needs: no processor, no logprobs (the
        race kernels' fast path, which draw a seeded row's noise in the kernel, and the CPU head's draw)."""
        return not self.processors and self.logprobs is None

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling this request's next token reads its previous tokens' values on the host
        (penalties count them; a grammar's mask follows them): each step waits for its tokens."""
        return self.has_penalties or self.structured_outputs is not None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class FrozenDict(dict):
    """A dict that refuses changes once made (SamplingParams' logit_bias), and still pickles."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("this mapping is part of a SamplingParams, which cannot be changed after it is made; "
                        "make a new SamplingParams instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):
        return FrozenDict, (dict(self),)
