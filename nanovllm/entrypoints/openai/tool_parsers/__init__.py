"""Tool-call parsers for `tool_choice="auto"`: the model's text in, content and tool calls out.

Each parser is one module of this package that subclasses `ToolParser` (base.py) with a `name`;
every module here is imported below, so a new format is one new file, chosen with
`nanovllm serve --tool-call-parser NAME`.
"""
import importlib
import pkgutil

from nanovllm.entrypoints.openai.tool_parsers.base import (ExtractedToolCalls, ParsedToolCall, ToolCallStream,
                                                           ToolParser)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

# Parser name -> class, from every ToolParser subclass the modules above defined.
TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in ToolParser.__subclasses__() if cls.name}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ParsedToolCall", "ToolCallStream", "ToolParser"]
