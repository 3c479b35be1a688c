"""CPU attention that reads the paged KV cache in place, through the C++ kernel of
kernels/cpu_paged_attention.cpp (built and loaded by kernels/cpu_build.py): the CPU platform's
own attention backend (chosen by platform/attention.py).

Decode rows, a mixed step's one-token rows and prefill chunks over a cached prefix all go to one
kernel call per layer: each (sequence, KV head, tile of queries) walks its sequence's blocks where
they lie in the cache with an online softmax, in float32, the group of query heads of a KV head
sharing each K/V read (no gather into a contiguous copy, no repeated K/V). Fresh prompts go there
too (`prefill_from_cache`: the runner gives every CPU prefill its block tables; the kernel's
prefill tiles beat torch's SDPA, docs/BENCHMARKS.md); a prefill without block tables (the start-up
warm-up, which has no cache) attends its own contiguous K/V with SDPA, and an fp8 cache goes to
the torch backend whole (its dequantising reads are the reference).

The metadata the kernel takes (int32 starts and lengths per sequence) depends only on the step,
so the first layer makes it and the others reuse it, as the torch backend does with its plan.
"""
from typing import NamedTuple

import torch

from nanovllm.attention.kv_quant import KVScales
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.kernels.cpu_build import DTYPE_CODES, PagedAttentionKernel
from nanovllm.utils.context import AttentionMetadata

# Queries of one sequence per work item in a prefill over a cached prefix: enough rows
# (PREFILL_Q_TILE x the query heads of a KV head) to reuse each K/V block read many times, few
# enough that a 256-token chunk still makes 16 items per KV head for the threads to share.
PREFILL_Q_TILE = 16


class KernelSteps(NamedTuple):
    """A step's per-sequence arguments of the kernel."""
    q_start: torch.Tensor  # [num_seqs] int32: each sequence's first row of q
    q_len: torch.Tensor  # [num_seqs] int32: its new tokens
    k_len: torch.Tensor  # [num_seqs] int32: its tokens in the cache, the new ones included
    block_tables: torch.Tensor  # [num_seqs, width] int32, unit stride along a row
    q_tile: int


class CpuPagedBackend(TorchBackend):
    name = "cpu"
    prefill_from_cache = True

    def __init__(self, kernel: PagedAttentionKernel) -> None:
        super().__init__()
        self.kernel = kernel
        self._steps_meta: AttentionMetadata | None = None
        self._steps: KernelSteps | None = None

    def _kernel_reads(self, q: torch.Tensor, k_cache: torch.Tensor, kv_scales: KVScales | None) -> bool:
        """Whether this call can go to the kernel: an unquantised cache in q's dtype."""
        return kv_scales is None and q.dtype in DTYPE_CODES and k_cache.dtype == q.dtype and q.stride(-1) == 1

    def steps(self, q: torch.Tensor, meta: AttentionMetadata) -> KernelSteps:
        if meta is self._steps_meta:
            return self._steps
        tables = meta.block_tables
        if tables.stride(-1) != 1 or tables.dtype != torch.int32:
            tables = tables.to(torch.int32).contiguous()
        if meta.is_prefill:
            q_start = meta.cu_seqlens_q[:-1].to(torch.int32).contiguous()
            q_len = torch.tensor(meta.seqlens_q, dtype=torch.int32)
            k_len = torch.tensor(meta.seqlens_k, dtype=torch.int32)
            q_tile = PREFILL_Q_TILE
        else:
            num_seqs = q.size(0)
            q_start = torch.arange(num_seqs, dtype=torch.int32)
            q_len = torch.ones(num_seqs, dtype=torch.int32)
            k_len = meta.context_lens.to(torch.int32).contiguous()
            q_tile = 1
        self._steps = KernelSteps(q_start, q_len, k_len, tables, q_tile)
        self._steps_meta = meta
        return self._steps

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        if meta.block_tables is None or not self._kernel_reads(q, k_cache, kv_scales):
            return super().prefill(q, k, v, k_cache, v_cache, meta, scale, kv_scales)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, kv_scales: KVScales | None = None) -> torch.Tensor:
        if not self._kernel_reads(q, k_cache, kv_scales):
            return super().decode(q, k_cache, v_cache, meta, scale, kv_scales)
        return self._attend(q, k_cache, v_cache, meta, scale)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        s = self.steps(q, meta)
        out = torch.empty(q.shape, dtype=q.dtype)
        self.kernel(q, out, k_cache, v_cache, s.block_tables, s.q_start, s.q_len, s.k_len, scale, s.q_tile)
        return out
