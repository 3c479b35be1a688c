"""The OpenAI wire format: request and response shapes as pydantic models, and the error JSON.

Owns what a request may look like (types, required fields, which roles exist) and how a bad
one is reported: `APIError` becomes OpenAI's `{"error": {"message", "type", "param", "code"}}`.
Value ranges (temperature >= 0, top_p in (0, 1], ...) are declared once, in `SamplingParams`,
whose `ParamError` names the field; `request_error()` turns it into a 400 with that `param`.
What this module bounds itself is what must never reach SamplingParams or the engine at all:
integers past what a tensor holds (`top_k=2**63`), strings that are not valid Unicode (a lone
surrogate, which JSON's `"\ud800"` makes), and lists longer than any real request needs.
Types are JSON's, strictly, except where OpenAI's API is lenient: an explicit null means the
field's default, and integer/number fields take 4.0 and "4" (`Int`, `Float`). Fields a model
does not declare go through `request_fields.screen_fields` (vLLM's refused by name, unknown
ones logged once). It does not know the engine, HTTP routing or tokenization.
"""
import json
import time
from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_serializer,
                      field_validator, model_validator)

from nanovllm.engine.chat import ChatOptions
from nanovllm.entrypoints.openai.request_fields import UNSUPPORTED_FIELD_ERROR, screen_fields
from nanovllm.sampling_params import MAX_LOGPROBS, MAX_SEED, MIN_SEED, SamplingParams, StructuredOutputsParams
from nanovllm.utils.validation import ParamError, first_surrogate

# OpenAI's default for /v1/completions; chat completions default to what the context has left.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Roles the chat template is given; others are refused (a template would render them blindly).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
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
# Functions a chat request may offer: each is rendered into the prompt (OpenAI allows 128).
MAX_TOOLS = 128


def _valid_unicode(text: str) -> str:
    """JSON's \\uD800-\\uDFFF escapes parse into lone surrogates, which are not text: no tokenizer
    takes them and no UTF-8 encoder writes them. Refused here (not replaced), so nothing the client
    did not mean is generated from."""
    bad = first_surrogate(text)
    if bad is not None:
        raise ValueError(f"must be valid Unicode, but it holds a lone surrogate ({text[bad]!r} at character "
                         f"{bad}); a \\uD800-\\uDBFF escape must be followed by a \\uDC00-\\uDFFF one")
    return text


# Characters of a number sent as a string: far more than any field's bound needs, far fewer than
# what makes int() slow (or refuse: Python limits int("...") to 4300 digits).
MAX_NUMBER_STRING_CHARS = 40


def _as_int(value: Any) -> Any:
    """OpenAI's API takes 4.0 and "4" for an integer field: they become 4. What is not an integer
    (4.5, "4.5", true) is left for the strict check to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in ("+", "-") else text
        if digits.isascii() and digits.isdigit() and len(digits) <= MAX_NUMBER_STRING_CHARS:
            return int(text)
    return value


def _as_float(value: Any) -> Any:
    """OpenAI's API takes "0.5" for a number field. A string that is no number (or is "nan") is
    left for the strict check to refuse."""
    if isinstance(value, str) and len(value) <= MAX_NUMBER_STRING_CHARS:
        try:
            return float(value)
        except ValueError:
            return value
    return value


# Every string field of a request: valid Unicode.
Text = Annotated[str, AfterValidator(_valid_unicode)]
# Every integer and number field of a request, coerced as OpenAI's API does (strict otherwise).
Int = Annotated[int, BeforeValidator(_as_int)]
Float = Annotated[float, BeforeValidator(_as_float)]
Count = Annotated[Int, Field(ge=0, le=MAX_COUNT)]
TokenId = Annotated[Int, Field(ge=0, le=MAX_COUNT)]
StopString = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]


class APIError(Exception):
    """An error a route returns to the client as OpenAI's error JSON with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        # A message quoting the client's input could hold a lone surrogate, which JSON encoders
        # (UTF-8) refuse: escaped, so reporting an error can never fail itself.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code = default_code(status) if code is None else code
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def default_code(status: int) -> str:
    """An error's `code` when nothing more precise is known: its status in words ("bad_request",
    "not_found"), so `code` is always a string, as OpenAI's."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:  # not a standard status (499)
        return f"http_{status}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


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
    if error["type"] == UNSUPPORTED_FIELD_ERROR:  # a vLLM field this server refuses (request_fields.py)
        param = error["ctx"]["field"]
        return APIError(400, error["msg"], param=param, code="unsupported_parameter")
    param = _loc_to_param(tuple(error["loc"]))
    if param is None and error["type"] == "value_error":  # a check of the body as a whole
        return APIError(400, error["msg"].removeprefix("Value error, "))
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
    # strict: 1 is not a bool and "hot" no number, as JSON types are meant (Int and Float take
    # what OpenAI's API coerces); no NaN or inf; fields the server does not know are ignored (as
    # vLLM does), so newer clients still work.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null for a field with a non-null default means that default, as the
        official clients send nulls for what they leave unset."""
        if not isinstance(data, dict):
            return data
        def null_is_a_value(name: str) -> bool:
            field = cls.model_fields.get(name)
            return field is None or field.is_required() or (field.default is None and field.default_factory is None)
        return {name: value for name, value in data.items() if value is not None or null_is_a_value(name)}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # refused: usage comes in the last chunk only


class JsonSchemaFormat(Strict):
    name: Text
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's response_format: free text, any JSON object, or JSON under a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(Strict):
    """vLLM's structured_outputs request field: exactly one constraint (StructuredOutputsParams)."""
    json_: dict | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(max_length=1024)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# Where each way of asking for a constraint puts it, for errors: StructuredOutputsParams' field -> the request's.
_CONSTRAINT_FIELDS = {"response_format": {"json": "response_format.json_schema.schema"},
                      "tools": {"json": "tools[].function.parameters"},  # tool_choice "required" or named
                      **{f"guided_{name}": {name: f"guided_{name}"} for name in ("json", "regex", "choice", "grammar")}}


def constraint_error(message: str, source: str) -> str:
    """A StructuredOutputsParams error ("structured_outputs.json ...") named by the request field
    that gave the constraint (`source`: "response_format", "guided_json", ...)."""
    for name, field in _CONSTRAINT_FIELDS.get(source, {}).items():
        message = message.replace(f"structured_outputs.{name}", field)
    return message.replace("structured_outputs", source) if source in _CONSTRAINT_FIELDS else message


class SamplingFields(Strict):
    """The sampling knobs both endpoints share, with vLLM's extensions; None means the default."""
    model: Text | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_COUNT)] = 1
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Annotated[Int, Field(ge=-1, le=MAX_COUNT)] | None = None
    min_p: Float | None = None
    seed: Annotated[Int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: Count = 0
    ignore_eos: bool = False
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None  # accepted and ignored, as OpenAI's
    # OpenAI's logit_bias: token ids (as JSON object keys, so strings) -> a value in [-100, 100]
    logit_bias: Annotated[dict[Text, Float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len)
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1, le=MAX_COUNT)] | None = None
    priority: Annotated[Int, Field(ge=-MAX_COUNT, le=MAX_COUNT)] = 0  # vLLM's: lower is scheduled first
    # vLLM's extension: top-N logprobs of every prompt token, returned as the choice's prompt_logprobs
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Structured outputs, at most one of: vLLM's field, OpenAI's response_format, vLLM's older guided_* names
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(max_length=1024)] | None = None
    guided_grammar: Text | None = None

    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The request's structured-outputs constraint and the field that gave it, or None."""
        given = {}
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            given["structured_outputs"] = lambda: StructuredOutputsParams(**fields)
        format_ = self.response_format
        if format_ is not None and format_.type == "json_object":
            given["response_format"] = lambda: StructuredOutputsParams(json_object=True)
        elif format_ is not None and format_.type == "json_schema":
            if format_.json_schema is None:
                raise ParamError("response_format", "response_format: type 'json_schema' needs a json_schema object with the schema")
            schema = format_.json_schema.schema_
            given["response_format"] = lambda: StructuredOutputsParams(
                json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                given[f"guided_{name}"] = lambda name=name, value=value: StructuredOutputsParams(**{name: value})
        if len(given) > 1:
            raise ParamError(next(iter(given)), f"{', '.join(given)} are given together; constrain the output one way only")
        if not given:
            return None
        (source, make), = given.items()
        try:
            return source, make()
        except ValueError as exc:
            raise ParamError(source, constraint_error(str(exc), source)) from None

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any) -> Any:
        return screen_fields(set(cls.model_fields), data)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
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
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_outputs=structured if structured is not None else (self.constraint() or (None, None))[1],
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
    # 0 only with echo: the prompt's text and logprobs alone, as vLLM (what lm-eval's scoring sends)
    max_tokens: Annotated[Int, Field(ge=0, le=MAX_COUNT)] | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: Text | None = None  # refused: no fill-in-the-middle
    best_of: Annotated[Int, Field(ge=1, le=MAX_COUNT)] | None = None  # refused unless equal to n
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (etc.) before a text prompt

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
        if max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens=0 is allowed only with echo=true (the prompt's text and "
                             "logprobs alone); max_tokens must be at least 1 otherwise")
        # Echoed with logprobs, the prompt's tokens carry theirs too (vLLM's rule).
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        # max_tokens 0 runs as 1 (the engine always samples once) and the server drops that token.
        return self.sampling_params(max(max_tokens, 1), self.logprobs, prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the response is the prompt alone."""
        return self.echo and self.max_tokens == 0


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(Strict):
    name: Text
    arguments: Text  # JSON text


class ToolCall(Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(Strict):
    name: Annotated[Text, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(Strict):
    role: Literal[CHAT_ROLES]
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    # None only in an assistant message with tool_calls (checked after role and tool_calls, declared first)
    content: Text | list[TextPart] | None = Field(default=None, validate_default=True)
    name: Text | None = None
    tool_call_id: Text | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content_or_tool_calls(cls, content, info: ValidationInfo):
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required; it may be null only in an assistant message with tool_calls")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it: tool calls' arguments as objects (as vLLM gives them)."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _arguments_object(arguments: str) -> dict | str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[Int, Field(ge=1, le=MAX_COUNT)] | None = None
    # OpenAI's newer name for max_tokens; wins when both are given
    max_completion_tokens: Annotated[Int, Field(ge=1, le=MAX_COUNT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    # "none", "auto" (the default with tools), "required", or a named function
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: "required" makes exactly one call
    # How the conversation is rendered (vLLM's extensions; engine/chat.py's ChatOptions).
    add_generation_prompt: bool = True  # end the prompt with the assistant header
    continue_final_message: bool = False  # leave the last (assistant) message open, to be continued
    add_special_tokens: bool = False  # the tokenizer's BOS (etc.) on top of what the template writes
    chat_template: Text | None = None  # replaces the server's template; only with --trust-request-chat-template
    chat_template_kwargs: dict[Text, Any] | None = None  # extra template variables (Qwen3's enable_thinking)
    documents: list[dict[Text, Text]] | None = None  # handed to the template as `documents` (RAG templates)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # handed to the template, as vLLM
    include_reasoning: bool = True  # with a --reasoning-parser: False leaves reasoning_content out
    echo: bool = False  # vLLM's: the answer begins with the last message when that is the answer's role's

    def echoed(self) -> str:
        """What `echo` puts before the answer: the last message's text when its role is the
        answer's (the assistant's, or the last message's own when no turn is opened)."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        return last.text() if self.echo and last.role == role else ""

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def chat_options(self, server_template: str | None, tools: list[dict] | None = None) -> ChatOptions:
        """How to render this request's conversation (ValueError naming the field if not allowed);
        `tools`: the function schemas the template is handed (serving_tools' plan)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return ChatOptions(add_generation_prompt=self.add_generation_prompt,
                           continue_final_message=self.continue_final_message,
                           chat_template=self.chat_template or server_template, chat_template_kwargs=kwargs,
                           tools=tools, documents=self.documents, add_special_tokens=self.add_special_tokens)

    def to_sampling_params(self, default_max_tokens: int,
                           structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """`structured`: a constraint the tools ask for (tool_choice "required" or named), in place of the request's own."""
        if self.stream and self.prompt_logprobs is not None:
            raise ParamError("prompt_logprobs", f"prompt_logprobs={self.prompt_logprobs} is not available with "
                             "stream=true (as vLLM); leave it out or do not stream")
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing, as vLLM takes it
            raise ParamError("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=true")
        max_tokens = next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None),
                          default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, structured=structured)


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


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's logprob at a prompt position, its rank and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extension: the stop token or string that ended it
    # vLLM's extension, with the request's prompt_logprobs: None for the first prompt token, then
    # token id -> its Logprob, the prompt token's own and the top-N
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


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
    content: str | None  # None when a reasoning parser found only reasoning, or with tool calls only
    reasoning_content: str | None = None  # vLLM's: the <think> part, with a --reasoning-parser
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("message")
    def _reasoning_only_when_parsed(self, message: AssistantMessage) -> dict:
        return message.model_dump(exclude={"reasoning_content"} if message.reasoning_content is None else None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's, as CompletionChoice's


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries its id, type and name; the others more arguments."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
