/* Baseline for the shm benchmark: single-thread memcpy throughput at one copy
 * size, on data that is not in cache.
 *
 *   memcpy_baseline --size BYTES[K|M|G] [--duration SECONDS]
 *
 * Copies rotate over source and destination slots whose total (at least
 * 512 MiB each side) is far larger than any last-level cache, so each copy
 * reads from and writes to memory, as a transfer of KV cache does. Pages are
 * touched before timing so that page faults are not measured. Prints one JSON
 * line: {"gbps": G, "size": N, "copies": C, "seconds": S} (GB = 1e9 bytes).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define POOL_MIN ((size_t)512 << 20)
#define SLOTS_MIN 8

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int parse_size(const char *s, size_t *out)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned shift = 0;
    if (*end == 'K' || *end == 'k')
        shift = 10;
    else if (*end == 'M' || *end == 'm')
        shift = 20;
    else if (*end == 'G' || *end == 'g')
        shift = 30;
    if (shift) end++;
    if (end == s || *end || v == 0 || v > (1ull << 36) >> shift) return -1;
    *out = (size_t)(v << shift);
    return 0;
}

static int usage(void)
{
    fprintf(stderr, "usage: memcpy_baseline --size BYTES[K|M|G] [--duration SECONDS]\n");
    return 2;
}

int main(int argc, char **argv)
{
    size_t size = 0;
    double duration = 3.0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--size") == 0 && parse_size(argv[i + 1], &size) == 0) continue;
        if (strcmp(argv[i], "--duration") == 0 && (duration = atof(argv[i + 1])) > 0) continue;
        return usage();
    }
    if (size == 0 || argc % 2 == 0) return usage();
    size_t slots = POOL_MIN / size < SLOTS_MIN ? SLOTS_MIN : POOL_MIN / size;
    char *src = malloc(slots * size), *dst = malloc(slots * size);
    if (!src || !dst) {
        fprintf(stderr, "memcpy_baseline: cannot allocate 2 x %zu bytes\n", slots * size);
        return 1;
    }
    memset(src, 0x5a, slots * size);
    memset(dst, 0xa5, slots * size);
    uint64_t copies = 0;
    double start = now_s(), elapsed = 0;
    /* Check the clock every few copies only, so small copies are not timed
     * mostly by clock_gettime. */
    size_t check = size >= ((size_t)1 << 20) ? 1 : ((size_t)1 << 20) / size;
    while (elapsed < duration) {
        for (size_t k = 0; k < check; k++, copies++) {
            size_t slot = copies % slots;
            memcpy(dst + slot * size, src + slot * size, size);
        }
        elapsed = now_s() - start;
    }
    /* Keep the copies observable so the compiler cannot drop them. */
    volatile char sink = dst[(copies % slots) * size];
    (void)sink;
    printf("{\"gbps\": %.3f, \"size\": %zu, \"copies\": %llu, \"seconds\": %.3f}\n",
           (double)copies * (double)size / elapsed / 1e9, size, (unsigned long long)copies,
           elapsed);
    free(src);
    free(dst);
    return 0;
}
