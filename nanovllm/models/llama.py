"""Llama (and Mistral-style configs without a sliding window): the decoder the Qwen families extend.

Pre-norm blocks of RMSNorm, grouped-query attention with rotary positions (plain, `linear` or
`llama3` scaled) and a SwiGLU MLP, with a tied or untied LM head and the optional biases the
config asks for (attention_bias on q/k/v/o, mlp_bias on the MLP). The blocks take their
variations as arguments, so Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm) and Qwen3-MoE (sparse
MLP) subclass this file rather than copy it. The model sees `input_ids, positions` and nothing
else; attention metadata reaches only the attention layer (and a platform's `fused_decode` of the
whole stack, which runs the attention layers' kernels itself: platform/cpu/decode.py).
"""
from typing import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_config_of, rotary_embedding_for
from nanovllm.models.base import CausalLM


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_even_head_dim(head_dim: int) -> None:
    if head_dim % 2:  # rotary turns each head's dimensions in pairs
        raise ValueError(f"head_dim={head_dim} is not allowed; rotary embedding needs an even "
                         "head_dim (head_dim, or hidden_size / num_attention_heads when it is not given)")


class LlamaAttention(nn.Module):

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool):
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb  # shared by every layer of the model
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # The attention layer applies q_norm/k_norm and rotary (one fused kernel where it can).
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        o = self.attn(q, k, v, positions, self.rotary_emb, q_norm, k_norm)  # [num_tokens, heads, head_dim]
        if keep_rows is not None:  # every token's K/V is stored above; only these rows go on
            o = o[keep_rows]
        return self.o_proj(o.flatten(1, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported; only 'silu' is")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):

    def __init__(self, config: PretrainedConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and residual stream, of the rows `keep_rows` only when given
        (LlamaModel.forward's last layer)."""
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, keep_rows)
        if keep_rows is not None:
            residual = residual[keep_rows]
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):

    def __init__(self, config: PretrainedConfig, layers: list[LlamaDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # A decode step through every layer and the final norm in one call, (positions, embeddings)
        # -> the norm's output, or None for a step it does not take; set by a platform that has one
        # for every layer's parts (platform/cpu/decode.py), after loading.
        self.fused_decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        if self.fused_decode is not None and keep_rows is None:
            out = self.fused_decode(positions, hidden_states)
            if out is not None:
                return out
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual, keep_rows if i == last else None)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False  # Qwen3 normalises q and k per head

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.adapt_config(config)
        rotary_emb = rotary_embedding_for(config, head_dim_of(config))
        layers = [LlamaDecoderLayer(config, self.make_attention(config, rotary_emb), self.make_mlp(config, i))
                  for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def check_raw_config(cls, raw: dict) -> None:
        super().check_raw_config(raw)
        if raw.get("head_dim") is not None:  # else transformers' default or hidden_size / heads, checked below
            check_even_head_dim(raw["head_dim"])

    @classmethod
    def adapt_config(cls, hf_config: PretrainedConfig) -> None:
        super().adapt_config(hf_config)
        check_even_head_dim(hf_config.head_dim)
        rope_config_of(hf_config)  # an unsupported rope type is refused here, before any work
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported; only 'silu' is")
        window = getattr(hf_config, "sliding_window", None)
        uses_window = getattr(hf_config, "use_sliding_window", True)  # Qwen configs switch their window on/off
        if uses_window and window is not None and window < hf_config.max_position_embeddings:
            raise ValueError(f"sliding_window={window} is not supported; every layer must use full attention "
                             f"(a window of at least max_position_embeddings={hf_config.max_position_embeddings})")

    def make_attention(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding) -> nn.Module:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaAttention(config, rotary_emb, qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm)

    def make_mlp(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, keep_rows)  # [num_tokens or len(keep_rows), hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)  # [num_rows, vocab] on rank 0

    def checkpoint_targets(self, weight_name: str, tensor: torch.Tensor) -> list:
        if weight_name.endswith("rotary_emb.inv_freq"):  # a buffer some older checkpoints saved; recomputed here
            return []
        return super().checkpoint_targets(weight_name, tensor)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's architecture is Llama's, with a sliding window that adapt_config refuses when set."""
