"""What structured outputs cost: output tok/s of the same workload with and without a JSON schema.

The workload: `--seqs` prompts of random token ids (random.seed(0)), each allowed `--max-tokens`
tokens, temperature 1.0 with per-request seeds, on the tiny random-weight Qwen3 (the test
checkpoint: a 640-token byte-level BPE vocabulary) or `--model DIR`. Run 1 is unconstrained,
with ignore_eos so every sequence makes max_tokens; run 2 constrains every output to
SCHEMA, one object whose free string a random model rarely closes, so most sequences also run
to max_tokens (the table gives each run's token count; throughput counts the tokens made).
Each kind is warmed up once, so the grammar is compiled (and the vocabulary read) before the
clock starts, then the timed runs alternate (unconstrained, schema, unconstrained, ...) so a
shared host's changing load falls on both alike; the median of each kind is reported. What remains is the per-step cost, filling each row's
token bitmask (xgrammar), masking the logits, and advancing each matcher by its token, plus the
plain loop a grammar request keeps the engine on. Prints a table, then one JSON line.

Usage: python benchmarks/structured_outputs.py [--seqs 16] [--max-tokens 128] [--repeats 3] [--model DIR]
"""
import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.testing.synthetic import build_checkpoint  # noqa: E402

# Free text inside JSON: the object stays open while the model writes, so the batch stays full.
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
PROMPT_LEN = (16, 64)  # random prompt lengths, in tokens


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, schema: dict | None) -> tuple[float, int]:
    """Seconds and output tokens of one generate call over the workload."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=schema is None,
                             structured_outputs=None if schema is None else {"json": schema})
              for i in range(len(prompts))]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o["token_ids"]) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each kind; the median is reported")
    parser.add_argument("--model", help="a checkpoint directory; default: the tiny random-weight Qwen3")
    args = parser.parse_args()
    model = args.model or build_checkpoint(tempfile.mkdtemp(prefix="nanovllm-so-bench-"), "qwen3")
    llm = LLM(model, kvcache_block_size=16, num_kvcache_blocks=1024)
    random.seed(0)
    vocab = min(llm.config.hf_config.vocab_size, 600)  # ordinary text tokens (the special ones come last)
    prompts = [[random.randrange(vocab) for _ in range(random.randint(*PROMPT_LEN))] for _ in range(args.seqs)]
    kinds = {"unconstrained": None, "json_schema": SCHEMA}
    for schema in kinds.values():
        run(llm, prompts, args.max_tokens, schema)  # warm-up (and, for the schema, its compilation)
    timed: dict[str, list[tuple[float, int]]] = {name: [] for name in kinds}
    for _ in range(args.repeats):
        for name, schema in kinds.items():
            timed[name].append(run(llm, prompts, args.max_tokens, schema))
    results = {}
    for name, runs in timed.items():
        seconds, tokens = statistics.median(t for t, _ in runs), runs[0][1]
        results[name] = {"seconds": round(seconds, 3), "tokens": tokens, "tok_s": round(tokens / seconds, 1)}
    cost = 1 - results["json_schema"]["tok_s"] / results["unconstrained"]["tok_s"]
    print(f"{args.seqs} sequences x up to {args.max_tokens} tokens, {Path(model).name}, {cpu_name()}")
    print(f"{'run':<15} {'tokens':>7} {'seconds':>8} {'tok/s':>8}")
    for name, r in results.items():
        print(f"{name:<15} {r['tokens']:>7} {r['seconds']:>8.3f} {r['tok_s']:>8.1f}")
    print(f"throughput cost of the schema: {cost:.1%}")
    print(json.dumps({"benchmark": "structured_outputs", "device": cpu_name(), "date": str(date.today()),
                      "seqs": args.seqs, "max_tokens": args.max_tokens, "repeats": args.repeats, **results,
                      "cost": round(cost, 4)}))


if __name__ == "__main__":
    main()
