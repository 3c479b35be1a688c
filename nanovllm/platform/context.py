"""Which platform the layers being built take their functions and linear methods from.

The model runner builds its model inside `building_for(platform)`; each layer asks
`current_platform()` once, in its constructor, and keeps what it gets, so two engines in one
process (a test comparing fused kernels with the torch path) never share a choice. A layer built
outside a runner (tests) gets the torch reference. The choice is per thread, so engines built in
two threads at once each see their own.
"""
import threading
from contextlib import contextmanager
from typing import Iterator

from nanovllm.platform.base import Platform
from nanovllm.platform.torch import TorchPlatform

REFERENCE = TorchPlatform()
_building = threading.local()  # .platform: the one of the building_for() in progress on this thread


def current_platform() -> Platform:
    return getattr(_building, "platform", None) or REFERENCE


@contextmanager
def building_for(platform: Platform) -> Iterator[None]:
    """Layers made inside take `platform`'s functions; nesting is refused (one model at a time)."""
    if getattr(_building, "platform", None) is not None:
        raise RuntimeError("building_for() does not nest: a model is already being built on this thread")
    _building.platform = platform
    try:
        yield
    finally:
        _building.platform = None
