"""The CPU's linear method: weights held in float32 where half-precision matmul is emulated, packed
once for oneDNN, and, with the C++ kernels (kernels/cpu_build.py), the few-row product, the AMX
product and the few-row product over a half-precision copy (HalfRows), each on the method's own
per-layer state. `cpu_linear` is the product over whichever of them a layer has.
"""
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.cpu_build import AMX_HEAD_MIN_ROWS, FusedKernels
from nanovllm.platform.base import LinearMethod
from nanovllm.platform.torch import linear_in_weight_dtype

# torch reports whether oneDNN has a native kernel for these (AVX-512 BF16/FP16 or AMX); without
# one, a half-precision matmul is emulated, about 10x slower than float32 on an AVX2-only Zen 3.
NATIVE_HALF_MATMUL_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
# The batch size oneDNN picks the packed layout for. Measured on a 2-core Zen 4 (3072x512 weight):
# packed for 64 rows ran as fast as packed for 1 at batch 1 and 1.6x faster at 16 rows in float32.
PACK_BATCH_HINT = 64
# Products on a packed weight are oneDNN's, which builds and caches a primitive per row count.
# Steps bring a new row count nearly every step, and caching one per count grew a batch job's
# memory by ~50 MB over 25,000 requests (tests/test_batch_scale.py), so packed products are
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


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively (float32 always does)."""
    check = NATIVE_HALF_MATMUL_CHECKS.get(dtype)
    if check is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the check: assume emulated, the safe side
        return False


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
    layer's weight and bias, for a layer that holds float32 for its matmuls
    (hold_matmul_weights_in_float32: a CPU without native bf16 matmul, e.g. AVX2-only). A decode
    step of a few rows is bound by reading the weight, so its bf16 rows read half of float32's
    bytes this way; the copy costs half the float32 weight's memory (none for a tied head, which
    reads the embedding's)."""

    def __init__(self, product: Callable, weight: torch.Tensor, bias: torch.Tensor | None):
        self.max_rows, self.dtype = product.max_rows, weight.dtype
        self._product, self.weight, self.bias = product, weight, bias

    @classmethod
    def for_layer(cls, layer: nn.Module, method: "CpuLinearMethod", kernels: FusedKernels) -> "HalfRows | None":
        """The copy for `layer` where it holds float32 for a half dtype the kernels multiply, on one
        tensor-parallel rank, else None."""
        held = method.held_dtype
        product = None if held is None else kernels.few_rows_linear(held)
        if product is None or layer.weight.dtype != torch.float32 or getattr(layer, "tp_size", 1) != 1:
            return None
        bias = getattr(layer, "bias", None)
        weight = method.held_weight  # a tied head's: the embedding's own tensor, no copy
        if weight is None:
            weight = layer.weight.detach().to(held)
        return cls(product, weight, None if bias is None else bias.detach().to(held))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x, self.weight, self.bias)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               packed: torch.Tensor | None = None, few_rows: Callable | None = None,
               amx: Callable | None = None, half_rows: HalfRows | None = None) -> torch.Tensor:
    """F.linear computed in the weight's dtype and returned in x's (platform/torch.py
    linear_in_weight_dtype), on the fastest product the layer has. With `packed` (the same weight in
    oneDNN's blocked layout) the product is oneDNN's on it instead of a matmul that reorders the
    plain weight on every call, at packed_rows(rows) rows (zero rows padding the difference). With
    `few_rows` (the CPU's few-row product, kernels/cpu_linear.cpp) up to its max_rows rows of x in
    the weight's dtype go to it instead: a decode step of a few sequences, which reads the weight.
    With `amx` (the weight packed for the CPU's AMX product, kernels/cpu_amx_linear.cpp, on a CPU
    with AMX) the rows above those, from its min_rows up to its max_rows, go to it: a bf16 decode
    step of up to 256 sequences, float32 rows of any count. Half-precision rows over float32
    weights go to the few-row product as float32 (as to the packed one), or, with `half_rows`
    (HalfRows) and up to its max_rows, to the product over the half-precision copy."""
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
    return linear_in_weight_dtype(x, weight, bias)


class CpuLinearMethod(LinearMethod):
    """A linear layer's weight on the CPU: what it held before hold_matmul_weights_in_float32 (if
    that ran), its oneDNN-packed copy and the C++ kernels' products (None without the kernels)."""

    def __init__(self, kernels: FusedKernels | None):
        self.kernels = kernels
        self.held_dtype: torch.dtype | None = None  # the dtype a float32-held weight was loaded in
        self.held_weight: torch.Tensor | None = None  # a tied weight's other holder, in that dtype
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout
        self.few_rows: Callable | None = None  # the few-row product (FewRowsLinear)
        self.amx: Callable | None = None  # the weight packed for the AMX product (AmxProduct)
        self.half_rows: HalfRows | None = None  # the few-row product over a half copy of a float32-held weight

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.packed = pack_weight(layer.weight)
        if self.kernels is None:
            return
        self.few_rows = self.kernels.few_rows_linear(layer.weight.dtype)
        self.amx = self.kernels.amx_linear(layer.weight)
        if self.few_rows is not None and self.amx is not None and \
                self.amx.takes_every_row_count_above(self.few_rows.max_rows):
            self.packed = None  # the oneDNN copy would multiply no rows (float32 on AMX): free it
        self.half_rows = HalfRows.for_layer(layer, self, self.kernels)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_linear(x, layer.weight, bias, self.packed, self.few_rows, self.amx, self.half_rows)


class CpuLmHeadMethod(CpuLinearMethod):
    """An LM head's: a float32 head's AMX product from AMX_HEAD_MIN_ROWS rows only (bf16 logits stay
    on oneDNN; kernels/cpu_build.py says why), and the oneDNN copy kept whatever AMX takes."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.packed = pack_weight(layer.weight)
        if self.kernels is None:
            return
        self.few_rows = self.kernels.few_rows_linear(layer.weight.dtype)
        self.half_rows = HalfRows.for_layer(layer, self, self.kernels)
        if layer.weight.dtype == torch.float32:
            self.amx = self.kernels.amx_linear(layer.weight, min_rows=AMX_HEAD_MIN_ROWS)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout, which cpu_linear then multiplies by
    instead of the plain weight; None where torch has no oneDNN, and for a dtype oneDNN does not
    multiply natively here (those stay on F.linear).

    Measured on a 2-core AMD EPYC (Zen 4, AVX-512 with bf16), this model's shapes, medians
    (docs/BENCHMARKS.md, "CPU kernels"): float32 at 16 rows 1.15-2.1x F.linear (MKL on the plain
    weight), bf16 at 1-16 rows 1.2-1.9x; 0.75-1.3x at 1 row in float32. The plain weight is kept
    (the embedding may share it, the loader's checks and the C++ products read it): the weights'
    memory doubles (docs/BENCHMARKS.md, "Memory").
    """
    if _LINEAR_POINTWISE is None or weight.dim() != 2:
        return None
    if not native_half_matmul(weight.dtype) or weight.dtype == torch.float16:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def hold_matmul_weights_in_float32(model: nn.Module) -> int:
    """Convert the parameters of every layer with a CPU linear method to float32; returns how many.

    The values are unchanged (every half-precision value is exact in float32); activations stay
    in the model's dtype and each matmul's result is rounded back to it, as a native kernel's
    float32 accumulation would be. A weight shared with another module (a tied LM head and
    embedding) gets a float32 copy of its own, so the embedding keeps returning the model's dtype.
    Each converted layer's method records what it held (`held_dtype`: its few-row product may read
    a copy in that dtype, half the bytes: HalfRows), and for a shared weight the other module's
    tensor (`held_weight`), which that copy can be.
    """
    uses = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    converted = 0
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if not isinstance(method, CpuLinearMethod):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.float32:
                continue
            method.held_dtype = param.dtype
            if uses[id(param)] > 1:
                if name == "weight":
                    method.held_weight = param.detach()
                setattr(module, name, nn.Parameter(param.detach().float(), requires_grad=False))
            else:
                param.data = param.data.float()
            converted += 1
    return converted
