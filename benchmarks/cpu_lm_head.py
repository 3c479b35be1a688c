"""A float32 decode step's LM head and token choice on the CPU, both ways the engine takes them:
the logits (platform/cpu/linear.py cpu_linear() as the CPU platform sets it up: the few-row product, AMX or
oneDNN's packed product) then the sampler's kernel (the greedy argmax, or the race for sampled
rows), against the head that chooses the tokens without every logit (kernels/cpu_greedy_head.cpp,
kernels/cpu_build.py GreedyHead), greedy and sampled (temperature 1, the default of a served
request that names none).

Random weights and rows (x ~ N(0, 1), w ~ N(0, 0.05^2)); the two ways alternate within each round,
so load on a shared host falls on both; medians over rounds. Each row also checks that both ways
give the same tokens. A final JSON line (`"benchmark": "cpu_lm_head"`) holds every row.

Usage: python benchmarks/cpu_lm_head.py [--vocab 32000] [--width 512] [--rows 1 4 16 64 256]
       [--threads 2] [--rounds 15]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vs_vllm_cpu import this_cpu  # noqa: E402
from nanovllm.kernels import cpu_build  # noqa: E402
from nanovllm.layers.logits_processors import LOGIT_LIMIT  # noqa: E402
from nanovllm.platform.cpu.linear import PACK_BATCH_HINT, cpu_linear  # noqa: E402
from nanovllm.runner.step_inputs import HeadDraw  # noqa: E402

SEED = 0
WEIGHT_SCALE = 0.05


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_build.load_fused()
    if isinstance(kernels, str):
        raise SystemExit(kernels)
    gen = torch.Generator().manual_seed(SEED)
    weight = torch.randn(args.vocab, args.width, generator=gen) * WEIGHT_SCALE
    head = kernels.greedy_head(weight, LOGIT_LIMIT)
    if head is None:
        raise SystemExit("this CPU's build has no greedy head (neither AVX512-VNNI nor AVX2)")
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    few_rows = kernels.few_rows_linear(torch.float32)
    amx = kernels.amx_linear(weight, min_rows=cpu_build.AMX_HEAD_MIN_ROWS)
    cpu, isa = this_cpu()
    print(f"{cpu} ({', '.join(isa) or 'ISA unknown'}), {args.threads} thread(s); head {args.vocab} x {args.width} "
          f"float32 ({4 * args.vocab * args.width / 1e6:.0f} MB)", flush=True)
    print(f"{'rows':>4s} {'mode':8s} {'logits + kernel ms':>18s} {'head ms':>8s} {'speed-up':>8s} "
          f"{'rechecked a row':>15s} {'same tokens':>11s}")
    results = []
    for rows in args.rows:
        x = torch.randn(rows, args.width, generator=gen)
        temperatures = torch.ones(rows)
        keys = torch.randint(0, 2**62, (rows,), generator=gen)
        counters = torch.arange(rows)
        draw = HeadDraw(temperatures.tolist(), keys.tolist(), counters.tolist())
        ways = {
            "greedy": (lambda: kernels.greedy_tokens(cpu_linear(x, weight, None, packed, few_rows, amx), LOGIT_LIMIT),
                       lambda: head(x)),
            "sampled": (lambda: kernels.race_tokens(cpu_linear(x, weight, None, packed, few_rows, amx), temperatures,
                                                    keys, counters, LOGIT_LIMIT),
                        lambda: head(x, draw)),
        }
        for mode, (logits_way, head_way) in ways.items():
            same = torch.equal(logits_way(), head_way())  # also the warm-up
            candidates = int(head.candidates) / rows
            logits_times, head_times = [], []
            for _ in range(args.rounds):
                for fn, times in ((logits_way, logits_times), (head_way, head_times)):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
            row = {"rows": rows, "mode": mode, "logits_ms": round(median_ms(logits_times), 3),
                   "head_ms": round(median_ms(head_times), 3), "rechecked_per_row": round(candidates, 1),
                   "same_tokens": same}
            row["speedup"] = round(row["logits_ms"] / row["head_ms"], 2)
            results.append(row)
            print(f"{rows:4d} {mode:8s} {row['logits_ms']:18.2f} {row['head_ms']:8.2f} {row['speedup']:7.2f}x "
                  f"{candidates:15.1f} {str(same):>11s}", flush=True)
    print(json.dumps({"benchmark": "cpu_lm_head", "cpu": cpu, "isa": isa, "threads": args.threads,
                      "vocab": args.vocab, "width": args.width, "rounds": args.rounds, "torch": torch.__version__,
                      "results": results}))


if __name__ == "__main__":
    main()
