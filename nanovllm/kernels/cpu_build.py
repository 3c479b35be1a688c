"""Builds and loads the CPU kernels once per machine: paged attention (cpu_paged_attention.cpp),
the fused elementwise kernels (cpu_fused.cpp), few-row linear products (cpu_linear.cpp), bf16
products on AMX tiles (cpu_amx_linear.cpp, where the CPU has AMX), bf16 prefill attention on AMX
tiles (cpu_amx_attention.cpp, called by the paged kernel) and a decode step through all decoder
layers built of those (cpu_decode_layers.cpp), one library sharing cpu_kernels.h.

The source is plain C++ with a C ABI (pointers and integers, no torch headers), so g++ builds it
in about a second, where a torch C++ extension (torch.utils.cpp_extension) spends ~30-60 s of a
shared 2-core machine on torch's headers and setuptools' import alone adds to every start-up.
It is compiled with -march=native for the CPU it runs on and OpenMP, linked by soname to the
libgomp torch already loaded (one thread pool), and cached under nanovllm's cache directory
(utils/paths.py), keyed by the source, the flags, the compiler and the CPU's flags: later
processes only load it (milliseconds). A machine without a C++ compiler, or a failed build,
gets a reason string instead, which the attention backend choice logs before falling back to the
torch backend.

Owns the build, the cache and the ctypes bindings (`PagedAttentionKernel`, `FusedKernels`,
`FewRowsLinear`, `AmxProduct`); the attention tensors' checks and metadata live with the backend
(platform/cpu/attention.py), and the CPU platform (platform/cpu/) calls the fused kernels with the
layers' tensors, unchecked.
"""
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from nanovllm.kernels import RMSNormOutput
from nanovllm.utils.paths import cache_dir

logger = logging.getLogger("nanovllm")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_paged_attention.cpp", "cpu_fused.cpp",
                                                                 "cpu_linear.cpp", "cpu_amx_linear.cpp",
                                                                 "cpu_amx_attention.cpp", "cpu_decode_layers.cpp",
                                                                 "cpu_greedy_head.cpp"))
HEADERS = (Path(__file__).with_name("cpu_kernels.h"),)
# -march=native: AVX-512/AVX2 as this CPU has them (the library is cached per CPU flags).
# -fopenmp: the (sequence, KV head, query tile) loop runs on torch's OpenMP pool.
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
ABI_VERSION = 7  # nanovllm_paged_attention_abi() of a library this module can call
BUILD_TIMEOUT_S = 120  # a build takes ~1 s alone; a loaded machine may stretch it
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The dtypes the few-row product takes (its most rows of x: cpu_linear.cpp's MAX_ROWS). Against
# oneDNN's packed product (a whole model's products in a row, 2 threads, AMD EPYC Zen 4;
# docs/BENCHMARKS.md, CPU kernels): float32 ~20% faster at 1 row, ~10% at 2, ~5% slower at 3-4;
# bfloat16 35-40% faster at 1-3 rows, ~5% at 4. Float32 takes 3-4 rows too: with them every decode
# step of up to 4 sequences can run as one call (platform/cpu/decode.py), which saves ~1 ms a step of
# Python (real-proportion model) where the slower products cost ~0.4 ms.
# How many rows it takes the library says (nanovllm_few_rows_supported): 4, or 128 for float32 in
# an AVX2-only build (cpu_linear.cpp many_rows, faster than oneDNN there up to ~128 rows).
FEW_ROWS_DTYPES = (torch.float32, torch.bfloat16)
# The most rows the AMX product takes (cpu_amx_linear.cpp): decode steps of up to 256 sequences.
# bfloat16: on a 2-vCPU Intel Xeon with AMX, after a 24 MB read (an attention layer's), the real
# model's layer shapes took 0.45-0.75x oneDNN's packed time at 16-64 rows, 0.6-0.9x at 128-256, and
# were level at 512 (docs/BENCHMARKS.md, CPU kernels); prefill chunks on it ran 0.91x
# end to end. float32 (bf16x3) weights of AMX_PREFILL_MIN_K columns or more take every row count,
# prefill chunks too (ANY_ROWS), where oneDNN's float32 products run at the FMAs' peak and bf16x3
# on AMX tiles beyond it: real model (K 512 and 1,536), 64 prompts, in one process, +8.6% end to end
# (same machine); so such layers keep no oneDNN copy (CpuLinearMethod). With
# fewer columns a tile of sums has too few K steps to pay for its set-up: the tiny model's (K 128)
# prefill chunks ran 0.92x.
# The bf16 LM head's logits (32,000 columns) stay on oneDNN: level at 64 rows, slower above; its
# greedy steps of AMX_GREEDY_HEAD_MIN_ROWS rows or more take their tokens from AMX tiles without
# the logits (AmxGreedyHead: 0.6-0.9x oneDNN's product and argmax at 16-256 rows from memory),
# fewer rows from the int8 greedy head (GreedyHead: level at 16 rows, 0.55-0.65x at 1-4 rows of the
# few-row product and argmax; docs/BENCHMARKS.md, CPU kernels). The float32
# one takes it from AMX_HEAD_MIN_ROWS rows: its three bf16 parts are 1.5x the float32 weight's
# bytes, and below 64 rows, where reading the 65 MB weight bounds the product, that was slower than
# oneDNN (0.87-0.89x at 16-32 rows, 1.07x at 64, 1.3-1.7x at 128-256).
AMX_MAX_ROWS = 256
ANY_ROWS = 1 << 62  # more rows than any step has
AMX_PREFILL_MIN_K = 512
AMX_HEAD_MIN_ROWS = 64
AMX_GREEDY_HEAD_MIN_ROWS = 16
AMX_TILE_ROWS, AMX_TILE_K, AMX_PAIR_COLUMNS = 16, 32, 32
GREEDY_HEAD_CHUNK = 64  # vocabulary rows a panel of cpu_greedy_head.cpp (its CHUNK)
GREEDY_HEAD_DTYPES = (torch.float32, torch.bfloat16)  # of its head and of the rows it takes
CPUINFO = "/proc/cpuinfo"
# NANOVLLM_CPU_ISA builds the kernels for less than this CPU has, as another x86 CPU would build
# them (its paths run here: to try them, or to compare engines capped alike, benchmarks/
# vs_vllm_cpu.py --isa-cap): name -> (flags after CXX_FLAGS, the /proc/cpuinfo flags its code needs).
# The code tests only __AVX512F__, __AVX512BF16__, __AVX512VNNI__, __AVX2__ and AMX's macros, so the
# generic x86-64 levels stand for the CPUs of each class.
CPU_ISA_ENV = "NANOVLLM_CPU_ISA"
CPU_ISAS = {
    "native": ((), set()),  # everything this CPU has (AMX where present)
    # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4) has AVX512-VNNI too.
    "avx512_bf16": (("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
                    {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}),
    "avx512": (("-march=x86-64-v4",), {"avx512f", "avx512bw", "avx512dq", "avx512vl"}),
    "avx2": (("-march=x86-64-v3",), {"avx2", "fma", "bmi2"}),
}

_loaded: "ctypes.CDLL | str | None" = None  # the library, or why there is none; None: not tried yet


class PagedAttentionKernel:
    """The loaded library's `nanovllm_paged_attention`, called with tensors."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        fn = library.nanovllm_paged_attention
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32, i32, i32, i32, i32, ctypes.c_float, i32,
                       i64, i64, i64, i64, i32]
        fn.restype = i32
        self._fn = fn
        self._amx = library.nanovllm_paged_attention_amx
        self._amx.argtypes = [i32]
        self._amx.restype = i32
        self._amx_takes = library.nanovllm_amx_prefill_takes
        self._amx_takes.argtypes = [i32, i32]
        self._amx_takes.restype = i32

    def use_amx(self, enable: bool | None = None) -> bool:
        """Whether bfloat16 prefill tiles go to AMX (cpu_amx_attention.cpp; on by default where the
        CPU has it) or to the AVX-512 path: for tests and A/B runs; None only asks. Returns the
        setting now, False where AMX is missing. One setting for the process (the library is loaded
        once)."""
        return bool(self._amx(-1 if enable is None else int(enable)))

    def amx_prefill(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether prefill tiles of this cache dtype and these shapes run on AMX here now."""
        return dtype == torch.bfloat16 and self.use_amx() and bool(self._amx_takes(head_dim, block_size))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor, k_len: torch.Tensor,
                 scale: float, q_tile: int) -> None:
        """out[q_start[s]:q_start[s] + q_len[s]] = attention of those rows of q over the first k_len[s]
        tokens of sequence s in the cache (bottom-right causal). q/out [rows, num_heads, head_dim]
        with unit stride in head_dim; caches [num_blocks, block_size, num_kv_heads, head_dim]
        contiguous; block_tables [num_seqs, width] int32 with unit stride in width; q_start, q_len,
        k_len [num_seqs] int32 contiguous. All on the CPU; the caller checks (the C++ does not).
        Runs on torch.get_num_threads() threads, the count torch's own ops use in this thread."""
        num_heads, head_dim = q.shape[1:]
        _, block_size, num_kv_heads, _ = k_cache.shape
        rc = self._fn(DTYPE_CODES[q.dtype], q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      block_tables.data_ptr(), block_tables.stride(0), q_start.data_ptr(), q_len.data_ptr(),
                      k_len.data_ptr(), q_len.numel(), num_heads, num_kv_heads, head_dim, block_size, scale, q_tile,
                      q.stride(0), q.stride(1), out.stride(0), out.stride(1), torch.get_num_threads())
        assert rc == 0, f"nanovllm_paged_attention returned {rc}"


class FewRowsLinear:
    """x @ weight.T (+ bias) for 1..max_rows rows of x in weight's dtype (cpu_linear.cpp), the
    product platform/cpu/linear.py cpu_linear() takes at decode steps of a few sequences (of up to
    128 in float32 on an AVX2-only build)."""

    def __init__(self, fn, max_rows: int):
        self._fn = fn
        self.max_rows = max_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, K] (rows <= max_rows), weight [N, K] contiguous, bias [N] or None, one dtype."""
        if x.stride(1) != 1:
            x = x.contiguous()
        rows, (n, k) = x.size(0), weight.shape
        out = torch.empty(rows, n, dtype=x.dtype)
        rc = self._fn(DTYPE_CODES[x.dtype], rows, x.data_ptr(), x.stride(0), weight.data_ptr(),
                      None if bias is None else bias.data_ptr(), out.data_ptr(), n, n, k, torch.get_num_threads())
        assert rc == 0, f"nanovllm_few_rows_linear returned {rc}"
        return out


def split_bf16x3(t: torch.Tensor) -> torch.Tensor:
    """[3, *t.shape] bfloat16 parts of float32 `t` with t = p0 + p1 + p2 exactly, each the nearest
    bfloat16 to what the parts before it left (cpu_amx_linear.cpp's split_rows, for weights)."""
    parts, rest = [], t.float()
    for _ in range(3):
        parts.append(rest.bfloat16())
        rest = rest - parts[-1].float()
    return torch.stack(parts)


class AmxProduct:
    """One weight packed for the AMX product (cpu_amx_linear.cpp), called as x @ weight.T (+ bias)
    for min_rows..max_rows rows of x: the product platform/cpu/linear.py cpu_linear() takes at decode
    steps (and, float32 with K >= AMX_PREFILL_MIN_K, prefill chunks). The weight is packed as the
    kernel's tiles, [N/32][K/32][parts][2 blocks of 16 columns][16 pairs of K][16 columns][2]: one
    part for bfloat16, for float32 its three bfloat16 parts (split_bf16x3) for the kernel's bf16x3
    product. The plain weight stays (the embedding may share it; other row counts use it)."""

    def __init__(self, fn, weight: torch.Tensor, min_rows: int = 1):
        n, k = weight.shape
        self._fn = fn
        self.max_rows = ANY_ROWS if weight.dtype == torch.float32 and k >= AMX_PREFILL_MIN_K else AMX_MAX_ROWS
        self.min_rows = min_rows  # fewer rows go to the product linear() would take without it
        self.n = n
        w = weight.detach()
        parts = split_bf16x3(w) if w.dtype == torch.float32 else w[None]  # [parts, n, k]
        self.packed = parts.reshape(len(parts), n // 32, 2, 16, k // AMX_TILE_K, AMX_TILE_K // 2, 2).permute(
            1, 4, 0, 2, 5, 3, 6).contiguous()

    def takes_every_row_count_above(self, rows: int) -> bool:
        """Whether linear() gives it every product of more than `rows` rows."""
        return self.min_rows <= rows + 1 and self.max_rows == ANY_ROWS

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        if weight.dim() != 2 or weight.dtype not in (torch.bfloat16, torch.float32) or not weight.is_contiguous():
            return False
        n, k = weight.shape
        return n % AMX_PAIR_COLUMNS == 0 and k % AMX_TILE_K == 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, K] in the weight's dtype with rows <= max_rows; returns [rows, N]."""
        rows, k = x.shape
        # bfloat16 rows are read in whole tiles: zero rows added (float32's are split into tiles by the kernel)
        padded = rows if x.dtype == torch.float32 else -(-rows // AMX_TILE_ROWS) * AMX_TILE_ROWS
        if padded != rows or x.stride(1) != 1:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        out = torch.empty(padded, self.n, dtype=x.dtype)
        rc = self._fn(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), padded, k, self.packed.data_ptr(), self.n,
                      None if bias is None else bias.data_ptr(), out.data_ptr(), self.n, torch.get_num_threads())
        assert rc == 0, f"nanovllm_amx_linear returned {rc}"
        return out if padded == rows else out[:rows]


class GreedyHead:
    """An LM head's greedy tokens (cpu_greedy_head.cpp): argmax_v x . w_v per row, found by int8
    scores with a proven bound and a float32 recheck of the few tokens the bound leaves, not by
    every logit in float32; with a HeadDraw, sampled rows' tokens the same way (the race's). The
    head float32 or bfloat16; float32 rows' logits are float32, bfloat16 rows' (a bf16 model's,
    its head bf16 or held in float32) are rounded to bfloat16 as their product writes them, and the
    token is the first of the largest rounded logits. Holds the head's int8 form, made once: each
    vocabulary row scaled by max|w_v| / 127 and rounded, packed per GREEDY_HEAD_CHUNK rows as
    [K/4][4][16][4] (what VNNI's dot products read), the vocabulary padded with zero rows; per row
    its scale, the sum of its int8 values, ||w_v|| and ||w_v - w^_v|| (upper bounds: float32's
    rounding error added). The plain weight stays (the recheck reads it, other steps multiply it)."""

    samples = True  # with a HeadDraw it draws sampled rows' tokens too (the race)

    def __init__(self, fn, pack, weight: torch.Tensor, limit: float):
        self._fn = fn
        self.limit = limit  # the sampler's clamp (layers/logits_processors.py LOGIT_LIMIT)
        self.weight = weight.detach()
        v, k = self.weight.shape
        self.vocab, self.width = v, k
        padded = -(-v // GREEDY_HEAD_CHUNK) * GREEDY_HEAD_CHUNK
        self.packed = torch.zeros(padded // GREEDY_HEAD_CHUNK, k // 4, 4, 16, 4, dtype=torch.int8)
        self.scale, self.norm, self.err = (torch.zeros(padded) for _ in range(3))
        self.qsum = torch.zeros(padded, dtype=torch.int32)
        # Norms widened by float32's worst relative error over k terms (and the rounding of scale *
        # q inside the difference): upper bounds, whatever order the kernel's sums take.
        widen = 1 + (k + 8) * 2.0 ** -23
        rc = pack(self.weight.data_ptr(), DTYPE_CODES[self.weight.dtype], v, k, widen, self.packed.data_ptr(),
                  self.scale.data_ptr(), self.qsum.data_ptr(), self.norm.data_ptr(), self.err.data_ptr(),
                  torch.get_num_threads())
        assert rc == 0, f"nanovllm_greedy_head_pack returned {rc}"
        self.max_norm = float(self.norm.max())
        self.candidates = torch.zeros((), dtype=torch.int64)  # tokens rechecked by the latest call (for tests)

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        return (weight.dim() == 2 and weight.dtype in GREEDY_HEAD_DTYPES and weight.is_contiguous()
                and weight.size(1) % 4 == 0 and bool(torch.isfinite(weight.sum())))  # NaN or inf anywhere: not finite

    def __call__(self, x: torch.Tensor, draw=None) -> torch.Tensor | None:
        """[rows] int64 tokens of rows x [rows, K] (float32, or bfloat16: logits rounded to
        bfloat16): the greedy tokens, or with `draw` (a runner/step_inputs.py HeadDraw:
        temperatures, keys, counters, one per row) each
        row's token as FusedKernels.race_tokens would draw it from the row's logits (its
        temperature, 0 = greedy, and noise key and counter). None where the logits must decide (rows
        neither float32 nor bfloat16, a row not finite, or logits near the sampler's clamp)."""
        if x.dtype not in GREEDY_HEAD_DTYPES:
            return None
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.size(0)
        out = torch.empty(rows, dtype=torch.int64)
        temperatures = keys = counters = None
        if draw is not None and draw.keys:  # else every row is greedy
            temperatures = torch.tensor(draw.temperatures, dtype=torch.float32)
            keys, counters = torch.tensor([draw.keys, draw.counters], dtype=torch.int64)
        rc = self._fn(x.data_ptr(), DTYPE_CODES[x.dtype], x.stride(0), rows, self.width, self.weight.data_ptr(),
                      DTYPE_CODES[self.weight.dtype], self.vocab,
                      self.packed.data_ptr(), self.scale.data_ptr(), self.qsum.data_ptr(), self.norm.data_ptr(),
                      self.err.data_ptr(), self.max_norm, self.limit, _pointer(temperatures), _pointer(keys),
                      _pointer(counters), out.data_ptr(), self.candidates.data_ptr(), torch.get_num_threads())
        assert rc in (0, 1), f"nanovllm_greedy_head returned {rc}"
        return out if rc == 0 else None


class AmxGreedyHead:
    """A bfloat16 LM head's greedy tokens on AMX tiles (cpu_amx_linear.cpp head_argmax): per row the
    first index of the largest logit, each logit as the AMX product writes it (bfloat16) and as the
    sampler's greedy pass reads it (NaN as -limit, clamped to +-limit), without writing the logits.
    Takes steps of min_rows rows or more whose rows are all greedy; the others go to `others` (the
    int8 GreedyHead, faster for few rows, and it samples), or return None (the logits decide)."""

    def __init__(self, fn, product: AmxProduct, limit: float, min_rows: int, others: GreedyHead | None = None):
        self._fn = fn
        self.product = product  # the weight packed for AMX (its packed tiles are what the kernel reads)
        self.limit, self.min_rows, self.others = limit, min_rows, others
        # Whether a HeadDraw with sampled rows is worth making for it (ModelRunner.launch)
        self.samples = others is not None and others.samples

    def __call__(self, x: torch.Tensor, draw=None) -> torch.Tensor | None:
        """[rows] int64 tokens of bfloat16 rows x [rows, K] (greedy, or with `draw`, as GreedyHead
        draws them); None where the logits must decide."""
        rows, k = x.shape
        if x.dtype != torch.bfloat16 or rows < self.min_rows or (draw is not None and draw.keys):
            return None if self.others is None else self.others(x, draw)
        padded = -(-rows // AMX_TILE_ROWS) * AMX_TILE_ROWS
        if padded != rows or x.stride(1) != 1:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        out = torch.empty(padded, dtype=torch.int64)
        rc = self._fn(x.data_ptr(), x.stride(0), padded, k, self.product.packed.data_ptr(), self.product.n, self.limit,
                      out.data_ptr(), torch.get_num_threads())
        assert rc == 0, f"nanovllm_amx_argmax returned {rc}"
        return out[:rows]


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedKernels:
    """The library's fused elementwise kernels (cpu_fused.cpp), and its few-row linear products
    (cpu_linear.cpp), called with tensors; the elementwise kernels with the
    signatures of the Triton kernels they stand in for (kernels/rms_norm.py, silu_mul.py and, but
    for fp8 caches, qk_norm_rope.py's norm + rotary + K/V store), so the layers take either. Inputs are the layers' own
    tensors: CPU, the model's dtype, unit stride in the last dimension; nothing is checked."""

    def __init__(self, library: ctypes.CDLL):
        ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        self._rms_norm = library.nanovllm_rms_norm
        self._rms_norm.argtypes = [i32, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i32, i32, f32, i32]
        self._silu_and_mul = library.nanovllm_silu_and_mul
        self._silu_and_mul.argtypes = [i32, ptr, i64, ptr, i64, i32, i32, i32]
        self._qk_norm_rope = library.nanovllm_qk_norm_rope
        self._qk_norm_rope.argtypes = [i32, ptr, i64, i64, i32, ptr, i64, i64, i32, ptr, ptr, i64, ptr, ptr, f32, ptr,
                                       i64, i64, ptr, ptr, ptr, i32, i32, i32]
        self._few_rows_linear = library.nanovllm_few_rows_linear
        self._few_rows_linear.argtypes = [i32, i32, ptr, i64, ptr, ptr, ptr, i64, i32, i32, i32]
        # (DecodeModel*, rows, x, out, positions, slots, block_tables, table_stride, q_start, q_len, k_len, threads):
        # platform/cpu/decode.py makes the arguments
        self.decode_layers = library.nanovllm_decode_layers
        self.decode_layers.argtypes = [ptr, i32, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32]
        for fn in (self._rms_norm, self._silu_and_mul, self._qk_norm_rope, self._few_rows_linear, self.decode_layers):
            fn.restype = i32
        self._few_rows_max = {dtype: library.nanovllm_few_rows_supported(code) for dtype, code in DTYPE_CODES.items()}
        amx_linear = library.nanovllm_amx_linear
        amx_linear.argtypes = [i32, ptr, i64, i32, i32, ptr, i32, ptr, ptr, i64, i32]
        amx_linear.restype = i32
        self._amx_linear = amx_linear if library.nanovllm_amx_linear_supported() else None
        self._amx_argmax = library.nanovllm_amx_argmax
        self._amx_argmax.argtypes = [ptr, i64, i32, i32, ptr, i32, f32, ptr, i32]
        self._amx_argmax.restype = i32
        self._greedy_tokens = library.nanovllm_greedy_tokens
        self._greedy_tokens.argtypes = [i32, ptr, i64, i32, i32, f32, ptr, i32]
        self._greedy_tokens.restype = i32
        self.greedy_vectorised = bool(library.nanovllm_greedy_vectorised())
        self._race_tokens = library.nanovllm_race_tokens
        self._race_tokens.argtypes = [i32, ptr, i64, i32, i32, ptr, ptr, ptr, f32, ptr, i32]
        self._race_tokens.restype = i32
        self._greedy_head = library.nanovllm_greedy_head if library.nanovllm_greedy_head_supported() else None
        if self._greedy_head is not None:
            self._greedy_head.argtypes = [ptr, i32, i64, i32, i32, ptr, i32, i32, ptr, ptr, ptr, ptr, ptr, f32, f32,
                                          ptr, ptr, ptr, ptr, ptr, i32]
            self._greedy_head.restype = i32
            self._greedy_head_pack = library.nanovllm_greedy_head_pack
            self._greedy_head_pack.argtypes = [ptr, i32, i32, i32, ctypes.c_double, ptr, ptr, ptr, ptr, ptr, i32]
            self._greedy_head_pack.restype = i32

    def greedy_tokens(self, logits: torch.Tensor, limit: float) -> torch.Tensor:
        """[rows] int64: each row's argmax of finite_logits(logits) (layers/logits_processors.py:
        NaN as -limit, values clamped to +-limit), the first index of the largest as torch.argmax's,
        for logits [rows, vocab] with unit stride along a row, in one pass over each row."""
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        rc = self._greedy_tokens(DTYPE_CODES[logits.dtype], logits.data_ptr(), logits.stride(0), rows, vocab, limit,
                                 out.data_ptr(), torch.get_num_threads())
        assert rc == 0, f"nanovllm_greedy_tokens returned {rc}"
        return out

    def race_tokens(self, logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                    limit: float) -> torch.Tensor:
        """[rows] int64: each row's token from finite_logits(logits) (as greedy_tokens): the argmax
        where its temperature is 0, else drawn from softmax(logits / T) by the Gumbel-max race with
        the noise of its key and counter (cpu_kernels.h gumbel64; runner/sampling_inputs.py
        philox_keys). logits [rows, vocab] with unit stride along a row; temperatures [rows]
        float32, keys and counters [rows] int64, contiguous."""
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        rc = self._race_tokens(DTYPE_CODES[logits.dtype], logits.data_ptr(), logits.stride(0), rows, vocab,
                               temperatures.data_ptr(), keys.data_ptr(), counters.data_ptr(), limit, out.data_ptr(),
                               torch.get_num_threads())
        assert rc == 0, f"nanovllm_race_tokens returned {rc}"
        return out

    def greedy_head(self, weight: torch.Tensor, limit: float) -> GreedyHead | None:
        """`weight` (an LM head's) in the int8 form of the greedy head, declining rows whose logits
        could near `limit` (the sampler's clamp); None where this build has neither AVX512-VNNI nor
        AVX2, or the head is not float32 or bfloat16, finite, with a width a multiple of 4."""
        if self._greedy_head is None or not GreedyHead.takes(weight):
            return None
        return GreedyHead(self._greedy_head, self._greedy_head_pack, weight, limit)

    def amx_greedy_head(self, weight: torch.Tensor, limit: float, min_rows: int,
                        others: GreedyHead | None = None) -> AmxGreedyHead | None:
        """A bfloat16 LM head `weight` packed for AMX, for its greedy tokens (AmxGreedyHead; the
        steps it does not take to `others`), or None where this build has no AMX product or the
        product does not take the weight."""
        if weight.dtype != torch.bfloat16:
            return None
        product = self.amx_linear(weight)
        return None if product is None else AmxGreedyHead(self._amx_argmax, product, limit, min_rows, others)

    def few_rows_linear(self, dtype: torch.dtype) -> FewRowsLinear | None:
        """The few-row product for weights of `dtype`, or None where this CPU's build has none
        (float32 needs AVX-512F or AVX2 + FMA, bfloat16 AVX512-BF16) or oneDNN is faster (float16)."""
        rows = self._few_rows_max.get(dtype, 0)
        if not rows or dtype not in FEW_ROWS_DTYPES:
            return None
        return FewRowsLinear(self._few_rows_linear, rows)

    def amx_linear(self, weight: torch.Tensor, min_rows: int = 1) -> AmxProduct | None:
        """`weight` packed for the AMX product (taking min_rows..max_rows rows), or None where
        this CPU's build has none or the product does not take the weight (bfloat16 or float32, N
        and K multiples of 32)."""
        if self._amx_linear is None or not AmxProduct.takes(weight):
            return None
        return AmxProduct(self._amx_linear, weight, min_rows)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> RMSNormOutput:
        """weight * rms_normalise(x) per row of a [rows, hidden] x; with `residual`, of x + residual,
        which is returned too (as platform/torch.py's add_rms_norm)."""
        rows, hidden = x.shape
        out = torch.empty(rows, hidden, dtype=x.dtype)
        residual_out = None if residual is None else torch.empty_like(out)
        rc = self._rms_norm(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0),
                            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
                            weight.data_ptr(), out.data_ptr(), hidden,
                            None if residual_out is None else residual_out.data_ptr(), hidden, rows, hidden, eps,
                            torch.get_num_threads())
        assert rc == 0, f"nanovllm_rms_norm returned {rc}"
        return RMSNormOutput(out, residual_out)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for x = [rows, gate | up] -> [rows, width]."""
        rows, width = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, width, dtype=x.dtype)
        rc = self._silu_and_mul(DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), out.data_ptr(), width, rows, width,
                                torch.get_num_threads())
        assert rc == 0, f"nanovllm_silu_and_mul returned {rc}"
        return out

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                     v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> None:
        """In place: q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim] RMS-normalised
        per head (when the weights are given) and rotated by `positions` through cos_sin_cache
        [max_position, 1, head_dim] float32 (cos | sin). With a cache (k_cache, v_cache [blocks,
        block_size, k_heads, head_dim] contiguous, in q's dtype, and v, slot_mapping int64), the
        rotated k and v are then stored at each token's slot (a negative slot skipped)."""
        tokens, q_heads, head_dim = q.shape
        if positions.dtype != torch.int64:
            positions = positions.long()
        store = k_cache is not None
        rc = self._qk_norm_rope(DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), q_heads, k.data_ptr(),
                                k.stride(0), k.stride(1), k.shape[1], positions.data_ptr(), cos_sin_cache.data_ptr(),
                                cos_sin_cache.stride(0), None if q_weight is None else q_weight.data_ptr(),
                                None if k_weight is None else k_weight.data_ptr(), eps,
                                v.data_ptr() if store else None, v.stride(0) if store else 0,
                                v.stride(1) if store else 0, k_cache.data_ptr() if store else None,
                                v_cache.data_ptr() if store else None, slot_mapping.data_ptr() if store else None,
                                tokens, head_dim, torch.get_num_threads())
        assert rc == 0, f"nanovllm_qk_norm_rope returned {rc}"


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX when set, else g++ or c++ on the PATH."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cache_key(cxx: str, extra_flags: tuple[str, ...] = ()) -> str:
    """Changes when anything that shapes the binary does: source, flags, compiler, CPU features."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.read_bytes())
    digest.update(" ".join((*CXX_FLAGS, *extra_flags)).encode())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest.update(version.encode())
    flags = cpu_flags_line()
    if flags is None:  # not Linux: -march=native still differs per CPU, so key on the machine name
        flags = os.uname().machine
    digest.update(flags.encode())
    return digest.hexdigest()[:16]


def cpu_flags_line() -> str | None:
    """The `flags` line of /proc/cpuinfo (the ISA extensions -march=native builds for), "" where it
    has none, None where there is no /proc/cpuinfo."""
    try:
        with open(CPUINFO) as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return None


def isa_flags_from_env() -> tuple[str, ...]:
    """The compiler flags $NANOVLLM_CPU_ISA asks for (none when unset or "native"). ValueError for
    a name not in CPU_ISAS or an ISA this CPU lacks (its code would stop on an illegal instruction)."""
    name = os.environ.get(CPU_ISA_ENV, "native")
    if name not in CPU_ISAS:
        raise ValueError(f"{CPU_ISA_ENV}={name!r} is not a known ISA; allowed: {', '.join(CPU_ISAS)}")
    flags, needs = CPU_ISAS[name]
    missing = needs - set((cpu_flags_line() or "").split())
    if missing:
        raise ValueError(f"{CPU_ISA_ENV}={name!r} needs {sorted(missing)}, which this CPU lacks; allowed: a class "
                         f"this CPU has, or 'native'")
    return flags


def build(directory: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the library into `directory` (default: the cache) unless it is there already;
    returns its path. `extra_flags` come after CXX_FLAGS (e.g. "-march=x86-64-v3": the build an
    AVX2-only CPU gets, which the tests run here too). Raises RuntimeError saying why when it cannot."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    directory = directory or cache_dir() / "cpu_kernels"
    path = directory / f"paged_attention-{_cache_key(cxx, extra_flags)}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: a concurrent process sees the whole library or none.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run([cxx, *CXX_FLAGS, *extra_flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                                timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{cxx} took over {BUILD_TIMEOUT_S} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def open_library(path: Path) -> ctypes.CDLL:
    """The built library at `path`, its ABI checked (RuntimeError when it is not ABI_VERSION); its
    `path` attribute says where it came from."""
    library = ctypes.CDLL(str(path))
    abi = library.nanovllm_paged_attention_abi()
    if abi != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {abi}, expected {ABI_VERSION}")
    library.path = path
    return library


def load_library() -> "ctypes.CDLL | str":
    """The library, built on first use in this process (or loaded from the cache) for the ISA
    $NANOVLLM_CPU_ISA names (this CPU's when unset), or a string saying why it cannot be had here.
    Tried once per process; a bad $NANOVLLM_CPU_ISA raises ValueError."""
    global _loaded
    if _loaded is None:
        flags = isa_flags_from_env()
        try:
            _loaded = open_library(build(extra_flags=flags))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _loaded = f"the CPU kernels could not be built or loaded: {e}"
    return _loaded


def load() -> "PagedAttentionKernel | str":
    """The paged-attention kernel, or a string saying why it cannot be had here."""
    library = load_library()
    return library if isinstance(library, str) else PagedAttentionKernel(library, library.path)


def load_fused() -> "FusedKernels | str":
    """The fused elementwise kernels, or a string saying why they cannot be had here."""
    library = load_library()
    return library if isinstance(library, str) else FusedKernels(library)
