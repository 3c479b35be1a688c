"""Whether a sequence that has just got a token is finished, and why: the one owner of the
stopping rules (as vLLM's StopChecker).

The scheduler calls `StopChecker.check` once for each sequence a step advanced, right after its
new token is appended. The rules, in this order:
0. structured outputs: the token advances the sequence's grammar matcher (the sampler's mask
   allowed only such tokens); a grammar completed and ended by its end-of-text token is a "stop",
   even with ignore_eos.
1. min_tokens: until a sequence has that many completion tokens, only the length rule ends it.
   The sampler keeps to the same rule from the other side: `banned_token_ids` are the tokens it
   must not pick for the next token, so no stop token comes before min_tokens either.
2. A stop token: one of stop_token_ids (stop_reason is that id) or the end-of-text token unless
   ignore_eos (stop_reason None); finish_reason "stop".
3. A stop string, looked for in the sequence's text as its Detokenizer produces it (every new
   token is fed to it, since streams read the same text): "stop", stop_reason the string. A stop
   token ends the sequence before any stop string it might also complete; a stop string
   completed by the last token max_tokens allows is still a "stop".
4. max_tokens completion tokens, or max_model_len tokens in all: "length".
Plain Python; it changes nothing but the detokenizer's text and knows nothing of blocks or
queues (the scheduler finishes the sequence and frees its blocks).
"""
from typing import NamedTuple

from nanovllm.scheduling.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


class Finish(NamedTuple):
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # the stop token id or stop string; None at end-of-text and for "length"


END_OF_TEXT = Finish("stop", None)
LENGTH = Finish("length", None)


def below_min_tokens(num_completion_tokens: int, params: SamplingParams) -> bool:
    """Fewer completion tokens than min_tokens: no stop rule but length may end the sequence yet."""
    return num_completion_tokens < params.min_tokens


def banned_token_ids(seq: Sequence, eos: int) -> list[int]:
    """The token ids the sampler must not pick as this sequence's next token: while it is below
    min_tokens, every token that would stop it (its stop tokens, and end-of-text unless ignored)."""
    params = seq.sampling_params
    if not below_min_tokens(seq.num_completion_tokens, params):
        return []
    return [*params.stop_token_ids, *([] if params.ignore_eos or eos < 0 else [eos])]


class StopChecker:

    def __init__(self, eos: int, max_model_len: int):
        self.eos = eos  # the end-of-text token id; negative when the checkpoint has none
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> Finish | None:
        """Apply the rules to a sequence whose newest token was just appended; None while it goes on.
        (It runs for every sequence in every step, so it reads the sequence's fields directly.)"""
        params = seq.sampling_params
        token_ids = seq.token_ids
        token = token_ids[-1]
        num_completion = len(token_ids) - seq.num_prompt_tokens
        may_stop = not below_min_tokens(num_completion, params)
        stop = None
        grammar = seq.grammar
        if grammar is not None:
            grammar.accept(token)
            if grammar.is_terminated:
                stop = END_OF_TEXT
        if may_stop and stop is None:
            if token in params.stop_token_ids:
                stop = Finish("stop", token)
            elif token == self.eos and not params.ignore_eos:
                stop = END_OF_TEXT
        detokenizer = seq.detokenizer
        if detokenizer is not None:
            found = detokenizer.add_token(token, check_stop=may_stop and stop is None)
            if found is not None:
                return Finish("stop", found)
        if stop is not None:
            return stop
        if num_completion >= params.max_tokens or len(token_ids) >= self.max_model_len:
            return LENGTH
        return None

    def next_token_ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token being sampled for this sequence (not yet appended) will finish it by
        rule 4 whatever it is: async scheduling schedules no step after it."""
        num_tokens = len(seq.token_ids) + 1
        return num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens or \
            num_tokens >= self.max_model_len
