"""Plain-torch attention: the CPU path and the oracle the other backends are tested against.

It gathers K/V through the block table and runs scaled_dot_product_attention with an explicit
bottom-right causal mask. Prefill loops over sequences on the host, except that the rows of
one new token over a cached prefix (the decode rows of a mixed batch) go together through the
decode path; decode is one batched call (which reads the longest context length on the host:
this backend is not for CUDA graphs). With an fp8 cache it is the reference of the quantised
arithmetic (attention/kv_quant.py): store_kv quantises, and every read of the cache goes through
`read_cache`, which dequantises the rows read (K and V) to the query's dtype.
"""
import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.kv_quant import KVScales, quantize, read_cache
from nanovllm.utils.context import AttentionMetadata
from nanovllm.utils.math_utils import cdiv


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: [length, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    blocks = block_table[:cdiv(length, block_size)].long()
    return cache[blocks].flatten(0, 1)[:length]


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


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
    """One query per row over its first context_lens cached keys: q [batch, Hq, D] -> [batch, Hq, D];
    a row with context length 0 outputs zeros. kv_scales: the fp8 cache's, None for an unquantised one."""
    batch, block_size = q.size(0), k_cache.size(1)
    longest = int(context_lens.max()) if batch else 0
    if longest == 0:
        return torch.zeros_like(q)
    # Gather exactly the first `longest` tokens of each row through its block table (not
    # whole blocks): slots [batch, longest]; padding (-1) entries are clamped, then masked.
    positions = torch.arange(longest, device=q.device)
    blocks = block_tables.long().gather(1, (positions // block_size).expand(batch, -1))
    slots = (blocks * block_size + positions % block_size).clamp_min(0)
    k_scale, v_scale = kv_scales or (None, None)
    k = read_cache(k_cache.flatten(0, 1)[slots], k_scale, q.dtype).transpose(1, 2)  # [batch, Hkv, longest, D]
    v = read_cache(v_cache.flatten(0, 1)[slots], v_scale, q.dtype).transpose(1, 2)
    mask = (positions.unsqueeze(0) < context_lens.unsqueeze(1)).view(batch, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out = out.squeeze(2)  # [batch, num_heads, head_dim]
    return torch.where((context_lens > 0).view(batch, 1, 1), out, 0.0)


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_fp8_kv_cache = True

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        k, v = k[keep], v[keep]
        if kv_scales is not None:
            k, v = quantize(k, kv_scales.k, k_cache.dtype), quantize(v, kv_scales.v, v_cache.dtype)
            # index_copy_ has no fp8 kernel on CPU: copy the bytes (fp8 is one byte per element).
            k_cache, v_cache, k, v = (x.view(torch.uint8) for x in (k_cache, v_cache, k, v))
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        k_scale, v_scale = kv_scales or (None, None)
        paged = meta.block_tables is not None
        # Sequences with one new token over the cache (index, row, keys), batched below.
        single: list[tuple[int, int, int]] = []
        start_q = start_k = 0
        for i, (lq, lk) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
            if paged and lq == 1:
                single.append((i, start_q, lk))
            else:
                if not paged:
                    ki, vi = k[start_k:start_k + lk], v[start_k:start_k + lk]
                else:
                    ki = read_cache(gather_kv(k_cache, meta.block_tables[i], lk), k_scale, q.dtype)
                    vi = read_cache(gather_kv(v_cache, meta.block_tables[i], lk), v_scale, q.dtype)
                out[start_q:start_q + lq] = causal_attention(q[start_q:start_q + lq], ki, vi, scale)
            start_q, start_k = start_q + lq, start_k + lk
        if single:
            index, rows, lens = (torch.tensor(x, device=q.device) for x in zip(*single))
            out[rows] = paged_decode(q[rows], k_cache, v_cache, meta.block_tables[index], lens, scale, kv_scales)
        return out

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, kv_scales)
