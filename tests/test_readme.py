"""README.md's examples, and the documentation site's, run as written: every ```python block of
README.md and of docs/*.md runs in a subprocess against the demo model (the reduced build of
conftest's demo_cache, found through XDG_CACHE_HOME as a user's cache would be), in a fresh folder;
a block that talks to `nanovllm serve` gets a server on a free loopback port in place of the
documented 127.0.0.1:8000. Shell blocks are not run, but CI's commands (.ci/run) must be README's
install and test commands, word for word."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serving import server_thread

REPO_ROOT = Path(__file__).resolve().parents[1]
README = (REPO_ROOT / "README.md").read_text()
# The documentation site's pages (mkdocs.yml's docs_dir): their examples are held to README's rule.
DOC_PAGES = sorted((REPO_ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SERVER_URL = "http://127.0.0.1:8000/v1"  # the address `nanovllm serve` listens on in the examples
SNIPPET_TIMEOUT = 600  # seconds: the Ray block starts a local Ray on a busy 2-core machine


def _blocks(language: str, text: str = README) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block in `language`."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


README_BLOCKS = [("README.md", line, code) for line, code in _blocks("python")]
PYTHON_BLOCKS = README_BLOCKS + [(f"docs/{page.name}", line, code) for page in DOC_PAGES
                                 for line, code in _blocks("python", page.read_text())]


def test_readme_and_site_have_python_examples():
    readme_code = "\n".join(code for _, _, code in README_BLOCKS)
    assert "llm.generate(" in readme_code and SERVER_URL in readme_code  # README's generate and serve examples
    pages = {name for name, _, _ in PYTHON_BLOCKS}
    # the site's: generate and the request API, structured outputs and speculative decoding, the
    # OpenAI client, Ray Data
    assert {"docs/usage.md", "docs/sampling.md", "docs/serving.md", "docs/batch.md"} <= pages, pages
    assert len(PYTHON_BLOCKS) >= 8


@pytest.mark.parametrize("name, line, code", PYTHON_BLOCKS, ids=[f"{name}:line{line}" for name, line, _ in PYTHON_BLOCKS])
def test_python_block_runs(name, line, code, demo_cache, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": demo_cache, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    script = tmp_path / f"example_line{line}.py"

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=SNIPPET_TIMEOUT)

    if SERVER_URL in code:  # the docs start it as `nanovllm serve --served-model-name qwen3 --api-key sk-local`
        model = os.path.join(demo_cache, "nanovllm", "demo-model")
        with server_thread(model, served_model_name="qwen3", api_key="sk-local") as server:
            script.write_text(code.replace(SERVER_URL, server.base_url))
            result = run()
    else:
        script.write_text(code)
        result = run()
    assert result.returncode == 0, f"{name} line {line}:\n{code}\n--- stderr:\n{result.stderr[-4000:]}"


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
