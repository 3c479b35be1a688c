"""RMSNorm, optionally fused with the residual add that precedes it (as in nano-vllm), and
LayerNorm with a bias (GPT-2).

RMSNorm is computed in float32 and cast back, exactly as HF transformers' Qwen RMSNorm does.
The torch functions are the oracle and the path without fused kernels (compiled where the compile
mode says); with fused kernels chosen by the model runner, 2-D inputs go to one: Triton's
(kernels/rms_norm.py, `enable_triton`) or the CPU's (kernels/cpu_fused.cpp, `enable_cpu`), which
compute the same thing in one pass over each row. LayerNorm is torch's, as HF's
nn.LayerNorm (GPT-2 only; it stays on torch with fused kernels on).
"""
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compilable


@compilable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@compilable
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual  # the new residual stream
    dtype = residual.dtype
    y = residual.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype), residual


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.fused_kernel: Callable | None = None  # (x, weight, eps, residual) -> (out, residual)

    def enable_triton(self) -> None:
        from nanovllm.kernels.rms_norm import rms_norm as kernel  # lazy: triton only when chosen
        self.fused_kernel = kernel

    def enable_cpu(self, kernels) -> None:
        self.fused_kernel = kernels.rms_norm

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused_kernel is not None and x.dim() == 2:
            out = self.fused_kernel(x, self.weight, self.eps, residual)
            return out.out if residual is None else (out.out, out.residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension; replicated on every rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
