/* The K-quant product over the byte-a-value layout (one signed byte a value, a float32
 * scale per 16 values and an offset per 32), kept as the reference the packed kernel of
 * builtin_cpu/enginecore_cpu/kquant_kernels.c must equal bit for bit (tests/models/test_quantized_formats.py
 * builds it beside a copy of quant_simd.h). Its loops are the ones the packed kernel
 * keeps: the same integer dot products per lane and the same float operations in the
 * same order.
 */
#include <stdint.h>
#include <math.h>
#include "quant_simd.h"

#define QK 32
#define HALF 16
#define ROWS 4


/* out[r, n] (row stride ldo) = sum_k x[r, k] w[n, k]: wq [N, K] signed bytes, wd
 * [N, K/16], wm [N, K/32]. */
void eck_gemm_s16_bytes(int64_t M, int64_t N, int64_t K, const int8_t *wq, const float *wd,
                        const float *wm, const int8_t *xq, const float *xd, const float *xs,
                        float *out, int64_t ldo) {
    const int64_t nb = K / QK;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wrow = wq + n * K;
        const float *d = wd + n * 2 * nb, *m = wm + n * nb;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int rows = M - r0 < ROWS ? (int)(M - r0) : ROWS;
            float offset[ROWS] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                _mm_prefetch((const char *)(wrow + b * QK) + PREFETCH_BYTES, _MM_HINT_T0);
                /* |w| as unsigned bytes times x with w's sign (as quant_kernels' Q8_0);
                 * lanes 0-3 of the dot product hold the first half, 4-7 the second. */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(wrow + b * QK));
                const __m256i wabs = _mm256_sign_epi8(w, w);
                const __m256 scales =
                    _mm256_set_m128(_mm_set1_ps(d[2 * b + 1]), _mm_set1_ps(d[2 * b]));
                for (int r = 0; r < rows; r++) {
                    const int64_t row = r0 + r;
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + row * K + b * QK));
                    const __m256 dot = _mm256_cvtepi32_ps(dot_u8_s8(wabs, _mm256_sign_epi8(x, w)));
                    const __m256 scale = _mm256_mul_ps(scales, _mm256_set1_ps(xd[row * nb + b]));
                    acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
                    offset[r] += m[b] * xs[row * nb + b];
                }
            }
            for (int r = 0; r < rows; r++) out[(r0 + r) * ldo + n] = hsum(acc[r]) + offset[r];
#else
            for (int r = 0; r < rows; r++) {
                const int64_t row = r0 + r;
                float total = 0.f;
                for (int64_t b = 0; b < nb; b++) {
                    const int8_t *q = wrow + b * QK;
                    const int8_t *x = xq + row * K + b * QK;
                    int dot0 = 0, dot1 = 0;
                    for (int i = 0; i < HALF; i++) {
                        dot0 += q[i] * x[i];
                        dot1 += q[i + HALF] * x[i + HALF];
                    }
                    total += xd[row * nb + b] * (d[2 * b] * (float)dot0 + d[2 * b + 1] * (float)dot1);
                    offset[r] += m[b] * xs[row * nb + b];
                }
                out[row * ldo + n] = total + offset[r];
            }
#endif
        }
    }
}
