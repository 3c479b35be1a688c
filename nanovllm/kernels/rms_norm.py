"""RMSNorm, optionally after the residual add that precedes it, in one pass over each row.

Owns one Triton kernel and its checking wrapper. It computes exactly what platform/torch.py's
torch functions compute, cast for cast (they are its oracle and the CPU path): the residual sum
in the input dtype, the statistics in float32, the normalised row rounded to the input dtype
before the weight multiplies it. It knows nothing of layers or models.

Design: a program takes BLOCK_ROWS whole rows in one [BLOCK_ROWS, hidden] tile (hidden sizes are
a few thousand), so each row is read once and written once (twice with the residual): one or two
rows per program for real models, dozens for tiny test models (fewer programs for the CPU
interpreter to run one after another). The row count changes every step, so it is excluded from
integer specialisation (see kernels/__init__.py): one compiled variant serves every batch.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import SUPPORTED_DTYPES, RMSNormOutput, check_tensor, next_power_of_2, num_warps_for
from nanovllm.kernels.reductions import SUM

# One tile holds whole rows; past this a row's fp32 copy would not fit in registers.
MAX_HIDDEN = 16384
# Elements per program: rows are added to a tile up to this (at least one row).
ELEMENTS_PER_PROGRAM = 2048
# Threads per tile: enough that each holds a few dozen elements of the widest rows.
ELEMENTS_PER_WARP = 512
MAX_WARPS = 16


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out,
    rows, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (cols < hidden)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK_ROWS, BLOCK], the input dtype
    dtype = x.dtype
    if HAS_RESIDUAL:
        # The new residual stream, rounded to the input dtype as torch's `x + residual` is.
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.reduce(xf * xf, 1, SUM) / hidden + eps)[:, None]  # [BLOCK_ROWS, 1]
    normed = (xf * inv_rms).to(dtype).to(tl.float32)  # torch rounds before the weight multiplies
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    check_tensor(name, t, 2, (like.dtype,), like.device)
    if t.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(like.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> RMSNormOutput:
    """weight * rms_normalise(x) per row; with `residual`, of x + residual, which is returned too.

    x, residual: [rows, hidden] (row strides free, stride(-1) == 1); weight: [hidden], x's dtype.
    `out` and `residual_out` are written when given (they may not alias the inputs), else allocated.
    """
    device = x.device
    check_tensor("x", x, 2, SUPPORTED_DTYPES, device)
    rows, hidden = x.shape
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is not supported; allowed: 1..{MAX_HIDDEN}")
    check_tensor("weight", weight, 1, (x.dtype,), device)
    if weight.size(0) != hidden:
        raise ValueError(f"weight has {weight.size(0)} elements for rows of {hidden}")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"eps={eps!r} is not allowed; it must be a float > 0")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _check_rows("out", out, x)
    if residual is not None:
        _check_rows("residual", residual, x)
        residual_out = torch.empty_like(out) if residual_out is None else residual_out
        _check_rows("residual_out", residual_out, x)
    elif residual_out is not None:
        raise ValueError("residual_out is given without a residual to add")
    if rows == 0:
        return RMSNormOutput(out, residual_out)
    block = next_power_of_2(hidden)
    block_rows = max(1, ELEMENTS_PER_PROGRAM // block)
    # Without a residual the pointers are never read: any tensor of the right type will do.
    res_in, res_out = (residual, residual_out) if residual is not None else (x, out)
    _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x, res_in, weight, out, res_out,
        x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
        rows, hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK=block,
        num_warps=num_warps_for(block_rows * block, ELEMENTS_PER_WARP, MAX_WARPS),
    )
    return RMSNormOutput(out, residual_out)
