"""nanovllm: a small, readable offline LLM inference engine (CPU and CUDA)."""
import logging

from nanovllm.engine.request import RequestOutput, SampleDelta
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SampleDelta", "SamplingParams"]

# Start-up facts (backend, dtype, device, KV capacity) are logged at INFO so a misconfigured
# run is visible; an application that configures logging itself keeps control.
_logger = logging.getLogger("nanovllm")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
