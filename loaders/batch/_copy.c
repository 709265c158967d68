/* The gather's copies: Python builds the address lists (numpy, vectorised), this copies them,
 * on a pool of C threads (below) or in one call per range, the GIL released. Loaded with
 * ctypes (loaders/batch/native.py), not imported: it needs no Python headers, so it builds with any C
 * compiler, and the gather falls back to numpy where none was there at install time.
 *
 * With `stream` set, copies write with non-temporal stores: a batch far larger than the cache
 * goes to memory without first reading every destination line into the cache (what glibc's
 * memcpy does for copies above its threshold, and never for one 150 KB sample). Nothing here
 * checks a range: native.Job checks every sample's source and destination range against its
 * buffers before it calls in (loaders/batch/native.py). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

static void copy(char *dst, const char *src, size_t n, int stream) {
#if defined(__x86_64__)
    if (stream && n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15; /* the streaming stores need 16-byte aligned targets */
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; n >= 64; n -= 64, src += 64, dst += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}

static void fence(int stream) {
#if defined(__x86_64__)
    if (stream)
        _mm_sfence(); /* streamed lines are visible to other threads once the call returns */
#endif
    (void)stream;
}

/* Sample i (nbytes at src[i]) to dst + pos[i] * nbytes, for i < count. */
void mm_gather_rows(char *dst, const uint64_t *src, const int64_t *pos, size_t count, size_t nbytes, int stream) {
    for (size_t i = 0; i < count; i++)
        copy(dst + (size_t)pos[i] * nbytes, (const char *)(uintptr_t)src[i], nbytes, stream);
    fence(stream);
}

/* Image i (hw[2i] rows of hw[2i+1] pixels of `pixel` bytes, contiguous at src[i]) to the top-left
 * of canvas slot pos[i] (`height` rows of `width` pixels), the rest of that slot zeroed. The work is
 * proportional to the bytes: an empty image (a zero side) is one memset, however many rows of
 * nothing its other side says (a hostile shapes file may say 2^31 - 1), and an image as wide as
 * the canvas one memcpy. Through
 * the cache: a canvas row is a few hundred bytes of image and then zeros in the same cache lines,
 * and streaming the image part while the zeros go through the cache made a canvas of 448 px
 * photos 5% slower to gather, streaming the zeros too 45% slower. A sample as wide as its slot
 * (an audio crop: frames of one "pixel") is one run of bytes and one of zeros, and with `stream`
 * both are written around the cache, as rows are. */
static void zero(char *dst, size_t n, int stream) {
#if defined(__x86_64__)
    if (stream && n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memset(dst, 0, head);
        dst += head, n -= head;
        __m128i z = _mm_setzero_si128();
        for (; n >= 64; n -= 64, dst += 64) {
            _mm_stream_si128((__m128i *)dst, z);
            _mm_stream_si128((__m128i *)(dst + 16), z);
            _mm_stream_si128((__m128i *)(dst + 32), z);
            _mm_stream_si128((__m128i *)(dst + 48), z);
        }
    }
#endif
    memset(dst, 0, n);
}

void mm_gather_canvas(char *dst, const uint64_t *src, const int64_t *pos, const int64_t *hw, size_t count,
                      size_t height, size_t width, size_t pixel, int stream) {
    size_t row_bytes = width * pixel;
    for (size_t i = 0; i < count; i++) {
        char *slot = dst + (size_t)pos[i] * height * row_bytes;
        const char *from = (const char *)(uintptr_t)src[i];
        size_t h = (size_t)hw[2 * i], w = (size_t)hw[2 * i + 1] * pixel;
        if (h == 0 || w == 0) {
            memset(slot, 0, height * row_bytes);
            continue;
        }
        if (w == row_bytes) {
            copy(slot, from, h * w, stream);
            zero(slot + h * w, (height - h) * row_bytes, stream);
            continue;
        } else {
            for (size_t r = 0; r < h; r++) {
                memcpy(slot + r * row_bytes, from + r * w, w);
                memset(slot + r * row_bytes + w, 0, row_bytes - w);
            }
        }
        memset(slot + h * row_bytes, 0, (height - h) * row_bytes);
    }
    fence(stream);
}

/* A pool of copy threads, one per Loader: a gather starts a column on it (`mm_pool_start`),
 * does its small columns in Python meanwhile, then copies shares itself until all are done
 * (`mm_pool_finish`, the GIL released). Its threads never run Python, so they need the GIL
 * neither to start nor to finish a share: a Python thread pool's copiers did, twice per batch,
 * each time waiting up to a switch interval behind a training loop that runs pure Python.
 * Shares are taken one at a time, so a helper that wakes late only finds less to do. One job
 * at a time per pool (`busy`, held from start to finish by the caller's thread). The pool
 * belongs to the process that made it: Python copies without it in a forked child (whose
 * copy of the lock may be held forever), and there `mm_pool_free` frees nothing. */
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

typedef struct {
    char *dst;
    const uint64_t *src;
    const int64_t *pos, *hw;
    size_t count, nbytes, height, width, pixel;
    int stream, canvas;
} job_t;

typedef struct {
    pthread_mutex_t busy, lock;
    pthread_cond_t start, finished;
    job_t job;
    size_t shares, next, left;
    unsigned long round;
    int quit, helpers;
    pid_t pid;
    pthread_t threads[];
} pool_t;

static void run_share(const job_t *j, size_t share, size_t shares) {
    size_t a = j->count * share / shares, b = j->count * (share + 1) / shares;
    if (j->canvas)
        mm_gather_canvas(j->dst, j->src + a, j->pos + a, j->hw + 2 * a, b - a, j->height, j->width, j->pixel,
                         j->stream);
    else
        mm_gather_rows(j->dst, j->src + a, j->pos + a, b - a, j->nbytes, j->stream);
}

/* Copies shares while any are left; called with the lock held, returns with it held. */
static void take_shares(pool_t *p) {
    while (p->next < p->shares) {
        size_t share = p->next++, shares = p->shares;
        job_t job = p->job;
        pthread_mutex_unlock(&p->lock);
        run_share(&job, share, shares);
        pthread_mutex_lock(&p->lock);
        if (--p->left == 0)
            pthread_cond_signal(&p->finished);
    }
}

static void *helper(void *arg) {
    pool_t *p = arg;
    pthread_mutex_lock(&p->lock);
    unsigned long seen = p->round;
    for (;;) {
        while (p->round == seen && !p->quit)
            pthread_cond_wait(&p->start, &p->lock);
        if (p->quit)
            break;
        seen = p->round;
        take_shares(p);
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* A pool for `threads` copiers: the caller of mm_pool_finish and threads - 1 helpers (fewer if
 * the system will not start them: the caller then copies their shares). NULL without memory. */
void *mm_pool_new(int threads) {
    int helpers = threads > 1 ? threads - 1 : 0;
    pool_t *p = calloc(1, sizeof(pool_t) + (size_t)helpers * sizeof(pthread_t));
    if (p == NULL)
        return NULL;
    pthread_mutex_init(&p->busy, NULL);
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->start, NULL);
    pthread_cond_init(&p->finished, NULL);
    p->pid = getpid();
    for (; p->helpers < helpers; p->helpers++)
        if (pthread_create(&p->threads[p->helpers], NULL, helper, p) != 0)
            break;
    return p;
}

void mm_pool_free(void *pool) {
    pool_t *p = pool;
    if (p == NULL || p->pid != getpid())
        return;
    pthread_mutex_lock(&p->lock);
    p->quit = 1;
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->lock);
    for (int i = 0; i < p->helpers; i++)
        pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->start);
    pthread_cond_destroy(&p->finished);
    pthread_mutex_destroy(&p->lock);
    pthread_mutex_destroy(&p->busy);
    free(p);
}

/* Starts copying a column in `shares` contiguous shares on the helpers (a canvas when hw is not
 * NULL, else fixed-shape rows); mm_pool_finish, from the same thread, completes it. */
void mm_pool_start(void *pool, char *dst, const uint64_t *src, const int64_t *pos, const int64_t *hw, size_t count,
                   size_t nbytes, size_t height, size_t width, size_t pixel, int stream, size_t shares) {
    pool_t *p = pool;
    job_t job = {dst, src, pos, hw, count, nbytes, height, width, pixel, stream, hw != NULL};
    pthread_mutex_lock(&p->busy);
    pthread_mutex_lock(&p->lock);
    p->job = job;
    p->shares = shares ? shares : 1;
    p->next = 0;
    p->left = p->shares;
    p->round++;
    pthread_cond_broadcast(&p->start);
    pthread_mutex_unlock(&p->lock);
}

void mm_pool_finish(void *pool) {
    pool_t *p = pool;
    pthread_mutex_lock(&p->lock);
    take_shares(p);
    while (p->left > 0)
        pthread_cond_wait(&p->finished, &p->lock);
    pthread_mutex_unlock(&p->lock);
    pthread_mutex_unlock(&p->busy);
}
