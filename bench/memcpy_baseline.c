/* Baseline for the shm benchmark: memcpy throughput at one copy size, on data
 * that is not in cache, from one thread or several.
 *
 *   memcpy_baseline --size BYTES[K|M|G] [--duration SECONDS] [--threads N]
 *
 * Copies rotate over source and destination slots whose total (at least
 * 512 MiB each side) is far larger than any last-level cache, so each copy
 * reads from and writes to memory, as a transfer of KV cache does. With
 * --threads N (default 1) each thread copies between slots of its own (at
 * least 8 a side each), all starting together: the baseline of an engine
 * moving with N initiator threads. Pages are touched (by the thread that
 * copies them) before timing so that page faults are not measured. Prints one
 * JSON line: {"gbps": G, "size": N, "copies": C, "seconds": S, "threads": T}
 * (GB = 1e9 bytes; copies summed over the threads, seconds the longest).
 *
 * --src-span / --dst-span BYTES set one side's footprint per thread instead
 * (rounded down to whole copies, at least one): the baseline of a transfer
 * at a caller's footprint, e.g. a batch of 32 WRITEs of 1 MiB from a block
 * each into one remote block is --size 1M --src-span 32M --dst-span 1M.
 */
#include <pthread.h>
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
    fprintf(stderr,
            "usage: memcpy_baseline --size BYTES[K|M|G] [--duration SECONDS] [--threads N]\n"
            "                       [--src-span BYTES[K|M|G]] [--dst-span BYTES[K|M|G]]\n");
    return 2;
}

typedef struct copier {
    char *src, *dst;
    size_t size, src_slots, dst_slots;
    double duration, elapsed;
    uint64_t copies;
    pthread_barrier_t *ready;
} copier;

static void *copy_loop(void *arg)
{
    copier *c = arg;
    memset(c->src, 0x5a, c->src_slots * c->size);
    memset(c->dst, 0xa5, c->dst_slots * c->size);
    pthread_barrier_wait(c->ready);
    uint64_t copies = 0;
    double start = now_s(), elapsed = 0;
    /* Check the clock every few copies only, so small copies are not timed
     * mostly by clock_gettime. */
    size_t check = c->size >= ((size_t)1 << 20) ? 1 : ((size_t)1 << 20) / c->size;
    while (elapsed < c->duration) {
        for (size_t k = 0; k < check; k++, copies++) {
            memcpy(c->dst + copies % c->dst_slots * c->size,
                   c->src + copies % c->src_slots * c->size, c->size);
        }
        elapsed = now_s() - start;
    }
    /* Keep the copies observable so the compiler cannot drop them. */
    volatile char sink = c->dst[copies % c->dst_slots * c->size];
    (void)sink;
    c->copies = copies;
    c->elapsed = elapsed;
    return NULL;
}

/* The copies a side's --*-span holds (one at least), or dflt without one. */
static size_t span_slots(size_t span, size_t size, size_t dflt)
{
    if (!span) return dflt;
    return span / size ? span / size : 1;
}

int main(int argc, char **argv)
{
    size_t size = 0, src_span = 0, dst_span = 0;
    double duration = 3.0;
    int threads = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--size") == 0 && parse_size(argv[i + 1], &size) == 0) continue;
        if (strcmp(argv[i], "--src-span") == 0 && parse_size(argv[i + 1], &src_span) == 0) continue;
        if (strcmp(argv[i], "--dst-span") == 0 && parse_size(argv[i + 1], &dst_span) == 0) continue;
        if (strcmp(argv[i], "--duration") == 0 && (duration = atof(argv[i + 1])) > 0) continue;
        if (strcmp(argv[i], "--threads") == 0 && (threads = atoi(argv[i + 1])) >= 1 &&
            threads <= 256)
            continue;
        return usage();
    }
    if (size == 0 || argc % 2 == 0) return usage();
    /* Slots per thread: the pool of every thread together is at least
     * POOL_MIN a side, each thread's at least SLOTS_MIN slots. */
    size_t slots = POOL_MIN / size / (size_t)threads;
    if (slots < SLOTS_MIN) slots = SLOTS_MIN;
    size_t src_slots = span_slots(src_span, size, slots);
    size_t dst_slots = span_slots(dst_span, size, slots);
    copier *c = calloc((size_t)threads, sizeof *c);
    pthread_t *t = calloc((size_t)threads, sizeof *t);
    pthread_barrier_t ready;
    if (!c || !t || pthread_barrier_init(&ready, NULL, (unsigned)threads)) return 1;
    for (int i = 0; i < threads; i++) {
        c[i] = (copier){.src = malloc(src_slots * size),
                        .dst = malloc(dst_slots * size),
                        .size = size,
                        .src_slots = src_slots,
                        .dst_slots = dst_slots,
                        .duration = duration,
                        .ready = &ready};
        if (!c[i].src || !c[i].dst) {
            fprintf(stderr, "memcpy_baseline: cannot allocate %d x %zu bytes\n", threads,
                    (src_slots + dst_slots) * size);
            return 1;
        }
    }
    for (int i = 0; i < threads; i++)
        if (pthread_create(&t[i], NULL, copy_loop, &c[i])) return 1;
    uint64_t copies = 0;
    double elapsed = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        copies += c[i].copies;
        if (c[i].elapsed > elapsed) elapsed = c[i].elapsed;
        free(c[i].src);
        free(c[i].dst);
    }
    printf("{\"gbps\": %.3f, \"size\": %zu, \"copies\": %llu, \"seconds\": %.3f, "
           "\"threads\": %d}\n",
           (double)copies * (double)size / elapsed / 1e9, size, (unsigned long long)copies, elapsed,
           threads);
    return 0;
}
