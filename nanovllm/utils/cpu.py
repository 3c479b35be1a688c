"""The CPU's weight layouts, applied once when a model runner starts there: whether half-precision
layers do their matmuls in float32, and the linear layers' weights packed for oneDNN.

The process-wide settings (threads, malloc) and the host's cores and memory are the CPU
device's (platform/device.py, platform/device_host.py). It changes nothing on CUDA.
"""
import torch
from torch import nn

# torch reports whether oneDNN has a native kernel for these (AVX-512 BF16/FP16 or AMX); without
# one, a half-precision matmul is emulated, about 10x slower than float32 on an AVX2-only Zen 3.
NATIVE_HALF_MATMUL_CHECKS = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
# The batch size oneDNN picks the packed layout for. Measured on a 2-core Zen 4 (3072x512 weight):
# packed for 64 rows ran as fast as packed for 1 at batch 1 and 1.6x faster at 16 rows in float32.
PACK_BATCH_HINT = 64


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively (float32 always does)."""
    check = NATIVE_HALF_MATMUL_CHECKS.get(dtype)
    if check is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the check: assume emulated, the safe side
        return False


def hold_matmul_weights_in_float32(model: nn.Module) -> int:
    """Convert the parameters of every layer that computes in its weight's dtype
    (`computes_in_weight_dtype`, see layers/linear.py linear()) to float32; returns how many.

    The values are unchanged (every half-precision value is exact in float32); activations stay
    in the model's dtype and each matmul's result is rounded back to it, as a native kernel's
    float32 accumulation would be. A weight shared with another module (a tied LM head and
    embedding) gets a float32 copy of its own, so the embedding keeps returning the model's dtype.
    Each converted layer's `held_dtype` says what it held (its enable_cpu may keep a copy in that
    dtype for the few-row product, which reads half the bytes: layers/linear.py HalfRows), and a
    shared weight's `held_weight` is the other module's tensor, which that copy can be.
    """
    uses = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    converted = 0
    for module in model.modules():
        if not getattr(module, "computes_in_weight_dtype", False):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype == torch.float32:
                continue
            module.held_dtype = param.dtype
            if uses[id(param)] > 1:
                if name == "weight":
                    module.held_weight = param.detach()
                setattr(module, name, nn.Parameter(param.detach().float(), requires_grad=False))
            else:
                param.data = param.data.float()
            converted += 1
    return converted


def pack_linear_weights(model: nn.Module) -> int:
    """Give every layer that computes in its weight's dtype (`computes_in_weight_dtype`: the
    linear layers and the LM head, layers/linear.py linear()) a `packed_weight`: its weight
    reordered once into oneDNN's blocked layout, which linear() then multiplies by instead of
    the plain weight. Returns how many were packed: none where torch has no oneDNN, and none for
    a dtype oneDNN does not multiply natively here (those stay on F.linear).

    Measured on a 2-core AMD EPYC (Zen 4, AVX-512 with bf16), this model's shapes, medians
    (docs/BENCHMARKS.md, "CPU kernels"): float32 at 16 rows 1.15-2.1x F.linear (MKL on the plain
    weight), bf16 at 1-16 rows 1.2-1.9x; 0.75-1.3x at 1 row in float32. The plain weight is kept
    (the embedding may share it, and the loader's checks read it): the weights' memory doubles.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not getattr(module, "computes_in_weight_dtype", False) or weight is None or weight.dim() != 2:
            continue
        if weight.device.type != "cpu" or not native_half_matmul(weight.dtype) or weight.dtype == torch.float16:
            continue
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        packed += 1
    return packed
