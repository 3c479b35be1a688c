"""Row reductions for the kernels that work compiled and under TRITON_INTERPRET=1 alike.

tl.max, tl.sum, tl.zeros and tl.cdiv are themselves @triton.jit functions, decided at the moment
triton is imported: if anything imported triton before TRITON_INTERPRET=1 was set (transformers
does, so a test session can), they stay compiled-mode functions the interpreter cannot call. The
builtin tl.reduce is patched by the interpreter instead, and it reduces these combine
functions with numpy (it recognises them by identity), so kernels write
`tl.reduce(x, axis, MAX)` / `MIN` / `SUM` (compiled, exactly what tl.max / tl.sum
emit for fp32), `tl.full(shape, 0.0, dtype)` for zeros and `(a + b - 1) // b` for cdiv.
"""
import triton
import triton.language as tl

MAX = tl.standard._elementwise_max
MIN = tl.standard._elementwise_min
SUM = tl.standard._sum_combine


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into a streaming softmax. scores: [rows, BLOCK_N] in log2 units with
    invisible keys at -inf; v: [BLOCK_N, DIM]; m_i, l_i: [rows] running max and sum; acc: [rows, DIM]."""
    m_new = tl.maximum(m_i, tl.reduce(scores, 1, MAX))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - -inf) would be NaN
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.reduce(p, 1, SUM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
