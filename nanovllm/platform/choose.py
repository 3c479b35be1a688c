"""The platform a model runner uses, chosen once at start-up from the config (device and
fused_kernels) and logged: on CUDA the Triton kernels or the torch functions; on the CPU its C++
kernels (falling back to torch's functions, with the reason logged, where the library cannot be
built here: Config.fused_kernels then says "torch"), torch's, or Triton's under TRITON_INTERPRET=1.
"""
import logging

from nanovllm.config import Config
from nanovllm.kernels import cpu_build
from nanovllm.platform.base import Platform
from nanovllm.platform.cpu import CpuPlatform, CpuTorchPlatform
from nanovllm.platform.torch import TorchPlatform
from nanovllm.utils.parallel import tp_rank

logger = logging.getLogger("nanovllm")


def choose_platform(config: Config) -> Platform:
    platform = _platform_for(config)
    if tp_rank() == 0:
        logger.info("platform: %s on %s (%s)", platform.name, config.device, type(platform).__name__)
    return platform


def _platform_for(config: Config) -> Platform:
    if config.fused_kernels == "triton":
        from nanovllm.platform.triton import InterpretedTritonPlatform, TritonPlatform  # lazy: imports triton
        return TritonPlatform("cuda") if config.device == "cuda" else InterpretedTritonPlatform(config.dtype)
    if config.device == "cuda":
        from nanovllm.platform.triton import CudaPlatform
        return CudaPlatform("cuda")
    if config.fused_kernels == "cpu":
        kernels = cpu_build.load_fused()
        if not isinstance(kernels, str):
            return CpuPlatform(kernels, config.dtype)
        if tp_rank() == 0:  # no compiler, or the build failed: the torch functions
            logger.warning("fused kernels: torch (%s)", kernels)
        config.fused_kernels = "torch"
    return CpuTorchPlatform(config.dtype)
