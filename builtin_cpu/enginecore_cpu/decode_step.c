/* A whole decode step of a Llama-family model in one call (see decode_step.py).
 *
 * The step runs the same kernels the layers call one by one (cpu_kernels.c,
 * quant_kernels.c, kquant_kernels.c), through their addresses, on the same values, so
 * its hidden states are the layers' bit for bit; what it saves is the interpreter
 * between them (about 150 module calls and 300 foreign calls a step on a 30-layer
 * model) and the thread team's start and stop around each kernel.
 *
 * One OpenMP team runs the whole step as a sequence of phases, five a layer: QKV,
 * attention, O, gate/up (with SiLU on the same columns) and down. A phase is cut into
 * units (ECD_ROW_ALIGN output rows of a product, or attention's spans of positions of
 * a (row, KV head): see ec_attention_spans) that the threads take from a
 * shared counter in chunks of a share of what is left, shrinking to one unit at the
 * end: both threads finish a phase together, and a thread the OS has paused (a busy
 * laptop, a shared machine) holds up one chunk instead of a fixed share. Each thread
 * quantizes a phase's input once, for all the chunks it takes. Whoever
 * finishes a phase's last chunk runs the small serial work after it (the residual add
 * and RMS norm, the paged-cache write) and opens the next phase. Every output element
 * is computed by the same code whichever thread takes it, so the split changes no bit.
 * The kernels are this library's serial builds (decode_step.py), so no inner team is
 * started. A one-row step (a single stream) runs on the step's own team (ecd_team,
 * below), not an OpenMP one: between steps its threads spin no longer than at a phase
 * (ECD_SPIN_CYCLES), then sleep, where OpenMP's idle threads spin on for milliseconds
 * and take a core from the engine's and the frontend's Python between steps. Functions
 * returning int give -1 when an index is out of range (checked before the team starts)
 * and -2 without scratch memory.
 */
#if defined(ECD_PROFILE) && defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* RUSAGE_THREAD, for the profile's preemption counts */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#else
#include <time.h>
#endif
#include <stdatomic.h>

#include "kv_types.h"

/* Built with -DECD_PROFILE (benchmarks/decode_step_phases.py), each thread adds its time
 * per kind of work, its waits for the next phase, and (the first thread) the whole call
 * into ecd_profile, which ecd_profile_read hands out ([ECD_PROFILE_THREADS][PH_COUNT])
 * and clears. */
enum { PH_QKV, PH_ATTENTION, PH_O, PH_GATE_UP, PH_DOWN, PH_SERIAL, PH_WAIT, PH_CALL, PH_HEAD,
       PH_PICK, PH_COUNT };
#define ECD_PROFILE_THREADS 8
#ifdef ECD_PROFILE
#include <time.h>
static double ecd_profile[ECD_PROFILE_THREADS][PH_COUNT];
static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}
#define PROFILE_START(var) const double var = now_ns()
#define PROFILE_ADD(thread, kind, since)                                                   \
    do {                                                                                   \
        if ((thread) < ECD_PROFILE_THREADS) ecd_profile[thread][kind] += now_ns() - (since); \
    } while (0)
int ecd_profile_read(double *out) {
    memcpy(out, ecd_profile, sizeof(ecd_profile));
    memset(ecd_profile, 0, sizeof(ecd_profile));
    return ECD_PROFILE_THREADS * PH_COUNT;
}
/* The last call's timeline, phase by phase: when each phase closed (the call's start
 * first), and how often the OS preempted a step thread while it was in that phase
 * (involuntary context switches, RUSAGE_THREAD): on a shared machine, the phases no
 * thread was preempted in say what the phase takes on a quiet one. */
#include <sys/resource.h>
#define ECD_PROFILE_PHASES 1024
static double ecd_phase_close[ECD_PROFILE_PHASES + 1];
static _Atomic int32_t ecd_phase_preempted[ECD_PROFILE_PHASES];
static int64_t switches_now(void) {
    struct rusage use;
    getrusage(RUSAGE_THREAD, &use);
    return use.ru_nivcsw;
}
#define PROFILE_PHASE_OPEN(p) \
    do { if ((p) <= ECD_PROFILE_PHASES) ecd_phase_close[p] = now_ns(); } while (0)
#define PROFILE_SWITCHES(var) int64_t var = switches_now()
#define PROFILE_PREEMPTED(p, var)                                                          \
    do {                                                                                   \
        const int64_t now_switches = switches_now();                                       \
        if ((p) < ECD_PROFILE_PHASES && now_switches != (var))                             \
            atomic_fetch_add(&ecd_phase_preempted[p], (int32_t)(now_switches - (var)));    \
        (var) = now_switches;                                                              \
    } while (0)
/* close [phases + 1] (ns), preempted [phases]; returns the phases copied, then clears */
int ecd_profile_phases(double *close, int32_t *preempted, int phases) {
    if (phases > ECD_PROFILE_PHASES) phases = ECD_PROFILE_PHASES;
    memcpy(close, ecd_phase_close, (phases + 1) * sizeof(double));
    for (int p = 0; p < phases; p++) preempted[p] = atomic_exchange(&ecd_phase_preempted[p], 0);
    return phases;
}
#else
#define PROFILE_START(var) ((void)0)
#define PROFILE_ADD(thread, kind, since) ((void)0)
#define PROFILE_PHASE_OPEN(p) ((void)0)
#define PROFILE_SWITCHES(var) ((void)0)
#define PROFILE_PREEMPTED(p, var) ((void)0)
#endif

typedef void (*rms_norm_fn)(const float *, int64_t, float *, int64_t, int, const float *,
                            float *, int64_t, int64_t, float, int);
typedef int (*rotary_fn)(float *, int64_t, int64_t, int64_t, int64_t, const int64_t *,
                         const float *, const float *, int64_t, int);
typedef void (*silu_and_mul_fn)(const float *, float *, int64_t, int64_t, int);
/* The K/V kernels take the cache's element type last (EC_KV_* in kv_types.h). */
typedef int (*write_kv_fn)(void *, void *, const float *, int64_t, const float *, int64_t,
                           const int64_t *, int64_t, int64_t, int64_t, int, int);
typedef int (*mirror_append_fn)(void *, void *, const float *, int64_t, const float *,
                                int64_t, const int64_t *, int64_t, int64_t, int64_t, int64_t,
                                int64_t, int64_t, int64_t, int, int);
typedef int64_t (*attention_spans_fn)(int64_t);
typedef void (*attend_span_fn)(const float *, const void *, const void *, int64_t, int64_t,
                               int64_t, int64_t, float, int64_t, int64_t, float *, int);
typedef void (*merge_spans_fn)(const float *, int64_t, int64_t, int64_t, float *);
typedef int (*linear_fn)(int, const float *, int64_t, int64_t, int64_t, int64_t, const void *,
                         const void *, const void *, float *, int64_t);
typedef void (*quantize_rows_fn)(const float *, int64_t, int64_t, int64_t, int8_t *, float *,
                                 float *);
typedef void (*gemm_k_fn)(int64_t, int64_t, int64_t, int64_t, const uint8_t *, const uint8_t *,
                          const int8_t *, const float *, const float *, float *, int64_t);
typedef void (*gemm_q4_fn)(int64_t, int64_t, int64_t, const uint8_t *, const void *, const void *,
                           int, const int8_t *, const float *, const float *, float *, int64_t);
typedef void (*gemm_q8_fn)(int64_t, int64_t, int64_t, const int8_t *, const void *, int,
                           const int8_t *, const float *, float *, int64_t);
typedef int (*gemm_fn)(int, int64_t, int64_t, int64_t, const void *, const void *, const void *,
                       const int8_t *, const float *, const float *, float *, int64_t);
/* BLAS's column-major sgemm_ (32-bit integers, as the LP64 interface torch links) */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *,
                         const float *, const float *, const int *, const float *, const int *,
                         const float *, float *, const int *);

/* The kernels' addresses (any of the last may be null when no part needs it). */
typedef struct {
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    silu_and_mul_fn silu_and_mul;
    write_kv_fn write_kv;
    mirror_append_fn mirror_append;
    attention_spans_fn attention_spans;
    attend_span_fn attend_span;
    merge_spans_fn merge_spans;
    linear_fn linear;
    quantize_rows_fn quantize_rows;
    gemm_k_fn gemm_k;
    gemm_q4_fn gemm_q4;
    gemm_q8_fn gemm_q8;
    gemm_fn gemm; /* quant_gemm.c's many-row kernel */
    sgemm_fn sgemm; /* BLAS's, for float32 weights (null when no part is float32) */
    /* MKL's MKL_Set_Num_Threads_Local (by value), or null: sgemm on the calling thread
     * alone, so that a team of one computes what a larger team's threads (where MKL
     * runs nested, on one thread) compute */
    int (*blas_threads_local)(int);
    /* cpu_kernels.c's ec_argmax_rows (the first maximum, the first NaN: torch.argmax's) */
    void (*argmax_rows)(const float *, int64_t, int64_t, int64_t, int64_t *, int);
} ecd_kernels;

/* ecq_linear's kinds (quant_kernels.c) and the scale modes ecq_gemm_q4 reads them in:
 * the step quantizes a phase's activations once a thread and calls the products on
 * them, where ecq_linear would quantize them again for every chunk. */
enum { ECQ_Q4 = 4, ECQ_Q8 = 8, ECQ_Q4_HALF = 20, ECQ_Q4_0_HALF = 21, ECQ_Q8_HALF = 22,
       ECQ_Q4_K = 24 };
enum { SCALES_F32 = 0, SCALES_F16 = 1, SCALES_Q4K = 2, SCALES_F16_SYM = 3 };
/* Float32 weights, multiplied by BLAS's sgemm as F.linear does: stored as rows [out, in]
 * (ECD_F32_ROWS) or input-major, [in, out] in memory (ECD_F32_INPUT_MAJOR, the
 * cpu_packed linear method's layout); qs_row is then the floats between consecutive
 * weight rows (in) or between consecutive inputs (out). */
enum { ECD_F32_ROWS = 32, ECD_F32_INPUT_MAJOR = 33 };

/* Output rows [first, first + rows) of a projection in one block layout: kind 5 or 6 for
 * Q5_K / Q6_K (eck_gemm_k's bits; d the scale bytes, m unused), else ecq_linear's kind
 * (Q4_K among them); each weight row's bytes in qs, d and m (m_row 0 where m is not
 * read), so that a thread can take a range of rows; gemm_from: the rows from which the
 * many-row kernel computes the part (where it overtakes the one-row kernels). */
typedef struct {
    int64_t kind, first, rows;
    const void *qs;
    const void *d, *m;
    int64_t qs_row, d_row, m_row;
    int64_t gemm_from;
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
    void *k_cache, *v_cache; /* the paged cache's halves (elements of the model's kv_type) */
    int64_t cache_slots;      /* slots in each half */
    int64_t window;           /* sliding window, 0 for none */
} ecd_layer;

typedef struct {
    ecd_kernels k;
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, vocab, max_pos;
    float eps, scale;
    const float *embed, *final_norm, *cos, *sin;
    const ecd_layer *layers;
    /* The LM head (logits = final hidden states x head^T), or num_parts 0: the caller
     * computes the logits from the hidden states. */
    ecd_proj head;
    int64_t kv_type; /* the KV cache's and the mirror's element type (EC_KV_*) */
} ecd_model;

/* A thread's activations quantized as the block kernels read them (xq, xd, xs), and
 * which input they were made from in which phase (a thread quantizes each phase's input
 * once, whichever chunks it takes). */
typedef struct {
    int8_t *xq;
    float *xd, *xs;
    const float *from;
    int32_t phase;
} ecd_quantized;

static int is_f32(int64_t kind) { return kind == ECD_F32_ROWS || kind == ECD_F32_INPUT_MAJOR; }

/* Columns [a, b) of out [n, ldc] = x [n, in] W^T (+ bias, the columns' own, where given)
 * for a float32 part whose columns start at a - skip: one sgemm, the column-major view of
 * what F.linear computes. With a bias, F.linear's addmm copies it into the output and
 * has sgemm add the product to it (beta 1): BLAS may sum that in another order than a
 * bias added after (MKL does on some CPUs), so the step does the same. */
static void f32_columns(const ecd_kernels *k, const ecd_part *part, const float *x, int64_t n,
                        int64_t in, int64_t skip, int64_t cols, float *target, int64_t ldc,
                        const float *bias) {
    const int input_major = part->kind == ECD_F32_INPUT_MAJOR;
    const int m = (int)cols, rows = (int)n, depth = (int)in, lda = (int)part->qs_row;
    const int ld_out = (int)ldc;
    const float one = 1.0f, zero = 0.0f;
    const float *w = (const float *)part->qs + (input_major ? skip : skip * part->qs_row);
    if (bias != NULL)
        for (int64_t r = 0; r < n; r++) memcpy(target + r * ldc, bias, cols * sizeof(float));
    k->sgemm(input_major ? "N" : "T", "N", &m, &rows, &depth, &one, w, &lda, x, &depth,
             bias != NULL ? &one : &zero, target, &ld_out);
}

/* out [n, p->out] rows [lo, hi) of x [n, p->in] W^T (+ bias), part by part as
 * blocks_linear does, on x quantized into q (this thread's) as ecq_linear quantizes it
 * (float32 parts read x itself). A row's value does not depend on which rows are
 * computed with it. */
static int project_rows(const ecd_kernels *k, const ecd_proj *p, const float *x, int64_t n,
                        float *out, int64_t lo, int64_t hi, ecd_quantized *q, int32_t phase) {
    int quantized = 0;
    for (int64_t i = 0; i < p->num_parts; i++) quantized |= !is_f32(p->parts[i].kind);
    if (quantized && (q->from != x || q->phase != phase)) {
        k->quantize_rows(x, p->in, n, p->in, q->xq, q->xd, q->xs);
        q->from = x, q->phase = phase;
    }
    const int8_t *xq = q->xq;
    const float *xd = q->xd, *xs = q->xs;
    /* float32 parts alone, more than one row: the bias goes into sgemm as addmm's does
     * (one row: F.linear's bits are the product's plus the bias, as added below) */
    const int bias_in_product = p->bias != NULL && !quantized && n > 1;
    for (int64_t i = 0; i < p->num_parts; i++) {
        const ecd_part *part = &p->parts[i];
        const int64_t a = lo > part->first ? lo : part->first;
        const int64_t b = hi < part->first + part->rows ? hi : part->first + part->rows;
        if (a >= b) continue;
        const int64_t skip = a - part->first;
        if (is_f32(part->kind)) {
            f32_columns(k, part, x, n, p->in, skip, b - a, out + a, p->out,
                        bias_in_product ? p->bias + a : NULL);
            continue;
        }
        const char *qs = (const char *)part->qs + skip * part->qs_row;
        const char *d = (const char *)part->d + skip * part->d_row;
        const char *m = part->m == NULL ? NULL : (const char *)part->m + skip * part->m_row;
        float *target = out + a;
        if (n >= part->gemm_from) {
            if (k->gemm((int)part->kind, n, b - a, p->in, qs, d, m, xq, xd, xs, target, p->out))
                return -2;
        } else if (part->kind == 5 || part->kind == 6) {
            k->gemm_k(n, b - a, p->in, part->kind, (const uint8_t *)qs, (const uint8_t *)d, xq,
                      xd, xs, target, p->out);
        } else if (part->kind == ECQ_Q8 || part->kind == ECQ_Q8_HALF) {
            k->gemm_q8(n, b - a, p->in, (const int8_t *)qs, d, part->kind == ECQ_Q8_HALF, xq, xd,
                       target, p->out);
        } else if (part->kind == ECQ_Q4 || part->kind == ECQ_Q4_HALF ||
                   part->kind == ECQ_Q4_0_HALF || part->kind == ECQ_Q4_K) {
            const int mode = part->kind == ECQ_Q4_K        ? SCALES_Q4K
                             : part->kind == ECQ_Q4_HALF   ? SCALES_F16
                             : part->kind == ECQ_Q4_0_HALF ? SCALES_F16_SYM
                                                           : SCALES_F32;
            k->gemm_q4(n, b - a, p->in, (const uint8_t *)qs, d, m, mode, xq, xd, xs, target,
                       p->out);
        } else if (k->linear((int)part->kind, x, p->in, n, b - a, p->in, qs, d, m, target,
                             p->out)) {
            return -2;
        }
    }
    if (p->bias != NULL && !bias_in_product)
        for (int64_t r = 0; r < n; r++)
            for (int64_t j = lo; j < hi; j++) out[r * p->out + j] += p->bias[j];
    return 0;
}

#define ECD_ROW_ALIGN 16 /* rows a chunk of a product starts at a multiple of */
/* A thread takes 1 / (ECD_SHARE_DIVISOR threads) of what is left of a phase at a time:
 * large chunks while much is left, down to one unit at the end, so the threads finish a
 * phase within a unit of each other instead of one waiting out the other's last chunk.
 * Each chunk is a call of the product (its activations rearranged, its weight stream
 * and prefetches started again) and two atomic updates of lines both cores write: a
 * divisor of 4 cut a phase of a small model's layer into some 20-30 chunks of a few KB,
 * and its products read slower than in the 7-12 chunks of 1 (benchmarks/RESULTS.md,
 * "A phase in fewer chunks"). */
#ifndef ECD_SHARE_DIVISOR
#define ECD_SHARE_DIVISOR 1
#endif
/* The fewest units a chunk takes. This and the two figures around it can be set at
 * build time, so that benchmarks/engine_step_gap.py (--build) can time other values. */
#ifndef ECD_MIN_UNITS
#define ECD_MIN_UNITS 1
#endif
/* Cycles a thread spins for the next phase before it sleeps: longer than a phase of a
 * small model's layer takes, far shorter than the OS pauses a thread for (a spinning
 * thread would then take the core the paused one needs). */
#ifndef ECD_SPIN_CYCLES
#define ECD_SPIN_CYCLES 200000
#endif

static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t aligned_floats(int64_t floats) { return (floats + 15) / 16 * 16; }

enum { STAGE_QKV, STAGE_ATTENTION, STAGE_O, STAGE_GATE_UP, STAGE_DOWN, STAGES };
/* After the layers, where the step computes the head: its product (units of
 * ECD_HEAD_TILE vocabulary rows), then for greedy tokens each row's pick among the
 * tiles' maxima (units of ECD_ROW_ALIGN rows of the batch). */
enum { STAGE_HEAD = STAGES, STAGE_PICK, ALL_STAGES };
/* Vocabulary rows a tile of the head is: a thread's tile of logits for the whole batch
 * stays in its cache while its maxima are taken, and no [rows, vocab] logits exist. */
#define ECD_HEAD_TILE 128

/* A phase's counters of units (ECD_ROW_ALIGN rows of a product, or attention's spans)
 * taken and done, a cache line each so threads taking chunks of one
 * phase do not contend with the phase word. */
typedef struct {
    _Atomic int64_t next, done;
    char pad[48];
} ecd_counter;

/* What a step's threads share. */
typedef struct {
    const ecd_model *m;
    int64_t n;
    const int64_t *positions, *slots, *lens;
    void *const *mirror;
    const int64_t *mirror_shape; /* row stride, chunk, chunk stride, capacity (see below) */
    float *out;
    float *logits;        /* [n, head.out] the head's product, or null */
    int64_t *tokens;      /* [n] each row's argmax (logits null), or null */
    float *tile_max;      /* [n, head units] each tile's maximum, per row */
    int64_t *tile_at;     /* [n, head units] where it is */
    float *residual, *normed, *qkv, *qk, *attn, *proj, *gate_up, *act;
    int64_t unit[ALL_STAGES];  /* rows a unit of each stage is (1 for attention's) */
    int64_t count[ALL_STAGES]; /* units of each stage (attention's: per layer, below) */
    /* Layer l's attention units of rows before r: attn_first[l * (n + 1) + r]; a row's
     * units are its KV heads' spans, head by head */
    int64_t *attn_first;
    float *parts;             /* [n * kv_heads * max_spans] spans' sums (ec_attend_span) */
    int64_t max_spans;
    _Atomic int32_t *spans_done; /* [num_layers * n * kv_heads] spans attended */
    int threads;
    ecd_counter *counters; /* [num_layers * STAGES + 2]: the layers', then the head's */
    _Atomic int32_t phase __attribute__((aligned(64))); /* the open phase (a futex word) */
    _Atomic int32_t sleepers; /* threads asleep on it, or about to be */
    _Atomic int status;
} ecd_run;

/* Attention unit c of layer l: span j of KV head kh of row r. Each unit rotates its own
 * copy of the head's queries (q_rotated, the thread's); the head's last span, the only
 * one that reads this step's position, rotates K and appends K and V to the mirror;
 * whichever unit attends a head's last missing span merges its spans into attn. */
static void attend_unit(ecd_run *st, int64_t l, int64_t c, float *q_rotated) {
    const ecd_model *m = st->m;
    const ecd_kernels *k = &m->k;
    const ecd_layer *layer = &m->layers[l];
    const int64_t hd = m->head_dim, n = st->n;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size, group = m->heads / m->kv_heads;
    const int64_t *first = st->attn_first + l * (n + 1);
    int64_t r = 0, hi = n; /* the row: the last whose first unit is at or before c */
    while (hi - r > 1) {
        const int64_t mid = (r + hi) / 2;
        if (first[mid] <= c) r = mid;
        else hi = mid;
    }
    const int64_t spans = (first[r + 1] - first[r]) / m->kv_heads;
    const int64_t kh = (c - first[r]) / spans, j = (c - first[r]) % spans;
    /* Q and K heads, side by side: in the fused projection, or normed into qk */
    float *heads = layer->q_norm != NULL ? st->qk : st->qkv;
    const int64_t stride = layer->q_norm != NULL ? q_size + kv_size : qkv_size;
    const float *row = st->qkv + r * qkv_size;
    float *k_at = heads + r * stride + q_size + kh * hd;
    const float *v_at = row + q_size + kv_size + kh * hd;
    const int64_t *pos = st->positions + r;
    if (layer->q_norm != NULL)
        k->rms_norm(row + kh * group * hd, hd, NULL, 0, 0, layer->q_norm, q_rotated, group, hd,
                    m->eps, 1);
    else
        memcpy(q_rotated, row + kh * group * hd, group * hd * sizeof(float));
    k->rotary(q_rotated, 0, 1, group, hd, pos, m->cos, m->sin, m->max_pos, 1);
    const int64_t *shape = st->mirror_shape, chunk = shape[1], chunk_stride = shape[2];
    /* this row's KV head's first chunk (its positions: ec_decode_attention's layout) */
    const int64_t at = r * shape[0] + kh * chunk * hd * ec_kv_size((int)m->kv_type);
    char *mk = (char *)st->mirror[2 * l] + at, *mv = (char *)st->mirror[2 * l + 1] + at;
    const int kv_type = (int)m->kv_type;
    if (j == spans - 1) {
        if (layer->k_norm != NULL)
            k->rms_norm(row + q_size + kh * hd, hd, NULL, 0, 0, layer->k_norm, k_at, 1, hd,
                        m->eps, 1);
        k->rotary(k_at, 0, 1, 1, hd, pos, m->cos, m->sin, m->max_pos, 1);
        k->mirror_append(mk, mv, k_at, 0, v_at, 0, st->lens + r, 1, 1, hd, 0, chunk,
                         chunk_stride, shape[3], 1, kv_type);
    }
    const int64_t len = st->lens[r];
    const int64_t start = layer->window > 0 && len > layer->window ? len - layer->window : 0;
    const int64_t positions = len - start, part_size = group * hd + 2 * group;
    float *parts = st->parts + (r * m->kv_heads + kh) * st->max_spans * part_size;
    k->attend_span(q_rotated, mk, mv, start + positions * j / spans,
                   start + positions * (j + 1) / spans, chunk, chunk_stride, m->scale, group,
                   hd, parts + j * part_size, kv_type);
    /* the last span's adder sees every other span's part (acquire-release) */
    if (atomic_fetch_add(&st->spans_done[(l * n + r) * m->kv_heads + kh], 1) + 1 == spans)
        k->merge_spans(parts, spans, group, hd, st->attn + (r * m->kv_heads + kh) * group * hd);
}

/* Units [u, u_end) of stage s of layer l (phase p); q is the thread's quantized
 * activations, silu_in its scratch for SiLU's columns, q_rotated for a KV head's query
 * heads. Returns 0, or -2 without scratch
 * memory in a kernel. */
static int run_chunk(ecd_run *st, int64_t l, int s, int64_t u, int64_t u_end, int32_t p,
                     ecd_quantized *q, float *silu_in, float *q_rotated) {
    const ecd_model *m = st->m;
    const ecd_kernels *k = &m->k;
    const ecd_layer *layer = &m->layers[l];
    const int64_t n = st->n, hd = m->head_dim, h = m->hidden, inter = m->inter;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t lo = u * st->unit[s];
    if (s == STAGE_QKV) {
        const int64_t hi = u_end * st->unit[s] < qkv_size ? u_end * st->unit[s] : qkv_size;
        return project_rows(k, &layer->qkv, st->normed, n, st->qkv, lo, hi, q, p);
    }
    for (int64_t c = u; s == STAGE_ATTENTION && c < u_end; c++)
        attend_unit(st, l, c, q_rotated);
    if (s == STAGE_ATTENTION) return 0;
    if (s == STAGE_O) {
        const int64_t hi = u_end * st->unit[s] < h ? u_end * st->unit[s] : h;
        return project_rows(k, &layer->o, st->attn, n, st->proj, lo, hi, q, p);
    }
    if (s == STAGE_DOWN) {
        const int64_t hi = u_end * st->unit[s] < h ? u_end * st->unit[s] : h;
        return project_rows(k, &layer->down, st->act, n, st->proj, lo, hi, q, p);
    }
    /* gate columns [lo, hi) and the same up columns, then their SiLU product */
    const int64_t hi = u_end * st->unit[s] < inter ? u_end * st->unit[s] : inter;
    int status = project_rows(k, &layer->gate_up, st->normed, n, st->gate_up, lo, hi, q, p);
    status |= project_rows(k, &layer->gate_up, st->normed, n, st->gate_up, inter + lo,
                           inter + hi, q, p);
    if (lo == 0 && hi == inter) { /* all the columns (one thread): the rows as they lie */
        k->silu_and_mul(st->gate_up, st->act, n, inter, 1);
        return status;
    }
    for (int64_t r = 0; r < n; r++) {
        const float *g = st->gate_up + r * 2 * inter;
        memcpy(silu_in, g + lo, (hi - lo) * sizeof(float));
        memcpy(silu_in + (hi - lo), g + inter + lo, (hi - lo) * sizeof(float));
        k->silu_and_mul(silu_in, st->act + r * inter + lo, 1, hi - lo, 1);
    }
    return status;
}

/* Units [u, u_end) of the head's stages (phase p): tiles of the head's product, into the
 * logits where asked, else into the thread's `tile` [n, ECD_HEAD_TILE] and each row's
 * maximum in it (the product's bits either way: the same columns in each call); or rows
 * of the batch, each picking its token among its tiles' maxima. */
static int run_head_chunk(ecd_run *st, int s, int64_t u, int64_t u_end, int32_t p,
                          ecd_quantized *q, float *tile) {
    const ecd_model *m = st->m;
    const ecd_kernels *k = &m->k;
    const int64_t n = st->n, vocab = m->head.out, tiles = st->count[STAGE_HEAD];
    int status = 0;
    for (int64_t c = u; s == STAGE_HEAD && c < u_end; c++) {
        const int64_t lo = c * ECD_HEAD_TILE;
        const int64_t hi = lo + ECD_HEAD_TILE < vocab ? lo + ECD_HEAD_TILE : vocab;
        if (st->logits != NULL) {
            status |= project_rows(k, &m->head, st->out, n, st->logits, lo, hi, q, p);
            continue;
        }
        ecd_proj narrow = m->head; /* the tile's columns [lo, hi), rows hi - lo apart */
        narrow.out = hi - lo;
        status |= project_rows(k, &narrow, st->out, n, tile - lo, lo, hi, q, p);
        for (int64_t r = 0; r < n; r++) {
            int64_t at;
            k->argmax_rows(tile + r * (hi - lo), 1, hi - lo, hi - lo, &at, 1);
            st->tile_max[r * tiles + c] = tile[r * (hi - lo) + at];
            st->tile_at[r * tiles + c] = lo + at;
        }
    }
    const int64_t last = u_end * ECD_ROW_ALIGN < n ? u_end * ECD_ROW_ALIGN : n;
    for (int64_t r = u * ECD_ROW_ALIGN; s == STAGE_PICK && r < last; r++) {
        /* tiles in vocabulary order: a later tile wins only with a larger value, or with
         * the first NaN (the row's first, as none came before it) */
        const float *vals = st->tile_max + r * tiles;
        float best = vals[0];
        int64_t at = st->tile_at[r * tiles];
        for (int64_t c = 1; c < tiles && best == best; c++)
            if (vals[c] > best || vals[c] != vals[c]) best = vals[c], at = st->tile_at[r * tiles + c];
        st->tokens[r] = at;
    }
    return status;
}

/* The serial work after stage s of layer l, by the thread that finished it. */
static void after_stage(ecd_run *st, int64_t l, int s) {
    const ecd_model *m = st->m;
    const ecd_kernels *k = &m->k;
    const ecd_layer *layer = &m->layers[l];
    const int64_t n = st->n, h = m->hidden, hd = m->head_dim;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size;
    if (s == STAGE_ATTENTION) {
        /* the paged cache, which later prompts read (this step reads the mirror) */
        const float *heads = layer->q_norm != NULL ? st->qk : st->qkv;
        const int64_t stride = layer->q_norm != NULL ? q_size + kv_size : qkv_size;
        k->write_kv(layer->k_cache, layer->v_cache, heads + q_size, stride,
                    st->qkv + q_size + kv_size, qkv_size, st->slots, n, kv_size,
                    layer->cache_slots, 1, (int)m->kv_type);
    } else if (s == STAGE_O) {
        k->rms_norm(st->proj, h, st->residual, h, 1, layer->post_norm, st->normed, n, h, m->eps,
                    1);
    } else if (s == STAGE_DOWN) {
        const int last = l + 1 == m->num_layers;
        k->rms_norm(st->proj, h, st->residual, h, 1,
                    last ? m->final_norm : m->layers[l + 1].input_norm,
                    last ? st->out : st->normed, n, h, m->eps, 1);
    }
}

/* A fast clock for the spin budget: the time-stamp counter, elsewhere nanoseconds. */
static uint64_t cycles(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#else
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
#endif
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

/* Open phase p (its work and the serial work after it done), waking sleeping threads. */
static void open_phase(ecd_run *st, int32_t p) {
    atomic_store(&st->phase, p);
#ifdef __linux__
    if (atomic_load(&st->sleepers) > 0)
        syscall(SYS_futex, (int32_t *)&st->phase, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#endif
}

/* The first open phase after p: spinning a while, then asleep until one opens. */
static int32_t wait_after(ecd_run *st, int32_t p) {
    int32_t open;
    const uint64_t start = cycles();
    while ((open = atomic_load_explicit(&st->phase, memory_order_acquire)) <= p) {
        if (cycles() - start < ECD_SPIN_CYCLES) {
            cpu_relax();
            continue;
        }
#ifdef __linux__
        atomic_fetch_add(&st->sleepers, 1);
        /* the opener either sees this sleeper or changed the word before the wait */
        if ((open = atomic_load(&st->phase)) <= p)
            syscall(SYS_futex, (int32_t *)&st->phase, FUTEX_WAIT_PRIVATE, open, NULL, NULL, 0);
        atomic_fetch_sub(&st->sleepers, 1);
#else
        sched_yield();
#endif
    }
    return open;
}

/* The units a thread takes of the `left` of a phase on `threads` threads (see
 * ECD_SHARE_DIVISOR), at least one; exported for the tests. */
int64_t ecd_share(int64_t left, int threads) {
    /* one thread has no one to balance with: all that is left, in one call */
    if (threads <= 1) return left;
    return max_i64(ECD_MIN_UNITS, left / (ECD_SHARE_DIVISOR * threads));
}

/* Units [*first, return) of a phase's `count`, taken from its counter: ecd_share of what
 * is left; *first >= count once all are taken. */
static int64_t take_units(_Atomic int64_t *next, int64_t count, int threads, int64_t *first) {
    int64_t at = atomic_load_explicit(next, memory_order_relaxed);
    for (;;) {
        if (at >= count) {
            *first = at;
            return at;
        }
        const int64_t share = ecd_share(count - at, threads);
        const int64_t end = at + share < count ? at + share : count;
        if (atomic_compare_exchange_weak(next, &at, end)) {
            *first = at;
            return end;
        }
    }
}

/* One thread's part of the step: chunks of each open phase until the last is done. `own`
 * is its scratch: xd, xs, xq, SiLU's columns and a KV head's rotated queries. */
static void take_chunks(ecd_run *st, int t, float *own) {
    (void)t; /* the profile's index */
    const ecd_model *m = st->m;
    const int64_t n = st->n;
    const int64_t blocks =
        max_i64(max_i64(m->hidden, m->heads * m->head_dim), m->inter) / 32;
    ecd_quantized q = {.xd = own, .xs = own + aligned_floats(n * blocks), .phase = -1};
    q.xq = (int8_t *)(q.xs + aligned_floats(n * blocks));
    float *silu_in = (float *)q.xq + aligned_floats((n * blocks * 32 + 3) / 4);
    float *q_rotated = silu_in + aligned_floats(2 * m->inter);
    float *head_tile = q_rotated + aligned_floats(m->heads / m->kv_heads * m->head_dim);
    const int32_t layer_phases = (int32_t)(m->num_layers * STAGES);
    const int32_t phases = layer_phases + (st->logits != NULL ? 1 : st->tokens != NULL ? 2 : 0);
    int32_t p = 0;
    PROFILE_SWITCHES(switches);
    while (p < phases) {
        const int64_t l = p < layer_phases ? p / STAGES : m->num_layers - 1;
        const int s = p < layer_phases ? (int)(p % STAGES) : STAGES + (int)(p - layer_phases);
        ecd_counter *counter = &st->counters[p];
        for (;;) {
            int64_t u;
            const int64_t count = s == STAGE_ATTENTION
                                      ? st->attn_first[l * (n + 1) + n]
                                      : st->count[s];
            const int64_t u_end = take_units(&counter->next, count, st->threads, &u);
            if (u >= count) break;
            PROFILE_START(work);
            const int failed = s >= STAGES
                                   ? run_head_chunk(st, s, u, u_end, p, &q, head_tile)
                                   : run_chunk(st, l, s, u, u_end, p, &q, silu_in, q_rotated);
            if (failed) atomic_store(&st->status, -2);
            PROFILE_ADD(t, s == STAGE_HEAD ? PH_HEAD : s == STAGE_PICK ? PH_PICK : s, work);
            if (atomic_fetch_add(&counter->done, u_end - u) + (u_end - u) == count) {
                PROFILE_START(serial);
                if (s < STAGES) after_stage(st, l, s);
                PROFILE_ADD(t, PH_SERIAL, serial);
                PROFILE_PHASE_OPEN(p + 1);
                open_phase(st, p + 1);
                break;
            }
        }
        PROFILE_START(wait);
        const int32_t was = p;
        p = wait_after(st, p); /* a late thread may find several phases done */
        PROFILE_ADD(t, PH_WAIT, wait);
        PROFILE_PREEMPTED(was, switches);
        (void)was;
    }
}

/* The step's team: threads 1.. of every step, started on first use and kept. The caller
 * is thread 0. Each step bumps `generation` (a futex word) and waits until every worker
 * has counted itself out of `left`; a worker spins ECD_SPIN_CYCLES for either word to
 * move, then sleeps on it. Every started worker counts out of each step (those beyond
 * the step's threads without work), so no worker can see a later step's fields as its
 * own. One step at a time in a process (`lock`). */
#define ECD_MAX_WORKERS 255
typedef struct {
    pthread_mutex_t lock;
    int workers;
    int32_t born[ECD_MAX_WORKERS]; /* the generation a worker was started in */
    _Atomic int32_t generation __attribute__((aligned(64)));
    _Atomic int32_t sleepers;
    _Atomic int32_t left __attribute__((aligned(64)));
    _Atomic int32_t caller_asleep;
    /* the step in flight (written before its generation opens) */
    ecd_run *st;
    float *own_base;
    int64_t own_size;
    int threads;
} ecd_team;
static ecd_team team = {.lock = PTHREAD_MUTEX_INITIALIZER};
static pthread_once_t team_once = PTHREAD_ONCE_INIT;

/* A forked child has none of the parent's threads: it starts its own. */
static void team_after_fork(void) {
    pthread_mutex_init(&team.lock, NULL);
    team.workers = 0;
}
static void team_register_fork(void) { pthread_atfork(NULL, NULL, team_after_fork); }

/* Spins a while, then sleeps, while *word is `value`; *sleepers counts the sleepers. */
static void wait_while(_Atomic int32_t *word, int32_t value, _Atomic int32_t *sleepers) {
    const uint64_t start = cycles();
    while (atomic_load_explicit(word, memory_order_acquire) == value) {
        if (cycles() - start < ECD_SPIN_CYCLES) {
            cpu_relax();
            continue;
        }
#ifdef __linux__
        atomic_fetch_add(sleepers, 1);
        if (atomic_load(word) == value)
            syscall(SYS_futex, (int32_t *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
        atomic_fetch_sub(sleepers, 1);
#else
        sched_yield();
#endif
    }
}

static void wake_all(_Atomic int32_t *word, _Atomic int32_t *sleepers) {
#ifdef __linux__
    if (atomic_load(sleepers) > 0)
        syscall(SYS_futex, (int32_t *)word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#else
    (void)word, (void)sleepers;
#endif
}

static void *team_worker(void *arg) {
    const int t = (int)(intptr_t)arg; /* 1.. */
    int32_t seen = team.born[t - 1];
    for (;;) {
        wait_while(&team.generation, seen, &team.sleepers);
        seen = atomic_load_explicit(&team.generation, memory_order_acquire);
        if (t < team.threads) {
            const ecd_kernels *k = &team.st->m->k;
            if (k->blas_threads_local != NULL) k->blas_threads_local(1);
            take_chunks(team.st, t, team.own_base + t * team.own_size);
        }
        if (atomic_fetch_sub(&team.left, 1) == 1) wake_all(&team.left, &team.caller_asleep);
    }
    return NULL;
}

/* Starts workers up to threads - 1 (with every signal blocked: they go to Python's
 * threads); the threads the team has, with the caller. */
static int team_grow(int threads) {
    pthread_once(&team_once, team_register_fork);
    if (threads - 1 > ECD_MAX_WORKERS) threads = ECD_MAX_WORKERS + 1;
    if (team.workers >= threads - 1) return threads;
    sigset_t all, before;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &before);
    while (team.workers < threads - 1) {
        pthread_t id;
        team.born[team.workers] = atomic_load(&team.generation);
        if (pthread_create(&id, NULL, team_worker, (void *)(intptr_t)(team.workers + 1))) break;
        pthread_detach(id);
        team.workers++;
    }
    pthread_sigmask(SIG_SETMASK, &before, NULL);
    return team.workers + 1 < threads ? team.workers + 1 : threads;
}

/* The step on `threads` threads: the caller and the team's workers. */
static void team_run(ecd_run *st, float *own_base, int64_t own_size, int threads) {
    pthread_mutex_lock(&team.lock);
    threads = team_grow(threads);
    st->threads = threads;
    if (team.workers > 0) {
        team.st = st, team.own_base = own_base, team.own_size = own_size;
        team.threads = threads;
        atomic_store(&team.left, team.workers);
        atomic_fetch_add_explicit(&team.generation, 1, memory_order_release);
        wake_all(&team.generation, &team.sleepers);
    }
    take_chunks(st, 0, own_base);
    for (int32_t left; (left = atomic_load(&team.left)) != 0;)
        wait_while(&team.left, left, &team.caller_asleep);
    pthread_mutex_unlock(&team.lock);
}

/* The final normed hidden states out [n, hidden] of n decoding rows: token ids[r] at
 * positions[r], its K/V written to paged slot slots[r] and to position lens[r] - 1 of
 * decode-mirror row r, whose layer l halves are mirror[2 l], mirror[2 l + 1], laid out as
 * ec_decode_attention reads them: mirror_shape holds the bytes between rows, the positions
 * a chunk, the bytes between chunks and the positions a row (its capacity). With a head (m->head.num_parts > 0), also
 * its logits [n, head.out] where `logits` is given, else each row's argmax of them
 * into `tokens` where that is given (the logits never whole in memory). */
int ecd_decode_step(const ecd_model *m, int64_t n, const int64_t *ids, const int64_t *positions,
                    const int64_t *slots, const int64_t *lens, void *const *mirror,
                    const int64_t *mirror_shape, float *out, float *logits, int64_t *tokens,
                    int nthreads) {
    PROFILE_START(call);
    PROFILE_PHASE_OPEN(0);
    const ecd_kernels *k = &m->k;
    const int64_t h = m->hidden, hd = m->head_dim;
    const int64_t q_size = m->heads * hd, kv_size = m->kv_heads * hd;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t widest_in = max_i64(max_i64(h, q_size), m->inter);
    const int64_t mirror_cap = mirror_shape[3];
    if (mirror_shape[1] < 1) return -1;
    /* The kernels' own index checks, made once here: nothing fails inside the team. */
    for (int64_t r = 0; r < n; r++) {
        if (ids[r] < 0 || ids[r] >= m->vocab) return -1;
        if (positions[r] < 0 || positions[r] >= m->max_pos) return -1;
        if (lens[r] < 1 || lens[r] > mirror_cap) return -1;
        for (int64_t l = 0; l < m->num_layers; l++)
            if (slots[r] < 0 || slots[r] >= m->layers[l].cache_slots) return -1;
    }
    if (n < 1 || m->num_layers < 1) return -1;
    if ((logits != NULL || tokens != NULL) && (m->head.num_parts < 1 || m->head.in != h))
        return -1;
    if (tokens != NULL && logits == NULL && k->argmax_rows == NULL) return -1;
    if (logits != NULL) tokens = NULL; /* the caller picks from the logits */
    if (nthreads < 1) nthreads = 1;
    const int64_t head_tiles = (m->head.out + ECD_HEAD_TILE - 1) / ECD_HEAD_TILE;
    const int64_t blocks = widest_in / 32;
    /* Shared products, then each thread's own scratch (xd, xs, xq, SiLU's columns). Each
     * buffer 64-byte aligned, as torch's tensors are: a kernel's vector loop may split a
     * row by its alignment, and the rows must round as they do in the layers. */
    const int64_t sizes[] = {n * h,        n * h,          n * qkv_size, n * (q_size + kv_size),
                             n * q_size,   n * h,          2 * n * m->inter, n * m->inter};
    const int64_t group = m->heads / m->kv_heads;
    const int64_t own_size = 2 * aligned_floats(n * blocks) +
                             aligned_floats((n * blocks * 32 + 3) / 4) +
                             aligned_floats(2 * m->inter) + aligned_floats(group * hd) +
                             (tokens != NULL ? aligned_floats(n * ECD_HEAD_TILE) : 0);
    /* attention's spans: the most a row can have, their parts, each layer's units */
    const int64_t max_spans = k->attention_spans(mirror_cap);
    const int64_t parts_size =
        aligned_floats(n * m->kv_heads * max_spans * (group * hd + 2 * group));
    const int64_t first_size = aligned_floats(m->num_layers * (n + 1) * 2); /* int64s */
    const int64_t done_size = aligned_floats(m->num_layers * n * m->kv_heads); /* int32s */
    int64_t shared_total = 0;
    for (int i = 0; i < 8; i++) shared_total += aligned_floats(sizes[i]);
    /* each tile's maxima and where they are (int64, two floats each) */
    const int64_t picks = tokens != NULL ? 3 * aligned_floats(n * head_tiles) : 0;
    shared_total += picks;
    const int64_t counter_floats = aligned_floats(
        (int64_t)((m->num_layers * STAGES + 2) * sizeof(ecd_counter) + sizeof(ecd_run)) / 4 +
        1);
    const int64_t attention_size = parts_size + first_size + done_size;
    float *scratch = aligned_alloc(64, (shared_total + counter_floats + attention_size +
                                        nthreads * own_size) * sizeof(float));
    if (scratch == NULL) return -2;
    float *buf[8];
    for (int i = 0, at = 0; i < 8; at += aligned_floats(sizes[i]), i++) buf[i] = scratch + at;
    ecd_run *st = (ecd_run *)(scratch + shared_total);
    memset(st, 0, counter_floats * sizeof(float));
    st->counters = (ecd_counter *)(st + 1);
    st->parts = scratch + shared_total + counter_floats;
    st->attn_first = (int64_t *)(st->parts + parts_size);
    st->spans_done = (_Atomic int32_t *)(st->parts + parts_size + first_size);
    memset((void *)st->spans_done, 0, done_size * sizeof(float));
    st->max_spans = max_spans;
    for (int64_t l = 0; l < m->num_layers; l++) {
        int64_t *first = st->attn_first + l * (n + 1), window = m->layers[l].window;
        first[0] = 0;
        for (int64_t r = 0; r < n; r++) {
            const int64_t positions = window > 0 && lens[r] > window ? window : lens[r];
            first[r + 1] = first[r] + m->kv_heads * k->attention_spans(positions);
        }
    }
    float *own_base = scratch + shared_total + counter_floats + attention_size;
    st->m = m, st->n = n, st->positions = positions, st->slots = slots, st->lens = lens;
    st->mirror = mirror, st->mirror_shape = mirror_shape, st->out = out;
    st->logits = logits, st->tokens = tokens;
    if (picks) {
        st->tile_max = scratch + shared_total - picks;
        st->tile_at = (int64_t *)(st->tile_max + aligned_floats(n * head_tiles));
    }
    st->residual = buf[0], st->normed = buf[1], st->qkv = buf[2], st->qk = buf[3];
    st->attn = buf[4], st->proj = buf[5], st->gate_up = buf[6], st->act = buf[7];
    /* the first layer norms the embedding */
    for (int64_t r = 0; r < n; r++)
        memcpy(st->residual + r * h, m->embed + ids[r] * h, h * sizeof(float));
    k->rms_norm(st->residual, h, st->residual, h, 0, m->layers[0].input_norm, st->normed, n, h,
                m->eps, 1);
    /* shares sized for the threads asked for: a smaller team still takes every unit */
    const int64_t rows[STAGES] = {qkv_size, 0, h, m->inter, h};
    for (int s = 0; s < STAGES; s++) {
        st->unit[s] = s == STAGE_ATTENTION ? 1 : ECD_ROW_ALIGN;
        st->count[s] = (rows[s] + ECD_ROW_ALIGN - 1) / ECD_ROW_ALIGN;
    }
    st->unit[STAGE_HEAD] = ECD_HEAD_TILE, st->count[STAGE_HEAD] = head_tiles;
    st->unit[STAGE_PICK] = ECD_ROW_ALIGN;
    st->count[STAGE_PICK] = (n + ECD_ROW_ALIGN - 1) / ECD_ROW_ALIGN;
    st->threads = nthreads;
    const int blas_threads = k->blas_threads_local != NULL ? k->blas_threads_local(1) : 0;
    if (n == 1 && (k->sgemm == NULL || k->blas_threads_local != NULL)) {
        team_run(st, own_base, own_size, nthreads);
    } else {
        /* Many rows: torch's sampling ops on [rows, vocab] run OpenMP regions between
         * steps, and the step takes over OpenMP's threads still spinning after them
         * rather than compete with them. (Or a BLAS that keeps to one thread only
         * inside an OpenMP team, OpenBLAS's OpenMP build, for float32 parts.) */
#pragma omp parallel num_threads(nthreads)
        take_chunks(st, omp_get_thread_num(), own_base + omp_get_thread_num() * own_size);
    }
    if (k->blas_threads_local != NULL) k->blas_threads_local(blas_threads);
    const int status = atomic_load(&st->status);
    free(scratch);
    PROFILE_ADD(0, PH_CALL, call);
    return status;
}
