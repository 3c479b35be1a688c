"""Every GPU check in one command, under 9 minutes: the test suite, greedy parity against HF
transformers on CUDA, the decode kernel's bandwidth, the throughput benchmark against HF and the
step profile (where each step's time goes).

Usage, from anywhere: scripts/gpu_check.sh OUT_DIR [--stages suite,parity] [--timeout bench=300]
(or, from the repository root: PYTHONPATH=. python scripts/gpu_check.py OUT_DIR ...)

Each stage is a command of its own, run from the repository root with its own time limit
(STAGES), to which it adds whatever the stages before it left unused of theirs: the last stages,
the least predictable, get the slack, and the total stays within 9 minutes. Its output (stdout
and stderr) goes to OUT_DIR/<stage>.log and the JSON line it prints last to OUT_DIR/<stage>.json
(for the suite: its counts, parsed from pytest's output). A stage that fails or runs out of time
is recorded in the summary and the next stage still runs. Last, a summary table is printed and
written to OUT_DIR/summary.txt (and OUT_DIR/summary.json), headed by the commit, device, library
versions and date. Exit status: 0 when every stage passed.

Needs only the packages the engine needs (torch, triton, transformers, safetensors, xxhash,
tqdm) and pytest; nothing is downloaded or installed. What each number means: docs/gpu.md, "Checking a GPU machine".
"""
import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable, NamedTuple

REPO = Path(__file__).resolve().parents[1]
# The whole check must end within this (the limit a GPU session gives one command).
TOTAL_LIMIT_S = 540
# What this script itself takes outside the stages' limits: its start-up, stopping a stage that
# ran out of time (STOP_GRACE_S), the summary.
OVERHEAD_S = 10
# A stage past its limit gets SIGINT (pytest then prints its counts so far, Python runs its exit
# handlers) and this long to exit before SIGKILL.
STOP_GRACE_S = 5


class Stage(NamedTuple):
    name: str
    args: list[str]  # run as `python ARGS` from the repository root
    timeout_s: int
    what: str  # what it checks, for --help and the summary


# Limits guessed from the first H100 run (/work/shared/gpu-runs/2026-11-22-h100): bench.py
# --compare-hf took about 3.5 minutes there (checkpoint build, 49 s engine start-up with cold
# caches, 10 s timed, HF's static-cache compile and its 78 s run); the suite did not finish in
# 220 s before its tests were pinned to CPU. The short, predictable stages go first, so the
# time they leave goes to the bench and then to the suite.
STAGES = (
    Stage("parity", ["scripts/gpu_parity.py"], 70,
          "greedy parity against HF on CUDA: float32 identical, bfloat16 agreement"),
    Stage("decode_bandwidth", ["benchmarks/decode_bandwidth.py"], 30,
          "Triton decode attention bandwidth against a device copy"),
    Stage("bench", ["bench.py", "--synthetic", "qwen3-0.6b", "--compare-hf"], 225,
          "nano-vllm's throughput workload, nanovllm against HF generate"),
    # The same workload twice with every step timed (the checkpoint is the bench stage's): start-up,
    # then two runs of ~10-15 s instrumented on an H100 (the first profile, 2026-11-22).
    Stage("step_profile", ["benchmarks/step_profile.py", "--synthetic", "qwen3-0.6b"], 90,
          "the workload step by step: model pass, LM head, sampler, host; KV bandwidth against copy"),
    Stage("suite", ["-m", "pytest", "-q", "tests", "-p", "no:cacheprovider", "--durations=15"], 110,
          "the test suite (CUDA variants included)"),
)


class StageResult(NamedTuple):
    name: str
    command: list[str]
    returncode: int | None  # None when it ran out of time
    seconds: float
    timeout_s: int
    log: str  # path of its log
    facts: dict | None  # its JSON line (for the suite: counts parsed from its log); None if absent
    result: str  # one line for the summary table


# --- what each stage's output says --------------------------------------------------------------

def last_json_line(text: str) -> dict | None:
    """The last line of `text` that is a JSON object, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
PYTEST_LAST_LINE = re.compile(r"\bin (\d+(?:\.\d+)?)s\b")
PYTEST_PROGRESS = re.compile(r"^[.FEsxX]+(\s+\[\s*\d+%\])?$")


def pytest_facts(log: str) -> dict | None:
    """Counts from pytest -q's last line ("2 failed, 268 passed, 20 skipped in 185.31s"), the tests
    it names as FAILED or ERROR, and the results it printed as progress characters (all there is
    when pytest was stopped before its last line). None when the log holds neither."""
    progress = ""
    for line in log.splitlines():
        if line.startswith(("==", "__")):  # the report sections begin: no more progress lines
            break
        if PYTEST_PROGRESS.match(line.strip()):
            progress += line.split()[0]
    facts: dict = {}
    for line in reversed(log.splitlines()):
        if PYTEST_LAST_LINE.search(line) and PYTEST_COUNT.search(line):
            for count, word in PYTEST_COUNT.findall(line):
                facts[{"error": "errors"}.get(word, word)] = int(count)
            facts["pytest_seconds"] = float(PYTEST_LAST_LINE.search(line).group(1))
            break
    if not facts and not progress:
        return None
    facts["not_passed"] = [line.split(" - ")[0] for line in log.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    facts["progress"] = {"results": len(progress), "failed": progress.count("F"), "errors": progress.count("E")}
    return facts


def describe_suite(facts: dict) -> str:
    if "passed" in facts or "failed" in facts or "errors" in facts:
        words = [f"{facts[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if facts.get(k)]
        return ", ".join(words) or "no tests ran"
    p = facts["progress"]
    return f"{p['results']} results before it stopped ({p['failed']} failed, {p['errors']} errors)"


def describe_parity(facts: dict) -> str:
    text = f"float32 {facts['float32_identical']}/{facts['float32_sequences']} sequences identical"
    if facts.get("bfloat16_agreement") is not None:
        text += f"; bfloat16 agreement {facts['bfloat16_agreement']:.2f}"
    return text


def describe_decode_bandwidth(facts: dict) -> str:
    return (f"{facts['decode_gbps']:.0f} GB/s = {100 * facts['fraction_of_copy']:.1f}% of copy "
            f"({facts['copy_gbps']:.0f} GB/s)")


def describe_step_profile(facts: dict) -> str:
    steady = facts["runs"][-1]
    return (f"start-up {facts['startup_s']:.1f} s; steady {steady['tok_s']:,.0f} tok/s, decode model "
            f"{steady['model_s']:.2f} s, sampler {steady['sampler_s']:.2f} s, host {steady['host_s']:.2f} s, "
            f"KV {steady['kv_tb_per_s']:.2f} of {facts['copy_tb_per_s']:.2f} TB/s copy")


def describe_bench(facts: dict) -> str:
    text = f"nanovllm {facts['throughput_tok_s']:,.0f} tok/s ({facts['dtype']})"
    if "hf_throughput_tok_s" in facts:
        text += f"; HF {facts['hf_throughput_tok_s']:,.0f} tok/s; {facts['speedup_vs_hf']:.2f}x"
    return text


DESCRIBE: dict[str, Callable[[dict], str]] = {
    "suite": describe_suite, "parity": describe_parity, "decode_bandwidth": describe_decode_bandwidth,
    "bench": describe_bench, "step_profile": describe_step_profile,
}


def stage_facts(name: str, log: str) -> dict | None:
    return pytest_facts(log) if name == "suite" else last_json_line(log)


def describe(name: str, facts: dict | None, returncode: int | None, timeout_s: int, log: str) -> str:
    """The summary's one line for a stage: its numbers, or why there are none."""
    text = ""
    if facts is not None:
        try:
            text = DESCRIBE[name](facts)
        except (KeyError, TypeError, ValueError) as error:  # a JSON line of another shape: say so, keep going
            text = f"unexpected JSON ({type(error).__name__}: {error})"
    if returncode is None:
        return f"stopped at its {timeout_s} s limit" + (f"; {text}" if text else "")
    if not text:
        lines = [line for line in log.splitlines() if line.strip()]
        text = f"no result; last line: {lines[-1][:120]}" if lines else "no output"
    return text


# --- running -------------------------------------------------------------------------------------

def stage_limit(stage: Stage, later: list[Stage], seconds_left: float) -> int:
    """A stage's time limit: its own, plus what earlier stages left unused, as long as the later
    stages' own limits still fit in `seconds_left` of the total. Never less than its own."""
    return max(stage.timeout_s, int(seconds_left - sum(s.timeout_s for s in later)))


def run_stage(stage: Stage, out_dir: Path, env: dict | None = None, python: str = sys.executable) -> StageResult:
    """Run one stage from the repository root within its limit; its process group is stopped at the limit."""
    log_path = out_dir / f"{stage.name}.log"
    command = [python, *stage.args]
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(command)}  (limit {stage.timeout_s} s)\n")
        log.flush()
        # A session of its own, so the stage and every process it starts can be stopped together.
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode: int | None = process.wait(timeout=stage.timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
            _stop(process)
    seconds = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    facts = stage_facts(stage.name, text)
    if facts is not None:
        (out_dir / f"{stage.name}.json").write_text(json.dumps(facts) + "\n")
    return StageResult(stage.name, command, returncode, round(seconds, 1), stage.timeout_s, str(log_path), facts,
                       describe(stage.name, facts, returncode, stage.timeout_s, text))


def _stop(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# --- the summary ---------------------------------------------------------------------------------

def environment() -> dict:
    """Commit, device, versions and date, for the summary's head."""
    import torch

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    cuda = torch.cuda.is_available()
    return {
        "commit": commit,
        "device": torch.cuda.get_device_name() if cuda else "no CUDA device",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": version("triton"),
        "transformers": version("transformers"),
        "flash_attn": version("flash-attn"),
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def status(result: StageResult) -> str:
    if result.returncode is None:
        return "TIMED OUT"
    return "passed" if result.returncode == 0 else f"FAILED ({result.returncode})"


def summary_table(env: dict, results: list[StageResult], out_dir: str) -> str:
    head = (f"gpu_check: commit {env['commit']}, {env['device']}, torch {env['torch']} (CUDA {env['cuda']}), "
            f"triton {env['triton']}, transformers {env['transformers']}, flash-attn {env['flash_attn']}, "
            f"Python {env['python']}, {env['date']}")
    rows = [("stage", "status", "seconds", "result")]
    rows += [(r.name, status(r), f"{r.seconds:.0f}/{r.timeout_s}", r.result) for r in results]
    rows.append(("total", "passed" if all(r.returncode == 0 for r in results) else "NOT ALL PASSED",
                 f"{sum(r.seconds for r in results):.0f}", f"logs and JSON in {out_dir}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [head] + [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def write_summary(env: dict, results: list[StageResult], out_dir: Path) -> str:
    table = summary_table(env, results, str(out_dir))
    (out_dir / "summary.txt").write_text(table + "\n")
    record = {**env, "stages": [{**r._asdict(), "status": status(r)} for r in results]}
    (out_dir / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    return table


# --- command line --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> tuple[Path, list[Stage]]:
    names = [s.name for s in STAGES]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="stages: " + "; ".join(f"{s.name} ({s.timeout_s} s): {s.what}" for s in STAGES))
    parser.add_argument("out_dir", help="directory for the logs, JSON and summary (created if missing)")
    parser.add_argument("--stages", default=",".join(names), help=f"comma-separated subset of {names}, run in "
                        "that order")
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                        help="another limit for one stage (repeatable)")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in names]
    if not chosen or unknown:
        parser.error(f"--stages={args.stages!r} is not allowed; give a comma-separated subset of {names}")
    limits = {}
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in names or not seconds.isdigit() or int(seconds) < 1:
            parser.error(f"--timeout={item!r} is not allowed; give STAGE=SECONDS with STAGE one of {names} "
                         "and SECONDS a whole number >= 1")
        limits[name] = int(seconds)
    by_name = {s.name: s for s in STAGES}
    stages = [by_name[name]._replace(timeout_s=limits.get(name, by_name[name].timeout_s)) for name in chosen]
    return Path(args.out_dir).resolve(), stages


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    out_dir, stages = parse_args(argv)
    env = environment()
    if env["device"] == "no CUDA device":
        print("gpu_check: torch sees no CUDA device; these checks need one", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    planned = sum(s.timeout_s for s in stages) + OVERHEAD_S
    if planned > TOTAL_LIMIT_S:
        print(f"gpu_check: NOTE the stage limits add up to {planned} s with overhead, over {TOTAL_LIMIT_S} s",
              file=sys.stderr)
    # The stages import nanovllm from this checkout, wherever the command was started; unbuffered,
    # so a log is complete up to the moment a stage is stopped.
    stage_env = {**os.environ, "PYTHONUNBUFFERED": "1",
                 "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    results = []
    for i, stage in enumerate(stages):
        seconds_left = TOTAL_LIMIT_S - OVERHEAD_S - (time.monotonic() - start)
        stage = stage._replace(timeout_s=stage_limit(stage, stages[i + 1:], seconds_left))
        print(f"gpu_check: {stage.name} ({stage.what}), limit {stage.timeout_s} s ...", flush=True)
        result = run_stage(stage, out_dir, stage_env)
        print(f"gpu_check: {stage.name} {status(result)} in {result.seconds:.0f} s: {result.result}", flush=True)
        results.append(result)
    print()
    print(write_summary(env, results, out_dir))
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
