"""Hermes' tool-call format, which Qwen2.5 and Qwen3 use: each call is
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, anywhere in the text."""
import json

from nanovllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, TaggedToolCallStream, ToolParser


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> TaggedToolCallStream:
        return TaggedToolCallStream("<tool_call>", "</tool_call>", parse_hermes_call)


def parse_hermes_call(body: str) -> ParsedToolCall | None:
    """A call from the JSON between the tags; None when it is not one (not JSON, no name)."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    # Arguments are an object; a model may also write them as JSON text, given through as they are.
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedToolCall(call["name"], text)
