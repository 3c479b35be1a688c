"""Token embedding and LM head, split by vocabulary across tensor-parallel ranks, and learned
absolute position embeddings (GPT-2), replicated.

Each rank holds a contiguous slice of the vocabulary; embedding lookups outside it produce
zeros and are summed across ranks; the LM head's logits are gathered on rank 0, computed by its
`linear_method`, which the platform gives it (platform/), as a linear layer's.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import divide, shard
from nanovllm.platform.context import current_platform
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

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.linear_method = current_platform().lm_head_method()

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: [num_rows, hidden] -> logits [num_rows, vocab] on rank 0 (None on the others)."""
        logits = self.linear_method.apply(self, x, None)
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
