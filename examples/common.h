/* What the examples share: the byte patterns each side writes and checks, and
 * one line of error text. */
#ifndef KVP_EXAMPLES_COMMON_H
#define KVP_EXAMPLES_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <kvpipe/kvpipe.h>

/* The target fills its memory with pattern 1; the initiator writes pattern 2. */
static inline uint8_t example_byte(int pattern, size_t i)
{
    return (uint8_t)(pattern == 1 ? i * 7 + 1 : i * 13 + 5);
}

/* Print what failed: the status text and the library's detail message. */
static inline int example_fail(const char *what, kvp_status st)
{
    fprintf(stderr, "%s: %s (%s)\n", what, kvp_strerror(st), kvp_last_error());
    return 1;
}

#endif
