"""The one interface every attention backend implements.

Shapes (flash-attn's conventions): q [num_tokens, num_heads, head_dim], k/v
[num_tokens, num_kv_heads, head_dim] (often strided views of the fused qkv output), and the
paged cache k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]. Causal masks are
bottom-right aligned: query i of a sequence with Lq new and Lk total tokens sees key j iff
j <= i + Lk - Lq, which is what makes a cached prefix (and a chunked prefill) work.
A quantised cache (fp8, Config.kv_cache_dtype) comes with the layer's `kv_scales`: store_kv
quantises with them and prefill/decode dequantise what they read from the cache, with the
arithmetic of attention/kv_quant.py; `kv_scales` is None for a cache in the model's dtype.
"""
from abc import ABC, abstractmethod

import torch

from nanovllm.attention.kv_quant import KVScales
from nanovllm.utils.context import AttentionMetadata


class AttentionBackend(ABC):
    name: str
    # Whether decode can be captured in a CUDA graph: fixed shapes, no host sync, no allocation.
    supports_cuda_graphs: bool = False
    # Whether its kernels compile at their first launch (Triton), so the start-up warm-up must launch them.
    compiles_kernels: bool = False
    # Whether it can read and write an fp8 KV cache (the `kv_scales` arguments below).
    supports_fp8_kv_cache: bool = False
    # Whether every prefill should read its keys from the paged cache (block tables always given),
    # even a prompt with no cached prefix: the backend's paged prefill is its fastest.
    prefill_from_cache: bool = False

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        """Write each new token's K/V to its cache slot; slot -1 means skip (a padding row)."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        """Varlen causal attention of the new tokens over each sequence's keys: the contiguous
        k/v when meta.block_tables is None (no cached prefix), else the cache via the block table."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        """One query token per sequence over its meta.context_lens cached keys (the new one
        included); a row with context length 0 outputs zeros."""

    def prepare_cuda_graphs(self, max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                            max_blocks: int, block_size: int, device: torch.device) -> None:
        """Called once before decode steps of up to `max_batch` sequences (this rank's heads,
        `max_blocks` blocks of `block_size` tokens each at most) are captured in CUDA graphs:
        a backend that keeps state across steps (scratch buffers) makes it here, so that capture
        never allocates. Nothing to do for a backend without such state."""

    def decode_warmup_shapes(self, max_batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                             device: torch.device) -> list[tuple[int, int]]:
        """(batch, block-table width) pairs at which eager decode steps (up to `max_batch` sequences,
        tables up to `max_blocks` wide) launch every kernel variant such steps can launch, for the
        start-up warm-up (runner/kernel_warmup.py). None for a backend whose launches do not change
        with those shapes."""
        return []
