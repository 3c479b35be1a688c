"""Rotary position embedding (neox style: the two halves of each head rotate together).

cos/sin are tabulated once for every position up to max_position, with the same float32
arithmetic as HF transformers, so positions index the table instead of recomputing it.
"""
import torch
from torch import nn

from nanovllm.utils.compile import compilable


def rope_theta_of(hf_config) -> float:
    """transformers 5 moved rope_theta into rope_parameters; read either form."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported; only 'default' rotary embedding is")
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta")
    if theta is None:
        raise ValueError("the model config has no rope_theta (neither top-level nor in rope_parameters)")
    return float(theta)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim // 2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@compilable
def rotate_qk(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class RotaryEmbedding(nn.Module):

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        # [max_position, 1, head_dim]: cos | sin; kept in float32 whatever the model dtype
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_qk(positions, q, k, self.cos_sin_cache)
