"""RMSNorm, optionally fused with the residual add that precedes it (as in nano-vllm), and
LayerNorm with a bias (GPT-2).

RMSNorm is the platform's (platform/): the torch functions of platform/torch.py, computed in
float32 and cast back exactly as HF transformers' Qwen RMSNorm does, are the oracle; Triton's or
the CPU's kernel computes the same in one pass over each row. LayerNorm is torch's, as HF's
nn.LayerNorm (GPT-2 only; no platform has a kernel for it).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.platform.context import current_platform


class RMSNorm(nn.Module):

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.platform = current_platform()

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.platform.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension; replicated on every rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
