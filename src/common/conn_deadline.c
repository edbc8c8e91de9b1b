/* Deadlines on a server's connections: see conn_deadline.h. */
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/conn_deadline.h"
#include "common/error.h"
#include "common/log.h"

#define TICK_MS 250

struct kvpi_deadline_conn {
    int fd;
    uint64_t since_ms; /* when its clock (re)started */
    uint64_t limit_ms;
    const char *why;
    int reaped;
    kvpi_deadline_conn *prev, *next;
};

struct kvpi_deadlines {
    const char *what;
    pthread_mutex_t lock; /* guards conns and every conn's fields */
    kvpi_deadline_conn *conns;
    unsigned long reaped;
    pthread_t reaper;
    int wake[2]; /* a byte here stops the reaper */
};

/* Shut down every overdue connection; their count, and the first one's
 * deadline in *why and *limit_ms. */
static unsigned reap(kvpi_deadlines *d, const char **why, uint64_t *limit_ms)
{
    uint64_t now = kvpi_now_ms();
    unsigned n = 0;
    pthread_mutex_lock(&d->lock);
    for (kvpi_deadline_conn *c = d->conns; c; c = c->next) {
        if (c->reaped || now - c->since_ms <= c->limit_ms) continue;
        shutdown(c->fd, SHUT_RDWR);
        c->reaped = 1;
        if (!n++) *why = c->why, *limit_ms = c->limit_ms;
    }
    d->reaped += n;
    pthread_mutex_unlock(&d->lock);
    return n;
}

static void *reaper_main(void *arg)
{
    kvpi_deadlines *d = arg;
    int warned = 0;
    for (;;) {
        struct pollfd p = {.fd = d->wake[0], .events = POLLIN};
        if (poll(&p, 1, TICK_MS) > 0) break;
        const char *why = "";
        uint64_t limit = 0;
        unsigned n = reap(d, &why, &limit);
        if (n && !warned) {
            KVPI_WARN("%s: closed %u connection(s) that did not complete their %s within %llu ms",
                      d->what, n, why, (unsigned long long)limit);
            warned = 1;
        } else if (n) {
            KVPI_DEBUG("%s: closed %u more overdue connection(s)", d->what, n);
        }
    }
    return NULL;
}

kvp_status kvpi_deadlines_start(const char *what, kvpi_deadlines **out)
{
    kvpi_deadlines *d = calloc(1, sizeof *d);
    if (!d) return kvpi_error(KVP_ENOMEM, "%s: out of memory", what);
    d->what = what;
    if (pipe2(d->wake, O_CLOEXEC) != 0) {
        free(d);
        return kvpi_error(KVP_EIO, "%s: cannot create a pipe", what);
    }
    pthread_mutex_init(&d->lock, NULL);
    if (pthread_create(&d->reaper, NULL, reaper_main, d) != 0) {
        close(d->wake[0]);
        close(d->wake[1]);
        pthread_mutex_destroy(&d->lock);
        free(d);
        return kvpi_error(KVP_EIO, "%s: cannot start a thread", what);
    }
    *out = d;
    return KVP_OK;
}

void kvpi_deadlines_stop(kvpi_deadlines *d)
{
    if (!d) return;
    if (write(d->wake[1], "x", 1) != 1) KVPI_WARN("%s: cannot wake the reaper", d->what);
    pthread_join(d->reaper, NULL);
    close(d->wake[0]);
    close(d->wake[1]);
    while (d->conns) {
        kvpi_deadline_conn *c = d->conns;
        d->conns = c->next;
        free(c);
    }
    pthread_mutex_destroy(&d->lock);
    free(d);
}

kvpi_deadline_conn *kvpi_deadlines_add(kvpi_deadlines *d, int fd, uint64_t limit_ms,
                                       const char *why)
{
    kvpi_deadline_conn *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->fd = fd;
    c->limit_ms = limit_ms;
    c->why = why;
    pthread_mutex_lock(&d->lock);
    c->since_ms = kvpi_now_ms();
    c->next = d->conns;
    if (d->conns) d->conns->prev = c;
    d->conns = c;
    pthread_mutex_unlock(&d->lock);
    return c;
}

void kvpi_deadlines_set(kvpi_deadlines *d, kvpi_deadline_conn *c, uint64_t limit_ms,
                        const char *why, int restart)
{
    if (!c) return;
    pthread_mutex_lock(&d->lock);
    if (restart) c->since_ms = kvpi_now_ms();
    c->limit_ms = limit_ms;
    c->why = why;
    pthread_mutex_unlock(&d->lock);
}

void kvpi_deadlines_remove(kvpi_deadlines *d, kvpi_deadline_conn *c)
{
    if (!c) return;
    pthread_mutex_lock(&d->lock);
    if (c->prev)
        c->prev->next = c->next;
    else
        d->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    pthread_mutex_unlock(&d->lock);
    free(c);
}

unsigned long kvpi_deadlines_reaped(kvpi_deadlines *d)
{
    pthread_mutex_lock(&d->lock);
    unsigned long n = d->reaped;
    pthread_mutex_unlock(&d->lock);
    return n;
}
