"""The CPU's fused decode (platform/cpu/decode.py, kernels/cpu_decode_layers.cpp): a decode step of
up to the few-row product's rows (or the AMX product's, bf16 on a CPU with AMX) through every
decoder layer in one C++ call. It must give bit for
bit what the model's Python layers give with the same kernels (token ids and logprobs), for every
Llama-family variant (q/k norm or not, biases, tied heads, rope scalings) in float32 and bf16; HF's
greedy tokens in float32; and leave every step it cannot run (more rows, prefill, an fp8 cache, an
MoE model) to the Python layers."""
import pytest
import torch

from helpers import greedy, hf_greedy, random_prompts

from nanovllm import LLM

FAMILIES = ["qwen3_tiny", "qwen3_tiny_tied", "qwen2_tiny", "llama_tiny", "llama_tiny_tied"]



def fused_decode_of(llm: LLM, cpu_kernels, dtype: torch.dtype):
    fused = llm.model_runner.model.model.fused_decode
    if cpu_kernels.few_rows_linear(dtype) is None:
        pytest.skip(f"this CPU's build has no few-row product for {dtype}, so no fused decode")
    assert fused is not None
    return fused


def record_rows(fused) -> list[int]:
    """The row count of each call the fused decode makes into the library."""
    rows, call = [], fused._fn
    fused._fn = lambda model, n, *rest: (rows.append(n), call(model, n, *rest))[1]
    return rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_is_bit_for_bit_the_python_layers(request, cpu_kernels, family, dtype):
    # Prefix caching off: a cached prefix is attended by another kernel than a fresh prompt, so
    # the second run's prompts would differ from the first's for that reason alone.
    path = request.getfixturevalue(family)
    probe = LLM(path, dtype=dtype, num_kvcache_blocks=16)
    # 4; 256 with the bf16 AMX product; any with the float32 one (256 here, its steps of 257 fused too)
    takes = fused_decode_of(probe, cpu_kernels, getattr(torch, dtype)).max_rows
    most = min(takes, 256)
    probe.exit()
    llm = LLM(path, dtype=dtype, enable_prefix_caching=False, kvcache_block_size=16, num_kvcache_blocks=4 * most + 64)
    fused = fused_decode_of(llm, cpu_kernels, getattr(torch, dtype))
    rows = record_rows(fused)
    prompts = random_prompts(200, [[5, 40, 17, 3, 33][i % 5] for i in range(most + 1)], seed=3)
    # One sequence, two, the most it takes, and more (where it takes no more: every step on the Python
    # layers); with the AMX product also the first row count past the few-row product's (a part-filled tile).
    sizes = [1, 2, most, most + 1] + ([fused.few_rows_max + 1] if most > fused.few_rows_max else [])
    results = {}
    for mode in ("fused", "python"):
        llm.model_runner.model.model.fused_decode = fused if mode == "fused" else None
        results[mode] = [[(o["token_ids"], o["logprobs"]) for o in llm.generate(prompts[:n], greedy(10, logprobs=3),
                                                                               use_tqdm=False)] for n in sizes]
    assert results["fused"] == results["python"]
    # Each batch decodes 9 steps after its prefill; the largest batch none of them fused.
    fused_sizes = [n for n in sizes if n <= takes]
    assert sorted(rows) == sorted(n for n in fused_sizes for _ in range(9))
    llm.exit()


@pytest.mark.parametrize("family", ["qwen3_tiny", "llama_tiny_tied"])
def test_fused_decode_gives_hf_greedy_tokens(request, cpu_kernels, family):
    path = request.getfixturevalue(family)
    prompts = random_prompts(200, [7, 30, 1], seed=11)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=64)
    rows = record_rows(fused_decode_of(llm, cpu_kernels, torch.float32))
    tokens = [llm.generate([prompt], greedy(12), use_tqdm=False)[0]["token_ids"] for prompt in prompts]
    assert tokens == hf_greedy(path, prompts, 12)
    # Every decode step of each prompt, alone (the one-token prompt's first step is decode-shaped too).
    assert set(rows) == {1} and len(rows) >= 3 * 11
    llm.exit()


def test_an_fp8_cache_stays_on_the_python_layers(qwen3_tiny, cpu_kernels):
    llm = LLM(qwen3_tiny, kv_cache_dtype="fp8_e4m3", kvcache_block_size=16, num_kvcache_blocks=64)
    fused = llm.model_runner.model.model.fused_decode  # None where the fp8 cache's backend is not the CPU kernel's
    rows = [] if fused is None else record_rows(fused)
    out = llm.generate(random_prompts(200, [9], seed=1), greedy(6), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 6 and rows == []
    llm.exit()


def test_models_with_other_layers_get_no_fused_decode(qwen3_moe_mixed, qwen3_tiny, cpu_kernels):
    llm = LLM(qwen3_moe_mixed, kvcache_block_size=16, num_kvcache_blocks=64)  # a sparse MLP in most layers
    assert llm.model_runner.model.model.fused_decode is None
    llm.exit()
    llm = LLM(qwen3_tiny, fused_kernels="torch", kvcache_block_size=16, num_kvcache_blocks=64)
    assert llm.model_runner.model.model.fused_decode is None
    llm.exit()
