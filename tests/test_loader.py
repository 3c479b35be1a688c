"""The safetensors loader: packed q/k/v and gate/up shards, tied embeddings, GPT-2's transposed
Conv1D weights and fused c_attn, Qwen3-MoE's per-expert tensors stacked, and for every family a
clear error naming a missing, unexpected or mis-shaped tensor."""
import glob
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm.config import Config
from nanovllm.models.registry import MODELS
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


# --------------------------------------------------------------------------------- other families

def test_gpt2_conv1d_weights_transposed_and_c_attn_cut_into_q_k_v(gpt2_tiny):
    model = build_model(gpt2_tiny)
    load_model(model, gpt2_tiny)
    (file,) = glob.glob(os.path.join(gpt2_tiny, "*.safetensors"))
    tensors = load_file(file)
    block, prefix = model.transformer.h[1], "transformer.h.1."
    c_attn = tensors[prefix + "attn.c_attn.weight"]  # Conv1D: [hidden, 3 * hidden]
    assert c_attn.shape == (80, 240)
    assert torch.equal(block.attn.c_attn.weight, c_attn.t())  # q | k | v rows, as nn.Linear holds them
    assert torch.equal(block.attn.c_attn.bias, tensors[prefix + "attn.c_attn.bias"])
    assert torch.equal(block.mlp.c_fc.weight, tensors[prefix + "mlp.c_fc.weight"].t())
    assert torch.equal(block.mlp.c_proj.weight, tensors[prefix + "mlp.c_proj.weight"].t())
    assert torch.equal(block.ln_2.bias, tensors[prefix + "ln_2.bias"])
    assert torch.equal(model.transformer.wpe.weight, tensors["transformer.wpe.weight"])
    assert "lm_head.weight" not in tensors and model.lm_head.weight is model.transformer.wte.weight


def test_gpt2_original_layout_loads_the_same(gpt2_tiny, tmp_path):
    """OpenAI's GPT-2 checkpoints name tensors without "transformer." and carry the causal mask
    buffers attn.bias / attn.masked_bias, which are not weights."""
    def original_layout(t):
        for name in list(t):
            t[name.removeprefix("transformer.")] = t.pop(name)
        t["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        t["h.0.attn.masked_bias"] = torch.tensor(-1e4)

    path = rewrite_weights(gpt2_tiny, tmp_path / "c", original_layout)
    expected, model = build_model(gpt2_tiny), build_model(path)
    load_model(expected, gpt2_tiny)
    load_model(model, path)
    for (name, a), (_, b) in zip(expected.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name


def test_moe_experts_stacked_per_projection(qwen3_moe_tiny):
    model = build_model(qwen3_moe_tiny)
    load_model(model, qwen3_moe_tiny)
    (file,) = glob.glob(os.path.join(qwen3_moe_tiny, "*.safetensors"))
    tensors = load_file(file)
    mlp, prefix = model.model.layers[1].mlp, "model.layers.1.mlp."
    assert torch.equal(mlp.gate.weight, tensors[prefix + "gate.weight"])
    for expert in range(8):
        gate, up = mlp.experts.gate_up_proj[expert].chunk(2)
        assert torch.equal(gate, tensors[f"{prefix}experts.{expert}.gate_proj.weight"])
        assert torch.equal(up, tensors[f"{prefix}experts.{expert}.up_proj.weight"])
        assert torch.equal(mlp.experts.down_proj[expert], tensors[f"{prefix}experts.{expert}.down_proj.weight"])


def drop(name: str):
    return lambda t: t.pop(name)


def shrink(name: str, dim: int):
    def edit(t):
        t[name] = t[name].narrow(dim, 0, t[name].size(dim) - 1).contiguous()
    return edit


@pytest.mark.parametrize("ckpt, edit, message", [
    ("gpt2_tiny", drop("transformer.h.1.attn.c_attn.bias"),
     r"missing.*transformer\.h\.1\.attn\.c_attn\.bias \(shard 'q'\).*\(shard 'v'\)"),
    ("gpt2_tiny", drop("transformer.ln_f.bias"), r"missing.*transformer\.ln_f\.bias"),
    ("gpt2_tiny", shrink("transformer.h.0.mlp.c_fc.weight", 1),
     r"transformer\.h\.0\.mlp\.c_fc\.weight \(Conv1D \[in, out\], transposed\) has shape \(319, 80\); "
     r"expected \(320, 80\)"),
    ("gpt2_tiny", shrink("transformer.h.0.attn.c_attn.weight", 1),
     r"transformer\.h\.0\.attn\.c_attn\.weight \(Conv1D.*has shape \(239, 80\); expected 240"),
    ("llama_tiny", drop("model.layers.1.mlp.down_proj.weight"), r"missing.*model\.layers\.1\.mlp\.down_proj\.weight"),
    ("llama_tiny", drop("model.layers.0.self_attn.v_proj.weight"),
     r"missing.*model\.layers\.0\.self_attn\.qkv_proj\.weight \(shard 'v'\)"),
    ("llama_tiny_tied", drop("model.layers.0.mlp.up_proj.bias"),
     r"missing.*model\.layers\.0\.mlp\.gate_up_proj\.bias \(shard 1\)"),
    ("llama_tiny", shrink("model.layers.0.self_attn.o_proj.weight", 0),
     r"model\.layers\.0\.self_attn\.o_proj\.weight has shape \(95, 96\); expected \(96, 96\)"),
    ("qwen3_moe_tiny", drop("model.layers.0.mlp.experts.5.up_proj.weight"),
     r"missing.*model\.layers\.0\.mlp\.experts\.gate_up_proj \(shard ExpertShard\(expert=5, proj='up_proj'\)\)"),
    ("qwen3_moe_tiny", drop("model.layers.1.mlp.gate.weight"), r"missing.*model\.layers\.1\.mlp\.gate\.weight"),
    ("qwen3_moe_tiny", shrink("model.layers.1.mlp.experts.3.down_proj.weight", 1),
     r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight has shape \(64, 31\); expected \(64, 32\)"),
])
def test_other_families_name_the_missing_or_misshaped_tensor(ckpt, edit, message, request, tmp_path):
    src = request.getfixturevalue(ckpt)
    path = rewrite_weights(src, tmp_path / "c", edit)
    with pytest.raises(ValueError, match=message):
        load_model(build_model(path), path)


def test_moe_expert_outside_the_config_is_named(qwen3_moe_tiny, tmp_path):
    def extra_expert(t):
        t["model.layers.0.mlp.experts.8.gate_proj.weight"] = t["model.layers.0.mlp.experts.7.gate_proj.weight"].clone()

    path = rewrite_weights(qwen3_moe_tiny, tmp_path / "c", extra_expert)
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj\.weight is for expert 8.*num_experts=8"):
        load_model(build_model(path), path)
