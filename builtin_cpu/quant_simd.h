/* Vector helpers shared by quant_kernels.c and kquant_kernels.c. */
#ifndef ENGINECORE_QUANT_SIMD_H
#define ENGINECORE_QUANT_SIMD_H

/* How far ahead of the weight bytes being multiplied to prefetch. A decode step streams
 * every weight once, and the hardware prefetcher alone leaves the loop waiting on loads:
 * measured on the demo model's 120 Q4_1 projections (AVX-512, 2 cores), 7.5 -> 3.8 ms on
 * one thread and 2.9 -> 2.1 ms on two (1,536 bytes: 4.2 ms, 3,072: 3.8 ms on one). */
#define PREFETCH_BYTES 2048

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

/* Block scales and offsets are float32, or float16 where the file's values are exact in
 * it (Q4_0, Q4_1): ``half`` says which, a constant in each inlined copy of a kernel. */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline __attribute__((always_inline)) float scale_at(const void *p, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#endif
