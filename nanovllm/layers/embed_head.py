"""Token embedding and LM head, split by vocabulary across tensor-parallel ranks, and learned
absolute position embeddings (GPT-2), replicated.

Each rank holds a contiguous slice of the vocabulary; embedding lookups outside it produce
zeros and are summed across ranks; the LM head's logits are gathered on rank 0.
"""
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.cpu_build import AMX_GREEDY_HEAD_MIN_ROWS, AMX_HEAD_MIN_ROWS
from nanovllm.layers.linear import HalfRows, divide, linear, shard
from nanovllm.layers.logits_processors import LOGIT_LIMIT
from nanovllm.utils.loader import copy_checked
from nanovllm.utils.parallel import tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = divide(num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start = self.shard_size * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
        copy_checked(param.data, shard(loaded, 0, self.tp_rank, self.shard_size, self.tp_size, name), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    computes_in_weight_dtype = True  # its weight may be held in float32 (see layers/linear.py linear())
    packed_weight: torch.Tensor | None = None  # set on CPU after loading (utils/cpu.py pack_linear_weights)
    few_rows: Callable | None = None  # the CPU's few-row product (layers/linear.py linear()), set by enable_cpu
    amx: Callable | None = None  # the weight packed for the CPU's AMX product (layers/linear.py linear())
    half_rows: HalfRows | None = None  # the few-row product over a bf16 copy of a float32-held head (enable_cpu)
    # Rows (and a HeadDraw, or None: greedy) -> their tokens, without every logit, set by enable_cpu
    # for a float32 or bf16 head on one rank where the CPU has AVX512-VNNI or AVX2 (kernels/cpu_build.py
    # GreedyHead; a bf16 head's greedy steps of many rows on AMX tiles where it has AMX: AmxGreedyHead);
    # returns None where the logits must decide.
    greedy: Callable[..., torch.Tensor | None] | None = None

    def enable_cpu(self, kernels) -> None:
        self.few_rows = kernels.few_rows_linear(self.weight.dtype)
        self.half_rows = HalfRows.for_layer(self, kernels)
        if self.weight.dtype == torch.float32:  # bf16 logits stay on oneDNN (kernels/cpu_build.py AMX_HEAD_MIN_ROWS)
            self.amx = kernels.amx_linear(self.weight, min_rows=AMX_HEAD_MIN_ROWS)
        # Steps that need only their tokens take them without every logit: float32 and bf16 rows (a
        # bf16 model's head bf16 or held in float32), through the int8 head, and a bf16 head's
        # greedy steps of many rows on AMX tiles where the CPU has them.
        if self.tp_size == 1 and getattr(self, "held_dtype", None) in (None, torch.bfloat16):
            self.greedy = kernels.greedy_head(self.weight, LOGIT_LIMIT)
            self.greedy = kernels.amx_greedy_head(self.weight, LOGIT_LIMIT, AMX_GREEDY_HEAD_MIN_ROWS,
                                                  self.greedy) or self.greedy

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [num_rows, hidden] -> logits [num_rows, vocab] on rank 0 (None on the others)."""
        logits = linear(x, self.weight, None, self.packed_weight, self.few_rows, self.amx, self.half_rows)
        if self.tp_size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, parts, 0)
        return torch.cat(parts, -1) if self.tp_rank == 0 else None


class PositionEmbedding(nn.Module):
    """One learned vector per position, [num_positions, dim], whole on every rank (it is small).
    Positions at or past num_positions have no vector: the engine caps max_model_len to it."""

    def __init__(self, num_positions: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_positions, embedding_dim))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)  # [num_tokens, dim]
