"""Prefill / extend attention: varlen causal attention of each sequence's new tokens over its keys.

Owns one Triton kernel and its checking wrapper. Keys come either from the contiguous k/v of
this step (no cache yet: Lk == Lq per sequence) or, when a block table is given, from the paged
cache, which already holds every key of the sequence (the cached prefix and the new tokens).
The causal mask is bottom-right aligned: query i of a sequence with Lq new and Lk total tokens
sees key j iff j <= i + Lk - Lq. It knows nothing of how the batch was scheduled.

Design: all query tokens are cut into blocks of BLOCK_Q consecutive tokens of one sequence, and
a program handles one such block for one KV head, packing the block's BLOCK_Q tokens times the
G = Hq/Hkv heads of that KV head as the rows of one tile (so a key tile is loaded once per group).
Sequence s owns program ids [cu_q[s] // BLOCK_Q + s, ...): an upper bound on its block count,
which gives a grid of total_q // BLOCK_Q + batch programs per KV head from host-known sizes,
and lets each program find its sequence by binary search over cu_seqlens_q. Spare programs exit.
A paged fp8 cache is dequantised as each K/V tile is loaded (kv_quant.dequantize_kv, the
program's KV-head scale held in a register).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import INDEX_DTYPES, LOG2E, MIN_DOT_SIZE, SUPPORTED_DTYPES, check_head_dim, check_paged_cache, \
    check_tensor, dot_precision, next_power_of_2, output_for, padded_head_dim
from nanovllm.kernels.kv_quant import dequantize_kv, kv_cache_scales
from nanovllm.kernels.reductions import online_softmax_step


class PrefillTiles(NamedTuple):
    block_m: int  # rows of a tile: BLOCK_Q tokens x the padded head group, >= 16 for tl.dot
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def default_tiles(head_dim: int, dtype: torch.dtype) -> PrefillTiles:
    """64 x 64 tiles, 4 warps, 2 stages (the usual start on Ampere/Hopper), shrunk where they would
    spill registers on sm_90 (ptxas -v, triton 3.9): wide heads halve the key tile, and fp32
    operands take the FMA path of tl.dot, which holds far more in registers than an MMA."""
    wide = padded_head_dim(head_dim) > 128
    if dtype == torch.float32:
        return PrefillTiles(block_m=16 if wide else 32, block_n=16, num_warps=4, num_stages=2)
    return PrefillTiles(block_m=64, block_n=32 if wide else 64, num_warps=4, num_stages=2)


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, q_block, batch, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first program id, cu_seqlens_q[s] // BLOCK_Q + s, is <= q_block."""
    lo = 0
    hi = batch
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The batch size and the block table's width change every step: no variant per value (kernels/__init__.py).
@triton.jit(do_not_specialize=["batch", "stride_table_batch"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    stride_q_token, stride_q_head,
    # Paged: block, slot-in-block and head strides of the caches. Contiguous: token, unused, head
    # (k and v may differ there: v is often a view of the fused qkv output, k a rotated copy).
    stride_k_outer, stride_k_inner, stride_k_head,
    stride_v_outer, stride_v_inner, stride_v_head,
    stride_out_token, stride_out_head,
    stride_table_batch,
    qk_scale_log2,  # softmax scale * log2(e)
    batch, head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KV_QUANTIZED: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    # 1. Which sequence and which of its query blocks; spare programs leave.
    seq = _find_sequence(cu_seqlens_q_ptr, q_block, batch, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    prefix = k_len - q_len  # keys before the first new token: the cached prefix

    # 2. Rows are (token, head) pairs: row r is token r // GROUP_PAD of the block, head r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_pos = local_block * BLOCK_Q + rows // GROUP_PAD  # position among the sequence's new tokens
    group_idx = rows % GROUP_PAD
    row_mask = (q_pos < q_len) & (group_idx < GROUP)
    heads = kv_head * GROUP + group_idx
    tokens = (q_start + q_pos).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < head_dim
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + dims[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, DIM_PAD]

    # 3. Online softmax over key tiles, up to the last key the block's last token can see.
    if KV_QUANTIZED:  # this KV head's scales, for every tile
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_Q * GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([BLOCK_Q * GROUP_PAD, DIM_PAD], 0.0, tl.float32)
    last_visible = prefix + tl.minimum((local_block + 1) * BLOCK_Q, q_len)  # exclusive
    kv_end = tl.minimum(k_len, last_visible)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_batch
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range(0, kv_end, BLOCK_N):
        key_pos = tile_start + offs_n
        valid = key_pos < kv_end  # masked loads never touch the table's -1 padding
        if PAGED:
            blocks = tl.load(table_row + key_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            k_offsets = blocks * stride_k_outer + (key_pos % BLOCK_SIZE) * stride_k_inner
            v_offsets = blocks * stride_v_outer + (key_pos % BLOCK_SIZE) * stride_v_inner
        else:
            k_offsets = (k_start + key_pos).to(tl.int64) * stride_k_outer
            v_offsets = (k_start + key_pos).to(tl.int64) * stride_v_outer
        k_offsets += kv_head * stride_k_head
        v_offsets += kv_head * stride_v_head
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + k_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        if KV_QUANTIZED:
            k = dequantize_kv(k, k_scale, q)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_M, BLOCK_N]
        visible = valid[None, :] & (key_pos[None, :] <= (prefix + q_pos)[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(v_ptr + v_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        if KV_QUANTIZED:
            v = dequantize_kv(v, v_scale, q)
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)

    # 4. A row that saw no key (only possible when Lk < Lq) has l == 0 and outputs zeros.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, scale: float, *, block_tables: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, tiles: PrefillTiles | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen bottom-right causal attention; returns `out` [total_q, num_heads, head_dim] (q's dtype).

    q: [total_q, num_heads, head_dim] (a strided view is fine, stride(-1) == 1); cu_seqlens_q/k:
    [batch + 1] int32 (or int64) prefix sums of new and total tokens. Without block_tables, k and v
    are this step's [total_k, num_kv_heads, head_dim] (strided views fine). With block_tables
    ([batch, max_blocks], padded with -1), k and v are the paged caches [num_blocks, block_size,
    num_kv_heads, head_dim] holding all Lk keys of each sequence, in q's dtype or in fp8 with
    k_scale, v_scale ([num_kv_heads] float32, see attention/kv_quant.py).
    """
    device = q.device
    check_tensor("q", q, 3, SUPPORTED_DTYPES, device)
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES, device)
    check_tensor("cu_seqlens_k", cu_seqlens_k, 1, INDEX_DTYPES, device)
    total_q, num_heads, head_dim = q.shape
    batch = cu_seqlens_q.size(0) - 1
    if batch < 0 or cu_seqlens_k.size(0) != batch + 1:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must both have batch + 1 >= 1 entries")
    paged = block_tables is not None
    if paged:
        check_paged_cache(k, v, q.dtype, device)
        check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
        if block_tables.size(0) != batch:
            raise ValueError(f"block_tables has {block_tables.size(0)} rows for batch={batch}")
        block_size = k.size(1)
        strides = (k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2))
        table_stride = block_tables.stride(0)
    else:
        check_tensor("k", k, 3, (q.dtype,), device)
        check_tensor("v", v, 3, (q.dtype,), device)
        if k.shape != v.shape:
            raise ValueError(f"k and v must share a shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        block_size = 1  # no block table: the constexpr is unused
        strides = (k.stride(0), 0, k.stride(1), v.stride(0), 0, v.stride(1))
        block_tables, table_stride = cu_seqlens_k, 0  # a placeholder pointer, never read
    num_kv_heads = k.size(-2)
    quantized, _, k_scale, v_scale = kv_cache_scales(k, k_scale, v_scale, num_kv_heads, q.dtype)
    if k.size(-1) != head_dim:
        raise ValueError(f"k/v head_dim {k.size(-1)} does not match q's {head_dim}")
    check_head_dim(head_dim)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    out = output_for(q, out)
    if total_q == 0 or batch == 0:
        return out
    tiles = tiles or default_tiles(head_dim, q.dtype)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_q = max(1, tiles.block_m // group_pad)
    assert block_q * group_pad >= MIN_DOT_SIZE and tiles.block_n >= MIN_DOT_SIZE, \
        f"tl.dot needs tiles >= {MIN_DOT_SIZE}, got {tiles}"

    grid = (total_q // block_q + batch, num_kv_heads)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k, block_tables, k_scale, v_scale,
        q.stride(0), q.stride(1),
        *strides,
        out.stride(0), out.stride(1),
        table_stride,
        scale * LOG2E,
        batch, head_dim,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=tiles.block_n,
        DIM_PAD=padded_head_dim(head_dim), BLOCK_SIZE=block_size, PAGED=paged, DOT_PRECISION=dot_precision(q.dtype),
        KV_QUANTIZED=quantized, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
