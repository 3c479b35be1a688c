// Paged attention on the CPU that reads the KV cache's blocks where they lie.
//
// One call attends every query row of a step: sequence s has q_len[s] new queries (1 for a
// decode row) starting at row q_start[s] of q, over its first k_len[s] cached tokens, found
// through its row of the block table; query i of the sequence sits at position
// k_len - q_len + i and sees keys 0..that position (bottom-right causal). A sequence with
// k_len 0 outputs zeros.
//
// The work is cut into items of (sequence, KV head, tile of up to `q_tile` queries), run in
// parallel by OpenMP (torch's own libgomp: the same soname, so the same thread pool). An item
// holds its group of query heads for each query of its tile as rows of float32 (GQA: K/V are
// read once for the whole group, never repeated per query head) and walks the sequence's
// blocks once: each block's K is converted to float32 and transposed to [head_dim][tokens] so
// that the scores of a row are a vector over the block's tokens (no horizontal sums), then an
// online softmax (running max and sum per row) folds the block's V into float32 accumulators.
// Caches and queries are float32, bfloat16 or float16, the same type for both; all arithmetic
// is float32.
//
// No torch headers: the library is plain C with an ABI of pointers and integers, built by
// nanovllm/kernels/cpu_build.py with g++ in about a second and loaded with ctypes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

// exp(x) for x <= 0 (scores minus their running max) in a form the compiler vectorises:
// 2^(x log2 e) split into 2^n (built in the exponent bits) times a degree-6 polynomial for 2^f,
// f in [-0.5, 0.5] (Cephes' exp2f coefficients); relative error ~2e-7, about float32 rounding.
// Below -87 it returns 0.
inline float exp_nonpositive(float x) {
  const float log2e = 1.44269504088896341f;
  float t = std::max(x, -87.0f) * log2e;
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

struct Item {
  int32_t seq, head, q_begin, q_end;  // queries q_begin..q_end-1 of the sequence, KV head `head`
};

template <typename T>
void attend_item(const Item& item, const typename T::storage* q, typename T::storage* out,
                 const typename T::storage* k_cache, const typename T::storage* v_cache,
                 const int32_t* table, int64_t q_stride_token, int64_t q_stride_head,
                 int64_t out_stride_token, int64_t out_stride_head, int32_t q_start, int32_t q_len,
                 int32_t k_len, int group, int num_kv_heads, int head_dim, int block_size, float scale,
                 std::vector<float>& scratch) {
  const int queries = item.q_end - item.q_begin;
  const int rows = queries * group;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;  // within a block
  const int64_t block_stride = token_stride * block_size;
  // Scratch: q rows, accumulators, K transposed, V, scores; running max and sum per row.
  const size_t need = static_cast<size_t>(rows) * head_dim * 2 + static_cast<size_t>(head_dim) * block_size * 2 +
                      static_cast<size_t>(rows) * (block_size + 2);
  if (scratch.size() < need) scratch.resize(need);
  float* qf = scratch.data();
  float* acc = qf + static_cast<size_t>(rows) * head_dim;
  float* kt = acc + static_cast<size_t>(rows) * head_dim;  // [head_dim][block_size]
  float* vf = kt + static_cast<size_t>(head_dim) * block_size;  // [block_size][head_dim]
  float* s = vf + static_cast<size_t>(head_dim) * block_size;  // [block_size] per row, reused
  float* m = s + block_size;
  float* l = m + rows;
  // Row r = (query i, head g of the group): query head item.head * group + g.
  for (int i = 0; i < queries; ++i) {
    for (int g = 0; g < group; ++g) {
      const typename T::storage* src = q + static_cast<int64_t>(q_start + item.q_begin + i) * q_stride_token +
                                       static_cast<int64_t>(item.head * group + g) * q_stride_head;
      float* dst = qf + static_cast<size_t>(i * group + g) * head_dim;
      for (int d = 0; d < head_dim; ++d) dst[d] = load<T>(src + d) * scale;
    }
  }
  std::fill(acc, acc + static_cast<size_t>(rows) * head_dim, 0.0f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.0f);
  // The last query of the tile sees the most keys: through position k_len - q_len + q_end - 1.
  const int visible_end = k_len - q_len + item.q_end;
  const int num_blocks = (visible_end + block_size - 1) / block_size;
  for (int b = 0; b < num_blocks; ++b) {
    const int first = b * block_size;
    const int n = std::min(block_size, visible_end - first);
    const int64_t base = static_cast<int64_t>(table[b]) * block_stride + static_cast<int64_t>(item.head) * head_dim;
    for (int t = 0; t < n; ++t) {
      const typename T::storage* kp = k_cache + base + t * token_stride;
      const typename T::storage* vp = v_cache + base + t * token_stride;
      for (int d = 0; d < head_dim; ++d) {
        kt[static_cast<size_t>(d) * block_size + t] = load<T>(kp + d);
        vf[static_cast<size_t>(t) * head_dim + d] = load<T>(vp + d);
      }
    }
    for (int i = 0; i < queries; ++i) {
      // Keys this query sees in the block: positions first..first+nv-1.
      const int position = k_len - q_len + item.q_begin + i;
      const int nv = std::min(n, position - first + 1);
      if (nv <= 0) continue;
      for (int g = 0; g < group; ++g) {
        const int r = i * group + g;
        const float* qr = qf + static_cast<size_t>(r) * head_dim;
        std::fill(s, s + nv, 0.0f);
        for (int d = 0; d < head_dim; ++d) {
          const float qd = qr[d];
          const float* kd = kt + static_cast<size_t>(d) * block_size;
#pragma omp simd
          for (int t = 0; t < nv; ++t) s[t] += qd * kd[t];
        }
        float block_max = s[0];
        for (int t = 1; t < nv; ++t) block_max = std::max(block_max, s[t]);
        const float new_max = std::max(m[r], block_max);
        const float correction = exp_nonpositive(m[r] - new_max);  // 0 on the first block (-inf)
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < nv; ++t) {
          s[t] = exp_nonpositive(s[t] - new_max);
          sum += s[t];
        }
        float* ar = acc + static_cast<size_t>(r) * head_dim;
        if (correction != 1.0f) {
#pragma omp simd
          for (int d = 0; d < head_dim; ++d) ar[d] *= correction;
        }
        for (int t = 0; t < nv; ++t) {
          const float p = s[t];
          const float* vt = vf + static_cast<size_t>(t) * head_dim;
#pragma omp simd
          for (int d = 0; d < head_dim; ++d) ar[d] += p * vt[d];
        }
        l[r] = l[r] * correction + sum;
        m[r] = new_max;
      }
    }
  }
  for (int i = 0; i < queries; ++i) {
    for (int g = 0; g < group; ++g) {
      const int r = i * group + g;
      typename T::storage* dst = out + static_cast<int64_t>(q_start + item.q_begin + i) * out_stride_token +
                                 static_cast<int64_t>(item.head * group + g) * out_stride_head;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // no keys: zeros
      const float* ar = acc + static_cast<size_t>(r) * head_dim;
      for (int d = 0; d < head_dim; ++d) store<T>(dst + d, ar[d] * inv);
    }
  }
}

template <typename T>
void run(const void* q, void* out, const void* k_cache, const void* v_cache, const int32_t* block_tables,
         int64_t table_stride, const int32_t* q_start, const int32_t* q_len, const int32_t* k_len, int num_seqs,
         int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int q_tile,
         int64_t q_stride_token, int64_t q_stride_head, int64_t out_stride_token, int64_t out_stride_head) {
  using S = typename T::storage;
  const int group = num_heads / num_kv_heads;
  std::vector<Item> items;
  for (int s = 0; s < num_seqs; ++s) {
    for (int begin = 0; begin < q_len[s]; begin += q_tile) {
      const int end = std::min(q_len[s], begin + q_tile);
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({s, h, begin, end});
    }
  }
  // Longest contexts first, so the dynamic schedule does not end on one long item.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return k_len[a.seq] - q_len[a.seq] + a.q_end > k_len[b.seq] - q_len[b.seq] + b.q_end;
  });
  const int64_t count = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < count; ++w) {
      const Item& item = items[w];
      attend_item<T>(item, static_cast<const S*>(q), static_cast<S*>(out), static_cast<const S*>(k_cache),
                     static_cast<const S*>(v_cache), block_tables + item.seq * table_stride, q_stride_token,
                     q_stride_head, out_stride_token, out_stride_head, q_start[item.seq], q_len[item.seq],
                     k_len[item.seq], group, num_kv_heads, head_dim, block_size, scale, scratch);
    }
  }
}

}  // namespace

extern "C" {

// The ABI version Python checks after loading, so a stale cached library is never called.
int nanovllm_paged_attention_abi() { return 1; }

// Returns 0, or -1 for a dtype code it does not know.
int nanovllm_paged_attention(int dtype, const void* q, void* out, const void* k_cache, const void* v_cache,
                             const int32_t* block_tables, int64_t table_stride, const int32_t* q_start,
                             const int32_t* q_len, const int32_t* k_len, int num_seqs, int num_heads,
                             int num_kv_heads, int head_dim, int block_size, float scale, int q_tile,
                             int64_t q_stride_token, int64_t q_stride_head, int64_t out_stride_token,
                             int64_t out_stride_head) {
  switch (dtype) {
    case F32:
      run<F32T>(q, out, k_cache, v_cache, block_tables, table_stride, q_start, q_len, k_len, num_seqs, num_heads,
                num_kv_heads, head_dim, block_size, scale, q_tile, q_stride_token, q_stride_head, out_stride_token,
                out_stride_head);
      return 0;
    case BF16:
      run<BF16T>(q, out, k_cache, v_cache, block_tables, table_stride, q_start, q_len, k_len, num_seqs, num_heads,
                 num_kv_heads, head_dim, block_size, scale, q_tile, q_stride_token, q_stride_head, out_stride_token,
                 out_stride_head);
      return 0;
    case F16:
      run<F16T>(q, out, k_cache, v_cache, block_tables, table_stride, q_start, q_len, k_len, num_seqs, num_heads,
                num_kv_heads, head_dim, block_size, scale, q_tile, q_stride_token, q_stride_head, out_stride_token,
                out_stride_head);
      return 0;
    default:
      return -1;
  }
}

}  // extern "C"
