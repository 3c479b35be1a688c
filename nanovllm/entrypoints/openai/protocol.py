"""The OpenAI wire format: request and response shapes as pydantic models, and the error JSON.

Owns what a request may look like (types, required fields, which roles exist) and how a bad
one is reported: `APIError` becomes OpenAI's `{"error": {"message", "type", "param", "code"}}`.
Value ranges (temperature >= 0, top_p in (0, 1], ...) are declared once, in `SamplingParams`,
whose `ParamError` names the field; `request_error()` turns it into a 400 with that `param`.
What this module bounds itself is what must never reach SamplingParams or the engine at all:
integers past what a tensor holds (`top_k=2**63`), strings that are not valid Unicode (a lone
surrogate, which JSON's `"\ud800"` makes), and lists longer than any real request needs. It does
not know the engine, HTTP routing or tokenization.
"""
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_serializer, field_validator

from nanovllm.sampling_params import MAX_LOGPROBS, MAX_SEED, MIN_SEED, SamplingParams
from nanovllm.utils.validation import ParamError, first_surrogate

# OpenAI's default for /v1/completions; chat completions default to what the context has left.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Roles the chat template is given; others are refused (a template would render them blindly).
CHAT_ROLES = ("system", "developer", "user", "assistant")
# Counts, token ids and top_k fit an int32 (what the sampler's and scheduler's tensors hold);
# the engine bounds them further (top_k and token ids to the vocabulary, n to the queue).
MAX_COUNT = 2**31 - 1
# Stop strings and stop token ids a request may give: each is checked on every generated token,
# so thousands of them would slow every step of the batch (OpenAI allows 4).
MAX_STOP = 64
# Characters of one stop string: text is held back from a stream until it cannot begin one.
MAX_STOP_CHARS = 1024
# logit_bias entries a request may give: each is one element of the sampler's bias, every step.
MAX_LOGIT_BIAS_ENTRIES = 1024


def _valid_unicode(text: str) -> str:
    """JSON's \\uD800-\\uDFFF escapes parse into lone surrogates, which are not text: no tokenizer
    takes them and no UTF-8 encoder writes them. Refused here (not replaced), so nothing the client
    did not mean is generated from."""
    bad = first_surrogate(text)
    if bad is not None:
        raise ValueError(f"must be valid Unicode, but it holds a lone surrogate ({text[bad]!r} at character "
                         f"{bad}); a \\uD800-\\uDBFF escape must be followed by a \\uDC00-\\uDFFF one")
    return text


# Every string field of a request: valid Unicode.
Text = Annotated[str, AfterValidator(_valid_unicode)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT)]
StopString = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]


class APIError(Exception):
    """An error a route returns to the client as OpenAI's error JSON with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        # A message quoting the client's input could hold a lone surrogate, which JSON encoders
        # (UTF-8) refuse: escaped, so reporting an error can never fail itself.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code = status if code is None else code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# Names pydantic puts in an error's location for the member of a union it tried ("str",
# "list[str]"): they are not fields, so the param leaves them out.
_UNION_MEMBER_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _loc_to_param(loc: tuple) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; None for the body as a whole."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str) and (not part.isidentifier() or part in _UNION_MEMBER_TAGS):
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else str(part)
    return param or None


def validation_error(errors: list[dict]) -> APIError:
    """A 400 for pydantic's (or FastAPI's) first complaint, naming the field it is about. For a
    union (`stop`: a string or a list of them) the complaint about the member the value was
    meant as wins over "not a string" from the members it plainly is not."""
    error = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    if error["type"] == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}")
    param = _loc_to_param(tuple(error["loc"]))
    if param is None:
        return APIError(400, f"the request body must be a JSON object: {error['msg']}")
    msg = error["msg"].removeprefix("Value error, ")
    got = "" if error["type"] == "missing" else f" (got {error.get('input')!r:.80})"
    return APIError(400, f"{param}: {msg}{got}", param=param)


def request_error(exc: ValueError, fields: set[str], prompt_field: str = "prompt") -> APIError:
    """A 400 for a ValueError from SamplingParams, this module's checks or the engine. A
    ParamError names its field (`.param`), which becomes `param` when the request has that field
    (the engine's "prompt" is the chat's "messages"); a refusal that names none is the engine's
    own request check, of the prompt (its token ids, its length, its tokenization)."""
    param = exc.param if isinstance(exc, ParamError) else "prompt"
    if param == "prompt":
        param = prompt_field
    elif param not in fields:
        param = None
    return APIError(400, str(exc), param=param)


class Strict(BaseModel):
    # strict: "5" is not an int and 1 is not a bool, as JSON types are meant; no NaN or inf;
    # fields the server does not know are ignored (as vLLM does), so newer clients still work.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """The sampling knobs both endpoints share, with vLLM's extensions; None means the default."""
    model: Text | None = None
    n: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT)] | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: Count = 0
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted and ignored, as OpenAI's
    # OpenAI's logit_bias: token ids (as JSON object keys, so strings) -> a value in [-100, 100]
    logit_bias: Annotated[dict[Text, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request (its checks raise ParamError naming the field)."""
        logit_bias = None
        if self.logit_bias:
            bad = next((key for key in self.logit_bias if not (key.isascii() and key.isdigit())), None)
            if bad is not None:
                raise ParamError("logit_bias", f"logit_bias has the key {bad!r:.40}; its keys must be token ids written as "
                                 "decimal strings, e.g. {\"50256\": -100}")
            logit_bias = {int(key): value for key, value in self.logit_bias.items()}
        given = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")}
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, min_tokens=self.min_tokens,
            max_tokens=max_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=logit_bias,
            **{name: value for name, value in given.items() if value is not None})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    # str, list of str, token ids or a list of token-id lists; checked below (the schema says so to clients)
    prompt: Any = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT}},
        {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": {
            "type": "integer", "minimum": 0, "maximum": MAX_COUNT}}}]})
    max_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Text | None = None  # refused: no fill-in-the-middle
    best_of: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None  # refused unless equal to n

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        def is_ids(x) -> bool:
            return isinstance(x, list) and bool(x) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_COUNT for t in x)
        if isinstance(prompt, str) and prompt:
            return _valid_unicode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) and p for p in prompt):
            for i, p in enumerate(prompt):
                try:
                    _valid_unicode(p)
                except ValueError as exc:
                    raise ValueError(f"prompt {i} {exc}") from None
            return prompt
        if isinstance(prompt, list) and prompt and (is_ids(prompt) or all(is_ids(p) for p in prompt)):
            return prompt
        raise ValueError("must be a non-empty string, a list of non-empty strings, a non-empty list of token ids "
                         f"(each in [0, {MAX_COUNT}]) or a list of such lists")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one engine request each."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported by this server; leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", f"best_of={self.best_of} is not supported; best_of must be left out or equal n={self.n}")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal[CHAT_ROLES]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    # OpenAI's newer name for max_tokens; wins when both are given
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True  # vLLM's extension: end the prompt with the assistant header
    tools: list[dict] | None = None  # refused: no tool calling

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.tools:
            raise ParamError("tools", "tools is not supported by this server; leave it out")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=true")
        max_tokens = next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None),
                          default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs)


# ---- responses ----

class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extension: the stop token or string that ended it


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # as OpenAI: {"content": "..."}, and {} at the end


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "nanovllm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
