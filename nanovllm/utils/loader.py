"""Loads a checkpoint's weights from *.safetensors only (a format that cannot carry code).

Each checkpoint tensor becomes one or more `WeightTarget`s: a model parameter, the tensor (or the
part of it) to copy there, and which piece of a fused parameter it is. By default names map onto
parameters directly or, for fused layers, through the model's `packed_modules_mapping` (q/k/v ->
qkv_proj, gate/up -> gate_up_proj); a model whose checkpoint is laid out differently (GPT-2's
transposed Conv1D weights and fused c_attn, Qwen3-MoE's per-expert tensors) maps its own names
in `checkpoint_targets`. A missing, unexpected or mis-shaped tensor is an error naming it; a fused
parameter lists the pieces it expects in `param.shard_ids`, so a missing piece is named too.
A file safetensors cannot read (truncated or corrupt) is an error naming it. Tied embeddings
share one parameter, so a checkpoint may omit lm_head.weight. KV-cache scales (vLLM's names,
`<attention module>.k_scale` / `.v_scale`, as fp8 checkpoints carry them) are not parameters:
they are returned for the model runner (runner/kv_scales.py), which uses them for an fp8 cache.
"""
import glob
import os
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


# Checkpoint tensors with these name endings are KV-cache scales, not weights.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


class WeightTarget(NamedTuple):
    param: str  # the model parameter's name
    tensor: torch.Tensor  # what to copy into it (this rank's shard is cut by its weight_loader)
    shard_id: object  # which piece of a fused parameter, or None for the whole parameter
    source: str  # the checkpoint tensor, as error messages name it


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor `name` into `dst` (a parameter or this rank's slice of one), which
    must have its shape: every weight loader ends here."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}; expected {tuple(dst.shape)}")
    dst.copy_(src)


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    copy_checked(param.data, loaded, name)


def packed_target(weight_name: str, tensor: torch.Tensor, packed: dict) -> WeightTarget:
    """A checkpoint tensor whose name is the parameter's, or a piece of a fused parameter."""
    for fragment, (fused, shard_id) in packed.items():
        if fragment in weight_name:
            return WeightTarget(weight_name.replace(fragment, fused), tensor, shard_id, weight_name)
    return WeightTarget(weight_name, tensor, None, weight_name)


def _load_file(file: str, params: dict[str, nn.Parameter], packed: dict, custom, loaded: set[tuple[int, object]],
               kv_scales: dict[str, torch.Tensor]) -> None:
    """Load every tensor of one *.safetensors file into its parameters, noting each in `loaded`;
    KV-cache scales go to `kv_scales` instead, by name."""
    with safe_open(file, "pt", device="cpu") as f:
        for weight_name in f.keys():
            tensor = f.get_tensor(weight_name)
            if weight_name.endswith(KV_SCALE_SUFFIXES):
                kv_scales[weight_name] = tensor
                continue
            targets = custom(weight_name, tensor) if custom else [packed_target(weight_name, tensor, packed)]
            for target in targets:
                param = params.get(target.param)
                if param is None:
                    raise ValueError(f"checkpoint tensor {target.source} has no matching model parameter")
                if target.shard_id is None:
                    getattr(param, "weight_loader", _default_weight_loader)(param, target.tensor, target.source)
                else:
                    param.weight_loader(param, target.tensor, target.source, target.shard_id)
                loaded.add((id(param), target.shard_id))


def load_model(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Load the checkpoint's weights into `model`; returns its KV-cache scale tensors by name
    (empty for most checkpoints)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors files (other weight formats are not loaded)")
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights appear under both names
    packed = getattr(model, "packed_modules_mapping", {})
    custom = getattr(model, "checkpoint_targets", None)
    loaded: set[tuple[int, object]] = set()  # (id of parameter, shard id)
    kv_scales: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            _load_file(file, params, packed, custom, loaded, kv_scales)
        except SafetensorError as error:  # the parser's message alone does not say which file
            raise ValueError(f"checkpoint file {file} cannot be read as safetensors ({error}); it may be "
                             "truncated or corrupt: copy or download it again") from None
    missing = []
    for name, param in params.items():
        shard_ids = getattr(param, "shard_ids", None) or [None]
        missing += [name if sid is None else f"{name} (shard {sid!r})"
                    for sid in shard_ids if (id(param), sid) not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensor(s): {missing}")
    return kv_scales
