/* Matrix products over block-quantized weights (GGUF's Q8_0, Q4_0, Q4_1 and Q4_K), for
 * enginecore's ``gguf`` linear method.
 *
 * Weights stay in 32-element blocks as the file stores them: 4-bit values (two per byte,
 * byte j holds element j in its low nibble and element j + 16 in its high one) with a
 * scale d and an offset m per block (Q4_0 is Q4_1 with m = -8 d), or signed bytes with a
 * scale (Q8_0). Q4_K's blocks have their scale d sc and offset -(dmin mn) in the bytes
 * of their super-block of 256 as the file holds them; each weight row's are expanded to
 * float32 on the stack when the row is reached (exact: quant_simd.h), and the row is
 * multiplied as one with float32 scales (at one activation row on AVX-512 and AVX2 they
 * are formed in vector registers inside the product).
 * Activations are quantized to signed bytes per block of 32 with their own scale, as
 * llama.cpp does, so each block's dot product is an integer one: VNNI's vpdpbusd where
 * the CPU has it, AVX2's vpmaddubsw + vpmaddwd elsewhere, a plain loop off x86. Each
 * output sums d_w d_x <q_w, q_x> over the blocks, plus m_w d_x sum(q_x) for the 4-bit
 * formats. Rows of the activations are taken four at a time, so a weight block read from
 * memory serves all four. One activation row (the batch-1 decode step) takes weight rows
 * several a pass (ROW_PASSES), each row's sum in the order it has alone: a row's sum is
 * a chain of dependent FMAs, which one row alone waits on.
 */
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "quant_simd.h"

#define QK 32
#define ECQ_Q4_HALF 20 /* ecq_linear's kind for 4-bit blocks with float16 scales */
#define ECQ_Q4_0_HALF 21 /* ... float16 scales d and offsets -8 d, formed from d (Q4_0) */
#define ECQ_Q8_HALF 22   /* ... and for 8-bit blocks with float16 scales (Q8_0's file's) */
#define ECQ_Q4_K 24    /* ... and for Q4_K's, scales per super-block (kquant_blocks.py) */

/* Where a 4-bit product's block scales and offsets come from: float32 or float16 arrays,
 * one of each a block, or Q4_K's super-block scale bytes. */
#define SCALES_F32 0
#define SCALES_F16 1
#define SCALES_F16_SYM 3 /* float16 d, offsets -8 d: m is never read */
#define SCALES_Q4K 2

/* The float32 scales and offsets of ``rows`` Q4_K weight rows from ``sb`` (their scale
 * bytes, nb * 2 a row) into d32, m32 [rows, nb]. */
static inline __attribute__((always_inline)) void q4k_expand_rows(int rows, const char *sb,
                                                                  int64_t nb, float *d32,
                                                                  float *m32) {
    const int64_t bytes = nb * 2; /* a row's */
    /* the next rows' scale bytes, so their expansion does not wait on them */
    for (int64_t at = 0; at < rows * bytes; at += 64) __builtin_prefetch(sb + rows * bytes + at);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t s = 0; s < nb / 8; s++)
            k4_expand((const uint8_t *)sb + r * bytes + s * K4_SCALE_BYTES, d32 + r * nb + 8 * s,
                      m32 + r * nb + 8 * s);
}

/* The row's scales and offsets as the kernel reads them: ``d`` and ``m`` as given, or for
 * Q4_K (``d`` the row's scale bytes) expanded into ``d32``, ``m32`` [nb]; returns the
 * mode they are read in. */
static inline __attribute__((always_inline)) int row_scales(int mode, const char **d,
                                                            const char **m, int64_t nb,
                                                            float *d32, float *m32) {
    if (mode != SCALES_Q4K) return mode;
    q4k_expand_rows(1, *d, nb, d32, m32);
    *d = (const char *)d32, *m = (const char *)m32;
    return SCALES_F32;
}

/* Block b's offset: m[b], or -8 d[b] for SCALES_F16_SYM (exact: a power of two). */
static inline __attribute__((always_inline)) float offset_at(const void *m, const void *d,
                                                             int64_t b, int mode) {
    return mode == SCALES_F16_SYM ? -8.f * scale_at(d, b, 1) : scale_at(m, b, mode == SCALES_F16);
}

/* x [M, K] (row stride ldx) -> xq [M, K] int8, xd [M, K/32] scales, xs [M, K/32] =
 * scale * sum of the block's bytes. */
void ecq_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xq,
                       float *xd, float *xs) {
    const int64_t nb = K / QK;
#pragma omp parallel for if (M * K > 65536)
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * ldx;
        for (int64_t b = 0; b < nb; b++) {
            const float *v = row + b * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            /* The loop below in 16 lanes, the same values: the products round to nearest
             * even under the default rounding mode as lrintf does. */
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            const float amax16 = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d16 = amax16 / 127.f;
            const __m512 inv16 = _mm512_set1_ps(d16 > 0.f ? 1.f / d16 : 0.f);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv16));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv16));
            int8_t *q16 = xq + r * K + b * QK;
            _mm_storeu_si128((__m128i *)q16, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q16 + 16), _mm512_cvtsepi32_epi8(q1));
            xd[r * nb + b] = d16;
            xs[r * nb + b] = d16 * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            continue;
#endif
            float amax = 0.f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            const float d = amax / 127.f;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            int8_t *q = xq + r * K + b * QK;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                int value = (int)lrintf(v[i] * inv);
                q[i] = (int8_t)value;
                sum += value;
            }
            xd[r * nb + b] = d;
            xs[r * nb + b] = d * (float)sum;
        }
    }
}

#if defined(__AVX2__)
/* The scales d of blocks b..b+7 of a row, float32. */
static inline __attribute__((always_inline)) __m256 scales8(const void *d, int64_t b, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)d + b)))
                : _mm256_loadu_ps((const float *)d + b);
}

static inline __m256i unpack_nibbles(const uint8_t *q) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(hi, lo);
}
#endif

#define ROWS 4

/* 4-bit weight rows a pass of the one-row kernels (dot_rows_q4, dot_rows_q4_avx2):
 * Q4_ROWS, or 2 where their packed bytes would pass Q4_PASS_BYTES; rows longer still go
 * one at a time. A pass prefetches the next pass's bytes, so a pass's bytes are the
 * prefetch distance: from memory four rows of 4 KB (8,192 inputs) read slower than one
 * row at a time, four of 1-1.5 KB faster. */
#ifndef Q4_ROWS
#define Q4_ROWS 4
#endif
#ifndef Q4_PASS_BYTES
#define Q4_PASS_BYTES 6144
#endif

/* The weight rows and the activation row of a one-row 4-bit product, for its passes
 * (ROW_PASSES): ``wd``, ``wm`` as ``mode`` says, ``xp`` the activations permuted for
 * the build's kernel. */
struct q4_args {
    const uint8_t *wq;
    const void *wd, *wm;
    int mode;
    const int8_t *xp;
    const float *xd, *xs;
    int64_t nb;
    float *out;
};

/* Weight row n0's packed bytes, scales and offsets (Q4_K: its scale bytes in ``d``). */
static inline void q4_rows_at(const struct q4_args *a, int64_t n0, const uint8_t **w,
                              const char **d, const char **m) {
    const int64_t scale_bytes = a->nb * (a->mode == SCALES_F32 ? 4 : 2); /* a row's */
    *w = a->wq + n0 * a->nb * (QK / 2);
    *d = (const char *)a->wd + n0 * scale_bytes;
    *m = a->wm == NULL ? NULL : (const char *)a->wm + n0 * scale_bytes;
}

/* The weight rows' count a one-row 4-bit pass takes for rows of ``nb`` blocks. */
static inline int q4_pass_rows(int64_t nb) {
    const int64_t row_bytes = nb * (QK / 2);
    return Q4_ROWS * row_bytes <= Q4_PASS_BYTES ? Q4_ROWS : 2 * row_bytes <= Q4_PASS_BYTES ? 2 : 1;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ECQ_AVX512 1
/* The AVX-512 one-row Q4_0 / Q4_1 product's rows a pass: q4_pass_rows, or one at a time
 * (the per-row kernel, prefetching PREFETCH_BYTES ahead of its own loads) where Q4_ROWS
 * rows span under Q4_PASS_MIN_BYTES. A pass prefetches the next pass's bytes, and from
 * memory passes of short rows (a small model's 576 inputs) read slower than one row at
 * a time, as the Q8_0 ones did (benchmarks/RESULTS.md, "The LM head of a small model one
 * row at a time"). */
#ifndef Q4_PASS_MIN_BYTES
#define Q4_PASS_MIN_BYTES 3072
#endif
static inline int q4_avx512_pass_rows(int64_t nb) {
    return Q4_ROWS * nb * (QK / 2) < Q4_PASS_MIN_BYTES ? 1 : q4_pass_rows(nb);
}
/* Q4_K weight rows a pass of the one-row kernel takes (dot_rows_q4k) */
#ifndef Q4K_ROWS
#define Q4K_ROWS 4
#endif
/* 4-bit weights, AVX-512: a load of G blocks' packed bytes (G = 4, 2 or 1) splits into
 * its low nibbles (elements 0-15 of each block, block after block) and its high ones
 * (elements 16-31). The activations are rearranged to that order once per call
 * (``permute_rows``), so no weight byte is shuffled: per 4 blocks two dot-product
 * instructions and one scale multiply, where the 256-bit loop needs four of each. */

/* Group size at block b of nb: 4 while four remain, then 2, then 1. */
static inline int64_t group_at(int64_t b, int64_t nb) {
    return nb - b >= 4 ? 4 : nb - b >= 2 ? 2 : 1;
}

/* xq's rows [M, K] -> out [M, K] with each group of G blocks as [low halves, high halves]. */
static void permute_rows(const int8_t *xq, int64_t M, int64_t K, int8_t *out) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++) {
        for (int64_t b = 0; b < nb;) {
            const int64_t g = group_at(b, nb);
            const int8_t *src = xq + r * K + b * QK;
            int8_t *dst = out + r * K + b * QK;
            for (int64_t j = 0; j < g; j++) {
                memcpy(dst + j * 16, src + j * QK, 16);
                memcpy(dst + g * 16 + j * 16, src + j * QK + 16, 16);
            }
            b += g;
        }
    }
}

static inline float hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Blocks b..b+3 of ``wrow`` (weight scales ``wd``) against the permuted activations
 * ``xp`` (scales ``xd``), added to ``acc``. */
static inline __attribute__((always_inline)) __m512 group4(__m512 acc, const uint8_t *wrow,
                                                           const int8_t *xp, const float *xd,
                                                           int64_t b, __m128 wd) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    _mm_prefetch((const char *)(wrow + b * 16) + PREFETCH_BYTES, _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512((const void *)(wrow + b * 16));
    const __m512i lo = _mm512_and_si512(v, mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    __m512i dot =
        DOT512(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)(xp + b * QK)));
    dot = DOT512(dot, hi, _mm512_loadu_si512((const void *)(xp + b * QK + 64)));
    const __m128 scale = _mm_mul_ps(wd, _mm_loadu_ps(xd + b));
    const __m512 scales = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scales, acc);
}

/* The integer dot products of Q4_K blocks b..b+3 of ``wrow`` (lanes 4 j..4 j + 3 block
 * b + j) with the permuted activations ``x0``, ``x1`` (their low and high halves): the
 * steps of ``group4`` before its scales (the caller prefetches). */
static inline __attribute__((always_inline)) __m512i dot4(const uint8_t *wrow, int64_t b,
                                                          __m512i x0, __m512i x1) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512((const void *)(wrow + b * 16));
    const __m512i lo = _mm512_and_si512(v, mask);
#if defined(__GFNI__)
    /* the high nibbles by one affine transform over GF(2) (output bit i is input bit
     * i + 4), where a shift and a mask take two instructions */
    const __m512i hi =
        _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64((long long)0x1020408000000000ull), 0);
#else
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
#endif
    return DOT512(DOT512(_mm512_setzero_si512(), lo, x0), hi, x1);
}

/* Q4_K's scales of super-blocks s and s + 1 (their 32 scale bytes at ``sb``; s alone where
 * ``one``, its 16 bytes only read), all in vector registers: d sc of their 16 blocks into
 * ``wd``, -(dmin mn) into ``wm`` (lanes 8-15 zero where ``one``). The 6-bit fields of
 * k4_scales8 and k4_mins8 come from two byte shuffles of the words (w0, w1, w2) into
 * [scale low bits, mins low bits] and [their top 2 bits] and three masks; d and dmin
 * are spread by one word permute each. The same float products as k4_expand, so the same
 * bits. */
static inline __attribute__((always_inline)) void q4k_scales16(const uint8_t *sb, int one,
                                                               __m512 *wd, __m512 *wm) {
    const __m256i v = one ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)sb))
                          : _mm256_loadu_si256((const __m256i *)sb);
    /* per super-block (128-bit lane): bytes 0-1 d, 2-3 dmin, 4-7 w0, 8-11 w1, 12-15 w2 */
    const __m256i low_src = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m256i top_src = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    /* [w0, w2, w1, w2 >> 4] and [0, w0, 0, w1] */
    const __m256i a = _mm256_shuffle_epi8(v, low_src);
    const __m256i low = _mm256_mask_blend_epi32(0x88, a, _mm256_srli_epi16(a, 4));
    const __m256i top = _mm256_shuffle_epi8(v, top_src);
    const __m256i keep = _mm256_broadcastsi128_si256(_mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
    /* (low & keep) | ((top >> 2) & 0x30): bits 6-7 of w0 / w1 become bits 4-5 */
    const __m256i fields = _mm256_ternarylogic_epi32(
        low, keep, _mm256_and_si256(_mm256_srli_epi16(top, 2), _mm256_set1_epi8(0x30)), 0xEA);
    /* [scales of s, of s + 1, mins of s, of s + 1] */
    const __m256i sm = _mm256_permute4x64_epi64(fields, _MM_SHUFFLE(3, 1, 2, 0));
    const __m512 scales = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(sm)));
    const __m512 mins = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(sm, 1)));
    const __m256i d_at = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    const __m512 d = _mm512_cvtph_ps(_mm256_permutexvar_epi16(d_at, v));
    const __m512 dmin =
        _mm512_cvtph_ps(_mm256_permutexvar_epi16(_mm256_add_epi16(d_at, _mm256_set1_epi16(1)), v));
    *wd = _mm512_mul_ps(d, scales);
    const __m512 off = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_mul_ps(dmin, mins)), _mm512_set1_epi32((int)0x80000000u)));
    *wm = one ? _mm512_maskz_mov_ps((__mmask16)0x00FF, off) : off;
}

/* ``rows`` outputs (a constant in each inlined copy) of the Q4_K weight rows from ``wrow``
 * (their scale bytes from ``sb``) against one permuted activation row, into ``out``. Each row's sum runs as one row's would alone:
 * two super-blocks' scales at a time, each block's d sc times its activation scale
 * formed sixteen at a time, the blocks in order into one accumulator, then the offsets
 * sum_b m_b xs_b (kept on the stack meanwhile), 16 blocks at a time. A row's sum is a
 * chain of dependent FMAs, so several rows at once keep the FMA units busy, and share
 * each activation load. */
static inline __attribute__((always_inline)) void dot_rows_q4k(
    int rows, const uint8_t *wrow, const uint8_t *sb, const int8_t *xp, const float *xd,
    const float *xs, int64_t nb, float *out) {
    const int64_t wstride = nb * (QK / 2), sstride = nb / 8 * K4_SCALE_BYTES; /* a row's */
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i four = _mm512_set1_epi32(4);
    float m32[rows * nb];
    const uint8_t *next = wrow + rows * wstride; /* the next rows' bytes */
    __m512 acc[Q4K_ROWS], sx[Q4K_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) { /* nb is a multiple of 8 */
        const int one = nb - b < 16;
        const __mmask16 lanes = one ? (__mmask16)0x00FF : (__mmask16)0xFFFF;
        const __m512 xdb = _mm512_maskz_loadu_ps(lanes, xd + b);
        for (int r = 0; r < rows; r++) {
            __m512 wd, wm;
            q4k_scales16(sb + r * sstride + (b / 8) * K4_SCALE_BYTES, one, &wd, &wm);
            sx[r] = _mm512_mul_ps(wd, xdb);
            _mm512_mask_storeu_ps(m32 + r * nb + b, lanes, wm);
        }
        __m512i at = spread;
        for (int g = 0; g < (one ? 2 : 4); g++, at = _mm512_add_epi32(at, four)) {
            const int8_t *x = xp + (b + 4 * g) * QK;
            const __m512i x0 = _mm512_loadu_si512((const void *)x);
            const __m512i x1 = _mm512_loadu_si512((const void *)(x + 64));
            for (int r = 0; r < rows; r++) {
                /* the next rows' bytes a line a group, in ascending order: one stream, where a
                 * prefetch ahead of each row's own loads makes four, which the hardware
                 * prefetchers follow far worse from memory */
                _mm_prefetch((const char *)next + ((b / 4 + g) * rows + r) * 64, _MM_HINT_T0);
                acc[r] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(dot4(wrow + r * wstride, b + 4 * g, x0, x1)),
                    _mm512_permutexvar_ps(at, sx[r]), acc[r]);
            }
        }
    }
    for (int64_t i = 0; i < nb; i += 16) {
        const __mmask16 left = nb - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)0x00FF;
        const __m512 x = _mm512_maskz_loadu_ps(left, xs + i);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(left, m32 + r * nb + i), x, acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* The offsets -8 d, m of 16 blocks from block i of a row (``lanes`` of them), float32,
 * as ``mode`` says (a constant in each inlined copy). */
static inline __attribute__((always_inline)) __m512 offsets16(const void *d, const void *m,
                                                              int64_t i, __mmask16 lanes,
                                                              int mode) {
    if (mode == SCALES_F16_SYM)
        return _mm512_mul_ps(_mm512_set1_ps(-8.f),
                             _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, (const uint16_t *)d + i)));
    if (mode == SCALES_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, (const uint16_t *)m + i));
    return _mm512_maskz_loadu_ps(lanes, (const float *)m + i);
}

/* The scales d of blocks b..b+3 of a row, float32. */
static inline __attribute__((always_inline)) __m128 scales4(const void *d, int64_t b, int half) {
    return half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)((const uint16_t *)d + b)))
                : _mm_loadu_ps((const float *)d + b);
}

/* ``total`` plus the row's last blocks from b (b + 4 > nb: a group of 2, then of 1). */
static inline __attribute__((always_inline)) float tail_q4(float total, const uint8_t *wrow,
                                                           const void *d, const int8_t *xp,
                                                           const float *xd, int64_t b,
                                                           int64_t nb, int half) {
    if (b + 2 <= nb) {
        const __m256i mask8 = _mm256_set1_epi8(0x0F);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wrow + b * 16));
        const __m256i lo = _mm256_and_si256(v, mask8);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask8);
        __m256i dot = DOT256(_mm256_setzero_si256(), lo,
                             _mm256_loadu_si256((const __m256i *)(xp + b * QK)));
        dot = DOT256(dot, hi, _mm256_loadu_si256((const __m256i *)(xp + b * QK + 32)));
        const __m256 scales = _mm256_set_m128(_mm_set1_ps(scale_at(d, b + 1, half) * xd[b + 1]),
                                              _mm_set1_ps(scale_at(d, b, half) * xd[b]));
        total += hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), scales));
        b += 2;
    }
    if (b < nb) {
        const __m128i mask4 = _mm_set1_epi8(0x0F);
        const __m128i v = _mm_loadu_si128((const __m128i *)(wrow + b * 16));
        const __m128i lo = _mm_and_si128(v, mask4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask4);
        __m128i dot = DOT128(_mm_setzero_si128(), lo, _mm_loadu_si128((const __m128i *)(xp + b * QK)));
        dot = DOT128(dot, hi, _mm_loadu_si128((const __m128i *)(xp + b * QK + 16)));
        total += scale_at(d, b, half) * xd[b] * hsum128(_mm_cvtepi32_ps(dot));
    }
    return total;
}

/* One output of 4-bit weights ``wrow`` against one permuted activation row; ``d``, ``m``
 * as ``mode`` says (a constant in each inlined copy; Q4_K's expanded to SCALES_F32). */
static inline __attribute__((always_inline)) float dot_row_q4(
    const uint8_t *wrow, const void *d, const void *m, const int8_t *xp, const float *xd,
    const float *xs, int64_t nb, int mode) {
    const int half = mode == SCALES_F16 || mode == SCALES_F16_SYM;
    __m512 acc = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) acc = group4(acc, wrow, xp, xd, b, scales4(d, b, half));
    /* The offsets: sum_b m_b d_x,b sum(q_x,b), 16 blocks at a time. */
    for (int64_t i = 0; i < nb; i += 16) {
        const __mmask16 left = nb - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - i)) - 1u);
        acc = _mm512_fmadd_ps(offsets16(d, m, i, left, mode), _mm512_maskz_loadu_ps(left, xs + i), acc);
    }
    return tail_q4(_mm512_reduce_add_ps(acc), wrow, d, xp, xd, b, nb, half);
}

/* ``rows`` outputs (a constant in each inlined copy) of consecutive 4-bit weight rows from
 * ``wrow``, scales from ``d``, ``m`` (``mode`` as in dot_row_q4), against one permuted
 * activation row, into ``out``. Each row's sum runs in dot_row_q4's order, so each output
 * has its bits; a row's sum is a chain of dependent FMAs, so several rows at once keep
 * the FMA units busy (one row alone waits on the FMA latency), and share each activation
 * load. */
static inline __attribute__((always_inline)) void dot_rows_q4(
    int rows, const uint8_t *wrow, const void *d, const void *m, const int8_t *xp,
    const float *xd, const float *xs, int64_t nb, int mode, float *out) {
    const int half = mode == SCALES_F16 || mode == SCALES_F16_SYM;
    const int64_t wstride = nb * (QK / 2), sstride = nb * (half ? 2 : 4); /* a row's bytes */
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const uint8_t *next = wrow + rows * wstride; /* the next rows' bytes */
    __m512 acc[Q4_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        const __m512i x0 = _mm512_loadu_si512((const void *)(xp + b * QK));
        const __m512i x1 = _mm512_loadu_si512((const void *)(xp + b * QK + 64));
        const __m128 xdb = _mm_loadu_ps(xd + b);
        for (int r = 0; r < rows; r++) {
            /* the next rows' bytes a line a group, in ascending order: one stream for the
             * hardware prefetchers to follow, where a prefetch ahead of each row makes
             * several */
            _mm_prefetch((const char *)next + ((b / 4) * rows + r) * 64, _MM_HINT_T0);
            const char *dr = (const char *)d + r * sstride;
            const __m128 scale = _mm_mul_ps(scales4(dr, b, half), xdb);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot4(wrow + r * wstride, b, x0, x1)),
                                     _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(scale)),
                                     acc[r]);
        }
    }
    for (int64_t i = 0; i < nb; i += 16) {
        const __mmask16 left = nb - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - i)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(left, xs + i);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_fmadd_ps(offsets16((const char *)d + r * sstride,
                                               m == NULL ? NULL : (const char *)m + r * sstride,
                                               i, left, mode),
                                     x, acc[r]);
    }
    for (int r = 0; r < rows; r++)
        out[r] = tail_q4(_mm512_reduce_add_ps(acc[r]), wrow + r * wstride,
                         (const char *)d + r * sstride, xp, xd, b, nb, half);
}

/* dot_rows_q4 with ``rows`` (Q4_ROWS, 2 or 1) and ``mode`` made constants of its copies. */
static inline __attribute__((always_inline)) void q4_rows_pass(
    int rows, const uint8_t *wrow, const void *d, const void *m, const int8_t *xp,
    const float *xd, const float *xs, int64_t nb, int mode, float *out) {
#define Q4_PASS(R)                                                                         \
    (mode == SCALES_F16_SYM ? dot_rows_q4(R, wrow, d, m, xp, xd, xs, nb, SCALES_F16_SYM, out) \
     : mode == SCALES_F16   ? dot_rows_q4(R, wrow, d, m, xp, xd, xs, nb, SCALES_F16, out)     \
                            : dot_rows_q4(R, wrow, d, m, xp, xd, xs, nb, SCALES_F32, out))
    if (rows == Q4_ROWS)
        Q4_PASS(Q4_ROWS);
    else if (rows == 2)
        Q4_PASS(2);
    else
        Q4_PASS(1);
#undef Q4_PASS
}

/* The passes of the one-row products (ROW_PASSES). */
static inline __attribute__((always_inline)) void q4k_pass(const void *args,
                                                           int64_t n0, int rows) {
    const struct q4_args *a = args;
    const uint8_t *w;
    const char *d, *m;
    q4_rows_at(a, n0, &w, &d, &m);
    if (rows == Q4K_ROWS)
        dot_rows_q4k(Q4K_ROWS, w, (const uint8_t *)d, a->xp, a->xd, a->xs, a->nb, a->out + n0);
    else
        dot_rows_q4k(1, w, (const uint8_t *)d, a->xp, a->xd, a->xs, a->nb, a->out + n0);
}

static inline __attribute__((always_inline)) void q4_pass(const void *args,
                                                          int64_t n0, int rows) {
    const struct q4_args *a = args;
    const uint8_t *w;
    const char *d, *m;
    q4_rows_at(a, n0, &w, &d, &m);
    if (rows == Q4_ROWS)
        q4_rows_pass(Q4_ROWS, w, d, m, a->xp, a->xd, a->xs, a->nb, a->mode, a->out + n0);
    else
        q4_rows_pass(1, w, d, m, a->xp, a->xd, a->xs, a->nb, a->mode, a->out + n0);
}

static inline __attribute__((always_inline)) void q4_pass_two(const void *args,
                                                              int64_t n0, int rows) {
    const struct q4_args *a = args;
    const uint8_t *w;
    const char *d, *m;
    q4_rows_at(a, n0, &w, &d, &m);
    if (rows == 2)
        q4_rows_pass(2, w, d, m, a->xp, a->xd, a->xs, a->nb, a->mode, a->out + n0);
    else
        q4_rows_pass(1, w, d, m, a->xp, a->xd, a->xs, a->nb, a->mode, a->out + n0);
}

/* The one-row products' loops, a function each: inlined into ecq_gemm_q4 together they
 * ran slower (one_row_cycles.py). Each takes its arguments by value: a copy nothing else
 * can write stays in registers across the passes, where read through a pointer the
 * four-row Q4_0 loop ran slower. */
static __attribute__((noinline)) void q4k_one_row(int64_t N, struct q4_args a) {
    ROW_PASSES(N, Q4K_ROWS, q4k_pass, &a);
}

static __attribute__((noinline)) void q4_one_row(int64_t N, struct q4_args a) {
    ROW_PASSES(N, Q4_ROWS, q4_pass, &a);
}

static __attribute__((noinline)) void q4_one_row_two(int64_t N, struct q4_args a) {
    ROW_PASSES(N, 2, q4_pass_two, &a);
}
#endif

#if defined(__AVX2__) && !defined(ECQ_AVX512)
/* One activation row on AVX2 takes two blocks a 256-bit load of their packed bytes, as
 * the AVX-512 kernel takes four: the low nibbles are elements 0-15 of both blocks, the
 * high ones elements 16-31, and the activations are rearranged to that order once a call
 * (``permute_pairs``), so no weight byte is shuffled. Per two blocks: two dot products
 * summed as integers (lanes 0-3 block b, 4-7 block b + 1), one conversion and one FMA
 * by the two blocks' scales, where a block at a time took twice as many. */

/* xq's row [K] -> out [K] with each pair of blocks as [low halves, high halves] (an odd
 * last block as it is). */
static void permute_pairs(const int8_t *xq, int64_t K, int8_t *out) {
    const int64_t nb = K / QK;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const int8_t *src = xq + b * QK;
        int8_t *dst = out + b * QK;
        memcpy(dst, src, 16);
        memcpy(dst + 16, src + QK, 16);
        memcpy(dst + 32, src + 16, 16);
        memcpy(dst + 48, src + QK + 16, 16);
    }
    if (b < nb) memcpy(out + b * QK, xq + b * QK, QK);
}

/* Blocks b, b + 1 at ``w`` against the permuted activations ``xp`` (their 64 bytes),
 * the integer sums per lane. */
static inline __m256i pair_dot(const uint8_t *w, const int8_t *xp) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)w);
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    return _mm256_add_epi32(dot_u8_s8(lo, x0), dot_u8_s8(hi, x1));
#else
    /* each 16-bit sum is at most 2 * 15 * 127, two of them well inside int16 */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
                             _mm256_set1_epi16(1));
#endif
}

/* ``rows`` outputs (a constant in each inlined copy) of consecutive 4-bit weight rows from
 * ``wrow`` against one activation row permuted by ``permute_pairs``, into ``out`` (``mode``
 * a constant in each inlined copy). Each row: the pairs in two accumulators and the
 * offsets eight blocks at a time, all in registers; Q4_K's eight blocks at a time are a
 * super-block, whose scales and offsets are formed in registers as they are reached
 * (the floats k4_expand gives, so its bits).
 * Each row's sum runs in the order it runs alone (rows == 1), so the outputs have its
 * bits; a pass of several rows keeps more independent FMA chains in flight, and shares
 * the activation loads. */
static inline __attribute__((always_inline)) void dot_rows_q4_avx2(
    int rows, const uint8_t *wrow, const void *d, const void *m, const int8_t *xp,
    const float *xd, const float *xs, int64_t nb, int mode, float *out) {
    const int half = mode != SCALES_F32; /* Q4_K: two scale bytes a block */
    const int64_t wstride = nb * (QK / 2), sstride = nb * (half ? 2 : 4); /* a row's bytes */
    const uint8_t *next = wrow + rows * wstride; /* the next pass's bytes */
    if (mode == SCALES_Q4K) /* the next pass's scale bytes */
        for (int64_t at = 0; at < rows * sstride; at += 64)
            _mm_prefetch((const char *)d + rows * sstride + at, _MM_HINT_T0);
    __m256 acc0[Q4_ROWS], acc1[Q4_ROWS], offsets[Q4_ROWS];
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = offsets[r] = _mm256_setzero_ps();
    int64_t b = 0;
    /* Eight blocks' scale products d_w d_x at a time, one vector multiply, each pair's
     * two spread over its lanes by one permute. */
    for (; b + 8 <= nb; b += 8) {
        const __m256 xd8 = _mm256_loadu_ps(xd + b);
        __m256 sx[Q4_ROWS];
        for (int r = 0; r < rows; r++) {
            __m256 wd;
            if (mode == SCALES_Q4K) {
                __m256 wm;
                k4_scales_offsets((const uint8_t *)d + r * sstride + b / 8 * K4_SCALE_BYTES, &wd,
                                  &wm);
                offsets[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs + b), offsets[r]);
            } else {
                wd = scales8((const char *)d + r * sstride, b, half);
            }
            sx[r] = _mm256_mul_ps(wd, xd8);
        }
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
            const __m256i at = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
            for (int r = 0; r < rows; r++) {
                const uint8_t *w = wrow + r * wstride + (b + j) * (QK / 2);
                if (rows == 1)
                    _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
                else if (!(j & 2)) /* the next pass's bytes as one ascending stream */
                    _mm_prefetch((const char *)next + ((b / 4 + j / 4) * rows + r) * 64,
                                 _MM_HINT_T0);
                const __m256 dot = _mm256_cvtepi32_ps(pair_dot(w, xp + (b + j) * QK));
                const __m256 scale = _mm256_permutevar8x32_ps(sx[r], at);
                if (j & 2)
                    acc1[r] = _mm256_fmadd_ps(dot, scale, acc1[r]);
                else
                    acc0[r] = _mm256_fmadd_ps(dot, scale, acc0[r]);
            }
        }
    }
    for (; b + 2 <= nb; b += 2) {
        for (int r = 0; r < rows; r++) {
            const char *dr = (const char *)d + r * sstride;
            const __m256i dot = pair_dot(wrow + r * wstride + b * (QK / 2), xp + b * QK);
            const __m256 scale = _mm256_set_m128(_mm_set1_ps(scale_at(dr, b + 1, half) * xd[b + 1]),
                                                 _mm_set1_ps(scale_at(dr, b, half) * xd[b]));
            acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc0[r]);
        }
    }
    if (b < nb) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xp + b * QK));
        for (int r = 0; r < rows; r++) {
            const __m256i w0 = unpack_nibbles(wrow + r * wstride + b * (QK / 2));
            acc1[r] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dot_u8_s8(w0, x0)),
                _mm256_set1_ps(scale_at((const char *)d + r * sstride, b, half) * xd[b]), acc1[r]);
        }
    }
    /* the offsets: sum_b m_b d_x,b sum(q_x,b) (Q4_K's summed above: nb is a multiple
     * of 8) */
    for (int r = 0; r < rows; r++) {
        const char *dr = (const char *)d + r * sstride;
        const char *mr = m == NULL ? NULL : (const char *)m + r * sstride;
        int64_t i = mode == SCALES_Q4K ? nb : 0;
        for (; i + 8 <= nb; i += 8) {
            const __m256 wm =
                mode == SCALES_F16_SYM ? _mm256_mul_ps(_mm256_set1_ps(-8.f), scales8(dr, i, 1))
                                       : scales8(mr, i, half);
            offsets[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xs + i), offsets[r]);
        }
        float total = hsum(_mm256_add_ps(acc0[r], acc1[r])) + hsum(offsets[r]);
        for (; i < nb; i++) total += offset_at(mr, dr, i, mode) * xs[i];
        out[r] = total;
    }
}

/* dot_rows_q4_avx2 for ``rows`` (a constant in each inlined copy) weight rows from n0,
 * its ``mode`` made a constant of its copies. */
static inline __attribute__((always_inline)) void q4_rows_avx2(int rows, const struct q4_args *a,
                                                               int64_t n0) {
    const uint8_t *w;
    const char *d, *m;
    q4_rows_at(a, n0, &w, &d, &m);
    const int mode = a->mode;
    const int64_t nb = a->nb;
    if (mode == SCALES_Q4K)
        dot_rows_q4_avx2(rows, w, d, m, a->xp, a->xd, a->xs, nb, SCALES_Q4K, a->out + n0);
    else if (mode == SCALES_F16_SYM)
        dot_rows_q4_avx2(rows, w, d, m, a->xp, a->xd, a->xs, nb, SCALES_F16_SYM, a->out + n0);
    else if (mode == SCALES_F16)
        dot_rows_q4_avx2(rows, w, d, m, a->xp, a->xd, a->xs, nb, SCALES_F16, a->out + n0);
    else
        dot_rows_q4_avx2(rows, w, d, m, a->xp, a->xd, a->xs, nb, SCALES_F32, a->out + n0);
}

/* The passes (ROW_PASSES) of Q4_ROWS and of two rows, and their loops, a function each. */
static inline __attribute__((always_inline)) void q4_pass_avx2(const void *args,
                                                               int64_t n0, int rows) {
    if (rows == Q4_ROWS)
        q4_rows_avx2(Q4_ROWS, args, n0);
    else
        q4_rows_avx2(1, args, n0);
}

static inline __attribute__((always_inline)) void q4_pass_avx2_two(const void *args,
                                                                   int64_t n0, int rows) {
    if (rows == 2)
        q4_rows_avx2(2, args, n0);
    else
        q4_rows_avx2(1, args, n0);
}

static __attribute__((noinline)) void q4_one_row_avx2(int64_t N, struct q4_args a) {
    ROW_PASSES(N, Q4_ROWS, q4_pass_avx2, &a);
}

/* ``pass`` 2, or 1: the rows one at a time */
static __attribute__((noinline)) void q4_one_row_avx2_two(int64_t N, int pass,
                                                          struct q4_args a) {
    ROW_PASSES(N, pass, q4_pass_avx2_two, &a);
}
#endif

/* out[r, n] (row stride ldo) = sum_k x[r, k] w[n, k] for 4-bit weights: wq [N, nb, 16],
 * wd, wm [N, nb] (float16 or float32 as ``mode`` says), or for SCALES_Q4K wd [N, nb / 8,
 * K4_SCALE_BYTES] and wm unused. */
void ecq_gemm_q4(int64_t M, int64_t N, int64_t K, const uint8_t *wq, const void *wd,
                 const void *wm, int mode, const int8_t *xq, const float *xd, const float *xs,
                 float *out, int64_t ldo) {
    const int64_t nb = K / QK;
    /* a row's scale bytes, per block (Q4_K: 16 a super-block of 8 blocks) */
    const int64_t scale_bytes = mode == SCALES_F32 ? 4 : 2;
    const int64_t expanded = mode == SCALES_Q4K ? nb : 1; /* floats of a row's expansion */
#if defined(ECQ_AVX512)
    int8_t stack_rows[4 * 4096];
    int8_t *xp = M * K <= (int64_t)sizeof(stack_rows) ? stack_rows : (int8_t *)malloc(M * K);
    if (xp != NULL) {
        permute_rows(xq, M, K, xp);
        const int pass = q4_avx512_pass_rows(nb);
        if (M == 1 && (mode == SCALES_Q4K || pass > 1)) {
            const struct q4_args a = {wq, wd, wm, mode, xp, xd, xs, nb, out};
            if (mode == SCALES_Q4K)
                q4k_one_row(N, a);
            else if (pass == Q4_ROWS)
                q4_one_row(N, a);
            else
                q4_one_row_two(N, a);
            if (xp != stack_rows) free(xp);
            return;
        }
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *wrow = wq + n * nb * (QK / 2);
            const char *d = (const char *)wd + n * nb * scale_bytes;
            const char *m = wm == NULL ? NULL : (const char *)wm + n * nb * scale_bytes;
            float d32[expanded], m32[expanded];
            const int rmode = row_scales(mode, &d, &m, nb, d32, m32);
            for (int64_t r = 0; r < M; r++)
                out[r * ldo + n] =
                    rmode == SCALES_F16_SYM
                        ? dot_row_q4(wrow, d, m, xp + r * K, xd + r * nb, xs + r * nb, nb, SCALES_F16_SYM)
                    : rmode == SCALES_F16
                        ? dot_row_q4(wrow, d, m, xp + r * K, xd + r * nb, xs + r * nb, nb, SCALES_F16)
                        : dot_row_q4(wrow, d, m, xp + r * K, xd + r * nb, xs + r * nb, nb, SCALES_F32);
        }
        if (xp != stack_rows) free(xp);
        return;
    }
#endif
#if defined(__AVX2__) && !defined(ECQ_AVX512)
    if (M == 1) { /* a decode step's row */
        int8_t xp[K];
        permute_pairs(xq, K, xp);
        const struct q4_args a = {wq, wd, wm, mode, xp, xd, xs, nb, out};
        /* Q4_K two rows a pass at most: with its offsets' accumulators four rows' sums
         * spill from AVX2's sixteen registers (one_row_cycles.py) */
        const int pass = mode == SCALES_Q4K && q4_pass_rows(nb) > 2 ? 2 : q4_pass_rows(nb);
        if (pass == Q4_ROWS)
            q4_one_row_avx2(N, a);
        else
            q4_one_row_avx2_two(N, pass, a);
        return;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = wq + n * nb * (QK / 2);
        const char *d = (const char *)wd + n * nb * scale_bytes;
        const char *m = wm == NULL ? NULL : (const char *)wm + n * nb * scale_bytes;
        float d32[expanded], m32[expanded];
        const int rmode = row_scales(mode, &d, &m, nb, d32, m32);
        const int half = rmode != SCALES_F32;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int rows = M - r0 < ROWS ? (int)(M - r0) : ROWS;
            float offset[ROWS] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                _mm_prefetch((const char *)(wrow + b * (QK / 2)) + PREFETCH_BYTES, _MM_HINT_T0);
                const __m256i w = unpack_nibbles(wrow + b * (QK / 2));
                for (int r = 0; r < rows; r++) {
                    const int64_t row = r0 + r;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + row * K + b * QK));
                    const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(w, x));
                    acc[r] = _mm256_fmadd_ps(
                        dot, _mm256_set1_ps(scale_at(d, b, half) * xd[row * nb + b]), acc[r]);
                    offset[r] += offset_at(m, d, b, rmode) * xs[row * nb + b];
                }
            }
            for (int r = 0; r < rows; r++) out[(r0 + r) * ldo + n] = hsum(acc[r]) + offset[r];
#else
            for (int r = 0; r < rows; r++) {
                const int64_t row = r0 + r;
                float total = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *q = wrow + b * (QK / 2);
                    const int8_t *x = xq + row * K + b * QK;
                    int dot = 0;
                    for (int i = 0; i < QK / 2; i++)
                        dot += (q[i] & 0x0F) * x[i] + (q[i] >> 4) * x[i + QK / 2];
                    total += scale_at(d, b, half) * xd[row * nb + b] * (float)dot;
                    offset[r] += offset_at(m, d, b, rmode) * xs[row * nb + b];
                }
                out[row * ldo + n] = total + offset[r];
            }
#endif
        }
    }
}

#if defined(__AVX2__)
/* 8-bit weight rows a pass of the one-row kernel (dot_rows_q8): Q8_ROWS where their
 * bytes lie between Q8_PASS_MIN_BYTES and Q8_PASS_BYTES, else one at a time. A pass
 * prefetches the next pass's bytes, so its bytes are its prefetch distance: from memory
 * (where a decode step reads its weights) a pass of short rows (the LM head of a small
 * model: 576 inputs) read slower than one row at a time, whose prefetch runs
 * PREFETCH_BYTES ahead, and four rows a pass read slower still at every width
 * (benchmarks/RESULTS.md, "The LM head of a small model one row at a time").
 * A pass's stream reaches the first line of the next pass's last row only a row's bytes
 * (of the pass's reading) before its load, so it starts q8_beyond bytes further on: each
 * line is prefetched at least PREFETCH_BYTES before its load, as one row at a time does
 * (benchmarks/RESULTS.md, "The Q8_0 pass's prefetch as far ahead as one row's"). */
#ifndef Q8_ROWS
#define Q8_ROWS 2
#endif
#ifndef Q8_PASS_BYTES
#define Q8_PASS_BYTES Q4_PASS_BYTES
#endif
#ifndef Q8_PASS_MIN_BYTES
#define Q8_PASS_MIN_BYTES 3072
#endif

/* The weight rows and the activation row of a one-row 8-bit product, for its passes. */
struct q8_args {
    const int8_t *wq;
    const void *wd;
    int half;
    const int8_t *xq;
    const float *xd;
    int64_t nb;
    float *out;
};

static inline int q8_pass_rows(int64_t nb) {
    const int64_t pass_bytes = Q8_ROWS * nb * QK;
    return pass_bytes >= Q8_PASS_MIN_BYTES && pass_bytes <= Q8_PASS_BYTES ? Q8_ROWS : 1;
}

/* How far beyond the next pass's first byte a pass of rows of ``row_bytes`` prefetches. */
static inline int64_t q8_beyond(int64_t row_bytes) {
    return PREFETCH_BYTES > row_bytes ? PREFETCH_BYTES - row_bytes : 0;
}

/* A block of 8-bit weights at ``w`` times the activations ``x``, the integer sums per
 * lane, as floats: |w| as unsigned bytes times x with w's sign (gemm_q8's way). */
static inline __attribute__((always_inline)) __m256 q8_dot(const int8_t *w, __m256i x) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    return _mm256_cvtepi32_ps(dot_u8_s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv)));
}

/* ``rows`` outputs (a constant in each inlined copy) of consecutive 8-bit weight rows from
 * ``wrow`` (scales ``d``, float16 where ``half``) against one activation row, into ``out``.
 * Each row's sum is gemm_q8's (one accumulator, block after block), so each output has
 * its bits; that sum is one chain of dependent FMAs, a block's each, so one row alone
 * waits on the FMA latency and several at once do not. */
static inline __attribute__((always_inline)) void dot_rows_q8(int rows, const int8_t *wrow,
                                                              const char *d, int half,
                                                              const int8_t *xq, const float *xd,
                                                              int64_t nb, float *out) {
    const int64_t wstride = nb * QK, sstride = nb * (half ? 2 : 4); /* a row's bytes */
    const int8_t *next = wrow + rows * wstride + q8_beyond(wstride); /* the next pass's */
    __m256 acc[Q8_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    /* eight blocks' scale products d_w d_x at a time, one vector multiply a row, each
     * block's spread over the lanes by one permute */
    for (; b + 8 <= nb; b += 8) {
        const __m256 xd8 = _mm256_loadu_ps(xd + b);
        __m256 sx[Q8_ROWS];
        for (int r = 0; r < rows; r++)
            sx[r] = _mm256_mul_ps(scales8(d + r * sstride, b, half), xd8);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (b + j) * QK));
            for (int r = 0; r < rows; r++) {
                const int8_t *w = wrow + r * wstride + (b + j) * QK;
                if (rows == 1)
                    _mm_prefetch((const char *)w + PREFETCH_BYTES, _MM_HINT_T0);
                else if (!(r & 1)) /* the next pass's bytes as one ascending stream */
                    _mm_prefetch((const char *)next + ((b + j) * rows + r) * QK, _MM_HINT_T0);
                acc[r] = _mm256_fmadd_ps(q8_dot(w, x),
                                         _mm256_permutevar8x32_ps(sx[r], _mm256_set1_epi32(j)),
                                         acc[r]);
            }
        }
    }
    for (; b < nb; b++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(
                q8_dot(wrow + r * wstride + b * QK, x),
                _mm256_set1_ps(scale_at(d + r * sstride, b, half) * xd[b]), acc[r]);
    }
    for (int r = 0; r < rows; r++) out[r] = hsum(acc[r]);
}

/* dot_rows_q8 for ``rows`` weight rows from n0, ``half`` made a constant of its copies. */
static inline __attribute__((always_inline)) void q8_rows(int rows, const struct q8_args *a,
                                                          int64_t n0) {
    const int8_t *w = a->wq + n0 * a->nb * QK;
    const char *d = (const char *)a->wd + n0 * a->nb * (a->half ? 2 : 4);
    if (a->half)
        dot_rows_q8(rows, w, d, 1, a->xq, a->xd, a->nb, a->out + n0);
    else
        dot_rows_q8(rows, w, d, 0, a->xq, a->xd, a->nb, a->out + n0);
}

static inline __attribute__((always_inline)) void q8_pass(const void *args,
                                                          int64_t n0, int rows) {
    if (rows == Q8_ROWS)
        q8_rows(Q8_ROWS, args, n0);
    else
        q8_rows(1, args, n0);
}

static __attribute__((noinline)) void q8_one_row(int64_t N, struct q8_args a) {
    ROW_PASSES(N, Q8_ROWS, q8_pass, &a);
}

/* the rows one at a time, each prefetching PREFETCH_BYTES ahead of its own loads */
static __attribute__((noinline)) void q8_one_row_each(int64_t N, struct q8_args a) {
    ROW_PASSES(N, 1, q8_pass, &a);
}
#endif

/* The same for 8-bit weights: wq [N, K] signed bytes, wd [N, nb] float32 or, where
 * ``half`` (a constant in each inlined copy), float16. */
static inline __attribute__((always_inline)) void gemm_q8(int64_t M, int64_t N, int64_t K,
                                                          const int8_t *wq, const void *wd,
                                                          int half, const int8_t *xq,
                                                          const float *xd, float *out,
                                                          int64_t ldo) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wrow = wq + n * K;
        const char *d = (const char *)wd + n * nb * (half ? 2 : 4);
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int rows = M - r0 < ROWS ? (int)(M - r0) : ROWS;
#if defined(__AVX2__)
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                _mm_prefetch((const char *)(wrow + b * QK) + PREFETCH_BYTES, _MM_HINT_T0);
                /* |w| as unsigned bytes times x with w's sign: the product of two signed
                 * bytes through the unsigned-by-signed instruction. */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wrow + b * QK));
                const __m256i wabs = _mm256_sign_epi8(w, w);
                for (int r = 0; r < rows; r++) {
                    const int64_t row = r0 + r;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + row * K + b * QK));
                    const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(wabs, _mm256_sign_epi8(x, w)));
                    acc[r] = _mm256_fmadd_ps(
                        dot, _mm256_set1_ps(scale_at(d, b, half) * xd[row * nb + b]), acc[r]);
                }
            }
            for (int r = 0; r < rows; r++) out[(r0 + r) * ldo + n] = hsum(acc[r]);
#else
            for (int r = 0; r < rows; r++) {
                const int64_t row = r0 + r;
                float total = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    const int8_t *q = wrow + b * QK;
                    const int8_t *x = xq + row * K + b * QK;
                    int dot = 0;
                    for (int i = 0; i < QK; i++) dot += q[i] * x[i];
                    total += scale_at(d, b, half) * xd[row * nb + b] * (float)dot;
                }
                out[row * ldo + n] = total;
            }
#endif
        }
    }
}

/* The weight rows a pass of the one-row Q4_0 / Q4_1 product (this build's) takes at K
 * inputs (1: one at a time), for the tests. */
int ecq_q4_pass_rows(int64_t K) {
#if defined(ECQ_AVX512)
    return q4_avx512_pass_rows(K / QK);
#else
    return q4_pass_rows(K / QK);
#endif
}

/* The weight rows a pass of the one-row 8-bit product takes at K inputs (1: one at a
 * time), for the tests. */
int ecq_q8_pass_rows(int64_t K) {
#if defined(__AVX2__)
    return q8_pass_rows(K / QK);
#else
    (void)K;
    return 1;
#endif
}

/* The fewest bytes of its reading by which the one-row 8-bit product prefetches a weight
 * line before loading it, at K inputs (0: it prefetches none), for the tests: one row at
 * a time PREFETCH_BYTES; a pass's stream a row's bytes plus q8_beyond. */
int64_t ecq_q8_prefetch_lead(int64_t K) {
#if defined(__AVX2__)
    return q8_pass_rows(K / QK) > 1 ? K + q8_beyond(K) : PREFETCH_BYTES;
#else
    (void)K;
    return 0;
#endif
}

void ecq_gemm_q8(int64_t M, int64_t N, int64_t K, const int8_t *wq, const void *wd, int half,
                 const int8_t *xq, const float *xd, float *out, int64_t ldo) {
#if defined(__AVX2__)
    if (M == 1) { /* a decode step's row */
        const struct q8_args a = {wq, wd, half, xq, xd, K / QK, out};
        if (q8_pass_rows(K / QK) == Q8_ROWS)
            q8_one_row(N, a);
        else
            q8_one_row_each(N, a);
        return;
    }
#endif
    if (half)
        gemm_q8(M, N, K, wq, wd, 1, xq, xd, out, ldo);
    else
        gemm_q8(M, N, K, wq, wd, 0, xq, xd, out, ldo);
}

/* The float32 weight [N, K] of 4-bit blocks (for many rows of activations, where one
 * float GEMM beats the integer dot products). */
void ecq_dequantize_q4(int64_t N, int64_t K, const uint8_t *wq, const float *wd,
                       const float *wm, float *out) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = wq + (n * nb + b) * (QK / 2);
            const float d = wd[n * nb + b], m = wm[n * nb + b];
            float *o = out + n * K + b * QK;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = (float)(q[i] & 0x0F) * d + m;
                o[i + QK / 2] = (float)(q[i] >> 4) * d + m;
            }
        }
    }
}

/* The same for Q4_K: wh [N, nb / 8, K4_SCALE_BYTES] the super-blocks' scale bytes. */
void ecq_dequantize_q4k(int64_t N, int64_t K, const uint8_t *wq, const uint8_t *wh,
                        float *out) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const char *dp = (const char *)wh + n * nb * 2, *mp = NULL;
        float d[nb], m[nb];
        row_scales(SCALES_Q4K, &dp, &mp, nb, d, m);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *q = wq + (n * nb + b) * (QK / 2);
            float *o = out + n * K + b * QK;
            for (int i = 0; i < QK / 2; i++) {
                o[i] = (float)(q[i] & 0x0F) * d[b] + m[b];
                o[i + QK / 2] = (float)(q[i] >> 4) * d[b] + m[b];
            }
        }
    }
}

void ecq_dequantize_q8(int64_t N, int64_t K, const int8_t *wq, const float *wd, float *out) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            const float d = wd[n * nb + b];
            for (int i = 0; i < QK; i++) out[n * K + b * QK + i] = (float)wq[n * K + b * QK + i] * d;
        }
    }
}

/* out [M, N] = x [M, K] (row stride ldx) times the blocks' weight, activations quantized
 * here: one call per projection (kind 4: wq, wd, wm as ``ecq_gemm_q4``, ECQ_Q4_HALF the
 * same with float16 wd, wm, ECQ_Q4_0_HALF float16 wd with wm unused (offsets -8 wd: a
 * decode step reads a tenth fewer bytes of Q4_0), ECQ_Q4_K wd Q4_K's scale bytes and wm
 * unused; 8: ``ecq_gemm_q8``, wm unused, ECQ_Q8_HALF the same with float16 wd). Returns
 * 0, or -1 when the scratch memory cannot be had. */
int ecq_linear(int kind, const float *x, int64_t ldx, int64_t M, int64_t N, int64_t K,
               const void *wq, const void *wd, const void *wm, float *out, int64_t ldo) {
    const int64_t nb = K / QK;
    int8_t stack_q[4 * 4096];
    float stack_s[2 * 4 * 128];
    const int small = M * K <= (int64_t)sizeof(stack_q) && 2 * M * nb <= 2 * 4 * 128;
    int8_t *xq = small ? stack_q : (int8_t *)malloc(M * K);
    float *xd = small ? stack_s : (float *)malloc(2 * M * nb * sizeof(float));
    if (xq == NULL || xd == NULL) {
        if (!small) free(xq), free(xd);
        return -1;
    }
    float *xs = xd + M * nb;
    ecq_quantize_rows(x, ldx, M, K, xq, xd, xs);
    if (kind == 8 || kind == ECQ_Q8_HALF)
        ecq_gemm_q8(M, N, K, (const int8_t *)wq, wd, kind == ECQ_Q8_HALF, xq, xd, out, ldo);
    else
        ecq_gemm_q4(M, N, K, (const uint8_t *)wq, wd, wm,
                    kind == ECQ_Q4_K      ? SCALES_Q4K
                    : kind == ECQ_Q4_HALF ? SCALES_F16
                    : kind == ECQ_Q4_0_HALF ? SCALES_F16_SYM
                                          : SCALES_F32,
                    xq, xd, xs, out, ldo);
    if (!small) free(xq), free(xd);
    return 0;
}
