"""The attention layer the model calls: prepares q and k (per-head norm, rotary embedding), stores
this step's K/V in the paged cache, then runs the backend's prefill or decode. The model runner
hands every layer its cache slice, the backend chosen at start-up and, for an fp8 cache, the
layer's K/V scales (or, while it calibrates them, an observer of K/V); the model code is the same
whatever the backend and cache dtype.

Preparing q and k here, not in the model, is what lets one Triton kernel (kernels/qk_norm_rope.py,
chosen by `enable_triton`) do the norm, the rotation and the cache store (quantised for an fp8
cache) in one pass, and the CPU's (kernels/cpu_fused.cpp, `enable_cpu`) the same for an unquantised
cache (an fp8 one is stored by the backend); the torch path (the oracle) calls the model's own q_norm,
k_norm and rotary modules.
"""
from typing import Callable

import torch
from torch import nn

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.kv_quant import KVRangeObserver, KVScales
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
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
        self.fused_qk_kernel: Callable | None = None  # norm + rotary + store, in place; set by enable_triton
        self.qk_kernel: Callable | None = None  # norm + rotary, in place; set by enable_cpu
        self.kv_scales: KVScales | None = None  # an fp8 cache's scales (set by the runner); None: unquantised
        self.kv_observer: KVRangeObserver | None = None  # set by the runner while it calibrates kv_scales

    def enable_triton(self) -> None:
        from nanovllm.kernels.qk_norm_rope import qk_norm_rope_store  # lazy: triton only when chosen
        self.fused_qk_kernel = qk_norm_rope_store

    def enable_cpu(self, kernels) -> None:
        self.qk_kernel = kernels.qk_norm_rope

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                rotary: RotaryEmbedding | None = None, q_norm: RMSNorm | None = None,
                k_norm: RMSNorm | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]. With
        `rotary` (and `positions`), q and k are rotated first, after q_norm/k_norm when given
        (both or neither); the fused kernels do that in place, in q and k, and store K/V."""
        meta = get_context()
        cached = self.k_cache.numel() > 0  # warm-up runs before the cache exists
        # The kernels rotate whole heads, as every model here does (rope_config_of refuses partial rotary).
        norm = {} if q_norm is None else dict(q_weight=q_norm.weight, k_weight=k_norm.weight, eps=float(q_norm.eps))
        stored = False  # whether a kernel stored this step's K/V in the cache
        if rotary is not None and self.fused_qk_kernel is not None:
            assert (q_norm is None) == (k_norm is None) and (q_norm is None or q_norm.eps == k_norm.eps)
            cache = dict(k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=meta.slot_mapping) if cached else {}
            if cached and self.kv_scales is not None:
                cache.update(k_scale=self.kv_scales.k, v_scale=self.kv_scales.v)
            self.fused_qk_kernel(q, k, v, positions, rotary.cos_sin_cache, **norm, **cache)
            stored = cached
        elif rotary is not None and self.qk_kernel is not None:
            # The CPU kernel stores K/V too, unless they are quantised (the backend's store does that).
            stored = cached and self.kv_scales is None
            cache = dict(v=v, k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=meta.slot_mapping) if stored else {}
            self.qk_kernel(q, k, positions, rotary.cos_sin_cache, **norm, **cache)
        else:
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            if rotary is not None:
                q, k = rotary(positions, q, k)
        if cached and not stored:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.kv_scales)
        if self.kv_observer is not None:  # calibration sees K as it is stored: normalised and rotated
            self.kv_observer.observe(k, v)
        if meta.is_prefill:
            return self.backend.prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
        return self.backend.decode(q, self.k_cache, self.v_cache, meta, self.scale, self.kv_scales)
