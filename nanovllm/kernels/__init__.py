"""Triton kernels: attention on the paged KV cache (store_kv, decode, prefill/extend), the fused
layer functions (rms_norm, qk_norm_rope, silu_mul) and the sampler's race (sampling). Beside
them, the CPU's kernels in C++, built into one library and loaded by cpu_build.py (no Triton
involved): paged attention (cpu_paged_attention.cpp) and the fused layer functions
(cpu_fused.cpp), sharing cpu_kernels.h.

Each kernel lives in its own module next to a wrapper that checks shapes, strides and dtypes.
This file holds only the checks and tile rules those wrappers share, and imports nothing from
triton: `import nanovllm` must stay cheap and work where triton is absent, so callers import
the kernel modules (`nanovllm.kernels.decode_attention`, ...) lazily, where they are used.

Specialisation, and why nothing compiles after start-up: Triton compiles one variant of a kernel
per distinct key of its launch: the dtypes (and 16-byte alignment) of its pointers, its constexpr
values, and for each integer argument whether it equals 1 or divides by 16. An integer that
changes from step to step (a batch size, a token count, a block table's width) would compile new
variants in the middle of generate(), so such arguments are named in the kernel's
`do_not_specialize`; and a constexpr that depends on the batch (decode's number of splits) takes
a few values only, each launched at start-up (runner/kernel_warmup.py). Everything else a kernel
is passed is fixed by the model: head counts, strides, the vocabulary. Row and token counts reach
the kernels as the grid where they can, which Triton never specialises on.
tests/test_compile_once.py checks the keys of every launch in a generate() against start-up's.
"""
from typing import NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
# A quantised paged cache (Config.kv_cache_dtype): K/V in fp8 with per-head scales (kv_quant.py).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# tl.dot refuses operands with a dimension below 16, so query rows and head_dim pad up to it.
MIN_DOT_SIZE = 16
# Kernels keep [rows, head_dim] fp32 accumulators in registers; beyond 256 they would spill.
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634  # softmax runs on exp2, so scores are pre-multiplied by log2(e)


class RMSNormOutput(NamedTuple):
    """What an RMSNorm kernel returns (the Triton one, kernels/rms_norm.py, and the CPU's, cpu_build.py)."""
    out: torch.Tensor  # [rows, hidden]: weight * normalised row
    residual: torch.Tensor | None  # [rows, hidden]: x + residual, the stream the next layer adds to


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def previous_power_of_2(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def num_warps_for(elements: int, elements_per_warp: int, max_warps: int) -> int:
    """One warp per `elements_per_warp` elements of a program, at least 1 and at most `max_warps`,
    rounded down to a power of two: Triton refuses any other warp count on CUDA (the interpreter
    ignores it, so CPU runs never see a bad one)."""
    return previous_power_of_2(min(max_warps, max(1, elements // elements_per_warp)))


def padded_head_dim(head_dim: int) -> int:
    """tl.arange needs a power of two: head_dim is padded up and the tail masked off."""
    return max(MIN_DOT_SIZE, next_power_of_2(head_dim))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 tl.dot defaults to TF32 on NVIDIA (10-bit mantissa); fp32 callers want real fp32.
    16-bit inputs ignore the setting, so they keep the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...],
                 device: torch.device) -> None:
    """The rank, dtype and device every kernel argument must have, and a unit last stride
    (kernels address the last dimension as a dense run; the other strides are passed in)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: {', '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the query is on {device}")
    if t.size(-1) > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride(-1) == 1, got strides {t.stride()}")


def check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_dim} is not supported; allowed: 1..{MAX_HEAD_DIM}")


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype,
                      device: torch.device) -> None:
    """k_cache and v_cache: [num_blocks, block_size, num_kv_heads, head_dim], one layout for both
    (the kernels address both with one set of strides), in the model's `dtype` or both in one fp8
    dtype (a quantised cache, whose scales kv_quant.kv_cache_scales checks)."""
    check_tensor("k_cache", k_cache, 4, (dtype, *FP8_CACHE_DTYPES), device)
    check_tensor("v_cache", v_cache, 4, (k_cache.dtype,), device)
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must share shape and strides, got {tuple(k_cache.shape)} "
                         f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}")


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The attention output: `out` checked to match q (shape, dtype, device), or a new tensor."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    check_tensor("out", out, 3, (q.dtype,), q.device)
    if out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")
    return out
