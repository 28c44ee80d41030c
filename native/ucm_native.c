/* ucm native engine, see ucm_native.h for the contract. */
#define _GNU_SOURCE /* MADV_HUGEPAGE */
#include "ucm_native.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define UCM_HAVE_SSE2 1
#endif

#ifndef UCM_NATIVE_SOURCE_DIGEST
#define UCM_NATIVE_SOURCE_DIGEST ""
#endif

#define UCM_MAX_THREADS 64
/* Below this many bytes per thread, extra threads cost more than they give. */
#define UCM_MIN_BYTES_PER_THREAD (256u * 1024u)

int ucm_native_abi(void) { return UCM_NATIVE_ABI; }

const char *ucm_native_source_digest(void) { return UCM_NATIVE_SOURCE_DIGEST; }

int ucm_max_threads(void) { return UCM_MAX_THREADS; }

/* Copies whose total is at least this large use non-temporal stores: the destination of a
 * bulk staging copy is read next by a DMA engine or the disk, not by this CPU, and streaming
 * stores skip the read-for-ownership of every destination line (a third of the memory traffic). */
#define UCM_NT_MIN_TOTAL (8u * 1024u * 1024u)

/* memcpy with streaming (non-temporal) stores; the caller issues the store fence. */
static void copy_stream(char *dst, const char *src, size_t n) {
#ifdef UCM_HAVE_SSE2
    size_t head = (size_t)(-(uintptr_t)dst & 15u);
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63u;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

/* One thread's share: bytes [begin, end) of the concatenation of all segments. */
typedef struct {
    const uint64_t *src;
    const uint64_t *dst;
    const uint64_t *len;
    size_t n;
    uint64_t begin;
    uint64_t end;
    int stream; /* use non-temporal stores */
} copy_job;

static void copy_range(const copy_job *job) {
    uint64_t pos = 0; /* byte offset of segment i in the concatenation */
    for (size_t i = 0; i < job->n && pos < job->end; i++) {
        uint64_t seg_len = job->len[i];
        uint64_t seg_end = pos + seg_len;
        if (seg_end > job->begin && seg_len > 0) {
            uint64_t lo = job->begin > pos ? job->begin - pos : 0;
            uint64_t hi = job->end < seg_end ? job->end - pos : seg_len;
            char *d = (char *)(uintptr_t)job->dst[i] + lo;
            const char *s = (const char *)(uintptr_t)job->src[i] + lo;
            if (job->stream)
                copy_stream(d, s, (size_t)(hi - lo));
            else
                memcpy(d, s, (size_t)(hi - lo));
        }
        pos = seg_end;
    }
#ifdef UCM_HAVE_SSE2
    if (job->stream) _mm_sfence();
#endif
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
        if (len[i] > UINT64_MAX - total) return -EINVAL; /* cannot describe real memory */
        total += len[i];
    }

    uint64_t useful = total / UCM_MIN_BYTES_PER_THREAD;
    int threads = n_threads;
    if (threads > UCM_MAX_THREADS) threads = UCM_MAX_THREADS;
    if ((uint64_t)threads > useful) threads = useful > 0 ? (int)useful : 1;

    int stream = total >= UCM_NT_MIN_TOTAL;
    if (threads == 1) {
        copy_job job = {src, dst, len, n, 0, total, stream};
        copy_range(&job);
        return 0;
    }

    copy_job jobs[UCM_MAX_THREADS];
    pthread_t tids[UCM_MAX_THREADS];
    int started[UCM_MAX_THREADS];
    /* Shares are multiples of 4 KiB of the concatenated stream (page-sized pieces of aligned
     * segments), so threads rarely touch the same destination cache line. */
    uint64_t share = (total / (uint64_t)threads + 4095u) & ~(uint64_t)4095u;
    for (int t = 0; t < threads; t++) {
        uint64_t b = share * (uint64_t)t;
        uint64_t e = b + share;
        if (b > total) b = total;
        if (e > total || t == threads - 1) e = total;
        copy_job j = {src, dst, len, n, b, e, stream};
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

/* Buffers of at least this size are mapped separately and backed by transparent huge pages:
 * scattered block copies then stop paying a page walk every 4 KiB (measured: two threads copying
 * 64 KiB segments to random places scale to 2x only with huge pages). */
#define UCM_HUGE (2u * 1024u * 1024u)

static size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

void *ucm_alloc_aligned(size_t size, size_t alignment) {
    if (size == 0) return NULL;
    if (alignment < sizeof(void *) || (alignment & (alignment - 1)) != 0) return NULL;
    if (size < UCM_HUGE) {
        void *p = NULL;
        if (posix_memalign(&p, alignment, size) != 0) return NULL;
        memset(p, 0, size);
        return p;
    }
    size_t align = alignment > UCM_HUGE ? alignment : UCM_HUGE;
    size_t len = round_up(size, UCM_HUGE);
    if (len < size || len + align < len) return NULL; /* overflow */
    char *raw = mmap(NULL, len + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *p = (char *)round_up((size_t)(uintptr_t)raw, align);
    if (p > raw) munmap(raw, (size_t)(p - raw));
    size_t tail = (size_t)((raw + len + align) - (p + len));
    if (tail) munmap(p + len, tail);
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE); /* a hint: ignored where THP is off */
#endif
    /* Fault every page in now (anonymous pages are already zero), not in the first copy. */
    for (size_t off = 0; off < len; off += 4096) p[off] = 0;
    return p;
}

void ucm_free_aligned(void *p, size_t size) {
    if (p == NULL) return;
    if (size < UCM_HUGE)
        free(p);
    else
        munmap(p, round_up(size, UCM_HUGE));
}

/* ---------------------------------------------------------------------------------------- */
/* checksum and batched file I/O                                                             */

#define UCM_PHI 0x9E3779B97F4A7C15ull
#define UCM_MIX 0xD6E8FEB86659FD93ull

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 32;
    x *= UCM_MIX;
    x ^= x >> 32;
    return x;
}

static uint64_t checksum_scalar(const unsigned char *p, uint64_t words, uint64_t k) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    uint64_t i = 0;
    for (; i + 4 <= words; i += 4) {
        uint64_t w0, w1, w2, w3;
        memcpy(&w0, p + 8 * i, 8);
        memcpy(&w1, p + 8 * i + 8, 8);
        memcpy(&w2, p + 8 * i + 16, 8);
        memcpy(&w3, p + 8 * i + 24, 8);
        s0 += mix64(w0 ^ k);
        s1 += mix64(w1 ^ (k + UCM_PHI));
        s2 += mix64(w2 ^ (k + 2 * UCM_PHI));
        s3 += mix64(w3 ^ (k + 3 * UCM_PHI));
        k += 4 * UCM_PHI;
    }
    for (; i < words; i++) {
        uint64_t w;
        memcpy(&w, p + 8 * i, 8);
        s0 += mix64(w ^ k);
        k += UCM_PHI;
    }
    return s0 + s1 + s2 + s3;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define UCM_HAVE_X86_SIMD 1

/* The same sum, 8 words at a time (AVX-512F + DQ for the 64-bit multiply). */
__attribute__((target("avx512f,avx512dq"))) static uint64_t checksum_avx512(const unsigned char *p,
                                                                           uint64_t words, uint64_t k) {
    const __m512i phi8 = _mm512_set1_epi64((long long)(8 * UCM_PHI));
    const __m512i mix = _mm512_set1_epi64((long long)UCM_MIX);
    __m512i key = _mm512_add_epi64(_mm512_set1_epi64((long long)k),
                                   _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0),
                                                      _mm512_set1_epi64((long long)UCM_PHI)));
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    uint64_t i = 0;
    for (; i + 16 <= words; i += 16) {
        __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + 8 * i)), key);
        key = _mm512_add_epi64(key, phi8);
        __m512i x1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(p + 8 * i + 64)), key);
        key = _mm512_add_epi64(key, phi8);
        x0 = _mm512_xor_si512(x0, _mm512_srli_epi64(x0, 32));
        x1 = _mm512_xor_si512(x1, _mm512_srli_epi64(x1, 32));
        x0 = _mm512_mullo_epi64(x0, mix);
        x1 = _mm512_mullo_epi64(x1, mix);
        x0 = _mm512_xor_si512(x0, _mm512_srli_epi64(x0, 32));
        x1 = _mm512_xor_si512(x1, _mm512_srli_epi64(x1, 32));
        a0 = _mm512_add_epi64(a0, x0);
        a1 = _mm512_add_epi64(a1, x1);
    }
    uint64_t lanes[8]; /* not _mm512_reduce_add_epi64: GCC's version adds signed (UB) */
    _mm512_storeu_si512((void *)lanes, _mm512_add_epi64(a0, a1));
    uint64_t s = 0;
    for (int l = 0; l < 8; l++) s += lanes[l];
    return s + checksum_scalar(p + 8 * i, words - i, k + i * UCM_PHI);
}

/* 4 words at a time; the 64-bit multiply from three 32x32->64 products. */
__attribute__((target("avx2"))) static inline __m256i mullo64_avx2(__m256i a, __m256i b) {
    __m256i lo = _mm256_mul_epu32(a, b);
    __m256i t1 = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), b);
    __m256i t2 = _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32));
    return _mm256_add_epi64(lo, _mm256_slli_epi64(_mm256_add_epi64(t1, t2), 32));
}

__attribute__((target("avx2"))) static uint64_t checksum_avx2(const unsigned char *p, uint64_t words,
                                                              uint64_t k) {
    const __m256i phi4 = _mm256_set1_epi64x((long long)(4 * UCM_PHI));
    const __m256i mix = _mm256_set1_epi64x((long long)UCM_MIX);
    __m256i key = _mm256_set_epi64x((long long)(k + 3 * UCM_PHI), (long long)(k + 2 * UCM_PHI),
                                    (long long)(k + UCM_PHI), (long long)k);
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    uint64_t i = 0;
    for (; i + 8 <= words; i += 8) {
        __m256i x0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 8 * i)), key);
        key = _mm256_add_epi64(key, phi4);
        __m256i x1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 8 * i + 32)), key);
        key = _mm256_add_epi64(key, phi4);
        x0 = _mm256_xor_si256(x0, _mm256_srli_epi64(x0, 32));
        x1 = _mm256_xor_si256(x1, _mm256_srli_epi64(x1, 32));
        x0 = mullo64_avx2(x0, mix);
        x1 = mullo64_avx2(x1, mix);
        x0 = _mm256_xor_si256(x0, _mm256_srli_epi64(x0, 32));
        x1 = _mm256_xor_si256(x1, _mm256_srli_epi64(x1, 32));
        a0 = _mm256_add_epi64(a0, x0);
        a1 = _mm256_add_epi64(a1, x1);
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a0, a1));
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] +
           checksum_scalar(p + 8 * i, words - i, k + i * UCM_PHI);
}
#endif

typedef uint64_t (*checksum_fn)(const unsigned char *, uint64_t, uint64_t);

static checksum_fn pick_checksum(void) {
#ifdef UCM_HAVE_X86_SIMD
    const char *force = getenv("UCM_NATIVE_SIMD"); /* "scalar", "avx2": for tests */
    __builtin_cpu_init();
    if (force && strcmp(force, "scalar") == 0) return checksum_scalar;
    if (!(force && strcmp(force, "avx2") == 0) && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq"))
        return checksum_avx512;
    if (__builtin_cpu_supports("avx2")) return checksum_avx2;
#endif
    return checksum_scalar;
}

static checksum_fn checksum_words;
static pthread_once_t checksum_once = PTHREAD_ONCE_INIT;
static void init_checksum(void) { checksum_words = pick_checksum(); }

uint64_t ucm_checksum(const void *data, uint64_t len, uint64_t word0) {
    pthread_once(&checksum_once, init_checksum);
    const unsigned char *p = (const unsigned char *)data;
    uint64_t words = len / 8;
    uint64_t s = checksum_words(p, words, word0 * UCM_PHI);
    uint64_t rest = len - 8 * words;
    if (rest) {
        uint64_t w = 0;
        memcpy(&w, p + 8 * words, (size_t)rest); /* little-endian hosts only (x86-64, arm64) */
        s += mix64(w ^ ((word0 + words) * UCM_PHI));
    }
    return s;
}

int ucm_checksum_units(const void *data, uint64_t len, uint64_t unit, uint64_t word0,
                       uint64_t *out) {
    if (unit == 0 || unit % 8 || len % unit) return -EINVAL;
    const unsigned char *p = (const unsigned char *)data;
    for (uint64_t k = 0; k < len / unit; k++) out[k] = ucm_checksum(p + k * unit, unit, word0 + k * unit / 8);
    return 0;
}

/* The copy in pieces small enough to stay in L1/L2, each checksummed from the destination
 * right after it is written: the source is read once (a copy, then a checksum pass, reads it
 * twice from memory). */
#define UCM_COPY_PIECE (16u * 1024u)

int ucm_copy_checksum_units(void *dst, const void *src, uint64_t len, uint64_t unit,
                            uint64_t word0, uint64_t *out) {
    if (unit == 0 || unit % 8 || len % unit) return -EINVAL;
    pthread_once(&checksum_once, init_checksum);
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    for (uint64_t k = 0; k < len / unit; k++) {
        uint64_t sum = 0;
        for (uint64_t off = 0; off < unit; off += UCM_COPY_PIECE) {
            uint64_t piece = unit - off < UCM_COPY_PIECE ? unit - off : UCM_COPY_PIECE;
            uint64_t at = k * unit + off;
            memmove(d + at, s + at, (size_t)piece);
            /* piece is a multiple of 8 (unit and UCM_COPY_PIECE are) */
            sum += checksum_words(d + at, piece / 8, (word0 + at / 8) * UCM_PHI);
        }
        out[k] = sum;
    }
    return 0;
}

#define UCM_IO_PIECE (256u * 1024u) /* checksum while the piece is still in cache */

static int64_t io_range(const ucm_io_op *op, char *buf, uint64_t off, uint64_t len) {
    uint64_t done = 0;
    while (done < len) {
        ssize_t r = op->write
            ? pwrite(op->fd, buf + off + done, (size_t)(len - done), (off_t)(op->file_off + off + done))
            : pread(op->fd, buf + off + done, (size_t)(len - done), (off_t)(op->file_off + off + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) return op->write ? -(int64_t)EIO : -(int64_t)ENODATA;
        done += (uint64_t)r;
    }
    return 0;
}

/* Checksums of a whole op: per unit into csum_out, or the op's total. */
static void checksum_units(const ucm_io_op *op, const char *buf, uint64_t *total) {
    uint64_t *outs = (uint64_t *)(uintptr_t)op->csum_out;
    if (!op->csum_unit) {
        *total = ucm_checksum(buf, op->len, op->word0);
        return;
    }
    for (uint64_t off = 0; off < op->len; off += op->csum_unit)
        outs[off / op->csum_unit] = ucm_checksum(buf + off, op->csum_unit, op->word0 + off / 8);
}

static int64_t io_one(ucm_io_op *op, int want_checksum) {
    char *buf = (char *)(uintptr_t)op->addr;
    uint64_t *outs = (uint64_t *)(uintptr_t)op->csum_out;
    uint64_t unit = op->csum_unit;
    if (want_checksum && unit && ((unit & 7u) || op->len % unit || outs == NULL)) return -EINVAL;
    uint64_t total = 0;
    /* Buffered I/O goes in cache-sized pieces, each checksummed while hot. O_DIRECT transfers
     * bypass the cache: one large request is what the device wants, checksummed in one pass. */
    int flags = fcntl(op->fd, F_GETFL);
    int direct = flags >= 0 && (flags & O_DIRECT);
    if (direct) {
        if (op->write && want_checksum) checksum_units(op, buf, &total);
        int64_t rc = io_range(op, buf, 0, op->len);
        if (rc < 0) return rc;
        if (!op->write && want_checksum) checksum_units(op, buf, &total);
        if (want_checksum && !unit) op->checksum = total;
        return (int64_t)op->len;
    }
    for (uint64_t off = 0; off < op->len;) {
        uint64_t piece = op->len - off;
        if (piece > UCM_IO_PIECE) piece = UCM_IO_PIECE;
        if (unit) {
            uint64_t to_unit_end = unit - off % unit;
            if (piece > to_unit_end) piece = to_unit_end;
        }
        uint64_t ck = 0;
        if (op->write && want_checksum) ck = ucm_checksum(buf + off, piece, op->word0 + off / 8);
        int64_t rc = io_range(op, buf, off, piece);
        if (rc < 0) return rc;
        if (!op->write && want_checksum) ck = ucm_checksum(buf + off, piece, op->word0 + off / 8);
        if (want_checksum) {
            if (unit) {
                if (off % unit == 0) outs[off / unit] = 0;
                outs[off / unit] += ck;
            } else {
                total += ck;
            }
        }
        off += piece;
    }
    if (want_checksum && !unit) op->checksum = total;
    return (int64_t)op->len;
}

typedef struct {
    ucm_io_op *ops;
    size_t n;
    int want_checksum;
    atomic_size_t next;
    atomic_int failed;
} io_work;

static void *io_thread(void *arg) {
    io_work *w = (io_work *)arg;
    for (;;) {
        size_t i = atomic_fetch_add(&w->next, 1);
        if (i >= w->n) break;
        ucm_io_op *op = &w->ops[i];
        op->result = io_one(op, w->want_checksum);
        if (op->result < 0) atomic_fetch_add(&w->failed, 1);
    }
    return NULL;
}

int ucm_io_batch(ucm_io_op *ops, size_t n, int n_threads, int want_checksum) {
    if (n_threads < 1) return -EINVAL;
    if (n == 0) return 0;
    if (ops == NULL) return -EINVAL;
    for (size_t i = 0; i < n; i++) {
        if (ops[i].len > 0 && ops[i].addr == 0) return -EINVAL;
        ops[i].result = 0;
        ops[i].checksum = 0;
    }
    io_work w;
    w.ops = ops;
    w.n = n;
    w.want_checksum = want_checksum;
    atomic_init(&w.next, 0);
    atomic_init(&w.failed, 0);
    int threads = n_threads;
    if (threads > UCM_MAX_THREADS) threads = UCM_MAX_THREADS;
    if ((size_t)threads > n) threads = (int)n;
    pthread_t tids[UCM_MAX_THREADS];
    int started[UCM_MAX_THREADS];
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, io_thread, &w) == 0;
    io_thread(&w); /* the calling thread works too; it alone suffices if creation failed */
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tids[t], NULL);
    return atomic_load(&w.failed);
}

/* ---- opening files beneath a directory, never through a symbolic link ---------------------- */

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#define UCM_RESOLVE_NO_SYMLINKS 0x04
#define UCM_RESOLVE_BENEATH 0x08

struct ucm_open_how { uint64_t flags, mode, resolve; };

static atomic_int openat2_missing; /* set once openat2 answered ENOSYS (or a sandbox's EPERM) */

/* The portable walk: every directory component with O_DIRECTORY | O_NOFOLLOW, the last one
 * with O_NOFOLLOW (an O_PATH descriptor of a link is refused by the caller's fstat). */
static int open_walk(int dirfd, const char *path, int flags, mode_t mode) {
    char part[256];
    int cur = dirfd;
    const char *p = path;
    for (;;) {
        const char *slash = strchr(p, '/');
        size_t len = slash ? (size_t)(slash - p) : strlen(p);
        if (len == 0 || len >= sizeof part || (len == 2 && p[0] == '.' && p[1] == '.')) {
            if (cur != dirfd) close(cur);
            return -EINVAL;
        }
        memcpy(part, p, len);
        part[len] = 0;
        int fd = slash ? openat(cur, part, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                       : openat(cur, part, flags | O_NOFOLLOW | O_CLOEXEC, mode);
        int err = errno;
        if (cur != dirfd) close(cur);
        if (fd < 0) return -(err == ENOTDIR && slash ? ELOOP : err);
        if (!slash) return fd;
        cur = fd;
        p = slash + 1;
    }
}

static int open_one(int dirfd, const char *path, int flags, mode_t mode) {
    if (path[0] == '/' || path[0] == 0) return -EINVAL;
    if (!atomic_load(&openat2_missing)) {
        struct ucm_open_how how;
        memset(&how, 0, sizeof how);
        how.flags = (uint64_t)(flags | O_NOFOLLOW | O_CLOEXEC);
        how.mode = ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) ? (uint64_t)mode : 0;
        how.resolve = UCM_RESOLVE_BENEATH | UCM_RESOLVE_NO_SYMLINKS;
        long fd;
        do {
            fd = syscall(SYS_openat2, dirfd, path, &how, sizeof how);
        } while (fd < 0 && (errno == EINTR || errno == EAGAIN));
        if (fd >= 0) return (int)fd;
        if (errno != ENOSYS && errno != EPERM) return -errno;
        if (errno == ENOSYS) atomic_store(&openat2_missing, 1);
    }
    return open_walk(dirfd, path, flags, mode);
}

int ucm_open_beneath(int dirfd, const char *paths, uint64_t stride, size_t n, int flags,
                     uint32_t mode, int keep_open, int64_t *fds, int64_t *sizes) {
    if (n == 0) return 0;
    if (paths == NULL || fds == NULL || stride == 0 || dirfd < 0) return -EINVAL;
    for (size_t i = 0; i < n; i++)
        if (memchr(paths + i * stride, 0, (size_t)stride) == NULL) return -EINVAL;
    int failed = 0;
    for (size_t i = 0; i < n; i++) {
        int fd = open_one(dirfd, paths + i * stride, flags, (mode_t)mode);
        if (fd >= 0 && sizes != NULL) {
            struct stat st;
            if (fstat(fd, &st) != 0) {
                int err = errno;
                close(fd);
                fd = -err;
            } else if (S_ISLNK(st.st_mode)) {
                close(fd);
                fd = -ELOOP;
            } else if (!S_ISREG(st.st_mode)) {
                close(fd);
                fd = -EINVAL;
            } else {
                sizes[i] = (int64_t)st.st_size;
            }
        }
        if (fd < 0) {
            fds[i] = fd;
            if (sizes != NULL) sizes[i] = -1;
            failed++;
            continue;
        }
        if (keep_open) {
            fds[i] = fd;
        } else {
            close(fd);
            fds[i] = 0;
        }
    }
    return failed;
}
