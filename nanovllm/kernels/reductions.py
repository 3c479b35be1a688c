"""Row reductions for the kernels that work compiled and under TRITON_INTERPRET=1 alike.

tl.max, tl.sum, tl.zeros and tl.cdiv are themselves @triton.jit functions, decided at the moment
triton is imported: if anything imported triton before TRITON_INTERPRET=1 was set (transformers
does, so a test session can), they stay compiled-mode functions the interpreter cannot call. The
builtin tl.reduce is patched by the interpreter instead, and it reduces these two combine
functions with numpy (it recognises them by identity), so kernels write
`tl.reduce(x, axis, MAX)` / `tl.reduce(x, axis, SUM)` (compiled, exactly what tl.max / tl.sum
emit for fp32), `tl.full(shape, 0.0, dtype)` for zeros and `(a + b - 1) // b` for cdiv.
"""
import triton.language as tl

MAX = tl.standard._elementwise_max
SUM = tl.standard._sum_combine
