"""Greedy parity against HF transformers on a GPU: float32 must be identical; bfloat16 agreement is measured.

float32: tiny random-weight Qwen3 and Qwen2 checkpoints (built here in seconds) run through the
engine on the device with every attention backend that runs there (triton, torch, and
flash_attn when installed), with CUDA graphs and with enforce_eager, on two workloads:
  mixed     10 prompts of 1..64 tokens around block boundaries, a roomy KV cache;
  pressure  8 prompts, 5 sharing a 48-token prefix, a KV cache too small for all of them
            (preemption), 40 tokens per step (chunked prefill), generated twice (prefix hits).
Every sequence's tokens must equal HF transformers' float32 greedy tokens computed on CPU, the
reference. flash_attn pages by 256 tokens, so it runs the mixed workload only.

bfloat16: the engine in bfloat16 (default backend, CUDA graphs) against HF in bfloat16 on the same
device, mixed workload. Random weights make near-ties common and the two round differently, so
sequences drift apart; reported is the agreement: tokens generated before each sequence's first
difference, over all tokens generated.

Prints a table, then one JSON line. Exit status 1 if any float32 sequence differs.
Run from the repository root: PYTHONPATH=. python scripts/gpu_parity.py [--device cuda]
(--device cpu runs the same checks on CPU with the torch backend, eager; the tests use it.)
"""
import argparse
import importlib.util
import json
import random
import sys
import tempfile
from datetime import datetime, timezone
from typing import NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.testing.synthetic import build_checkpoint

MAX_TOKENS = 24  # as tests/test_parity.py
PROMPT_VOCAB = 200  # prompt ids drawn below this: ordinary text tokens of the synthetic tokenizer
SEED = 0
SMALL_BLOCK = 16  # the Triton and torch backends page by 16 here: many block boundaries in short prompts
FLASH_ATTN_BLOCK = 256  # flash-attn's paged KV takes multiples of 256
# More than any workload's batch; on CUDA, 5 decode graphs to capture instead of the default 36.
MAX_NUM_SEQS = 16
# (name, build_checkpoint arguments): GQA with 3 query heads per KV head; Qwen2 has q/k/v biases.
CHECKPOINTS = {"qwen3": dict(arch="qwen3"), "qwen2": dict(arch="qwen2", hidden_size=96)}


class Workload(NamedTuple):
    name: str
    prompts: list[list[int]]
    calls: int  # generate() calls in a row over the same prompts; the later ones hit the prefix cache
    engine_kwargs: dict  # for blocks of SMALL_BLOCK tokens


class ParityRun(NamedTuple):
    checkpoint: str
    dtype: str
    backend: str  # the backend that ran (what "auto" chose, for the bfloat16 runs)
    cuda_graphs: bool
    workload: str
    sequences: int
    identical: int  # sequences whose tokens all equal the reference's
    tokens: int
    agreeing_tokens: int  # tokens before each sequence's first difference, summed
    preemptions: int
    cached_tokens: int


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_VOCAB) for _ in range(n)] for n in lengths]


def workloads() -> list[Workload]:
    mixed = random_prompts([1, 2, 15, 16, 17, 31, 32, 33, 50, 64], SEED + 1)
    shared = random_prompts([48], SEED + 2)[0]
    pressure = [shared + tail for tail in random_prompts([3, 17, 30, 1, 12], SEED + 3)]
    pressure += random_prompts([5, 40, 64], SEED + 4)
    return [Workload("mixed", mixed, 1, dict(num_kvcache_blocks=256)),
            # 8 blocks of 16 tokens: the longest prompt (78) plus MAX_TOKENS fits alone, and the mixed
            # scheduler preempts even with --max-tokens 4 (the tests' setting).
            Workload("pressure", pressure, 2, dict(num_kvcache_blocks=8, max_num_batched_tokens=40))]


def agreeing_prefix(got: list[int], expected: list[int]) -> int:
    """How many tokens `got` and `expected` share before their first difference."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return i
    return min(len(got), len(expected))


@torch.inference_mode()
def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int, device: str, dtype: torch.dtype) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, one prompt at a time (no padding),
    exactly max_tokens new ids (EOS does not stop it, as the engine's ignore_eos)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt], device=device)
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   max_new_tokens=max_tokens, min_new_tokens=0, eos_token_id=None,
                                   pad_token_id=model.config.pad_token_id)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def run_engine(path: str, checkpoint: str, workload: Workload, device: str, dtype: torch.dtype, backend: str,
               enforce_eager: bool, expected: list[list[int]], max_tokens: int) -> ParityRun:
    kwargs = dict(workload.engine_kwargs)
    block = SMALL_BLOCK
    if backend == "flash_attn":
        block = FLASH_ATTN_BLOCK
        kwargs["num_kvcache_blocks"] = max(1, kwargs["num_kvcache_blocks"] * SMALL_BLOCK // FLASH_ATTN_BLOCK)
    llm = LLM(path, device=device, dtype=dtype, attention_backend=backend, enforce_eager=enforce_eager,
              kvcache_block_size=block, max_num_seqs=MAX_NUM_SEQS, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = [o for _ in range(workload.calls) for o in llm.generate(workload.prompts, params, use_tqdm=False)]
    graphs, backend = bool(llm.model_runner.graphs), llm.attention_backend  # what "auto" chose
    preemptions = llm.scheduler.num_preemptions
    llm.exit()
    got = [o["token_ids"] for o in outputs]
    want = expected * workload.calls
    return ParityRun(checkpoint, str(dtype).removeprefix("torch."), backend, graphs, workload.name, len(got),
                     sum(g == w for g, w in zip(got, want)), sum(map(len, want)),
                     sum(agreeing_prefix(g, w) for g, w in zip(got, want)), preemptions,
                     sum(o["num_cached_tokens"] for o in outputs))


def backends_for(device: str) -> list[str]:
    if device == "cpu":
        return ["torch"]  # triton runs on CPU only in its interpreter, for tests
    installed = [name for name in ("triton", "flash_attn") if importlib.util.find_spec(name) is not None]
    return [*installed, "torch"]


def check(device: str, archs: list[str], max_tokens: int, workdir: str) -> list[ParityRun]:
    runs: list[ParityRun] = []
    for arch in archs:
        path = build_checkpoint(f"{workdir}/{arch}", **CHECKPOINTS[arch])
        for workload in workloads():
            expected = hf_greedy(path, workload.prompts, max_tokens, "cpu", torch.float32)
            for backend in backends_for(device):
                if backend == "flash_attn" and workload.name != "mixed":
                    continue
                for enforce_eager in (False, True):
                    run = run_engine(path, arch, workload, device, torch.float32, backend, enforce_eager, expected,
                                     max_tokens)
                    runs.append(run)
                    if not run.cuda_graphs:  # no graphs captured (CPU, or a backend without them): eager already
                        break
        mixed = workloads()[0]
        expected = hf_greedy(path, mixed.prompts, max_tokens, device, torch.bfloat16)
        runs.append(run_engine(path, arch, mixed, device, torch.bfloat16, "auto", False, expected, max_tokens))
    return runs


def summarize(runs: list[ParityRun]) -> dict:
    """The float32 and bfloat16 totals the JSON line and gpu_check's summary report."""
    f32 = [r for r in runs if r.dtype == "float32"]
    bf16 = [r for r in runs if r.dtype == "bfloat16"]
    tokens = sum(r.tokens for r in bf16)
    return {
        "float32_sequences": sum(r.sequences for r in f32),
        "float32_identical": sum(r.identical for r in f32),
        "bfloat16_tokens": tokens,
        "bfloat16_agreeing_tokens": sum(r.agreeing_tokens for r in bf16),
        "bfloat16_agreement": round(sum(r.agreeing_tokens for r in bf16) / tokens, 4) if tokens else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--archs", default=",".join(CHECKPOINTS), help=f"comma-separated, of {list(CHECKPOINTS)}")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args(argv)
    archs = args.archs.split(",")
    if not archs or any(a not in CHECKPOINTS for a in archs):
        parser.error(f"--archs={args.archs!r} is not allowed; give a comma-separated list of {list(CHECKPOINTS)}")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens={args.max_tokens} is not allowed; it must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (use --device cpu to run the checks on CPU)")

    with tempfile.TemporaryDirectory(prefix="nanovllm-parity-") as workdir:
        runs = check(args.device, archs, args.max_tokens, workdir)

    header = f"{'checkpoint':<11}{'dtype':<10}{'backend':<11}{'graphs':<8}{'workload':<10}{'identical':>11}" \
             f"{'agreeing tokens':>17}{'preempt':>9}{'cached':>8}"
    print(header)
    for r in runs:
        print(f"{r.checkpoint:<11}{r.dtype:<10}{r.backend:<11}{'on' if r.cuda_graphs else 'off':<8}{r.workload:<10}"
              f"{f'{r.identical}/{r.sequences}':>11}{f'{r.agreeing_tokens}/{r.tokens}':>17}{r.preemptions:>9}"
              f"{r.cached_tokens:>8}")
    totals = summarize(runs)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(json.dumps({
        "check": "gpu_parity", "device": args.device, "device_name": device_name, "torch": torch.__version__,
        "transformers": transformers.__version__, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "max_tokens": args.max_tokens, **totals, "runs": [r._asdict() for r in runs],
    }))
    return 0 if totals["float32_identical"] == totals["float32_sequences"] else 1


if __name__ == "__main__":
    sys.exit(main())
