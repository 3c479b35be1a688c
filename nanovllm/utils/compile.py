"""`torch.compile` for the small hot layer functions, on CUDA only.

On CUDA, fusing RMSNorm + residual add, rotary embedding, SiLU-and-mul and the plain sampler
into single kernels saves launches and memory traffic (nano-vllm does the same). On CPU they run
eagerly by default, though compiled versions are faster there too (benchmarks/compiled_layers.py,
recorded in docs/BENCHMARKS.md: the sampler ~7x, RMSNorm and rotary several x, SiLU-and-mul no
gain): the CPU path is the float32 oracle that must match HF transformers bit for bit, and a
cold compile costs seconds per function in every fresh process (14 s for the first one
measured), more than tests and short runs gain. NANOVLLM_COMPILE=all compiles on CPU too, for
long CPU runs; =0 compiles nowhere. The choice is made per call from the input's device.
"""
import functools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

COMPILE_MODES = ("cuda", "all", "0")
MODE = os.environ.get("NANOVLLM_COMPILE", "cuda")
if MODE not in COMPILE_MODES:
    raise ValueError(f"NANOVLLM_COMPILE={MODE!r} is not allowed; it must be one of {COMPILE_MODES}")


# Each function sees a few input kinds (2-D and 3-D, batch 1, sizes that equal a head count),
# and each is one more compiled version; past dynamo's default limit of 8 it would silently
# fall back to eager.
RECOMPILE_LIMIT = 64


def _allow_recompiles() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def compile_on_cuda(fn: F) -> F:
    compiled = None

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args, **kwargs):
        nonlocal compiled
        if MODE == "0" or (MODE == "cuda" and not x.is_cuda):
            return fn(x, *args, **kwargs)
        if compiled is None:
            _allow_recompiles()
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args, **kwargs)

    return dispatch
