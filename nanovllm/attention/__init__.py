"""Attention backends behind one interface, and the choice among them, made once at start-up.

"auto" picks flash_attn on CUDA when it imports, otherwise torch. Asking for a backend that
cannot run here is an error that says why.
"""
import importlib.util
import logging

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.torch_backend import TorchBackend

logger = logging.getLogger("nanovllm")


def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend_name(requested: str, device: str, block_size: int) -> str:
    if requested == "auto":
        return "flash_attn" if device == "cuda" and _flash_attn_available() else "torch"
    if requested == "flash_attn":
        if device != "cuda":
            raise ValueError(f"attention_backend='flash_attn' needs a CUDA device; device is {device!r}")
        if not _flash_attn_available():
            raise ValueError("attention_backend='flash_attn' but flash_attn is not installed "
                             "(pip install flash-attn); use 'auto' or 'torch'")
    if requested in ("flash_attn", "triton"):
        raise ValueError(f"attention_backend={requested!r} is not built yet; allowed now: 'auto', 'torch'")
    return requested


def create_backend(requested: str, device: str, block_size: int) -> AttentionBackend:
    name = resolve_backend_name(requested, device, block_size)
    logger.info("attention backend: %s (requested %r, device %s)", name, requested, device)
    return {"torch": TorchBackend}[name]()
