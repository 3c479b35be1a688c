"""The engine loop: one loop owns an LLMEngine, in a process of its own (how `nanovllm serve` runs it,
as vLLM runs its engine core) or in a thread of the server's process; asyncio code talks to it
through commands and messages.

`EngineClient` is the asyncio side. `add()` validates and queues a call's prompts (all or none),
refusing them with `QueueFullError` when too many requests already wait for their first token;
the returned `Submission` yields their `RequestDelta`s as they come (the last one's `final` is
the request's typed `RequestOutput`). `abort()` stops requests. The client also feeds the
latency metrics, as each step's outputs arrive.

The loop (`run_engine_loop`) is the only caller of its engine (which refuses a second thread
anyway). It sleeps on its commands while the engine is idle, so an idle server burns no CPU; while
requests run it takes the commands that came between steps. Each step's outputs go back in one
message with the engine's stats, so no coroutine ever polls. It knows nothing of HTTP or the
OpenAI format. In a process of its own, the engine's steps never wait for the GIL while the
server parses requests, tokenizes prompts and writes streams (and the other way round):
commands and messages cross a pipe, pickled. In a thread (`engine_process=False`) they cross a
queue and `call_soon_threadsafe`; tests that patch the engine use that.

The loop drives the engine with its one driver, `LLMEngine.run`, and keeps only what is its own:
the commands, the idle sleep and the messages. It never dies of one request's fault: the engine
fails such a request alone (its final output carries `error`), and should a step itself raise,
the requests live then get a failed final output and the loop serves on. Only
MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row (an engine that cannot step at all) stop it,
as does an engine process that dies (killed,
out of memory): every live request then gets an `EngineDeadError`, and `is_serving` is False from
then on, as it is from the start of a shutdown (`begin_shutdown`, which also aborts every live
request). An engine process ignores SIGINT and SIGTERM (the server's shutdown stops it, with its
grace period) and stops when the server's end of the pipe closes.
"""
import asyncio
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import AsyncIterator, Callable, NamedTuple, Protocol

from nanovllm.config import Config
from nanovllm.engine.outputs import RequestDelta
from nanovllm.engine.stats import EngineStats
from nanovllm.entrypoints.openai.metrics import ServerMetrics
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request_builder import AdmittedPrompt
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_outputs import GrammarCompiler
from nanovllm.utils.validation import ParamError

logger = logging.getLogger("nanovllm")

Prompt = str | list[int] | AdmittedPrompt  # the server's are admitted: the engine builds them unchecked

# A step raising this many times in a row means the engine cannot step at all (each failure
# already failed every live request, LLMEngine.run): the loop stops, and the server reports unhealthy.
MAX_CONSECUTIVE_STEP_FAILURES = 3
ADD_FAILED_MESSAGE = "an internal error while queueing the request; it was not queued (the server log has details)"
LOOP_FAILED_MESSAGE = "the engine loop stopped on an internal error (the server log has details)"
# Seconds an engine process gets to exit once its loop has stopped (freeing the engine, its
# tensor-parallel workers among it) before it is killed.
PROCESS_EXIT_TIMEOUT_S = 30.0


class QueueFullError(Exception):
    """More requests wait for their first token than the server allows; retry later."""


class EngineDeadError(Exception):
    """The engine loop stopped (a step raised, its process died, or the server is shutting down)."""


# --- commands, from the client to the loop ---

class _Add(NamedTuple):
    requests: list[tuple[str, Prompt, SamplingParams]]  # (request id, prompt, params): all or none
    add_id: int  # the client's key for the answer (_Settled)
    priority: int = 0  # the scheduler's: lower runs first


class _Abort(NamedTuple):
    request_ids: list[str]


class _AbortAll(NamedTuple):
    """Abort every live request (a shutdown's grace period is ending)."""


class _Stop(NamedTuple):
    pass


# --- messages, from the loop to the client ---

class _Ready(NamedTuple):
    config: Config
    cache_capacity_tokens: int  # tokens the whole KV cache holds
    stats: EngineStats
    grammars: GrammarCompiler | None  # the engine's own, shared with a loop thread; None from a process


class _StartFailed(NamedTuple):
    error: BaseException


class _Settled(NamedTuple):
    add_id: int
    error: BaseException | None  # None: every prompt of the add was queued


class _Outputs(NamedTuple):
    """One loop iteration's outputs (a step's, and those of the aborts before it)."""
    items: list[tuple[str, RequestDelta]]
    stats: EngineStats


class _Stopped(NamedTuple):
    error: BaseException | None  # None after a _Stop; else what stopped the loop


class Submission:
    """The prompts of one add() call as its HTTP handler sees them: their outputs, in the order
    they come, until every one has finished. Prompt i is request `request_ids[i]`."""

    def __init__(self, request_ids: list[str], n: int):
        self.request_ids = request_ids
        self.n = n  # samples per prompt: each holds n queue places until its first output
        self.arrival = time.monotonic()  # when the call came in, for the latency histograms
        self.last_token: dict[str, float] = {}  # by request id: when its latest tokens arrived
        self.outputs: asyncio.Queue = asyncio.Queue()  # RequestDelta, or the error that ended the loop
        self.unstarted = set(request_ids)  # no output yet (the client's bookkeeping)
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
    """Runs an engine loop in a process (`engine_process=True`) or a thread of its own and lets
    coroutines use it.

    `build_engine` is called by the loop (the engine is made and used there only); for a process it
    must pickle (a class, or a functools.partial of one, as the server's `partial(LLM, model, ...)`).
    `max_queue_len` bounds the sequences accepted but not yet producing tokens.
    """

    def __init__(self, build_engine: Callable[[], LLMEngine], max_queue_len: int,
                 metrics: ServerMetrics | None = None, engine_process: bool = False):
        if not isinstance(max_queue_len, int) or max_queue_len < 1:
            raise ValueError(f"max_queue_len={max_queue_len!r} is not allowed; it must be an integer >= 1")
        self._build_engine = build_engine
        self.max_queue_len = max_queue_len
        self.metrics = metrics or ServerMetrics()
        self.engine_process = engine_process
        self._submissions: dict[str, Submission] = {}  # by live request id
        self._pending: dict[int, asyncio.Future] = {}  # by add id: adds the loop has not answered yet
        self._next_add_id = 0
        self._num_queued = 0  # sequences accepted whose request has had no output yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: threading.Thread | multiprocessing.Process | None = None  # the loop's
        self._inbox: queue.SimpleQueue | None = None  # a loop thread's commands
        self._conn = None  # the pipe to a loop process
        self._sender: threading.Thread | None = None  # writes the pipe, so a full pipe never stalls the event loop
        self._outbox: queue.SimpleQueue | None = None  # the sender's pickled commands
        self._ready: asyncio.Future | None = None
        self._stopped: asyncio.Event | None = None
        self._closed = False  # the loop has stopped (or never started): no command is sent any more
        self._dead: BaseException | None = None
        self.shutting_down = False  # set by begin_shutdown(): every request is aborted, new ones refused
        self.config: Config | None = None  # the engine's, once started (read-only from here on)
        self.cache_capacity_tokens = 0  # tokens the whole KV cache holds, once started
        self.grammars: GrammarCompiler | None = None  # the engine's structured-outputs compiler (a loop thread's)

    # --- lifetime ---

    async def start(self) -> None:
        """Start the loop and wait until its engine is built (re-raising what building raised)."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._stopped = asyncio.Event()
        if self.engine_process:
            context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or OpenMP pool
            self._conn, child_end = context.Pipe()
            worker = context.Process(target=_engine_process_main, args=(self._build_engine, child_end),
                                     name="nanovllm-engine")
            try:
                worker.start()  # pickles build_engine: one that cannot cross fails here
            except BaseException:
                self._conn.close()
                raise
            finally:
                child_end.close()  # the child's copy alone keeps it open: its exit is EOF here
            self._worker = worker
            self._loop.add_reader(self._conn.fileno(), self._on_readable)
            self._outbox = queue.SimpleQueue()
            self._sender = threading.Thread(target=self._send_loop, name="nanovllm-engine-sender", daemon=True)
            self._sender.start()
        else:
            self._inbox = queue.SimpleQueue()
            channel = _ThreadChannel(self._inbox, self._post)
            self._worker = threading.Thread(target=run_engine_loop, args=(self._build_engine, channel, True),
                                            name="nanovllm-engine-loop", daemon=True)
            self._worker.start()
        await self._ready

    async def shutdown(self) -> None:
        """Abort whatever is still running, free the engine and stop the loop."""
        if self._worker is None:
            return
        if self._send(_Stop()):
            await self._stopped.wait()
        self._closed = True
        if self.engine_process:
            await asyncio.to_thread(self._worker.join, PROCESS_EXIT_TIMEOUT_S)
            if self._worker.is_alive():
                logger.warning("the engine process did not exit in %.0f s; killing it", PROCESS_EXIT_TIMEOUT_S)
                self._worker.kill()
                await asyncio.to_thread(self._worker.join)
            self._loop.remove_reader(self._conn.fileno())
            self._outbox.put(None)
            await asyncio.to_thread(self._sender.join)
            self._conn.close()
        else:
            await asyncio.to_thread(self._worker.join)
        self._worker = None

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort the live ones now (their final outputs, finish_reason
        "abort", still arrive): what a shutdown does before its grace period runs out."""
        self.shutting_down = True
        self._send(_AbortAll())

    @property
    def is_running(self) -> bool:
        return self._worker is not None and self._worker.is_alive() and not self._closed

    @property
    def is_serving(self) -> bool:
        """Whether a new request can be served: the loop runs and no shutdown has begun."""
        return self.is_running and not self.shutting_down

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None for a loop thread, or before start())."""
        return self._worker.pid if self.engine_process and self._worker is not None else None

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
        add_id, self._next_add_id = self._next_add_id, self._next_add_id + 1
        if not self._send(_Add(list(zip(submission.request_ids, prompts, [params] * len(prompts))), add_id,
                               priority)):
            raise EngineDeadError("the engine is not running") from self._dead
        accepted = self._pending[add_id] = self._loop.create_future()
        # Registered before this coroutine yields, so before any output can be delivered.
        for rid in submission.request_ids:
            self._submissions[rid] = submission
        self._num_queued += weight
        try:
            await accepted
        except BaseException:  # refused, or the caller was cancelled while waiting
            self._pending.pop(add_id, None)
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
        """Hand a command to the loop; False if the loop has stopped (or never started)."""
        if self._worker is None or self._closed:
            return False
        if self.engine_process:  # pickled here, so a command that cannot cross fails its caller
            self._outbox.put(ForkingPickler.dumps(command))
        else:
            self._inbox.put(command)
        return True

    def _release(self, request_id: str) -> None:
        """Give back a request's queue places (once): it has started, or will never start."""
        submission = self._submissions.get(request_id)
        if submission is not None and request_id in submission.unstarted:
            submission.unstarted.discard(request_id)
            self._num_queued -= submission.n

    # --- what the loop sends (handled on the event loop) ---

    def _receive(self, message: "_Ready | _StartFailed | _Settled | _Outputs | _Stopped") -> None:
        if isinstance(message, _Outputs):
            self._observe(message.items, message.stats)
            self._deliver(message.items)
        elif isinstance(message, _Settled):
            future = self._pending.pop(message.add_id, None)
            if future is not None:
                _settle(future, message.error)
        elif isinstance(message, _Ready):
            self.config, self.cache_capacity_tokens = message.config, message.cache_capacity_tokens
            self.grammars = message.grammars
            self.metrics.observe_engine(message.stats)  # every metric shows from the start
            _settle(self._ready, None)
        elif isinstance(message, _StartFailed):
            self._close(message.error)
            _settle(self._ready, message.error)
        elif isinstance(message, _Stopped):
            error = message.error
            if error is None:
                error = EngineDeadError("the server is shutting down")
            elif not isinstance(error, EngineDeadError):
                error = EngineDeadError(LOOP_FAILED_MESSAGE)
            self._close(error)
            self._stopped.set()

    def _close(self, error: BaseException) -> None:
        """The loop has stopped: refuse every add it has not answered, end every live request with
        `error`, and send no more commands."""
        self._closed, self._dead = True, error
        for future in self._pending.values():
            _settle(future, error)
        self._pending.clear()
        self._deliver([(request_id, error) for request_id in list(self._submissions)])

    def _deliver(self, items: list[tuple[str, RequestDelta | BaseException]]) -> None:
        """Hand each output to its submission."""
        for request_id, item in items:
            submission = self._submissions.get(request_id)
            if submission is None:  # its handler gave up on it (refused or cancelled)
                continue
            self._release(request_id)
            submission.outputs.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                del self._submissions[request_id]

    def _observe(self, items: list[tuple[str, RequestDelta]], stats: EngineStats) -> None:
        """Update the metrics with one loop iteration's outputs and the engine's state."""
        m = self.metrics
        now = time.monotonic()
        for request_id, output in items:
            submission = self._submissions.get(request_id)
            if submission is None:  # its handler gave up on it
                continue
            num_new = sum(len(sample.token_ids) for sample in output.samples)
            if num_new:
                m.generation_tokens.inc(num_new)
                last_token = submission.last_token.get(request_id)
                if last_token is None:
                    m.prompt_tokens.inc(len(output.prompt_token_ids))
                    m.time_to_first_token.observe(now - submission.arrival)
                else:
                    m.time_per_output_token.observe(now - last_token)
                submission.last_token[request_id] = now
            for sample in output.samples:
                if sample.finished:
                    m.requests_finished.labels(sample.finish_reason).inc()
            if output.finished:
                m.e2e_request_latency.observe(now - submission.arrival)
        m.observe_engine(stats)

    def _post(self, message) -> None:
        """From a loop thread: handle the message on the event loop (dropped if it has closed)."""
        try:
            self._loop.call_soon_threadsafe(self._receive, message)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _on_readable(self) -> None:
        """The engine process's pipe has data, or has closed."""
        try:
            while self._conn.poll():
                self._receive(self._conn.recv())
        except (EOFError, OSError):  # the process exited: after its _Stopped, or died
            self._loop.remove_reader(self._conn.fileno())
            if not self._ready.done():
                self._receive(_StartFailed(EngineDeadError("the engine process exited while building the engine "
                                                           "(the server log has details)")))
            elif not self._closed:
                logger.error("the engine process exited unexpectedly; failing every live request")
                self._worker.join(1)  # it has closed its end: it is exiting, or gone
                self._receive(_Stopped(EngineDeadError(f"the engine process exited (exit code {self._worker.exitcode}); "
                                                       "the server log has details")))
            self._stopped.set()

    def _send_loop(self) -> None:
        while (payload := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(payload)
            except OSError:  # the process has gone: the reader sees the pipe close
                return


# --- the loop (in the engine's thread or process) ---

class _Channel(Protocol):
    def receive(self, block: bool) -> "_Add | _Abort | _AbortAll | _Stop | None": ...
    def emit(self, message: "_Ready | _StartFailed | _Settled | _Outputs | _Stopped") -> None: ...


class _ThreadChannel:
    def __init__(self, inbox: queue.SimpleQueue, post: Callable):
        self.inbox, self.emit = inbox, post

    def receive(self, block: bool):
        try:
            return self.inbox.get(block)
        except queue.Empty:
            return None


class _PipeChannel:
    def __init__(self, conn):
        self.conn = conn

    def receive(self, block: bool):
        try:
            return self.conn.recv() if self.conn.poll(None if block else 0) else None
        except (EOFError, OSError):  # the server has gone: stop
            return _Stop()

    def emit(self, message) -> None:
        error = getattr(message, "error", None)
        if error is not None:
            message = message._replace(error=_portable(error))
        try:
            self.conn.send(message)
        except OSError:  # the server has gone; the loop stops at its next receive
            pass


def _portable(error: BaseException) -> BaseException:
    """`error`, or an exception of its kind with its message where it does not survive a pickle."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return (ValueError if isinstance(error, ValueError) else RuntimeError)(str(error))


def _engine_process_main(build_engine: Callable[[], LLMEngine], conn) -> None:
    # Ctrl-C reaches the whole process group and a service manager may signal every process: the
    # server alone decides when the engine stops (after its grace period), by _Stop or by closing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        run_engine_loop(build_engine, _PipeChannel(conn), share_grammars=False)
    finally:
        conn.close()


def run_engine_loop(build_engine: Callable[[], LLMEngine], channel: _Channel, share_grammars: bool) -> None:
    """Build the engine, say so, serve commands until a _Stop (or an engine that cannot step), free it."""
    engine = None
    try:
        engine = build_engine()
        ready = _Ready(engine.config, engine.block_manager.num_blocks * engine.config.kvcache_block_size,
                       engine.stats(), engine.grammars if share_grammars else None)
    except BaseException as exc:
        if engine is not None:  # freed before the client hears of it
            try:
                engine.exit()
            except Exception:
                logger.exception("exiting the engine after its failed start-up failed too")
        channel.emit(_StartFailed(exc))
        return
    try:  # here, in the tokenizer's own thread: a loop thread's client then only compiles
        engine.grammars.load()
    except Exception:  # a vocabulary xgrammar cannot read: each constrained request is refused with why
        logger.warning("structured outputs are unavailable for this tokenizer", exc_info=True)
    channel.emit(ready)
    error = None
    try:
        _serve(engine, channel)
    except BaseException as exc:
        logger.exception("the engine loop stopped on an error; failing every live request")
        error = exc
    finally:
        channel.emit(_Stopped(error))
        engine.exit()


def _serve(engine: LLMEngine, channel: _Channel) -> None:
    live: dict[str, None] = {}  # the requests the loop has queued and not yet seen finish, in order
    steps = engine.run(live, MAX_CONSECUTIVE_STEP_FAILURES)
    while True:
        # Idle: sleep until a command comes. Busy: take what has come, then step.
        commands = []
        command = channel.receive(block=not engine.has_unfinished_requests())
        while command is not None:
            commands.append(command)
            command = channel.receive(block=False)
        outputs: list[RequestDelta] = []
        for command in commands:
            if isinstance(command, _Stop):
                _abort(engine, list(live), outputs, live)
                channel.emit(_Outputs([(output.request_id, output) for output in outputs], engine.stats()))
                return
            if isinstance(command, _Add):
                _accept(engine, command, live, channel)
            else:
                _abort(engine, list(live) if isinstance(command, _AbortAll) else command.request_ids, outputs, live)
        # A step after an add, even with nothing to run: a request failed as it was built has news.
        if engine.has_unfinished_requests() or any(isinstance(c, _Add) for c in commands):
            for output in next(steps):
                outputs.append(output)
                if output.finished:
                    del live[output.request_id]
        channel.emit(_Outputs([(output.request_id, output) for output in outputs], engine.stats()))


def _accept(engine: LLMEngine, command: _Add, live: dict[str, None], channel: _Channel) -> None:
    request_ids, prompts, params = zip(*command.requests)
    try:  # all or none: the engine checks and builds every prompt before it queues any
        engine.add_requests(list(prompts), list(params), request_ids=list(request_ids),
                            priority=[command.priority] * len(prompts))
    except Exception as exc:
        if not isinstance(exc, ValueError):  # not bad input (that is the caller's 400): a fault
            logger.exception("queueing requests %s failed", ", ".join(request_ids))
            exc = RuntimeError(ADD_FAILED_MESSAGE)
        channel.emit(_Settled(command.add_id, exc))
        return
    live.update(dict.fromkeys(request_ids))
    channel.emit(_Settled(command.add_id, None))


def _abort(engine: LLMEngine, request_ids: list[str], outputs: list[RequestDelta], live: dict[str, None]) -> None:
    for request_id in request_ids:
        if request_id in live and engine.abort(request_id):
            outputs.append(engine.pop_output(request_id))
            del live[request_id]


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():  # its waiter may have been cancelled
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
