/* One-row block products timed in core-clock ticks (rdtsc), one thread, for
 * benchmarks/one_row_cycles.py: the kernels' own sources linked in, their serial builds
 * (as the fused decode step holds them), random blocks with normal scales.
 *
 *   one_row_cycles FORMAT N K COPIES ROUNDS
 *
 * prints the fewest ticks a call took over ROUNDS passes over COPIES weights of N x K
 * (the least disturbed pass on a shared machine), and the bytes a call reads. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

void eck_gemm_k(int64_t M, int64_t N, int64_t K, int64_t bits, const uint8_t *wq,
                const uint8_t *wh, const int8_t *xq, const float *xd, const float *xs,
                float *out, int64_t ldo);
void ecq_gemm_q4(int64_t M, int64_t N, int64_t K, const uint8_t *wq, const void *wd,
                 const void *wm, int mode, const int8_t *xq, const float *xd, const float *xs,
                 float *out, int64_t ldo);
void ecq_gemm_q8(int64_t M, int64_t N, int64_t K, const int8_t *wq, const void *wd, int half,
                 const int8_t *xq, const float *xd, float *out, int64_t ldo);

static uint64_t state = 88172645463325252ull;
static uint64_t next(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
}
static void fill(uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)next();
}
static uint16_t half_scale(void) { return (uint16_t)(0x2000 + (next() & 0x3FF)); }
static uint8_t *block(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64); }

int main(int argc, char **argv) {
    if (argc != 6) return 2;
    const char *fmt = argv[1];
    const int64_t N = atoll(argv[2]), K = atoll(argv[3]), copies = atoll(argv[4]);
    const int64_t rounds = atoll(argv[5]), nb = K / 32, supers = N * (K / 256);
    /* kind: 5, 6 (eck_gemm_k's bits); ecq_gemm_q4's scale modes 3 (Q4_0), 1 (Q4_1), 2
     * (Q4_K) as 40 + mode; 8 (Q8_0, float16 scales) */
    int kind;
    size_t qbytes, dbytes, mbytes = 0;
    if (!strcmp(fmt, "Q5_K")) kind = 5, qbytes = N * (K / 64) * 40, dbytes = supers * 16;
    else if (!strcmp(fmt, "Q6_K")) kind = 6, qbytes = N * (K / 64) * 48, dbytes = supers * 18;
    else if (!strcmp(fmt, "Q4_0")) kind = 43, qbytes = N * K / 2, dbytes = N * nb * 2;
    else if (!strcmp(fmt, "Q4_1")) kind = 41, qbytes = N * K / 2, dbytes = mbytes = N * nb * 2;
    else if (!strcmp(fmt, "Q4_K")) kind = 42, qbytes = N * K / 2, dbytes = supers * 16;
    else if (!strcmp(fmt, "Q8_0")) kind = 8, qbytes = N * K, dbytes = N * nb * 2;
    else return 2;
    uint8_t **wq = malloc(copies * sizeof *wq), **wd = malloc(copies * sizeof *wd);
    uint8_t **wm = malloc(copies * sizeof *wm);
    for (int64_t c = 0; c < copies; c++) {
        fill(wq[c] = block(qbytes), qbytes);
        fill(wd[c] = block(dbytes), dbytes);
        wm[c] = mbytes ? block(mbytes) : NULL;
        for (size_t i = 0; i < mbytes / 2; i++) ((uint16_t *)wm[c])[i] = half_scale();
        if (kind == 6) {
            for (int64_t s = 0; s < supers; s++) memcpy(wd[c] + s * 18 + 16, &(uint16_t){half_scale()}, 2);
        } else if (kind == 5 || kind == 42) {
            for (int64_t s = 0; s < supers; s++) {
                const uint16_t d = half_scale(), dmin = half_scale();
                memcpy(wd[c] + s * 16, &d, 2), memcpy(wd[c] + s * 16 + 2, &dmin, 2);
            }
        } else {
            for (size_t i = 0; i < dbytes / 2; i++) ((uint16_t *)wd[c])[i] = half_scale();
        }
    }
    int8_t *xq = (int8_t *)block(K);
    float *xd = malloc(nb * sizeof *xd), *xs = malloc(nb * sizeof *xs), *out = malloc(N * sizeof *out);
    for (int64_t i = 0; i < K; i++) xq[i] = (int8_t)((int)(next() % 255) - 127);
    for (int64_t b = 0; b < nb; b++) {
        int sum = 0;
        for (int i = 0; i < 32; i++) sum += xq[b * 32 + i];
        xd[b] = 0.01f + (float)(next() % 100) * 1e-4f, xs[b] = xd[b] * (float)sum;
    }
    double best = 1e300;
    for (int64_t r = 0; r < rounds; r++) {
        const uint64_t started = __rdtsc();
        for (int64_t c = 0; c < copies; c++) {
            if (kind == 5 || kind == 6)
                eck_gemm_k(1, N, K, kind, wq[c], wd[c], xq, xd, xs, out, N);
            else if (kind == 8)
                ecq_gemm_q8(1, N, K, (const int8_t *)wq[c], wd[c], 1, xq, xd, out, N);
            else
                ecq_gemm_q4(1, N, K, wq[c], wd[c], wm[c], kind - 40, xq, xd, xs, out, N);
        }
        const double took = (double)(__rdtsc() - started) / (double)copies;
        if (took < best) best = took;
    }
    /* Q4_0 forms its offsets from its scales: it reads no m */
    printf("%.0f %zu\n", best, qbytes + dbytes + mbytes);
    return 0;
}
