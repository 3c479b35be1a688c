"""Plain-torch attention: the CPU path and the oracle the other backends are tested against.

Decode rows (a decode step's batch, and the one-new-token rows of a mixed step) read the paged
cache a cache-sized tile at a time, never as one copy of every context padded to the longest:
the rows are sorted by context length and cut into tiles of neighbouring rows whose K/V,
gathered whole blocks at a time (a memcpy per block), fit in DECODE_TILE_BYTES.
scaled_dot_product_attention then runs on each tile while it is still in the CPU's cache, padded
only to the tile's own longest context. Each KV head's group of query heads is folded into the
query length (q [rows, kv_heads, group, head_dim]), which the CPU kernel runs faster than
enable_gqa (several times in bfloat16). How a step's rows are tiled depends only on its
metadata, so it is worked out once per step (a StepPlan) and reused by every layer.

With one or two KV heads in float32 on CPU a tile is attended by two batched matmuls instead
(`attend_by_matmul`): each row's query heads are laid out block-diagonally against all of its
KV heads side by side, so the gathered tile is read as it lies, one matrix per row, at the
price of multiplying by zeros (twice the flops with two KV heads). That measured 12-15% faster
per decode step than SDPA on issue 15's model (docs/BENCHMARKS.md, "CPU decode tile size and
formulation"); with more KV heads the zeros cost more than they save, and half-precision
matmuls are emulated on CPUs without native kernels, so SDPA stays there.

Prefill loops over the other sequences on the host; one with a cached prefix reads its keys from
the cache through its own blocks. Both read lengths on the host: this backend is not for CUDA graphs.

With an fp8 cache it is the reference of the quantised arithmetic (attention/kv_quant.py):
store_kv quantises, and every read of the cache goes through `read_cache`, which dequantises the
rows read (K and V) to the query's dtype: a prefill sequence's gathered keys, or one decode tile
at a time (never a dequantised copy of the whole cache).
"""
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.kv_quant import KVScales, quantize, read_cache
from nanovllm.utils.context import AttentionMetadata
from nanovllm.utils.math_utils import cdiv

# Bytes of gathered K+V per decode tile. Tiles small enough to stay in cache while they are
# attended run several times faster per sequence than one batch-wide copy; below ~1 MiB the
# calls per tile cost more than they save, past ~8 MiB the tile leaves the cache (measured
# 256 KiB..16 MiB on a 2-core Zen 3: 4 MiB best; BENCHMARKS.md, "CPU decode tile size and formulation").
DECODE_TILE_BYTES = 4 << 20
MATMUL_DECODE_MAX_KV_HEADS = 2  # attend_by_matmul's zeros cost num_kv_heads times the useful flops


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: [length, num_kv_heads, head_dim]."""
    num_blocks, block_size = cache.shape[:2]
    blocks = block_table[:cdiv(length, block_size)]
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


def block_diagonal_queries(q: torch.Tensor) -> torch.Tensor:
    """q [rows, num_kv_heads, group, head_dim] -> [rows, num_kv_heads * group, num_kv_heads * head_dim]
    with KV head h's queries in columns h * head_dim:(h + 1) * head_dim and zeros elsewhere."""
    rows, num_kv_heads, group, head_dim = q.shape
    out = q.new_zeros(rows, num_kv_heads, group, num_kv_heads, head_dim)
    for h in range(num_kv_heads):
        out[:, h, :, h] = q[:, h]
    return out.view(rows, num_kv_heads * group, num_kv_heads * head_dim)


def attend_by_matmul(q_bd: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Decode attention of one tile as two batched matmuls: q_bd from block_diagonal_queries
    ([rows, kv_heads * group, kv_heads * head_dim]), k/v [rows, num_tokens, kv_heads, head_dim]
    (slices of a gathered tile: each token's heads contiguous), mask [rows, 1, 1, num_tokens]
    additive or None -> [rows, kv_heads, group, head_dim]. Scores are scaled after the dot
    product, as HF's eager attention does."""
    rows, num_tokens, num_kv_heads, head_dim = k.shape
    k, v = k.reshape(rows, num_tokens, -1), v.reshape(rows, num_tokens, -1)  # views: [rows, tokens, heads * dim]
    # [rows, kv_heads * group, tokens], every query head against every KV head; the zeros of q_bd keep
    # them apart exactly (0 * x is 0 for the finite x a cache holds)
    if mask is None:
        scores = torch.bmm(q_bd, k.transpose(1, 2)).mul_(scale)
    else:
        scores = torch.baddbmm(mask.view(rows, 1, num_tokens), q_bd, k.transpose(1, 2), alpha=scale)
    out = torch.bmm(scores.softmax(-1), v).view(rows, num_kv_heads, -1, num_kv_heads, head_dim)
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # each query head's own KV head


class DecodeTile(NamedTuple):
    start: int  # rows start:end of the length-sorted decode rows
    end: int
    block_ids: torch.Tensor  # [rows * blocks] int64: each row's first `blocks` cache blocks, row-major
    num_tokens: int  # the tile's longest context; shorter rows are masked
    mask: torch.Tensor | None  # [rows, 1, 1, num_tokens] additive (0 or -inf); None when no row is shorter


class DecodePlan(NamedTuple):
    order: torch.Tensor  # [active] int64: decode rows with a context, longest first
    tiles: list[DecodeTile]
    all_active: bool  # no row has context length 0 (those output zeros)


def plan_decode(context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, bytes_per_token: int,
                dtype: torch.dtype, tile_bytes: int = DECODE_TILE_BYTES) -> DecodePlan:
    """Sort the decode rows by context length and cut them into tiles of at most tile_bytes of
    gathered K/V (a row longer than that is a tile of its own)."""
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
        blocks = cdiv(longest, block_size)
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


class PrefillSeq(NamedTuple):
    """A sequence of a prefill step with more than one new token (or no cache to read)."""
    index: int  # among the step's sequences
    start_q: int  # its new tokens are rows start_q:start_q + len_q
    len_q: int
    start_k: int  # its keys, in the step's contiguous k/v when there is no cache
    len_k: int


class StepPlan(NamedTuple):
    """What every layer of one step does, worked out by the first layer."""
    prefills: list[PrefillSeq]
    decode_rows: torch.Tensor | None  # [n] int64 rows of q that decode (one new token over the cache); None: all
    decode: DecodePlan | None  # None: the step has no decode rows


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_fp8_kv_cache = True

    def __init__(self, decode_tile_bytes: int = DECODE_TILE_BYTES, decode_by_matmul: bool = True) -> None:
        self.decode_tile_bytes = decode_tile_bytes
        # Float32 tiles of few KV heads by two matmuls (attend_by_matmul): the platform turns it off
        # on CUDA (platform/attention.py), where SDPA's kernels serve every shape.
        self.decode_by_matmul = decode_by_matmul
        # The plan of the step in flight and the metadata it was made from: the runner makes one
        # AttentionMetadata per step and hands it to every layer, so layers 2..n reuse layer 1's plan.
        self._plan_meta: AttentionMetadata | None = None
        self._plan: StepPlan | None = None
        # Decode gathers each tile into these, reused across tiles, layers and steps: a hot buffer
        # instead of a fresh megabyte per tile (which glibc malloc maps and faults in anew).
        self._k_tile = self._v_tile = torch.empty(0)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        keep = slot_mapping >= 0
        if bool(keep.all()):  # the usual case: no masked copy of this step's K and V
            slots = slot_mapping.long()
        else:
            slots, k, v = slot_mapping[keep].long(), k[keep], v[keep]
        if kv_scales is not None:
            k, v = quantize(k, kv_scales.k, k_cache.dtype), quantize(v, kv_scales.v, v_cache.dtype)
            # index_copy_ has no fp8 kernel on CPU: copy the bytes (fp8 is one byte per element).
            k_cache, v_cache, k, v = (x.view(torch.uint8) for x in (k_cache, v_cache, k, v))
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        plan = self.step_plan(q, k_cache, meta)
        out = torch.empty_like(q)
        for seq in plan.prefills:
            if meta.block_tables is None:
                ki, vi = k[seq.start_k:seq.start_k + seq.len_k], v[seq.start_k:seq.start_k + seq.len_k]
            else:
                k_scale, v_scale = kv_scales or (None, None)
                ki = read_cache(gather_kv(k_cache, meta.block_tables[seq.index], seq.len_k), k_scale, q.dtype)
                vi = read_cache(gather_kv(v_cache, meta.block_tables[seq.index], seq.len_k), v_scale, q.dtype)
            rows = slice(seq.start_q, seq.start_q + seq.len_q)
            out[rows] = causal_attention(q[rows], ki, vi, scale)
        if plan.decode is not None:
            out[plan.decode_rows] = self.paged_decode(q.index_select(0, plan.decode_rows), k_cache, v_cache,
                                                      plan.decode, scale, kv_scales)
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        return self.paged_decode(q, k_cache, v_cache, self.step_plan(q, k_cache, meta).decode, scale, kv_scales)

    def step_plan(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> StepPlan:
        """This step's plan, made by its first layer. A prefill step's one-new-token rows over a
        cache (a mixed step's decodes) decode with the decode step's tiles."""
        if meta is self._plan_meta:
            return self._plan

        def plan(context_lens: torch.Tensor, block_tables: torch.Tensor) -> DecodePlan:
            # K and V as SDPA reads them: a quantised cache's tile is dequantised to q's dtype.
            bytes_per_token = 2 * k_cache[0, 0].numel() * max(k_cache.element_size(), q.element_size())
            return plan_decode(context_lens, block_tables, k_cache.size(1), bytes_per_token, q.dtype,
                               self.decode_tile_bytes)

        if not meta.is_prefill:
            self._plan = StepPlan([], None, plan(meta.context_lens, meta.block_tables))
        else:
            paged = meta.block_tables is not None
            prefills, decode_index, decode_rows, decode_lens = [], [], [], []
            start_q = start_k = 0
            for i, (lq, lk) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
                if paged and lq == 1:
                    decode_index.append(i)
                    decode_rows.append(start_q)
                    decode_lens.append(lk)
                else:
                    prefills.append(PrefillSeq(i, start_q, lq, start_k, lk))
                start_q, start_k = start_q + lq, start_k + lk
            decode = rows = None
            if decode_rows:
                index = torch.tensor(decode_index, dtype=torch.int64, device=q.device)
                rows = torch.tensor(decode_rows, dtype=torch.int64, device=q.device)
                lens = torch.tensor(decode_lens, dtype=torch.int32, device=q.device)
                decode = plan(lens, meta.block_tables.index_select(0, index))
            self._plan = StepPlan(prefills, rows, decode)
        self._plan_meta = meta
        return self._plan

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                     scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        """One query per row over its cached context, tile by tile: q [rows, Hq, D] -> [rows, Hq, D];
        a row with context length 0 outputs zeros. An fp8 cache's tile is dequantised as it is read."""
        num_heads, head_dim = q.shape[1:]
        num_blocks, num_kv_heads = k_cache.size(0), k_cache.size(2)
        group = num_heads // num_kv_heads
        k_scale, v_scale = kv_scales or (None, None)
        k_flat, v_flat = k_cache.view(num_blocks, -1), v_cache.view(num_blocks, -1)  # [num_blocks, block numel]
        need = max((t.block_ids.numel() for t in plan.tiles), default=0) * k_flat.size(1)
        if self._k_tile.numel() < need or self._k_tile.dtype != k_cache.dtype or self._k_tile.device != k_cache.device:
            self._k_tile, self._v_tile = (torch.empty(need, dtype=k_cache.dtype, device=k_cache.device)
                                          for _ in range(2))
        q_sorted = q.index_select(0, plan.order).view(-1, num_kv_heads, group, head_dim)
        out_sorted = torch.empty_like(q_sorted)  # [active, num_kv_heads, group, head_dim]
        by_matmul = self.decode_by_matmul and q.dtype == torch.float32 and num_kv_heads <= MATMUL_DECODE_MAX_KV_HEADS
        q_bd = block_diagonal_queries(q_sorted) if by_matmul else None
        for tile in plan.tiles:
            rows, n = tile.end - tile.start, tile.block_ids.numel()
            k = torch.index_select(k_flat, 0, tile.block_ids, out=self._k_tile[:n * k_flat.size(1)].view(n, -1))
            v = torch.index_select(v_flat, 0, tile.block_ids, out=self._v_tile[:n * v_flat.size(1)].view(n, -1))
            # [rows, num_tokens, num_kv_heads, head_dim]: strided views of the gathered blocks
            k, v = (x.view(rows, -1, num_kv_heads, head_dim)[:, :tile.num_tokens] for x in (k, v))
            k, v = read_cache(k, k_scale, q.dtype), read_cache(v, v_scale, q.dtype)
            if by_matmul:
                out_sorted[tile.start:tile.end] = attend_by_matmul(q_bd[tile.start:tile.end], k, v, tile.mask, scale)
                continue
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [rows, num_kv_heads, num_tokens, head_dim]
            # The group of query heads of a KV head is that head's "query length".
            out_sorted[tile.start:tile.end] = F.scaled_dot_product_attention(
                q_sorted[tile.start:tile.end], k, v, attn_mask=tile.mask, scale=scale)
        out = torch.empty_like(q) if plan.all_active else torch.zeros_like(q)
        return out.index_copy_(0, plan.order, out_sorted.view(-1, num_heads, head_dim))
