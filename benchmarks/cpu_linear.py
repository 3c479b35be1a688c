"""CPU linear layers: F.linear on the plain weight (MKL sgemm in float32; oneDNN reordering the weight
on every call in bf16) against oneDNN on a weight packed once (utils/cpu.py pack_linear_weights,
what the engine runs for prefill) and, on a CPU with AMX, our AMX product (kernels/cpu_amx_linear.cpp,
float32 as bf16x3; what the engine runs for decode steps of 5-256 sequences) and our row product
(kernels/cpu_linear.cpp: up to 4 rows, or 128 in float32 on an AVX2-only build), per GEMM shape of
issue 29's real-proportion model and per batch size. Its GB/s count the weight's own bytes (the
float32 AMX product reads 1.5x as many: three bf16 parts).

The variants alternate, round after round, so load on a shared host falls on all; the table gives
the median and minimum over rounds of the process's CPU time per call (with one thread, the work
done, little disturbed by other processes; with more it counts their spinning too) and, from the
median, GFLOP/s (2*M*N*K) and GB/s of weight streamed (what bounds batch 1), each also as a share
of this machine's measured ceilings, timed the same way first: GFLOP/s of a large square matmul
in the dtype (compute-bound) and GB/s of a sum over a buffer far larger than the caches
(memory-bound). A final JSON line (`"benchmark": "cpu_linear"`) holds every row.

Usage: python benchmarks/cpu_linear.py [--threads 1] [--rows 1,4,16,64,256] [--rounds 9]
"""
import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.kernels import cpu_build  # noqa: E402

PACK_BATCH_HINT = 64  # as nanovllm/utils/cpu.py
# (N, K) of the real-proportion model: qkv, o, gate_up, down, LM head.
SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536), (32000, 512)]


CEILING_GEMM = 2048  # M = N = K of the compute ceiling's matmul
CEILING_BUFFER_BYTES = 512 * 1024 * 1024  # the bandwidth ceiling's buffer: far past any cache
SEED = 0


def cpu_seconds(fn, calls: int, rounds: int) -> float:
    """Median over rounds of the process's CPU time per call, after one untimed call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            fn()
        times.append((time.process_time() - start) / calls)
    return statistics.median(times)


def ceilings(rounds: int) -> dict:
    """GFLOP/s of a CEILING_GEMM-cubed matmul per dtype, and GB/s of a sum over a large buffer."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(CEILING_GEMM, CEILING_GEMM, dtype=dtype)
        b = torch.randn(CEILING_GEMM, CEILING_GEMM, dtype=dtype)
        out[f"{str(dtype).removeprefix('torch.')}_gflops"] = 2 * CEILING_GEMM ** 3 / cpu_seconds(
            lambda: torch.mm(a, b), 2, rounds) / 1e9
    buffer = torch.ones(CEILING_BUFFER_BYTES // 4, dtype=torch.float32)
    out["gb_per_s"] = CEILING_BUFFER_BYTES / cpu_seconds(lambda: buffer.sum(), 2, rounds) / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,16,64,256")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    peak = ceilings(max(3, args.rounds // 3))
    print(f"ceilings, {args.threads} thread(s): float32 {peak['float32_gflops']:.0f} GFLOP/s, bfloat16 "
          f"{peak['bfloat16_gflops']:.0f} GFLOP/s (a {CEILING_GEMM}^3 matmul); {peak['gb_per_s']:.1f} GB/s "
          f"(a sum over {CEILING_BUFFER_BYTES >> 20} MiB)", flush=True)
    kernels = cpu_build.load_fused()
    kernels = None if isinstance(kernels, str) else kernels
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            print("bfloat16: oneDNN has no bf16 product on this CPU (or under this ISA cap): skipped", flush=True)
            continue
        few = None if kernels is None else kernels.few_rows_linear(dtype)
        for n, k in SHAPES:
            weight = torch.randn(n, k, dtype=dtype) * 0.02
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            amx = None if kernels is None else kernels.amx_linear(weight)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k, dtype=dtype)
                variants = {"F.linear": lambda: F.linear(x, weight),
                            "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
                if few is not None and m <= few.max_rows:  # our row product (cpu_linear.cpp)
                    variants["rows"] = lambda: few(x, weight, None)
                if amx is not None and m <= amx.max_rows:
                    variants["amx"] = lambda: amx(x, None)
                for name in variants:
                    torch.testing.assert_close(variants[name]().float(), variants["F.linear"]().float(),
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
                name_of_dtype = str(dtype).removeprefix('torch.')
                for name, ts in times.items():
                    median, weight_bytes = statistics.median(ts), n * k * weight.element_size()
                    gflops, gbps = 2 * m * n * k / median / 1e9, weight_bytes / median / 1e9
                    share_flops, share_bytes = gflops / peak[f"{name_of_dtype}_gflops"], gbps / peak["gb_per_s"]
                    cells.append(f"{name} {median * 1e6:.0f} us (min {min(ts) * 1e6:.0f}; {gflops:.0f} GFLOP/s = "
                                 f"{share_flops:.0%}, {gbps:.0f} GB/s = {share_bytes:.0%})")
                    rows.append({"dtype": name_of_dtype, "m": m, "n": n, "k": k, "variant": name, "us": median * 1e6,
                                 "gflops": gflops, "gflops_share": share_flops, "gb_per_s": gbps,
                                 "gb_share": share_bytes})
                print(f"{name_of_dtype} M={m} N={n} K={k}: " + " | ".join(cells), flush=True)
    print(json.dumps({"benchmark": "cpu_linear", "date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or
                      platform.machine(), "threads": args.threads, "torch": torch.__version__, "ceilings": peak,
                      "rows": rows}))


if __name__ == "__main__":
    main()
