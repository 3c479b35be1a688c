"""The safetensors loader: packed q/k/v and gate/up shards, tied embeddings, and a clear error
for a missing, unexpected or mis-shaped tensor."""
import glob
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm.config import Config
from nanovllm.models.qwen3 import MODELS
from nanovllm.utils.loader import load_model


def build_model(path: str) -> torch.nn.Module:
    config = Config(path, device="cpu")
    return MODELS[config.architecture](config.hf_config)


def rewrite_weights(src: str, dst, edit) -> str:
    """Copy a checkpoint and apply `edit` to its tensor dict."""
    shutil.copytree(src, dst)
    (file,) = glob.glob(os.path.join(dst, "*.safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("ckpt", ["qwen3_tiny", "qwen3_tiny_tied", "qwen2_tiny"])
def test_every_tensor_lands_in_the_right_place(ckpt, request):
    path = request.getfixturevalue(ckpt)
    model = build_model(path)
    load_model(model, path)
    (file,) = glob.glob(os.path.join(path, "*.safetensors"))
    tensors = load_file(file)
    attn = model.model.layers[0].self_attn
    qkv = attn.qkv_proj.weight
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size])
    prefix = "model.layers.0."
    assert torch.equal(q, tensors[prefix + "self_attn.q_proj.weight"])
    assert torch.equal(k, tensors[prefix + "self_attn.k_proj.weight"])
    assert torch.equal(v, tensors[prefix + "self_attn.v_proj.weight"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, tensors[prefix + "mlp.gate_proj.weight"])
    assert torch.equal(up, tensors[prefix + "mlp.up_proj.weight"])
    if ckpt == "qwen2_tiny":
        bias = attn.qkv_proj.bias
        assert torch.equal(bias[:attn.q_size], tensors[prefix + "self_attn.q_proj.bias"])
        assert not hasattr(attn, "q_norm")
    else:
        assert torch.equal(attn.q_norm.weight, tensors[prefix + "self_attn.q_norm.weight"])
    if ckpt == "qwen3_tiny_tied":
        assert "lm_head.weight" not in tensors
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_missing_tensor_is_named(qwen3_tiny, tmp_path):
    path = rewrite_weights(qwen3_tiny, tmp_path / "c", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.qkv_proj\.weight \(shard 'k'\)"):
        load_model(build_model(path), path)


def test_missing_plain_tensor_is_named(qwen3_tiny, tmp_path):
    path = rewrite_weights(qwen3_tiny, tmp_path / "c", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.norm\.weight"):
        load_model(build_model(path), path)


def test_unexpected_tensor_is_named(qwen3_tiny, tmp_path):
    path = rewrite_weights(qwen3_tiny, tmp_path / "c",
                           lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.extra\.weight"):
        load_model(build_model(path), path)


def test_misshaped_tensor_is_named(qwen3_tiny, tmp_path):
    def shrink(t):
        name = "model.layers.0.mlp.up_proj.weight"
        t[name] = t[name][:-1].contiguous()

    path = rewrite_weights(qwen3_tiny, tmp_path / "c", shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape"):
        load_model(build_model(path), path)
