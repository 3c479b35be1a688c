"""Every live request by id, their news, and the one owner of their outputs.

The table registers built requests and queues their samples in the scheduler, keeps the one
ordered set of requests with news not yet popped, hands out their outputs (a pop, the final
output), and forgets them. A fault fails its request alone, by construction: whatever raises
while one request is built, scheduled, sampled, stop-checked or run fails that request (the
scheduler finishes its samples with finish_reason "abort" and frees their blocks, and returns
the fault, `Scheduler.take_failed`); the table reports it: its final output carries `error`, a
message for its caller, and the traceback goes to the log under its request id. Every other
request goes on as if it had never been there. It knows nothing of steps or the model.
"""
import logging
from itertools import count

from transformers import PreTrainedTokenizerBase

from nanovllm.engine.outputs import RequestDelta
from nanovllm.engine.request import Request
from nanovllm.scheduling.scheduler import Scheduler, SequenceFault
from nanovllm.utils.validation import ParamError

logger = logging.getLogger("nanovllm")

# What the caller of a failed request is told: no exception text, which may hold paths or data.
FAILED_MESSAGE = ("request {request_id} failed: an internal error while {phase}; it was aborted and the engine "
                  "goes on serving (the server log has the details under this request id)")
# A fault the request's own input causes on the way (a ParamError: a constraint its tokenizer
# cannot spell), whose message is written for the client.
REFUSED_MESSAGE = "request {request_id} failed: {error}"
BUILDING = "building it (tokenization, detokenizer)"
OUTPUT = "building its output (detokenization)"


class RequestTable:

    def __init__(self, scheduler: Scheduler, tokenizer: PreTrainedTokenizerBase | None,
                 enable_prefix_caching: bool):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.enable_prefix_caching = enable_prefix_caching
        self.requests: dict[str, Request] = {}  # every live request, whoever made it
        self.news: dict[str, None] = {}  # live requests with news not yet popped (an ordered set)
        # Live requests whose sampling reads their output tokens' values on the host (penalties):
        # while any is live, every step waits for its tokens (the plain loop).
        self.num_plain_only = 0
        self._ids = count()

    def _new_id(self) -> str:
        while True:
            request_id = str(next(self._ids))
            if request_id not in self.requests:  # a caller may have chosen this one
                return request_id

    def submit(self, requests: list[Request]) -> None:
        """Register built requests (giving each without one an id) and queue their samples."""
        for request in requests:
            if request.request_id is None:
                request.request_id = self._new_id()
            self.requests[request.request_id] = request
            self.num_plain_only += request.params.reads_output_tokens
            first, *others = request.seqs
            for seq in request.seqs:
                seq.request_id = request.request_id
            if request.fault is not None:  # building it raised: it is failed (its samples finished), never queued
                self._report(request, BUILDING, request.fault)
                continue
            self.scheduler.add(first)
            # The other samples follow once the prompt is computed: so they hit its cached blocks,
            # and none gets a token before sample 0 has the prompt's logprobs.
            if self.enable_prefix_caching or request.params.prompt_logprobs is not None:
                first.pending_siblings = others
            else:
                for seq in others:
                    self.scheduler.add(seq)

    def unregister(self, request: Request) -> None:
        del self.requests[request.request_id]
        self.num_plain_only -= request.params.reads_output_tokens

    def report_failed(self, failed: list[SequenceFault]) -> None:
        """Report the requests of the sequences the scheduler failed (a bare sequence, a
        benchmark's, has no request to tell)."""
        for fault in failed:
            request = self.requests.get(fault.seq.request_id)
            if request is not None:
                self._report(request, fault.phase, fault.error)

    def _report(self, request: Request, phase: str, error: Exception | None) -> None:
        """A failed request: its final output carries an error message, its caller is told.
        `error` is logged with its traceback under the request id (None: logged already)."""
        if request.error is None and isinstance(error, ParamError):
            request.error = REFUSED_MESSAGE.format(request_id=request.request_id, error=error)
            logger.warning("%s", request.error)
        elif request.error is None:
            request.error = FAILED_MESSAGE.format(request_id=request.request_id, phase=phase)
            if error is not None:
                logger.error("request %s failed while %s; aborting it alone", request.request_id, phase,
                             exc_info=error)
        self.news[request.request_id] = None

    def _fail(self, request: Request, exc: Exception) -> None:
        """Building a request's output raised: it fails (what is unfinished of it aborted)."""
        self.scheduler.abort([seq for seq in request.seqs if not seq.is_finished])
        self._report(request, OUTPUT, exc)

    def pop(self, request: Request) -> RequestDelta:
        """request.pop(); if building the output raises, the request fails alone and its error
        output is built instead (without the detokenizer)."""
        try:
            return request.pop(self.tokenizer)
        except Exception as exc:
            self._fail(request, exc)
            self.news.pop(request.request_id, None)  # this very pop reports it
            return request.pop(self.tokenizer)
