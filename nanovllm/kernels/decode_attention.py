"""Decode attention over the paged KV cache: split-KV, GQA-packed, CUDA-graph safe.

Owns two Triton kernels, their checking wrapper and the host-side rule for the number of
splits. It knows the cache layout, block tables padded with -1 and context lengths that include
the new token (0 = a padding row, which outputs zeros). It does not know who owns the scratch
buffer for split partials: the caller passes one (the backend keeps it across steps).

Design: grid (batch, num_kv_heads, num_splits). A program loads the G = Hq/Hkv query heads that
share its KV head as the rows of one tile (padded to >= 16 for tl.dot), walks its share of the
context in tiles of BLOCK_N positions through the block table with an online softmax (m, l, acc
in fp32), and writes the output directly (one split) or a normalised partial plus its
log-sum-exp for `_reduce_kernel`, grid (batch, num_heads). Each program sizes its share from the
row's context length on the device, so the grid depends only on host-known shapes and the whole
call can be captured in a CUDA graph: no host synchronisation, no data-dependent launch.
An fp8 cache is dequantised as each K/V tile is loaded (kv_quant.dequantize_kv, the program's
KV-head scale held in a register), so the tile math is the same as for a 16-bit cache.
"""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import INDEX_DTYPES, LOG2E, MIN_DOT_SIZE, SUPPORTED_DTYPES, check_head_dim, check_paged_cache, \
    check_tensor, dot_precision, next_power_of_2, output_for, padded_head_dim
from nanovllm.kernels.kv_quant import dequantize_kv, kv_cache_scales
from nanovllm.kernels.reductions import MAX, SUM, online_softmax_step

# Splits multiply the programs so small batches fill the GPU; past this, the reduce and the
# scratch cost more than the extra parallelism gains.
MAX_SPLITS = 64
# Below this many tokens a split's fixed costs (its partial write, its share of the reduce)
# rival the K/V it reads. 64 from the graph-timed sweep on an H100 (docs/BENCHMARKS.md, GPU decode
# attention kernel): batch 1 x 1024 tokens took 6.0 us in 16 splits against 8.8 us in the 4 that
# 256 gave; no shape of batch 1-64 x context 1024/4096 was slower with 64.
MIN_TOKENS_PER_SPLIT = 64
# Programs per SM we aim for. 4 from the eager-timed sweep on an H200 (docs/BENCHMARKS.md, GPU
# decode attention kernel): the splits it gives read more of copy bandwidth than 2's at every batch
# of 4-32 and context 1,024 / 4,096 measured (batch 16 x 1,024: 67.8% against 60.5%; batch 8 x
# 4,096: 82.7% against 72.4%; batch 32 x 4,096: 100.9% against 87.9%), the same at batch 1 x 1,024
# and >= 64.
PROGRAMS_PER_SM = 4
# Without a GPU to ask (the CPU interpreter) the split rule pretends to have this many SMs.
FALLBACK_SM_COUNT = 64


class DecodeTiles(NamedTuple):
    block_n: int  # context positions per tile
    num_warps: int
    num_stages: int


def default_tiles(head_dim: int, dtype: torch.dtype) -> DecodeTiles:
    """Largest key tile that compiles for sm_90 without register spills (ptxas -v, triton 3.9):
    fp32 operands take the FMA path of tl.dot, which holds far more in registers than an MMA."""
    if dtype == torch.float32:
        return DecodeTiles(block_n=16, num_warps=4, num_stages=2)
    return DecodeTiles(block_n=64 if padded_head_dim(head_dim) <= 128 else 32, num_warps=4, num_stages=2)


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, num_sms: int) -> int:
    """Splits of each row's context, a power of two chosen from shapes only (never from the actual
    lengths) so a CUDA graph captured for this batch size stays valid: enough programs to give
    every SM PROGRAMS_PER_SM of them, but no split shorter than MIN_TOKENS_PER_SPLIT of the longest
    context the block table can hold (max_blocks * block_size)."""
    by_occupancy = (PROGRAMS_PER_SM * num_sms) // max(1, batch * num_kv_heads)
    by_length = (max_blocks * block_size) // MIN_TOKENS_PER_SPLIT
    splits = max(1, min(MAX_SPLITS, by_occupancy, by_length))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def split_shapes(max_batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                 num_sms: int) -> dict[int, tuple[int, int]]:
    """Every number of splits choose_num_splits gives for batches 1..max_batch and block tables
    1..max_blocks wide, each with one (batch, width) that gives it (the start-up warm-up compiles
    each). The rule is a rounded min(by_occupancy(batch), by_length(width)), falling in batch and
    rising in width, so every value it takes is taken with batch 1 or with the full width."""
    shapes: dict[int, tuple[int, int]] = {}
    candidates = [(1, w) for w in range(1, max_blocks + 1)] + [(b, max_blocks) for b in range(1, max_batch + 1)]
    for batch, width in candidates:
        shapes.setdefault(choose_num_splits(batch, num_kv_heads, width, block_size, num_sms), (batch, width))
    return shapes


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """SMs of the device (cached: asked once per device, not per decode step)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return FALLBACK_SM_COUNT


def scratch_numel(batch: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of scratch one call needs: per (row, head, split) a partial output and its
    log-sum-exp. Zero with one split, which writes the output directly."""
    return 0 if num_splits == 1 else batch * num_heads * num_splits * (head_dim + 1)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    stride_q_batch, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_batch,
    stride_out_batch, stride_out_head,
    qk_scale_log2,  # softmax scale * log2(e)
    num_heads, head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_QUANTIZED: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # 1. This split's share of the context, in whole tiles: [start, end).
    context_len = tl.load(context_lens_ptr + batch).to(tl.int32)
    per_split = (context_len + NUM_SPLITS - 1) // NUM_SPLITS
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    # 2. The GROUP query heads of this KV head, one per row; rows past GROUP are zero padding.
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + batch * stride_q_batch + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [GROUP_PAD, DIM_PAD]

    # 3. Online softmax over tiles of BLOCK_N positions, each found through the block table.
    if KV_QUANTIZED:  # this KV head's scales, for every tile
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, DIM_PAD], 0.0, tl.float32)
    table_row = block_tables_ptr + batch * stride_table_batch
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + offs_n
        valid = positions < end  # masked loads never touch the table's -1 padding
        blocks = tl.load(table_row + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slots = blocks * stride_cache_block + (positions % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        if KV_QUANTIZED:
            k = dequantize_kv(k, k_scale, q)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        v = tl.load(v_cache_ptr + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        if KV_QUANTIZED:
            v = dequantize_kv(v, v_scale, q)
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)

    # 4. An empty share (context 0, or past the end of a short context) has l == 0: output zeros.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + batch * stride_out_batch + heads[:, None] * stride_out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Scratch is dense: partial_out [batch, num_heads, NUM_SPLITS, head_dim], lse [.., NUM_SPLITS].
        part = (batch * num_heads + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(partial_out_ptr + part[:, None] * head_dim + dims[None, :], out, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(partial_lse_ptr + part, lse, mask=row_mask)


@triton.jit
def _reduce_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_out_batch, stride_out_head,
    num_heads, head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    # One program per (row, query head): weight each split's partial by exp2(lse - max lse).
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < head_dim
    part = (batch * num_heads + head) * NUM_SPLITS + splits  # [SPLITS_PAD]
    lse = tl.load(partial_lse_ptr + part, mask=split_mask, other=float("-inf"))
    lse_max = tl.reduce(lse, 0, MAX)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty: context 0
    weights = tl.exp2(lse - lse_max)  # 0 for empty splits
    partial = tl.load(partial_out_ptr + part[:, None] * head_dim + dims[None, :],
                      mask=split_mask[:, None] & dim_mask[None, :], other=0.0)  # [SPLITS_PAD, DIM_PAD]
    total = tl.reduce(weights, 0, SUM)
    out = tl.reduce(weights[:, None] * partial, 0, SUM) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + batch * stride_out_batch + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, *, num_splits: int = 1,
                     scratch: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     tiles: DecodeTiles | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per row over its first context_lens[b] cached positions.

    q: [batch, num_heads, head_dim] (a strided view is fine, stride(-1) == 1); k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [batch, max_blocks] int32 (or
    int64), padded with -1, never read past a row's context; context_lens: [batch] int32 (or
    int64), 0 for a padding row. num_splits > 1 needs `scratch`, a flat fp32 tensor of at least
    scratch_numel(...) elements (allocated here if None, which a CUDA graph capture must avoid).
    An fp8 cache needs k_scale, v_scale: [num_kv_heads] float32 (attention/kv_quant.py). Returns `out` ([batch, num_heads, head_dim], q's dtype), allocated when not given.
    """
    device = q.device
    check_tensor("q", q, 3, SUPPORTED_DTYPES, device)
    check_paged_cache(k_cache, v_cache, q.dtype, device)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES, device)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES, device)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.size(1), k_cache.size(2)
    if k_cache.size(3) != head_dim:
        raise ValueError(f"cache head_dim {k_cache.size(3)} does not match q's {head_dim}")
    check_head_dim(head_dim)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if block_tables.size(0) != batch or context_lens.size(0) != batch:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must have batch={batch} rows")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    quantized, _, k_scale, v_scale = kv_cache_scales(k_cache, k_scale, v_scale, num_kv_heads, q.dtype)
    out = output_for(q, out)
    if batch == 0:
        return out
    need = scratch_numel(batch, num_heads, head_dim, num_splits)
    if need and scratch is None:
        scratch = torch.empty(need, dtype=torch.float32, device=device)
    if need:
        check_tensor("scratch", scratch, 1, (torch.float32,), device)
        if scratch.numel() < need:
            raise ValueError(f"scratch has {scratch.numel()} elements; batch={batch}, num_heads={num_heads}, "
                             f"head_dim={head_dim}, num_splits={num_splits} need {need}")
        partial_out = scratch[:batch * num_heads * num_splits * head_dim]
        partial_lse = scratch[partial_out.numel():need]
    else:  # unused: the one-split kernel writes `out` directly
        partial_out = partial_lse = out
    tiles = tiles or default_tiles(head_dim, q.dtype)
    group = num_heads // num_kv_heads
    dim_pad = padded_head_dim(head_dim)

    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale,
        out, partial_out, partial_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        num_heads, head_dim,
        GROUP=group, GROUP_PAD=max(MIN_DOT_SIZE, next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=tiles.block_n, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype),
        KV_QUANTIZED=quantized, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _reduce_kernel[(batch, num_heads)](
            partial_out, partial_lse, out,
            out.stride(0), out.stride(1),
            num_heads, head_dim,
            NUM_SPLITS=num_splits, SPLITS_PAD=next_power_of_2(num_splits), DIM_PAD=dim_pad,
        )
    return out
