"""Checks that cannot be bypassed: SamplingParams frozen once checked, seeds range-checked with n,
a checkpoint without a usable tokenizer refused at load (unless skip_tokenizer_init=True, whose
token-id-only path runs end to end), and unreadable config.json or safetensors files named.
Each refusal comes before any work is queued, and the next good call works."""
import dataclasses
import os
import re
import shutil

import pytest

from helpers import greedy, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.engine import llm_engine
from nanovllm.config import Config
from nanovllm.sampling_params import MAX_SEED, MIN_SEED

BLOCK = 16
ENGINE = dict(device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=32, max_model_len=256)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# The bound on the heartbeat timeout's default: a silent worker is reported within a
# minute unless the user asks for longer.
MAX_DEFAULT_HEARTBEAT_TIMEOUT_S = 60


def copy_checkpoint(src: str, dst, drop: tuple[str, ...] = ()) -> str:
    shutil.copytree(src, dst)
    for name in drop:
        os.remove(os.path.join(dst, name))
    return str(dst)


def assert_clean(llm: LLM) -> None:
    """Nothing queued or running, and every KV block free."""
    assert llm.is_finished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    engine = LLM(qwen3_tiny, **ENGINE)
    yield engine
    engine.exit()


@pytest.fixture(scope="module")
def no_tokenizer(qwen3_tiny, tmp_path_factory) -> str:
    """qwen3_tiny's weights and config.json, without any tokenizer file."""
    return copy_checkpoint(qwen3_tiny, tmp_path_factory.mktemp("ckpt") / "no_tokenizer", drop=TOKENIZER_FILES)


# --- SamplingParams: checked once, then immutable ---

@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SamplingParams)])
def test_every_sampling_field_refuses_assignment(field):
    params = SamplingParams(stop=["x"], stop_token_ids=[3], seed=1)
    before = getattr(params, field)
    with pytest.raises(dataclasses.FrozenInstanceError, match=rf"{field}=.*dataclasses\.replace\(params, {field}="):
        setattr(params, field, before)
    with pytest.raises(dataclasses.FrozenInstanceError, match=field):
        delattr(params, field)
    assert getattr(params, field) == before


def test_misspelt_field_is_named():
    with pytest.raises(AttributeError, match=r"SamplingParams has no field 'temprature'; its fields are \['n', "):
        SamplingParams().temprature = 0


def test_the_audits_assignments_are_refused_and_the_engine_runs_the_checked_values(llm):
    params = greedy(6)
    for field, value in (("stop", ["a"]), ("temperature", -1), ("logprobs", 1000), ("n", 0)):
        with pytest.raises(AttributeError, match=re.escape(f"{field}={value!r} refused")):
            setattr(params, field, value)
    (out,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(out["token_ids"]) == 6 and "outputs" not in out and "logprobs" not in out
    assert_clean(llm)


def test_callers_lists_are_copied_and_replace_checks_again():
    stops, ids = ["ab"], [4]
    params = SamplingParams(stop=stops, stop_token_ids=ids)
    stops.append("")  # an empty stop string would end every sequence at once, were it taken
    ids.append(-1)
    assert params.stop == params.stop_strings == ("ab",) and params.stop_token_ids == (4,)
    assert dataclasses.replace(params, top_k=5).top_k == 5 and params.top_k == 0
    with pytest.raises(ValueError, match="temperature=-1"):
        dataclasses.replace(params, temperature=-1)
    same = SamplingParams(stop="ab", stop_token_ids=(4,))
    assert same == params and hash(same) == hash(params)


# --- seeds: every sample's seed (seed + i) is one torch.Generator takes ---

@pytest.mark.parametrize("seed, n", [(MAX_SEED + 1, 1), (MIN_SEED - 1, 1), (MAX_SEED - 1, 3), (MAX_SEED, 2)])
def test_seed_out_of_range_with_n_refused(seed, n):
    with pytest.raises(ValueError, match=rf"seed={seed} .*n={n}.*\[{MIN_SEED}, {MAX_SEED - n + 1}\]"):
        SamplingParams(seed=seed, n=n)


@pytest.mark.parametrize("seed, n", [(MAX_SEED - 2, 3), (MIN_SEED, 2)])
def test_seeds_at_the_ends_of_the_range_sample(llm, seed, n):
    params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=3, ignore_eos=True)
    first = llm.generate([[9, 8, 7]], params, use_tqdm=False)[0]["outputs"]
    again = llm.generate([[9, 8, 7]], params, use_tqdm=False)[0]["outputs"]
    assert [s["token_ids"] for s in first] == [s["token_ids"] for s in again]
    assert all(len(s["token_ids"]) == 3 for s in first)
    assert_clean(llm)


# --- tokenizer: usable, or explicitly skipped ---

@pytest.mark.parametrize("drop, corrupt, message", [
    (TOKENIZER_FILES, None, r"no ordinary tokens.*missing: tokenizer\.json \(or else tokenizer_config\.json and "
                            r"vocabulary files"),
    (("tokenizer.json",), None, r"loading it failed.*present: \['tokenizer_config\.json'\]; missing: tokenizer\.json"),
    ((), "tokenizer.json", r"loading it failed with JSONDecodeError.*present: \['tokenizer\.json'"),
], ids=["no tokenizer files", "tokenizer_config.json only", "corrupt tokenizer.json"])
def test_checkpoint_without_usable_tokenizer_refused_before_the_model_loads(qwen3_tiny, tmp_path, monkeypatch,
                                                                            drop, corrupt, message):
    path = copy_checkpoint(qwen3_tiny, tmp_path / "ckpt", drop)
    if corrupt:
        with open(os.path.join(path, corrupt), "w") as f:
            f.write('{"version": "1.0", "truncat')

    def no_model(config):
        raise AssertionError("the model was loaded for a checkpoint that has no usable tokenizer")
    monkeypatch.setattr(llm_engine, "create_model_runner", no_model)
    with pytest.raises(ValueError, match=rf"model=.* has no usable tokenizer: .*{message}.*skip_tokenizer_init=True"):
        LLM(path, **ENGINE)


def test_skip_tokenizer_init_runs_token_ids_end_to_end(llm, no_tokenizer):
    bare = LLM(no_tokenizer, skip_tokenizer_init=True, **ENGINE)
    try:
        assert bare.tokenizer is None and bare.config.eos == llm.config.eos >= 0  # from config.json
        prompts = random_prompts(200, [5, 23, 40], seed=21)
        params = [greedy(6), SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=6),
                  SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[llm.config.eos + 1])]
        got = bare.generate(prompts, params, use_tqdm=False)
        want = llm.generate(prompts, params, use_tqdm=False)
        assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
        assert [s["token_ids"] for s in got[1]["outputs"]] == [s["token_ids"] for s in want[1]["outputs"]]
        assert all(o["text"] == "" for o in got + got[1]["outputs"]) and any(o["text"] for o in want)
        streamed = list(bare.stream(prompts[:1], greedy(6)))
        assert [t for s in streamed for t in s.token_ids] == got[0]["token_ids"]
        assert all(s.text == "" for s in streamed) and streamed[-1].finished
        assert_clean(bare)

        refusals = [
            (lambda: bare.generate([prompts[0], "hello world"], greedy(6), use_tqdm=False),
             r"prompt='hello world' is a string.*skip_tokenizer_init=True.*token ids"),
            (lambda: bare.generate(prompts[:1], greedy(6, stop=["ab"]), use_tqdm=False),
             r"stop=\['ab'\] needs a tokenizer.*skip_tokenizer_init=True.*stop_token_ids"),
            (lambda: list(bare.stream(prompts[:1], greedy(6, stop="ab"))), r"stop=\['ab'\] needs a tokenizer"),
            (lambda: bare.chat([{"role": "user", "content": "hi"}], greedy(6), use_tqdm=False),
             r"chat\(\) needs the tokenizer's chat template.*skip_tokenizer_init=True"),
        ]
        for call, message in refusals:
            with pytest.raises(ValueError, match=message):
                call()
            assert_clean(bare)
        assert bare.generate(prompts[:1], greedy(6), use_tqdm=False)[0]["token_ids"] == got[0]["token_ids"]
    finally:
        bare.exit()


# --- unreadable files are named ---

@pytest.mark.parametrize("content, message", [
    ('{"architectures": ["Qwen3ForCausalLM"], ', r"config\.json is not valid JSON \(Expecting"),
    ("[1, 2]", r"config\.json holds a JSON list, not an object"),
    ('{"architectures": ["Qwen3ForCausalLM"]}', r"config\.json is not a config transformers can read.*model_type"),
])
def test_unreadable_config_json_is_named(qwen3_tiny, tmp_path, content, message):
    path = copy_checkpoint(qwen3_tiny, tmp_path / "ckpt")
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(content)
    with pytest.raises(ValueError, match=message) as refused:
        LLM(path, **ENGINE)
    assert os.path.join(path, "config.json") in str(refused.value)


# How much of the file is left: half (the header, part of the tensor data), part of the header,
# less than the header's 8-byte length field.
@pytest.mark.parametrize("keep", [lambda size: size // 2, lambda size: 40, lambda size: 7], ids=["half", "40", "7"])
def test_truncated_safetensors_is_named(qwen3_tiny, tmp_path, keep, llm):
    path = copy_checkpoint(qwen3_tiny, tmp_path / "ckpt")
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:keep(len(data))])
    with pytest.raises(ValueError, match=rf"checkpoint file {file} cannot be read as safetensors \(.+\); it may "
                                         r"be truncated or corrupt"):
        LLM(path, **ENGINE)
    assert len(llm.generate([[1, 2, 3]], greedy(6), use_tqdm=False)[0]["token_ids"]) == 6  # others unaffected


def test_heartbeat_timeout_has_a_short_default_and_is_checked(qwen3_tiny):
    default = next(f.default for f in dataclasses.fields(Config) if f.name == "tensor_parallel_heartbeat_timeout_s")
    assert 1 <= default <= MAX_DEFAULT_HEARTBEAT_TIMEOUT_S
    for bad in (0.5, 0, -3, float("nan"), float("inf"), "30", True):
        with pytest.raises(ValueError, match=rf"tensor_parallel_heartbeat_timeout_s={bad!r} .*>= 1"):
            Config(qwen3_tiny, tensor_parallel_heartbeat_timeout_s=bad)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        Config(qwen3_tiny, skip_tokenizer_init="yes")

