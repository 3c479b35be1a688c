"""What a loaded model costs in host memory on CPU: RSS after `LLM(path)` against the checkpoint's
bytes at the serving dtype (issue 55's "one copy of every weight": its goal is a ratio <= 1.15x).

Each row is a fresh subprocess (this script with --child), so nothing one row allocates or
imports is counted in another: it reads VmRSS and VmHWM (peak) from /proc/self/status once after
importing torch, transformers and the engine (the process's fixed cost, before any model), and
again after `LLM(path, device="cpu", dtype=..., fused_kernels=...)` has loaded the weights, run
its warm-up and allocated a small fixed KV cache (cpu_kvcache_space_gib=KV_CACHE_GIB, at most
one sequence of MAX_MODEL_LEN tokens). The ratio is

    (RSS after load - fixed cost - KV cache bytes) / checkpoint bytes at the dtype,

the checkpoint's bytes being its tensors' elements times the dtype's size (a tied LM head once),
whatever dtype the file stores. What the ratio counts beyond one copy: oneDNN's packed copies
beside the plain weights, other per-layer forms (AMX tiles, the greedy head's int8 form), the
rotary tables, the warm-up's activations (kept by the engine's malloc tuning, cpu_malloc_tuning),
and the loader's transient buffers glibc did not give back. Peak (VmHWM) includes the loading.

Checkpoints are random-weight ones with real models' shapes (bench.py's --synthetic kinds, built
once under --workdir; the bytes are the point, not the outputs). Nothing is timed. Prints a table,
then one JSON line (`"benchmark": "memory"`) holding every row.

Usage: python benchmarks/memory.py [--shape qwen3-0.6b[,gpt2]] [--dtypes float32,bfloat16]
       [--fused-kernels cpu[,torch]] [--malloc-tuning on[,off]] [--workdir DIR] [--quick]
"""
import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# A small fixed KV cache, so the figure is the weights' and its bytes are subtracted exactly:
# 64 MiB holds one sequence of MAX_MODEL_LEN tokens of Qwen3-0.6B in float32 (56 MiB).
KV_CACHE_GIB = 1 / 16
MAX_MODEL_LEN = 256  # also bounds the CPU warm-up's prompt, so its activations stay small
TARGET_RATIO = 1.15  # issue 55's goal for (RSS - fixed cost - KV cache) / checkpoint bytes
DTYPE_NAMES = ("float32", "bfloat16", "float16")
FUSED_KERNELS = ("cpu", "torch")  # the CPU's choices of Config.fused_kernels ("auto" is "cpu")
# Config.cpu_malloc_tuning: "on" (the default) keeps what glibc frees, so RSS holds the loader's
# and warm-up's transient buffers too; "off" returns it, separating them from the held weights.
MALLOC_TUNING = {"on": True, "off": False}
# --quick: the tiny random-weight Qwen3 (a few hundred kB): seconds a row, for the test.
QUICK = dict(shapes=["tiny"], dtypes=["float32", "bfloat16"], fused_kernels=["cpu"], malloc_tuning=["on"])
MIB = 1 << 20
CHILD_TIMEOUT_S = 1800  # far above a 0.6B load on 2 busy cores, so a hang fails instead of blocking


def proc_status_bytes() -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (the peak resident) of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                values[name] = int(rest.split()[0]) * 1024  # the kernel writes kB (KiB)
    return values


# --- one row, in its own process ----------------------------------------------------------------

def child(spec: dict) -> dict:
    """Measure one row: the fixed cost after the imports, then RSS after LLM() has loaded."""
    import torch  # noqa: F401
    import transformers  # noqa: F401  (the engine reads configs and tokenizers through it)
    from nanovllm import LLM
    import nanovllm.runner.model_runner  # noqa: F401  (imported by LLM() anyway; counted as fixed)
    from nanovllm.runner.memory_check import model_bytes

    fixed = proc_status_bytes()
    llm = LLM(spec["path"], device="cpu", dtype=spec["dtype"], fused_kernels=spec["fused_kernels"],
              cpu_malloc_tuning=spec["malloc_tuning"], cpu_kvcache_space_gib=KV_CACHE_GIB, max_model_len=MAX_MODEL_LEN)
    loaded = proc_status_bytes()
    runner = llm.model_runner
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    row = dict(fixed_rss_bytes=fixed["VmRSS"], fixed_peak_bytes=fixed["VmHWM"], rss_bytes=loaded["VmRSS"],
               peak_bytes=loaded["VmHWM"], kv_cache_bytes=kv_bytes, kv_cache_blocks=runner.num_kvcache_blocks,
               model_tensor_bytes=model_bytes(runner.model), platform=runner.platform.name,
               fused_kernels_used=llm.config.fused_kernels, attention_backend=runner.attention_backend,
               cpu_threads=llm.config.cpu_threads)
    llm.exit()
    return row


def run_child(spec: dict) -> dict:
    """One row in a fresh interpreter; its engine logs pass through to stderr."""
    result = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                            text=True, timeout=CHILD_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise SystemExit(f"memory.py: the row {spec} failed (exit {result.returncode}); its log is above")
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- the table -----------------------------------------------------------------------------------

def checkpoint_bytes(path: str, dtype_name: str) -> tuple[int, int]:
    """(elements, bytes at `dtype_name`) of the checkpoint's tensors, read from the safetensors
    headers (no tensor is loaded)."""
    import torch
    from safetensors import safe_open

    itemsize = getattr(torch, dtype_name).itemsize
    elements = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                count = 1
                for size in shape:
                    count *= size
                elements += count
    return elements, elements * itemsize


def ratio(rss: int, fixed: int, kv: int, checkpoint: int) -> float:
    """Issue 55's figure: what loading added, less the KV cache, per byte of checkpoint."""
    return round((rss - fixed - kv) / checkpoint, 3)


def git_commit() -> str:
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def comma_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {', '.join(choices)}")
        return items
    return parse


def parse_args() -> argparse.Namespace:
    import bench  # the --synthetic kinds and where their checkpoints are cached

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = tuple(bench.SYNTHETIC_KINDS)
    parser.add_argument("--shape", type=comma_list(shapes), default=["qwen3-0.6b"],
                        help="random-weight checkpoints with these models' shapes, a comma list of "
                             f"{', '.join(shapes)} (default: %(default)s)")
    parser.add_argument("--dtypes", type=comma_list(DTYPE_NAMES), default=["float32", "bfloat16"],
                        help="the serving dtypes, a comma list (default: %(default)s)")
    parser.add_argument("--fused-kernels", type=comma_list(FUSED_KERNELS), default=["cpu"],
                        help="Config.fused_kernels values, a comma list (default: %(default)s)")
    parser.add_argument("--malloc-tuning", type=comma_list(tuple(MALLOC_TUNING)), default=["on"],
                        help="Config.cpu_malloc_tuning, a comma list of on, off (default: %(default)s)")
    parser.add_argument("--workdir", default=str(bench.default_workdir()),
                        help="where the checkpoints are built once and reused (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny shape in float32 and bfloat16 with the cpu kernels: seconds, for tests")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one row's spec, as JSON (run_child)
    args = parser.parse_args()
    if args.quick:
        args.shape, args.dtypes = QUICK["shapes"], QUICK["dtypes"]
        args.fused_kernels, args.malloc_tuning = QUICK["fused_kernels"], QUICK["malloc_tuning"]
    return args


def main() -> None:
    if "--child" in sys.argv:  # the row's process: no bench.py import, so the fixed cost is the engine's own
        spec = json.loads(sys.argv[sys.argv.index("--child") + 1])
        print(json.dumps(child(spec)), flush=True)
        return
    args = parse_args()
    import bench
    import torch
    from benchmarks.vs_vllm_cpu import this_cpu

    cpu, flags = this_cpu()
    commit = git_commit()  # before the rows: the code they ran, whatever is committed meanwhile
    rows = []
    for shape in args.shape:
        model = bench.synthetic_model(shape, on_cpu=True)
        path = bench.synthetic_checkpoint(model, args.workdir)
        for dtype in args.dtypes:
            elements, ckpt = checkpoint_bytes(path, dtype)
            for fused in args.fused_kernels:
                for malloc in args.malloc_tuning:
                    print(f"memory.py: {model.name}, {dtype}, fused kernels {fused}, malloc tuning {malloc} ...",
                          file=sys.stderr, flush=True)
                    measured = run_child(dict(path=path, dtype=dtype, fused_kernels=fused,
                                              malloc_tuning=MALLOC_TUNING[malloc]))
                    rows.append(dict(shape=shape, model=model.name, dtype=dtype, fused_kernels=fused,
                                     malloc_tuning=malloc, checkpoint_elements=elements, checkpoint_bytes=ckpt,
                                     **measured, ratio=ratio(measured["rss_bytes"], measured["fixed_rss_bytes"],
                                                             measured["kv_cache_bytes"], ckpt),
                                     peak_ratio=ratio(measured["peak_bytes"], measured["fixed_rss_bytes"],
                                                      measured["kv_cache_bytes"], ckpt)))
    header = ["shape", "dtype", "fused kernels", "malloc tuning", "checkpoint MiB", "fixed MiB", "KV MiB", "RSS MiB",
              "peak MiB", "ratio", "peak ratio"]
    print(" | ".join(header))
    for r in rows:
        mib = [round(r[key] / MIB, 1) for key in ("checkpoint_bytes", "fixed_rss_bytes", "kv_cache_bytes",
                                                   "rss_bytes", "peak_bytes")]
        cells = (r["shape"], r["dtype"], r["fused_kernels"], r["malloc_tuning"], *mib, f"{r['ratio']:.3f}x",
                 f"{r['peak_ratio']:.3f}x")
        print(" | ".join(str(v) for v in cells))
    print(f"ratio = (RSS - fixed - KV) / checkpoint bytes at the dtype; goal <= {TARGET_RATIO}x (issue 55)")
    print(json.dumps(dict(benchmark="memory", date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          commit=commit, cpu=cpu, isa_flags=flags, cores=os.cpu_count(),
                          torch=torch.__version__, kv_cache_gib=KV_CACHE_GIB, max_model_len=MAX_MODEL_LEN,
                          target_ratio=TARGET_RATIO, rows=rows)))


if __name__ == "__main__":
    main()
