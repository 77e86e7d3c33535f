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
#include <stdlib.h>
#include <string.h>

#include "kv_types.h"

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

#ifdef __AVX2__
#include <immintrin.h>
/* exp_poly on 8 lanes: the same operations in the same order, so the same bits. Left to
 * itself, GCC vectorizes SiLU's clamp as blends around a second division per vector, 2.4x
 * slower. */
static inline __m256 exp_poly8(__m256 x) {
    /* the constant first: a NaN lane passes through, as through the scalar compares */
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));
    const __m256 round = _mm256_set1_ps(12582912.0f);
    const __m256 n = _mm256_sub_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), round), round);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

#ifdef __AVX2__
/* silu(g) * u on 8 lanes: the same operations as the scalar tail below, so the same bits,
 * here and in the GEMM that applies it to its gate and up accumulators. */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp_poly8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
#endif

/* out[t, i] = silu(x[t, i]) * x[t, inter + i] for x [T, 2 * inter] (gate then up). */
void ec_silu_and_mul(const float *x, float *out, int64_t tokens, int64_t inter, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (tokens >= 16) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *g = x + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        int64_t i = 0;
#ifdef __AVX2__
        for (; i + 8 <= inter; i += 8)
            _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}

/* Scatter T tokens' K and V (rows of `width` floats at the given token strides) into the
 * paged cache halves (elements of type kv_type, EC_KV_*), token t to slot slots[t]. */
int ec_write_kv(void *k_cache, void *v_cache, const float *k, int64_t k_stride,
                const float *v, int64_t v_stride, const int64_t *slots, int64_t tokens,
                int64_t width, int64_t num_slots, int nthreads, int kv_type) {
    if (!ec_kv_valid(kv_type)) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int64_t row = width * ec_kv_size(kv_type);
#pragma omp parallel for num_threads(nthreads) if (tokens * width >= 32768) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        ec_kv_store((char *)k_cache + slots[t] * row, k + t * k_stride, width, kv_type);
        ec_kv_store((char *)v_cache + slots[t] * row, v + t * v_stride, width, kv_type);
    }
    return 0;
}

/* The decode mirror's layout. Each half (K, V) of a layer holds, per row, its positions
 * in chunks of `chunk` positions, chunk_stride bytes apart; a chunk holds each KV head's
 * `chunk` positions [chunk, dim] side by side, head after head. Rows are row_stride bytes
 * apart. (One chunk of `cap` positions is the dense [rows, kv_heads, cap, dim].) The
 * offset in bytes of row r's KV head h at position p, pos_bytes per position: */
static inline int64_t mirror_at(int64_t r, int64_t h, int64_t p, int64_t row_stride,
                                int64_t chunk, int64_t chunk_stride, int64_t pos_bytes) {
    return r * row_stride + p / chunk * chunk_stride + (h * chunk + p % chunk) * pos_bytes;
}

/* Append this step's K/V (k, v [n, kv_heads, D] at the given token strides) to the
 * decode mirror's halves (see mirror_at; `cap` positions a row): row r's token goes to
 * position lens[r] - 1 of each of its heads. */
int ec_mirror_append(void *k_cache, void *v_cache, const float *k, int64_t k_stride,
                     const float *v, int64_t v_stride, const int64_t *lens, int64_t n,
                     int64_t kv_heads, int64_t dim, int64_t row_stride, int64_t chunk,
                     int64_t chunk_stride, int64_t cap, int nthreads, int kv_type) {
    if (!ec_kv_valid(kv_type) || chunk < 1) return -1;
    for (int64_t r = 0; r < n; r++)
        if (lens[r] < 1 || lens[r] > cap) return -1;
    const int64_t es = ec_kv_size(kv_type);
#pragma omp parallel for num_threads(nthreads) if (n * kv_heads * dim >= 32768) \
    schedule(static)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t at =
                mirror_at(r, h, lens[r] - 1, row_stride, chunk, chunk_stride, dim * es);
            ec_kv_store((char *)k_cache + at, k + r * k_stride + h * dim, dim, kv_type);
            ec_kv_store((char *)v_cache + at, v + r * v_stride + h * dim, dim, kv_type);
        }
    }
    return 0;
}

/* Copy n requests' first lens[i] positions of K and V from the paged cache halves
 * [num_blocks, block_size, kv_heads, D] into decode-mirror rows row0 + i of the mirror
 * halves (see mirror_at; `cap` positions a row; both of type kv_type); request i's block
 * ids are table[i * table_stride ..]. */
int ec_mirror_fill(void *mk, void *mv, const void *ck, const void *cv, const int64_t *table,
                   int64_t table_stride, const int64_t *lens, int64_t n, int64_t row0,
                   int64_t mirror_rows, int64_t kv_heads, int64_t dim, int64_t row_stride,
                   int64_t chunk, int64_t chunk_stride, int64_t cap, int64_t block_size,
                   int64_t num_blocks, int nthreads, int kv_type) {
    if (!ec_kv_valid(kv_type) || row0 < 0 || row0 + n > mirror_rows || chunk < 1) return -1;
    const int64_t es = ec_kv_size(kv_type), row = dim * es;
    for (int64_t i = 0; i < n; i++) {
        if (lens[i] < 0 || lens[i] > cap || lens[i] > table_stride * block_size) return -1;
        for (int64_t b = 0; b * block_size < lens[i]; b++) {
            const int64_t id = table[i * table_stride + b];
            if (id < 0 || id >= num_blocks) return -1;
        }
    }
#pragma omp parallel for num_threads(nthreads) if (n * kv_heads >= 2) schedule(dynamic, 1)
    for (int64_t u = 0; u < n * kv_heads; u++) {
        const int64_t i = u / kv_heads, h = u % kv_heads;
        for (int64_t p = 0; p < lens[i]; p++) {
            const int64_t slot = table[i * table_stride + p / block_size] * block_size +
                                 p % block_size;
            const int64_t at = mirror_at(row0 + i, h, p, row_stride, chunk, chunk_stride, row);
            memcpy((char *)mk + at, (const char *)ck + (slot * kv_heads + h) * row, row);
            memcpy((char *)mv + at, (const char *)cv + (slot * kv_heads + h) * row, row);
        }
    }
    return 0;
}

/* Decode attention over the decode mirror, each row over its own length (SDPA would pad
 * every row to the longest). q [n, kv_heads * group, dim] (heads contiguous, token stride
 * q_stride): the `group` query heads of KV head h are h * group .. h * group + group - 1.
 * The mirror halves are laid out as mirror_at says; row r attends positions
 * [max(0, lens[r] - window), lens[r]) (window 0: all). One pass over K and V in blocks
 * of EC_BLOCK positions with an online softmax: the running maximum and sum are rescaled
 * per block, so each position is read once; past EC_SPAN positions in spans, merged (see
 * ec_attention_spans). out is [n, kv_heads * group, dim]. */
#define EC_BLOCK 64
#define EC_MAX_GROUP 16
#define EC_MAX_DIM 256

/* The block's softmax step for one query head: scores s[0..nb) become exp(s - new max),
 * and the running max m, sum l and the accumulator's scale factor are updated. */
static inline float online_softmax_block(float *s, int64_t nb, float *m, float *l) {
    float bmax = *m;
    for (int64_t j = 0; j < nb; j++) bmax = s[j] > bmax ? s[j] : bmax;
    const float alpha = exp_poly(*m - bmax); /* m = -inf (first block): acc is still 0 */
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < nb; j++) {
        s[j] = exp_poly(s[j] - bmax);
        sum += s[j];
    }
    *l = *l * alpha + sum;
    *m = bmax;
    return alpha;
}

/* The next block of the positions [t0, len) of a (row, KV head) whose K and V start at K
 * and V and run `chunk` positions (pos_bytes each) a chunk, chunks chunk_stride bytes
 * apart: at most EC_BLOCK positions and none past its chunk, so that its positions lie
 * side by side from *Kb and *Vb. Returns how many. */
static inline int64_t chunk_block(const void *K, const void *V, int64_t t0, int64_t len,
                                  int64_t chunk, int64_t chunk_stride, int64_t pos_bytes,
                                  const char **Kb, const char **Vb) {
    const int64_t in_chunk = t0 % chunk, at = t0 / chunk * chunk_stride + in_chunk * pos_bytes;
    int64_t nb = len - t0 < EC_BLOCK ? len - t0 : EC_BLOCK;
    if (nb > chunk - in_chunk) nb = chunk - in_chunk;
    *Kb = (const char *)K + at;
    *Vb = (const char *)V + at;
    return nb;
}

#ifdef __AVX512F__
#include <immintrin.h>
#define EC_FAST_GROUP 8
#define EC_FAST_NV 8 /* dim / 16 */
/* Positions ahead to prefetch K from: the hardware prefetcher stops at each 4 KB page
 * (16 positions of 64 floats). At 256 rows of ~192 positions, 8 ahead (with this block's
 * V prefetched as its K is read) ran 8-15% faster than no prefetch, 16 or 32 ahead. */
#define EC_PREFETCH_AHEAD 8

/* The sums of the 16 lanes of a, b, c and d, as one 4-float vector (a shuffle tree:
 * cheaper than four horizontal reductions). */
static inline __m128 reduce4_avx512(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], cd likewise */
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: [sum a, sum b, sum c, sum d] of its four elements */
    __m512 t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    /* then across the four 128-bit lanes */
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
    t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(t);
}

/* One (row, KV head) with the query heads and accumulators held in registers; G and NV
 * are literals at each call site, so the loops unroll. */
static inline __attribute__((always_inline)) void attend_unit_avx512(
    const float *qh, const void *K, const void *V, int64_t start, int64_t len, int64_t chunk,
    int64_t chunk_stride, float scale, float *o, float *ml, const int G, const int NV,
    const int T) {
    const int64_t es = ec_kv_size(T), lines = NV * 16 * es / 64; /* a position's lines */
    const int64_t pos_bytes = NV * 16 * es;
    __m512 q[EC_FAST_GROUP][EC_FAST_NV], acc[EC_FAST_GROUP][EC_FAST_NV];
    float s[EC_FAST_GROUP][EC_BLOCK], m[EC_FAST_GROUP], l[EC_FAST_GROUP];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int v = 0; v < NV; v++) {
            q[g][v] = _mm512_loadu_ps(qh + g * NV * 16 + v * 16);
            acc[g][v] = _mm512_setzero_ps();
        }
    }
    for (int64_t t0 = start, nb; t0 < len; t0 += nb) {
        const char *Kb, *Vb;
        nb = chunk_block(K, V, t0, len, chunk, chunk_stride, pos_bytes, &Kb, &Vb);
        const __m128 scale4 = _mm_set1_ps(scale);
        int64_t j = 0;
        for (; j + 4 <= nb; j += 4) { /* four positions share one reduction tree */
            __m512 x[EC_FAST_GROUP][4];
            for (int u = 0; u < 4; u++) {
                const int64_t kt = (j + u) * NV * 16;
                const char *kb = Kb + (kt + EC_PREFETCH_AHEAD * NV * 16) * es;
                const char *vb = Vb + kt * es;
                for (int c = 0; c < lines; c++) {
                    _mm_prefetch(kb + c * 64, _MM_HINT_T0);
                    /* this block's V is read once its scores are known */
                    _mm_prefetch(vb + c * 64, _MM_HINT_T0);
                }
                __m512 k[EC_FAST_NV];
                for (int v = 0; v < NV; v++) k[v] = ec_kv_load16(Kb, kt + v * 16, T);
                for (int g = 0; g < G; g++) {
                    x[g][u] = _mm512_mul_ps(q[g][0], k[0]);
                    for (int v = 1; v < NV; v++) x[g][u] = _mm512_fmadd_ps(q[g][v], k[v], x[g][u]);
                }
            }
            for (int g = 0; g < G; g++)
                _mm_storeu_ps(&s[g][j], _mm_mul_ps(reduce4_avx512(x[g][0], x[g][1], x[g][2],
                                                                  x[g][3]), scale4));
        }
        for (; j < nb; j++) {
            const int64_t kt = j * NV * 16;
            __m512 k[EC_FAST_NV];
            for (int v = 0; v < NV; v++) k[v] = ec_kv_load16(Kb, kt + v * 16, T);
            for (int g = 0; g < G; g++) {
                __m512 x = _mm512_mul_ps(q[g][0], k[0]);
                for (int v = 1; v < NV; v++) x = _mm512_fmadd_ps(q[g][v], k[v], x);
                s[g][j] = _mm512_reduce_add_ps(x) * scale;
            }
        }
        for (int g = 0; g < G; g++) {
            const __m512 alpha = _mm512_set1_ps(online_softmax_block(s[g], nb, &m[g], &l[g]));
            for (int v = 0; v < NV; v++) acc[g][v] = _mm512_mul_ps(acc[g][v], alpha);
        }
        for (int64_t j = 0; j < nb; j++) {
            const int64_t vt = j * NV * 16;
            __m512 x[EC_FAST_NV];
            for (int v = 0; v < NV; v++) x[v] = ec_kv_load16(Vb, vt + v * 16, T);
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(s[g][j]);
                for (int v = 0; v < NV; v++) acc[g][v] = _mm512_fmadd_ps(p, x[v], acc[g][v]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        ml[g] = m[g], ml[G + g] = l[g];
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + g * NV * 16 + v * 16, acc[g][v]);
    }
}

/* Whether (group, dim) has a specialized version; it is then run and 1 returned. */
static inline int attend_unit_fast(const float *qh, const void *K, const void *V,
                                   int64_t start, int64_t len, int64_t chunk,
                                   int64_t chunk_stride, float scale, float *o, float *ml,
                                   int64_t group, int64_t dim, int t) {
#define EC_CASE(G, NV)                                                                  \
    if (group == G && dim == NV * 16) {                                                 \
        if (t == EC_KV_F16)                                                             \
            attend_unit_avx512(qh, K, V, start, len, chunk, chunk_stride, scale, o, ml, \
                G, NV, EC_KV_F16);                                                      \
        else if (t == EC_KV_BF16)                                                       \
            attend_unit_avx512(qh, K, V, start, len, chunk, chunk_stride, scale, o, ml, \
                G, NV, EC_KV_BF16);                                                     \
        else                                                                            \
            attend_unit_avx512(qh, K, V, start, len, chunk, chunk_stride, scale, o, ml, \
                G, NV, EC_KV_F32);                                                      \
        return 1;                                                                       \
    }
    EC_CASE(1, 2) EC_CASE(2, 2) EC_CASE(4, 2) EC_CASE(8, 2)
    EC_CASE(1, 4) EC_CASE(2, 4) EC_CASE(4, 4) EC_CASE(8, 4)
    EC_CASE(1, 8) EC_CASE(2, 8) EC_CASE(4, 8) EC_CASE(8, 8)
    /* groups of 3, 6 and 7 (SmolLM2's 135M and 360M, Qwen2.5's) at dims 64 and 128 */
    EC_CASE(3, 4) EC_CASE(6, 4) EC_CASE(7, 4) EC_CASE(3, 8) EC_CASE(6, 8) EC_CASE(7, 8)
#undef EC_CASE
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EC_FAST_GROUP 8
#define EC_FAST_NV 16 /* dim / 8 */

/* The sums of the 8 lanes of a, b, c and d, as one 4-float vector. */
static inline __m128 reduce4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
    /* [a01 a23 b01 b23 | a45 a67 b45 b67], [c.. d..] likewise, then the four sums per half */
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* The AVX-512 kernel's loop with 8-float vectors. Sixteen registers cannot hold the query
 * heads as well as the accumulators: the queries are read from L1 (memory operands). */
static inline __attribute__((always_inline)) void attend_unit_avx2(
    const float *qh, const void *K, const void *V, int64_t start, int64_t len, int64_t chunk,
    int64_t chunk_stride, float scale, float *o, float *ml, const int G, const int NV,
    const int T) {
    const int64_t es = ec_kv_size(T), lines = NV * 8 * es / 64; /* a position's lines */
    const int64_t pos_bytes = NV * 8 * es;
    __m256 acc[EC_FAST_GROUP][EC_FAST_NV];
    float s[EC_FAST_GROUP][EC_BLOCK], m[EC_FAST_GROUP], l[EC_FAST_GROUP];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int v = 0; v < NV; v++) acc[g][v] = _mm256_setzero_ps();
    }
    for (int64_t t0 = start, nb; t0 < len; t0 += nb) {
        const char *Kb, *Vb;
        nb = chunk_block(K, V, t0, len, chunk, chunk_stride, pos_bytes, &Kb, &Vb);
        const __m128 scale4 = _mm_set1_ps(scale);
        int64_t j = 0;
        for (; j + 4 <= nb; j += 4) { /* four positions share one reduction tree */
            /* This block's V is read once its scores are known: fetch it now. K is not
             * prefetched ahead: on AVX2-only CPUs that is 9-11% slower at 256 rows (on one
             * thread or two) than leaving K to the hardware prefetcher. */
            for (int u = 0; u < 4; u++) {
                const char *vb = Vb + (j + u) * NV * 8 * es;
                for (int c = 0; c < (lines > 0 ? lines : 1); c++)
                    _mm_prefetch(vb + c * 64, _MM_HINT_T0);
            }
            for (int g = 0; g < G; g++) {
                const float *qg = qh + g * NV * 8;
                __m256 x[4];
                for (int u = 0; u < 4; u++) {
                    const int64_t kt = (j + u) * NV * 8;
                    x[u] = _mm256_mul_ps(_mm256_loadu_ps(qg), ec_kv_load8(Kb, kt, T));
                    for (int v = 1; v < NV; v++)
                        x[u] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + v * 8),
                                               ec_kv_load8(Kb, kt + v * 8, T), x[u]);
                }
                _mm_storeu_ps(&s[g][j], _mm_mul_ps(reduce4_avx2(x[0], x[1], x[2], x[3]), scale4));
            }
        }
        for (; j < nb; j++) {
            const int64_t kt = j * NV * 8;
            for (int g = 0; g < G; g++) {
                const float *qg = qh + g * NV * 8;
                __m256 x = _mm256_mul_ps(_mm256_loadu_ps(qg), ec_kv_load8(Kb, kt, T));
                for (int v = 1; v < NV; v++)
                    x = _mm256_fmadd_ps(_mm256_loadu_ps(qg + v * 8), ec_kv_load8(Kb, kt + v * 8, T),
                                        x);
                const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
                const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
                s[g][j] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2))) * scale;
            }
        }
        for (int g = 0; g < G; g++) {
            const __m256 alpha = _mm256_set1_ps(online_softmax_block(s[g], nb, &m[g], &l[g]));
            for (int v = 0; v < NV; v++) acc[g][v] = _mm256_mul_ps(acc[g][v], alpha);
        }
        for (int64_t j = 0; j < nb; j++) {
            const int64_t vt = j * NV * 8;
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_set1_ps(s[g][j]);
                for (int v = 0; v < NV; v++)
                    acc[g][v] = _mm256_fmadd_ps(p, ec_kv_load8(Vb, vt + v * 8, T), acc[g][v]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        ml[g] = m[g], ml[G + g] = l[g];
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(o + g * NV * 8 + v * 8, acc[g][v]);
    }
}

static inline int attend_unit_fast(const float *qh, const void *K, const void *V,
                                   int64_t start, int64_t len, int64_t chunk,
                                   int64_t chunk_stride, float scale, float *o, float *ml,
                                   int64_t group, int64_t dim, int t) {
#define EC_CASE(G, NV)                                                                  \
    if (group == G && dim == NV * 8) {                                                  \
        if (t == EC_KV_F16)                                                             \
            attend_unit_avx2(qh, K, V, start, len, chunk, chunk_stride, scale, o, ml,   \
                G, NV, EC_KV_F16);                                                      \
        else if (t == EC_KV_BF16)                                                       \
            attend_unit_avx2(qh, K, V, start, len, chunk, chunk_stride, scale, o, ml,   \
                G, NV, EC_KV_BF16);                                                     \
        else                                                                            \
            attend_unit_avx2(qh, K, V, start, len, chunk, chunk_stride, scale, o, ml,   \
                G, NV, EC_KV_F32);                                                      \
        return 1;                                                                       \
    }
    EC_CASE(1, 4) EC_CASE(2, 4) EC_CASE(4, 4) EC_CASE(8, 4)
    EC_CASE(1, 8) EC_CASE(2, 8) EC_CASE(4, 8) EC_CASE(8, 8)
    EC_CASE(1, 16) EC_CASE(2, 16) EC_CASE(4, 16) EC_CASE(8, 16)
    EC_CASE(3, 8) EC_CASE(6, 8) EC_CASE(7, 8) EC_CASE(3, 16) EC_CASE(6, 16) EC_CASE(7, 16)
#undef EC_CASE
    return 0;
}
#else
static inline int attend_unit_fast(const float *qh, const void *K, const void *V,
                                   int64_t start, int64_t len, int64_t chunk,
                                   int64_t chunk_stride, float scale, float *o, float *ml,
                                   int64_t group, int64_t dim, int t) {
    return 0;
}
#endif

/* Any group and dim (up to the maxima), in portable C. */
static void attend_unit_generic(const float *qh, const void *K, const void *V, int64_t start,
                                int64_t len, int64_t chunk, int64_t chunk_stride, float scale,
                                float *o, float *ml, int64_t group, int64_t dim, int t) {
    const int64_t pos_bytes = dim * ec_kv_size(t);
    float s[EC_MAX_GROUP * EC_BLOCK], acc[EC_MAX_GROUP * EC_MAX_DIM], wide[EC_MAX_DIM];
    float m[EC_MAX_GROUP], l[EC_MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    for (int64_t t0 = start, nb; t0 < len; t0 += nb) {
        const char *Kb, *Vb;
        nb = chunk_block(K, V, t0, len, chunk, chunk_stride, pos_bytes, &Kb, &Vb);
        for (int64_t j = 0; j < nb; j++) {
            const float *kt = ec_kv_row(Kb, j * dim, dim, t, wide);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qh + g * dim;
                float d = 0.0f;
#pragma omp simd reduction(+ : d)
                for (int64_t i = 0; i < dim; i++) d += qg[i] * kt[i];
                s[g * EC_BLOCK + j] = d * scale;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            const float alpha = online_softmax_block(s + g * EC_BLOCK, nb, &m[g], &l[g]);
            float *ag = acc + g * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) ag[i] *= alpha;
        }
        for (int64_t j = 0; j < nb; j++) {
            const float *vt = ec_kv_row(Vb, j * dim, dim, t, wide);
            for (int64_t g = 0; g < group; g++) {
                const float p = s[g * EC_BLOCK + j];
                float *ag = acc + g * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) ag[i] += p * vt[i];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) ml[g] = m[g], ml[group + g] = l[g];
    memcpy(o, acc, sizeof(float) * group * dim);
}

/* A (row, KV head)'s positions are attended in spans, each its own unit of work (the
 * fused decode step's threads share a phase's spans, so a few KV heads still split
 * evenly), then merged: the softmax's running maximum and sum of each span rescaled to
 * the largest maximum. The spans depend on the positions alone (never on the threads), a
 * power of two of them so that they split evenly over a power of two of threads, about
 * EC_SPAN positions each, at most EC_MAX_SPANS; every caller merges them in the same
 * order with the same code, so the layers and the fused step agree bit for bit. */
#define EC_SPAN 64
#define EC_MAX_SPANS 8

int64_t ec_attention_spans(int64_t positions) {
    int64_t spans = 1;
    while (spans < EC_MAX_SPANS && spans * EC_SPAN < positions) spans *= 2;
    return spans;
}

/* One span, positions [lo, hi) of a (row, KV head)'s K and V (elements of type kv_type),
 * `chunk` positions [chunk, dim] side by side from K and V, each next chunk chunk_stride
 * bytes on (see ec_decode_attention), for the `group` query heads qh [group, dim]: part
 * holds the unnormalized sums [group, dim], then each head's running maximum [group] and
 * softmax sum [group]. */
void ec_attend_span(const float *qh, const void *K, const void *V, int64_t lo, int64_t hi,
                    int64_t chunk, int64_t chunk_stride, float scale, int64_t group,
                    int64_t dim, float *part, int kv_type) {
    float *ml = part + group * dim;
    if (!attend_unit_fast(qh, K, V, lo, hi, chunk, chunk_stride, scale, part, ml, group, dim,
                          kv_type))
        attend_unit_generic(qh, K, V, lo, hi, chunk, chunk_stride, scale, part, ml, group, dim,
                            kv_type);
}

/* Folds span j's part into the running sums o [group, dim] and ml (maxima, then sums). */
static void merge_span(float *o, float *ml, const float *part, int64_t j, int64_t group,
                       int64_t dim) {
    const float *pm = part + group * dim, *pl = pm + group;
    if (j == 0) {
        memcpy(o, part, sizeof(float) * group * dim);
        memcpy(ml, pm, sizeof(float) * 2 * group);
        return;
    }
    for (int64_t g = 0; g < group; g++) {
        const float top = ml[g] > pm[g] ? ml[g] : pm[g];
        const float a = expf(ml[g] - top), b = expf(pm[g] - top);
        ml[g] = top;
        ml[group + g] = fmaf(ml[group + g], a, pl[g] * b);
        float *og = o + g * dim;
        const float *pg = part + g * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) og[i] = fmaf(og[i], a, pg[i] * b);
    }
}

/* The attention output o [group, dim] from the merged sums. */
static void normalize_spans(float *o, const float *ml, int64_t group, int64_t dim) {
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / ml[group + g];
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[g * dim + i] *= inv;
    }
}

/* out [group, dim]: the `spans` parts (ec_attend_span's, each group * dim + 2 * group
 * floats, in span order) merged. */
void ec_merge_spans(const float *parts, int64_t spans, int64_t group, int64_t dim, float *out) {
    float ml[2 * EC_MAX_GROUP];
    for (int64_t j = 0; j < spans; j++)
        merge_span(out, ml, parts + j * (group * dim + 2 * group), j, group, dim);
    normalize_spans(out, ml, group, dim);
}

int ec_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                        const void *v_cache, const int64_t *lens, int64_t n, int64_t kv_heads,
                        int64_t group, int64_t dim, int64_t row_stride, int64_t chunk,
                        int64_t chunk_stride, int64_t cap, int64_t window, float scale,
                        float *out, int nthreads, int kv_type) {
    if (group < 1 || group > EC_MAX_GROUP || dim < 1 || dim > EC_MAX_DIM) return -1;
    if (!ec_kv_valid(kv_type) || chunk < 1) return -1;
    const int64_t pos_bytes = dim * ec_kv_size(kv_type);
    int64_t positions = 0; /* over all rows and heads: below ~1k, threads cost more */
    for (int64_t r = 0; r < n; r++) {
        if (lens[r] < 1 || lens[r] > cap) return -1;
        positions += (window > 0 && lens[r] > window ? window : lens[r]) * kv_heads;
    }
#pragma omp parallel for num_threads(nthreads) if (n * kv_heads >= 2 && positions >= 1024) \
    schedule(dynamic, 1)
    for (int64_t u = 0; u < n * kv_heads; u++) {
        const int64_t r = u / kv_heads, h = u % kv_heads, len = lens[r];
        const int64_t start = window > 0 && len > window ? len - window : 0;
        const int64_t at = mirror_at(r, h, 0, row_stride, chunk, chunk_stride, pos_bytes);
        const char *K = (const char *)k_cache + at, *V = (const char *)v_cache + at;
        const float *qh = q + r * q_stride + h * group * dim;
        float *o = out + (r * kv_heads + h) * group * dim;
        float part[EC_MAX_GROUP * EC_MAX_DIM + 2 * EC_MAX_GROUP], ml[2 * EC_MAX_GROUP];
        const int64_t attended = len - start, spans = ec_attention_spans(attended);
        for (int64_t j = 0; j < spans; j++) {
            ec_attend_span(qh, K, V, start + attended * j / spans,
                           start + attended * (j + 1) / spans, chunk, chunk_stride, scale, group,
                           dim, part, kv_type);
            merge_span(o, ml, part, j, group, dim);
        }
        normalize_spans(o, ml, group, dim);
    }
    return 0;
}

/* The index of the largest of row[0..cols): the first one on ties, and the first NaN if
 * the row has one, as numpy's argmax. */
static int64_t argmax_row(const float *row, int64_t cols) {
    int64_t i = 0, at = 0;
    float best = row[0];
#ifdef __AVX512F__
    if (cols >= 16) {
        /* Each lane keeps its own maximum and where it first saw it (strict >), in two
         * independent sets (even and odd vectors) so consecutive compares overlap; the
         * smallest index among the lanes holding the overall maximum is the first one. */
        __m512 best0 = _mm512_set1_ps(-INFINITY), best1 = best0;
        __m512i at0 = _mm512_setzero_si512(), at1 = at0;
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i sixteen = _mm512_set1_epi32(16), thirty_two = _mm512_set1_epi32(32);
        __mmask16 nan = 0;
        for (; i + 32 <= cols; i += 32) {
            const __m512 v0 = _mm512_loadu_ps(row + i), v1 = _mm512_loadu_ps(row + i + 16);
            nan |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) |
                   _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
            const __mmask16 gt0 = _mm512_cmp_ps_mask(v0, best0, _CMP_GT_OQ);
            const __mmask16 gt1 = _mm512_cmp_ps_mask(v1, best1, _CMP_GT_OQ);
            best0 = _mm512_mask_mov_ps(best0, gt0, v0);
            best1 = _mm512_mask_mov_ps(best1, gt1, v1);
            at0 = _mm512_mask_mov_epi32(at0, gt0, idx);
            at1 = _mm512_mask_mov_epi32(at1, gt1, _mm512_add_epi32(idx, sixteen));
            idx = _mm512_add_epi32(idx, thirty_two);
        }
        for (; i + 16 <= cols; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best0, _CMP_GT_OQ);
            best0 = _mm512_mask_mov_ps(best0, gt, v);
            at0 = _mm512_mask_mov_epi32(at0, gt, idx);
            idx = _mm512_add_epi32(idx, sixteen);
        }
        if (nan) {
            while (row[at] == row[at]) at++;
            return at;
        }
        /* Merge the odd set into the even one: a larger value wins, a tie the lower index. */
        const __mmask16 take = _mm512_cmp_ps_mask(best1, best0, _CMP_GT_OQ) |
                               (_mm512_cmp_ps_mask(best1, best0, _CMP_EQ_OQ) &
                                _mm512_cmp_epi32_mask(at1, at0, _MM_CMPINT_LT));
        const __m512 lane_best = _mm512_mask_mov_ps(best0, take, best1);
        const __m512i lane_at = _mm512_mask_mov_epi32(at0, take, at1);
        best = _mm512_reduce_max_ps(lane_best);
        const __mmask16 top = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
        at = _mm512_mask_reduce_min_epi32(top, lane_at);
    }
#elif defined(__AVX2__)
    if (cols >= 8) {
        /* As above with 8 lanes: blends instead of masks, a scalar pass over the lanes. */
        __m256 best0 = _mm256_set1_ps(-INFINITY), best1 = best0;
        __m256i at0 = _mm256_setzero_si256(), at1 = at0;
        __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i eight = _mm256_set1_epi32(8), sixteen = _mm256_set1_epi32(16);
        __m256 nan = _mm256_setzero_ps();
        for (; i + 16 <= cols; i += 16) {
            const __m256 v0 = _mm256_loadu_ps(row + i), v1 = _mm256_loadu_ps(row + i + 8);
            /* unordered when either is NaN: one compare covers both vectors */
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
            const __m256 gt0 = _mm256_cmp_ps(v0, best0, _CMP_GT_OQ);
            const __m256 gt1 = _mm256_cmp_ps(v1, best1, _CMP_GT_OQ);
            best0 = _mm256_blendv_ps(best0, v0, gt0);
            best1 = _mm256_blendv_ps(best1, v1, gt1);
            at0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at0),
                                                       _mm256_castsi256_ps(idx), gt0));
            at1 = _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(at1), _mm256_castsi256_ps(_mm256_add_epi32(idx, eight)),
                gt1));
            idx = _mm256_add_epi32(idx, sixteen);
        }
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(v, best0, _CMP_GT_OQ);
            best0 = _mm256_blendv_ps(best0, v, gt);
            at0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at0),
                                                       _mm256_castsi256_ps(idx), gt));
            idx = _mm256_add_epi32(idx, eight);
        }
        if (_mm256_movemask_ps(nan)) {
            while (row[at] == row[at]) at++;
            return at;
        }
        float b0[8], b1[8];
        int32_t a0[8], a1[8];
        _mm256_storeu_ps(b0, best0);
        _mm256_storeu_ps(b1, best1);
        _mm256_storeu_si256((__m256i *)a0, at0);
        _mm256_storeu_si256((__m256i *)a1, at1);
        best = b0[0];
        at = a0[0];
        for (int lane = 0; lane < 8; lane++) {
            /* a larger value wins, a tie the lower index (the odd set may have no value) */
            if (b0[lane] > best || (b0[lane] == best && a0[lane] < at))
                best = b0[lane], at = a0[lane];
            if (b1[lane] > best || (b1[lane] == best && a1[lane] < at))
                best = b1[lane], at = a1[lane];
        }
    }
#endif
    for (; i < cols; i++) {
        if (row[i] != row[i]) {
            if (best == best) return i; /* the first NaN (none came before: see above) */
            return at;
        }
        if (row[i] > best) {
            best = row[i];
            at = i;
        }
    }
    return at;
}

/* out[r] = argmax_row of row r of x ([rows, cols], rows `stride` floats apart). */
void ec_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out,
                    int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * cols >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, cols);
}

/* ---- Projection GEMM (see panel_gemm.py) -------------------------------------------------
 * c[m, n] = sum_k a[m, k] * w[n, k] (+ bias[n]), with w packed once into panels of
 * EC_PANEL output columns: panel p holds w[EC_PANEL p + j][k] at [k][j], zero-padded past
 * the last column. Every output sums its K products in one FMA chain from k = 0 up and
 * then adds its bias, whatever the row count or tile: a row gets the same bits alone or in
 * any batch. A 6 x 16 tile keeps its 12 accumulators in registers over the whole chain.
 *
 * A gated weight (an MLP's gate rows, then as many up rows: `half` each, a multiple of 8)
 * is packed in pairs instead: panel p holds gate columns 8p..8p+7, then up columns
 * 8p..8p+7. Each output still has its own chain, so the bits are the plain packing's; a
 * tile then holds both factors of its 8 outputs and can store silu(gate) * up directly,
 * which skips writing the [m, 2 * half] product and reading it back. */
#define EC_PANEL 16
#define EC_TILE_ROWS 6
#define EC_ROW_BLOCK_BYTES (256 * 1024) /* the rows of a that one block keeps in L2 */
#define EC_PACK_MIN_PANELS 32
#define EC_PACK_MIN_TILES 4

/* The panels of an n-output weight: plain (half 0) or gated (n = 2 * half). */
static int64_t panel_count(int64_t n, int64_t half) {
    return half ? half / 8 : (n + EC_PANEL - 1) / EC_PANEL;
}

/* The weight row in column j of panel p. */
static inline int64_t panel_column(int64_t p, int64_t j, int64_t half) {
    if (!half) return p * EC_PANEL + j;
    return j < 8 ? p * 8 + j : half + p * 8 + j - 8;
}

int ec_gemm_pack(const float *w, int64_t stride_n, int64_t stride_k, int64_t n, int64_t k,
                 int64_t half, float *panels) {
    if (half && (half % 8 || n != 2 * half)) return -1;
    for (int64_t p = 0; p < panel_count(n, half); p++) {
        float *dst = panels + p * k * EC_PANEL;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < EC_PANEL; j++) {
                const int64_t col = panel_column(p, j, half);
                dst[kk * EC_PANEL + j] = col < n ? w[col * stride_n + kk * stride_k] : 0.0f;
            }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

int ec_gemm_available(void) { return 1; }

#define EC_ROW_FMA(i)                                                                     \
    if (i < R) {                                                                          \
        const __m256 x = _mm256_broadcast_ss(a + i * row_step + kk * k_step);             \
        acc##i##a = _mm256_fmadd_ps(x, b0, acc##i##a);                                    \
        acc##i##b = _mm256_fmadd_ps(x, b1, acc##i##b);                                    \
    }
#define EC_ROW_STORE(i, dst, ld, off)                                                     \
    if (i < R) {                                                                          \
        _mm256_storeu_ps(dst + i * ld, acc##i##a);                                        \
        _mm256_storeu_ps(dst + i * ld + off, acc##i##b);                                  \
    }
#define EC_ROW_STORES(dst, ld, off)                                                       \
    EC_ROW_STORE(0, dst, ld, off) EC_ROW_STORE(1, dst, ld, off)                           \
    EC_ROW_STORE(2, dst, ld, off) EC_ROW_STORE(3, dst, ld, off)                           \
    EC_ROW_STORE(4, dst, ld, off) EC_ROW_STORE(5, dst, ld, off)
/* The bias is added as in the stores below: bias + product. */
#define EC_ROW_SILU(i)                                                                    \
    if (i < R) {                                                                          \
        __m256 g = acc##i##a, u = acc##i##b;                                              \
        if (bias) {                                                                       \
            g = _mm256_add_ps(_mm256_loadu_ps(bias), g);                                  \
            u = _mm256_add_ps(_mm256_loadu_ps(bias + up), u);                             \
        }                                                                                 \
        _mm256_storeu_ps(c + i * ldc, silu_mul8(g, u));                                   \
    }

/* R (1-6) rows of a times one panel into c (width columns of it are real). Row i's k-th
 * value is at a[i * row_step + k * k_step]: rows of the caller's matrix (lda, 1) or a
 * packed tile (1, 6). The panel's second 8 columns go `up` floats after its first, in c
 * and in bias: 8 for a plain panel, half for a gated one. With `silu`, c takes the 8
 * values silu(gate) * up per row instead. */
static inline __attribute__((always_inline)) void gemm_tile_strided(
    const float *a, const int64_t row_step, const int64_t k_step, const float *panel,
    const int64_t panel_step, int64_t k, const float *bias, float *c, int64_t ldc,
    int64_t width, int64_t up, const int silu, const int R) {
    __m256 acc0a = _mm256_setzero_ps(), acc0b = acc0a, acc1a = acc0a, acc1b = acc0a;
    __m256 acc2a = acc0a, acc2b = acc0a, acc3a = acc0a, acc3b = acc0a;
    __m256 acc4a = acc0a, acc4b = acc0a, acc5a = acc0a, acc5b = acc0a;
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 b0 = _mm256_loadu_ps(panel + kk * panel_step);
        const __m256 b1 = _mm256_loadu_ps(panel + kk * panel_step + 8);
        EC_ROW_FMA(0) EC_ROW_FMA(1) EC_ROW_FMA(2) EC_ROW_FMA(3) EC_ROW_FMA(4) EC_ROW_FMA(5)
    }
    if (silu) {
        EC_ROW_SILU(0) EC_ROW_SILU(1) EC_ROW_SILU(2) EC_ROW_SILU(3) EC_ROW_SILU(4) EC_ROW_SILU(5)
        return;
    }
    if (width == EC_PANEL && !bias) {
        EC_ROW_STORES(c, ldc, up)
        return;
    }
    float tile[EC_TILE_ROWS][EC_PANEL];
    EC_ROW_STORES(tile[0], EC_PANEL, 8)
    for (int i = 0; i < R; i++)
        for (int64_t j = 0; j < width; j++) {
            const int64_t at = j < 8 ? j : up + j - 8;
            c[i * ldc + at] = bias ? bias[at] + tile[i][j] : tile[i][j];
        }
}

/* The last tile of `n` (0-5) rows, through the caller's EC_LAST(R) with a literal R. */
#define EC_PARTIAL_TILE(n)                                                                \
    switch (n) {                                                                          \
    case 5: EC_LAST(5)                                                                    \
    case 4: EC_LAST(4)                                                                    \
    case 3: EC_LAST(3)                                                                    \
    case 2: EC_LAST(2)                                                                    \
    case 1: EC_LAST(1)                                                                    \
    }

/* A packed panel's k-th 16 values are EC_PANEL floats after its (k-1)-th. */
#define gemm_tile(a, row_step, k_step, panel, ...)                                        \
    gemm_tile_strided(a, row_step, k_step, panel, EC_PANEL, __VA_ARGS__)

/* `rows` (any count) rows of a times one 16-column panel, six at a time (see gemm_tile). */
static void gemm_rows(const float *a, int64_t row_step, const float *panel, int64_t panel_step,
                      int64_t k, float *c, int64_t ldc, int64_t width, int64_t rows) {
    int64_t t = 0;
    for (; t + EC_TILE_ROWS <= rows; t += EC_TILE_ROWS)
        gemm_tile_strided(a + t * row_step, row_step, 1, panel, panel_step, k, NULL,
                          c + t * ldc, ldc, width, 8, 0, 6);
    const float *at = a + t * row_step;
    float *ct = c + t * ldc;
#define EC_LAST(R)                                                                        \
    gemm_tile_strided(at, row_step, 1, panel, panel_step, k, NULL, ct, ldc, width, 8, 0, R); \
    break;
    EC_PARTIAL_TILE(rows - t)
#undef EC_LAST
}

/* All `rows` rows of a times one panel, six at a time; with `packed`, a holds the tiles
 * as pack_tile wrote them. With `next` (the panel this thread takes after this one) and
 * enough tiles to hide it, each tile first asks for its share of the next panel's k
 * lines (64 bytes each): between a decode step's projections the attention streams the
 * KV cache through L3, so each panel's first tile would otherwise wait on memory (10% of
 * the projections' time at 64-2048 rows). */
static void gemm_panel(const float *a, int64_t lda, int packed, int64_t rows,
                       const float *panel, int64_t k, const float *bias, float *c,
                       int64_t ldc, int64_t width, int64_t up, int silu, const float *next) {
    const int64_t tiles = rows / EC_TILE_ROWS;
    const int64_t share = tiles >= 4 && next ? (k + tiles - 1) / tiles : 0;
    const int64_t tile_step = packed ? k * EC_TILE_ROWS : EC_TILE_ROWS * lda;
    const int64_t row_step = packed ? 1 : lda, k_step = packed ? EC_TILE_ROWS : 1;
    int64_t t = 0, fetched = 0;
    for (; t < tiles; t++) {
        for (int64_t l = 0; l < share && fetched < k; l++, fetched++)
            _mm_prefetch((const char *)(next + fetched * EC_PANEL), _MM_HINT_T0);
        float *ct = c + t * EC_TILE_ROWS * ldc;
        /* literal steps, so that each full-tile loop is compiled for its own addressing */
        const float *at = a + t * tile_step;
        if (packed && silu)
            gemm_tile(at, 1, EC_TILE_ROWS, panel, k, bias, ct, ldc, width, up, 1, 6);
        else if (packed)
            gemm_tile(at, 1, EC_TILE_ROWS, panel, k, bias, ct, ldc, width, up, 0, 6);
        else if (silu)
            gemm_tile(at, lda, 1, panel, k, bias, ct, ldc, width, up, 1, 6);
        else
            gemm_tile(at, lda, 1, panel, k, bias, ct, ldc, width, up, 0, 6);
    }
    const float *at = a + t * tile_step;
    float *ct = c + t * EC_TILE_ROWS * ldc;
#define EC_LAST(R)                                                                        \
    if (silu)                                                                             \
        gemm_tile(at, row_step, k_step, panel, k, bias, ct, ldc, width, up, 1, R);        \
    else                                                                                  \
        gemm_tile(at, row_step, k_step, panel, k, bias, ct, ldc, width, up, 0, R);        \
    break;
    EC_PARTIAL_TILE(rows - t * EC_TILE_ROWS)
#undef EC_LAST
}
#undef EC_ROW_FMA
#undef EC_ROW_STORE
#undef EC_ROW_STORES
#undef EC_ROW_SILU
#undef EC_PARTIAL_TILE

/* Row r of the scores s (its first `valid` keys real, then masked up to `width`) becomes
 * its softmax: scaled, max subtracted, exponentiated, divided by the sum; masked keys 0. */
static void softmax_row(float *s, int64_t valid, int64_t width, float scale) {
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= valid; j += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), sc);
        _mm256_storeu_ps(s + j, x);
        mx = _mm256_max_ps(mx, x);
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = mx[l] > m ? mx[l] : m;
    for (; j < valid; j++) {
        s[j] *= scale;
        m = s[j] > m ? s[j] : m;
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    for (j = 0; j + 8 <= valid; j += 8) {
        const __m256 e = exp_poly8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        sum8 = _mm256_add_ps(sum8, e);
    }
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += sum8[l];
    for (; j < valid; j++) {
        s[j] = exp_poly(s[j] - m);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    const __m256 iv = _mm256_set1_ps(inv);
    for (j = 0; j + 8 <= valid; j += 8)
        _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), iv));
    for (; j < valid; j++) s[j] *= inv;
    for (; j < width; j++) s[j] = 0.0f;
}

/* Causal attention of fresh prompts (nothing cached before them) over their own K/V, read
 * in place from the step's projections: q [T, kv_heads * group, dim] (tokens q_stride
 * floats apart), k and v [T, kv_heads, dim] (k_stride, v_stride); prompt i is tokens
 * starts[i] .. starts[i] + lens[i] - 1. out [T, kv_heads * group, dim], contiguous, gets
 * the prompts' rows. A task is EC_QBLOCK query positions of one prompt and KV head: the
 * keys up to its last position are copied transposed into 16-key panels, and the GEMM
 * tile computes each query head's scores; after the causal mask and the softmax, V's rows
 * serve in place as the panels of the second product. dim: a multiple of 16. Returns -1
 * on bad sizes, -2 without memory for the per-thread buffers. */
#define EC_QBLOCK 48
int ec_prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                         const float *v, int64_t v_stride, const int64_t *starts,
                         const int64_t *lens, int64_t prompts, int64_t kv_heads, int64_t group,
                         int64_t dim, float scale, float *out, int nthreads) {
    if (dim < 16 || dim % 16 || group < 1 || kv_heads < 1 || prompts < 1) return -1;
    int64_t longest = 0, blocks = 0, work = 0;
    for (int64_t i = 0; i < prompts; i++) {
        if (lens[i] < 1 || starts[i] < 0) return -1;
        longest = lens[i] > longest ? lens[i] : longest;
        blocks += (lens[i] + EC_QBLOCK - 1) / EC_QBLOCK;
        work += lens[i] * lens[i];
    }
    const int64_t heads = kv_heads * group, ld = (longest + 15) / 16 * 16;
    const int64_t tasks = blocks * kv_heads;
    int failed = 0;
    /* ~1k query-key pairs per head take a few microseconds: less is not worth a thread */
#pragma omp parallel num_threads(nthreads) if (tasks >= 2 && work * heads >= 16384)
    {
        float *kt = aligned_alloc(64, (ld * dim * sizeof(float) + 63) / 64 * 64);
        float *sc = aligned_alloc(64, (EC_QBLOCK * ld * sizeof(float) + 63) / 64 * 64);
        if (!kt || !sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            if (!kt || !sc) continue;
            int64_t b = t / kv_heads, i = 0; /* block b of prompt i */
            const int64_t h = t % kv_heads;
            while (b >= (lens[i] + EC_QBLOCK - 1) / EC_QBLOCK)
                b -= (lens[i++] + EC_QBLOCK - 1) / EC_QBLOCK;
            const int64_t first = starts[i], q0 = b * EC_QBLOCK;
            const int64_t nq = lens[i] - q0 < EC_QBLOCK ? lens[i] - q0 : EC_QBLOCK;
            const int64_t keys = q0 + nq, panels = (keys + 15) / 16;
            for (int64_t p = 0; p < panels; p++) /* K^T: panel p is [dim][16 keys] */
                for (int64_t j = 0; j < 16; j++) {
                    const int64_t key = p * 16 + j;
                    const float *row = k + (first + key) * k_stride + h * dim;
                    float *dst = kt + p * dim * 16 + j;
                    for (int64_t d = 0; d < dim; d++) dst[d * 16] = key < keys ? row[d] : 0.0f;
                }
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = h * group + g;
                const float *qg = q + (first + q0) * q_stride + head * dim;
                for (int64_t p = 0; p < panels; p++)
                    gemm_rows(qg, q_stride, kt + p * dim * 16, 16, dim, sc + p * 16, ld, 16, nq);
                for (int64_t r = 0; r < nq; r++)
                    softmax_row(sc + r * ld, q0 + r + 1, keys, scale);
                float *o = out + (first + q0) * heads * dim + head * dim;
                const float *vh = v + first * v_stride + h * dim;
                for (int64_t c = 0; c < dim; c += 16)
                    gemm_rows(sc, ld, vh + c, v_stride, keys, o + c, heads * dim, 16, nq);
            }
        }
        free(kt);
        free(sc);
    }
    return failed ? -2 : 0;
}

/* One tile: the first min(rows, 6) rows of a into dst as [k][6], rows past them as zeros.
 * 8 k at a time through an 8 x 8 transpose (rows 6 and 7 zero) whose 8 outputs are
 * stored 6 floats apart, each over the previous one's 2 spare lanes. */
static void pack_tile(const float *a, int64_t lda, int64_t rows, int64_t k, float *dst) {
    const __m256i first6 = _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0);
    int64_t kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++)
            r[i] = i < rows && i < EC_TILE_ROWS ? _mm256_loadu_ps(a + i * lda + kk)
                                                : _mm256_setzero_ps();
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        float *d = dst + kk * EC_TILE_ROWS;
        _mm256_storeu_ps(d + 0 * EC_TILE_ROWS, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_storeu_ps(d + 1 * EC_TILE_ROWS, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_storeu_ps(d + 2 * EC_TILE_ROWS, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_storeu_ps(d + 3 * EC_TILE_ROWS, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_storeu_ps(d + 4 * EC_TILE_ROWS, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_storeu_ps(d + 5 * EC_TILE_ROWS, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_storeu_ps(d + 6 * EC_TILE_ROWS, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_maskstore_ps(d + 7 * EC_TILE_ROWS, first6, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
    for (; kk < k; kk++)
        for (int i = 0; i < EC_TILE_ROWS; i++)
            dst[kk * EC_TILE_ROWS + i] = i < rows ? a[i * lda + kk] : 0.0f;
}

/* c [m, n] (rows ldc apart) = a [m, k] (rows lda apart) times the packed weight, plus bias
 * (or NULL). Rows go in blocks that fit L2; each block's panels are split over the
 * threads. For wide weights each block's rows are first copied tile by tile into one
 * stream ([k][6] per tile), which the threads share. A gated weight (`half` > 0) gives c
 * the plain column order; with `silu`, c is [m, half] = silu(gate) * up. Returns -1 for a
 * gated call that does not match its packing. */
int ec_gemm(const float *a, int64_t lda, int64_t m, int64_t k, const float *panels, int64_t n,
            const float *bias, float *c, int64_t ldc, int64_t half, int silu, int nthreads) {
    if ((half && (half % 8 || n != 2 * half)) || (silu && !half)) return -1;
    if (m <= 0) return 0;
    const int64_t count = panel_count(n, half);
    const int64_t up = half ? half : 8; /* a panel's second 8 columns, from its first */
    /* As few row blocks as fit L2, of even size in whole tiles (256 rows of k = 256 are two
     * blocks of 132 and 124, not 126, 126 and a 4-row block that streams every panel again). */
    const int64_t tiles = (m + EC_TILE_ROWS - 1) / EC_TILE_ROWS;
    int64_t fit = EC_ROW_BLOCK_BYTES / (int64_t)sizeof(float) / (k > 0 ? k : 1) / EC_TILE_ROWS;
    fit = fit < 1 ? 1 : fit;
    const int64_t blocks = (tiles + fit - 1) / fit;
    const int64_t block = (tiles + blocks - 1) / blocks * EC_TILE_ROWS;
    /* A wide weight's tiles read the block's rows copied into one stream per tile: a
     * 2,048 x 256 weight takes 6-14% less time so at 256 and 2,048 rows (2 threads).
     * Narrow weights (16 panels) and a few rows do not repay the copy. Without
     * memory for it the rows are read in place. */
    float *packed = NULL;
    if (count >= EC_PACK_MIN_PANELS && tiles >= EC_PACK_MIN_TILES)
        packed = aligned_alloc(64, (block * k * sizeof(float) + 63) / 64 * 64);
    /* A tile's chain costs about k FMA latencies: below ~16k of them (~20 us) over all
     * tiles, waking the second thread costs more than it saves. */
    const int64_t chain = tiles * count * k;
#pragma omp parallel num_threads(nthreads) if (chain >= 16384)
    for (int64_t r0 = 0; r0 < m; r0 += block) {
        const int64_t rows = m - r0 < block ? m - r0 : block;
        if (packed) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < (rows + EC_TILE_ROWS - 1) / EC_TILE_ROWS; t++)
                pack_tile(a + (r0 + t * EC_TILE_ROWS) * lda, lda, rows - t * EC_TILE_ROWS, k,
                          packed + t * k * EC_TILE_ROWS);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const int64_t col = panel_column(p, 0, half);
            const int64_t width = half || n - col >= EC_PANEL ? EC_PANEL : n - col;
            const float *panel = panels + p * k * EC_PANEL;
            const float *next = p + 1 < count ? panel + k * EC_PANEL : NULL;
            gemm_panel(packed ? packed : a + r0 * lda, lda, packed != NULL, rows, panel, k,
                       bias ? bias + col : NULL, c + r0 * ldc + col, ldc, width, up, silu,
                       next);
        }
    }
    free(packed);
    return 0;
}
#else
int ec_gemm_available(void) { return 0; }

int ec_gemm(const float *a, int64_t lda, int64_t m, int64_t k, const float *panels, int64_t n,
            const float *bias, float *c, int64_t ldc, int64_t half, int silu, int nthreads) {
    return -1;
}

int ec_prefill_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                         const float *v, int64_t v_stride, const int64_t *starts,
                         const int64_t *lens, int64_t prompts, int64_t kv_heads, int64_t group,
                         int64_t dim, float scale, float *out, int nthreads) {
    return -1;
}
#endif
