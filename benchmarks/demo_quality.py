"""Quality numbers a trained model makes meaningful, on the demo model (nanovllm/demo_model.py):

1. n-gram speculative decoding on code: the acceptance rate (accepted / proposed draft tokens) and
   the tokens each target forward pass yields, for several k, greedy; and whether the output is
   the same as without speculation (it must be).
2. FP8 KV cache against bf16: perplexity of held-out standard-library text (files the demo model
   never trained on) with kv_cache_dtype "auto" (bf16), "fp8_e4m3" and "fp8_e5m2", and the greedy
   agreement of each fp8 run with the bf16 run (nanovllm/testing/accuracy.py: the share of tokens
   before each sequence's first difference; the chosen tokens' mean |logprob difference|).

Perplexity is teacher-forced through the engine's own forward pass: each held-out window is one
prompt (max_tokens=1, prefix cache off), and the hidden states of every prompt position are read
from the runner's prefill step and turned into logits by the model's own LM head. With an fp8
cache the engine's prefill attends from the quantised cache, so the numbers include its error.

Prompts and windows are drawn with a fixed seed from the held-out files. Prints a table, then one
JSON line. Usage: python benchmarks/demo_quality.py [--model DIR] [--num-prompts 16] [--max-tokens 64]
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.demo_model import default_model, read_corpus  # noqa: E402
from nanovllm.testing.accuracy import compare_runs  # noqa: E402

HELD_OUT_BYTES = 2_000_000  # all of the held-out files (about 0.6 MB with Python 3.11's library)
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
SPEC_K = (2, 4, 6)  # proposal lengths to measure
TOP_LOGPROBS = 5  # for the near-tie check at the first greedy difference


def held_out_tokens(tokenizer) -> list[list[int]]:
    """Each held-out file's tokens (files of fewer than 2 tokens dropped)."""
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in read_corpus(HELD_OUT_BYTES, True)]
    return [ids for ids in encoded if len(ids) > 1]


def draw_windows(files: list[list[int]], count: int, length: int, rng: random.Random) -> list[list[int]]:
    """`count` windows of `length` tokens at random places in files long enough to hold one."""
    long_enough = [ids for ids in files if len(ids) >= length]
    windows = []
    for _ in range(count):
        ids = rng.choice(long_enough)
        start = rng.randrange(len(ids) - length + 1)
        windows.append(ids[start:start + length])
    return windows


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    """exp(mean next-token NLL) over every position of every window, through the engine's prefill."""
    runner = llm.model_runner
    captured: list[torch.Tensor] = []
    original = runner._forward

    def capture(step):
        inputs, hidden_states = original(step)
        if step.is_prefill:
            captured.append(hidden_states.clone())  # [window tokens, hidden]
        return inputs, hidden_states

    runner._forward = capture
    nll, count = 0.0, 0
    try:
        for window in windows:
            captured.clear()
            llm.generate([window], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            hidden = torch.cat(captured)
            assert hidden.shape[0] == len(window), (hidden.shape, len(window))
            with torch.inference_mode():
                logits = runner.model.compute_logits(hidden).float()  # [window tokens, vocab]
            targets = torch.tensor(window[1:], device=logits.device)
            nll += torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum").item()
            count += len(window) - 1
    finally:
        del runner._forward  # the class's method again
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the demo model, built if missing)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--num-prompts", type=int, default=16, help="code prompts for speculation and agreement")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per code prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens generated per prompt")
    parser.add_argument("--ppl-windows", type=int, default=32, help="held-out windows for perplexity")
    parser.add_argument("--ppl-len", type=int, default=256, help="tokens per perplexity window")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    path = args.model or default_model()
    started = time.perf_counter()
    with LLM(path, device=args.device, dtype="float32") as llm:
        files = held_out_tokens(llm.tokenizer)
        rng = random.Random(args.seed)
        prompts = draw_windows(files, args.num_prompts, args.prompt_len, rng)
        windows = draw_windows(files, args.ppl_windows, args.ppl_len, rng)
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        plain = [out["token_ids"] for out in llm.generate(prompts, greedy, use_tqdm=False)]

    spec_rows = []
    for k in SPEC_K:
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
        with LLM(path, device=args.device, dtype="float32", speculative_config=spec) as llm:
            outs = [out["token_ids"] for out in llm.generate(prompts, greedy, use_tqdm=False)]
            stats = llm.stats()
        spec_rows.append(dict(k=k, proposed=stats.spec_proposed_tokens, accepted=stats.spec_accepted_tokens,
                              acceptance_rate=round(stats.spec_acceptance_rate or 0.0, 4),
                              tokens_per_forward=round(stats.spec_tokens_per_forward or 0.0, 3),
                              same_as_plain_greedy=outs == plain))

    kv_rows, reference = [], None
    with_logprobs = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
    for kv in KV_DTYPES:
        with LLM(path, device=args.device, dtype="bfloat16", kv_cache_dtype=kv, enable_prefix_caching=False) as llm:
            ppl = perplexity(llm, windows)
            outs = llm.generate(prompts, with_logprobs, use_tqdm=False)
        row = dict(kv_cache_dtype=kv, perplexity=round(ppl, 4))
        if reference is None:
            reference = outs
        else:
            a = compare_runs(reference, outs)
            row.update(greedy_agreement=round(a.greedy_agreement, 4), identical_sequences=a.identical_sequences,
                       mean_abs_logprob_diff=round(a.mean_abs_logprob_diff, 5),
                       near_tie_divergences=a.near_tie_divergences)
        kv_rows.append(row)
    with LLM(path, device=args.device, dtype="float32", enable_prefix_caching=False) as llm:
        float32_ppl = perplexity(llm, windows)

    print(f"model {path}; {args.num_prompts} code prompts of {args.prompt_len} tokens, {args.max_tokens} greedy "
          f"tokens each; perplexity over {args.ppl_windows} held-out windows of {args.ppl_len} tokens")
    print(f"\nn-gram speculation (prompt_lookup 1..4, float32)\n{'k':>3} {'proposed':>9} {'accepted':>9} "
          f"{'accept':>7} {'tok/fwd':>8} {'same':>5}")
    for r in spec_rows:
        print(f"{r['k']:>3} {r['proposed']:>9} {r['accepted']:>9} {r['acceptance_rate']:>7.3f} "
              f"{r['tokens_per_forward']:>8.3f} {str(r['same_as_plain_greedy']):>5}")
    print(f"\nKV cache, model in bfloat16 (float32 perplexity: {float32_ppl:.3f})\n{'kv_cache_dtype':<10} "
          f"{'ppl':>8} {'agree':>7} {'identical':>10} {'|dlogp|':>9}")
    for r in kv_rows:
        agree = f"{r['greedy_agreement']:.3f}" if "greedy_agreement" in r else "ref"
        identical = f"{r['identical_sequences']}/{args.num_prompts}" if "identical_sequences" in r else "ref"
        diff = f"{r['mean_abs_logprob_diff']:.4f}" if "mean_abs_logprob_diff" in r else "ref"
        print(f"{r['kv_cache_dtype']:<14} {r['perplexity']:>8.3f} {agree:>7} {identical:>10} {diff:>9}")
    print(json.dumps({"model": path, "seed": args.seed, "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "ppl_windows": args.ppl_windows, "ppl_len": args.ppl_len,
                      "float32_perplexity": round(float32_ppl, 4), "speculative": spec_rows, "kv_cache": kv_rows,
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
