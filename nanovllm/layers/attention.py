"""The attention layer the model calls: stores this step's K/V in the paged cache, then runs
the backend's prefill or decode. The model runner hands every layer its cache slice, the backend
chosen at start-up and, for an fp8 cache, the layer's K/V scales (or, while it calibrates them,
an observer of K/V); the model code is the same whatever the backend and cache dtype."""
import torch
from torch import nn

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.kv_quant import KVRangeObserver, KVScales
from nanovllm.utils.context import get_context


class Attention(nn.Module):

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend: AttentionBackend | None = None  # set by the model runner
        # [num_blocks, block_size, num_kv_heads, head_dim] each; empty until the cache exists
        self.k_cache = self.v_cache = torch.tensor([])
        self.kv_scales: KVScales | None = None  # an fp8 cache's scales (set by the runner); None: unquantised
        self.kv_observer: KVRangeObserver | None = None  # set by the runner while it calibrates kv_scales

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        meta = get_context()
        if self.kv_observer is not None:
            self.kv_observer.observe(k, v)
        if self.k_cache.numel():  # warm-up runs before the cache exists
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.kv_scales)
        if meta.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
        return self.backend.decode(q, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
