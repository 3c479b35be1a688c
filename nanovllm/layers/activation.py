"""SwiGLU's activation: silu(gate) * up on the merged gate_up projection.

The torch function is the CPU path and the oracle (compiled where the compile mode says); with
Triton kernels chosen (`enable_triton`, by the model runner) a 2-D input goes to
kernels/silu_mul.py instead, which computes the same thing in one pass.
"""
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compilable


@compilable
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.triton_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def enable_triton(self) -> None:
        from nanovllm.kernels.silu_mul import silu_and_mul as kernel  # lazy: triton only when chosen
        self.triton_kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_kernel is not None and x.dim() == 2:
            return self.triton_kernel(x)
        return silu_and_mul(x)
