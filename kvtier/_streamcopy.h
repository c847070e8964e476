/* Streaming (non-temporal) stores and a per-thread bounce buffer, for the C loops that copy
 * K/V into memory not read again soon (kvtier/_stream.c, kvtier/_putloop.c). Ordinary stores
 * into memory not in cache read every destination line first (read-for-ownership) and write
 * it back later; streaming stores write whole lines without reading them. A copy that must
 * also hash what it stores goes through the bounce buffer (in L2): memcpy in, hash there,
 * stream out, so the hash is of exactly the stored bytes whatever the source does meanwhile.
 * x86-64 SSE2; elsewhere memcpy. Include after Python.h; call scratch_init() once from the
 * module's init.
 */
#ifndef KVTIER_STREAMCOPY_H
#define KVTIER_STREAMCOPY_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#define STREAMING 1
#else
#define STREAMING 0
#endif

#include "_xxh3.h"

#define BOUNCE (128 << 10) /* fits a core's L2 with room for the hash's and the runs' lines */

/* n bytes from s to d: streaming stores for the 16-byte-aligned body of d, memcpy around it.
 * The caller fences (stream_fence) before the data may be read by another thread. */
static void stream_range(char *d, const char *s, size_t n) {
#if defined(__x86_64__)
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t j = 0; j < body; j += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + j));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + j + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + j + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + j + 48));
        _mm_stream_si128((__m128i *)(d + j), a);
        _mm_stream_si128((__m128i *)(d + j + 16), b);
        _mm_stream_si128((__m128i *)(d + j + 32), c);
        _mm_stream_si128((__m128i *)(d + j + 48), e);
    }
    memcpy(d + body, s + body, n - body);
#else
    memcpy(d, s, n);
#endif
}

static void stream_fence(void) {
#if defined(__x86_64__)
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before we return */
#endif
}

/* The calling thread's bounce buffer (BOUNCE bytes) and hash state (made on first use by
 * the caller), freed when the thread ends. */
static pthread_key_t scratch_key;

typedef struct {
    char *bounce;
    void *state;
} scratch_t;

static void scratch_free(void *p) {
    scratch_t *s = p;
    if (s->state != NULL && xxh_free != NULL)
        xxh_free(s->state);
    free(s->bounce);
    free(s);
}

static scratch_t *scratch(void) {
    scratch_t *s = pthread_getspecific(scratch_key);
    if (s != NULL)
        return s;
    s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    if (posix_memalign((void **)&s->bounce, 64, BOUNCE) != 0) {
        free(s);
        return NULL;
    }
    pthread_setspecific(scratch_key, s);
    return s;
}

static int scratch_init(void) {
    return pthread_key_create(&scratch_key, scratch_free);
}

#endif
