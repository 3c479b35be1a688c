"""The torch backend as it was before the tiled CPU decode (commit 87b6818): the reference the
new one is tested against (tests/test_torch_attention.py). Kept verbatim apart from names.

It gathers K/V through the block table and runs scaled_dot_product_attention with an explicit
bottom-right causal mask. Prefill loops over sequences on the host; decode is one batched call
over every context padded to the longest. It knows no fp8 cache (kv_scales must be None; the
fp8 tests compare with it on a dequantised copy of the cache).
"""
import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend
from nanovllm.utils.context import AttentionMetadata


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from the paged cache: [length, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    blocks = block_table[:(length + block_size - 1) // block_size].long()
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


class ReferenceTorchBackend(AttentionBackend):
    name = "torch-reference"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        assert kv_scales is None
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, kv_scales=None):
        assert kv_scales is None
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

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, kv_scales=None):
        assert kv_scales is None
        batch, block_size = q.size(0), k_cache.size(1)
        longest = int(meta.context_lens.max()) if batch else 0
        if longest == 0:
            return torch.zeros_like(q)
        # Gather exactly the first `longest` tokens of each row through its block table (not
        # whole blocks): slots [batch, longest]; padding (-1) entries are clamped, then masked.
        positions = torch.arange(longest, device=q.device)
        blocks = meta.block_tables.long().gather(1, (positions // block_size).expand(batch, -1))
        slots = (blocks * block_size + positions % block_size).clamp_min(0)
        k = k_cache.flatten(0, 1)[slots].transpose(1, 2)  # [batch, num_kv_heads, longest, head_dim]
        v = v_cache.flatten(0, 1)[slots].transpose(1, 2)
        mask = (positions.unsqueeze(0) < meta.context_lens.unsqueeze(1)).view(batch, 1, 1, -1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out = out.squeeze(2)  # [batch, num_heads, head_dim]
        return torch.where((meta.context_lens > 0).view(batch, 1, 1), out, 0.0)
