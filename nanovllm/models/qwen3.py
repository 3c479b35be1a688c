"""Qwen3 and Qwen2: Llama's decoder with a different attention block.

Qwen3 normalises q and k per head (q_norm, k_norm) and, like Llama, has biases on q/k/v/o only
when attention_bias says so; Qwen2 always has a q/k/v bias (and none on o_proj) and no q/k
norm. Everything else is models/llama.py's.
"""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Qwen2ForCausalLM(LlamaForCausalLM):

    def make_attention(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding) -> nn.Module:
        return LlamaAttention(config, rotary_emb, qkv_bias=True, o_bias=False, qk_norm=False)
