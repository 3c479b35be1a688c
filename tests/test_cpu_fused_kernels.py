"""The CPU's fused elementwise kernels (kernels/cpu_fused.cpp) against the torch functions they
replace (layers/layernorm.py, activation.py, rotary_embedding.py), which stay the oracle: float32
to a few ulps (sums taken in another order), bfloat16 and float16 to one unit of their rounding in
a few elements at most. Odd widths, one row and more rows than one thread takes (the parallel
path), strided rows as the model hands them (views of the fused qkv and gate_up outputs)."""
import logging

import pytest
import torch

from helpers import greedy, hf_greedy, random_prompts

from nanovllm import LLM
from nanovllm.kernels import cpu_build
from nanovllm.layers.logits_processors import LOGIT_LIMIT, finite_logits
from nanovllm.platform.cpu import CpuPlatform, CpuTorchPlatform
from nanovllm.platform.torch import add_rms_norm, rms_norm, silu_and_mul
from nanovllm.layers.rotary_embedding import RopeConfig, RotaryEmbedding, rotate_qk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]



def randn(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 within a few ulps; half types: in under 2% of the elements (where the two took a
    float32 value on either side of a rounding tie) and by at most two units of rounding of the
    element, or of its row's largest element where a difference cancels (rotary's x1 cos - x2 sin)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=4e-6, atol=1e-6)
        return
    a, e = actual.float(), expected.float()
    eps = torch.finfo(actual.dtype).eps
    bound = 2 * eps * torch.maximum(e.abs(), e.abs().amax(-1, keepdim=True)) + 1e-6
    differ = a != e
    assert ((a - e).abs() <= bound)[differ].all(), (a - e).abs().max()
    assert differ.float().mean() < 0.02, differ.float().mean()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 1), (1, 48), (5, 7), (3, 1000), (300, 512), (64, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(cpu_kernels, dtype, rows, hidden, with_residual):
    # x as a strided view (row stride 2 * hidden), as the first half of a wider output would be.
    x = randn(rows, 2 * hidden, dtype=dtype, seed=rows + hidden, scale=3.0)[:, :hidden]
    weight = randn(hidden, dtype=dtype, seed=1)
    residual = randn(rows, hidden, dtype=dtype, seed=2) if with_residual else None
    out = cpu_kernels.rms_norm(x, weight, 1e-6, residual)
    if with_residual:
        expected, expected_residual = add_rms_norm(x, residual, weight, 1e-6)
        assert torch.equal(out.residual, expected_residual)  # one add, rounded once: exact
    else:
        expected = rms_norm(x, weight, 1e-6)
        assert out.residual is None
    assert_close(out.out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1), (1, 96), (7, 33), (300, 1536)])
def test_silu_and_mul_matches_torch(cpu_kernels, dtype, rows, width):
    # Large gates both ways, where exp(-g) would overflow if taken as it is written.
    x = randn(rows, 2 * width, dtype=dtype, seed=width, scale=4.0)
    x[0, 0] = 100.0
    x[0, -1 - width] = -100.0 if width > 1 else x[0, 0]
    assert_close(cpu_kernels.silu_and_mul(x), silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_vector_lanes_equal_the_element_loop(cpu_kernels, dtype):
    """The first 16 columns of a 31-wide row go through the AVX-512 loop (where the build has it),
    the same 15 gates and ups alone through the element loop: equal bit for bit, special values too."""
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.0, -88.0, 1e-30,
                            -1e-30, 3.0e38, -3.0e38, 1.0, -1.0, 0.5, -20.0])
    gate = torch.cat([special, randn(16, dtype=torch.float32, seed=5, scale=6.0)])[:31].to(dtype)
    up = randn(31, dtype=dtype, seed=6, scale=2.0)
    wide = cpu_kernels.silu_and_mul(torch.cat([gate, up]).unsqueeze(0))[0, :15]
    alone = cpu_kernels.silu_and_mul(torch.cat([gate[:15], up[:15]]).unsqueeze(0))[0]
    assert torch.equal(wide.isnan(), alone.isnan())
    assert torch.equal(wide.nan_to_num(), alone.nan_to_num())
    torch.testing.assert_close(alone.nan_to_num(), silu_and_mul(torch.cat([gate[:15], up[:15]]).unsqueeze(0))[0].nan_to_num(),
                               rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 16), (8, 4, 64), (16, 8, 128), (3, 3, 32)])
@pytest.mark.parametrize("tokens", [1, 5, 200])
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_matches_torch(cpu_kernels, dtype, heads, kv_heads, head_dim, tokens, with_norm):
    # q and k as views of one fused qkv output, positions past the first few.
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=tokens * heads, scale=2.0)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(tokens))
    rotary = RotaryEmbedding(head_dim, 4096, RopeConfig(1_000_000.0, "default", {}))
    q_ref, k_ref = q.clone(), k.clone()
    norm = {}
    if with_norm:
        norm = dict(q_weight=randn(head_dim, dtype=dtype, seed=3), k_weight=randn(head_dim, dtype=dtype, seed=4), eps=1e-6)
        q_ref, k_ref = rms_norm(q_ref, norm["q_weight"], 1e-6), rms_norm(k_ref, norm["k_weight"], 1e-6)
    q_ref, k_ref = rotate_qk(positions, q_ref, k_ref, rotary.cos_sin_cache)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    cpu_kernels.qk_norm_rope(q, k, positions.to(torch.int32), rotary.cos_sin_cache, **norm)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_stores_k_and_v_at_their_slots(cpu_kernels, dtype):
    tokens, heads, kv_heads, head_dim, block_size = 7, 4, 2, 32, 4
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    k_cache = torch.full((5, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.tensor([3, 0, -1, 17, 9, -1, 12])  # -1: padding, not stored
    rotary = RotaryEmbedding(head_dim, 64, RopeConfig(10000.0, "default", {}))
    positions = torch.arange(tokens)
    q_ref, k_ref = rotate_qk(positions, q.clone(), k.clone(), rotary.cos_sin_cache)
    cpu_kernels.qk_norm_rope(q, k, positions, rotary.cos_sin_cache, v=v, k_cache=k_cache, v_cache=v_cache,
                         slot_mapping=slots)
    assert_close(k, k_ref)
    flat_k, flat_v = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    kept = slots >= 0
    assert torch.equal(flat_k[slots[kept]], k[kept]) and torch.equal(flat_v[slots[kept]], v[kept])
    untouched = torch.ones(flat_k.size(0), dtype=torch.bool)
    untouched[slots[kept]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (2, 16), (5, 17), (70, 1000), (4, 32000)])
def test_greedy_tokens_are_the_argmax_of_the_finite_logits(cpu_kernels, dtype, rows, vocab):
    logits = randn(rows, vocab + 3, dtype=dtype, seed=vocab, scale=5.0)[:, 2:vocab + 2]  # strided rows
    gen = torch.Generator().manual_seed(rows)
    for r in range(rows):  # in each row one of: ties, NaN, infinities, values past the limit, all NaN
        case = r % 5
        picks = torch.randint(0, vocab, (3,), generator=gen)
        if case == 0:
            logits[r, picks] = 50.0  # the same largest value two or three times: the first index wins
        elif case == 1:
            logits[r, picks[0]] = float("nan")
        elif case == 2:
            logits[r, picks[0]], logits[r, picks[1]] = float("inf"), float("-inf")
        elif case == 3 and dtype != torch.float16:  # float16 cannot hold a value past the limit
            logits[r, picks] = 3e38
        elif case == 4:
            logits[r] = float("nan")
    expected = finite_logits(logits).argmax(dim=-1)
    assert torch.equal(cpu_kernels.greedy_tokens(logits, LOGIT_LIMIT), expected)


def test_engine_with_fused_kernels_equals_hf_and_the_torch_path(qwen3_tiny, cpu_kernels):
    prompts = random_prompts(200, [3, 17, 40, 1, 64], seed=5)
    expected = hf_greedy(qwen3_tiny, prompts, 12)
    tokens = {}
    for fused in ("cpu", "torch"):
        llm = LLM(qwen3_tiny, device="cpu", fused_kernels=fused, kvcache_block_size=16, num_kvcache_blocks=64,
                  max_num_batched_tokens=48)  # chunked prefill too
        if fused == "cpu":
            assert all(type(layer.platform) is CpuPlatform for layer in llm.model_runner.attention_layers)
            assert (llm.model_runner.sampler.greedy_kernel is not None) == cpu_kernels.greedy_vectorised
        tokens[fused] = [o["token_ids"] for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
        llm.exit()
    assert tokens["cpu"] == expected == tokens["torch"]


def test_a_library_that_cannot_be_built_falls_back_to_torch(qwen3_tiny, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "load_fused", lambda: "no C++ compiler found (set CXX, or install g++)")
    with caplog.at_level(logging.WARNING, logger="nanovllm"):
        llm = LLM(qwen3_tiny, device="cpu", fused_kernels="cpu", kvcache_block_size=16, num_kvcache_blocks=16)
    assert "fused kernels: torch (no C++ compiler found" in caplog.text
    assert llm.model_runner.config.fused_kernels == "torch"
    assert all(type(layer.platform) is CpuTorchPlatform for layer in llm.model_runner.attention_layers)
    llm.exit()


def test_every_file_the_build_reads_ships_in_the_package():
    """An installed wheel builds the library on the user's machine: each source and header
    cpu_build compiles must match pyproject's package-data."""
    import fnmatch
    import tomllib
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["nanovllm"]
    for path in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        relative = path.relative_to(root / "nanovllm").as_posix()
        assert any(fnmatch.fnmatch(relative, g) for g in globs), f"{relative} is not package data"
