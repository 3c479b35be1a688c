// The greedy token of LM-head rows, argmax_v x . w_v, without every logit in float32.
//
// A greedy step reads only the largest logit of each row. The head's weight is also held in int8
// (layers/embed_head.py GreedyHead: each vocabulary row w_v scaled by its own s_v = max|w_v| / 127
// and rounded), each row x is rounded to int8 the same way at each call, and AVX512-VNNI multiplies
// the two: 64 products an instruction where float32 FMAs do 16, from a quarter of the weight's bytes
// (AVX2 builds: vpmaddubsw + vpmaddwd, 32 products in two instructions on the FMAs' ports, x
// rounded to 7 bits so that the 16-bit pair sums cannot saturate).
// The int8 score s_v is within B_v of the float32 logit r_v that the recheck computes (x^ and w^_v
// the rounded vectors as reals, Cauchy-Schwarz on both differences):
//   |s_v - r_v| <= ||x - x^|| ||w_v|| + ||x^|| ||w_v - w^_v|| + slack ||x|| ||w_v|| = B_v,
// the slack covering float32's roundings of r_v (K terms) and of s_v. So the token with the largest
// r_v has s_v + B_v >= max_u (s_u - B_u): only the tokens that pass are recomputed in float32 and
// the largest taken (the first on ties, as torch.argmax). One pass over the int8 head scores every
// token and keeps those whose s_v + B_v reach the largest s_u - B_u seen so far (RowScan); the
// second rechecks the kept ones that reach the final one. The token is the one a float32 product of
// every logit (in the recheck's order) would give, for a few dozen row products a row (random
// weights: ~10 of 32,000) instead of the vocabulary's.
//
// A sampled row (temperature T > 0) draws the token cpu_fused.cpp's race would draw from its float32
// logits, argmax_v fma(r_v, 1 / T, g_v) with g_v its Gumbel noise (cpu_kernels.h gumbel64): the same
// two passes on bounds moved to those values (race_bounds), the noise computed for every token.
//
// Rows of a bfloat16 model (bfloat16 x; the head bfloat16, or float32 where it is held so) have
// bfloat16 logits: the sampler sees each r_v rounded to bfloat16 (nearest even), and ties between
// tokens whose logits round alike go to the first. Those calls bound the rounded value instead
// (`rounded`: each bound moved out by 2^-7 of itself, twice rounding's largest relative change) and
// round each rechecked logit before comparing, so the token is the one the rounded logits give.
//
// Every norm is an upper bound (a row's computed in double, the head's widened by float32's
// worst error, cpu_build.py GreedyHead), and B_v is widened by MARGIN, so the float32
// arithmetic of the bound and the comparisons can only let more tokens through. Rows that are not
// finite, or whose logits could reach a tenth of the sampler's clamp (`limit`), return 1: the caller then
// takes the float32 logits' path.
#include <omp.h>

#include <vector>

#include "cpu_kernels.h"
#pragma GCC diagnostic ignored "-Wpsabi"  // GCC vectors passed between inline functions (cpu_kernels.h)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define NANOVLLM_GREEDY_HEAD 512
#elif defined(__AVX2__) && defined(__FMA__)
#define NANOVLLM_GREEDY_HEAD 256
#endif

namespace {

#ifdef NANOVLLM_GREEDY_HEAD
constexpr int CHUNK = 64;  // vocabulary rows a panel (GreedyHead packs the int8 weight per panel)
static_assert(CHUNK == nanovllm_cpu::NOISE_TOKENS, "a panel's noise is one gumbel64");
constexpr double MARGIN = 1.0 + 1.0 / 64;  // well above float32's roundings of the bound and of s +- B
#if NANOVLLM_GREEDY_HEAD == 512
constexpr int XQ = 127;  // x rounded to [-XQ, XQ], stored + XQ + 1 as unsigned bytes
constexpr int BIAS_SHIFT = 7;  // log2(XQ + 1)
constexpr int XROWS = 6;  // rows of x a pass over a panel (6 x 4 accumulators)
#else
constexpr int XQ = 63;  // 7 bits: vpmaddubsw's pair sums 2 x 127 x 127 stay inside int16
constexpr int BIAS_SHIFT = 6;
constexpr int XROWS = 4;  // rows of x a pass over a group of 16 tokens (4 x 2 accumulators of 16 registers)
#endif

// A row's constants: its int8 scale, the two factors of B_v (c1 * ||w_v|| + c2 * ||w_v - w^_v||)
// and, for a sampled row, 1 / T and its noise's key.
struct RowConsts {
  float sx, c1, c2;
  bool sampled;
  float inv;
  nanovllm_cpu::NoiseKey key;
};

float round_up(double v) {
  float f = static_cast<float>(v);
  return static_cast<double>(f) < v ? std::nextafter(f, INFINITY) : f;
}

// xu = round(x / sx) + XQ + 1 (unsigned bytes, the products' first operand), sx = max|x| / XQ.
// False when x is not finite or its logits could reach a tenth of `limit` (the sampler's clamp).
// (c.inv is set on entry: a sampled row's values are its logits times inv.)
bool quantize_row(const float* x, int K, float max_weight_norm, float limit, uint8_t* xu, RowConsts& c) {
  float maxabs = 0.0f;
  for (int k = 0; k < K; ++k) {
    if (!std::isfinite(x[k])) return false;
    maxabs = std::max(maxabs, std::fabs(x[k]));
  }
  const float sx = maxabs > 0.0f ? maxabs / XQ : 1.0f;
  double d2 = 0.0, h2 = 0.0, n2 = 0.0;  // ||x - x^||^2, ||x^||^2, ||x||^2
  for (int k = 0; k < K; ++k) {
    const float q = std::min(float(XQ), std::max(-float(XQ), std::nearbyint(x[k] / sx)));
    xu[k] = static_cast<uint8_t>(static_cast<int>(q) + XQ + 1);
    const double xh = static_cast<double>(sx) * q, d = x[k] - xh;
    d2 += d * d;
    h2 += xh * xh;
    n2 += static_cast<double>(x[k]) * x[k];
  }
  const double norm = std::sqrt(n2);
  if (norm * max_weight_norm * std::max(1.0f, c.inv) >= limit / 10.0) return false;
  const double slack = (K + 64) * 0x1p-20;  // > 2 (K + 8) u: float32's roundings, relative to ||x|| ||w_v||
  c.sx = sx;
  c.c1 = round_up((std::sqrt(d2) + slack * norm) * MARGIN);
  c.c2 = round_up(std::sqrt(h2) * MARGIN);
  return true;
}

inline nanovllm_cpu::fvec abs_v(nanovllm_cpu::fvec x) {
  return (nanovllm_cpu::fvec)((nanovllm_cpu::ivec)x & 0x7fffffff);
}

// A sampled row draws argmax_v z_v, z_v = fma(r_v, inv, g_v) (r_v its float32 logit as the recheck
// computes it, g_v its noise: cpu_kernels.h gumbel64), so its bounds move to z: lo <= r_v <= hi gives
// lo inv + g_v - e <= z_v <= hi inv + g_v + e, where e is well above the roundings of z_v and of these
// sums (each under 2^-23 of |r_v inv| + |g_v|, and |g_v| < NOISE_MAX_ABS). Lanes past V stay -inf.
// In place on the 16 tokens of lo[0:16], hi[0:16] (`noise`: their g_v), a native vector at a time.
inline void race_bounds(float* lo, float* hi, const RowConsts& c, const float* noise) {
  using nanovllm_cpu::fvec;
  for (int i = 0; i < 16; i += nanovllm_cpu::NOISE_LANES) {
    fvec l, u, g;
    std::memcpy(&l, lo + i, sizeof l);
    std::memcpy(&u, hi + i, sizeof u);
    std::memcpy(&g, noise + i, sizeof g);
    const fvec a_lo = l * c.inv, a_hi = u * c.inv;
    const fvec e = (abs_v(a_lo) + abs_v(a_hi) + 2 * nanovllm_cpu::NOISE_MAX_ABS) * 0x1p-21f;
    const nanovllm_cpu::ivec valid = u > -INFINITY;
    l = valid ? a_lo + g - e : l;
    u = valid ? a_hi + g + e : u;
    std::memcpy(lo + i, &l, sizeof l);
    std::memcpy(hi + i, &u, sizeof u);
  }
}

// The per-token arrays the bounds read (GreedyHead's, padded to whole panels); `rounded`: the
// logits are bfloat16 (the bounds are widened to cover the rounding).
struct Head {
  const int8_t* q;
  const float *scale, *norm, *err;
  const int32_t* qsum;
  int K, V;
  bool rounded;
};

// Bounds on a logit moved out to bound it rounded to bfloat16 too: nearest-even rounding changes
// a value by at most 2^-8 of itself (and less than 2^-133 below float32's normal range).
constexpr float ROUNDING = 0x1p-7f, ROUNDING_FLOOR = 0x1p-120f;
inline float rounded_logit(float r) {
  uint16_t b;
  nanovllm_cpu::store<nanovllm_cpu::BF16T>(&b, r);
  return nanovllm_cpu::bf16_to_float(b);
}

// A token pass 1 could not rule out for a row: its upper bound and (a sampled row) its noise g_v.
struct Candidate {
  int v;
  float upper, noise;
};

// One row's pass 1 in one thread: the largest lower bound it has seen (its floor) and every token
// whose upper bound reached the floor as it stood when the token was scored. The row's final floor
// (the largest over all threads) is at least each of those, so no token left out can pass it.
struct RowScan {
  float floor;
  std::vector<Candidate> kept;

  // A group's tokens from v0: `mask` bit i set where up[i] >= floor (the floor already raised to
  // the group's own lower bounds); lanes past V are never kept.
  void keep(uint64_t mask, const float* up, const float* noise, int v0, int V) {
    for (; mask; mask &= mask - 1) {
      const int i = __builtin_ctzll(mask);
      if (v0 + i < V) kept.push_back({v0 + i, up[i], noise ? noise[i] : 0.0f});
    }
  }
};

#if NANOVLLM_GREEDY_HEAD == 512
// acc[r][j] = sum over k of xu[r][k] * q[v][k] for the panel's 64 rows v (vector j: rows 16j..16j+15),
// the panel's int8 weight laid out [K/4][4 vectors][16 rows][4 k].
template <int R>
inline void panel_dots(const uint8_t* xu, int K, const int8_t* wp, __m512i (&acc)[XROWS][4]) {
  __m512i a[R][4];  // in registers (the caller's array would be spilled at every step)
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_si512();
  for (int k = 0; k < K; k += 4, wp += 4 * CHUNK) {
    const __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + 64);
    const __m512i w2 = _mm512_loadu_si512(wp + 128), w3 = _mm512_loadu_si512(wp + 192);
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, xu + static_cast<size_t>(r) * K + k, sizeof quad);
      const __m512i xb = _mm512_set1_epi32(quad);
      a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, w0);
      a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, w1);
      a[r][2] = _mm512_dpbusd_epi32(a[r][2], xb, w2);
      a[r][3] = _mm512_dpbusd_epi32(a[r][3], xb, w3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = a[r][j];
}

// One row's 64 int8 scores of the panel at v0 as bounds on its float32 logits: s - B and s + B
// (-inf in lanes past V); MARGIN covers however the compiler rounds or contracts them.
inline void panel_bounds(const __m512i (&acc)[4], const RowConsts& c, int v0, const Head& h, __m512 (&lower)[4],
                         __m512 (&upper)[4]) {
  const __m512 c1 = _mm512_set1_ps(c.c1), c2 = _mm512_set1_ps(c.c2), sx = _mm512_set1_ps(c.sx);
  const __m512 none = _mm512_set1_ps(-INFINITY);
  for (int j = 0; j < 4; ++j) {
    const int v = v0 + 16 * j, left = h.V - v;
    const __mmask16 valid = static_cast<__mmask16>(left >= 16 ? 0xffff : left > 0 ? (1u << left) - 1 : 0);
    // sum xu q = sum x_q q + (XQ + 1) sum q: the integer dot of the signed values, exact.
    const __m512i dots = _mm512_sub_epi32(acc[j], _mm512_slli_epi32(_mm512_loadu_si512(h.qsum + v), BIAS_SHIFT));
    const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(sx, _mm512_loadu_ps(h.scale + v)));
    const __m512 bound =
        _mm512_fmadd_ps(c1, _mm512_loadu_ps(h.norm + v), _mm512_mul_ps(c2, _mm512_loadu_ps(h.err + v)));
    __m512 lo = _mm512_sub_ps(s, bound), hi = _mm512_add_ps(s, bound);
    if (h.rounded) {
      const __m512 k = _mm512_set1_ps(ROUNDING), tiny = _mm512_set1_ps(ROUNDING_FLOOR);
      lo = _mm512_sub_ps(lo, _mm512_fmadd_ps(_mm512_abs_ps(lo), k, tiny));
      hi = _mm512_add_ps(hi, _mm512_fmadd_ps(_mm512_abs_ps(hi), k, tiny));
    }
    lower[j] = _mm512_mask_blend_ps(valid, none, lo);
    upper[j] = _mm512_mask_blend_ps(valid, none, hi);
  }
}

// Pass 1 over panel p for rows [0, rows) of xu: each row's scan (`scans[r]`, this thread's) raised to
// the panel's lower bounds, and the tokens whose upper bounds reach it kept.
void pass1_panel(const uint8_t* xu, int rows, const RowConsts* rc, const Head& h, int p, RowScan* scans) {
  const int8_t* wp = h.q + static_cast<size_t>(p) * CHUNK * h.K;
  __m512i acc[XROWS][4];
  __m512 lower[4], upper[4];
  alignas(64) float noise[CHUNK];
  for (int r0 = 0; r0 < rows; r0 += XROWS) {
    const int n = std::min(XROWS, rows - r0);
    const uint8_t* xr = xu + static_cast<size_t>(r0) * h.K;
    switch (n) {
      case 6: panel_dots<6>(xr, h.K, wp, acc); break;
      case 5: panel_dots<5>(xr, h.K, wp, acc); break;
      case 4: panel_dots<4>(xr, h.K, wp, acc); break;
      case 3: panel_dots<3>(xr, h.K, wp, acc); break;
      case 2: panel_dots<2>(xr, h.K, wp, acc); break;
      default: panel_dots<1>(xr, h.K, wp, acc); break;
    }
    for (int i = 0; i < n; ++i) {
      const RowConsts& c = rc[r0 + i];
      panel_bounds(acc[i], c, p * CHUNK, h, lower, upper);
      if (c.sampled) {
        nanovllm_cpu::gumbel64(c.key, p * CHUNK, noise);
        for (int j = 0; j < 4; ++j)
          race_bounds(reinterpret_cast<float*>(&lower[j]), reinterpret_cast<float*>(&upper[j]), c, noise + 16 * j);
      }
      RowScan& scan = scans[r0 + i];
      const __m512 low = _mm512_max_ps(_mm512_max_ps(lower[0], lower[1]), _mm512_max_ps(lower[2], lower[3]));
      scan.floor = std::max(scan.floor, _mm512_reduce_max_ps(low));
      const __m512 floor = _mm512_set1_ps(scan.floor);
      uint64_t mask = 0;
      for (int j = 0; j < 4; ++j) mask |= uint64_t{_mm512_cmp_ps_mask(upper[j], floor, _CMP_GE_OQ)} << (16 * j);
      if (mask) scan.keep(mask, reinterpret_cast<const float*>(upper), c.sampled ? noise : nullptr, p * CHUNK, h.V);
    }
  }
}

// x . w in float32 (two chains of FMAs, a masked tail).
float dot(const float* x, const float* w, int K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
  }
  for (; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#else  // AVX2: the panel in four groups of 16 tokens, each two vectors of 8
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// acc[r][h] = sum over k of xu[r][k] * q[v][k] for group g's tokens 16g + 8h .. 16g + 8h + 7 of the panel.
template <int R>
inline void group_dots(const uint8_t* xu, int K, const int8_t* wp, int g, __m256i (&acc)[XROWS][2]) {
  __m256i a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* p = wp + 64 * g;
  for (int k = 0; k < K; k += 4, p += 4 * CHUNK) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, xu + static_cast<size_t>(r) * K + k, sizeof quad);
      const __m256i xb = _mm256_set1_epi32(quad);
      a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w0), ones));
      a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w1), ones));
    }
  }
  for (int r = 0; r < R; ++r) acc[r][0] = a[r][0], acc[r][1] = a[r][1];
}

// panel_bounds's AVX2 form for one group's 16 tokens from v.
inline void group_bounds(const __m256i (&acc)[2], const RowConsts& c, int v, const Head& h, __m256 (&lower)[2],
                         __m256 (&upper)[2]) {
  const __m256 c1 = _mm256_set1_ps(c.c1), c2 = _mm256_set1_ps(c.c2), sx = _mm256_set1_ps(c.sx);
  const __m256 none = _mm256_set1_ps(-INFINITY);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int j = 0; j < 2; ++j) {
    const int u = v + 8 * j;
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(h.V - u), lanes));
    const __m256i dots = _mm256_sub_epi32(
        acc[j], _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h.qsum + u)), BIAS_SHIFT));
    const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(sx, _mm256_loadu_ps(h.scale + u)));
    const __m256 bound =
        _mm256_fmadd_ps(c1, _mm256_loadu_ps(h.norm + u), _mm256_mul_ps(c2, _mm256_loadu_ps(h.err + u)));
    __m256 lo = _mm256_sub_ps(s, bound), hi = _mm256_add_ps(s, bound);
    if (h.rounded) {
      const __m256 k = _mm256_set1_ps(ROUNDING), tiny = _mm256_set1_ps(ROUNDING_FLOOR);
      const __m256 sign = _mm256_set1_ps(-0.0f);
      lo = _mm256_sub_ps(lo, _mm256_fmadd_ps(_mm256_andnot_ps(sign, lo), k, tiny));
      hi = _mm256_add_ps(hi, _mm256_fmadd_ps(_mm256_andnot_ps(sign, hi), k, tiny));
    }
    lower[j] = _mm256_blendv_ps(none, lo, valid);
    upper[j] = _mm256_blendv_ps(none, hi, valid);
  }
}

void pass1_panel(const uint8_t* xu, int rows, const RowConsts* rc, const Head& h, int p, RowScan* scans) {
  const int8_t* wp = h.q + static_cast<size_t>(p) * CHUNK * h.K;
  __m256i acc[XROWS][2];
  __m256 lower[2], upper[2];  // the group's 16 tokens as two vectors of 8
  thread_local std::vector<float> noise;  // the sampled rows' g_v for the panel's 64 tokens
  noise.resize(static_cast<size_t>(rows) * CHUNK);
  for (int r = 0; r < rows; ++r)
    if (rc[r].sampled) nanovllm_cpu::gumbel64(rc[r].key, p * CHUNK, noise.data() + static_cast<size_t>(r) * CHUNK);
  for (int g = 0; g < 4; ++g)
    for (int r0 = 0; r0 < rows; r0 += XROWS) {
      const int n = std::min(XROWS, rows - r0);
      const uint8_t* xr = xu + static_cast<size_t>(r0) * h.K;
      switch (n) {
        case 4: group_dots<4>(xr, h.K, wp, g, acc); break;
        case 3: group_dots<3>(xr, h.K, wp, g, acc); break;
        case 2: group_dots<2>(xr, h.K, wp, g, acc); break;
        default: group_dots<1>(xr, h.K, wp, g, acc); break;
      }
      for (int i = 0; i < n; ++i) {
        const RowConsts& c = rc[r0 + i];
        group_bounds(acc[i], c, p * CHUNK + 16 * g, h, lower, upper);
        const float* g_v = c.sampled ? noise.data() + static_cast<size_t>(r0 + i) * CHUNK + 16 * g : nullptr;
        if (c.sampled) race_bounds(reinterpret_cast<float*>(lower), reinterpret_cast<float*>(upper), c, g_v);
        RowScan& scan = scans[r0 + i];
        scan.floor = std::max(scan.floor, max8(_mm256_max_ps(lower[0], lower[1])));
        const __m256 floor = _mm256_set1_ps(scan.floor);
        const uint64_t mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(upper[0], floor, _CMP_GE_OQ))) |
                              static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(upper[1], floor, _CMP_GE_OQ))) << 8;
        if (mask) scan.keep(mask, reinterpret_cast<const float*>(upper), g_v, p * CHUNK + 16 * g, h.V);
      }
    }
}

float dot(const float* x, const float* w, int K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(a0, a1));
  float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; k < K; ++k) sum += x[k] * w[k];
  return sum;
}
#endif

// Row v of the head w [V, K], float32 (w_dtype 0: in place) or bfloat16 (widened into `buffer`).
inline const float* weight_row(const void* w, int w_dtype, int v, int K, float* buffer) {
  if (w_dtype == 0) return static_cast<const float*>(w) + static_cast<int64_t>(v) * K;
  const uint16_t* row = static_cast<const uint16_t*>(w) + static_cast<int64_t>(v) * K;
  for (int k = 0; k < K; ++k) buffer[k] = nanovllm_cpu::bf16_to_float(row[k]);
  return buffer;
}
#endif

}  // namespace

extern "C" {

// The head's int8 form (GreedyHead), one pass over w [V, K] float32 or bfloat16 (w_dtype 0 or 1;
// K a multiple of 4), rows in parallel: per vocabulary row v its scale max|w_v| / 127 (1 for a zero
// row), q_v = round(w_v / scale) in [-127, 127] written to `packed` in the panels' layout
// ([V/64][K/4][4][16][4], the caller's zeroed buffer of whole panels), the sum of q_v, and upper
// bounds of ||w_v|| and of ||w_v - scale q_v|| (computed in double, then widened by `widen` and
// rounded up to float32).
// Returns 0, or -1 where this build has no greedy head.
int nanovllm_greedy_head_pack(const void* w, int w_dtype, int V, int K, double widen, int8_t* packed, float* scale,
                              int32_t* qsum, float* norm, float* err, int num_threads) {
#ifndef NANOVLLM_GREEDY_HEAD
  (void)w, (void)w_dtype, (void)V, (void)K, (void)widen, (void)packed, (void)scale, (void)qsum, (void)norm, (void)err;
  (void)num_threads;
  return -1;
#else
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<int8_t> q(K);
    std::vector<float> d(K), widened(w_dtype == 1 ? K : 0);
#pragma omp for schedule(static)
    for (int v = 0; v < V; ++v) {
      const float* row = weight_row(w, w_dtype, v, K, widened.data());
      float maxabs = 0.0f;
      for (int k = 0; k < K; ++k) maxabs = std::max(maxabs, std::fabs(row[k]));
      const float s = maxabs > 0.0f ? maxabs / 127.0f : 1.0f;
      int32_t sum = 0;
      for (int k = 0; k < K; ++k) {  // vectorised: the bounds below hold for whatever q this rounds to
        const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(row[k] / s)));
        q[k] = static_cast<int8_t>(r);
        sum += static_cast<int32_t>(r);
        d[k] = row[k] - s * r;  // float32: its rounding is what err's 2^-22 term covers
      }
      // Squares summed in double, eight chains; each float32 d_k is within 2^-24 max|w| of the real
      // difference (Sterbenz: row[k] and s * r are close), which the 2^-22 term below covers.
      double n2[8] = {}, e2[8] = {};
      for (int k = 0; k < K; ++k) {
        n2[k % 8] += static_cast<double>(row[k]) * row[k];
        e2[k % 8] += static_cast<double>(d[k]) * d[k];
      }
      double n2s = 0.0, e2s = 0.0;
      for (int i = 0; i < 8; ++i) n2s += n2[i], e2s += e2[i];
      int8_t* panel = packed + static_cast<int64_t>(v / 64) * 64 * K;
      const int j = (v % 64) / 16, l = v % 16;
      for (int k = 0; k < K; k += 4) std::memcpy(panel + ((static_cast<int64_t>(k / 4) * 4 + j) * 16 + l) * 4, &q[k], 4);
      const double n = std::sqrt(n2s);
      scale[v] = s;
      qsum[v] = sum;
      norm[v] = round_up(n * widen);
      err[v] = round_up((std::sqrt(e2s) + n * std::sqrt(static_cast<double>(K)) * 0x1p-22) * widen);
    }
  }
  return 0;
#endif
}

int nanovllm_greedy_head_supported() {
#ifdef NANOVLLM_GREEDY_HEAD
  return 1;
#else
  return 0;
#endif
}

// out[r] = argmax_v x[r] . w[v] for rows x [rows, K] (row stride x_stride) and the head w [V, K]
// (with `temperatures` [rows], where not null: for a row with T > 0, race_rows's token of those
// logits, keyed by keys[r] and counters[r]); x float32 or bfloat16 (x_dtype 0 or 1: bfloat16 rows'
// logits are rounded to bfloat16, as their product writes them), w float32 or bfloat16 (w_dtype),
// through its int8 form (GreedyHead: q packed per 64 rows as [K/4][4][16][4], V padded to a
// multiple of 64 with zero rows; per row its scale, sum of q, ||w_v|| and ||w_v - w^_v|| rounded up;
// max_weight_norm the largest ||w_v||; limit the sampler's clamp, LOGIT_LIMIT). K a multiple of 4.
// `candidates`, when not null, gets the number of tokens rechecked in float32. Returns 0, 1 where the float32 logits must decide (a
// row not finite, or logits near the sampler's clamp), -1 where this build has neither
// AVX512-VNNI nor AVX2.
int nanovllm_greedy_head(const void* x_, int x_dtype, int64_t x_stride, int rows, int K, const void* w, int w_dtype,
                         int V, const int8_t* q, const float* scale, const int32_t* qsum, const float* norm,
                         const float* err, float max_weight_norm, float limit, const float* temperatures,
                         const int64_t* keys, const int64_t* counters, int64_t* out, int64_t* candidates,
                         int num_threads) {
#ifndef NANOVLLM_GREEDY_HEAD
  (void)x_, (void)x_dtype, (void)w_dtype, (void)x_stride, (void)rows, (void)K, (void)w, (void)V, (void)q;
  (void)scale, (void)qsum, (void)norm;
  (void)err, (void)max_weight_norm, (void)limit, (void)temperatures, (void)keys, (void)counters, (void)out;
  (void)candidates, (void)num_threads;
  return -1;
#else
  const int panels = (V + CHUNK - 1) / CHUNK;
  thread_local std::vector<float> xf;  // bfloat16 rows widened (exactly)
  const float* x = static_cast<const float*>(x_);
  if (x_dtype == 1) {
    xf.resize(static_cast<size_t>(rows) * K);
    const uint16_t* xb = static_cast<const uint16_t*>(x_);
    for (int r = 0; r < rows; ++r)
      for (int k = 0; k < K; ++k)
        xf[static_cast<size_t>(r) * K + k] = nanovllm_cpu::bf16_to_float(xb[r * x_stride + k]);
    x = xf.data();
    x_stride = K;
  }
  thread_local std::vector<uint8_t> xu;  // scratch kept across calls
  thread_local std::vector<RowConsts> consts;
  thread_local std::vector<RowScan> scans;  // [thread][row]: each thread's pass 1 of each row
  xu.resize(static_cast<size_t>(rows) * K);
  consts.resize(rows);
  scans.resize(static_cast<size_t>(num_threads) * rows);
  for (RowScan& scan : scans) {
    scan.floor = -INFINITY;
    scan.kept.clear();
  }
  for (int r = 0; r < rows; ++r) {
    RowConsts& c = consts[r];
    c.sampled = temperatures && temperatures[r] > 0.0f;
    c.inv = c.sampled ? 1.0f / temperatures[r] : 1.0f;  // as cpu_fused.cpp race_rows
    c.key = c.sampled ? nanovllm_cpu::noise_key(keys[r], counters[r]) : nanovllm_cpu::NoiseKey{0, 0};
    if (!quantize_row(x + r * x_stride, K, max_weight_norm, limit, xu.data() + static_cast<size_t>(r) * K, c))
      return 1;
  }
  const uint8_t* xu_p = xu.data();
  const RowConsts* rc = consts.data();
  RowScan* scan_p = scans.data();
  const Head h{q, scale, norm, err, qsum, K, V, x_dtype == 1};
  // Pass 1: every panel's int8 scores for every row, each thread over its share of the panels:
  // the row's largest s_v - B_v so far, and the tokens whose s_v + B_v reach it.
#pragma omp parallel num_threads(num_threads)
  {
    RowScan* mine = scan_p + static_cast<size_t>(omp_get_thread_num()) * rows;
#pragma omp for schedule(static)
    for (int p = 0; p < panels; ++p) pass1_panel(xu_p, rows, rc, h, p, mine);
  }
  // Pass 2: per row, the kept tokens that reach its largest s_u - B_u over all threads, rechecked
  // in float32 (each row its own token: the threads' lists in any order).
  int64_t total = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(+ : total)
  for (int r = 0; r < rows; ++r) {
    thread_local std::vector<float> widened;  // a bfloat16 head's row in float32
    widened.resize(w_dtype == 1 ? K : 0);
    float floor = -INFINITY;
    for (int t = 0; t < num_threads; ++t) floor = std::max(floor, scan_p[static_cast<size_t>(t) * rows + r].floor);
    const float* xr = x + r * x_stride;
    float best = -INFINITY;
    int64_t token = -1;
    for (int t = 0; t < num_threads; ++t)
      for (const Candidate& cand : scan_p[static_cast<size_t>(t) * rows + r].kept) {
        if (cand.upper < floor) continue;
        ++total;
        const float exact = dot(xr, weight_row(w, w_dtype, cand.v, K, widened.data()), K);
        const float logit = h.rounded ? rounded_logit(exact) : exact;
        const float z = rc[r].sampled ? std::fma(logit, rc[r].inv, cand.noise) : logit;  // as race_rows
        if (z > best || (z == best && cand.v < token)) {  // the first of the largest, as torch.argmax
          best = z;
          token = cand.v;
        }
      }
    out[r] = token;
  }
  if (candidates) *candidates = total;
  return 0;
#endif
}

}  // extern "C"
