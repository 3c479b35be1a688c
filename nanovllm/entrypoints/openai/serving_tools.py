"""Tool calling on chat completions: what a request's `tools` and `tool_choice` ask of the engine,
and how its output becomes OpenAI's `tool_calls`, whole or streamed.

`plan_tools` decides, before any work:
- "none" (or no tools): a plain answer; the template is not given the tools (as vLLM).
- a named function: its arguments are forced to match its JSON schema through structured
  outputs; the whole output is that call's arguments.
- "required": the output is forced to a JSON array of {"name", "parameters"} objects, one
  schema per offered function (one call only with parallel_tool_calls false).
- "auto" (the default with tools): the model answers freely and the server's parser
  (`--tool-call-parser`, tool_parsers/) finds the calls in its text.
`ToolOutput` turns one sample's text into content and calls; `ToolDeltas` does it as the text
streams, as deltas the openai client reassembles (each call's first delta carries its id, type
and name, later ones more arguments). A response with calls ends with finish_reason "tool_calls".
"""
import json
import uuid
from dataclasses import dataclass

from nanovllm.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, DeltaFunctionCall, DeltaMessage,
                                                  DeltaToolCall, FunctionCall, NamedToolChoice, ToolCall)
from nanovllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedToolCall, ToolCallStream, ToolParser
from nanovllm.sampling_params import StructuredOutputsParams

NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that declares no parameters takes none


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "named", "required" or "auto"
    tools: list[dict]  # the function schemas, as the chat template gets them
    structured: StructuredOutputsParams | None  # the constraint "named" and "required" put on the output
    function_name: str | None = None  # "named": the function called
    parser: ToolParser | None = None  # "auto": what finds the calls


def plan_tools(body: ChatCompletionRequest, parser_name: str | None) -> ToolPlan | None:
    """What this request's tools ask for; None for a plain answer. Refuses (400) what cannot be served."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, f"tool_choice={_shown(choice)} needs tools; give the functions in tools",
                           param="tool_choice")
        return None
    if choice == "none":
        return None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    functions = {tool.function.name: tool.function.parameters or NO_PARAMETERS for tool in body.tools}
    if isinstance(choice, NamedToolChoice) or choice == "required":
        if body.constraint() is not None:
            raise APIError(400, "tool_choice 'required' or a named function constrains the output to tool calls, "
                                "so it cannot be combined with response_format or structured_outputs",
                           param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in functions:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools "
                                f"({', '.join(functions)})", param="tool_choice")
        return ToolPlan("named", tools, _schema(functions[name], "tools"), function_name=name)
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
             "required": ["name", "parameters"]} for name, parameters in functions.items()]}}
        if not body.parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolPlan("required", tools, _schema(calls, "tools"))
    if parser_name is None:  # "auto"
        raise APIError(400, "tool_choice 'auto' (the default with tools) needs the server started with "
                            f"--tool-call-parser (one of: {', '.join(TOOL_PARSERS)}); or use tool_choice 'required', "
                            "a named function, or 'none'", param="tool_choice")
    return ToolPlan("auto", tools, None, parser=TOOL_PARSERS[parser_name]())


def _schema(schema: dict, param: str) -> StructuredOutputsParams:
    try:  # compact JSON: arguments are read by programs, and a model cannot wander off into blanks
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


def _shown(value) -> str:
    return repr(value.model_dump() if hasattr(value, "model_dump") else value)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended normally with calls in it."""
    return "tool_calls" if called and reason == "stop" else reason


def _required_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls of a "required" output (a JSON array of {"name", "parameters"}); None if it does not parse
    (the output was cut short by max_tokens)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]


class ToolOutput:
    """One finished sample's text as an assistant message's content and tool calls."""

    def __init__(self, plan: ToolPlan, text: str):
        if plan.mode == "named":
            self.content, parsed = None, [ParsedToolCall(plan.function_name, text)]
        elif plan.mode == "required":
            parsed = _required_calls(text)
            self.content, parsed = (text, []) if parsed is None else (None, parsed)
        else:
            self.content, parsed = plan.parser.extract(text)
        self.tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                           for c in parsed]


class ToolDeltas:
    """One streamed sample's text pieces as chat deltas: content, and tool calls in pieces."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.num_calls = 0
        self.text = ""  # "required": the output so far (parsed once it has ended)
        self.stream: ToolCallStream | None = plan.parser.stream() if plan.mode == "auto" else None

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _call_deltas(self, name: str, arguments: str | None) -> list[DeltaMessage]:
        """A new call: its id, type and name, then its arguments (when known) as a second delta."""
        index = self.num_calls
        self.num_calls += 1
        deltas = [DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=new_call_id(), type="function",
                                                         function=DeltaFunctionCall(name=name, arguments=""))])]
        if arguments:
            deltas.append(self._arguments(index, arguments))
        return deltas

    @staticmethod
    def _arguments(index: int, arguments: str) -> DeltaMessage:
        return DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))])

    def _pieces(self, pieces: list) -> list[DeltaMessage]:
        deltas = []
        for piece in pieces:
            if isinstance(piece, ParsedToolCall):
                deltas += self._call_deltas(piece.name, piece.arguments)
            elif piece:
                deltas.append(DeltaMessage(content=piece))
        return deltas

    def feed(self, text: str) -> list[DeltaMessage]:
        if not text:
            return []
        if self.plan.mode == "named":  # the output is the arguments: streamed as they come
            if not self.called:
                return self._call_deltas(self.plan.function_name, text)
            return [self._arguments(0, text)]
        if self.plan.mode == "required":  # the array is parsed once it is complete
            self.text += text
            return []
        return self._pieces(self.stream.feed(text))

    def finish(self) -> list[DeltaMessage]:
        if self.plan.mode == "named":
            return self._call_deltas(self.plan.function_name, None) if not self.called else []
        if self.plan.mode == "required":
            calls = _required_calls(self.text)
            if calls is None:
                return [DeltaMessage(content=self.text)] if self.text else []
            return self._pieces(calls)
        return self._pieces(self.stream.finish())
