// Attention one query row at a time, each row over a prefix of the keys (engine.fused_llama.rows_apart: the int8
// and int4 targets' attention, and fp32 models' on the CPU): a verify's row then computes what a one-row forward at
// its position computes, bit for bit, whatever rows are beside it. torch's SDPA gives that only when called once
// per row (about 30 us a call at SmolLM2's size, most of it the call); here every row of a forward is one pass of a
// few loops, in a fixed order that depends on nothing but the row and its keys: each head's scores (a 64-wide dot
// product, 8 lanes then the lanes added), their largest, exp(score - largest) from a polynomial, the weights' sum
// in key order, and the values summed in key order, divided by that sum at the end. The Python forward and the C++
// layer loop both call it.
#include <ATen/ATen.h>   // not torch/extension.h: a third of the compile time

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "lanes.h"
#define SPECPLAY_ROWS 1
#endif

namespace {

#ifdef SPECPLAY_ROWS
#define AVX2 __attribute__((target("avx2,fma")))

// One head of one row: q [d] against keys k (n of them, `key_stride` apart) and values v (`value_stride` apart);
// out [d]. d is a multiple of 8; `scores` holds n rounded up to 8 floats.
AVX2 void one_head(const float* q, const float* k, const float* v, int64_t key_stride, int64_t value_stride,
                   int64_t n, int64_t d, float scaling, float* scores, float* out) {
  float largest = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {   // four keys side by side, each key's sum in the same order as alone
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 qc = _mm256_loadu_ps(q + c);
      for (int t = 0; t < 4; ++t) acc[t] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + (j + t) * key_stride + c), acc[t]);
    }
    for (int t = 0; t < 4; ++t) {
      scores[j + t] = lanes_added(acc[t]) * scaling;
      largest = std::max(largest, scores[j + t]);
    }
  }
  for (; j < n; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + j * key_stride + c), acc);
    scores[j] = lanes_added(acc) * scaling;
    largest = std::max(largest, scores[j]);
  }
  for (j = n; j < ((n + 7) & ~int64_t(7)); ++j) scores[j] = -INFINITY;   // exp gives 0 past the keys
  const __m256 top = _mm256_set1_ps(largest);
  __m256 total = _mm256_setzero_ps();
  for (j = 0; j < n; j += 8) {
    const __m256 w = exp_negative(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top));
    _mm256_storeu_ps(scores + j, w);
    total = _mm256_add_ps(total, w);
  }
  const __m256 inverse = _mm256_set1_ps(1.f / lanes_added(total));
  for (int64_t c0 = 0; c0 < d; c0 += 64) {   // up to eight columns' sums in flight, each over the keys in order
    const int64_t width = std::min<int64_t>(64, d - c0);
    __m256 acc[8];
    for (int64_t c = 0; c < width; c += 8) acc[c / 8] = _mm256_setzero_ps();
    for (j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(scores[j]);
      const float* vj = v + j * value_stride + c0;
      for (int64_t c = 0; c < width; c += 8) acc[c / 8] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + c), acc[c / 8]);
    }
    for (int64_t c = 0; c < width; c += 8) _mm256_storeu_ps(out + c0 + c, _mm256_mul_ps(acc[c / 8], inverse));
  }
}
#endif

}  // namespace

bool coded_supported();   // coded.cpp: x86-64 with AVX2 and FMA, what this file needs too

// Whether this build and CPU run `rows_attention`.
bool rows_supported() { return coded_supported(); }

// qs [1, heads, q, d] float32; keys and values [1, kv_heads, N, d] float32 (heads a multiple of kv_heads, each
// head reading kv head h / (heads / kv_heads); the last dimension contiguous); row r attends to the first
// counts[r] keys. Returns [1, heads, q, d].
at::Tensor rows_attention(const at::Tensor& qs, const at::Tensor& keys, const at::Tensor& values,
                          const std::vector<int64_t>& counts, double scaling) {
  TORCH_CHECK(rows_supported(), "rows_attention needs an x86-64 CPU with AVX2 and FMA");
  TORCH_CHECK(qs.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && qs.size(0) == 1 && keys.size(0) == 1 &&
                  qs.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "rows_attention takes float32 [1, heads, q, d] queries and [1, kv_heads, keys, d] keys and values");
  const int64_t heads = qs.size(1), q = qs.size(2), d = qs.size(3), kv = keys.size(1), n_keys = keys.size(2);
  TORCH_CHECK(d % 8 == 0 && keys.size(3) == d && values.sizes() == keys.sizes() && kv > 0 && heads % kv == 0 &&
                  static_cast<int64_t>(counts.size()) == q,
              "rows_attention: shapes do not agree");
  for (int64_t c : counts) TORCH_CHECK(c >= 1 && c <= n_keys, "rows_attention: a row sees 1 to ", n_keys, " keys");
  auto query = qs.contiguous();
  auto k = keys.stride(3) == 1 ? keys : keys.contiguous();
  auto v = values.stride(3) == 1 ? values : values.contiguous();
  auto out = at::empty({1, heads, q, d}, qs.options());
#ifdef SPECPLAY_ROWS
  std::vector<float> scores((n_keys + 7) & ~int64_t(7));
  const float* qp = query.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv;
  for (int64_t r = 0; r < q; ++r)
    for (int64_t h = 0; h < heads; ++h)
      one_head(qp + (h * q + r) * d, kp + (h / group) * k.stride(1), vp + (h / group) * v.stride(1), k.stride(2),
               v.stride(2), counts[r], d, static_cast<float>(scaling), scores.data(), op + (h * q + r) * d);
#endif
  return out;
}
