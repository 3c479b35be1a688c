"""What a fresh CPU install needs: triton is a CUDA-only dependency (pyproject's `cuda` extra), so
nothing on the CPU path may import it. A subprocess with triton made unimportable runs the engine,
the CLI and the server modules on CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# sys.modules["triton"] = None makes every `import triton` raise ImportError, as on a machine
# without it. Then: the package and its entry points import, and CPU generates, in float32 and
# with an fp8 KV cache and n-gram speculation (the paths with kernels of their own on CUDA).
NO_TRITON_SCRIPT = """
import sys
sys.modules["triton"] = None
from nanovllm import LLM, SamplingParams
import nanovllm.entrypoints.cli.main, nanovllm.entrypoints.openai.api_server, nanovllm.entrypoints.batch.job
from nanovllm.demo_model import default_model

path = default_model()
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
for kwargs in ({}, {"kv_cache_dtype": "fp8_e4m3"},
               {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}):
    with LLM(path, device="cpu", **kwargs) as llm:
        out = llm.generate(["def main():\\n"], params, use_tqdm=False)[0]
        assert len(out["token_ids"]) == 8, out
print("ok")
"""


def test_cpu_path_runs_without_triton(demo_cache):
    env = {**os.environ, "XDG_CACHE_HOME": demo_cache, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", NO_TRITON_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_triton_is_a_cuda_and_test_extra_not_a_core_dependency():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip()
                for req in requirements}
    assert "triton" not in names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "triton" in names(extras["cuda"]) and "triton" in names(extras["test"])
