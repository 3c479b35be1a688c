"""Loads a checkpoint's weights from *.safetensors only (a format that cannot carry code).

Checkpoint names map onto the model's parameters directly or, for fused layers, through the
model's `packed_modules_mapping` (q/k/v -> qkv_proj, gate/up -> gate_up_proj). A missing,
unexpected or mis-shaped tensor is an error naming it, and so is a file safetensors cannot
read (truncated or corrupt). Tied embeddings share one parameter, so a checkpoint may omit
lm_head.weight.
"""
import glob
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy checkpoint tensor `name` into `dst` (a parameter or this rank's slice of one), which
    must have its shape: every weight loader ends here."""
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}; expected {tuple(dst.shape)}")
    dst.copy_(src)


def _default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
    copy_checked(param.data, loaded, name)


def _resolve(weight_name: str, packed: dict) -> tuple[str, object]:
    """Checkpoint name -> (model parameter name, shard id or None)."""
    for fragment, (fused, shard_id) in packed.items():
        if fragment in weight_name:
            return weight_name.replace(fragment, fused), shard_id
    return weight_name, None


def _load_file(file: str, params: dict[str, nn.Parameter], packed: dict, loaded: set[tuple[int, object]]) -> None:
    """Load every tensor of one *.safetensors file into its parameter, noting each in `loaded`."""
    with safe_open(file, "pt", device="cpu") as f:
        for weight_name in f.keys():
            name, shard_id = _resolve(weight_name, packed)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {weight_name} has no matching model parameter")
            tensor = f.get_tensor(weight_name)
            if shard_id is None:
                getattr(param, "weight_loader", _default_weight_loader)(param, tensor, weight_name)
            else:
                param.weight_loader(param, tensor, weight_name, shard_id)
            loaded.add((id(param), shard_id))


def load_model(model: nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors files (other weight formats are not loaded)")
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights appear under both names
    packed = getattr(model, "packed_modules_mapping", {})
    loaded: set[tuple[int, object]] = set()  # (id of parameter, shard id)
    for file in files:
        try:
            _load_file(file, params, packed, loaded)
        except SafetensorError as error:  # the parser's message alone does not say which file
            raise ValueError(f"checkpoint file {file} cannot be read as safetensors ({error}); it may be "
                             "truncated or corrupt: copy or download it again") from None
    missing = []
    for name, param in params.items():
        shard_ids = [sid for fused, sid in packed.values() if f".{fused}." in name] or [None]
        missing += [name if sid is None else f"{name} (shard {sid!r})"
                    for sid in shard_ids if (id(param), sid) not in loaded]
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing tensor(s): {missing}")
