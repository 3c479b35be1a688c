"""Decode attention bandwidth: how close the Triton split-KV kernel gets to the GPU's copy bandwidth.

Workload (defaults; flags change them): Qwen3-0.6B attention shapes (16 query heads, 8 KV heads,
head_dim 128) in bfloat16, a paged KV cache in blocks of 256 reached through shuffled block
tables, batch 256, every sequence with 1024 tokens of context.
Bytes per decode call = K and V read (batch * context * kv_heads * head_dim * 2 bytes, twice)
+ q read + output written. The reference is a device-to-device copy of a large tensor, counted
as bytes read + bytes written. Timing: warm-up, then CUDA events around one replay of a CUDA
graph of back-to-back calls (the GPU's time, not the host's launches).

Run from the repository root: python benchmarks/decode_bandwidth.py. Lists in --batch, --context
and --splits time every combination (--splits forces the split count instead of the kernel's rule).
Prints a table for people, then one JSON line for machines. CUDA only.
"""
import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B
DTYPE = torch.bfloat16
SEED = 0


def time_ms(fn, warmup: int, iters: int) -> float:
    """Mean milliseconds per call of `fn` on the GPU alone: `iters` back-to-back calls captured in one
    CUDA graph (as the engine runs decode steps), replayed between CUDA events. Timed eagerly, a
    small call measures the host's launch cost instead (~70 us for one Triton launch, ~110 us for
    the split kernel and its reduce on an H200; docs/BENCHMARKS.md, GPU decode attention kernel).
    Not for the copy reference (step_profile.copy_bandwidth times it eagerly: captured, it ran
    slow)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) off the capturing stream, as torch asks
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()  # one untimed replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure(batch: int, context: int, block_size: int, splits: int | None, args, gen) -> dict:
    """One decode call's time and bandwidth at this shape; `splits` None = the kernel's own rule."""
    from nanovllm.kernels.decode_attention import choose_num_splits, decode_attention, num_sms, scratch_numel

    device = gen.device
    # A paged cache exactly big enough, blocks handed out in a shuffled order.
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=DTYPE)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device=device, dtype=DTYPE)
    out = torch.empty_like(q)
    rule = choose_num_splits(batch, NUM_KV_HEADS, blocks_per_seq, block_size, num_sms(device))
    num_splits = rule if splits is None else splits
    numel = scratch_numel(batch, NUM_HEADS, HEAD_DIM, num_splits)
    scratch = torch.empty(numel, dtype=torch.float32, device=device) if numel else None

    def decode() -> None:
        decode_attention(q, k_cache, v_cache, block_tables, context_lens, HEAD_DIM ** -0.5,
                         num_splits=num_splits, scratch=scratch, out=out)

    itemsize = torch.empty(0, dtype=DTYPE).element_size()
    decode_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * itemsize + 2 * q.numel() * itemsize
    decode_ms = time_ms(decode, args.warmup, args.iters)
    return {"batch": batch, "context": context, "num_splits": num_splits, "rule_splits": rule,
            "decode_us": round(decode_ms * 1e3, 2), "decode_bytes": decode_bytes,
            "decode_gbps": round(decode_bytes / decode_ms / 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256], help="one or more batch sizes")
    parser.add_argument("--context", type=int, nargs="+", default=[1024],
                        help="tokens of context per sequence (one or more)")
    parser.add_argument("--splits", type=int, nargs="+", default=None,
                        help="split counts to time at every shape (default: the kernel's own rule)")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--copy-gib", type=float, default=1.0, help="size of the tensor the copy reference moves")
    args = parser.parse_args()
    for name in ("batch", "context", "splits"):
        if any(value < 1 for value in getattr(args, name) or []):
            parser.error(f"--{name} {getattr(args, name)}: every value must be >= 1")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_bandwidth.py measures a CUDA kernel and needs a CUDA GPU; none is available")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter runs kernels on the CPU")
    import triton

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(SEED)
    runs = [measure(batch, context, args.block_size, splits, args, gen)
            for batch in args.batch for context in args.context for splits in (args.splits or [None])]

    # The reference: a large device-to-device copy, bytes read + written (step_profile's).
    from step_profile import copy_bandwidth  # beside this script
    copy_bytes = 2 * int(args.copy_gib * 2 ** 30)
    copy_gbps = copy_bandwidth(device, copy_bytes // 2) / 1e9
    for run in runs:
        run["fraction_of_copy"] = round(run["decode_gbps"] / copy_gbps, 4)

    device_name = torch.cuda.get_device_name(device)
    print(f"device {device_name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today().isoformat()}")
    print(f"workload Qwen3-0.6B decode: heads {NUM_HEADS}/{NUM_KV_HEADS} x {HEAD_DIM}, {str(DTYPE)[6:]}, "
          f"block {args.block_size}; device copy {copy_gbps:.0f} GB/s ({copy_bytes / 1e6:.0f} MB moved)")
    print(f"{'batch':>6}{'context':>9}{'splits':>8}{'rule':>6}{'MB moved':>10}{'time us':>10}{'GB/s':>8}{'% of copy':>11}")
    for run in runs:
        print(f"{run['batch']:>6}{run['context']:>9}{run['num_splits']:>8}{run['rule_splits']:>6}"
              f"{run['decode_bytes'] / 1e6:>10.1f}{run['decode_us']:>10.1f}{run['decode_gbps']:>8.0f}"
              f"{100 * run['fraction_of_copy']:>11.1f}")
    first = runs[0]  # the headline (the only run on the defaults), then every run
    print(json.dumps({
        "benchmark": "decode_bandwidth", "date": datetime.date.today().isoformat(), "device": device_name,
        "torch": torch.__version__, "triton": triton.__version__, "model": "Qwen3-0.6B",
        "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE)[6:],
        "block_size": args.block_size, **{k: v for k, v in first.items() if k != "decode_bytes"},
        "copy_gbps": round(copy_gbps, 1), "runs": runs,
    }))


if __name__ == "__main__":
    main()
