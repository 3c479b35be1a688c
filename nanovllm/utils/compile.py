"""`torch.compile` for the small hot layer functions, where the engine's compile mode says.

On CUDA, fusing RMSNorm + residual add, rotary embedding, SiLU-and-mul and the plain sampler
into single kernels saves launches and memory traffic (nano-vllm does the same). On CPU they run
eagerly by default, though compiled versions are faster there too (benchmarks/compiled_layers.py,
recorded in docs/BENCHMARKS.md: the sampler ~7x, RMSNorm and rotary several x, SiLU-and-mul no
gain): the CPU path is the float32 oracle that must match HF transformers bit for bit, and a
cold compile costs seconds per function in every fresh process (14 s for the first one
measured), more than tests and short runs gain.

The choice is `Config.compile_mode`, resolved once per engine ("auto": on for CUDA, off for
CPU). The model runner runs each step inside `compiling(enabled)`; a decorated function called
outside any such scope (a test, a benchmark timing the eager version) runs eagerly. Dynamo's
recompile limit is one setting for the whole process: it is raised at the first compile.
"""
import functools
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# Each function sees a few input kinds (2-D and 3-D, batch 1, sizes that equal a head count),
# and each is one more compiled version; past dynamo's default limit of 8 it would silently
# fall back to eager.
RECOMPILE_LIMIT = 64

_enabled = False  # inside a step of an engine whose compile mode is "on"


@contextmanager
def compiling(enabled: bool) -> Iterator[None]:
    """Run the decorated functions compiled (or not) for the duration of the block."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def _allow_recompiles() -> None:
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def compilable(fn: F) -> F:
    """`fn`, compiled (once, with dynamic shapes) when called inside `compiling(True)`."""
    compiled = None

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        nonlocal compiled
        if not _enabled:
            return fn(*args, **kwargs)
        if compiled is None:
            _allow_recompiles()
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args, **kwargs)

    return dispatch
