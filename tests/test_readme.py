"""README.md's examples run as written: every ```python block runs in a subprocess against the demo
model (the reduced build of conftest's demo_cache, found through XDG_CACHE_HOME as a user's cache
would be), in a fresh folder; a block that talks to `nanovllm serve` gets a server on a free
loopback port in place of README's 127.0.0.1:8000. Shell blocks are not run, but CI's commands
(.ci/run) must be README's install and test commands, word for word."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serving import server_thread

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SERVER_URL = "http://127.0.0.1:8000/v1"  # README's `nanovllm serve` address
SNIPPET_TIMEOUT = 600  # seconds: the Ray block starts a local Ray on a busy 2-core machine


def _blocks(language: str, text: str = README) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block in `language`."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


PYTHON_BLOCKS = _blocks("python")


def test_readme_has_python_examples():
    assert len(PYTHON_BLOCKS) >= 5  # API, online API, speculative, OpenAI client, Ray Data


@pytest.mark.parametrize("line, code", PYTHON_BLOCKS, ids=[f"line{line}" for line, _ in PYTHON_BLOCKS])
def test_python_block_runs(line, code, demo_cache, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": demo_cache, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    script = tmp_path / f"readme_line{line}.py"

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=SNIPPET_TIMEOUT)

    if SERVER_URL in code:  # README starts it as `nanovllm serve --served-model-name qwen3 --api-key sk-local`
        model = os.path.join(demo_cache, "nanovllm", "demo-model")
        with server_thread(model, served_model_name="qwen3", api_key="sk-local") as server:
            script.write_text(code.replace(SERVER_URL, server.base_url))
            result = run()
    else:
        script.write_text(code)
        result = run()
    assert result.returncode == 0, f"README.md line {line}:\n{code}\n--- stderr:\n{result.stderr[-4000:]}"


def _commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_readme_commands_word_for_word():
    ci = _commands((REPO_ROOT / ".ci" / "run").read_text())
    ci = ci[ci.index(". .venv-ci/bin/activate") + 1:]  # what follows the fresh venv's activation
    readme_bash = [command for _, code in _blocks("bash") for command in _commands(code)]
    missing = [command for command in ci if command not in readme_bash]
    assert not missing, f"run by .ci/run but not in README.md: {missing}"
    test_section = README[README.index("\n## Test\n"):]
    test_block = _commands(_blocks("bash", test_section)[0][1])
    assert ci[-len(test_block):] == test_block  # CI ends with README's Test block, exactly
