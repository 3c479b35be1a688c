"""SwiGLU's activation: silu(gate) * up on the merged gate_up projection (compiled on CUDA)."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
