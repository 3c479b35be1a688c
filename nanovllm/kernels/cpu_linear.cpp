// Products of a few rows with a linear layer's weight, out = x @ w^T (+ bias), for decode steps of
// one to a few sequences, where the product is bound by reading the weight from memory.
//
// oneDNN's packed product (layers/linear.py) costs ~15 us a call before it reads anything and
// streams a weight of one row at ~60-75% of the machine's read rate (docs/BENCHMARKS.md). Here
// each thread takes a contiguous run of the weight's rows (x: [M, K], w: [N, K], both row-major)
// and reads it front to back, one row at a time, prefetching PREFETCH_BYTES ahead of its loads:
// a single sequential stream per thread, which the measured ceiling of this kind of read needs
// (a plain AVX-512 sum of 166 MB with two threads: ~23 GB/s; prefetching 8-16 KB ahead: ~29).
// Each weight row's products with the M rows of x stay 16-lane vectors (two per row of x, to
// break the FMA chain) until 16 of them are summed together by sum16.
//
// float32: FMAs. bfloat16: AVX512-BF16 dot products of x and w as they are (exact products,
// float32 sums), as oneDNN's bf16 product computes; results are rounded to bfloat16 after the
// bias is added in float32. Built only where the compiler has the instructions (AVX-512F for
// float32, AVX512-BF16 for bfloat16); a build for AVX2-only CPUs has the float32 product on 8
// lanes (sum8). nanovllm_few_rows_supported says which, and Python keeps oneDNN for the rest.
#include <omp.h>

#include "cpu_kernels.h"

namespace {

using namespace nanovllm_cpu;

constexpr int MAX_ROWS = 4;  // rows of x a call takes (M)
constexpr int PREFETCH_BYTES = 8192;  // measured: 4-16 KB ahead all near the best, 1 KB or less well below

#ifdef __AVX512F__
constexpr int FEW_LANES = LANES;  // lanes of the vectors below: each weight row's sums, R = FEW_LANES / M rows a pass
template <typename T>
constexpr bool supported() {
#ifdef __AVX512BF16__
  return std::is_same_v<T, F32T> || std::is_same_v<T, BF16T>;
#else
  return std::is_same_v<T, F32T>;
#endif
}

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0); }

// Row r of w times the M rows of x, left as M vectors of 16 lanes (lanes[m * stride]).
template <typename T, int M>
inline void row_products(const typename T::storage* __restrict__ x, int64_t x_stride,
                         const typename T::storage* __restrict__ wr, int K, __m512* lanes, int stride) {
  __m512 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, F32T>) {
    int k = 0;
    for (; k + 2 * LANES <= K; k += 2 * LANES) {
      prefetch(wr + k);
      prefetch(wr + k + LANES);
      const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + LANES);
      for (int m = 0; m < M; ++m) {
        a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * x_stride + k), w0, a[m]);
        b[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * x_stride + k + LANES), w1, b[m]);
      }
    }
    for (; k < K; k += LANES) {  // the tail, masked: lanes past K load zeros
      const __mmask16 mask = first_lanes(K - k);
      const __m512 w0 = _mm512_maskz_loadu_ps(mask, wr + k);
      for (int m = 0; m < M; ++m) a[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * x_stride + k), w0, a[m]);
    }
  } else {
#ifdef __AVX512BF16__
    constexpr int STEP = 2 * LANES;  // bfloat16 elements per vector
    int k = 0;
    for (; k + 2 * STEP <= K; k += 2 * STEP) {
      prefetch(wr + k);
      prefetch(wr + k + STEP);
      const __m512i w0 = _mm512_loadu_si512(wr + k), w1 = _mm512_loadu_si512(wr + k + STEP);
      for (int m = 0; m < M; ++m) {
        a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(x + m * x_stride + k), (__m512bh)w0);
        b[m] = _mm512_dpbf16_ps(b[m], (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + STEP), (__m512bh)w1);
      }
    }
    for (; k < K; k += STEP) {
      const __mmask32 mask = K - k >= STEP ? 0xffffffffu : static_cast<__mmask32>((1u << (K - k)) - 1);
      const __m512i w0 = _mm512_maskz_loadu_epi16(mask, wr + k);
      for (int m = 0; m < M; ++m)
        a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + k), (__m512bh)w0);
    }
#endif
  }
  for (int m = 0; m < M; ++m) lanes[m * stride] = _mm512_add_ps(a[m], b[m]);
}

// out[0:M, n0:n1] for this thread's rows n0..n1 of w, R = 16 / M rows at a time.
template <typename T, int M>
void few_rows(const typename T::storage* x, int64_t x_stride, const typename T::storage* w,
              const typename T::storage* bias, typename T::storage* out, int64_t out_stride, int n0, int n1, int K) {
  constexpr int R = LANES / M;
  alignas(64) float sums[LANES];
  __m512 lanes[LANES];
  for (int i = 0; i < LANES; ++i) lanes[i] = _mm512_setzero_ps();
  for (int g = n0; g < n1; g += R) {
    const int rows = std::min(R, n1 - g);
    for (int r = 0; r < rows; ++r)
      row_products<T, M>(x, x_stride, w + static_cast<int64_t>(g + r) * K, K, lanes + r, R);
    _mm512_store_ps(sums, sum16(lanes));
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) {
        const float sum = sums[m * R + r] + (bias ? load<T>(bias + g + r) : 0.0f);
        store<T>(out + m * out_stride + g + r, sum);
      }
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// The float32 product on AVX2 (8 lanes): the same loops as above.
constexpr int FEW_LANES = 8;
template <typename T>
constexpr bool supported() { return std::is_same_v<T, F32T>; }

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0); }

template <typename T, int M>
inline void row_products(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ wr, int K,
                         __m256* lanes, int stride) {
  constexpr int W = FEW_LANES;
  __m256 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm256_setzero_ps();
  int k = 0;
  for (; k + 2 * W <= K; k += 2 * W) {
    prefetch(wr + k);
    const __m256 w0 = _mm256_loadu_ps(wr + k), w1 = _mm256_loadu_ps(wr + k + W);
    for (int m = 0; m < M; ++m) {
      a[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + k), w0, a[m]);
      b[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + k + W), w1, b[m]);
    }
  }
  for (; k < K; k += W) {  // the tail, masked: lanes past K load zeros
    const __m256i mask = first_lanes8(K - k);
    const __m256 w0 = _mm256_maskload_ps(wr + k, mask);
    for (int m = 0; m < M; ++m) a[m] = _mm256_fmadd_ps(_mm256_maskload_ps(x + m * x_stride + k, mask), w0, a[m]);
  }
  for (int m = 0; m < M; ++m) lanes[m * stride] = _mm256_add_ps(a[m], b[m]);
}

// out[0:M, n0:n1] for this thread's rows n0..n1 of w, R = 8 / M rows at a time (M = 3: 2 rows, 6 lanes used).
template <typename T, int M>
void few_rows(const float* x, int64_t x_stride, const float* w, const float* bias, float* out, int64_t out_stride,
              int n0, int n1, int K) {
  constexpr int W = FEW_LANES, R = W / M;
  alignas(32) float sums[W];
  __m256 lanes[W];
  for (int i = 0; i < W; ++i) lanes[i] = _mm256_setzero_ps();
  for (int g = n0; g < n1; g += R) {
    const int rows = std::min(R, n1 - g);
    for (int r = 0; r < rows; ++r) row_products<T, M>(x, x_stride, w + static_cast<int64_t>(g + r) * K, K, lanes + r, R);
    _mm256_store_ps(sums, sum8(lanes));
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) out[m * out_stride + g + r] = sums[m * R + r] + (bias ? bias[g + r] : 0.0f);
  }
}

#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define NANOVLLM_FEW_ROWS 1
template <typename T, int M>
void run_rows(const void* x, int64_t x_stride, const void* w, const void* bias, void* out, int64_t out_stride, int N,
              int K, int num_threads) {
  using S = typename T::storage;
  constexpr int R = FEW_LANES / M;
  const int groups = (N + R - 1) / R;
  // Small weights are not worth waking a second thread for (~2-5 us a fork); a thread per 64 KB.
  const int64_t bytes = static_cast<int64_t>(N) * K * sizeof(S);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, bytes / 65536)));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
    const int n0 = static_cast<int>(static_cast<int64_t>(groups) * t / n) * R;
    const int n1 = std::min(N, static_cast<int>(static_cast<int64_t>(groups) * (t + 1) / n) * R);
    few_rows<T, M>(static_cast<const S*>(x), x_stride, static_cast<const S*>(w), static_cast<const S*>(bias),
                   static_cast<S*>(out), out_stride, n0, n1, K);
  }
}

template <typename T>
int run(int rows, const void* x, int64_t x_stride, const void* w, const void* bias, void* out, int64_t out_stride,
        int N, int K, int num_threads) {
  if constexpr (!supported<T>()) {
    return -1;
  } else {
    switch (rows) {
      case 1: run_rows<T, 1>(x, x_stride, w, bias, out, out_stride, N, K, num_threads); return 0;
      case 2: run_rows<T, 2>(x, x_stride, w, bias, out, out_stride, N, K, num_threads); return 0;
      case 3: run_rows<T, 3>(x, x_stride, w, bias, out, out_stride, N, K, num_threads); return 0;
      case 4: run_rows<T, 4>(x, x_stride, w, bias, out, out_stride, N, K, num_threads); return 0;
      default: return -1;
    }
  }
}
#endif

}  // namespace

extern "C" {

// Whether this build multiplies the dtype (codes as cpu_paged_attention.cpp's): 1 or 0.
int nanovllm_few_rows_supported(int dtype) {
#ifdef NANOVLLM_FEW_ROWS
  if (dtype == F32) return supported<F32T>();
  if (dtype == BF16) return supported<BF16T>();
#endif
  (void)dtype;
  return 0;
}

// out[rows, N] (row stride out_stride) = x[rows, K] (row stride x_stride) @ w[N, K]^T (+ bias[N]
// when not null), all of one dtype, unit stride within rows, 1 <= rows <= MAX_ROWS. Returns 0, or
// -1 for a dtype this build does not multiply or a row count out of range.
int nanovllm_few_rows_linear(int dtype, int rows, const void* x, int64_t x_stride, const void* w, const void* bias,
                             void* out, int64_t out_stride, int N, int K, int num_threads) {
#ifdef NANOVLLM_FEW_ROWS
  if (dtype == F32) return run<F32T>(rows, x, x_stride, w, bias, out, out_stride, N, K, num_threads);
  if (dtype == BF16) return run<BF16T>(rows, x, x_stride, w, bias, out, out_stride, N, K, num_threads);
#endif
  (void)dtype, (void)rows, (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)out_stride, (void)N, (void)K,
      (void)num_threads;
  return -1;
}

}  // extern "C"
