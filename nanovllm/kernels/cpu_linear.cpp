// Products of a few rows with a linear layer's weight, out = x @ w^T (+ bias), for decode steps of
// one to a few sequences, where the product is bound by reading the weight from memory.
//
// oneDNN's packed product (layers/linear.py) costs ~15 us a call before it reads anything and
// streams a weight of one row at ~60-75% of the machine's read rate (docs/BENCHMARKS.md, CPU
// kernels). Here
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
// float32, AVX512-BF16 for bfloat16); a build for AVX2-only CPUs has both on 8 lanes (sum8),
// bfloat16 widened to float32 FMAs. nanovllm_few_rows_supported says which, and Python keeps
// oneDNN for the rest.
#include <omp.h>

#include <vector>

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
// The product on AVX2 (8 lanes): the same loops as above. bfloat16 (no dot product instruction
// here): x widened to float32 once per call, each weight vector widened as it is loaded, FMAs in
// float32 (each product exact, as the dot product's), so a bf16 weight is read at half float32's
// bytes: a bf16 model's layers keep it beside the float32 copy oneDNN takes (layers/linear.py HalfRows).
constexpr int FEW_LANES = 8;
template <typename T>
constexpr bool supported() { return std::is_same_v<T, F32T> || std::is_same_v<T, BF16T>; }

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0); }

template <typename T, int M>
inline void row_products(const float* __restrict__ x, int64_t x_stride, const typename T::storage* __restrict__ wr,
                         int K, __m256* lanes, int stride) {
  constexpr int W = FEW_LANES;
  constexpr int V = 64 / (W * sizeof(typename T::storage));  // vectors of w in a cache line: 2 float32, 4 bf16
  __m256 a[M], b[M];
  for (int m = 0; m < M; ++m) a[m] = b[m] = _mm256_setzero_ps();
  int k = 0;
  for (; k + V * W <= K; k += V * W) {
    prefetch(wr + k);
    for (int v = 0; v < V; v += 2) {
      const int k0 = k + v * W, k1 = k0 + W;
      const __m256 w0 = load8<T>(wr + k0), w1 = load8<T>(wr + k1);
      for (int m = 0; m < M; ++m) {
        a[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + k0), w0, a[m]);
        b[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * x_stride + k1), w1, b[m]);
      }
    }
  }
  for (; k < K; k += W) {  // the tail: lanes past K are zeros
    const __m256i mask = first_lanes8(K - k);
    __m256 w0;
    if constexpr (std::is_same_v<T, F32T>) {
      w0 = _mm256_maskload_ps(wr + k, mask);
    } else {
      alignas(32) float tail[W] = {};
      for (int j = 0; j < std::min(W, K - k); ++j) tail[j] = load<T>(wr + k + j);
      w0 = _mm256_load_ps(tail);
    }
    for (int m = 0; m < M; ++m) a[m] = _mm256_fmadd_ps(_mm256_maskload_ps(x + m * x_stride + k, mask), w0, a[m]);
  }
  for (int m = 0; m < M; ++m) lanes[m * stride] = _mm256_add_ps(a[m], b[m]);
}

// out[0:M, n0:n1] for this thread's rows n0..n1 of w, R = 8 / M rows at a time (M = 3: 2 rows, 6 lanes used).
template <typename T, int M>
void few_rows(const typename T::storage* x, int64_t x_stride, const typename T::storage* w,
              const typename T::storage* bias, typename T::storage* out, int64_t out_stride, int n0, int n1, int K) {
  constexpr int W = FEW_LANES, R = W / M;
  const float* xf = nullptr;
  int64_t xf_stride = x_stride;
  std::vector<float> widened;  // bf16 rows of x as float32, K apart
  if constexpr (std::is_same_v<T, F32T>) {
    xf = x;
  } else {
    widened.resize(static_cast<size_t>(M) * K);
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) widened[static_cast<size_t>(m) * K + k] = load<T>(x + m * x_stride + k);
    xf = widened.data(), xf_stride = K;
  }
  alignas(32) float sums[W];
  __m256 lanes[W];
  for (int i = 0; i < W; ++i) lanes[i] = _mm256_setzero_ps();
  for (int g = n0; g < n1; g += R) {
    const int rows = std::min(R, n1 - g);
    for (int r = 0; r < rows; ++r)
      row_products<T, M>(xf, xf_stride, w + static_cast<int64_t>(g + r) * K, K, lanes + r, R);
    _mm256_store_ps(sums, sum8(lanes));
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < rows; ++r) {
        const float sum = sums[m * R + r] + (bias ? load<T>(bias + g + r) : 0.0f);
        store<T>(out + m * out_stride + g + r, sum);
      }
  }
}

// More rows (MAX_ROWS < M <= MANY_ROWS): blocks of MR rows of x against NR rows of w, the MR x NR
// products summed over K in 12 vector registers (7 loads for 12 FMAs) and only then across their
// lanes. A thread walks its run of w's rows NR at a time; each block of w stays in L1 while every
// block of x passes (x, M x K floats, from L2), and the next block of w is requested as it goes.
// Measured against oneDNN's packed product on issue 29's real-proportion shapes (8 layers' weights,
// capped at AVX2, 2 threads): 1.6x at 16 rows, 1.3x at 32, 1.2x at 64, 1.1x at 128, 0.9x at 256
// (docs/BENCHMARKS.md, CPU kernels). An AVX-512 form measured level with oneDNN.
constexpr int MANY_ROWS = 128;
constexpr int MR = 4, NR = 3;
constexpr int64_t X_BLOCK_BYTES = 1 << 20;  // x rows a pass over w: ~1 MB, inside L2

inline __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[0:R, 0:C] = x[0:R] . w[0:C] (+ bias) for R <= MR rows of x and C <= NR rows of w.
template <int R, int C>
inline void block_products(const float* __restrict__ x, int64_t x_stride, const float* __restrict__ w, int K,
                           const float* __restrict__ bias, float* __restrict__ out, int64_t out_stride) {
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  int k = 0;
  for (; k + FEW_LANES <= K; k += FEW_LANES) {
    __m256 wv[C];
    for (int j = 0; j < C; ++j) wv[j] = _mm256_loadu_ps(w + static_cast<int64_t>(j) * K + k);
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * x_stride + k);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {  // the tail, masked: lanes past K load zeros
    const __m256i mask = first_lanes8(K - k);
    __m256 wv[C];
    for (int j = 0; j < C; ++j) wv[j] = _mm256_maskload_ps(w + static_cast<int64_t>(j) * K + k, mask);
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_maskload_ps(x + i * x_stride + k, mask);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  for (int i = 0; i < R; ++i) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, sum4(acc[i][0], C > 1 ? acc[i][1] : zero, C > 2 ? acc[i][2] : zero, zero));
    for (int j = 0; j < C; ++j) out[i * out_stride + j] = sums[j] + (bias ? bias[j] : 0.0f);
  }
}

// Every block of `rows` rows of x against the C rows of w at w (their outputs at out).
template <int C>
inline void column_products(const float* x, int64_t x_stride, int rows, const float* w, int K, const float* bias,
                            float* out, int64_t out_stride) {
  int m = 0;
  for (; m + MR <= rows; m += MR)
    block_products<MR, C>(x + m * x_stride, x_stride, w, K, bias, out + m * out_stride, out_stride);
  switch (rows - m) {
    case 3: block_products<3, C>(x + m * x_stride, x_stride, w, K, bias, out + m * out_stride, out_stride); break;
    case 2: block_products<2, C>(x + m * x_stride, x_stride, w, K, bias, out + m * out_stride, out_stride); break;
    case 1: block_products<1, C>(x + m * x_stride, x_stride, w, K, bias, out + m * out_stride, out_stride); break;
  }
}

void many_rows(int M, const float* x, int64_t x_stride, const float* w, const float* bias, float* out,
               int64_t out_stride, int N, int K, int num_threads) {
  const int blocks = (N + NR - 1) / NR;
  const int64_t block_bytes = static_cast<int64_t>(NR) * K * sizeof(float);
  const int chunk = std::max<int>(MR, static_cast<int>(X_BLOCK_BYTES / (K * static_cast<int64_t>(sizeof(float)))) / MR * MR);
  for (int m0 = 0; m0 < M; m0 += chunk) {
    const int rows = std::min(chunk, M - m0);
    const float* xc = x + m0 * x_stride;
    float* oc = out + m0 * out_stride;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int b = 0; b < blocks; ++b) {
      const int n = b * NR;
      if (b + 1 < blocks) {  // the next block of w, to L2, while this one computes
        const char* next = reinterpret_cast<const char*>(w + static_cast<int64_t>(n + NR) * K);
        for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
      }
      const float* wb = w + static_cast<int64_t>(n) * K;
      const float* bb = bias ? bias + n : nullptr;
      switch (std::min(NR, N - n)) {
        case 3: column_products<3>(xc, x_stride, rows, wb, K, bb, oc + n, out_stride); break;
        case 2: column_products<2>(xc, x_stride, rows, wb, K, bb, oc + n, out_stride); break;
        default: column_products<1>(xc, x_stride, rows, wb, K, bb, oc + n, out_stride); break;
      }
    }
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define NANOVLLM_FEW_ROWS 1
#if !defined(__AVX512F__)
#define NANOVLLM_MANY_ROWS 1  // float32 products of up to MANY_ROWS rows (many_rows)
#endif
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
      default:
#ifdef NANOVLLM_MANY_ROWS
        if (std::is_same_v<T, F32T> && rows > 0 && rows <= MANY_ROWS) {
          many_rows(rows, static_cast<const float*>(x), x_stride, static_cast<const float*>(w),
                    static_cast<const float*>(bias), static_cast<float*>(out), out_stride, N, K, num_threads);
          return 0;
        }
#endif
        return -1;
    }
  }
}
#endif

}  // namespace

extern "C" {

// The most rows of the dtype (codes as cpu_paged_attention.cpp's) this build's product takes
// (MAX_ROWS, or MANY_ROWS for float32 in an AVX2 build), or 0 where it does not multiply the dtype.
int nanovllm_few_rows_supported(int dtype) {
#ifdef NANOVLLM_FEW_ROWS
#ifdef NANOVLLM_MANY_ROWS
  if (dtype == F32) return MANY_ROWS;
#endif
  if (dtype == F32) return supported<F32T>() ? MAX_ROWS : 0;
  if (dtype == BF16) return supported<BF16T>() ? MAX_ROWS : 0;
#endif
  (void)dtype;
  return 0;
}

// out[rows, N] (row stride out_stride) = x[rows, K] (row stride x_stride) @ w[N, K]^T (+ bias[N]
// when not null), all of one dtype, unit stride within rows, 1 <= rows <= nanovllm_few_rows_supported's
// count for the dtype. Returns 0, or
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
