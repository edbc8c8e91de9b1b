/* Internal: the one clock every deadline uses.
 *
 * All deadlines in kvpipe are points on CLOCK_MONOTONIC, so a wall-clock step
 * (NTP, an operator setting the date) never shortens or stretches a wait.
 * kvpi_now_ns()/kvpi_now_ms() read it; condition variables that wait with a
 * timeout are created with kvpi_cond_init(), which makes them measure timeouts
 * on the same clock, and wait until a timespec from kvpi_timespec_at_ns() or
 * kvpi_deadline_after_ms().
 */
#ifndef KVPI_COMMON_CLOCK_H
#define KVPI_COMMON_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

/* The default of every timeout the API leaves to kvpipe (0 or unset): an
 * engine's timeout_ms, a pipe's io_timeout_ms, the requests to a metadata
 * store and the P2P handshakes, a connection server's deadline base. */
#define KVPI_DEFAULT_TIMEOUT_MS 5000

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

/* A deadline timeout_ms from now, in kvpi_now_ns() nanoseconds; a negative
 * timeout gives 0, which deadline-taking functions read as "no deadline". */
static inline uint64_t kvpi_deadline_ns(int64_t timeout_ms)
{
    return timeout_ms < 0 ? 0 : kvpi_now_ns() + (uint64_t)timeout_ms * 1000000u;
}

/* Milliseconds left until deadline_ns (kvpi_now_ns() clock), rounded up, so
 * that a wait of the result never ends before the deadline; 0 once it passed;
 * -1 for deadline_ns 0 (none). Capped at INT32_MAX. */
int kvpi_remaining_ms(uint64_t deadline_ns);

/* Initialise a condition variable whose timed waits run on CLOCK_MONOTONIC.
 * Returns 0 or the pthread error. */
int kvpi_cond_init(pthread_cond_t *cond);

/* Stop a thread that waits on cond, under lock, until *stop: set *stop
 * under lock, wake the thread and join it. */
void kvpi_thread_stop(pthread_t thread, pthread_mutex_t *lock, pthread_cond_t *cond, int *stop);

/* The absolute timespec of deadline_ns, for pthread_cond_timedwait on a
 * condition variable made by kvpi_cond_init(). */
struct timespec kvpi_timespec_at_ns(uint64_t deadline_ns);

/* The same for a deadline timeout_ms from now (negative: now). */
struct timespec kvpi_deadline_after_ms(int64_t timeout_ms);

#endif
