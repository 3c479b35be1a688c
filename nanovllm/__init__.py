"""nanovllm: a small, readable offline LLM inference engine (CPU and CUDA)."""
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
