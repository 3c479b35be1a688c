"""Persistent decode-step inputs: one step's StepMessage written into buffers made once.

A decode step's inputs (token ids, positions, slot mapping, context lengths, block tables) are
written into buffers made once: pinned host arrays filled from Python lists through numpy,
then copied to same-shaped device buffers without blocking. No step allocates, and a captured
CUDA graph (graph.py) keeps reading the same device memory. Padding rows up to a graph's batch
size get slot -1 (store nothing) and context length 0 (attend to nothing, output zeros).
"""
import torch

from nanovllm.platform.device import device_platform
from nanovllm.runner.step_inputs import StepInputs, StepMessage, decode_slot
from nanovllm.utils.context import AttentionMetadata

class DecodeInputs:

    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.block_size = block_size
        platform = device_platform(device)

        def host(*shape: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, pin_memory=platform.pin_memory)

        # Host (pinned) buffers and their numpy views, which take a Python list in one call.
        self.host = {
            "input_ids": host(max_batch, dtype=torch.int64, fill=0),
            "positions": host(max_batch, dtype=torch.int64, fill=0),
            "slot_mapping": host(max_batch, dtype=torch.int64, fill=-1),
            "context_lens": host(max_batch, dtype=torch.int32, fill=0),
            "block_tables": host(max_batch, max_blocks_per_seq, dtype=torch.int32, fill=-1),
        }
        self.np = {name: t.numpy() for name, t in self.host.items()}
        # On CPU the host buffers are the device buffers: nothing to copy.
        self.device = self.host if platform.shares_host_memory else {
            name: t.to(device) for name, t in self.host.items()}
        # Marks the latest step's copies out of the host buffers (None where there are none). Under
        # async scheduling the host fills step N+1 while step N's copies may still wait in the
        # stream behind step N-1, so it waits on this before writing over what they read.
        self.copied = platform.copy_event()

    def fill(self, step: StepMessage, padded_batch: int, full_width: bool) -> StepInputs:
        """Write a decode step's inputs and pad to `padded_batch` rows. Block tables keep their
        full width (a fixed shape, for graphs) or are cut to the batch's longest table. Every
        sequence samples, from its own row."""
        n, bs = step.num_seqs, self.block_size
        if self.copied is not None:
            self.copied.synchronize()  # at once unless the stream has not reached the last step's copies
        np_ = self.np
        np_["input_ids"][:n] = step.token_ids
        np_["positions"][:n] = step.starts
        np_["context_lens"][:n] = step.lengths
        np_["slot_mapping"][:n] = [decode_slot(table, bs, n_tokens) for table, n_tokens in zip(step.block_tables,
                                                                                                 step.lengths)]
        width = 0
        tables = np_["block_tables"]
        for i, table in enumerate(step.block_tables):
            # Entries past a row's own blocks may be stale: they lie beyond its context length,
            # so no backend reads them.
            tables[i, :len(table)] = table
            width = max(width, len(table))
        np_["input_ids"][n:padded_batch] = 0
        np_["positions"][n:padded_batch] = 0
        np_["slot_mapping"][n:padded_batch] = -1
        np_["context_lens"][n:padded_batch] = 0
        dev = self.device
        if dev is not self.host:
            for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
                dev[name][:padded_batch].copy_(self.host[name][:padded_batch], non_blocking=True)
            dev["block_tables"][:padded_batch].copy_(self.host["block_tables"][:padded_batch], non_blocking=True)
            self.copied.record()
        tables_view = dev["block_tables"][:padded_batch]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=dev["slot_mapping"][:padded_batch],
            context_lens=dev["context_lens"][:padded_batch],
            block_tables=tables_view if full_width else tables_view[:, :max(width, 1)],
        )
        return StepInputs(dev["input_ids"][:padded_batch], dev["positions"][:padded_batch], meta, list(range(n)),
                          slice(0, n))
