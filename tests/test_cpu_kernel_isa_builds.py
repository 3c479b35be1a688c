"""The CPU kernels as other CPUs build them, run here: an AVX2-only CPU gets `-march=x86-64-v3`
(no AVX-512: the kernels' plain loops, which the native build on an AVX-512 machine never runs),
an AVX-512 CPU without AVX512-BF16 gets `-march=x86-64-v4 -mno-avx512bf16` (bfloat16 scores
through widened FMAs instead of dot products). Each build is checked against the same oracles as
the native one (tests/reference_attention.py, the torch layer functions), on a compact set of
cases: decode and prefill (chunks over a prefix, tiles of many rows) for every dtype, head dims
that take each path, GQA groups 1/2/4; the fused residual add + RMSNorm and SiLU-and-mul. A build
is skipped, saying so, where this CPU lacks what it needs."""
import pytest
import torch

from nanovllm.attention.cpu_backend import CpuPagedBackend
from nanovllm.kernels import cpu_build
from nanovllm.layers.activation import silu_and_mul
from nanovllm.layers.layernorm import add_rms_norm
from reference_attention import ReferenceTorchBackend
from test_cpu_fused_kernels import assert_close, randn
from test_cpu_paged_attention import assert_matches, decode_meta, paged_cache, prefill_meta

# build name: (extra compiler flags, the /proc/cpuinfo flags the build's code needs)
ISA_BUILDS = {
    "avx2": (("-march=x86-64-v3",), {"avx2", "fma", "bmi2"}),
    "avx512-no-bf16": (("-march=x86-64-v4", "-mno-avx512bf16"), {"avx512f", "avx512bw", "avx512dq", "avx512vl"}),
}


@pytest.fixture(scope="module", params=sorted(ISA_BUILDS))
def library(request, tmp_path_factory):
    flags, needs = ISA_BUILDS[request.param]
    missing = needs - set((cpu_build.cpu_flags_line() or "").split())
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)}, which the {request.param} build's code needs")
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler here")
    return cpu_build.open_library(cpu_build.build(tmp_path_factory.mktemp(request.param), extra_flags=flags))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
def test_attention_build_matches_reference(library, dtype, head_dim):
    backend, reference = CpuPagedBackend(cpu_build.PagedAttentionKernel(library, library.path)), ReferenceTorchBackend()
    for group in (1, 2, 4):
        gen = torch.Generator().manual_seed(group * 1000 + head_dim)
        block_size, num_kv_heads, scale = 16, 2, head_dim ** -0.5
        lengths = [0, 1, block_size, block_size + 1, 5 * block_size + 3, 7]
        k_cache, v_cache, tables = paged_cache(lengths, block_size, num_kv_heads, head_dim, dtype, gen)
        meta = decode_meta(lengths, tables)
        q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
        assert_matches(backend.decode(q, k_cache, v_cache, meta, scale),
                       reference.decode(q, k_cache, v_cache, meta, scale), dtype)
        lens = [(0, 1), (15, 2), (17, 40), (0, 33), (40, 20)]  # one-token rows, chunks, tiles of 16+ rows
        k_cache, v_cache, tables = paged_cache([p + n for p, n in lens], block_size, num_kv_heads, head_dim, dtype,
                                               gen)
        meta = prefill_meta(lens, tables)
        q = torch.randn(sum(meta.seqlens_q), num_kv_heads * group, head_dim, generator=gen).to(dtype)
        assert_matches(backend.prefill(q, None, None, k_cache, v_cache, meta, scale),
                       reference.prefill(q, None, None, k_cache, v_cache, meta, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_build_matches_torch(library, dtype):
    kernels = cpu_build.FusedKernels(library)
    x = randn(70, 2 * 300, dtype=dtype, seed=3, scale=3.0)[:, :300]  # rows past one thread's share, strided
    weight, residual = randn(300, dtype=dtype, seed=1), randn(70, 300, dtype=dtype, seed=2)
    out = kernels.rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(out.residual, expected_residual)
    assert_close(out.out, expected)
    gate_up = randn(33, 2 * 200, dtype=dtype, seed=4, scale=4.0)
    assert_close(kernels.silu_and_mul(gate_up), silu_and_mul(gate_up))
