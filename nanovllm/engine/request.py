"""One request as its caller sees it: a prompt, its n samples (sequences), what of their output
the caller has already been handed, and where news of it is reported.

Whoever drives a step, each sequence's new tokens land on the sequence itself; `Request.pop`
hands the caller what is new since the last pop (a RequestOutput), so every caller gets exactly
its own requests' output. It also builds the final output dict that generate() returns. It
knows nothing of scheduling or tensors.

A request the engine failed (a fault while building, scheduling, running or finishing it; see
LLMEngine._fail_request) carries `error`, a message meant for its client: its samples end with
finish_reason "abort", its final dict gains an "error" key and its text is built without the
detokenizer (which may be what failed). Normal outputs keep their exact shape.
"""
import logging

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanovllm.engine.detokenizer import decode_after
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


@dataclass
class SampleDelta:
    """What is new in one sample since its request was last popped."""
    index: int  # which of the request's n samples
    token_ids: list[int]  # token ids new since then
    text: str  # text new since then; a sample's texts concatenate to its final text
    logprobs: list[dict]  # one per new token, when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    """A request's news since its last pop: only samples with news are listed. `final` is set
    once every sample has finished: the same dict generate() returns for that prompt."""
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleDelta]
    finished: bool
    final: dict | None
    # Set on the final output of a request the engine failed: a message for its client (no
    # exception text; the server log has the traceback under the request id). None otherwise.
    error: str | None = None
    # vLLM's prompt_logprobs (see prompt_logprobs_output), on the first output after the prompt is
    # computed, when the request asked for them; None otherwise.
    prompt_logprobs: list[dict | None] | None = None


class Request:
    """One prompt of a call (or of add_request) and its n samples; sample i is seqs[i]."""

    def __init__(self, index: int, prompt_token_ids: list[int], params: SamplingParams, seqs: list[Sequence],
                 request_id: str | None, inbox: dict[str, None]):
        self.index = index  # its position in the call that made it
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        self.request_id = request_id  # None until the engine registers it
        # The ordered set its news is reported into: the engine's (for add_request) or its call's.
        self.inbox = inbox
        self.num_tokens_handed = [0] * len(seqs)  # completion tokens already popped, per sample
        self.num_logprobs_handed = [0] * len(seqs)
        self.finish_handed = [False] * len(seqs)
        self.prompt_logprobs_handed = False
        self.error: str | None = None  # set when the engine failed this request (a client-safe message)
        self.fault: Exception | None = None  # what building it raised: it fails as soon as it is submitted

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(...): generate() asks this of each request every step
            if not seq.is_finished:
                return False
        return True

    def pop(self, tokenizer: PreTrainedTokenizerBase | None) -> RequestOutput:
        """The news since the last pop; once finished, with the final output (built first, so a
        fault there leaves nothing handed out and the engine can build the error output instead)."""
        finished = self.finished
        final = self.final_output(tokenizer) if finished else None
        samples = []
        for i, seq in enumerate(self.seqs):
            start = seq.num_prompt_tokens + self.num_tokens_handed[i]
            new_tokens = seq.token_ids[start:seq.num_known_tokens]
            finished_now = seq.is_finished and not self.finish_handed[i]
            if not new_tokens and not finished_now:
                continue
            self.num_tokens_handed[i] += len(new_tokens)
            self.finish_handed[i] = seq.is_finished
            logprobs = [lp._asdict() for lp in seq.logprobs[self.num_logprobs_handed[i]:]]
            self.num_logprobs_handed[i] = len(seq.logprobs)
            failed = self.error is not None  # its text stays what was streamed: the detokenizer may be what failed
            text = seq.detokenizer.stream_delta(seq.is_finished) if seq.detokenizer is not None and not failed else ""
            samples.append(SampleDelta(i, new_tokens, text, logprobs, seq.is_finished,
                                       "abort" if failed and seq.is_finished else seq.finish_reason,
                                       None if failed else seq.stop_reason))
        prompt_logprobs = None
        first = self.seqs[0]
        if first.prompt_logprobs is not None and not self.prompt_logprobs_handed and samples and (
                not first.needs_prompt_logprobs or finished):
            self.prompt_logprobs_handed = True
            prompt_logprobs = prompt_logprobs_output(first, tokenizer)
        return RequestOutput(self.request_id, self.prompt_token_ids, samples, finished, final,
                             self.error if finished else None, prompt_logprobs)

    def final_output(self, tokenizer: PreTrainedTokenizerBase | None) -> dict:
        """generate()'s dict for this prompt: sample 0's fields at the top, every sample under
        "outputs" when n > 1; a failed request's has "error" too, and every sample's finish_reason
        is "abort" (the request failed as a whole)."""
        samples = [_sample_output(seq, tokenizer, self.error is not None) for seq in self.seqs]
        out = {**samples[0], "prompt_token_ids": self.prompt_token_ids}
        if self.params.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs_output(self.seqs[0], tokenizer)
        if len(samples) > 1:
            out["outputs"] = samples
        if self.error is not None:
            out["error"] = self.error
        return out


def _sample_output(seq: Sequence, tokenizer: PreTrainedTokenizerBase | None, failed: bool = False) -> dict:
    params = seq.sampling_params
    text = ""
    try:
        if seq.detokenizer is not None:
            text = seq.detokenizer.final_text()
        elif tokenizer is not None:  # None: skip_tokenizer_init, token ids only
            text = decode_after(tokenizer, seq.prompt_token_ids, seq.completion_token_ids, params.skip_special_tokens)
    except Exception:
        if not failed:
            raise  # the engine fails the request (LLMEngine._final), which builds this again
        logger.warning("request %s: its text could not be decoded; its failed output has none", seq.request_id)
    out = {
        "text": text,
        "token_ids": seq.completion_token_ids,
        "finish_reason": "abort" if failed else seq.finish_reason,
        "stop_reason": None if failed else seq.stop_reason,
        "num_cached_tokens": seq.num_cached_tokens,
    }
    if params.logprobs is not None:
        out["logprobs"] = [lp._asdict() for lp in seq.logprobs]
    return out


def prompt_logprobs_output(seq: Sequence, tokenizer: PreTrainedTokenizerBase | None) -> list[dict | None]:
    """vLLM's prompt_logprobs: one entry per prompt token, None for the first (nothing scores it);
    each a dict token id -> {"logprob", "rank", "decoded_token"} holding the prompt token itself,
    then the top-N (ranks 1..N). Shorter when the request ended before its prompt was computed
    (it failed or was aborted)."""
    decoded: dict[int, str | None] = {}

    def info(token_id: int, logprob: float, rank: int) -> dict:
        if token_id not in decoded:
            decoded[token_id] = tokenizer.decode([token_id]) if tokenizer is not None else None
        return {"logprob": logprob, "rank": rank, "decoded_token": decoded[token_id]}

    out: list[dict | None] = [None]
    for entry in seq.prompt_logprobs or ():
        position = {entry.token_id: info(entry.token_id, entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top_logprobs.items(), 1):
            position.setdefault(token_id, info(token_id, logprob, rank))
        out.append(position)
    return out
