"""Tensor parallelism across processes: rank 0 runs in the caller's process, ranks 1..N-1 in
spawned worker processes, each an ordinary ModelRunner over its shard of the weights.

Owns the workers' lives, the process group (gloo on CPU, NCCL on CUDA with one GPU per rank),
the channel that carries each step from rank 0 to the workers, the workers' heartbeats, and
turning a worker's failure (an exception, its death, or its silence) into a prompt, clear
error on rank 0. It knows nothing of scheduling or sampling: the engine
hands rank 0 each step, rank 0 forwards it, and the parallel layers' collectives keep the ranks
in step (only rank 0 samples).

Nothing is fixed that two engines on one host could share: the rendezvous store listens on a
port the OS picks (port 0 on 127.0.0.1), and steps travel through one multiprocessing Pipe per
worker, which frames each message with its length, so a message of any size arrives whole
(never truncated) and no shared-memory name exists to collide. A step is pickled once per
step: `Sequence.__getstate__` sends only the step's tokens, the length, the block table and
two counts, never whole sequences or their sampling fields.

Messages, rank 0 -> worker: (RUN, seqs, is_prefill) or (EXIT,).
Worker -> rank 0: (STARTED,) once, just before it joins the process group, or (FAILED, traceback).
Worker -> rank 0 on a second pipe, from a thread of the worker's own: (HEARTBEAT,) every
tensor_parallel_heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT seconds. A pipe of its own means
no two threads ever write to (or, on rank 0, read from) one connection.
"""
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from time import monotonic, sleep

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import SamplerOutput
from nanovllm.utils.parallel import tensor_parallel_rank

logger = logging.getLogger("nanovllm")

LOOPBACK = "127.0.0.1"  # every rank runs on this host
# Rendezvous and collectives. Generous, since ranks load their shards at the same time but may
# reach the first collective far apart on a slow disk; a worker that dies is caught by its exit
# (its connections close) and one that stops answering by its missing heartbeats, never by
# waiting this out (except while rank 0 is still in the rendezvous itself).
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
# From spawn to a worker's STARTED: a fresh interpreter importing torch and nanovllm.
WORKER_START_TIMEOUT_S = 300.0
# At exit, how long a worker may take to leave after EXIT (or SIGTERM) before the next resort.
WORKER_JOIN_TIMEOUT_S = 10.0
# After an error on rank 0, how long to wait for a worker to report the failure behind it.
FAILURE_GRACE_S = 2.0
# Heartbeats sent per heartbeat timeout: a few beats late (a worker thread briefly starved of CPU)
# are not yet silence.
HEARTBEATS_PER_TIMEOUT = 5

RUN, EXIT, STARTED, FAILED, HEARTBEAT = "run", "exit", "started", "failed", "heartbeat"


class TensorParallelError(RuntimeError):
    """A worker failed or died; the message says which and why (its traceback when it had one)."""


def threads_per_rank(world_size: int) -> int:
    """CPU threads for each rank: the cores this process may use, shared out evenly (no
    oversubscription, since every rank computes at the same time)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world_size)


def _backend(config: Config) -> str:
    return "nccl" if config.device == "cuda" else "gloo"


def _join_process_group(config: Config, rank: int, store: dist.Store) -> None:
    kwargs = {"device_id": torch.device("cuda", rank)} if config.device == "cuda" else {}
    dist.init_process_group(_backend(config), store=store, rank=rank, world_size=config.tensor_parallel_size,
                            timeout=PROCESS_GROUP_TIMEOUT, **kwargs)


def _send(conn: Connection, *message) -> None:
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def _heartbeat_interval_s(config: Config) -> float:
    return config.tensor_parallel_heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT


def _beat(conn: Connection, interval_s: float) -> None:
    """A worker's heartbeat thread: says "alive" every interval_s for as long as the process runs
    (a stopped or wedged process stops it too), until rank 0 is gone."""
    message = pickle.dumps((HEARTBEAT,), pickle.HIGHEST_PROTOCOL)
    while True:
        try:
            conn.send_bytes(message)
        except OSError:  # rank 0's end is closed: nobody is listening any more
            return
        sleep(interval_s)


def _worker_main(config: Config, rank: int, store_port: int, conn: Connection, heartbeat: Connection,
                 num_threads: int) -> None:
    """Worker `rank`: join the group, build this rank's runner, then run every step rank 0 sends."""
    # Ctrl-C reaches every process in the terminal's group; rank 0 alone decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("nanovllm").setLevel(logging.WARNING)  # rank 0 logs the start-up facts once
    threading.Thread(target=_beat, args=(heartbeat, _heartbeat_interval_s(config)), name="nanovllm-tp-heartbeat",
                     daemon=True).start()
    try:
        if config.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(num_threads)
        _send(conn, STARTED)
        store = dist.TCPStore(LOOPBACK, store_port, config.tensor_parallel_size, is_master=False,
                              timeout=PROCESS_GROUP_TIMEOUT)
        _join_process_group(config, rank, store)
        with tensor_parallel_rank(rank, config.tensor_parallel_size):
            runner = ModelRunner(config)  # warms up and sizes the KV cache together with the other ranks
        while True:
            try:
                kind, *args = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0's process is gone without saying EXIT: nobody is left to tell
                os._exit(0)
            if kind == EXIT:
                break
            if kind != RUN:
                raise ValueError(f"unknown step message {kind!r}")
            runner.run(*args)
        runner.exit()
        dist.destroy_process_group()
    except BaseException:
        # Report first: exiting closes this rank's connections, which is what unblocks rank 0.
        try:
            _send(conn, FAILED, traceback.format_exc())
        except OSError:
            pass
        os._exit(1)  # no clean-up: a collective may be stuck, and the OS frees everything anyway


@dataclass
class Worker:
    rank: int
    process: BaseProcess
    conn: Connection  # rank 0's end of this worker's pipe
    heartbeat: Connection  # rank 0's end of its heartbeat pipe; only the watcher thread reads it
    started: bool = False

    @property
    def name(self) -> str:
        return f"tensor-parallel worker rank {self.rank} (pid {self.process.pid})"

    def how_it_ended(self) -> str:
        code = self.process.exitcode
        if code is None:
            return f"{self.name} closed its channel"
        if code < 0:
            return f"{self.name} was killed by {signal.Signals(-code).name}"
        return f"{self.name} exited with code {code}"


class WorkerGroup:
    """Ranks 1..N-1 as rank 0 sees them: their processes and pipes, and the process group that
    rank 0 (this process) shares with them. Once anything fails the group is broken for good:
    every later step raises, and close() terminates what is left. A watcher thread follows the
    workers' heartbeats (see _watch); `failure` is written through _record_failure, by either thread."""

    def __init__(self, config: Config):
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: another tensor-parallel "
                               "engine is running (call its exit() first) or the program made its own process group")
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.workers: list[Worker] = []
        self.failure: str | None = None  # why the group is broken: the first failure recorded
        self._failure_lock = threading.Lock()
        self.closed = False
        self._watcher: threading.Thread | None = None
        self._stop_watcher: Connection | None = None  # closing it wakes the watcher
        self._saved_threads: int | None = None
        # Port 0: the OS picks a free port and holds it from now on, so engines never collide.
        self.store = dist.TCPStore(LOOPBACK, 0, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=PROCESS_GROUP_TIMEOUT)
        try:
            self._start(config)
        except BaseException:
            self.close()
            raise

    def _start(self, config: Config) -> None:
        num_threads = threads_per_rank(self.world_size)
        ctx = mp.get_context("spawn")  # a forked child would inherit CUDA and thread-pool state it cannot use
        for rank in range(1, self.world_size):
            conn, child_conn = ctx.Pipe()
            heartbeat, child_heartbeat = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_main, args=(config, rank, self.store.port, child_conn,
                                                             child_heartbeat, num_threads),
                                  name=f"nanovllm-tp-rank{rank}", daemon=True)
            process.start()
            child_conn.close()  # the worker holds the only other end, so its death reads as EOF here
            child_heartbeat.close()
            self.workers.append(Worker(rank, process, conn, heartbeat))
        self._wait_started()
        self._start_watcher()  # every worker beats from before its STARTED
        if config.device == "cuda":
            torch.cuda.set_device(0)
        else:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(num_threads)
        _join_process_group(config, 0, self.store)
        logger.info("tensor parallel: %d ranks over %s, workers %s, rendezvous on %s:%d%s", self.world_size,
                    _backend(config), self.pids, LOOPBACK, self.store.port,
                    "" if config.device == "cuda" else f", {num_threads} CPU thread(s) per rank")

    def _wait_started(self) -> None:
        deadline = monotonic() + WORKER_START_TIMEOUT_S
        while not all(w.started for w in self.workers):
            pending = [w for w in self.workers if not w.started]
            if monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel worker rank(s) {[w.rank for w in pending]} did not start "
                                          f"within {WORKER_START_TIMEOUT_S:.0f} s")
            wait([w.conn for w in pending] + [w.process.sentinel for w in pending], deadline - monotonic())
            self._raise_if_failed()

    def _poll(self, worker: Worker) -> str | None:
        """Read what `worker` has sent; a description of its failure if it failed or died, else None."""
        try:
            while worker.conn.poll():
                kind, *args = pickle.loads(worker.conn.recv_bytes())
                if kind == STARTED:
                    worker.started = True
                elif kind == FAILED:
                    return f"{worker.name} failed:\n{args[0]}"
        except (EOFError, OSError):  # its end is closed: it has exited or is exiting
            worker.process.join(FAILURE_GRACE_S)
            return worker.how_it_ended()
        return worker.how_it_ended() if worker.process.exitcode is not None else None

    def _first_failure(self) -> str | None:
        return next((f for f in map(self._poll, self.workers) if f is not None), None)

    def _error(self) -> TensorParallelError:
        return TensorParallelError(f"{self.failure}\n(the tensor-parallel group is stopped; create a new engine)")

    def _record_failure(self, failure: str) -> bool:
        """Keep `failure` as the group's cause unless one is recorded already; True if it was kept."""
        with self._failure_lock:
            if self.failure is not None:
                return False
            self.failure = failure
            return True

    def _raise_if_failed(self) -> None:
        if self.failure is None and (failure := self._first_failure()) is not None:
            self._record_failure(failure)
        if self.failure is not None:
            raise self._error()

    def send_step(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """Hand this step to every worker, after checking they are all still alive."""
        if self.closed:
            raise RuntimeError("the engine has exited; create a new one")
        self._raise_if_failed()
        message = pickle.dumps((RUN, seqs, is_prefill), pickle.HIGHEST_PROTOCOL)
        try:
            for worker in self.workers:
                worker.conn.send_bytes(message)
        except OSError as error:  # a worker died since the check: its pipe is broken
            failure = self.failed_with(error)
            if failure is None:
                raise
            raise failure from error

    def failed_with(self, error: BaseException) -> TensorParallelError | None:
        """Rank 0 raised `error` mid-step, so the ranks are out of step and the group is broken.
        Returns the worker failure behind it (waiting up to FAILURE_GRACE_S for the report), if any."""
        deadline = monotonic() + (FAILURE_GRACE_S if isinstance(error, Exception) else 0)  # not on Ctrl-C
        while self.failure is None:
            if (failure := self._first_failure()) is not None:
                self._record_failure(failure)
                break
            if monotonic() >= deadline:
                break
            wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], deadline - monotonic())
        if self._record_failure(f"rank 0 failed: {error!r}"):  # rank 0's own error; workers may be stuck
            return None
        return self._error()

    def _start_watcher(self) -> None:
        wake, self._stop_watcher = mp.Pipe(duplex=False)  # closing _stop_watcher wakes it to leave
        self._watcher = threading.Thread(target=self._watch, args=(wake,), name="nanovllm-tp-watcher", daemon=True)
        self._watcher.start()

    def _watch(self, wake: Connection) -> None:
        """The watcher thread on rank 0. A worker silent for tensor_parallel_heartbeat_timeout_s
        (stopped, hung) is recorded as the group's failure, then killed: a gloo collective waiting
        on it fails at once, so rank 0's blocked call raises and run() reports the silent rank.
        Under NCCL a collective waiting on a dead peer never returns, so on CUDA the watcher also
        aborts the group, when a worker goes silent or exits. Returns at the first of these, or
        when close() wakes it."""
        timeout = self.config.tensor_parallel_heartbeat_timeout_s
        interval = _heartbeat_interval_s(self.config)
        beating = {w.heartbeat: w for w in self.workers}
        sentinels = [w.process.sentinel for w in self.workers]
        last_beat = {w.rank: monotonic() for w in self.workers}
        previous = monotonic()
        try:
            while True:
                ready = wait([wake, *beating, *sentinels], interval)
                now = monotonic()
                if now - previous > interval + timeout / 2:  # this process itself was paused (Ctrl-Z, a
                    last_beat = dict.fromkeys(last_beat, now)  # debugger): silence counts only while watched
                previous = now
                if wake in ready or self.closed:
                    return
                for conn in (c for c in ready if c in beating):
                    try:
                        while conn.poll():
                            conn.recv_bytes()
                        last_beat[beating[conn].rank] = now
                    except (EOFError, OSError):  # the worker is exiting; its sentinel will say so
                        del beating[conn]
                if any(sentinel in ready for sentinel in sentinels):  # a worker exited: run() reports it
                    break
                silent = [w for w in self.workers if now - last_beat[w.rank] > timeout]
                if silent:
                    self._record_failure(
                        "; ".join(f"{w.name} sent no heartbeat for {now - last_beat[w.rank]:.1f} s (more than "
                                  f"tensor_parallel_heartbeat_timeout_s={timeout:g}): it is stopped or hung, so it "
                                  "was killed" for w in silent))
                    for worker in silent:
                        worker.process.kill()
                    break
        finally:
            wake.close()
        if self.config.device == "cuda" and dist.is_initialized() and not self.closed \
                and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()

    def close(self) -> None:
        """Stop every worker (politely when the group is healthy, by signal otherwise), then free
        the process group, the pipes and the store. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._watcher is not None:  # first, so that workers leaving now are not taken for failures
            self._stop_watcher.close()
            self._watcher.join()
        healthy = self.failure is None and all(w.process.is_alive() for w in self.workers)
        if healthy:
            for worker in self.workers:
                try:
                    _send(worker.conn, EXIT)
                except OSError:
                    pass
        for worker in self.workers:
            worker.process.join(WORKER_JOIN_TIMEOUT_S if healthy else 0)
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(WORKER_JOIN_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.process.close()
            worker.conn.close()
            worker.heartbeat.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]


class TensorParallelRunner(ModelRunner):
    """Rank 0's ModelRunner, which also hands every step to the workers. The engine uses it as
    a ModelRunner; only run() and exit() differ."""

    def __init__(self, config: Config):
        self._forwarding = False  # the warm-up in ModelRunner.__init__ runs on every rank by itself
        self.workers = WorkerGroup(config)
        self._exited = False  # the engine's exit hook calls exit(); this runner registers none of its own
        try:
            with tensor_parallel_rank(0, config.tensor_parallel_size):
                super().__init__(config)
        except BaseException as error:
            failure = self.workers.failed_with(error)
            self.exit()
            if failure is None or isinstance(error, ValueError):  # bad input fails every rank alike
                raise
            raise failure from error
        self._forwarding = True

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.pids

    def run(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        if not self._forwarding:
            return super().run(seqs, is_prefill)
        self.workers.send_step(seqs, is_prefill)
        try:
            return super().run(seqs, is_prefill)
        except BaseException as error:
            failure = self.workers.failed_with(error)
            if failure is None:
                raise
            raise failure from error

    def exit(self) -> None:
        if self._exited:
            return
        self._exited = True
        # Workers first: under NCCL, freeing this rank's cache synchronises the GPU, which must not
        # wait on a collective a dead worker will never join.
        self.workers.close()
        if hasattr(self, "kv_cache"):  # absent when start-up failed before the cache was made
            super().exit()


def create_model_runner(config: Config) -> ModelRunner:
    """One process for tensor_parallel_size=1; otherwise rank 0 here and a worker per other rank."""
    return ModelRunner(config) if config.tensor_parallel_size == 1 else TensorParallelRunner(config)
