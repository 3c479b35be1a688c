"""Reasoning parsers: split a chat answer's reasoning (`<think>...</think>`) from its content.

A `ReasoningParser` is made per sample and fed the answer's text as it is generated; each `feed`
returns what is new of each part (`ReasoningDelta`), holding back text that may still turn out
to be a tag, and `finish` hands back what was held. A whole answer is fed once and finished, so a
streamed answer's deltas always add up to the non-streamed split. `TagReasoningParser` does the
work for any model that marks reasoning with a start and an end tag; a new parser is a subclass
naming its tags, registered in `REASONING_PARSERS` (the --reasoning-parser choices). This module
knows nothing of HTTP or tokenizers.

Where reasoning starts: at the start tag when the answer opens with it (after whitespace), or
at once when the prompt already ends with it (templates that open the thinking block themselves,
as Qwen3's thinking-only models). Without either, the whole answer is content; after the end tag
everything is content. An answer cut short inside the reasoning is all reasoning.
"""
from typing import NamedTuple


class ReasoningDelta(NamedTuple):
    reasoning: str  # new reasoning text ("" if none)
    content: str  # new content text ("" if none)


_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


class TagReasoningParser:
    """Splits on `start_tag` ... `end_tag`; subclasses name the tags."""
    start_tag: str
    end_tag: str

    def __init__(self, prompt_text: str = ""):
        # The prompt's last characters tell whether its template already opened the reasoning.
        self._state = _REASONING if prompt_text.rstrip().endswith(self.start_tag) else _OPENING
        self._held = ""  # text not yet handed out: a possible tag, or the answer's leading whitespace

    def feed(self, text: str) -> ReasoningDelta:
        """The parts of the answer that `text`, its next piece, settles."""
        self._held += text
        reasoning = content = ""
        if self._state == _OPENING:
            opening = self._held.lstrip()
            if opening.startswith(self.start_tag):
                self._held = opening[len(self.start_tag):]
                self._state = _REASONING
            elif self.start_tag.startswith(opening):
                return ReasoningDelta("", "")  # still possibly the start tag
            else:
                self._state = _CONTENT
        if self._state == _REASONING:
            end = self._held.find(self.end_tag)
            if end < 0:
                keep = _partial_tag_length(self._held, self.end_tag)
                reasoning, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                return ReasoningDelta(reasoning, "")
            reasoning, self._held = self._held[:end], self._held[end + len(self.end_tag):]
            self._state = _CONTENT
        content, self._held = self._held, ""
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        """What was held back, once the answer has ended: a partial end tag is reasoning text,
        a partial start tag (or whitespace alone) is content."""
        held, self._held = self._held, ""
        return ReasoningDelta(held, "") if self._state == _REASONING else ReasoningDelta("", held)

    def split(self, text: str) -> ReasoningDelta:
        """A whole answer's (reasoning, content)."""
        first, last = self.feed(text), self.finish()
        return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class Qwen3ReasoningParser(TagReasoningParser):
    """Qwen3 (and QwQ, DeepSeek-R1 style): `<think>` ... `</think>`."""
    start_tag = "<think>"
    end_tag = "</think>"


# --reasoning-parser NAME -> the parser class.
REASONING_PARSERS: dict[str, type[TagReasoningParser]] = {"qwen3": Qwen3ReasoningParser}
