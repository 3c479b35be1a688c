"""Where a throughput run's time goes, step by step: bench.py's workload with every engine step
synchronised and timed. CUDA only.

The workload is bench.py's (nano-vllm's: 256 prompts of 100..1024 random tokens, as many output
tokens each, temperature 0.6, EOS ignored; the same flags change it). One engine runs it twice:
run 1 is what bench.py times (anything compiled inside generate() shows there), run 2 the steady
state (its prompts hit the prefix cache). Every engine step is cut into
- model: the forward pass to the last hidden states (its inputs built on the host included),
- lm head: the logits of the rows that sample,
- sampler: the sampling inputs built on the host, the sampling kernels, the tokens back on the host,
- host: the rest of the step (scheduling, postprocessing, output routing),
each part ended by a device synchronisation, so the parts add up to the step and the instrumented
run is somewhat slower than bench.py's. Printed per run: prefill time and tokens; mixed steps
(prompt chunks beside the running sequences' decode rows, what the default "mixed" scheduling
policy runs while prompts arrive); pure decode time by batch-size bucket in milliseconds per step
for each part; the KV cache bytes pure decode steps read over their model passes as bandwidth,
against the device-to-device copy bandwidth measured here (the floor: KV bytes / copy bandwidth).
Start-up times first; one JSON line last.

Run from the repository root: python benchmarks/step_profile.py [--synthetic qwen3-0.6b] [--num-seqs N] ...
"""
import argparse
import datetime
import os
import sys
import time
from typing import Callable, NamedTuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as a script: nanovllm and bench.py from this checkout

import bench  # noqa: E402  (the workload, the model choice)
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.scheduling.scheduler import SCHEDULING_POLICIES  # noqa: E402
from nanovllm.runner.model_runner import ModelRunner  # noqa: E402
from nanovllm.runner.step_inputs import StepMessage  # noqa: E402

# Upper ends of the decode batch-size buckets of the table (the last one takes everything above).
BATCH_BUCKETS = (8, 32, 64, 128, 192, 256, 384, 512)
COPY_BYTES = 1 << 30  # the copy reference moves 1 GiB (read) into another 1 GiB (written)
COPY_REPEATS = 20
TB = 1e12


PREFILL, MIXED, DECODE = "prefill", "mixed", "decode"


class StepRecord(NamedTuple):
    kind: str  # PREFILL (prompts only), MIXED (prompt chunks beside decode rows: the default policy) or DECODE
    num_seqs: int
    num_tokens: int  # tokens the forward pass computed
    decode_rows: int  # sequences that computed their one newest token (all of a decode step's)
    context_tokens: int  # decode: tokens of KV cache the step's attention read (every sequence's length)
    model_s: float
    lmhead_s: float
    sampler_s: float
    step_s: float  # the whole engine step

    @property
    def host_s(self) -> float:
        return self.step_s - self.model_s - self.lmhead_s - self.sampler_s


class StepProfiler:
    """Wraps an engine's step, and its model runner's forward pass, LM head and sampling, to time
    each with a device synchronisation at its end. One process only (tensor_parallel_size=1)."""

    def __init__(self, llm: LLM):
        runner = llm.model_runner
        if not isinstance(runner, ModelRunner):
            raise ValueError("step_profile times one process's model runner; use tensor_parallel_size=1")
        self.records: list[StepRecord] = []
        self._device = runner.device
        self._current: dict = {}
        forward, lm_head, sample, step = runner._forward, runner.model.compute_logits, runner.sample, llm._step
        schedule = llm.scheduler.schedule

        def counted_schedule():
            batch = schedule()
            self._current["num_prefill_seqs"] = batch.num_prefill_seqs
            return batch

        def timed_forward(message: StepMessage):
            decode_rows = message.num_seqs - self._current.pop("num_prefill_seqs")
            kind = DECODE if not message.is_prefill else MIXED if decode_rows else PREFILL
            self._current.update(kind=kind, num_seqs=message.num_seqs, num_tokens=len(message.token_ids),
                                 decode_rows=decode_rows,
                                 context_tokens=sum(message.lengths) if kind == DECODE else 0)
            return self._time("model_s", forward, message)

        llm.scheduler.schedule = counted_schedule

        runner._forward = timed_forward
        runner.model.compute_logits = lambda hidden_states: self._time("lmhead_s", lm_head, hidden_states)
        runner.sample = lambda seqs, logits: self._time("sampler_s", sample, seqs, logits)

        def timed_step():
            self._current = {"model_s": 0.0, "lmhead_s": 0.0, "sampler_s": 0.0}
            out = self._time("step_s", step)
            if "kind" in self._current:  # not an idle step
                self.records.append(StepRecord(**self._current))
            return out

        llm._step = timed_step  # generate() drives the engine through this

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _time(self, part: str, fn: Callable, *args):
        self._sync()
        start = time.perf_counter()
        result = fn(*args)
        self._sync()
        self._current[part] = self._current.get(part, 0.0) + time.perf_counter() - start
        return result


def bucket_of(batch: int) -> str:
    low = 1
    for high in BATCH_BUCKETS:
        if batch <= high:
            return f"{low}-{high}"
        low = high + 1
    return f"{low}+"


def summarize(records: list[StepRecord], kv_bytes_per_token: int, copy_bytes_per_s: float,
              output_tokens: int, wall_s: float) -> dict:
    """A run's numbers: totals, prefill, mixed steps, decode by batch bucket, KV bandwidth and its floor."""
    prefill = [r for r in records if r.kind == PREFILL]
    mixed = [r for r in records if r.kind == MIXED]
    decode = [r for r in records if r.kind == DECODE]
    kv_bytes = sum(r.context_tokens for r in decode) * kv_bytes_per_token
    decode_model_s = sum(r.model_s for r in decode)
    buckets = {}
    for r in decode:
        buckets.setdefault(bucket_of(r.num_seqs), []).append(r)
    rows = []
    for name, group in sorted(buckets.items(), key=lambda item: int(item[0].split("-")[0].rstrip("+"))):
        n = len(group)
        model_s = sum(r.model_s for r in group)
        rows.append({
            "batch": name, "steps": n, "time_s": round(sum(r.step_s for r in group), 4),
            "ms_per_step": round(1e3 * sum(r.step_s for r in group) / n, 3),
            "model_ms": round(1e3 * model_s / n, 3),
            "lmhead_ms": round(1e3 * sum(r.lmhead_s for r in group) / n, 3),
            "sampler_ms": round(1e3 * sum(r.sampler_s for r in group) / n, 3),
            "host_ms": round(1e3 * sum(r.host_s for r in group) / n, 3),
            "kv_tb_per_s": round(sum(r.context_tokens for r in group) * kv_bytes_per_token / model_s / TB, 3)
            if model_s > 0 else 0.0,
        })
    return {
        "wall_s": round(wall_s, 3),
        "output_tokens": output_tokens,
        "tok_s": round(output_tokens / wall_s, 1),
        "steps": len(records),
        "step_s": round(sum(r.step_s for r in records), 3),
        "outside_steps_s": round(wall_s - sum(r.step_s for r in records), 3),
        "prefill_steps": len(prefill),
        "prefill_tokens": sum(r.num_tokens for r in prefill),
        "prefill_s": round(sum(r.step_s for r in prefill), 3),
        "mixed_steps": len(mixed),
        "mixed_prompt_tokens": sum(r.num_tokens - r.decode_rows for r in mixed),
        "mixed_decode_rows": sum(r.decode_rows for r in mixed),
        "mixed_s": round(sum(r.step_s for r in mixed), 3),
        "decode_steps": len(decode),
        "decode_s": round(sum(r.step_s for r in decode), 3),
        "model_s": round(decode_model_s, 3),
        "lmhead_s": round(sum(r.lmhead_s for r in decode), 3),
        "sampler_s": round(sum(r.sampler_s for r in decode), 3),
        "host_s": round(sum(r.host_s for r in records), 3),
        "kv_read_tb": round(kv_bytes / TB, 4),
        "kv_tb_per_s": round(kv_bytes / decode_model_s / TB, 3) if decode_model_s > 0 else 0.0,
        "kv_floor_s": round(kv_bytes / copy_bytes_per_s, 3),
        "decode_buckets": rows,
    }


def print_run(tag: str, s: dict, copy_bytes_per_s: float) -> None:
    print(f"\n== {tag}: {s['wall_s']:.2f} s, {s['tok_s']:,.0f} output tok/s (instrumented: every step synchronised)")
    print(f"steps {s['steps']}: {s['step_s']:.2f} s in steps, of which host (schedule, postprocess) "
          f"{s['host_s']:.2f} s; outside steps {s['outside_steps_s']:.2f} s")
    print(f"prefill: {s['prefill_steps']} steps, {s['prefill_tokens']} tokens, {s['prefill_s']:.2f} s")
    print(f"mixed: {s['mixed_steps']} steps, {s['mixed_prompt_tokens']} prompt tokens beside "
          f"{s['mixed_decode_rows']} decode rows, {s['mixed_s']:.2f} s")
    print(f"decode: {s['decode_steps']} steps, {s['decode_s']:.2f} s (model {s['model_s']:.2f} s, lm head "
          f"{s['lmhead_s']:.2f} s, sampler {s['sampler_s']:.2f} s); KV read {s['kv_read_tb']:.2f} TB -> "
          f"{s['kv_tb_per_s']:.2f} TB/s over the model passes; floor at {copy_bytes_per_s / TB:.2f} TB/s copy = "
          f"{s['kv_floor_s']:.2f} s")
    header = ("batch", "steps", "time s", "ms/step", "model ms", "lmhead ms", "samp ms", "host ms", "KV TB/s")
    print("".join(f"{h:>10}" for h in header))
    for b in s["decode_buckets"]:
        print(f"{b['batch']:>10}{b['steps']:>10}{b['time_s']:>10.2f}{b['ms_per_step']:>10.2f}{b['model_ms']:>10.2f}"
              f"{b['lmhead_ms']:>10.2f}{b['sampler_ms']:>10.2f}{b['host_ms']:>10.2f}{b['kv_tb_per_s']:>10.2f}")


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth in bytes/s, read + written (warmed up, CUDA events, timed
    eagerly: captured in a CUDA graph, a 1 GiB copy ran at 2.77 TB/s on an H200 that copies at 4.26)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(COPY_REPEATS):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / COPY_REPEATS
    return 2 * nbytes / seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="local checkpoint directory (default: as bench.py)")
    source.add_argument("--synthetic", choices=list(bench.SYNTHETIC_KINDS),
                        help="a random-weight checkpoint (built once)")
    parser.add_argument("--workdir", default=str(bench.default_workdir()),
                        help="where --synthetic checkpoints are cached (default: %(default)s)")
    parser.add_argument("--num-seqs", type=int, default=bench.GPU_NUM_SEQS)
    parser.add_argument("--min-len", type=int, default=bench.GPU_MIN_LEN)
    parser.add_argument("--max-len", type=int, default=bench.GPU_MAX_LEN)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--fused-kernels", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES),
                        help="the engine's scheduling_policy (default: the engine's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", help="also write the result JSON to this file")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/step_profile.py profiles steps on a CUDA GPU and needs one; torch sees none "
                 "(on CPU, bench.py measures throughput and benchmarks/host_overhead.py the host's share)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter runs Triton kernels on the CPU")
    choice = bench.choose_model(args.model, args.synthetic, on_cpu=False)
    if choice.path is not None:
        path, model_name = choice.path, os.path.basename(os.path.normpath(choice.path))
    else:
        synthetic = bench.synthetic_model(choice.synthetic, on_cpu=False)
        path, model_name = bench.synthetic_checkpoint(synthetic, args.workdir), synthetic.name
    print(f"step_profile: model {model_name} ({choice.reason}); workload {args.num_seqs} seqs of "
          f"{args.min_len}..{args.max_len} tokens in and out", flush=True)

    # 1. Start-up, timed, and the engine's own parts of it.
    start = time.perf_counter()
    scheduling = {} if args.scheduling_policy is None else {"scheduling_policy": args.scheduling_policy}
    # The plain loop: every part is synchronised and timed, which an overlapped loop could not be
    # (its host column is then the host work itself, all of which async scheduling may hide).
    llm = LLM(path, device="cuda", dtype=args.dtype, enforce_eager=args.enforce_eager,
              fused_kernels=args.fused_kernels, max_model_len=args.max_model_len, async_scheduling="off",
              **scheduling)
    startup_s = time.perf_counter() - start
    parts = llm.model_runner.startup
    print(f"start-up {startup_s:.1f} s: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s"
                                                      for k, v in parts._asdict().items()))
    config, runner = llm.config, llm.model_runner
    kv_bytes_per_token = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * config.dtype.itemsize
    copy_bytes_per_s = copy_bandwidth(runner.device)
    prompts, sampling_params = bench.make_workload(args.num_seqs, args.min_len, args.max_len,
                                                   config.hf_config.vocab_size, args.seed)
    output_tokens = sum(sp.max_tokens for sp in sampling_params)

    # 2. bench.py's warm-up, then the workload twice, every step timed.
    llm.generate(["Benchmark: "], SamplingParams(max_tokens=bench.WARMUP_MAX_TOKENS), use_tqdm=False)
    profiler = StepProfiler(llm)
    runs = {}
    for tag in ("run 1 (as bench.py times it)", "run 2 (steady state, prefix hits)"):
        profiler.records.clear()
        start = time.perf_counter()
        llm.generate(prompts, sampling_params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        runs[tag] = summarize(list(profiler.records), kv_bytes_per_token, copy_bytes_per_s, output_tokens, wall_s)
        print_run(tag, runs[tag], copy_bytes_per_s)
    llm.exit()

    result = {
        "benchmark": "step_profile", "date": datetime.date.today().isoformat(),
        "device_name": torch.cuda.get_device_name(), "torch": torch.__version__, "model": model_name,
        "dtype": str(config.dtype).removeprefix("torch."), "attention_backend": llm.attention_backend,
        "fused_kernels": config.fused_kernels, "compile_mode": config.compile_mode,
        "scheduling_policy": config.scheduling_policy,
        "enforce_eager": args.enforce_eager, "num_seqs": args.num_seqs, "len_range": [args.min_len, args.max_len],
        "seed": args.seed, "copy_tb_per_s": round(copy_bytes_per_s / TB, 3), "startup_s": round(startup_s, 2),
        "startup_parts_s": {k.removesuffix("_s"): round(v, 2) for k, v in parts._asdict().items()},
        "runs": list(runs.values()),
    }
    bench.print_json_line(result, args.json_out)


if __name__ == "__main__":
    main()
