"""The up-front memory check: will this rank's model and the smallest KV cache the engine runs with
fit in the memory there is, before anything is allocated?

Owns the estimate (the model built on the meta device, which allocates nothing: every parameter
and buffer in the configured dtype, so no per-family formula can drift from the models; plus
one sequence of max_model_len in the KV cache, the least the runner accepts, or exactly
num_kvcache_blocks when given; plus a draft model's share, `MemoryReserve`) and the memory
available, as the device's platform measures it (platform/device.py: on CUDA gpu_memory_utilization
of the device less what is in use, as the KV cache is sized; on CPU MemAvailable, capped by a
cgroup v2 memory limit). A model that cannot fit is a ValueError saying what it needs and what
there is. The estimate is a lower bound (activations, CUDA graphs and allocator slack come on
top), so it refuses only what certainly cannot run; the runner's own sizing still has the last
word.
"""
import logging
from typing import NamedTuple

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.attention import Attention
from nanovllm.models.registry import MODELS
from nanovllm.platform.device import GIB, device_platform
from nanovllm.utils.math_utils import cdiv

logger = logging.getLogger("nanovllm")


class MemoryEstimate(NamedTuple):
    weight_bytes: int  # parameters and buffers (rotary tables) of this rank's model
    kv_bytes: int  # the smallest KV cache the engine runs with
    kv_blocks: int  # its blocks
    reserve_bytes: int  # what another model sharing the budget takes (a speculative draft)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.reserve_bytes


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one paged KV block: K and V of block_size tokens in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def model_on_meta(config: Config) -> nn.Module:
    """The model as this rank would build it, on the meta device: shapes and dtypes, no memory."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device("meta"):
            return MODELS[config.architecture](config.hf_config)
    finally:
        torch.set_default_dtype(default_dtype)


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each shared tensor (a tied LM head) once."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def estimate(config: Config, reserve_fixed: int = 0, reserve_per_block: int = 0) -> MemoryEstimate:
    model = model_on_meta(config)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    block_bytes = kv_block_bytes(len(layers), config.kvcache_block_size, layers[0].num_kv_heads, layers[0].head_dim,
                                 config.kv_cache_torch_dtype)
    n = config.num_kvcache_blocks
    blocks = n if n > 0 else cdiv(config.max_model_len, config.kvcache_block_size)
    return MemoryEstimate(model_bytes(model), blocks * block_bytes, blocks, reserve_fixed + blocks * reserve_per_block)


def check_fits(config: Config, device: torch.device, reserve_fixed: int = 0, reserve_per_block: int = 0) -> MemoryEstimate:
    """Refuse (ValueError, needed vs available) a model whose weights and smallest KV cache
    cannot fit on `device`; returns the estimate."""
    need = estimate(config, reserve_fixed, reserve_per_block)
    have = device_platform(device).available_memory(config.gpu_memory_utilization)
    if have is None:
        logger.debug("memory check skipped: no way to measure the available memory here")
        return need
    if need.total_bytes > have.bytes:
        kv = (f"{need.kv_blocks} KV blocks (num_kvcache_blocks)" if config.num_kvcache_blocks > 0 else
              f"a KV cache for one sequence of max_model_len={config.max_model_len}")
        draft = f" + a draft model {need.reserve_bytes / GIB:.2f} GiB" if need.reserve_bytes else ""
        raise ValueError(
            f"model={config.model!r} cannot fit: it needs at least {need.total_bytes / GIB:.2f} GiB (weights in "
            f"{str(config.dtype).removeprefix('torch.')} {need.weight_bytes / GIB:.2f} GiB + {kv} "
            f"{need.kv_bytes / GIB:.2f} GiB{draft}), but {max(have.bytes, 0) / GIB:.2f} GiB is available "
            f"({have.where}); use a smaller model or dtype, lower max_model_len, or free memory")
    return need
