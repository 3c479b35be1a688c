"""Decode attention bandwidth: how close the Triton split-KV kernel gets to the GPU's copy bandwidth.

Workload (defaults; flags change them): Qwen3-0.6B attention shapes (16 query heads, 8 KV heads,
head_dim 128) in bfloat16, a paged KV cache in blocks of 256 reached through shuffled block
tables, batch 256, every sequence with 1024 tokens of context.
Bytes per decode call = K and V read (batch * context * kv_heads * head_dim * 2 bytes, twice)
+ q read + output written. The reference is a device-to-device copy of a large tensor, counted
as bytes read + bytes written. Timing: warm-up, then CUDA events around back-to-back calls.

Run from the repository root: python benchmarks/decode_bandwidth.py
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
    """Mean milliseconds per call of `fn`, from CUDA events around `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024, help="tokens of context per sequence")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--copy-gib", type=float, default=1.0, help="size of the tensor the copy reference moves")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode_bandwidth.py measures a CUDA kernel and needs a CUDA GPU; none is available")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter runs kernels on the CPU")
    import triton

    from nanovllm.kernels.decode_attention import choose_num_splits, decode_attention, num_sms, scratch_numel

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(SEED)
    batch, context, block_size = args.batch, args.context, args.block_size

    # 1. A paged cache exactly big enough, blocks handed out in a shuffled order.
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
    num_splits = choose_num_splits(batch, NUM_KV_HEADS, blocks_per_seq, block_size, num_sms(device))
    numel = scratch_numel(batch, NUM_HEADS, HEAD_DIM, num_splits)
    scratch = torch.empty(numel, dtype=torch.float32, device=device) if numel else None

    def decode() -> None:
        decode_attention(q, k_cache, v_cache, block_tables, context_lens, HEAD_DIM ** -0.5,
                         num_splits=num_splits, scratch=scratch, out=out)

    itemsize = torch.empty(0, dtype=DTYPE).element_size()
    decode_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * itemsize + 2 * q.numel() * itemsize
    decode_ms = time_ms(decode, args.warmup, args.iters)

    # 2. The reference: a large device-to-device copy, bytes read + written.
    src = torch.empty(int(args.copy_gib * 2 ** 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), args.warmup, args.iters)
    copy_bytes = 2 * src.numel()
    del src, dst

    decode_gbps, copy_gbps = decode_bytes / decode_ms / 1e6, copy_bytes / copy_ms / 1e6
    device_name = torch.cuda.get_device_name(device)
    print(f"device {device_name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today().isoformat()}")
    print(f"workload Qwen3-0.6B decode: heads {NUM_HEADS}/{NUM_KV_HEADS} x {HEAD_DIM}, {str(DTYPE)[6:]}, "
          f"block {block_size}, batch {batch}, context {context}, splits {num_splits}")
    print(f"{'what':<22}{'MB moved':>12}{'time us':>12}{'GB/s':>10}{'% of copy':>11}")
    print(f"{'device copy (d2d)':<22}{copy_bytes / 1e6:>12.1f}{copy_ms * 1e3:>12.1f}{copy_gbps:>10.0f}{100.0:>11.1f}")
    print(f"{'decode attention':<22}{decode_bytes / 1e6:>12.1f}{decode_ms * 1e3:>12.1f}{decode_gbps:>10.0f}"
          f"{100 * decode_gbps / copy_gbps:>11.1f}")
    print(json.dumps({
        "benchmark": "decode_bandwidth", "date": datetime.date.today().isoformat(), "device": device_name,
        "torch": torch.__version__, "triton": triton.__version__, "model": "Qwen3-0.6B",
        "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(DTYPE)[6:],
        "block_size": block_size, "batch": batch, "context": context, "num_splits": num_splits,
        "decode_us": round(decode_ms * 1e3, 2), "decode_gbps": round(decode_gbps, 1),
        "copy_gbps": round(copy_gbps, 1), "fraction_of_copy": round(decode_gbps / copy_gbps, 4),
    }))


if __name__ == "__main__":
    main()
