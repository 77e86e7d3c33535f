/* Matrix products over block-quantized weights (GGUF's Q8_0, Q4_0 and Q4_1), for
 * enginecore's ``gguf`` linear method.
 *
 * Weights stay in 32-element blocks as the file stores them: 4-bit values (two per byte,
 * byte j holds element j in its low nibble and element j + 16 in its high one) with a
 * scale d and an offset m per block (Q4_0 is Q4_1 with m = -8 d), or signed bytes with a
 * scale (Q8_0). Activations are quantized to signed bytes per block of 32 with their own
 * scale, as llama.cpp does, so each block's dot product is an integer one: VNNI's
 * vpdpbusd where the CPU has it, AVX2's vpmaddubsw + vpmaddwd elsewhere, a plain loop
 * off x86. Each output sums d_w d_x <q_w, q_x> over the blocks, plus m_w d_x sum(q_x) for
 * the 4-bit formats. Rows of the activations are taken four at a time, so a weight block
 * read from memory serves all four.
 */
#include <stdint.h>
#include <math.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32

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

static inline __m256i unpack_nibbles(const uint8_t *q) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    return _mm256_set_m128i(hi, lo);
}
#endif

#define ROWS 4

/* out[r, n] (row stride ldo) = sum_k x[r, k] w[n, k] for 4-bit weights: wq [N, nb, 16],
 * wd, wm [N, nb]. */
void ecq_gemm_q4(int64_t M, int64_t N, int64_t K, const uint8_t *wq, const float *wd,
                 const float *wm, const int8_t *xq, const float *xd, const float *xs,
                 float *out, int64_t ldo) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wrow = wq + n * nb * (QK / 2);
        const float *d = wd + n * nb, *m = wm + n * nb;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int rows = M - r0 < ROWS ? (int)(M - r0) : ROWS;
            float offset[ROWS] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const __m256i w = unpack_nibbles(wrow + b * (QK / 2));
                for (int r = 0; r < rows; r++) {
                    const int64_t row = r0 + r;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + row * K + b * QK));
                    const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(w, x));
                    acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d[b] * xd[row * nb + b]), acc[r]);
                    offset[r] += m[b] * xs[row * nb + b];
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
                    total += d[b] * xd[row * nb + b] * (float)dot;
                    offset[r] += m[b] * xs[row * nb + b];
                }
                out[row * ldo + n] = total + offset[r];
            }
#endif
        }
    }
}

/* The same for 8-bit weights: wq [N, K] signed bytes, wd [N, nb]. */
void ecq_gemm_q8(int64_t M, int64_t N, int64_t K, const int8_t *wq, const float *wd,
                 const int8_t *xq, const float *xd, float *out, int64_t ldo) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wrow = wq + n * K;
        const float *d = wd + n * nb;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int rows = M - r0 < ROWS ? (int)(M - r0) : ROWS;
#if defined(__AVX2__)
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                /* |w| as unsigned bytes times x with w's sign: the product of two signed
                 * bytes through the unsigned-by-signed instruction. */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wrow + b * QK));
                const __m256i wabs = _mm256_sign_epi8(w, w);
                for (int r = 0; r < rows; r++) {
                    const int64_t row = r0 + r;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + row * K + b * QK));
                    const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(wabs, _mm256_sign_epi8(x, w)));
                    acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d[b] * xd[row * nb + b]), acc[r]);
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
                    total += d[b] * xd[row * nb + b] * (float)dot;
                }
                out[row * ldo + n] = total;
            }
#endif
        }
    }
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
