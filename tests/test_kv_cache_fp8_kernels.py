"""The FP8 KV cache's arithmetic: the torch reference against float64, and the Triton kernels
(store_kv, the fused q/k norm + rotary + store, decode, prefill over the paged cache) against the
torch backend.

Triton's interpreter (TRITON_INTERPRET=1, how CI runs the kernels) reads fp8 correctly (every
finite fp8 value converts to float32 exactly) but rounds float32 -> fp8 wrongly whenever rounding
carries into the exponent (triton 3.9: 31.8 -> 16 instead of 32 for e4m3; e5m2 also breaks ties
upwards). So interpreter tests store values that are exact in fp8 after scaling (fp8 values
times power-of-two scales, plus values past the range, which must clamp): they check the
kernels' addressing, per-head scales and clamping; the rounding itself is checked compiled, on a
GPU (marked `gpu`).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.attention.kv_quant import (FP8_DTYPES, KVRangeObserver, KVScales, dequantize, fp8_max,  # noqa: E402
                                         quantize, scale_from_amax)

FP8 = list(FP8_DTYPES.values())


def random_fp8(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random finite fp8 values of every magnitude (random bit patterns, NaN/inf ones set to 0)."""
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    return torch.where(bits.float().isfinite(), bits.float(), 0.0).to(dtype)


# ---------------------------------------------------------------------------------------------- torch reference

@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_and_dequantize_match_float64(dtype, model_dtype):
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.013, 0.7, 3.0])  # [num_kv_heads]
    limit = fp8_max(dtype)
    # Values inside the range, tiny ones (subnormals), and past it on both sides (clamped).
    x = torch.randn(64, 3, 16, generator=gen) * scale[:, None] * limit / 4
    x[0] = scale[:, None] * limit * 3
    x[1] = -scale[:, None] * limit * 3
    x[2] = scale[:, None] * 1e-3
    x = x.to(model_dtype)
    stored = quantize(x, scale, dtype)
    assert stored.dtype == dtype and stored.shape == x.shape
    expected = (x.double() / scale.double()[:, None]).clamp(-limit, limit).to(dtype)
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    assert (stored[0].float() == limit).all() and (stored[1].float() == -limit).all()
    read = dequantize(stored, scale, model_dtype)
    assert read.dtype == model_dtype
    assert torch.equal(read, (stored.double() * scale.double()[:, None]).to(model_dtype))
    # The round trip loses at most half an fp8 step (relative 2^-(mantissa bits + 1)) plus half
    # the smallest subnormal, before the model dtype's own rounding.
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    tiny = torch.finfo(dtype).smallest_normal * 2.0 ** -mantissa
    inside = slice(2, None)
    error = (dequantize(stored, scale, torch.float64) - x.double())[inside].abs()
    bound = (x.double().abs() * 2.0 ** -(mantissa + 1) + tiny / 2 * scale.double()[:, None])[inside]
    assert (error <= bound * (1 + 1e-6) + x.double().abs()[inside] * torch.finfo(model_dtype).eps).all()


def test_calibrated_scales_span_the_range_with_headroom():
    observer = KVRangeObserver(2, torch.device("cpu"))
    k = torch.zeros(5, 2, 4)
    k[3, 0, 1], k[1, 1, 2] = -8.0, 2.0
    v = torch.zeros(5, 2, 4)
    v[0, 0, 0] = 1.0  # head 1 of V stays all zeros
    observer.observe(k, v)
    observer.observe(k[:0], v[:0])  # an empty step changes nothing
    scales = observer.scales(torch.float8_e4m3fn)
    assert torch.equal(scales.k, scale_from_amax(torch.tensor([8.0, 2.0]), torch.float8_e4m3fn))
    assert torch.allclose(scales.k * 448, torch.tensor([16.0, 4.0]))  # 2x headroom over the max seen
    assert scales.v[1] == 1.0 and scales.v[0] * 448 == pytest.approx(2.0)


# ---------------------------------------------------------------------------------------------- Triton kernels

triton = pytest.importorskip("triton", reason="triton is not installed, so the Triton kernels cannot run")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nanovllm.attention.torch_backend import TorchBackend  # noqa: E402
from nanovllm.platform.attention import triton_backend as make_triton_backend  # noqa: E402
from nanovllm.kernels.decode_attention import decode_attention  # noqa: E402
from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store  # noqa: E402
from nanovllm.kernels.store_kv import _store_kv_kernel, store_kv  # noqa: E402
from nanovllm.layers.rotary_embedding import RopeConfig, RotaryEmbedding  # noqa: E402
from nanovllm.utils.context import AttentionMetadata  # noqa: E402

INTERPRET = isinstance(_store_kv_kernel, InterpretedFunction)
KERNELS_RUN = INTERPRET or torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(not KERNELS_RUN, reason="the kernels were compiled for a GPU and there is none")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEAD_DIM, BLOCK = 32, 16
SCALE = HEAD_DIM ** -0.5
# Powers of two: x = fp8 value * scale is exact in the model dtype and x / scale gives it back.
EXACT_SCALES = [0.5, 0.125]


def exact_kv(num_tokens: int, dtype: torch.dtype, model_dtype: torch.dtype, gen: torch.Generator,
             scales: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """k (or v) [num_tokens, 2, HEAD_DIM] whose quantisation needs no rounding: fp8 values times
    `scales` (powers of two) per head, and a few past the range (clamped to +-fp8 max exactly)."""
    scale = torch.tensor(scales)
    x = random_fp8((num_tokens, 2, HEAD_DIM), dtype, gen).float() * scale[:, None]
    x[0, :, :4] = fp8_max(dtype) * scale[:, None] * 1.5
    x[-1, :, -4:] = -fp8_max(dtype) * scale[:, None] * 1.5
    return x.to(DEVICE, model_dtype), scale.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
def test_store_kv_quantizes_as_torch(dtype, model_dtype):
    gen = torch.Generator().manual_seed(1)
    k, k_scale = exact_kv(21, dtype, model_dtype, gen, EXACT_SCALES)
    v, v_scale = exact_kv(21, dtype, model_dtype, gen, EXACT_SCALES[::-1])
    slots = torch.randperm(4 * BLOCK, generator=gen)[:21].to(DEVICE)
    slots[5] = -1  # a padding row
    caches = {}
    for name, backend in (("torch", TorchBackend()), ("triton", make_triton_backend())):
        k_cache = torch.zeros(4, BLOCK, 2, HEAD_DIM, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        backend.store_kv(k, v, k_cache, v_cache, slots, KVScales(k_scale, v_scale))
        caches[name] = (k_cache.view(torch.uint8), v_cache.view(torch.uint8))
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])
    assert caches["torch"][0].any()


@needs_kernels
def test_store_kv_refuses_mismatched_scales():
    k = torch.zeros(3, 2, HEAD_DIM, device=DEVICE)
    cache = torch.zeros(2, BLOCK, 2, HEAD_DIM, dtype=torch.float8_e4m3fn, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        store_kv(k, k, cache, cache, slots)
    with pytest.raises(ValueError, match="k_scale has 3 entries for 2 KV heads"):
        store_kv(k, k, cache, cache, slots, k_scale=torch.ones(3, device=DEVICE), v_scale=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="are for an fp8 cache"):
        store_kv(k, k, cache.float(), cache.float(), slots, k_scale=torch.ones(2, device=DEVICE),
                 v_scale=torch.ones(2, device=DEVICE))


def fused_store(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                slots: torch.Tensor, kv_scales: KVScales, dtype: torch.dtype, num_heads: int = 4,
                norm: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel's fp8 store of k, v (q a fresh random one): the caches, and k as it left it
    (normalised and rotated in place, what the cache must hold quantised)."""
    q = torch.randn(k.size(0), num_heads, k.size(-1), device=DEVICE).to(k.dtype)
    k = k.clone()
    k_cache = torch.zeros(4, BLOCK, 2, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qk_norm_rope_store(q, k, v, positions, rotary.cos_sin_cache, **(norm or {}), k_cache=k_cache, v_cache=v_cache,
                       slot_mapping=slots, k_scale=kv_scales.k, v_scale=kv_scales.v)
    return k_cache, v_cache, k


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
def test_fused_qk_norm_rope_store_quantizes_as_torch(dtype, model_dtype):
    """The fused rotary + store kernel's fp8 store against the torch backend's store_kv of the same
    K/V. Position 0 (cos 1, sin 0) and no norm leave K as given, so its values can be exact in fp8."""
    gen = torch.Generator().manual_seed(4)
    k, k_scale = exact_kv(21, dtype, model_dtype, gen, EXACT_SCALES)
    v, v_scale = exact_kv(21, dtype, model_dtype, gen, EXACT_SCALES[::-1])
    kv_scales = KVScales(k_scale, v_scale)
    slots = torch.randperm(4 * BLOCK, generator=gen)[:21].to(DEVICE)
    slots[5] = -1  # a padding row
    rotary = RotaryEmbedding(HEAD_DIM, 64, RopeConfig(10000.0, "default", {})).to(DEVICE)
    positions = torch.zeros(21, dtype=torch.int64, device=DEVICE)
    k_cache, v_cache, rotated = fused_store(k, v, positions, rotary, slots, kv_scales, dtype)
    assert torch.equal(rotated, k)  # as numbers: the rotation may flip a zero's sign, so store `rotated`
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    TorchBackend().store_kv(rotated, v, k_ref, v_ref, slots, kv_scales)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    assert k_ref.view(torch.uint8).any()


@needs_kernels
def test_fused_qk_norm_rope_store_refuses_mismatched_scales():
    k = torch.zeros(3, 2, HEAD_DIM, device=DEVICE)
    q = torch.zeros(3, 4, HEAD_DIM, device=DEVICE)
    cos_sin = RotaryEmbedding(HEAD_DIM, 64, RopeConfig(10000.0, "default", {})).cos_sin_cache.to(DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(2, BLOCK, 2, HEAD_DIM, dtype=torch.float8_e4m3fn, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        qk_norm_rope_store(q, k, k, positions, cos_sin, k_cache=cache, v_cache=cache.clone(), slot_mapping=slots)
    with pytest.raises(ValueError, match="no cache was given"):
        qk_norm_rope_store(q, k, k, positions, cos_sin, k_scale=torch.ones(2, device=DEVICE),
                           v_scale=torch.ones(2, device=DEVICE))


def paged_fp8_cache(lengths: list[int], dtype: torch.dtype, gen: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k_cache, v_cache [blocks, BLOCK, 2, HEAD_DIM] of random fp8 values in shuffled blocks, and
    the block tables ([batch, width] int32, padded with -1)."""
    counts = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lengths), max(counts) + 1), -1, dtype=torch.int32)
    for i, count in enumerate(counts):
        tables[i, :count] = torch.tensor(order[:count])
        order = order[count:]
    k = random_fp8((num_blocks, BLOCK, 2, HEAD_DIM), dtype, gen)
    v = random_fp8((num_blocks, BLOCK, 2, HEAD_DIM), dtype, gen)
    return k.to(DEVICE), v.to(DEVICE), tables.to(DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
def test_decode_and_prefill_dequantize_as_torch(dtype, model_dtype):
    """Decode (one and several splits) and paged prefill over an fp8 cache, scales differing
    per head, against the torch backend reading the same cache."""
    gen = torch.Generator().manual_seed(2)
    num_heads = 4
    lengths = [1, 17, 33, 0]
    k_cache, v_cache, tables = paged_fp8_cache(lengths, dtype, gen)
    # Scales that keep fp16 finite: |fp8| * scale stays well under 65504.
    kv_scales = KVScales(torch.tensor([0.02, 0.5], device=DEVICE), torch.tensor([0.3, 0.01], device=DEVICE))
    tolerance = dict(atol=2e-4, rtol=1e-3) if model_dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    q = (torch.randn(len(lengths), num_heads, HEAD_DIM, generator=gen) * 0.1).to(DEVICE, model_dtype)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.full((len(lengths),), -1, device=DEVICE),
                             context_lens=context_lens, block_tables=tables)
    expected = TorchBackend().decode(q, k_cache, v_cache, meta, SCALE, kv_scales)
    for splits in (1, 2):
        out = decode_attention(q, k_cache, v_cache, tables, context_lens, SCALE, num_splits=splits,
                               k_scale=kv_scales.k, v_scale=kv_scales.v)
        torch.testing.assert_close(out.float(), expected.float(), **tolerance)
    # Prefill: (cached prefix, new tokens) per sequence, every key read back from the fp8 cache.
    lens = [(0, 1), (9, 8), (16, 17)]
    seqlens_q, seqlens_k = [n for _, n in lens], [p + n for p, n in lens]
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.empty(0, device=DEVICE),
                             cu_seqlens_q=cu(seqlens_q), cu_seqlens_k=cu(seqlens_k), max_seqlen_q=max(seqlens_q),
                             max_seqlen_k=max(seqlens_k), block_tables=tables[:3], seqlens_q=seqlens_q,
                             seqlens_k=seqlens_k)
    q = (torch.randn(sum(seqlens_q), num_heads, HEAD_DIM, generator=gen) * 0.1).to(DEVICE, model_dtype)
    expected = TorchBackend().prefill(q, None, None, k_cache, v_cache, meta, SCALE, kv_scales)
    out = make_triton_backend().prefill(q, None, None, k_cache, v_cache, meta, SCALE, kv_scales)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the interpreter rounds to fp8 wrongly")
def test_store_kv_rounds_as_torch_on_gpu(dtype, model_dtype):
    """Compiled, the kernel's float32 -> fp8 cast rounds to nearest even as torch's does, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(64, 2, HEAD_DIM, generator=gen) * 3).to(DEVICE, model_dtype)
    v = (torch.randn(64, 2, HEAD_DIM, generator=gen) * 100).to(DEVICE, model_dtype)
    kv_scales = KVScales(torch.tensor([0.013, 0.02], device=DEVICE), torch.tensor([0.5, 0.3], device=DEVICE))
    slots = torch.arange(64, device=DEVICE)
    caches = {}
    for name, backend in (("torch", TorchBackend()), ("triton", make_triton_backend())):
        k_cache = torch.zeros(4, BLOCK, 2, HEAD_DIM, dtype=dtype, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        backend.store_kv(k, v, k_cache, v_cache, slots, kv_scales)
        caches[name] = torch.stack([k_cache.view(torch.uint8), v_cache.view(torch.uint8)])
    assert torch.equal(caches["triton"], caches["torch"])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the interpreter rounds to fp8 wrongly")
def test_fused_qk_norm_rope_store_rounds_as_torch_on_gpu(dtype, model_dtype):
    """Compiled, with norms and real rotations: the cache holds torch's quantisation of the K the
    kernel left in place (and of V), bit for bit."""
    gen = torch.Generator().manual_seed(5)
    k = (torch.randn(64, 2, HEAD_DIM, generator=gen) * 3).to(DEVICE, model_dtype)
    v = (torch.randn(64, 2, HEAD_DIM, generator=gen) * 100).to(DEVICE, model_dtype)
    kv_scales = KVScales(torch.tensor([0.013, 0.02], device=DEVICE), torch.tensor([0.5, 0.3], device=DEVICE))
    slots = torch.arange(64, device=DEVICE)
    rotary = RotaryEmbedding(HEAD_DIM, 512, RopeConfig(10000.0, "default", {})).to(DEVICE)
    positions = torch.randint(0, 512, (64,), generator=gen).to(DEVICE)
    weights = [(1 + torch.randn(HEAD_DIM, generator=gen) * 0.1).to(DEVICE, model_dtype) for _ in range(2)]
    norm = dict(q_weight=weights[0], k_weight=weights[1], eps=1e-6)
    k_cache, v_cache, rotated = fused_store(k, v, positions, rotary, slots, kv_scales, dtype, norm=norm)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    TorchBackend().store_kv(rotated, v, k_ref, v_ref, slots, kv_scales)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
