"""Where an fp8 KV cache's scales come from: the checkpoint, else calibration on the warm-up.

1. From the checkpoint (utils/loader.py hands over its `*.k_scale` / `*.v_scale` tensors): vLLM's
   names, `<prefix>.k_scale` and `<prefix>.v_scale`, where <prefix> is an attention layer's
   module name or its parent's (`model.layers.3.self_attn.k_scale`, as fp8 checkpoints carry
   them). Each is a scalar (one scale for every head, vLLM's per-tensor scales) or one value per
   KV head of the whole model (each tensor-parallel rank takes its own heads). Every attention
   layer needs both, or the checkpoint is refused.
2. Otherwise calibrated: during the runner's warm-up forward (before the cache exists) every
   attention layer's KVRangeObserver records max |K| and |V| per KV head, and the scale is
   CALIBRATION_HEADROOM * max / fp8_max (attention/kv_quant.py). The warm-up's tokens are drawn
   with a fixed seed, so the same checkpoint and settings always give the same scales.
Either way the scales are fixed for the engine's life: float32 device tensors the CUDA graphs
read by address. It knows the attention layers and nothing of steps or scheduling.
"""
import random
from contextlib import contextmanager
from typing import Iterator

import torch

from nanovllm.attention.kv_quant import KVRangeObserver, KVScales
from nanovllm.layers.attention import Attention

# The warm-up prompt's token ids are drawn with this seed (calibration must be reproducible).
CALIBRATION_SEED = 0


def calibration_token_ids(vocab_size: int, length: int) -> list[int]:
    """The warm-up's prompt: varied tokens (a prompt of one repeated token would show calibration
    little of K's range), the same on every run and every tensor-parallel rank."""
    rng = random.Random(CALIBRATION_SEED)
    return [rng.randrange(vocab_size) for _ in range(length)]


def checkpoint_kv_scales(tensors: dict[str, torch.Tensor], layers: dict[str, Attention], rank: int,
                         world_size: int, device: torch.device) -> list[KVScales] | None:
    """Each layer's scales (in the order of `layers`, keyed by module name) from the checkpoint's
    scale tensors; None when it has none. A ValueError names a missing, unused or bad tensor."""
    if not tensors:
        return None
    scales, used = [], set()
    for name, layer in layers.items():
        parent = name.rpartition(".")[0]
        pair = []
        for kind in ("k_scale", "v_scale"):
            found = [f"{prefix}.{kind}" for prefix in (parent, name) if f"{prefix}.{kind}" in tensors]
            if not found:
                raise ValueError(f"the checkpoint has KV-cache scales but no {parent}.{kind} (or {name}.{kind}) "
                                 f"for attention layer {name}; every layer needs k_scale and v_scale")
            used.add(found[0])
            pair.append(_rank_heads(tensors[found[0]], found[0], layer.num_kv_heads, rank, world_size, device))
        scales.append(KVScales(*pair))
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(f"checkpoint KV-cache scale tensor(s) {unused} match no attention layer")
    return scales


def _rank_heads(tensor: torch.Tensor, name: str, num_kv_heads: int, rank: int, world_size: int,
                device: torch.device) -> torch.Tensor:
    """This rank's [num_kv_heads] float32 scales from a scalar or a per-KV-head checkpoint tensor."""
    values = tensor.float().flatten()
    if values.numel() == 1:
        values = values.expand(num_kv_heads)
    elif values.numel() == num_kv_heads * world_size:
        values = values[rank * num_kv_heads:(rank + 1) * num_kv_heads]
    else:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; a KV-cache scale must be "
                         f"a scalar or have one value per KV head ({num_kv_heads * world_size})")
    if not (torch.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"checkpoint tensor {name} holds {values.tolist()}; KV-cache scales must be finite and > 0")
    return values.contiguous().to(device)


@contextmanager
def observing_kv(layers: list[Attention], device: torch.device) -> Iterator[list[KVRangeObserver]]:
    """Every layer records its K/V ranges while inside (the calibration forward), then stops."""
    observers = [KVRangeObserver(layer.num_kv_heads, device) for layer in layers]
    for layer, observer in zip(layers, observers):
        layer.kv_observer = observer
    try:
        yield observers
    finally:
        for layer in layers:
            layer.kv_observer = None


def describe(scales: list[KVScales]) -> str:
    """The scales' range over layers and heads, for the start-up log."""
    k = torch.cat([s.k for s in scales])
    v = torch.cat([s.v for s in scales])
    return f"K {k.min().item():.3g}..{k.max().item():.3g}, V {v.min().item():.3g}..{v.max().item():.3g}"
