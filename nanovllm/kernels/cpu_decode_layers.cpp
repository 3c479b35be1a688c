// A decode step through every decoder layer of a Llama-family model (Llama,
// Qwen2, Qwen3) in one call: for each layer the residual add + RMSNorm, the q/k/v product, q/k
// RMSNorm + rotary + the K/V store, paged attention over the cache, the output product, the
// second add + RMSNorm, gate/up, SiLU-and-mul and down; then the final add + RMSNorm.
//
// Each part is the library's own kernel (cpu_fused.cpp, cpu_linear.cpp or, above the few-row
// product's rows, cpu_amx_linear.cpp on a packed weight, cpu_paged_attention.cpp),
// called with the same arguments and writing the same dtype between parts as the model's Python
// layers do when they call them one by one (models/llama.py with fused_kernels="cpu"), so the
// result is bit for bit theirs. What one call saves is the Python between the parts: ~10 calls
// a layer through torch modules and ctypes, ~150 us a layer, where one sequence's whole layer
// reads its weights in ~200 us (platform/cpu/decode.py measures and takes it).
//
// Scratch rows between the parts live in a per-thread buffer that grows to the largest step seen;
// with the AMX product its rows are whole tiles (the rows past `rows` are computed and never read).
#include <vector>

#include "cpu_kernels.h"  // declares the parts it calls

namespace {

using namespace nanovllm_cpu;

// One decoder layer's tensors (a bias, q_norm or k_norm may be null); platform/cpu/decode.py's
// LayerWeights mirrors this layout.
struct LayerWeights {
  const void *input_norm, *post_norm, *qkv, *qkv_bias, *o, *o_bias, *q_norm, *k_norm, *gate_up, *gate_up_bias,
      *down, *down_bias;
  void *k_cache, *v_cache;
  const void *qkv_amx, *o_amx, *gate_up_amx, *down_amx;  // packed for the AMX product, or null
  float input_eps, post_eps, qk_eps;
};

// The model's sizes and shared tensors; platform/cpu/decode.py's DecodeModel mirrors this layout.
struct DecodeModel {
  int dtype, element_size, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_layers;
  int few_rows_max;  // the few-row product's rows; above them the AMX product's weights must be there
  float scale, final_eps;
  const void* final_norm;
  const float* cos_sin;
  int64_t cos_sin_stride;
  const LayerWeights* layers;
};

// The rows a step's products compute: its own up to the few-row product's, whole AMX tiles above.
int product_rows(const DecodeModel* m, int rows) {
  return rows <= m->few_rows_max ? rows : (rows + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS * AMX_TILE_ROWS;
}

// out[rows, N] = x[rows, K] @ w^T (+ bias), x and out with row strides K and N: the few-row
// product up to its rows, the AMX product on w_amx above them (on product_rows rows).
int product(const DecodeModel* m, int rows, const void* x, const void* w, const void* w_amx, const void* bias,
            void* out, int N, int K, int num_threads) {
  if (rows <= m->few_rows_max) return nanovllm_few_rows_linear(m->dtype, rows, x, K, w, bias, out, N, N, K, num_threads);
  if (w_amx == nullptr) return -1;
  return nanovllm_amx_linear(m->dtype, x, K, product_rows(m, rows), K, w_amx, N, bias, out, N, num_threads);
}

}  // namespace

extern "C" {

// out[rows, hidden] = the final norm of the last layer's output, for input embeddings x[rows,
// hidden] of `rows` decode sequences (1 <= rows <= few_rows_max, or more with every layer's AMX
// weights, up to cpu_build.py's AMX_MAX_ROWS; row i at position
// positions[i], its K/V stored at slots[i]); block_tables, q_start, q_len, k_len are the paged
// attention kernel's per-sequence arguments. Returns 0, or the first failing part's code.
int nanovllm_decode_layers(const DecodeModel* m, int rows, const void* x, void* out, const int64_t* positions,
                           const int64_t* slots, const int32_t* block_tables, int64_t table_stride,
                           const int32_t* q_start, const int32_t* q_len, const int32_t* k_len, int num_threads) {
  const int H = m->hidden, q_width = m->num_heads * m->head_dim, kv_width = m->num_kv_heads * m->head_dim;
  const int qkv_width = q_width + 2 * kv_width, I = m->intermediate, dt = m->dtype;
  // Scratch, in elements: normed rows, two residual rows (read one, write the other), the
  // layer's output, q/k/v, attention output, gate/up, and its activation.
  const size_t sizes[] = {size_t(H), size_t(H), size_t(H), size_t(H), size_t(qkv_width), size_t(q_width),
                          size_t(2 * I), size_t(I)};
  const int scratch_rows = product_rows(m, rows);
  size_t total = 0;
  for (size_t s : sizes) total += s * scratch_rows;
  thread_local std::vector<unsigned char> scratch;
  if (scratch.size() < total * m->element_size) scratch.resize(total * m->element_size);
  unsigned char* parts[8];
  unsigned char* p = scratch.data();
  for (int i = 0; i < 8; ++i) {
    parts[i] = p;
    p += sizes[i] * scratch_rows * m->element_size;
  }
  unsigned char *h = parts[0], *res_in = parts[1], *res_out = parts[2], *y = parts[3], *qkv = parts[4],
                *attn = parts[5], *gate_up = parts[6], *act = parts[7];
  const size_t es = m->element_size;
  int rc = 0;
  for (int l = 0; l < m->num_layers && rc == 0; ++l) {
    const LayerWeights& w = m->layers[l];
    // 1. Residual add + RMSNorm (the first layer: RMSNorm of the embeddings, which are the residual).
    if (l == 0) {
      rc |= nanovllm_rms_norm(dt, x, H, nullptr, 0, w.input_norm, h, H, nullptr, 0, rows, H, w.input_eps, num_threads);
      std::memcpy(res_out, x, size_t(rows) * H * es);
    } else {
      rc |= nanovllm_rms_norm(dt, y, H, res_in, H, w.input_norm, h, H, res_out, H, rows, H, w.input_eps, num_threads);
    }
    std::swap(res_in, res_out);
    // 2. q, k, v; their norms and rotation in place, K/V stored; attention over the cache.
    rc |= product(m, rows, h, w.qkv, w.qkv_amx, w.qkv_bias, qkv, qkv_width, H, num_threads);
    unsigned char *q = qkv, *k = qkv + size_t(q_width) * es, *v = qkv + size_t(q_width + kv_width) * es;
    rc |= nanovllm_qk_norm_rope(dt, q, qkv_width, m->head_dim, m->num_heads, k, qkv_width, m->head_dim,
                                m->num_kv_heads, positions, m->cos_sin, m->cos_sin_stride, w.q_norm, w.k_norm,
                                w.qk_eps, v, qkv_width, m->head_dim, w.k_cache, w.v_cache, slots, rows, m->head_dim,
                                num_threads);
    rc |= nanovllm_paged_attention(dt, q, attn, w.k_cache, w.v_cache, block_tables, table_stride, q_start, q_len,
                                   k_len, rows, m->num_heads, m->num_kv_heads, m->head_dim, m->block_size, m->scale,
                                   1, qkv_width, m->head_dim, q_width, m->head_dim, num_threads);
    // 3. The output product, then the second residual add + RMSNorm.
    rc |= product(m, rows, attn, w.o, w.o_amx, w.o_bias, y, H, q_width, num_threads);
    rc |= nanovllm_rms_norm(dt, y, H, res_in, H, w.post_norm, h, H, res_out, H, rows, H, w.post_eps, num_threads);
    std::swap(res_in, res_out);
    // 4. The MLP: gate/up, SiLU(gate) * up, down.
    rc |= product(m, rows, h, w.gate_up, w.gate_up_amx, w.gate_up_bias, gate_up, 2 * I, H, num_threads);
    rc |= nanovllm_silu_and_mul(dt, gate_up, 2 * I, act, I, rows, I, num_threads);
    rc |= product(m, rows, act, w.down, w.down_amx, w.down_bias, y, H, I, num_threads);
  }
  // 5. The final residual add + RMSNorm.
  if (rc == 0)
    rc |= nanovllm_rms_norm(dt, y, H, res_in, H, m->final_norm, out, H, res_out, H, rows, H, m->final_eps, num_threads);
  return rc;
}

}  // extern "C"
