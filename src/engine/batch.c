#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "engine/engine_ext.h"
#include "engine/engine_internal.h"

/* Consecutive small slices to one segment are handed to a transport together,
 * so that it can pipeline them on one connection. */
#define GROUP_MAX 64

struct kvpi_work {
    kvpi_work *next;
    kvp_batch *batch;
    size_t req;
    kvp_mem_kind local_kind; /* of the request's local memory */
    kvpi_slice slice;
    const kvpi_transport_ops *ops; /* that ran it, for the metrics */
};

typedef struct req_state {
    kvp_status status; /* KVP_EINPROGRESS until its last slice completes */
    kvp_status first_error;
    size_t slices_left;
    size_t length;
} req_state;

struct kvp_batch {
    kvpi_segment *seg;
    size_t n;
    req_state *reqs;
    kvpi_work *works;
    size_t n_works;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    size_t pending;     /* requests not completed */
    size_t outstanding; /* works not completed */
    atomic_int canceled;
    /* The first connection-level failure (the peer timed out, reset or
     * refused): works not started yet fail with it instead of each waiting
     * out its own deadline against a dead or stopped peer. */
    kvp_status conn_error;
    char detail[256]; /* kvp_last_error() of the first failure, from its worker */
    int notify_fd;    /* -1, or an eventfd told when pending reaches 0 */
    kvpi_engine_metrics *metrics;
    uint64_t submit_ns;
};

static int connection_level(kvp_status st)
{
    return st == KVP_ETIMEDOUT || st == KVP_ECONNRESET || st == KVP_ECONNREFUSED;
}

/* Tell the batch's waiter, if it has an fd, that every request completed. */
static void notify(kvp_batch *b)
{
    uint64_t one = 1;
    if (b->notify_fd >= 0 && write(b->notify_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVPI_WARN("batch: cannot write its completion eventfd: %s", strerror(errno));
}

/* done_ns: when the work's transfer finished (the clock read once for a
 * group), for the latency of a request that succeeds; 0 for a failure. */
static void complete(kvpi_work *w, kvp_status st, uint64_t done_ns)
{
    kvp_batch *b = w->batch;
    pthread_mutex_lock(&b->lock);
    req_state *r = &b->reqs[w->req];
    if (st != KVP_OK && r->first_error == KVP_OK) r->first_error = st;
    if (st != KVP_OK && !b->detail[0])
        snprintf(b->detail, sizeof b->detail, "%s",
                 *kvp_last_error() ? kvp_last_error() : kvp_strerror(st));
    if (connection_level(st) && b->conn_error == KVP_OK) b->conn_error = st;
    int done = --r->slices_left == 0;
    if (done) {
        r->status = r->first_error;
        if (--b->pending == 0) notify(b);
    }
    /* Counted before a waiter can see the request done. */
    if (done)
        kvpi_metrics_request_done(b->metrics, w->slice.opcode, r->length, w->ops, r->status,
                                  done_ns - b->submit_ns);
    b->outstanding--;
    pthread_cond_broadcast(&b->cond);
    pthread_mutex_unlock(&b->lock);
}

static int groupable(const kvpi_work *first, const kvpi_work *next, size_t bytes, size_t limit)
{
    return next && next->batch->seg == first->batch->seg &&
           next->slice.opcode == first->slice.opcode && next->local_kind == first->local_kind &&
           bytes + next->slice.length <= limit;
}

/* Pop a group of works; returns its size, 0 when stopping with nothing left. */
static size_t queue_pop(kvp_engine *e, kvpi_work **group, int *stopping)
{
    kvpi_queue *q = &e->queue;
    pthread_mutex_lock(&q->lock);
    while (!q->head && !q->stopping) pthread_cond_wait(&q->cond, &q->lock);
    *stopping = q->stopping;
    size_t n = 0, bytes = 0;
    kvpi_work *first = q->head;
    while (q->head && n < GROUP_MAX &&
           (n == 0 || groupable(first, q->head, bytes, atomic_load(&first->batch->seg->group_bytes)))) {
        group[n++] = q->head;
        bytes += q->head->slice.length;
        q->head = q->head->next;
    }
    if (!q->head) q->tail = NULL;
    pthread_mutex_unlock(&q->lock);
    return n;
}

static int all_inside(const kvpi_peer *peer, kvpi_work **live, size_t m)
{
    for (size_t i = 0; i < m; i++)
        if (!kvpi_regions_contain(peer->desc.regions, peer->desc.n_regions, live[i]->slice.remote,
                                  live[i]->slice.length))
            return 0;
    return 1;
}

/* A referenced peer whose descriptor covers the group, if any does: a range
 * outside the cached descriptor may mean the peer re-registered or restarted,
 * so look it up once more before calling the range bad. */
static kvp_status acquire_for(kvp_engine *e, kvpi_segment *seg, kvpi_work **live, size_t m,
                              kvpi_peer **out)
{
    kvp_status st = kvpi_segment_acquire(e, seg, out);
    if (st || all_inside(*out, live, m)) return st;
    kvpi_segment_release(seg, *out, 1);
    return kvpi_segment_acquire(e, seg, out);
}

/* Why a work need not run: its batch was freed, its request already failed
 * (a request fails with its first failed slice), or its batch lost the peer.
 * KVP_OK to run it. */
static kvp_status skip_reason(kvpi_work *w)
{
    kvp_batch *b = w->batch;
    if (atomic_load(&b->canceled)) return kvpi_error(KVP_ECANCELED, "the batch was freed");
    pthread_mutex_lock(&b->lock);
    kvp_status st = b->conn_error ? b->conn_error : b->reqs[w->req].first_error;
    pthread_mutex_unlock(&b->lock);
    return st;
}

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

/* Move n checked slices whose memory is of the kinds in mask kinds through
 * the peer's link for them; every slice gets its final status, but for one
 * the peer refused as outside its buffers (KVP_ERANGE) when stale is not
 * NULL: those are appended to stale[*n_stale], not completed. Returns the
 * connection-level error, if any. */
static kvp_status run_slices(kvp_engine *e, kvpi_peer *peer, unsigned kinds, kvpi_work **works,
                             kvpi_slice **slices, size_t n, kvpi_work **stale, size_t *n_stale)
{
    kvpi_link *link;
    kvp_status st = kvpi_peer_select(e, peer, kinds, &link);
    if (st) {
        for (size_t i = 0; i < n; i++)
            complete(works[i], st, 0);
        return KVP_OK; /* nothing wrong with the connection */
    }
    kvpi_pin pins[GROUP_MAX];
    local_handles(e, link, slices, n, pins);
    for (size_t i = 0; i < n; i++)
        works[i]->ops = link->ops;
    st = link->ops->peer_xfer(link->handle, slices, n);
    uint64_t done_ns = kvpi_now_ns();
    for (size_t i = 0; i < n; i++)
        if (pins[i]) kvpi_region_unpin(&e->regions, pins[i]);
    for (size_t i = 0; i < n; i++) {
        if (stale && slices[i]->status == KVP_ERANGE) {
            stale[(*n_stale)++] = works[i];
            continue;
        }
        complete(works[i],
                 slices[i]->status == KVP_EINPROGRESS ? (st ? st : KVP_EIO) : slices[i]->status,
                 done_ns);
    }
    return st;
}

/* The kinds of memory a checked slice touches: its local and its remote. */
static unsigned kinds_of(const kvpi_peer *peer, const kvpi_work *w)
{
    return KVPI_MEM_BIT(w->local_kind) |
           KVPI_MEM_BIT(peer->desc.regions[w->slice.remote_region].kind);
}

/* Run the m live works of one segment. A slice the peer refuses as outside
 * its buffers although our descriptor lists the range means the peer
 * re-registered meanwhile (a pool chunk given back and mapped again at the
 * same address, whose old rkey a one-sided transport still holds): such
 * slices run once more (retried 0) against a fresh lookup, and fail with the
 * peer's answer only then. */
static void run_live(kvp_engine *e, kvpi_segment *seg, kvpi_work **live, size_t m, int retried)
{
    kvpi_slice *slices[GROUP_MAX];
    kvpi_work *stale[GROUP_MAX];
    size_t n_stale = 0;
    kvpi_peer *peer;
    kvp_status st = acquire_for(e, seg, live, m, &peer);
    if (st) {
        for (size_t i = 0; i < m; i++)
            complete(live[i], st, 0);
        return;
    }
    /* Check against the peer's published buffers before sending anything;
     * the peer checks again, since its descriptor may have changed since -
     * except a one-sided (KVPI_CAP_RDMA) transport's, whose target checks
     * nothing: for it this is the only check. */
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        kvpi_slice *s = &live[i]->slice;
        long r = kvpi_regions_find(peer->desc.regions, peer->desc.n_regions, s->remote, s->length);
        if (r < 0) {
            kvpi_error(KVP_ERANGE, "segment %s: [0x%llx, +%zu) is outside its registered buffers%s",
                       seg->name, (unsigned long long)s->remote, s->length,
                       retried ? " (it deregistered them meanwhile)" : "");
            complete(live[i], KVP_ERANGE, 0);
            continue;
        }
        s->remote_region = (size_t)r;
        s->status = KVP_EINPROGRESS;
        live[k++] = live[i];
    }
    /* Slices go by the kinds of memory they touch (all the same, but for a
     * group that spans remote buffers of different kinds). */
    kvp_status last = KVP_OK, conn = KVP_OK;
    while (k > 0) {
        unsigned kinds = kinds_of(peer, live[0]);
        kvpi_work *same[GROUP_MAX];
        size_t ns = 0, rest = 0;
        for (size_t i = 0; i < k; i++) {
            if (kinds_of(peer, live[i]) == kinds) {
                same[ns] = live[i];
                slices[ns++] = &live[i]->slice;
            } else {
                live[rest++] = live[i];
            }
        }
        k = rest;
        if (conn) { /* the peer's connection failed: so do the rest */
            for (size_t i = 0; i < ns; i++)
                complete(same[i], conn, 0);
            continue;
        }
        kvp_status sub = run_slices(e, peer, kinds, same, slices, ns, retried ? NULL : stale,
                                    &n_stale);
        if (sub) last = sub;
        if (connection_level(sub)) conn = sub;
    }
    /* Any failure the transport reports (a refused slice included: the
     * peer's registrations changed) drops the peer, to look it up again. */
    kvpi_segment_release(seg, peer, last != KVP_OK || n_stale > 0);
    kvpi_segment_note(seg, last);
    if (n_stale > 0) {
        kvpi_counter_add(&e->metrics.retries, n_stale);
        run_live(e, seg, stale, n_stale, 1);
    }
}

static void run_group(kvp_engine *e, kvpi_work **group, size_t n)
{
    kvpi_work *live[GROUP_MAX];
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        kvp_status skip = skip_reason(group[i]);
        if (skip)
            complete(group[i], skip, 0);
        else
            live[m++] = group[i];
    }
    if (m > 0) run_live(e, group[0]->batch->seg, live, m, 0);
}

static void *worker_main(void *arg)
{
    kvp_engine *e = arg;
    kvpi_work *group[GROUP_MAX];
    for (;;) {
        int stopping;
        size_t n = queue_pop(e, group, &stopping);
        if (n == 0) break;
        if (stopping) {
            for (size_t i = 0; i < n; i++)
                complete(group[i], kvpi_error(KVP_ECLOSED, "the engine is shutting down"), 0);
            continue;
        }
        run_group(e, group, n);
    }
    return NULL;
}

kvp_status kvpi_workers_start(kvp_engine *e)
{
    pthread_mutex_init(&e->queue.lock, NULL);
    kvpi_cond_init(&e->queue.cond);
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
    pthread_mutex_lock(&e->queue.lock);
    e->queue.stopping = 1;
    pthread_cond_broadcast(&e->queue.cond);
    pthread_mutex_unlock(&e->queue.lock);
    for (int i = 0; i < e->n_workers; i++) pthread_join(e->workers[i], NULL);
    free(e->workers);
    e->workers = NULL;
    pthread_mutex_destroy(&e->queue.lock);
    pthread_cond_destroy(&e->queue.cond);
}

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

static void enqueue(kvp_engine *e, kvpi_work *first, kvpi_work *last)
{
    kvpi_queue *q = &e->queue;
    pthread_mutex_lock(&q->lock);
    if (q->tail)
        q->tail->next = first;
    else
        q->head = first;
    q->tail = last;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
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
        kvp_mem_kind kind =
            kvpi_region_kind_at(&e->regions, (uint64_t)(uintptr_t)r->local, r->length, &device);
        b->reqs[i] = (req_state){count ? KVP_EINPROGRESS : KVP_OK, KVP_OK, count, r->length};
        if (count) b->pending++;
        bytes += r->length;
        for (size_t off = 0; off < r->length; off += slice_size) {
            kvpi_work *work = &b->works[w];
            work->next = w + 1 < b->n_works ? &b->works[w + 1] : NULL;
            work->batch = b;
            work->req = i;
            work->local_kind = kind;
            size_t len = r->length - off < slice_size ? r->length - off : slice_size;
            work->slice = (kvpi_slice){.opcode = r->opcode,
                                       .local = (char *)r->local + off,
                                       .remote = r->remote + off,
                                       .length = len,
                                       .status = KVP_EINPROGRESS};
            w++;
        }
    }
    return bytes;
}

kvp_status kvp_batch_submit(kvp_engine *e, kvp_segment_id seg_id, const kvp_request *reqs,
                            size_t n, kvp_batch **out)
{
    return kvpi_batch_submit_notify(e, seg_id, reqs, n, -1, out);
}

kvp_status kvpi_batch_submit_notify(kvp_engine *e, kvp_segment_id seg_id, const kvp_request *reqs,
                                    size_t n, int notify_fd, kvp_batch **out)
{
    if (!e || !out || (n && !reqs)) return kvpi_error(KVP_EINVAL, "batch_submit: NULL argument");
    kvpi_segment *seg = kvpi_segment_get(e, seg_id);
    if (!seg) return kvpi_error(KVP_EINVAL, "batch_submit: segment id %u is not open", seg_id);
    size_t n_works = 0;
    kvp_status st = check_requests(reqs, n, e->opts.slice_size, &n_works);
    if (st) return st;
    kvp_batch *b = calloc(1, sizeof *b);
    if (!b) return kvpi_error(KVP_ENOMEM, "batch_submit: out of memory");
    b->reqs = calloc(n ? n : 1, sizeof *b->reqs);
    b->works = calloc(n_works ? n_works : 1, sizeof *b->works);
    if (!b->reqs || !b->works) {
        free(b->reqs);
        free(b->works);
        free(b);
        return kvpi_error(KVP_ENOMEM, "batch_submit: out of memory");
    }
    pthread_mutex_init(&b->lock, NULL);
    kvpi_cond_init(&b->cond);
    b->seg = seg;
    b->n = n;
    b->n_works = b->outstanding = n_works;
    b->notify_fd = notify_fd;
    b->metrics = &e->metrics;
    b->submit_ns = kvpi_now_ns();
    uint64_t bytes = build_works(e, b, reqs, e->opts.slice_size);
    kvpi_metrics_submitted(&e->metrics, b->pending, bytes);
    if (b->pending == 0) notify(b);
    if (n_works) enqueue(e, &b->works[0], &b->works[n_works - 1]);
    *out = b;
    return KVP_OK;
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

kvp_status kvp_batch_wait(kvp_batch *b, int timeout_ms)
{
    if (!b) return kvpi_error(KVP_EINVAL, "batch_wait: NULL batch");
    struct timespec dl = kvpi_deadline_after_ms(timeout_ms < 0 ? 0 : timeout_ms);
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&b->lock);
    while (b->pending > 0) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&b->cond, &b->lock);
        } else if (pthread_cond_timedwait(&b->cond, &b->lock, &dl) == ETIMEDOUT) {
            if (b->pending == 0) break;
            st = kvpi_error(KVP_ETIMEDOUT, "batch: %zu of %zu requests still running after %d ms",
                            b->pending, b->n, timeout_ms);
            goto out;
        }
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

void kvp_batch_free(kvp_batch *b)
{
    if (!b) return;
    atomic_store(&b->canceled, 1);
    pthread_mutex_lock(&b->lock);
    while (b->outstanding > 0) pthread_cond_wait(&b->cond, &b->lock);
    pthread_mutex_unlock(&b->lock);
    pthread_mutex_destroy(&b->lock);
    pthread_cond_destroy(&b->cond);
    free(b->reqs);
    free(b->works);
    free(b);
}

/* A synchronous request runs in the calling thread when it is one slice:
 * handing it to a worker and waiting for it costs two thread wake-ups, which
 * were most of a 4 KiB READ's time on loopback. Larger requests go to the
 * workers, to spread their slices over connections - except over a one-sided
 * (KVPI_CAP_RDMA) transport, whose slices all go to the one UCX endpoint of
 * the peer whichever thread issues them, and which the caller then issues one
 * after another itself: UCX stripes over its lanes, and over shared memory
 * the caller copies. Measured (docs/transport-ucx.md): a 16 MiB READ of a
 * pool buffer over UCX's shared memory, 4 MiB slices through the workers,
 * 13.0 and 15.6 GB/s; here, 20.1 and 25.1 GB/s. */
static kvp_status transfer_here(kvp_engine *e, kvpi_segment *seg, const kvp_request *req,
                                size_t n_works)
{
    kvp_batch b = {.seg = seg, .n = 1, .n_works = n_works, .outstanding = n_works, .notify_fd = -1,
                   .metrics = &e->metrics, .submit_ns = kvpi_now_ns()};
    req_state r = {0};
    kvpi_work one = {0};
    kvpi_work *w = n_works == 1 ? &one : calloc(n_works, sizeof *w);
    if (!w) return kvpi_error(KVP_ENOMEM, "transfer: out of memory");
    b.reqs = &r;
    b.works = w;
    pthread_mutex_init(&b.lock, NULL);
    kvpi_cond_init(&b.cond);
    /* The same work as a batch of one would queue: the local memory's kind
     * included, which transport selection needs. A slice after a failed one
     * completes with its error without running (run_group's skip_reason). */
    uint64_t bytes = build_works(e, &b, req, e->opts.slice_size);
    kvpi_metrics_submitted(&e->metrics, b.pending, bytes);
    for (size_t i = 0; i < n_works; i++) {
        kvpi_work *group[1] = {&w[i]};
        run_group(e, group, 1);
    }
    kvp_status st = kvp_batch_wait(&b, 0);
    pthread_mutex_destroy(&b.lock);
    pthread_cond_destroy(&b.cond);
    if (w != &one) free(w);
    return st;
}

static kvp_status transfer_sync(kvp_engine *e, kvp_segment_id seg, kvp_opcode op, void *local,
                                uint64_t remote, size_t length)
{
    kvp_request req = {op, local, remote, length};
    kvpi_segment *s = e ? kvpi_segment_get(e, seg) : NULL;
    if (s && length > 0 && (length <= e->opts.slice_size || atomic_load(&s->one_sided))) {
        size_t works;
        kvp_status st = check_requests(&req, 1, e->opts.slice_size, &works);
        return st ? st : transfer_here(e, s, &req, works);
    }
    kvp_batch *b;
    kvp_status st = kvp_batch_submit(e, seg, &req, 1, &b);
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

kvp_status kvp_engine_write(kvp_engine *e, kvp_segment_id seg, const void *local,
                            uint64_t remote, size_t length)
{
    return transfer_sync(e, seg, KVP_OP_WRITE, (void *)local, remote, length);
}
