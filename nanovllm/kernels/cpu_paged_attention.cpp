// Paged attention on the CPU that reads the KV cache's blocks where they lie.
//
// One call attends every query row of a step: sequence s has q_len[s] new queries (1 for a
// decode row) starting at row q_start[s] of q, over its first k_len[s] cached tokens, found
// through its row of the block table; query i of the sequence sits at position
// k_len - q_len + i and sees keys 0..that position (bottom-right causal). A sequence with
// k_len 0 outputs zeros.
//
// The work is cut into items of (sequence, KV head, tile of up to `q_tile` queries), run in
// parallel by OpenMP (torch's own libgomp: the same soname, so the same thread pool) on as many
// threads as torch uses in the calling thread (passed in: OpenMP's count is per thread). An item
// holds its group of query heads for each query of its tile as rows of float32 (GQA: K/V are
// read once for the whole group, never repeated per query head) and walks the sequence's
// blocks once: scores for ROWS query rows at a time in registers, then an online softmax
// (running max and sum per row) folds the block's V into float32 accumulators, ROWS rows per V
// vector loaded. A prefill tile of 16 or more rows (float32 or bfloat16, AVX-512) goes instead to
// attend_prefill_lanes, which holds 16 rows in the lanes of a vector (see there), or, bfloat16 on a
// CPU with AMX, to cpu_amx_attention.cpp's tile products (items of up to AMX_ITEM_ROWS rows).
// Caches and queries are float32, bfloat16 or float16, the same type for both; all arithmetic
// is float32.
//
// Pointers into the scratch and the cache are __restrict__ in the inner loops: with float32
// caches, the compiler could not otherwise tell the scratch written from the cache read.
//
// No torch headers: the library is plain C with an ABI of pointers and integers, built by
// nanovllm/kernels/cpu_build.py with g++ in about a second and loaded with ctypes.
#include <utility>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace nanovllm_cpu;

// Query rows per register block (a template parameter, ROWS): each K/V vector loaded serves ROWS
// rows. Prefill takes MAX_ROWS; a decode item has `group` rows (one query per head of the group),
// so it takes 1 or 2 for groups of 1 or 2 rather than compute padding rows.
constexpr int MAX_ROWS = 4;
// Lines Ahead::step() requests per 16-bit element's worth of cache (float32 twice as many): the
// loops step ~256 times a 32-token block, and its K, V and the next block's K and V must all be
// asked for by its end (decode, 64 sequences: bf16 ~5-20%, float32 ~12-15% faster than bursts on
// a 2-vCPU AMD EPYC Zen 4, docs/BENCHMARKS.md, CPU kernels; 1 line left most to the end, 4 ran
// slower).
constexpr int AHEAD_LINES_PER_STEP = 2;
// A head's rows (queries x group, padded to ROWS) from which the block's K is transposed to
// [head_dim][tokens] so scores are vectors over tokens (no horizontal sums); fewer rows (decode)
// read each K row as it lies and sum horizontally, which costs less than the transposition.
constexpr int TRANSPOSE_MIN_ROWS = 16;
// Work items per thread below which each KV head is an item of its own; above it an item takes
// all of a sequence's KV heads, so each block is read front to back (measured ~1.5x in decode).
constexpr int ITEMS_PER_THREAD = 4;
// Query rows (queries x group) per prefill item on AMX (cpu_amx_attention.cpp): it transposes each
// chunk of K and V once for all its row tiles, so more rows share that work; fewer where the
// items would not keep the threads busy.
constexpr int AMX_ITEM_ROWS = 256;
// Whether bfloat16 prefill items go to AMX: -1 until run() first asks the CPU (amx_granted), then
// 1 or 0; nanovllm_paged_attention_amx() sets it (tests and benchmarks compare both paths).
int amx_prefill = -1;

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

struct Item {
  int32_t seq, head_begin, head_end, q_begin, q_end;  // KV heads and queries of one sequence
};

// Blocks still to come, fetched a few lines at a time from inside the compute loops (step() per
// token or group of tokens) rather than in one burst per block: a burst of hundreds of prefetches
// fills the core's miss queues and stalls the compute it was meant to overlap. `l1` (the next
// block's K, read first) goes to L1; then `l2`'s runs (the next block's V, the block after's K
// and V) to L2, offset by offset. A step asks for whole groups of lines with one test per group,
// not one per line: decode, 64 sequences, data from memory, bf16 ~15% and float32 ~6% faster on a
// 2-vCPU Intel Xeon with AMX (docs/BENCHMARKS.md, CPU kernels); a group may reach a
// few lines past a run's end, which a prefetch never faults on.
struct Ahead {
  const char* l1 = nullptr;
  int64_t l1_left = 0;
  const char* l2[3] = {nullptr, nullptr, nullptr};
  int64_t l2_off = 0, l2_bytes = 0;

  int lines_per_step = AHEAD_LINES_PER_STEP;  // attend_item scales it by the element size

  inline void step(int times = 1) {
    const int lines = lines_per_step * times;
    if (l1_left > 0) {
      for (int i = 0; i < lines; ++i) __builtin_prefetch(l1 + i * CACHE_LINE, 0, 3);
      l1 += lines * CACHE_LINE;
      l1_left -= lines * CACHE_LINE;
    } else if (l2_off < l2_bytes) {
      for (int i = 0; i < lines; ++i) {
        const int64_t off = l2_off + i * CACHE_LINE;
        __builtin_prefetch(l2[0] + off, 0, 1);
        __builtin_prefetch(l2[1] + off, 0, 1);
        __builtin_prefetch(l2[2] + off, 0, 1);
      }
      l2_off += lines * CACHE_LINE;
    }
  }
  inline void finish() {
    while (l1_left > 0 || l2_off < l2_bytes) step();
  }
};

// acc[r][0:CHUNK] += sum over t < n of p[r][t] * v[t][0:CHUNK] for ROWS rows, held in registers.
// V rows are read from the cache where they lie (token stride `token_stride`), converted in registers.
template <typename T, int ROWS, int CHUNK>
inline void accumulate_pv(float* __restrict__ acc, const float* __restrict__ p,
                          const typename T::storage* __restrict__ v, int64_t token_stride, int n,
                          int head_dim, int p_stride) {
  float a[ROWS][CHUNK];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < CHUNK; ++j) a[i][j] = acc[static_cast<size_t>(i) * head_dim + j];
  for (int t = 0; t < n; ++t) {
    float vt[CHUNK];
    load_row<T>(v + t * token_stride, vt, CHUNK);
    for (int i = 0; i < ROWS; ++i) {
      const float pi = p[static_cast<size_t>(i) * p_stride + t];
#pragma omp simd
      for (int j = 0; j < CHUNK; ++j) a[i][j] += pi * vt[j];
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < CHUNK; ++j) acc[static_cast<size_t>(i) * head_dim + j] = a[i][j];
}

// s[r][t] = qf[r] . k[t] for `rows` rows (a multiple of ROWS) and the block's n tokens of one head.
template <typename T, int ROWS>
void scores_by_dot(float* __restrict__ s, const float* __restrict__ qf, const typename T::storage* __restrict__ k,
                   int64_t token_stride, int n, int rows, int head_dim, int width, float* __restrict__ kf) {
  for (int t = 0; t < n; ++t) {
    const typename T::storage* kp = k + t * token_stride;
    const float* kr = kf;
    if constexpr (std::is_same_v<T, F32T>) {
      kr = kp;  // already float32: read in place
    } else if (head_dim % LANES == 0) {
      load_row<T>(kp, kf, head_dim);
    } else {
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) kf[d] = load<T>(kp + d);
    }
    for (int r0 = 0; r0 < rows; r0 += ROWS) {
      float a[ROWS][LANES] = {};
      int d0 = 0;
      for (; d0 + LANES <= head_dim; d0 += LANES)
        for (int i = 0; i < ROWS; ++i) {
          const float* qr = qf + static_cast<size_t>(r0 + i) * head_dim + d0;
#pragma omp simd
          for (int j = 0; j < LANES; ++j) a[i][j] += qr[j] * kr[d0 + j];
        }
      for (; d0 < head_dim; ++d0)  // a head_dim that is not a multiple of LANES: the last columns one by one
        for (int i = 0; i < ROWS; ++i) a[i][0] += qf[static_cast<size_t>(r0 + i) * head_dim + d0] * kr[d0];
      for (int i = 0; i < ROWS; ++i) {
#ifdef __AVX512F__
        s[static_cast<size_t>(r0 + i) * width + t] = _mm512_reduce_add_ps(_mm512_loadu_ps(a[i]));
#else  // a pairwise tree: vector halves added, not 16 scalar adds in a chain
        for (int half = LANES / 2; half > 0; half /= 2)
          for (int j = 0; j < half; ++j) a[i][j] += a[i][j + half];
        s[static_cast<size_t>(r0 + i) * width + t] = a[i][0];
#endif
      }
    }
  }
}

// Whether bfloat16 scores are AVX512-BF16 dot products of raw bfloat16 pairs (scaled on the sums).
template <typename T>
constexpr bool bf16_pair_dots() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return std::is_same_v<T, BF16T>;
#else
  return false;
#endif
}

#ifdef __AVX512F__
constexpr int SUM_LANES = LANES;  // lanes of scores_by_sums's and accumulate_pv_vectors's vectors
// Whether scores_by_sums takes this head_dim: whole pairs of vectors.
inline bool sums_head_dim(int head_dim) { return head_dim % (2 * SUM_LANES) == 0; }

// accumulate_pv for float32 and bfloat16 with explicit AVX-512 vectors: each row's VECS
// accumulators and the token's V vectors stay in registers, V widened once per token for all rows.
// bfloat16 V is widened 32 elements at a time by a shift (the even ones) and a mask (the odd ones),
// two plain operations where widening in order takes two shuffles more: the accumulators hold
// each 32 columns as their 16 even then their 16 odd ones (pv_position maps them back).
template <typename T, int ROWS, int VECS>
inline void accumulate_pv_vectors(float* __restrict__ acc, const float* __restrict__ p,
                                  const typename T::storage* __restrict__ v, int64_t token_stride, int n,
                                  int head_dim, int p_stride, Ahead* ahead = nullptr) {
  __m512 a[ROWS][VECS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < VECS; ++j) a[i][j] = _mm512_loadu_ps(acc + static_cast<size_t>(i) * head_dim + j * LANES);
  for (int t = 0; t < n; ++t) {
    if (ahead) ahead->step();
    const typename T::storage* vt = v + t * token_stride;
    __m512 vv[VECS];
    if constexpr (std::is_same_v<T, BF16T>) {  // 32 elements a load: even ones, then odd ones (see pv_position)
      for (int j = 0; j < VECS; j += 2) {
        const __m512i w = _mm512_loadu_si512(vt + j * LANES);
        vv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        vv[j + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
      }
    } else {
      for (int j = 0; j < VECS; ++j) vv[j] = load16<T>(vt + j * LANES);
    }
    for (int i = 0; i < ROWS; ++i) {
      const __m512 pi = _mm512_set1_ps(p[static_cast<size_t>(i) * p_stride + t]);
      for (int j = 0; j < VECS; ++j) a[i][j] = _mm512_fmadd_ps(pi, vv[j], a[i][j]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < VECS; ++j) _mm512_storeu_ps(acc + static_cast<size_t>(i) * head_dim + j * LANES, a[i][j]);
}

// One query row's products with one key row, summed to 16 lanes (not yet across them). float32:
// FMAs; bfloat16: pairwise dot products on the raw bfloat16 (qb, unscaled: products are exact in
// float32, the scale is applied to the sums) with AVX512-BF16, else K widened to float32 for FMAs
// with qf (scaled). HD: head_dim when known at compile time (0: the runtime value), so the loop
// unrolls; two accumulators halve the chain of dependent FMAs (decode, bf16: ~17% less compute
// with the data in cache, 2-vCPU AMD EPYC Zen 4, docs/BENCHMARKS.md, CPU kernels).
template <typename T, int HD>
inline __m512 dot_lanes(const float* __restrict__ qf, const uint16_t* __restrict__ qb,
                        const typename T::storage* __restrict__ kp, int runtime_head_dim) {
  const int head_dim = HD > 0 ? HD : runtime_head_dim;
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // two chains: half the FMA latency
  if constexpr (std::is_same_v<T, F32T>) {
    for (int d = 0, c = 0; d < head_dim; d += LANES, c ^= 1)
      acc[c] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), _mm512_loadu_ps(kp + d), acc[c]);
  } else {
#ifdef __AVX512BF16__
    for (int d = 0, c = 0; d < head_dim; d += 2 * LANES, c ^= 1)
      acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)_mm512_loadu_si512(qb + d), (__m512bh)_mm512_loadu_si512(kp + d));
#else
    for (int d = 0, c = 0; d < head_dim; d += LANES, c ^= 1)
      acc[c] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16<T>(kp + d), acc[c]);
#endif
  }
  return _mm512_add_ps(acc[0], acc[1]);
}

// scores_by_dot's result for the few-row (decode) case, 16 / ROWS tokens at a time: each (row,
// token) product left as 16 lanes, the 16 of a pass summed together by sum16 and stored as
// vectors. Tokens past n repeat the last one (their scores are never read). HD as dot_lanes's.
template <typename T, int ROWS, int HD>
void scores_by_sums(float* __restrict__ s, const float* __restrict__ qf, const uint16_t* __restrict__ qb,
                    const typename T::storage* __restrict__ k, int64_t token_stride, int n, int rows, int head_dim,
                    int width, float scale, Ahead* ahead = nullptr) {
  constexpr int TOKENS = LANES / ROWS;
#ifdef __AVX512BF16__
  const __m512 factor = _mm512_set1_ps(std::is_same_v<T, BF16T> ? scale : 1.0f);
#else
  const __m512 factor = _mm512_set1_ps(1.0f);
#endif
  for (int r0 = 0; r0 < rows; r0 += ROWS) {
    for (int t0 = 0; t0 < n; t0 += TOKENS) {
      if (ahead) ahead->step(TOKENS);
      __m512 lanes[LANES];
      for (int j = 0; j < TOKENS; ++j) {
        const typename T::storage* kp = k + std::min(t0 + j, n - 1) * token_stride;
        for (int i = 0; i < ROWS; ++i)
          lanes[i * TOKENS + j] = dot_lanes<T, HD>(qf + static_cast<size_t>(r0 + i) * head_dim,
                                               qb + static_cast<size_t>(r0 + i) * head_dim, kp, head_dim);
      }
      const __m512 sums = _mm512_mul_ps(sum16(lanes), factor);
      // Row i's scores are lanes i*TOKENS.. : a masked store shifted so they land at t0.
      for (int i = 0; i < ROWS; ++i)
        _mm512_mask_storeu_ps(s + static_cast<size_t>(r0 + i) * width + t0 - i * TOKENS,
                              static_cast<__mmask16>(((1u << TOKENS) - 1) << (i * TOKENS)), sums);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The decode path's vector forms in a build for AVX2-only CPUs (8 lanes): the same loops as the
// AVX-512 ones above, for float32 and bfloat16 (widened in order: no evens/odds layout here).
constexpr int SUM_LANES = 8;
inline bool sums_head_dim(int head_dim) { return head_dim % (2 * SUM_LANES) == 0; }


template <typename T, int ROWS, int VECS>
inline void accumulate_pv_vectors(float* __restrict__ acc, const float* __restrict__ p,
                                  const typename T::storage* __restrict__ v, int64_t token_stride, int n,
                                  int head_dim, int p_stride, Ahead* ahead = nullptr) {
  __m256 a[ROWS][VECS];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < VECS; ++j) a[i][j] = _mm256_loadu_ps(acc + static_cast<size_t>(i) * head_dim + j * SUM_LANES);
  for (int t = 0; t < n; ++t) {
    if (ahead) ahead->step();
    const typename T::storage* vt = v + t * token_stride;
    __m256 vv[VECS];
    for (int j = 0; j < VECS; ++j) vv[j] = load8<T>(vt + j * SUM_LANES);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 pi = _mm256_set1_ps(p[static_cast<size_t>(i) * p_stride + t]);
      for (int j = 0; j < VECS; ++j) a[i][j] = _mm256_fmadd_ps(pi, vv[j], a[i][j]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < VECS; ++j) _mm256_storeu_ps(acc + static_cast<size_t>(i) * head_dim + j * SUM_LANES, a[i][j]);
}

// One query row (float32, scaled) times one key row, summed to 8 lanes; two chains of FMAs.
template <typename T, int HD>
inline __m256 dot_lanes(const float* __restrict__ qf, const typename T::storage* __restrict__ kp,
                        int runtime_head_dim) {
  const int head_dim = HD > 0 ? HD : runtime_head_dim;
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int d = 0, c = 0; d < head_dim; d += SUM_LANES, c ^= 1)
    acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), load8<T>(kp + d), acc[c]);
  return _mm256_add_ps(acc[0], acc[1]);
}

// scores_by_dot's result for the few-row (decode) case, 8 / ROWS tokens at a time (tokens past n
// repeat the last one; their scores are never read). qb and scale are the AVX-512 form's (unused).
template <typename T, int ROWS, int HD>
void scores_by_sums(float* __restrict__ s, const float* __restrict__ qf, const uint16_t* __restrict__ /*qb*/,
                    const typename T::storage* __restrict__ k, int64_t token_stride, int n, int rows, int head_dim,
                    int width, float /*scale*/, Ahead* ahead = nullptr) {
  constexpr int TOKENS = SUM_LANES / ROWS;
  for (int r0 = 0; r0 < rows; r0 += ROWS) {
    for (int t0 = 0; t0 < n; t0 += TOKENS) {
      if (ahead) ahead->step(TOKENS);
      __m256 lanes[SUM_LANES];
      for (int j = 0; j < TOKENS; ++j) {
        const typename T::storage* kp = k + std::min(t0 + j, n - 1) * token_stride;
        for (int i = 0; i < ROWS; ++i)
          lanes[i * TOKENS + j] = dot_lanes<T, HD>(qf + static_cast<size_t>(r0 + i) * head_dim, kp, head_dim);
      }
      alignas(32) float sums[SUM_LANES];
      _mm256_store_ps(sums, sum8(lanes));
      for (int i = 0; i < ROWS; ++i)  // row i's scores are lanes i*TOKENS..
        std::memcpy(s + static_cast<size_t>(r0 + i) * width + t0, sums + i * TOKENS, TOKENS * sizeof(float));
    }
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define NANOVLLM_SUMS 1  // scores_by_sums and accumulate_pv_vectors exist
#endif

// The same scores through K transposed into kt [head_dim][width] (tokens n..padded zeroed).
template <typename T, int ROWS>
void scores_transposed(float* __restrict__ s, const float* __restrict__ qf, const typename T::storage* __restrict__ k,
                       int64_t token_stride, int n, int rows, int head_dim, int width, float* __restrict__ kt) {
  const int n_padded = round_up(n, LANES);
  // Row by row of kt: its stores are contiguous and its strided loads vectorise as gathers.
  for (int d = 0; d < head_dim; ++d) {
    float* kd = kt + static_cast<size_t>(d) * width;
    for (int t = 0; t < n; ++t) kd[t] = load<T>(k + t * token_stride + d);
    for (int t = n; t < n_padded; ++t) kd[t] = 0.0f;
  }
  for (int r0 = 0; r0 < rows; r0 += ROWS) {
    for (int t0 = 0; t0 < n_padded; t0 += LANES) {
      float a[ROWS][LANES] = {};
      for (int d = 0; d < head_dim; ++d) {
        const float* kd = kt + static_cast<size_t>(d) * width + t0;
        for (int i = 0; i < ROWS; ++i) {
          const float qd = qf[static_cast<size_t>(r0 + i) * head_dim + d];
#pragma omp simd
          for (int j = 0; j < LANES; ++j) a[i][j] += qd * kd[j];
        }
      }
      for (int i = 0; i < ROWS; ++i)
        for (int j = 0; j < LANES; ++j) s[static_cast<size_t>(r0 + i) * width + t0 + j] = a[i][j];
    }
  }
}

#define ALWAYS_INLINE __attribute__((always_inline)) inline
// The vector operations of the prefill lanes path, at the width the build has: 16 lanes with
// AVX-512, 8 with AVX2 + FMA (the build an AVX2-only CPU gets), none otherwise (the generic loops).
#if defined(__AVX512F__)
#define NANOVLLM_LANES 1
struct Lanes {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  ALWAYS_INLINE static F load(const float* p) { return _mm512_loadu_ps(p); }
  ALWAYS_INLINE static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  ALWAYS_INLINE static F set1(float x) { return _mm512_set1_ps(x); }
  ALWAYS_INLINE static F zero() { return _mm512_setzero_ps(); }
  ALWAYS_INLINE static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  ALWAYS_INLINE static F add(F a, F b) { return _mm512_add_ps(a, b); }
  ALWAYS_INLINE static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  ALWAYS_INLINE static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  ALWAYS_INLINE static F max(F a, F b) { return _mm512_max_ps(a, b); }
  ALWAYS_INLINE static F exp(F x) { return exp_nonpositive_v(x); }
  ALWAYS_INLINE static I load_positions(const int32_t* p) { return _mm512_loadu_si512(p); }
  // x with -inf in the lanes whose query lies before key position `key` (the causal mask)
  ALWAYS_INLINE static F mask_past(F x, int key, I pos) {
    return _mm512_mask_mov_ps(x, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(key), pos), _mm512_set1_ps(-INFINITY));
  }
  ALWAYS_INLINE static bool all_one(F x) { return !_mm512_cmp_ps_mask(x, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define NANOVLLM_LANES 1
struct Lanes {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  ALWAYS_INLINE static F load(const float* p) { return _mm256_loadu_ps(p); }
  ALWAYS_INLINE static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  ALWAYS_INLINE static F set1(float x) { return _mm256_set1_ps(x); }
  ALWAYS_INLINE static F zero() { return _mm256_setzero_ps(); }
  ALWAYS_INLINE static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  ALWAYS_INLINE static F add(F a, F b) { return _mm256_add_ps(a, b); }
  ALWAYS_INLINE static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  ALWAYS_INLINE static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  ALWAYS_INLINE static F max(F a, F b) { return _mm256_max_ps(a, b); }
  ALWAYS_INLINE static F exp(F x) { return exp_nonpositive_v8(x); }
  ALWAYS_INLINE static I load_positions(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  ALWAYS_INLINE static F mask_past(F x, int key, I pos) {
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY),
                            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(key), pos)));
  }
  ALWAYS_INLINE static bool all_one(F x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(1.0f), _CMP_NEQ_UQ)) == 0; }
};
#endif

#ifdef NANOVLLM_LANES
// ---- Prefill tiles: query rows in the vector lanes ----
// A tile of many query rows (queries x its group of heads) puts W rows in the lanes of a vector
// (Lanes: 16 with AVX-512, 8 in an AVX2-only build),
// RV vectors a pass, so every step is a vertical vector operation: scores are 16 rows x one key
// (Q transposed once per pass, each key element broadcast from the cache where it lies: no K
// transposition, no horizontal sums), the softmax's max and sum run down a block's tokens, and
// P x V broadcasts each V element to W rows' FMAs. bfloat16 scores are AVX512-BF16 dot products
// of raw bfloat16 pairs (as decode's: products exact in float32, scaled on the sums).

// Whether a prefill tile of a vector_type takes the lanes path: head_dim whole vectors.
inline bool lanes_head_dim(int head_dim) { return head_dim % LANES == 0; }

// One pass: R = W * RV rows of one KV head, their positions `pos` (lane r sees keys 0..pos[r]),
// over the head's keys 0..visible_end-1. qt holds Q transposed: float32 [head_dim][R] (scaled),
// or for bfloat16 [head_dim / 2][R] pairs of raw bfloat16 as 32-bit words. Leaves O transposed,
// unnormalised, in ot [head_dim][R] and the softmax sums in l[R].
template <typename T, int RV>
ALWAYS_INLINE void prefill_lanes_pass(const void* qt, const int32_t* pos, const typename T::storage* k_head,
                        const typename T::storage* v_head, const int32_t* table, int64_t token_stride,
                        int64_t block_stride, int block_size, int visible_end, int head_dim, float scale,
                        float* __restrict__ ot, float* __restrict__ l, float* __restrict__ s, float* __restrict__ vf) {
  using S = typename T::storage;
  using F = Lanes::F;
  constexpr int W = Lanes::W;
  constexpr int R = W * RV;
  constexpr int TT = W / RV;  // key tokens per register tile of scores (TT x RV accumulators)
  constexpr int DB = W / RV;  // head dims per register tile of P x V
  constexpr bool pairs = bf16_pair_dots<T>() && W == LANES;  // AVX512-BF16 pairs: 16-lane vectors
  F m[RV], sum[RV];
  typename Lanes::I positions[RV];
  for (int rv = 0; rv < RV; ++rv) {
    m[rv] = Lanes::set1(-INFINITY);
    sum[rv] = Lanes::zero();
    positions[rv] = Lanes::load_positions(pos + rv * W);
  }
  const int min_pos = *std::min_element(pos, pos + R);
  std::fill(ot, ot + static_cast<size_t>(head_dim) * R, 0.0f);
  const int num_blocks = (visible_end + block_size - 1) / block_size;
  for (int b = 0; b < num_blocks; ++b) {
    const int first = b * block_size;
    const int n = std::min(block_size, visible_end - first);
    const S* k = k_head + static_cast<int64_t>(table[b]) * block_stride;
    const S* v = v_head + static_cast<int64_t>(table[b]) * block_stride;
    // 1. Scores s[t][R] for the block's n tokens, TT at a time (tokens past n repeat the last).
    for (int t0 = 0; t0 < n; t0 += TT) {
      F acc[TT][RV];
      const S* kt[TT];
      for (int j = 0; j < TT; ++j) {
        kt[j] = k + std::min(t0 + j, n - 1) * token_stride;
        for (int rv = 0; rv < RV; ++rv) acc[j][rv] = Lanes::zero();
      }
      if constexpr (pairs) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        const uint32_t* qp = static_cast<const uint32_t*>(qt);
        for (int dp = 0; dp < head_dim / 2; ++dp) {
          __m512bh qv[RV];
          for (int rv = 0; rv < RV; ++rv) qv[rv] = (__m512bh)_mm512_loadu_si512(qp + static_cast<size_t>(dp) * R + rv * LANES);
          for (int j = 0; j < TT; ++j) {
            uint32_t word;
            std::memcpy(&word, kt[j] + 2 * dp, sizeof word);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
            for (int rv = 0; rv < RV; ++rv) acc[j][rv] = _mm512_dpbf16_ps(acc[j][rv], qv[rv], kb);
          }
        }
        for (int j = 0; j < TT; ++j)
          for (int rv = 0; rv < RV; ++rv) acc[j][rv] = _mm512_mul_ps(acc[j][rv], _mm512_set1_ps(scale));
#endif
      } else {
        const float* qf = static_cast<const float*>(qt);
        for (int d = 0; d < head_dim; ++d) {
          F qv[RV];
          for (int rv = 0; rv < RV; ++rv) qv[rv] = Lanes::load(qf + static_cast<size_t>(d) * R + rv * W);
          for (int j = 0; j < TT; ++j) {
            const F kb = Lanes::set1(load<T>(kt[j] + d));
            for (int rv = 0; rv < RV; ++rv) acc[j][rv] = Lanes::fmadd(qv[rv], kb, acc[j][rv]);
          }
        }
      }
      const bool masked = first + t0 + TT - 1 > min_pos;  // some key here lies past some row's query
      for (int j = 0; j < TT && t0 + j < n; ++j)
        for (int rv = 0; rv < RV; ++rv) {
          F x = acc[j][rv];
          if (masked) x = Lanes::mask_past(x, first + t0 + j, positions[rv]);
          Lanes::store(s + static_cast<size_t>(t0 + j) * R + rv * W, x);
        }
    }
    // 2. Online softmax down the block's tokens: new running max, weights, sums, O rescaled.
    for (int rv = 0; rv < RV; ++rv) {
      F block_max = Lanes::set1(-INFINITY);
      for (int t = 0; t < n; ++t) block_max = Lanes::max(block_max, Lanes::load(s + static_cast<size_t>(t) * R + rv * W));
      const F new_max = Lanes::max(m[rv], block_max);  // finite: every lane sees key 0
      const F correction = Lanes::exp(Lanes::sub(m[rv], new_max));  // 0 on the first block
      F block_sum = Lanes::zero();
      for (int t = 0; t < n; ++t) {
        float* st = s + static_cast<size_t>(t) * R + rv * W;
        const F p = Lanes::exp(Lanes::sub(Lanes::load(st), new_max));
        Lanes::store(st, p);
        block_sum = Lanes::add(block_sum, p);
      }
      sum[rv] = Lanes::add(Lanes::mul(sum[rv], correction), block_sum);
      m[rv] = new_max;
      if (!Lanes::all_one(correction))
        for (int d = 0; d < head_dim; ++d) {
          float* od = ot + static_cast<size_t>(d) * R + rv * W;
          Lanes::store(od, Lanes::mul(Lanes::load(od), correction));
        }
    }
    // 3. O += P x V: V in float32 (bfloat16 widened once per block), each element broadcast.
    const float* vrows = nullptr;
    int64_t v_stride = token_stride;
    if constexpr (std::is_same_v<T, F32T>) {
      vrows = v;
    } else {
      for (int t = 0; t < n; ++t) load_row<T>(v + t * token_stride, vf + static_cast<size_t>(t) * head_dim, head_dim);
      vrows = vf;
      v_stride = head_dim;
    }
    for (int d0 = 0; d0 < head_dim; d0 += DB) {
      F o[DB][RV];
      for (int j = 0; j < DB; ++j)
        for (int rv = 0; rv < RV; ++rv) o[j][rv] = Lanes::load(ot + static_cast<size_t>(d0 + j) * R + rv * W);
      for (int t = 0; t < n; ++t) {
        F p[RV];
        for (int rv = 0; rv < RV; ++rv) p[rv] = Lanes::load(s + static_cast<size_t>(t) * R + rv * W);
        const float* vt = vrows + t * v_stride + d0;
        for (int j = 0; j < DB; ++j) {
          const F vb = Lanes::set1(vt[j]);
          for (int rv = 0; rv < RV; ++rv) o[j][rv] = Lanes::fmadd(p[rv], vb, o[j][rv]);
        }
      }
      for (int j = 0; j < DB; ++j)
        for (int rv = 0; rv < RV; ++rv) Lanes::store(ot + static_cast<size_t>(d0 + j) * R + rv * W, o[j][rv]);
    }
  }
  for (int rv = 0; rv < RV; ++rv) Lanes::store(l + rv * W, sum[rv]);
}

// A prefill item on the lanes path: for each KV head, its rows (queries x group) in passes of up
// to 2W rows (W when W cover them), each pass a walk of the keys its rows see.
template <typename T>
void attend_prefill_lanes(const Item& item, const typename T::storage* q, typename T::storage* out,
                          const typename T::storage* k_cache, const typename T::storage* v_cache,
                          const int32_t* table, int64_t q_stride_token, int64_t q_stride_head,
                          int64_t out_stride_token, int64_t out_stride_head, int32_t q_start, int32_t q_len,
                          int32_t k_len, int group, int num_kv_heads, int head_dim, int block_size, float scale,
                          std::vector<float>& scratch) {
  using S = typename T::storage;
  constexpr int W = Lanes::W, R = 2 * W;
  const int live_rows = (item.q_end - item.q_begin) * group;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t block_stride = token_stride * block_size;
  // Scratch: Q transposed, O transposed, scores [block][R], V of a block in float32, sums.
  const size_t need = 2 * static_cast<size_t>(head_dim) * R + static_cast<size_t>(block_size) * R +
                      static_cast<size_t>(block_size) * head_dim + R;
  if (scratch.size() < need) scratch.resize(need);
  float* qt = scratch.data();
  float* ot = qt + static_cast<size_t>(head_dim) * R;
  float* s = ot + static_cast<size_t>(head_dim) * R;
  float* vf = s + static_cast<size_t>(block_size) * R;
  float* l = vf + static_cast<size_t>(block_size) * head_dim;
  const int first_pos = k_len - q_len + item.q_begin;  // the item's first query's position
  for (int h = item.head_begin; h < item.head_end; ++h) {
    for (int r0 = 0; r0 < live_rows; r0 += R) {
      const int rows = std::min(R, live_rows - r0);
      const int rv_count = rows > W ? 2 : 1;
      const int width = rv_count * W;
      // Lane r: row r0 + r = query (r0 + r) / group, head h * group + (r0 + r) % group. Padding
      // lanes repeat the pass's last row (finite, dropped).
      alignas(64) int32_t pos[R] = {};
      for (int r = 0; r < width; ++r) pos[r] = first_pos + (r0 + std::min(r, rows - 1)) / group;
      for (int r = 0; r < width; ++r) {
        const int row = r0 + std::min(r, rows - 1);
        const S* src = q + static_cast<int64_t>(q_start + item.q_begin + row / group) * q_stride_token +
                       static_cast<int64_t>(h * group + row % group) * q_stride_head;
        if constexpr (bf16_pair_dots<T>() && W == LANES) {
          uint32_t* qp = reinterpret_cast<uint32_t*>(qt);
          for (int dp = 0; dp < head_dim / 2; ++dp)
            qp[static_cast<size_t>(dp) * width + r] = static_cast<uint32_t>(src[2 * dp]) |
                                                       static_cast<uint32_t>(src[2 * dp + 1]) << 16;
        } else {
          for (int d = 0; d < head_dim; ++d) qt[static_cast<size_t>(d) * width + r] = load<T>(src + d) * scale;
        }
      }
      const int visible_end = pos[rows - 1] + 1;
      const S* k_head = k_cache + static_cast<int64_t>(h) * head_dim;
      const S* v_head = v_cache + static_cast<int64_t>(h) * head_dim;
      if (rv_count == 2)
        prefill_lanes_pass<T, 2>(qt, pos, k_head, v_head, table, token_stride, block_stride, block_size, visible_end,
                                 head_dim, scale, ot, l, s, vf);
      else
        prefill_lanes_pass<T, 1>(qt, pos, k_head, v_head, table, token_stride, block_stride, block_size, visible_end,
                                 head_dim, scale, ot, l, s, vf);
      for (int r = 0; r < rows; ++r) {
        const int row = r0 + r;
        S* dst = out + static_cast<int64_t>(q_start + item.q_begin + row / group) * out_stride_token +
                 static_cast<int64_t>(h * group + row % group) * out_stride_head;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < head_dim; ++d) store<T>(dst + d, ot[static_cast<size_t>(d) * width + r] * inv);
      }
    }
  }
}
#endif

// One row's block of the online softmax: with its running max m, scores sr[0..nv) become
// exp(score - new max) and sr[nv..n) zeros; returns (new max, the weights' sum). sr has room for n
// rounded up to whole vectors (the scratch's row width).
inline std::pair<float, float> softmax_weights(float* __restrict__ sr, int nv, int n, float m) {
#ifdef __AVX512F__
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int t = 0; t < nv; t += LANES) vmax = _mm512_mask_max_ps(vmax, first_lanes(nv - t), vmax, _mm512_loadu_ps(sr + t));
  const float new_max = std::max(m, _mm512_reduce_max_ps(vmax));
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 vsum = _mm512_setzero_ps();
  for (int t = 0; t < n; t += LANES) {
    const __mmask16 live = first_lanes(nv - t);
    const __m512 w = _mm512_maskz_mov_ps(live, exp_nonpositive_v(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sr + t), shift)));
    vsum = _mm512_add_ps(vsum, w);
    _mm512_mask_storeu_ps(sr + t, first_lanes(n - t), w);
  }
  return {new_max, _mm512_reduce_add_ps(vsum)};
#else
  float block_max = sr[0];
#pragma omp simd reduction(max : block_max)
  for (int t = 1; t < nv; ++t) block_max = std::max(block_max, sr[t]);
  const float new_max = std::max(m, block_max);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < nv; ++t) {
    sr[t] = exp_nonpositive(sr[t] - new_max);
    sum += sr[t];
  }
  std::fill(sr + nv, sr + n, 0.0f);
  return {new_max, sum};
#endif
}

// Where column d of a row's accumulator lies: bfloat16's vector P x V (head_dim's whole 32s) keeps
// each 32 columns as evens then odds; everything else in order.
template <typename T>
inline int pv_position(int d, int head_dim) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, BF16T>) {
    if (d < head_dim / (2 * LANES) * (2 * LANES)) {
      const int within = d % (2 * LANES);
      return d - within + (within % 2) * LANES + within / 2;
    }
  }
#endif
  return d;
}

template <typename T, int ROWS>
void attend_item(const Item& item, const typename T::storage* q, typename T::storage* out,
                 const typename T::storage* k_cache, const typename T::storage* v_cache,
                 const int32_t* table, int64_t q_stride_token, int64_t q_stride_head,
                 int64_t out_stride_token, int64_t out_stride_head, int32_t q_start, int32_t q_len,
                 int32_t k_len, int group, int num_kv_heads, int head_dim, int block_size, float scale,
                 std::vector<float>& scratch) {
  using S = typename T::storage;
  const int queries = item.q_end - item.q_begin;
  const int heads = item.head_end - item.head_begin;
  // Rows are head-major: head hl's rows start at hl * head_rows, query i's group at i * group
  // within them; rows past queries * group pad each head's to a multiple of ROWS (zeros, dropped).
  const int live_rows = queries * group;
  const int head_rows = round_up(live_rows, ROWS);
  const int rows = heads * head_rows;
  const bool transpose = head_rows >= TRANSPOSE_MIN_ROWS;
  if constexpr (std::is_same_v<T, BF16T>) {  // a prefill tile of many rows, on AMX where it takes the shapes
    if (live_rows >= LANES && amx_prefill == 1 &&
        nanovllm_amx_prefill_attention(q, out, k_cache, v_cache, table, q_stride_token, q_stride_head,
                                       out_stride_token, out_stride_head, q_start + item.q_begin,
                                       k_len - q_len + item.q_begin, queries, item.head_begin, item.head_end, group,
                                       num_kv_heads, head_dim, block_size, scale) == 0)
      return;
  }
#ifdef NANOVLLM_LANES
  if constexpr (vector_type<T>()) {
    if (live_rows >= Lanes::W && lanes_head_dim(head_dim)) {  // a prefill tile of many rows
      attend_prefill_lanes<T>(item, q, out, k_cache, v_cache, table, q_stride_token, q_stride_head, out_stride_token,
                              out_stride_head, q_start, q_len, k_len, group, num_kv_heads, head_dim, block_size, scale,
                              scratch);
      return;
    }
  }
#endif
  const int width = round_up(block_size, LANES);  // a score row's stride
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;  // within a block
  const int64_t block_stride = token_stride * block_size;
  // Scratch: q rows, accumulators, scores [rows][width], K in float32 (one row, or the block
  // transposed); running max and sum per row.
  const size_t q_size = static_cast<size_t>(rows) * head_dim;
  const size_t s_size = static_cast<size_t>(rows) * width;
  const size_t k_size = static_cast<size_t>(head_dim) * (transpose ? width : 1);
#ifdef NANOVLLM_SUMS
  const bool by_sums = vector_type<T>() && !transpose && sums_head_dim(head_dim);
  const bool steps_ahead = by_sums;  // its loops and P x V's vector loops call Ahead::step()
  auto sums = head_dim == 64    ? scores_by_sums<T, ROWS, 64>
              : head_dim == 128 ? scores_by_sums<T, ROWS, 128>
              : head_dim == 32  ? scores_by_sums<T, ROWS, 32>
                                : scores_by_sums<T, ROWS, 0>;  // HD: the head_dims models have, unrolled
#else
  const bool steps_ahead = false;
#endif
  // bfloat16 queries as they are, for scores_by_sums's dot products (q_size halves: 16-bit each).
  const size_t qb_size = bf16_pair_dots<T>() ? (q_size + 1) / 2 : 0;  // only AVX512-BF16's dot products read them
  const size_t need = 2 * q_size + s_size + k_size + 2 * static_cast<size_t>(rows) + qb_size;
  if (scratch.size() < need) scratch.resize(need);
  float* qf = scratch.data();
  float* acc = qf + q_size;
  float* s = acc + q_size;
  float* kbuf = s + s_size;
  float* m = kbuf + k_size;
  float* l = m + rows;
  uint16_t* qb = reinterpret_cast<uint16_t*>(l + rows);
  std::fill(qf, qf + q_size, 0.0f);
  if (qb_size) std::fill(qb, qb + q_size, uint16_t{0});
  for (int hl = 0; hl < heads; ++hl)
    for (int i = 0; i < queries; ++i)
      for (int g = 0; g < group; ++g) {
        const S* src = q + static_cast<int64_t>(q_start + item.q_begin + i) * q_stride_token +
                       static_cast<int64_t>((item.head_begin + hl) * group + g) * q_stride_head;
        const size_t row = static_cast<size_t>(hl * head_rows + i * group + g) * head_dim;
        for (int d = 0; d < head_dim; ++d) qf[row + d] = load<T>(src + d) * scale;
        if (qb_size) std::memcpy(qb + row, src, head_dim * sizeof(S));
      }
  std::fill(acc, acc + q_size, 0.0f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);
  // The last query of the tile sees the most keys: through position k_len - q_len + q_end - 1.
  const int visible_end = k_len - q_len + item.q_end;
  const int num_blocks = (visible_end + block_size - 1) / block_size;
  const int head_bytes = head_dim * static_cast<int>(sizeof(S));
  if (heads == num_kv_heads && num_blocks > 1) {  // the second block on its way to L2 (the loop fetches the third on)
    const char* kp = reinterpret_cast<const char*>(k_cache + static_cast<int64_t>(table[1]) * block_stride);
    const char* vp = reinterpret_cast<const char*>(v_cache + static_cast<int64_t>(table[1]) * block_stride);
    for (int64_t off = 0; off < block_stride * static_cast<int64_t>(sizeof(S)); off += CACHE_LINE) {
      __builtin_prefetch(kp + off, 0, 1);
      __builtin_prefetch(vp + off, 0, 1);
    }
  }
  for (int b = 0; b < num_blocks; ++b) {
    const int first = b * block_size;
    const int n = std::min(block_size, visible_end - first);
    const S* k_block = k_cache + static_cast<int64_t>(table[b]) * block_stride;
    const S* v_block = v_cache + static_cast<int64_t>(table[b]) * block_stride;
    Ahead ahead;  // the blocks to come, fetched from inside the loops below (where steps_ahead)
    if (b + 1 < num_blocks) {  // the next block's rows of these heads, fetched while this one computes
      const int64_t next = static_cast<int64_t>(table[b + 1]) * block_stride;
      if (heads == num_kv_heads) {  // the whole block: one contiguous run of bytes
        const char* kp = reinterpret_cast<const char*>(k_cache + next);
        const char* vp = reinterpret_cast<const char*>(v_cache + next);
        const int64_t bytes = block_stride * static_cast<int64_t>(sizeof(S));
        // And the block after it, K and V, to L2: decode is memory-bound (cache-resident, a bf16
        // layer at 64 sequences takes 0.63 ms against 1.8 from memory), and the earlier request
        // keeps more lines in flight (bf16 ~15% faster, docs/BENCHMARKS.md, CPU kernels).
        const bool third = b + 2 < num_blocks;
        const char* kp2 = third ? reinterpret_cast<const char*>(k_cache + static_cast<int64_t>(table[b + 2]) * block_stride) : nullptr;
        const char* vp2 = third ? reinterpret_cast<const char*>(v_cache + static_cast<int64_t>(table[b + 2]) * block_stride) : nullptr;
        // Where the loops step (scores by sums: float32 and bfloat16), the requests go out from
        // inside them (Ahead); elsewhere all at once here: K to L1, read first (float32 ~7% faster
        // than to L2), the rest to L2 (both blocks would overflow L1).
        if (steps_ahead) {
          ahead.l1 = kp;
          ahead.l1_left = bytes;
          ahead.l2[0] = vp;
          ahead.l2[1] = third ? kp2 : vp;  // no block after: the next V again (requests that hit)
          ahead.l2[2] = third ? vp2 : vp;
          ahead.l2_off = 0;
          ahead.l2_bytes = bytes;
          ahead.lines_per_step = AHEAD_LINES_PER_STEP * static_cast<int>(sizeof(S)) / 2;
        } else {
          for (int64_t off = 0; off < bytes; off += CACHE_LINE) {
            __builtin_prefetch(kp + off, 0, 3);
            __builtin_prefetch(vp + off, 0, 1);
            if (third) {
              __builtin_prefetch(kp2 + off, 0, 1);
              __builtin_prefetch(vp2 + off, 0, 1);
            }
          }
        }
      } else {
        for (int t = 0; t < block_size; ++t) {
          const char* kp = reinterpret_cast<const char*>(k_cache + next + t * token_stride + item.head_begin * head_dim);
          const char* vp = reinterpret_cast<const char*>(v_cache + next + t * token_stride + item.head_begin * head_dim);
          for (int off = 0; off < heads * head_bytes; off += CACHE_LINE) {
            __builtin_prefetch(kp + off, 0, 1);
            __builtin_prefetch(vp + off, 0, 1);
          }
        }
      }
    }
    for (int hl = 0; hl < heads; ++hl) {
      const S* k = k_block + static_cast<int64_t>(item.head_begin + hl) * head_dim;
      float* sh = s + static_cast<size_t>(hl) * head_rows * width;
      const float* qh = qf + static_cast<size_t>(hl) * head_rows * head_dim;
      if (transpose) {
        scores_transposed<T, ROWS>(sh, qh, k, token_stride, n, head_rows, head_dim, width, kbuf);
        continue;
      }
#ifdef NANOVLLM_SUMS
      if (by_sums) {
        sums(sh, qh, qb + static_cast<size_t>(hl) * head_rows * head_dim, k, token_stride, n, head_rows, head_dim,
             width, scale, &ahead);
        continue;
      }
#endif
      scores_by_dot<T, ROWS>(sh, qh, k, token_stride, n, head_rows, head_dim, width, kbuf);
    }
    // Online softmax per row over the keys it sees here (positions first..first+nv-1); the
    // row's scores become its weights, zero past nv, and its accumulator is rescaled.
    for (int r = 0; r < rows; ++r) {
      float* sr = s + static_cast<size_t>(r) * width;
      const int within = r % head_rows;
      const int nv = within < live_rows ? std::min(n, k_len - q_len + item.q_begin + within / group - first + 1) : 0;
      if (nv <= 0) {
        std::fill(sr, sr + n, 0.0f);
        continue;
      }
      const auto [new_max, sum] = softmax_weights(sr, nv, n, m[r]);
      const float correction = exp_nonpositive(m[r] - new_max);  // 0 on the first block (-inf)
      if (correction != 1.0f) {
        float* ar = acc + static_cast<size_t>(r) * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; ++d) ar[d] *= correction;
      }
      l[r] = l[r] * correction + sum;
      m[r] = new_max;
    }
    for (int r0 = 0; r0 < rows; r0 += ROWS) {
      float* ar = acc + static_cast<size_t>(r0) * head_dim;
      const float* pr = s + static_cast<size_t>(r0) * width;
      const S* v = v_block + static_cast<int64_t>(item.head_begin + r0 / head_rows) * head_dim;
      int d0 = 0;
#ifdef NANOVLLM_SUMS
      if constexpr (vector_type<T>()) {
        // Four vectors a pass, but two for four rows on AVX2 (its 16 registers hold 4 x 2 sums)
        constexpr int VECS = SUM_LANES == LANES || ROWS <= 2 ? 4 : 2;
        for (; d0 + VECS * SUM_LANES <= head_dim; d0 += VECS * SUM_LANES)
          accumulate_pv_vectors<T, ROWS, VECS>(ar + d0, pr, v + d0, token_stride, n, head_dim, width, &ahead);
        for (; d0 + 2 * SUM_LANES <= head_dim; d0 += 2 * SUM_LANES)  // head_dim 32, or the rest of 96
          accumulate_pv_vectors<T, ROWS, 2>(ar + d0, pr, v + d0, token_stride, n, head_dim, width, &ahead);
      }
#endif
      for (; d0 + 4 * LANES <= head_dim; d0 += 4 * LANES)
        accumulate_pv<T, ROWS, 4 * LANES>(ar + d0, pr, v + d0, token_stride, n, head_dim, width);
      for (; d0 + LANES <= head_dim; d0 += LANES)
        accumulate_pv<T, ROWS, LANES>(ar + d0, pr, v + d0, token_stride, n, head_dim, width);
      for (; d0 < head_dim; ++d0)  // a head_dim that is not a multiple of LANES: the last columns one by one
        for (int i = 0; i < ROWS; ++i)
          for (int t = 0; t < n; ++t)
            ar[static_cast<size_t>(i) * head_dim + d0] +=
                pr[static_cast<size_t>(i) * width + t] * load<T>(v + t * token_stride + d0);
    }
    ahead.finish();  // what the loops left (a short block, a path that does not step)
  }
  for (int hl = 0; hl < heads; ++hl)
    for (int i = 0; i < queries; ++i)
      for (int g = 0; g < group; ++g) {
        const int r = hl * head_rows + i * group + g;
        S* dst = out + static_cast<int64_t>(q_start + item.q_begin + i) * out_stride_token +
                 static_cast<int64_t>((item.head_begin + hl) * group + g) * out_stride_head;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // no keys: zeros
        const float* ar = acc + static_cast<size_t>(r) * head_dim;
        for (int d = 0; d < head_dim; ++d) store<T>(dst + d, ar[pv_position<T>(d, head_dim)] * inv);
      }
}

template <typename T>
void run(const void* q, void* out, const void* k_cache, const void* v_cache, const int32_t* block_tables,
         int64_t table_stride, const int32_t* q_start, const int32_t* q_len, const int32_t* k_len, int num_seqs,
         int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int q_tile,
         int64_t q_stride_token, int64_t q_stride_head, int64_t out_stride_token, int64_t out_stride_head,
         int num_threads) {
  using S = typename T::storage;
  const int group = num_heads / num_kv_heads;
  const auto count_tiles = [&](int tile) {
    int64_t n = 0;
    for (int s = 0; s < num_seqs; ++s) n += (q_len[s] + tile - 1) / tile;
    return n;
  };
  if (amx_prefill < 0) amx_prefill = amx_granted();
  if (std::is_same_v<T, BF16T> && amx_prefill == 1 && q_tile > 1 && nanovllm_amx_prefill_takes(head_dim, block_size)) {
    // Prefill items for AMX take up to AMX_ITEM_ROWS rows, where that leaves the threads enough items.
    const int amx_tile = std::max(q_tile, AMX_ITEM_ROWS / group);
    if (count_tiles(amx_tile) * num_kv_heads >= static_cast<int64_t>(ITEMS_PER_THREAD) * num_threads) q_tile = amx_tile;
  }
  const int64_t tiles = count_tiles(q_tile);
  const int heads_per_item = tiles >= static_cast<int64_t>(ITEMS_PER_THREAD) * num_threads ? num_kv_heads : 1;
  std::vector<Item> items;
  for (int s = 0; s < num_seqs; ++s)
    for (int begin = 0; begin < q_len[s]; begin += q_tile) {
      const int end = std::min(q_len[s], begin + q_tile);
      for (int h = 0; h < num_kv_heads; h += heads_per_item) items.push_back({s, h, h + heads_per_item, begin, end});
    }
  // Longest contexts first, so the dynamic schedule does not end on one long item.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return k_len[a.seq] - q_len[a.seq] + a.q_end > k_len[b.seq] - q_len[b.seq] + b.q_end;
  });
  const int64_t count = static_cast<int64_t>(items.size());
  // Rows per item's head: decode (one query) has `group`, prefill tiles many more.
  const int max_live_rows = q_tile * group;
  auto attend = max_live_rows == 1 ? attend_item<T, 1> : max_live_rows == 2 ? attend_item<T, 2> : attend_item<T, MAX_ROWS>;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < count; ++w) {
      const Item& item = items[w];
      attend(item, static_cast<const S*>(q), static_cast<S*>(out), static_cast<const S*>(k_cache),
                     static_cast<const S*>(v_cache), block_tables + item.seq * table_stride, q_stride_token,
                     q_stride_head, out_stride_token, out_stride_head, q_start[item.seq], q_len[item.seq],
                     k_len[item.seq], group, num_kv_heads, head_dim, block_size, scale, scratch);
    }
  }
}

}  // namespace

extern "C" {

// The ABI version Python checks after loading, so a stale cached library is never called.
int nanovllm_paged_attention_abi() { return 7; }

// Whether bfloat16 prefill items run on AMX tiles (cpu_amx_attention.cpp): enable 0 turns it off,
// 1 on where the CPU and build have AMX, -1 leaves it as it is. Returns the setting now (1 on, 0 off).
int nanovllm_paged_attention_amx(int enable) {
  if (enable >= 0)
    amx_prefill = enable ? amx_granted() : 0;
  else if (amx_prefill < 0)
    amx_prefill = amx_granted();
  return amx_prefill;
}

// Returns 0, or -1 for a dtype code it does not know.
int nanovllm_paged_attention(int dtype, const void* q, void* out, const void* k_cache, const void* v_cache,
                             const int32_t* block_tables, int64_t table_stride, const int32_t* q_start,
                             const int32_t* q_len, const int32_t* k_len, int num_seqs, int num_heads,
                             int num_kv_heads, int head_dim, int block_size, float scale, int q_tile,
                             int64_t q_stride_token, int64_t q_stride_head, int64_t out_stride_token,
                             int64_t out_stride_head, int num_threads) {
  switch (dtype) {
    case F32:
      run<F32T>(q, out, k_cache, v_cache, block_tables, table_stride, q_start, q_len, k_len, num_seqs, num_heads,
                num_kv_heads, head_dim, block_size, scale, q_tile, q_stride_token, q_stride_head, out_stride_token,
                out_stride_head, num_threads);
      return 0;
    case BF16:
      run<BF16T>(q, out, k_cache, v_cache, block_tables, table_stride, q_start, q_len, k_len, num_seqs, num_heads,
                 num_kv_heads, head_dim, block_size, scale, q_tile, q_stride_token, q_stride_head, out_stride_token,
                 out_stride_head, num_threads);
      return 0;
    case F16:
      run<F16T>(q, out, k_cache, v_cache, block_tables, table_stride, q_start, q_len, k_len, num_seqs, num_heads,
                num_kv_heads, head_dim, block_size, scale, q_tile, q_stride_token, q_stride_head, out_stride_token,
                out_stride_head, num_threads);
      return 0;
    default:
      return -1;
  }
}

}  // extern "C"
