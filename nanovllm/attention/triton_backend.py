"""Triton attention: the CUDA backend that needs no flash-attn (runs on CPU under TRITON_INTERPRET=1).

It adapts the AttentionBackend interface to the kernels in nanovllm/kernels, which the platform
hands it (platform/attention.py), and owns the one piece of state they need across steps: the
fp32 scratch for decode's split-KV partials. It does not choose tiles or splits (the kernel
modules do) and imports no kernel itself, so importing nanovllm works where triton is absent.
"""
import torch

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.kv_quant import KVScales
from nanovllm.utils.context import AttentionMetadata


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    compiles_kernels = True
    supports_fp8_kv_cache = True

    def __init__(self, store_kv, prefill_attention, decode_attention) -> None:
        """kernels/store_kv.py's store_kv, kernels/prefill_attention.py's prefill_attention and the
        kernels/decode_attention.py module (its kernel and its split rules)."""
        self._store_kv = store_kv
        self._prefill = prefill_attention
        self._decode_kernels = decode_attention
        self._scratch: torch.Tensor | None = None  # flat fp32, grown only when a step needs more
        # Buffers the scratch outgrew: a CUDA graph captured earlier may still write to one, so
        # they stay alive for the backend's lifetime rather than return to the allocator.
        self._retired_scratch: list[torch.Tensor] = []

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None) -> None:
        self._store_kv(k, v, k_cache, v_cache, slot_mapping, **_scale_args(kv_scales))

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if meta.block_tables is None:  # no cache yet (warm-up): keys are this step's k/v
            return self._prefill(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, scale)
        return self._prefill(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, scale,
                             block_tables=meta.block_tables, **_scale_args(kv_scales))

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        # Everything below reads shapes only, never tensor values: no host synchronisation, and
        # the same launch for the same shapes, so a CUDA graph can capture it.
        kernels = self._decode_kernels
        batch, num_heads, head_dim = q.shape
        num_splits = kernels.choose_num_splits(batch, k_cache.size(2), meta.block_tables.size(1),
                                               k_cache.size(1), kernels.num_sms(q.device))
        scratch = self._scratch_for(kernels.scratch_numel(batch, num_heads, head_dim, num_splits), q.device)
        return kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                        num_splits=num_splits, scratch=scratch, **_scale_args(kv_scales))

    def prepare_cuda_graphs(self, max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                            max_blocks: int, block_size: int, device: torch.device) -> None:
        """Allocate, before any CUDA graph capture, the scratch every batch size up to max_batch
        will need, so capture never allocates and no captured graph points at a retired buffer."""
        kernels = self._decode_kernels
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        sms = kernels.num_sms(device)
        need = max(kernels.scratch_numel(b, num_heads, head_dim,
                                         kernels.choose_num_splits(b, num_kv_heads, max_blocks, block_size, sms))
                   for b in range(1, max_batch + 1))
        self._scratch_for(need, device)

    def decode_warmup_shapes(self, max_batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                             device: torch.device) -> list[tuple[int, int]]:
        """One (batch, width) per number of splits an eager decode step can choose: each is its own
        compiled variant of the decode and reduce kernels."""
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        kernels = self._decode_kernels
        return list(kernels.split_shapes(max_batch, num_kv_heads, max_blocks, block_size,
                                         kernels.num_sms(device)).values())

    def _scratch_for(self, numel: int, device: torch.device) -> torch.Tensor | None:
        if numel == 0:
            return None
        if self._scratch is None or self._scratch.numel() < numel or self._scratch.device != device:
            if self._scratch is not None:
                self._retired_scratch.append(self._scratch)
            self._scratch = torch.empty(numel, dtype=torch.float32, device=device)
        return self._scratch


def _scale_args(kv_scales: KVScales | None) -> dict[str, torch.Tensor]:
    """The kernels' k_scale/v_scale keyword arguments: none for a cache in the model's dtype."""
    return {} if kv_scales is None else {"k_scale": kv_scales.k, "v_scale": kv_scales.v}
