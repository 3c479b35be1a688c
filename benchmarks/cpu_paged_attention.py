"""CPU paged attention: the torch backend (blocks gathered into tiles, then SDPA or matmuls) against
the in-place C++ kernel (platform/cpu/attention.py), for decode, for a prefill chunk over a
cached prefix and for fresh prompts (torch's SDPA on the contiguous K/V against the kernel reading
them from the cache), on issue 29's real-proportion shapes (8 query / 4 KV heads of 64, blocks of 32).

On a CPU with AMX the kernel runs twice: with its bf16 prefill tiles on AMX (cpu_amx_attention.cpp,
the default; "kernel") and on AVX-512 ("kernel-avx512", `use_amx(False)`).

One step of every layer's attention (NUM_LAYERS caches, so the data comes from memory as in the
engine), the backends alternating round after round so that load on a shared host falls on
both; the table gives the median and minimum over rounds of the process's CPU time per layer
(less disturbed by other processes than wall time; with one thread it is the work done) and the
same for wall time. The outputs are compared first. Last, one JSON line.

Usage: python benchmarks/cpu_paged_attention.py [--batch 64] [--threads 1] [--rounds 9]
"""
import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.kernels import cpu_build  # noqa: E402
from nanovllm.platform.cpu.attention import CpuPagedBackend  # noqa: E402
from nanovllm.utils.context import AttentionMetadata  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 8, 4, 64, 32, 8
MIN_CONTEXT, MAX_CONTEXT = 100, 628  # prompts of 100..500 plus up to 128 generated
PREFIX, CHUNK = 256, 256  # the prefill case: a 256-token chunk over a 256-token cached prefix, 2 sequences
FRESH, FRESH_SEQS = 320, 16  # the fresh case: 16 prompts of 320 tokens, no cached prefix


def paged(lengths: list[int], dtype: torch.dtype, gen: torch.Generator):
    blocks = [-(-n // BLOCK_SIZE) for n in lengths]
    order = torch.randperm(sum(blocks), generator=gen).tolist()
    tables = torch.full((len(lengths), max(blocks)), -1, dtype=torch.int32)
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2)) for _ in range(NUM_LAYERS)], tables


def case(mode: str, batch: int, dtype: torch.dtype):
    """(make metadata, run every layer with a backend) for one case."""
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    if mode == "decode":
        lengths = [rng.randint(MIN_CONTEXT, MAX_CONTEXT) for _ in range(batch)]
        caches, tables = paged(lengths, dtype, gen)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        meta = lambda: AttentionMetadata(False, torch.zeros(batch, dtype=torch.long), block_tables=tables,
                                         context_lens=torch.tensor(lengths, dtype=torch.int32))
        return meta, lambda backend, m: [backend.decode(q, kc, vc, m, HEAD_DIM ** -0.5) for kc, vc in caches]
    if mode == "fresh":  # torch attends the contiguous K/V with SDPA; the kernel reads the same from the cache
        caches, tables = paged([FRESH] * FRESH_SEQS, dtype, gen)
        rows = FRESH * FRESH_SEQS
        slots = (tables.long().unsqueeze(-1) * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten(1)[:, :FRESH].flatten()
        kv = [tuple(c.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] for c in layer) for layer in caches]
        q = torch.randn(rows, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        cu = torch.arange(0, rows + 1, FRESH, dtype=torch.int32)
        meta = lambda paged_tables: AttentionMetadata(True, torch.zeros(rows, dtype=torch.long), cu_seqlens_q=cu,
                                                      cu_seqlens_k=cu, max_seqlen_q=FRESH, max_seqlen_k=FRESH,
                                                      block_tables=paged_tables, seqlens_q=[FRESH] * FRESH_SEQS,
                                                      seqlens_k=[FRESH] * FRESH_SEQS)
        return lambda: None, lambda backend, _: [
            backend.prefill(q, k, v, kc, vc, meta(tables if backend.prefill_from_cache else None), HEAD_DIM ** -0.5)
            for (kc, vc), (k, v) in zip(caches, kv)]
    total = PREFIX + CHUNK
    caches, tables = paged([total, total], dtype, gen)
    q = torch.randn(2 * CHUNK, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    cu = lambda n: torch.tensor([0, n, 2 * n], dtype=torch.int32)
    meta = lambda: AttentionMetadata(True, torch.zeros(2 * CHUNK, dtype=torch.long), cu_seqlens_q=cu(CHUNK),
                                     cu_seqlens_k=cu(total), max_seqlen_q=CHUNK, max_seqlen_k=total,
                                     block_tables=tables, seqlens_q=[CHUNK] * 2, seqlens_k=[total] * 2)
    return meta, lambda backend, m: [backend.prefill(q, None, None, kc, vc, m, HEAD_DIM ** -0.5) for kc, vc in caches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="decode rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_build.load()
    if isinstance(kernel, str):
        sys.exit(kernel)
    amx = kernel.use_amx(True)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for mode in ("decode", "prefill", "fresh"):
            meta, run = case(mode, args.batch, dtype)
            backends = {"torch": TorchBackend(), "kernel": CpuPagedBackend(kernel)}
            if amx:
                backends["kernel-avx512"] = CpuPagedBackend(kernel)

            def timed(name: str, m):
                kernel.use_amx(name != "kernel-avx512")
                c, w = time.process_time(), time.perf_counter()
                outs = run(backends[name], m)
                return outs, time.process_time() - c, time.perf_counter() - w

            outs = {name: timed(name, meta())[0] for name in backends}
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs["torch"], outs["kernel"]))
            cpu, wall = ({name: [] for name in backends} for _ in range(2))
            for _ in range(args.rounds):
                for name in backends:
                    _, c, w = timed(name, meta())
                    cpu[name].append(c / NUM_LAYERS * 1e3)
                    wall[name].append(w / NUM_LAYERS * 1e3)
            what = {"decode": f"batch {args.batch}", "prefill": f"2 x {CHUNK} over {PREFIX}",
                    "fresh": f"{FRESH_SEQS} x {FRESH}, no prefix (torch: SDPA)"}[mode]
            cells = " | ".join(f"{name}: CPU {statistics.median(cpu[name]):.2f} (min {min(cpu[name]):.2f}), wall "
                               f"{statistics.median(wall[name]):.2f} ms" for name in backends)
            print(f"{mode} {what}, {str(dtype).removeprefix('torch.')}, {args.threads} thread(s), "
                  f"max |diff| {diff:.1e}: {cells}", flush=True)
            results.append({"mode": mode, "dtype": str(dtype).removeprefix("torch."), "max_abs_diff": diff,
                            **{f"{name}_{what}_ms": round(statistics.median(times[name]), 3)
                               for name in backends for what, times in (("cpu", cpu), ("wall", wall))}})
    kernel.use_amx(True)
    print(json.dumps({"benchmark": "cpu_paged_attention", "threads": args.threads, "batch": args.batch,
                      "rounds": args.rounds, "amx": amx, "results": results}))


if __name__ == "__main__":
    main()
