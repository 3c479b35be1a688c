"""Eager vs torch.compile for the hot layer functions, at Qwen3-0.6B decode shapes.

Decides what `compile_mode="auto"` (nanovllm/config.py) means per device: run it on the device in question. Prints a
table (microseconds per call, eager and compiled, and the one-off compile time) and a final
JSON line. Usage: python benchmarks/compiled_layers.py [--device cpu|cuda] [--tokens 256]
"""
import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm.layers import rotary_embedding  # noqa: E402
from nanovllm.layers.sampler import exponential_race, scale_by_temperature  # noqa: E402
from nanovllm.platform import torch as reference  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 3072, 16, 8, 128, 151936  # Qwen3-0.6B


def time_call(fn, args, repeats: int, device: torch.device) -> float:
    for _ in range(3):  # warm-up
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=256, help="rows per call (a decode batch)")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    n = args.tokens

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, device=device, dtype=dt)

    rope = rotary_embedding.RotaryEmbedding(HEAD_DIM, 4096, 1e6).to(device)
    cases = {
        "rms_norm": (reference.rms_norm.__wrapped__, (rand(n, HIDDEN), rand(HIDDEN), 1e-6)),
        "add_rms_norm": (reference.add_rms_norm.__wrapped__, (rand(n, HIDDEN), rand(n, HIDDEN), rand(HIDDEN), 1e-6)),
        "rotary": (rotary_embedding.rotate_qk.__wrapped__,
                   (torch.randint(0, 4096, (n,), device=device), rand(n, HEADS, HEAD_DIM), rand(n, KV_HEADS, HEAD_DIM),
                    rope.cos_sin_cache)),
        "silu_and_mul": (reference.silu_and_mul.__wrapped__, (rand(n, 2 * INTERMEDIATE),)),
        "sampler": (lambda logits, t, noise: exponential_race.__wrapped__(scale_by_temperature.__wrapped__(logits, t),
                                                                          noise),
                    (rand(n, VOCAB, dt=torch.float32), torch.full((n,), 0.6, device=device),
                     torch.empty(n, VOCAB, device=device).exponential_())),
    }
    rows = []
    for name, (fn, fn_args) in cases.items():
        eager = time_call(fn, fn_args, args.repeats, device)
        compiled = torch.compile(fn, dynamic=True)
        start = time.perf_counter()
        compiled(*fn_args)
        compile_s = time.perf_counter() - start
        rows.append({"op": name, "eager_us": round(eager, 1),
                     "compiled_us": round(time_call(compiled, fn_args, args.repeats, device), 1),
                     "compile_s": round(compile_s, 1)})
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"device: {label} ({device.type}), dtype {dtype}, rows {n}, torch {torch.__version__}")
    print(f"{'op':<14}{'eager us':>12}{'compiled us':>14}{'compile s':>12}")
    for r in rows:
        print(f"{r['op']:<14}{r['eager_us']:>12}{r['compiled_us']:>14}{r['compile_s']:>12}")
    print(json.dumps({"benchmark": "compiled_layers", "device": label, "device_type": device.type, "dtype": str(dtype),
                      "rows": n, "torch": torch.__version__, "date": date.today().isoformat(), "results": rows}))


if __name__ == "__main__":
    main()
