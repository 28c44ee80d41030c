/* ucm native engine, see ucm_native.h for the contract. */
#define _POSIX_C_SOURCE 200809L
#include "ucm_native.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#ifndef UCM_NATIVE_SOURCE_DIGEST
#define UCM_NATIVE_SOURCE_DIGEST ""
#endif

#define UCM_MAX_THREADS 64
/* Below this many bytes per thread, extra threads cost more than they give. */
#define UCM_MIN_BYTES_PER_THREAD (256u * 1024u)

int ucm_native_abi(void) { return UCM_NATIVE_ABI; }

const char *ucm_native_source_digest(void) { return UCM_NATIVE_SOURCE_DIGEST; }

int ucm_max_threads(void) { return UCM_MAX_THREADS; }

/* One thread's share: bytes [begin, end) of the concatenation of all segments. */
typedef struct {
    const uint64_t *src;
    const uint64_t *dst;
    const uint64_t *len;
    size_t n;
    uint64_t begin;
    uint64_t end;
} copy_job;

static void copy_range(const copy_job *job) {
    uint64_t pos = 0; /* byte offset of segment i in the concatenation */
    for (size_t i = 0; i < job->n && pos < job->end; i++) {
        uint64_t seg_len = job->len[i];
        uint64_t seg_end = pos + seg_len;
        if (seg_end > job->begin && seg_len > 0) {
            uint64_t lo = job->begin > pos ? job->begin - pos : 0;
            uint64_t hi = job->end < seg_end ? job->end - pos : seg_len;
            memcpy((char *)(uintptr_t)job->dst[i] + lo,
                   (const char *)(uintptr_t)job->src[i] + lo, (size_t)(hi - lo));
        }
        pos = seg_end;
    }
}

static void *copy_thread(void *arg) {
    copy_range((const copy_job *)arg);
    return NULL;
}

int ucm_copy_segments(const uint64_t *src, const uint64_t *dst,
                      const uint64_t *len, size_t n, int n_threads) {
    if (n_threads < 1) return -EINVAL;
    if (n == 0) return 0;
    if (src == NULL || dst == NULL || len == NULL) return -EINVAL;

    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (len[i] > 0 && (src[i] == 0 || dst[i] == 0)) return -EINVAL;
        total += len[i];
    }

    uint64_t useful = total / UCM_MIN_BYTES_PER_THREAD;
    int threads = n_threads;
    if (threads > UCM_MAX_THREADS) threads = UCM_MAX_THREADS;
    if ((uint64_t)threads > useful) threads = useful > 0 ? (int)useful : 1;

    if (threads == 1) {
        copy_job job = {src, dst, len, n, 0, total};
        copy_range(&job);
        return 0;
    }

    copy_job jobs[UCM_MAX_THREADS];
    pthread_t tids[UCM_MAX_THREADS];
    int started[UCM_MAX_THREADS];
    /* Split on 4 KiB boundaries so threads do not share cache lines or pages. */
    uint64_t share = (total / (uint64_t)threads + 4095u) & ~(uint64_t)4095u;
    for (int t = 0; t < threads; t++) {
        uint64_t b = share * (uint64_t)t;
        uint64_t e = b + share;
        if (b > total) b = total;
        if (e > total || t == threads - 1) e = total;
        copy_job j = {src, dst, len, n, b, e};
        jobs[t] = j;
    }
    /* Thread 0's share runs on the calling thread. */
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&tids[t], NULL, copy_thread, &jobs[t]) == 0;
        if (!started[t]) copy_range(&jobs[t]); /* degrade, never fail */
    }
    copy_range(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
    }
    return 0;
}

void *ucm_alloc_aligned(size_t size, size_t alignment) {
    if (size == 0) return NULL;
    if (alignment < sizeof(void *) || (alignment & (alignment - 1)) != 0) return NULL;
    void *p = NULL;
    if (posix_memalign(&p, alignment, size) != 0) return NULL;
    memset(p, 0, size);
    return p;
}

void ucm_free_aligned(void *p) { free(p); }
