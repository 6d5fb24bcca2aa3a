// A decoder layer's steps between its products, one pass over each row: the RMS norm, the SwiGLU gate and the
// rotary turn. From ATen each is several calls (torch's CPU rms_norm alone is six: pow, mean, add, rsqrt, two
// products), and at one row SmolLM2's 30 layers spent about 3.6 ms a token in these calls against 3.7 ms in
// int4's products. Each row is computed alone, in an order that depends on nothing else (a verify's row is a
// one-row forward's, bit for bit). The norm and the gate round otherwise than ATen's (8-lane sums, a polynomial
// exp), so the Python forward calls these same functions wherever the C++ loop would (engine.fused_llama:
// `_rms_norm`, `_gated`); the rotary turn is ATen's arithmetic, product for product, and needs no twin.
#include <ATen/ATen.h>   // not torch/extension.h: a third of the compile time

#include <cmath>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "lanes.h"
#define SPECPLAY_POINTWISE 1
#endif

bool coded_supported();   // coded.cpp: x86-64 with AVX2 and FMA, what this file needs too

namespace {

#ifdef SPECPLAY_POINTWISE
#define AVX2 __attribute__((target("avx2,fma")))

// The lanes of a row's last, partial group of eight: the first n (< 8) on.
AVX2 inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// out = x / sqrt(mean(x^2) + eps) * w over one row of d: the squares summed in 8 lanes, then the lanes added.
AVX2 void rms_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  if (c < d) {
    const __m256 v = _mm256_maskload_ps(x + c, first_lanes(d - c));
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float inverse = 1.f / std::sqrt(lanes_added(acc) / static_cast<float>(d) + eps);
  const __m256 scale = _mm256_set1_ps(inverse);
  for (c = 0; c + 8 <= d; c += 8)
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c), scale), _mm256_loadu_ps(w + c)));
  if (c < d) {
    const __m256i on = first_lanes(d - c);
    _mm256_maskstore_ps(out + c, on, _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(x + c, on), scale),
                                                   _mm256_maskload_ps(w + c, on)));
  }
}

// silu(g) * u for eight: g * sigmoid(g) * u, sigmoid from e = exp(-|g|) (1 / (1 + e), or e / (1 + e) below 0).
AVX2 inline __m256 gate(__m256 g, __m256 u) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp_negative(_mm256_or_ps(g, sign));   // -|g|
  const __m256 one_more = _mm256_add_ps(_mm256_set1_ps(1.f), e);
  const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.f), e, negative), one_more);
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), u);
}

AVX2 void gated_row(const float* gate_up, float* out, int64_t inter) {
  const float* up = gate_up + inter;
  int64_t c = 0;
  for (; c + 8 <= inter; c += 8)
    _mm256_storeu_ps(out + c, gate(_mm256_loadu_ps(gate_up + c), _mm256_loadu_ps(up + c)));
  if (c < inter) {
    const __m256i on = first_lanes(inter - c);
    _mm256_maskstore_ps(out + c, on, gate(_mm256_maskload_ps(gate_up + c, on), _mm256_maskload_ps(up + c, on)));
  }
}
#endif

// Rows of x [..., d] as a [rows, d] contiguous float32 tensor (a copy only where x is not one already).
at::Tensor as_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1, what,
              " takes float32 rows on the CPU");
  return x.contiguous();
}

}  // namespace

// Whether this build and CPU run the functions below.
bool pointwise_supported() { return coded_supported(); }

// x [..., d] float32 normed row by row and scaled by weight [d]: LlamaRMSNorm's arithmetic, 8 lanes at a time.
at::Tensor rms_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(pointwise_supported(), "rms_rows needs an x86-64 CPU with AVX2 and FMA");
  const auto rows = as_rows(x, "rms_rows");
  const auto w = as_rows(weight, "rms_rows");
  const int64_t d = rows.size(-1);
  TORCH_CHECK(w.numel() == d, "rms_rows: the weight has ", w.numel(), " entries for rows of ", d);
  auto out = at::empty_like(rows);
#ifdef SPECPLAY_POINTWISE
  const float *xp = rows.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0, n = rows.numel() / d; r < n; ++r) rms_row(xp + r * d, wp, op + r * d, d, static_cast<float>(eps));
#endif
  return out;
}

// gate_up [..., 2 * inter] float32 (the gate, then the up projection) to silu(gate) * up [..., inter].
at::Tensor gated_rows(const at::Tensor& gate_up, int64_t inter) {
  TORCH_CHECK(pointwise_supported(), "gated_rows needs an x86-64 CPU with AVX2 and FMA");
  const auto rows = as_rows(gate_up, "gated_rows");
  TORCH_CHECK(inter > 0 && rows.size(-1) == 2 * inter, "gated_rows: rows of ", rows.size(-1), " are not 2 x ", inter);
  auto shape = rows.sizes().vec();
  shape.back() = inter;
  auto out = at::empty(shape, rows.options());
#ifdef SPECPLAY_POINTWISE
  const float* gp = rows.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0, n = rows.numel() / (2 * inter); r < n; ++r) gated_row(gp + r * 2 * inter, op + r * inter, inter);
#endif
  return out;
}

// The rotary turn of a [1, q, (heads + 2 kv_heads) * head_dim] QKV product's queries and keys, as
// fused_llama.decoder_layer writes it (x * cos + rotate_half(x) * sin, each product rounded, then the sum; built
// without contracted multiply-adds): [1, heads + kv_heads, q, head_dim], with cos and sin [q, head_dim] per row.
at::Tensor rotated(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                   int64_t kv_heads, int64_t head_dim) {
  const auto rows = as_rows(qkv, "rotated");
  const auto c = as_rows(cos, "rotated"), s = as_rows(sin, "rotated");
  const int64_t q = rows.numel() / rows.size(-1), turned = heads + kv_heads, half = head_dim / 2;
  TORCH_CHECK(head_dim % 2 == 0 && rows.size(-1) == (turned + kv_heads) * head_dim && c.numel() == q * head_dim &&
                  s.numel() == q * head_dim,
              "rotated: shapes do not agree");
  auto out = at::empty({1, turned, q, head_dim}, rows.options());
  const float *xp = rows.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < q; ++r) {
    const float *cr = cp + r * head_dim, *sr = sp + r * head_dim;
    for (int64_t h = 0; h < turned; ++h) {
      const float* x = xp + r * rows.size(-1) + h * head_dim;
      float* o = op + (h * q + r) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        o[i] = x[i] * cr[i] + (-x[i + half]) * sr[i];
        o[i + half] = x[i + half] * cr[i + half] + x[i] * sr[i + half];
      }
    }
  }
  return out;
}
