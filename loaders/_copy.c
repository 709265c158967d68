/* The gather's copies in one C call per thread and batch: Python builds the address lists
 * (numpy, vectorised), this copies, and ctypes releases the GIL for the whole call. Loaded with
 * ctypes (loaders/native.py), not imported: it needs no Python headers, so it builds with any C
 * compiler, and the gather falls back to numpy where none was there at install time.
 *
 * With `stream` set, copies write with non-temporal stores: a batch far larger than the cache
 * goes to memory without first reading every destination line into the cache (what glibc's
 * memcpy does for copies above its threshold, and never for one 150 KB sample). Every address
 * here comes from arrays the reader validated (loaders/gather.py). */
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
 * of canvas slot pos[i] (`height` rows of `width` pixels), the rest of that slot zeroed. Through
 * the cache: a canvas row is a few hundred bytes of image and then zeros in the same cache lines,
 * and streaming the image part while the zeros go through the cache made a canvas of 448 px
 * photos 5% slower to gather, streaming the zeros too 45% slower. */
void mm_gather_canvas(char *dst, const uint64_t *src, const int64_t *pos, const int64_t *hw, size_t count,
                      size_t height, size_t width, size_t pixel) {
    size_t row_bytes = width * pixel;
    for (size_t i = 0; i < count; i++) {
        char *slot = dst + (size_t)pos[i] * height * row_bytes;
        const char *from = (const char *)(uintptr_t)src[i];
        size_t h = (size_t)hw[2 * i], w = (size_t)hw[2 * i + 1] * pixel;
        for (size_t r = 0; r < h; r++) {
            memcpy(slot + r * row_bytes, from + r * w, w);
            memset(slot + r * row_bytes + w, 0, row_bytes - w);
        }
        memset(slot + h * row_bytes, 0, (height - h) * row_bytes);
    }
}
