/* Verification patterns for `kvpipe bench --verify`: every 8-byte word is a
 * hash of a seed and its offset in the target's buffer, so any byte moved to
 * the wrong place, or corrupted, fails the check. */
#ifndef TOOLS_PATTERN_H
#define TOOLS_PATTERN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PATTERN_TARGET 0x7461726765740000ull /* what the target fills in */
#define PATTERN_WRITE 0x7772697465000000ull  /* what initiators write */

static inline uint64_t pattern_word(uint64_t seed, uint64_t offset)
{
    uint64_t x = seed ^ (offset * 0x9e3779b97f4a7c15ull);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return x;
}

/* Fill len bytes (a multiple of 8) that sit at offset (a multiple of 8). */
static inline void pattern_fill(void *buf, size_t len, uint64_t seed, uint64_t offset)
{
    for (size_t i = 0; i + 8 <= len; i += 8) {
        uint64_t w = pattern_word(seed, offset + i);
        memcpy((char *)buf + i, &w, 8);
    }
}

/* 0 if every word matches the pattern of seed; otherwise 1 + the byte index of
 * the first mismatch. */
static inline size_t pattern_check(const void *buf, size_t len, uint64_t seed, uint64_t offset)
{
    for (size_t i = 0; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, (const char *)buf + i, 8);
        if (w != pattern_word(seed, offset + i)) return i + 1;
    }
    return 0;
}

#endif
