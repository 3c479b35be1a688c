"""Attention backends behind one interface, and the choice among them, made once at start-up.

"auto" picks flash_attn on CUDA when it imports, else our Triton kernels on CUDA, else torch.
Asking for a backend that cannot run here is an error that says why. Backends are imported
lazily, so `import nanovllm` never imports flash-attn or triton.
"""
import importlib.util
import logging
import os

from nanovllm.attention.base import AttentionBackend

logger = logging.getLogger("nanovllm")

# flash-attn's paged KV cache takes pages whose size is a multiple of this.
FLASH_ATTN_PAGE_MULTIPLE = 256


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(requested: str, device: str, block_size: int) -> str:
    """The backend to use, or a ValueError saying why the requested one cannot run here."""
    if requested == "auto":
        if device != "cuda":
            return "torch"
        if _installed("flash_attn") and block_size % FLASH_ATTN_PAGE_MULTIPLE == 0:
            return "flash_attn"
        return "triton" if _installed("triton") else "torch"
    if requested == "flash_attn":
        if device != "cuda":
            raise ValueError(f"attention_backend='flash_attn' needs a CUDA device; device is {device!r}")
        if not _installed("flash_attn"):
            raise ValueError("attention_backend='flash_attn' but flash_attn is not installed "
                             "(pip install flash-attn, or use 'triton' or 'auto')")
        if block_size % FLASH_ATTN_PAGE_MULTIPLE:
            raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple of "
                             f"{FLASH_ATTN_PAGE_MULTIPLE}; it is {block_size}")
    if requested == "triton":
        if not _installed("triton"):
            raise ValueError("attention_backend='triton' but triton is not installed (pip install triton)")
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' needs a CUDA device (device is {device!r}), "
                             "or TRITON_INTERPRET=1 to run the kernels on CPU (slowly, for tests)")
    return requested


def create_backend(requested: str, device: str, block_size: int) -> AttentionBackend:
    name = resolve_backend_name(requested, device, block_size)
    logger.info("attention backend: %s (requested %r, device %s)", name, requested, device)
    if name == "flash_attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend()
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonBackend
        return TritonBackend()
    from nanovllm.attention.torch_backend import TorchBackend
    return TorchBackend()
