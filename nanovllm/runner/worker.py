"""A tensor-parallel worker process (ranks 1..N-1) and the protocol it speaks with rank 0.

A worker joins the process group, builds an ordinary ModelRunner over its shard of the weights,
then runs every step rank 0 sends until told to exit; the parallel layers' collectives keep the
ranks in step (only rank 0 samples). From its own thread it sends heartbeats, so rank 0 can tell
a silent (stopped or wedged) worker from a busy one. It knows nothing of scheduling, sampling or
of the other workers: rank 0's side of all this is `worker_group.py`.

Messages, rank 0 -> worker: (RUN, StepMessage) or (EXIT,).
Worker -> rank 0: (STARTED,) once, just before it joins the process group, or (FAILED, traceback).
Worker -> rank 0 on a second pipe, from a thread of the worker's own: (HEARTBEAT,) every
tensor_parallel_heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT seconds. A pipe of its own means
no two threads ever write to (or, on rank 0, read from) one connection. Each pipe frames a
message with its length, so a message of any size arrives whole (never truncated).
"""
import logging
import os
import pickle
import signal
import threading
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from time import sleep

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.platform.device import device_platform
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.utils.parallel import tensor_parallel_rank

LOOPBACK = "127.0.0.1"  # every rank runs on this host
# Rendezvous and collectives. Generous, since ranks load their shards at the same time but may
# reach the first collective far apart on a slow disk; a worker that dies is caught by its exit
# (its connections close) and one that stops answering by its missing heartbeats, never by
# waiting this out (except while rank 0 is still in the rendezvous itself).
PROCESS_GROUP_TIMEOUT = timedelta(minutes=30)
# Heartbeats sent per heartbeat timeout: a few beats late (a worker thread briefly starved of CPU)
# are not yet silence.
HEARTBEATS_PER_TIMEOUT = 5

RUN, EXIT, STARTED, FAILED, HEARTBEAT = "run", "exit", "started", "failed", "heartbeat"


def join_process_group(config: Config, rank: int, store: dist.Store) -> None:
    platform = device_platform(config.device)
    dist.init_process_group(platform.process_group_backend, store=store, rank=rank,
                            world_size=config.tensor_parallel_size, timeout=PROCESS_GROUP_TIMEOUT,
                            **platform.process_group_options(rank))


def send(conn: Connection, *message) -> None:
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def heartbeat_interval_s(config: Config) -> float:
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


def worker_main(config: Config, rank: int, store_port: int, conn: Connection, heartbeat: Connection) -> None:
    """Worker `rank`: join the group, build this rank's runner, then run every step rank 0 sends."""
    # Ctrl-C reaches every process in the terminal's group; rank 0 alone decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("nanovllm").setLevel(logging.WARNING)  # rank 0 logs the start-up facts once
    threading.Thread(target=_beat, args=(heartbeat, heartbeat_interval_s(config)), name="nanovllm-tp-heartbeat",
                     daemon=True).start()
    try:
        device_platform(config.device).bind_rank(rank, config.cpu_threads)  # per rank, resolved by Config
        send(conn, STARTED)
        store = dist.TCPStore(LOOPBACK, store_port, config.tensor_parallel_size, is_master=False,
                              timeout=PROCESS_GROUP_TIMEOUT)
        join_process_group(config, rank, store)
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
            runner.forward(*args)  # rank 0 alone samples
        runner.exit()
        dist.destroy_process_group()
    except BaseException:
        # Report first: exiting closes this rank's connections, which is what unblocks rank 0.
        try:
            send(conn, FAILED, traceback.format_exc())
        except OSError:
            pass
        os._exit(1)  # no clean-up: a collective may be stuck, and the OS frees everything anyway
