"""Ray Data scale-out for batch jobs (`pip install nanovllm[ray]`).

`NanoVLLMPredictor` is a callable class for `ray.data.Dataset.map_batches`: each actor builds one
engine and runs the JSONL request lines of the batches it is given, returning one result line
per row (the format of `nanovllm batch`). For example, on a laptop or a cluster alike:

    import ray
    from nanovllm.entrypoints.batch.ray import NanoVLLMPredictor

    ray.init()  # or ray.init(address="ray://head:10001") for a cluster
    results = ray.data.read_text("prompts.jsonl").map_batches(
        NanoVLLMPredictor, fn_constructor_kwargs={"model": "/models/Qwen3-0.6B"},
        batch_size=256, concurrency=4, num_gpus=1)  # 4 actors, one GPU each (num_cpus=... without GPUs)

`run_ray_batch` is `nanovllm batch --ray`: the same resumable job as batch.py, with the engines in
Ray actors. The input is read by Ray Data tasks pinned to this machine (so it need not be on
shared storage), the results stream back here and this process alone appends them to the
output log. The lines still to do are cut into at least BLOCKS_PER_REPLICA blocks per actor, so
every actor gets work and results come back (and the progress bar moves) a block at a time.
This module knows nothing of the CLI; Ray is imported only when it is used.
"""
import functools
import logging
import os
from typing import Any

import numpy as np

from nanovllm.entrypoints.batch.job import (BatchJob, BatchSummary, EngineBatcher, Finished, JobOutput, check_job,
                                        engine_factory)
from nanovllm.entrypoints.batch.lines import LineError, parse_line, resolve_sampling_defaults
from nanovllm.entrypoints.batch.log import DoneLines

logger = logging.getLogger("nanovllm.ray")

# Input lines are read in chunks (one chunk: one Ray block, one actor batch) of at most
# max_in_flight lines, and small enough that each actor gets this many blocks: a block is run to
# its end before the actor takes the next, so with fewer an idle actor would wait on a busy one.
BLOCKS_PER_REPLICA = 4
# Reading tasks running at once: one worker process reads every chunk (see _results).
READ_CONCURRENCY = 1
RESULT_COLUMNS = ("line", "custom_id", "result", "num_tokens", "ok")


class NanoVLLMPredictor:
    """One engine per actor. A batch has a "text" column of JSONL request lines (str or bytes;
    OpenAI batch lines or bare bodies, as `nanovllm batch` reads) and optionally a "line" column
    of their line numbers; the result has, per row, "line", "custom_id", "result" (the result
    line: JSON text), "num_tokens" (completion tokens) and "ok" (False for an error line)."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any] | None = None,
                 sampling_defaults: dict[str, Any] | None = None):
        self.batcher = EngineBatcher(engine_factory(model, engine_kwargs or {}))
        self.sampling_defaults = resolve_sampling_defaults(sampling_defaults)  # a line's own fields win

    @property
    def llm(self):
        """The actor's engine (rebuilt by the batcher if a step ever fails)."""
        return self.batcher.llm

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        texts = list(batch["text"])
        numbers = [int(n) for n in batch["line"]] if "line" in batch else [None] * len(texts)
        results: list[Finished | None] = [None] * len(texts)
        for row, (text, number) in enumerate(zip(texts, numbers)):
            request = parse_line(text, number, self.sampling_defaults)
            if isinstance(request, LineError):
                results[row] = Finished(number, request.custom_id, request.to_json(), 0, False)
            else:  # all of the batch: its size bounds what is in flight
                results[row] = self.batcher.submit(request, tag=row)
        while self.batcher.num_in_flight:
            for finished in self.batcher.step():
                results[finished.tag] = finished
        return {"line": numbers, "custom_id": [r.custom_id for r in results], "result": [r.text for r in results],
                "num_tokens": [r.num_tokens for r in results], "ok": [r.ok for r in results]}


# --- `nanovllm batch --ray` ---

def chunk_size(num_pending: int, replicas: int, max_in_flight: int) -> int:
    """Lines per chunk: BLOCKS_PER_REPLICA chunks (or more) per replica, none over max_in_flight."""
    return max(1, min(max_in_flight, num_pending // (replicas * BLOCKS_PER_REPLICA)))


def _index_input(path: str, done: DoneLines, chunk_lines: int) -> tuple[int, list[tuple[int, int]]]:
    """(number of lines, (first line, byte offset) of each chunk), in one pass over the input. A
    chunk starts at a line still to do and holds the next `chunk_lines` such lines (done lines
    between them are skipped when it is read), so every chunk but the last is full."""
    chunks, offset, number, pending = [], 0, 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number not in done:
                if pending % chunk_lines == 0:
                    chunks.append((number, offset))
                pending += 1
            offset += len(raw)
    return number, chunks


def _read_chunks(batch: dict[str, np.ndarray], path: str, chunks: list[tuple[int, int]], chunk_lines: int,
                 done: DoneLines) -> dict[str, np.ndarray]:
    """A Ray Data map over chunk indices: the `chunk_lines` lines still to do from each chunk's
    start, with their numbers."""
    numbers, texts = [], []
    with open(path, "rb") as f:
        for index in batch["id"]:
            number, offset = chunks[int(index)]
            f.seek(offset)
            taken = 0
            while taken < chunk_lines and (raw := f.readline()):
                if number not in done:
                    numbers.append(number)
                    texts.append(raw.rstrip(b"\n").rstrip(b"\r"))
                    taken += 1
                number += 1
    text_column = np.empty(len(texts), dtype=object)
    text_column[:] = texts
    return {"line": np.array(numbers, dtype=np.int64), "text": text_column}


def run_ray_batch(job: BatchJob, replicas: int = 1, address: str | None = None,
                  cpus_per_replica: float = 1.0) -> BatchSummary:
    """Run (or resume) a job with `replicas` engine actors; the output is that of run_batch."""
    import ray

    check_job(job)
    resolve_sampling_defaults(job.sampling_defaults)  # refuse bad defaults here, not in every actor
    if job.data_parallel != 1:
        raise ValueError(f"data_parallel={job.data_parallel} is not allowed with Ray; use replicas instead")
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r} is not allowed; it must be an integer >= 1")
    if not isinstance(cpus_per_replica, (int, float)) or cpus_per_replica <= 0:
        raise ValueError(f"cpus_per_replica={cpus_per_replica!r} is not allowed; it must be a number > 0")
    started_ray = False
    try:
        with JobOutput(job) as output:
            chunk_lines = chunk_size(output.start() - len(output.done), replicas, job.resolved_max_in_flight())
            _, chunks = _index_input(job.input, output.done, chunk_lines)
            if chunks:
                if not ray.is_initialized():
                    address = address or os.environ.get("RAY_ADDRESS")
                    ray.init(address=address, **({} if address else {"include_dashboard": False}))
                    started_ray = address is None
                ray.data.DataContext.get_current().enable_progress_bars = False  # ours is enough
                for batch in _results(job, chunks, chunk_lines, output.done, replicas, cpus_per_replica):
                    output.record([Finished(int(line), custom_id, text, int(tokens), bool(ok)) for
                                   line, custom_id, text, tokens, ok in zip(*(batch[c] for c in RESULT_COLUMNS))])
            output.finish()
    finally:
        if started_ray:
            ray.shutdown()
    return output.summary()


def _results(job: BatchJob, chunks: list[tuple[int, int]], chunk_lines: int, done: DoneLines, replicas: int,
             cpus_per_replica: float):
    """The job as a Ray Data pipeline: chunk descriptors -> their lines still to do (read on this
    machine) -> engine actors; yields the result batches as they come."""
    import ray

    device = job.engine_kwargs.get("device", "auto")
    use_gpus = device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    tp = job.engine_kwargs.get("tensor_parallel_size", 1)
    resources = {"num_gpus": tp} if use_gpus else {"num_cpus": cpus_per_replica}
    logger.info("Ray: %d engine actor(s) with %s each", replicas,
                f"{tp} GPU(s)" if use_gpus else f"{cpus_per_replica} CPU(s)")
    reader = functools.partial(_read_chunks, path=os.path.abspath(job.input), chunks=chunks,
                               chunk_lines=chunk_lines, done=done)
    # The chunk indices are made here (no read task). The reading map runs on this machine, where
    # the input is, and reserves no CPU: the actors may hold them all, and it must still run.
    # (Its resources differ from the actors', which also keeps Ray Data from fusing the two.)
    this_node = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    # One block per chunk: Ray Data hands blocks, not rows, to its tasks and actors.
    ds = ray.data.from_items([{"id": i} for i in range(len(chunks))], override_num_blocks=len(chunks))
    # One reading task at a time: reading lines is cheap, and with no CPU reserved Ray would
    # otherwise start a worker process per chunk, each importing this package (torch included):
    # on a small host that start-up held the actors' first results back by 25-30 s.
    ds = ds.map_batches(reader, batch_size=1, num_cpus=0, concurrency=READ_CONCURRENCY,
                        label_selector=this_node)
    ds = ds.map_batches(NanoVLLMPredictor, batch_size=chunk_lines,
                        compute=ray.data.ActorPoolStrategy(size=replicas),
                        fn_constructor_kwargs={"model": job.model, "engine_kwargs": job.engine_kwargs,
                                               "sampling_defaults": job.sampling_defaults}, **resources)
    return ds.iter_batches(batch_size=None, batch_format="numpy")
