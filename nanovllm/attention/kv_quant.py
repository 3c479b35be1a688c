"""FP8 KV cache arithmetic: the torch reference every backend's quantised cache matches.

A quantised cache stores each K (and V) element as `clamp(x / scale, -fp8_max, fp8_max)` cast to
fp8 (round to nearest even), with one float32 scale per (layer, KV head) for K and one for V,
fixed at start-up; reading it back is `(stored as float32) * scale`, cast to the model's dtype.
The Triton kernels do exactly this in registers (kernels/kv_quant.py); the torch backend calls
the functions here. This module also owns the scales' type and how a scale is made from an
observed max |x| (calibration). It does not know where scales come from (runner/kv_scales.py).
"""
from typing import NamedTuple

import torch

# Config.kv_cache_dtype's quantised choices ("auto" is the model's dtype, no quantisation).
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Calibration leaves this factor of the fp8 range above the largest |K| (|V|) it saw, so longer
# or different prompts rarely saturate. It costs nothing in precision (fp8 spacing is relative)
# until values fall below fp8's smallest normal, max/28,672 of the range for e4m3.
CALIBRATION_HEADROOM = 2.0


class KVScales(NamedTuple):
    """One layer's dequantisation scales: K = stored K * k[head], V = stored V * v[head]."""
    k: torch.Tensor  # [num_kv_heads] float32, on the cache's device
    v: torch.Tensor  # [num_kv_heads] float32


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3, 57,344 for e5m2): quantised values
    are clamped to it, since e4m3 has no infinity (an overflow would become NaN)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] in the model's dtype -> the same shape in fp8 `dtype`."""
    limit = fp8_max(dtype)
    return (x.float() / scale[:, None]).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] in fp8 -> the same shape in `dtype` (the model's)."""
    return (x.float() * scale[:, None]).to(dtype)


def read_cache(cache_rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as read from the cache: dequantised when the cache is quantised (scale given)."""
    return cache_rows if scale is None else dequantize(cache_rows, scale, dtype)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-head scales from calibration's max |x| per head: CALIBRATION_HEADROOM * amax spans
    fp8's range. A head that was all zeros gets scale 1 (any scale stores zeros exactly)."""
    scale = amax.float() * CALIBRATION_HEADROOM / fp8_max(dtype)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


class KVRangeObserver:
    """Running max |K| and |V| per KV head of one attention layer, over calibration forwards."""

    def __init__(self, num_kv_heads: int, device: torch.device):
        self.k_amax = torch.zeros(num_kv_heads, dtype=torch.float32, device=device)
        self.v_amax = torch.zeros(num_kv_heads, dtype=torch.float32, device=device)

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [num_tokens, num_kv_heads, head_dim], as they would be stored
        if k.size(0):
            self.k_amax = torch.maximum(self.k_amax, k.detach().abs().amax(dim=(0, 2)).float())
            self.v_amax = torch.maximum(self.v_amax, v.detach().abs().amax(dim=(0, 2)).float())

    def scales(self, dtype: torch.dtype) -> KVScales:
        return KVScales(scale_from_amax(self.k_amax, dtype), scale_from_amax(self.v_amax, dtype))
