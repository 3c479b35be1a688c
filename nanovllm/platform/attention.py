"""The choice of attention backend (attention/), made once at start-up, and the backend built
with the kernels it calls.

"auto" picks flash_attn on CUDA when it imports, else our Triton kernels on CUDA; on CPU the
in-place paged kernel ("cpu", platform/cpu/attention.py) when it builds here (a C++ compiler is
needed once per machine), else torch, with the reason logged.
An fp8 KV cache rules flash_attn out (flash-attn 2 reads 16-bit caches only): "auto" then picks
Triton, and asking for flash_attn is an error. Asking for a backend that cannot run here is an
error that says why. Backends and their kernels are imported lazily, so `import nanovllm` never
imports flash-attn or triton.
"""
import importlib.util
import logging
import os

import torch

from nanovllm.attention.base import AttentionBackend
from nanovllm.attention.flash_attn_backend import FLASH_ATTN_PAGE_MULTIPLE

logger = logging.getLogger("nanovllm")

# Triton converts to and from both fp8 formats in hardware from this compute capability (Ada, Hopper).
MIN_FP8_CAPABILITY = (8, 9)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(requested: str, device: str, block_size: int, kv_cache_dtype: str = "auto") -> str:
    """The backend to use, or a ValueError saying why the requested one cannot run here."""
    fp8_cache = kv_cache_dtype != "auto"
    if fp8_cache and device == "cuda" and requested in ("auto", "triton") and _installed("triton"):
        capability = torch.cuda.get_device_capability()
        if capability < MIN_FP8_CAPABILITY:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability >= "
                             f"{MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]} for the Triton kernels' fp8 "
                             f"conversions; this one is {capability[0]}.{capability[1]} (use kv_cache_dtype='auto')")
    if requested == "auto":
        if device != "cuda":
            # An fp8 cache reads through the torch backend's dequantising path either way.
            return "cpu" if device == "cpu" and not fp8_cache else "torch"
        if _installed("flash_attn") and block_size % FLASH_ATTN_PAGE_MULTIPLE == 0 and not fp8_cache:
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
        if fp8_cache:
            raise ValueError(f"attention_backend='flash_attn' cannot read an fp8 KV cache "
                             f"(kv_cache_dtype={kv_cache_dtype!r}); use attention_backend='triton' or 'auto', "
                             "or kv_cache_dtype='auto'")
    if requested == "cpu" and device != "cpu":
        raise ValueError(f"attention_backend='cpu' needs device 'cpu'; device is {device!r}")
    if requested == "triton":
        if not _installed("triton"):
            raise ValueError("attention_backend='triton' but triton is not installed (pip install triton)")
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' needs a CUDA device (device is {device!r}), "
                             "or TRITON_INTERPRET=1 to run the kernels on CPU (slowly, for tests)")
    return requested


def create_backend(requested: str, device: str, block_size: int, kv_cache_dtype: str = "auto") -> AttentionBackend:
    name = resolve_backend_name(requested, device, block_size, kv_cache_dtype)
    if name == "cpu":
        from nanovllm.kernels import cpu_build  # lazy: builds the library the first time
        kernel = cpu_build.load()
        if isinstance(kernel, str):  # why it could not be built
            if requested == "cpu":
                raise ValueError(f"attention_backend='cpu': {kernel}")
            logger.warning("%s; using the torch attention backend", kernel)
            name = "torch"
    logger.info("attention backend: %s (requested %r, device %s)", name, requested, device)
    if name == "cpu":
        from nanovllm.platform.cpu.attention import CpuPagedBackend
        return CpuPagedBackend(kernel)
    # Lazy below: importing triton is slow, and must not happen at `import nanovllm` (tests set
    # TRITON_INTERPRET=1 before it; CPU installs may lack triton altogether).
    if name == "flash_attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend
        from nanovllm.kernels.store_kv import store_kv
        return FlashAttnBackend(store_kv)
    if name == "triton":
        return triton_backend()
    from nanovllm.attention.torch_backend import TorchBackend
    # Decode tiles by two matmuls suit the CPU's float32 kernels (torch_backend.py attend_by_matmul).
    return TorchBackend(decode_by_matmul=device == "cpu")


def triton_backend():
    """The Triton attention backend with its kernels (on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
    from nanovllm.attention.triton_backend import TritonBackend
    from nanovllm.kernels import decode_attention, prefill_attention, store_kv
    return TritonBackend(store_kv.store_kv, prefill_attention.prefill_attention, decode_attention)
