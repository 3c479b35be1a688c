"""CPU decode attention alone: the tiled torch backend against the one it replaced, by tile budget
and KV block size.

One decode step of a 4-layer model (4 KV caches, as the engine reads them) for a batch whose
contexts are issue 15's (prompts of 50..300 tokens plus up to 64 generated), blocks shuffled
through the cache. Each configuration runs in turn, round after round, so that load on the host
falls on all of them alike; the table gives the minimum and median over rounds of the process's
CPU time per step (less disturbed by other processes than wall time, which is also reported).
Last, one JSON line.

Usage: python benchmarks/cpu_decode_attention.py [--batch 256] [--dtype float32] [--rounds 15]
           [--threads 1] [--heads 4,2,32]
"""
import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from nanovllm.attention.torch_backend import DECODE_TILE_BYTES, TorchBackend  # noqa: E402
from nanovllm.utils.context import AttentionMetadata  # noqa: E402
from reference_attention import ReferenceTorchBackend  # noqa: E402

NUM_LAYERS = 4
MIN_PROMPT, MAX_PROMPT, MAX_NEW = 50, 300, 64
BLOCK_SIZES = [16, 32, 64, 128, 256]
TILE_BYTES = [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]


def paged_caches(lengths: list[int], block_size: int, heads: tuple[int, int, int], dtype: torch.dtype,
                 gen: torch.Generator) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """NUM_LAYERS (k_cache, v_cache) pairs and one block table (rows padded with -1) for `lengths`."""
    _, num_kv_heads, head_dim = heads
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(blocks)), -1, dtype=torch.int32)
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2)) for _ in range(NUM_LAYERS)]
    return caches, tables


def step(backend, q: torch.Tensor, caches, meta: AttentionMetadata, scale: float) -> None:
    for k_cache, v_cache in caches:
        backend.decode(q, k_cache, v_cache, meta, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", default="4,2,32", help="query heads, KV heads, head_dim")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    heads = tuple(int(x) for x in args.heads.split(","))
    num_heads, _, head_dim = heads
    rng = random.Random(args.seed)
    lengths = [rng.randint(MIN_PROMPT, MAX_PROMPT) + rng.randint(0, MAX_NEW) for _ in range(args.batch)]
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(args.batch, num_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim ** -0.5

    # (name, block size, backend); the old backend at nano-vllm's 256 and at the new CPU default.
    setups = {bs: paged_caches(lengths, bs, heads, dtype, gen) for bs in BLOCK_SIZES}
    configs = [(f"old, block {bs}", bs, ReferenceTorchBackend()) for bs in (32, 256)]
    configs += [(f"tiled {DECODE_TILE_BYTES >> 10} KiB, block {bs}", bs, TorchBackend()) for bs in BLOCK_SIZES]
    configs += [(f"tiled {tb >> 10} KiB, block 32", 32, TorchBackend(tb)) for tb in TILE_BYTES if tb != DECODE_TILE_BYTES]
    cpu_ms: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    wall_ms: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, bs, backend in configs:
            caches, tables = setups[bs]
            meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.empty(0, dtype=torch.int64),
                                     context_lens=context_lens, block_tables=tables)  # a new step: a new plan
            wall, cpu = time.perf_counter(), time.process_time()
            step(backend, q, caches, meta, scale)
            cpu_ms[name].append(1e3 * (time.process_time() - cpu))
            wall_ms[name].append(1e3 * (time.perf_counter() - wall))

    print(f"decode attention, {NUM_LAYERS} layers, batch {args.batch}, contexts {min(lengths)}..{max(lengths)}, "
          f"{args.dtype}, heads {args.heads}, {args.threads} thread(s), {args.rounds} rounds, "
          f"load {min(loads):.1f}..{max(loads):.1f}")
    width = max(len(name) for name in cpu_ms)
    print(f"{'configuration':<{width}}  cpu ms min  cpu ms median  wall ms median")
    for name in cpu_ms:
        print(f"{name:<{width}}  {min(cpu_ms[name]):10.1f}  {statistics.median(cpu_ms[name]):13.1f}  "
              f"{statistics.median(wall_ms[name]):14.1f}")
    print(json.dumps({
        "benchmark": "cpu_decode_attention", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "batch": args.batch, "dtype": args.dtype, "heads": args.heads, "threads": args.threads,
        "rounds": args.rounds, "load_1m": [round(x, 2) for x in loads],
        "cpu_ms": {n: {"min": round(min(t), 2), "median": round(statistics.median(t), 2)} for n, t in cpu_ms.items()},
        "wall_ms_median": {n: round(statistics.median(t), 2) for n, t in wall_ms.items()},
    }))


if __name__ == "__main__":
    main()
