/* Internal: monotonic clock helpers. */
#ifndef KVPI_COMMON_CLOCK_H
#define KVPI_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t kvpi_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t kvpi_now_ms(void)
{
    return kvpi_now_ns() / 1000000u;
}

/* An absolute CLOCK_REALTIME deadline timeout_ms from now, for
 * pthread_cond_timedwait on a default condition variable. */
struct timespec kvpi_deadline_after_ms(int64_t timeout_ms);

#endif
