"""What one line of a batch job's input asks for, and the line that reports its result.

An input line is OpenAI's batch format, `{"custom_id", "method", "url", "body"}`, whose body is
a /v1/completions body (with "prompt") or a /v1/chat/completions body (with "messages"); a bare
body (`{"prompt": ...}`, optionally with a "custom_id") works too. A line without a custom_id is
given `line-N`, N being its line number in the file (from 1). The body is checked by the
server's pydantic models (protocol.py), so a batch line takes what the server takes, with the
server's error messages. Sampling fields a line leaves out (or sets to null) take the job's
defaults: the `nanovllm batch` sampling flags, or SamplingParams' defaults.

A line that cannot be run (not JSON, no prompt, a bad sampling value, ...) becomes an error line
for its custom_id instead; the job goes on. Every result line names its input line ("line"), the
key a restarted job resumes by. This module knows nothing of files, engines or tokenizers.
"""
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from nanovllm.engine.chat import ChatOptions
from nanovllm.engine.outputs import CompletionOutput, RequestOutput
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, request_error, validation_error
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.validation import first_surrogate

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
DERIVED_ID_PREFIX = "line-"  # custom_id of a line that has none: "line-N"
# Keys of an OpenAI batch line around its body; a bare-body line may carry them too.
ENVELOPE_KEYS = ("custom_id", "method", "url")
_COMPLETION_FIELDS = set(CompletionRequest.model_fields)
_CHAT_FIELDS = set(ChatCompletionRequest.model_fields)
_DEFAULT_MAX_TOKENS = SamplingParams.__dataclass_fields__["max_tokens"].default
# Request fields the server implements in its routes but a batch job does not -> the value that
# asks for nothing: another value is refused by name, never ignored.
BATCH_UNSUPPORTED = {"truncate_prompt_tokens": None, "priority": 0}
BATCH_UNSUPPORTED_CHAT = {**BATCH_UNSUPPORTED, "include_reasoning": True}  # no reasoning parser in a job
BATCH_UNSUPPORTED_COMPLETION = {**BATCH_UNSUPPORTED, "add_special_tokens": True}  # the engine encodes prompts


@dataclass
class BatchRequest:
    """A line that can run: its prompt (or conversation) and sampling settings."""
    line: int | None  # line number in the input file, from 1 (None where rows carry none, as in Ray Data)
    custom_id: str | None  # None only for a line without one and without a line number
    prompt: str | list[int] | None  # a completion's prompt (None for a chat)
    messages: list[dict[str, str]] | None  # a chat's conversation, rendered by the engine's tokenizer
    chat_options: ChatOptions | None  # how to render it (None for a completion)
    params: SamplingParams


@dataclass
class LineError:
    """A line that cannot run, and why; it is reported as the line's result."""
    line: int | None
    custom_id: str | None
    message: str
    param: str | None = None  # the field at fault, when one is

    def to_json(self) -> str:
        return json.dumps({"custom_id": self.custom_id, "line": self.line,
                           "error": {"message": self.message, "param": self.param}})


def default_sampling() -> dict[str, Any]:
    """SamplingParams' defaults as keyword arguments: what a line starts from when no flag is given."""
    return {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init}


def resolve_sampling_defaults(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A job's sampling defaults: SamplingParams' with `overrides` on top, checked once (a
    ValueError names an unknown key or a bad value)."""
    known = default_sampling()
    unknown = sorted(set(overrides or {}) - set(known))
    if unknown:
        raise ValueError(f"sampling_defaults has unknown key(s) {unknown}; allowed keys: {sorted(known)}")
    merged = {**known, **(overrides or {})}
    SamplingParams(**merged)
    return merged


def derived_custom_id(line: int | None) -> str | None:
    return None if line is None else f"{DERIVED_ID_PREFIX}{line}"


def _with_defaults(body: dict, defaults: dict[str, Any], chat: bool) -> dict:
    """The body with the job's sampling defaults under it: a field the body sets wins; null is unset."""
    merged = {name: value for name, value in defaults.items() if value is not None and name != "logprobs"}
    logprobs = defaults.get("logprobs")
    if logprobs is not None:
        if not chat:
            merged["logprobs"] = logprobs
        elif "logprobs" not in body and "top_logprobs" not in body:  # chat's are a flag plus a count
            merged.update(logprobs=True, top_logprobs=logprobs)
    merged.update((key, value) for key, value in body.items() if value is not None)
    return merged


def _lone_surrogate(value: Any, path: str) -> tuple[str, str] | None:
    """(field path, the text around it) of the first string in `value`, keys included, that holds
    a lone surrogate: JSON's "\\ud800" escape carries one, but no tokenizer can encode it."""
    if isinstance(value, str):
        bad = first_surrogate(value)
        return None if bad is None else (path, value[max(0, bad - 10):bad + 11])
    if isinstance(value, dict):
        children = [(f"{path}.{key}" if path else key, key, item) for key, item in value.items()]
    elif isinstance(value, list):
        children = [(f"{path}[{i}]", None, item) for i, item in enumerate(value)]
    else:
        return None
    for child, key, item in children:
        if key is not None and _lone_surrogate(key, child) is not None:
            return ascii(child), key
        if (found := _lone_surrogate(item, child)) is not None:
            return found
    return None


def _read_object(raw: str | bytes, line: int | None) -> dict | LineError:
    """A line as a JSON object with a valid custom_id (if it has one), or why it is not."""
    where = "the line" if line is None else f"line {line}"

    def error(message: str, param: str | None = None) -> LineError:
        return LineError(line, derived_custom_id(line), message, param)

    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        return error(f"{where} is not UTF-8 text: {exc}")
    if not text.strip():
        return error(f"{where} is blank; every line must be a JSON object (a request)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return error(f"{where} is not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return error(f"{where} is {type(obj).__name__} JSON; it must be a JSON object (a request)")
    if "custom_id" in obj:
        custom_id = obj["custom_id"]
        if not isinstance(custom_id, str) or not custom_id:
            return error(f"custom_id={custom_id!r:.80} is not allowed; it must be a non-empty string", "custom_id")
        if _lone_surrogate(custom_id, "custom_id") is not None:
            return error(f"custom_id={custom_id!a:.80} holds a lone surrogate, which is not valid Unicode; it must "
                         "be valid UTF-8 text", "custom_id")
    return obj


def line_custom_id(raw: str | bytes, line: int) -> str:
    """The custom_id a line's result carries: its own, or line-N when it has none (or a bad one)."""
    obj = _read_object(raw, line)
    return obj.custom_id if isinstance(obj, LineError) else obj.get("custom_id", derived_custom_id(line))


def parse_line(raw: str | bytes, line: int | None, defaults: dict[str, Any] | None = None
               ) -> BatchRequest | LineError:
    """Read one input line (with or without its newline); `line` is its number, from 1, if known.
    `defaults` come from resolve_sampling_defaults() (None: SamplingParams' defaults)."""
    obj = _read_object(raw, line)
    if isinstance(obj, LineError):
        return obj
    custom_id = obj.get("custom_id", derived_custom_id(line))

    def error(message: str, param: str | None = None) -> LineError:
        return LineError(line, custom_id, message, param)

    if "body" in obj:
        body = obj["body"]
        if not isinstance(body, dict):
            return error(f"body must be a JSON object (got {type(body).__name__})", "body")
    else:  # a bare body
        body = {key: value for key, value in obj.items() if key not in ENVELOPE_KEYS}
    if (found := _lone_surrogate(body, "")) is not None:
        param, around = found
        return error(f"{param} holds a lone surrogate ({around!a}), which is not valid Unicode; text must be valid "
                     "UTF-8 (a \\ud800-\\udfff escape only as half of a surrogate pair)", param)
    chat = "messages" in body
    if chat and "prompt" in body:
        return error("a request has either prompt (a completion) or messages (a chat), not both", "prompt")
    if not chat and "prompt" not in body:
        return error("prompt: field required (or messages, for a chat)", "prompt")
    url = obj.get("url")
    expected_url = CHAT_URL if chat else COMPLETIONS_URL
    if url is not None and url != expected_url:
        return error(f"url={url!r:.80} is not allowed for a body with {'messages' if chat else 'prompt'}; "
                     f"it must be {expected_url!r} (or left out)", "url")
    merged = _with_defaults(body, default_sampling() if defaults is None else defaults, chat)
    model_class = ChatCompletionRequest if chat else CompletionRequest
    try:
        request = model_class.model_validate(merged)
    except ValidationError as exc:
        api_error = validation_error(exc.errors())
        return error(api_error.message, api_error.param)
    unsupported = BATCH_UNSUPPORTED_CHAT if chat else BATCH_UNSUPPORTED_COMPLETION
    refused = next((name for name, noop in unsupported.items() if getattr(request, name) != noop), None)
    if refused is not None:
        return error(f"{refused}={getattr(request, refused)!r:.80} is not supported in a batch job; leave it out",
                     refused)
    if chat and (request.tools or request.tool_choice not in (None, "none")):  # the server's tool calling only
        return error("tools and tool_choice are not supported in batch jobs (only by the server's chat completions); "
                     "leave them out", "tools")
    try:
        if chat:
            params = request.to_sampling_params(default_max_tokens=_DEFAULT_MAX_TOKENS)
            options = request.chat_options(None)
        else:
            params = request.to_sampling_params()
    except ValueError as exc:
        api_error = request_error(exc, _CHAT_FIELDS if chat else _COMPLETION_FIELDS,
                                  "messages" if chat else "prompt")
        return error(api_error.message, api_error.param)
    if chat:
        return BatchRequest(line, custom_id, None, request.conversation(), options, params)
    prompts = request.prompts()
    if len(prompts) != 1:
        return error(f"prompt holds {len(prompts)} prompts; a batch line takes one (a string or a list of "
                     "token ids): put each prompt on a line of its own", "prompt")
    return BatchRequest(line, custom_id, prompts[0], None, None, params)


def result_line(request: BatchRequest, final: RequestOutput) -> str:
    """The result of a finished request: sample 0's text, token ids and finish reason (and
    logprobs when asked) at the top, every sample's under "outputs" when n > 1, and usage."""
    samples = [_sample_result(sample) for sample in final.outputs]
    out: dict[str, Any] = {"custom_id": request.custom_id, "line": request.line, **samples[0]}
    if len(samples) > 1:
        out["outputs"] = samples
    prompt_tokens = len(final.prompt_token_ids)
    completion_tokens = sum(len(sample.token_ids) for sample in final.outputs)
    out["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}
    out["error"] = None
    return json.dumps(out)


def _sample_result(sample: CompletionOutput) -> dict[str, Any]:
    """What a result reports of a sample (the engine's output has more: cache hits, cumulative logprob)."""
    out = {"text": sample.text, "token_ids": sample.token_ids, "finish_reason": sample.finish_reason,
           "stop_reason": sample.stop_reason}
    if sample.logprobs is not None:
        out["logprobs"] = sample.logprobs
    return out
