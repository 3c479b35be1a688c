// Prefill attention for bfloat16 caches on AMX tiles: one work item of cpu_paged_attention.cpp
// (a sequence, its KV heads, a tile of its queries) with many query rows.
//
// The AVX-512 path (attend_prefill_lanes) runs a bf16 prefill's attention at ~140 GFLOP/s on a
// 2-vCPU Intel Xeon with AMX, 42% of a bf16 prefill of the real-proportion model
// (docs/BENCHMARKS.md, CPU kernels); AMX multiplies bf16 tiles an order faster,
// which leaves the softmax's vector work as most of the time. Per KV head:
//   1. The keys the item sees, in chunks of 32 tokens (a chunk lies in one block: block_size a
//      multiple of 32), are laid out once for all its rows as the products' B operands: K^T (K's
//      rows of bf16 pairs transposed, by gathers) and V with its token pairs interleaved.
//   2. Each tile of 16 query rows (queries x the group of query heads, copied together per KV head:
//      the A tiles of S) walks its chunks as flash attention does: S = Q K^T in two float32 tiles; per row, in
//      float32 vectors, the causal mask, the running max, the weights P (rounded to bf16, as flash
//      attention's P is) and their sum; O += P V. For head_dim 64 O stays in four tiles across the
//      chunks; wider heads keep O in float32 rows, each chunk's P V added with AVX-512.
// A row's running max is raised only where one of its weights would pass 2^RESCALE_LOG2 (256:
// exact enough in float32 and bf16), so O seldom has to leave its tiles to be rescaled. Scores' products are exact in float32 (bf16 x bf16) and summed in float32, as the
// AVX-512 path's dot products are; the one rounding more is P's to bf16 (relative 2^-9, below the
// bf16 output's own).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace nanovllm_cpu;

#ifdef NANOVLLM_AMX
constexpr int TILE = AMX_TILE_ROWS;  // query rows, and output columns, per tile
constexpr int CHUNK = 32;  // keys a step: one tile row of bf16 pairs
constexpr int PV_TILES = 4;  // output column tiles a pass of P x V (tiles 0-3), so head_dim % 64 == 0
constexpr int TILE_ELEMS = TILE * CHUNK;  // bf16 elements of a B tile (16 rows of 64 bytes)
constexpr float RESCALE_LOG2 = 8.0f;  // how far (log2) scores may pass the running max before it moves

// kt[w][t] = word w (bf16 pair 2w, 2w+1) of key token t of the chunk, t < CHUNK (tokens past n
// repeat the last): K^T in the B tiles' pair-interleaved layout, row stride CHUNK words.
void transpose_k(uint32_t* __restrict__ kt, const uint16_t* k, int64_t token_stride, int n, int head_dim) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int32_t* words = reinterpret_cast<const int32_t*>(k);
  for (int half = 0; half < CHUNK / TILE; ++half) {
    const __m512i t = _mm512_min_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(half * TILE)), _mm512_set1_epi32(n - 1));
    const __m512i at = _mm512_mullo_epi32(t, _mm512_set1_epi32(static_cast<int>(token_stride / 2)));
    for (int w = 0; w < head_dim / 2; ++w)
      _mm512_storeu_si512(kt + w * CHUNK + half * TILE, _mm512_i32gather_epi32(at, words + w, 4));
  }
}

// V's tokens 2r and 2r+1 interleaved element by element (zeros past n): B tiles of P x V, tile j
// at vv + j * TILE_ELEMS. unpacklo/hi work within 128-bit lanes, so tile j's column c holds
// dimension 32 (j / 2) + 8 (c / 4) + 4 (j % 2) + c % 4 (finish_row puts them back in order).
void interleave_v(uint16_t* __restrict__ vv, const uint16_t* v, int64_t token_stride, int n, int head_dim) {
  for (int r = 0; r < CHUNK / 2; ++r)
    for (int g = 0; g < head_dim / 32; ++g) {
      const __m512i a = 2 * r < n ? _mm512_loadu_si512(v + 2 * r * token_stride + 32 * g) : _mm512_setzero_si512();
      const __m512i b = 2 * r + 1 < n ? _mm512_loadu_si512(v + (2 * r + 1) * token_stride + 32 * g) : _mm512_setzero_si512();
      _mm512_storeu_si512(vv + (2 * g * TILE + r) * CHUNK, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vv + ((2 * g + 1) * TILE + r) * CHUNK, _mm512_unpackhi_epi16(a, b));
    }
}

// 2^t for t <= RESCALE_LOG2 (finite): 2^round(t) by vscalefps (0 below float32's range) times a
// degree-5 polynomial for 2^f, f in [-0.5, 0.5] (Taylor: relative error < 3e-6, far below the
// bf16 rounding the weights get).
inline __m512 exp2_v(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  for (const float c : {9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

struct Scratch {
  std::vector<uint16_t> qa;  // [rows][head_dim]: the head's query rows, A tiles of S
  std::vector<int32_t> pos;  // [rows]: each row's query position
  std::vector<uint32_t> kt;  // [chunks][head_dim / 2][CHUNK]: K^T, B tiles of S
  std::vector<uint16_t> vv;  // [chunks][head_dim / 16][TILE][CHUNK]: V, B tiles of P x V
  std::vector<float> o;  // [TILE][head_dim]: a row tile's output, columns in tile order
  std::vector<float> pv;  // [TILE][head_dim]: one chunk's P x V (heads wider than 64)
  alignas(64) float s[TILE * CHUNK];  // a row tile's scores for one chunk
  alignas(64) uint16_t p[TILE * CHUNK];  // their weights in bf16: an A tile
  alignas(64) float m[TILE];  // running max per row (raw scores)
  alignas(64) float correction[TILE];  // by how much each row's output shrinks at this chunk
  alignas(64) float l[TILE * LANES];  // each row's sum of weights, in 16 lanes
};

// The row tile's scores in s (keys first..first + n - 1) become weights in p; m, l and correction
// updated. `diagonal`: some key lies past some row's query, or the chunk is short, so the
// scores are masked (row r sees keys up to pos[r]). Returns whether some row with earlier weights
// had its max raised (its output must shrink by `correction`).
bool softmax_rows(Scratch& sc, const int32_t* pos, int first, int n, float scale, bool diagonal) {
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  // Pass 1: each row's max; masked scores become -inf in s.
  alignas(64) float row_max[TILE];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(first));
  const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(TILE));
  const __mmask16 live0 = first_lanes(n), live1 = first_lanes(n - TILE);
  for (int r = 0; r < TILE; ++r) {
    float* sr = sc.s + r * CHUNK;
    __m512 x0 = _mm512_load_ps(sr), x1 = _mm512_load_ps(sr + TILE);
    if (diagonal) {
      const __m512i at = _mm512_set1_epi32(pos[r]);
      x0 = _mm512_mask_mov_ps(minus_inf, live0 & _mm512_cmple_epi32_mask(key0, at), x0);
      x1 = _mm512_mask_mov_ps(minus_inf, live1 & _mm512_cmple_epi32_mask(key1, at), x1);
      _mm512_store_ps(sr, x0);
      _mm512_store_ps(sr + TILE, x1);
    }
    row_max[r] = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
  }
  // The 16 rows' maxima at once: raised only past RESCALE_LOG2 (a row with no weights yet, -inf,
  // takes its first max); correction = e^(scale (old - new)), 0 from -inf, 1 where kept.
  const __m512 old_max = _mm512_load_ps(sc.m), seen = _mm512_load_ps(row_max);
  const __mmask16 raise = _mm512_cmp_ps_mask(seen, _mm512_add_ps(old_max, _mm512_set1_ps(RESCALE_LOG2 / (scale * LOG2E))),
                                             _CMP_GT_OQ);
  const __m512 new_max = _mm512_mask_mov_ps(old_max, raise, seen);
  _mm512_store_ps(sc.m, new_max);
  _mm512_store_ps(sc.correction, exp_nonpositive_v(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), _mm512_set1_ps(scale))));
  // Pass 2: weights 2^(c (x - max)), c = scale log2 e; masked ones exactly 0.
  const __m512 c = _mm512_set1_ps(scale * LOG2E);
  for (int r = 0; r < TILE; ++r) {
    const float* sr = sc.s + r * CHUNK;
    const __m512 shift = _mm512_set1_ps(sc.m[r] * scale * LOG2E);
    const __m512 x0 = _mm512_load_ps(sr), x1 = _mm512_load_ps(sr + TILE);
    __m512 p0, p1;
    if (diagonal) {
      const __m512 floor = _mm512_set1_ps(-200.0f);  // keeps -inf out of exp2_v; its 2^-200 is 0
      p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, minus_inf, _CMP_NEQ_OQ), exp2_v(_mm512_max_ps(_mm512_fmsub_ps(x0, c, shift), floor)));
      p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, minus_inf, _CMP_NEQ_OQ), exp2_v(_mm512_max_ps(_mm512_fmsub_ps(x1, c, shift), floor)));
    } else {
      p0 = exp2_v(_mm512_fmsub_ps(x0, c, shift));
      p1 = exp2_v(_mm512_fmsub_ps(x1, c, shift));
    }
    float* lr = sc.l + r * LANES;
    _mm512_store_ps(lr, _mm512_fmadd_ps(_mm512_load_ps(lr), _mm512_set1_ps(sc.correction[r]), _mm512_add_ps(p0, p1)));
    _mm512_store_si512(sc.p + r * CHUNK, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys 0-15, then 16-31
  }
  return _mm512_cmp_ps_mask(old_max, minus_inf, _CMP_NEQ_OQ) & raise;
}

// S = Q K^T for the row tile (qa: its rows, stride head_dim) and one chunk (kt: its K^T) into s:
// keys 0-15 in tile 4, 16-31 in tile 5; tile 6 takes Q, 7 K^T.
void scores(Scratch& sc, const uint16_t* qa, const uint32_t* kt, int head_dim) {
  _tile_zero(4);
  _tile_zero(5);
  for (int d = 0; d < head_dim; d += 32) {
    _tile_loadd(6, qa + d, head_dim * 2);
    const uint32_t* kd = kt + (d / 2) * CHUNK;
    _tile_loadd(7, kd, CHUNK * 4);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, kd + TILE, CHUNK * 4);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, sc.s, CHUNK * 4);
  _tile_stored(5, sc.s + TILE, CHUNK * 4);
}

// Tiles 0-3 += P (tile 6) x the four V tiles from vv (through tile 7).
inline void pv_into_tiles(const uint16_t* p, const uint16_t* vv) {
  _tile_loadd(6, p, CHUNK * 2);
  _tile_loadd(7, vv, CHUNK * 2);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(7, vv + TILE_ELEMS, CHUNK * 2);
  _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(7, vv + 2 * TILE_ELEMS, CHUNK * 2);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(7, vv + 3 * TILE_ELEMS, CHUNK * 2);
  _tile_dpbf16ps(3, 6, 7);
}

inline void zero_o_tiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

inline void store_o_tiles(float* o, int stride_bytes) {
  _tile_stored(0, o, stride_bytes);
  _tile_stored(1, o + TILE, stride_bytes);
  _tile_stored(2, o + 2 * TILE, stride_bytes);
  _tile_stored(3, o + 3 * TILE, stride_bytes);
}

// o[r] = o[r] * correction[r] + add[r] (add null: o[r] * correction[r]) for the tile's rows.
void rescale_rows(Scratch& sc, const float* add, int head_dim) {
  for (int r = 0; r < TILE; ++r) {
    const __m512 c = _mm512_set1_ps(sc.correction[r]);
    float* o = sc.o.data() + static_cast<size_t>(r) * head_dim;
    for (int d = 0; d < head_dim; d += LANES) {
      const __m512 x = _mm512_loadu_ps(o + d);
      _mm512_storeu_ps(o + d, add == nullptr ? _mm512_mul_ps(x, c)
                                             : _mm512_fmadd_ps(x, c, _mm512_loadu_ps(add + r * head_dim + d)));
    }
  }
}

// out row = o row / l, bf16, columns back in order: tile 2g's column c holds dimension
// 32g + 8(c / 4) + c % 4, tile 2g + 1's the same + 4 (interleave_v's unpacklo / unpackhi).
void finish_row(const float* o, float l, uint16_t* out, int head_dim) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
  for (int g = 0; g < head_dim / 32; ++g) {
    const __m512 lo = _mm512_loadu_ps(o + 32 * g), hi = _mm512_loadu_ps(o + 32 * g + TILE);
    store16<BF16T>(out + 32 * g, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
    store16<BF16T>(out + 32 * g + TILE, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
  }
}
#endif

}  // namespace

extern "C" {

// 1 where nanovllm_amx_prefill_attention takes these shapes in this build, else 0.
int nanovllm_amx_prefill_takes(int head_dim, int block_size) {
#ifdef NANOVLLM_AMX
  return head_dim > 0 && head_dim % (PV_TILES * TILE) == 0 && block_size % CHUNK == 0;
#else
  (void)head_dim, (void)block_size;
  return 0;
#endif
}

// Attends rows first_row .. first_row + queries - 1 of q (query positions first_pos..), KV heads
// head_begin..head_end - 1 with their groups of query heads, over the keys each sees through
// `table`, into the same rows of out. bfloat16 throughout (q, out, caches [blocks][block_size]
// [num_kv_heads][head_dim]). Runs on the calling thread. Returns 0, or -1 where it does not take
// the shapes (head_dim not a multiple of 64, block_size not of 32) or the build has no AMX; the
// caller asks amx_granted() first.
int nanovllm_amx_prefill_attention(const uint16_t* q, uint16_t* out, const uint16_t* k_cache, const uint16_t* v_cache,
                                   const int32_t* table, int64_t q_stride_token, int64_t q_stride_head,
                                   int64_t out_stride_token, int64_t out_stride_head, int64_t first_row, int first_pos,
                                   int queries, int head_begin, int head_end, int group, int num_kv_heads,
                                   int head_dim, int block_size, float scale) {
#ifdef NANOVLLM_AMX
  if (!nanovllm_amx_prefill_takes(head_dim, block_size) || queries <= 0) return -1;
  thread_local Scratch sc;
  const int live = queries * group, rows = (live + TILE - 1) / TILE * TILE;
  const int visible_end = first_pos + queries;  // the last query sees keys 0..first_pos + queries - 1
  const int chunks = (visible_end + CHUNK - 1) / CHUNK;
  const bool o_in_tiles = head_dim == PV_TILES * TILE;  // else O in float32 rows, P x V added per chunk
  const int64_t kt_chunk = static_cast<int64_t>(head_dim) / 2 * CHUNK, vv_chunk = static_cast<int64_t>(head_dim) * CHUNK;
  sc.qa.resize(static_cast<size_t>(rows) * head_dim);
  sc.pos.resize(rows);
  sc.kt.resize(chunks * kt_chunk);
  sc.vv.resize(chunks * vv_chunk);
  sc.o.resize(static_cast<size_t>(TILE) * head_dim);
  sc.pv.resize(static_cast<size_t>(TILE) * head_dim);
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t block_stride = token_stride * block_size;
  const int o_stride = head_dim * 4;
  load_tile_config();
  for (int h = head_begin; h < head_end; ++h) {
    // Row r: query r / group, head h * group + r % group; padding rows repeat the last (dropped).
    for (int r = 0; r < rows; ++r) {
      const int row = std::min(r, live - 1);
      const uint16_t* src = q + (first_row + row / group) * q_stride_token + (h * group + row % group) * q_stride_head;
      uint16_t* dst = sc.qa.data() + static_cast<size_t>(r) * head_dim;
      for (int d = 0; d < head_dim; d += 32) _mm512_storeu_si512(dst + d, _mm512_loadu_si512(src + d));
      sc.pos[r] = first_pos + row / group;
    }
    const auto chunk_at = [&](int first) {  // where a chunk's first key of head h lies in a cache
      return static_cast<int64_t>(table[first / block_size]) * block_stride + (first % block_size) * token_stride +
             static_cast<int64_t>(h) * head_dim;
    };
    for (int c = 0; c < chunks; ++c) {  // 1.
      const int first = c * CHUNK;
      const int64_t at = chunk_at(first);
      const int n = std::min(CHUNK, visible_end - first);
      if (c + 1 < chunks) {  // the next chunk's rows on their way (its block is anywhere in the cache)
        const int64_t next = chunk_at(first + CHUNK);
        for (int t = 0; t < std::min(CHUNK, visible_end - first - CHUNK); ++t)
          for (int d = 0; d < head_dim; d += CACHE_LINE / static_cast<int>(sizeof(uint16_t))) {
            _mm_prefetch(reinterpret_cast<const char*>(k_cache + next + t * token_stride + d), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + next + t * token_stride + d), _MM_HINT_T0);
          }
      }
      transpose_k(sc.kt.data() + c * kt_chunk, k_cache + at, token_stride, n, head_dim);
      interleave_v(sc.vv.data() + c * vv_chunk, v_cache + at, token_stride, n, head_dim);
    }
    for (int row0 = 0; row0 < live; row0 += TILE) {  // 2.
      const int32_t* pos = sc.pos.data() + row0;
      std::fill(sc.m, sc.m + TILE, -INFINITY);
      std::fill(sc.l, sc.l + TILE * LANES, 0.0f);
      if (o_in_tiles)
        zero_o_tiles();
      else
        std::fill(sc.o.begin(), sc.o.end(), 0.0f);
      const int row_end = pos[TILE - 1] + 1;  // keys the tile's last row sees
      for (int first = 0; first < row_end; first += CHUNK) {
        const int c = first / CHUNK, n = std::min(CHUNK, row_end - first);
        scores(sc, sc.qa.data() + static_cast<size_t>(row0) * head_dim, sc.kt.data() + c * kt_chunk, head_dim);
        const bool shrink = softmax_rows(sc, pos, first, n, scale, first + CHUNK - 1 > pos[0] || n < CHUNK);
        const uint16_t* vv = sc.vv.data() + c * vv_chunk;
        if (o_in_tiles) {
          if (shrink) {  // out of the tiles, rescaled, back
            store_o_tiles(sc.o.data(), o_stride);
            rescale_rows(sc, nullptr, head_dim);
            _tile_loadd(0, sc.o.data(), o_stride);
            _tile_loadd(1, sc.o.data() + TILE, o_stride);
            _tile_loadd(2, sc.o.data() + 2 * TILE, o_stride);
            _tile_loadd(3, sc.o.data() + 3 * TILE, o_stride);
          }
          pv_into_tiles(sc.p, vv);
        } else {
          for (int j0 = 0; j0 < head_dim / TILE; j0 += PV_TILES) {
            zero_o_tiles();
            pv_into_tiles(sc.p, vv + j0 * TILE_ELEMS);
            store_o_tiles(sc.pv.data() + j0 * TILE, o_stride);
          }
          rescale_rows(sc, sc.pv.data(), head_dim);
        }
      }
      if (o_in_tiles) store_o_tiles(sc.o.data(), o_stride);
      for (int r = 0; r < std::min(TILE, live - row0); ++r) {
        const int row = row0 + r;
        finish_row(sc.o.data() + static_cast<size_t>(r) * head_dim, _mm512_reduce_add_ps(_mm512_load_ps(sc.l + r * LANES)),
                   out + (first_row + row / group) * out_stride_token + (h * group + row % group) * out_stride_head,
                   head_dim);
      }
    }
  }
  _tile_release();
  return 0;
#else
  (void)q, (void)out, (void)k_cache, (void)v_cache, (void)table, (void)q_stride_token, (void)q_stride_head,
      (void)out_stride_token, (void)out_stride_head, (void)first_row, (void)first_pos, (void)queries,
      (void)head_begin, (void)head_end, (void)group, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale;
  return -1;
#endif
}

}  // extern "C"
