"""The oracle of the attention tests, written from the definition of attention and nothing else.

For each query head h of a sequence: scores = q_h · k_g(h)ᵀ × scale over the keys it may see,
weights = exp(scores - max) / Σ exp(scores - max), output = weights · v_g(h), where g(h) is the KV
head of h's group (GQA). The i-th of Lq new queries of a sequence of Lk tokens sits at position
Lk - Lq + i and sees keys 0..Lk - Lq + i (bottom-right causal). Token t of a sequence lives in
block block_table[t // block_size] at offset t % block_size.

It is deliberately naive: scores, masks and softmax are materialised in float64, one head and
one sequence at a time, and K/V are read token by token through the block table. It shares no
code with the backends (no SDPA, no tiling, no gather helpers), so a mistake in their approach
cannot pass by being made here too. It knows no fp8 cache (kv_scales must be None; the fp8 tests
compare with it on a dequantised copy of the cache).
"""
import torch

from nanovllm.attention.base import AttentionBackend
from nanovllm.utils.context import AttentionMetadata


def read_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens 0..length-1 of one sequence, each read from its block and offset: [length, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    table = block_table.tolist()
    slots = [table[t // block_size] * block_size + t % block_size for t in range(length)]
    return cache.flatten(0, 1)[torch.tensor(slots, dtype=torch.long, device=cache.device)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] -> [Lq, Hq, D] in float64, bottom-right causal; no keys: zeros."""
    lq, num_heads, head_dim = q.shape
    lk, num_kv_heads = k.shape[:2]
    out = torch.zeros(lq, num_heads, head_dim, dtype=torch.float64, device=q.device)
    if lq == 0 or lk == 0:
        return out
    query_pos = torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq)  # [Lq, 1]
    visible = torch.arange(lk, device=q.device).unsqueeze(0) <= query_pos  # [Lq, Lk]
    group = num_heads // num_kv_heads
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()  # [Lk, D]
        scores = (q[:, h].double() @ kh.T) * scale  # [Lq, Lk]
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = (scores - scores.max(dim=1, keepdim=True).values).exp()
        weights = weights / weights.sum(dim=1, keepdim=True)
        out[:, h] = weights @ vh
    return out


class ReferenceTorchBackend(AttentionBackend):
    name = "torch-reference"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        assert kv_scales is None
        block_size = k_cache.size(1)
        for i, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:  # -1: a padding token with no slot
                k_cache[slot // block_size, slot % block_size] = k[i]
                v_cache[slot // block_size, slot % block_size] = v[i]

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, kv_scales=None):
        assert kv_scales is None
        out = torch.empty_like(q)
        start_q = start_k = 0
        for i, (lq, lk) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
            if meta.block_tables is None:  # no cached prefix: the new tokens are the whole sequence
                ki, vi = k[start_k:start_k + lk], v[start_k:start_k + lk]
            else:
                ki = read_sequence(k_cache, meta.block_tables[i], lk)
                vi = read_sequence(v_cache, meta.block_tables[i], lk)
            out[start_q:start_q + lq] = attention(q[start_q:start_q + lq], ki, vi, scale).to(q.dtype)
            start_q, start_k = start_q + lq, start_k + lk
        return out

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, kv_scales=None):
        assert kv_scales is None
        out = torch.empty_like(q)
        for b, length in enumerate(meta.context_lens.tolist()):
            ki = read_sequence(k_cache, meta.block_tables[b], length)
            vi = read_sequence(v_cache, meta.block_tables[b], length)
            out[b] = attention(q[b:b + 1], ki, vi, scale)[0].to(q.dtype)
        return out
