"""The attention layer the model calls: prepares q and k (per-head norm, rotary embedding), stores
this step's K/V in the paged cache, then runs the backend's prefill or decode. The model runner
hands every layer its cache slice, the backend chosen at start-up and, for an fp8 cache, the
layer's K/V scales (or, while it calibrates them, an observer of K/V); the model code is the same
whatever the backend and cache dtype.

Preparing q and k here, not in the model, is what lets the platform (platform/ prepare_qk) do the
norm, the rotation and the cache store in one kernel where it has one (Triton's, quantising for an
fp8 cache; the CPU's, for an unquantised cache); the torch reference calls the model's own q_norm,
k_norm and rotary modules. What the platform did not store, the backend stores here.
"""
import torch
from torch import nn

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.kv_quant import KVRangeObserver, KVScales
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.platform.context import current_platform
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
        self.platform = current_platform()
        self.kv_scales: KVScales | None = None  # an fp8 cache's scales (set by the runner); None: unquantised
        self.kv_observer: KVRangeObserver | None = None  # set by the runner while it calibrates kv_scales

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                rotary: RotaryEmbedding | None = None, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]. With
        `rotary` (and `positions`), q and k are rotated first, after q_norm/k_norm when given
        (both or neither); a platform's kernel does that in place, in q and k, and stores K/V."""
        meta = get_context()
        cached = self.k_cache.numel() > 0  # warm-up runs before the cache exists
        stored = False  # whether the platform stored this step's K/V in the cache
        if rotary is not None:
            q, k, stored = self.platform.prepare_qk(self, q, k, v, positions, rotary, q_norm, k_norm, meta.slot_mapping)
        elif q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        if cached and not stored:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.kv_scales)
        if self.kv_observer is not None:  # calibration sees K as it is stored: normalised and rotated
            self.kv_observer.observe(k, v)
        if meta.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
        return self.backend.decode(q, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
