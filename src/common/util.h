/* Internal: small helpers every layer uses. */
#ifndef KVPI_COMMON_UTIL_H
#define KVPI_COMMON_UTIL_H

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

/* Text a user wrote (an environment variable, part of a connection string)
 * as a whole decimal number in lo..hi: 0 and *out set, or -1 (empty, not a
 * number, trailing characters, out of range) and *out untouched. */
static inline int kvpi_parse_long(const char *text, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (!*text || *end || errno || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* Make room in the array *arr of *cap elements of elem bytes for need of
 * them: doubles it (from 8) until it does. 0, or -1 when out of memory (the
 * array as it was). */
static inline int kvpi_grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap * 2 : 8;
    while (n < need)
        n *= 2;
    void *p = realloc(*arr, n * elem);
    if (!p) return -1;
    *arr = p;
    *cap = n;
    return 0;
}

/* Take node out of a doubly linked list (members prev and next) whose first
 * node is head, an lvalue. */
#define KVPI_LIST_UNLINK(head, node)                                                               \
    do {                                                                                           \
        if ((node)->prev)                                                                          \
            (node)->prev->next = (node)->next;                                                     \
        else                                                                                       \
            (head) = (node)->next;                                                                 \
        if ((node)->next) (node)->next->prev = (node)->prev;                                       \
    } while (0)

#endif
