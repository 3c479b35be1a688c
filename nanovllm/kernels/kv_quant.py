"""The FP8 KV cache's quantise and dequantise steps as @triton.jit helpers, for every kernel that
writes or reads the paged cache (store_kv, decode_attention, prefill_attention, and any fused
kernel that stores K/V). They do, in registers, exactly what attention/kv_quant.py does in torch
(the reference): store `clamp(x / scale, -FP8_MAX, FP8_MAX)` rounded to fp8, read back
`float32(stored) * scale` in the model's dtype, with one float32 scale per (layer, KV head).
No kernels here, so nothing to launch or test on its own; the wrapper checks live beside.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import FP8_CACHE_DTYPES, check_tensor


@triton.jit
def quantize_kv(x, scale, cache_ptr, FP8_MAX: tl.constexpr):
    """x (any shape, model dtype) / scale (broadcastable, float32) as cache_ptr's fp8 element type.
    div_rn: an IEEE division, as torch's, so both round the same quotient to the same fp8 value."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return y.to(cache_ptr.dtype.element_ty)


@triton.jit
def dequantize_kv(x, scale, like):
    """Stored fp8 x (any shape) times its float32 scale, in the dtype of `like` (the query) for tl.dot.
    Through float32 first: exact for fp8, and the interpreter's direct fp8 -> fp16 cast is wrong."""
    return (x.to(tl.float32) * scale).to(like.dtype)


def kv_cache_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    num_kv_heads: int, model_dtype: torch.dtype) -> tuple[bool, float, torch.Tensor, torch.Tensor]:
    """Check a kernel's cache dtype against its scales and return (quantised, FP8_MAX, k_scale,
    v_scale): an fp8 cache needs both scales, [num_kv_heads] float32 on the cache's device; a cache
    in the model's dtype takes none (its scale pointers get the cache, never read)."""
    quantized = k_cache.dtype in FP8_CACHE_DTYPES
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for an fp8 cache; this cache is {k_cache.dtype}")
        return False, 0.0, k_cache, k_cache
    if k_scale is None or v_scale is None:
        raise ValueError(f"an {k_cache.dtype} cache needs k_scale and v_scale ([num_kv_heads] float32)")
    if model_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"an fp8 cache holds K/V of a float16/bfloat16/float32 model, not {model_dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_tensor(name, scale, 1, (torch.float32,), k_cache.device)
        if scale.size(0) != num_kv_heads:
            raise ValueError(f"{name} has {scale.size(0)} entries for {num_kv_heads} KV heads")
    return True, float(torch.finfo(k_cache.dtype).max), k_scale, v_scale
