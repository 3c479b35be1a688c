// The CPU's fused elementwise kernels: residual add + RMSNorm, SiLU-and-mul, and q/k RMSNorm +
// rotary (+ the KV-cache store), and the greedy sampler's argmax, each one pass over its rows where torch takes five to ten ops (and as many temporary
// tensors). Each computes what the torch functions of layers/ compute, step for step in float32
// with the same roundings to the model's type between steps, so that float32 matches them to the
// last bits or nearly (sums are taken in another order) and bfloat16 rounds where torch rounds.
// Contraction into fused multiply-adds is off in this file: torch rounds each product.
//
// Rows run in parallel on OpenMP (torch's pool, `num_threads` passed in) when there are enough
// elements to pay for waking the threads; a decode step of one sequence stays on the caller's.
//
// Built with cpu_paged_attention.cpp into one library by cpu_build.py; plain C ABI.
#pragma GCC optimize("fp-contract=off")
#include <vector>

#include "cpu_kernels.h"
#pragma GCC diagnostic ignored "-Wpsabi"  // GCC vectors passed between inline functions (cpu_kernels.h)

namespace {

using namespace nanovllm_cpu;

// Elements below which a call stays on one thread.
constexpr int64_t PARALLEL_MIN_ELEMENTS = 16384;

inline int threads_for(int64_t elements, int num_threads) {
  return elements >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
}

// 1 / sqrt(mean(v[0:n]^2) + eps), as torch.rsqrt(x.pow(2).mean(-1) + eps) in float32.
inline float inverse_rms(const float* __restrict__ v, int n, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < n; ++d) sum += v[d] * v[d];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// layers/layernorm.py: residual = x + residual (in T); y = residual in float32 times its inverse
// RMS, rounded to T; out = weight * y (in T). Without a residual, the same on x.
template <typename T>
void rms_norm_rows(const void* x_, int64_t x_stride, const void* residual_, int64_t residual_stride,
                   const void* weight_, void* out_, int64_t out_stride, void* residual_out_,
                   int64_t residual_out_stride, int rows, int hidden, float eps, int num_threads) {
  using S = typename T::storage;
  const S* x = static_cast<const S*>(x_);
  const S* residual = static_cast<const S*>(residual_);
  const S* weight = static_cast<const S*>(weight_);
  S* out = static_cast<S*>(out_);
  S* residual_out = static_cast<S*>(residual_out_);
#pragma omp parallel num_threads(threads_for(static_cast<int64_t>(rows) * hidden, num_threads))
  {
    std::vector<float> buffer(hidden);
    float* v = buffer.data();
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      const S* xr = x + r * x_stride;
      int vectors = 0;  // elements the explicit vector loops take (the same operations, the same values)
#ifdef __AVX512F__
      if constexpr (vector_type<T>()) vectors = hidden / LANES * LANES;
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (vector_type<T>()) vectors = hidden / 8 * 8;
#endif
      if (residual) {
        const S* rr = residual + r * residual_stride;
        S* ro = residual_out + r * residual_out_stride;
#ifdef __AVX512F__
        if constexpr (vector_type<T>())
          for (int d = 0; d < vectors; d += LANES) {
            const __m512 sum = rounded16<T>(_mm512_add_ps(load16<T>(xr + d), load16<T>(rr + d)));
            _mm512_storeu_ps(v + d, sum);
            store16<T>(ro + d, sum);
          }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (vector_type<T>())
          for (int d = 0; d < vectors; d += 8) {
            const __m256 sum = rounded8<T>(_mm256_add_ps(load8<T>(xr + d), load8<T>(rr + d)));
            _mm256_storeu_ps(v + d, sum);
            store8<T>(ro + d, sum);
          }
#endif
        for (int d = vectors; d < hidden; ++d) {
          v[d] = rounded<T>(load<T>(xr + d) + load<T>(rr + d));
          store<T>(ro + d, v[d]);
        }
      } else {
        for (int d = 0; d < hidden; ++d) v[d] = load<T>(xr + d);
      }
      const float inv = inverse_rms(v, hidden, eps);
      S* o = out + r * out_stride;
#ifdef __AVX512F__
      if constexpr (vector_type<T>()) {
        const __m512 scale = _mm512_set1_ps(inv);
        for (int d = 0; d < vectors; d += LANES)
          store16<T>(o + d, _mm512_mul_ps(load16<T>(weight + d), rounded16<T>(_mm512_mul_ps(_mm512_loadu_ps(v + d), scale))));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (vector_type<T>()) {
        const __m256 scale = _mm256_set1_ps(inv);
        for (int d = 0; d < vectors; d += 8)
          store8<T>(o + d, _mm256_mul_ps(load8<T>(weight + d), rounded8<T>(_mm256_mul_ps(_mm256_loadu_ps(v + d), scale))));
      }
#endif
      for (int d = vectors; d < hidden; ++d) store<T>(o + d, load<T>(weight + d) * rounded<T>(v[d] * inv));
    }
  }
}

// layers/activation.py: silu(gate) in T, then times up in T; x = [gate | up] per row.
// silu(g) = g / (1 + exp(-g)), with exp taken of -|g| so that it never overflows.
template <typename T>
void silu_and_mul_rows(const void* x_, int64_t x_stride, void* out_, int64_t out_stride, int rows, int width,
                       int num_threads) {
  using S = typename T::storage;
  const S* x = static_cast<const S*>(x_);
  S* out = static_cast<S*>(out_);
#pragma omp parallel for schedule(static) num_threads(threads_for(static_cast<int64_t>(rows) * width, num_threads))
  for (int r = 0; r < rows; ++r) {
    const S* gate = x + r * x_stride;
    const S* up = gate + width;
    S* o = out + r * out_stride;
    int d = 0;
#ifdef __AVX512F__
    if constexpr (vector_type<T>()) {  // the loop below on 16 lanes: the same operations, the same values
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; d + LANES <= width; d += LANES) {
        const __m512 g = load16<T>(gate + d);
        const __m512 e = exp_nonpositive_v(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __m512 den = _mm512_add_ps(one, e);
        const __mmask16 nonnegative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
        const __m512 numerator = _mm512_mask_mov_ps(_mm512_mul_ps(g, e), nonnegative, g);  // one division for both
        const __m512 silu = _mm512_div_ps(numerator, den);
        store16<T>(o + d, _mm512_mul_ps(rounded16<T>(silu), load16<T>(up + d)));
      }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if constexpr (vector_type<T>()) {  // the same on 8 lanes (a build for AVX2-only CPUs)
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (; d + 8 <= width; d += 8) {
        const __m256 g = load8<T>(gate + d);
        const __m256 e = exp_nonpositive_v8(_mm256_or_ps(g, sign));  // exp(-|g|)
        const __m256 den = _mm256_add_ps(one, e);
        const __m256 nonnegative = _mm256_cmp_ps(g, zero, _CMP_GE_OQ);
        const __m256 numerator = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, nonnegative);
        const __m256 silu = _mm256_div_ps(numerator, den);
        store8<T>(o + d, _mm256_mul_ps(rounded8<T>(silu), load8<T>(up + d)));
      }
    }
#endif
    for (; d < width; ++d) {
      const float g = load<T>(gate + d);
      const float e = exp_nonpositive(-std::fabs(g));  // exp(-g) for g >= 0, exp(g) for g < 0
      const float silu = g >= 0.0f ? g / (1.0f + e) : g * e / (1.0f + e);
      store<T>(o + d, rounded<T>(silu) * load<T>(up + d));
    }
  }
}

// layers/attention.py's q_norm/k_norm then layers/rotary_embedding.py's rotation, in place, for
// every head of q ([tokens, q_heads, head_dim] at the given strides) and k: each head's row
// RMS-normalised with its weight when `q_weight` is given, then rotated by its token's position
// (cos | sin halves of a float32 row of cos_sin, NeoX style: the first half pairs with the second).
// With a cache (k_cache non-null), then the backend's store: token t's k and v rows (v given at its
// strides) copied to slot slots[t] of k_cache / v_cache ([slots, k_heads, head_dim] contiguous),
// a negative slot skipped.
template <typename T>
void qk_norm_rope_rows(void* q_, int64_t q_token_stride, int64_t q_head_stride, int q_heads, void* k_,
                       int64_t k_token_stride, int64_t k_head_stride, int k_heads, const int64_t* positions,
                       const float* cos_sin, int64_t cos_sin_stride, const void* q_weight_, const void* k_weight_,
                       float eps, const void* v_, int64_t v_token_stride, int64_t v_head_stride, void* k_cache_,
                       void* v_cache_, const int64_t* slots, int tokens, int head_dim, int num_threads) {
  using S = typename T::storage;
  const int64_t slot_size = static_cast<int64_t>(k_heads) * head_dim;
  const int half = head_dim / 2;
  const int heads = q_heads + k_heads;
#pragma omp parallel num_threads(threads_for(static_cast<int64_t>(tokens) * heads * head_dim, num_threads))
  {
    std::vector<float> buffer(head_dim);
    float* v = buffer.data();
#pragma omp for schedule(static)
    for (int t = 0; t < tokens; ++t) {
      const float* cos = cos_sin + positions[t] * cos_sin_stride;
      const float* sin = cos + half;
      for (int h = 0; h < heads; ++h) {
        const bool is_q = h < q_heads;
        S* row = is_q ? static_cast<S*>(q_) + t * q_token_stride + h * q_head_stride
                      : static_cast<S*>(k_) + t * k_token_stride + (h - q_heads) * k_head_stride;
        for (int d = 0; d < head_dim; ++d) v[d] = load<T>(row + d);
        if (q_weight_) {
          const S* weight = static_cast<const S*>(is_q ? q_weight_ : k_weight_);
          const float inv = inverse_rms(v, head_dim, eps);
          for (int d = 0; d < head_dim; ++d) v[d] = rounded<T>(load<T>(weight + d) * rounded<T>(v[d] * inv));
        }
        for (int d = 0; d < half; ++d) {
          const float x1 = v[d], x2 = v[d + half];
          store<T>(row + d, x1 * cos[d] - x2 * sin[d]);
          store<T>(row + d + half, x2 * cos[d] + x1 * sin[d]);
        }
        if (k_cache_ && !is_q && slots[t] >= 0) {
          const int64_t at = slots[t] * slot_size + static_cast<int64_t>(h - q_heads) * head_dim;
          const S* v_row = static_cast<const S*>(v_) + t * v_token_stride + (h - q_heads) * v_head_stride;
          std::memcpy(static_cast<S*>(k_cache_) + at, row, head_dim * sizeof(S));
          std::memcpy(static_cast<S*>(v_cache_) + at, v_row, head_dim * sizeof(S));
        }
      }
    }
  }
}

// layers/sampler.py's greedy token: argmax over a row of finite_logits(logits) (NaN as -limit,
// everything clamped to +-limit), the first index of the largest, as torch.argmax gives it. With
// AVX-512 each lane keeps its first largest and index, and the lanes' smallest index among the
// largest values wins; else one value at a time.
template <typename T>
void greedy_rows(const void* logits_, int64_t stride, int rows, int vocab, float limit, int64_t* out,
                 int num_threads) {
  const auto* logits = static_cast<const typename T::storage*>(logits_);
#pragma omp parallel for num_threads(threads_for(static_cast<int64_t>(rows) * vocab, num_threads))
  for (int r = 0; r < rows; ++r) {
    const typename T::storage* row = logits + r * stride;
    int v = 0;
    float best = -INFINITY;
    int64_t best_index = 0;
#ifdef __AVX512F__
    if (vocab >= LANES) {
      const __m512 low = _mm512_set1_ps(-limit), high = _mm512_set1_ps(limit);
      __m512 lane_best = _mm512_set1_ps(-INFINITY);
      __m512i lane_index = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                              13, 14, 15);
      alignas(64) float chunk[LANES];
      for (; v + LANES <= vocab; v += LANES) {
        load_row<T>(row + v, chunk, LANES);
        // max_ps(x, low) is low where x is NaN: NaN becomes -limit, as nan_to_num then clamp.
        const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_load_ps(chunk), low), high);
        const __mmask16 larger = _mm512_cmp_ps_mask(x, lane_best, _CMP_GT_OQ);
        lane_best = _mm512_mask_mov_ps(lane_best, larger, x);
        lane_index = _mm512_mask_mov_epi32(lane_index, larger, index);
        index = _mm512_add_epi32(index, _mm512_set1_epi32(LANES));
      }
      alignas(64) float bests[LANES];
      alignas(64) int32_t indices[LANES];
      _mm512_store_ps(bests, lane_best);
      _mm512_store_si512(indices, lane_index);
      for (int j = 0; j < LANES; ++j)
        if (bests[j] > best || (bests[j] == best && indices[j] < best_index)) {
          best = bests[j];
          best_index = indices[j];
        }
    }
#endif
    for (; v < vocab; ++v) {
      float x = load<T>(row + v);
      x = std::isnan(x) ? -limit : std::min(std::max(x, -limit), limit);
      if (x > best) {
        best = x;
        best_index = v;
      }
    }
    out[r] = best_index;
  }
}

// layers/sampler.py's draw on the CPU: each row's token, the argmax of its finite logits (as
// greedy_rows) where its temperature is 0, else argmax_v fma(l_v, 1 / T, g_v) with g_v the row's
// Gumbel noise (gumbel64: keys and counters as the Triton race's), the first index of the largest.
// 64 tokens at a time, each of NOISE_LANES lanes keeping its first largest and its index.
template <typename T>
void race_rows(const void* logits_, int64_t stride, int rows, int vocab, const float* temperatures,
               const int64_t* keys, const int64_t* counters, float limit, int64_t* out, int num_threads) {
  const auto* logits = static_cast<const typename T::storage*>(logits_);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_for(static_cast<int64_t>(rows) * vocab * 8, num_threads))
  for (int r = 0; r < rows; ++r) {
    const typename T::storage* row = logits + r * stride;
    const bool sampled = temperatures[r] > 0.0f;
    const float inv = sampled ? 1.0f / temperatures[r] : 1.0f;
    const NoiseKey key = noise_key(keys[r], counters[r]);
    fvec lane_best = fvec{} - INFINITY;
    ivec lane_index = {}, index;
    for (int i = 0; i < NOISE_LANES; ++i) index[i] = i;
    alignas(64) float chunk[NOISE_TOKENS], g[NOISE_TOKENS];
    for (int v = 0; v < vocab; v += NOISE_TOKENS) {
      const int n = std::min(NOISE_TOKENS, vocab - v);
      for (int i = 0; i < n; ++i) {
        const float x = load<T>(row + v + i);
        chunk[i] = std::isnan(x) ? -limit : std::min(std::max(x, -limit), limit);
      }
      for (int i = n; i < NOISE_TOKENS; ++i) chunk[i] = -INFINITY;
      if (sampled) {
        gumbel64(key, v, g);
        for (int i = 0; i < NOISE_TOKENS; ++i) chunk[i] = std::fma(chunk[i], inv, g[i]);  // -inf stays -inf
      }
      for (int j = 0; j < NOISE_TOKENS; j += NOISE_LANES, index += NOISE_LANES) {
        fvec z;
        std::memcpy(&z, chunk + j, sizeof z);
        const ivec larger = z > lane_best;
        lane_best = larger ? z : lane_best;
        lane_index = larger ? index : lane_index;
      }
    }
    float best = -INFINITY;
    int64_t best_index = 0;
    for (int i = 0; i < NOISE_LANES; ++i)
      if (lane_best[i] > best || (lane_best[i] == best && lane_index[i] < best_index)) {
        best = lane_best[i];
        best_index = lane_index[i];
      }
    out[r] = best_index;
  }
}

template <template <typename> class F, typename... Args>
int by_dtype(int dtype, Args... args) {
  switch (dtype) {
    case F32: F<F32T>::run(args...); return 0;
    case BF16: F<BF16T>::run(args...); return 0;
    case F16: F<F16T>::run(args...); return 0;
    default: return -1;
  }
}

template <typename T> struct RmsNorm { template <typename... A> static void run(A... a) { rms_norm_rows<T>(a...); } };
template <typename T> struct SiluAndMul { template <typename... A> static void run(A... a) { silu_and_mul_rows<T>(a...); } };
template <typename T> struct QkNormRope { template <typename... A> static void run(A... a) { qk_norm_rope_rows<T>(a...); } };
template <typename T> struct Greedy { template <typename... A> static void run(A... a) { greedy_rows<T>(a...); } };
template <typename T> struct Race { template <typename... A> static void run(A... a) { race_rows<T>(a...); } };

}  // namespace

extern "C" {

// Each returns 0, or -1 for a dtype code it does not know (codes as cpu_paged_attention.cpp's).

int nanovllm_rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                      const void* weight, void* out, int64_t out_stride, void* residual_out,
                      int64_t residual_out_stride, int rows, int hidden, float eps, int num_threads) {
  return by_dtype<RmsNorm>(dtype, x, x_stride, residual, residual_stride, weight, out, out_stride, residual_out,
                           residual_out_stride, rows, hidden, eps, num_threads);
}

int nanovllm_silu_and_mul(int dtype, const void* x, int64_t x_stride, void* out, int64_t out_stride, int rows,
                          int width, int num_threads) {
  return by_dtype<SiluAndMul>(dtype, x, x_stride, out, out_stride, rows, width, num_threads);
}

int nanovllm_qk_norm_rope(int dtype, void* q, int64_t q_token_stride, int64_t q_head_stride, int q_heads, void* k,
                          int64_t k_token_stride, int64_t k_head_stride, int k_heads, const int64_t* positions,
                          const float* cos_sin, int64_t cos_sin_stride, const void* q_weight, const void* k_weight,
                          float eps, const void* v, int64_t v_token_stride, int64_t v_head_stride, void* k_cache,
                          void* v_cache, const int64_t* slots, int tokens, int head_dim, int num_threads) {
  return by_dtype<QkNormRope>(dtype, q, q_token_stride, q_head_stride, q_heads, k, k_token_stride, k_head_stride,
                              k_heads, positions, cos_sin, cos_sin_stride, q_weight, k_weight, eps, v, v_token_stride,
                              v_head_stride, k_cache, v_cache, slots, tokens, head_dim, num_threads);
}

// Whether greedy_rows is vectorised in this build (AVX-512); one value at a time it is no faster than torch.
int nanovllm_greedy_vectorised() {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

// Each row's token by race_rows (temperatures [rows] float32, 0 = greedy; keys, counters [rows] int64).
int nanovllm_race_tokens(int dtype, const void* logits, int64_t stride, int rows, int vocab, const float* temperatures,
                         const int64_t* keys, const int64_t* counters, float limit, int64_t* out, int num_threads) {
  return by_dtype<Race>(dtype, logits, stride, rows, vocab, temperatures, keys, counters, limit, out, num_threads);
}

int nanovllm_greedy_tokens(int dtype, const void* logits, int64_t stride, int rows, int vocab, float limit,
                           int64_t* out, int num_threads) {
  return by_dtype<Greedy>(dtype, logits, stride, rows, vocab, limit, out, num_threads);
}

}  // extern "C"
