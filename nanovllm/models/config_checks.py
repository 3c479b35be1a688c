"""Checks of a checkpoint's config.json values, before anything is built or allocated from them.

Owns the bounds every model family's sizes must meet (integers, at least 1, at most a cap far
above any released model, so a typo such as an intermediate_size of 2e8 is refused at once
rather than after minutes of allocation), the epsilons (finite and > 0) and the head counts that
must divide. Each model class lists its own fields, spelled as its config.json spells them
(GPT-2's n_embd, n_head), in a `ConfigSpec` (models/base.py and the family files). Checks run on
the raw JSON before transformers reads it (an absurd num_hidden_layers makes transformers build
a list of that many layer types) and again on the config transformers made, defaults included.
It knows nothing of how a model runs.
"""
from typing import NamedTuple

from transformers import PretrainedConfig

from nanovllm.utils.validation import is_int, is_number

# Caps on sizes: each is far above the largest released model's, so only a broken config meets it.
MAX_VOCAB_SIZE = 1 << 22  # 4M tokens; the largest vocabularies in use are ~262k (Gemma 3)
MAX_HIDDEN_SIZE = 1 << 16  # Llama 3.1 405B's hidden size is 16384
MAX_INTERMEDIATE_SIZE = 1 << 20  # Llama 3.1 405B's MLP is 53248 wide
MAX_LAYERS = 1 << 10  # Llama 3.1 405B has 126 layers
MAX_HEADS = 1 << 10  # Llama 3.1 405B has 128 query heads
MAX_HEAD_DIM = 1 << 10  # 256 is the widest head in use (Gemma)
MAX_POSITIONS = 1 << 24  # 16M positions; the longest contexts released are ~10M (Llama 4 Scout)
MAX_EXPERTS = 1 << 12  # the largest MoE models route among a few hundred experts (Kimi K2: 384)


class ConfigSpec(NamedTuple):
    """What a model family requires of its config.json, by the names the file uses."""
    sizes: dict[str, range]  # must be an integer in the range
    optional_sizes: dict[str, range]  # absent or null, else an integer in the range
    epsilons: tuple[str, ...]  # normalisation epsilons: finite numbers > 0
    # (width, query heads, KV heads or None): heads split the width unless head_dim is given, and
    # each KV head serves a whole group of query heads
    heads: tuple[str, str, str | None]


def sizes_up_to(**caps: int) -> dict[str, range]:
    """{field: range(1, cap + 1)}: the usual size, an integer from 1 to its cap."""
    return {name: range(1, cap + 1) for name, cap in caps.items()}


def _refuse(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name}={value!r} is not allowed; {name} must be {allowed}")


def _describe(allowed: range) -> str:
    return f"an integer in {allowed.start}..{allowed.stop - 1}"


def check_values(values: dict, spec: ConfigSpec, complete: bool) -> None:
    """Refuse (ValueError naming the field) any value of `values` that breaks `spec`. With
    `complete` False (the raw JSON) an absent field passes, as transformers fills in a default;
    with `complete` True (the config transformers made) a required size must be there."""
    for name, allowed in spec.sizes.items():
        if name not in values and not complete:
            continue
        value = values.get(name)
        if not (is_int(value) and value in allowed):
            _refuse(name, value, _describe(allowed))
    for name, allowed in spec.optional_sizes.items():
        value = values.get(name)
        if value is not None and not (is_int(value) and value in allowed):
            _refuse(name, value, f"null or {_describe(allowed)}")
    for name in spec.epsilons:
        if name not in values and not complete:
            continue
        value = values.get(name)
        if not (is_number(value) and value > 0):  # is_number refuses NaN and infinities
            _refuse(name, value, "a finite number > 0")


def check_raw_heads(raw: dict, spec: ConfigSpec) -> None:
    """The divisibility rules on config.json as written (its sizes already checked), for the
    fields it has: transformers may fill a head_dim the file does not give."""
    width, heads, kv_heads = spec.heads
    if raw.get("head_dim") is None and raw.get(width) is not None and raw.get(heads) is not None:
        check_divides(width, raw[width], heads, raw[heads])
    if kv_heads is not None and raw.get(heads) is not None and raw.get(kv_heads) is not None:
        check_divides(heads, raw[heads], kv_heads, raw[kv_heads])


def config_values(hf_config: PretrainedConfig, spec: ConfigSpec) -> dict:
    """The values `spec` names, read from a transformers config (absent ones left out)."""
    names = [*spec.sizes, *spec.optional_sizes, *spec.epsilons]
    return {name: getattr(hf_config, name) for name in names if hasattr(hf_config, name)}


def check_divides(total_name: str, total: int, part_name: str, part: int) -> None:
    """Refuse a config whose `total` field is not a multiple of its `part` field."""
    if total % part:
        raise ValueError(f"{total_name}={total} and {part_name}={part} do not fit: "
                         f"{total_name} must be a multiple of {part_name}")
