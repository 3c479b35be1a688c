"""A sparse mixture-of-experts MLP: top-k routing and the experts' SwiGLU, with each expert's
weights stacked into one tensor per projection.

Owns the routing rule (softmax over the router's logits, top-k, optionally renormalised to sum
to 1, as HF transformers' Qwen3-MoE), the stacked expert parameters with their per-expert
weight loader; the experts' product is the platform's (platform/ fused_experts: on CUDA the
Triton grouped GEMM of kernels/fused_moe.py, elsewhere platform/torch.py's loop over the experts,
which is also the kernel's oracle).

Tensor parallelism splits every expert's intermediate dimension: each rank holds a slice of
every expert's gate/up rows and down columns, computes a partial sum of the layer's output, and
the ranks all-reduce it (the router is replicated, so every rank routes alike).
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from nanovllm.layers.linear import divide, shard
from nanovllm.platform.context import current_platform
from nanovllm.utils.loader import copy_checked
from nanovllm.utils.parallel import tp_rank, tp_size

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ExpertShard(NamedTuple):
    """One expert's projection: the piece of a stacked parameter one checkpoint tensor fills."""
    expert: int
    proj: str  # one of EXPERT_PROJECTIONS


class Routing(NamedTuple):
    weights: torch.Tensor  # [num_tokens, top_k], the router logits' dtype
    expert_ids: torch.Tensor  # [num_tokens, top_k] int64


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax in float32 over all experts, the top_k of them, their probabilities renormalised to
    sum to 1 when the config says so (norm_topk_prob), cast back to the logits' dtype."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [num_tokens, num_experts]
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(router_logits.dtype), expert_ids)


class FusedMoE(nn.Module):
    """The experts of one sparse MLP block; the router (a replicated linear layer) is the model's."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.platform = current_platform()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.inter_per_rank = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        # [num_experts, 2 * inter / tp, hidden]: this rank's gate rows, then its up rows, per expert
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.inter_per_rank, hidden_size))
        # [num_experts, hidden, inter / tp]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter_per_rank))
        for param, projections in ((self.gate_up_proj, ("gate_proj", "up_proj")), (self.down_proj, ("down_proj",))):
            param.weight_loader = self.weight_loader
            param.shard_ids = tuple(ExpertShard(e, p) for e in range(num_experts) for p in projections)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str,
                      shard_id: ExpertShard | None = None) -> None:
        if shard_id is None:
            raise ValueError(f"checkpoint tensor {name}: experts load one tensor per expert and projection "
                             f"(experts.<e>.{{{','.join(EXPERT_PROJECTIONS)}}}.weight), not stacked")
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {name} is for expert {expert}; the config has num_experts="
                             f"{self.num_experts}")
        size = self.inter_per_rank
        if proj == "down_proj":  # [hidden, inter]: this rank's columns
            copy_checked(param.data[expert], shard(loaded, 1, self.tp_rank, size, self.tp_size, name), name)
        else:  # [inter, hidden]: this rank's rows, into the gate or the up half
            offset = 0 if proj == "gate_proj" else size
            copy_checked(param.data[expert, offset:offset + size],
                         shard(loaded, 0, self.tp_rank, size, self.tp_size, name), name)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; router_logits: [num_tokens, num_experts]
        routing = route(router_logits, self.top_k, self.renormalize)
        out = self.platform.fused_experts(x, self.gate_up_proj, self.down_proj, routing.weights, routing.expert_ids)
        if self.tp_size > 1:
            dist.all_reduce(out)
        return out  # [num_tokens, hidden]
