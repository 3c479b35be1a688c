"""Activations: SwiGLU's silu(gate) * up on the merged gate_up projection, and GELU in the
variants checkpoints name in config.json.

SiluAndMul is the platform's (platform/: the torch function of platform/torch.py is the oracle,
Triton's or the CPU's kernel computes the same in one pass). GELU stays on torch, compiled where
the compile mode says (GPT-2 only; its MLP is one GEMM, GELU, one GEMM, with nothing beside the
activation to fuse).
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.platform.context import current_platform
from nanovllm.utils.compile import compilable

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class SiluAndMul(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.platform = current_platform()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        return self.platform.silu_and_mul(x)


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
