"""Offline throughput benchmark: nano-vllm's workload, a table for people, one JSON line last.

The workload (as nano-vllm's bench.py): `num_seqs` prompts of random token ids, each with a
random input length and a random output length uniform in min_len..max_len, ignore_eos so
every request makes exactly its max_tokens, temperature 0.6, random.seed(seed). On CUDA the
default is nano-vllm's 256 sequences of 100..1024 tokens; on CPU it is scaled down (see the
defaults of --num-seqs, --min-len and --max-len) unless the sizes are given.

With no --model or --synthetic, as nano-vllm's bench.py, it loads ~/huggingface/Qwen3-0.6B/
when that directory exists; else it builds a random-weight checkpoint: Qwen3-0.6B's shapes
(--synthetic qwen3-0.6b) on CUDA, the tiny model (--synthetic tiny) on CPU. The first line it
prints says which model and workload it chose, and why.

Throughput counts output tokens only (sum of max_tokens), over the timed generate call.

--synthetic builds (once) a random-weight checkpoint with a real model's config: qwen3-0.6b,
gpt2 (124M), llama-3.2-1b, qwen3-30b-a3b (with fewer of its 48 layers, see synthetic_model), or a
tiny Qwen3 for smoke tests. Where the default lengths do not fit the model's positions (GPT-2's
1024 cannot hold 1024 in + 1024 out) they are capped to fit; every such change is printed as a
NOTE and listed under "notes" in the JSON line.

Inter-token latency is the mean time between two consecutive tokens of one sequence, over the
timed call (the engine's counters, LLMEngine.stats()); "during prefills" is the mean over the
gaps in which a step computed prompts, which is what a prefill costs the running sequences:
under --scheduling-policy prefill_first they wait the whole prefill, under mixed their token
comes in the same step. With every request admitted at once there are no such gaps; a
--max-num-seqs below --num-seqs admits requests as others finish, as a server does.

--speculative ngram|draft_model turns on speculative decoding (--num-speculative-tokens,
--prompt-lookup-min/max, --draft-model) and reports tokens proposed and accepted, the acceptance
rate and the mean tokens per target forward pass per decoding sequence. --workload repetitive
makes each prompt a random chunk repeated (what prompt lookup feeds on); --temperature 0 is greedy.

Every engine setting is a flag generated from Config's fields (their types, choices, defaults and
help, as `nanovllm serve`'s): --device, --dtype, --max-num-seqs, --scheduling-policy, ... .

With --compare-hf the same prompts and output lengths then go through HuggingFace transformers'
`generate` in the same process, on the same device and dtype, and the table and the JSON line
gain HF's throughput and the ratio (see run_hf_baseline for how HF is batched and counted).
"""
import argparse
import gc
from dataclasses import asdict
import json
import os
import platform
import random
import sys
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from nanovllm import LLM, SamplingParams
from nanovllm.config import KV_CACHE_DTYPES, Config
from nanovllm.entrypoints.cli.args import add_dataclass_flags, dataclass_kwargs
from nanovllm.speculative_config import SPECULATIVE_METHODS
from nanovllm.utils.paths import cache_dir
from nanovllm.testing.synthetic import (GPT2_CONFIG, LLAMA_3_2_1B_CONFIG, QWEN3_30B_A3B_CONFIG, build_checkpoint,
                                        build_qwen3_0_6b, build_shaped)

# nano-vllm's workload (its README's RTX 4070 numbers use exactly this).
GPU_NUM_SEQS, GPU_MIN_LEN, GPU_MAX_LEN = 256, 100, 1024
# Scaled so a 0.6B model in float32 on 2 CPU cores finishes in a few minutes.
CPU_NUM_SEQS, CPU_MIN_LEN, CPU_MAX_LEN = 16, 16, 64
TEMPERATURE = 0.6  # nano-vllm's bench value
MAX_PROMPT_TOKEN_ID = 10000  # nano-vllm draws prompt ids from 0..10000 (capped by the vocabulary)
WARMUP_MAX_TOKENS = 16  # enough to run prefill and decode once before timing
# HF generate pads every sequence of a batch to the batch's longest prompt and output, so big
# batches waste work; these keep a GPU busy and keep 2 CPU cores' per-step time reasonable.
HF_BATCH_SIZE_CUDA, HF_BATCH_SIZE_CPU = 64, 16
# torch's scaled_dot_product_attention: transformers' fastest attention that needs no extra package.
HF_ATTN_IMPLEMENTATION = "sdpa"
REPEAT_CHUNK_LEN = (8, 16)  # --workload repetitive: each prompt repeats a random chunk of this many tokens
# Config fields bench sets its own way: the checkpoint (--model/--synthetic), the KV-cache dtype
# (a comma list runs each) and speculative decoding (--speculative and its flags build the dict).
BENCH_OWN_CONFIG_FIELDS = ("model", "kv_cache_dtype", "speculative_config")
HF_PROBE_NEW_TOKENS = 32  # decode steps timed per KV-cache setup when --hf-cache auto chooses on CUDA
# nano-vllm's bench.py loads this checkpoint; with no --model or --synthetic so do we, when it exists.
NANO_VLLM_CHECKPOINT = "~/huggingface/Qwen3-0.6B/"
# What runs with no --model or --synthetic when that checkpoint is absent: nano-vllm's model size
# where a GPU makes it quick, and on CPU the tiny model, so a bare `python bench.py` takes seconds.
DEFAULT_SYNTHETIC_CUDA, DEFAULT_SYNTHETIC_CPU = "qwen3-0.6b", "tiny"



class SyntheticModel(NamedTuple):
    dirname: str  # under --workdir
    name: str  # as the table and the JSON line name it
    build: Callable[[str], str]  # writes the checkpoint into the directory it is given
    note: str = ""  # how it differs from the real model, printed and kept in the JSON line


SYNTHETIC = {
    "qwen3-0.6b": SyntheticModel("qwen3-0.6b-random-bf16", "Qwen3-0.6B (random weights)", build_qwen3_0_6b),
    # Positions for nano-vllm's full workload (1024 in + 1024 out), so tiny runs it on CUDA too.
    "tiny": SyntheticModel("qwen3-tiny-random", "tiny Qwen3 (random weights)",
                           partial(build_checkpoint, max_position_embeddings=4096)),
    "gpt2": SyntheticModel("gpt2-random-bf16", "GPT-2 124M (random weights)",
                           partial(build_shaped, arch="gpt2", config_fields=GPT2_CONFIG)),
    "llama-3.2-1b": SyntheticModel("llama-3.2-1b-random-bf16", "Llama-3.2-1B (random weights)",
                                   partial(build_shaped, arch="llama", config_fields=LLAMA_3_2_1B_CONFIG)),
}
# Qwen3-30B-A3B is 61 GB in bfloat16, more than the disk of the GPU machines lent here holds, so
# its checkpoint keeps every per-layer shape (128 experts of 768, top-8, 32/4 heads of 128) but
# not all 48 layers: per-token work scales with depth, so throughput is that of the shallower model.
QWEN3_30B_A3B_LAYERS_CUDA = 24  # half depth: ~32 GB of bf16, leaving an 80 GB GPU room for the KV cache
QWEN3_30B_A3B_LAYERS_CPU = 2  # ~1.9B parameters (two 311M embedding tables among them): a few GB on CPU
SYNTHETIC_KINDS = (*SYNTHETIC, "qwen3-30b-a3b")


def synthetic_model(kind: str, on_cpu: bool) -> SyntheticModel:
    if kind != "qwen3-30b-a3b":
        return SYNTHETIC[kind]
    layers = QWEN3_30B_A3B_LAYERS_CPU if on_cpu else QWEN3_30B_A3B_LAYERS_CUDA
    total = QWEN3_30B_A3B_CONFIG["num_hidden_layers"]
    return SyntheticModel(
        f"qwen3-30b-a3b-{layers}-layers-random-bf16", f"Qwen3-30B-A3B, {layers} of {total} layers (random weights)",
        partial(build_shaped, arch="qwen3_moe", config_fields={**QWEN3_30B_A3B_CONFIG, "num_hidden_layers": layers}),
        note=f"Qwen3-30B-A3B scaled down to {layers} of its {total} layers ({'CPU' if on_cpu else 'checkpoint size'}); "
             "every layer has the real shapes, so throughput is that of the shallower model")


def default_workdir() -> Path:
    """Where --synthetic checkpoints are built: the user's cache (nanovllm/utils/paths.py), not
    whatever directory the benchmark runs from."""
    return cache_dir() / "checkpoints"


def synthetic_checkpoint(model: SyntheticModel, workdir: str) -> str:
    """The path of a random-weight checkpoint, built once under workdir and reused."""
    dirname, name, build = model.dirname, model.name, model.build
    path = os.path.join(workdir, dirname)
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"building {name} checkpoint in {path} ...", file=sys.stderr)
        partial = path + ".partial"  # built aside and renamed, so a killed build is never reused
        os.makedirs(partial, exist_ok=True)
        build(partial)
        os.replace(partial, path)
    return path


def make_workload(num_seqs: int, min_len: int, max_len: int, vocab_size: int, seed: int,
                  repetitive: bool = False, temperature: float = TEMPERATURE
                  ) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's workload: random prompt ids and output lengths, each length uniform in
    min_len..max_len; `repetitive` makes each prompt a random chunk repeated."""
    random.seed(seed)
    # Draw ids from nano-vllm's range for any vocabulary, so the random stream (and with it every
    # length) is the same whatever the model; a small vocabulary folds them with a modulo.
    prompts = [[random.randint(0, MAX_PROMPT_TOKEN_ID) % vocab_size for _ in range(random.randint(min_len, max_len))]
               for _ in range(num_seqs)]
    if repetitive:
        prompts = [(p[:random.randint(*REPEAT_CHUNK_LEN)] * len(p))[:len(p)] for p in prompts]
    sampling_params = [SamplingParams(temperature=temperature, ignore_eos=True,
                                      max_tokens=random.randint(min_len, max_len)) for _ in range(num_seqs)]
    return prompts, sampling_params


def print_json_line(result: dict, json_out: str | None) -> None:
    """The result as one JSON line, printed last (and written to `json_out` when given)."""
    line = json.dumps(result)
    if json_out:
        with open(json_out, "w") as f:
            f.write(line + "\n")
    print(line)


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


class ModelChoice(NamedTuple):
    path: str | None  # a checkpoint directory to load, or None for a synthetic one
    synthetic: str | None  # a SYNTHETIC kind to build (once) and load, or None
    reason: str  # why, in words, for the first line printed


def choose_model(model: str | None, synthetic: str | None, on_cpu: bool) -> ModelChoice:
    """The checkpoint to benchmark: the one given, else nano-vllm's default path when it exists,
    else a random-weight one suited to the device."""
    if model is not None:
        return ModelChoice(model, None, "given by --model")
    if synthetic is not None:
        return ModelChoice(None, synthetic, "given by --synthetic")
    default = os.path.expanduser(NANO_VLLM_CHECKPOINT)
    if os.path.isdir(default):
        return ModelChoice(default, None, f"no --model or --synthetic given; nano-vllm's default checkpoint "
                                          f"{NANO_VLLM_CHECKPOINT} exists")
    kind = DEFAULT_SYNTHETIC_CPU if on_cpu else DEFAULT_SYNTHETIC_CUDA
    return ModelChoice(None, kind, f"no --model or --synthetic given and {NANO_VLLM_CHECKPOINT} does not exist, "
                                   f"so --synthetic {kind}, the default on {'CPU' if on_cpu else 'CUDA'}")


def workload_reason(args: argparse.Namespace, on_cpu: bool) -> str:
    """Why the workload has its sizes, for the first line printed."""
    given = [name for name, value in (("--num-seqs", args.num_seqs), ("--min-len", args.min_len),
                                      ("--max-len", args.max_len)) if value is not None]
    if len(given) == 3:
        return "given by --num-seqs, --min-len and --max-len"
    if on_cpu:
        defaults = (f"the CPU default, scaled down from nano-vllm's {GPU_NUM_SEQS} seqs of "
                    f"{GPU_MIN_LEN}..{GPU_MAX_LEN}; --num-seqs/--min-len/--max-len change it")
    else:
        defaults = "nano-vllm's workload"
    return defaults + (f", with {', '.join(given)} given" if given else "")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help=f"local checkpoint directory (default: {NANO_VLLM_CHECKPOINT} if it exists)")
    source.add_argument("--synthetic", choices=SYNTHETIC_KINDS, help="build (once) and use a random-weight checkpoint "
                        f"(default when {NANO_VLLM_CHECKPOINT} does not exist: {DEFAULT_SYNTHETIC_CUDA} on CUDA, "
                        f"{DEFAULT_SYNTHETIC_CPU} on CPU)")
    parser.add_argument("--workdir", default=str(default_workdir()),
                        help="where --synthetic checkpoints are cached (default: %(default)s)")
    parser.add_argument("--num-seqs", type=int, help=f"default {GPU_NUM_SEQS} on CUDA, {CPU_NUM_SEQS} on CPU")
    parser.add_argument("--min-len", type=int, help=f"shortest input/output; default {GPU_MIN_LEN} on CUDA, "
                        f"{CPU_MIN_LEN} on CPU")
    parser.add_argument("--max-len", type=int, help=f"longest input/output; default {GPU_MAX_LEN} on CUDA, "
                        f"{CPU_MAX_LEN} on CPU")
    # The engine's settings: one flag per Config field, generated (as `nanovllm serve`'s), so their
    # choices and defaults are Config's own. --kv-cache-dtype is bench's: it also takes a comma list.
    engine = parser.add_argument_group("engine (Config fields)")
    engine.add_argument("--kv-cache-dtype", default="auto",
                        help=f"one of {', '.join(KV_CACHE_DTYPES)}, or a comma list to run each in turn and compare "
                             "(e.g. auto,fp8_e4m3); the JSON line then holds every run")
    config_fields = add_dataclass_flags(engine, Config, skip=BENCH_OWN_CONFIG_FIELDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=TEMPERATURE, help="0 = greedy")
    parser.add_argument("--workload", choices=["random", "repetitive"], default="random",
                        help="random token prompts (nano-vllm's), or each prompt a random chunk repeated")
    parser.add_argument("--speculative", choices=list(SPECULATIVE_METHODS), help="speculative decoding method")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--draft-model", help="the draft checkpoint for --speculative draft_model")
    parser.add_argument("--json-out", help="also write the result JSON to this file")
    parser.add_argument("--compare-hf", action="store_true",
                        help="after nanovllm's timed run, run the same workload through HF transformers' generate")
    parser.add_argument("--hf-batch-size", type=int, help=f"sequences per HF generate call; default "
                        f"{HF_BATCH_SIZE_CUDA} on CUDA, {HF_BATCH_SIZE_CPU} on CPU")
    parser.add_argument("--hf-cache", default="auto", choices=["auto", "dynamic", "static"],
                        help="HF KV cache: 'static' is a static cache with transformers' torch.compile of the "
                        "decode step (on CUDA); 'auto' is dynamic on CPU and, on CUDA, static when it works and "
                        "is faster on a short probe. A failing static setup falls back to dynamic, and says so.")
    args = parser.parse_args()
    args.config_fields = config_fields
    return args


def workload_sizes(args: argparse.Namespace, on_cpu: bool) -> tuple[int, int, int]:
    """(num_seqs, min_len, max_len): the device's defaults where not given, checked."""
    defaults = (CPU_NUM_SEQS, CPU_MIN_LEN, CPU_MAX_LEN) if on_cpu else (GPU_NUM_SEQS, GPU_MIN_LEN, GPU_MAX_LEN)
    given = (args.num_seqs, args.min_len, args.max_len)
    num_seqs, min_len, max_len = (g if g is not None else d for g, d in zip(given, defaults))
    if num_seqs < 1 or not 1 <= min_len <= max_len:
        raise ValueError(f"--num-seqs={num_seqs}, --min-len={min_len}, --max-len={max_len} are not allowed; "
                         "need num_seqs >= 1 and 1 <= min_len <= max_len")
    return num_seqs, min_len, max_len


# --- HF transformers baseline (--compare-hf) ---------------------------------------------------

class HFResult(NamedTuple):
    time_s: float  # the timed generate calls over the whole workload
    generated_tokens: int  # what HF made, counting tokens past a sequence's own output length
    setup: str  # how HF ran, in words, for the table and the JSON line
    cache: str  # "dynamic" or "static", the KV cache used for the timed run
    batch_size: int
    num_batches: int
    notes: list[str]  # why the cache setup was chosen (a failed static attempt, probe times)
    host_load_1m: float


def hf_batches(prompts: list[list[int]], output_lens: list[int], batch_size: int) -> list[list[int]]:
    """Sequence indices per HF generate call: sorted by output length (then input length), neighbours batched.

    HF generate takes one max_new_tokens per call, so a batch runs until its longest member's
    output length; sorting by output length keeps that overshoot small, and the tie-break by
    input length trims the left padding a little.
    """
    order = sorted(range(len(prompts)), key=lambda i: (output_lens[i], len(prompts[i])))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def hf_sampling(temperature: float) -> dict:
    """HF generate's sampling arguments for nanovllm's temperature: greedy at 0, else sampling at
    that temperature with nothing else applied. The checkpoint's generation_config may set
    top_k/top_p; they are overridden so HF samples as nanovllm does (temperature only)."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int, cache: str,
                max_cache_len: int, sampling: dict) -> int:
    """One HF generate call over `prompts`, left-padded with an attention mask, sampling as
    `sampling` (hf_sampling) says; exactly max_new_tokens new tokens per prompt (no EOS stops it).
    Returns the tokens generated."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    # The checkpoint's generation_config may set EOS ids: none here, so every sequence makes max_new_tokens.
    kwargs = {**sampling, "max_new_tokens": max_new_tokens, "eos_token_id": None, "pad_token_id": pad_token_id}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
        if hasattr(GenerationConfig(), "max_cache_len"):  # transformers >= 5.x: one cache size, no recompiles
            kwargs["max_cache_len"] = max_cache_len
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=attention_mask, **kwargs)  # [batch, width + new]
    made = output.shape[1] - width
    if made != max_new_tokens:
        raise RuntimeError(f"HF generate made {made} tokens per sequence, expected max_new_tokens={max_new_tokens}")
    return made * len(prompts)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _warm_up_hf(model, prompts: list[list[int]], output_lens: list[int], sampling: dict, batches: list[list[int]],
                pad_token_id: int, cache: str, max_cache_len: int) -> None:
    """A short generate per distinct batch size: a compiled static-cache decode step is
    compiled per batch shape, and that must not happen inside the timed run. No call makes more
    than its batch's output length, so every call fits the one static cache size."""
    first_of_size: dict[int, list[int]] = {}
    for batch in batches:
        first_of_size.setdefault(len(batch), batch)
    for batch in first_of_size.values():
        new_tokens = min(WARMUP_MAX_TOKENS, max(output_lens[i] for i in batch))
        hf_generate(model, [prompts[i] for i in batch], new_tokens, pad_token_id, cache, max_cache_len, sampling)


def _choose_hf_cache(model, prompts: list[list[int]], output_lens: list[int], sampling: dict,
                     batches: list[list[int]], pad_token_id: int, mode: str, device: str,
                     max_cache_len: int) -> tuple[str, list[str]]:
    """The KV cache for the timed run, warmed up; and notes saying why it was chosen.

    "static" (transformers compiles the decode step on CUDA) is tried when asked for, or by
    "auto" on CUDA; if it raises, HF runs with the dynamic cache. "auto" keeps static only if it
    is faster than dynamic over (up to) HF_PROBE_NEW_TOKENS steps of the first batch.
    """
    warm_up = partial(_warm_up_hf, model, prompts, output_lens, sampling)
    if mode == "dynamic" or (mode == "auto" and device != "cuda"):
        warm_up(batches[:1], pad_token_id, "dynamic", max_cache_len)
        return "dynamic", []
    try:
        warm_up(batches, pad_token_id, "static", max_cache_len)
    except Exception as error:  # noqa: BLE001 -- any failure of the optional setup falls back, and is reported
        note = f"static cache failed ({type(error).__name__}: {str(error).splitlines()[0][:200]}); used dynamic"
        print(f"NOTE: HF {note}", file=sys.stderr)
        warm_up(batches[:1], pad_token_id, "dynamic", max_cache_len)
        return "dynamic", [note]
    if mode == "static":
        return "static", []
    warm_up(batches[:1], pad_token_id, "dynamic", max_cache_len)
    first = [prompts[i] for i in batches[0]]
    probe_tokens = min(HF_PROBE_NEW_TOKENS, max(output_lens[i] for i in batches[0]))
    probe_s = {}
    for cache in ("static", "dynamic"):
        _synchronize(device)
        start = time.perf_counter()
        hf_generate(model, first, probe_tokens, pad_token_id, cache, max_cache_len, sampling)
        _synchronize(device)
        probe_s[cache] = time.perf_counter() - start
    cache = min(probe_s, key=probe_s.get)
    probe = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in probe_s.items())
    return cache, [f"auto chose the {cache} cache: {probe_tokens} new tokens of the first batch took {probe}"]


def run_hf_baseline(path: str, prompts: list[list[int]], output_lens: list[int], device: str, dtype: torch.dtype,
                    batch_size: int, cache_mode: str, seed: int, temperature: float) -> HFResult:
    """The workload through HF transformers' generate: batched, warmed up, timed.

    Fairness: the same prompts, output lengths, device, dtype and sampling (nanovllm's
    temperature, greedy at 0; EOS ignored). HF cannot give each sequence of a batch its own max_new_tokens, so sequences
    are sorted by output length and neighbours batched (hf_batches); each batch generates its
    longest member's length, but only each sequence's own requested tokens count as output,
    as for nanovllm. The overshoot is HF's cost of static batching, reported as generated_tokens.
    """
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=HF_ATTN_IMPLEMENTATION)
    model = model.to(device).eval()
    pad_token_id = next((t for t in (getattr(model.config, "pad_token_id", None),
                                     model.generation_config.pad_token_id) if t is not None), 0)
    batches = hf_batches(prompts, output_lens, batch_size)
    # Static caches are sized once for the longest batch (prompt padded + output) so no call reallocates.
    max_cache_len = max(max(len(prompts[i]) for i in b) + max(output_lens[i] for i in b) for b in batches)
    sampling = hf_sampling(temperature)
    cache, notes = _choose_hf_cache(model, prompts, output_lens, sampling, batches, pad_token_id, cache_mode,
                                   device, max_cache_len)

    torch.manual_seed(seed)
    load_1m = os.getloadavg()[0]
    _synchronize(device)
    start = time.perf_counter()
    generated = sum(hf_generate(model, [prompts[i] for i in batch], max(output_lens[i] for i in batch),
                                pad_token_id, cache, max_cache_len, sampling) for batch in batches)
    _synchronize(device)
    elapsed = time.perf_counter() - start

    dtype_name = str(dtype).removeprefix("torch.")
    # transformers compiles the decode step itself when the cache is static and the device a GPU.
    compiled = cache == "static" and hasattr(model, "_compiled_call")
    cache_words = f"{cache} KV cache, " + ("decode step torch.compile'd by transformers" if compiled else "eager")
    setup = (f"transformers {transformers.__version__} generate: AutoModelForCausalLM({dtype_name}, "
             f"attn_implementation={HF_ATTN_IMPLEMENTATION}), {cache_words}, <= {batch_size} seqs per call "
             "sorted by output length, left-padded with attention masks, "
             + ("greedy" if temperature == 0 else f"sampling at temperature {temperature}"))
    del model
    gc.collect()
    return HFResult(elapsed, generated, setup, cache, batch_size, len(batches), notes, load_1m)


def mean_ms(total_s: float, count: int) -> float | None:
    return round(1000 * total_s / count, 3) if count else None


def format_ms(value: float | None) -> str:
    return "n/a (none)" if value is None else f"{value:.2f}"


def bench_one(args: argparse.Namespace, kv_cache_dtype: str, compare_hf: bool) -> dict:
    """One engine over the workload with this KV-cache dtype (and HF after it when compare_hf);
    prints the table and returns the result that the JSON line reports."""
    # 1. The workload: the device's default sizes unless given, checked before the (slow) model load.
    # "auto" resolves as Config resolves it; the device reported is the engine's own.
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    num_seqs, min_len, max_len = workload_sizes(args, on_cpu)
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size={args.hf_batch_size} is not allowed; it must be >= 1")
    hf_batch_size = args.hf_batch_size or (HF_BATCH_SIZE_CPU if on_cpu else HF_BATCH_SIZE_CUDA)
    scaled_down = on_cpu and (args.num_seqs, args.min_len, args.max_len) == (None, None, None)
    choice = choose_model(args.model, args.synthetic, on_cpu)
    model_name = (os.path.basename(os.path.normpath(choice.path)) if choice.path is not None
                  else synthetic_model(choice.synthetic, on_cpu).name)
    print(f"bench: model {model_name} ({choice.reason}); workload {num_seqs} seqs with input and output lengths "
          f"{min_len}..{max_len} ({workload_reason(args, on_cpu)})", flush=True)

    notes = []  # how this run differs from the stated workload or model, in the table and the JSON line
    if choice.path is not None:
        path = choice.path
    else:
        synthetic = synthetic_model(choice.synthetic, on_cpu)
        path = synthetic_checkpoint(synthetic, args.workdir)
        notes += [synthetic.note] if synthetic.note else []
    settings = dataclass_kwargs(args, args.config_fields)
    if args.speculative == "ngram":
        settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                          "prompt_lookup_min": args.prompt_lookup_min,
                                          "prompt_lookup_max": args.prompt_lookup_max}
    elif args.speculative == "draft_model":
        settings["speculative_config"] = {"method": "draft_model", "model": args.draft_model,
                                          "num_speculative_tokens": args.num_speculative_tokens}
    startup_begin = time.perf_counter()
    llm = LLM(path, kv_cache_dtype=kv_cache_dtype, **settings)
    startup_s = time.perf_counter() - startup_begin
    device = llm.config.device
    if 2 * max_len > llm.config.max_model_len and args.max_len is None:
        # The default lengths do not fit the model's positions (GPT-2 has 1024): halve them to fit.
        max_len = llm.config.max_model_len // 2
        min_len = min(min_len, max_len)
        notes.append(f"input and output lengths capped to {min_len}..{max_len}: the model's max_model_len is "
                     f"{llm.config.max_model_len}")
    if 2 * max_len > llm.config.max_model_len:  # input + output must fit, or outputs get cut short
        raise ValueError(f"--max-len={max_len} is not allowed: an input and output of {max_len} tokens each "
                         f"exceed max_model_len={llm.config.max_model_len}; lower --max-len or raise --max-model-len")
    for note in notes:
        print(f"NOTE: {note}")

    prompts, sampling_params = make_workload(num_seqs, min_len, max_len, llm.config.hf_config.vocab_size, args.seed,
                                             args.workload == "repetitive", args.temperature)

    # 2. Warm up, then time one generate call over the whole workload.
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=WARMUP_MAX_TOKENS), use_tqdm=False)
    load_1m = os.getloadavg()[0]  # other work on the host slows a CPU run; record how busy it was
    before = asdict(llm.stats())
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    # This process's CPU time: on a shared host, less sensitive than wall time to waiting for a core.
    cpu_s = time.process_time() - start_cpu
    counted = {name: value - before[name] for name, value in asdict(llm.stats()).items()}  # the timed call's

    # 3. With ignore_eos every request makes exactly max_tokens; check rather than trust it.
    for i, (out, sp) in enumerate(zip(outputs, sampling_params)):
        if len(out["token_ids"]) != sp.max_tokens:
            raise RuntimeError(f"sequence {i} made {len(out['token_ids'])} tokens, expected max_tokens={sp.max_tokens}")
    total_output_tokens = sum(sp.max_tokens for sp in sampling_params)

    total_input_tokens = sum(len(p) for p in prompts)
    result = {
        "device": device,
        "device_name": device_name(device),
        "model": model_name,
        "dtype": str(llm.config.dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_cache_dtype,
        "kv_cache_tokens": llm.model_runner.num_kvcache_blocks * llm.config.kvcache_block_size,
        "attention_backend": llm.attention_backend,
        "enforce_eager": args.enforce_eager,
        "num_seqs": num_seqs,
        "input_len_range": [min_len, max_len],
        "output_len_range": [min_len, max_len],
        "cpu_scaled_workload": scaled_down,
        "seed": args.seed,
        "temperature": args.temperature,
        "workload": args.workload,
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens if args.speculative else 0,
        "spec_proposed_tokens": counted["spec_proposed_tokens"],
        "spec_accepted_tokens": counted["spec_accepted_tokens"],
        "spec_acceptance_rate": (round(counted["spec_accepted_tokens"] / counted["spec_proposed_tokens"], 4)
                                 if counted["spec_proposed_tokens"] else None),
        "spec_tokens_per_forward": (round(counted["spec_decode_tokens"] / counted["spec_decode_rows"], 4)
                                    if counted["spec_decode_rows"] else None),
        "total_input_tokens": total_input_tokens,
        "total_output_tokens": total_output_tokens,
        "time_s": round(elapsed, 3),
        "throughput_tok_s": round(total_output_tokens / elapsed, 2),
        "fused_kernels": llm.config.fused_kernels,
        # LLM() from call to return, and the model runner's parts of it (the rest: config, tokenizer).
        "startup_s": round(startup_s, 3),
        "startup_parts_s": {name.removesuffix("_s"): round(value, 3)
                            for name, value in llm.model_runner.startup._asdict().items()},
        "host_load_1m": round(load_1m, 2),
        "notes": notes,
        "process_cpu_s": round(cpu_s, 3),
        "scheduling_policy": llm.config.scheduling_policy,
        "async_scheduling": llm.config.async_scheduling,
        "max_num_seqs": llm.config.max_num_seqs,
        "max_num_batched_tokens": llm.config.max_num_batched_tokens,
        "itl_mean_ms": mean_ms(counted["inter_token_latency_sum_s"], counted["inter_token_latency_count"]),
        "itl_during_prefill_mean_ms": mean_ms(counted["inter_token_latency_during_prefill_sum_s"],
                                              counted["inter_token_latency_during_prefill_count"]),
        "itl_during_prefill_count": counted["inter_token_latency_during_prefill_count"],
        "prefill_steps": counted["prefill_steps"],
        "decode_steps": counted["decode_steps"],
        "mixed_steps": counted["mixed_steps"],
        "preemptions": counted["preemptions_recompute"] + counted["preemptions_swap"],
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }
    rows = [
        ("device", f"{device} ({result['device_name']})"),
        ("model", model_name),
        ("dtype", result["dtype"]),
        ("attention backend", result["attention_backend"]),
        ("fused kernels", result["fused_kernels"]),
        ("start-up (s)", f"{startup_s:.2f} (" + ", ".join(f"{name} {value:.2f}" for name, value
                                                        in result["startup_parts_s"].items()) + ")"),
        ("seqs", num_seqs),
        ("input len", f"{min_len}..{max_len} ({total_input_tokens} tokens)"),
        ("output len", f"{min_len}..{max_len}"),
        ("output tokens", total_output_tokens),
        ("nanovllm time (s)", f"{elapsed:.2f}"),
        ("nanovllm output tok/s", f"{result['throughput_tok_s']:.2f}"),
        ("KV cache", f"{kv_cache_dtype} ({str(llm.config.kv_cache_torch_dtype).removeprefix('torch.')}), "
                     f"{result['kv_cache_tokens']} tokens"),
        ("scheduling", f"{result['scheduling_policy']}, max_num_seqs {result['max_num_seqs']}, "
                       f"max_num_batched_tokens {result['max_num_batched_tokens']}, "
                       f"async scheduling {result['async_scheduling']}"),
        ("steps", f"{result['prefill_steps']} with prefill ({result['mixed_steps']} of them mixed), "
                  f"{result['decode_steps']} decode only; {result['preemptions']} preemptions"),
        ("inter-token latency (ms)", format_ms(result["itl_mean_ms"])),
        ("  during prefills (ms)", f"{format_ms(result['itl_during_prefill_mean_ms'])} "
                                   f"({result['itl_during_prefill_count']} gaps)"),
        *(("note", note) for note in notes),
    ]
    if args.speculative:
        rows.append(("speculative", f"{args.speculative}, k={args.num_speculative_tokens}: "
                                    f"{result['spec_proposed_tokens']} proposed, {result['spec_accepted_tokens']} "
                                    f"accepted (rate {result['spec_acceptance_rate']}), "
                                    f"{result['spec_tokens_per_forward']} tokens per target forward"))
    if on_cpu:
        rows.append(("host load (1 min)", f"{load_1m:.2f} on {os.cpu_count()} cores"))
        rows.append(("process CPU time (s)", f"{cpu_s:.2f} on {torch.get_num_threads()} threads"))

    # 4. The same workload through HF transformers, after nanovllm's KV cache and weights are freed.
    dtype = llm.config.dtype
    llm.exit()
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if compare_hf:
        hf = run_hf_baseline(path, prompts, [sp.max_tokens for sp in sampling_params], device, dtype,
                             hf_batch_size, args.hf_cache, args.seed, args.temperature)
        hf_throughput = total_output_tokens / hf.time_s
        result.update({
            "hf_setup": hf.setup,
            "hf_cache": hf.cache,
            "hf_batch_size": hf.batch_size,
            "hf_num_batches": hf.num_batches,
            "hf_generated_tokens": hf.generated_tokens,
            "hf_time_s": round(hf.time_s, 3),
            "hf_throughput_tok_s": round(hf_throughput, 2),
            "hf_host_load_1m": round(hf.host_load_1m, 2),
            "hf_notes": hf.notes,
            "speedup_vs_hf": round(hf.time_s / elapsed, 3),  # equal output tokens, so the time ratio
            "transformers": transformers.__version__,
        })
        rows += [
            ("HF setup", hf.setup),
            *(("HF note", note) for note in hf.notes),
            ("HF batching", (f"{hf.num_batches} generate call(s) of <= {hf.batch_size} seqs; each makes its "
                             f"longest member's output length ({hf.generated_tokens} tokens generated), but only "
                             f"each sequence's own output length counts ({total_output_tokens} tokens)")),
            ("HF time (s)", f"{hf.time_s:.2f}"),
            ("HF output tok/s", f"{hf_throughput:.2f}"),
        ]
        if on_cpu:
            rows.append(("HF host load (1 min)", f"{hf.host_load_1m:.2f} on {os.cpu_count()} cores"))
        rows.append(("nanovllm / HF", f"{result['speedup_vs_hf']:.2f}x"))

    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return result


def main() -> None:
    """One run per --kv-cache-dtype (HF, if asked, after the first only); with several, a
    comparison of their throughputs, and a JSON line holding every run."""
    args = parse_args()
    kv_cache_dtypes = args.kv_cache_dtype.split(",")
    for value in kv_cache_dtypes:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype={args.kv_cache_dtype!r} is not allowed: {value!r} is not one of "
                             f"{KV_CACHE_DTYPES} (a comma list runs each)")
    runs = [bench_one(args, kv, args.compare_hf and i == 0) for i, kv in enumerate(kv_cache_dtypes)]
    result = runs[0]
    if len(runs) > 1:
        base = runs[0]["throughput_tok_s"]
        for run in runs[1:]:
            run["throughput_vs_first"] = round(run["throughput_tok_s"] / base, 3)
            print(f"kv_cache_dtype {run['kv_cache_dtype']} / {runs[0]['kv_cache_dtype']}: "
                  f"{run['throughput_vs_first']:.3f}x output tok/s, "
                  f"{run['kv_cache_tokens'] / runs[0]['kv_cache_tokens']:.2f}x KV-cache tokens")
        result = {"kv_cache_dtypes": kv_cache_dtypes, "runs": runs}
    print_json_line(result, args.json_out)


if __name__ == "__main__":
    main()
