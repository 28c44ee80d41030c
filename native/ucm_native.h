/*
 * ucm native engine: multi-threaded segment copies and aligned host buffers.
 *
 * C11 + pthreads. Wrapped by cffi in API mode (native/build_native.py reads the
 * declarations between the CFFI markers below, so this header is the single
 * source of truth for the Python binding).
 *
 * Error convention: functions return 0 on success and a negative errno value
 * on failure; they never abort the process.
 */
#ifndef UCM_NATIVE_H
#define UCM_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* Bumped whenever the C ABI or behaviour changes; checked by ucm/fast/native.py. */
#define UCM_NATIVE_ABI 5

/* CFFI-BEGIN */
/* ABI version compiled into the library (UCM_NATIVE_ABI). */
int ucm_native_abi(void);

/* Hex digest of the C sources this library was built from ("" if unknown). */
const char *ucm_native_source_digest(void);

/* Largest thread count ucm_copy_segments will use. */
int ucm_max_threads(void);

/*
 * Copy n segments: for each i, len[i] bytes from address src[i] to address
 * dst[i]. Segments must not overlap each other (source with destination).
 * The work is split by bytes across up to n_threads threads (a segment may be
 * shared by two threads); small copies run on the calling thread.
 * Returns 0, or -EINVAL for bad arguments (a NULL address with a non-zero
 * length, n_threads < 1, lengths whose sum overflows 64 bits); nothing is copied then.
 */
int ucm_copy_segments(const uint64_t *src, const uint64_t *dst,
                      const uint64_t *len, size_t n, int n_threads);

/* Zero-filled host memory aligned to `alignment` (a power of two >= sizeof(void*)), every page
 * faulted in. Sizes >= 2 MiB are mmap'ed, 2 MiB-aligned and advised to use transparent huge
 * pages. Returns NULL on failure. Free with ucm_free_aligned(p, size) using the same size. */
void *ucm_alloc_aligned(size_t size, size_t alignment);
void ucm_free_aligned(void *p, size_t size);

/*
 * Block checksum "ucm-sum64" (docs/block-format.md): the little-endian 64-bit words w_i of the
 * bytes (the last one zero-padded), with global word numbers j = word0 + i, give
 *     x_i = mix(w_i ^ (j * 0x9E3779B97F4A7C15)),  mix(x) = x ^= x >> 32; x *= 0xD6E8FEB86659FD93;
 *                                                        x ^= x >> 32
 *     checksum = sum of x_i mod 2^64.
 * mix is a bijection, so any change to one word changes the sum; sums of adjacent ranges add up
 * (a range's checksum can be computed in pieces, by several threads).
 */
uint64_t ucm_checksum(const void *data, uint64_t len, uint64_t word0);

/* One checksum per `unit` bytes (a multiple of 8 dividing len): out[k] = ucm_checksum(data +
 * k * unit, unit, word0 + k * unit / 8). Returns 0, or -EINVAL for a unit that does not fit. */
int ucm_checksum_units(const void *data, uint64_t len, uint64_t unit, uint64_t word0,
                       uint64_t *out);

/* Copy len bytes from src to dst and checksum what was copied, one pass over the source:
 * out[k] = ucm_checksum(dst + k * unit, unit, word0 + k * unit / 8). Same unit rule and result
 * as ucm_checksum_units; overlapping buffers are copied as memmove does. */
int ucm_copy_checksum_units(void *dst, const void *src, uint64_t len, uint64_t unit,
                            uint64_t word0, uint64_t *out);

/* One positioned read or write of a batch (see ucm_io_batch). */
typedef struct {
    int32_t fd;
    int32_t write;       /* 1: pwrite len bytes from addr; 0: pread into addr */
    uint64_t addr;
    uint64_t len;
    uint64_t file_off;
    uint64_t word0;      /* global word number of addr[0], for the checksum */
    uint64_t csum_unit;  /* 0: one checksum of the op in `checksum`; else a multiple of 8 */
    uint64_t csum_out;   /* with csum_unit: address of len / csum_unit uint64 checksums */
    int64_t result;      /* out: bytes moved (== len) or -errno (-ENODATA: end of file) */
    uint64_t checksum;   /* out: ucm_checksum of the op's bytes, when requested */
} ucm_io_op;

/*
 * Run n positioned reads/writes on up to n_threads C threads (short transfers and EINTR are
 * retried to completion). With want_checksum, checksums are computed in 256 KiB pieces right
 * before a piece is written or right after it is read, while the bytes are in cache: one per op,
 * or one per csum_unit bytes into csum_out. Returns the number of failed ops (0 = all done);
 * per-op outcome in result. Never aborts; -EINVAL for bad arguments.
 */
int ucm_io_batch(ucm_io_op *ops, size_t n, int n_threads, int want_checksum);

/*
 * Open n relative paths beneath the directory dirfd without following any symbolic link and
 * without leaving dirfd (Linux openat2 with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS; on kernels
 * or sandboxes without openat2, a walk of the components with O_NOFOLLOW). Path i is the
 * NUL-terminated string at paths + i * stride (at most stride bytes, no "..", not absolute).
 * flags/mode as for open(2) (O_CLOEXEC and O_NOFOLLOW are always added; O_PATH probes).
 * fds[i]: the descriptor (keep_open), 0 (closed again), or -errno: -ELOOP/-EXDEV for a link
 * or an escape, -ENOENT, -EINVAL when sizes is given and the target is not a regular file.
 * sizes (optional, may be NULL): st_size of each regular file opened. Returns the number of
 * paths that failed, or -EINVAL for bad arguments (nothing opened then).
 */
int ucm_open_beneath(int dirfd, const char *paths, uint64_t stride, size_t n, int flags,
                     uint32_t mode, int keep_open, int64_t *fds, int64_t *sizes);
/* CFFI-END */

#endif /* UCM_NATIVE_H */
