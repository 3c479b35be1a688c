"""What every model class offers the engine, beside `forward(input_ids, positions, keep_rows=None)`
and `compute_logits(hidden_states)`.

`keep_rows` (an int64 index tensor, or None for every row) names the rows whose output the caller
reads: a prefill's sampling rows. Every row's K/V is still stored, but past the last layer's
attention only those rows are computed (the last layer's output projection, MLP and final norm:
an eighth of an 8-layer prefill's products), and the output has those rows, in that order.

Owns the defaults of the per-family hooks the engine calls before and while building a model:
checking and completing the checkpoint's config (`config_spec`, `check_raw_config` and
`adapt_config`, before any work starts; models/config_checks.py holds the bounds), the
config sizes that tensor parallelism splits (`tensor_parallel_sizes`, checked before any worker
is spawned) and how checkpoint tensors map onto parameters (`checkpoint_targets`). It knows
nothing of any one family.
"""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.config_checks import (MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN_SIZE, MAX_INTERMEDIATE_SIZE,
                                           MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB_SIZE, ConfigSpec, check_divides,
                                           check_raw_heads, check_values, config_values, sizes_up_to)
from nanovllm.utils.loader import WeightTarget, packed_target


class CausalLM(nn.Module):
    # checkpoint name fragment -> (fused parameter fragment, shard id); see utils/loader.py
    packed_modules_mapping: dict[str, tuple[str, object]] = {}
    # Config sizes that each tensor-parallel rank holds a slice of (heads, KV heads, vocabulary, MLP width).
    tensor_parallel_fields: tuple[str, ...] = ("num_attention_heads", "num_key_value_heads", "vocab_size",
                                               "intermediate_size")
    # The config.json fields this family reads, as the file names them, and their bounds.
    config_spec = ConfigSpec(
        sizes=sizes_up_to(vocab_size=MAX_VOCAB_SIZE, hidden_size=MAX_HIDDEN_SIZE,
                          intermediate_size=MAX_INTERMEDIATE_SIZE, num_hidden_layers=MAX_LAYERS,
                          num_attention_heads=MAX_HEADS, max_position_embeddings=MAX_POSITIONS),
        optional_sizes=sizes_up_to(num_key_value_heads=MAX_HEADS, head_dim=MAX_HEAD_DIM),
        epsilons=("rms_norm_eps",),
        heads=("hidden_size", "num_attention_heads", "num_key_value_heads"))

    @classmethod
    def check_raw_config(cls, raw: dict) -> None:
        """Refuse (ValueError naming the field) a value of config.json, as read from the file,
        that breaks config_spec: run before transformers makes a config of it."""
        check_values(raw, cls.config_spec, complete=False)
        check_raw_heads(raw, cls.config_spec)

    @classmethod
    def adapt_config(cls, hf_config: PretrainedConfig) -> None:
        """Refuse (ValueError) what this model cannot run, and fill the fields the runner reads
        (num_key_value_heads, head_dim) where the family's config does not have them."""
        spec = cls.config_spec
        check_values(config_values(hf_config, spec), spec, complete=True)
        width, heads, kv_heads = spec.heads
        if getattr(hf_config, "head_dim", None) is None:
            check_divides(width, hf_config.hidden_size, heads, hf_config.num_attention_heads)
        if kv_heads is not None and getattr(hf_config, kv_heads, None) is not None:
            check_divides(heads, hf_config.num_attention_heads, kv_heads, getattr(hf_config, kv_heads))
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
