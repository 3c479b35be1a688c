"""Offline throughput benchmark: nano-vllm's workload, a table for people, one JSON line last.

The workload (as nano-vllm's bench.py): `num_seqs` prompts of random token ids, each with a
random input length and a random output length uniform in min_len..max_len, ignore_eos so
every request makes exactly its max_tokens, temperature 0.6, random.seed(seed). On CUDA the
default is nano-vllm's 256 sequences of 100..1024 tokens; on CPU it is scaled down (see the
defaults of --num-seqs, --min-len and --max-len) unless the sizes are given.

Throughput counts output tokens only (sum of max_tokens), over the timed generate call.
"""
import argparse
import json
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone
from functools import partial

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.synthetic import build_checkpoint, build_qwen3_0_6b

# nano-vllm's workload (its README's RTX 4070 numbers use exactly this).
GPU_NUM_SEQS, GPU_MIN_LEN, GPU_MAX_LEN = 256, 100, 1024
# Scaled so a 0.6B model in float32 on 2 CPU cores finishes in a few minutes.
CPU_NUM_SEQS, CPU_MIN_LEN, CPU_MAX_LEN = 16, 16, 64
TEMPERATURE = 0.6  # nano-vllm's bench value
MAX_PROMPT_TOKEN_ID = 10000  # nano-vllm draws prompt ids from 0..10000 (capped by the vocabulary)
WARMUP_MAX_TOKENS = 16  # enough to run prefill and decode once before timing

SYNTHETIC = {
    "qwen3-0.6b": ("qwen3-0.6b-random-bf16", "Qwen3-0.6B (random weights)", build_qwen3_0_6b),
    # Positions for nano-vllm's full workload (1024 in + 1024 out), so tiny runs it on CUDA too.
    "tiny": ("qwen3-tiny-random", "tiny Qwen3 (random weights)", partial(build_checkpoint, max_position_embeddings=4096)),
}


def synthetic_checkpoint(kind: str, workdir: str) -> tuple[str, str]:
    """(path, display name) of a random-weight checkpoint, built once under workdir and reused."""
    dirname, name, build = SYNTHETIC[kind]
    path = os.path.join(workdir, dirname)
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"building {name} checkpoint in {path} ...", file=sys.stderr)
        partial = path + ".partial"  # built aside and renamed, so a killed build is never reused
        os.makedirs(partial, exist_ok=True)
        build(partial)
        os.replace(partial, path)
    return path, name


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {torch.get_num_threads()} threads"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="local checkpoint directory")
    source.add_argument("--synthetic", choices=list(SYNTHETIC), help="build (once) and use a random-weight checkpoint")
    parser.add_argument("--workdir", default="./checkpoints/", help="where --synthetic checkpoints are cached")
    parser.add_argument("--num-seqs", type=int, help=f"default {GPU_NUM_SEQS} on CUDA, {CPU_NUM_SEQS} on CPU")
    parser.add_argument("--min-len", type=int, help=f"shortest input/output; default {GPU_MIN_LEN} on CUDA, "
                        f"{CPU_MIN_LEN} on CPU")
    parser.add_argument("--max-len", type=int, help=f"longest input/output; default {GPU_MAX_LEN} on CUDA, "
                        f"{CPU_MAX_LEN} on CPU")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="also write the result JSON to this file")
    return parser.parse_args()


def workload_sizes(args: argparse.Namespace, on_cpu: bool) -> tuple[int, int, int]:
    """(num_seqs, min_len, max_len): the device's defaults where not given, checked."""
    defaults = (CPU_NUM_SEQS, CPU_MIN_LEN, CPU_MAX_LEN) if on_cpu else (GPU_NUM_SEQS, GPU_MIN_LEN, GPU_MAX_LEN)
    given = (args.num_seqs, args.min_len, args.max_len)
    num_seqs, min_len, max_len = (g if g is not None else d for g, d in zip(given, defaults))
    if num_seqs < 1 or not 1 <= min_len <= max_len:
        raise ValueError(f"--num-seqs={num_seqs}, --min-len={min_len}, --max-len={max_len} are not allowed; "
                         "need num_seqs >= 1 and 1 <= min_len <= max_len")
    return num_seqs, min_len, max_len


def main() -> None:
    args = parse_args()
    # 1. The workload: the device's default sizes unless given, checked before the (slow) model load.
    # "auto" resolves as Config resolves it; the device reported is the engine's own.
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    num_seqs, min_len, max_len = workload_sizes(args, on_cpu)
    scaled_down = on_cpu and (args.num_seqs, args.min_len, args.max_len) == (None, None, None)
    if scaled_down:
        print(f"NOTE: CPU run, so the workload is scaled down to {num_seqs} seqs of {min_len}..{max_len} tokens "
              f"(nano-vllm's is {GPU_NUM_SEQS} seqs of {GPU_MIN_LEN}..{GPU_MAX_LEN}); "
              "set --num-seqs/--min-len/--max-len to change it.")

    if args.model is not None:
        path, model_name = args.model, os.path.basename(os.path.normpath(args.model))
    else:
        path, model_name = synthetic_checkpoint(args.synthetic, args.workdir)
    llm = LLM(path, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              max_model_len=args.max_model_len)
    device = llm.config.device
    if 2 * max_len > llm.config.max_model_len:  # input + output must fit, or outputs get cut short
        raise ValueError(f"--max-len={max_len} is not allowed: an input and output of {max_len} tokens each "
                         f"exceed max_model_len={llm.config.max_model_len}; lower --max-len or raise --max-model-len")

    random.seed(args.seed)
    # Draw ids from nano-vllm's range for any vocabulary, so the random stream (and with it every
    # length) is the same whatever the model; a small vocabulary folds them with a modulo.
    vocab_size = llm.config.hf_config.vocab_size
    prompts = [[random.randint(0, MAX_PROMPT_TOKEN_ID) % vocab_size for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    sampling_params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=random.randint(min_len, max_len))
                       for _ in range(num_seqs)]

    # 2. Warm up, then time one generate call over the whole workload.
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=WARMUP_MAX_TOKENS), use_tqdm=False)
    load_1m = os.getloadavg()[0]  # other work on the host slows a CPU run; record how busy it was
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    # 3. With ignore_eos every request makes exactly max_tokens; check rather than trust it.
    for i, (out, sp) in enumerate(zip(outputs, sampling_params)):
        if len(out["token_ids"]) != sp.max_tokens:
            raise RuntimeError(f"sequence {i} made {len(out['token_ids'])} tokens, expected max_tokens={sp.max_tokens}")
    total_output_tokens = sum(sp.max_tokens for sp in sampling_params)

    result = {
        "device": device,
        "device_name": device_name(device),
        "model": model_name,
        "dtype": str(llm.config.dtype).removeprefix("torch."),
        "attention_backend": llm.model_runner.backend.name,
        "enforce_eager": args.enforce_eager,
        "num_seqs": num_seqs,
        "input_len_range": [min_len, max_len],
        "output_len_range": [min_len, max_len],
        "cpu_scaled_workload": scaled_down,
        "seed": args.seed,
        "temperature": TEMPERATURE,
        "total_input_tokens": sum(len(p) for p in prompts),
        "total_output_tokens": total_output_tokens,
        "time_s": round(elapsed, 3),
        "throughput_tok_s": round(total_output_tokens / elapsed, 2),
        "host_load_1m": round(load_1m, 2),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }
    llm.exit()

    rows = [
        ("device", f"{device} ({result['device_name']})"),
        ("model", model_name),
        ("dtype", result["dtype"]),
        ("attention backend", result["attention_backend"]),
        ("seqs", num_seqs),
        ("input len", f"{min_len}..{max_len} ({result['total_input_tokens']} tokens)"),
        ("output len", f"{min_len}..{max_len}"),
        ("output tokens", total_output_tokens),
        ("time (s)", f"{elapsed:.2f}"),
        ("output tok/s", f"{result['throughput_tok_s']:.2f}"),
    ]
    if on_cpu:
        rows.append(("host load (1 min)", f"{load_1m:.2f} on {os.cpu_count()} cores"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
