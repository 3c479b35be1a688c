"""Plain-torch attention: the CPU path and the oracle the other backends are tested against.

Decode reads the paged cache a cache-sized tile at a time, never as one copy of every context
padded to the longest: the batch is sorted by context length and cut into tiles of neighbouring
rows whose K/V, gathered whole blocks at a time (a memcpy per block), fit in DECODE_TILE_BYTES.
scaled_dot_product_attention then runs on each tile while it is still in the CPU's cache, padded
only to the tile's own longest context. Each KV head's group of query heads is folded into the
query length (q [rows, kv_heads, group, head_dim]), which the CPU kernel runs faster than
enable_gqa (several times in bfloat16). How a step's batch is tiled depends only on its metadata,
so it is worked out once per step (a DecodePlan) and reused by every layer.

Prefill loops over sequences on the host; a sequence with a cached prefix reads its keys from the
cache through its own blocks. Both read lengths on the host: this backend is not for CUDA graphs.
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend
from nanovllm.utils.context import AttentionMetadata

# Bytes of gathered K+V per decode tile. Tiles small enough to stay in cache while SDPA reads
# them run several times faster per sequence than one batch-wide copy; below ~512 KiB the calls
# per tile cost more than they save (measured 128 KiB..16 MiB on a 2-core Zen 4, docs/BENCHMARKS.md).
DECODE_TILE_BYTES = 1 << 20


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: [length, num_kv_heads, head_dim]."""
    num_blocks, block_size = cache.shape[:2]
    blocks = block_table[:(length + block_size - 1) // block_size]
    # index_select over whole blocks: one contiguous copy per block, the fastest gather on CPU.
    return cache.view(num_blocks, -1).index_select(0, blocks).view(-1, *cache.shape[2:])[:length]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D], bottom-right causal, GQA by head groups."""
    lq, lk = q.size(0), k.size(0)
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, L, D]
    if lq == lk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(lq, device=q.device).unsqueeze(1)
        cols = torch.arange(lk, device=q.device).unsqueeze(0)
        mask = cols <= rows + (lk - lq)  # [Lq, Lk]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class DecodeTile(NamedTuple):
    start: int  # rows start:end of the length-sorted batch
    end: int
    block_ids: torch.Tensor  # [rows * blocks] int64: each row's first `blocks` cache blocks, row-major
    num_tokens: int  # the tile's longest context; shorter rows are masked
    mask: torch.Tensor | None  # [rows, 1, 1, num_tokens] additive (0 or -inf); None when no row is shorter


class DecodePlan(NamedTuple):
    order: torch.Tensor  # [active] int64: batch rows with a context, longest first
    tiles: list[DecodeTile]
    all_active: bool  # no row has context length 0 (those output zeros)


def plan_decode(context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, bytes_per_token: int,
                dtype: torch.dtype, tile_bytes: int = DECODE_TILE_BYTES) -> DecodePlan:
    """Sort the batch by context length and cut it into tiles of at most tile_bytes of gathered
    K/V (a row longer than that is a tile of its own)."""
    lengths = context_lens.tolist()
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    device = block_tables.device
    order_t = torch.tensor(order, dtype=torch.int64, device=device)
    # Entries past a row's own blocks are -1 or stale; the ones a tile reads lie past the row's
    # context, so any valid block will do before they are masked.
    tables = block_tables.index_select(0, order_t).long().clamp_min_(0)  # [active, max_blocks]
    sorted_lens = [lengths[i] for i in order]
    lens_t = context_lens.index_select(0, order_t).view(-1, 1)  # [active, 1]
    tiles, start = [], 0
    while start < len(order):
        longest = sorted_lens[start]
        blocks = (longest + block_size - 1) // block_size
        rows = max(1, min(len(order) - start, tile_bytes // (blocks * block_size * bytes_per_token)))
        end = start + rows
        mask = None
        if sorted_lens[end - 1] < longest:
            positions = torch.arange(longest, device=device).unsqueeze(0)  # [1, longest]
            hidden = positions >= lens_t[start:end]  # [rows, longest]
            mask = torch.zeros(rows, 1, 1, longest, dtype=dtype, device=device)
            mask.masked_fill_(hidden.view(rows, 1, 1, longest), float("-inf"))
        tiles.append(DecodeTile(start, end, tables[start:end, :blocks].flatten(), longest, mask))
        start = end
    return DecodePlan(order_t, tiles, len(order) == len(lengths))


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, decode_tile_bytes: int | None = None) -> None:
        self.decode_tile_bytes = decode_tile_bytes or DECODE_TILE_BYTES
        # The plan of the step in flight and the metadata it was made from: the runner makes one
        # AttentionMetadata per step and hands it to every layer, so layers 2..n reuse layer 1's plan.
        self._plan_meta: AttentionMetadata | None = None
        self._plan: DecodePlan | None = None
        # Decode gathers each tile into these, reused across tiles, layers and steps: a hot buffer
        # instead of a fresh megabyte per tile (which glibc malloc maps and faults in anew).
        self._k_tile = self._v_tile = torch.empty(0)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale):
        out = torch.empty_like(q)
        start_q = start_k = 0
        for i, (lq, lk) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
            if meta.block_tables is None:
                ki, vi = k[start_k:start_k + lk], v[start_k:start_k + lk]
            else:
                ki = gather_kv(k_cache, meta.block_tables[i], lk)
                vi = gather_kv(v_cache, meta.block_tables[i], lk)
            out[start_q:start_q + lq] = causal_attention(q[start_q:start_q + lq], ki, vi, scale)
            start_q, start_k = start_q + lq, start_k + lk
        return out

    def decode_plan(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> DecodePlan:
        if meta is not self._plan_meta:
            bytes_per_token = 2 * k_cache[0, 0].numel() * k_cache.element_size()  # K and V
            self._plan = plan_decode(meta.context_lens, meta.block_tables, k_cache.size(1), bytes_per_token, q.dtype,
                                     self.decode_tile_bytes)
            self._plan_meta = meta
        return self._plan

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        plan = self.decode_plan(q, k_cache, meta)
        num_heads, head_dim = q.shape[1:]
        num_blocks, num_kv_heads = k_cache.size(0), k_cache.size(2)
        group = num_heads // num_kv_heads
        k_flat, v_flat = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)  # [num_blocks, block numel]
        need = max((t.block_ids.numel() for t in plan.tiles), default=0) * k_flat.size(1)
        if self._k_tile.numel() < need or self._k_tile.dtype != k_cache.dtype or self._k_tile.device != k_cache.device:
            self._k_tile, self._v_tile = (torch.empty(need, dtype=k_cache.dtype, device=k_cache.device)
                                          for _ in range(2))
        q_sorted = q.index_select(0, plan.order).view(-1, num_kv_heads, group, head_dim)
        out_sorted = torch.empty_like(q_sorted)  # [active, num_kv_heads, group, head_dim]
        for tile in plan.tiles:
            rows = tile.end - tile.start
            # [rows, num_kv_heads, num_tokens, head_dim]: strided views of the gathered blocks
            n = tile.block_ids.numel()
            k = torch.index_select(k_flat, 0, tile.block_ids, out=self._k_tile[:n * k_flat.size(1)].view(n, -1))
            v = torch.index_select(v_flat, 0, tile.block_ids, out=self._v_tile[:n * v_flat.size(1)].view(n, -1))
            k, v = (x.view(rows, -1, num_kv_heads, head_dim) for x in (k, v))
            k, v = (x[:, :tile.num_tokens].transpose(1, 2) for x in (k, v))
            # The group of query heads of a KV head is that head's "query length".
            out_sorted[tile.start:tile.end] = F.scaled_dot_product_attention(
                q_sorted[tile.start:tile.end], k, v, attn_mask=tile.mask, scale=scale)
        out = torch.empty_like(q) if plan.all_active else torch.zeros_like(q)
        return out.index_copy_(0, plan.order, out_sorted.view(-1, num_heads, head_dim))
