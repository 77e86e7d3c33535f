/* A whole decode step of a Llama-family model in one call (see decode_step.py).
 *
 * The step runs the same kernels the layers call one by one (cpu_kernels.c,
 * quant_kernels.c, kquant_kernels.c), through their addresses, on the same values, so
 * its hidden states are the layers' bit for bit; what it saves is the interpreter
 * between them (about 150 module calls and 300 foreign calls a step on a 30-layer
 * model) and the thread team's start and stop around each kernel.
 *
 * One OpenMP team runs the whole step. Each product's output rows are split over the
 * threads (by bytes, so mixed formats balance), each thread calling the kernel on its
 * own rows, whose inner parallel loop is then a team of one; attention is split by
 * (row, KV head), each unit rotating, appending and attending its own heads. Every
 * output element is computed by the same code whichever thread computes it, so the
 * split changes no bit. Five barriers a layer remain: after QKV, attention, O, gate/up
 * (with SiLU on each thread's own columns) and down. The residual stream and the
 * normed input are kept per thread, each thread computing the same values, so the
 * norms need no barrier of their own. Functions returning int give -1 when an index
 * is out of range (checked before the team starts) and -2 without scratch memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* Built with -DECD_PROFILE (benchmarks/decode_step_phases.py), the step adds each phase's
 * wall time on the first thread into ecd_phase_ns, which ecd_profile_read hands out and
 * clears: its work, then its wait at the barrier after it (the other threads' lag). */
enum {
    PH_START, PH_NORM, PH_QKV, PH_QKV_WAIT, PH_ATTENTION, PH_ATTENTION_WAIT, PH_O, PH_O_WAIT,
    PH_GATE_UP, PH_SILU, PH_GATE_UP_WAIT, PH_DOWN, PH_DOWN_WAIT, PH_END, PH_COUNT
};
#ifdef ECD_PROFILE
#include <time.h>
static double ecd_phase_ns[PH_COUNT];
static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}
#define MARK(phase)                                                                        \
    do {                                                                                   \
        const double t_ = now_ns();                                                        \
        ecd_phase_ns[phase] += t_ - mark_;                                                 \
        mark_ = t_;                                                                        \
    } while (0)
#define MARK_START double mark_ = now_ns()
int ecd_profile_read(double *out) {
    memcpy(out, ecd_phase_ns, sizeof(ecd_phase_ns));
    memset(ecd_phase_ns, 0, sizeof(ecd_phase_ns));
    return PH_COUNT;
}
#else
#define MARK(phase) ((void)0)
#define MARK_START ((void)0)
#endif

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
 * (Q4_K among them); each weight row's bytes in qs, d and m (m_row 0 where m is not
 * read), so that a thread can take a range of rows. */
typedef struct {
    int64_t kind, first, rows;
    const void *qs;
    const void *d, *m;
    int64_t qs_row, d_row, m_row;
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

/* out [n, p->out] rows [lo, hi) of x [n, p->in] W^T (+ bias), part by part as
 * blocks_linear does: the K-quant parts quantize x into xq, xd, xs (this thread's).
 * A row's value does not depend on which rows are computed with it. */
static int project_rows(const ecd_kernels *k, const ecd_proj *p, const float *x, int64_t n,
                        float *out, int64_t lo, int64_t hi, int8_t *xq, float *xd, float *xs) {
    int quantized = 0;
    for (int64_t i = 0; i < p->num_parts; i++) {
        const ecd_part *part = &p->parts[i];
        const int64_t a = lo > part->first ? lo : part->first;
        const int64_t b = hi < part->first + part->rows ? hi : part->first + part->rows;
        if (a >= b) continue;
        const int64_t skip = a - part->first;
        const char *qs = (const char *)part->qs + skip * part->qs_row;
        const char *d = (const char *)part->d + skip * part->d_row;
        const char *m = part->m == NULL ? NULL : (const char *)part->m + skip * part->m_row;
        float *target = out + a;
        if (part->kind == 5 || part->kind == 6) {
            if (!quantized) k->quantize_rows(x, p->in, n, p->in, xq, xd, xs);
            quantized = 1;
            k->gemm_k(n, b - a, p->in, part->kind, (const uint8_t *)qs, (const uint8_t *)d, xq,
                      xd, xs, target, p->out);
        } else if (k->linear((int)part->kind, x, p->in, n, b - a, p->in, qs, d, m, target,
                             p->out)) {
            return -2;
        }
    }
    if (p->bias != NULL)
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = lo; j < hi; j++) out[r * p->out + j] += p->bias[j];
    return 0;
}

#define ECD_ROW_ALIGN 16 /* rows a thread's range starts at a multiple of */

/* Thread t's rows [*lo, *hi) of projection p among `threads`: the weight's bytes split
 * evenly, boundaries rounded to ECD_ROW_ALIGN rows. */
static void row_range(const ecd_proj *p, int t, int threads, int64_t *lo, int64_t *hi) {
    double total = 0.0;
    for (int64_t i = 0; i < p->num_parts; i++) {
        const ecd_part *part = &p->parts[i];
        total += (double)part->rows * (double)(part->qs_row + part->d_row + part->m_row);
    }
    int64_t bounds[2];
    for (int e = 0; e < 2; e++) {
        const int which = t + e;
        if (which == 0 || which == threads) {
            bounds[e] = which == 0 ? 0 : p->out;
            continue;
        }
        const double goal = total * which / threads;
        double seen = 0.0;
        int64_t row = p->out;
        for (int64_t i = 0; i < p->num_parts; i++) {
            const ecd_part *part = &p->parts[i];
            const double per_row = (double)(part->qs_row + part->d_row + part->m_row);
            if (seen + per_row * (double)part->rows >= goal) {
                row = part->first + (int64_t)((goal - seen) / per_row + 0.5);
                break;
            }
            seen += per_row * (double)part->rows;
        }
        row = (row + ECD_ROW_ALIGN / 2) / ECD_ROW_ALIGN * ECD_ROW_ALIGN;
        bounds[e] = row < p->out ? row : p->out;
    }
    *lo = bounds[0];
    *hi = bounds[1] > bounds[0] ? bounds[1] : bounds[0];
}

/* Thread t's share [*lo, *hi) of `count` columns, in multiples of ECD_ROW_ALIGN. */
static void even_range(int64_t count, int t, int threads, int64_t *lo, int64_t *hi) {
    const int64_t chunks = (count + ECD_ROW_ALIGN - 1) / ECD_ROW_ALIGN;
    const int64_t a = chunks * t / threads * ECD_ROW_ALIGN;
    const int64_t b = chunks * (t + 1) / threads * ECD_ROW_ALIGN;
    *lo = a < count ? a : count;
    *hi = b < count ? b : count;
}

static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t aligned_floats(int64_t floats) { return (floats + 15) / 16 * 16; }

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
    const int64_t group = m->heads / m->kv_heads;
    const int64_t widest_in = max_i64(max_i64(h, q_size), m->inter);
    /* The kernels' own index checks, made once here: nothing fails inside the team. */
    for (int64_t r = 0; r < n; r++) {
        if (ids[r] < 0 || ids[r] >= m->vocab) return -1;
        if (positions[r] < 0 || positions[r] >= m->max_pos) return -1;
        if (lens[r] < 1 || lens[r] > mirror_cap) return -1;
        for (int64_t l = 0; l < m->num_layers; l++)
            if (slots[r] < 0 || slots[r] >= m->layers[l].cache_slots) return -1;
    }
    if (nthreads < 1) nthreads = 1;
    const int64_t blocks = widest_in / 32;
    /* Shared: the step's products; per thread: the residual stream, the normed input,
     * the quantized activations and SiLU's gate/up columns. Each buffer 64-byte aligned,
     * as torch's tensors are: a kernel's vector loop may split a row by its alignment,
     * and the rows must round as they do in the layers. */
    const int64_t shared_sizes[] = {n * qkv_size, n * (q_size + kv_size), n * q_size, n * h,
                                    2 * n * m->inter, n * m->inter};
    const int64_t own_sizes[] = {n * h, n * h, n * blocks, n * blocks, (n * widest_in + 3) / 4,
                                 2 * n * m->inter};
    int64_t shared_total = 0, own_total = 0;
    for (int i = 0; i < 6; i++) shared_total += aligned_floats(shared_sizes[i]);
    for (int i = 0; i < 6; i++) own_total += aligned_floats(own_sizes[i]);
    float *scratch = aligned_alloc(64, (shared_total + nthreads * own_total) * sizeof(float));
    if (scratch == NULL) return -2;
    float *shared[6];
    for (int i = 0, at = 0; i < 6; at += aligned_floats(shared_sizes[i]), i++)
        shared[i] = scratch + at;
    float *qkv = shared[0], *qk = shared[1], *attn = shared[2], *proj = shared[3];
    float *gate_up = shared[4], *act = shared[5];
    int status = 0;
    MARK_START;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        if (t == 0) MARK(PH_START);
        float *own[6];
        float *mine = scratch + shared_total + t * own_total;
        for (int i = 0, at = 0; i < 6; at += aligned_floats(own_sizes[i]), i++)
            own[i] = mine + at;
        float *residual = own[0], *normed = own[1], *xd = own[2], *xs = own[3];
        int8_t *xq = (int8_t *)own[4];
        float *silu_in = own[5];
        int failed = 0; /* this thread's; a failure skips work, never a barrier */
        for (int64_t r = 0; r < n; r++)
            memcpy(residual + r * h, m->embed + ids[r] * h, h * sizeof(float));
        int64_t lo, hi;
        for (int64_t l = 0; l < m->num_layers; l++) {
            const ecd_layer *layer = &m->layers[l];
            /* the first layer norms the embedding; later ones add the previous MLP first */
            k->rms_norm(l ? proj : residual, h, residual, h, l > 0, layer->input_norm, normed,
                        n, h, m->eps, 1);
            if (t == 0) MARK(PH_NORM);
            row_range(&layer->qkv, t, threads, &lo, &hi);
            failed |= !failed && project_rows(k, &layer->qkv, normed, n, qkv, lo, hi, xq, xd, xs);
            if (t == 0) MARK(PH_QKV);
#pragma omp barrier
            if (t == 0) MARK(PH_QKV_WAIT);
            /* Q and K heads, side by side: in the fused projection, or normed into qk */
            float *heads = layer->q_norm != NULL ? qk : qkv;
            const int64_t stride = layer->q_norm != NULL ? q_size + kv_size : qkv_size;
            lo = n * m->kv_heads * t / threads, hi = n * m->kv_heads * (t + 1) / threads;
            for (int64_t u = lo; u < hi; u++) {
                const int64_t r = u / m->kv_heads, kh = u % m->kv_heads;
                const float *row = qkv + r * qkv_size;
                float *q_at = heads + r * stride + kh * group * hd;
                float *k_at = heads + r * stride + q_size + kh * hd;
                const float *v_at = row + q_size + kv_size + kh * hd;
                if (layer->q_norm != NULL) {
                    k->rms_norm(row + kh * group * hd, hd, NULL, 0, 0, layer->q_norm, q_at,
                                group, hd, m->eps, 1);
                    k->rms_norm(row + q_size + kh * hd, hd, NULL, 0, 0, layer->k_norm, k_at, 1,
                                hd, m->eps, 1);
                }
                k->rotary(q_at, 0, 1, group, hd, positions + r, m->cos, m->sin, m->max_pos, 1);
                k->rotary(k_at, 0, 1, 1, hd, positions + r, m->cos, m->sin, m->max_pos, 1);
                const int64_t at = (r * m->kv_heads + kh) * mirror_cap * hd;
                k->mirror_append(mirror[2 * l] + at, mirror[2 * l + 1] + at, k_at, 0, v_at, 0,
                                 lens + r, 1, 1, hd, mirror_cap, 1);
                k->decode_attention(q_at, 0, mirror[2 * l] + at, mirror[2 * l + 1] + at,
                                    lens + r, 1, 1, group, hd, mirror_cap, layer->window,
                                    m->scale, attn + (r * m->kv_heads + kh) * group * hd, 1);
            }
            if (t == 0) MARK(PH_ATTENTION);
#pragma omp barrier
            if (t == 0) MARK(PH_ATTENTION_WAIT);
            /* the paged cache is read by later prompts, not by this step: one thread */
            if (t == threads - 1)
                k->write_kv(layer->k_cache, layer->v_cache, heads + q_size, stride,
                            qkv + q_size + kv_size, qkv_size, slots, n, kv_size,
                            layer->cache_slots, 1);
            row_range(&layer->o, t, threads, &lo, &hi);
            failed |= !failed && project_rows(k, &layer->o, attn, n, proj, lo, hi, xq, xd, xs);
            if (t == 0) MARK(PH_O);
#pragma omp barrier
            if (t == 0) MARK(PH_O_WAIT);
            k->rms_norm(proj, h, residual, h, 1, layer->post_norm, normed, n, h, m->eps, 1);
            if (t == 0) MARK(PH_NORM);
            /* gate columns [lo, hi) and the same up columns, then their SiLU product */
            const int64_t inter = m->inter;
            even_range(inter, t, threads, &lo, &hi);
            failed |= !failed && project_rows(k, &layer->gate_up, normed, n, gate_up, lo, hi,
                                              xq, xd, xs);
            failed |= !failed && project_rows(k, &layer->gate_up, normed, n, gate_up,
                                              inter + lo, inter + hi, xq, xd, xs);
            if (t == 0) MARK(PH_GATE_UP);
            if (hi > lo)
                for (int64_t r = 0; r < n; r++) {
                    const float *g = gate_up + r * 2 * inter;
                    memcpy(silu_in, g + lo, (hi - lo) * sizeof(float));
                    memcpy(silu_in + (hi - lo), g + inter + lo, (hi - lo) * sizeof(float));
                    k->silu_and_mul(silu_in, act + r * inter + lo, 1, hi - lo, 1);
                }
            if (t == 0) MARK(PH_SILU);
#pragma omp barrier
            if (t == 0) MARK(PH_GATE_UP_WAIT);
            row_range(&layer->down, t, threads, &lo, &hi);
            failed |= !failed && project_rows(k, &layer->down, act, n, proj, lo, hi, xq, xd, xs);
            if (t == 0) MARK(PH_DOWN);
#pragma omp barrier
            if (t == 0) MARK(PH_DOWN_WAIT);
        }
        if (t == 0) k->rms_norm(proj, h, residual, h, 1, m->final_norm, out, n, h, m->eps, 1);
        if (failed) {
#pragma omp atomic write
            status = -2;
        }
    }
    MARK(PH_END);
    free(scratch);
    return status;
}
