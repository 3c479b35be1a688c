"""The reference platform: plain torch functions, the oracle every kernel is tested against.

RMSNorm is computed in float32 and cast back, exactly as HF transformers' Qwen RMSNorm does;
SwiGLU's silu(gate) * up as HF's; the MoE experts one matmul pair per expert that has tokens;
a linear layer is F.linear, computed in the weight's dtype (the CPU platform may hold
half-precision weights in float32) and returned in the activations'. These functions run
compiled where the compile mode says (utils/compile.py). q/k norm and rotary run the model's
own modules; the sampler is layers/sampler.py's torch pipeline, drawing by the exponential race.
It is what layers built outside a model runner use (platform/context.py), and the CUDA
platform without fused kernels; the other platforms override what they have kernels for.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention.base import AttentionBackend
from nanovllm.layers.sampler import Sampler, race_draw, race_from_logits
from nanovllm.platform.attention import create_backend
from nanovllm.platform.base import LinearMethod, Platform
from nanovllm.utils.compile import compilable


@compilable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@compilable
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual  # the new residual stream
    dtype = residual.dtype
    y = residual.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(dtype), residual


@compilable
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts in plain torch, one matmul pair per expert that has tokens (as HF transformers).
    x: [num_tokens, hidden]; w13: [num_experts, 2 * inter, hidden]; w2: [num_experts, hidden, inter];
    topk_weights, topk_ids: [num_tokens, top_k]. Returns [num_tokens, hidden] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()  # [num_pairs] the expert of each (token, slot) pair
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.size(0)).tolist()
    pair_weights = topk_weights.flatten()
    out = torch.empty(num_tokens * top_k, x.size(1), dtype=x.dtype, device=x.device)  # [num_pairs, hidden]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        gate, up = F.linear(x[pairs // top_k], w13[expert]).chunk(2, dim=-1)  # [count, inter] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [count, hidden]
        out[pairs] = (y * pair_weights[pairs, None]).to(x.dtype)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def linear_in_weight_dtype(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear computed in the weight's dtype and returned in x's (the two differ only where the
    CPU platform holds half-precision weights in float32)."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def qk_norm_args(q_norm: nn.Module | None, k_norm: nn.Module | None) -> dict:
    """The per-head norm's keyword arguments of the fused q/k kernels (none without a norm). The
    kernels rotate whole heads, as every model here does (rope_config_of refuses partial rotary)."""
    if q_norm is None:
        assert k_norm is None
        return {}
    assert q_norm.eps == k_norm.eps
    return dict(q_weight=q_norm.weight, k_weight=k_norm.weight, eps=float(q_norm.eps))


class UnquantizedLinearMethod(LinearMethod):
    """The weight as loaded, multiplied by F.linear."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear_in_weight_dtype(x, layer.weight, bias)


class TorchPlatform(Platform):
    name = "torch"

    def __init__(self, device: str = "cpu"):
        self.device = device  # where the attention backend runs ("cuda" or "cpu")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, weight, eps)
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def linear_method(self) -> LinearMethod:
        return UnquantizedLinearMethod()

    def lm_head_method(self) -> LinearMethod:
        return UnquantizedLinearMethod()

    def prepare_qk(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor, rotary: nn.Module, q_norm: nn.Module | None,
                   k_norm: nn.Module | None, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = rotary(positions, q, k)
        return q, k, False

    def fused_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      expert_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_torch(x, w13, w2, weights, expert_ids)

    def attention_backend(self, requested: str, block_size: int, kv_cache_dtype: str) -> AttentionBackend:
        return create_backend(requested, self.device, block_size, kv_cache_dtype)

    def prepare_model(self, model: nn.Module) -> str | None:
        return None

    def sampler(self, model: nn.Module) -> Sampler:
        return Sampler(race_from_logits)

    def draw(self, weights: torch.Tensor, t) -> torch.Tensor:
        return race_draw(weights, t)
