// bfloat16 products of a decode step's rows with a linear layer's weight on AMX tiles,
// out = x @ w^T (+ bias), for 16..AMX_MAX_ROWS rows (Python pads x to a multiple of 16).
//
// oneDNN's packed product (layers/linear.py) is fast when called back to back, but in a decode
// step each call follows the attention's read of tens of MB of K/V, and then its first call costs
// ~60-110 us more whatever its data (docs/BENCHMARKS.md, "Tenth 2026-11-26 session"): a bf16
// step of the real-proportion model spent 8.1 ms in products that take 3.1 ms back to back (a
// 2-vCPU Intel Xeon with AMX). This
// kernel is a few hundred bytes of code and no state between calls: per thread one tile
// configuration, then for each pair of 16-column blocks of w (threads share the pairs) the rows
// of x two tiles of 16 at a time, K in steps of 32 (one TDPBF16PS per tile pair), sums in float32
// tiles, bias added in float32 and rounded to bfloat16 (round to nearest even) on the way out.
//
// w is packed once (AmxLinear.pack in cpu_build.py) into AMX's pair-interleaved layout, tile
// after tile: [N/16][K/32][16 pairs of K][16 columns][2], 1 KiB a tile, so each B tile is one
// contiguous load and a thread reads its columns' weights front to back.
//
// Built only where the compiler has AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native on such a
// CPU); nanovllm_amx_linear_supported() also asks Linux for the tile data state (arch_prctl), which
// a process needs before its first tile instruction, and says 0 where either is missing.
#include <cstdint>

#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define NANOVLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using nanovllm_cpu::AMX_TILE_ROWS;
constexpr int TILE_ROWS = AMX_TILE_ROWS;
constexpr int TILE_K = 32;  // bf16 elements of K per tile row: 64 bytes
constexpr int TILE_ELEMS = TILE_ROWS * TILE_K;  // one packed weight tile: 1 KiB
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

#ifdef NANOVLLM_AMX
struct TileConfig {  // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 sums (rows m0..m0+15 and m0+16..m0+31, x the two column blocks), 4-5 x, 6-7 w.
void product(const uint16_t* x, int64_t x_stride, int M, int K, const uint16_t* wp, int N, const uint16_t* bias,
             uint16_t* out, int64_t out_stride, int num_threads) {
  const int k_tiles = K / TILE_K;
  const int64_t block_elems = static_cast<int64_t>(k_tiles) * TILE_ELEMS;  // one 16-column block of w
#pragma omp parallel num_threads(num_threads)
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = TILE_ROWS;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    alignas(64) float sums[4][TILE_ROWS * 16];
#pragma omp for schedule(static)
    for (int pair = 0; pair < N / 32; ++pair) {
      const uint16_t* w0 = wp + 2 * pair * block_elems;
      const uint16_t* w1 = w0 + block_elems;
      for (int m0 = 0; m0 < M; m0 += 2 * TILE_ROWS) {
        const bool two = m0 + TILE_ROWS < M;  // a second tile of rows
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kt = 0; kt < k_tiles; ++kt) {
          _tile_loadd(4, x + m0 * x_stride + kt * TILE_K, x_stride * 2);
          _tile_loadd(6, w0 + kt * TILE_ELEMS, 64);
          _tile_loadd(7, w1 + kt * TILE_ELEMS, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, x + (m0 + TILE_ROWS) * x_stride + kt * TILE_K, x_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        if (two) {
          _tile_stored(2, sums[2], 64);
          _tile_stored(3, sums[3], 64);
        }
        for (int t = 0; t < (two ? 4 : 2); ++t) {
          const int row0 = m0 + (t / 2) * TILE_ROWS, col0 = pair * 32 + (t % 2) * 16;
          const __m512 b = bias == nullptr ? _mm512_setzero_ps()
                                           : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + col0))), 16));
          for (int r = 0; r < TILE_ROWS; ++r) {
            const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[t] + r * 16), b));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (row0 + r) * out_stride + col0), (__m256i)y);
          }
        }
      }
    }
    _tile_release();
  }
}
#endif

}  // namespace

extern "C" {

// 1 where this build has the AMX product and Linux grants this process the tile data state, else 0.
int nanovllm_amx_linear_supported() {
#ifdef NANOVLLM_AMX
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return 0;
#endif
}

// out[M, N] (row stride out_stride) = x[M, K] (row stride x_stride) @ w^T (+ bias[N] when not
// null), bfloat16, w packed as the header says. M a multiple of 16, K of 32, N of 32. Returns 0,
// or -1 for shapes it does not take or a build without AMX.
int nanovllm_amx_linear(const void* x, int64_t x_stride, int M, int K, const void* w_packed, int N, const void* bias,
                        void* out, int64_t out_stride, int num_threads) {
#ifdef NANOVLLM_AMX
  if (M <= 0 || M % TILE_ROWS || K % TILE_K || N % 32) return -1;
  product(static_cast<const uint16_t*>(x), x_stride, M, K, static_cast<const uint16_t*>(w_packed), N,
          static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), out_stride, num_threads);
  return 0;
#else
  (void)x, (void)x_stride, (void)M, (void)K, (void)w_packed, (void)N, (void)bias, (void)out, (void)out_stride,
      (void)num_threads;
  return -1;
#endif
}

}  // extern "C"
