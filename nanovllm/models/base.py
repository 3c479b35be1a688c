"""What every model class offers the engine, beside `forward(input_ids, positions)` and
`compute_logits(hidden_states)`.

Owns the defaults of the per-family hooks the engine calls before and while building a model:
checking and completing the checkpoint's config (`adapt_config`, before any work starts), the
config sizes that tensor parallelism splits (`tensor_parallel_sizes`, checked before any worker
is spawned) and how checkpoint tensors map onto parameters (`checkpoint_targets`). It knows
nothing of any one family.
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.utils.loader import WeightTarget, packed_target


class CausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id); see utils/loader.py
    packed_modules_mapping: dict[str, tuple[str, object]] = {}
    # Config sizes that each tensor-parallel rank holds a slice of (heads, KV heads, vocabulary, MLP width).
    tensor_parallel_fields: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads", "vocab_size",
                                               "intermediate_size")

    @classmethod
    def adapt_config(cls, hf_config: PretrainedConfig) -> None:
        """Refuse (ValueError) what this model cannot run, and fill the fields the runner reads
        (num_key_value_heads, head_dim) where the family's config does not have them."""
        if getattr(hf_config, "num_key_value_heads", None) is None:  # multi-head attention: a KV head per head
            hf_config.num_key_value_heads = hf_config.num_attention_heads
        if getattr(hf_config, "head_dim", None) is None:
            hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads

    @classmethod
    def tensor_parallel_sizes(cls, hf_config: PretrainedConfig) -> dict[str, int]:
        """The sizes tensor_parallel_size must divide, by config field name."""
        sizes = {name: getattr(hf_config, name, None) for name in cls.tensor_parallel_fields}
        return {name: value for name, value in sizes.items() if value is not None}

    def checkpoint_targets(self, weight_name: str, tensor: torch.Tensor) -> list[WeightTarget]:
        """Where a checkpoint tensor goes: by name, or into a fused parameter (packed_modules_mapping)."""
        return [packed_target(weight_name, tensor, self.packed_modules_mapping)]
