"""bench.py, benchmark_plot.py and benchmarks/memory.py end to end on CPU: a tiny random-weight
model and a tiny workload, each script run as a user runs it (a subprocess), writing only under
tmp_path. Nothing here is timed: the scripts' tables and JSON lines are checked for consistency."""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanovllm.config import VOCABULARIES, Config
from nanovllm.scheduling.scheduler import DEFAULT_SCHEDULING_POLICY

REPO = Path(__file__).resolve().parents[1]
# 4 sequences of 8..16 tokens: seconds of work, while still batching and padding on the HF side.
WORKLOAD = ["--num-seqs", "4", "--min-len", "8", "--max-len", "16"]
SCRIPT_TIMEOUT_S = 120  # far above the few seconds a run takes, so a hang fails instead of blocking CI
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# bench.py's JSON rounds times to 1 ms, throughputs to 0.01 tok/s and the ratio to 0.001; these
# bound what that rounding can change in the quantities recomputed here.
TIME_TOLERANCE_S = 0.001
THROUGHPUT_ROUNDING = 0.005  # half of 0.01 tok/s
RATIO_TOLERANCE = 0.002


def time_tolerance(time_s: float, throughput: float) -> float:
    """How far tokens / rounded throughput may lie from the rounded time: half a millisecond,
    plus what rounding the throughput moves it (time * 0.005 / throughput; ~2 ms on a slow run)."""
    return TIME_TOLERANCE_S / 2 + time_s * THROUGHPUT_ROUNDING / throughput


def run_script(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], check=False, cwd=cwd, capture_output=True, text=True,
                            timeout=SCRIPT_TIMEOUT_S, env=env)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Shared by the bench runs, so the tiny checkpoint is built once."""
    return tmp_path_factory.mktemp("bench")


def run_bench(workdir: Path, name: str, extra: list[str]) -> tuple[dict, Path]:
    """bench.py --synthetic tiny on CPU; its last stdout line parsed, and its --json-out file."""
    json_out = workdir / f"{name}.json"
    result = run_script([str(REPO / "bench.py"), "--synthetic", "tiny", "--device", "cpu", *WORKLOAD,
                         "--workdir", str(workdir), "--json-out", str(json_out), *extra], cwd=workdir)
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(json_out.read_text()) == last
    return last, json_out


def check_nanovllm(run: dict) -> None:
    assert run["device"] == "cpu" and run["num_seqs"] == 4
    assert run["input_len_range"] == [8, 16] and run["output_len_range"] == [8, 16]
    assert 4 * 8 <= run["total_output_tokens"] <= 4 * 16
    assert 4 * 8 <= run["total_input_tokens"] <= 4 * 16
    assert run["time_s"] > 0 and run["throughput_tok_s"] > 0
    assert run["time_s"] == pytest.approx(run["total_output_tokens"] / run["throughput_tok_s"],
                                          abs=time_tolerance(run["time_s"], run["throughput_tok_s"]))
    # Start-up: LLM()'s time, and the runner's parts of it, which cannot add up to more.
    parts = run["startup_parts_s"]
    assert set(parts) == {"load", "warmup", "kv_cache", "kernels", "capture"}
    assert all(value >= 0 for value in parts.values()) and parts["load"] > 0
    assert sum(parts.values()) <= run["startup_s"] + 0.005  # each part rounded to 1 ms


@pytest.fixture(scope="module")
def plain_run(workdir) -> tuple[dict, Path]:
    return run_bench(workdir, "plain", [])


@pytest.fixture(scope="module")
def hf_run(workdir) -> tuple[dict, Path]:
    return run_bench(workdir, "hf", ["--compare-hf"])


def test_bench_reports_nanovllm_throughput(plain_run):
    run, _ = plain_run
    check_nanovllm(run)
    assert not any(key.startswith("hf_") for key in run), "no HF numbers without --compare-hf"
    # All 4 admitted at once: one prefill step, then decodes; no gap spans a prefill.
    assert run["scheduling_policy"] == DEFAULT_SCHEDULING_POLICY
    assert run["prefill_steps"] == 1 and run["mixed_steps"] == 0
    assert run["itl_during_prefill_count"] == 0 and run["itl_during_prefill_mean_ms"] is None


@pytest.mark.parametrize("policy", ["mixed", "prefill_first"])
def test_bench_scheduling_policy_and_inter_token_latency(workdir, policy):
    """Two sequences at a time out of 4: the later ones are prefilled while the first decode, so
    there are gaps during prefills; mixed steps exactly under the mixed policy."""
    run, _ = run_bench(workdir, policy, ["--scheduling-policy", policy, "--max-num-seqs", "2",
                                         "--max-num-batched-tokens", "64"])
    check_nanovllm(run)
    assert (run["scheduling_policy"], run["max_num_seqs"], run["max_num_batched_tokens"]) == (policy, 2, 64)
    assert run["prefill_steps"] >= 2 and run["decode_steps"] > 0 and run["preemptions"] == 0
    assert (run["mixed_steps"] > 0) == (policy == "mixed")
    # Every output token after a sequence's first closes one gap.
    assert run["itl_mean_ms"] > 0 and run["itl_during_prefill_mean_ms"] > 0
    assert 0 < run["itl_during_prefill_count"] < run["total_output_tokens"] - 4
    assert run["process_cpu_s"] > 0


def test_bench_compare_hf(hf_run, plain_run):
    run, _ = hf_run
    check_nanovllm(run)
    # The same seed gives the same workload with or without --compare-hf.
    assert run["total_output_tokens"] == plain_run[0]["total_output_tokens"]
    assert run["total_input_tokens"] == plain_run[0]["total_input_tokens"]
    assert run["hf_time_s"] > 0 and run["hf_throughput_tok_s"] > 0
    # HF's throughput counts the requested output tokens, the same as nanovllm's.
    assert run["hf_time_s"] == pytest.approx(run["total_output_tokens"] / run["hf_throughput_tok_s"],
                                             abs=time_tolerance(run["hf_time_s"], run["hf_throughput_tok_s"]))
    assert run["speedup_vs_hf"] == pytest.approx(run["throughput_tok_s"] / run["hf_throughput_tok_s"],
                                                 rel=RATIO_TOLERANCE, abs=RATIO_TOLERANCE)
    # One batch of all 4 (the CPU default batch size is 16) runs to its longest output length:
    # the same length for all 4, and at least the requested work.
    assert run["hf_batch_size"] == 16 and run["hf_num_batches"] == 1
    assert run["hf_generated_tokens"] % 4 == 0
    assert run["total_output_tokens"] <= run["hf_generated_tokens"] <= 4 * 16
    assert run["hf_cache"] == "dynamic" and "transformers" in run["hf_setup"]
    assert run["hf_setup"].endswith("sampling at temperature 0.6")  # bench.py's default, as nanovllm's


def test_benchmark_plot_writes_png(plain_run, hf_run, tmp_path):
    image_reader = pytest.importorskip("matplotlib.image", reason="matplotlib (the optional `bench` extra) "
                                       "is not installed, and drawing needs it")
    # One file as --json-out writes it, one as JSON lines (two runs).
    lines = tmp_path / "runs.jsonl"
    lines.write_text(json.dumps(plain_run[0]) + "\n" + json.dumps(hf_run[0]) + "\n")
    out = tmp_path / "plot" / "benchmark.png"
    run_script([str(REPO / "benchmark_plot.py"), str(hf_run[1]), str(lines), "--out", str(out)], cwd=tmp_path)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    image = image_reader.imread(out)  # [height, width, channels]
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_benchmark_plot_rejects_non_results(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}\n')
    result = subprocess.run([sys.executable, str(REPO / "benchmark_plot.py"), str(bad), "--out",
                             str(tmp_path / "x.png")], check=False, capture_output=True, text=True,
                            timeout=SCRIPT_TIMEOUT_S)
    assert result.returncode != 0 and "lacks" in result.stderr
    assert not (tmp_path / "x.png").exists()


# --- bench.py with no arguments, as nano-vllm's ---

@pytest.fixture(scope="module")
def bench():
    """bench.py imported as a module, for its constants and its model choice."""
    spec = importlib.util.spec_from_file_location("bench", REPO / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_with_no_arguments_runs_and_says_what_it_chose(bench, tmp_path):
    """A HOME without nano-vllm's checkpoint and no visible GPU (on any machine): the tiny model
    and the CPU workload, said on the first line; the table and the JSON line follow."""
    env = {**os.environ, "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("XDG_CACHE_HOME", None)
    result = run_script([str(REPO / "bench.py")], cwd=tmp_path, env=env)
    lines = result.stdout.strip().splitlines()
    name = bench.SYNTHETIC[bench.DEFAULT_SYNTHETIC_CPU][1]
    assert lines[0].startswith(f"bench: model {name} (no --model or --synthetic given")
    assert f"{bench.NANO_VLLM_CHECKPOINT} does not exist" in lines[0] and "default on CPU" in lines[0]
    assert (f"workload {bench.CPU_NUM_SEQS} seqs with input and output lengths "
            f"{bench.CPU_MIN_LEN}..{bench.CPU_MAX_LEN} (the CPU default") in lines[0]
    assert any(line.startswith("nanovllm output tok/s") for line in lines[1:-1])
    run = json.loads(lines[-1])
    assert run["device"] == "cpu" and run["model"] == name and run["cpu_scaled_workload"] is True
    assert run["num_seqs"] == bench.CPU_NUM_SEQS
    assert run["input_len_range"] == run["output_len_range"] == [bench.CPU_MIN_LEN, bench.CPU_MAX_LEN]
    built = tmp_path / ".cache" / "nanovllm" / "checkpoints" / bench.SYNTHETIC[bench.DEFAULT_SYNTHETIC_CPU].dirname
    assert (built / "config.json").is_file(), "the synthetic checkpoint is built under ~/.cache/nanovllm/"
    assert not (tmp_path / "checkpoints").exists(), "nothing is written to the directory bench.py runs from"


def test_bench_checkpoints_go_to_the_xdg_cache(bench, tmp_path, monkeypatch):
    """--workdir defaults to $XDG_CACHE_HOME/nanovllm/checkpoints when that is an absolute path,
    else ~/.cache/nanovllm/checkpoints (a relative XDG_CACHE_HOME is ignored, as the spec says)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", ["bench.py"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bench.parse_args().workdir == str(tmp_path / "xdg" / "nanovllm" / "checkpoints")
    for ignored in ("relative/cache", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert bench.parse_args().workdir == str(tmp_path / "home" / ".cache" / "nanovllm" / "checkpoints")


def test_bench_engine_flags_are_generated_from_config(bench, monkeypatch, capsys):
    """Every Config field bench does not set its own way is a flag, with Config's choices."""
    monkeypatch.setattr(sys, "argv", ["bench.py", "--device", "cpu", "--scheduling-policy", "prefill_first",
                                      "--max-num-seqs", "3", "--no-enable-prefix-caching"])
    args = bench.parse_args()
    generated = [f.name for f in dataclasses.fields(Config) if f.init and f.name not in bench.BENCH_OWN_CONFIG_FIELDS]
    assert args.config_fields == generated and "preemption_mode" in generated
    assert (args.device, args.scheduling_policy, args.max_num_seqs, args.enable_prefix_caching) == \
        ("cpu", "prefill_first", 3, False)
    assert args.max_num_batched_tokens == Config.max_num_batched_tokens  # Config's default, not bench's own
    monkeypatch.setattr(sys, "argv", ["bench.py", "--attention-backend", "nope"])
    with pytest.raises(SystemExit):
        bench.parse_args()
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and all(value in err for value in VOCABULARIES["attention_backend"])


def test_bench_model_choice(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bench.choose_model("/some/dir", None, on_cpu=True).path == "/some/dir"
    assert bench.choose_model(None, "qwen3-0.6b", on_cpu=True).synthetic == "qwen3-0.6b"
    # No checkpoint at nano-vllm's path: a random-weight model sized for the device.
    assert bench.choose_model(None, None, on_cpu=True).synthetic == "tiny"
    on_cuda = bench.choose_model(None, None, on_cpu=False)
    assert on_cuda.synthetic == "qwen3-0.6b" and on_cuda.path is None and "CUDA" in on_cuda.reason
    # With one there, nano-vllm's checkpoint on either device.
    default = tmp_path / "huggingface" / "Qwen3-0.6B"
    default.mkdir(parents=True)
    for on_cpu in (True, False):
        choice = bench.choose_model(None, None, on_cpu=on_cpu)
        assert choice.path == str(default) + os.sep and choice.synthetic is None and "exists" in choice.reason


def test_bench_runs_each_kv_cache_dtype_of_a_comma_list(workdir):
    """--kv-cache-dtype auto,fp8_e4m3: one engine per cache dtype over the same workload, and a
    JSON line holding both runs with the throughput of the second relative to the first."""
    result, _ = run_bench(workdir, "kv_dtypes", ["--kv-cache-dtype", "auto,fp8_e4m3"])
    assert result["kv_cache_dtypes"] == ["auto", "fp8_e4m3"]
    first, second = result["runs"]
    for run in (first, second):
        check_nanovllm(run)
    assert (first["kv_cache_dtype"], second["kv_cache_dtype"]) == ("auto", "fp8_e4m3")
    assert first["total_output_tokens"] == second["total_output_tokens"]
    assert second["throughput_vs_first"] == pytest.approx(second["throughput_tok_s"] / first["throughput_tok_s"],
                                                          abs=0.002)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_hf_baseline_samples_as_nanovllm_does(bench, plain_run, workdir, monkeypatch, temperature):
    """--temperature reaches every HF generate call: greedy at 0, else that temperature alone."""
    seen = []

    def fake_generate(model, prompts, max_new_tokens, pad_token_id, cache, max_cache_len, sampling):
        seen.append(sampling)
        return max_new_tokens * len(prompts)

    monkeypatch.setattr(bench, "hf_generate", fake_generate)
    checkpoint = workdir / bench.SYNTHETIC["tiny"].dirname  # built by plain_run
    result = bench.run_hf_baseline(str(checkpoint), [[1, 2, 3], [4, 5]], [4, 6], "cpu", torch.float32,
                                   batch_size=2, cache_mode="dynamic", seed=0, temperature=temperature)
    expected = {"do_sample": False} if temperature == 0 else \
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    assert seen and all(sampling == expected for sampling in seen)
    assert result.setup.endswith("greedy" if temperature == 0 else f"temperature {temperature}")


# --- benchmarks/memory.py --quick ---

MEMORY_TABLE_HEADER = ("shape | dtype | fused kernels | malloc tuning | checkpoint MiB | fixed MiB | KV MiB | RSS MiB | "
                       "peak MiB | ratio | peak ratio")
MIB = 1 << 20


def test_memory_benchmark_table_and_json_agree(tmp_path):
    """--quick (the tiny shape, float32 and bfloat16): a table row per JSON row with the same
    numbers, and each ratio recomputed from its row's own bytes."""
    result = run_script([str(REPO / "benchmarks" / "memory.py"), "--quick", "--workdir", str(tmp_path)], cwd=tmp_path)
    lines = result.stdout.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["benchmark"] == "memory" and report["cores"] >= 1
    rows = report["rows"]
    assert [(r["shape"], r["dtype"], r["fused_kernels"], r["malloc_tuning"]) for r in rows] == \
        [("tiny", "float32", "cpu", "on"), ("tiny", "bfloat16", "cpu", "on")]
    table = lines[lines.index(MEMORY_TABLE_HEADER) + 1:][:len(rows)]
    for row, line in zip(rows, table):
        # the checkpoint's elements at the dtype's size; the model holds them (and its rotary tables)
        assert row["checkpoint_bytes"] == row["checkpoint_elements"] * getattr(torch, row["dtype"]).itemsize
        assert row["model_tensor_bytes"] >= row["checkpoint_bytes"]
        assert 0 < row["fixed_rss_bytes"] <= row["fixed_peak_bytes"] <= row["peak_bytes"]
        assert row["fixed_rss_bytes"] < row["rss_bytes"] <= row["peak_bytes"]
        assert 0 < row["kv_cache_bytes"] <= report["kv_cache_gib"] * (1 << 30)
        assert row["fused_kernels_used"] in ("cpu", "torch") and row["platform"] == row["fused_kernels_used"]
        for key, of in (("ratio", "rss_bytes"), ("peak_ratio", "peak_bytes")):
            added = row[of] - row["fixed_rss_bytes"] - row["kv_cache_bytes"]
            assert row[key] == pytest.approx(added / row["checkpoint_bytes"], abs=0.0005)
        cells = line.split(" | ")
        assert cells[:4] == [row["shape"], row["dtype"], row["fused_kernels"], row["malloc_tuning"]]
        for cell, key in zip(cells[4:9], ("checkpoint_bytes", "fixed_rss_bytes", "kv_cache_bytes", "rss_bytes",
                                          "peak_bytes")):
            assert float(cell) == pytest.approx(row[key] / MIB, abs=0.05)
        assert cells[9:] == [f"{row['ratio']:.3f}x", f"{row['peak_ratio']:.3f}x"]
    float32, bfloat16 = rows
    assert float32["checkpoint_elements"] == bfloat16["checkpoint_elements"]
    assert float32["checkpoint_bytes"] == 2 * bfloat16["checkpoint_bytes"]
