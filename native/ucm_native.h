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
#define UCM_NATIVE_ABI 2

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
/* CFFI-END */

#endif /* UCM_NATIVE_H */
