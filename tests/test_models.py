"""The model families beyond Qwen3/Qwen2 end to end: GPT-2, Llama (llama3 and linear rope
scaling, tied and untied, with and without biases), Mistral and Qwen3-MoE (8 and 10 experts,
top-2, renormalised or not, a dense layer among sparse ones). Greedy float32 tokens equal HF
transformers' with prefix-cache hits and under preemption, on the torch and the Triton attention
backends (and for Qwen3-MoE through the fused MoE kernel too); the registry and the config checks
refuse what cannot run, naming it; rope frequencies are transformers' bit for bit."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import nanovllm.kernels.fused_moe as fused_moe_kernel
from nanovllm.platform.torch import TorchPlatform
from helpers import hf_greedy, random_prompts
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.layers.rotary_embedding import inverse_frequencies, rope_config_of
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM
from nanovllm.models.registry import MODELS, SUPPORTED_ARCHITECTURES
from nanovllm.testing.synthetic import (ARCHITECTURES, GPT2_CONFIG, LLAMA_3_2_1B_CONFIG, QWEN3_30B_A3B_CONFIG,
                                      build_checkpoint)

BLOCK = 16
MAX_TOKENS = 12
# qwen3_moe_mixed's parity (TP=1 and TP=2) is in test_tensor_parallel.py.
FAMILIES = ["gpt2_tiny", "llama_tiny", "llama_tiny_tied", "qwen3_moe_tiny"]
SHARED = random_prompts(200, [40], seed=20)[0]  # 2 full blocks and a half
PROMPTS = [SHARED + tail for tail in random_prompts(200, [1, 9], seed=21)] + random_prompts(200, [5, 33], seed=22)
_expected: dict[str, list[list[int]]] = {}


def expected_tokens(path: str) -> list[list[int]]:
    """HF's greedy continuations of PROMPTS, computed once per checkpoint (a shorter greedy run is
    a prefix of a longer one, so tests that make fewer tokens compare with a prefix)."""
    if path not in _expected:
        _expected[path] = hf_greedy(path, PROMPTS, MAX_TOKENS)
    return _expected[path]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def with_config(src: str, dst, **changes) -> str:
    """A copy of checkpoint `src` whose config.json has `changes` applied."""
    path = shutil.copytree(src, dst)
    with open(path / "config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(path / "config.json", "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.mark.parametrize("ckpt", FAMILIES)
def test_greedy_parity_with_prefix_hits_and_preemption(ckpt, request):
    path = request.getfixturevalue(ckpt)
    expected = expected_tokens(path)
    assert all(len(set(e)) > 4 for e in expected), "the random model should not repeat one token"
    # 6 blocks of 16 tokens: the first three prompts fill them, and the first one growing past 48
    # tokens preempts another.
    llm = LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=6)
    first = llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)
    batch = llm.generate(PROMPTS, greedy(), use_tqdm=False)  # the shared prefix's blocks are cached
    assert token_ids(first) == expected[:1]
    assert token_ids(batch) == expected
    assert llm.scheduler.num_preemptions > 0
    assert sum(o["num_cached_tokens"] for o in batch) >= 32
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    llm.exit()


def test_mistral_without_sliding_window(tmp_path):
    path = build_checkpoint(str(tmp_path / "mistral"), "mistral")
    prompts = random_prompts(200, [7, 30], seed=23)
    llm = LLM(path, kvcache_block_size=BLOCK, num_kvcache_blocks=16)
    assert token_ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == hf_greedy(path, prompts, 8)
    llm.exit()
    windowed = with_config(path, tmp_path / "windowed", sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window=64 is not supported"):
        LLM(windowed)


@pytest.mark.parametrize("ckpt", ["gpt2_tiny", "llama_tiny", "qwen3_moe_tiny"])
def test_triton_backend_and_fused_moe_kernel_match_hf(ckpt, request, monkeypatch):
    """The Triton attention kernels (under TRITON_INTERPRET=1 without a GPU) and, for Qwen3-MoE,
    the fused MoE kernel in place of the torch loop it replaces on CUDA."""
    path = request.getfixturevalue(ckpt)
    calls = []
    kernel = fused_moe_kernel.fused_moe

    def counting_kernel(*args, **kwargs):
        calls.append(args[0].shape)
        return kernel(*args, **kwargs)
    from nanovllm.platform.triton import CudaPlatform
    monkeypatch.setattr(TorchPlatform, "fused_experts", CudaPlatform.fused_experts)  # the kernel on the CPU too
    monkeypatch.setattr(fused_moe_kernel, "fused_moe", counting_kernel)
    # Two prompts sharing 2 full blocks; 2 tokens: a prefill and a decode step (the interpreter is slow).
    prompts, num_tokens = [SHARED[:32] + [5], SHARED[:32] + [9, 10, 11]], 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(path, attention_backend="triton", device=device, kvcache_block_size=BLOCK, num_kvcache_blocks=16,
              enforce_eager=True, dtype="float32")
    assert llm.model_runner.backend.name == "triton"
    first = llm.generate(prompts, greedy(num_tokens), use_tqdm=False)
    second = llm.generate(prompts, greedy(num_tokens), use_tqdm=False)
    llm.exit()
    assert token_ids(first) == token_ids(second) == hf_greedy(path, prompts, num_tokens)
    assert [o["num_cached_tokens"] for o in second] == [32, 32]
    assert bool(calls) == (ckpt == "qwen3_moe_tiny")


def test_unsupported_architecture_lists_the_supported_ones(llama_tiny, tmp_path):
    path = with_config(llama_tiny, tmp_path / "mamba", architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match=r"MambaForCausalLM.*supported:.*GPT2LMHeadModel") as error:
        LLM(path)
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_gpt2_positions_cap_max_model_len_and_odd_heads_refuse_tp2(gpt2_tiny):
    assert Config(gpt2_tiny).max_model_len == 128  # n_positions
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*num_attention_heads=5.*allowed: \[1, 5\]"):
        Config(gpt2_tiny, tensor_parallel_size=2)


def test_moe_tensor_parallel_splits_expert_width(qwen3_moe_tiny, qwen3_moe_mixed):
    sparse = Config(qwen3_moe_tiny).hf_config
    assert Qwen3MoeForCausalLM.tensor_parallel_sizes(sparse) == {
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": sparse.vocab_size,
        "moe_intermediate_size": 32}  # every layer is sparse: the dense width is unused
    mixed = Config(qwen3_moe_mixed).hf_config
    assert Qwen3MoeForCausalLM.tensor_parallel_sizes(mixed)["intermediate_size"] == 128  # layer 0 is dense


def test_moe_indivisible_expert_width_refused(qwen3_moe_tiny, tmp_path):
    path = with_config(qwen3_moe_tiny, tmp_path / "odd", moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*moe_intermediate_size=33"):
        Config(path, tensor_parallel_size=2)


# ----------------------------------------------------------------------------------------------- rope

LLAMA_3_2_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope_parameters, head_dim", [
    (LLAMA_3_2_ROPE, 64),  # Llama 3.2's config.json values
    ({**LLAMA_3_2_ROPE, "factor": 8.0, "original_max_position_embeddings": 256}, 16),
    ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 32),
    ({"rope_type": "default", "rope_theta": 1e6}, 128),
])
def test_rope_frequencies_equal_transformers(rope_parameters, head_dim):
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         rope_parameters=dict(rope_parameters))
    rope_type = rope_parameters["rope_type"]
    init = LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default" \
        else ROPE_INIT_FUNCTIONS[rope_type]
    expected, _ = init(config)
    got = inverse_frequencies(head_dim, rope_config_of(config))
    assert torch.equal(got, expected)
    if rope_type == "llama3":  # all three bands are exercised: some kept, some divided, some in between
        base = inverse_frequencies(head_dim, rope_config_of(SimpleNamespace(rope_theta=500000.0)))
        ratio = base / got
        assert (ratio == 1).any() and (ratio == rope_parameters["factor"]).any()
        assert ((ratio > 1) & (ratio < rope_parameters["factor"])).any()


def test_rope_settings_read_in_both_forms():
    """transformers 5's rope_parameters, and the older top-level rope_theta with rope_scaling
    (whose type key was once "type")."""
    new = rope_config_of(SimpleNamespace(rope_parameters=LLAMA_3_2_ROPE))
    old = rope_config_of(SimpleNamespace(rope_theta=500000.0, rope_scaling={
        "type": "llama3", **{k: v for k, v in LLAMA_3_2_ROPE.items() if k not in ("rope_type", "rope_theta")}}))
    assert new == old and new.rope_type == "llama3" and new.theta == 500000.0


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, r"rope_type='dynamic' is not supported"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}, r"rope_type='yarn' is not supported.*llama3"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 2.0}, r"missing \['low_freq_factor'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ({"rope_type": "default"}, r"no rope_theta"),
])
def test_unsupported_rope_refused(params, match):
    with pytest.raises(ValueError, match=match):
        rope_config_of(SimpleNamespace(rope_parameters=params))


def test_unsupported_rope_refused_before_the_engine_starts(llama_tiny, tmp_path):
    path = with_config(llama_tiny, tmp_path / "dynamic",
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type='dynamic'"):
        Config(path)


@pytest.mark.parametrize("arch, fields", [
    ("gpt2", GPT2_CONFIG), ("llama", LLAMA_3_2_1B_CONFIG), ("qwen3_moe", QWEN3_30B_A3B_CONFIG)])
def test_benchmark_shapes_build_with_transformers_parameter_count(arch, fields):
    """bench.py's GPT-2, Llama-3.2-1B and Qwen3-30B-A3B shapes, built on the meta device (no memory):
    our model holds exactly the parameters HF transformers' does (tied ones counted once)."""
    config_class, hf_class = ARCHITECTURES[arch]
    config = config_class(**fields)
    with torch.device("meta"):
        ours, theirs = MODELS[hf_class.__name__](config), hf_class(config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
