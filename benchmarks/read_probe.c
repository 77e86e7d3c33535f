/* Bytes a second that `threads` threads read from memory together, and whether the OS
 * preempted any of them meanwhile (benchmarks/step_builds.py): each thread sums its share
 * of the buffer with 512-bit loads (or what the compiler makes of them), timed from the
 * first thread's start to the last one's end. On a shared machine the windows no thread
 * was preempted in say what the cores read on a quiet one. */
#define _GNU_SOURCE /* RUSAGE_THREAD */
#include <pthread.h>
#include <stdint.h>
#include <sys/resource.h>
#include <time.h>

typedef struct {
    const float *from;
    int64_t floats;
    pthread_barrier_t *start;
    double began, ended, sum;
    int64_t preempted;
} share;

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static int64_t switches(void) {
    struct rusage use;
    getrusage(RUSAGE_THREAD, &use);
    return use.ru_nivcsw;
}

static void *read_share(void *arg) {
    share *s = arg;
    pthread_barrier_wait(s->start);
    const int64_t before = switches();
    s->began = now_ns();
    float lanes[32] = {0};
#pragma GCC unroll 2
    for (int64_t i = 0; i + 32 <= s->floats; i += 32)
        for (int j = 0; j < 32; j++) lanes[j] += s->from[i + j];
    s->ended = now_ns();
    s->preempted = switches() - before;
    for (int j = 0; j < 32; j++) s->sum += lanes[j];
    return NULL;
}

/* Reads `bytes` of `buffer` on `threads` (1-16) threads; returns the nanoseconds it took,
 * and in *preempted the threads' involuntary context switches meanwhile. */
double erp_read(const float *buffer, int64_t bytes, int threads, int64_t *preempted) {
    pthread_t ids[16];
    share shares[16];
    pthread_barrier_t start;
    if (threads < 1) threads = 1;
    if (threads > 16) threads = 16;
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    const int64_t floats = bytes / 4 / threads;
    for (int t = 0; t < threads; t++) {
        shares[t] = (share){.from = buffer + t * floats, .floats = floats, .start = &start};
        pthread_create(&ids[t], NULL, read_share, &shares[t]);
    }
    double began = 1e300, ended = 0;
    *preempted = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(ids[t], NULL);
        *preempted += shares[t].preempted;
        began = shares[t].began < began ? shares[t].began : began;
        ended = shares[t].ended > ended ? shares[t].ended : ended;
    }
    pthread_barrier_destroy(&start);
    return ended - began;
}
