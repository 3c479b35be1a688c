"""Which request fields the server knows, and what it does with the ones its models do not declare.

vLLM's completion and chat request schemas (vllm/entrypoints/openai/{completion,chat_completion}/
protocol.py) are the reference: a client written for vLLM may send any of their fields, and none
may be dropped without a word. So every vLLM field is one of:
- declared by a request model in `protocol.py` (implemented there or by the route);
- implemented by another part of the server that declares it itself (`IMPLEMENTED_ELSEWHERE`:
  structured outputs and tool calling);
- refused here with a 400 naming it (`REFUSED`), unless its value is the one that asks for
  nothing (null, or vLLM's default), which is accepted so full vLLM-shaped requests still work.
A field in none of these lists is unknown: logged once per name (as vLLM logs them), then
ignored, so a newer client still works. This module knows the lists; `protocol.py` calls
`screen_fields` before validating a request.
"""
import logging
from typing import Any

from pydantic_core import PydanticCustomError

logger = logging.getLogger("nanovllm")

# Distinct unknown field names logged at most: a client inventing names cannot flood the log
# or grow this set without bound.
MAX_LOGGED_UNKNOWN_FIELDS = 64
# pydantic's error type for a refused field; `validation_error()` takes the field from its ctx.
UNSUPPORTED_FIELD_ERROR = "unsupported_field"

# vLLM fields this server does not implement -> the value that asks for nothing (accepted).
# Empty containers ask for nothing too (vLLM's defaults for bad_words, stop_token_ids ...).
REFUSED: dict[str, Any] = {
    "use_beam_search": False,  # no beam search
    "length_penalty": 1.0,  # beam search only
    "spaces_between_special_tokens": True,  # fast tokenizers always decode this way
    "allowed_token_ids": None,
    "bad_words": None,
    "mm_processor_kwargs": None,  # no multimodal models
    "prompt_embeds": None,
    "request_id": None,  # the server assigns ids (x-request-id header, response ids)
    "logits_processors": None,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "cache_salt": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "max_repetition_pattern_size": 0,
    "min_repetition_pattern_size": 0,
    "repetition_min_count": 0,
}

# vLLM fields another part of the server declares (structured outputs, tool calling): never
# refused here; until a request model declares them they are unknown fields.
IMPLEMENTED_ELSEWHERE = frozenset({
    "response_format", "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structural_tag",
})

# Every field of vLLM's requests, for the test that checks each is accounted for.
VLLM_COMPLETION_FIELDS = frozenset({
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
    "prompt_embeds", "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size", "repetition_min_count",
})
VLLM_CHAT_FIELDS = frozenset({
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "include_reasoning",
    "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size",
    "repetition_min_count",
})

_logged_unknown: set[str] = set()


def _asks_for_nothing(value: Any, noop: Any) -> bool:
    return value is None or value == noop or (isinstance(value, (list, dict, str)) and not value)


def screen_fields(declared: set[str], data: Any) -> Any:
    """`data` (a request body) without the fields its model does not declare: a refused vLLM
    field that asks for something raises a pydantic error naming it (a 400); an unknown field is
    logged (once per name) and dropped."""
    if not isinstance(data, dict):
        return data
    kept = {}
    for name, value in data.items():
        if name in declared:
            kept[name] = value
        elif name in REFUSED:
            if not _asks_for_nothing(value, REFUSED[name]):
                raise PydanticCustomError(
                    UNSUPPORTED_FIELD_ERROR, "{field}={value} is not supported by this server; leave it out",
                    {"field": name, "value": f"{value!r:.80}"})
        elif name not in _logged_unknown and len(_logged_unknown) < MAX_LOGGED_UNKNOWN_FIELDS:
            _logged_unknown.add(name)
            logger.warning("a request had the field %r, which this server does not know: ignored (logged once "
                           "per field name)", name[:80])
    return kept
