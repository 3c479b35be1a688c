"""Which platform the layers being built take their functions and linear methods from.

The model runner builds its model inside `building_for(platform)`; each layer asks
`current_platform()` once, in its constructor, and keeps what it gets, so two engines in one
process (a test comparing fused kernels with the torch path) never share a choice. A layer built
outside a runner (tests) gets the torch reference.
"""
from contextlib import contextmanager
from typing import Iterator

from nanovllm.platform.base import Platform
from nanovllm.platform.torch import TorchPlatform

REFERENCE = TorchPlatform()
_building: Platform | None = None


def current_platform() -> Platform:
    return _building or REFERENCE


@contextmanager
def building_for(platform: Platform) -> Iterator[None]:
    """Layers made inside take `platform`'s functions; nesting is refused (one model at a time)."""
    global _building
    if _building is not None:
        raise RuntimeError("building_for() does not nest: a model is already being built")
    _building = platform
    try:
        yield
    finally:
        _building = None
