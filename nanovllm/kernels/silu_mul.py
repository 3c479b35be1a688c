"""SiLU-and-mul, SwiGLU's activation: silu(gate) * up over the merged gate_up projection.

Owns one Triton kernel and its checking wrapper. It computes what platform/torch.py's torch
function computes, cast for cast (its oracle and the CPU path): silu in float32 rounded to the
input dtype, then the product rounded again. It knows nothing of layers.

Design: grid (row tiles, column tiles); a program reads [BLOCK_ROWS, BLOCK] gate and up values and
writes as many outputs, so the [rows, 2 * width] input is read once: a row or two per program
for real models, dozens for tiny test models (fewer programs for the CPU interpreter). The row
count changes every step, so it is excluded from integer specialisation (see kernels/__init__.py).
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels import SUPPORTED_DTYPES, check_tensor, next_power_of_2

# Columns per program: wide enough to amortise a program, small enough that a decode batch of a
# few rows still spreads over the GPU (width 3072 -> 3 programs per row).
MAX_BLOCK = 1024
# Elements per program: rows are added to a tile up to this (at least one row).
ELEMENTS_PER_PROGRAM = 2048


@triton.jit(do_not_specialize=["rows"])
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    stride_x, stride_out, rows, width,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < rows) & (cols < width)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # torch's F.silu rounds here
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, 2 * width] (gate | up; row stride free, stride(-1) == 1) -> [rows, width]."""
    device = x.device
    check_tensor("x", x, 2, SUPPORTED_DTYPES, device)
    rows, double = x.shape
    if double % 2:
        raise ValueError(f"x has {double} columns; it must hold gate and up halves of equal width")
    width = double // 2
    if out is None:
        out = torch.empty(rows, width, dtype=x.dtype, device=device)
    check_tensor("out", out, 2, (x.dtype,), device)
    if out.shape != (rows, width):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(rows, width)}")
    if rows == 0 or width == 0:
        return out
    block = min(MAX_BLOCK, next_power_of_2(width))
    block_rows = max(1, ELEMENTS_PER_PROGRAM // block)
    _silu_and_mul_kernel[(triton.cdiv(rows, block_rows), triton.cdiv(width, block))](
        x, out, x.stride(0), out.stride(0), rows, width, BLOCK_ROWS=block_rows, BLOCK=block,
    )
    return out
