"""kv_cache_dtype="fp8_e4m3" end to end on CPU (the torch backend, the quantised reference):
outputs within the documented tolerance of the float32 cache, the capacity it buys, prefix hits
and preemption (recompute, swap, tensor-parallel swap) and speculative decoding (n-gram, and a
draft model with its own fp8 cache and scales) exact relative to the fp8 run itself, checkpoint
scales, and refused settings.

The tolerance is docs/BENCHMARKS.md's measurement on this checkpoint with room to spare: the
tiny random-weight models are far more sensitive than trained ones (2% multiplicative noise
on K/V moves their logprobs as much as fp8 does), so greedy runs part early on near-ties; what
must hold is small logprob differences while they agree and near-ties where they part.
"""
import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from helpers import greedy, random_prompts
from nanovllm import LLM
from nanovllm.testing.synthetic import build_checkpoint
from nanovllm.platform import attention
from nanovllm.testing.accuracy import compare_runs

BLOCK = 16
MAX_TOKENS = 16
LENGTHS = [1, 5, 15, 16, 17, 33, 48, 70]
# Per-token |logprob(fp8) - logprob(float32 cache)| while the greedy runs agree (measured: mean
# 0.065, max 0.22 on qwen3_tiny, docs/BENCHMARKS.md).
MEAN_LOGPROB_TOLERANCE = 0.15
MAX_LOGPROB_TOLERANCE = 0.6
TOP_LOGPROBS = 5
# Blocks and a budget small enough that sequences are preempted again and again.
SMALL_CACHE = dict(num_kvcache_blocks=7, max_num_batched_tokens=48)


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, device="cpu", kvcache_block_size=BLOCK, **{"max_num_seqs": 16, "num_kvcache_blocks": 64,
                                                                "kv_cache_dtype": "fp8_e4m3", **kwargs})


def generate(llm: LLM, prompts: list[list[int]]) -> list[dict]:
    return llm.generate(prompts, greedy(MAX_TOKENS, logprobs=TOP_LOGPROBS), use_tqdm=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(200, LENGTHS, seed=5)


@pytest.fixture(scope="module")
def fp8_reference(qwen3_tiny, prompts) -> list[dict]:
    """The fp8 run every exactness test compares with: all prompts at once, no preemption."""
    with engine(qwen3_tiny) as llm:
        outputs = generate(llm, prompts)
        assert llm.stats().num_preemptions == 0
    return outputs


def tokens(outputs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def test_outputs_within_tolerance_of_the_float32_cache(qwen3_tiny, prompts, fp8_reference):
    with engine(qwen3_tiny, kv_cache_dtype="auto") as llm:
        reference = generate(llm, prompts)
    agreement = compare_runs(reference, fp8_reference)
    assert agreement.compared_tokens >= len(prompts)  # every sequence's first token at least
    assert agreement.mean_abs_logprob_diff < MEAN_LOGPROB_TOLERANCE
    assert agreement.max_abs_logprob_diff < MAX_LOGPROB_TOLERANCE
    assert agreement.near_tie_divergences
    assert agreement.mean_abs_logprob_diff > 0  # the cache really was quantised


def test_capacity_is_4x_float32_and_2x_bfloat16_and_logged(qwen3_tiny, caplog):
    budget = dict(num_kvcache_blocks=-1, cpu_kvcache_space_gib=2 ** -13, max_num_seqs=64, max_model_len=128)
    blocks = {}
    for dtype in ("float32", "bfloat16"):
        for kv in ("auto", "fp8_e4m3"):
            with caplog.at_level(logging.INFO, logger="nanovllm"):
                caplog.clear()
                with engine(qwen3_tiny, dtype=dtype, kv_cache_dtype=kv, **budget) as llm:
                    blocks[dtype, kv] = llm.model_runner.num_kvcache_blocks
                    assert llm.model_runner.kv_cache.dtype == (torch.float8_e4m3fn if kv != "auto" else
                                                               getattr(torch, dtype))
            if kv != "auto":
                ratio = 4 if dtype == "float32" else 2
                assert f"float8_e4m3fn: {ratio}x the tokens of a {dtype} cache" in caplog.text
                assert "KV-cache scales calibrated on the warm-up" in caplog.text
    # 2 layers x 2 KV heads x 16 dims x K,V x 16 tokens: 8 KiB a block in float32, 16 in 128 KiB.
    assert blocks["float32", "auto"] == 16
    assert blocks["float32", "fp8_e4m3"] == 4 * blocks["float32", "auto"]
    assert blocks["bfloat16", "fp8_e4m3"] == 2 * blocks["bfloat16", "auto"]


def test_prefix_hits_are_exact(qwen3_tiny, prompts, fp8_reference):
    with engine(qwen3_tiny) as llm:
        generate(llm, prompts[4:])  # caches the blocks of the longer prompts
        outputs = generate(llm, prompts)
    assert sum(o["num_cached_tokens"] for o in outputs) > 0
    assert tokens(outputs) == tokens(fp8_reference)
    for out, ref in zip(outputs, fp8_reference):
        assert [lp["logprob"] for lp in out["logprobs"]] == pytest.approx([lp["logprob"] for lp in ref["logprobs"]],
                                                                          abs=1e-4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_is_exact(qwen3_tiny, prompts, fp8_reference, mode):
    with engine(qwen3_tiny, **SMALL_CACHE, preemption_mode=mode, swap_space=0.001) as llm:
        outputs = generate(llm, prompts)
        stats = llm.stats()
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) >= 1
    if mode == "swap":
        assert stats.swap_ins >= 1
    assert tokens(outputs) == tokens(fp8_reference)


def test_tensor_parallel_swap_is_exact(qwen3_tiny, prompts, fp8_reference):
    """Each rank calibrates and quantises its own KV heads and swaps its own fp8 blocks."""
    with LLM(qwen3_tiny, device="cpu", tensor_parallel_size=2, kvcache_block_size=BLOCK, kv_cache_dtype="fp8_e4m3",
             **SMALL_CACHE, preemption_mode="swap", swap_space=0.001) as llm:
        outputs = generate(llm, prompts)
        assert llm.stats().preemptions_swap >= 1
    assert tokens(outputs) == tokens(fp8_reference)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_is_target"])
def test_speculative_decoding_is_exact(qwen3_tiny, prompts, fp8_reference, method, tmp_path):
    """Greedy speculation keeps the target's own fp8 tokens. A draft model gets an fp8 cache too,
    sized in fp8, with scales calibrated on its own warm-up (the target's own, when it is the target)."""
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3}
    else:
        path = qwen3_tiny if method == "draft_is_target" else build_checkpoint(str(tmp_path), "qwen3",
                                                                              num_hidden_layers=1, seed=7)
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with engine(qwen3_tiny, speculative_config=spec) as llm:
        outputs = llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
        stats = llm.stats()
        runner = llm.model_runner
        if runner.draft is not None:
            target_layers, draft_layers = runner.target.attention_layers, runner.draft.attention_layers
            assert runner.draft.kv_cache.dtype == torch.float8_e4m3fn
            assert all(layer.kv_scales is not None for layer in draft_layers)
            if method == "draft_is_target":
                for mine, theirs in zip(draft_layers, target_layers):
                    assert torch.equal(mine.kv_scales.k, theirs.kv_scales.k)
    assert stats.spec_proposed_tokens > 0
    if method == "draft_is_target":
        assert stats.spec_acceptance_rate == 1.0
    assert tokens(outputs) == tokens(fp8_reference)


def with_scales(src: str, dst, tensors: dict[str, torch.Tensor]) -> str:
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return str(dst)


def test_checkpoint_scales_are_used(qwen3_tiny, tmp_path, prompts, caplog):
    """vLLM's names: a per-tensor k_scale and a per-head v_scale on each layer's self_attn."""
    path = with_scales(qwen3_tiny, tmp_path / "ckpt", {
        **{f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.01 * (i + 1)) for i in range(2)},
        **{f"model.layers.{i}.self_attn.v_scale": torch.tensor([0.02, 0.03]) for i in range(2)}})
    with caplog.at_level(logging.INFO, logger="nanovllm"), engine(path) as llm:
        layers = llm.model_runner.attention_layers
        assert torch.equal(layers[1].kv_scales.k, torch.tensor([0.02, 0.02]))
        assert torch.equal(layers[0].kv_scales.v, torch.tensor([0.02, 0.03]))
        assert len(generate(llm, prompts[:2])) == 2
    assert "KV-cache scales checkpoint" in caplog.text
    with engine(path, kv_cache_dtype="auto") as llm:  # a 16/32-bit cache ignores them
        assert llm.model_runner.attention_layers[0].kv_scales is None


@pytest.mark.parametrize("tensors, message", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([1.0, 2.0, 3.0])}, "one value per KV head"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)}, "no model.layers.0.self_attn.v_scale"),
    ({f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(-1.0) for i in range(2) for kind in "kv"},
     "finite and > 0"),
])
def test_bad_checkpoint_scales_are_refused(qwen3_tiny, tmp_path, tensors, message):
    path = with_scales(qwen3_tiny, tmp_path / "ckpt", tensors)
    with pytest.raises(ValueError, match=message):
        engine(path)


@pytest.mark.parametrize("value", ["fp8", "int8", "float16", None, 8])
def test_bad_kv_cache_dtype_is_refused(qwen3_tiny, value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype=.* is not allowed; kv_cache_dtype must be one of "
                                         r"\('auto', 'fp8_e4m3', 'fp8_e5m2'\)"):
        LLM(qwen3_tiny, device="cpu", kv_cache_dtype=value)


def test_flash_attn_is_refused_for_fp8_and_auto_picks_triton(monkeypatch):
    monkeypatch.setattr(attention, "_installed", lambda module: module in ("flash_attn", "triton"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention.resolve_backend_name("auto", "cuda", 256) == "flash_attn"
    assert attention.resolve_backend_name("auto", "cuda", 256, "fp8_e4m3") == "triton"
    with pytest.raises(ValueError, match="'flash_attn' cannot read an fp8 KV cache"):
        attention.resolve_backend_name("flash_attn", "cuda", 256, "fp8_e5m2")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        attention.resolve_backend_name("auto", "cuda", 16, "fp8_e4m3")
    assert attention.resolve_backend_name("auto", "cpu", 16, "fp8_e4m3") == "torch"
