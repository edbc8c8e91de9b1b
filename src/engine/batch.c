/* The batch API, and the engine's one execution path: a request is cut into
 * slices of at most slice_size (kvpi_work); consecutive slices of a batch
 * that touch the same kinds of memory are grouped, up to the transport's
 * group_bytes, into an xfer posted to the peer's transport (transport.h);
 * the xfer's completion completes its slices. Every transport, blocking or
 * one-sided, goes this way.
 *
 * Who posts: the submitting thread, when the segment's peer is looked up
 * and its link open (posting never blocks); otherwise the engine's workers,
 * which look the segment up (metadata, peer_open) and then post. A
 * synchronous call (kvp_engine_read/write) posts on its own thread, runs the
 * last group there where the transport can (peer_run), and may block on the
 * lookup itself. Completions run on the transports' threads, or on a
 * waiter's: kvp_batch_wait drives the progress of the transports with
 * manual progress (ucx) its batch posted to (transport.h). What a
 * completion must not do (a lookup for a retry, closing a peer) goes to the
 * workers.
 *
 * Cancel: kvp_batch_cancel and kvp_batch_free set the cancel flag of every
 * xfer of the batch in flight; a connection-level failure does the same to
 * the batch's other xfers, which fail with it instead of each waiting out
 * its own deadline against a dead peer. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/sized.h"
#include "common/util.h"
#include "engine/engine_internal.h"
#include "gpu/cuda.h"

typedef struct kvpi_work {
    kvp_batch *batch;
    size_t req;
    kvp_mem_kind local_kind; /* of the request's local memory */
    kvpi_slice slice;
    const kvpi_transport_ops *ops; /* that ran it, for the metrics */
} kvpi_work;

/* Works waiting for a worker: a lookup (or a link to open) comes first. */
struct kvpi_job {
    kvpi_job *next;
    int retried;
    size_t n;
    kvpi_work *works[];
};

/* One posted xfer. */
typedef struct group {
    kvpi_xfer x; /* first: the completion finds the group */
    kvp_engine *e;
    kvp_batch *b;
    kvpi_peer *peer; /* a reference, until the completion */
    int retried;
    struct group *prev, *next; /* the batch's groups in flight */
    kvpi_work **works;
    kvpi_pin *pins;
    kvpi_slice *slices[];
} group;

typedef struct req_state {
    kvp_status status; /* KVP_EINPROGRESS until its last slice completes */
    kvp_status first_error;
    size_t slices_left;
    size_t length;
} req_state;

struct kvp_batch {
    kvp_engine *e;
    kvpi_segment *seg;
    size_t n;
    req_state *reqs;
    kvpi_work *works;
    kvpi_work **order; /* &works[i], what dispatch takes */
    size_t n_works;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    size_t pending;     /* requests not completed */
    size_t outstanding; /* works not completed */
    group *groups;      /* in flight */
    atomic_int canceled;
    /* The first connection-level failure (the peer timed out, reset or
     * refused): the batch's other works fail with it. */
    kvp_status conn_error;
    char detail[256]; /* kvp_last_error() of the first failure, from its thread */
    /* What completing does (kvp_batch_opts): call on_complete, then queue
     * the batch on the engine's completion queue if reap is set. */
    kvp_batch_done_fn on_complete;
    void *user_data;
    int reap;
    /* On the completion queue (under e->cq.lock), and its place there. */
    int queued;
    kvp_batch *cq_prev, *cq_next;
    /* The slots (bits) of the transports with manual progress it posted
     * to, which its waiter drives; and the eventfd that waiter sleeps on
     * besides theirs (-1 until it first sleeps), told when the batch
     * finished. */
    unsigned progress;
    int wake_fd;
    /* The thread finishing it (complete): pending is 0 and outstanding 1
     * while it runs on_complete. */
    pthread_t finisher;
    kvp_status final;                    /* the first failed request's status, once completed */
    char instance[KVP_INSTANCE_LEN + 1]; /* "", or the only peer instance to run on */
    kvpi_engine_metrics *metrics;
    uint64_t submit_ns;
};

/* ---- the completion queue ---- */

kvp_status kvpi_cq_init(kvp_engine *e)
{
    pthread_mutex_init(&e->cq.lock, NULL);
    e->cq.fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->cq.fd < 0)
        return kvpi_error(KVP_EIO, "engine: cannot make the completion eventfd: %s",
                          strerror(errno));
    return KVP_OK;
}

void kvpi_cq_destroy(kvp_engine *e)
{
    if (e->cq.fd >= 0) close(e->cq.fd);
    e->cq.fd = -1;
    pthread_mutex_destroy(&e->cq.lock);
}

static void cq_signal(int fd, int readable)
{
    uint64_t v = 1;
    ssize_t r = readable ? write(fd, &v, sizeof v) : read(fd, &v, sizeof v);
    if (r < 0 && errno != EAGAIN) KVPI_WARN("engine: the completion eventfd: %s", strerror(errno));
}

/* Queue a completed batch; the fd turns readable with the first. */
static void cq_push(kvp_engine *e, kvp_batch *b)
{
    pthread_mutex_lock(&e->cq.lock);
    b->cq_next = NULL;
    b->cq_prev = e->cq.tail;
    if (e->cq.tail)
        e->cq.tail->cq_next = b;
    else
        e->cq.head = b;
    e->cq.tail = b;
    b->queued = 1;
    if (!b->cq_prev) cq_signal(e->cq.fd, 1);
    pthread_mutex_unlock(&e->cq.lock);
}

/* Take b off the queue; under e->cq.lock. The fd turns unreadable with the
 * last. */
static void cq_unlink(kvp_engine *e, kvp_batch *b)
{
    if (b->cq_prev)
        b->cq_prev->cq_next = b->cq_next;
    else
        e->cq.head = b->cq_next;
    if (b->cq_next)
        b->cq_next->cq_prev = b->cq_prev;
    else
        e->cq.tail = b->cq_prev;
    b->queued = 0;
    b->cq_prev = b->cq_next = NULL;
    if (!e->cq.head) cq_signal(e->cq.fd, 0);
}

int kvp_engine_completion_fd(const kvp_engine *e)
{
    return e ? e->cq.fd : -1;
}

size_t kvp_engine_reap(kvp_engine *e, kvp_completion *out, size_t cap)
{
    if (!e || !out) return 0;
    size_t n = 0;
    pthread_mutex_lock(&e->cq.lock);
    while (n < cap && e->cq.head) {
        kvp_batch *b = e->cq.head;
        out[n++] = (kvp_completion){.batch = b, .user_data = b->user_data, .status = b->final};
        cq_unlink(e, b);
    }
    pthread_mutex_unlock(&e->cq.lock);
    return n;
}

/* Every request of b completed (nothing runs any more): call its callback,
 * queue it. The caller holds no lock of b's; b->outstanding is still 1 (or
 * the batch has no works), so a kvp_batch_free waits for this. */
static void finish(kvp_batch *b)
{
    b->final = KVP_OK;
    for (size_t i = 0; i < b->n && !b->final; i++)
        b->final = b->reqs[i].status;
    if (b->on_complete) b->on_complete(b, b->user_data);
    if (b->reap) cq_push(b->e, b);
}

/* Cancel every xfer of the batch in flight; the caller holds b->lock. */
static void cancel_groups(kvp_batch *b)
{
    for (group *g = b->groups; g; g = g->next)
        atomic_store(&g->x.canceled, 1);
}

/* done_ns: when the work's transfer finished (the clock read once for a
 * group), for the latency of a request that succeeds; 0 for a failure. The
 * last work completed may free the batch: the caller touches neither after. */
static void complete(kvpi_work *w, kvp_status st, uint64_t done_ns)
{
    kvp_batch *b = w->batch;
    pthread_mutex_lock(&b->lock);
    /* A slice cancelled because the peer failed fails as the peer did. */
    if (st == KVP_ECANCELED && b->conn_error) st = b->conn_error;
    req_state *r = &b->reqs[w->req];
    if (st != KVP_OK && r->first_error == KVP_OK) r->first_error = st;
    if (st == KVP_ECORRUPT) kvpi_metrics_corrupt(b->seg, w->ops);
    if (st != KVP_OK && !b->detail[0])
        snprintf(b->detail, sizeof b->detail, "%s",
                 *kvp_last_error() ? kvp_last_error() : kvp_strerror(st));
    if (kvpi_connection_level(st) && b->conn_error == KVP_OK) {
        b->conn_error = st;
        cancel_groups(b);
    }
    int done = --r->slices_left == 0;
    if (done) {
        r->status = r->first_error;
        b->pending--;
    }
    /* Counted before a waiter can see the request done. */
    if (done)
        kvpi_metrics_request_done(b->metrics, w->slice.opcode, r->length, w->ops, r->status,
                                  done_ns - b->submit_ns);
    /* Both waiters (kvp_batch_wait, kvp_batch_free) wait for the last
     * work: waking them at every slice cost a wake-up per group. The last
     * work is the last request's (pending is 0 now); the batch finishes
     * first, outside the lock (its callback may read it), and only then
     * may a waiter free it. */
    if (b->outstanding > 1) {
        b->outstanding--;
        pthread_mutex_unlock(&b->lock);
        return;
    }
    b->finisher = pthread_self(); /* kvp_batch_wait waits for finish, but on it */
    pthread_mutex_unlock(&b->lock);
    finish(b);
    pthread_mutex_lock(&b->lock);
    b->outstanding = 0;
    pthread_cond_broadcast(&b->cond);
    uint64_t one = 1;
    if (b->wake_fd >= 0 && write(b->wake_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVPI_WARN("batch: cannot wake its waiter: %s", strerror(errno));
    pthread_mutex_unlock(&b->lock);
}

static void complete_all(kvpi_work **w, size_t n, kvp_status st)
{
    for (size_t i = 0; i < n; i++)
        complete(w[i], st, 0);
}

/* ---- the workers ---- */

static void enqueue(kvp_engine *e, kvpi_job *job)
{
    kvpi_queue *q = &e->queue;
    pthread_mutex_lock(&q->lock);
    job->next = NULL;
    *q->tail = job;
    q->tail = &job->next;
    pthread_cond_signal(&q->cond);
    pthread_mutex_unlock(&q->lock);
}

/* Hand n works to the workers. */
static void defer(kvp_engine *e, kvpi_work **w, size_t n, int retried)
{
    kvpi_job *job = malloc(sizeof *job + n * sizeof job->works[0]);
    if (!job) {
        complete_all(w, n, kvpi_error(KVP_ENOMEM, "engine: out of memory"));
        return;
    }
    job->retried = retried;
    job->n = n;
    memcpy(job->works, w, n * sizeof *w);
    enqueue(e, job);
}

void kvpi_workers_close(kvp_engine *e, kvpi_peer *peer)
{
    kvpi_queue *q = &e->queue;
    pthread_mutex_lock(&q->lock);
    peer->next_closing = q->closing;
    q->closing = peer;
    pthread_cond_signal(&q->cond);
    pthread_mutex_unlock(&q->lock);
}

static void dispatch(kvp_engine *e, kvpi_work **w, size_t m, int retried, int blocking,
                     int run_last);

static void *worker_main(void *arg)
{
    kvp_engine *e = arg;
    kvpi_queue *q = &e->queue;
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (!q->head && !q->closing && !q->stopping)
            pthread_cond_wait(&q->cond, &q->lock);
        if (q->closing) {
            kvpi_peer *peer = q->closing;
            q->closing = peer->next_closing;
            pthread_mutex_unlock(&q->lock);
            kvpi_peer_free(peer);
        } else if (q->head) {
            kvpi_job *job = q->head;
            if (!(q->head = job->next)) q->tail = &q->head;
            pthread_mutex_unlock(&q->lock);
            dispatch(e, job->works, job->n, job->retried, 1, 0);
            free(job);
        } else {
            break; /* stopping, nothing left */
        }
        pthread_mutex_lock(&q->lock);
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

kvp_status kvpi_workers_start(kvp_engine *e)
{
    pthread_mutex_init(&e->queue.lock, NULL);
    kvpi_cond_init(&e->queue.cond);
    e->queue.tail = &e->queue.head;
    e->workers = calloc((size_t)e->opts.workers, sizeof *e->workers);
    if (!e->workers) return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    for (int i = 0; i < e->opts.workers; i++) {
        if (pthread_create(&e->workers[i], NULL, worker_main, e) != 0)
            return kvpi_error(KVP_EIO, "engine: cannot start a worker: %s", strerror(errno));
        e->n_workers++;
    }
    return KVP_OK;
}

void kvpi_workers_stop(kvp_engine *e)
{
    if (!e->workers) return;
    kvpi_queue *q = &e->queue;
    /* No new xfer from now on (see post_group); wait for those in flight,
     * whose completions may still hand the workers peers to close. */
    atomic_store(&q->draining, 1);
    pthread_mutex_lock(&q->lock);
    while (atomic_load(&q->inflight) > 0)
        pthread_cond_wait(&q->cond, &q->lock);
    q->stopping = 1;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
    for (int i = 0; i < e->n_workers; i++)
        pthread_join(e->workers[i], NULL);
    free(e->workers);
    e->workers = NULL;
    pthread_mutex_destroy(&q->lock);
    pthread_cond_destroy(&q->cond);
}

/* ---- posting ---- */

/* For a transport that wants local memory registered with it: pin the
 * local region of each slice and hand the slice its handle (NULL where the
 * memory is not registered). pins[i] is NULL where nothing was pinned. */
static void local_handles(kvp_engine *e, const kvpi_link *l, kvpi_slice **slices, size_t n,
                          kvpi_pin *pins)
{
    for (size_t i = 0; i < n; i++) {
        pins[i] = NULL;
        slices[i]->local_handle = NULL;
        if (!(l->ops->caps & KVPI_CAP_NEEDS_LOCAL_REG)) continue;
        if (kvpi_region_pin(&e->regions, (uint64_t)(uintptr_t)slices[i]->local, slices[i]->length,
                            l->ops->mem_kinds, &pins[i]) == KVP_OK)
            slices[i]->local_handle = kvpi_pin_region(pins[i])->handle[l->slot];
        else
            pins[i] = NULL;
    }
}

static void inflight_done(kvp_engine *e)
{
    kvpi_queue *q = &e->queue;
    if (atomic_fetch_sub(&q->inflight, 1) != 1 || !atomic_load(&q->draining)) return;
    pthread_mutex_lock(&q->lock);
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
}

/* The completion of a group: every slice completes, but for one the peer
 * refused as outside its buffers although our descriptor lists the range.
 * That means the peer re-registered meanwhile (a pool chunk given back and
 * mapped again at the same address, whose old rkey a one-sided transport
 * still holds): such slices run once more against a fresh lookup, and fail
 * with the peer's answer only then. */
static void group_done(kvpi_xfer *x, kvp_status st)
{
    group *g = (group *)x;
    kvp_engine *e = g->e;
    kvp_batch *b = g->b;
    kvpi_segment *seg = b->seg;
    uint64_t done_ns = kvpi_now_ns();
    for (size_t i = 0; i < x->n; i++)
        if (g->pins[i]) kvpi_region_unpin(&e->regions, g->pins[i]);
    pthread_mutex_lock(&b->lock);
    KVPI_LIST_UNLINK(b->groups, g);
    pthread_mutex_unlock(&b->lock);
    int failed = st != KVP_OK && st != KVP_ECANCELED;
    if (failed) kvpi_segment_note(seg, st);
    /* The statuses, read before any work is handed on: once the stale ones
     * are deferred, a worker may retry and complete them, and the batch's
     * last completion frees it, slices included. */
    kvp_status sts[KVPI_XFER_MAX];
    kvpi_work *stale[KVPI_XFER_MAX];
    size_t n_stale = 0;
    for (size_t i = 0; i < x->n; i++) {
        sts[i] = x->slices[i]->status;
        if (!g->retried && sts[i] == KVP_ERANGE) stale[n_stale++] = g->works[i];
    }
    /* Any failure the transport reports (a refused slice included) drops
     * the peer, to look it up again - before a retry looks it up. */
    kvpi_segment_release_later(e, seg, g->peer, failed || n_stale > 0);
    if (n_stale > 0) {
        kvpi_counter_add(&e->metrics.retries, n_stale);
        defer(e, stale, n_stale, 1);
    }
    for (size_t i = 0; i < x->n; i++) {
        kvp_status s = sts[i];
        if (!g->retried && s == KVP_ERANGE) continue;
        complete(g->works[i], s == KVP_EINPROGRESS ? (st ? st : KVP_EIO) : s, done_ns);
    }
    free(g);
    inflight_done(e);
}

static void post_group(kvp_engine *e, kvpi_peer *peer, kvpi_link *link, kvpi_work **w, size_t n,
                       int retried, int run_here)
{
    kvp_batch *b = w[0]->batch;
    kvpi_queue *q = &e->queue;
    atomic_fetch_add(&q->inflight, 1);
    if (atomic_load(&q->draining)) {
        complete_all(w, n, kvpi_error(KVP_ECLOSED, "the engine is shutting down"));
        inflight_done(e);
        return;
    }
    group *g = malloc(sizeof *g + n * (sizeof g->slices[0] + sizeof *g->works + sizeof *g->pins));
    if (!g) {
        complete_all(w, n, kvpi_error(KVP_ENOMEM, "engine: out of memory"));
        inflight_done(e);
        return;
    }
    *g = (group){.x = {.slices = g->slices, .n = n, .done = group_done},
                 .e = e,
                 .b = b,
                 .peer = peer,
                 .retried = retried};
    g->works = (kvpi_work **)(g->slices + n);
    g->pins = (kvpi_pin *)(g->works + n);
    for (size_t i = 0; i < n; i++) {
        g->works[i] = w[i];
        g->slices[i] = &w[i]->slice;
        w[i]->ops = link->ops;
    }
    local_handles(e, link, g->slices, n, g->pins);
    atomic_fetch_add(&peer->refs, 1);
    pthread_mutex_lock(&b->lock);
    g->next = b->groups;
    if (b->groups) b->groups->prev = g;
    b->groups = g;
    if (atomic_load(&b->canceled) || b->conn_error) atomic_store(&g->x.canceled, 1);
    unsigned bit = 1u << link->slot;
    if (link->ops->server_progress && !(b->progress & bit)) {
        b->progress |= bit;
        pthread_cond_broadcast(&b->cond); /* a waiter on the condition drives it now */
    }
    pthread_mutex_unlock(&b->lock);
    if (run_here && link->ops->peer_run)
        link->ops->peer_run(link->handle, &g->x);
    else
        link->ops->peer_post(link->handle, &g->x);
}

static int all_inside(const kvpi_peer *peer, kvpi_work **w, size_t m)
{
    for (size_t i = 0; i < m; i++)
        if (!kvpi_regions_contain(peer->desc.regions, peer->desc.n_regions, w[i]->slice.remote,
                                  w[i]->slice.length))
            return 0;
    return 1;
}

/* A referenced peer whose descriptor covers the works, if any does: a range
 * outside the cached descriptor may mean the peer re-registered or
 * restarted, so look it up once more before calling the range bad. Without
 * blocking, KVP_EBUSY where that needs a lookup. */
static kvp_status acquire_for(kvp_engine *e, kvpi_segment *seg, kvpi_work **w, size_t m,
                              int blocking, kvpi_peer **out)
{
    kvp_status st =
        blocking ? kvpi_segment_acquire(e, seg, out) : kvpi_segment_try_acquire(seg, out);
    if (st || all_inside(*out, w, m)) return st;
    kvpi_segment_release(seg, *out, 1);
    return blocking ? kvpi_segment_acquire(e, seg, out) : KVP_EBUSY;
}

/* The batch runs only against its instance, if it names one
 * (kvp_batch_opts.instance). */
static kvp_status check_instance(const kvp_batch *b, const kvpi_peer *peer)
{
    if (!b->instance[0]) return KVP_OK;
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(peer->desc.json, KVPI_INSTANCE_FIELD);
    if (cJSON_IsString(id) && strcmp(id->valuestring, b->instance) == 0) return KVP_OK;
    return kvpi_error(KVP_ECONNRESET,
                      "segment %s: the addresses come from its instance %s, and it is %s now "
                      "(the process restarted): not transferred",
                      b->seg->name, b->instance, cJSON_IsString(id) ? id->valuestring : "another");
}

/* Why a work need not run: its batch was cancelled or freed, or it lost the
 * peer. KVP_OK to run it. */
static kvp_status skip_reason(kvpi_work *w)
{
    kvp_batch *b = w->batch;
    if (atomic_load(&b->canceled)) return kvpi_error(KVP_ECANCELED, "the batch was cancelled");
    pthread_mutex_lock(&b->lock);
    kvp_status st = b->conn_error;
    pthread_mutex_unlock(&b->lock);
    return st;
}

/* The kinds of memory a checked slice touches: its local and its remote. */
static unsigned kinds_of(const kvpi_peer *peer, const kvpi_work *w)
{
    return KVPI_MEM_BIT(w->local_kind) |
           KVPI_MEM_BIT(peer->desc.regions[w->slice.remote_region].kind);
}

/* Post m works of one batch (in order) to its segment's peer. Without
 * blocking, what needs a lookup or a link opened goes to the workers.
 * run_last: the caller waits for the batch, so the last group runs on its
 * thread where the transport can (peer_run). Nothing of the batch is
 * touched after the last post. */
static void dispatch(kvp_engine *e, kvpi_work **w, size_t m, int retried, int blocking,
                     int run_last)
{
    if (m == 0) return;
    kvpi_segment *seg = w[0]->batch->seg;
    /* The batch stays alive while any of these works is not completed: skip
     * and check in one pass, then post, completing nothing after the last
     * post. */
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        kvp_status skip = skip_reason(w[i]);
        if (skip) {
            complete(w[i], skip, 0);
            continue;
        }
        w[k++] = w[i];
    }
    if (k == 0) return;
    kvpi_peer *peer;
    kvp_status st = acquire_for(e, seg, w, k, blocking, &peer);
    if (st == KVP_EBUSY && !blocking) {
        defer(e, w, k, retried);
        return;
    }
    if (!st && (st = check_instance(w[0]->batch, peer))) kvpi_segment_release(seg, peer, 0);
    if (st) {
        complete_all(w, k, st);
        return;
    }
    /* Check against the peer's published buffers before sending anything;
     * the peer checks again, since its descriptor may have changed since -
     * except a one-sided (KVPI_CAP_RDMA) transport's, whose target checks
     * nothing: for it this is the only check. */
    size_t live = 0;
    for (size_t i = 0; i < k; i++) {
        kvpi_slice *s = &w[i]->slice;
        long r = kvpi_regions_find(peer->desc.regions, peer->desc.n_regions, s->remote, s->length);
        if (r < 0) {
            kvpi_error(KVP_ERANGE, "segment %s: [0x%llx, +%zu) is outside its registered buffers%s",
                       seg->name, (unsigned long long)s->remote, s->length,
                       retried ? " (it deregistered them meanwhile)" : "");
            complete(w[i], KVP_ERANGE, 0);
            continue;
        }
        s->remote_region = (size_t)r;
        s->status = KVP_EINPROGRESS;
        w[live++] = w[i];
    }
    for (size_t i = 0; i < live;) {
        unsigned kinds = kinds_of(peer, w[i]);
        kvpi_link *link = NULL;
        st = kvpi_peer_select(e, peer, kinds, blocking, &link);
        if (st == KVP_EBUSY) {
            defer(e, w + i, live - i, retried);
            break;
        }
        size_t limit =
            link && link->ops->group_bytes ? link->ops->group_bytes : KVPI_GROUP_BYTES_DEFAULT;
        size_t j = i + 1, bytes = w[i]->slice.length;
        while (j < live && j - i < KVPI_XFER_MAX && w[j]->slice.opcode == w[i]->slice.opcode &&
               kinds_of(peer, w[j]) == kinds && bytes + w[j]->slice.length <= limit)
            bytes += w[j++]->slice.length;
        if (st)
            complete_all(w + i, j - i, st);
        else
            post_group(e, peer, link, w + i, j - i, retried, run_last && j == live);
        i = j;
    }
    kvpi_segment_release(seg, peer, 0);
}

/* ---- the batch API ---- */

static size_t slices_of(const kvp_request *r, size_t slice_size)
{
    return r->length == 0 ? 0 : (r->length - 1) / slice_size + 1;
}

static kvp_status check_requests(const kvp_request *reqs, size_t n, size_t slice_size,
                                 size_t *works)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const kvp_request *r = &reqs[i];
        if (r->opcode != KVP_OP_READ && r->opcode != KVP_OP_WRITE)
            return kvpi_error(KVP_EINVAL, "request %zu: unknown opcode %d", i, (int)r->opcode);
        if (r->length && !r->local)
            return kvpi_error(KVP_EINVAL, "request %zu: NULL local buffer", i);
        if (r->length > UINT64_MAX - r->remote)
            return kvpi_error(KVP_ERANGE, "request %zu: remote range wraps around", i);
        total += slices_of(r, slice_size);
    }
    *works = total;
    return KVP_OK;
}

/* The kind of a request's local memory: its registered region's (no driver
 * call: classified once, at registration). Memory no region holds is host
 * memory, unless this process loaded the CUDA driver: then one driver call
 * per request says (a slice of device memory the CPU touched would crash). */
static kvp_mem_kind local_kind(kvp_engine *e, const kvp_request *r, int *device)
{
    uint64_t addr = (uint64_t)(uintptr_t)r->local;
    if (!kvpi_cuda_active()) return kvpi_region_kind_at(&e->regions, addr, r->length, device);
    kvp_mem_kind kind;
    if (kvpi_region_kind_find(&e->regions, addr, r->length, &kind, device) || !r->length)
        return kind;
    kvpi_ptr_kind pk;
    if (kvpi_cuda_classify(r->local, &pk, device) == KVP_OK &&
        (pk == KVPI_PTR_DEVICE || pk == KVPI_PTR_MANAGED))
        return KVP_MEM_CUDA;
    *device = 0;
    return KVP_MEM_HOST;
}

/* Returns the bytes of the requests. */
static uint64_t build_works(kvp_engine *e, kvp_batch *b, const kvp_request *reqs, size_t slice_size)
{
    size_t w = 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < b->n; i++) {
        const kvp_request *r = &reqs[i];
        size_t count = slices_of(r, slice_size);
        int device;
        kvp_mem_kind kind = local_kind(e, r, &device);
        b->reqs[i] = (req_state){count ? KVP_EINPROGRESS : KVP_OK, KVP_OK, count, r->length};
        if (count) b->pending++;
        bytes += r->length;
        for (size_t off = 0; off < r->length; off += slice_size) {
            kvpi_work *work = &b->works[w];
            b->order[w] = work;
            work->batch = b;
            work->req = i;
            work->local_kind = kind;
            size_t len = r->length - off < slice_size ? r->length - off : slice_size;
            work->slice = (kvpi_slice){.opcode = r->opcode,
                                       .local = (char *)r->local + off,
                                       .remote = r->remote + off,
                                       .length = len,
                                       .status = KVP_EINPROGRESS,
                                       .local_kind = kind,
                                       .local_device = device};
            w++;
        }
    }
    return bytes;
}

static kvp_batch_opts default_batch_opts(void)
{
    return (kvp_batch_opts){0};
}

void kvp_batch_opts_init_size(kvp_batch_opts *opts, size_t size)
{
    kvp_batch_opts d = default_batch_opts();
    if (opts) kvpi_sized_out(opts, size, &d, sizeof d);
}

/* sync: the caller waits for the batch at once (see dispatch). */
static kvp_status submit(kvp_engine *e, kvp_segment_id seg_id, const kvp_request *reqs, size_t n,
                         const kvp_batch_opts *o, int sync, kvp_batch **out)
{
    if (!e || !out || (n && !reqs)) return kvpi_error(KVP_EINVAL, "batch_submit: NULL argument");
    if (o->instance && strlen(o->instance) > KVP_INSTANCE_LEN)
        return kvpi_error(KVP_EINVAL, "batch_submit: instance id longer than %d characters",
                          KVP_INSTANCE_LEN);
    kvpi_segment *seg = kvpi_segment_get(e, seg_id);
    if (!seg) return kvpi_error(KVP_EINVAL, "batch_submit: segment id %u is not open", seg_id);
    size_t n_works = 0;
    kvp_status st = check_requests(reqs, n, e->opts.slice_size, &n_works);
    if (st) return st;
    kvp_batch *b = calloc(1, sizeof *b);
    if (!b) return kvpi_error(KVP_ENOMEM, "batch_submit: out of memory");
    b->reqs = calloc(n ? n : 1, sizeof *b->reqs);
    b->works = calloc(n_works ? n_works : 1, sizeof *b->works);
    b->order = calloc(n_works ? n_works : 1, sizeof *b->order);
    if (!b->reqs || !b->works || !b->order) {
        free(b->reqs);
        free(b->works);
        free(b->order);
        free(b);
        return kvpi_error(KVP_ENOMEM, "batch_submit: out of memory");
    }
    pthread_mutex_init(&b->lock, NULL);
    kvpi_cond_init(&b->cond);
    b->e = e;
    b->seg = seg;
    b->n = n;
    b->n_works = b->outstanding = n_works;
    b->on_complete = o->on_complete;
    b->user_data = o->user_data;
    b->reap = o->reap;
    if (o->instance) strcpy(b->instance, o->instance);
    b->wake_fd = -1;
    b->metrics = &e->metrics;
    b->submit_ns = kvpi_now_ns();
    uint64_t bytes = build_works(e, b, reqs, e->opts.slice_size);
    kvpi_metrics_submitted(&e->metrics, b->pending, bytes);
    *out = b;
    /* Nothing to run (no request, or none with bytes): complete now. */
    if (n_works == 0) finish(b);
    /* b may complete (and be freed by a waiter on another thread) once the
     * last group is posted: out is set first. */
    dispatch(e, b->order, n_works, 0, sync, sync);
    return KVP_OK;
}

kvp_status kvp_batch_submit(kvp_engine *e, kvp_segment_id seg_id, const kvp_request *reqs, size_t n,
                            kvp_batch **out)
{
    kvp_batch_opts o = default_batch_opts();
    return submit(e, seg_id, reqs, n, &o, 0, out);
}

kvp_status kvp_batch_submit_with_size(kvp_engine *e, kvp_segment_id seg_id, const kvp_request *reqs,
                                      size_t n, const kvp_batch_opts *opts, size_t size,
                                      kvp_batch **out)
{
    kvp_batch_opts o = default_batch_opts();
    kvp_status st;
    if (opts && (st = kvpi_sized_in(&o, sizeof o, opts, size, "kvp_batch_opts"))) return st;
    return submit(e, seg_id, reqs, n, &o, 0, out);
}

kvp_status kvp_batch_request_status(const kvp_batch *b, size_t i)
{
    if (!b || i >= b->n) return KVP_EINVAL;
    pthread_mutex_lock((pthread_mutex_t *)&b->lock);
    kvp_status st = b->reqs[i].status;
    pthread_mutex_unlock((pthread_mutex_t *)&b->lock);
    return st;
}

size_t kvp_batch_pending(const kvp_batch *b)
{
    if (!b) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&b->lock);
    size_t n = b->pending;
    pthread_mutex_unlock((pthread_mutex_t *)&b->lock);
    return n;
}

/* Progress calls of a transport per round of a waiter (transport.h). */
#define PROGRESS_BUDGET 16

/* A round of the waiter of b on the transports with manual progress it
 * posted to: progress them; when none had anything, sleep in poll() on
 * their wait descriptors and the batch's wake-up until one is ready, the
 * batch completed or deadline_ns passed (0: none). Called and returns with
 * b->lock held; b->wake_fd is open. */
static void drive(kvp_batch *b, uint64_t deadline_ns)
{
    kvp_engine *e = b->e;
    unsigned slots = b->progress;
    int wake_fd = b->wake_fd;
    pthread_mutex_unlock(&b->lock);
    unsigned did = 0;
    for (size_t i = 0; slots >> i; i++)
        if (slots >> i & 1)
            did += e->transports[i]->server_progress(e->servers[i], PROGRESS_BUDGET);
    struct pollfd fds[KVPI_MAX_TRANSPORTS + 1];
    nfds_t n = 0;
    for (size_t i = 0; !did && slots >> i; i++) {
        int fd =
            slots >> i & 1 ? e->transports[i]->server_wait_fd(e->servers[i]) : KVPI_WAIT_FD_NONE;
        did = fd == -1; /* it has something already */
        if (fd >= 0) fds[n++].fd = fd;
    }
    int ms = did ? 0 : kvpi_remaining_ms(deadline_ns);
    if (ms != 0) {
        fds[n++].fd = wake_fd;
        for (nfds_t k = 0; k < n; k++)
            fds[k].events = POLLIN;
        int rc = poll(fds, n, ms);
        uint64_t v;
        if (rc > 0 && fds[n - 1].revents && read(wake_fd, &v, sizeof v) < 0 && errno != EAGAIN)
            KVPI_WARN("batch: cannot read its wake-up: %s", strerror(errno));
    }
    pthread_mutex_lock(&b->lock);
}

kvp_status kvp_batch_wait(kvp_batch *b, int timeout_ms)
{
    if (!b) return kvpi_error(KVP_EINVAL, "batch_wait: NULL batch");
    struct timespec dl = kvpi_deadline_after_ms(timeout_ms < 0 ? 0 : timeout_ms);
    uint64_t deadline_ns = timeout_ms < 0 ? 0 : kvpi_deadline_ns(timeout_ms);
    int timed_out = 0;
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&b->lock);
    while (b->pending > 0 && !timed_out) {
        /* Where its transports need driving, this thread drives them (the
         * transports' own threads do without an eventfd to wake it). */
        if (b->progress &&
            (b->wake_fd >= 0 || (b->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) >= 0)) {
            drive(b, deadline_ns);
            timed_out = deadline_ns && kvpi_now_ns() >= deadline_ns;
        } else if (timeout_ms < 0) {
            pthread_cond_wait(&b->cond, &b->lock);
        } else {
            timed_out = pthread_cond_timedwait(&b->cond, &b->lock, &dl) == ETIMEDOUT;
        }
    }
    /* Every request completed, and the thread of the last one may still be
     * in on_complete (pending is 0 before it runs): wait for it to return
     * (engine.h), unless this is the callback's own kvp_batch_wait. The
     * callback does not block, so this wait is short. */
    while (b->pending == 0 && b->outstanding > 0 && !pthread_equal(b->finisher, pthread_self()))
        pthread_cond_wait(&b->cond, &b->lock);
    if (b->pending > 0) {
        st = kvpi_error(KVP_ETIMEDOUT, "batch: %zu of %zu requests still running after %d ms",
                        b->pending, b->n, timeout_ms);
        goto out;
    }
    for (size_t i = 0; i < b->n; i++)
        if (b->reqs[i].status != KVP_OK) {
            st = kvpi_error(b->reqs[i].status, "request %zu failed: %s", i, b->detail);
            break;
        }
out:
    pthread_mutex_unlock(&b->lock);
    return st;
}

void kvp_batch_cancel(kvp_batch *b)
{
    if (!b) return;
    atomic_store(&b->canceled, 1);
    pthread_mutex_lock(&b->lock);
    cancel_groups(b);
    pthread_mutex_unlock(&b->lock);
    /* What a transport holds unstarted completes now, not when one of its
     * threads (maybe all stuck on a stalled peer) comes free. */
    kvp_engine *e = b->e;
    for (size_t i = 0; e->transports[i]; i++)
        if (e->servers[i] && e->transports[i]->server_cancel)
            e->transports[i]->server_cancel(e->servers[i]);
}

void kvp_batch_free(kvp_batch *b)
{
    if (!b) return;
    kvp_batch_cancel(b);
    pthread_mutex_lock(&b->lock);
    while (b->outstanding > 0)
        pthread_cond_wait(&b->cond, &b->lock);
    pthread_mutex_unlock(&b->lock);
    if (b->reap) {
        kvp_engine *e = b->e;
        pthread_mutex_lock(&e->cq.lock);
        if (b->queued) cq_unlink(e, b);
        pthread_mutex_unlock(&e->cq.lock);
    }
    pthread_mutex_destroy(&b->lock);
    pthread_cond_destroy(&b->cond);
    if (b->wake_fd >= 0) close(b->wake_fd);
    free(b->reqs);
    free(b->works);
    free(b->order);
    free(b);
}

/* A synchronous transfer posts on the calling thread and runs its last
 * group there where the transport can (peer_run: tcp and shm do the I/O on
 * this thread; ucx issues it, and this thread drives UCX's progress while
 * it waits), so a one-slice request runs without a thread wake-up; a larger
 * one spreads its other groups over the transport's threads. */
static kvp_status transfer_sync(kvp_engine *e, kvp_segment_id seg, kvp_opcode op, void *local,
                                uint64_t remote, size_t length)
{
    kvp_request req = {op, local, remote, length};
    kvp_batch *b;
    kvp_batch_opts o = default_batch_opts();
    kvp_status st = submit(e, seg, &req, 1, &o, 1, &b);
    if (st) return st;
    st = kvp_batch_wait(b, -1);
    kvp_batch_free(b);
    return st;
}

kvp_status kvp_engine_read(kvp_engine *e, kvp_segment_id seg, void *local, uint64_t remote,
                           size_t length)
{
    return transfer_sync(e, seg, KVP_OP_READ, local, remote, length);
}

kvp_status kvp_engine_write(kvp_engine *e, kvp_segment_id seg, const void *local, uint64_t remote,
                            size_t length)
{
    return transfer_sync(e, seg, KVP_OP_WRITE, (void *)local, remote, length);
}
