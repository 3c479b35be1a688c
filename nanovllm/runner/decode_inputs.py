"""Persistent decode-step inputs, and the CUDA-graph batch buckets they are padded to.

A decode step's inputs (token ids, positions, slot mapping, context lengths, block tables) are
written into buffers made once: pinned host arrays filled from Python lists through numpy,
then copied to same-shaped device buffers without blocking. No step allocates, and a captured
CUDA graph keeps reading the same device memory. Padding rows of a bucket get slot -1 (store
nothing) and context length 0 (attend to nothing, output zeros).
"""
from bisect import bisect_left

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.runner.step_inputs import decode_slot
from nanovllm.utils.context import AttentionMetadata

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


class DecodeInputs:

    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        self.block_size = block_size
        pin = device.type == "cuda"

        def host(*shape: int, dtype: torch.dtype, fill: int) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, pin_memory=pin)

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
        self.device = self.host if device.type == "cpu" else {
            name: t.to(device) for name, t in self.host.items()}

    def fill(self, seqs: list[Sequence], padded_batch: int, full_width: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        AttentionMetadata]:
        """Write the step's inputs for `seqs` and pad to `padded_batch` rows. Block tables keep
        their full width (a fixed shape, for graphs) or are cut to the batch's longest table."""
        n, bs = len(seqs), self.block_size
        lengths = [len(seq) for seq in seqs]
        np_ = self.np
        np_["input_ids"][:n] = [seq.last_token for seq in seqs]
        np_["positions"][:n] = [length - 1 for length in lengths]
        np_["context_lens"][:n] = lengths
        np_["slot_mapping"][:n] = [decode_slot(seq.block_table, bs, length) for seq, length in zip(seqs, lengths)]
        width = 0
        tables = np_["block_tables"]
        for i, seq in enumerate(seqs):
            # Entries past a row's own blocks may be stale: they lie beyond its context length,
            # so no backend reads them.
            tables[i, :len(seq.block_table)] = seq.block_table
            width = max(width, len(seq.block_table))
        np_["input_ids"][n:padded_batch] = 0
        np_["positions"][n:padded_batch] = 0
        np_["slot_mapping"][n:padded_batch] = -1
        np_["context_lens"][n:padded_batch] = 0
        dev = self.device
        if dev is not self.host:
            for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
                dev[name][:padded_batch].copy_(self.host[name][:padded_batch], non_blocking=True)
            dev["block_tables"][:padded_batch].copy_(self.host["block_tables"][:padded_batch], non_blocking=True)
        tables_view = dev["block_tables"][:padded_batch]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=dev["slot_mapping"][:padded_batch],
            context_lens=dev["context_lens"][:padded_batch],
            block_tables=tables_view if full_width else tables_view[:, :max(width, 1)],
        )
        return dev["input_ids"][:padded_batch], dev["positions"][:padded_batch], meta

