"""Qwen3 and Qwen2 decoder-only models, built from `layers/`.

The two differ only in the attention block: Qwen3 normalises q and k per head (q_norm,
k_norm) and has no qkv bias; Qwen2 has a qkv bias and no q/k norm. The model sees
`input_ids, positions` and nothing else; attention metadata reaches only the attention layer.
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_theta_of


class Qwen3Attention(nn.Module):

    def __init__(self, config: PretrainedConfig, qk_norm: bool, qkv_bias: bool):
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # per rank
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_theta_of(config))
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, self.num_kv_heads)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # The attention layer applies q_norm/k_norm and rotary (one fused kernel where it can).
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        o = self.attn(q, k, v, positions, self.rotary_emb, q_norm, k_norm)  # [num_tokens, heads, head_dim]
        return self.o_proj(o.flatten(1, -1))


class Qwen3MLP(nn.Module):

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; only 'silu' is")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):

    def __init__(self, config: PretrainedConfig, qk_norm: bool, qkv_bias: bool):
        super().__init__()
        self.self_attn = Qwen3Attention(config, qk_norm, qkv_bias)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3Model(nn.Module):

    def __init__(self, config: PretrainedConfig, qk_norm: bool, qkv_bias: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, qk_norm, qkv_bias)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm, qkv_bias = True, False

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported; every layer must use full attention")
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        self.model = Qwen3Model(config, self.qk_norm, qkv_bias)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)  # [num_tokens, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)  # [num_rows, vocab] on rank 0


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    qk_norm, qkv_bias = False, True


MODELS: dict[str, type[Qwen3ForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
