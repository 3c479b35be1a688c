"""The engine: takes requests, steps the scheduler and the model runner, and routes every
sequence's output to the request it belongs to. The offline API (generate/stream/chat) is
`LLM`, in nanovllm/llm.py, on top of it.

Its parts: `engine/request_builder.py` checks and builds a call's requests (every call is
checked in full before any of it is queued, so bad input raises a clear ValueError and leaves
the engine as it was); `engine/request_table.py` registers them, owns their news and reports
their outputs (a failed request's included); `engine/stats.py` keeps the counters.

`run()` is the one driver of the request lifecycle, shared by `LLM`'s calls, the server's
engine loop and batch jobs: it steps the engine and yields each step's outputs of the requests
its caller drives, with one fault policy. A request that fails (a fault in its own work) is
reported alone, as its final output carrying `error`; a step that fails fails that step's
requests (EngineCore) and the engine serves on; a step that raises (an engine that could not
step) fails the caller's live requests, and after `max_step_failures` such steps in a row the
error is raised. News of every request goes into one ordered set, and each caller pops only its
own requests' news, so calls may interleave in one thread and each gets exactly what it would
get alone. The online API (add_requests / step / pop_output / abort) sees only the requests
made by add_requests().

The engine is single-threaded: a call from a second thread while one thread is inside it is
refused with a RuntimeError (a server drives it from one engine loop). Its only exit hook
(weakref.finalize) holds the model runner, not the engine, so a dropped engine is freed by the
garbage collector; exit() (or leaving `with LLM(...) as llm:`) frees it at once.
"""
import logging
import threading
import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Collection, Iterator

from nanovllm.config import Config
from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.engine.engine_core import EngineCore, StepOutput
from nanovllm.engine.outputs import RequestDelta, failed_output
from nanovllm.engine.request import Request
from nanovllm.engine.request_builder import Prompt, RequestBuilder
from nanovllm.engine.request_table import RequestTable
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.engine.stats import EngineStats, engine_stats, log_speculation
from nanovllm.scheduling.stop_checker import StopChecker
from nanovllm.runner.protocol import Runner
from nanovllm.runner.tensor_parallel import create_model_runner
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs import GrammarCompiler

logger = logging.getLogger("nanovllm")

EXITED_MESSAGE = "this engine has exited (exit() was called); create a new LLM to generate again"
# What the caller of a request is told when a step raised while it was live (only a driver that
# serves on after such a step, the server's loop, ever tells it).
STEP_FAILED_MESSAGE = ("request {request_id} failed: an internal error in the engine's step; it was aborted and "
                       "the server goes on (the server log has the details under this request id)")


class LLMEngine:

    def __init__(self, model: str, **kwargs):
        config = Config.from_kwargs(model, kwargs)  # settings checked and resolved, tokenizer loaded
        self.config = config
        # None with skip_tokenizer_init: token-id prompts only, and outputs have empty text.
        self.tokenizer = config.tokenizer
        # Plain, tensor-parallel (spawns the other ranks) or speculative: the loop uses them alike.
        self.model_runner: Runner = create_model_runner(config)
        self.attention_backend: str = self.model_runner.attention_backend  # what "auto" chose
        # The one exit hook of the whole engine (tensor-parallel workers included). It holds the
        # runner, not the engine, so dropping the engine lets the garbage collector run it; it
        # also runs at interpreter exit if the engine is still alive then.
        self._finalizer = weakref.finalize(self, self.model_runner.exit)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, self.model_runner.num_swap_blocks)
        self.stop_checker = StopChecker(config.eos, config.max_model_len)
        # Speculative decoding: the runner proposes and verifies; the scheduler reserves the slots.
        self.speculative = config.speculative is not None
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager,
                                   self.stop_checker, config.scheduling_policy, config.preemption_mode,
                                   config.speculative.num_speculative_tokens if self.speculative else 0)
        # Compiles structured_outputs constraints (thread-safe and cached: the server compiles in its
        # prompt thread first, so building the request finds them compiled).
        self.grammars = GrammarCompiler(self.tokenizer, config.hf_config.vocab_size, config.eos)
        self._builder = RequestBuilder(self.tokenizer, config.hf_config.vocab_size, config.max_model_len,
                                       config.kvcache_block_size, self.block_manager.num_blocks, self.grammars)
        self._table = RequestTable(self.scheduler, self.tokenizer, config.enable_prefix_caching)
        self.core = EngineCore(config, self.scheduler, self.model_runner, self._table)
        self._requests = self._table.requests  # every live request, whoever made it
        self._news = self._table.news  # live requests with news not yet popped, whoever made them
        self._lock = threading.Lock()  # held by the thread inside the engine
        self._inside: str | None = None  # that thread's name, for the refusal message
        # Calls whose requests were released by a thread that could not enter; they are freed at
        # the next step or the next entry, whichever comes first.
        self._deferred: list[list[Request]] = []
        self._exited = False

    # --- lifetime and the single-thread rule ---

    def exit(self) -> None:
        """Free the model and the KV cache (and stop tensor-parallel workers) now. Idempotent;
        every later call raises RuntimeError."""
        if self._exited:
            return
        with self._entered():
            self._exited = True
            if self.speculative:
                log_speculation(self.scheduler.stats, self.config.speculative.method)
            self._finalizer()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit()

    @contextmanager
    def _entered(self) -> Iterator[None]:
        """Hold the engine for one call: refused once it has exited, or while another thread is inside."""
        if self._exited:
            raise RuntimeError(EXITED_MESSAGE)
        if not self._lock.acquire(blocking=False):
            inside = self._inside
            raise RuntimeError(f"the engine is single-threaded and another thread ({inside}) is inside it now; "
                               f"call it from one thread only (thread {threading.current_thread().name} was "
                               "refused). To serve many clients, let one engine loop own it, as the server in "
                               "nanovllm.entrypoints does")
        self._inside = threading.current_thread().name
        try:
            if self._exited:  # another thread exited it between the check above and the lock
                raise RuntimeError(EXITED_MESSAGE)
            self._free_deferred()
            yield
        finally:
            self._inside = None
            self._lock.release()

    # --- the online API: add_requests / step / pop_output / abort ---

    def add_requests(self, prompts: list[Prompt], sampling_params: SamplingParams | list[SamplingParams],
                     request_ids: list[str | None] | None = None, priority: list[int] | None = None) -> list[str]:
        """Check and queue prompts, all or none: every prompt is checked and built first, and if
        one is bad a ValueError names it (its index, the field) and none is queued. Returns their
        request ids (unique strings, or the ones given). Their outputs are read with pop_output()
        as step() reports news of them. Lower `priority` values (one int per prompt; None: all 0)
        are admitted first and preempted last (ties: earlier requests first), as vLLM."""
        with self._entered():
            requests = self._builder.build_all(prompts, sampling_params, deltas=True, priority=priority,
                                               request_ids=request_ids, live=self._requests)
            for request in requests:
                request.online = True
            try:
                self._table.submit(requests)
            except BaseException:  # an internal error part-way: take back what was queued
                self._forget(requests)
                raise
            return [request.request_id for request in requests]

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str | None = None,
                    priority: int = 0) -> str:
        """add_requests() of one prompt; returns its request id."""
        return self.add_requests([prompt], [sampling_params], [request_id], [priority])[0]

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks: its unfinished samples finish with finish_reason
        "abort", and its final output is still delivered by pop_output(). Returns whether it was
        running or waiting (False for an unknown or already finished request)."""
        with self._entered():
            return self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        request = self._requests.get(request_id) if isinstance(request_id, str) else None
        if request is None or request.finished:
            return False
        self.core.drain()  # an aborted sample keeps no placeholder, and gets no token after its abort
        self.scheduler.abort([seq for seq in request.seqs if not seq.is_finished])
        self._news[request_id] = None
        return True

    def pop_output(self, request_id: str) -> RequestDelta:
        """What is new in an add_requests() request since its last pop (new token ids, text and
        logprobs of the samples with news). Once `finished`, `final` holds its RequestOutput and
        the engine forgets the id."""
        with self._entered():
            request = self._requests.get(request_id) if isinstance(request_id, str) else None
            if request is None or not request.online:
                raise ValueError(f"request_id={request_id!r} is not a live request made by add_request() "
                                 "(unknown, or finished and already popped)")
            return self._pop(request_id)

    def _pop(self, request_id: str) -> RequestDelta:
        """A live request's news since its last pop; a finished one is forgotten."""
        request = self._requests[request_id]
        self._news.pop(request_id, None)
        output = self._table.pop(request)
        if output.finished:
            self._table.unregister(request)
        return output

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def stats(self) -> EngineStats:
        """The scheduler's counters, the queues' sizes, block use and inter-token latency, as a snapshot."""
        return engine_stats(self.scheduler, self.block_manager, self.core.itl)

    # --- releasing a call's requests ---

    def _forget(self, requests: list[Request]) -> None:
        """Abort what is unfinished of these requests (freeing their blocks at once) and forget
        them. The caller is inside the engine."""
        submitted = [r for r in requests if self._requests.get(r.request_id) is r]
        unfinished = [seq for r in submitted for seq in r.seqs if not seq.is_finished]
        if unfinished:
            self.core.drain()
            self.scheduler.abort([seq for seq in unfinished if not seq.is_finished])
        for request in submitted:
            self._table.unregister(request)
            self._news.pop(request.request_id, None)

    def _release(self, requests: list[Request]) -> None:
        """_forget() from a call that has ended (a stream closed, finished or dropped), which may
        happen while another thread is inside the engine: then that thread does it at its next step."""
        if not any(r.request_id is not None for r in requests):  # never submitted
            return
        if self._lock.acquire(blocking=False):
            try:
                self._forget(requests)
            finally:
                self._lock.release()
        else:
            self._deferred.append(requests)

    def _free_deferred(self) -> None:
        while self._deferred:
            self._forget(self._deferred.pop())

    # --- the step ---

    def step(self) -> StepOutput:
        """Run one scheduled batch; the scheduler advances its sequences and finishes those the
        stop checker says are done. Its `request_ids` are the add_requests() requests with news
        not yet popped (pop_output), in the order their news came."""
        with self._entered():
            step = self._step()
            return step._replace(request_ids=[rid for rid in step.request_ids if self._requests[rid].online])

    def _step(self) -> StepOutput:
        self._free_deferred()
        return self.core.step()

    # --- the driver: one request lifecycle for every caller ---

    def run(self, live: Collection[str], max_step_failures: int = 1) -> Iterator[list[RequestDelta]]:
        """Step the engine, yielding after each step the outputs (RequestDelta) of the requests in
        `live` (their ids: the caller adds the ones it submits and drops the finished ones as it
        goes) that have news; other requests' news stays for their own callers. A step that
        raises fails every request in `live` (its final output carries `error`) and the engine
        serves on; the `max_step_failures`-th such step in a row raises instead (an engine that
        cannot step). Each step holds the engine: other calls may come between items."""
        return self._drive(live, max_step_failures, self._entered)

    def _drive(self, live: Collection[str], max_step_failures: int,
               hold: Callable[[], AbstractContextManager] = nullcontext) -> Iterator[list[RequestDelta]]:
        """run(), each step inside `hold()` (nothing: the caller is inside the engine already)."""
        failures = 0
        while True:
            with hold():
                try:
                    outputs = [self._pop(rid) for rid in self._step().request_ids if rid in live]
                    failures = 0
                except Exception:
                    failures += 1
                    if failures >= max_step_failures:
                        raise
                    logger.exception("an engine step failed; failing the %d live request(s), serving on", len(live))
                    outputs = self._fail_live(live)
            yield outputs

    def _fail_live(self, live: Collection[str]) -> list[RequestDelta]:
        """A step raised: every live request ends now, with an error output (made without the
        engine when even aborting it fails)."""
        outputs = []
        for request_id in list(live):
            message = STEP_FAILED_MESSAGE.format(request_id=request_id)
            n, output = self._num_samples(request_id), None
            try:
                self._abort(request_id)
                output = self._pop(request_id)
            except Exception:
                logger.exception("request %s could not be aborted; its caller gets an error output", request_id)
            if output is None or not output.finished:
                output = failed_output(request_id, n, message)
            elif output.error is None:
                output.final.error = message
            outputs.append(output)
        return outputs

    def _num_samples(self, request_id: str) -> int:
        request = self._requests.get(request_id)
        return 1 if request is None else request.params.n
