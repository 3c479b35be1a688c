"""`nanovllm batch --ray`: does a second replica help? Throughput of one job with 1 and 2 engine actors.

A random-weight Qwen3-shaped checkpoint (a few million parameters, so the model's arithmetic, not
the host, sets the pace) and a fixed-seed JSONL input of short prompts, greedy, run through
`run_ray_batch` (what `nanovllm batch --ray` runs) on a local Ray started once. Each layout is
warmed up with a small job first (the actors' processes, imports, the engine's start-up), then
the layouts take turns, `--repeats` rounds (so a machine that gets busier mid-run slows every
layout alike), each job timed whole: wall time from the call to the last result on disk (Ray Data's planning
and the actors' start-up included, as a user waits for them), and the steady rate: lines per
second from the first result batch's arrival to the last (start-up excluded). Layouts:
1 replica with 1 CPU, 1 replica with every CPU (one engine, more torch threads), and 2 replicas
with 1 CPU each (Ray gives each actor OMP_NUM_THREADS equal to its CPUs). Prints a table, then
one JSON line.

Usage: python benchmarks/batch_replicas.py [--lines 512] [--max-tokens 32] [--repeats 3]
"""
import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.entrypoints.batch.job import BatchJob, JobOutput  # noqa: E402
from nanovllm.entrypoints.batch.ray import run_ray_batch  # noqa: E402
from nanovllm.testing.synthetic import build_checkpoint  # noqa: E402

SEED = 0
# A model big enough that a decode step is mostly matrix work on one core (~10 ms at batch 16).
MODEL = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2, head_dim=64)
ENGINE = {"max_num_seqs": 16, "kvcache_block_size": 16, "num_kvcache_blocks": 512, "device": "cpu"}
WORDS = "the quick brown fox jumps over the lazy dog while the cache keeps every block warm".split()
WARMUP_LINES_PER_REPLICA = 8


def write_input(path: str, lines: int, max_tokens: int) -> None:
    rng = random.Random(SEED)
    with open(path, "w") as f:
        for i in range(lines):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))
            f.write(json.dumps({"custom_id": f"r{i}", "body": {"prompt": prompt, "max_tokens": max_tokens,
                                                               "ignore_eos": True}}) + "\n")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or platform.machine()


class Arrivals:
    """When result batches reach the output (JobOutput.record, timestamped while in the `with`)."""

    def __enter__(self) -> "Arrivals":
        self.times: list[tuple[float, int]] = []  # (when, lines)
        self.record = JobOutput.record

        def timed(output, finished):
            self.record(output, finished)
            self.times.append((time.perf_counter(), len(finished)))
        JobOutput.record = timed
        return self

    def __exit__(self, *exc_info) -> None:
        JobOutput.record = self.record

    def steady_lines_per_s(self) -> float:
        """Lines after the first batch over the time from the first batch to the last."""
        (first, first_lines), (last, _) = self.times[0], self.times[-1]
        lines = sum(n for _, n in self.times) - first_lines
        return lines / (last - first) if last > first else float("nan")


def run_job(model: str, inp: str, out: str, replicas: int, cpus: float) -> tuple[float, float, int]:
    """One whole job: (seconds, steady lines per second, completion tokens)."""
    job = BatchJob(model, inp, out, ENGINE, {"temperature": 0.0}, progress=False, overwrite=True)
    with Arrivals() as arrivals:
        start = time.perf_counter()
        summary = run_ray_batch(job, replicas=replicas, cpus_per_replica=cpus)
        elapsed = time.perf_counter() - start
    return elapsed, arrivals.steady_lines_per_s(), summary.num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import ray

    logging.getLogger("nanovllm").setLevel(logging.WARNING)
    cores = len(os.sched_getaffinity(0))
    layouts = [(1, 1.0), (1, float(cores)), (2, 1.0)] if cores >= 2 else [(1, 1.0)]
    ray.init(num_cpus=cores, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = build_checkpoint(os.path.join(folder, "model"), "qwen3", seed=SEED, **MODEL)
        inp, warm = os.path.join(folder, "in.jsonl"), os.path.join(folder, "warm.jsonl")
        write_input(inp, args.lines, args.max_tokens)
        for replicas, cpus in layouts:
            write_input(warm, WARMUP_LINES_PER_REPLICA * replicas, 4)
            run_job(model, warm, os.path.join(folder, "warm-out.jsonl"), replicas, cpus)
        runs: dict[tuple[int, float], list[tuple[float, float, int]]] = {layout: [] for layout in layouts}
        for _ in range(args.repeats):
            for replicas, cpus in layouts:
                runs[replicas, cpus].append(run_job(model, inp, os.path.join(folder, "out.jsonl"), replicas, cpus))
        for (replicas, cpus), timed in runs.items():
            times, rates, tokens = [t for t, _, _ in timed], [r for _, r, _ in timed], timed[0][2]
            median = statistics.median(times)
            rows.append({"replicas": replicas, "cpus_per_replica": cpus, "best_s": round(min(times), 2),
                         "median_s": round(median, 2), "lines_per_s": round(args.lines / median, 1),
                         "tokens_per_s": round(tokens / median, 1),
                         "steady_lines_per_s": round(statistics.median(rates), 1)})
    ray.shutdown()
    print(f"nanovllm batch --ray: {args.lines} lines x {args.max_tokens} tokens, greedy, model {MODEL}, engine "
          f"{ENGINE}, {args.repeats} timed jobs per layout after a warm-up job; {cores} cores, {cpu_model()}")
    print(f"{'replicas':>9}{'cpus each':>11}{'best s':>9}{'median s':>10}{'lines/s':>9}{'tok/s':>9}"
          f"{'steady lines/s':>16}")
    for row in rows:
        print(f"{row['replicas']:>9}{row['cpus_per_replica']:>11.0f}{row['best_s']:>9.2f}{row['median_s']:>10.2f}"
              f"{row['lines_per_s']:>9.1f}{row['tokens_per_s']:>9.1f}{row['steady_lines_per_s']:>16.1f}")
    print(json.dumps({"benchmark": "batch_replicas", "device": "cpu", "cpu": cpu_model(), "cores": cores,
                      "lines": args.lines, "max_tokens": args.max_tokens, "repeats": args.repeats, "model": MODEL,
                      "engine": ENGINE, "results": rows, "date": date.today().isoformat()}))


if __name__ == "__main__":
    main()
