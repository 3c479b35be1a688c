"""The demo model (nanovllm/demo_model.py) at a reduced recipe (conftest.DEMO_TEST_RECIPE): it
trains, saves a normal HF checkpoint, reloads with transformers, and nanovllm's greedy output on
it matches HF's token for token; the cache builds it once; the CLI builds it and defaults to it."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEMO_TEST_RECIPE
from helpers import greedy, hf_greedy
from transformers import AutoConfig, AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.demo_model import (DEMO_DIR_NAME, EOS_TOKEN, INFO_FILE, DemoRecipe, build_demo_model, corpus_files,
                                 default_model)
from nanovllm.entrypoints.cli.main import main

REPO_ROOT = Path(__file__).resolve().parents[1]
CODE_PROMPTS = ["def read_file(path):\n", "class Config:\n    def __init__(self", "import os\nimport sys\n\n"]
# A recipe of seconds for the tests that build their own models.
QUICK = DemoRecipe(**{**DEMO_TEST_RECIPE, "steps": 2, "corpus_bytes": 60_000, "tokenizer_bytes": 60_000})


def _model_dir(cache: str) -> str:
    return os.path.join(cache, "nanovllm", DEMO_DIR_NAME)


def test_builder_saves_an_hf_checkpoint_that_learned(demo_cache):
    path = _model_dir(demo_cache)
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.vocab_size == DEMO_TEST_RECIPE["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == EOS_TOKEN and config.eos_token_id == tokenizer.eos_token_id
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    info = json.loads(Path(path, INFO_FILE).read_text())
    # An untrained model's loss is about ln(vocab); a few steps on Python text bring it down.
    assert abs(info["first_loss"] - math.log(config.vocab_size)) < 1.0, info
    assert info["final_loss"] < info["first_loss"] - 0.3, info


def test_greedy_matches_hf_transformers(demo_cache):
    path = _model_dir(demo_cache)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(p) for p in CODE_PROMPTS]
    with LLM(path, device="cpu", dtype="float32") as llm:
        ours = [out["token_ids"] for out in llm.generate(prompts, greedy(24), use_tqdm=False)]
    assert ours == hf_greedy(path, prompts, 24)


def test_same_recipe_gives_the_same_checkpoint(tmp_path):
    first = build_demo_model(tmp_path / "a", QUICK, log=lambda message: None)
    second = build_demo_model(tmp_path / "b", QUICK, log=lambda message: None)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert Path(first, name).read_bytes() == Path(second, name).read_bytes(), name


def test_held_out_files_are_never_trained_on():
    train, held_out = set(corpus_files()), set(corpus_files(held_out=True))
    assert train and held_out and not train & held_out


def test_default_model_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    messages = []
    path = default_model(QUICK, log=messages.append)
    assert path == _model_dir(str(tmp_path))
    assert any(path in message for message in messages), messages  # says where it builds
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    again = []
    assert default_model(QUICK, log=again.append) == path and again == []  # cached: not built again
    assert sorted(os.listdir(tmp_path / "nanovllm")) == [DEMO_DIR_NAME]  # no staging folder left behind


def _cli(args: list[str], cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": cache, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nanovllm", *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_generate_defaults_to_the_demo_model(demo_cache):
    run = _cli(["generate", CODE_PROMPTS[0], "--temperature", "0", "--max-tokens", "8", "--device", "cpu"], demo_cache)
    assert run.returncode == 0, run.stderr
    with LLM(_model_dir(demo_cache), device="cpu") as llm:
        expected = llm.generate(CODE_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert run.stdout == expected[0]["text"] + "\n"


def test_cli_demo_model_builds_into_a_dir(tmp_path):
    run = _cli(["demo-model", str(tmp_path / "demo"), "--steps", "1"], str(tmp_path / "cache"))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "demo")
    assert AutoConfig.from_pretrained(tmp_path / "demo").architectures == ["Qwen3ForCausalLM"]
    assert not (tmp_path / "cache").exists()  # a DIR given: the cache is left alone


@pytest.mark.parametrize("steps", ["0", "-3", "many"])
def test_cli_demo_model_refuses_bad_steps(steps, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo-model", str(tmp_path / "demo"), "--steps", steps])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--steps" in err and repr(steps) in err, err
    assert not (tmp_path / "demo").exists()


def test_example_py_completes_code_with_the_demo_model(demo_cache):
    spec = importlib.util.spec_from_file_location("example", REPO_ROOT / "example.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    run = subprocess.run([sys.executable, "example.py", "--max-tokens", "8", "--device", "cpu"], cwd=REPO_ROOT,
                         env={**os.environ, "XDG_CACHE_HOME": demo_cache, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    with LLM(_model_dir(demo_cache), device="cpu") as llm:
        outputs = llm.generate(example.CODE_PROMPTS, SamplingParams(**example.DEMO_PARAMS, max_tokens=8),
                               use_tqdm=False)
    for prompt, output in zip(example.CODE_PROMPTS, outputs):
        assert prompt + output["text"] in run.stdout


def test_default_model_rebuilds_what_an_older_recipe_left(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stale = Path(_model_dir(str(tmp_path)))
    stale.mkdir(parents=True)
    (stale / INFO_FILE).write_text(json.dumps({"recipe_version": 0}))  # an older recipe, or a torn build
    messages = []
    path = default_model(QUICK, log=messages.append)
    assert messages and json.loads(Path(path, INFO_FILE).read_text())["recipe"]["steps"] == QUICK.steps
    assert AutoConfig.from_pretrained(path).architectures == ["Qwen3ForCausalLM"]


def test_cli_generate_reads_a_first_of_several_words_as_model(tmp_path, capsys, monkeypatch):
    """`generate "a" "b"`: MODEL is "a" (as README says), refused in one line before any build."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["generate", "def a():", "def b():"]) == 1
    assert "model directory 'def a():' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nanovllm").exists()  # the demo model was not built for it
