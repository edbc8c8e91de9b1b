/* Shared by the fuzz harnesses: an invariant check that stops the run (libFuzzer
 * records the input as a crash) and a reader that takes typed values off the
 * front of an input. */
#ifndef KVPF_FUZZ_H
#define KVPF_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A broken invariant is a bug like a crash: report it and abort. */
#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: invariant broken: %s\n", __FILE__, __LINE__, #cond);           \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

typedef struct kvpf_reader {
    const uint8_t *p;
    size_t left;
} kvpf_reader;

/* The next n bytes (fewer at the end of the input: the rest reads as 0). */
static inline uint64_t kvpf_take(kvpf_reader *r, size_t n)
{
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        v |= (uint64_t)(r->left ? *r->p : 0) << (8 * i);
        if (r->left) {
            r->p++;
            r->left--;
        }
    }
    return v;
}

/* The next n bytes into buf (zeros past the end of the input). */
static inline void kvpf_take_bytes(kvpf_reader *r, uint8_t *buf, size_t n)
{
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)kvpf_take(r, 1);
}

/* A frame decoded and encoded again: the first used bytes as they came,
 * zeros after them up to len. */
static inline void kvpf_check_again(const uint8_t *again, const uint8_t *raw, size_t used,
                                    size_t len)
{
    FUZZ_CHECK(memcmp(again, raw, used) == 0);
    for (size_t i = used; i < len; i++)
        FUZZ_CHECK(again[i] == 0);
}

/* Quiet logs: a fuzzer feeds millions of bad inputs, each worth a warning. */
static inline void kvpf_quiet(void)
{
    setenv("KVPIPE_LOG", "error", 0);
}

/* The LLVMFuzzerInitialize of a target that needs nothing but quiet logs. */
#define KVPF_QUIET_INITIALIZE                                                                      \
    int LLVMFuzzerInitialize(int *argc, char ***argv)                                              \
    {                                                                                              \
        (void)argc;                                                                                \
        (void)argv;                                                                                \
        kvpf_quiet();                                                                              \
        return 0;                                                                                  \
    }

#endif
