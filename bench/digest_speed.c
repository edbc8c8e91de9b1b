/* The speed of integrity's digest (src/common/digest.c) on this machine,
 * beside the candidates it was chosen over and beside memcpy:
 *
 *   digest_speed [--duration SECONDS]
 *
 * Each function digests 256 KiB chunks (the size kvpipe digests a received
 * slice in) twice: over one chunk again and again (in cache: what kvpipe's
 * passes see, which read what was just copied or is about to be) and walking
 * 1 GiB of memory (out of cache). Prints one JSON line per function:
 *   {"function": F, "in_cache_gbps": G, "memory_gbps": M}
 * xxh3-64 is kvpipe's (libxxhash's XXH3_64bits, through its x86
 * dispatcher); xxh64 libxxhash's older XXH64; crc32 zlib's (the CRC
 * libraries Debian packages; none has CRC32C); crc32c-sse42 the x86
 * instruction, one word at a time, as a reference only (kvpipe does not
 * hand-write a digest); memcpy the copy it rides on. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>
#if defined(__x86_64__) && defined(__has_include) /* as src/common/digest.c */
#if __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>
#endif
#endif
#include <zlib.h>
#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#define CHUNK ((size_t)256 << 10)
#define SPAN ((size_t)1 << 30)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint8_t *dst; /* for memcpy */

static uint64_t f_xxh3(const uint8_t *p, size_t n)
{
    return XXH3_64bits(p, n);
}

static uint64_t f_xxh64(const uint8_t *p, size_t n)
{
    return XXH64(p, n, 0);
}

static uint64_t f_crc32(const uint8_t *p, size_t n)
{
    return crc32(0, p, (uInt)n);
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint64_t f_crc32c(const uint8_t *p, size_t n)
{
    uint64_t c = ~0ull;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        c = _mm_crc32_u64(c, w);
    }
    return ~c;
}
#endif

static uint64_t f_memcpy(const uint8_t *p, size_t n)
{
    memcpy(dst, p, n);
    return dst[n - 1];
}

/* GB/s of fn over chunks of buf: the same chunk, or walking span bytes. */
static double speed(uint64_t (*fn)(const uint8_t *, size_t), const uint8_t *buf, size_t span,
                    double duration)
{
    volatile uint64_t sink = 0;
    size_t off = 0, bytes = 0;
    double t0 = now_s(), t;
    do {
        for (int i = 0; i < 64; i++) {
            sink += fn(buf + off, CHUNK);
            bytes += CHUNK;
            off = off + 2 * CHUNK <= span ? off + CHUNK : 0;
        }
        t = now_s() - t0;
    } while (t < duration);
    (void)sink;
    return (double)bytes / t / 1e9;
}

int main(int argc, char **argv)
{
    double duration = 1;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--duration") == 0 && i + 1 < argc)
            duration = atof(argv[++i]);
        else
            return fprintf(stderr, "usage: digest_speed [--duration SECONDS]\n"), 2;
    uint8_t *buf = malloc(SPAN);
    dst = malloc(CHUNK);
    if (!buf || !dst) return 1;
    for (size_t i = 0; i < SPAN; i++)
        buf[i] = (uint8_t)(i * 2654435761u >> 13);
    memset(dst, 0, CHUNK);
    struct {
        const char *name;
        uint64_t (*fn)(const uint8_t *, size_t);
    } fs[] = {
        {"xxh3-64", f_xxh3},
        {"xxh64", f_xxh64},
        {"crc32", f_crc32},
#if defined(__x86_64__)
        {"crc32c-sse42", f_crc32c},
#endif
        {"memcpy", f_memcpy},
    };
    for (size_t i = 0; i < sizeof fs / sizeof fs[0]; i++)
        printf("{\"function\": \"%s\", \"in_cache_gbps\": %.2f, \"memory_gbps\": %.2f}\n",
               fs[i].name, speed(fs[i].fn, buf, CHUNK, duration),
               speed(fs[i].fn, buf, SPAN, duration));
    free(buf);
    free(dst);
    return 0;
}
