/* The element types of the KV cache and the decode mirror (cache.kv_cache_dtype): float32,
 * or float16 / bfloat16 rounded to nearest even when written (as torch's .to() rounds) and
 * widened exactly to float32 when read. The kernels take the type as an int (EC_KV_*);
 * the vector loads are specialized per type where a literal type is passed. */
#ifndef EC_KV_TYPES_H
#define EC_KV_TYPES_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#define EC_KV_F32 0
#define EC_KV_F16 1
#define EC_KV_BF16 2

static inline int ec_kv_valid(int t) { return t == EC_KV_F32 || t == EC_KV_F16 || t == EC_KV_BF16; }

/* Bytes per element. */
static inline int64_t ec_kv_size(int t) { return t == EC_KV_F32 ? 4 : 2; }

static inline uint32_t ec_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float ec_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* torch's float -> bfloat16: round to nearest even, NaN to the quiet NaN 0x7fc0. */
static inline uint16_t ec_f32_to_bf16(float f) {
    const uint32_t u = ec_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float ec_bf16_to_f32(uint16_t h) { return ec_bits_f32((uint32_t)h << 16); }

/* float -> IEEE half, round to nearest even, subnormals included (F. Giesen's
 * float_to_half_fast3_rtne, public domain). */
static inline uint16_t ec_f32_to_f16(float f) {
    const uint32_t f32_inf = 255u << 23, f16_max = (127u + 16u) << 23;
    const float denorm_magic = ec_bits_f32(((127u - 15u) + (23u - 10u) + 1u) << 23);
    uint32_t u = ec_f32_bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t o;
    if (u >= f16_max) {
        o = u > f32_inf ? 0x7e00 : 0x7c00; /* NaN stays NaN, the rest overflow to inf */
    } else if (u < (113u << 23)) {        /* a subnormal half (or zero): the FPU rounds */
        o = (uint16_t)(ec_f32_bits(ec_bits_f32(u) + denorm_magic) - ec_f32_bits(denorm_magic));
    } else {
        const uint32_t odd = (u >> 13) & 1u;
        u += (uint32_t)(15 - 127) * (1u << 23) + 0xfffu + odd;
        o = (uint16_t)(u >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

/* IEEE half -> float, exact (F. Giesen's half_to_float, public domain). */
static inline float ec_f16_to_f32(uint16_t h) {
    const float magic = ec_bits_f32(113u << 23);
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = (uint32_t)(h & 0x7fffu) << 13;
    const uint32_t exp = shifted_exp & o;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == shifted_exp) {
        o += (uint32_t)(128 - 16) << 23; /* inf or NaN */
    } else if (exp == 0) {
        o = ec_f32_bits(ec_bits_f32(o + (1u << 23)) - magic); /* a subnormal */
    }
    return ec_bits_f32(o | ((uint32_t)(h & 0x8000u) << 16));
}

/* n floats of src stored as type t at dst. */
static inline void ec_kv_store(void *dst, const float *src, int64_t n, int t) {
    if (t == EC_KV_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
    if (t == EC_KV_F16) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(d + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) d[i] = ec_f32_to_f16(src[i]);
    } else {
        for (; i < n; i++) d[i] = ec_f32_to_bf16(src[i]);
    }
}

/* Elements [at, at + n) of a type-t array as floats: the array itself for float32, else
 * widened into buf. */
static inline const float *ec_kv_row(const void *src, int64_t at, int64_t n, int t, float *buf) {
    if (t == EC_KV_F32) return (const float *)src + at;
    const uint16_t *s = (const uint16_t *)src + at;
    if (t == EC_KV_F16) {
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) buf[i] = ec_f16_to_f32(s[i]);
    } else {
        for (int64_t i = 0; i < n; i++) buf[i] = ec_bf16_to_f32(s[i]);
    }
    return buf;
}

#if defined(__AVX512F__)
/* 16 elements of a type-t array from element i, as floats. */
static inline __attribute__((always_inline)) __m512 ec_kv_load16(const void *p, int64_t i,
                                                                 const int t) {
    if (t == EC_KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    if (t == EC_KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))),
            16));
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* 8 elements of a type-t array from element i, as floats. */
static inline __attribute__((always_inline)) __m256 ec_kv_load8(const void *p, int64_t i,
                                                                const int t) {
    if (t == EC_KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (t == EC_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))),
            16));
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

#endif
