"""Tensor parallelism across processes: rank 0 runs in the caller's process, ranks 1..N-1 in
spawned worker processes, each an ordinary ModelRunner over its shard of the weights.

Owns the workers' lives, the process group (gloo on CPU, NCCL on CUDA with one GPU per rank),
the channel that carries each step from rank 0 to the workers, and turning a worker's failure
into a prompt, clear error on rank 0. It knows nothing of scheduling or sampling: the engine
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
from time import monotonic

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
# (its connections close), never by waiting this out.
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
# From spawn to a worker's STARTED: a fresh interpreter importing torch and nanovllm.
WORKER_START_TIMEOUT_S = 300.0
# At exit, how long a worker may take to leave after EXIT (or SIGTERM) before the next resort.
WORKER_JOIN_TIMEOUT_S = 10.0
# After an error on rank 0, how long to wait for a worker to report the failure behind it.
FAILURE_GRACE_S = 2.0

RUN, EXIT, STARTED, FAILED = "run", "exit", "started", "failed"


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


def _worker_main(config: Config, rank: int, store_port: int, conn: Connection, num_threads: int) -> None:
    """Worker `rank`: join the group, build this rank's runner, then run every step rank 0 sends."""
    # Ctrl-C reaches every process in the terminal's group; rank 0 alone decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("nanovllm").setLevel(logging.WARNING)  # rank 0 logs the start-up facts once
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
    every later step raises, and close() terminates what is left."""

    def __init__(self, config: Config):
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: another tensor-parallel "
                               "engine is running (call its exit() first) or the program made its own process group")
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.workers: list[Worker] = []
        self.failure: str | None = None  # why the group is broken
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
            process = ctx.Process(target=_worker_main, args=(config, rank, self.store.port, child_conn, num_threads),
                                  name=f"nanovllm-tp-rank{rank}", daemon=True)
            process.start()
            child_conn.close()  # the worker holds the only other end, so its death reads as EOF here
            self.workers.append(Worker(rank, process, conn))
        self._wait_started()
        if config.device == "cuda":
            torch.cuda.set_device(0)
        else:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(num_threads)
        _join_process_group(config, 0, self.store)
        if config.device == "cuda":
            self._start_watcher()
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

    def _raise_if_failed(self) -> None:
        if self.failure is None:
            self.failure = self._first_failure()
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
            self.failure = self._first_failure()
            if self.failure is not None or monotonic() >= deadline:
                break
            wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], deadline - monotonic())
        if self.failure is None:  # rank 0's own error; the workers may be stuck in a collective
            self.failure = f"rank 0 failed: {error!r}"
            return None
        return self._error()

    def _start_watcher(self) -> None:
        """CUDA only. Under NCCL, a collective waiting on a dead peer never returns (gloo's sockets
        report the loss instead), so a watcher aborts the group when a worker exits unexpectedly;
        rank 0's blocked call then raises, and run() reports the worker."""
        wake, self._stop_watcher = mp.Pipe(duplex=False)

        def watch() -> None:
            wait([w.process.sentinel for w in self.workers] + [wake])
            wake.close()
            if not self.closed and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group()
        self._watcher = threading.Thread(target=watch, name="nanovllm-tp-watcher", daemon=True)
        self._watcher.start()

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
