/* Fused float32 kernels for the CPU decode path (see cpu_kernels.py).
 *
 * Each replaces a chain of small eager torch ops whose per-op cost (dispatch, allocation,
 * waking the OpenMP team) dominates a small-batch step. Rounding follows the reference
 * formulas term by term; built with -ffp-contract=off so no multiply-add is fused.
 * Functions returning int check their indices first and return -1, writing nothing, when
 * one is out of range.
 * Parallel loops use the OpenMP runtime torch already loaded (same SONAME), so the
 * calling thread keeps a single thread team.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* residual[t] += x[t] (when add is set), then out[t] = residual[t] / rms * weight, with
 * rms = sqrt(mean(residual[t]^2) + eps). Without add, the normed input is x itself. */
void ec_rms_norm(const float *x, int64_t x_stride, float *residual, int64_t res_stride, int add,
                 const float *weight, float *out, int64_t rows, int64_t dim, float eps,
                 int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= 32) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *src = x + t * x_stride;
        if (add) {
            float *res = residual + t * res_stride;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) res[i] = res[i] + src[i];
            src = res;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += src[i] * src[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *dst = out + t * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) dst[i] = weight[i] * (src[i] * inv);
    }
}

/* Neox rotary in place on x [T, H, D] (token stride given, heads contiguous). The tables
 * are [max_pos, D] laid out as [cos, cos] and [-sin, sin]:
 * x[i] * cos[i] + x[i ^ half] * sin[i], the reference's q * cos + rotate_half(q) * sin. */
int ec_rotary(float *x, int64_t tok_stride, int64_t tokens, int64_t heads, int64_t dim,
              const int64_t *positions, const float *cos_table, const float *sin_table,
              int64_t max_pos, int nthreads) {
    int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
#pragma omp parallel for num_threads(nthreads) if (tokens >= 32) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * dim;
        const float *s = sin_table + positions[t] * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * tok_stride + h * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    return 0;
}

/* e^x for x in float range, vectorizable (libm's expf is a call per element): Cody-Waite
 * range reduction x = n ln2 + r, a degree-5 polynomial for e^r (Cephes' coefficients,
 * about 1 ulp), then scaling by 2^n through the exponent bits. */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln2): adding and removing 1.5 * 2^23 rounds to an integer; floorf
     * would not vectorize. */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) << 23};
    return y * scale.f;
}

/* out[t, i] = silu(x[t, i]) * x[t, inter + i] for x [T, 2 * inter] (gate then up). */
void ec_silu_and_mul(const float *x, float *out, int64_t tokens, int64_t inter, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (tokens >= 16) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *g = x + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}

/* Scatter T tokens' K and V (rows of `width` floats at the given token strides) into the
 * paged cache halves, token t to slot slots[t]. */
int ec_write_kv(float *k_cache, float *v_cache, const float *k, int64_t k_stride,
                const float *v, int64_t v_stride, const int64_t *slots, int64_t tokens,
                int64_t width, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        memcpy(k_cache + slots[t] * width, k + t * k_stride, width * sizeof(float));
        memcpy(v_cache + slots[t] * width, v + t * v_stride, width * sizeof(float));
    }
    return 0;
}

/* Append this step's K/V (k, v [n, kv_heads, D] at the given token strides) to the
 * decode mirror's halves [rows, kv_heads, cap, D]: row r's token goes to position
 * lens[r] - 1 of each of its heads. */
int ec_mirror_append(float *k_cache, float *v_cache, const float *k, int64_t k_stride,
                     const float *v, int64_t v_stride, const int64_t *lens, int64_t n,
                     int64_t kv_heads, int64_t dim, int64_t cap) {
    for (int64_t r = 0; r < n; r++)
        if (lens[r] < 1 || lens[r] > cap) return -1;
    for (int64_t r = 0; r < n; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = ((r * kv_heads + h) * cap + lens[r] - 1) * dim;
            memcpy(k_cache + at, k + r * k_stride + h * dim, dim * sizeof(float));
            memcpy(v_cache + at, v + r * v_stride + h * dim, dim * sizeof(float));
        }
    }
    return 0;
}
