/* Vector helpers shared by quant_kernels.c and kquant_kernels.c. */
#ifndef ENGINECORE_QUANT_SIMD_H
#define ENGINECORE_QUANT_SIMD_H

/* How far ahead of the weight bytes being multiplied to prefetch. A decode step streams
 * every weight once, and the hardware prefetcher alone leaves the loop waiting on loads;
 * a few rows of a 2048-wide product ahead keeps enough lines in flight for one core to
 * approach its streaming rate (benchmarks/decode_kernel_rate.py; RESULTS.md has the
 * distances tried). Set at build time to try another. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

#include <stdint.h>

/* The one-row (batch-1 decode) product's N weight rows, ``pass`` rows a pass (each pass
 * interleaves its rows' sums, which are chains of dependent FMAs one row alone would
 * wait on), the threads taking whole passes, the last N % pass rows one at a time:
 * ``fn(args, n0, rows)`` makes outputs n0 .. n0 + rows - 1, ``rows`` the pass's count or
 * 1. Every format's several-rows kernel runs under this one loop. A macro, so that each
 * use is a parallel region of its own, whose call of ``fn`` the compiler inlines: as a
 * function, OpenMP's one outlined region would call every format's pass through a
 * pointer, which ran slower. */
#define ROW_PASSES(N, pass, fn, args)                                                      \
    do {                                                                                   \
        const int64_t rp_rows = (N), rp_pass = (pass);                                     \
        const int64_t rp_tiles = (rp_rows + rp_pass - 1) / rp_pass;                        \
        _Pragma("omp parallel for schedule(static)")                                       \
        for (int64_t rp_t = 0; rp_t < rp_tiles; rp_t++) {                                  \
            const int64_t rp_n0 = rp_t * rp_pass;                                          \
            if (rp_rows - rp_n0 >= rp_pass)                                                \
                fn(args, rp_n0, (int)rp_pass);                                             \
            else                                                                           \
                for (int64_t rp_n = rp_n0; rp_n < rp_rows; rp_n++) fn(args, rp_n, 1);     \
        }                                                                                  \
    } while (0)

#if defined(__AVX2__)
#include <immintrin.h>

/* Per 32-bit lane, the sum of four products of unsigned and signed bytes. */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    /* the same sums: no pair of products here reaches vpmaddubsw's saturation */
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* acc + the sums of four products of unsigned and signed bytes per 32-bit lane, at 512,
 * 256 and 128 bits: VNNI's vpdpbusd, or AVX-512BW's vpmaddubsw + vpmaddwd. */
#if defined(__AVX512VNNI__)
#define DOT512(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define DOT256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#define DOT128(acc, u, s) _mm_dpbusd_epi32(acc, u, s)
#else
#define DOT512(acc, u, s) \
    _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)))
#define DOT256(acc, u, s) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define DOT128(acc, u, s) \
    _mm_add_epi32(acc, _mm_madd_epi16(_mm_maddubs_epi16(u, s), _mm_set1_epi16(1)))
#endif
#endif

/* Q5_K's and Q6_K's high bits in a pair record (kquant_kernels.c): an AVX2 build without
 * AVX-512's byte masks keeps them packed (kquant_blocks.PACKED: Q5_K eight values a byte,
 * Q6_K four), which it unpacks with a shift and an and per 32 values; the bit planes (a
 * word a plane, bit i for value i) would take a shuffle, an and, a compare and an and per
 * plane and block. Every other build reads the planes. */
#if !(defined(__AVX512BW__) && defined(__AVX512VL__))
#define Q5K_PACKED 1
#define Q6K_PACKED 1

/* The two blocks of Q5_K pair record ``pair`` (values 0-31): byte b of its last 8 holds
 * the 5th bits of the first block's values b, 8 + b, 16 + b, 24 + b in bits 4-7 and of
 * the second block's in bits 0-3. One 64-bit shift of the 8 bytes broadcast, by q for
 * values 8q.., puts each value's bit of the first block in bit 4 of its byte and of the
 * second in bit 0. */
static inline __attribute__((always_inline)) void q5_pair_values(const uint8_t *pair,
                                                                  __m256i *first,
                                                                  __m256i *second) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    const __m256i v = _mm256_loadu_si256((const __m256i *)pair);
    const __m256i high =
        _mm256_srlv_epi64(_mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(pair + 32))),
                          _mm256_setr_epi64x(0, 1, 2, 3));
    *first = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(high, fifth));
    *second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                              _mm256_and_si256(_mm256_slli_epi16(high, 4), fifth));
}

/* The two blocks of Q6_K pair record ``pair`` (unsigned values 0-63, not centred): byte
 * t of its last 16 holds the high bits of the second block's values t (bits 0-1) and
 * t + 16 (bits 2-3), of the first block's values t (bits 4-5) and t + 16 (bits 6-7). */
static inline __attribute__((always_inline)) void q6_pair_values(const uint8_t *pair,
                                                                  __m256i *first,
                                                                  __m256i *second) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i v = _mm256_loadu_si256((const __m256i *)pair);
    /* values 0-15 take the bytes as they are, 16-31 shifted by 2: the first block's bits
     * then lie in bits 4-5, the second's in bits 0-1 */
    const __m256i high = _mm256_srlv_epi32(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(pair + 32))),
        _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
    *first = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(high, top2));
    *second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                              _mm256_and_si256(_mm256_slli_epi16(high, 4), top2));
}
#endif

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

/* The eight 6-bit scales of the twelve packed bytes ``q``, scale j in byte j (ggml's
 * get_scale_min_k4, four sub-blocks a word): bytes 0-3 hold sub-blocks 0-3's scales in
 * their low 6 bits and the top 2 bits of sub-blocks 4-7's, whose low 4 bits are the low
 * nibbles of bytes 8-11. */
static inline uint64_t k4_scales8(const uint8_t *q) {
    uint32_t w0, w2;
    memcpy(&w0, q, 4);
    memcpy(&w2, q + 8, 4);
    const uint32_t high = (w2 & 0x0F0F0F0Fu) | (((w0 >> 6) & 0x03030303u) << 4);
    return (uint64_t)high << 32 | (w0 & 0x3F3F3F3Fu);
}

/* The eight 6-bit mins, the same way: bytes 4-7 and the high nibbles of bytes 8-11. */
static inline uint64_t k4_mins8(const uint8_t *q) {
    uint32_t w1, w2;
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    const uint32_t high = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4);
    return (uint64_t)high << 32 | (w1 & 0x3F3F3F3Fu);
}

#if defined(__AVX2__)
/* The float32 scales d sc and offsets -(dmin mn) of the eight sub-blocks of super-block
 * ``h`` (its sixteen scale bytes), in registers. */
static inline __attribute__((always_inline)) void k4_scales_offsets(const uint8_t *h, __m256 *d,
                                                                    __m256 *m) {
    /* k4_scales8 and k4_mins8 on the words (d dmin, w0, w1, w2) in four lanes at once */
    const __m128i v = _mm_loadu_si128((const __m128i *)h);
    const __m128i t = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 1, 1)); /* w0 w0 w1 w1 */
    const __m128i w2 = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(3, 3, 3, 3)),
                                      _mm_setr_epi32(0, 0, 0, 4));
    const __m128i low = _mm_and_si128(t, _mm_set1_epi32(0x3F3F3F3F));
    const __m128i top =
        _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(t, 6), _mm_set1_epi32(0x03030303)), 4);
    const __m128i high = _mm_or_si128(_mm_and_si128(w2, _mm_set1_epi32(0x0F0F0F0F)), top);
    const __m128i sm = _mm_blend_epi32(low, high, 0xA); /* 8 scales, then 8 mins */
    const __m128 dd = _mm_cvtph_ps(v);                   /* d, dmin */
    const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm)));
    const __m256 dmin = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_set1_epi32(1));
    const __m256 products = _mm256_mul_ps(dmin, mins);
    *d = _mm256_mul_ps(_mm256_broadcastss_ps(dd), scales);
    *m = _mm256_castsi256_ps(
        _mm256_xor_si256(_mm256_castps_si256(products), _mm256_set1_epi32((int)0x80000000u)));
}
#endif

/* The float32 scales d sc and offsets -(dmin mn) of the eight sub-blocks of super-block
 * ``h`` (its sixteen scale bytes) into ``d`` and ``m``. */
static inline void k4_expand(const uint8_t *h, float *d, float *m) {
#if defined(__AVX2__)
    __m256 dv, mv;
    k4_scales_offsets(h, &dv, &mv);
    _mm256_storeu_ps(d, dv);
    _mm256_storeu_ps(m, mv);
#else
    const uint64_t sc = k4_scales8(h + 4), mn = k4_mins8(h + 4);
    const float dd = k4_half(h), dmin = k4_half(h + 2);
    for (int j = 0; j < 8; j++) {
        d[j] = dd * (float)((sc >> (8 * j)) & 0xFF);
        m[j] = -(dmin * (float)((mn >> (8 * j)) & 0xFF));
    }
#endif
}

#endif
