/* Many-row products over block-quantized weights (prefill), for enginecore's ``gguf``
 * linear method: GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K as quant_kernels.c and
 * kquant_kernels.c keep them, against activations quantized once a call by
 * ``ecq_quantize_rows`` (signed bytes per block of 32, a scale xd and xs = xd * sum).
 *
 * Every weight value is v = d u + m with u an unsigned byte: the 4-bit formats' nibble
 * (Q4_0: m = -8 d), Q5_K's 5 bits, Q6_K's 6 bits (m = -32 d, a scale per 16 values), Q8_0's
 * signed byte plus 128 (m = -128 d). A thread takes a panel of 16 output columns, decodes
 * its blocks once into u as VNNI wants them (for each 4 inputs, the 16 columns' 4 bytes:
 * one register per 4 inputs) and its scales into float32 per run (32 inputs; Q6_K 16),
 * then multiplies every activation row by it: per run, each row's 4 bytes broadcast into
 * the integer dot-product instruction (VNNI's vpdpbusd on AVX-512 or AVX-VNNI; AVX2's
 * vpmaddubsw + vpmaddwd; a plain loop off x86) sum 16 columns at once; where m is -B d
 * (Q4_0, Q6_K, Q8_0) B times the run's sum of activation bytes is taken off the integer
 * sum (exact), then one multiply-add by d_w d_x per run, and for Q4_1, Q4_K, Q5_K one by
 * m_w xs. The integer sums are those of the one-row kernels; the float sums run in
 * another order (docs/quantization.md states the tolerance, tests check it).
 *
 * Without VNNI, Q8_0's signed bytes are multiplied as quant_kernels.c does (|w| times x
 * with w's sign: vpmaddubsw's pairs of u * x would overflow 16 bits at u = 255).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "quant_simd.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define QK 32
#define PW 16 /* output columns a panel */

/* What ``ecg_gemm`` is told (the kinds of quant_kernels.c and kquant_kernels.c) */
#define KIND_Q8 8        /* Q8_0, float32 d */
#define KIND_Q8_HALF 22  /* Q8_0, float16 d (the file's) */
#define KIND_Q4 4        /* 4-bit blocks, float32 d and m */
#define KIND_Q4_HALF 20  /* ... float16 d and m (Q4_1) */
#define KIND_Q4_0_HALF 21 /* ... float16 d, m = -8 d (Q4_0) */
#define KIND_Q4_K 24
#define KIND_Q5_K 5
#define KIND_Q6_K 6

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ECG_ZMM 1
#elif defined(__AVX2__)
#define ECG_YMM 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define ECG_YMM_VNNI 1
#endif
#endif

/* Q8_0's bytes go into the panel as u = q + 128, except without VNNI, which multiplies
 * them signed (the 16-bit pairs of vpmaddubsw would overflow at u = 255). */
#if (defined(ECG_ZMM) && defined(__AVX512VNNI__)) || defined(ECG_YMM_VNNI) || \
    !(defined(ECG_ZMM) || defined(ECG_YMM))
#define Q8_SIGNED 0
#else
#define Q8_SIGNED 1
#endif

static inline int64_t run_length(int kind) { return kind == KIND_Q6_K ? 16 : 32; }

/* B where m = -B d (taken off the integer sums), else 0 (m read as floats). */
static inline int bias_of(int kind) {
    switch (kind) {
    case KIND_Q8:
    case KIND_Q8_HALF: return Q8_SIGNED ? 0 : 128;
    case KIND_Q4_0_HALF: return 8;
    case KIND_Q6_K: return 32;
    default: return 0;
    }
}

static inline int has_offsets(int kind) {
    return kind == KIND_Q4 || kind == KIND_Q4_HALF || kind == KIND_Q4_K || kind == KIND_Q5_K;
}

/* Block b of the panel's 16 columns: ``vals`` [2][16 columns][16 bytes] (each column's
 * 32 values, values 0-15 then 16-31) into ``pu`` [K/4][16][4], four columns at a time by
 * 4 x 4 transposes of 32-bit words. */
static inline void put_blocks(uint8_t *pu, int64_t b, const uint8_t *vals) {
    uint8_t *dst = pu + b * 8 * 4 * PW;
#if defined(ECG_ZMM)
    /* Per half h: four loads of four columns' words (column-major), two word permutes
     * that pair columns 0-7 and 8-15 by word, then 128-bit lane shuffles that give each
     * group of 4 inputs its 16 columns. */
    const __m512i even = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(2));
    for (int h = 0; h < 2; h++) {
        const uint8_t *src = vals + h * PW * 16;
        const __m512i c0 = _mm512_load_si512((const void *)src);
        const __m512i c1 = _mm512_load_si512((const void *)(src + 64));
        const __m512i c2 = _mm512_load_si512((const void *)(src + 128));
        const __m512i c3 = _mm512_load_si512((const void *)(src + 192));
        const __m512i a01 = _mm512_permutex2var_epi32(c0, even, c1); /* words 0, 1: cols 0-7 */
        const __m512i a23 = _mm512_permutex2var_epi32(c0, odd, c1);
        const __m512i b01 = _mm512_permutex2var_epi32(c2, even, c3); /* cols 8-15 */
        const __m512i b23 = _mm512_permutex2var_epi32(c2, odd, c3);
        uint8_t *o = dst + 4 * h * 4 * PW;
        _mm512_store_si512((void *)o, _mm512_shuffle_i64x2(a01, b01, 0x44));
        _mm512_store_si512((void *)(o + 64), _mm512_shuffle_i64x2(a01, b01, 0xEE));
        _mm512_store_si512((void *)(o + 128), _mm512_shuffle_i64x2(a23, b23, 0x44));
        _mm512_store_si512((void *)(o + 192), _mm512_shuffle_i64x2(a23, b23, 0xEE));
    }
#elif defined(__SSE2__)
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 4; q++) {
            const uint8_t *src = vals + (h * PW + 4 * q) * 16;
            const __m128i r0 = _mm_loadu_si128((const __m128i *)src);
            const __m128i r1 = _mm_loadu_si128((const __m128i *)(src + 16));
            const __m128i r2 = _mm_loadu_si128((const __m128i *)(src + 32));
            const __m128i r3 = _mm_loadu_si128((const __m128i *)(src + 48));
            const __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpacklo_epi32(r2, r3);
            const __m128i t2 = _mm_unpackhi_epi32(r0, r1), t3 = _mm_unpackhi_epi32(r2, r3);
            uint8_t *o = dst + (4 * h * PW + 4 * q) * 4;
            _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(o + 4 * PW), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(o + 8 * PW), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128((__m128i *)(o + 12 * PW), _mm_unpackhi_epi64(t2, t3));
        }
#else
    for (int c = 0; c < PW; c++)
        for (int g = 0; g < 8; g++)
            memcpy(dst + (g * PW + c) * 4, vals + ((g / 4) * PW + c) * 16 + (g % 4) * 4, 4);
#endif
}

/* Column c's 32 values of a 4-bit block (byte i: value i low, value i + 16 high). */
static inline void nibbles(const uint8_t *q, uint8_t *vals, int64_t c) {
#if defined(__SSE2__)
    const __m128i v = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(0x0F);
    _mm_storeu_si128((__m128i *)(vals + c * 16), _mm_and_si128(v, low4));
    _mm_storeu_si128((__m128i *)(vals + (PW + c) * 16), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
#else
    for (int i = 0; i < 16; i++) vals[c * 16 + i] = q[i] & 15, vals[(PW + c) * 16 + i] = q[i] >> 4;
#endif
}

/* Column c's 32 values of a Q8_0 block, as u = q + 128 or signed (Q8_SIGNED). */
static inline void bytes32(const uint8_t *q, uint8_t *vals, int64_t c) {
    const uint8_t flip = Q8_SIGNED ? 0 : 0x80;
#if defined(__SSE2__)
    const __m128i f = _mm_set1_epi8((char)flip);
    _mm_storeu_si128((__m128i *)(vals + c * 16), _mm_xor_si128(_mm_loadu_si128((const __m128i *)q), f));
    _mm_storeu_si128((__m128i *)(vals + (PW + c) * 16),
                     _mm_xor_si128(_mm_loadu_si128((const __m128i *)(q + 16)), f));
#else
    for (int i = 0; i < QK; i++) vals[((i / 16) * PW + c) * 16 + i % 16] = q[i] ^ flip;
#endif
}

/* Column c's 32 values of block j (0, 1) of a Q5_K / Q6_K pair record (kquant_kernels.c). */
static inline void kquant_values(const uint8_t *pair, int j, int planes, uint8_t *vals, int64_t c) {
#if defined(Q6K_PACKED) && defined(Q5K_PACKED)
    { /* the high bits packed (quant_simd.h) */
        __m256i first, second;
        if (planes == 2)
            q6_pair_values(pair, &first, &second);
        else
            q5_pair_values(pair, &first, &second);
        const __m256i w = j ? second : first;
        _mm_storeu_si128((__m128i *)(vals + c * 16), _mm256_castsi256_si128(w));
        _mm_storeu_si128((__m128i *)(vals + (PW + c) * 16), _mm256_extracti128_si256(w, 1));
        return;
    }
#endif
    uint32_t h4, h5 = 0;
    memcpy(&h4, pair + 32 + j * 4 * planes, 4);
    if (planes == 2) memcpy(&h5, pair + 32 + j * 4 * planes + 4, 4);
#if defined(__AVX2__)
    const __m256i v = _mm256_loadu_si256((const __m256i *)pair), low4 = _mm256_set1_epi8(0x0F);
    const __m256i low = j ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low4) : _mm256_and_si256(v, low4);
    /* byte i takes byte i / 8 of a word, then tests its bit i % 8 */
    const __m256i pick = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b4 = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h4), pick);
    __m256i w = _mm256_or_si256(low, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b4, select), select),
                                                      _mm256_set1_epi8(16)));
    if (planes == 2) {
        const __m256i b5 = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h5), pick);
        w = _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b5, select), select),
                                                _mm256_set1_epi8(32)));
    }
    _mm_storeu_si128((__m128i *)(vals + c * 16), _mm256_castsi256_si128(w));
    _mm_storeu_si128((__m128i *)(vals + (PW + c) * 16), _mm256_extracti128_si256(w, 1));
#else
    for (int i = 0; i < QK; i++)
        vals[((i / 16) * PW + c) * 16 + i % 16] =
            (uint8_t)((j ? pair[i] >> 4 : pair[i] & 15) | ((h4 >> i) & 1) << 4 | ((h5 >> i) & 1) << 5);
#endif
}

/* The scales of column c (weight row ``n``): per run, into ``pd`` and ``pm`` ([runs][PW]).
 * Layouts: quant_kernels.c (Q8_0, Q4_*), kquant_kernels.c (Q5_K, Q6_K), quant_simd.h (the
 * K-quants' scale bytes). */
static void column_scales(int kind, int64_t n, int64_t K, const void *wd, const void *wm,
                          float *pd, float *pm, int64_t c) {
    const int64_t nb = K / QK;
    if (kind == KIND_Q8 || kind == KIND_Q8_HALF || kind == KIND_Q4 || kind == KIND_Q4_HALF ||
        kind == KIND_Q4_0_HALF) {
        const int half = kind != KIND_Q4 && kind != KIND_Q8;
        const int read_m = kind == KIND_Q4 || kind == KIND_Q4_HALF; /* else the bias, or none */
        for (int64_t b = 0; b < nb; b++) {
            pd[b * PW + c] = scale_at(wd, n * nb + b, half);
            pm[b * PW + c] = read_m ? scale_at(wm, n * nb + b, half) : 0.f;
        }
    } else if (kind == KIND_Q4_K || kind == KIND_Q5_K) {
        const uint8_t *h = (const uint8_t *)wd + n * (nb / 8) * K4_SCALE_BYTES;
        for (int64_t s = 0; s < nb / 8; s++) {
            float d[8], m[8];
            k4_expand(h + s * K4_SCALE_BYTES, d, m);
            for (int j = 0; j < 8; j++) pd[(8 * s + j) * PW + c] = d[j], pm[(8 * s + j) * PW + c] = m[j];
        }
    } else { /* Q6_K: d sc per 16 values, the offsets -32 d sc taken as a bias */
        const uint8_t *h = (const uint8_t *)wd + n * (nb / 8) * 18;
        for (int64_t s = 0; s < nb / 8; s++) {
            const float dd = k4_half(h + s * 18 + 16);
            for (int j = 0; j < 16; j++) {
                pd[(16 * s + j) * PW + c] = dd * (float)(int8_t)h[s * 18 + j];
                pm[(16 * s + j) * PW + c] = 0.f;
            }
        }
    }
}

/* The panel of ``cols`` weight rows from n0 (the rest of the 16 zero): values into ``pu``
 * [K/4][PW][4], scales and offsets into ``pd``, ``pm`` [runs][PW]. */
static void decode_panel(int kind, int64_t n0, int64_t cols, int64_t K, const uint8_t *wq,
                         const void *wd, const void *wm, uint8_t *pu, float *pd, float *pm) {
    const int64_t runs = K / run_length(kind), nb = K / QK;
    if (cols < PW) {
        memset(pd, 0, (size_t)runs * PW * sizeof(float));
        memset(pm, 0, (size_t)runs * PW * sizeof(float));
    }
    uint8_t vals[2 * PW * 16] __attribute__((aligned(64)));
    memset(vals, 0, sizeof vals);
    const int planes = kind == KIND_Q6_K ? 2 : 1;
    const int64_t rec = 32 + 8 * planes; /* Q5_K / Q6_K pair record */
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t c = 0; c < cols; c++) {
            const int64_t n = n0 + c;
            if (kind == KIND_Q8 || kind == KIND_Q8_HALF)
                bytes32(wq + n * K + b * QK, vals, c);
            else if (kind == KIND_Q5_K || kind == KIND_Q6_K)
                kquant_values(wq + (n * (nb / 2) + b / 2) * rec, (int)(b & 1), planes, vals, c);
            else
                nibbles(wq + (n * nb + b) * 16, vals, c);
        }
        put_blocks(pu, b, vals);
    }
    for (int64_t c = 0; c < cols; c++) column_scales(kind, n0 + c, K, wd, wm, pd, pm, c);
}

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(ECG_ZMM)
#define TILE_ROWS 8
/* Rows r0 .. r0 + R of the output against the panel: R a constant in each inlined copy. */
static inline __attribute__((always_inline)) void tile_rows(
    int R, int64_t run, int offsets, int64_t K, int64_t runs, const uint8_t *pu,
    const float *pd, const float *pm, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *bx, int64_t r0, int64_t n0, int64_t cols, float *out, int64_t ldo,
    int sign) {
    const int64_t nb = K / QK, per_block = QK / run;
    __m512 acc[TILE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < runs; u++) {
        __m512i dot[TILE_ROWS];
        for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        const uint8_t *p = pu + u * run * PW;
        const int8_t *x = xq + r0 * K + u * run;
        for (int g = 0; g < run / 4; g++) {
            const __m512i w = _mm512_load_si512((const void *)(p + g * 4 * PW));
            if (sign) { /* Q8_0 without VNNI: |w| times x with w's sign */
                const __mmask64 negative = _mm512_movepi8_mask(w);
                const __m512i wabs = _mm512_abs_epi8(w);
                for (int r = 0; r < R; r++) {
                    const __m512i x4 = _mm512_set1_epi32(load_i32(x + r * K + 4 * g));
                    dot[r] = DOT512(dot[r], wabs,
                                    _mm512_mask_sub_epi8(x4, negative, _mm512_setzero_si512(), x4));
                }
                continue;
            }
            for (int r = 0; r < R; r++)
                dot[r] = DOT512(dot[r], w, _mm512_set1_epi32(load_i32(x + r * K + 4 * g)));
        }
        const __m512 dw = _mm512_load_ps(pd + u * PW);
        const int64_t b = u / per_block;
        for (int r = 0; r < R; r++) {
            if (bx != NULL)
                dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(bx[(r0 + r) * runs + u]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                     _mm512_mul_ps(dw, _mm512_set1_ps(xd[(r0 + r) * nb + b])), acc[r]);
        }
        if (offsets) {
            const __m512 mw = _mm512_load_ps(pm + u * PW);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[(r0 + r) * nb + b]), acc[r]);
        }
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(out + (r0 + r) * ldo + n0, keep, acc[r]);
}
#elif defined(ECG_YMM)
#define TILE_ROWS 4
/* Per 4 inputs, ``w`` (8 columns' 4 bytes) times row bytes ``x4`` added to ``acc``. */
static inline __attribute__((always_inline)) __m256i dot8(__m256i acc, __m256i w, __m256i wabs,
                                                          int32_t x4, int sign) {
    const __m256i x = _mm256_set1_epi32(x4);
#if defined(ECG_YMM_VNNI)
    (void)wabs, (void)sign;
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    return _mm256_dpbusd_epi32(acc, w, x);
#endif
#else
    const __m256i prod = sign ? _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w))
                              : _mm256_maddubs_epi16(w, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
#endif
}

/* Rows r0 .. r0 + R, columns h * 8 .. h * 8 + 8 of the panel. */
static inline __attribute__((always_inline)) void tile_rows_half(
    int R, int h, int64_t run, int offsets, int sign, int64_t K, int64_t runs,
    const uint8_t *pu, const float *pd, const float *pm, const int8_t *xq, const float *xd,
    const float *xs, const int32_t *bx, int64_t r0, int64_t n0, int64_t cols, float *out,
    int64_t ldo) {
    const int64_t nb = K / QK, per_block = QK / run;
    __m256 acc[TILE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < runs; u++) {
        __m256i dot[TILE_ROWS];
        for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
        const uint8_t *p = pu + u * run * PW + h * 32;
        const int8_t *x = xq + r0 * K + u * run;
        for (int g = 0; g < run / 4; g++) {
            const __m256i w = _mm256_load_si256((const __m256i *)(p + g * 4 * PW));
            const __m256i wabs = sign ? _mm256_sign_epi8(w, w) : w;
            for (int r = 0; r < R; r++) dot[r] = dot8(dot[r], w, wabs, load_i32(x + r * K + 4 * g), sign);
        }
        const __m256 dw = _mm256_load_ps(pd + u * PW + h * 8);
        const int64_t b = u / per_block;
        for (int r = 0; r < R; r++) {
            if (bx != NULL)
                dot[r] = _mm256_sub_epi32(dot[r], _mm256_set1_epi32(bx[(r0 + r) * runs + u]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(xd[(r0 + r) * nb + b])), acc[r]);
        }
        if (offsets) {
            const __m256 mw = _mm256_load_ps(pm + u * PW + h * 8);
            for (int r = 0; r < R; r++)
                acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[(r0 + r) * nb + b]), acc[r]);
        }
    }
    const int64_t left = cols - h * 8;
    for (int r = 0; r < R; r++) {
        float *o = out + (r0 + r) * ldo + n0 + h * 8;
        if (left >= 8) {
            _mm256_storeu_ps(o, acc[r]);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, acc[r]);
            for (int64_t i = 0; i < left; i++) o[i] = tmp[i];
        }
    }
}

static inline __attribute__((always_inline)) void tile_rows(
    int R, int64_t run, int offsets, int64_t K, int64_t runs, const uint8_t *pu,
    const float *pd, const float *pm, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *bx, int64_t r0, int64_t n0, int64_t cols, float *out, int64_t ldo,
    int sign) {
    tile_rows_half(R, 0, run, offsets, sign, K, runs, pu, pd, pm, xq, xd, xs, bx, r0, n0, cols, out, ldo);
    if (cols > 8)
        tile_rows_half(R, 1, run, offsets, sign, K, runs, pu, pd, pm, xq, xd, xs, bx, r0, n0, cols, out, ldo);
}
#endif

#if defined(ECG_ZMM) || defined(ECG_YMM)
#define TILE(R) tile_rows(R, run, offsets, K, runs, pu, pd, pm, xq, xd, xs, bx, r0, n0, cols, out, ldo, sign)
/* All rows against one decoded panel; ``run``, ``offsets`` (and ``sign``) constants in
 * each inlined copy. */
static inline __attribute__((always_inline)) void panel_rows(
    int64_t run, int offsets, int sign, int64_t M, int64_t K, const uint8_t *pu,
    const float *pd, const float *pm, const int8_t *xq, const float *xd, const float *xs,
    const int32_t *bx, int64_t n0, int64_t cols, float *out, int64_t ldo) {
    const int64_t runs = K / run;
    int64_t r0 = 0;
    for (; r0 + TILE_ROWS <= M; r0 += TILE_ROWS) TILE(TILE_ROWS);
    switch (M - r0) {
    case 1: TILE(1); break;
    case 2: TILE(2); break;
    case 3: TILE(3); break;
#if TILE_ROWS > 4
    case 4: TILE(4); break;
    case 5: TILE(5); break;
    case 6: TILE(6); break;
    case 7: TILE(7); break;
#endif
    default: break;
    }
}
#undef TILE
#else
/* Plain C: the same sums, one output at a time. */
static void panel_rows_plain(int64_t run, int offsets, int64_t M, int64_t K, const uint8_t *pu,
                             const float *pd, const float *pm, const int8_t *xq, const float *xd,
                             const float *xs, const int32_t *bx, int64_t n0, int64_t cols,
                             float *out, int64_t ldo) {
    const int64_t nb = K / QK, runs = K / run, per_block = QK / run;
    for (int64_t r = 0; r < M; r++)
        for (int64_t c = 0; c < cols; c++) {
            float acc = 0.f;
            for (int64_t u = 0; u < runs; u++) {
                int32_t dot = 0;
                for (int64_t i = 0; i < run; i++) {
                    const int64_t k = u * run + i;
                    dot += (int32_t)pu[((k / 4) * PW + c) * 4 + k % 4] * xq[r * K + k];
                }
                if (bx != NULL) dot -= bx[r * runs + u];
                const int64_t b = u / per_block;
                acc += (float)dot * (pd[u * PW + c] * xd[r * nb + b]);
                if (offsets) acc += pm[u * PW + c] * xs[r * nb + b];
            }
            out[r * ldo + n0 + c] = acc;
        }
}
#endif

/* out[r, n] (row stride ldo) = sum_k x[r, k] w[n, k], the activations quantized by
 * ``ecq_quantize_rows`` (xq [M, K], xd, xs [M, K/32]); the weight (kind as above): wq,
 * wd, wm as quant_kernels.c's ``ecq_linear`` or kquant_kernels.c's ``eck_gemm_k`` take
 * them (K-quants: wd the scale bytes, wm unused). K is a multiple of 32 (256 for the
 * K-quants). Returns 0, or -1 when the scratch memory cannot be had. */
int ecg_gemm(int kind, int64_t M, int64_t N, int64_t K, const void *wq, const void *wd,
             const void *wm, const int8_t *xq, const float *xd, const float *xs, float *out,
             int64_t ldo) {
    const int64_t run = run_length(kind), runs = K / run;
    const int bias = bias_of(kind), offsets = has_offsets(kind);
    int32_t *bx = NULL;
    if (bias) { /* B times each run's sum of activation bytes */
        bx = (int32_t *)malloc((size_t)(M * runs) * sizeof(int32_t));
        if (bx == NULL) return -1;
        for (int64_t r = 0; r < M; r++)
            for (int64_t u = 0; u < runs; u++) {
                int32_t sum = 0;
                for (int64_t i = 0; i < run; i++) sum += xq[r * K + u * run + i];
                bx[r * runs + u] = bias * sum;
            }
    }
    const int64_t panels = (N + PW - 1) / PW;
    int failed = 0;
#pragma omp parallel
    {
        uint8_t *pu = (uint8_t *)aligned_alloc(64, (size_t)K * PW);
        float *pd = (float *)aligned_alloc(64, (size_t)runs * PW * sizeof(float));
        float *pm = (float *)aligned_alloc(64, (size_t)runs * PW * sizeof(float));
        if (pu == NULL || pd == NULL || pm == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* Panels handed out one at a time: a thread the OS takes away for a while (a
         * shared machine) leaves its panels to the others instead of holding the call. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < panels; p++) {
            if (pu == NULL || pd == NULL || pm == NULL) continue;
            const int64_t n0 = p * PW, cols = N - n0 < PW ? N - n0 : PW;
            decode_panel(kind, n0, cols, K, (const uint8_t *)wq, wd, wm, pu, pd, pm);
#if defined(ECG_ZMM) || defined(ECG_YMM)
            const int sign = Q8_SIGNED && (kind == KIND_Q8 || kind == KIND_Q8_HALF);
            if (run == 16)
                panel_rows(16, 0, 0, M, K, pu, pd, pm, xq, xd, xs, bx, n0, cols, out, ldo);
            else if (offsets)
                panel_rows(32, 1, 0, M, K, pu, pd, pm, xq, xd, xs, bx, n0, cols, out, ldo);
            else if (sign)
                panel_rows(32, 0, 1, M, K, pu, pd, pm, xq, xd, xs, bx, n0, cols, out, ldo);
            else
                panel_rows(32, 0, 0, M, K, pu, pd, pm, xq, xd, xs, bx, n0, cols, out, ldo);
#else
            panel_rows_plain(run, offsets, M, K, pu, pd, pm, xq, xd, xs, bx, n0, cols, out, ldo);
#endif
        }
        free(pu), free(pd), free(pm);
    }
    free(bx);
    return failed ? -1 : 0;
}
