"""Incremental detokenisation and stop strings, for requests that stream or have stop strings.

Text is produced token by token (as vLLM does): decode a small window of recent tokens and
emit only the part past what was already emitted, holding it back while it ends in an
incomplete UTF-8 character. A stop string is searched only in the newly produced text (plus
the few characters before it that a stop string spanning tokens needs) and the text is cut as
vLLM cuts it: before the stop string, or after it with include_stop_str_in_output.
Without a tokenizer (the engine's skip_tokenizer_init) all text is empty; the engine refuses
stop strings then, since nothing could find them.
"""
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class Detokenizer:

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this are already in `text`
        self.text = ""
        self.stopped: str | None = None  # the stop string found, once found
        # While streaming, this many trailing characters could be the start of a stop string.
        self.hold_back = max((len(s) for s in params.stop_strings), default=1) - 1
        self.num_streamed = 0  # characters of `text` handed to a stream so far

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append one token's text; returns the stop string if it completes one."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return None
        new_text = window_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new_text
        if check_stop and self.params.stop_strings:
            return self._find_stop(len(new_text))
        return None

    def _find_stop(self, num_new: int) -> str | None:
        best = None  # (index, stop string): the earliest stop string in the text
        for stop in self.params.stop_strings:
            index = self.text.find(stop, max(0, len(self.text) - num_new - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[:index + len(stop)] if self.params.include_stop_str_in_output else self.text[:index]
        self.stopped = stop
        return stop

    def final_text(self) -> str:
        """The whole output text: the cut text after a stop string, else a full decode (which
        also renders a trailing incomplete character the incremental text held back)."""
        return self.text if self.stopped is not None else self._decode(self.token_ids)

    def stream_delta(self, finished: bool) -> str:
        """The text not yet handed to the stream; unfinished, it keeps back what might still
        become a stop string."""
        text = self.final_text() if finished else self.text
        end = len(text) if finished else max(self.num_streamed, len(text) - self.hold_back)
        delta = text[self.num_streamed:end]
        self.num_streamed = end
        return delta
