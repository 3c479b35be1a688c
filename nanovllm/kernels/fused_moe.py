"""fused_moe: a top-k routed layer's experts as two Triton grouped GEMMs over tokens sorted by expert.

Owns the sort (`align_by_expert`), one grouped-GEMM kernel and the checking wrapper `fused_moe`.
It knows the weight layout ([num_experts, out, in], as nn.Linear per expert) and SwiGLU; it knows
nothing of routing (the caller passes each token's experts and weights) or of tensor parallelism
(a rank passes its slice of every expert's intermediate dimension and all-reduces the result).
The torch loop in platform/torch.py (fused_experts_torch) is the oracle it is tested against.

Design (as vLLM's fused_moe): num_tokens * top_k (token, expert) pairs, sorted by expert, each
expert's run padded up to a multiple of BLOCK_M with a sentinel pair id, so every BLOCK_M sorted
rows belong to one expert. A program computes one [BLOCK_M, BLOCK_N] output tile of one such
block: its rows gathered from the input by pair, times that expert's weight. The first GEMM
(gate_up [E, 2I, H]) reads input row pair // top_k; SiLU-and-mul is kernels/silu_mul.py's one pass
over the [pairs, 2I] result (gate | up halves, the layout it takes); the second GEMM
(down [E, H, I]) reads row `pair` and scales it by the pair's routing weight; each token's top_k
rows are then summed. The padded length is bounded from host-known sizes, so the grid needs no
device-to-host sync (CUDA graphs capture it); blocks past the real padded length exit at once.
The pair count changes every step and is excluded from integer specialisation; the tile shape
takes two values (few rows per expert or many), both launched at start-up (the first forward
pass's full-size prefill and runner/kernel_warmup.py's one-token steps): see kernels/__init__.py.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import INDEX_DTYPES, SUPPORTED_DTYPES, check_tensor, dot_precision
from nanovllm.kernels.silu_mul import silu_and_mul

# tl.dot refuses a tile dimension below 16.
MIN_TILE = 16


class MoeTiles(NamedTuple):
    block_m: int  # sorted (token, expert) rows per tile; each expert's rows are padded to a multiple
    block_n: int  # output features per tile
    block_k: int  # input features per step of the inner loop
    num_warps: int
    num_stages: int


def default_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """vLLM's default shape for an untuned device: 16-row blocks when experts get few rows each
    (decode: padding is then most of the work), 64-row blocks otherwise; fp32 operands take the FMA
    path of tl.dot, which holds far more in registers, so they get smaller tiles. Not tuned on a GPU."""
    few_rows = num_pairs <= num_experts * MIN_TILE
    if dtype == torch.float32:
        return MoeTiles(block_m=16 if few_rows else 32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    return MoeTiles(block_m=16 if few_rows else 64, block_n=64, block_k=32 if few_rows else 64, num_warps=4,
                    num_stages=2 if few_rows else 3)


class ExpertAlignment(NamedTuple):
    sorted_pair_ids: torch.Tensor  # [max_blocks * block_m] int32: a pair per row; num_pairs marks padding
    block_experts: torch.Tensor  # [max_blocks] int32: each block's expert (num_experts past the used blocks)
    num_padded: torch.Tensor  # [1] int32: rows in use, a multiple of block_m


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Each expert's run rounds up by less than block_m, and no run is longer than block_m per pair."""
    return min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Pair ids (token * top_k + slot) grouped by expert in pair order, each group padded to a
    multiple of block_m. Plain torch ops with no host sync."""
    flat = topk_ids.flatten().long()  # [num_pairs] expert of each pair
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [num_experts]
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts  # where each expert's pairs begin once sorted, unpadded
    order = torch.argsort(flat, stable=True)  # [num_pairs] pair ids grouped by expert
    sorted_experts = flat[order]
    rows = padded_start[sorted_experts] + torch.arange(num_pairs, device=device) - start[sorted_experts]
    max_blocks = -(-max_padded_rows(num_pairs, num_experts, block_m) // block_m)
    sorted_pair_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[rows] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device) * block_m
    # The first expert whose padded run ends after the block's first row (empty experts end where they start).
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return ExpertAlignment(sorted_pair_ids, block_experts, padded_end[-1:].to(torch.int32))


# The pair count changes every step: no variant per value (kernels/__init__.py).
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pair_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_pairs, pairs_per_a_row, N, K,
    stride_a_row, stride_b_expert, stride_b_n, stride_c_row,
    MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # c[pair, n] = sum_k a[pair // pairs_per_a_row, k] * b[expert of pair, n, k] (* weights[pair])
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    if block * BLOCK_M >= tl.load(num_padded_ptr):  # past the last expert's padded run
        return
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_mask = pairs < num_pairs  # padding rows read zeros and store nothing
    # int64 before any multiply: row * stride overflows int32 on a large batch.
    a_rows = (pairs // pairs_per_a_row).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_b_expert + offs_n[None, :].to(tl.int64) * stride_b_n
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_idx = k_start + offs_k
        k_mask = k_idx < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a_row + k_idx[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_base + k_idx[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_c_row + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None,
                  alignment: ExpertAlignment, pairs_per_a_row: int, tiles: MoeTiles) -> None:
    num_pairs, n = c.shape
    grid = (alignment.block_experts.numel(), triton.cdiv(n, tiles.block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, alignment.sorted_pair_ids, alignment.block_experts,
        alignment.num_padded,
        num_pairs, pairs_per_a_row, n, b.size(2),
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        MUL_WEIGHT=weights is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(a.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: MoeTiles | None = None) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, k].

    x: [num_tokens, hidden]; w13: [num_experts, 2 * inter, hidden] (gate rows, then up rows);
    w2: [num_experts, hidden, inter], both x's dtype; topk_weights: [num_tokens, top_k] float32 or
    x's dtype; topk_ids: [num_tokens, top_k] int32/int64, each < num_experts (not checked: that
    would cost a device-to-host sync). Returns [num_tokens, hidden] in x's dtype.
    """
    device = x.device
    check_tensor("x", x, 2, SUPPORTED_DTYPES, device)
    check_tensor("w13", w13, 3, (x.dtype,), device)
    check_tensor("w2", w2, 3, (x.dtype,), device)
    check_tensor("topk_weights", topk_weights, 2, (torch.float32, x.dtype), device)
    check_tensor("topk_ids", topk_ids, 2, INDEX_DTYPES, device)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    if w13.size(2) != hidden or two_inter % 2:
        raise ValueError(f"w13 has shape {tuple(w13.shape)}; expected [num_experts, 2 * inter, hidden={hidden}]")
    inter = two_inter // 2
    if w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}; expected {(num_experts, hidden, inter)}")
    if topk_ids.size(0) != num_tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [num_tokens={num_tokens}, top_k]")
    top_k = topk_ids.size(1)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = tiles or default_tiles(num_pairs, num_experts, x.dtype)
    assert min(tiles.block_m, tiles.block_n, tiles.block_k) >= MIN_TILE, f"tl.dot needs tiles >= 16, got {tiles}"
    alignment = align_by_expert(topk_ids, num_experts, tiles.block_m)
    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=device)  # [pairs, 2 * inter]
    _grouped_gemm(x, w13, gate_up, None, alignment, top_k, tiles)
    act = silu_and_mul(gate_up)  # [pairs, inter]
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=device)  # [pairs, hidden], weighted
    _grouped_gemm(act, w2, down, topk_weights.flatten(), alignment, 1, tiles)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
