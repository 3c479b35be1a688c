"""One request as its caller sees it: a prompt, its n samples (sequences) and what of their
output the caller has already been handed.

Whoever drives a step, each sequence's new tokens land on the sequence itself; `Request.pop`
hands the caller what is new since the last pop (a RequestDelta), so every caller gets exactly
its own requests' output. It also builds the request's final RequestOutput (engine/outputs.py).
It knows nothing of scheduling or tensors.

A request the engine failed (a fault while building, scheduling, running or finishing it; see
engine/request_table.py) carries `error`, a message meant for its client: its samples end with
finish_reason "abort", its final output carries the error and its text is built without the
detokenizer (which may be what failed). Normal outputs keep their exact shape.
"""
import logging

from transformers import PreTrainedTokenizerBase

from nanovllm.engine.detokenizer import decode_after
from nanovllm.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, SampleDelta
from nanovllm.scheduling.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


class Request:
    """One prompt of a call (or of add_requests) and its n samples; sample i is seqs[i]."""

    def __init__(self, index: int, prompt_token_ids: list[int], params: SamplingParams, seqs: list[Sequence],
                 request_id: str | None, prompt: str | None = None,
                 text_tokenizer=None):
        self.index = index  # its position in the call that made it
        self.prompt = prompt  # its text, when it was given as text
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = seqs
        Sequence.link_samples(seqs)
        self.request_id = request_id  # None until the engine registers it
        self.online = False  # made by add_requests(): the online API (step, pop_output) sees it
        self.num_tokens_handed = [0] * len(seqs)  # completion tokens already popped, per sample
        self.num_logprobs_handed = [0] * len(seqs)
        self.finish_handed = [False] * len(seqs)
        self.prompt_logprobs_handed = False
        self.error: str | None = None  # set when the engine failed this request (a client-safe message)
        self.fault: Exception | None = None  # what building it raised: it fails as soon as it is submitted
        # What decodes its samples' text, when not the engine's tokenizer (structured outputs over
        # a WordPiece vocabulary: structured_outputs/wordpiece.py).
        self.text_tokenizer = text_tokenizer

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # a loop, not all(...): generate() asks this of each request every step
            if not seq.is_finished:
                return False
        return True

    def pop(self, tokenizer: PreTrainedTokenizerBase | None) -> RequestDelta:
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
        return RequestDelta(self.request_id, self.prompt_token_ids, samples, finished, final, prompt_logprobs)

    def final_output(self, tokenizer: PreTrainedTokenizerBase | None) -> RequestOutput:
        """This request's RequestOutput, once finished; a failed request's carries `error`, and
        every sample's finish_reason is "abort" (the request failed as a whole)."""
        failed = self.error is not None
        samples = [_completion(i, seq, self.text_tokenizer or tokenizer, failed) for i, seq in enumerate(self.seqs)]
        prompt_logprobs = prompt_logprobs_output(self.seqs[0], tokenizer) if self.params.prompt_logprobs is not None \
            else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_logprobs, samples, True,
                             self.error)


def _completion(index: int, seq: Sequence, tokenizer: PreTrainedTokenizerBase | None, failed: bool) -> CompletionOutput:
    params = seq.sampling_params
    text = ""
    try:
        if seq.detokenizer is not None:
            text = seq.detokenizer.final_text()
        elif tokenizer is not None:  # None: skip_tokenizer_init, token ids only
            text = decode_after(tokenizer, seq.prompt_token_ids, seq.completion_token_ids, params.skip_special_tokens)
    except Exception:
        if not failed:
            raise  # the engine fails the request (RequestTable.final), which builds this again
        logger.warning("request %s: its text could not be decoded; its failed output has none", seq.request_id)
    logprobs = None if params.logprobs is None else [lp._asdict() for lp in seq.logprobs]
    cumulative = None if logprobs is None else sum(lp["logprob"] for lp in logprobs)
    return CompletionOutput(index, text, seq.completion_token_ids, cumulative, logprobs,
                            "abort" if failed else seq.finish_reason, None if failed else seq.stop_reason,
                            seq.num_cached_tokens)


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
