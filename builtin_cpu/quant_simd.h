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

/* Q4_K and Q5_K keep a super-block's scales as the file does (kquant_blocks.py): float16
 * d and dmin, then twelve bytes of 6-bit scales and mins for its eight sub-blocks of 32.
 * A float16 times a 6-bit integer is exact in float32, so d sc and -(dmin mn) formed here
 * are the float32 scales and offsets bit for bit. */
#define K4_SCALE_BYTES 16

static inline float k4_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

/* The eight scales (bytes 0-7 of the result) and eight mins (8-15) of the twelve packed
 * bytes ``q`` (ggml's get_scale_min_k4, four sub-blocks a word): bytes 0-3 and 4-7 hold
 * sub-blocks 0-3's scales and mins in their low 6 bits and the top 2 bits of sub-blocks
 * 4-7's, bytes 8-11 the low 4 bits of those. */
static inline void k4_unpack(const uint8_t *q, uint8_t out[16]) {
    uint32_t w[3], u[4];
    memcpy(w, q, 12);
    u[0] = w[0] & 0x3F3F3F3Fu;
    u[1] = (w[2] & 0x0F0F0F0Fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    u[2] = w[1] & 0x3F3F3F3Fu;
    u[3] = ((w[2] >> 4) & 0x0F0F0F0Fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    memcpy(out, u, 16);
}

/* Sub-block ``j`` (0-7) of the super-block scales ``h``: its scale d sc and its offset
 * -(dmin mn). */
static inline void k4_scale_offset(const uint8_t *h, int j, float *scale, float *offset) {
    uint8_t sm[16];
    k4_unpack(h + 4, sm);
    *scale = k4_half(h) * (float)sm[j];
    *offset = -(k4_half(h + 2) * (float)sm[8 + j]);
}

#endif
