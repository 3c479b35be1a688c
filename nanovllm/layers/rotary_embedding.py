"""Rotary position embedding (neox style: the two halves of each head rotate together).

cos/sin are tabulated once for every position up to max_position, with the same float32
arithmetic as HF transformers, so positions index the table instead of recomputing it. The
frequencies follow the checkpoint's rope type: plain, `linear` (positions divided by a factor)
or `llama3` (Llama 3.1's wavelength-dependent scaling); other types are refused by name. One
table serves every layer of a model (`rotary_embedding_for` is called once per model).
"""
import math
from typing import NamedTuple

import torch
from torch import nn

from nanovllm.utils.compile import compilable

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class RopeConfig(NamedTuple):
    theta: float
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    params: dict  # the checkpoint's scaling fields (factor, ...), empty for "default"


def rope_config_of(hf_config) -> RopeConfig:
    """The rope settings in either form: transformers 5 keeps them (rope_theta included) in
    `rope_parameters`; older configs have a top-level rope_theta and a `rope_scaling` dict, whose
    type key was once "type". Refuses what is not implemented here, naming the field."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported; only 1.0 (rotate every dimension) is")
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta")
    if theta is None:
        raise ValueError("the model config has no rope_theta (neither top-level nor in rope_parameters)")
    needed = {"default": (), "linear": ("factor",), "llama3": LLAMA3_FIELDS}[rope_type]
    missing = [name for name in needed if params.get(name) is None]
    if missing:
        raise ValueError(f"rope_type={rope_type!r} needs {list(needed)} in rope_parameters; missing {missing}")
    return RopeConfig(float(theta), rope_type, {name: params[name] for name in needed})


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim // 2] float32 rotation frequencies on the CPU, computed exactly as transformers'
    ROPE_INIT_FUNCTIONS at a model's construction (same operations in the same order, on the CPU,
    so the same bits)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
                                     / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.params["factor"]
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, **rope.params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: wavelengths shorter than original_len / high_freq_factor keep their frequency,
    those longer than original_len / low_freq_factor are slowed by `factor`, and the band between
    is interpolated smoothly."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


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

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig):
        super().__init__()
        # The table is computed on the CPU (as transformers computes its frequencies at a model's
        # construction), then moved to the device the model is built on. Even under the meta
        # device (the start-up memory estimate) no op runs there: meta runs these through Python
        # reference ops that import sympy and ~900 modules (+150 MB resident) for nothing.
        device = torch.get_default_device()
        inv_freq = inverse_frequencies(head_dim, rope)
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        # [max_position, 1, head_dim]: cos | sin; kept in float32 whatever the model dtype
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1)
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_qk(positions, q, k, self.cos_sin_cache)


def rotary_embedding_for(hf_config, head_dim: int) -> RotaryEmbedding:
    """The model's one rotary table, for all of its layers (the table is the same in each)."""
    return RotaryEmbedding(head_dim, hf_config.max_position_embeddings, rope_config_of(hf_config))
