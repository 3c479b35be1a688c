"""flash-attn: nano-vllm's path, used on CUDA when the optional flash-attn package is installed.

Prefill is `flash_attn_varlen_func` (over the paged cache through the block table when a prefix
is cached), decode is `flash_attn_with_kvcache`. flash-attn's paged KV needs blocks of a
multiple of 256 tokens (checked when the backend is chosen). K/V are stored with our Triton
store_kv kernel, as in nano-vllm. flash-attn 2 reads only a 16-bit cache, so an fp8 KV cache
(Config.kv_cache_dtype) never gets this backend (platform/attention.py refuses or avoids it).
"""
import torch

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.kv_quant import KVScales
from nanovllm.utils.context import AttentionMetadata

# flash-attn's paged KV cache takes pages whose size is a multiple of this.
FLASH_ATTN_PAGE_MULTIPLE = 256


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True

    def __init__(self, store_kv) -> None:
        """`store_kv`: kernels/store_kv.py's, given by the platform (platform/attention.py)."""
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._store_kv = store_kv

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        assert kv_scales is None, "flash_attn is never chosen for an fp8 KV cache"
        self._store_kv(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if meta.block_tables is not None:  # a cached prefix: every key comes from the paged cache
            k, v = k_cache, v_cache
        return self._varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
                            causal=True, block_table=meta.block_tables)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        # Eager steps pass the table cut to the batch's width (a strided view); a graph's is whole.
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                 block_table=meta.block_tables.contiguous(), softmax_scale=scale, causal=True)
        return out.squeeze(1)  # [batch, num_heads, head_dim]
