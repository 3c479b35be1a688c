// Helpers shared by the CPU kernels (cpu_*.cpp): the element types a kernel is instantiated for,
// loads and stores that convert to and from float32 (bfloat16 rounds to nearest even, as torch
// does), an exp for non-positive arguments that vectorises, sum16, and the C entry points one
// kernel calls from another.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// AMX kernels (cpu_amx_linear.cpp, cpu_amx_attention.cpp) exist only where the compiler has
// AMX-TILE, AMX-BF16 and AVX512-BF16 (-march=native on such a CPU).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define NANOVLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace nanovllm_cpu {

enum DType { F32 = 0, BF16 = 1, F16 = 2 };

struct F32T { using storage = float; };
struct BF16T { using storage = uint16_t; };
struct F16T { using storage = _Float16; };

inline float to_float(float x) { return x; }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T> inline float load(const typename T::storage* p);
template <> inline float load<F32T>(const float* p) { return *p; }
template <> inline float load<F16T>(const _Float16* p) { return static_cast<float>(*p); }
template <> inline float load<BF16T>(const uint16_t* p) { return bf16_to_float(*p); }

#ifdef __AVX512F__
// 16 elements of float32 or bfloat16 (widened) as a float32 vector; store16 below is the way back.
template <typename T>
inline __m512 load16(const typename T::storage* p) {
  if constexpr (std::is_same_v<T, BF16T>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  else
    return _mm512_loadu_ps(p);
}

#endif

// dst[0:n] = src[0:n] as float32, n a multiple of LANES. bfloat16 by explicit AVX-512 widening
// where the compiler has it (its auto-vectorised memcpy form runs several times slower).
template <typename T>
inline void load_row(const typename T::storage* __restrict__ src, float* __restrict__ dst, int n) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, BF16T>) {
    for (int j = 0; j < n; j += 16) _mm512_storeu_ps(dst + j, load16<T>(src + j));
    return;
  }
#endif
#pragma omp simd
  for (int j = 0; j < n; ++j) dst[j] = load<T>(src + j);
}

template <typename T> inline void store(typename T::storage* p, float x);
template <> inline void store<F32T>(float* p, float x) { *p = x; }
template <> inline void store<F16T>(_Float16* p, float x) { *p = static_cast<_Float16>(x); }
template <> inline void store<BF16T>(uint16_t* p, float x) {
  // Round to nearest even, as torch's float -> bfloat16 conversion does; NaN stays NaN.
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

// x rounded to T's precision and back to float32: what a torch op in T leaves between two steps.
template <typename T>
inline float rounded(float x) {
  typename T::storage v;
  store<T>(&v, x);
  return load<T>(&v);
}

constexpr int CACHE_LINE = 64;  // bytes a prefetch brings
constexpr float LOG2E = 1.44269504088896341f;  // log2(e): exp(x) = 2^(x log2 e)

// exp(x) for x <= 0 (scores minus their running max) in a form the compiler vectorises:
// 2^(x log2 e) split into 2^n (built in the exponent bits) times a degree-6 polynomial for 2^f,
// f in [-0.5, 0.5] (Cephes' exp2f coefficients); relative error ~2e-7, about float32 rounding.
// Below -87 it returns 0.
inline float exp_nonpositive(float x) {
  float t = std::max(x, -87.0f) * LOG2E;
  float n = __builtin_rintf(t);  // nearest, ties to even: vectorises (roundf does not)
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return x < -87.0f ? 0.0f : r;
}

constexpr int LANES = 16;  // floats per AVX-512 vector (two AVX2 vectors): the unit of the inner loops
constexpr int AMX_TILE_ROWS = 16;  // rows of an AMX tile: the AMX product's rows come in whole tiles

#ifdef NANOVLLM_AMX
struct TileConfig {  // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every one of the 8 tiles 16 rows of 64 bytes: what the AMX kernels use (one configuration a thread).
inline void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = AMX_TILE_ROWS;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}
#endif

// 1 where this build has AMX and Linux grants this process the tile data state (arch_prctl), which
// a process needs before its first tile instruction; else 0. Idempotent.
inline int amx_granted() {
#ifdef NANOVLLM_AMX
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return 0;
#endif
}

// The types with explicit vector paths (attention's scores by sums, P x V and prefill lanes; the
// fused elementwise rows): float32 and bfloat16.
template <typename T>
constexpr bool vector_type() { return std::is_same_v<T, F32T> || std::is_same_v<T, BF16T>; }

#ifdef __AVX512F__

// The mask of a vector's first `count` lanes, count clamped to 0..LANES (a loop's tail).
inline __mmask16 first_lanes(int count) {
  return count >= LANES ? static_cast<__mmask16>(0xffff)
                        : count <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << count) - 1);
}

// x's bfloat16 bits (nearest even, NaN kept quiet: as store<BF16T>), one in the low half of each
// 32-bit lane. store16 and rounded16 round through it, so a vector loop gives a scalar loop's values.
inline __m512i bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

template <typename T>
inline void store16(typename T::storage* p, __m512 x) {
  if constexpr (std::is_same_v<T, BF16T>)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  else
    _mm512_storeu_ps(p, x);
}

// rounded() on 16 lanes.
template <typename T>
inline __m512 rounded16(__m512 x) {
  if constexpr (std::is_same_v<T, BF16T>)
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16));
  else
    return x;
}

// Vector form of exp_nonpositive (the same operations in the same order, so the same values).
inline __m512 exp_nonpositive_v(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(LOG2E));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  for (const float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                        6.931472028550421e-1f, 1.0f})
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(c));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(bits), under, _mm512_setzero_ps());
}

#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 8 elements of float32 or bfloat16 (widened) as a float32 vector, for builds without AVX-512.
template <typename T>
inline __m256 load8(const typename T::storage* p) {
  if constexpr (std::is_same_v<T, BF16T>)
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  else if constexpr (std::is_same_v<T, F16T>)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // F16C, part of x86-64-v3
  else
    return _mm256_loadu_ps(p);
}

// bf16_bits (below) on 8 lanes: nearest even, NaN kept quiet, as store<BF16T>.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

template <typename T>
inline void store8(typename T::storage* p, __m256 x) {
  if constexpr (std::is_same_v<T, BF16T>) {
    const __m256i b = bf16_bits8(x);  // 8 x 32-bit, the value in the low half: pack to 8 x 16-bit
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    _mm256_storeu_ps(p, x);
  }
}

template <typename T>
inline __m256 rounded8(__m256 x) {
  if constexpr (std::is_same_v<T, BF16T>)
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
  else
    return x;
}

// Lane i of the result = the sum of v[i]'s 8 lanes (horizontal adds, then the two halves).
inline __m256 sum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The mask (all ones per lane) of a vector's first `count` lanes, count clamped to 0..8.
inline __m256i first_lanes8(int count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp_nonpositive on 8 lanes, for builds without AVX-512 (the same operations in the same order).
inline __m256 exp_nonpositive_v8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(LOG2E));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  for (const float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                        6.931472028550421e-1f, 1.0f})
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(c));
  const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  return _mm256_blendv_ps(_mm256_castsi256_ps(bits), _mm256_setzero_ps(),
                          _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
}
#endif

#ifdef __AVX512F__
// Lane i of the result = the sum of v[i]'s 16 lanes: a transpose-and-add tree, 45 instructions for
// 16 sums where 16 separate horizontal sums take ~130.
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across the four 128-bit lanes: lanes 0+2 and 1+3, then (0+2)+(1+3).
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#endif

}  // namespace nanovllm_cpu

// The sampler's noise on the CPU: cpu_fused.cpp's race over logits and cpu_greedy_head.cpp's
// sampled rows call the same (not inlined) function, so a row draws the same token either way.
// Token v of a row keyed (key, counter) (runner/sampling_inputs.py philox_keys: a seeded row's seed
// and token index, else a key drawn per step and the row) gets g_v = -log(-log(w_v)), Gumbel noise,
// with w_v = (2 m + 1) 2^-24 and m the top 23 bits of a 32-bit hash of v under the row's two 32-bit
// keys (lowbias32, twice). w_v lies in (0, 1) exactly, so g_v is finite, in [-2.9, 16.7]; and
// argmax_v (l_v / T + g_v) is v with probability softmax(l / T)_v (the Gumbel-max trick: the Triton
// sampler's exponential race in log space, with a cheaper hash than its Philox).
// Written with GCC's vector extensions, NOISE_LANES lanes: the build's vector width (GCC would not
// vectorise 16-lane comparisons and selects on AVX2).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
namespace nanovllm_cpu {

#ifdef __AVX512F__
constexpr int NOISE_LANES = 16;
#else
constexpr int NOISE_LANES = 8;
#endif
typedef float fvec __attribute__((vector_size(4 * NOISE_LANES)));
typedef int32_t ivec __attribute__((vector_size(4 * NOISE_LANES)));
typedef uint32_t uvec __attribute__((vector_size(4 * NOISE_LANES)));

constexpr float NOISE_MAX_ABS = 17.0f;  // |g_v| is below this
constexpr int NOISE_TOKENS = 64;  // tokens a call of gumbel64: independent chains of NOISE_LANES lanes

struct NoiseKey {
  uint32_t k0, k1;
};

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline NoiseKey noise_key(int64_t key, int64_t counter) {
  const uint64_t s = splitmix64(static_cast<uint64_t>(key) ^ splitmix64(static_cast<uint64_t>(counter)));
  return {static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32)};
}

inline uvec lowbias32(uvec x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// log(x) for normal x > 0: x = 2^e m with m in [sqrt(1/2), sqrt(2)) (found in the bits, as musl's
// logf), log(m) = f + f^2 P(f) with f = m - 1 and P of degree 6 fitted by least squares at
// Chebyshev nodes (|error| < 5e-8 before rounding).
inline fvec log_positive(fvec x) {
  const ivec shifted = (ivec)x - 0x3f3504f3;  // the bits of sqrt(1/2)
  const ivec e = shifted >> 23;  // arithmetic: the exponent of x / sqrt(1/2), rounded down
  const fvec f = (fvec)((shifted & 0x7fffff) + 0x3f3504f3) - 1.0f;
  fvec p = f * -0.097315522252516f + 0.16239617584151525f;
  for (const float c : {-0.17389141343906622f, 0.199029355732184f, -0.2495676805010601f, 0.33334727199967495f,
                        -0.5000070577831116f})
    p = p * f + c;
  return __builtin_convertvector(e, fvec) * 0.693147180559945f + (f + f * f * p);
}

// g[i] = g_v of the token v = v0 + i, i < 64 (lanes past the vocabulary are the caller's to ignore).
__attribute__((noinline)) inline void gumbel64(NoiseKey key, int v0, float* g) {
  constexpr int N = NOISE_TOKENS / NOISE_LANES;
  uvec lanes;
  for (int i = 0; i < NOISE_LANES; ++i) lanes[i] = i;
  fvec w[N];
  for (int j = 0; j < N; ++j) {
    const uvec x = lowbias32(lowbias32((lanes + static_cast<uint32_t>(v0 + NOISE_LANES * j)) ^ key.k0) ^ key.k1);
    const ivec odd = (ivec)((x >> 9) << 1 | 1u);  // an odd integer below 2^24
    w[j] = __builtin_convertvector(odd, fvec) * 0x1p-24f;  // exact
  }
  for (int j = 0; j < N; ++j) w[j] = -log_positive(w[j]);  // Exp(1)
  for (int j = 0; j < N; ++j) w[j] = -log_positive(w[j]);  // Gumbel
  std::memcpy(g, w, sizeof w);
}

}  // namespace nanovllm_cpu
#pragma GCC diagnostic pop

// The library's C entry points that one kernel calls from another (cpu_decode_layers.cpp), declared
// once here so that their definitions, which include this header, are checked against them.
extern "C" {
int nanovllm_rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                      const void* weight, void* out, int64_t out_stride, void* residual_out,
                      int64_t residual_out_stride, int rows, int hidden, float eps, int num_threads);
int nanovllm_silu_and_mul(int dtype, const void* x, int64_t x_stride, void* out, int64_t out_stride, int rows,
                          int width, int num_threads);
int nanovllm_qk_norm_rope(int dtype, void* q, int64_t q_token_stride, int64_t q_head_stride, int q_heads, void* k,
                          int64_t k_token_stride, int64_t k_head_stride, int k_heads, const int64_t* positions,
                          const float* cos_sin, int64_t cos_sin_stride, const void* q_weight, const void* k_weight,
                          float eps, const void* v, int64_t v_token_stride, int64_t v_head_stride, void* k_cache,
                          void* v_cache, const int64_t* slots, int tokens, int head_dim, int num_threads);
int nanovllm_few_rows_linear(int dtype, int rows, const void* x, int64_t x_stride, const void* w, const void* bias,
                             void* out, int64_t out_stride, int N, int K, int num_threads);
int nanovllm_amx_linear(int dtype, const void* x, int64_t x_stride, int M, int K, const void* w_packed, int N,
                        const void* bias, void* out, int64_t out_stride, int num_threads);
int nanovllm_amx_prefill_takes(int head_dim, int block_size);
int nanovllm_amx_prefill_attention(const uint16_t* q, uint16_t* out, const uint16_t* k_cache, const uint16_t* v_cache,
                                   const int32_t* table, int64_t q_stride_token, int64_t q_stride_head,
                                   int64_t out_stride_token, int64_t out_stride_head, int64_t first_row, int first_pos,
                                   int queries, int head_begin, int head_end, int group, int num_kv_heads,
                                   int head_dim, int block_size, float scale);
int nanovllm_paged_attention(int dtype, const void* q, void* out, const void* k_cache, const void* v_cache,
                             const int32_t* block_tables, int64_t table_stride, const int32_t* q_start,
                             const int32_t* q_len, const int32_t* k_len, int num_seqs, int num_heads,
                             int num_kv_heads, int head_dim, int block_size, float scale, int q_tile,
                             int64_t q_stride_token, int64_t q_stride_head, int64_t out_stride_token,
                             int64_t out_stride_head, int num_threads);
}
