#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "transport/runner.h"

struct kvpi_runner {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    kvpi_xfer *head, **tail;
    int stopping;
    int want, started; /* threads to start at the first queued xfer, started */
    pthread_t *threads;
};

/* Every slice not yet answered gets st; then the completion. */
static void finish(kvpi_xfer *x, kvp_status st)
{
    for (size_t i = 0; i < x->n; i++)
        if (x->slices[i]->status == KVP_EINPROGRESS) x->slices[i]->status = st;
    x->done(x, st);
}

static void run_one(kvpi_run_fn run, void *peer, kvpi_xfer *x)
{
    if (atomic_load(&x->canceled)) {
        finish(x, kvpi_error(KVP_ECANCELED, "the transfer was cancelled before it started"));
        return;
    }
    kvp_status st = run(peer, x->slices, x->n);
    /* A transport's function sets every slice; one it left unset failed
     * with the call. */
    finish(x, st ? st : KVP_OK);
}

static void *runner_main(void *arg)
{
    kvpi_runner *r = arg;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        while (!r->head && !r->stopping) pthread_cond_wait(&r->cond, &r->lock);
        kvpi_xfer *x = r->head;
        if (!x) break; /* stopping, nothing left */
        if (!(r->head = x->next)) r->tail = &r->head;
        int stopping = r->stopping;
        pthread_mutex_unlock(&r->lock);
        if (stopping)
            finish(x, kvpi_error(KVP_ECLOSED, "the engine is shutting down"));
        else
            run_one(x->run, x->peer, x);
        pthread_mutex_lock(&r->lock);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

kvp_status kvpi_runner_create(int threads, kvpi_runner **out)
{
    kvpi_runner *r = calloc(1, sizeof *r);
    if (!r) return kvpi_error(KVP_ENOMEM, "runner: out of memory");
    r->want = threads > 0 ? threads : KVPI_RUNNER_THREADS_DEFAULT;
    if (!(r->threads = calloc((size_t)r->want, sizeof *r->threads))) {
        free(r);
        return kvpi_error(KVP_ENOMEM, "runner: out of memory");
    }
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
    for (int i = 0; i < r->started; i++) pthread_join(r->threads[i], NULL);
    /* Without a thread, nothing was ever queued. */
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->cond);
    free(r->threads);
    free(r);
}

void kvpi_runner_cancel(kvpi_runner *r)
{
    if (!r) return;
    kvpi_xfer *canceled = NULL, **last = &canceled;
    pthread_mutex_lock(&r->lock);
    for (kvpi_xfer **pp = &r->head; *pp;) {
        kvpi_xfer *x = *pp;
        if (!atomic_load(&x->canceled)) {
            pp = &x->next;
            continue;
        }
        *pp = x->next;
        *last = x;
        last = &x->next;
    }
    *last = NULL;
    r->tail = &r->head;
    while (*r->tail) r->tail = &(*r->tail)->next;
    pthread_mutex_unlock(&r->lock);
    while (canceled) {
        kvpi_xfer *x = canceled;
        canceled = x->next; /* before done: x may be freed there */
        finish(x, kvpi_error(KVP_ECANCELED, "the transfer was cancelled before it started"));
    }
}

void kvpi_runner_post(kvpi_runner *r, kvpi_run_fn run, void *peer, kvpi_xfer *x, unsigned flags)
{
    if (!r || (flags & KVPI_POST_INLINE)) {
        run_one(run, peer, x);
        return;
    }
    x->next = NULL;
    x->peer = peer;
    x->run = run;
    pthread_mutex_lock(&r->lock);
    if (r->stopping) {
        pthread_mutex_unlock(&r->lock);
        finish(x, kvpi_error(KVP_ECLOSED, "the engine is shutting down"));
        return;
    }
    while (r->started < r->want) {
        if (pthread_create(&r->threads[r->started], NULL, runner_main, r) != 0) {
            KVPI_WARN("runner: cannot start a thread: %s", strerror(errno));
            break;
        }
        r->started++;
    }
    if (r->started == 0) {
        pthread_mutex_unlock(&r->lock);
        run_one(run, peer, x); /* no thread: this one */
        return;
    }
    *r->tail = x;
    r->tail = &x->next;
    pthread_cond_signal(&r->cond);
    pthread_mutex_unlock(&r->lock);
}
