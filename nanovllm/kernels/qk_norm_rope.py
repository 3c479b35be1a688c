"""Per-head q/k RMSNorm, rotary embedding and the KV-cache store, in one pass over q, k and v.

Owns one Triton kernel and its checking wrapper. Per token it normalises each q and k head
(Qwen3's q_norm/k_norm; skipped for models without them, as Llama and Qwen2), rotates both
(neox style: the two halves of a head turn together), writes them back in place, and stores the
token's rotated K and its V in the paged cache at its slot (-1: a padding row, store nothing),
quantised per KV head by kv_quant.quantize_kv when the cache is fp8 (Config.kv_cache_dtype).
It computes what platform/torch.py's rms_norm and layers/rotary_embedding.py compute, cast for
cast (they are its oracle and the CPU path); it knows the cache layout [num_blocks, block_size,
num_kv_heads, head_dim] and nothing of sequences or attention.

Design: a program takes BLOCK_T tokens, the rows of its tiles being (token, head) pairs and the
columns one half of a head, so q, k and v are each read once and the rotated q and k written
once, into the fused qkv output they are views of: one token per program for real models
(Qwen3-0.6B: 3,072 elements), several for tiny test models (fewer programs for the CPU
interpreter). The token count changes every step, so it is excluded from integer specialisation
(see kernels/__init__.py): one compiled variant serves every batch.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import INDEX_DTYPES, SUPPORTED_DTYPES, check_head_dim, check_paged_cache, check_tensor, \
    next_power_of_2, num_warps_for, previous_power_of_2
from nanovllm.kernels.kv_quant import kv_cache_scales, quantize_kv
from nanovllm.kernels.reductions import SUM

# Elements of q, k and v per program: tokens are added to a program up to this (at least one).
ELEMENTS_PER_PROGRAM = 4096
# Threads per program: one warp per this many elements, up to MAX_WARPS.
ELEMENTS_PER_WARP = 1024
MAX_WARPS = 8


@triton.jit
def _token_rows(first_token, num_tokens, num_heads, BLOCK_T: tl.constexpr, HEADS_PAD: tl.constexpr):
    """Rows of a tile: row r is head r % HEADS_PAD of token first_token + r // HEADS_PAD. Returns
    each row's token (int64), head, whether it is a real (token, head) and whether its token is."""
    rows = tl.arange(0, BLOCK_T * HEADS_PAD)
    token = (first_token + rows // HEADS_PAD).to(tl.int64)
    head = rows % HEADS_PAD
    token_ok = token < num_tokens
    return token, head, token_ok & (head < num_heads), token_ok


@triton.jit
def _cos_sin(positions_ptr, cos_sin_ptr, stride_cos_sin, token, token_ok, HALF: tl.constexpr,
             HALF_PAD: tl.constexpr):
    """Each row's rotation: cos and sin of its token's position, [rows, HALF_PAD] each, fp32."""
    position = tl.load(positions_ptr + token, mask=token_ok, other=0).to(tl.int64)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = token_ok[:, None] & (cols < HALF)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + cols, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + cols, mask=mask, other=0.0)
    return cos, sin


@triton.jit
def _norm_rope_rows(ptr, stride_token, stride_head, token, head, row_ok, weight_ptr, cos, sin, eps,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr):
    """Normalise (if HAS_NORM) and rotate the tile's rows (one head of one token each) in place;
    returns the two rotated halves, [rows, HALF_PAD] each, in the input dtype."""
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = row_ok[:, None] & (cols < HALF)
    first = ptr + token[:, None] * stride_token + head[:, None] * stride_head + cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.reduce(x1f * x1f, 1, SUM) + tl.reduce(x2f * x2f, 1, SUM)  # [rows]
        inv_rms = tl.math.rsqrt(sum_sq / (2 * HALF) + eps)[:, None]
        w1 = tl.load(weight_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        # As torch: normalised in fp32, rounded, times the weight, rounded again before rotary.
        x1f = ((x1f * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2f = ((x2f * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = (x1f * cos - x2f * sin).to(dtype)
    y2 = (x2f * cos + x1f * sin).to(dtype)
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF, y2, mask=mask)
    return y1, y2


@triton.jit(do_not_specialize=["num_tokens"])
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cos_sin,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    num_tokens, num_heads, num_kv_heads, eps,
    BLOCK_T: tl.constexpr, Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, STORE: tl.constexpr,
    QUANTIZED: tl.constexpr, FP8_MAX: tl.constexpr,
):
    first_token = tl.program_id(0) * BLOCK_T
    # 1. q: every head of the program's tokens, normalised and rotated in place.
    token, head, row_ok, token_ok = _token_rows(first_token, num_tokens, num_heads, BLOCK_T, Q_HEADS_PAD)
    cos, sin = _cos_sin(positions_ptr, cos_sin_ptr, stride_cos_sin, token, token_ok, HALF, HALF_PAD)
    _norm_rope_rows(q_ptr, stride_q_token, stride_q_head, token, head, row_ok, q_weight_ptr, cos, sin, eps,
                    HALF, HALF_PAD, HAS_NORM)
    # 2. k the same way.
    token, head, row_ok, token_ok = _token_rows(first_token, num_tokens, num_kv_heads, BLOCK_T, KV_HEADS_PAD)
    cos, sin = _cos_sin(positions_ptr, cos_sin_ptr, stride_cos_sin, token, token_ok, HALF, HALF_PAD)
    k1, k2 = _norm_rope_rows(k_ptr, stride_k_token, stride_k_head, token, head, row_ok, k_weight_ptr, cos, sin,
                             eps, HALF, HALF_PAD, HAS_NORM)
    # 3. The rotated K and the V of each token into its cache slot (-1: none); int64, as block *
    #    stride overflows int32 on a large cache. An fp8 cache stores x / scale of the row's KV head.
    if STORE:
        slot = tl.load(slot_mapping_ptr + token, mask=token_ok, other=-1).to(tl.int64)[:, None]
        cols = tl.arange(0, HALF_PAD)[None, :]
        mask = row_ok[:, None] & (slot >= 0) & (cols < HALF)
        cache = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot \
            + head[:, None] * stride_cache_head + cols
        v_first = v_ptr + token[:, None] * stride_v_token + head[:, None] * stride_v_head + cols
        v1 = tl.load(v_first, mask=mask)
        v2 = tl.load(v_first + HALF, mask=mask)
        if QUANTIZED:
            ks = tl.load(k_scale_ptr + head, mask=row_ok, other=1.0)[:, None]  # [rows, 1] float32
            vs = tl.load(v_scale_ptr + head, mask=row_ok, other=1.0)[:, None]
            k1 = quantize_kv(k1, ks, k_cache_ptr, FP8_MAX)
            k2 = quantize_kv(k2, ks, k_cache_ptr, FP8_MAX)
            v1 = quantize_kv(v1, vs, v_cache_ptr, FP8_MAX)
            v2 = quantize_kv(v2, vs, v_cache_ptr, FP8_MAX)
        tl.store(k_cache_ptr + cache, k1, mask=mask)
        tl.store(k_cache_ptr + cache + HALF, k2, mask=mask)
        tl.store(v_cache_ptr + cache, v1, mask=mask)
        tl.store(v_cache_ptr + cache + HALF, v2, mask=mask)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       cos_sin_cache: torch.Tensor, q_weight: torch.Tensor | None = None,
                       k_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                       k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                       slot_mapping: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """In place: q and k normalised per head (when the weights are given) and rotated; and with a
    cache, k_cache/v_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t], v[t] for every slot >= 0.

    q: [num_tokens, num_heads, head_dim], k, v: [num_tokens, num_kv_heads, head_dim], usually strided
    views of the fused qkv output (stride(-1) == 1); positions: [num_tokens] int32/int64;
    cos_sin_cache: [max_position, head_dim] or [max_position, 1, head_dim] float32, cos | sin halves;
    q_weight, k_weight: [head_dim] in q's dtype, both or neither; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim] and slot_mapping [num_tokens] int32/int64, all or none;
    the cache in q's dtype, or fp8 with k_scale, v_scale ([num_kv_heads] float32: stored as
    x / scale, see attention/kv_quant.py).
    """
    device = q.device
    check_tensor("q", q, 3, SUPPORTED_DTYPES, device)
    check_tensor("k", k, 3, (q.dtype,), device)
    check_tensor("v", v, 3, (q.dtype,), device)
    num_tokens, num_heads, head_dim = q.shape
    if k.shape != v.shape or k.size(0) != num_tokens or k.size(2) != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [{num_tokens}, num_kv_heads, "
                         f"{head_dim}] to match q {tuple(q.shape)}")
    check_head_dim(head_dim)
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even: rotary embedding turns the two halves of a head together")
    check_tensor("positions", positions, 1, INDEX_DTYPES, device)
    if positions.size(0) != num_tokens:
        raise ValueError(f"positions has {positions.size(0)} entries for {num_tokens} tokens")
    cos_sin = cos_sin_cache.view(cos_sin_cache.size(0), -1) if cos_sin_cache.dim() == 3 else cos_sin_cache
    check_tensor("cos_sin_cache", cos_sin, 2, (torch.float32,), device)
    if cos_sin.size(1) != head_dim:
        raise ValueError(f"cos_sin_cache rows have {cos_sin.size(1)} values; expected head_dim={head_dim} (cos | sin)")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must be given together (q/k norm) or both be None")
    has_norm = q_weight is not None
    if has_norm:
        for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
            check_tensor(name, w, 1, (q.dtype,), device)
            if w.size(0) != head_dim:
                raise ValueError(f"{name} has {w.size(0)} elements; expected head_dim={head_dim}")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"eps={eps!r} is not allowed; it must be a float > 0")
    store = k_cache is not None
    if store != (v_cache is not None) or store != (slot_mapping is not None):
        raise ValueError("k_cache, v_cache and slot_mapping must be given together or not at all")
    if store:
        check_paged_cache(k_cache, v_cache, q.dtype, device)
        if k_cache.shape[2:] != k.shape[1:]:
            raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match k's {tuple(k.shape[1:])}")
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, device)
        if slot_mapping.size(0) != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.size(0)} entries for {num_tokens} tokens")
        quantized, fp8_max, k_scale, v_scale = kv_cache_scales(k_cache, k_scale, v_scale, k.size(1), q.dtype)
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale/v_scale are for storing into an fp8 cache; no cache was given")
    else:
        quantized, fp8_max, k_scale, v_scale = False, 0.0, k, k  # placeholder pointers, never read
    if num_tokens == 0:
        return
    num_kv_heads = k.size(1)
    half = head_dim // 2
    # Unused pointers (no norm, no cache) get a tensor of the right type that is never read.
    q_weight, k_weight = (q_weight, k_weight) if has_norm else (q, q)
    k_cache, v_cache, slot_mapping = (k_cache, v_cache, slot_mapping) if store else (k, v, positions)
    cache_strides = k_cache.stride()[:3] if store else (0, 0, 0)
    q_heads_pad, kv_heads_pad = next_power_of_2(num_heads), next_power_of_2(num_kv_heads)
    half_pad = next_power_of_2(half)
    token_elements = (q_heads_pad + 2 * kv_heads_pad) * 2 * half_pad
    block_t = previous_power_of_2(max(1, ELEMENTS_PER_PROGRAM // token_elements))
    _qk_norm_rope_store_kernel[(triton.cdiv(num_tokens, block_t),)](
        q, k, v, positions, cos_sin, q_weight, k_weight, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0),
        *cache_strides,
        num_tokens, num_heads, num_kv_heads, eps,
        BLOCK_T=block_t, Q_HEADS_PAD=q_heads_pad, KV_HEADS_PAD=kv_heads_pad, HALF=half, HALF_PAD=half_pad,
        BLOCK_SIZE=k_cache.size(1) if store else 1, HAS_NORM=has_norm, STORE=store, QUANTIZED=quantized,
        FP8_MAX=fp8_max,
        num_warps=num_warps_for(block_t * token_elements, ELEMENTS_PER_WARP, MAX_WARPS),
    )
