"""GPT-2 (`GPT2LMHeadModel`): the seeds' baseline model.

Learned absolute position embeddings (so positions stop at n_positions, and the engine caps
max_model_len there), pre-norm blocks of LayerNorm with a bias, multi-head attention (a KV head
per head) and a GELU MLP, all with biases, and an LM head tied to the token embedding.

Checkpoints store every projection as a `Conv1D`, whose weight is [in, out], the transpose of
nn.Linear's, and q/k/v as one `c_attn`; `checkpoint_targets` transposes the weights and cuts
c_attn into the q/k/v pieces of a QKVParallelLinear at load time. The model sees
`input_ids, positions` and nothing else.
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.activation import GELU
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, PositionEmbedding, VocabParallelEmbedding
from nanovllm.layers.layernorm import LayerNorm
from nanovllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.models.base import CausalLM
from nanovllm.models.config_checks import (MAX_HEADS, MAX_HIDDEN_SIZE, MAX_INTERMEDIATE_SIZE, MAX_LAYERS,
                                           MAX_POSITIONS, MAX_VOCAB_SIZE, ConfigSpec, sizes_up_to)
from nanovllm.utils.loader import WeightTarget

# Checkpoint weights stored as Conv1D ([in, out]): transposed to nn.Linear's [out, in] on load.
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
# Buffers older GPT-2 checkpoints saved beside the weights: the causal mask and its fill value.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def intermediate_size_of(config: PretrainedConfig) -> int:
    return config.n_inner if config.n_inner is not None else 4 * config.hidden_size


class GPT2Attention(nn.Module):

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.c_attn = QKVParallelLinear(hidden, self.head_dim, config.num_attention_heads,
                                        config.num_attention_heads, bias=True)
        self.num_heads = self.c_attn.num_heads  # per rank
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.num_heads, self.head_dim, scale, self.num_heads)

    def forward(self, hidden_states: torch.Tensor, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.c_attn(hidden_states)  # [num_tokens, 3 * heads * head_dim]
        q, k, v = qkv.view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)  # [num_tokens, heads, head_dim] each
        o = self.attn(q, k, v)  # [num_tokens, heads, head_dim]
        if keep_rows is not None:  # every token's K/V is stored above; only these rows go on
            o = o[keep_rows]
        return self.c_proj(o.flatten(1, -1))


class GPT2MLP(nn.Module):

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        inner = intermediate_size_of(config)
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, bias=True)
        self.act = GELU(config.activation_function)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden_states: torch.Tensor, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        attended = self.attn(self.ln_1(hidden_states), keep_rows)
        hidden_states = (hidden_states if keep_rows is None else hidden_states[keep_rows]) + attended
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = PositionEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, hidden]
        last = len(self.h) - 1
        for i, block in enumerate(self.h):
            hidden_states = block(hidden_states, keep_rows if i == last else None)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(CausalLM):
    tensor_parallel_fields = ("num_attention_heads", "vocab_size", "n_inner")
    config_spec = ConfigSpec(
        sizes=sizes_up_to(vocab_size=MAX_VOCAB_SIZE, n_embd=MAX_HIDDEN_SIZE, n_layer=MAX_LAYERS, n_head=MAX_HEADS,
                          n_positions=MAX_POSITIONS),
        optional_sizes=sizes_up_to(n_inner=MAX_INTERMEDIATE_SIZE),  # null: 4 * n_embd
        epsilons=("layer_norm_epsilon",),
        heads=("n_embd", "n_head", None))  # multi-head attention: no KV head count

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.adapt_config(config)
        self.hidden_size = config.hidden_size
        self.transformer = GPT2Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.transformer.wte.weight

    @classmethod
    def adapt_config(cls, hf_config: PretrainedConfig) -> None:
        super().adapt_config(hf_config)
        GELU(hf_config.activation_function)  # an unsupported activation is refused here, before any work
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("add_cross_attention=True is not supported; only decoder-only GPT-2 is")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.transformer(input_ids, positions, keep_rows)  # [num_tokens or len(keep_rows), hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)  # [num_rows, vocab] on rank 0

    def checkpoint_targets(self, weight_name: str, tensor: torch.Tensor) -> list[WeightTarget]:
        if weight_name.endswith(MASK_BUFFERS):
            return []
        # The original OpenAI checkpoints name tensors without the "transformer." prefix.
        name = weight_name if weight_name.startswith(("transformer.", "lm_head.")) else "transformer." + weight_name
        source = weight_name
        if name.endswith(CONV1D_WEIGHTS):
            tensor, source = tensor.t(), f"{weight_name} (Conv1D [in, out], transposed)"
        if ".attn.c_attn." not in name:
            return [WeightTarget(name, tensor, None, source)]
        hidden = self.hidden_size
        if tensor.size(0) != 3 * hidden:  # q, k and v of every head, one after the other
            raise ValueError(f"checkpoint tensor {source} has shape {tuple(tensor.shape)}; expected "
                             f"{3 * hidden} (q, k, v of hidden size {hidden}) in dim 0")
        return [WeightTarget(name, part, shard, f"{source}, {shard} part")
                for shard, part in zip("qkv", tensor.split(hidden, dim=0))]
