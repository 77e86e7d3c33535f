/* bfloat16 weights times a few bfloat16 activation rows (decode steps), float32 sums.
 *
 * out[m, n] = bf16(sum_k x[m, k] w[n, k] + bias[n]) for a weight [N, K] with K contiguous.
 * AVX512-BF16's vdpbf16ps multiplies pairs of bfloat16 values exactly and adds them into
 * float32 lanes, so each output is float32 accumulation rounded to bfloat16 once, as
 * torch's bfloat16 GEMM does. At a handful of rows the product reads every weight once
 * and does little else, so the loop is built around the weight stream: tiles of four
 * weight rows against up to four activation rows (16 accumulators), software prefetch
 * ahead of the stream, OpenMP over tiles of output rows.
 *
 * Every output is the same chain of instructions over k whatever the tile it falls in,
 * so a row of activations gets the same bits alone and in any batch.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "bf16_gemv.c needs AVX512-BF16 (built with -mavx512bf16 where the CPU has it)"
#endif

/* How far ahead of the weight bytes being multiplied to prefetch: the hardware prefetcher
 * alone leaves the loop waiting on loads. At 4 and 8 rows of a 1536 x 576 weight, 4 KB
 * measured 25-30% faster than 2 KB or none; 8 and 16 KB about the same (and a hint to L2 only). */
#ifndef ECB_PREFETCH_BYTES
#define ECB_PREFETCH_BYTES 4096
#endif
#define ECB_PREFETCH (ECB_PREFETCH_BYTES / 2) /* in bfloat16 elements */
#define RN 4                                 /* weight rows per tile */
#define RM 4                                 /* activation rows per pass over a tile */

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, NaN kept a (quiet) NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* sums[n * RM + m] = <w row n, x row m> for rn weight rows and rm activation rows
 * (constants in each inlined copy). */
static inline __attribute__((always_inline)) void dot_tile(const uint16_t *x, int64_t ldx,
                                                           const int rm, const uint16_t *w,
                                                           int64_t ldw, const int rn, int64_t K,
                                                           int prefetch, float *sums) {
    __m512 acc[RN][RM];
    for (int n = 0; n < rn; n++)
        for (int m = 0; m < rm; m++) acc[n][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[RN];
        for (int n = 0; n < rn; n++) {
            if (prefetch && ECB_PREFETCH)
                _mm_prefetch((const char *)(w + n * ldw + k + ECB_PREFETCH), _MM_HINT_T0);
            wv[n] = _mm512_loadu_si512((const void *)(w + n * ldw + k));
        }
        for (int m = 0; m < rm; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k));
            for (int n = 0; n < rn; n++)
                acc[n][m] = _mm512_dpbf16_ps(acc[n][m], (__m512bh)wv[n], xv);
        }
    }
    if (k < K) { /* the last K % 32 values; the masked-off lanes multiply zeros */
        const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512i wv[RN];
        for (int n = 0; n < rn; n++) wv[n] = _mm512_maskz_loadu_epi16(mask, w + n * ldw + k);
        for (int m = 0; m < rm; m++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
            for (int n = 0; n < rn; n++)
                acc[n][m] = _mm512_dpbf16_ps(acc[n][m], (__m512bh)wv[n], xv);
        }
    }
    for (int n = 0; n < rn; n++)
        for (int m = 0; m < rm; m++) sums[n * RM + m] = _mm512_reduce_add_ps(acc[n][m]);
}

/* One tile of rn weight rows (RN, or 1 for the last N % RN) against every activation row. */
static inline __attribute__((always_inline)) void tile_rows(const uint16_t *x, int64_t ldx,
                                                            int64_t M, const uint16_t *w,
                                                            int64_t ldw, const int rn, int64_t K,
                                                            const uint16_t *bias, uint16_t *out,
                                                            int64_t ldo) {
    float sums[RN * RM];
    for (int64_t m0 = 0; m0 < M; m0 += RM) {
        const int rows = M - m0 < RM ? (int)(M - m0) : RM;
        const uint16_t *xm = x + m0 * ldx;
        const int prefetch = m0 == 0; /* later passes find the tile in cache */
        switch (rows) {
        case 4: dot_tile(xm, ldx, 4, w, ldw, rn, K, prefetch, sums); break;
        case 3: dot_tile(xm, ldx, 3, w, ldw, rn, K, prefetch, sums); break;
        case 2: dot_tile(xm, ldx, 2, w, ldw, rn, K, prefetch, sums); break;
        default: dot_tile(xm, ldx, 1, w, ldw, rn, K, prefetch, sums); break;
        }
        for (int n = 0; n < rn; n++) {
            const float b = bias != NULL ? bf16_to_float(bias[n]) : 0.f;
            for (int m = 0; m < rows; m++)
                out[(m0 + m) * ldo + n] = float_to_bf16(sums[n * RM + m] + b);
        }
    }
}

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times w [N, K] (row stride ldw)
 * transposed, plus bias [N] (NULL for none); all bfloat16 bits. */
void ecb_linear(const uint16_t *x, int64_t ldx, int64_t M, int64_t N, int64_t K,
                const uint16_t *w, int64_t ldw, const uint16_t *bias, uint16_t *out,
                int64_t ldo, int nthreads) {
    const int64_t tiles = (N + RN - 1) / RN;
#pragma omp parallel for num_threads(nthreads) if (N * K >= 65536) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * RN;
        const uint16_t *b = bias != NULL ? bias + n0 : NULL;
        if (n0 + RN <= N)
            tile_rows(x, ldx, M, w + n0 * ldw, ldw, RN, K, b, out + n0, ldo);
        else
            for (int64_t n = n0; n < N; n++)
                tile_rows(x, ldx, M, w + n * ldw, ldw, 1, K, bias != NULL ? bias + n : NULL,
                          out + n, ldo);
    }
}
