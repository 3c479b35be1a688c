"""What an fp8 KV cache costs in accuracy: the same greedy batch with kv_cache_dtype "auto" (the
reference) and each fp8 format, compared token by token (nanovllm/testing/accuracy.py): the
chosen tokens' logprob difference, mean and max over the batch while the runs agree, and greedy
agreement (the share of tokens before each sequence's first difference; identical sequences).

Models: the tiny random-weight checkpoints the tests use (qwen3, qwen2, llama), and with
--synthetic-0.6b a random-weight checkpoint of Qwen3-0.6B's shapes (slow on CPU in float32).
Random weights make flatter distributions than a trained model's, so greedy ties are commoner:
read greedy agreement as a lower bound. Fixed seeds; prints a table, then one JSON line.
Usage: python benchmarks/kv_cache_accuracy.py [--device cpu] [--num-seqs 8] [--max-tokens 32]
"""
import argparse
import json
import platform
import random
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.testing.accuracy import compare_runs  # noqa: E402
from nanovllm.testing.synthetic import build_checkpoint, build_qwen3_0_6b  # noqa: E402

FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
TOP_LOGPROBS = 5  # for the near-tie check at a first difference
PROMPT_VOCAB = 200  # prompt ids drawn below this (every tiny checkpoint's vocabulary is larger)


def run(path: str, kv_cache_dtype: str, prompts: list[list[int]], max_tokens: int, args) -> list[dict]:
    llm = LLM(path, device=args.device, dtype=args.dtype, kv_cache_dtype=kv_cache_dtype, kvcache_block_size=16,
              max_model_len=512, max_num_seqs=len(prompts), num_kvcache_blocks=len(prompts) * 32)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.exit()
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--synthetic-0.6b", dest="qwen3_0_6b", action="store_true",
                        help="also a random-weight Qwen3-0.6B (float32 on CPU: minutes)")
    parser.add_argument("--workdir", default=tempfile.mkdtemp(prefix="kv_accuracy_"))
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(PROMPT_VOCAB) for _ in range(rng.randrange(8, 96))] for _ in range(args.num_seqs)]
    models = {arch: build_checkpoint(str(Path(args.workdir) / arch), arch) for arch in ("qwen3", "qwen2", "llama")}
    if args.qwen3_0_6b:
        models["qwen3-0.6b (random)"] = build_qwen3_0_6b(str(Path(args.workdir) / "qwen3-0.6b"), torch.float32)
    rows = []
    for model, path in models.items():
        start = time.perf_counter()
        reference = run(path, "auto", prompts, args.max_tokens, args)
        for fmt in FP8_FORMATS:
            a = compare_runs(reference, run(path, fmt, prompts, args.max_tokens, args))
            rows.append(dict(model=model, kv_cache_dtype=fmt, mean_abs_logprob_diff=round(a.mean_abs_logprob_diff, 5),
                             max_abs_logprob_diff=round(a.max_abs_logprob_diff, 5),
                             greedy_agreement=round(a.greedy_agreement, 4),
                             identical_sequences=f"{a.identical_sequences}/{a.num_sequences}",
                             near_tie_divergences=a.near_tie_divergences))
        print(f"# {model}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    header = ["model", "kv_cache_dtype", "mean_abs_logprob_diff", "max_abs_logprob_diff", "greedy_agreement",
              "identical_sequences", "near_tie_divergences"]
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[h]) for h in header))
    print(json.dumps(dict(benchmark="kv_cache_accuracy", date=date.today().isoformat(), device=args.device,
                          cpu=platform.processor() or platform.machine(), torch=torch.__version__,
                          num_seqs=args.num_seqs, max_tokens=args.max_tokens, rows=rows)))


if __name__ == "__main__":
    main()
