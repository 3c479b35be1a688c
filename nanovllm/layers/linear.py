"""Linear layers shaped for tensor parallelism (Megatron style).

Column-parallel layers split the output features across ranks, row-parallel layers split the
input features and all-reduce the result. Each parameter carries a `weight_loader` that copies
this rank's shard of a checkpoint tensor into it, checking the shape, so the loader stays a
few lines. With one rank every shard is the whole tensor.

How a layer holds its weight and multiplies by it is its `linear_method` (as vLLM's
`quant_method`), which the platform gives it (platform/): F.linear on the loaded weight for the
reference; on the CPU a oneDNN-packed copy and the C++ products, kept on the method.
"""
import torch
import torch.distributed as dist
from torch import nn

from nanovllm.platform.context import current_platform
from nanovllm.utils.loader import copy_checked
from nanovllm.utils.parallel import tp_rank, tp_size


def shard(loaded: torch.Tensor, dim: int, rank: int, size: int, world: int, name: str) -> torch.Tensor:
    """This rank's slice of `loaded` along `dim`, after checking the whole is `world` slices."""
    if world == 1:
        return loaded
    if loaded.size(dim) != size * world:
        raise ValueError(f"checkpoint tensor {name} has size {loaded.size(dim)} in dim {dim}; "
                         f"expected {size * world}")
    return loaded.narrow(dim, rank * size, size)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def _expect_shards(layer: nn.Module, shard_ids: tuple) -> None:
    """Tell the loader which checkpoint pieces fill a fused layer's parameters, so that one
    missing piece is reported by name."""
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.shard_ids = shard_ids


class LinearBase(nn.Module):

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim  # the weight dimension split across ranks (None = replicated)
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.linear_method = current_platform().linear_method()
        self.linear_method.create_weights(self, input_size, output_size, bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
        if self.tp_dim is not None:
            loaded = shard(loaded, self.tp_dim, self.tp_rank, param.size(self.tp_dim), self.tp_size, name)
        copy_checked(param.data, loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, None)


class ColumnParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, tp_size(), "output_size"), bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        _expect_shards(self, tuple(range(len(output_sizes))))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        loaded = shard(loaded, 0, self.tp_rank, size, self.tp_size, name)
        copy_checked(param.data.narrow(0, offset, size), loaded, name)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, size, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, size, "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)
        _expect_shards(self, ("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        loaded = shard(loaded, 0, self.tp_rank, size, self.tp_size, name)
        copy_checked(param.data.narrow(0, offset, size), loaded, name)


class RowParallelLinear(LinearBase):

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, tp_size(), "input_size"), output_size, bias, 1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
        if param.dim() == 1:  # the bias is added once, on the reduced output: not split
            copy_checked(param.data, loaded, name)
        else:
            super().weight_loader(param, loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only rank 0 adds the bias, so the all-reduce counts it once.
        y = self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
