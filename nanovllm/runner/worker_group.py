"""Ranks 1..N-1 as rank 0 sees them: spawning the worker processes, the process group rank 0
shares with them, handing each step to them, following their heartbeats, and stopping them.

Owns the workers' lives and turning a worker's failure (an exception, its death, or its
silence) into a prompt, clear TensorParallelError on rank 0. Nothing is fixed that two engines
on one host could share: the rendezvous store listens on a port the OS picks (port 0 on
127.0.0.1), and steps travel through one multiprocessing Pipe per worker, so no shared-memory
name exists to collide. Every rank runs on this host (multi-node is out of scope), so the store
listens on loopback alone: nothing on the network can reach it. The protocol itself (message
kinds, the worker's side) is `worker.py`.
"""
import logging
import multiprocessing as mp
import pickle
import signal
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from time import monotonic
from typing import Iterator

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.platform.device import device_platform
from nanovllm.runner.step_inputs import StepMessage
from nanovllm.runner.worker import (EXIT, FAILED, LOOPBACK, PROCESS_GROUP_TIMEOUT, RUN, STARTED, heartbeat_interval_s,
                                    join_process_group, send, worker_main)

logger = logging.getLogger("nanovllm")

# From spawn to a worker's STARTED: a fresh interpreter importing torch and nanovllm.
WORKER_START_TIMEOUT_S = 300.0
# At exit, how long a worker may take to leave after EXIT (or SIGTERM) before the next resort.
WORKER_JOIN_TIMEOUT_S = 10.0
# After an error on rank 0, how long to wait for a worker to report the failure behind it.
FAILURE_GRACE_S = 2.0


def loopback_listener() -> socket.socket:
    """A listening socket for the rendezvous store on 127.0.0.1 and a port the OS picks (free, and
    held from now on, so engines never collide). Given to the store, since a TCPStore binds every
    interface when it opens its own socket, whatever host it is told."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


class TensorParallelError(RuntimeError):
    """A worker failed or died; the message says which and why (its traceback when it had one)."""


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
        listener = loopback_listener()
        try:
            self.store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], self.world_size, is_master=True,
                                       wait_for_workers=False, timeout=PROCESS_GROUP_TIMEOUT,
                                       master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now, and closes it when it is freed
        try:
            self._start(config)
        except BaseException:
            self.close()
            raise

    def _start(self, config: Config) -> None:
        num_threads = config.cpu_threads  # per rank, resolved by Config on CPU (unused on CUDA)
        ctx = mp.get_context("spawn")  # a forked child would inherit CUDA and thread-pool state it cannot use
        worker_config = config.for_workers()
        for rank in range(1, self.world_size):
            conn, child_conn = ctx.Pipe()
            heartbeat, child_heartbeat = ctx.Pipe(duplex=False)
            process = ctx.Process(target=worker_main, args=(worker_config, rank, self.store.port, child_conn,
                                                            child_heartbeat),
                                  name=f"nanovllm-tp-rank{rank}", daemon=True)
            process.start()
            child_conn.close()  # the worker holds the only other end, so its death reads as EOF here
            child_heartbeat.close()
            self.workers.append(Worker(rank, process, conn, heartbeat))
        self._wait_started()
        self._start_watcher()  # every worker beats from before its STARTED
        platform = device_platform(config.device)
        self._saved_threads = torch.get_num_threads()  # bind_rank may change them for the group's life
        platform.bind_rank(0, num_threads)
        join_process_group(config, 0, self.store)
        logger.info("tensor parallel: %d ranks over %s, workers %s, rendezvous on %s:%d%s", self.world_size,
                    platform.process_group_backend, self.pids, LOOPBACK, self.store.port,
                    platform.describe_ranks(num_threads))

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

    def send_step(self, step: StepMessage) -> None:
        """Hand this step to every worker (pickled once), after checking they are all still alive."""
        if self.closed:
            raise RuntimeError("the engine has exited; create a new one")
        self._raise_if_failed()
        message = pickle.dumps((RUN, step), pickle.HIGHEST_PROTOCOL)
        with self.reporting_failures():  # a worker that died since the check has a broken pipe
            for worker in self.workers:
                worker.conn.send_bytes(message)

    @contextmanager
    def reporting_failures(self, own_errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
        """Rank 0's part of a step the workers share. If it raises, the ranks are out of step and
        the group is broken for good; a worker failure behind the error is raised in its place,
        as a TensorParallelError from it. Errors of the `own_errors` types are rank 0's own to
        report as they are (bad input fails every rank alike)."""
        try:
            yield
        except BaseException as error:
            failure = self.failed_with(error)
            if failure is None or isinstance(error, own_errors):
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
        Under NCCL a collective waiting on a dead peer never returns, so there
        (collectives_hang_on_dead_rank, platform/device.py) the watcher also aborts the group, when a
        worker goes silent or exits. Returns at the first of these, or when close() wakes it."""
        timeout = self.config.tensor_parallel_heartbeat_timeout_s
        interval = heartbeat_interval_s(self.config)
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
        hangs = device_platform(self.config.device).collectives_hang_on_dead_rank
        if hangs and dist.is_initialized() and not self.closed \
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
                    send(worker.conn, EXIT)
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
