/* A whole decode step of a Llama-family model in one call (see decode_step.py).
 *
 * The step runs the same kernels the layers call one by one (cpu_kernels.c,
 * quant_kernels.c, kquant_kernels.c), through their addresses, in the same order and
 * with the same arguments, so its hidden states are the layers' bit for bit; what it
 * saves is the interpreter between them (about 150 module calls and 300 foreign calls a
 * step on a 30-layer model). Functions returning int give -1 when an index is out of
 * range (the kernels' own checks) and -2 without scratch memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*rms_norm_fn)(const float *, int64_t, float *, int64_t, int, const float *,
                            float *, int64_t, int64_t, float, int);
typedef int (*rotary_fn)(float *, int64_t, int64_t, int64_t, int64_t, const int64_t *,
                         const float *, const float *, int64_t, int);
typedef void (*silu_and_mul_fn)(const float *, float *, int64_t, int64_t, int);
typedef int (*write_kv_fn)(float *, float *, const float *, int64_t, const float *, int64_t,
                           const int64_t *, int64_t, int64_t, int64_t, int);
typedef int (*mirror_append_fn)(float *, float *, const float *, int64_t, const float *,
                                int64_t, const int64_t *, int64_t, int64_t, int64_t, int64_t,
                                int);
typedef int (*decode_attention_fn)(const float *, int64_t, const float *, const float *,
                                   const int64_t *, int64_t, int64_t, int64_t, int64_t,
                                   int64_t, int64_t, float, float *, int);
typedef int (*linear_fn)(int, const float *, int64_t, int64_t, int64_t, int64_t, const void *,
                         const void *, const void *, float *, int64_t);
typedef void (*quantize_rows_fn)(const float *, int64_t, int64_t, int64_t, int8_t *, float *,
                                 float *);
typedef void (*gemm_k_fn)(int64_t, int64_t, int64_t, int64_t, const uint8_t *, const uint8_t *,
                          const int8_t *, const float *, const float *, float *, int64_t);

/* The kernels' addresses (any of the last may be null when no part needs it). */
typedef struct {
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    silu_and_mul_fn silu_and_mul;
    write_kv_fn write_kv;
    mirror_append_fn mirror_append;
    decode_attention_fn decode_attention;
    linear_fn linear;
    quantize_rows_fn quantize_rows;
    gemm_k_fn gemm_k;
} ecd_kernels;

/* Output rows [first, first + rows) of a projection in one block layout: kind 5 or 6 for
 * Q5_K / Q6_K (eck_gemm_k's bits; d the scale bytes, m unused), else ecq_linear's kind
 * (Q4_K among them). */
typedef struct {
    int64_t kind, first, rows;
    const void *qs;
    const void *d, *m;
} ecd_part;

typedef struct {
    int64_t in, out, num_parts;
    const ecd_part *parts;
    const float *bias; /* [out] or null */
} ecd_proj;

typedef struct {
    const float *input_norm, *post_norm;
    const float *q_norm, *k_norm; /* per-head norms of Q and K (Qwen3), or null */
    ecd_proj qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* the paged cache's halves */
    int64_t cache_slots;      /* slots in each half */
    int64_t window;           /* sliding window, 0 for none */
} ecd_layer;

typedef struct {
    ecd_kernels k;
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, vocab, max_pos;
    float eps, scale;
    const float *embed, *final_norm, *cos, *sin;
    const ecd_layer *layers;
} ecd_model;

/* out [n, p->out] = x [n, p->in] W^T (+ bias), part by part as blocks_linear does: the
 * K-quant parts share one quantization of x (into xq, xd, xs). */
static int project(const ecd_kernels *k, const ecd_proj *p, const float *x, int64_t n,
                   float *out, int8_t *xq, float *xd, float *xs) {
    int quantized = 0;
    for (int64_t i = 0; i < p->num_parts; i++) {
        const ecd_part *part = &p->parts[i];
        float *target = out + part->first;
        if (part->kind == 5 || part->kind == 6) {
            if (!quantized) k->quantize_rows(x, p->in, n, p->in, xq, xd, xs);
            quantized = 1;
            k->gemm_k(n, part->rows, p->in, part->kind, (const uint8_t *)part->qs,
                      (const uint8_t *)part->d, xq, xd, xs, target, p->out);
        } else if (k->linear((int)part->kind, x, p->in, n, part->rows, p->in, part->qs, part->d,
                             part->m, target, p->out)) {
            return -2;
        }
    }
    if (p->bias != NULL)
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = 0; j < p->out; j++) out[r * p->out + j] += p->bias[j];
    return 0;
}

static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The final normed hidden states out [n, hidden] of n decoding rows: token ids[r] at
 * positions[r], its K/V written to paged slot slots[r] and to position lens[r] - 1 of
 * decode-mirror row r, whose layer l halves are mirror[2 l], mirror[2 l + 1]
 * ([rows, kv_heads, mirror_cap, head_dim]). */
int ecd_decode_step(const ecd_model *m, int64_t n, const int64_t *ids, const int64_t *positions,
                    const int64_t *slots, const int64_t *lens, float *const *mirror,
                    int64_t mirror_cap, float *out, int nthreads) {
    const ecd_kernels *k = &m->k;
    const int64_t h = m->hidden, hd = m->head_dim;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t widest_in = max_i64(max_i64(h, q_size), m->inter);
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= m->vocab) return -1;
    const int64_t blocks = widest_in / 32;
    /* Each buffer 64-byte aligned, as torch's tensors are: a kernel's vector loop may
     * split a row by its alignment, and the rows must round as they do in the layers. */
    const int64_t sizes[] = {n * h,        n * h,          n * qkv_size,  n * (q_size + kv_size),
                             n * q_size,   n * h,          2 * n * m->inter, n * m->inter,
                             n * blocks,   n * blocks,     (n * widest_in + 3) / 4};
    float *buf[11];
    int64_t total = 0;
    for (int i = 0; i < 11; i++) total += (sizes[i] + 15) / 16 * 16;
    float *scratch = aligned_alloc(64, total * sizeof(float));
    if (scratch == NULL) return -2;
    for (int i = 0, at = 0; i < 11; at += (sizes[i] + 15) / 16 * 16, i++) buf[i] = scratch + at;
    float *residual = buf[0], *normed = buf[1], *qkv = buf[2], *qk = buf[3], *attn = buf[4];
    float *proj = buf[5], *gate_up = buf[6], *act = buf[7], *xd = buf[8], *xs = buf[9];
    int8_t *xq = (int8_t *)buf[10];
    int status = 0;
    for (int64_t r = 0; r < n; r++)
        memcpy(residual + r * h, m->embed + ids[r] * h, h * sizeof(float));
    for (int64_t l = 0; l < m->num_layers && status == 0; l++) {
        const ecd_layer *layer = &m->layers[l];
        /* the first layer norms the embedding; later ones add the previous MLP first */
        k->rms_norm(l ? proj : residual, h, residual, h, l > 0, layer->input_norm, normed, n, h,
                    m->eps, nthreads);
        if ((status = project(k, &layer->qkv, normed, n, qkv, xq, xd, xs))) break;
        /* Q and K heads, side by side: in the fused projection, or normed into qk */
        float *heads = qkv;
        int64_t stride = qkv_size;
        if (layer->q_norm != NULL) {
            heads = qk, stride = q_size + kv_size;
            for (int64_t r = 0; r < n; r++) {
                k->rms_norm(qkv + r * qkv_size, hd, NULL, 0, 0, layer->q_norm, qk + r * stride,
                            m->heads, hd, m->eps, nthreads);
                k->rms_norm(qkv + r * qkv_size + q_size, hd, NULL, 0, 0, layer->k_norm,
                            qk + r * stride + q_size, m->kv_heads, hd, m->eps, nthreads);
            }
        }
        if ((status = k->rotary(heads, stride, n, m->heads + m->kv_heads, hd, positions, m->cos,
                                m->sin, m->max_pos, nthreads)))
            break;
        const float *key = heads + q_size, *value = qkv + q_size + kv_size;
        if ((status = k->write_kv(layer->k_cache, layer->v_cache, key, stride, value, qkv_size,
                                  slots, n, kv_size, layer->cache_slots, nthreads)))
            break;
        if ((status = k->mirror_append(mirror[2 * l], mirror[2 * l + 1], key, stride, value,
                                       qkv_size, lens, n, m->kv_heads, hd, mirror_cap, nthreads)))
            break;
        if ((status = k->decode_attention(heads, stride, mirror[2 * l], mirror[2 * l + 1], lens,
                                          n, m->kv_heads, m->heads / m->kv_heads, hd, mirror_cap,
                                          layer->window, m->scale, attn, nthreads)))
            break;
        if ((status = project(k, &layer->o, attn, n, proj, xq, xd, xs))) break;
        k->rms_norm(proj, h, residual, h, 1, layer->post_norm, normed, n, h, m->eps, nthreads);
        if ((status = project(k, &layer->gate_up, normed, n, gate_up, xq, xd, xs))) break;
        k->silu_and_mul(gate_up, act, n, m->inter, nthreads);
        status = project(k, &layer->down, act, n, proj, xq, xd, xs);
    }
    if (status == 0)
        k->rms_norm(proj, h, residual, h, 1, m->final_norm, out, n, h, m->eps, nthreads);
    free(scratch);
    return status;
}
