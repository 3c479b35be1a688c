"""The engine loop: one background thread owns an LLMEngine; asyncio code talks to it through a queue.

`EngineClient` is the asyncio side. `add()` validates and queues a call's prompts (all or none),
refusing them with `QueueFullError` when too many requests already wait for their first token;
the returned `Submission` yields their `RequestDelta`s as they come (the last one's `final` is
the request's typed `RequestOutput`). `abort()` stops requests.

The thread is the only caller of the engine (it refuses a second thread anyway). It sleeps on its
command queue while the engine is idle, so an idle server burns no CPU; while requests run it
drains the queue between steps. Outputs go back once per step, in one `call_soon_threadsafe`
that puts each on its request's asyncio.Queue, so no coroutine ever polls. It also feeds the
engine-side metrics. It knows nothing of HTTP or the OpenAI format.

The thread never dies of one request's fault: the engine fails such a request alone (its final
output carries `error`), and should `engine.step()` itself raise, the requests live then get a
failed final output and the loop serves on. Only MAX_CONSECUTIVE_STEP_FAILURES failed steps in a
row (an engine that cannot step at all) stop it; `is_serving` is False from then on, as it is
from the start of a shutdown (`begin_shutdown`, which also aborts every live request).
"""
import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, NamedTuple

from nanovllm.config import Config
from nanovllm.llm_engine import LLMEngine
from nanovllm.engine.outputs import CompletionOutput, RequestDelta, RequestOutput, SampleDelta
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs import GrammarCompiler
from nanovllm.utils.validation import ParamError

logger = logging.getLogger("nanovllm")

Prompt = str | list[int]

# engine.step() raising this many times in a row means the engine cannot step at all (each
# failure already failed every live request): the loop stops, and the server reports unhealthy.
MAX_CONSECUTIVE_STEP_FAILURES = 3
STEP_FAILED_MESSAGE = ("request {request_id} failed: an internal error in the engine's step; it was aborted and "
                       "the server goes on (the server log has the details under this request id)")
ADD_FAILED_MESSAGE = "an internal error while queueing the request; it was not queued (the server log has details)"


class QueueFullError(Exception):
    """More requests wait for their first token than the server allows; retry later."""


class EngineDeadError(Exception):
    """The engine loop stopped (a step raised, or the server is shutting down)."""


class _Add(NamedTuple):
    requests: list[tuple[str, Prompt, SamplingParams]]  # (request id, prompt, params): all or none
    accepted: asyncio.Future  # set to None, or to the ValueError that refused the call
    arrival: float  # time.monotonic() when the call came in, for time-to-first-token
    priority: int = 0  # the scheduler's: lower runs first


class _Abort(NamedTuple):
    request_ids: list[str]


class _Stop(NamedTuple):
    pass


class _AbortAll(NamedTuple):
    """Abort every live request (a shutdown's grace period is ending)."""


@dataclass
class _Timing:
    """What the loop thread remembers of a live request, for the latency histograms."""
    arrival: float
    n: int = 1  # its samples, for an error output made without the engine
    last_token: float | None = None  # None until its first token


class Submission:
    """The prompts of one add() call as its HTTP handler sees them: their outputs, in the order
    they come, until every one has finished. Prompt i is request `request_ids[i]`."""

    def __init__(self, request_ids: list[str], n: int):
        self.request_ids = request_ids
        self.n = n  # samples per prompt: each holds n queue places until its first output
        self.outputs: asyncio.Queue = asyncio.Queue()  # RequestDelta, or the error that ended the loop
        self.unstarted = set(request_ids)  # no output yet (the engine loop side's bookkeeping)
        self.unfinished = set(request_ids)  # no final output yet (the consumer's bookkeeping)

    def index(self, request_id: str) -> int:
        return self.request_ids.index(request_id)

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        while self.unfinished:
            item = await self.outputs.get()
            if isinstance(item, BaseException):
                self.unfinished.clear()
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item


class EngineClient:
    """Runs an engine in a thread of its own and lets coroutines use it.

    `build_engine` is called in that thread (the engine is made and used by one thread only).
    `max_queue_len` bounds the sequences accepted but not yet producing tokens.
    """

    def __init__(self, build_engine: Callable[[], LLMEngine], max_queue_len: int,
                 metrics: ServerMetrics | None = None):
        if not isinstance(max_queue_len, int) or max_queue_len < 1:
            raise ValueError(f"max_queue_len={max_queue_len!r} is not allowed; it must be an integer >= 1")
        self._build_engine = build_engine
        self.max_queue_len = max_queue_len
        self.metrics = metrics or ServerMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Held to put a command, and by the loop thread to close the inbox when it stops: a
        # command is either taken by the loop or refused, never left unanswered.
        self._inbox_lock = threading.Lock()
        self._inbox_closed = False
        self._submissions: dict[str, Submission] = {}  # by live request id; touched by the event loop only
        self._num_queued = 0  # sequences accepted whose request has had no output yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self.shutting_down = False  # set by begin_shutdown(): every request is aborted, new ones refused
        self.config: Config | None = None  # the engine's, once started (read-only from here on)
        self.cache_capacity_tokens = 0  # tokens the whole KV cache holds, once started
        self.grammars: GrammarCompiler | None = None  # the engine's structured-outputs compiler, once started

    # --- lifetime ---

    async def start(self) -> None:
        """Start the loop thread and wait until its engine is built (re-raising what building raised)."""
        self._loop = asyncio.get_running_loop()
        ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="nanovllm-engine-loop", daemon=True)
        self._thread.start()
        await ready

    async def shutdown(self) -> None:
        """Abort whatever is still running, free the engine and stop the thread."""
        if self._thread is None:
            return
        self._send(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the live ones now (their final outputs, finish_reason
        "abort", still arrive): what a shutdown does before its grace period runs out."""
        self.shutting_down = True
        self._send(_AbortAll())

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._inbox_closed

    @property
    def is_serving(self) -> bool:
        """Whether a new request can be served: the loop runs and no shutdown has begun."""
        return self.is_running and not self.shutting_down

    @property
    def num_queued(self) -> int:
        return self._num_queued

    # --- requests (called on the event loop) ---

    async def add(self, prompts: list[Prompt], params: SamplingParams, request_id: str,
                  priority: int = 0) -> Submission:
        """Queue the prompts (request ids `{request_id}-{i}`), once the engine has accepted all of
        them. Raises ValueError if it refused one (then none is queued; a ParamError names the
        field), QueueFullError if the queue is full, EngineDeadError if the loop has stopped."""
        if self.shutting_down:
            raise EngineDeadError("the server is shutting down")
        weight = len(prompts) * params.n
        if weight > self.max_queue_len:
            raise ParamError("n", f"n={params.n} samples of {len(prompts)} prompt(s) make {weight} sequences, "
                             f"more than this server queues at once (max_queue_len={self.max_queue_len}); send fewer")
        if self._num_queued + weight > self.max_queue_len:
            raise QueueFullError(f"the server's queue is full ({self._num_queued} of {self.max_queue_len} sequences "
                                 "wait for their first token); retry later")
        submission = Submission([f"{request_id}-{i}" for i in range(len(prompts))], params.n)
        accepted = self._loop.create_future()
        if not self._send(_Add(list(zip(submission.request_ids, prompts, [params] * len(prompts))), accepted,
                               time.monotonic(), priority)):
            raise EngineDeadError("the engine is not running") from self._dead
        # Registered before this coroutine yields, so before any output can be delivered.
        for rid in submission.request_ids:
            self._submissions[rid] = submission
        self._num_queued += weight
        try:
            await accepted
        except BaseException:  # refused, or the caller was cancelled while waiting
            self.abort(submission.request_ids)
            for rid in submission.request_ids:
                self._release(rid)
                self._submissions.pop(rid, None)
            raise
        return submission

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (unknown or finished ones are ignored); their final outputs, with
        finish_reason "abort", still arrive."""
        if request_ids:
            self._send(_Abort(list(request_ids)))

    def _send(self, command: "_Add | _Abort | _AbortAll | _Stop") -> bool:
        """Put a command in the loop's inbox; False if the loop has stopped taking commands."""
        with self._inbox_lock:
            if self._thread is None or self._inbox_closed:
                return False
            self._inbox.put(command)
            return True

    def _release(self, request_id: str) -> None:
        """Give back a request's queue places (once): it has started, or will never start."""
        submission = self._submissions.get(request_id)
        if submission is not None and request_id in submission.unstarted:
            submission.unstarted.discard(request_id)
            self._num_queued -= submission.n

    def _deliver(self, items: list[tuple[str, RequestDelta | BaseException]]) -> None:
        """On the event loop: hand each output to its submission (called once per engine step)."""
        for request_id, item in items:
            submission = self._submissions.get(request_id)
            if submission is None:  # its handler gave up on it (refused or cancelled)
                continue
            self._release(request_id)
            submission.outputs.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                del self._submissions[request_id]

    def _post(self, callback: Callable, *args) -> None:
        """From the loop thread: run callback(*args) on the event loop (dropped if it has closed)."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    # --- the loop thread ---

    def _run(self, ready: asyncio.Future) -> None:
        engine = None
        try:
            engine = self._build_engine()
            self.config = engine.config
            self.cache_capacity_tokens = engine.block_manager.num_blocks * engine.config.kvcache_block_size
            self.grammars = engine.grammars
            self.metrics.observe_engine(engine.stats())  # every metric shows from the start
        except BaseException as exc:  # handed to start(), which re-raises it
            self._dead = exc
            if engine is not None:  # freed before start() hears of it
                try:
                    engine.exit()
                except Exception:
                    logger.exception("exiting the engine after its failed start-up failed too")
            self._close_inbox([], exc)
            self._post(_settle, ready, exc)
            return
        try:  # here, in the tokenizer's own thread: the prompt thread then only compiles
            engine.grammars.load()
        except Exception:  # a vocabulary xgrammar cannot read: each constrained request is refused with why
            logger.warning("structured outputs are unavailable for this tokenizer", exc_info=True)
        self._post(_settle, ready, None)
        live: dict[str, _Timing] = {}
        try:
            self._serve(engine, live)
        except BaseException as exc:
            logger.exception("the engine loop stopped on an error; failing every live request")
            self._dead = exc
            error = EngineDeadError("the engine loop stopped on an internal error (the server log has details)")
            self._close_inbox([], error)  # first: whoever sees the error finds the client stopped
            self._post(self._deliver, [(request_id, error) for request_id in live])
        finally:
            engine.exit()

    def _serve(self, engine: LLMEngine, live: dict[str, _Timing]) -> None:
        failures = 0  # consecutive steps that raised
        while True:
            # Idle: sleep until a command comes. Busy: take what has come, then step.
            commands = [] if engine.has_unfinished_requests() else [self._inbox.get()]
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            outputs: list[tuple[str, RequestDelta]] = []
            for i, command in enumerate(commands):
                if isinstance(command, _Stop):
                    self._abort(engine, list(live), outputs, live)
                    self._post(self._deliver, outputs)
                    self._close_inbox(commands[i + 1:], EngineDeadError("the server is shutting down"))
                    return
                if isinstance(command, _Add):
                    self._accept(engine, command, live)
                else:
                    self._abort(engine, list(live) if isinstance(command, _AbortAll) else command.request_ids,
                                outputs, live)
            # A step after an add, even with nothing to run: a request failed as it was built has news.
            if engine.has_unfinished_requests() or any(isinstance(c, _Add) for c in commands):
                try:
                    step = engine.step()
                    for request_id in step.request_ids:
                        if request_id in live:  # not one a failed step already ended
                            outputs.append((request_id, engine.pop_output(request_id)))
                    failures = 0
                except Exception as exc:
                    failures += 1
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise
                    logger.exception("an engine step failed; failing the %d live request(s), serving on", len(live))
                    self._fail_live(engine, live, outputs, exc)
            self._observe(engine, outputs, live)
            if outputs:
                self._post(self._deliver, outputs)

    def _accept(self, engine: LLMEngine, command: _Add, live: dict[str, _Timing]) -> None:
        request_ids, prompts, params = zip(*command.requests)
        try:  # all or none: the engine checks and builds every prompt before it queues any
            engine.add_requests(list(prompts), list(params), request_ids=list(request_ids),
                                priority=[command.priority] * len(prompts))
        except Exception as exc:
            if not isinstance(exc, ValueError):  # not bad input (that is the caller's 400): a fault
                logger.exception("queueing requests %s failed", ", ".join(request_ids))
                exc = RuntimeError(ADD_FAILED_MESSAGE)
            self._post(_settle, command.accepted, exc)
            return
        for request_id, _, sampling_params in command.requests:
            live[request_id] = _Timing(command.arrival, sampling_params.n)
        self._post(_settle, command.accepted, None)

    def _fail_live(self, engine: LLMEngine, live: dict[str, _Timing], outputs: list, error: Exception) -> None:
        """engine.step() raised: every live request ends now, with an error output."""
        done = {request_id for request_id, output in outputs if output.finished}
        for request_id in list(live):
            if request_id in done:
                continue
            output = None
            try:
                engine.abort(request_id)
                output = engine.pop_output(request_id)
            except Exception:
                logger.exception("request %s could not be aborted; its caller gets an error output", request_id)
            if output is None or not output.finished:
                message = STEP_FAILED_MESSAGE.format(request_id=request_id)
                output = failed_output(request_id, live[request_id].n, message)
            elif output.error is None:
                output.final.error = STEP_FAILED_MESSAGE.format(request_id=request_id)
            outputs.append((request_id, output))

    def _abort(self, engine: LLMEngine, request_ids: list[str], outputs: list, live: dict[str, _Timing]) -> None:
        for request_id in request_ids:
            if request_id in live and engine.abort(request_id):
                outputs.append((request_id, engine.pop_output(request_id)))

    def _close_inbox(self, taken: list, error: BaseException) -> None:
        """Take no more commands, and refuse the calls among those taken but not done and those
        still in the inbox."""
        with self._inbox_lock:
            self._inbox_closed = True
        while True:
            try:
                taken.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for command in taken:
            if isinstance(command, _Add):
                self._post(_settle, command.accepted, error)

    def _observe(self, engine: LLMEngine, outputs: list[tuple[str, RequestDelta]], live: dict[str, _Timing]) -> None:
        """Update the metrics with this iteration's outputs and the engine's state."""
        m = self.metrics
        now = time.monotonic()
        for request_id, output in outputs:
            timing = live[request_id]
            num_new = sum(len(sample.token_ids) for sample in output.samples)
            if num_new:
                m.generation_tokens.inc(num_new)
                if timing.last_token is None:
                    m.prompt_tokens.inc(len(output.prompt_token_ids))
                    m.time_to_first_token.observe(now - timing.arrival)
                else:
                    m.time_per_output_token.observe(now - timing.last_token)
                timing.last_token = now
            for sample in output.samples:
                if sample.finished:
                    m.requests_finished.labels(sample.finish_reason).inc()
            if output.finished:
                m.e2e_request_latency.observe(now - timing.arrival)
                del live[request_id]
        m.observe_engine(engine.stats())


def failed_output(request_id: str, n: int, error: str) -> RequestDelta:
    """A failed request's final output made without the engine: n aborted samples, no tokens."""
    samples = [SampleDelta(j, [], "", [], True, "abort", None) for j in range(n)]
    final = RequestOutput(request_id, None, [], None, [CompletionOutput(j, "", [], None, None, "abort", None)
                                                        for j in range(n)], True, error)
    return RequestDelta(request_id, [], samples, True, final)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # its waiter may have been cancelled
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
