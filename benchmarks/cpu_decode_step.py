"""One whole CPU decode step of the engine (model forward and sampling), by decode tile budget and
by how a tile is attended (batched matmuls or SDPA).

cpu_decode_attention.py times the attention alone on shuffled blocks; this times what a decode
step costs inside the engine: issue 15's tiny Qwen3 checkpoint (built once, as vs_vllm_cpu.py
builds it), `--batch` random prompts of 50..300 tokens prefilled and decoded a few steps by the
engine itself (so the blocks lie as the block manager placed them), then the same scheduled
decode batch run again and again with the torch backend's tile budget and formulation switched
between rounds, so that load on the host falls on every configuration alike. Prints the median and minimum wall
milliseconds per step, then one JSON line.

Usage: python benchmarks/cpu_decode_step.py [--batch 256] [--dtype float32] [--rounds 15]
           [--tile-kib 1024 2048 4096 8192] [--formulations matmul sdpa]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.attention import torch_backend  # noqa: E402
from vs_vllm_cpu import MAX_MODEL_LEN, MAX_PROMPT, MIN_PROMPT, build_checkpoint  # noqa: E402

STEPS_PER_ROUND = 3
PREFILL_STEPS = 40  # enough engine steps to prefill 256 prompts and decode a few tokens each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tile-kib", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--formulations", nargs="+", default=["matmul", "sdpa"], choices=["matmul", "sdpa"],
                        help="matmul: the default rule (batched matmuls with <= 2 KV heads in float32); sdpa: never")
    parser.add_argument("--workdir", default=str(REPO / "checkpoints"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.batch < 1 or args.rounds < 1 or min(args.tile_kib) < 1:
        parser.error("--batch, --rounds and --tile-kib must be >= 1")

    llm = LLM(build_checkpoint(args.workdir), dtype=args.dtype, max_model_len=MAX_MODEL_LEN)
    rng = random.Random(args.seed)
    vocab = llm.config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=MAX_MODEL_LEN - MAX_PROMPT, ignore_eos=True)
    for _ in range(args.batch):
        llm.add_request([rng.randrange(vocab) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))], params)
    for _ in range(PREFILL_STEPS):
        llm.step()
    batch = llm.scheduler.schedule()  # a decode step, its blocks allocated; run as often as needed
    if batch.is_prefill or len(batch.seqs) != args.batch:
        raise RuntimeError(f"expected a decode step of {args.batch} sequences after {PREFILL_STEPS} steps")
    runner, backend = llm.model_runner, llm.model_runner.backend
    contexts = [len(seq) for seq in batch.seqs]

    max_kv_heads = {"matmul": torch_backend.MATMUL_DECODE_MAX_KV_HEADS, "sdpa": 0}
    configs = [(f"{form}, {kib} KiB", form, kib) for form in args.formulations for kib in args.tile_kib]
    wall_ms: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, form, kib in configs:
            torch_backend.MATMUL_DECODE_MAX_KV_HEADS = max_kv_heads[form]
            backend.decode_tile_bytes = kib << 10
            runner.run(batch.seqs, False)  # the first step of a configuration plans its tiles anew
            start = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                runner.run(batch.seqs, False)
            wall_ms[name].append(1e3 * (time.perf_counter() - start) / STEPS_PER_ROUND)
    llm.exit()

    print(f"decode step, batch {args.batch}, contexts {min(contexts)}..{max(contexts)}, {args.dtype}, "
          f"{llm.config.cpu_threads} thread(s), {args.rounds} rounds, load {min(loads):.1f}..{max(loads):.1f}")
    width = max(len(name) for name in wall_ms)
    print(f"{'configuration':<{width}}  wall ms median  wall ms min")
    for name, times in wall_ms.items():
        print(f"{name:<{width}}  {statistics.median(times):14.2f}  {min(times):11.2f}")
    print(json.dumps({
        "benchmark": "cpu_decode_step", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "batch": args.batch, "dtype": args.dtype, "threads": llm.config.cpu_threads, "rounds": args.rounds,
        "load_1m": [round(x, 2) for x in loads],
        "wall_ms": {name: {"median": round(statistics.median(t), 2), "min": round(min(t), 2)}
                    for name, t in wall_ms.items()},
    }))


if __name__ == "__main__":
    main()
