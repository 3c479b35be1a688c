"""Which model class serves a checkpoint, by the names in its config.json's "architectures".

Owns the table of supported architectures (one file per family under models/) and the lookup
that refuses any other, listing the supported ones. It knows nothing of how a model runs; each
class carries its own config checks and tensor-parallel sizes (models/base.py).
"""
from nanovllm.models.base import CausalLM
from nanovllm.models.gpt2 import GPT2LMHeadModel
from nanovllm.models.llama import LlamaForCausalLM, MistralForCausalLM
from nanovllm.models.qwen3 import Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}
SUPPORTED_ARCHITECTURES = tuple(MODELS)


def architecture_of(architectures: list[str] | None, model: str) -> str:
    """The first of a checkpoint's architectures that a model here serves; ValueError otherwise."""
    for name in architectures or []:
        if name in MODELS:
            return name
    raise ValueError(f"model={model!r} has architectures {architectures}; supported: {list(SUPPORTED_ARCHITECTURES)}")
