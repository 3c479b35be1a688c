"""The sampler's race in one pass over the logits: temperature, exponential noise and argmax per row.

Owns two Triton kernels, their checking wrapper and the definition of the noise. A row with
temperature 0 takes the exact argmax of its logits (the first index among equal maxima, as
torch.argmax). A row with temperature T > 0 draws its token by the exponential race:
argmax_v softmax(z / T)_v / E_v with E_v ~ Exp(1), computed in log space as
argmax_v (z_v / T - log E_v), which needs neither the softmax's maximum nor its sum, so the row
is read once, in whatever dtype the LM head wrote it (bf16 or fp32). It knows nothing of
sequences or sampling parameters: platform/sampling.py decides which rows come here and with what.

The noise: E_v = -log1p(-u_v) with u_v = (x_v + 0.5) * 2^-32, x_v the first word of Philox-4x32-10
(the generator of curand and tl.philox) keyed by the row's 64-bit seed, with counter (v, row
counter low word, row counter high word, 0). The key and counter come in per row, so a row's
noise depends on nothing but its own seed and counter: not on its position in the batch nor on
the other rows. (log1p, not log(u): an exponential's small values decide the race and need
u's fine resolution near 0; written with Goldberg's identity, exact to rounding.) Tests inject
E instead (`noise=`), to compare tokens with the torch sampler's for the same noise.

Design: grid (row tiles, vocabulary chunks); a program keeps a running best per lane over its
chunk's tiles and reduces once, writing its chunk's best (value, index) per row; a second kernel
picks each row's best chunk. A chunk is 8192 logits for real vocabularies (a 152k vocabulary is
19 programs per row, so even one row spreads over the GPU), and a tile holds one row there and
several rows of tiny test vocabularies (fewer programs for the CPU interpreter). A program whose
rows are all greedy skips the noise. The row count changes every step, so it is excluded from
integer specialisation (see kernels/__init__.py).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels import SUPPORTED_DTYPES, check_tensor, next_power_of_2, previous_power_of_2
from nanovllm.kernels.reductions import MAX, MIN

# Constants the kernels read are tl.constexpr: compiled Triton refuses other globals.
# Philox-4x32-10's multipliers and key increments (Salmon et al., SC'11; as curand and tl.philox).
PHILOX_ROUND_A = tl.constexpr(0xD2511F53)
PHILOX_ROUND_B = tl.constexpr(0xCD9E8D57)
PHILOX_KEY_A = tl.constexpr(0x9E3779B9)
PHILOX_KEY_B = tl.constexpr(0xBB67AE85)
PHILOX_ROUNDS = tl.constexpr(10)
UINT32_SCALE = tl.constexpr(2.0 ** -32)  # maps a 32-bit word to [0, 1)
# The smallest E the torch sampler lets through (it clamps at float32's tiny); matched here.
FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)
# Larger than any vocabulary index: loses every "smallest index" vote.
MAX_VOCAB = 2**31 - 1
INDEX_SENTINEL = tl.constexpr(MAX_VOCAB)
# Logits per tile, and tiles per chunk: a chunk of 8192 splits a 152k vocabulary into 19 programs
# per row, so even a batch of one row spreads over the GPU.
MAX_BLOCK = 1024
TILES_PER_CHUNK = 8
# Logits per program: rows are added to a program's tiles up to this (at least one row).
ELEMENTS_PER_PROGRAM = 8192
# Rows per program of the pick kernel (a few values each).
PICK_ROWS = 64


@triton.jit
def philox_4x32(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr):
    """The first word of Philox-4x32 after ROUNDS rounds, for uint32 counters c0..c3, key k0, k1."""
    for _ in tl.static_range(ROUNDS):
        prev_c0, prev_c2 = c0, c2
        c0 = tl.math.umulhi(prev_c2, PHILOX_ROUND_B) ^ c1 ^ k0
        c2 = tl.math.umulhi(prev_c0, PHILOX_ROUND_A) ^ c3 ^ k1
        c1 = prev_c2 * PHILOX_ROUND_B
        c3 = prev_c0 * PHILOX_ROUND_A
        k0 = k0 + PHILOX_KEY_A
        k1 = k1 + PHILOX_KEY_B
    return c0


@triton.jit
def exponential_from_uint32(x):
    """E = -log1p(-u), u = (x + 0.5) * 2^-32 in float32: Exp(1) noise, fine-grained near 0."""
    u = (x.to(tl.float32) + 0.5) * UINT32_SCALE
    w = 1.0 - u
    # Goldberg: log1p(-u) = -u * log(w) / (1 - w) where w = fl(1 - u) != 1; u itself where w == 1.
    return tl.where(w == 1.0, u, u * (-tl.log(w)) / tl.where(w == 1.0, 1.0, 1.0 - w))


@triton.jit(do_not_specialize=["rows"])
def _race_chunk_kernel(
    logits_ptr, temperatures_ptr, seeds_ptr, counters_ptr, noise_ptr, chunk_value_ptr, chunk_index_ptr,
    stride_logits, stride_noise, rows, vocab,
    ROWS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    HAS_NOISE: tl.constexpr,
):
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # [ROWS]
    row_ok = row < rows
    chunk = tl.program_id(1)
    temperature_1d = tl.load(temperatures_ptr + row, mask=row_ok, other=0.0)
    any_sampled = tl.reduce(temperature_1d, 0, MAX) > 0
    temperature = temperature_1d[:, None]  # [ROWS, 1]
    sampled = temperature > 0
    # 1. Each row's Philox key (its seed) and counter words, as uint32, [ROWS, 1].
    seed = tl.load(seeds_ptr + row, mask=row_ok, other=0)[:, None]
    counter = tl.load(counters_ptr + row, mask=row_ok, other=0)[:, None]
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c1 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c2 = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)

    # 2. A running best per lane over the chunk's tiles; ties keep the earlier tile (smaller index).
    lanes = tl.arange(0, BLOCK)[None, :]
    start = chunk * CHUNK
    best_value = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
    best_index = start + lanes + (row[:, None] * 0).to(tl.int32)  # [ROWS, BLOCK]
    for tile in range(start, start + CHUNK, BLOCK):
        offsets = tile + lanes  # [1, BLOCK]
        mask = row_ok[:, None] & (offsets < vocab)
        z = tl.load(logits_ptr + row[:, None] * stride_logits + offsets, mask=mask,
                    other=float("-inf")).to(tl.float32)  # [ROWS, BLOCK]
        if any_sampled:
            if HAS_NOISE:
                e = tl.load(noise_ptr + row[:, None] * stride_noise + offsets, mask=mask, other=1.0)
            else:
                zero = (row[:, None] * 0 + offsets * 0).to(tl.uint32)  # [ROWS, BLOCK], to broadcast every word
                e = exponential_from_uint32(philox_4x32(offsets.to(tl.uint32) + zero, c1 + zero, c2 + zero, zero,
                                                        k0 + zero, k1 + zero, PHILOX_ROUNDS))
            # div_rn: exactly torch's float32 division (plain `/` may be approximate on a GPU).
            noisy = tl.math.div_rn(z, tl.where(sampled, temperature, 1.0)) - tl.log(tl.maximum(e, FLOAT32_TINY))
            z = tl.where(sampled, noisy, z)
        better = z > best_value
        best_index = tl.where(better, offsets, best_index)
        best_value = tl.where(better, z, best_value)

    # 3. The chunk's best per row: the largest value, and among lanes holding it the smallest index.
    value = tl.reduce(best_value, 1, MAX)  # [ROWS]
    index = tl.reduce(tl.where(best_value == value[:, None], best_index, INDEX_SENTINEL), 1, MIN)
    tl.store(chunk_value_ptr + row * NUM_CHUNKS + chunk, value, mask=row_ok)
    tl.store(chunk_index_ptr + row * NUM_CHUNKS + chunk, index, mask=row_ok)


@triton.jit(do_not_specialize=["rows"])
def _pick_kernel(chunk_value_ptr, chunk_index_ptr, out_ptr, rows,
                 ROWS: tl.constexpr, NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    # Each row's best chunk, the earlier one on a tie (chunks are in index order).
    rows_1d = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row = rows_1d[:, None]  # [ROWS, 1]
    chunks = tl.arange(0, CHUNKS_PAD)[None, :]
    mask = (row < rows) & (chunks < NUM_CHUNKS)
    values = tl.load(chunk_value_ptr + row * NUM_CHUNKS + chunks, mask=mask, other=float("-inf"))
    indices = tl.load(chunk_index_ptr + row * NUM_CHUNKS + chunks, mask=mask, other=INDEX_SENTINEL)
    value = tl.reduce(values, 1, MAX)[:, None]
    index = tl.reduce(tl.where(mask & (values == value), indices, INDEX_SENTINEL), 1, MIN)  # [ROWS]
    tl.store(out_ptr + rows_1d, index.to(tl.int64), mask=rows_1d < rows)


class Chunking(NamedTuple):
    block: int  # logits per row per tile
    chunk: int  # logits per row per program
    rows: int  # rows per program


def chunking(vocab: int) -> Chunking:
    """How the race kernel cuts the logits: powers of two fixed by the vocabulary alone."""
    block = min(MAX_BLOCK, next_power_of_2(vocab))
    chunk = min(block * TILES_PER_CHUNK, next_power_of_2(vocab))
    return Chunking(block, chunk, previous_power_of_2(max(1, ELEMENTS_PER_PROGRAM // chunk)))


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                  *, noise: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token: argmax of its logits where its temperature is 0, else the exponential race.

    logits: [rows, vocab] float32/float16/bfloat16 (row stride free, stride(-1) == 1); temperatures:
    [rows] float32 (0 = greedy); seeds, counters: [rows] int64, each row's Philox key and counter;
    noise: [rows, vocab] float32 Exp(1) draws to use instead of Philox's (tests). Returns `out`, [rows]
    int64, allocated when not given.
    """
    device = logits.device
    check_tensor("logits", logits, 2, SUPPORTED_DTYPES, device)
    rows, vocab = logits.shape
    if not 1 <= vocab < MAX_VOCAB:
        raise ValueError(f"vocabulary of {vocab} is not supported; allowed: 1..{MAX_VOCAB - 1}")
    for name, t, dtype in (("temperatures", temperatures, torch.float32), ("seeds", seeds, torch.int64),
                           ("counters", counters, torch.int64)):
        check_tensor(name, t, 1, (dtype,), device)
        if t.size(0) != rows:
            raise ValueError(f"{name} has {t.size(0)} entries for {rows} rows of logits")
    if noise is not None:
        check_tensor("noise", noise, 2, (torch.float32,), device)
        if noise.shape != logits.shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(logits.shape)}")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=device)
    check_tensor("out", out, 1, (torch.int64,), device)
    if out.size(0) != rows:
        raise ValueError(f"out has {out.size(0)} entries for {rows} rows")
    if rows == 0:
        return out
    tiles = chunking(vocab)
    num_chunks = triton.cdiv(vocab, tiles.chunk)
    chunk_values = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chunk_indices = torch.empty(rows, num_chunks, dtype=torch.int32, device=device)
    noise_arg = noise if noise is not None else logits  # never read without noise
    _race_chunk_kernel[(triton.cdiv(rows, tiles.rows), num_chunks)](
        logits, temperatures, seeds, counters, noise_arg, chunk_values, chunk_indices,
        logits.stride(0), noise_arg.stride(0), rows, vocab,
        ROWS=tiles.rows, CHUNK=tiles.chunk, BLOCK=tiles.block, NUM_CHUNKS=num_chunks, HAS_NOISE=noise is not None,
    )
    _pick_kernel[(triton.cdiv(rows, PICK_ROWS),)](chunk_values, chunk_indices, out, rows, ROWS=PICK_ROWS,
                                                  NUM_CHUNKS=num_chunks, CHUNKS_PAD=next_power_of_2(num_chunks))
    return out
