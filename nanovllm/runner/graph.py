"""CUDA graphs of decode steps: one per batch-size bucket, captured at start-up, replayed after.

Owns the buckets (every decode batch pads up to one), the captured graphs, the memory pool they
share and the buffer they write hidden states to (as mini-sglang's engine/graph.py). A graph
reads the persistent decode buffers of `DecodeInputs`, so replaying it after `fill` runs the
model on that step's inputs with no host work. It builds no inputs and never samples.
"""
from bisect import bisect_left

import torch
from torch import nn

from nanovllm.platform.device import DeviceGraph, device_platform
from nanovllm.runner.decode_inputs import DecodeInputs
from nanovllm.runner.step_inputs import StepInputs, StepMessage
from nanovllm.utils.context import forward_context

# Small batches get their own graphs; past this, one graph every GRAPH_BUCKET_STEP sequences.
SMALL_GRAPH_BATCHES = (1, 2, 4, 8)
GRAPH_BUCKET_STEP = 16


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: every decode batch (1..max_num_seqs) pads up to one of them."""
    sizes = [b for b in SMALL_GRAPH_BATCHES if b < max_num_seqs]
    sizes += range(GRAPH_BUCKET_STEP, max_num_seqs, GRAPH_BUCKET_STEP)
    return sizes + [max_num_seqs]


def bucket_for(batch: int, sizes: list[int]) -> int:
    """The smallest captured batch size >= batch."""
    i = bisect_left(sizes, batch)
    if i == len(sizes):
        raise ValueError(f"decode batch of {batch} sequences exceeds the largest graph bucket {sizes[-1]}")
    return sizes[i]



class DecodeGraphs:
    """The captured decode graphs of one model runner; empty until `capture` (and after `clear`)."""

    def __init__(self) -> None:
        self.graphs: dict[int, DeviceGraph] = {}
        self.batch_sizes: list[int] = []
        self.pool: tuple | None = None  # the memory pool every graph shares (an opaque handle)
        self.hidden_states: torch.Tensor | None = None  # [largest batch, hidden]: what every graph writes

    def __len__(self) -> int:
        return len(self.graphs)

    def padded_batch(self, batch: int) -> int:
        """The captured batch size a decode batch of `batch` sequences pads up to."""
        return bucket_for(batch, self.batch_sizes)

    @torch.inference_mode()
    def capture(self, model: nn.Module, decode_inputs: DecodeInputs, batch_sizes: list[int], hidden_size: int,
                dtype: torch.dtype, device: torch.device) -> None:
        """One graph per batch size, largest first, sharing one memory pool. The attention
        backend must be prepared for these sizes first (AttentionBackend.prepare_cuda_graphs)."""
        platform = device_platform(device)
        self.batch_sizes = batch_sizes
        self.hidden_states = torch.zeros(batch_sizes[-1], hidden_size, dtype=dtype, device=device)
        empty = StepMessage.of([], is_prefill=False)
        for batch in reversed(batch_sizes):
            # All rows are padding (slot -1, context 0): warm-up and capture write no KV.
            inputs = decode_inputs.fill(empty, batch, full_width=True)

            def step() -> None:
                self.hidden_states[:batch] = model(inputs.input_ids, inputs.positions)

            with forward_context(inputs.meta):
                step()  # warm-up (and compile)
                graph = platform.capture_graph(step, self.pool)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[batch] = graph
            platform.synchronize()

    def replay(self, inputs: StepInputs) -> torch.Tensor:
        """Run the graph of the batch size `inputs` were padded to (by DecodeInputs.fill, into the
        buffers the graph reads); returns its hidden states, [padded batch, hidden]."""
        batch = inputs.input_ids.size(0)
        self.graphs[batch].replay()
        return self.hidden_states[:batch]

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = self.hidden_states = None
