// fp32 matrix products that read each matrix from the codes it was dequantized from (engine.fused_llama's
// CodedWeights): a GGUF file's Q4_1 blocks (w = step * code + minimum, codes 0..15) or Q8_0 blocks (w = step *
// code, codes -128..127), 32 columns a block. SmolLM2's fp32 model is such a file dequantized, so its matrices are
// these values exactly; reading 0.75 or 1.125 bytes a weight instead of 4 is what makes its one-row products
// faster than oneDNN's on the fp32 matrices (a product is bound by the memory it reads).
//
// The weights are rebuilt as the file's reader builds them (the step times the code, rounded to fp32, plus the
// minimum, rounded again: two roundings, so this file is compiled without contracting them into one fused
// multiply-add), then multiplied in fp32. Each output of each row is one fixed sum (see `tile`), so a row's
// outputs are the same alone or among any number of rows, and the same from this loop and from Python.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECPLAY_CODED 1
#endif

namespace {

constexpr int64_t GROUP = 32;      // columns a block covers
constexpr int64_t Q4_BLOCK = 24;   // 16 bytes of codes (byte i: column i low nibble, i + 16 high), step, minimum
constexpr int64_t Q8_BLOCK = 36;   // step, then 32 signed codes
constexpr int TILE = 4;            // output rows rebuilt together, then multiplied with every input row

#ifdef SPECPLAY_CODED
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 inline void rebuild_q4(const uint8_t* block, float* w) {
  float step, low;
  std::memcpy(&step, block + 16, 4);
  std::memcpy(&low, block + 20, 4);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  const __m128i eights[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  const __m256 s = _mm256_set1_ps(step), m = _mm256_set1_ps(low);
  for (int j = 0; j < 4; ++j) {
    const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[j]));
    _mm256_storeu_ps(w + 8 * j, _mm256_add_ps(_mm256_mul_ps(code, s), m));
  }
}

AVX2 inline void rebuild_q8(const uint8_t* block, float* w) {
  float step;
  std::memcpy(&step, block, 4);
  const __m256 s = _mm256_set1_ps(step);
  for (int j = 0; j < 4; ++j) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4 + 8 * j));
    _mm256_storeu_ps(w + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), s));
  }
}

AVX2 inline float lanes_added(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// O output rows (rebuilt in w, k apart) times R input rows (x, k apart) into out (n apart). Every output of every
// row is one sum: eight lanes, acc += w[c:c+8] * x[c:c+8] (a fused multiply-add) for c = 0, 8, ..., k - 8, then the
// lanes added in a fixed tree. O and R only say how many such sums run side by side, never their order.
template <int O, int R>
AVX2 inline void tile(const float* w, int64_t k, const float* x, float* out, int64_t n) {
  __m256 acc[O][R];
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += 8) {
    __m256 xs[R];
    for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(x + r * k + c);
    for (int o = 0; o < O; ++o) {
      const __m256 ws = _mm256_loadu_ps(w + o * k + c);
      for (int r = 0; r < R; ++r) acc[o][r] = _mm256_fmadd_ps(ws, xs[r], acc[o][r]);
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) out[r * n + o] = lanes_added(acc[o][r]);
}

// Output rows [begin, end) of x [m, k] times the coded matrix [n, k].
template <bool Q4>
AVX2 void outputs(const float* x, int64_t m, int64_t k, const uint8_t* blocks, float* out, int64_t n, int64_t begin,
                  int64_t end) {
  std::vector<float> w(TILE * k);
  const int64_t groups = k / GROUP, row_bytes = groups * (Q4 ? Q4_BLOCK : Q8_BLOCK);
  for (int64_t first = begin; first < end; first += TILE) {
    const int64_t t = std::min<int64_t>(TILE, end - first);
    for (int64_t o = 0; o < t; ++o) {
      const uint8_t* row = blocks + (first + o) * row_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        if (Q4) rebuild_q4(row + g * Q4_BLOCK, w.data() + o * k + g * GROUP);
        else rebuild_q8(row + g * Q8_BLOCK, w.data() + o * k + g * GROUP);
      }
    }
    for (int64_t r = 0; r < m;) {
      const float* xr = x + r * k;
      float* yr = out + r * n + first;
      // three rows at a time keep 12 sums in flight (16 registers: 12 sums, 3 rows, 1 weight vector); four
      // rows go as two pairs, since one row alone keeps only 4 sums in flight
      const int64_t left = m - r, step = t < TILE ? 1 : left == 4 ? 2 : std::min<int64_t>(3, left);
      if (step == 3) tile<TILE, 3>(w.data(), k, xr, yr, n);
      else if (step == 2) tile<TILE, 2>(w.data(), k, xr, yr, n);
      else if (t == TILE) tile<TILE, 1>(w.data(), k, xr, yr, n);
      else
        for (int64_t o = 0; o < t; ++o) tile<1, 1>(w.data() + o * k, k, xr, yr + o, n);
      r += step;
    }
  }
}
#endif

}  // namespace

// Whether this build and CPU multiply from codes (x86-64 with AVX2 and FMA).
bool coded_supported() {
#ifdef SPECPLAY_CODED
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// x [..., k] float32 times the coded matrix [n, k] (blocks: uint8 [n, k / 32 * block bytes]; q4: Q4_1 blocks, else
// Q8_0), transposed: [..., n] float32. Output rows are shared out among torch's threads.
at::Tensor coded_product(const at::Tensor& x, const at::Tensor& blocks, int64_t n, bool q4) {
  const int64_t k = x.size(-1);
  TORCH_CHECK(coded_supported(), "coded products need an x86-64 CPU with AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "coded_product takes float32 rows and uint8 blocks");
  TORCH_CHECK(k % GROUP == 0 && blocks.numel() == n * (k / GROUP) * (q4 ? Q4_BLOCK : Q8_BLOCK),
              "the blocks do not cover an [", n, ", ", k, "] matrix");
  auto rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  auto out = at::empty({m, n}, x.options());
#ifdef SPECPLAY_CODED
  const float* xp = rows.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + TILE - 1) / TILE, 16, [&](int64_t b, int64_t e) {
    if (q4) outputs<true>(xp, m, k, bp, op, n, b * TILE, std::min(e * TILE, n));
    else outputs<false>(xp, m, k, bp, op, n, b * TILE, std::min(e * TILE, n));
  });
#endif
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}
