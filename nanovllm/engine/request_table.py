"""Every live request by id, and failing one alone.

The table registers built requests and queues their samples in the scheduler, hands out their
outputs (a pop, the final output), and forgets them. A fault fails its request alone, by
construction: whatever raises while one request is built, scheduled, sampled, stop-checked or
turned into output fails that request (its samples finish with finish_reason "abort", its
blocks are freed, its final output carries `error`, a message for its caller; the traceback
goes to the log under its request id), and every other request goes on as if it had never been
there. It knows nothing of steps or the model: the engine tells it which sequences failed.
"""
import logging
from itertools import count

from transformers import PreTrainedTokenizerBase

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.engine.outputs import RequestDelta, RequestOutput
from nanovllm.engine.request import Request
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.scheduling.sequence import Sequence
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

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, tokenizer: PreTrainedTokenizerBase | None,
                 enable_prefix_caching: bool):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.tokenizer = tokenizer
        self.enable_prefix_caching = enable_prefix_caching
        self.requests: dict[str, Request] = {}  # every live request, whoever made it
        self.news: dict[str, None] = {}  # add_requests()'s requests with news not yet popped (an ordered set)
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
            if request.fault is not None:  # building it raised: it is failed, never queued
                self.fail(request, BUILDING, request.fault)
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

    def fail(self, request: Request, phase: str, error: Exception | None) -> None:
        """Fail one request: its unfinished samples finish with "abort" (blocks freed at once), its
        final output carries `error`, its caller is told. `error` is logged with its traceback
        under the request id (None: the caller logged it already)."""
        if request.error is None and isinstance(error, ParamError):
            request.error = REFUSED_MESSAGE.format(request_id=request.request_id, error=error)
            logger.warning("%s", request.error)
        elif request.error is None:
            request.error = FAILED_MESSAGE.format(request_id=request.request_id, phase=phase)
            if error is not None:
                logger.error("request %s failed while %s; aborting it alone", request.request_id, phase,
                             exc_info=error)
        unfinished = [seq for seq in request.seqs if not seq.is_finished]
        if unfinished:
            self.scheduler.abort(unfinished)
        request.inbox[request.request_id] = None

    def settle_faults(self) -> None:
        """Fail the requests of the sequences the scheduler failed alone (their other samples too)."""
        if not self.scheduler.faults:
            return
        for fault in self.scheduler.take_faults():
            request = self.requests.get(fault.seq.request_id)
            if request is not None:  # a bare sequence (a benchmark's) is finished already
                self.fail(request, fault.phase, fault.error)
        self.scheduler.drop_finished()

    def fail_seqs(self, error: Exception, seqs: list[Sequence], phase: str) -> None:
        """Fail the requests these sequences belong to (bare sequences are aborted), logging the
        error once. Blocks only they hold leave the prefix cache first: their K/V may never have
        been written."""
        seqs = [seq for seq in seqs if not seq.is_finished]  # one that finished normally keeps its output
        requests = {seq.request_id: self.requests.get(seq.request_id) for seq in seqs}
        logger.error("a fault while %s fails %d request(s): %s", phase, len(requests),
                     ", ".join(map(str, list(requests)[:20])), exc_info=error)
        self.block_manager.unpublish(seqs)
        for request in requests.values():
            if request is not None:
                self.fail(request, phase, None)
        self.scheduler.abort([seq for seq in seqs if not seq.is_finished])
        self.settle_faults()  # sequences failed alone before this: their requests fail too

    def pop(self, request: Request) -> RequestDelta:
        """request.pop(); if building the output raises, the request fails alone and its error
        output is built instead (without the detokenizer)."""
        try:
            return request.pop(self.tokenizer)
        except Exception as exc:
            self.fail(request, OUTPUT, exc)
            request.inbox.pop(request.request_id, None)  # this very pop reports it
            return request.pop(self.tokenizer)

    def final(self, request: Request) -> RequestOutput:
        """request.final_output(), failing the request alone if building it raises."""
        try:
            return request.final_output(self.tokenizer)
        except Exception as exc:
            self.fail(request, OUTPUT, exc)
            return request.final_output(self.tokenizer)
