#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/conn_server.h"
#include "common/error.h"
#include "common/log.h"
#include "transport/runner.h"
#include "transport/staging.h"

struct kvpi_runner {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    kvpi_xfer *head, **tail; /* queued, in posting order */
    int stopping;
    int started;
    int idle;  /* threads waiting on cond */
    int wakes; /* of them, woken for an xfer and not yet running */
    pthread_t threads[KVPI_RUNNER_THREADS_MAX];
};

/* Every slice not yet answered gets st; then the completion. */
static void finish(kvpi_xfer *x, kvp_status st)
{
    for (size_t i = 0; i < x->n; i++)
        if (x->slices[i]->status == KVP_EINPROGRESS) x->slices[i]->status = st;
    x->done(x, st);
}

static kvp_status run_fn(kvpi_xfer *x)
{
    if (atomic_load(&x->canceled))
        return kvpi_error(KVP_ECANCELED, "the transfer was cancelled before it started");
    kvpi_runner_lane *lane = x->lane;
    uint64_t bytes = 0;
    for (size_t i = 0; i < x->n; i++)
        bytes += x->slices[i]->length;
    uint64_t start = kvpi_now_ns();
    /* A transport's function sets every slice; one it left unset failed
     * with the call. Device memory goes through bounce buffers on the way,
     * unless the function stages itself. */
    uint64_t deadline = kvpi_transfer_deadline(lane->timeout_ms, lane->min_rate, bytes);
    if (lane->own_staging) return x->run(x->peer, x->slices, x->n, start, deadline);
    return kvpi_stage_run(x->run, x->peer, x->slices, x->n, start, deadline);
}

static int in_lane(const kvpi_xfer *x, const void *lane)
{
    return x->lane == lane;
}

static int flagged(const kvpi_xfer *x, const void *unused)
{
    (void)unused;
    return atomic_load(&x->canceled);
}

/* Take the queued xfers that match off the queue, in order; under the lock. */
static kvpi_xfer *take_if(kvpi_runner *r, int (*match)(const kvpi_xfer *, const void *),
                          const void *arg)
{
    kvpi_xfer *out = NULL, **last = &out;
    for (kvpi_xfer **pp = &r->head; *pp;) {
        kvpi_xfer *x = *pp;
        if (!match(x, arg)) {
            pp = &x->next;
            continue;
        }
        *pp = x->next;
        *last = x;
        last = &x->next;
        ((kvpi_runner_lane *)x->lane)->queued--;
    }
    *last = NULL;
    r->tail = &r->head;
    while (*r->tail)
        r->tail = &(*r->tail)->next;
    return out;
}

/* Complete a detached list with st, detail as kvp_last_error(). */
static void finish_list(kvpi_xfer *list, kvp_status st, const char *detail)
{
    while (list) {
        kvpi_xfer *x = list;
        list = x->next; /* before done: x may be freed there */
        finish(x, kvpi_error(st, "%s", detail));
    }
}

/* The first queued xfer whose lane has room (any, when stopping), taken off
 * the queue; NULL if none. Under the lock. */
static kvpi_xfer *take(kvpi_runner *r)
{
    for (kvpi_xfer **pp = &r->head; *pp; pp = &(*pp)->next) {
        kvpi_xfer *x = *pp;
        kvpi_runner_lane *lane = x->lane;
        if (!r->stopping && lane->running >= lane->limit) continue;
        if (!(*pp = x->next)) r->tail = pp;
        lane->queued--;
        lane->running++;
        return x;
    }
    return NULL;
}

static void *runner_main(void *arg)
{
    kvpi_runner *r = arg;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        kvpi_xfer *x = take(r);
        if (!x) {
            if (r->stopping && !r->head) break;
            r->idle++;
            pthread_cond_wait(&r->cond, &r->lock);
            r->idle--;
            if (r->wakes > 0) r->wakes--;
            continue;
        }
        int stopping = r->stopping;
        pthread_mutex_unlock(&r->lock);
        kvp_status st =
            stopping ? kvpi_error(KVP_ECLOSED, "the engine is shutting down") : run_fn(x);
        char detail[300] = "";
        pthread_mutex_lock(&r->lock);
        /* Before the completions, after which the peer may be closed. */
        kvpi_runner_lane *lane = x->lane;
        lane->running--;
        kvpi_xfer *behind = NULL;
        if (kvpi_connection_level(st) && !stopping) {
            behind = take_if(r, in_lane, lane);
            if (behind)
                snprintf(detail, sizeof detail, "the peer failed a transfer posted before: %s",
                         kvp_last_error());
        }
        /* Room in its lane now: this thread takes what waits there next. */
        pthread_mutex_unlock(&r->lock);
        finish(x, st);
        finish_list(behind, st, detail);
        pthread_mutex_lock(&r->lock);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

kvp_status kvpi_runner_create(kvpi_runner **out)
{
    kvpi_runner *r = calloc(1, sizeof *r);
    if (!r) return kvpi_error(KVP_ENOMEM, "runner: out of memory");
    pthread_mutex_init(&r->lock, NULL);
    kvpi_cond_init(&r->cond);
    r->tail = &r->head;
    *out = r;
    return KVP_OK;
}

void kvpi_runner_stop(kvpi_runner *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->lock);
    r->stopping = 1;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
    for (int i = 0; i < r->started; i++)
        pthread_join(r->threads[i], NULL);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->cond);
    free(r);
}

void kvpi_runner_cancel(kvpi_runner *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->lock);
    kvpi_xfer *canceled = take_if(r, flagged, NULL);
    pthread_mutex_unlock(&r->lock);
    finish_list(canceled, KVP_ECANCELED, "the transfer was cancelled before it started");
}

void kvpi_runner_run(kvpi_run_fn run, void *peer, kvpi_runner_lane *lane, kvpi_xfer *x)
{
    x->next = NULL;
    x->peer = peer;
    x->run = run;
    x->lane = lane;
    finish(x, run_fn(x));
}

void kvpi_runner_post(kvpi_runner *r, kvpi_run_fn run, void *peer, kvpi_runner_lane *lane,
                      kvpi_xfer *x)
{
    if (!r) {
        kvpi_runner_run(run, peer, lane, x);
        return;
    }
    x->next = NULL;
    x->peer = peer;
    x->run = run;
    x->lane = lane;
    pthread_mutex_lock(&r->lock);
    if (r->stopping) {
        pthread_mutex_unlock(&r->lock);
        finish(x, kvpi_error(KVP_ECLOSED, "the engine is shutting down"));
        return;
    }
    /* Each xfer that can run now gets a thread of its own, an idle one no
     * other such xfer claimed or a new one; one behind its lane's limit is
     * taken by the thread that ends one of the lane's. So threads stay about
     * the lanes' limits summed over the peers with work, and a thread taken
     * by a stalled peer's backlog never leaves another peer's xfer
     * waiting. */
    int runnable = lane->running + lane->queued < lane->limit;
    int wake = runnable && r->idle > r->wakes;
    if (runnable && !wake && r->started < KVPI_RUNNER_THREADS_MAX) {
        if (pthread_create(&r->threads[r->started], NULL, runner_main, r) == 0)
            r->started++;
        else
            KVPI_WARN("runner: cannot start a thread: %s", strerror(errno));
    }
    if (r->started == 0) { /* no thread: this one */
        pthread_mutex_unlock(&r->lock);
        finish(x, run_fn(x));
        return;
    }
    *r->tail = x;
    r->tail = &x->next;
    lane->queued++;
    if (wake) {
        r->wakes++;
        pthread_cond_signal(&r->cond);
    }
    pthread_mutex_unlock(&r->lock);
}
