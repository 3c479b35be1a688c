"""Activations: SwiGLU's silu(gate) * up on the merged gate_up projection, and GELU in the
variants checkpoints name in config.json.

The torch functions are the oracle and the path without fused kernels (compiled where the compile
mode says); with fused kernels chosen by the model runner, SiluAndMul sends a 2-D input to one:
Triton's (kernels/silu_mul.py, `enable_triton`) or the CPU's (kernels/cpu_fused.cpp, `enable_cpu`),
which compute the same thing in one pass. GELU stays on torch
(GPT-2 only; its MLP is one GEMM, GELU, one GEMM, with nothing beside the activation to fuse).
"""
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compilable

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@compilable
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.fused_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def enable_triton(self) -> None:
        from nanovllm.kernels.silu_mul import silu_and_mul as kernel  # lazy: triton only when chosen
        self.fused_kernel = kernel

    def enable_cpu(self, kernels) -> None:
        self.fused_kernel = kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernel is not None and x.dim() == 2:
            return self.fused_kernel(x)
        return silu_and_mul(x)


@compilable
def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh approximation, written as HF's NewGELUActivation writes it: torch's own
    F.gelu(approximate="tanh") rounds differently, and the float32 oracle must match bit for bit."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


@compilable
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


@compilable
def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


# config.json's activation name -> the function HF transformers runs for it.
GELU_VARIANTS = {"gelu_new": gelu_new, "gelu_pytorch_tanh": gelu_tanh, "gelu": gelu_exact}


class GELU(nn.Module):

    def __init__(self, name: str):
        super().__init__()
        if name not in GELU_VARIANTS:
            raise ValueError(f"activation_function={name!r} is not supported; supported: {list(GELU_VARIANTS)}")
        self.fn = GELU_VARIANTS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
