"""The attention metadata of the forward pass in flight, scoped by a context manager.

The runner's step-input builders (runner/step_inputs.py, runner/decode_inputs.py) make an
`AttentionMetadata` per step, and the model runner enters `forward_context(...)` around the
model call (or a graph's capture); attention layers read it with `get_context()`. Nothing else does.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    is_prefill: bool
    # [num_tokens] int64: flat cache slot (block_id * block_size + offset) per new token; -1 = skip
    slot_mapping: torch.Tensor
    # Prefill: [batch + 1] int32 prefix sums of new (q) and total (k) tokens per sequence.
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # Decode: [batch] int32 tokens of context per sequence, the new one included.
    context_lens: torch.Tensor | None = None
    # [batch, max_blocks] int32, padded with -1; None in a prefill with no cached prefix.
    block_tables: torch.Tensor | None = None
    # Host copies of the prefill lengths, for backends that loop over sequences on the host.
    seqlens_q: list[int] | None = None
    seqlens_k: list[int] | None = None


_context: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _context
    if _context is not None:
        raise RuntimeError("forward_context is already active; forward passes do not nest")
    _context = metadata
    try:
        yield metadata
    finally:
        _context = None


def get_context() -> AttentionMetadata:
    if _context is None:
        raise RuntimeError("attention called outside forward_context")
    return _context
