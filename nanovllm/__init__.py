"""nanovllm: a small, readable offline LLM inference engine (CPU and CUDA).

`from nanovllm import LLM, SamplingParams` works as ever, but the names are imported on first
use (PEP 562): importing the package alone does not import torch, so the `nanovllm` command
answers --version at once and can catch a Ctrl-C pressed while torch is still loading.
"""
import importlib
import logging

# Each public name and the module that defines it.
_EXPORTS = {"LLM": "nanovllm.llm", "SamplingParams": "nanovllm.sampling_params",
            "StructuredOutputsParams": "nanovllm.sampling_params",
            **dict.fromkeys(("RequestOutput", "CompletionOutput", "RequestDelta", "SampleDelta"),
                            "nanovllm.engine.outputs")}
__all__ = [*_EXPORTS, "__version__"]
# The source tree's version, pyproject.toml's (tests/test_cli.py checks they agree); an installed
# package reports its own through importlib.metadata (`nanovllm --version`).
__version__ = "0.1.0"

# Start-up facts (backend, dtype, device, KV capacity) are logged at INFO so a misconfigured
# run is visible; an application that configures logging itself keeps control.
_logger = logging.getLogger("nanovllm")
if not _logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
