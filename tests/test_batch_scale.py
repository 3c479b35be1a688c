"""Batch jobs at scale: memory stays flat over a long input of short prompts (peak RSS of the
`nanovllm batch` process measured), and the scale-out paths give exactly the single engine's
greedy results: `--data-parallel 2` (two engine processes) and `--ray --replicas 2` (local Ray,
two CPU actors)."""
import json
import os
import random
import subprocess
import time

import pytest
import torch

from batching import (BAD_LINES, GREEDY, JOB_ENGINE, JOB_FLAGS, SUBPROCESS_ENV, by_line, read_results,
                      request_lines, write_lines)
from nanovllm.entrypoints.batch.job import BatchJob, run_batch
from serving import ENGINE_FLAGS, REPO_ROOT, cli

# The issue asks for 100,000 lines; on 2 busy cores that run takes minutes (about 1.4 ms a
# request plus start-up), so CI runs this many and NANOVLLM_BATCH_MEMORY_LINES=100000 runs the
# full size. Flatness is judged after the first tenth (start-up and warm-up done).
MEMORY_LINES = int(os.environ.get("NANOVLLM_BATCH_MEMORY_LINES", "25000"))
BASELINE_FRACTION = 0.1
# Allowed RSS growth from the baseline to the last line's result. Keeping just each request's input
# line (about 150 bytes as a Python bytes object) would add over 3 MiB across 22,500 requests.
# Judged only while results are still coming: on an H200 machine (16 cores) RSS stayed within
# 0.15 MB over 21,000 lines and then rose 0.1-38 MB in the second after the last result was
# written, as the process shut down (docs/BENCHMARKS.md, Memory): that is no growth over the input.
RSS_GROWTH_BOUND_KIB = 2048
MEMORY_MAX_NUM_SEQS = 64
POLL_S = 0.1
RUN_TIMEOUT = 600


@pytest.fixture(scope="module")
def small_job(tmp_path_factory, qwen3_tiny):
    """A small input with bad lines, and its single-engine results (in process, greedy)."""
    lines = request_lines(24, max_tokens=8)
    for i, bad in enumerate(list(BAD_LINES)[:4]):
        lines.insert(1 + 3 * i, bad)
    folder = tmp_path_factory.mktemp("scale")
    path = write_lines(folder / "in.jsonl", lines)
    run_batch(BatchJob(qwen3_tiny, path, str(folder / "single.jsonl"), JOB_ENGINE, GREEDY, progress=False))
    return path, by_line(read_results(folder / "single.jsonl"))


def _status_kib(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of a process, in KiB; None once it has exited (a zombie has neither)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    if "VmRSS" not in fields:
        return None
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def test_memory_stays_flat_over_a_long_input(tmp_path, qwen3_tiny):
    rng = random.Random(0)
    words = "the quick brown fox jumps over the lazy dog cache block token".split()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with open(inp, "w") as f:
        for i in range(MEMORY_LINES):
            prompt = " ".join(rng.choice(words) for _ in range(4))
            f.write(json.dumps({"custom_id": f"r{i}", "body": {"prompt": prompt, "max_tokens": 1}}) + "\n")
    command = cli("batch", qwen3_tiny, "--input", str(inp), "--output", str(out), "--temperature", "0",
                  "--max-num-seqs", str(MEMORY_MAX_NUM_SEQS), "--no-progress", *ENGINE_FLAGS,
                  # The job's streaming, on CPU everywhere.
                  "--device", "cpu")
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err, env=SUBPROCESS_ENV)
    baseline = None  # (lines done, VmRSS, VmHWM) once a tenth is done
    # peak: the high-water mark (the most RSS the process ever had) at the last sample taken before
    # every result was written; max_rss_after: the most RSS after the baseline, up to that sample.
    max_rss_after = peak = 0
    done, tail = 0, None
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while True:
            # Not poll(): reaping the process before its last sample would lose the sample. (Its
            # ru_maxrss is no use either: it counts the forked copy of this test process.)
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            assert time.monotonic() < deadline, "the job did not finish in time"
            status_kib = _status_kib(proc.pid)
            if status_kib is None:
                continue  # exited just now: waitpid reaps it next
            rss, hwm = status_kib
            if tail is None and out.exists():
                tail = open(out, "rb")
            if tail is not None:
                done += tail.read().count(b"\n")  # only the bytes appended since the last poll
            if done >= MEMORY_LINES:  # every result is written: what follows is the shutdown
                time.sleep(POLL_S)
                continue
            peak = max(peak, hwm, rss)
            if baseline is None and done >= BASELINE_FRACTION * MEMORY_LINES:
                baseline = (done, rss, hwm)
            elif baseline is not None:
                max_rss_after = max(max_rss_after, rss)
            time.sleep(POLL_S)
    finally:
        if tail is not None:
            tail.close()
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (tmp_path / "stderr.txt").read_text()
    assert sum(1 for _ in open(out, "rb")) == MEMORY_LINES
    assert baseline is not None, "the job finished before its progress could be sampled"
    base_done, base_rss, base_hwm = baseline
    report = (f"{MEMORY_LINES} lines: RSS {base_rss} KiB at {base_done} done, highest {max_rss_after} KiB after; "
              f"peak RSS {peak} KiB (high-water mark {base_hwm} KiB at the baseline)")
    print(report)
    assert max_rss_after - base_rss <= RSS_GROWTH_BOUND_KIB, report
    assert peak - max(base_hwm, base_rss) <= RSS_GROWTH_BOUND_KIB, report


def test_data_parallel_equals_single_engine(small_job, qwen3_tiny, tmp_path):
    path, single = small_job
    out = tmp_path / "dp.jsonl"
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("data_parallel=2 on CUDA needs 2 GPUs (one engine each); torch sees 1")
    summary = run_batch(BatchJob(qwen3_tiny, path, str(out), JOB_ENGINE, GREEDY, data_parallel=2, progress=False))
    assert summary.num_lines == len(single)
    assert by_line(read_results(out)) == single


@pytest.mark.parametrize("num_lines,replicas,max_in_flight", [(31, 2, 16), (1000, 2, 16), (5, 4, 8), (64, 1, 512)])
def test_ray_input_is_split_for_every_replica(tmp_path, num_lines, replicas, max_in_flight):
    """At least BLOCKS_PER_REPLICA blocks per actor (one line each at the least), none larger than
    what an engine holds in flight, together every line still to do exactly once."""
    pytest.importorskip("numpy")
    from nanovllm.entrypoints.batch.log import DoneLines
    from nanovllm.entrypoints.batch.ray import BLOCKS_PER_REPLICA, _index_input, _read_chunks, chunk_size

    inp = write_lines(tmp_path / "in.jsonl", [f'{{"prompt": "{i}"}}' for i in range(1, num_lines + 1)])
    done = DoneLines()
    for line in range(1, num_lines // 4):  # a resumed job: the first quarter done
        done.add(line)
    pending = num_lines - len(done)
    lines = chunk_size(pending, replicas, max_in_flight)
    assert 1 <= lines <= max_in_flight
    total, chunks = _index_input(inp, done, lines)
    assert total == num_lines
    assert len(chunks) == -(-pending // lines) >= min(pending, replicas * BLOCKS_PER_REPLICA)
    read = _read_chunks({"id": list(range(len(chunks)))}, inp, chunks, lines, done)
    assert list(read["line"]) == [n for n in range(1, num_lines + 1) if n not in done]
    assert [bytes(t) for t in read["text"]] == [f'{{"prompt": "{n}"}}'.encode() for n in read["line"]]


def test_ray_two_cpu_actors_equal_single_engine(small_job, qwen3_tiny, tmp_path):
    pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'nanovllm[ray]')")
    path, single = small_job
    out = tmp_path / "ray.jsonl"
    # The lines are cut into 4 blocks per actor (of at most --max-in-flight lines), so both get some.
    command = cli("batch", qwen3_tiny, "--input", path, "--output", str(out), "--temperature", "0", "--ray",
                  "--replicas", "2", "--max-in-flight", "16", "--no-progress", *JOB_FLAGS)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.run(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=err, env=SUBPROCESS_ENV,
                              timeout=RUN_TIMEOUT)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 0, stderr[-5000:]
    assert by_line(read_results(out)) == single
