"""store_kv: scatter each new token's K and V into the paged cache through slot_mapping.

Owns one Triton kernel and its checking wrapper. It knows the cache layout
[num_blocks, block_size, num_kv_heads, head_dim] and that slot -1 marks a padding row to skip;
it knows nothing of sequences, block tables or attention. An fp8 cache is written quantised, per
KV head, by kv_quant.quantize_kv in the same pass.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import INDEX_DTYPES, SUPPORTED_DTYPES, check_head_dim, check_paged_cache, check_tensor, \
    next_power_of_2
from nanovllm.kernels.kv_quant import kv_cache_scales, quantize_kv


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, QUANTIZED: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # One program per token: copy its [num_kv_heads, head_dim] K and V rows to one cache slot.
    token = tl.program_id(0).to(tl.int64)
    # int64 before any multiply: block * stride overflows int32 on a large cache.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padding row (CUDA-graph bucket): nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offsets = block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head + dims
    k = tl.load(k_ptr + token * stride_k_token + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads * stride_v_head + dims, mask=mask)
    if QUANTIZED:  # per-head scales, [HEADS_PAD, 1]
        head_mask = heads < num_kv_heads
        k = quantize_kv(k, tl.load(k_scale_ptr + heads, mask=head_mask, other=1.0), k_cache_ptr, FP8_MAX)
        v = quantize_kv(v, tl.load(v_scale_ptr + heads, mask=head_mask, other=1.0), v_cache_ptr, FP8_MAX)
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k_cache.view(-1, H, D)[slot_mapping[t]] = k[t] (same for v) for every t with a slot >= 0.

    k, v: [num_tokens, num_kv_heads, head_dim], possibly strided views of the fused qkv output
    (only stride(-1) == 1 is required); k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim] with k's dtype, or fp8 with k_scale, v_scale ([num_kv_heads] float32: stored as
    x / scale, see attention/kv_quant.py); slot_mapping: [num_tokens] int32 or int64, -1 = skip.
    """
    device = k.device
    check_tensor("k", k, 3, SUPPORTED_DTYPES, device)
    check_tensor("v", v, 3, (k.dtype,), device)
    check_paged_cache(k_cache, v_cache, k.dtype, device)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES, device)
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match k's {tuple(k.shape[1:])}")
    if slot_mapping.size(0) != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.size(0)} entries for {num_tokens} tokens")
    check_head_dim(head_dim)
    quantized, fp8_max, k_scale, v_scale = kv_cache_scales(k_cache, k_scale, v_scale, num_kv_heads, k.dtype)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.size(1), HEADS_PAD=next_power_of_2(num_kv_heads), DIM_PAD=next_power_of_2(head_dim),
        QUANTIZED=quantized, FP8_MAX=fp8_max,
    )
