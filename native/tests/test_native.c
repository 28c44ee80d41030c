/*
 * Standalone tests for the ucm native engine (native/ucm_native.c).
 *
 * No framework: CHECK counts passes and failures, the last line printed is
 * "N passed, N failed" and the exit status is non-zero on any failure.
 * Build and run through native/Makefile (`make -C native test`, `make -C native
 * tsan`), which compiles this file and ucm_native.c under sanitizers.
 *
 * Randomised cases use a fixed-seed xorshift64 PRNG, so every run is the same;
 * pass a seed as argv[1] to explore other cases (the seed is printed).
 *
 * When built with -DUCM_TEST_WRAP_PTHREAD_CREATE and linked with
 * -Wl,--wrap=pthread_create (the Makefile does both), the pthread_create calls
 * made by ucm_native.c go through __wrap_pthread_create below. That lets the
 * tests count the worker threads actually started (so they can prove that both
 * the single-thread and the multi-thread paths ran) and force thread creation
 * to fail (the documented "degrade, never fail" path).
 *
 * Covered: ucm_copy_segments on the single-thread, multi-thread (up to the
 * 64-thread cap) and non-temporal-store (total >= 8 MiB) paths against a plain
 * memcpy loop, with sentinel-filled destinations; argument validation;
 * ucm_alloc_aligned on the posix_memalign (< 2 MiB) and mmap (>= 2 MiB) paths:
 * alignment, zero fill, pages faulted in (mincore), full unmap on free.
 * Under -fsanitize=thread the data-race checks come from TSan itself (the
 * non-temporal stores are invisible to it; the sentinel checks still apply).
 */
#define _GNU_SOURCE /* mincore, O_PATH */
#define _POSIX_C_SOURCE 200809L
#include "../ucm_native.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Tiny test harness                                                         */
/* ------------------------------------------------------------------------ */

static long g_passed;
static long g_failed;
static const char *g_section = "";

static void check_fail(const char *file, int line, const char *expr,
                       const char *fmt, ...) {
    g_failed++;
    fprintf(stderr, "FAIL %s:%d [%s]: %s", file, line, g_section, expr);
    if (fmt != NULL && fmt[0] != '\0') {
        va_list ap;
        va_start(ap, fmt);
        fputs(" -- ", stderr);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fputc('\n', stderr);
}

/* CHECK(cond) / CHECKF(cond, fmt, ...): count a pass or report a failure. */
#define CHECKF(cond, ...)                                              \
    do {                                                               \
        if (cond) {                                                    \
            g_passed++;                                                \
        } else {                                                       \
            check_fail(__FILE__, __LINE__, #cond, __VA_ARGS__);        \
        }                                                              \
    } while (0)
#define CHECK(cond) CHECKF(cond, NULL)

/* Abort the run if the test itself cannot proceed (e.g. out of memory). */
static void *xmalloc(size_t size) {
    void *p = malloc(size ? size : 1);
    if (p == NULL) {
        fprintf(stderr, "test harness: malloc(%zu) failed\n", size);
        exit(2);
    }
    return p;
}

#define KIB ((uint64_t)1024)
#define MIB (KIB * KIB)

/*
 * Below this many bytes per thread ucm_copy_segments stays on fewer threads
 * (UCM_MIN_BYTES_PER_THREAD in ucm_native.c; not part of the public header, so
 * repeated here for the white-box thread-count checks).
 */
#define MIN_BYTES_PER_THREAD (256 * KIB)
#define SHARE_ALIGN ((uint64_t)4096)
/* Copies of at least this many bytes in total use non-temporal stores
 * (UCM_NT_MIN_TOTAL in ucm_native.c): 16-byte head, 64-byte body, tail. */
#define STREAM_MIN_TOTAL (8 * MIB)

/* ------------------------------------------------------------------------ */
/* Reproducible PRNG                                                         */
/* ------------------------------------------------------------------------ */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static uint64_t rng(void) { /* xorshift64 */
    uint64_t x = g_rng;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    g_rng = x;
    return x;
}

/* Uniform-ish in [lo, hi] (modulo bias is irrelevant here). */
static uint64_t rng_range(uint64_t lo, uint64_t hi) {
    return lo + rng() % (hi - lo + 1);
}

static void fill_random(unsigned char *p, size_t size) {
    size_t i = 0;
    for (; i + 8 <= size; i += 8) {
        uint64_t v = rng();
        memcpy(p + i, &v, 8);
    }
    if (i < size) {
        uint64_t v = rng();
        memcpy(p + i, &v, size - i);
    }
}

/* ------------------------------------------------------------------------ */
/* pthread_create interposition (see file comment)                          */
/* ------------------------------------------------------------------------ */

/* Only the thread calling ucm_copy_segments creates threads: no atomics. */
static int g_creates;      /* successful pthread_create calls since reset */
static int g_create_fails; /* pthread_create calls refused since reset */
static int g_fail_next;    /* refuse this many upcoming pthread_create calls */

#ifdef UCM_TEST_WRAP_PTHREAD_CREATE
#define HAVE_THREAD_COUNT 1
int __real_pthread_create(pthread_t *thread, const pthread_attr_t *attr,
                          void *(*start)(void *), void *arg);
int __wrap_pthread_create(pthread_t *thread, const pthread_attr_t *attr,
                          void *(*start)(void *), void *arg);
int __wrap_pthread_create(pthread_t *thread, const pthread_attr_t *attr,
                          void *(*start)(void *), void *arg) {
    if (g_fail_next > 0) {
        g_fail_next--;
        g_create_fails++;
        return EAGAIN;
    }
    int rc = __real_pthread_create(thread, attr, start, arg);
    if (rc == 0) g_creates++;
    return rc;
}
#else
#define HAVE_THREAD_COUNT 0
#endif

static void reset_thread_counters(void) {
    g_creates = 0;
    g_create_fails = 0;
    g_fail_next = 0;
}

/* Threads ucm_copy_segments is expected to use (calling thread included). */
static int expected_threads(uint64_t total, int n_threads) {
    int t = n_threads;
    if (t > ucm_max_threads()) t = ucm_max_threads();
    uint64_t useful = total / MIN_BYTES_PER_THREAD;
    if ((uint64_t)t > useful) t = useful > 0 ? (int)useful : 1;
    return t;
}

/* The per-thread share (bytes of the concatenated segments) the engine uses. */
static uint64_t expected_share(uint64_t total, int threads) {
    return (total / (uint64_t)threads + SHARE_ALIGN - 1) & ~(SHARE_ALIGN - 1);
}

/* ------------------------------------------------------------------------ */
/* Scenarios: a segment list over a source buffer and a destination buffer   */
/* ------------------------------------------------------------------------ */

typedef struct {
    size_t n;
    uint64_t *len;
    size_t *soff; /* offset of segment i in sbuf */
    size_t *doff; /* offset of segment i in dbuf */
    uint64_t *src; /* absolute addresses handed to ucm_copy_segments */
    uint64_t *dst;
    unsigned char *sbuf;
    unsigned char *dbuf;
    unsigned char *ref;
    size_t ssize;
    size_t dsize;
    uint64_t total;
    int ref_sentinel; /* sentinel ref was built with, -1: ref not built */
} scenario;

static uint64_t addr_of(const void *p) { return (uint64_t)(uintptr_t)p; }

static void shuffle(size_t *a, size_t n) {
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)(rng() % i);
        size_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

/*
 * Lay the segments out in a random order with random (often odd, sometimes
 * zero) gaps, starting at a random offset; returns the buffer size needed.
 * With spread16, the segments longer than 16 bytes get offsets cycling
 * through every residue modulo 16 (the buffers come from malloc, so they are
 * 16-byte aligned and the residues carry over to the addresses).
 */
static size_t layout(const uint64_t *len, size_t n, size_t *off,
                     uint64_t max_gap, int spread16) {
    size_t *order = xmalloc(n * sizeof *order);
    for (size_t i = 0; i < n; i++) order[i] = i;
    shuffle(order, n);
    size_t pos = (size_t)rng_range(0, 63);
    size_t residue = 0;
    for (size_t k = 0; k < n; k++) {
        size_t i = order[k];
        if (spread16 && len[i] > 16) pos += (residue++ % 16 - pos % 16) & 15;
        off[i] = pos;
        pos += (size_t)len[i];
        pos += (size_t)((rng() % 4 == 0) ? 0 : rng_range(0, max_gap));
    }
    free(order);
    return pos + (size_t)rng_range(1, 64); /* trailing sentinel area */
}

/*
 * Build a scenario from lengths. Destinations never overlap (the contract);
 * when overlap_src is set, sources are placed at random offsets and may
 * overlap each other (reading the same bytes twice is allowed).
 */
static void scenario_init2(scenario *s, const uint64_t *len, size_t n,
                           int overlap_src, uint64_t max_gap, int spread16) {
    memset(s, 0, sizeof *s);
    s->n = n;
    s->len = xmalloc((n ? n : 1) * sizeof *s->len);
    s->soff = xmalloc((n ? n : 1) * sizeof *s->soff);
    s->doff = xmalloc((n ? n : 1) * sizeof *s->doff);
    s->src = xmalloc((n ? n : 1) * sizeof *s->src);
    s->dst = xmalloc((n ? n : 1) * sizeof *s->dst);
    uint64_t max_len = 0;
    for (size_t i = 0; i < n; i++) {
        s->len[i] = len[i];
        s->total += len[i];
        if (len[i] > max_len) max_len = len[i];
    }
    if (overlap_src) {
        s->ssize = (size_t)(max_len + 64 * KIB + rng_range(0, 999));
        for (size_t i = 0; i < n; i++)
            s->soff[i] = (size_t)rng_range(0, s->ssize - len[i]);
    } else {
        s->ssize = layout(s->len, n, s->soff, max_gap, spread16);
    }
    s->dsize = layout(s->len, n, s->doff, max_gap, spread16);
    s->ref_sentinel = -1;
    s->sbuf = xmalloc(s->ssize);
    s->dbuf = xmalloc(s->dsize);
    s->ref = xmalloc(s->dsize);
    fill_random(s->sbuf, s->ssize);
    for (size_t i = 0; i < n; i++) {
        s->src[i] = addr_of(s->sbuf + s->soff[i]);
        s->dst[i] = addr_of(s->dbuf + s->doff[i]);
    }
}

static void scenario_init(scenario *s, const uint64_t *len, size_t n,
                          int overlap_src, uint64_t max_gap) {
    scenario_init2(s, len, n, overlap_src, max_gap, 0);
}

static void scenario_free(scenario *s) {
    free(s->len);
    free(s->soff);
    free(s->doff);
    free(s->src);
    free(s->dst);
    free(s->sbuf);
    free(s->dbuf);
    free(s->ref);
    memset(s, 0, sizeof *s);
}

/* Reference result: sentinel everywhere, then a plain memcpy loop. */
static void scenario_reference(scenario *s, unsigned char sentinel) {
    if (s->ref_sentinel == (int)sentinel) return; /* already built */
    s->ref_sentinel = sentinel;
    memset(s->ref, sentinel, s->dsize);
    for (size_t i = 0; i < s->n; i++)
        memcpy(s->ref + s->doff[i], s->sbuf + s->soff[i], (size_t)s->len[i]);
}

/* Segment whose destination contains offset `at`, or -1 if none. */
static long segment_at(const scenario *s, size_t at) {
    for (size_t i = 0; i < s->n; i++)
        if (at >= s->doff[i] && at < s->doff[i] + s->len[i]) return (long)i;
    return -1;
}

static uint64_t g_bytes_copied; /* by ucm_copy_segments, for the summary */
static long g_runs, g_runs_multi, g_runs_stream; /* paths taken, ditto */

/*
 * Run ucm_copy_segments on a sentinel-filled destination and compare with the
 * reference byte for byte: bytes inside segments must equal the source, bytes
 * outside every segment must still hold the sentinel. `fail_creates` refuses
 * that many pthread_create calls. Returns non-zero if everything matched.
 */

static int run_scenario(scenario *s, int n_threads, unsigned char sentinel,
                        int fail_creates, const char *what) {
    g_bytes_copied += s->total;
    g_runs++;
    g_runs_multi += expected_threads(s->total, n_threads) > 1;
    g_runs_stream += s->total >= STREAM_MIN_TOTAL;
    scenario_reference(s, sentinel);
    memset(s->dbuf, sentinel, s->dsize);
    reset_thread_counters();
    g_fail_next = fail_creates;
    int rc = ucm_copy_segments(s->src, s->dst, s->len, s->n, n_threads);
    int ok = 1;
    CHECKF(rc == 0, "%s: rc=%d n=%zu total=%llu threads=%d", what, rc, s->n,
           (unsigned long long)s->total, n_threads);
    ok &= rc == 0;

    int same = memcmp(s->dbuf, s->ref, s->dsize) == 0;
    if (!same) {
        size_t at = 0;
        while (at < s->dsize && s->dbuf[at] == s->ref[at]) at++;
        size_t bad = 0;
        for (size_t k = at; k < s->dsize; k++) bad += s->dbuf[k] != s->ref[k];
        long seg = segment_at(s, at);
        CHECKF(same,
               "%s: n=%zu total=%llu threads=%d: first wrong byte at dst+%zu "
               "(%s segment %ld, seg offset %lld), got 0x%02x want 0x%02x, "
               "%zu wrong bytes",
               what, s->n, (unsigned long long)s->total, n_threads, at,
               seg >= 0 ? "inside" : "outside every", seg,
               seg >= 0 ? (long long)(at - s->doff[seg]) : -1LL, s->dbuf[at],
               s->ref[at], bad);
    } else {
        CHECK(same);
    }
    ok &= same;

#if HAVE_THREAD_COUNT
    int want = expected_threads(s->total, n_threads);
    CHECKF(g_creates + g_create_fails == want - 1,
           "%s: total=%llu n_threads=%d: %d threads created + %d refused, "
           "expected %d worker threads",
           what, (unsigned long long)s->total, n_threads, g_creates,
           g_create_fails, want - 1);
    ok &= g_creates + g_create_fails == want - 1;
#endif
    g_fail_next = 0; /* counters stay readable until the next reset */
    return ok;
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                      */
/* ------------------------------------------------------------------------ */

static const int k_thread_counts[] = {1, 2, 3, 4, 7, 64, 1000};
#define N_THREAD_COUNTS (sizeof k_thread_counts / sizeof k_thread_counts[0])

static void test_abi(void) {
    g_section = "abi";
    CHECK(ucm_native_abi() == UCM_NATIVE_ABI);
    CHECK(ucm_max_threads() >= 1);
    CHECK(ucm_max_threads() == 64);
    const char *digest = ucm_native_source_digest();
    CHECK(digest != NULL);
    if (digest != NULL) {
        int hex = 1;
        for (const char *c = digest; *c; c++)
            hex &= (*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f');
        CHECKF(hex, "digest \"%s\" is not lower-case hex", digest);
    }
}

/* A random length: 0, 1, odd small, medium, around the thresholds, large. */
static uint64_t random_len(int *large_left) {
    switch (rng() % 16) {
    case 0: return 0;
    case 1: return 1;
    case 2: case 3: return rng_range(1, 31) * 2 + 1; /* odd, 3..63 */
    case 4: case 5: return rng_range(2, 4096);
    case 6: case 7: return rng_range(4096 - 3, 4096 + 3);
    case 8: case 9: return rng_range(4097, 64 * KIB);
    case 10: return rng_range(64 * KIB, 300 * KIB) | 1;
    case 11: return rng_range(MIN_BYTES_PER_THREAD - 2, MIN_BYTES_PER_THREAD + 2);
    case 12:
        if (*large_left > 0) {
            (*large_left)--;
            return rng_range(1 * MIB, 4 * MIB); /* large, 1-4 MiB */
        }
        return rng_range(1, 999);
    default: return rng_range(1, 255);
    }
}

static void test_random_segments(void) {
    g_section = "random";
    enum { CASES = 48 };
    long cases_ok = 0;
    for (int c = 0; c < CASES; c++) {
        size_t n;
        switch (c % 4) {
        case 0: n = (size_t)rng_range(1, 3); break;
        case 1: n = (size_t)rng_range(4, 16); break;
        case 2: n = (size_t)rng_range(17, 64); break;
        default: n = (size_t)rng_range(65, 128); break;
        }
        int large_left = c % 8 == 0 ? 1 : 0;
        uint64_t *len = xmalloc(n * sizeof *len);
        for (size_t i = 0; i < n; i++) len[i] = random_len(&large_left);
        scenario s;
        scenario_init(&s, len, n, c % 5 == 4, c % 2 ? 300 : 70000);
        free(len);
        char what[64];
        snprintf(what, sizeof what, "case %d", c);
        int ok = 1;
        for (size_t t = 0; t < N_THREAD_COUNTS; t++)
            ok &= run_scenario(&s, k_thread_counts[t], c % 2 ? 0x5A : 0xA5, 0,
                               what);
        cases_ok += ok;
        scenario_free(&s);
    }
    printf("  random: %ld/%d cases fully correct\n", cases_ok, (int)CASES);
}

/* Many segments, >= 64 * 256 KiB in total: the 64-thread cap is reached. */
static void test_thread_cap(void) {
    g_section = "thread-cap";
    size_t n = 40;
    uint64_t *len = xmalloc(n * sizeof *len);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        len[i] = rng_range(300 * KIB, 400 * KIB) | 1; /* sum < 17 MiB */
        total += len[i];
    }
    len[n - 1] += 17 * MIB - total; /* exactly 17 MiB */
    scenario s;
    scenario_init(&s, len, n, 0, 100);
    free(len);
    CHECK(s.total == 17 * MIB);
    CHECK(expected_threads(s.total, 1000) == 64);
    run_scenario(&s, 64, 0xA5, 0, "64 threads");
#if HAVE_THREAD_COUNT
    CHECKF(g_creates == 63, "64 threads: %d workers", g_creates);
#endif
    run_scenario(&s, 1000, 0xA5, 0, "1000 threads");
#if HAVE_THREAD_COUNT
    CHECKF(g_creates == ucm_max_threads() - 1, "1000 threads: %d workers",
           g_creates);
#endif
    run_scenario(&s, INT_MAX, 0x5A, 0, "INT_MAX threads");
    scenario_free(&s);
}

/*
 * Totals just below / at / above multiples of the 256 KiB per-thread
 * threshold, as one segment and as a random split: both the single-thread
 * path (total < 512 KiB for any n_threads) and the multi-thread one run.
 */
static void test_threshold(void) {
    g_section = "threshold";
    const int threads[] = {1, 2, 3, 4, 1000};
    for (uint64_t k = 1; k <= 5; k++) {
        for (int d = -1; d <= 1; d++) {
            uint64_t total = k * MIN_BYTES_PER_THREAD + (uint64_t)(int64_t)d;
            for (int split = 0; split < 2; split++) {
                uint64_t len[16];
                size_t n = 1;
                len[0] = total;
                if (split) {
                    n = 9;
                    uint64_t left = total;
                    for (size_t i = 0; i + 1 < n; i++) {
                        len[i] = i == 3 ? 0 : rng_range(1, left / 4) | 1;
                        left -= len[i];
                    }
                    len[n - 1] = left;
                }
                scenario s;
                scenario_init(&s, len, n, 0, 500);
                for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
                    char what[80];
                    snprintf(what, sizeof what, "total=%llu split=%d",
                             (unsigned long long)total, split);
                    run_scenario(&s, threads[t], 0xA5, 0, what);
                }
                scenario_free(&s);
            }
        }
    }
#if HAVE_THREAD_COUNT
    /* The exact switch points, asserted directly. */
    struct { uint64_t total; int n_threads; int workers; } pts[] = {
        {2 * MIN_BYTES_PER_THREAD - 1, 2, 0},
        {2 * MIN_BYTES_PER_THREAD, 2, 1},
        {2 * MIN_BYTES_PER_THREAD - 1, 1000, 0},
        {2 * MIN_BYTES_PER_THREAD, 1000, 1},
        {3 * MIN_BYTES_PER_THREAD - 1, 4, 1},
        {3 * MIN_BYTES_PER_THREAD, 4, 2},
        {MIN_BYTES_PER_THREAD + 1, 64, 0},
        {8 * MIN_BYTES_PER_THREAD, 1, 0},
    };
    for (size_t i = 0; i < sizeof pts / sizeof pts[0]; i++) {
        uint64_t len[1] = {pts[i].total};
        scenario s;
        scenario_init(&s, len, 1, 0, 0);
        memset(s.dbuf, 0, s.dsize);
        reset_thread_counters();
        CHECK(ucm_copy_segments(s.src, s.dst, s.len, 1, pts[i].n_threads) == 0);
        CHECKF(g_creates == pts[i].workers,
               "total=%llu n_threads=%d: %d workers, expected %d",
               (unsigned long long)pts[i].total, pts[i].n_threads, g_creates,
               pts[i].workers);
        CHECK(memcmp(s.dbuf + s.doff[0], s.sbuf + s.soff[0], s.len[0]) == 0);
        reset_thread_counters();
        scenario_free(&s);
    }
#endif
}

/*
 * Segments that straddle the per-thread share boundaries (so one segment is
 * copied piecewise by two or more threads), boundaries that fall exactly on
 * segment edges, and zero-length segments sitting right at a boundary.
 */
static void test_straddle(void) {
    g_section = "straddle";
    const int threads = 4;
    uint64_t total = 4 * MIB + 12345;
    CHECK(expected_threads(total, threads) == threads);
    uint64_t share = expected_share(total, threads);

    /* 0: 777 | 1: crosses boundary 1 | 2: 3 bytes | 3: spans boundaries 2 and 3
     * entirely | 4: the rest. */
    uint64_t len[5] = {777, share + 224, 3, 2 * share + 5, 0};
    len[4] = total - (len[0] + len[1] + len[2] + len[3]);
    uint64_t start1 = len[0], start3 = len[0] + len[1] + len[2];
    CHECK(start1 < share && start1 + len[1] > share);
    CHECK(start3 < 2 * share && start3 + len[3] > 3 * share);
    scenario s;
    scenario_init(&s, len, 5, 0, 333);
    run_scenario(&s, threads, 0xA5, 0, "straddle");
    run_scenario(&s, 3, 0x5A, 0, "straddle, 3 threads");
    run_scenario(&s, 7, 0xA5, 0, "straddle, 7 threads");
    /* pthread_create refused: the share runs on the calling thread instead. */
    run_scenario(&s, threads, 0x5A, 1, "straddle, 1 create refused");
    run_scenario(&s, threads, 0xA5, 3, "straddle, all creates refused");
    scenario_free(&s);

    /* Boundaries exactly on segment edges, with empty segments around them. */
    uint64_t len2[8] = {share, 0, 0, share, 0, share - 1, 1, 0};
    len2[7] = total - 3 * share; /* last thread's share */
    scenario s2;
    scenario_init(&s2, len2, 8, 0, 50);
    CHECK(s2.total == total);
    run_scenario(&s2, threads, 0xA5, 0, "edges");
    run_scenario(&s2, threads, 0x5A, 2, "edges, 2 creates refused");
    /* Zero-length segments at a boundary may carry zero addresses. */
    s2.src[1] = 0;
    s2.dst[2] = 0;
    s2.src[4] = 0;
    s2.dst[4] = 0;
    run_scenario(&s2, threads, 0xA5, 0, "edges, zero addresses");
    scenario_free(&s2);

    /* One huge segment split over 64 threads. */
    uint64_t len3[1] = {64 * MIN_BYTES_PER_THREAD + 4095};
    scenario s3;
    scenario_init(&s3, len3, 1, 0, 0);
    run_scenario(&s3, 64, 0xA5, 0, "single segment, 64 threads");
    scenario_free(&s3);
}

static void test_edge_arguments(void) {
    g_section = "arguments";
    unsigned char src[64], dst[64], want[64];
    for (int i = 0; i < 64; i++) src[i] = (unsigned char)(i * 7 + 1);
    uint64_t s[3] = {addr_of(src), addr_of(src + 10), addr_of(src + 40)};
    uint64_t d[3] = {addr_of(dst + 1), addr_of(dst + 20), addr_of(dst + 50)};
    uint64_t l[3] = {5, 9, 13};

    /* n == 0: nothing to do, with real or NULL arrays. */
    memset(dst, 0xA5, sizeof dst);
    memcpy(want, dst, sizeof dst);
    CHECK(ucm_copy_segments(s, d, l, 0, 1) == 0);
    CHECK(ucm_copy_segments(s, d, l, 0, 1000) == 0);
    CHECK(ucm_copy_segments(NULL, NULL, NULL, 0, 1) == 0);
    CHECK(ucm_copy_segments(NULL, NULL, NULL, 0, 4) == 0);
    CHECK(memcmp(dst, want, sizeof dst) == 0);

    /* NULL arrays with n > 0. */
    CHECK(ucm_copy_segments(NULL, d, l, 3, 1) == -EINVAL);
    CHECK(ucm_copy_segments(s, NULL, l, 3, 1) == -EINVAL);
    CHECK(ucm_copy_segments(s, d, NULL, 3, 1) == -EINVAL);
    CHECK(ucm_copy_segments(NULL, NULL, NULL, 1, 2) == -EINVAL);
    CHECK(memcmp(dst, want, sizeof dst) == 0);

    /* n_threads < 1. */
    CHECK(ucm_copy_segments(s, d, l, 3, 0) == -EINVAL);
    {
        /* lengths whose sum overflows 64 bits are rejected before any byte moves */
        uint64_t ls[2] = {UINT64_MAX, 2};
        CHECK(ucm_copy_segments(s, d, ls, 2, 1) == -EINVAL);
    }
    CHECK(ucm_copy_segments(s, d, l, 3, -1) == -EINVAL);
    CHECK(ucm_copy_segments(s, d, l, 3, INT_MIN) == -EINVAL);
    CHECK(ucm_copy_segments(s, d, l, 0, 0) == -EINVAL);
    CHECK(ucm_copy_segments(NULL, NULL, NULL, 0, -5) == -EINVAL);
    CHECK(memcmp(dst, want, sizeof dst) == 0);

    /* A NULL (zero) address with a non-zero length, anywhere in the list:
     * -EINVAL, and the arguments are validated before anything is copied. */
    for (int which = 0; which < 3; which++) {
        for (int side = 0; side < 2; side++) {
            uint64_t s2[3], d2[3];
            memcpy(s2, s, sizeof s2);
            memcpy(d2, d, sizeof d2);
            if (side == 0) s2[which] = 0;
            else d2[which] = 0;
            for (int t = 1; t <= 4; t += 3) {
                int rc = ucm_copy_segments(s2, d2, l, 3, t);
                CHECKF(rc == -EINVAL, "segment %d %s NULL, threads %d: rc=%d",
                       which, side ? "dst" : "src", t, rc);
                CHECKF(memcmp(dst, want, sizeof dst) == 0,
                       "segment %d %s NULL: destination written before "
                       "validation", which, side ? "dst" : "src");
            }
        }
    }
    /* Both addresses zero with a length: also invalid. */
    {
        uint64_t zs[1] = {0}, zd[1] = {0}, zl[1] = {1};
        CHECK(ucm_copy_segments(zs, zd, zl, 1, 1) == -EINVAL);
    }

    /* Zero addresses with zero length are fine, alone or among real ones. */
    {
        uint64_t zs[1] = {0}, zd[1] = {0}, zl[1] = {0};
        CHECK(ucm_copy_segments(zs, zd, zl, 1, 1) == 0);
        CHECK(ucm_copy_segments(zs, zd, zl, 1, 64) == 0);
        uint64_t s3[5] = {0, s[0], 0, s[1], s[2]};
        uint64_t d3[5] = {0, d[0], addr_of(dst), d[1], d[2]};
        uint64_t l3[5] = {0, l[0], 0, l[1], l[2]};
        CHECK(ucm_copy_segments(s3, d3, l3, 5, 3) == 0);
        memcpy(want + 1, src, 5);
        memcpy(want + 20, src + 10, 9);
        memcpy(want + 50, src + 40, 13);
        CHECK(memcmp(dst, want, sizeof dst) == 0);
    }

    /* Single bytes, adjacent destinations, same source read twice. */
    {
        unsigned char b[8];
        memset(b, 0xA5, sizeof b);
        uint64_t s4[4] = {addr_of(src + 3), addr_of(src + 3), addr_of(src + 9),
                          addr_of(src + 9)};
        uint64_t d4[4] = {addr_of(b + 2), addr_of(b + 3), addr_of(b + 4),
                          addr_of(b + 6)};
        uint64_t l4[4] = {1, 1, 2, 1};
        CHECK(ucm_copy_segments(s4, d4, l4, 4, 2) == 0);
        unsigned char w[8] = {0xA5, 0xA5, src[3], src[3], src[9], src[10],
                              src[9], 0xA5};
        CHECK(memcmp(b, w, sizeof b) == 0);
    }
}

static int all_zero(const unsigned char *p, size_t size) {
    static const unsigned char zero[16384];
    for (size_t i = 0; i < size; i += sizeof zero) {
        size_t k = size - i < sizeof zero ? size - i : sizeof zero;
        if (memcmp(p + i, zero, k) != 0) return 0;
    }
    return 1;
}

static size_t page_size(void) {
    long ps = sysconf(_SC_PAGESIZE);
    return ps > 0 ? (size_t)ps : 4096;
}

/*
 * mincore() over the pages covering [p, p + size): 1 if every page is
 * resident, 0 if some is not, -1 if part of the range is not mapped at all.
 */
static int pages_resident(const void *p, size_t size) {
    size_t ps = page_size();
    uintptr_t lo = (uintptr_t)p & ~(uintptr_t)(ps - 1);
    uintptr_t hi = ((uintptr_t)p + size + ps - 1) & ~(uintptr_t)(ps - 1);
    size_t pages = (size_t)(hi - lo) / ps;
    unsigned char *vec = xmalloc(pages);
    int r = 1;
    if (mincore((void *)lo, (size_t)(hi - lo), vec) != 0) {
        r = errno == ENOMEM ? -1 : 0;
    } else {
        for (size_t i = 0; i < pages; i++)
            if (!(vec[i] & 1)) r = 0;
    }
    free(vec);
    return r;
}

/* ucm_alloc_aligned maps sizes >= this separately, 2 MiB aligned (header). */
#define HUGE_SIZE ((size_t)2 * 1024 * 1024)

static void check_one_alloc(size_t size, size_t al) {
    unsigned char *p = ucm_alloc_aligned(size, al);
    CHECKF(p != NULL, "size %zu alignment %zu", size, al);
    if (p == NULL) return;
    CHECKF((uintptr_t)p % al == 0, "%p not %zu-aligned (size %zu)", (void *)p,
           al, size);
    if (size >= HUGE_SIZE)
        CHECKF((uintptr_t)p % HUGE_SIZE == 0,
               "size %zu: %p not 2 MiB-aligned", size, (void *)p);
    /* Before anything here reads the buffer (a read faults pages in too). */
    CHECKF(pages_resident(p, size) == 1,
           "size %zu alignment %zu: not every page faulted in", size, al);
    CHECKF(all_zero(p, size), "size %zu alignment %zu not zero-filled", size,
           al);
    memset(p, 0xFF, size); /* the whole range is writable (ASan checks) */
    ucm_free_aligned(p, size);
#ifndef __SANITIZE_THREAD__ /* TSan's background thread may map memory */
    /* A separately mapped buffer is unmapped in full, tail rounding included. */
    if (size >= HUGE_SIZE) {
        size_t mapped = (size + HUGE_SIZE - 1) / HUGE_SIZE * HUGE_SIZE;
        CHECKF(pages_resident(p, 1) == -1,
               "size %zu: first page still mapped after free", size);
        CHECKF(pages_resident(p + mapped - 1, 1) == -1,
               "size %zu: last page still mapped after free", size);
    }
#endif
}

static void test_alloc_aligned(void) {
    g_section = "alloc";
    const size_t aligns[] = {sizeof(void *), 8, 16, 64, 4096, HUGE_SIZE};
    const size_t sizes[] = {1, 7, 64, 4097, HUGE_SIZE - 1, HUGE_SIZE,
                            HUGE_SIZE + 1, 3 * HUGE_SIZE / 2 + 1};
    for (size_t a = 0; a < sizeof aligns / sizeof aligns[0]; a++)
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
            check_one_alloc(sizes[z], aligns[a]);
    /* Alignments above 2 MiB, on both sides of the mmap threshold. */
    check_one_alloc(100, 4 * HUGE_SIZE);
    check_one_alloc(HUGE_SIZE + 4097, 4 * HUGE_SIZE);
    check_one_alloc(HUGE_SIZE + 4097, 8 * HUGE_SIZE);

    /* Reused memory must come back zero-filled too. */
    for (int i = 0; i < 4; i++) {
        size_t size = i < 2 ? 4096 + (size_t)i : HUGE_SIZE + (size_t)i;
        unsigned char *p = ucm_alloc_aligned(size, 64);
        CHECK(p != NULL);
        if (p == NULL) continue;
        CHECKF(all_zero(p, size), "reuse %d not zero-filled", i);
        memset(p, 0xEE, size);
        ucm_free_aligned(p, size);
    }
    /* Size 0 -> NULL for any alignment. */
    CHECK(ucm_alloc_aligned(0, 64) == NULL);
    CHECK(ucm_alloc_aligned(0, 8) == NULL);
    CHECK(ucm_alloc_aligned(0, 4096) == NULL);
    CHECK(ucm_alloc_aligned(0, HUGE_SIZE) == NULL);
    /* Bad alignment -> NULL: zero, not a power of two, below sizeof(void*);
     * for small and for separately mapped sizes. */
    const size_t bad[] = {0, 3, 12, 24, 1000, 4097, 1, 2, 3 * HUGE_SIZE};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (bad[i] >= sizeof(void *) && (bad[i] & (bad[i] - 1)) == 0) continue;
        for (int big = 0; big < 2; big++) {
            size_t size = big ? HUGE_SIZE + 1 : 64;
            void *p = ucm_alloc_aligned(size, bad[i]);
            CHECKF(p == NULL, "size %zu: alignment %zu accepted", size, bad[i]);
            ucm_free_aligned(p, size);
        }
    }
    if (sizeof(void *) > 4) CHECK(ucm_alloc_aligned(64, 4) == NULL);
    /* Sizes whose rounding to 2 MiB would overflow -> NULL (not a crash). */
    CHECK(ucm_alloc_aligned(SIZE_MAX, 64) == NULL);
    CHECK(ucm_alloc_aligned(SIZE_MAX - HUGE_SIZE, 64) == NULL);
    CHECK(ucm_alloc_aligned(SIZE_MAX / 2 + 1, HUGE_SIZE) == NULL);
    /* Freeing NULL is a no-op, whatever the size. */
    ucm_free_aligned(NULL, 0);
    ucm_free_aligned(NULL, 64);
    ucm_free_aligned(NULL, 4 * HUGE_SIZE);
    CHECK(1);
}

/*
 * Totals just below, at and above the streaming threshold, with segments of
 * every length class around the 16/64-byte split points placed at every
 * destination alignment modulo 16 (checked), on 1 and several threads.
 */
static void test_stream(void) {
    g_section = "stream";
    const uint64_t small[] = {0,  1,  2,  15, 16, 17,  31,  32,   33,   47,
                              48, 63, 64, 65, 79, 127, 128, 129, 191, 4095,
                              4096, 4097, 65535, 65536, 65537};
    const size_t n_small = sizeof small / sizeof small[0];
    const int threads[] = {1, 3, 64};
    for (int d = -1; d <= 1; d++) {
        uint64_t total = STREAM_MIN_TOTAL + (uint64_t)(int64_t)d;
        size_t n = 4 * n_small + 3;
        uint64_t *len = xmalloc(n * sizeof *len);
        uint64_t sum = 0;
        for (size_t i = 0; i < 4 * n_small; i++) {
            len[i] = small[i % n_small];
            sum += len[i];
        }
        len[n - 3] = 3 * MIB + 5;
        len[n - 2] = 2 * MIB - 3;
        len[n - 1] = total - sum - len[n - 3] - len[n - 2];
        scenario s;
        scenario_init2(&s, len, n, 0, 40, 1);
        free(len);
        CHECK(s.total == total);
        unsigned seen = 0; /* destination residues mod 16 of non-empty segs */
        for (size_t i = 0; i < n; i++)
            if (s.len[i] > 16) seen |= 1u << (s.dst[i] % 16);
        CHECKF(seen == 0xFFFFu, "destination alignments covered: 0x%04x", seen);
        char what[64];
        snprintf(what, sizeof what, "total=8MiB%+d", d);
        for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++)
            run_scenario(&s, threads[t], t % 2 ? 0x5A : 0xA5, 0, what);
        /* With worker threads refused, the caller streams their shares. */
        run_scenario(&s, 4, 0xA5, 3, "stream, creates refused");
        scenario_free(&s);
    }
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define RUN(fn)                                                             \
    do {                                                                    \
        double t0_ = now_s();                                               \
        long f0_ = g_failed, p0_ = g_passed;                                \
        fn();                                                               \
        printf("%-24s %6ld passed, %ld failed (%.2f s)\n", #fn,            \
               g_passed - p0_, g_failed - f0_, now_s() - t0_);              \
        fflush(stdout);                                                     \
    } while (0)

/* ---- checksum and batched file I/O ---------------------------------------------------- */

static uint64_t ref_mix(uint64_t x) {
    x ^= x >> 32;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 32;
    return x;
}

/* The definition, one word at a time (little-endian host). */
static uint64_t ref_checksum(const unsigned char *p, uint64_t len, uint64_t word0) {
    uint64_t s = 0;
    for (uint64_t i = 0; i * 8 < len; i++) {
        uint64_t w = 0;
        uint64_t take = len - i * 8 < 8 ? len - i * 8 : 8;
        memcpy(&w, p + i * 8, (size_t)take);
        s += ref_mix(w ^ ((word0 + i) * 0x9E3779B97F4A7C15ull));
    }
    return s;
}

static void test_checksum_and_io(void) {
    size_t n = 3 * MIB + 13;
    unsigned char *buf = xmalloc(n);
    for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(rng() >> 24);
    static const uint64_t lens[] = {0, 1, 7, 8, 9, 63, 64, 65, 127, 128, 129, 1000, 4096, 65536 + 3};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++)
        for (uint64_t w0 = 0; w0 < 3; w0++)
            for (size_t off = 0; off < 3; off++)  /* unaligned starts too */
                CHECKF(ucm_checksum(buf + off, lens[k], w0 * 1000) == ref_checksum(buf + off, lens[k], w0 * 1000),
                       "len %llu off %zu", (unsigned long long)lens[k], off);
    CHECK(ucm_checksum(buf, n, 5) == ref_checksum(buf, n, 5));
    /* additive over adjacent ranges */
    CHECK(ucm_checksum(buf, 2 * MIB, 0) == ucm_checksum(buf, MIB, 0) + ucm_checksum(buf + MIB, MIB, MIB / 8));
    /* per-unit checksums: each unit's own, and a unit that does not fit is refused */
    uint64_t units[16];
    CHECK(ucm_checksum_units(buf + 1, 16 * 4096, 4096, 9, units) == 0);
    for (int k = 0; k < 16; k++)
        CHECKF(units[k] == ref_checksum(buf + 1 + 4096 * k, 4096, 9 + 512 * (uint64_t)k), "unit %d", k);
    CHECK(ucm_checksum_units(buf, 100, 12, 0, units) == -EINVAL);
    CHECK(ucm_checksum_units(buf, 100, 0, 0, units) == -EINVAL);
    /* copy + per-unit checksums in one pass: the bytes copied and the same sums, unaligned too,
     * with a unit that is not a multiple of the copy piece */
    {
        uint64_t cu_units[16];
        unsigned char *copy = malloc(16 * 24584 + 8);
        CHECK(copy != NULL);
        CHECK(ucm_copy_checksum_units(copy + 3, buf + 1, 16 * 24584, 24584, 7, cu_units) == 0);
        CHECK(memcmp(copy + 3, buf + 1, 16 * 24584) == 0);
        for (int k = 0; k < 16; k++)
            CHECKF(cu_units[k] == ref_checksum(buf + 1 + 24584 * (uint64_t)k, 24584, 7 + 3073 * (uint64_t)k),
                   "copy unit %d", k);
        CHECK(ucm_copy_checksum_units(copy, buf, 100, 12, 0, cu_units) == -EINVAL);
        CHECK(ucm_copy_checksum_units(copy, buf, 100, 0, 0, cu_units) == -EINVAL);
        free(copy);
    }

    char path[] = "/tmp/ucm-native-test-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) {
        free(buf);
        return;
    }
    unlink(path);
    unsigned char *back = xmalloc(n);
    memset(back, 0, n);
    uint64_t sums[48];
    ucm_io_op ops[3];
    memset(ops, 0, sizeof ops);
    for (int k = 0; k < 3; k++) { /* three 1 MiB writes, 64 KiB checksum units */
        ops[k].fd = fd;
        ops[k].write = 1;
        ops[k].addr = (uint64_t)(uintptr_t)(buf + (size_t)k * MIB);
        ops[k].len = MIB;
        ops[k].file_off = (uint64_t)k * MIB;
        ops[k].word0 = (uint64_t)k * MIB / 8;
        ops[k].csum_unit = 64 * 1024;
        ops[k].csum_out = (uint64_t)(uintptr_t)(sums + 16 * k);
    }
    CHECK(ucm_io_batch(ops, 3, 2, 1) == 0);
    int units_ok = 1;
    for (int u = 0; u < 48; u++)
        units_ok &= sums[u] == ref_checksum(buf + (size_t)u * 65536, 65536, (uint64_t)u * 8192);
    CHECK(units_ok);
    ucm_io_op rd;
    memset(&rd, 0, sizeof rd);
    rd.fd = fd;
    rd.addr = (uint64_t)(uintptr_t)back;
    rd.len = 3 * MIB;
    CHECK(ucm_io_batch(&rd, 1, 4, 1) == 0 && rd.result == (int64_t)(3 * MIB));
    CHECK(memcmp(back, buf, 3 * MIB) == 0 && rd.checksum == ref_checksum(buf, 3 * MIB, 0));
    rd.file_off = 3 * MIB - 10; /* past the end */
    CHECK(ucm_io_batch(&rd, 1, 1, 1) == 1 && rd.result == -ENODATA);
    rd.fd = -1;
    rd.file_off = 0;
    CHECK(ucm_io_batch(&rd, 1, 1, 1) == 1 && rd.result == -EBADF);
    rd.fd = fd;
    rd.csum_unit = 12; /* not a multiple of 8 */
    rd.csum_out = (uint64_t)(uintptr_t)sums;
    CHECK(ucm_io_batch(&rd, 1, 1, 1) == 1 && rd.result == -EINVAL);
    CHECK(ucm_io_batch(NULL, 1, 1, 1) == -EINVAL);
    CHECK(ucm_io_batch(ops, 3, 0, 1) == -EINVAL);
    CHECK(ucm_io_batch(ops, 0, 1, 1) == 0);
    close(fd);
    free(back);
    free(buf);
}

/* ucm_open_beneath: regular files open; links anywhere in the path, escapes, directories and
 * bad arguments fail per path with the documented -errno, the others still open. */
static void test_open_beneath(void) {
    char root[] = "/tmp/ucm-native-beneath-XXXXXX";
    CHECK(mkdtemp(root) != NULL);
    char p[512];
    snprintf(p, sizeof p, "%s/ab", root);
    CHECK(mkdir(p, 0700) == 0);
    snprintf(p, sizeof p, "%s/ab/f.blk", root);
    int w = open(p, O_WRONLY | O_CREAT | O_EXCL, 0600);
    CHECK(w >= 0 && write(w, "hello", 5) == 5);
    close(w);
    snprintf(p, sizeof p, "%s/lnk", root);
    CHECK(symlink("ab", p) == 0);            /* a linked directory */
    snprintf(p, sizeof p, "%s/ab/l.blk", root);
    CHECK(symlink("f.blk", p) == 0);         /* a linked file */
    int dirfd = open(root, O_RDONLY | O_DIRECTORY);
    CHECK(dirfd >= 0);
    enum { STRIDE = 32, N = 7 };
    char paths[N * STRIDE];
    const char *names[N] = {"ab/f.blk", "lnk/f.blk", "ab/l.blk", "../x", "ab/none.blk", "ab", "/etc/passwd"};
    for (int i = 0; i < N; i++) {
        memset(paths + i * STRIDE, 0, STRIDE);
        strcpy(paths + i * STRIDE, names[i]);
    }
    int64_t fds[N], sizes[N];
    CHECK(ucm_open_beneath(dirfd, paths, STRIDE, N, O_RDONLY, 0, 1, fds, sizes) == N - 1);
    CHECK(fds[0] > 0 && sizes[0] == 5);
    CHECKF(fds[1] == -ELOOP, "linked directory: %lld", (long long)fds[1]);
    CHECKF(fds[2] == -ELOOP, "linked file: %lld", (long long)fds[2]);
    CHECKF(fds[3] == -EXDEV || fds[3] == -EINVAL, "escape: %lld", (long long)fds[3]);
    CHECK(fds[4] == -ENOENT && sizes[4] == -1);
    CHECK(fds[5] == -EINVAL);                /* a directory is not a block file */
    CHECK(fds[6] == -EINVAL || fds[6] == -EXDEV);
    if (fds[0] > 0) close((int)fds[0]);
    /* a directory through O_PATH | O_DIRECTORY (the mode is ignored then) */
    memset(paths, 0, STRIDE);
    strcpy(paths, "ab");
    CHECK(ucm_open_beneath(dirfd, paths, STRIDE, 1, O_PATH | O_DIRECTORY, 0600, 1, fds, NULL) == 0 && fds[0] > 0);
    if (fds[0] > 0) close((int)fds[0]);
    strcpy(paths, "ab/f.blk");
    /* probes (O_PATH, closed again) and creation */
    CHECK(ucm_open_beneath(dirfd, paths, STRIDE, 1, O_PATH, 0, 0, fds, sizes) == 0 && fds[0] == 0 && sizes[0] == 5);
    memset(paths, 0, STRIDE);
    strcpy(paths, "ab/new.tmp");
    CHECK(ucm_open_beneath(dirfd, paths, STRIDE, 1, O_WRONLY | O_CREAT | O_EXCL, 0600, 1, fds, NULL) == 0 && fds[0] > 0);
    if (fds[0] > 0) close((int)fds[0]);
    struct stat st;
    snprintf(p, sizeof p, "%s/ab/new.tmp", root);
    CHECK(stat(p, &st) == 0 && (st.st_mode & 0777) == (0600 & ~(mode_t)0));
    /* bad arguments open nothing */
    CHECK(ucm_open_beneath(dirfd, NULL, STRIDE, 1, O_RDONLY, 0, 1, fds, NULL) == -EINVAL);
    CHECK(ucm_open_beneath(dirfd, paths, 0, 1, O_RDONLY, 0, 1, fds, NULL) == -EINVAL);
    memset(paths, 'a', STRIDE); /* no NUL inside the stride */
    CHECK(ucm_open_beneath(dirfd, paths, STRIDE, 1, O_RDONLY, 0, 1, fds, NULL) == -EINVAL);
    CHECK(ucm_open_beneath(dirfd, paths, STRIDE, 0, O_RDONLY, 0, 1, fds, NULL) == 0);
    close(dirfd);
    const char *rm[] = {"ab/new.tmp", "ab/l.blk", "ab/f.blk", "lnk"};
    for (size_t i = 0; i < sizeof rm / sizeof rm[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", root, rm[i]);
        unlink(p);
    }
    snprintf(p, sizeof p, "%s/ab", root);
    rmdir(p);
    rmdir(root);
}

int main(int argc, char **argv) {
    if (argc > 1) {
        g_rng = strtoull(argv[1], NULL, 0);
        if (g_rng == 0) g_rng = 1; /* xorshift must not be seeded with 0 */
    }
    printf("ucm native tests: seed 0x%016llx, thread counting %s\n",
           (unsigned long long)g_rng, HAVE_THREAD_COUNT ? "on" : "off");
    fflush(stdout);
    double t0 = now_s();
    RUN(test_abi);
    RUN(test_edge_arguments);
    RUN(test_alloc_aligned);
    RUN(test_threshold);
    RUN(test_straddle);
    RUN(test_stream);
    RUN(test_thread_cap);
    RUN(test_random_segments);
    RUN(test_checksum_and_io);
    RUN(test_open_beneath);
    fflush(stderr);
    printf("%ld copies (%ld multi-threaded, %ld streaming), %.0f MiB; "
           "total time %.2f s\n",
           g_runs, g_runs_multi, g_runs_stream,
           (double)g_bytes_copied / (double)MIB, now_s() - t0);
    printf("%ld passed, %ld failed\n", g_passed, g_failed);
    fflush(stdout);
    return g_failed == 0 ? 0 : 1;
}
