// bfloat16 and float32 products of a step's rows with a linear layer's weight on AMX tiles,
// out = x @ w^T (+ bias): bfloat16 decode steps of up to 256 rows (Python pads x to a multiple of
// 16), float32 rows of any count, prefill chunks too (cpu_build.py AMX_MAX_ROWS).
//
// oneDNN's packed product (layers/linear.py) is fast when called back to back, but in a decode
// step each call follows the attention's read of tens of MB of K/V, and then its first call costs
// ~60-110 us more whatever its data (docs/BENCHMARKS.md, CPU kernels): a bf16
// step of the real-proportion model spent 8.1 ms in products that take 3.1 ms back to back (a
// 2-vCPU Intel Xeon with AMX). This kernel is a few hundred bytes of code and no state between
// calls: per thread one tile configuration, then for each pair of 16-column blocks of w (threads
// share the pairs) the rows of x two tiles of 16 at a time, K in steps of 32 (TDPBF16PS per tile
// pair), sums in float32 tiles, bias added in float32, out in x's dtype (bf16 rounded to nearest
// even). Float32 runs as bf16x3 (product() below): on that machine 0.5-0.9x oneDNN's float32 time
// at 16-256 rows and ~0.5-0.9x on prefill chunks (same section), where oneDNN's
// float32 FMAs run at their peak.
//
// w is packed once (AmxProduct in cpu_build.py) into AMX's pair-interleaved layout, tile after
// tile, 1 KiB a tile, so each w tile is one contiguous load and a thread reads its columns'
// weights front to back.
//
// head_argmax runs the bfloat16 product over an LM head and keeps, per row, only the first index of
// its largest logit (the sampler's greedy token), never writing the logits: greedy decode steps of a
// bf16 model (AmxGreedyHead in cpu_build.py).
//
// Built only where the compiler has AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native on such a
// CPU); nanovllm_amx_linear_supported() also asks Linux for the tile data state (arch_prctl), which
// a process needs before its first tile instruction, and says 0 where either is missing.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_kernels.h"

namespace {

using nanovllm_cpu::AMX_TILE_ROWS;
constexpr int TILE_ROWS = AMX_TILE_ROWS;
constexpr int TILE_K = 32;  // bf16 elements of K per tile row: 64 bytes
constexpr int TILE_ELEMS = TILE_ROWS * TILE_K;  // one packed weight tile: 1 KiB

#ifdef NANOVLLM_AMX
using nanovllm_cpu::load_tile_config;

__m512 widen(__m256bh h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)); }

// Sums 0-3 += the x rows in tile 4 and (when `two`) tile 5 times the w tiles in 6 and 7. With
// `second`, tile 5 is loaded from there between the two, where its load overlaps tile 4's products.
inline void times_w(bool two, const uint16_t* second = nullptr, int64_t stride_bytes = 0) {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (two) {
    if (second != nullptr) _tile_loadd(5, second, stride_bytes);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Tiles 6 and 7 = a K step of w's two column blocks (one part), packed one after the other.
inline void load_w(const uint16_t* w) {
  _tile_loadd(6, w, 64);
  _tile_loadd(7, w + TILE_ELEMS, 64);
}

inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Sums 0-3 = bfloat16 x's rows m0..m0+15 (and, when `two`, the next 16) times a pair of w's column
// blocks (packed K step after K step), over all K.
inline void bf16_pair_sums(const uint16_t* x, int64_t x_stride, int m0, int k_tiles, const uint16_t* w, bool two) {
  zero_sums();
  for (int kt = 0; kt < k_tiles; ++kt) {
    const uint16_t* xk = x + m0 * x_stride + kt * TILE_K;
    _tile_loadd(4, xk, x_stride * 2);  // before w's tiles: ~5% faster than after
    load_w(w + kt * 2 * TILE_ELEMS);
    times_w(two, xk + TILE_ROWS * x_stride, x_stride * 2);
  }
}

// The sums tiles (0-1, and 2-3 when `two`) into `sums`, 16 rows of 16 floats each.
inline void store_sums(float (*sums)[TILE_ROWS * 16], bool two) {
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  if (two) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
}

// `rows` rows from row0 of out, columns col0..col0+15, from the sums tile plus bias: float32, or
// bfloat16 rounded to nearest even.
template <typename T>
void write_tile(const float* sums, const T* bias, int col0, T* out, int64_t out_stride, int row0, int rows) {
  using Tag = std::conditional_t<sizeof(T) == 4, nanovllm_cpu::F32T, nanovllm_cpu::BF16T>;
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : nanovllm_cpu::load16<Tag>(bias + col0);
  for (int r = 0; r < rows; ++r) {
    const __m512 y = _mm512_add_ps(_mm512_load_ps(sums + r * 16), b);
    T* dst = out + (row0 + r) * out_stride + col0;
    if constexpr (sizeof(T) == 4)
      _mm512_storeu_ps(dst, y);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(y));
  }
}

// x's rows m0..m0+31 split in three bfloat16 parts, x = p0 + p1 + p2 exactly (each part rounds
// what the parts before it left; a float32's 24 significant bits fit three bfloat16's 8), stored
// as the tiles product() reads, one K step after another: [K/32][3 parts][2 tiles of rows][16][32].
// Rows from `rows` up to `tile_rows` are zeros (a last tile's padding).
void split_rows(const float* x, int64_t x_stride, int rows, int tile_rows, int K, uint16_t* tiles) {
  for (int r = 0; r < tile_rows; ++r)
    for (int k = 0; k < K; k += 16) {
      __m512 rest = r < rows ? _mm512_loadu_ps(x + r * x_stride + k) : _mm512_setzero_ps();
      uint16_t* at = tiles + (k / TILE_K) * 6 * TILE_ELEMS + (r / TILE_ROWS) * TILE_ELEMS + (r % TILE_ROWS) * TILE_K +
                     k % TILE_K;
      for (int part = 0; part < 3; ++part, at += 2 * TILE_ELEMS) {
        const __m256bh h = _mm512_cvtneps_pbh(rest);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), (__m256i)h);
        rest = _mm512_sub_ps(rest, widen(h));
      }
    }
}

// Rows of x a chunk: the rows whose split parts (or bfloat16 rows) fit ~1.5 MiB, in L2 (2 MiB a core
// on the Xeon measured), since each pair of column blocks reads all of them; whole pairs of row
// tiles, at least one pair. Each chunk reads w again: with 1 MiB, K 1,536's 96-row chunks made the
// real model's down projection ~10% slower in a float32 prefill.
int chunk_rows(int K, int parts) {
  return std::max(2 * TILE_ROWS, (3 << 19) / (2 * parts * K) / (2 * TILE_ROWS) * (2 * TILE_ROWS));
}

// Tiles: 0-3 sums (rows m0..m0+15 and m0+16..m0+31, x the two column blocks of a pair), 4-5 x,
// 6-7 w. w is packed per pair of column blocks, one K step after another, [N/32][K/32][parts][2
// blocks][16 pairs of K][16 columns][2], so a thread reads its pairs front to back. Rows go in
// chunks (chunk_rows); in a chunk threads share the pairs.
// bfloat16: one w part; x tiles are read from x itself. float32 (bf16x3): the chunk's x is split
// into three parts x0 + x1 + x2 (split_rows, into xs: 32 rows' tiles after 32 rows') and w was
// packed as three, w0 + w1 + w2; the sums take the six products whose parts' orders add to at
// most 2 (x0w0, x1w0, x2w0, x1w1, x0w1, x0w2: in that order, 16 tile loads a K step). What the
// other three would add is below 2^-26 of |x||w| a term, under float32's own rounding of a product
// (2^-25): the result is a float32 product's to rounding (oneMKL calls this BF16X3), at AMX's rate.
// M: x's rows; the kernel computes whole tiles of rows (float32: the split's padding rows are zeros;
// bfloat16: M must be whole tiles) and writes out's first M.
template <typename T>
void product(const T* x, int64_t x_stride, int M, int K, const uint16_t* wp, int N, const T* bias, T* out,
             int64_t out_stride, uint16_t* xs, int num_threads) {
  constexpr bool x3 = sizeof(T) == 4;
  const int M_tiles = (M + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  constexpr int parts = x3 ? 3 : 1;
  const int k_tiles = K / TILE_K, chunk = chunk_rows(K, parts);
  const int64_t step_elems = parts * 2 * TILE_ELEMS;  // one K step of a pair of w, or of 32 rows of xs
#pragma omp parallel num_threads(num_threads)
  {
    load_tile_config();
    alignas(64) float sums[4][TILE_ROWS * 16];
    for (int c0 = 0; c0 < M_tiles; c0 += chunk) {
      const int c1 = std::min(M_tiles, c0 + chunk);
      if constexpr (x3) {
#pragma omp for schedule(static)
        for (int m0 = c0; m0 < c1; m0 += 2 * TILE_ROWS)
          split_rows(reinterpret_cast<const float*>(x) + m0 * x_stride, x_stride,
                     std::clamp(M - m0, 0, 2 * TILE_ROWS), std::min(c1 - m0, 2 * TILE_ROWS), K,
                     xs + static_cast<int64_t>((m0 - c0) / (2 * TILE_ROWS)) * k_tiles * step_elems);
      }
#pragma omp for schedule(static)
      for (int pair = 0; pair < N / 32; ++pair) {
        const uint16_t* w = wp + static_cast<int64_t>(pair) * k_tiles * step_elems;
        for (int m0 = c0; m0 < c1; m0 += 2 * TILE_ROWS) {
          const bool two = m0 + TILE_ROWS < c1;  // a second tile of rows
          if constexpr (!x3) {
            bf16_pair_sums(reinterpret_cast<const uint16_t*>(x), x_stride, m0, k_tiles, w, two);
          } else {
            zero_sums();
            for (int kt = 0; kt < k_tiles; ++kt) {
              const uint16_t* wk = w + kt * step_elems;
              const uint16_t* xk = xs + (static_cast<int64_t>((m0 - c0) / (2 * TILE_ROWS)) * k_tiles + kt) * step_elems;
              const auto x_part = [&](int part) {  // x's part's two tiles of rows by w's tiles
                _tile_loadd(4, xk + part * 2 * TILE_ELEMS, 64);
                times_w(two, xk + part * 2 * TILE_ELEMS + TILE_ELEMS, 64);
              };
              load_w(wk);  // w0 by x0, x1, x2
              x_part(0), x_part(1), x_part(2);
              load_w(wk + 2 * TILE_ELEMS);  // w1 by x1, x0
              x_part(1), x_part(0);
              load_w(wk + 4 * TILE_ELEMS);  // w2 by x0, still in tiles 4-5
              times_w(two);
            }
          }
          store_sums(sums, two);
          for (int t = 0; t < (two ? 4 : 2); ++t) {
            const int row0 = m0 + (t / 2) * TILE_ROWS;
            if (row0 < M)
              write_tile(sums[t], bias, pair * 32 + (t % 2) * 16, out, out_stride, row0, std::min(TILE_ROWS, M - row0));
          }
        }
      }
    }
    _tile_release();
  }
}

// Per row of bfloat16 x (M rows, whole tiles), the first index of the largest of its logits
// x @ w^T, each rounded to bfloat16 as the product would write it and taken as greedy_rows
// (cpu_fused.cpp) takes a logit (NaN as -limit, clamped to +-limit): the argmax the sampler would
// take from product()'s output, without writing the logits. Threads take contiguous runs of pairs;
// each keeps per row and lane its first largest and its index, merged at the end (largest value,
// then smallest index).
void head_argmax(const uint16_t* x, int64_t x_stride, int M, int K, const uint16_t* wp, int N, float limit,
                 int64_t* out, int num_threads) {
  const int k_tiles = K / TILE_K, pairs = N / 32;
  const int64_t pair_elems = static_cast<int64_t>(k_tiles) * 2 * TILE_ELEMS;
  // Per thread, row and lane; a thread the runtime does not start leaves its -inf.
  std::vector<float> best(static_cast<size_t>(num_threads) * M * 16, -INFINITY);
  std::vector<int32_t> index(best.size(), 0);
#pragma omp parallel num_threads(num_threads)
  {
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int p0 = static_cast<int64_t>(pairs) * me / threads, p1 = static_cast<int64_t>(pairs) * (me + 1) / threads;
    float* my_best = best.data() + static_cast<size_t>(me) * M * 16;
    int32_t* my_index = index.data() + static_cast<size_t>(me) * M * 16;
    load_tile_config();
    alignas(64) float sums[4][TILE_ROWS * 16];
    const __m512 low = _mm512_set1_ps(-limit), high = _mm512_set1_ps(limit);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int pair = p0; pair < p1; ++pair) {
      const uint16_t* w = wp + pair * pair_elems;
      for (int m0 = 0; m0 < M; m0 += 2 * TILE_ROWS) {
        const bool two = m0 + TILE_ROWS < M;
        bf16_pair_sums(x, x_stride, m0, k_tiles, w, two);
        store_sums(sums, two);
        for (int t = 0; t < (two ? 4 : 2); ++t) {
          const int row0 = m0 + (t / 2) * TILE_ROWS;
          const __m512i columns = _mm512_add_epi32(lanes, _mm512_set1_epi32(pair * 32 + (t % 2) * 16));
          for (int r = 0; r < TILE_ROWS; ++r) {
            // As product() writes it (bf16, nearest even), then as greedy_rows reads it.
            const __m512 y = widen(_mm512_cvtneps_pbh(_mm512_load_ps(sums[t] + r * 16)));
            const __m512 v = _mm512_min_ps(_mm512_max_ps(y, low), high);  // max_ps(NaN, low) is low
            float* b = my_best + (row0 + r) * 16;
            int32_t* ix = my_index + (row0 + r) * 16;
            const __m512 old = _mm512_loadu_ps(b);
            const __mmask16 larger = _mm512_cmp_ps_mask(v, old, _CMP_GT_OQ);
            if (larger) {  // rare once a row's lanes hold their largest so far: no stores otherwise
              _mm512_storeu_ps(b, _mm512_mask_mov_ps(old, larger, v));
              _mm512_storeu_si512(ix, _mm512_mask_mov_epi32(_mm512_loadu_si512(ix), larger, columns));
            }
          }
        }
      }
    }
    _tile_release();
  }
  for (int r = 0; r < M; ++r) {  // lanes of every thread: the largest, the smallest index among equals
    float top = -INFINITY;
    int64_t at = 0;
    for (int t = 0; t < num_threads; ++t)
      for (int j = 0; j < 16; ++j) {
        const size_t i = (static_cast<size_t>(t) * M + r) * 16 + j;
        if (best[i] > top || (best[i] == top && index[i] < at)) top = best[i], at = index[i];
      }
    out[r] = at;
  }
}
#endif

}  // namespace

extern "C" {

// 1 where this build has the AMX product and Linux grants this process the tile data state, else 0.
int nanovllm_amx_linear_supported() { return nanovllm_cpu::amx_granted(); }

// out[M, N] (row stride out_stride) = x[M, K] (row stride x_stride) @ w^T (+ bias[N] when not
// null), all of `dtype` (DTYPE_CODES: 0 float32, 1 bfloat16), w packed as the header says. K a
// multiple of 32, N of 32, M (bfloat16) of 16. Returns 0, or -1 for what it does not take or a build
// without AMX.
int nanovllm_amx_linear(int dtype, const void* x, int64_t x_stride, int M, int K, const void* w_packed, int N,
                        const void* bias, void* out, int64_t out_stride, int num_threads) {
#ifdef NANOVLLM_AMX
  if (M <= 0 || (dtype == 1 && M % TILE_ROWS) || K % TILE_K || N % 32 || (dtype != 0 && dtype != 1)) return -1;
  const auto* wp = static_cast<const uint16_t*>(w_packed);
  if (dtype == 1) {
    product(static_cast<const uint16_t*>(x), x_stride, M, K, wp, N, static_cast<const uint16_t*>(bias),
            static_cast<uint16_t*>(out), out_stride, nullptr, num_threads);
    return 0;
  }
  thread_local std::vector<uint16_t> parts;  // x split in three (product()); grows to the largest call
  const size_t split = 3 * static_cast<size_t>(std::min(M + 31, chunk_rows(K, 3)) / 32 * 32) * K;
  if (parts.size() < split) parts.resize(split);
  product(static_cast<const float*>(x), x_stride, M, K, wp, N, static_cast<const float*>(bias),
          static_cast<float*>(out), out_stride, parts.data(), num_threads);
  return 0;
#else
  (void)dtype, (void)x, (void)x_stride, (void)M, (void)K, (void)w_packed, (void)N, (void)bias, (void)out,
      (void)out_stride, (void)num_threads;
  return -1;
#endif
}

// out[r] for r < M: the first index of the largest of x[r] @ w^T's logits as bfloat16 (head_argmax),
// x bfloat16 [M, K] (M whole tiles of 16, row stride x_stride), w bfloat16 packed as for
// nanovllm_amx_linear ([N, K], N a multiple of 32, K of 32). Returns 0, or -1 for what it does not
// take or a build without AMX.
int nanovllm_amx_argmax(const void* x, int64_t x_stride, int M, int K, const void* w_packed, int N, float limit,
                        int64_t* out, int num_threads) {
#ifdef NANOVLLM_AMX
  if (M <= 0 || M % TILE_ROWS || K % TILE_K || N % 32) return -1;
  head_argmax(static_cast<const uint16_t*>(x), x_stride, M, K, static_cast<const uint16_t*>(w_packed), N, limit, out,
              num_threads);
  return 0;
#else
  (void)x, (void)x_stride, (void)M, (void)K, (void)w_packed, (void)N, (void)limit, (void)out, (void)num_threads;
  return -1;
#endif
}

}  // extern "C"
