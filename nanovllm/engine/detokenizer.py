"""Incremental detokenisation and stop strings, for requests that stream or have stop strings.

Text is produced token by token with the prompt as context (vLLM's prefix/read offsets): the
last few prompt tokens open the decode window, so an output's first token keeps what decoding
it alone would lose (SentencePiece's leading space, a character begun in the prompt), and the
prompt's text plus every delta is the text of prompt and output decoded together. Each new token
decodes a small window of recent tokens and emits only the part past what was already emitted,
holding it back while it ends in an incomplete UTF-8 character (U+FFFD). A decoder that rewrites
text already emitted (WordPiece's `cleanup`: " do not" -> " don't") cannot be streamed exactly;
such rewrites across the window's start are kept as emitted, as in vLLM.
A stop string is searched only in the newly produced text (plus the few characters before it
that a stop string spanning tokens needs) and the text is cut as vLLM cuts it: before the stop
string, or after it with include_stop_str_in_output.
Without a tokenizer (the engine's skip_tokenizer_init) all text is empty; the engine refuses
stop strings then, since nothing could find them.
"""
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence
# Prompt tokens decoded before the first output token (vLLM's initial offset): enough for a
# leading-space marker and a character begun in the prompt, few enough to decode every step.
CONTEXT_TOKENS = 5
# Further prompt tokens the context may take so as not to begin inside a character spelled in
# byte tokens (SentencePiece's byte fallback): a UTF-8 character has at most 4 bytes.
MAX_CONTEXT_BACKOFF = 3


def prompt_context(tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                   skip_special_tokens: bool) -> list[int]:
    """The prompt's last CONTEXT_TOKENS, reaching back up to MAX_CONTEXT_BACKOFF more while they
    decode to text that begins with U+FFFD: a context that begins with a character's continuation
    bytes makes a byte-fallback decoder replace its whole run of byte tokens (the output's bytes
    that follow included) with U+FFFD."""
    start = max(0, len(prompt_token_ids) - CONTEXT_TOKENS)
    for _ in range(MAX_CONTEXT_BACKOFF):
        text = tokenizer.decode(prompt_token_ids[start:], skip_special_tokens=skip_special_tokens)
        if start == 0 or not text.startswith(REPLACEMENT_CHAR):
            break
        start -= 1
    return list(prompt_token_ids[start:])


def decode_after(tokenizer: PreTrainedTokenizerBase | None, prompt_token_ids: list[int], token_ids: list[int],
                 skip_special_tokens: bool) -> str:
    """The text `token_ids` add after the prompt: the prompt's context (prompt_context) and them
    decoded together, less the context's own text (what a Detokenizer's deltas add up to)."""
    if tokenizer is None:
        return ""
    context = prompt_context(tokenizer, list(prompt_token_ids), skip_special_tokens)
    return text_after(tokenizer, context, token_ids, skip_special_tokens)


def text_after(tokenizer: PreTrainedTokenizerBase, context: list[int], token_ids: list[int],
               skip_special_tokens: bool) -> str:
    """`context` and `token_ids` decoded together, less the context's own text."""
    context_text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    text = tokenizer.decode(context + list(token_ids), skip_special_tokens=skip_special_tokens)
    return text[len(context_text):]


class Detokenizer:

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, params: SamplingParams,
                 prompt_token_ids: list[int] = ()):
        self.tokenizer = tokenizer
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        # The decode window's context (the prompt's last tokens), then every output token.
        self.token_ids: list[int] = (self.prompt_token_ids[-CONTEXT_TOKENS:] if tokenizer is None else
                                     prompt_context(tokenizer, self.prompt_token_ids, params.skip_special_tokens))
        self.num_context = len(self.token_ids)
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.token_ids)  # tokens before this are already in `text` (or the prompt's)
        self.text = ""
        self.stopped: str | None = None  # the stop string found, once found
        # While streaming, this many trailing characters could be the start of a stop string.
        self.hold_back = max((len(s) for s in params.stop_strings), default=1) - 1
        self.num_streamed = 0  # characters of `text` handed to a stream so far
        self._final: str | None = None  # final_text(), made once: the last delta and the final output share it

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append one token's text; returns the stop string if it completes one."""
        self.token_ids.append(token_id)
        self._final = None
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
        if self._final is None:
            self._final = self.text if self.stopped is not None else "" if self.tokenizer is None else text_after(
                self.tokenizer, self.token_ids[:self.num_context], self.token_ids[self.num_context:],
                self.params.skip_special_tokens)
        return self._final

    def stream_delta(self, finished: bool) -> str:
        """The text not yet handed to the stream; unfinished, it keeps back what might still
        become a stop string."""
        text = self.final_text() if finished else self.text
        end = len(text) if finished else max(self.num_streamed, len(text) - self.hold_back)
        delta = text[self.num_streamed:end]
        self.num_streamed = end
        return delta
