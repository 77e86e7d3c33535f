/* Vector helpers shared by quant_kernels.c and kquant_kernels.c. */
#ifndef ENGINECORE_QUANT_SIMD_H
#define ENGINECORE_QUANT_SIMD_H

#if defined(__AVX2__)
#include <immintrin.h>

/* Per 32-bit lane, the sum of four products of unsigned and signed bytes. */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
