"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 whose MLPs are sparse mixtures of experts.

A replicated router (`mlp.gate`) scores num_experts experts per token; the top num_experts_per_tok
run, weighted by their softmax probabilities (renormalised to sum to 1 when norm_topk_prob is
set) — see layers/fused_moe.py. Layers listed in mlp_only_layers, or not on the
decoder_sparse_step grid, keep a dense SwiGLU MLP of intermediate_size. Checkpoints hold one
tensor per expert and projection (`mlp.experts.<e>.gate_proj.weight`, ...); they are stacked
into one parameter per projection at load time. Attention is Qwen3's.
"""
import re

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.fused_moe import EXPERT_PROJECTIONS, ExpertShard, FusedMoE
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.config_checks import MAX_EXPERTS, MAX_INTERMEDIATE_SIZE, MAX_LAYERS, ConfigSpec, sizes_up_to
from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.loader import WeightTarget

# model.layers.<i>.mlp.experts.<e>.<gate_proj|up_proj|down_proj>.weight
EXPERT_TENSOR = re.compile(rf"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>{'|'.join(EXPERT_PROJECTIONS)})"
                           r"\.weight$")


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """HF transformers' rule: every decoder_sparse_step-th layer is sparse, except mlp_only_layers."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class Qwen3MoeSparseMoeBlock(nn.Module):

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # router logits: [num_tokens, num_experts]


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_spec = ConfigSpec(
        # num_experts 0 makes every layer dense
        sizes={**Qwen3ForCausalLM.config_spec.sizes, "num_experts": range(MAX_EXPERTS + 1),
               **sizes_up_to(num_experts_per_tok=MAX_EXPERTS, moe_intermediate_size=MAX_INTERMEDIATE_SIZE,
                             decoder_sparse_step=MAX_LAYERS)},
        optional_sizes=Qwen3ForCausalLM.config_spec.optional_sizes,
        epsilons=Qwen3ForCausalLM.config_spec.epsilons,
        heads=Qwen3ForCausalLM.config_spec.heads)

    @classmethod
    def adapt_config(cls, hf_config: PretrainedConfig) -> None:
        super().adapt_config(hf_config)
        top_k, num_experts = hf_config.num_experts_per_tok, hf_config.num_experts
        if num_experts > 0 and not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} is not allowed; num_experts_per_tok "
                             f"must be in 1..num_experts={num_experts}")

    @classmethod
    def tensor_parallel_sizes(cls, hf_config: PretrainedConfig) -> dict[str, int]:
        sizes = super().tensor_parallel_sizes(hf_config)
        if all(is_sparse_layer(hf_config, i) for i in range(hf_config.num_hidden_layers)):
            sizes.pop("intermediate_size", None)  # only dense MLPs use it
        if any(is_sparse_layer(hf_config, i) for i in range(hf_config.num_hidden_layers)):
            sizes["moe_intermediate_size"] = hf_config.moe_intermediate_size
        return sizes

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseMoeBlock(config)
        return super().make_mlp(config, layer_idx)

    def checkpoint_targets(self, weight_name: str, tensor: torch.Tensor) -> list[WeightTarget]:
        match = EXPERT_TENSOR.match(weight_name)
        if match is None:
            return super().checkpoint_targets(weight_name, tensor)
        stacked = "gate_up_proj" if match["proj"] != "down_proj" else "down_proj"
        shard = ExpertShard(int(match["expert"]), match["proj"])
        return [WeightTarget(f"{match['prefix']}.{stacked}", tensor, shard, weight_name)]
