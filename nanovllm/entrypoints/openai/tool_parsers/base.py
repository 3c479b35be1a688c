"""The tool-parser interface, and a stream for formats that wrap each call in a start and an end tag.

A parser turns generated text into content and tool calls, all at once (`extract`) or as the text
streams in (`stream()`, whose `feed` and `finish` return content pieces and complete calls in the
order they appear). Text that is not a well-formed call (malformed JSON between the tags, an
unclosed tag) stays content, so nothing the model wrote is lost. Whitespace around calls is not
content. It knows nothing of HTTP or of the engine.
"""
from typing import ClassVar, NamedTuple


class ParsedToolCall(NamedTuple):
    name: str
    arguments: str  # the arguments as JSON text (OpenAI's function.arguments)


class ExtractedToolCalls(NamedTuple):
    content: str | None  # the text outside the calls; None when there is none
    calls: list[ParsedToolCall]


Piece = str | ParsedToolCall  # what a stream gives back: content text, or one complete call


class ToolCallStream:
    """Incremental parsing of one output."""

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        """What is left once the output has ended."""
        raise NotImplementedError


class ToolParser:
    name: ClassVar[str] = ""  # what --tool-call-parser calls it; "" for an abstract base

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def extract(self, text: str) -> ExtractedToolCalls:
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        return ExtractedToolCalls(content or None, [p for p in pieces if isinstance(p, ParsedToolCall)])


class TaggedToolCallStream(ToolCallStream):
    """Calls written as START body END, anywhere in the text (Hermes' <tool_call>...</tool_call>).

    Content goes out as soon as it cannot be the beginning of a start tag; a body goes to
    `parse_body` once its end tag is in, and comes back as a call, or as content (the tags with
    it) when it does not parse. Whitespace-only content before a call, between calls and at the
    end after a call is dropped."""

    def __init__(self, start: str, end: str, parse_body):
        self.start, self.end, self.parse_body = start, end, parse_body
        self.buffer = ""  # text not yet given back
        self.inside = False  # the buffer is a call's body (its start tag is consumed)
        self.held = ""  # trailing whitespace of the content given back so far, held until it matters
        self.num_calls = 0

    def _content(self, text: str) -> list[Piece]:
        text = self.held + text
        kept = text.rstrip()
        self.held = text[len(kept):]
        return [kept] if kept else []

    def _call(self, body: str) -> list[Piece]:
        call = self.parse_body(body)
        if call is None:  # not a call after all: the model's text, tags and all
            return self._content(self.start + body + self.end)
        self.held = ""  # whitespace before a call is not content
        self.num_calls += 1
        return [call]

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while True:
            if self.inside:
                end = self.buffer.find(self.end)
                if end < 0:
                    return pieces
                body, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(self.end):], False
                pieces += self._call(body)
                continue
            start = self.buffer.find(self.start)
            if start >= 0:
                pieces += self._content(self.buffer[:start])
                self.buffer, self.inside = self.buffer[start + len(self.start):], True
                continue
            keep = _partial_tag_length(self.buffer, self.start)
            pieces += self._content(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return pieces

    def finish(self) -> list[Piece]:
        if self.inside:  # an unclosed call (the output ended first): a call if its body parses
            call = self.parse_body(self.buffer)
            pieces = [call] if call is not None else self._content(self.start + self.buffer)
        else:
            pieces = self._content(self.buffer)
        self.buffer, self.inside = "", False
        if self.held and not self.num_calls and not any(isinstance(p, ParsedToolCall) for p in pieces):
            pieces.append(self.held)  # plain text keeps its trailing whitespace
        self.held = ""
        return pieces


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may become one)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
