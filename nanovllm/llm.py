"""The public entry point: `LLM(path, **config)` is the engine under nano-vllm's name."""
from nanovllm.llm_engine import LLMEngine


class LLM(LLMEngine):
    pass
