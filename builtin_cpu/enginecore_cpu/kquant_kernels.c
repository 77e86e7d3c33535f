/* Matrix products over GGUF's Q5_K and Q6_K weights at the file's width, for
 * enginecore's ``gguf`` linear method (layout: kquant_blocks.py).
 *
 * A row's values go by pairs of 32-value blocks, one record of bytes each: 32 bytes of
 * low 4 bits (byte j: value j of the first block in its low nibble, of the second in its
 * high one), then each block's high bits as 32-bit words, bit i for value i (Q5_K one
 * word a block, the 5th bit; Q6_K two, the 5th and the 6th; an AVX2 build's instead
 * packed as the file's qh packs them: Q5_K's a bit a value in 8 bytes, Q6_K's two bits a
 * value in 16, quant_simd.h's Q5K_PACKED and Q6K_PACKED). The scales are the file's,
 * per super-block of 256 values: Q5_K float16 d and dmin and twelve bytes of 6-bit
 * scales and mins (quant_simd.h), a scale d sc and an offset -(dmin mn) per 32 values
 * (value = q d sc - dmin mn); Q6_K sixteen signed 8-bit scales and float16 d, a scale
 * d sc per 16 values (value = (q - 32) d sc). Each weight row's scales are expanded to
 * float32 on the stack as the row is reached, once for all activation rows: a float16
 * times a 6- or 8-bit integer is exact, so they are the same floats as scales held in
 * float32, and the product is the one over those bit for bit.
 *
 * The activations are those of quant_kernels.c: signed bytes per block of 32 with a
 * scale xd and xs = xd * (sum of the block's bytes). Each block's values are rebuilt in
 * a register (the high bits by AVX-512 byte masks, or by a shuffle and compare on AVX2),
 * then its two halves get their integer dot products, VNNI's vpdpbusd where the CPU has
 * it, AVX2's vpmaddubsw + vpmaddwd elsewhere, a plain loop off x86. Each output sums
 * xd (d0 <q0, x0> + d1 <q1, x1>) + m xs, with the same integer sums per vector lane and
 * the same float operations in the same order as a product over one byte a value. One
 * activation row (the batch-1 decode step) takes a kernel of its own: a pair of blocks a
 * register on AVX-512 (``gemv512``), a block a register on AVX2 (``gemv256``), both with
 * unsigned values and Q6_K's centring as one offset a row.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include "quant_simd.h"

#define QK 32
#define HALF 16
#define ROWS 4
#define Q6K_SCALE_BYTES 18

/* Bytes of a pair record with ``planes`` high-bit words a block (1: Q5_K, 2: Q6_K). */
static inline int64_t record_bytes(int planes) { return 2 * HALF + 2 * 4 * planes; }

/* Bytes of a super-block's scales. */
static inline int64_t scale_bytes(int planes) {
    return planes == 2 ? Q6K_SCALE_BYTES : K4_SCALE_BYTES;
}

/* The float32 scales of super-block ``h`` (its scale bytes): Q6_K's d sc of its sixteen
 * runs of 16 values into ``d``; Q5_K's d sc and -(dmin mn) of its eight blocks into ``d``
 * and ``m``. */
static inline __attribute__((always_inline)) void super_scales(int planes, const uint8_t *h,
                                                               float *d, float *m) {
    if (planes == 1) {
        k4_expand(h, d, m);
        return;
    }
#if defined(__AVX2__)
    const __m256 dd = _mm256_set1_ps(k4_half(h + 16));
    for (int half = 0; half < 2; half++) {
        const __m128i sc = _mm_loadl_epi64((const __m128i *)(h + 8 * half));
        _mm256_storeu_ps(d + 8 * half,
                         _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    }
#else
    const float dd = k4_half(h + 16);
    for (int i = 0; i < 16; i++) d[i] = dd * (float)(int8_t)h[i];
#endif
}

/* The float32 scales of ``rows`` weight rows from ``wh`` (their scale bytes, ``hstride``
 * apart) with ``nb`` blocks each: d [rows, nb] (Q6_K [rows, 2 nb]), Q5_K's m [rows, nb]. */
static inline __attribute__((always_inline)) void expand_scales(int planes, const uint8_t *wh,
                                                                int64_t hstride, int64_t rows,
                                                                int64_t nb, float *d, float *m) {
    const int64_t per_block = planes == 2 ? 2 : 1;
    /* the next rows' scale bytes, so their expansion does not wait on them */
    for (int64_t at = 0; at < rows * hstride; at += 64)
        __builtin_prefetch(wh + rows * hstride + at);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < nb / 8; s++)
            super_scales(planes, wh + r * hstride + s * scale_bytes(planes),
                         d + (r * nb + 8 * s) * per_block, m + r * nb + 8 * s);
}

static inline uint32_t load_word(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

/* Value i (0-31) of block ``j`` (0, 1) of the pair ``rec``, centred for Q6_K. */
static inline int value_at(const uint8_t *rec, int j, int i, int planes) {
    const uint8_t *high = rec + 2 * HALF + j * 4 * planes;
    int q = (j ? rec[i] >> 4 : rec[i] & 15) | (((high[i >> 3] >> (i & 7)) & 1) << 4);
    if (planes == 2) q = (q | (((high[4 + (i >> 3)] >> (i & 7)) & 1) << 5)) - 32;
    return q;
}

#if defined(__AVX2__)
/* ``w`` with ``value`` added to the bytes whose bit is set in ``bits`` (a bit the bytes
 * do not hold yet, so adding is or-ing). */
static inline __m256i or_where(__m256i w, uint32_t bits, char value) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_mask_add_epi8(w, _cvtu32_mask32(bits), w, _mm256_set1_epi8(value));
#else
    /* byte i takes byte i / 8 of the word, then tests its bit i % 8 */
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(value)));
#endif
}

/* Block ``j`` (0, 1) of the pair ``rec`` as signed bytes (Q6_K centred), its low 4 bits
 * given (``low``). */
static inline __attribute__((always_inline)) __m256i block_values(const uint8_t *rec, int j,
                                                                   int planes, __m256i low) {
    const uint8_t *high = rec + 2 * HALF + j * 4 * planes;
    __m256i w = or_where(low, load_word(high), 16);
    if (planes == 2) w = _mm256_sub_epi8(or_where(w, load_word(high + 4), 32), _mm256_set1_epi8(32));
    return w;
}

/* The scales of a pair's blocks times activation row ``row``'s: lanes 0-1 (Q6_K: each
 * half of block 2p) or lane 0 (Q5_K) for the first block, lanes 2-3 or 1 for the second. */
static inline __attribute__((always_inline)) __m128 pair_scales(int planes, const float *d,
                                                                 int64_t p, const float *xd) {
    const __m128 x = _mm_castpd_ps(_mm_load_sd((const double *)(xd + 2 * p)));
    if (planes == 2) return _mm_mul_ps(_mm_loadu_ps(d + 4 * p), _mm_unpacklo_ps(x, x));
    return _mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double *)(d + 2 * p))), x);
}

/* Block b = 2p + j (values ``w``) against ``rows`` activation rows from ``row0``, with
 * ``scales[r]`` of pair_scales: the byte-a-value kernel's steps, in its order. */
static inline __attribute__((always_inline)) void block_rows(
    int planes, __m256i w, int64_t b, int j, const __m128 *scales, const float *m, int rows,
    int64_t row0, int64_t K, int64_t nb, const int8_t *xq, const float *xs, __m256 *acc,
    float *offset) {
    /* lanes 0-3 of the dot product hold the first half, 4-7 the second */
    const __m256i spread = planes == 2 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)
                                       : _mm256_set1_epi32(0);
    const __m256i pick = _mm256_add_epi32(spread, _mm256_set1_epi32(j * (planes == 2 ? 2 : 1)));
    /* Q6_K: |w| as unsigned bytes times x with w's sign (as quant_kernels' Q8_0); Q5_K's
     * values are unsigned already */
    const __m256i wabs = planes == 2 ? _mm256_sign_epi8(w, w) : w;
#pragma GCC unroll 4
    for (int r = 0; r < rows; r++) {
        const int64_t row = row0 + r;
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + row * K + b * QK));
        const __m256i dot = dot_u8_s8(wabs, planes == 2 ? _mm256_sign_epi8(x, w) : x);
        const __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scales[r]), pick);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
        if (planes == 1) offset[r] += m[b] * xs[row * nb + b];
    }
}
#endif

#if defined(__AVX2__)
/* The activation terms a call shares: per run of 16 values (Q6_K) the block's scale xd
 * (``xd16``) and -32 xd times the run's sum of bytes (``xoff16``). */
static void row_terms(int64_t K, const int8_t *xq, const float *xd, float *xd16,
                      float *xoff16) {
    for (int64_t h = 0; h < K / HALF; h++) {
        int sum = 0;
        for (int i = 0; i < HALF; i++) sum += xq[h * HALF + i];
        xd16[h] = xd[h / 2];
        xoff16[h] = -32.f * xd[h / 2] * (float)sum;
    }
}

#endif

#if defined(__AVX2__) && !(defined(__AVX512BW__) && defined(__AVX512VL__))
#define ECK_GEMV256 1
/* One activation row on AVX2 (the batch-1 decode step): as ``gemv512`` a block a register.
 * The values stay unsigned (Q6_K 0-63, its -32 d sc a value one offset a row from the
 * activations' run sums), so no sign is moved onto the activations; the high bits are
 * unpacked from the record's packed bytes of them (quant_simd.h's Q5K_PACKED and
 * Q6K_PACKED); each run's scale times its activation scale is formed once a weight row,
 * eight at a time. Two accumulators over alternate blocks keep the FMA latency off the
 * loop's path. */

/* Values ``w`` times ``x``, scaled by ``scale`` (a float per lane) into ``acc``. */
static inline __attribute__((always_inline)) __m256 block256(__m256i w, __m256i x, __m256 scale,
                                                             __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(w, x)), scale, acc);
}

/* sum_i a[i] b[i] over ``count`` floats (a multiple of 8). */
static inline float dot_f32_256(const float *a, const float *b, int64_t count) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < count; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum(acc);
}

static inline __attribute__((always_inline)) void gemv256(
    int planes, int64_t N, int64_t K, const uint8_t *wq, const uint8_t *wh, const int8_t *xq,
    const float *xd, const float *xs, float *out) {
    const int64_t nb = K / QK, pairs = nb / 2, rec = record_bytes(planes);
    const int64_t runs = planes == 2 ? 2 * nb : nb; /* scales a row */
    const int64_t hstride = nb / 8 * scale_bytes(planes);
    float xd16[planes == 2 ? 2 * nb : 1], xoff16[planes == 2 ? 2 * nb : 1];
    if (planes == 2) row_terms(K, xq, xd, xd16, xoff16);
    const float *xrun = planes == 2 ? xd16 : xd; /* each run's activation scale */
    /* Q6_K: lanes 0-3 take the block's first run, 4-7 its second */
    const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = wq + n * pairs * rec;
        float d[runs], m[nb], sx[runs];
        expand_scales(planes, wh + n * hstride, hstride, 1, nb, d, m);
        for (int64_t i = 0; i < runs; i += 8)
            _mm256_storeu_ps(sx + i, _mm256_mul_ps(_mm256_loadu_ps(d + i), _mm256_loadu_ps(xrun + i)));
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t *pair = wrow + p * rec;
            _mm_prefetch((const char *)pair + PREFETCH_BYTES, _MM_HINT_T0); /* quant_simd.h */
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 2 * p * QK));
            const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + (2 * p + 1) * QK));
            __m256 s0, s1;
            if (planes == 2) {
                const __m256 four = _mm256_castps128_ps256(_mm_loadu_ps(sx + 4 * p));
                s0 = _mm256_permutevar8x32_ps(four, halves);
                s1 = _mm256_permutevar8x32_ps(four, _mm256_add_epi32(halves, _mm256_set1_epi32(2)));
            } else {
                s0 = _mm256_broadcast_ss(sx + 2 * p);
                s1 = _mm256_broadcast_ss(sx + 2 * p + 1);
            }
            __m256i w0, w1;
            if (planes == 2)
                q6_pair_values(pair, &w0, &w1);
            else
                q5_pair_values(pair, &w0, &w1);
            acc0 = block256(w0, x0, s0, acc0);
            acc1 = block256(w1, x1, s1, acc1);
        }
        const float offset = planes == 2 ? dot_f32_256(d, xoff16, runs) : dot_f32_256(m, xs, nb);
        out[n] = hsum(_mm256_add_ps(acc0, acc1)) + offset;
    }
}
#endif

#if defined(__AVX2__)
/* The outputs of ``nw`` weight rows from ``wrow`` (``wstride`` bytes apart, scales
 * ``dstride`` floats apart, offsets ``nb`` apart) for ``rows`` activation rows from
 * ``row0``; ``nw`` and ``rows`` are constants in each inlined copy, so the nw * rows <= 4
 * accumulators stay in registers. Each output's sum runs over its blocks in order, one
 * dependent FMA a block: several weight rows at once keep the FMA unit busy when there
 * is one activation row. */
static inline __attribute__((always_inline)) void tile(
    int planes, int nw, int rows, const uint8_t *wrow, int64_t wstride, const float *d,
    int64_t dstride, const float *m, int64_t row0, int64_t K, const int8_t *xq,
    const float *xd, const float *xs, float *out, int64_t ldo) {
    const int64_t nb = K / QK, rec = record_bytes(planes);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    float offset[ROWS] = {0.f, 0.f, 0.f, 0.f};
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < nb / 2; p++) {
#pragma GCC unroll 4
        for (int i = 0; i < nw; i++) {
            const uint8_t *pair = wrow + i * wstride + p * rec;
            const float *di = d + i * dstride;
            const float *mi = planes == 1 ? m + i * nb : NULL;
            _mm_prefetch((const char *)pair + PREFETCH_BYTES, _MM_HINT_T0); /* quant_simd.h */
            __m256i w0, w1;
#if defined(Q6K_PACKED)
            if (planes == 2) {
                q6_pair_values(pair, &w0, &w1);
                w0 = _mm256_sub_epi8(w0, _mm256_set1_epi8(32));
                w1 = _mm256_sub_epi8(w1, _mm256_set1_epi8(32));
            } else
#endif
#if defined(Q5K_PACKED)
            if (planes == 1) {
                q5_pair_values(pair, &w0, &w1);
            } else
#endif
            {
                const __m256i v = _mm256_loadu_si256((const __m256i *)pair);
                w0 = block_values(pair, 0, planes, _mm256_and_si256(v, low4));
                w1 = block_values(pair, 1, planes,
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
            }
            __m128 scales[ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++)
                scales[r] = pair_scales(planes, di, p, xd + (row0 + r) * nb);
            block_rows(planes, w0, 2 * p, 0, scales, mi, rows, row0, K, nb, xq, xs,
                       acc + i * rows, offset + i * rows);
            block_rows(planes, w1, 2 * p + 1, 1, scales, mi, rows, row0, K, nb, xq, xs,
                       acc + i * rows, offset + i * rows);
        }
    }
    for (int i = 0; i < nw; i++)
        for (int r = 0; r < rows; r++)
            out[(row0 + r) * ldo + i] = hsum(acc[i * rows + r]) + offset[i * rows + r];
}

/* ``tile`` for nw, rows known only at run time (nw * rows <= 4). */
static inline __attribute__((always_inline)) void any_tile(
    int planes, int nw, int rows, const uint8_t *wrow, int64_t wstride, const float *d,
    int64_t dstride, const float *m, int64_t row0, int64_t K, const int8_t *xq,
    const float *xd, const float *xs, float *out, int64_t ldo) {
#define TILE(NW, R) tile(planes, NW, R, wrow, wstride, d, dstride, m, row0, K, xq, xd, xs, out, ldo)
    switch (nw * 8 + rows) {
    case 8 + 4: TILE(1, 4); break;
    case 8 + 3: TILE(1, 3); break;
    case 8 + 2: TILE(1, 2); break;
    case 16 + 2: TILE(2, 2); break;
    case 16 + 1: TILE(2, 1); break;
    case 24 + 1: TILE(3, 1); break;
    case 32 + 1: TILE(4, 1); break;
    default: TILE(1, 1); break;
    }
#undef TILE
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ECK_AVX512 1
/* One activation row on AVX-512 (the batch-1 decode step): a pair record's 64 values in
 * one register, with nothing shuffled. Its 32 low-nibble bytes are loaded into both
 * halves and the upper half shifted by 4 (block 2p in bytes 0-31, block 2p + 1 in 32-63,
 * the order of the activations), the 5th (and 6th) bits added under byte masks formed
 * from the pair's bit-plane words, and the 64 products summed by one dot-product
 * instruction. Q6_K's values stay unsigned (0-63): its -32 d sc per value becomes one
 * offset a row, sum over runs of 16 of d sc xd (-32 sum(x)), with the activations' run
 * sums formed once a call, as Q5_K's offsets are. Two accumulators over alternate pairs
 * keep the FMA latency off the loop's path. */

/* sum_i a[i] b[i] over ``count`` floats (a multiple of 8). */
static inline float dot_f32(const float *a, const float *b, int64_t count) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= count; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < count) {
        const __mmask16 left = (__mmask16)((1u << (count - i)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(left, a + i), _mm512_maskz_loadu_ps(left, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

#if defined(__GFNI__)
/* Q6_K's 5th and 6th bits of pair record ``pair``'s 64 values as 16 and 32 in their bytes,
 * all in vector registers: its four plane words (5th and 6th of block 2p, then of
 * 2p + 1) in each 128-bit lane, one byte shuffle puts in qword q (values 8 (q % 4).. of
 * block q / 4) the 5th plane's byte of those values as byte 3 and the 6th's as byte 2,
 * and GF(2)'s affine transform with byte j of each qword being 1 << j moves bit j of
 * byte 3 to bit 4 and of byte 2 to bit 5. Where the CPU has GFNI this replaces the mask
 * words spliced in general registers, their two mask moves and the two masked adds:
 * fewer instructions a pair, for cores that split 512-bit work and run out of
 * instruction slots before vector units. */
static inline __attribute__((always_inline)) __m512i q6_high_bits(const uint8_t *pair) {
    const __m512i words =
        _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(pair + 2 * HALF)));
#define Q6_PICK(q)                                                                         \
    (long long)(0x8080808080808080ull & ~0xFFFF0000ull |                                   \
                (unsigned long long)(8 * ((q) / 4) + (q) % 4) << 24 |                      \
                (unsigned long long)(8 * ((q) / 4) + 4 + (q) % 4) << 16)
    const __m512i pick = _mm512_set_epi64(Q6_PICK(7), Q6_PICK(6), Q6_PICK(5), Q6_PICK(4),
                                          Q6_PICK(3), Q6_PICK(2), Q6_PICK(1), Q6_PICK(0));
#undef Q6_PICK
    const __m512i bit = _mm512_set1_epi64((long long)0x8040201008040201ULL);
    return _mm512_gf2p8affine_epi64_epi8(bit, _mm512_shuffle_epi8(words, pick), 0);
}
#endif

/* Pair ``p`` of weight row ``wrow`` against the activations: the dot products, times
 * ``scales`` (a float per lane), added to ``acc``. */
static inline __attribute__((always_inline)) __m512 pair512(int planes, const uint8_t *wrow,
                                                            int64_t p, const int8_t *xq,
                                                            __m512 scales, __m512 acc) {
    const uint8_t *pair = wrow + p * record_bytes(planes);
    _mm_prefetch((const char *)pair + PREFETCH_BYTES, _MM_HINT_T0); /* quant_simd.h */
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)pair));
#if defined(__GFNI__)
    if (planes == 2) {
        const __m512i w6 = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(both, shift),
                                                     _mm512_set1_epi8(0x0F), q6_high_bits(pair),
                                                     0xEA); /* (a & b) | c */
        const __m512i x6 = _mm512_loadu_si512((const void *)(xq + p * 2 * QK));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(DOT512(_mm512_setzero_si512(), w6, x6)), scales,
                               acc);
    }
#endif
    __m512i w = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(0x0F));
    uint64_t a, b = 0;
    memcpy(&a, pair + 2 * HALF, 8);
    if (planes == 2) memcpy(&b, pair + 2 * HALF + 8, 8);
    /* Q5_K: the two blocks' 5th-bit words, in order; Q6_K: (5th, 6th) of block 2p, then
     * of 2p + 1 */
    const uint64_t fifth = planes == 2 ? (a & 0xFFFFFFFFu) | (b << 32) : a;
    w = _mm512_mask_add_epi8(w, _cvtu64_mask64(fifth), w, _mm512_set1_epi8(16));
    if (planes == 2) {
        const uint64_t sixth = (a >> 32) | (b & 0xFFFFFFFF00000000ull);
        w = _mm512_mask_add_epi8(w, _cvtu64_mask64(sixth), w, _mm512_set1_epi8(32));
    }
    const __m512i x = _mm512_loadu_si512((const void *)(xq + p * 2 * QK));
    const __m512i dot = DOT512(_mm512_setzero_si512(), w, x);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scales, acc);
}

/* The lane scales of pair ``p`` from ``sx`` (each run's scale times its activation
 * scale): Q6_K's four runs of 16, four lanes each; Q5_K's two blocks, eight lanes each. */
static inline __attribute__((always_inline)) __m512 lane_scales(int planes, const float *sx,
                                                                int64_t p) {
    if (planes == 2)
        return _mm512_permutexvar_ps(
            _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
            _mm512_castps128_ps512(_mm_loadu_ps(sx + 4 * p)));
    return _mm512_permutexvar_ps(
        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)(sx + 2 * p)))));
}

/* Q6_K's row scales for ``gemv512`` (scale bytes ``h``): each run's d sc times its
 * activation scale into ``sx``, a super-block's sixteen at a time in registers, and the
 * row's offset sum over runs of d sc xoff16 (dot_f32's sum, in its order), returned. */
static inline __attribute__((always_inline)) float q6_row_scales(const uint8_t *h, int64_t hstride,
                                                                 int64_t nb, const float *xrun,
                                                                 const float *xoff16, float *sx) {
    for (int64_t at = 0; at < hstride; at += 64) __builtin_prefetch(h + hstride + at);
    __m512 off = _mm512_setzero_ps();
    for (int64_t s = 0; s < nb / 8; s++, h += Q6K_SCALE_BYTES) {
        const __m512 ds = _mm512_mul_ps(
            _mm512_set1_ps(k4_half(h + 16)),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)h))));
        _mm512_storeu_ps(sx + 16 * s, _mm512_mul_ps(ds, _mm512_loadu_ps(xrun + 16 * s)));
        off = _mm512_fmadd_ps(ds, _mm512_loadu_ps(xoff16 + 16 * s), off);
    }
    return _mm512_reduce_add_ps(off);
}

static inline __attribute__((always_inline)) void gemv512(
    int planes, int64_t N, int64_t K, const uint8_t *wq, const uint8_t *wh, const int8_t *xq,
    const float *xd, const float *xs, float *out) {
    const int64_t nb = K / QK, pairs = nb / 2, rec = record_bytes(planes);
    const int64_t runs = planes == 2 ? 2 * nb : nb; /* scales a row */
    const int64_t hstride = nb / 8 * scale_bytes(planes);
    float xd16[planes == 2 ? 2 * nb : 1], xoff16[planes == 2 ? 2 * nb : 1];
    if (planes == 2) row_terms(K, xq, xd, xd16, xoff16);
    const float *xrun = planes == 2 ? xd16 : xd; /* each run's activation scale */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = wq + n * pairs * rec;
        float d[planes == 2 ? 1 : runs], m[nb], sx[runs];
        float offset = 0.f;
        if (planes == 2) {
            offset = q6_row_scales(wh + n * hstride, hstride, nb, xrun, xoff16, sx);
        } else {
            expand_scales(planes, wh + n * hstride, hstride, 1, nb, d, m);
            for (int64_t i = 0; i < runs; i += 16) {
                const __mmask16 left = runs - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (runs - i)) - 1u);
                _mm512_mask_storeu_ps(sx + i, left, _mm512_mul_ps(_mm512_maskz_loadu_ps(left, d + i),
                                                                  _mm512_maskz_loadu_ps(left, xrun + i)));
            }
        }
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; p += 2) { /* pairs is a multiple of 4 */
            acc0 = pair512(planes, wrow, p, xq, lane_scales(planes, sx, p), acc0);
            acc1 = pair512(planes, wrow, p + 1, xq, lane_scales(planes, sx, p + 1), acc1);
        }
        if (planes == 1) offset = dot_f32(m, xs, nb);
        out[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + offset;
    }
}
#endif

/* The product for one layout (``planes`` a constant in each inlined copy). */
static inline __attribute__((always_inline)) void gemm(
    int planes, int64_t M, int64_t N, int64_t K, const uint8_t *wq, const uint8_t *wh,
    const int8_t *xq, const float *xd, const float *xs, float *out, int64_t ldo) {
    const int64_t nb = K / QK, rec = record_bytes(planes);
    const int64_t scales_per_block = planes == 2 ? 2 : 1;
    const int64_t hstride = nb / 8 * scale_bytes(planes);
#if defined(ECK_AVX512)
    if (M == 1) {
        gemv512(planes, N, K, wq, wh, xq, xd, xs, out);
        return;
    }
#endif
#if defined(ECK_GEMV256)
    if (M == 1) {
        gemv256(planes, N, K, wq, wh, xq, xd, xs, out);
        return;
    }
#endif
#if defined(__AVX2__)
    /* weight rows a tile: 4 for one activation row, 2 for two, else one (and 4 rows) */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const int64_t nw = M == 1 ? 4 : M == 2 ? 2 : 1;
#else
    const int64_t nw = 1; /* 16 vector registers: more accumulators spill */
#endif
    const int64_t tiles = (N + nw - 1) / nw;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n = t * nw;
        const int w = (int)(N - n < nw ? N - n : nw);
        const uint8_t *wrow = wq + n * (nb / 2) * rec;
        float d[w * scales_per_block * nb], m[w * nb];
        expand_scales(planes, wh + n * hstride, hstride, w, nb, d, m);
        for (int64_t r0 = 0; r0 < M; r0 += ROWS / nw) {
            const int rows = M - r0 < ROWS / nw ? (int)(M - r0) : (int)(ROWS / nw);
            any_tile(planes, w, rows, wrow, (nb / 2) * rec, d, scales_per_block * nb, m, r0, K,
                     xq, xd, xs, out + n, ldo);
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = wq + n * (nb / 2) * rec;
        float d[scales_per_block * nb], m[nb];
        expand_scales(planes, wh + n * hstride, hstride, 1, nb, d, m);
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int rows = M - r0 < ROWS ? (int)(M - r0) : ROWS;
            float offset[ROWS] = {0.f, 0.f, 0.f, 0.f};
            for (int r = 0; r < rows; r++) {
                const int64_t row = r0 + r;
                float total = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *pair = wrow + (b / 2) * rec;
                    const int8_t *x = xq + row * K + b * QK;
                    int dot0 = 0, dot1 = 0;
                    for (int i = 0; i < HALF; i++) {
                        dot0 += value_at(pair, (int)(b & 1), i, planes) * x[i];
                        dot1 += value_at(pair, (int)(b & 1), i + HALF, planes) * x[i + HALF];
                    }
                    const float d0 = planes == 2 ? d[2 * b] : d[b];
                    const float d1 = planes == 2 ? d[2 * b + 1] : d[b];
                    total += xd[row * nb + b] * (d0 * (float)dot0 + d1 * (float)dot1);
                    if (planes == 1) offset[r] += m[b] * xs[row * nb + b];
                }
                out[row * ldo + n] = total + offset[r];
            }
        }
    }
#endif
}

/* out[r, n] (row stride ldo) = sum_k x[r, k] w[n, k] for ``bits`` 5 (Q5_K: wq [N, K/64]
 * records of 40 bytes, wh [N, K/256, 16] scale bytes) or 6 (Q6_K: records of 48 bytes,
 * wh [N, K/256, 18]). K is a multiple of 256. */
void eck_gemm_k(int64_t M, int64_t N, int64_t K, int64_t bits, const uint8_t *wq,
                const uint8_t *wh, const int8_t *xq, const float *xd, const float *xs,
                float *out, int64_t ldo) {
    if (bits == 6)
        gemm(2, M, N, K, wq, wh, xq, xd, xs, out, ldo);
    else
        gemm(1, M, N, K, wq, wh, xq, xd, xs, out, ldo);
}

#if defined(Q5K_PACKED)
/* The 5th bit plane (bit i for value i) of block ``j`` (0, 1) of a Q5_K pair record whose
 * high bits are ``packed`` (its last 8 bytes, quant_simd.h's Q5K_PACKED). */
static inline uint32_t q5_packed_plane(const uint8_t *packed, int j) {
    uint32_t h4 = 0;
    for (int i = 0; i < QK; i++)
        h4 |= (uint32_t)((packed[i % 8] >> ((j ? 0 : 4) + i / 8)) & 1) << i;
    return h4;
}
#endif

#if defined(Q6K_PACKED)
/* The 5th and 6th bit planes (bit i for value i) of block ``j`` (0, 1) of a pair record
 * whose high bits are ``packed`` (its last 16 bytes, quant_simd.h's Q6K_PACKED). */
static inline void q6_packed_planes(const uint8_t *packed, int j, uint32_t *h4, uint32_t *h5) {
    *h4 = *h5 = 0;
    for (int i = 0; i < QK; i++) {
        const uint32_t two = (uint32_t)(packed[i % HALF] >> ((j ? 0 : 4) + (i < HALF ? 0 : 2))) & 3;
        *h4 |= (two & 1) << i;
        *h5 |= (two >> 1) << i;
    }
}
#endif

/* The float32 weight [N, K] (for many rows of activations, where one float GEMM beats
 * the integer dot products): the file's values, q d sc - dmin mn or (q - 32) d sc. */
void eck_dequantize_k(int64_t N, int64_t K, int64_t bits, const uint8_t *wq,
                      const uint8_t *wh, float *out) {
    const int planes = bits == 6 ? 2 : 1;
    const int64_t nb = K / QK, rec = record_bytes(planes);
    const int64_t hstride = nb / 8 * scale_bytes(planes);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float wd[(planes == 2 ? 2 : 1) * nb], wm[nb];
        expand_scales(planes, wh + n * hstride, hstride, 1, nb, wd, wm);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *pair = wq + (n * (nb / 2) + b / 2) * rec;
            const int j = (int)(b & 1);
            const uint8_t *high = pair + 2 * HALF + j * 4 * planes;
            uint32_t h4 = load_word(high), h5 = planes == 2 ? load_word(high + 4) : 0;
#if defined(Q6K_PACKED)
            if (planes == 2) q6_packed_planes(pair + 2 * HALF, j, &h4, &h5);
#endif
#if defined(Q5K_PACKED)
            if (planes == 1) h4 = q5_packed_plane(pair + 2 * HALF, j);
#endif
            float *o = out + n * K + b * QK;
            /* value_at's arithmetic, in loops the compiler vectorizes */
            for (int half = 0; half < 2; half++) {
                const float d = planes == 2 ? wd[2 * b + half] : wd[b];
                const float m = planes == 2 ? 0.f : wm[b];
                for (int i = half * HALF; i < (half + 1) * HALF; i++) {
                    const int low = j ? pair[i] >> 4 : pair[i] & 15;
                    const int q = low | (int)((h4 >> i) & 1) << 4 | (int)((h5 >> i) & 1) << 5;
                    o[i] = planes == 2 ? (float)(q - 32) * d : (float)q * d + m;
                }
            }
        }
    }
}

/* Bit ``shift`` of each of the 32 bytes at ``h`` as one little-endian word (bit l from
 * byte l): one high-bit plane of the layout above. */
static inline uint32_t bit_plane(const uint8_t *h, int shift) {
#if defined(__AVX2__)
    const __m256i v = _mm256_loadu_si256((const __m256i *)h);
    return (uint32_t)_mm256_movemask_epi8(_mm256_sll_epi16(v, _mm_cvtsi32_si128(7 - shift)));
#else
    uint32_t word = 0;
    for (int l = 0; l < 32; l++) word |= (uint32_t)((h[l] >> shift) & 1) << l;
    return word;
#endif
}

static inline void store_word(uint8_t *p, uint32_t w) { memcpy(p, &w, 4); }

/* One super-block of the file (``blk``) into the kernels' layout: ``qs`` its values
 * (Q4_K: eight blocks of 16 bytes, byte t holding values t and t + 16; Q5_K / Q6_K: four
 * pair records), ``sc`` its scale bytes as they are. */
static inline void repack_super(int bits, const uint8_t *blk, uint8_t *qs, uint8_t *sc) {
    if (bits == 6) {
        const uint8_t *ql = blk, *qh = blk + 128;
        memcpy(sc, blk + 192, Q6K_SCALE_BYTES);
        for (int n = 0; n < 2; n++)
            for (int q = 0; q < 2; q++) {
                /* values 128 n + 64 q ..: the low (q = 0) or high nibbles of ql's half */
                uint8_t *rec = qs + (2 * n + q) * record_bytes(2);
                const uint8_t *a = ql + 64 * n, *b = a + 32;
                for (int j = 0; j < 32; j++)
                    rec[j] = q ? (uint8_t)((a[j] >> 4) | (b[j] & 0xF0))
                               : (uint8_t)((a[j] & 15) | (b[j] << 4));
#if defined(Q6K_PACKED)
                /* qh's bits 4q, 4q + 1 of byte l hold the first block's value l, bits
                 * 4q + 2, 4q + 3 the second's (quant_simd.h's order) */
                for (int t = 0; t < HALF; t++) {
                    const int v = (qh[32 * n + t] >> (4 * q)) & 15;
                    const int v16 = (qh[32 * n + HALF + t] >> (4 * q)) & 15;
                    rec[32 + t] =
                        (uint8_t)((v >> 2) | (v16 >> 2) << 2 | (v & 3) << 4 | (v16 & 3) << 6);
                }
#else
                for (int blk2 = 0; blk2 < 2; blk2++) {
                    const int s = 2 * q + blk2; /* the 2-bit field of qh holding this block */
                    store_word(rec + 32 + 8 * blk2, bit_plane(qh + 32 * n, 2 * s));
                    store_word(rec + 36 + 8 * blk2, bit_plane(qh + 32 * n, 2 * s + 1));
                }
#endif
            }
        return;
    }
    memcpy(sc, blk, K4_SCALE_BYTES);
    const uint8_t *vals = blk + (bits == 5 ? 48 : 16), *qh = blk + 16;
    for (int j = 0; j < 4; j++) {
        const uint8_t *c = vals + 32 * j; /* low nibbles: block 2 j, high: block 2 j + 1 */
        if (bits == 4) {
            uint8_t *lo = qs + 32 * j, *hi = lo + 16;
            for (int t = 0; t < 16; t++) {
                lo[t] = (uint8_t)((c[t] & 15) | (c[t + 16] << 4));
                hi[t] = (uint8_t)((c[t] >> 4) | (c[t + 16] & 0xF0));
            }
        } else {
            uint8_t *rec = qs + j * record_bytes(1);
            memcpy(rec, c, 32); /* the file's chunk is the pair's low-bit bytes already */
#if defined(Q5K_PACKED)
            /* qh's bit 2j of byte l holds the first block's value l, bit 2j + 1 the
             * second's (quant_simd.h's order: byte b, values b, 8 + b, 16 + b, 24 + b) */
            for (int b = 0; b < 8; b++) {
                int packed = 0;
                for (int q = 0; q < 4; q++) {
                    const int bits2 = qh[8 * q + b] >> (2 * j);
                    packed |= (bits2 & 1) << (4 + q) | ((bits2 >> 1) & 1) << q;
                }
                rec[32 + b] = (uint8_t)packed;
            }
#else
            store_word(rec + 32, bit_plane(qh, 2 * j));
            store_word(rec + 36, bit_plane(qh, 2 * j + 1));
#endif
        }
    }
}

/* GGUF's Q4_K / Q5_K / Q6_K rows (``bits`` 4, 5, 6; ``src`` rows of K / 256 super-blocks,
 * ``src_stride`` bytes apart, row n read from row ``order[n]``, or n where it is NULL: a
 * q/k weight's rows put back in rotary order as they are read) in the layout the kernels multiply: ``qs``
 * [N, K / 2 (Q4_K) or K / 64 records] and ``sc`` [N, K / 256 * 16 (Q6_K 18)] bytes.
 * The same bytes as kquant_blocks.from_gguf, made on every thread. */
void eck_repack_k(int64_t bits, int64_t N, int64_t K, const uint8_t *src, int64_t src_stride,
                  const int64_t *order, uint8_t *qs, uint8_t *sc) {
    const int64_t supers = K / 256;
    const int64_t in_bytes = bits == 4 ? 144 : bits == 5 ? 176 : 210;
    const int64_t out_bytes = bits == 4 ? 128 : 4 * record_bytes(bits == 6 ? 2 : 1);
    const int64_t sc_bytes = bits == 6 ? Q6K_SCALE_BYTES : K4_SCALE_BYTES;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t s = 0; s < supers; s++)
            repack_super((int)bits, src + (order ? order[n] : n) * src_stride + s * in_bytes,
                         qs + (n * supers + s) * out_bytes, sc + (n * supers + s) * sc_bytes);
}

/* 1 where this build keeps Q5_K's 5th bits eight values a byte (kquant_blocks.PACKED), 0
 * where as bit planes: the layout eck_repack_k writes and the products read. */
int64_t eck_q5_packed(void) {
#if defined(Q5K_PACKED)
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build keeps Q6_K's high bits two a value (kquant_blocks.PACKED), 0 where
 * as bit planes: the layout eck_repack_k writes and the products read. */
int64_t eck_q6_packed(void) {
#if defined(Q6K_PACKED)
    return 1;
#else
    return 0;
#endif
}

/* -8 d in float16 from d's bits (Q4_0's offset): exact where d is zero or normal and
 * stays so; -1 elsewhere (the caller prepares such a weight in torch, in float32). */
static inline int32_t minus_eight(uint16_t h) {
    const int32_t e = (h >> 10) & 31, mant = h & 1023, sign = (h ^ 0x8000) & 0x8000;
    if (e == 0) return mant ? -1 : sign;
    return e + 3 <= 30 ? sign | (e + 3) << 10 | mant : -1;
}

/* GGUF's Q8_0 / Q4_0 / Q4_1 rows (``kind`` 8, 40, 41; ``src`` rows of K / 32 blocks,
 * ``src_stride`` bytes apart, read in ``order`` as eck_repack_k's) in the layout the kernels multiply: ``qs`` [N, K] (Q8_0) or
 * [N, K / 32, 16] bytes, ``d`` and ``m`` [N, K / 32] float16 (Q4_0's m = -8 d, Q8_0's
 * zero). The bytes of gguf_blocks.from_gguf; returns how many Q4_0 offsets float16
 * cannot hold (then nothing is usable: that function keeps such a weight in float32). */
int64_t eck_repack_blocks(int64_t kind, int64_t N, int64_t K, const uint8_t *src,
                          int64_t src_stride, const int64_t *order, uint8_t *qs, uint16_t *d,
                          uint16_t *m) {
    const int64_t nb = K / QK, head = kind == 41 ? 4 : 2;
    const int64_t payload = kind == 8 ? QK : HALF, size = head + payload;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad)
    for (int64_t n = 0; n < N; n++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + (order ? order[n] : n) * src_stride + b * size;
            const int64_t at = n * nb + b;
            uint16_t h;
            memcpy(&h, blk, 2);
            d[at] = h;
            if (kind == 41) {
                memcpy(m + at, blk + 2, 2);
            } else if (kind == 40) {
                const int32_t off = minus_eight(h);
                bad += off < 0;
                m[at] = (uint16_t)(off < 0 ? 0 : off);
            } else {
                m[at] = 0;
            }
            memcpy(qs + at * payload, blk + head, (size_t)payload);
        }
    return bad;
}
