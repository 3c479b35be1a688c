"""scripts/gpu_check.py and scripts/gpu_parity.py without a GPU: argument handling, the stage
limits, reading each stage's output, the summary (with fake stages standing in for the real
ones), and the parity check itself run on CPU."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


@pytest.fixture(scope="module")
def gpu_parity():
    return load_script("gpu_parity")


def test_stage_limits_fit_in_nine_minutes(gpu_check):
    assert gpu_check.TOTAL_LIMIT_S == 9 * 60
    assert sum(stage.timeout_s for stage in gpu_check.STAGES) + gpu_check.OVERHEAD_S < gpu_check.TOTAL_LIMIT_S
    assert {stage.name for stage in gpu_check.STAGES} == {"suite", "parity", "decode_bandwidth", "bench",
                                                          "step_profile"}
    (bench,) = [stage for stage in gpu_check.STAGES if stage.name == "bench"]
    assert bench.args == ["bench.py", "--synthetic", "qwen3-0.6b", "--compare-hf"]


def test_arguments(gpu_check, tmp_path):
    out, stages = gpu_check.parse_args([str(tmp_path / "run")])
    assert out == (tmp_path / "run").resolve() and stages == list(gpu_check.STAGES)
    _, stages = gpu_check.parse_args(["out", "--stages", "bench,parity", "--timeout", "bench=300"])
    parity = next(stage for stage in gpu_check.STAGES if stage.name == "parity")
    assert [(s.name, s.timeout_s) for s in stages] == [("bench", 300), ("parity", parity.timeout_s)]
    for bad in (["out", "--stages", "suite,gpu"], ["out", "--stages", ","], ["out", "--timeout", "bench=soon"],
                ["out", "--timeout", "nothing=5"], []):
        with pytest.raises(SystemExit) as error:
            gpu_check.parse_args(bad)
        assert error.value.code == 2


def test_pytest_output_read_whole_and_cut_short(gpu_check):
    whole = ("..F.s.E\n=================== FAILURES ===================\nE   assert 0 == 1\nE\n"
             "FAILED tests/test_a.py::test_b - assert 0 == 1\nERROR tests/test_c.py::test_d - RuntimeError\n"
             "1 failed, 4 passed, 1 skipped, 1 error, 3 warnings in 12.50s\n")
    facts = gpu_check.pytest_facts(whole)
    assert {k: facts[k] for k in ("passed", "failed", "skipped", "errors")} == {"passed": 4, "failed": 1,
                                                                                "skipped": 1, "errors": 1}
    assert facts["pytest_seconds"] == 12.5
    assert facts["not_passed"] == ["FAILED tests/test_a.py::test_b", "ERROR tests/test_c.py::test_d"]
    assert facts["progress"] == {"results": 7, "failed": 1, "errors": 1}
    assert gpu_check.describe_suite(facts) == "4 passed, 1 failed, 1 errors, 1 skipped"
    cut = "$ python -m pytest\n" + "." * 72 + " [ 40%]\n" + ".F.."
    facts = gpu_check.pytest_facts(cut)
    assert "passed" not in facts and facts["progress"] == {"results": 76, "failed": 1, "errors": 0}
    assert gpu_check.describe("suite", facts, None, 190, cut) == (
        "stopped at its 190 s limit; 76 results before it stopped (1 failed, 0 errors)")
    assert gpu_check.pytest_facts("Traceback\nImportError: no module\n") is None


def test_json_stages_described(gpu_check):
    log = 'text\n{"not": "last"}\n{"float32_sequences": 52, "float32_identical": 51, "bfloat16_agreement": 0.5}\n'
    facts = gpu_check.last_json_line(log + "trailing words\n")
    assert facts["float32_identical"] == 51
    assert gpu_check.describe("parity", facts, 1, 80, log) == (
        "float32 51/52 sequences identical; bfloat16 agreement 0.50")
    bandwidth = {"decode_gbps": 1000.4, "copy_gbps": 2000.0, "fraction_of_copy": 0.5002}
    assert gpu_check.describe("decode_bandwidth", bandwidth, 0, 40, "") == "1000 GB/s = 50.0% of copy (2000 GB/s)"
    bench = {"throughput_tok_s": 12345.6, "dtype": "bfloat16", "hf_throughput_tok_s": 1000.0, "speedup_vs_hf": 12.3456}
    assert gpu_check.describe("bench", bench, 0, 205, "") == (
        "nanovllm 12,346 tok/s (bfloat16); HF 1,000 tok/s; 12.35x")
    assert gpu_check.describe("bench", {"other": 1}, 0, 205, "").startswith("unexpected JSON (KeyError")
    run = {"tok_s": 14062.2, "model_s": 7.4, "sampler_s": 0.91, "host_s": 0.56, "kv_tb_per_s": 1.87}
    profile = {"startup_s": 20.3, "copy_tb_per_s": 3.0, "runs": [{**run, "tok_s": 10000.0}, run]}
    assert gpu_check.describe("step_profile", profile, 0, 90, "") == (
        "start-up 20.3 s; steady 14,062 tok/s, decode model 7.40 s, sampler 0.91 s, host 0.56 s, "
        "KV 1.87 of 3.00 TB/s copy")
    assert gpu_check.describe("bench", None, 1, 205, "loading\nValueError: no\n") == (
        "no result; last line: ValueError: no")


def test_time_left_by_a_stage_goes_to_the_next(gpu_check):
    first, second, third = (gpu_check.Stage(name, [], limit, "") for name, limit in (("a", 50), ("b", 100), ("c", 30)))
    total = 180
    assert gpu_check.stage_limit(first, [second, third], total) == 50
    # "a" took 20 s of its 50: "b" may use the 30 left over, "c" still gets its own 30.
    assert gpu_check.stage_limit(second, [third], total - 20) == 130
    assert gpu_check.stage_limit(third, [], total - 20 - 60) == 100
    # A stage that overran (its stop took a few seconds) never cuts the next below its own limit.
    assert gpu_check.stage_limit(second, [third], total - 55) == 100


FAKE_ENV = {"commit": "abc1234", "device": "Fake GPU 80GB", "torch": "9.9", "cuda": "13.0", "triton": "3.6.0",
            "transformers": "5.17.0", "flash_attn": "not installed", "python": "3.12.3", "date": "2026-11-23 10:00 UTC"}


def fake_stages(gpu_check) -> tuple:
    """Quick stand-ins: a suite with a failure, a JSON stage, a crash, one past its limit, one more after it."""
    def stage(name: str, code: str, timeout_s: int = 60):
        return gpu_check.Stage(name, ["-c", code], timeout_s, f"fake {name}")
    suite = ("import sys; print('..F.'); print('FAILED tests/t.py::test_x - boom');"
             "print('1 failed, 3 passed in 0.10s'); sys.exit(1)")
    parity = 'import json; print("table"); print(json.dumps({"float32_sequences": 4, "float32_identical": 4}))'
    crash = "import sys; print('starting'); sys.exit(3)"
    sleeper = "import time; print('working', flush=True); time.sleep(60)"
    bench = 'import json; print(json.dumps({"throughput_tok_s": 10.0, "dtype": "float32"}))'
    return (stage("suite", suite), stage("parity", parity), stage("decode_bandwidth", crash),
            stage("sleeper", sleeper, timeout_s=1), stage("bench", bench))


def test_every_stage_recorded_and_summary_printed_last(gpu_check, tmp_path, monkeypatch, capsys):
    stages = fake_stages(gpu_check)
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    # No total to share out, so each stage keeps its own limit (the sleeper's 1 s).
    monkeypatch.setattr(gpu_check, "TOTAL_LIMIT_S", 0)
    monkeypatch.setattr(gpu_check, "environment", lambda: dict(FAKE_ENV))
    out = tmp_path / "out"
    assert gpu_check.main([str(out)]) == 1
    printed = capsys.readouterr().out.rstrip("\n").splitlines()
    table = (out / "summary.txt").read_text().rstrip("\n").splitlines()
    assert printed[-len(table):] == table, "the summary table is the last thing printed"
    head, rows = table[0], {line.split()[0]: line for line in table[1:]}
    for fact in ("abc1234", "Fake GPU 80GB", "torch 9.9", "triton 3.6.0", "2026-11-23"):
        assert fact in head
    assert "FAILED (1)" in rows["suite"] and "3 passed, 1 failed" in rows["suite"]
    assert "passed" in rows["parity"] and "float32 4/4 sequences identical" in rows["parity"]
    assert "FAILED (3)" in rows["decode_bandwidth"] and "last line: starting" in rows["decode_bandwidth"]
    assert "TIMED OUT" in rows["sleeper"] and "stopped at its 1 s limit" in rows["sleeper"]
    assert "passed" in rows["bench"] and "nanovllm 10 tok/s (float32)" in rows["bench"], "stages after a failure run"
    assert "NOT ALL PASSED" in rows["total"] and str(out) in rows["total"]
    for stage in stages:
        assert (out / f"{stage.name}.log").read_text().startswith(f"$ {sys.executable} -c")
    assert json.loads((out / "suite.json").read_text())["failed"] == 1
    assert json.loads((out / "parity.json").read_text())["float32_identical"] == 4
    assert not (out / "decode_bandwidth.json").exists()
    record = json.loads((out / "summary.json").read_text())
    assert record["commit"] == "abc1234"
    assert [s["status"] for s in record["stages"]] == ["FAILED (1)", "passed", "FAILED (3)", "TIMED OUT", "passed"]
    assert record["stages"][3]["returncode"] is None and record["stages"][3]["seconds"] < 30


def test_refuses_without_a_gpu(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "environment", lambda: {**FAKE_ENV, "device": "no CUDA device"})
    assert gpu_check.main([str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_environment_names_commit_device_and_versions(gpu_check):
    env = gpu_check.environment()
    assert env["torch"] == torch.__version__ and env["commit"]
    assert env["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
    assert set(env) >= {"triton", "transformers", "python", "date"}


# --- gpu_parity.py ---

def test_agreement_counts_tokens_before_the_first_difference(gpu_parity):
    assert gpu_parity.agreeing_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert gpu_parity.agreeing_prefix([5, 6], [5, 6]) == 2 and gpu_parity.agreeing_prefix([7], [8]) == 0
    run = gpu_parity.ParityRun
    runs = [run("qwen3", "float32", "triton", True, "mixed", 10, 9, 240, 230, 0, 0),
            run("qwen3", "bfloat16", "triton", True, "mixed", 10, 3, 240, 120, 0, 0),
            run("qwen2", "bfloat16", "triton", True, "mixed", 10, 5, 240, 180, 0, 0)]
    assert gpu_parity.summarize(runs) == {"float32_sequences": 10, "float32_identical": 9, "bfloat16_tokens": 480,
                                          "bfloat16_agreeing_tokens": 300, "bfloat16_agreement": 0.625}


def test_parity_check_runs_on_cpu(gpu_parity, capsys):
    """The script end to end on CPU (torch backend, one checkpoint, short outputs): float32 identical."""
    assert gpu_parity.main(["--device", "cpu", "--archs", "qwen3", "--max-tokens", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["device"] == "cpu" and result["max_tokens"] == 4
    # One checkpoint and one backend: float32 over every workload's calls, bfloat16 over the first workload.
    workloads = gpu_parity.workloads()
    assert result["float32_identical"] == result["float32_sequences"] == sum(len(w.prompts) * w.calls
                                                                             for w in workloads)
    assert result["bfloat16_tokens"] == len(workloads[0].prompts) * 4 and 0 <= result["bfloat16_agreement"] <= 1
    pressure = next(r for r in result["runs"] if r["workload"] == "pressure")
    assert pressure["preemptions"] > 0 and pressure["cached_tokens"] > 0
    assert len(lines) == 1 + len(result["runs"]) + 1, "a header, a row per run, the JSON line"
