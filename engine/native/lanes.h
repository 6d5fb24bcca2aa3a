// Helpers shared by coded.cpp and attention.cpp (x86-64 with AVX2 only).
#pragma once

#include <immintrin.h>

// The eight lanes of s added in a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two.
__attribute__((target("avx2,fma"))) inline float lanes_added(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
