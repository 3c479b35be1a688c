"""Where the model being built sits in its tensor-parallel group (rank 0 of 1 unless told otherwise).

Layers read tp_rank() and tp_size() once, when they are built, and keep them. The tensor-parallel
runner builds each rank's model inside `tensor_parallel_rank(rank, size)`; outside it a model is
built for one rank, even when torch.distributed is initialised for something else (a TP=1 engine
beside a TP=2 one in the same process, or a program launched by torchrun).
"""
from contextlib import contextmanager
from typing import Iterator

_rank, _size = 0, 1


def tp_rank() -> int:
    return _rank


def tp_size() -> int:
    return _size


@contextmanager
def tensor_parallel_rank(rank: int, size: int) -> Iterator[None]:
    global _rank, _size
    if _size != 1:
        raise RuntimeError(f"already building rank {_rank} of {_size}; tensor_parallel_rank does not nest")
    assert 0 <= rank < size, (rank, size)
    _rank, _size = rank, size
    try:
        yield
    finally:
        _rank, _size = 0, 1
