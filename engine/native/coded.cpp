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
//
// The int4 target's products (engine.fused_llama.Int4Weights) are integer ones, as llama.cpp computes a Q4_1
// matrix: each input row is rounded to 8-bit codes in blocks of 32 (a step of the block's largest |value| / 127,
// and the step times the codes' sum, both rounded to float16 as a Q8_1 block keeps them), each block's 32 products
// of 4-bit and 8-bit codes are summed as integers, scaled by the two steps, and the weights' minimums are added
// times the input block's sum. The weights are repacked once, four output rows together (`q4_packed`), so that
// one pass over memory reads them in order and each group of four is multiplied with all input rows at once.
// Its LM head, a Q8_0 matrix, multiplies likewise as llama.cpp computes one (`q8_packed`, `integer_tile_q8`): the
// input rounded as a Q8_0 block (the same codes and step, no sum), signed codes times signed codes.
#include <ATen/ATen.h>   // not torch/extension.h: a third of the compile time

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "lanes.h"
#define SPECPLAY_CODED 1
#endif

namespace {

constexpr int64_t GROUP = 32;      // columns a block covers
constexpr int64_t Q4_BLOCK = 24;   // 16 bytes of codes (byte i: column i low nibble, i + 16 high), step, minimum
constexpr int64_t Q8_BLOCK = 36;   // step, then 32 signed codes
constexpr int TILE = 4;            // output rows rebuilt together, then multiplied with every input row

#ifdef SPECPLAY_CODED
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_F16C __attribute__((target("avx2,fma,f16c")))

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
// -- integer products from Q4_1 codes ---------------------------------------------------------------------------

constexpr int64_t PACKED = 96;     // four output rows' block: 4 x 16 bytes of codes, 4 steps, 4 minimums
constexpr int64_t PACKED8 = 144;   // four Q8_0 output rows' block: 4 x 32 signed codes (see q8_packed), 4 steps
constexpr int64_t ROW_CODES = 64;  // an input row's block: columns 0..15 twice, then columns 16..31 twice

AVX2_F16C inline float half_rounded(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

// One input row's blocks of 32 as 8-bit codes (laid out as ROW_CODES), each block's step and step times the sum
// of its codes, both rounded to float16.
AVX2_F16C void rounded_row(const float* x, int64_t groups, int8_t* codes, float* steps, float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + g * GROUP + 8 * j);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float largest = _mm_cvtss_f32(h);
    const __m256 scale = _mm256_set1_ps(largest != 0.f ? 127.f / largest : 0.f);
    __m256i c[4];
    for (int j = 0; j < 4; ++j)
      c[j] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[j], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_hadd_epi32(t, t);
    t = _mm_hadd_epi32(t, t);
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));   // columns in order
    int8_t* out = codes + g * ROW_CODES;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(bytes, bytes, 0x00));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute2x128_si256(bytes, bytes, 0x11));
    const float step = largest / 127.f;
    steps[g] = half_rounded(step);
    sums[g] = half_rounded(step * static_cast<float>(_mm_cvtsi128_si32(t)));
  }
}

// An integer tile's sums [o0 o0 o2 o2 | o1 o1 o3 o3] folded into its four outputs y[0..3], each its two lanes added.
AVX2 inline void folded(__m256 acc, float* y) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  y[0] = lanes[0] + lanes[1];
  y[1] = lanes[4] + lanes[5];
  y[2] = lanes[2] + lanes[3];
  y[3] = lanes[6] + lanes[7];
}

// Four output rows (one packed group, `w`) times R rounded input rows. Per block and row: the codes' products
// summed as integers into [o0 o0 o2 o2 | o1 o1 o3 o3], scaled by the weights' and the row's steps, plus the
// minimums times the row's sum (in one lane of each pair); each output is its two lanes added at the end. The
// order of every sum is fixed, whatever R, so a row's outputs are the same alone or among others.
template <int R>
AVX2 void integer_tile(const uint8_t* w, int64_t groups, const int8_t* codes, const float* steps, const float* sums,
                       float* out, int64_t n) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
  const __m256i pairs = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = w + g * PACKED;
    const __m256i c01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    const __m256i c23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32));
    const __m256i low01 = _mm256_and_si256(c01, nibble), high01 = _mm256_and_si256(_mm256_srli_epi16(c01, 4), nibble);
    const __m256i low23 = _mm256_and_si256(c23, nibble), high23 = _mm256_and_si256(_mm256_srli_epi16(c23, 4), nibble);
    const __m256 wsteps = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_loadu_ps(reinterpret_cast<const float*>(block + 64))), pairs);
    const __m256 mins = _mm256_blend_ps(_mm256_setzero_ps(), _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_loadu_ps(reinterpret_cast<const float*>(block + 80))), pairs), 0x55);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = codes + (r * groups + g) * ROW_CODES;
      const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      // 4-bit codes times 8-bit ones, pairs added: at most 2 * 15 * 128 per 16-bit lane, twice: no overflow
      const __m256i s01 = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(low01, first), _mm256_maddubs_epi16(high01, second)), ones);
      const __m256i s23 = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(low23, first), _mm256_maddubs_epi16(high23, second)), ones);
      const __m256 products = _mm256_cvtepi32_ps(_mm256_hadd_epi32(s01, s23));
      acc[r] = _mm256_fmadd_ps(products, _mm256_mul_ps(wsteps, _mm256_set1_ps(steps[r * groups + g])), acc[r]);
      acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(sums[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) folded(acc[r], out + r * n);
}

// Four Q8_0 output rows (one packed group, `w`: rows a, b, c, d as [a 0..15 | b 0..15], [a 16..31 | b 16..31],
// then c and d alike, then the four steps) times R rounded input rows, as llama.cpp multiplies a Q8_0 matrix with
// inputs rounded to Q8_0 blocks: per block and row, the codes' 32 products summed as integers (signed times signed:
// |w| times x with w's sign, at most 2 * 128 * 127 per 16-bit lane), scaled by the two steps. Lanes as in
// integer_tile, so the outputs are folded the same way, in an order that does not depend on R.
template <int R>
AVX2 void integer_tile_q8(const uint8_t* w, int64_t groups, const int8_t* codes, const float* steps, float* out,
                          int64_t n) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pairs = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = w + g * PACKED8;
    __m256i rows[4], size[4];
    for (int j = 0; j < 4; ++j) {
      rows[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j));
      size[j] = _mm256_sign_epi8(rows[j], rows[j]);   // |w| (-128 stays 0x80: 128 read unsigned)
    }
    const __m256 wsteps = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_loadu_ps(reinterpret_cast<const float*>(block + 128))), pairs);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = codes + (r * groups + g) * ROW_CODES;
      const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      const __m256i sab = _mm256_add_epi32(
          _mm256_madd_epi16(_mm256_maddubs_epi16(size[0], _mm256_sign_epi8(first, rows[0])), ones),
          _mm256_madd_epi16(_mm256_maddubs_epi16(size[1], _mm256_sign_epi8(second, rows[1])), ones));
      const __m256i scd = _mm256_add_epi32(
          _mm256_madd_epi16(_mm256_maddubs_epi16(size[2], _mm256_sign_epi8(first, rows[2])), ones),
          _mm256_madd_epi16(_mm256_maddubs_epi16(size[3], _mm256_sign_epi8(second, rows[3])), ones));
      const __m256 products = _mm256_cvtepi32_ps(_mm256_hadd_epi32(sab, scd));
      acc[r] = _mm256_fmadd_ps(products, _mm256_mul_ps(wsteps, _mm256_set1_ps(steps[r * groups + g])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) folded(acc[r], out + r * n);
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

// Whether this build and CPU take the integer products (AVX2, FMA and F16C).
bool integer_supported() {
#ifdef SPECPLAY_CODED
  return coded_supported() && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

namespace {

// A matrix's blocks (uint8 [n, k / 32 * block], a row's blocks in a line) regrouped four output rows together:
// [n / 4, k / 32, packed], where place(to, j, from) puts row j's block `from` into its group's block `to`.
template <class Place>
at::Tensor regrouped(const at::Tensor& blocks, int64_t n, int64_t block, int64_t packed, const char* what,
                     Place&& place) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && n > 0 && n % 4 == 0 &&
                  blocks.numel() % (n * block) == 0,
              what, " takes the uint8 blocks of a matrix whose rows are a multiple of 4");
  const int64_t row_bytes = blocks.numel() / n, groups = row_bytes / block;
  auto out = at::empty({n / 4, groups, packed}, blocks.options());
  const uint8_t* from = blocks.data_ptr<uint8_t>();
  uint8_t* to = out.data_ptr<uint8_t>();
  for (int64_t t = 0; t < n / 4; ++t)
    for (int64_t g = 0; g < groups; ++g)
      for (int j = 0; j < 4; ++j)
        place(to + (t * groups + g) * packed, j, from + (4 * t + j) * row_bytes + g * block);
  return out;
}

}  // namespace

// Q4_1 blocks (uint8 [n, k / 32 * 24], as CodedWeights keeps them) repacked for `integer_product`: uint8
// [n / 4, k / 32, 96], each block of four output rows holding their codes, then their steps, then their minimums.
at::Tensor q4_packed(const at::Tensor& blocks, int64_t n) {
  return regrouped(blocks, n, Q4_BLOCK, PACKED, "q4_packed", [](uint8_t* to, int j, const uint8_t* from) {
    std::memcpy(to + 16 * j, from, 16);
    std::memcpy(to + 64 + 4 * j, from + 16, 4);
    std::memcpy(to + 80 + 4 * j, from + 20, 4);
  });
}

// Q8_0 blocks (uint8 [n, k / 32 * 36], as q8_blocks keeps them: a float32 step, then 32 signed codes) repacked for
// `integer_product`: uint8 [n / 4, k / 32, 144], each block of four output rows holding their codes two rows to a
// 32-byte line (columns 0..15 of rows 0 and 1, columns 16..31 of rows 0 and 1, then rows 2 and 3), then their steps.
at::Tensor q8_packed(const at::Tensor& blocks, int64_t n) {
  return regrouped(blocks, n, Q8_BLOCK, PACKED8, "q8_packed", [](uint8_t* to, int j, const uint8_t* from) {
    const int64_t line = 64 * (j / 2) + 16 * (j % 2);   // row j's columns 0..15; 32 bytes on, its 16..31
    std::memcpy(to + line, from + 4, 16);
    std::memcpy(to + line + 32, from + 20, 16);
    std::memcpy(to + 128 + 4 * j, from, 4);
  });
}

// x [..., k] float32 times a packed matrix [n, k], transposed, with 8-bit inputs: [..., n]. The packing says which:
// Q4_1 blocks from q4_packed (the input rounded as a Q8_1 block) or Q8_0 blocks from q8_packed (as a Q8_0 block).
at::Tensor integer_product(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const int64_t k = x.size(-1), groups = k / GROUP;
  TORCH_CHECK(integer_supported(), "integer products need an x86-64 CPU with AVX2, FMA and F16C");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "integer_product takes float32 rows and uint8 packed blocks");
  const bool q8 = packed.dim() == 3 && packed.size(2) == PACKED8;
  TORCH_CHECK(k % GROUP == 0 && n % 4 == 0 && packed.numel() == n / 4 * groups * (q8 ? PACKED8 : PACKED),
              "the packed blocks do not cover an [", n, ", ", k, "] matrix");
  auto rows = x.reshape({-1, k}).contiguous();
  const int64_t m = rows.size(0);
  auto out = at::empty({m, n}, x.options());
#ifdef SPECPLAY_CODED
  std::vector<int8_t> codes(m * groups * ROW_CODES);
  std::vector<float> steps(m * groups), sums(m * groups);
  for (int64_t r = 0; r < m; ++r)
    rounded_row(rows.data_ptr<float>() + r * k, groups, codes.data() + r * groups * ROW_CODES,
                steps.data() + r * groups, sums.data() + r * groups);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* group = w + t * groups * (q8 ? PACKED8 : PACKED);
      for (int64_t r = 0; r < m;) {   // four rows at a time, then three, two or one
        const int64_t step = std::min<int64_t>(4, m - r);
        const int8_t* c = codes.data() + r * groups * ROW_CODES;
        const float *s = steps.data() + r * groups, *u = sums.data() + r * groups;
        float* o = y + r * n + 4 * t;
        if (q8) {
          if (step == 4) integer_tile_q8<4>(group, groups, c, s, o, n);
          else if (step == 3) integer_tile_q8<3>(group, groups, c, s, o, n);
          else if (step == 2) integer_tile_q8<2>(group, groups, c, s, o, n);
          else integer_tile_q8<1>(group, groups, c, s, o, n);
        } else if (step == 4) integer_tile<4>(group, groups, c, s, u, o, n);
        else if (step == 3) integer_tile<3>(group, groups, c, s, u, o, n);
        else if (step == 2) integer_tile<2>(group, groups, c, s, u, o, n);
        else integer_tile<1>(group, groups, c, s, u, o, n);
        r += step;
      }
    }
  });
#endif
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
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
