"""The public API: outputs, stopping rules, config handling, and bad input refused up front
with a clear error that leaves the engine clean for the next call. Engines run on CPU unless a
test says otherwise: the start-up log on CUDA too, and what "auto" chooses on this machine."""
import json
import logging
import os
import shutil

import pytest
import torch

from helpers import (AUTO_BACKEND_SMALL_BLOCKS, AUTO_CPU_BACKEND, AUTO_DEVICE, EVERY_DEVICE, greedy, hf_greedy,
                     random_prompts)
from nanovllm import LLM, SamplingParams
from nanovllm.attention.flash_attn_backend import FLASH_ATTN_PAGE_MULTIPLE
from nanovllm.config import Config
from nanovllm.platform.device import CpuDevice, CudaDevice, device_platform
from nanovllm.layers.rotary_embedding import rope_config_of
from nanovllm.runner.graph import graph_batch_sizes

BLOCK = 16


@pytest.fixture(scope="module")
def llm(qwen3_tiny):
    engine = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=64, max_model_len=256)
    yield engine
    engine.exit()


def test_outputs_in_input_order_with_text_and_counts(llm):
    prompts = ["hello world", "the quick brown fox jumps", "a"]
    outputs = llm.generate(prompts, [greedy(3), greedy(7), greedy(5)], use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [3, 7, 5]
    for o in outputs:
        assert set(o) >= {"text", "token_ids", "finish_reason", "num_cached_tokens"}
        assert o["text"] == llm.tokenizer.decode(o["token_ids"], skip_special_tokens=True)
        assert o["finish_reason"] == "length"


def test_string_and_token_id_prompts_agree(llm):
    text = "hello world, hello again"
    ids = llm.tokenizer.encode(text)
    by_text, by_ids = llm.generate([text, ids], greedy(10), use_tqdm=False)
    assert by_text["token_ids"] == by_ids["token_ids"]


def test_eos_stops_unless_ignored(llm, qwen3_tiny):
    prompt = random_prompts(200, [10], seed=11)[0]
    free_run = hf_greedy(qwen3_tiny, [prompt], 12)[0]
    eos = free_run[5]
    first = free_run.index(eos)
    old_eos = llm.stop_checker.eos
    llm.stop_checker.eos = eos  # pretend the tokenizer's eos is the 6th greedy token
    try:
        stopped, ignored = llm.generate([prompt, prompt], [greedy(12, ignore_eos=False), greedy(12)], use_tqdm=False)
    finally:
        llm.stop_checker.eos = old_eos
    assert stopped["token_ids"] == free_run[:first + 1]
    assert stopped["finish_reason"] == "stop"
    assert ignored["token_ids"] == free_run
    assert ignored["finish_reason"] == "length"


def test_max_model_len_ends_generation(qwen3_tiny):
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=16, max_model_len=40)
    prompt = random_prompts(200, [30], seed=12)[0]
    (out,) = llm.generate([prompt], greedy(100), use_tqdm=False)
    assert len(prompt) + len(out["token_ids"]) == 40
    assert out["finish_reason"] == "length"
    assert out["token_ids"] == hf_greedy(qwen3_tiny, [prompt], 10)[0]
    llm.exit()


def test_max_model_len_is_capped_by_the_model(qwen3_tiny):
    with open(os.path.join(qwen3_tiny, "config.json")) as f:
        max_positions = json.load(f)["max_position_embeddings"]
    config = Config(qwen3_tiny, max_model_len=max_positions * 4)
    assert config.max_model_len == max_positions


def test_defaults_match_nano_vllm(qwen3_tiny):
    config = Config(qwen3_tiny)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.gpu_memory_utilization,
            config.tensor_parallel_size, config.enforce_eager, config.kvcache_block_size,
            config.num_kvcache_blocks) == (16384, 512, 0.9, 1, False,
                                           device_platform(AUTO_DEVICE).default_block_size, -1)
    # The default block is the device's: nano-vllm's 256 on CUDA, which flash-attn can page; 32 on
    # CPU. An explicit size wins.
    assert (CudaDevice.default_block_size, CpuDevice.default_block_size) == (256, 32)
    assert 256 % FLASH_ATTN_PAGE_MULTIPLE == 0
    assert Config(qwen3_tiny, kvcache_block_size=256).kvcache_block_size == 256
    assert config.enable_prefix_caching is True
    assert config.attention_backend == "auto"
    # device="auto" resolves on the machine the test runs on; dtype="auto" is float32 on CPU and
    # the checkpoint's dtype (float32 for this one) on CUDA.
    assert config.device == AUTO_DEVICE and config.dtype == torch.float32


@pytest.mark.parametrize("cuda_available", [False, True])
def test_auto_device_and_dtype_follow_what_torch_sees(qwen3_tiny, tmp_path, monkeypatch, cuda_available):
    """Config builds no tensors, so each of "auto"'s answers (device, dtype, compile mode) is
    checked on any machine by telling it what torch sees; a bfloat16 checkpoint shows which
    dtype "auto" takes. (Only config.json is copied: no tokenizer is asked for.)"""
    with open(os.path.join(qwen3_tiny, "config.json")) as f:
        hf_config = json.load(f)
    hf_config["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(cuda_available))
    config = Config(str(tmp_path), skip_tokenizer_init=True)
    if cuda_available:
        assert (config.device, config.dtype, config.compile_mode) == ("cuda", torch.bfloat16, "on")
    else:
        assert (config.device, config.dtype, config.compile_mode) == ("cpu", torch.float32, "off")
        with pytest.raises(ValueError, match="device='cuda'"):
            Config(str(tmp_path), device="cuda", skip_tokenizer_init=True)
    pinned = Config(str(tmp_path), device="cpu", skip_tokenizer_init=True)
    assert (pinned.device, pinned.dtype, pinned.compile_mode) == ("cpu", torch.float32, "off")


def test_settings_have_one_resolved_form_once_the_config_is_made(qwen3_tiny):
    """dtype is a torch.dtype whatever form it was given in; compile_mode "on" or "off"; eos the
    tokenizer's end-of-text id, or config.json's without a tokenizer. Nothing is set afterwards."""
    for given, expected in (("auto", torch.float32), ("float32", torch.float32), (torch.float32, torch.float32),
                            ("bfloat16", torch.bfloat16), (torch.float16, torch.float16)):
        assert Config(qwen3_tiny, device="cpu", dtype=given).dtype is expected
    assert Config(qwen3_tiny, device="cpu", compile_mode="on").compile_mode == "on"
    assert Config(qwen3_tiny, device="cpu", compile_mode="off").compile_mode == "off"
    with pytest.raises(ValueError, match=r"compile_mode='cuda' is not allowed.*one of \('auto', 'on', 'off'\)"):
        Config(qwen3_tiny, compile_mode="cuda")
    config = Config(qwen3_tiny, device="cpu")
    assert config.tokenizer is not None and config.eos == config.tokenizer.eos_token_id >= 0
    bare = Config(qwen3_tiny, device="cpu", skip_tokenizer_init=True)
    assert bare.tokenizer is None and bare.eos == bare.hf_config.eos_token_id
    with pytest.raises(ValueError, match="unknown config key.*'eos'"):
        Config.from_kwargs(qwen3_tiny, {"eos": 3})


def test_cpu_kv_cache_sized_from_budget(qwen3_tiny):
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, max_num_seqs=4, max_model_len=128)
    # The budget is far larger than the tiny model needs, so the cap (4 sequences x 128 tokens) applies.
    assert llm.block_manager.num_blocks == 4 * 128 // BLOCK
    llm.exit()
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, max_model_len=512, cpu_kvcache_space_gib=1e-6)


@pytest.mark.parametrize("device", EVERY_DEVICE)
def test_start_up_log_names_backend_dtype_device_and_capacity(qwen3_tiny, caplog, device):
    max_num_seqs = 4  # on CUDA: a few graph captures, not nano-vllm's 36
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        llm = LLM(qwen3_tiny, device=device, kvcache_block_size=BLOCK, num_kvcache_blocks=20,
                  max_num_seqs=max_num_seqs)
    text = caplog.text
    # The checkpoint is float32, which is also "auto"'s dtype on CPU.
    assert f"device {device}, dtype torch.float32, attention " in text
    backend = AUTO_BACKEND_SMALL_BLOCKS if device == "cuda" else AUTO_CPU_BACKEND
    assert f"attention backend: {backend} (requested 'auto', device {device})" in text
    # Decode graphs are captured on CUDA with a backend that allows it (not the torch one).
    captured = device == "cuda" and backend != "torch"
    graphs = f"on ({len(graph_batch_sizes(max_num_seqs))} batch sizes)" if captured else "off"
    assert f"CUDA graphs {graphs}" in text
    assert f"20 blocks x {BLOCK} tokens = {20 * BLOCK} tokens" in text
    # "auto" fused kernels: Triton's where the auto attention backend is Triton's (CUDA with triton);
    # on CPU the C++ library's where it builds (the same condition as the "cpu" attention backend).
    fused = ("triton" if backend == "triton" else "torch") if device == "cuda" else backend
    assert f"fused kernels {fused}" in text
    startup = llm.model_runner.startup
    assert f"start-up {startup.total_s:.1f} s: load {startup.load_s:.1f} s, warm-up {startup.warmup_s:.1f} s" in text
    llm.exit()


def test_fused_kernels_on_cpu_need_the_interpreter(qwen3_tiny, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="fused_kernels='triton' needs a CUDA device.*TRITON_INTERPRET=1"):
        LLM(qwen3_tiny, device="cpu", fused_kernels="triton")


def test_exit_is_idempotent(qwen3_tiny):
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=8)
    llm.exit()
    llm.exit()
    assert llm.model_runner.kv_cache is None


def test_rope_theta_read_from_either_config_form():
    class Old:  # transformers 4: top-level rope_theta, no rope_parameters
        rope_theta = 1_000_000
        rope_scaling = None

    class New:  # transformers 5: rope_parameters dict
        rope_parameters = {"rope_type": "default", "rope_theta": 5e5}

    class Scaled:
        rope_parameters = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}

    assert rope_config_of(Old()).theta == 1e6
    assert rope_config_of(New()).theta == 5e5
    with pytest.raises(ValueError, match="rope_type"):
        rope_config_of(Scaled())


# --- bad input: a clear ValueError naming the field, before anything is queued ---

@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("bad_prompt, message", [
    ("", "empty"),
    ([], "empty"),
    ([5, 10_000_000], "outside the vocabulary"),
    ([5, -1], "outside the vocabulary"),
    ([1] * 300, "max_model_len"),
    ([1.5, 2.0], "prompt"),
    (None, "prompt"),
])
def test_bad_prompt_refused_and_engine_stays_clean(llm, bad_prompt, message):
    good = random_prompts(200, [6], seed=13)[0]
    with pytest.raises(ValueError, match=message):
        llm.generate([good, bad_prompt], greedy(4), use_tqdm=False)
    assert llm.is_finished(), "nothing of the refused call may stay queued"
    outputs = llm.generate([good], greedy(4), use_tqdm=False)
    assert len(outputs) == 1 and len(outputs[0]["token_ids"]) == 4
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_request_larger_than_the_whole_cache_is_refused(qwen3_tiny):
    llm = LLM(qwen3_tiny, device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=4, max_model_len=256)
    with pytest.raises(ValueError, match="whole cache"):
        llm.generate([[1] * 60], greedy(20), use_tqdm=False)  # 80 tokens need 5 blocks of 16
    assert llm.is_finished()
    (out,) = llm.generate([[1] * 40], greedy(20), use_tqdm=False)  # 60 tokens fit in 4 blocks
    assert len(out["token_ids"]) == 20
    llm.exit()


def test_mismatched_sampling_params_list_refused(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2], [3, 4]], [greedy(8)], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize("kwargs, field", [
    ({"no_such_key": 1}, "no_such_key"),
    ({"kvcache_block_size": 24}, "kvcache_block_size"),
    ({"kvcache_block_size": 8}, "kvcache_block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"num_kvcache_blocks": 0}, "num_kvcache_blocks"),
    ({"device": "tpu"}, "device"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention_backend": "xformers"}, "attention_backend"),
    ({"attention_backend": "flash_attn"}, "flash_attn"),
    ({"tensor_parallel_size": 9}, "tensor_parallel_size"),
    ({"enforce_eager": "no"}, "enforce_eager"),
    ({"fused_kernels": "fast"}, "fused_kernels"),
    ({"cpu_threads": 0}, "cpu_threads=0"),
    ({"cpu_threads": "2"}, "cpu_threads='2'"),
    ({"cpu_threads": True}, "cpu_threads=True"),
    ({"cpu_malloc_tuning": "no"}, "cpu_malloc_tuning"),
])
def test_bad_config_refused(qwen3_tiny, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(qwen3_tiny, **{"device": "cpu", **kwargs})


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "nowhere"))


def test_unsupported_architecture(qwen3_tiny, tmp_path):
    path = shutil.copytree(qwen3_tiny, tmp_path / "mamba")
    with open(path / "config.json") as f:
        config = json.load(f)
    config["architectures"] = ["MambaForCausalLM"]
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="MambaForCausalLM.*supported.*Qwen3ForCausalLM"):
        LLM(str(path))


def test_weights_only_from_safetensors(qwen3_tiny, tmp_path):
    path = shutil.copytree(qwen3_tiny, tmp_path / "no_weights")
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            os.remove(path / name)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(path), device="cpu", num_kvcache_blocks=4, kvcache_block_size=BLOCK)


def test_step_reports_what_it_computed(llm):
    request_id = llm.add_request([3, 1, 4, 1, 5, 9, 2], greedy(3))
    prefill = llm.step()
    assert prefill.is_prefill and prefill.num_tokens == 7
    assert [seq.request_id for seq in prefill.advanced] == [request_id] and prefill.finished == []
    assert prefill.request_ids == [request_id]
    decode = llm.step()
    assert not decode.is_prefill and decode.num_tokens == 1
    last = llm.step()
    assert [seq.request_id for seq in last.finished] == [request_id]
    assert last.finished[0].finish_reason == "length" and llm.is_finished()
    assert llm.pop_output(request_id).finished
