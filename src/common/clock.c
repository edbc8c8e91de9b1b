#include <stdint.h>

#include "common/clock.h"

int kvpi_remaining_ms(uint64_t deadline_ns)
{
    if (deadline_ns == 0) return -1;
    uint64_t now = kvpi_now_ns();
    if (now >= deadline_ns) return 0;
    uint64_t ms = (deadline_ns - now + 999999u) / 1000000u;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

int kvpi_cond_init(pthread_cond_t *cond)
{
    pthread_condattr_t attr;
    int err = pthread_condattr_init(&attr);
    if (err) return err;
    err = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (!err) err = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return err;
}

void kvpi_thread_stop(pthread_t thread, pthread_mutex_t *lock, pthread_cond_t *cond, int *stop)
{
    pthread_mutex_lock(lock);
    *stop = 1;
    pthread_cond_signal(cond);
    pthread_mutex_unlock(lock);
    pthread_join(thread, NULL);
}

struct timespec kvpi_timespec_at_ns(uint64_t deadline_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000u),
                          .tv_nsec = (long)(deadline_ns % 1000000000u)};
    return ts;
}

struct timespec kvpi_deadline_after_ms(int64_t timeout_ms)
{
    return kvpi_timespec_at_ns(kvpi_now_ns() +
                               (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000u);
}
