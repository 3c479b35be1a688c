"""CPU linear layers: F.linear on the plain weight (MKL sgemm in float32; oneDNN reordering the weight
on every call in bf16) against oneDNN on a weight packed once (utils/cpu.py pack_linear_weights,
what the engine runs), per GEMM shape of issue 29's real-proportion model and per batch size.

The variants alternate, round after round, so load on a shared host falls on all; the table gives
the median and minimum over rounds of the process's CPU time per call (with one thread, the work
done, little disturbed by other processes; with more it counts their spinning too) and, from the
median, GFLOP/s (2*M*N*K) and GB/s of weight streamed (what bounds batch 1).

Usage: python benchmarks/cpu_linear.py [--threads 1] [--rows 1,4,16,64,256] [--rounds 9]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

PACK_BATCH_HINT = 64  # as nanovllm/utils/cpu.py
# (N, K) of the real-proportion model: qkv, o, gate_up, down, LM head.
SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536), (32000, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in SHAPES:
            weight = torch.randn(n, k, dtype=dtype) * 0.02
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, dtype=dtype)
                variants = {"F.linear": lambda: F.linear(x, weight),
                            "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
                torch.testing.assert_close(variants["packed"]().float(), variants["F.linear"]().float(),
                                           atol=2e-2, rtol=2e-2)
                calls = min(100, max(3, int(3e7 / (2 * m * n * k / 50 + n * k * weight.element_size()))))
                times = {name: [] for name in variants}
                for _ in range(args.rounds):
                    for name, fn in variants.items():
                        start = time.process_time()
                        for _ in range(calls):
                            fn()
                        times[name].append((time.process_time() - start) / calls)
                cells = []
                for name, ts in times.items():
                    median, weight_bytes = statistics.median(ts), n * k * weight.element_size()
                    cells.append(f"{name} {median * 1e6:.0f} us (min {min(ts) * 1e6:.0f}; "
                                 f"{2 * m * n * k / median / 1e9:.0f} GFLOP/s, {weight_bytes / median / 1e9:.0f} GB/s)")
                print(f"{str(dtype).removeprefix('torch.')} M={m} N={n} K={k}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
