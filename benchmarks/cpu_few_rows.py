"""CPU decode products of a few rows: a whole decode step's linear products of issue 29's
real-proportion model (8 layers of q/k/v, o, gate/up, down, then the 32,000-row LM head: 166 MB
of float32 weights, each weight its own tensor, so every step streams them from memory as the
engine does) through oneDNN's packed product (1-3 rows padded to 4, as layers/linear.py did
before) against the few-row product (kernels/cpu_linear.cpp, what linear() takes now), for 1-4
rows, float32 and bfloat16.

The two alternate, round after round, so load on a shared host falls on both; the table gives the
wall time of a step (median and minimum over rounds) and the weight bytes read per second, beside
the machine's read rate measured first (a torch sum over 512 MiB with the same threads). A final
JSON line (`"benchmark": "cpu_few_rows"`) holds every row.

Usage: python benchmarks/cpu_few_rows.py [--threads 2] [--rounds 25]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vs_vllm_cpu import this_cpu  # noqa: E402
from nanovllm.kernels import cpu_build  # noqa: E402

PACK_BATCH_HINT = 64  # as nanovllm/utils/cpu.py
MIN_PACKED_ROWS = 4  # oneDNN's product of 1-3 rows is padded to 4 (faster than one row alone)
LAYERS = 8
# (N, K) of one layer's products: qkv, o, gate_up, down; then the LM head.
LAYER_SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536)]
LM_HEAD = (32000, 512)
STEPS_PER_ROUND = 4
READ_BUFFER_BYTES = 512 * 1024 * 1024
SEED = 0


def read_rate(rounds: int) -> float:
    """GB/s of a sum over READ_BUFFER_BYTES: the best of `rounds` timed sums."""
    buffer = torch.ones(READ_BUFFER_BYTES // 4)
    buffer.sum()
    best = min(timed(lambda: buffer.sum()) for _ in range(rounds))
    return READ_BUFFER_BYTES / best / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    kernels = cpu_build.load_fused()
    if isinstance(kernels, str):
        raise SystemExit(kernels)
    ceiling = read_rate(5)
    cpu, isa = this_cpu()
    print(f"{cpu} ({', '.join(isa) or 'ISA unknown'}), {args.threads} thread(s): reads {ceiling:.1f} GB/s "
          f"(a sum over {READ_BUFFER_BYTES >> 20} MiB)", flush=True)
    print(f"{'dtype':9s} {'rows':>4s} {'oneDNN packed: ms (min), GB/s':>32s} {'few-row: ms (min), GB/s':>30s} "
          f"{'few-row / oneDNN':>17s}")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        few_rows = kernels.few_rows_linear(dtype)
        if few_rows is None:
            print(f"{dtype}: no few-row product in this CPU's build")
            continue
        shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
        weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in shapes]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
        step_bytes = sum(w.numel() * w.element_size() for w in weights)
        for rows in range(1, few_rows.max_rows + 1):
            inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for _, k in shapes}}
            padded = {k: F.pad(x, (0, 0, 0, MIN_PACKED_ROWS - rows)) if rows < MIN_PACKED_ROWS else x
                      for k, x in inputs.items()}

            def onednn():
                for w, p in zip(weights, packed):
                    torch.ops.mkldnn._linear_pointwise(padded[w.size(1)], p, None, "none", [], "")[:rows]

            def ours():
                for w in weights:
                    few_rows(inputs[w.size(1)], w, None)

            for w in weights[:4] + weights[-1:]:  # the two agree before anything is timed
                torch.testing.assert_close(few_rows(inputs[w.size(1)], w, None).float(),
                                           F.linear(inputs[w.size(1)], w).float(), atol=2e-2, rtol=2e-2)
            times = {"onednn": [], "few_rows": []}
            for fn in (onednn, ours):
                fn()
            for _ in range(args.rounds):
                for name, fn in (("onednn", onednn), ("few_rows", ours)):
                    times[name].append(timed(lambda: [fn() for _ in range(STEPS_PER_ROUND)]) / STEPS_PER_ROUND)
            row = {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "step_mb": step_bytes / 1e6}
            cells = []
            for name, ts in times.items():
                median = statistics.median(ts)
                row[name] = {"ms": median * 1e3, "min_ms": min(ts) * 1e3, "gb_per_s": step_bytes / median / 1e9}
                cells.append(f"{median * 1e3:6.2f} ({min(ts) * 1e3:5.2f}), {step_bytes / median / 1e9:5.1f}")
            row["ratio"] = row["few_rows"]["ms"] / row["onednn"]["ms"]
            results.append(row)
            print(f"{row['dtype']:9s} {rows:4d} {cells[0]:>32s} {cells[1]:>30s} {row['ratio']:16.2f}x", flush=True)
    print(json.dumps({"benchmark": "cpu_few_rows", "date": time.strftime("%Y-%m-%d"), "cpu": cpu, "isa": isa,
                      "threads": args.threads,
                      "torch": torch.__version__, "read_gb_per_s": ceiling, "rows": results}))


if __name__ == "__main__":
    main()
