"""Linear layers shaped for tensor parallelism (Megatron style).

Column-parallel layers split the output features across ranks, row-parallel layers split the
input features and all-reduce the result. Each parameter carries a `weight_loader` that copies
this rank's shard of a checkpoint tensor into it, checking the shape, so the loader stays a
few lines. With one rank every shard is the whole tensor.
"""
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

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


# Products on a packed weight (utils/cpu.py) are oneDNN's, which builds and caches a primitive per
# row count. Steps bring a new row count nearly every step, and caching one per count grew a batch
# job's memory by ~50 MB over 25,000 requests (tests/test_batch_scale.py), so packed products are
# limited to a bounded set of row counts (packed_rows): decode-sized ones exactly (up to
# EXACT_PACKED_ROWS; 1-3 rows padded with zero rows to MIN_PACKED_ROWS, which oneDNN multiplies
# 7-12% faster than one row on a Zen 4), and large prefill chunks (BUCKETED_PACKED_ROWS or more)
# padded to multiples of an eighth of the power of two below them (8 buckets per doubling, under
# 1/8 padding; float32 prefill GEMMs ~25% faster packed than F.linear). Row counts between the two
# go to F.linear on the plain weight.
MIN_PACKED_ROWS = 4
EXACT_PACKED_ROWS = 64
BUCKETED_PACKED_ROWS = 1024
_LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


def packed_rows(rows: int) -> int | None:
    """The row count a packed product of `rows` rows is computed at (>= rows), or None for F.linear."""
    if rows <= EXACT_PACKED_ROWS:
        return max(rows, MIN_PACKED_ROWS)
    if rows < BUCKETED_PACKED_ROWS:
        return None
    step = (1 << (rows.bit_length() - 1)) // 8
    return -(-rows // step) * step


class HalfRows:
    """The few-row product (kernels/cpu_build.py FewRowsLinear) over a half-precision copy of a
    layer's weight and bias, for a layer that holds float32 for its matmuls (utils/cpu.py
    hold_matmul_weights_in_float32: a CPU without native bf16 matmul, e.g. AVX2-only). A decode
    step of a few rows is bound by reading the weight, so its bf16 rows read half of float32's
    bytes this way; the copy costs half the float32 weight's memory (none for a tied head, which
    reads the embedding's)."""

    def __init__(self, product: Callable, weight: torch.Tensor, bias: torch.Tensor | None):
        self.max_rows, self.dtype = product.max_rows, weight.dtype
        self._product, self.weight, self.bias = product, weight, bias

    @classmethod
    def for_layer(cls, layer: nn.Module, kernels) -> "HalfRows | None":
        """The copy for `layer` where it holds float32 for a half dtype the kernels multiply, on one
        tensor-parallel rank, else None."""
        held = getattr(layer, "held_dtype", None)
        product = None if held is None else kernels.few_rows_linear(held)
        if product is None or layer.weight.dtype != torch.float32 or getattr(layer, "tp_size", 1) != 1:
            return None
        bias = getattr(layer, "bias", None)
        weight = getattr(layer, "held_weight", None)  # a tied head's: the embedding's own tensor, no copy
        if weight is None:
            weight = layer.weight.detach().to(held)
        return cls(product, weight, None if bias is None else bias.detach().to(held))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None, few_rows: Callable | None = None,
           amx: Callable | None = None, half_rows: HalfRows | None = None) -> torch.Tensor:
    """F.linear computed in the weight's dtype and returned in x's. The two differ only where
    half-precision layers keep float32 weights (utils/cpu.py: a CPU that emulates bf16/fp16
    matmul, ~10x slower there than float32); everywhere else this is F.linear. With `packed`
    (the same weight in oneDNN's blocked layout, utils/cpu.py pack_linear_weights) the product
    is oneDNN's on it instead of a matmul that reorders the plain weight on every call, at
    packed_rows(rows) rows (zero rows padding the difference). With `few_rows` (the CPU's
    few-row product, kernels/cpu_linear.cpp, set by enable_cpu) up to its max_rows rows of x in the
    weight's dtype go to it instead: a decode step of a few sequences, which reads the weight. With
    `amx` (the weight packed for the CPU's AMX product, kernels/cpu_amx_linear.cpp, set by
    enable_cpu on a CPU with AMX) the rows above those, from its min_rows up to its max_rows, go to
    it: a bf16 decode step of up to 256 sequences, float32 rows of any count. Half-precision rows
    over float32 weights go to the few-row product as float32 (as to the packed one), or, with
    `half_rows` (HalfRows) and up to its max_rows, to the product over the half-precision copy."""
    if x.dim() == 2 and x.size(0) > 0:
        if half_rows is not None and x.dtype == half_rows.dtype and x.size(0) <= half_rows.max_rows:
            return half_rows(x)
        if few_rows is not None and x.size(0) <= few_rows.max_rows:
            y = few_rows(x if x.dtype == weight.dtype else x.to(weight.dtype), weight, bias)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if amx is not None and x.dtype == weight.dtype and amx.min_rows <= x.size(0) <= amx.max_rows:
            return amx(x, bias)
    padded = None if packed is None else packed_rows(x.numel() // x.size(-1))
    if padded is not None:
        flat = x if x.dim() == 2 else x.reshape(-1, x.size(-1))
        if flat.dtype != weight.dtype:
            flat = flat.to(weight.dtype)
        rows = flat.size(0)
        if padded != rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        y = _LINEAR_POINTWISE(flat, packed, bias, "none", [], "")
        if padded != rows:
            y = y[:rows]
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], y.size(-1))
        return y if y.dtype == x.dtype else y.to(x.dtype)
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


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
    computes_in_weight_dtype = True  # its weights may be held in float32 (see linear())
    packed_weight: torch.Tensor | None = None  # set on CPU after loading (utils/cpu.py pack_linear_weights)
    few_rows: Callable | None = None  # the CPU's few-row product (see linear()), set by enable_cpu
    amx: Callable | None = None  # the weight packed for the CPU's AMX product (see linear()), set by enable_cpu
    half_rows: HalfRows | None = None  # the few-row product over a bf16 copy of a float32-held weight (enable_cpu)

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim = tp_dim  # the weight dimension split across ranks (None = replicated)
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str) -> None:
        if self.tp_dim is not None:
            loaded = shard(loaded, self.tp_dim, self.tp_rank, param.size(self.tp_dim), self.tp_size, name)
        copy_checked(param.data, loaded, name)

    def enable_cpu(self, kernels) -> None:
        self.few_rows = kernels.few_rows_linear(self.weight.dtype)
        self.amx = kernels.amx_linear(self.weight)
        if self.few_rows is not None and self.amx is not None and \
                self.amx.takes_every_row_count_above(self.few_rows.max_rows):
            self.packed_weight = None  # the oneDNN copy would multiply no rows (float32 on AMX): free it
        self.half_rows = HalfRows.for_layer(self, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.few_rows, self.amx, self.half_rows)


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
        y = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.packed_weight, self.few_rows,
                   self.amx, self.half_rows)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
