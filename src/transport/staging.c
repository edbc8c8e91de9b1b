/* Device memory through pinned bounce buffers (see staging.h). */
#include "transport/staging.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "gpu/cuda.h"

#define BOUNCE_BYTES_DEFAULT ((size_t)4 << 20)
#define BOUNCE_BYTES_MIN ((size_t)64 << 10)
#define BOUNCE_BUFFERS_DEFAULT 8
#define BOUNCE_BUFFERS_MAX 256

typedef struct bounce {
    struct bounce *next;
    char *host;               /* pinned, pool.bytes long */
    kvpi_cuda_stream *stream; /* of the device it last served */
} bounce;

typedef struct pool {
    pthread_mutex_t lock;
    pthread_cond_t freed;
    bounce *idle;
    int made; /* buffers allocated, at most max */
} pool;

static pool pools[2] = {
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0},
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0},
};
enum { INITIATOR, TARGET };

static pthread_once_t knobs_once = PTHREAD_ONCE_INIT;
static size_t buf_bytes;
static int max_bufs;

static void read_knobs(void)
{
    const char *b = getenv("KVPIPE_CUDA_BOUNCE_BYTES");
    const char *n = getenv("KVPIPE_CUDA_BOUNCE_BUFFERS");
    unsigned long long v = b ? strtoull(b, NULL, 0) : 0;
    buf_bytes = v >= BOUNCE_BYTES_MIN && v <= ((size_t)1 << 30) ? (size_t)v : BOUNCE_BYTES_DEFAULT;
    long k = n ? strtol(n, NULL, 0) : 0;
    max_bufs = k >= 1 && k <= BOUNCE_BUFFERS_MAX ? (int)k : BOUNCE_BUFFERS_DEFAULT;
    if ((b && (size_t)v != buf_bytes) || (n && k != max_bufs))
        KVPI_WARN("KVPIPE_CUDA_BOUNCE_BYTES/_BUFFERS out of range; using %zu bytes x %d", buf_bytes,
                  max_bufs);
}

/* A buffer of the role's pool with a stream of device: an idle one, a new
 * one while fewer than max exist, else the first given back. */
static kvp_status acquire(int role, int device, bounce **out)
{
    pthread_once(&knobs_once, read_knobs);
    pool *p = &pools[role];
    pthread_mutex_lock(&p->lock);
    while (!p->idle && p->made >= max_bufs)
        pthread_cond_wait(&p->freed, &p->lock);
    bounce *b = p->idle;
    if (b)
        p->idle = b->next;
    else
        p->made++;
    pthread_mutex_unlock(&p->lock);
    kvp_status st = KVP_OK;
    if (!b) {
        if (!(b = calloc(1, sizeof *b)))
            st = kvpi_error(KVP_ENOMEM, "staging: out of memory");
        else if ((st = kvpi_cuda_host_alloc(buf_bytes, (void **)&b->host)))
            free(b);
        if (st) {
            pthread_mutex_lock(&p->lock);
            p->made--;
            pthread_cond_signal(&p->freed);
            pthread_mutex_unlock(&p->lock);
            return st;
        }
    }
    if (b->stream && kvpi_cuda_stream_device(b->stream) != device) {
        kvpi_cuda_stream_destroy(b->stream);
        b->stream = NULL;
    }
    if (!b->stream && (st = kvpi_cuda_stream_create(device, &b->stream))) {
        pthread_mutex_lock(&p->lock);
        b->next = p->idle;
        p->idle = b;
        pthread_cond_signal(&p->freed);
        pthread_mutex_unlock(&p->lock);
        return st;
    }
    *out = b;
    return KVP_OK;
}

static void release(int role, bounce *b)
{
    pool *p = &pools[role];
    pthread_mutex_lock(&p->lock);
    b->next = p->idle;
    p->idle = b;
    pthread_cond_signal(&p->freed);
    pthread_mutex_unlock(&p->lock);
}

/* ------------------------------------------------------------ initiator --- */

/* One call of run: pieces of the group, the device ones in one half of the
 * bounce buffer. */
typedef struct stage_batch {
    kvpi_slice piece[KVPI_XFER_MAX];
    kvpi_slice *ptr[KVPI_XFER_MAX];
    size_t owner[KVPI_XFER_MAX]; /* index of the slice it is part of */
    void *device[KVPI_XFER_MAX]; /* its device memory; NULL for host pieces */
    size_t m;
    size_t end; /* slices before this index are wholly in this batch or before */
} stage_batch;

/* One group's pass: its slices, where it stands, the statuses so far. */
typedef struct stage_pass {
    kvpi_run_fn run;
    void *peer;
    uint64_t start, deadline; /* the group's, for every call of run */
    kvpi_slice *const *slices;
    size_t n, i, off; /* the next piece starts at slices[i] + off */
    bounce *b;
    char *half[2];
    size_t half_bytes;
    kvp_status agg[KVPI_XFER_MAX]; /* each slice's first failure, else KVP_OK */
    size_t done;                   /* slices whose agg is final */
} stage_pass;

/* Fill bt from the pass's position on, into host memory of cap bytes, with
 * device pieces of the buffer's device only; advances the position. bt->m is
 * 0 when the pass is over or its next slice is on another device. */
static void batch_fill(stage_pass *ps, stage_batch *bt, char *host)
{
    size_t used = 0;
    int device = kvpi_cuda_stream_device(ps->b->stream);
    bt->m = 0;
    while (ps->i < ps->n && bt->m < KVPI_XFER_MAX) {
        const kvpi_slice *s = ps->slices[ps->i];
        size_t m = bt->m;
        bt->piece[m] = *s;
        bt->piece[m].status = KVP_EINPROGRESS;
        bt->owner[m] = ps->i;
        bt->device[m] = NULL;
        bt->ptr[m] = &bt->piece[m];
        if (s->local_kind == KVP_MEM_HOST) {
            bt->m++;
            ps->i++;
            continue;
        }
        if (used == ps->half_bytes || s->local_device != device) break;
        size_t left = s->length - ps->off, room = ps->half_bytes - used;
        size_t piece = left < room ? left : room;
        bt->piece[m].local = host + used;
        bt->piece[m].local_kind = KVP_MEM_HOST;
        bt->piece[m].remote = s->remote + ps->off;
        bt->piece[m].length = piece;
        bt->device[m] = (char *)s->local + ps->off;
        bt->m++;
        used += piece;
        if ((ps->off += piece) == s->length) {
            ps->i++;
            ps->off = 0;
        }
    }
    bt->end = ps->i;
}

/* Fail every device piece of bt from k on that has not failed yet. */
static void batch_fail_copies(stage_batch *bt, size_t k, kvp_status st)
{
    for (; k < bt->m; k++)
        if (bt->device[k] &&
            (bt->piece[k].status == KVP_OK || bt->piece[k].status == KVP_EINPROGRESS))
            bt->piece[k].status = st;
}

/* Enqueue the copies of bt's device pieces (host to device: only those whose
 * bytes arrived); a failed one fails itself and every later one. */
static kvp_status batch_enqueue(stage_batch *bt, kvpi_cuda_stream *s, int d2h)
{
    for (size_t k = 0; k < bt->m; k++) {
        kvpi_slice *p = &bt->piece[k];
        if (!bt->device[k] || (!d2h && p->status != KVP_OK)) continue;
        kvp_status st = d2h ? kvpi_cuda_copy_d2h_async(s, p->local, bt->device[k], p->length)
                            : kvpi_cuda_copy_h2d_async(s, bt->device[k], p->local, p->length);
        if (st) {
            batch_fail_copies(bt, k, st);
            return st;
        }
    }
    return KVP_OK;
}

/* bt is final: fold its pieces' statuses into their slices'. A piece run
 * left unanswered has run's status. */
static void batch_merge(stage_pass *ps, stage_batch *bt, kvp_status run_st)
{
    for (size_t k = 0; k < bt->m; k++) {
        kvp_status st = bt->piece[k].status;
        if (st == KVP_EINPROGRESS) st = run_st;
        if (ps->agg[bt->owner[k]] == KVP_OK) ps->agg[bt->owner[k]] = st;
    }
    ps->done = bt->end;
}

static int fatal(kvp_status st)
{
    return st != KVP_OK && st != KVP_ERANGE;
}

/* WRITEs of one device's slices: the device-to-host copy of batch k+1 runs
 * on the stream while batch k is on the wire. */
static kvp_status pass_writes(stage_pass *ps)
{
    stage_batch bt[2];
    kvpi_cuda_stream *s = ps->b->stream;
    int h = 0;
    kvp_status result = KVP_OK;
    batch_fill(ps, &bt[h], ps->half[h]);
    kvp_status copied = batch_enqueue(&bt[h], s, 1);
    while (bt[h].m) {
        stage_batch *cur = &bt[h], *next = &bt[h ^ 1];
        kvp_status synced = kvpi_cuda_stream_sync(s);
        if (synced && !copied) {
            batch_fail_copies(cur, 0, synced);
            copied = synced;
        }
        if (copied) { /* nothing of a failed copy goes on the wire */
            batch_merge(ps, cur, copied);
            return copied;
        }
        batch_fill(ps, next, ps->half[h ^ 1]);
        kvp_status next_copied = next->m ? batch_enqueue(next, s, 1) : KVP_OK;
        kvp_status st = ps->run(ps->peer, cur->ptr, cur->m, ps->start, ps->deadline);
        batch_merge(ps, cur, st);
        if (fatal(st)) {
            kvpi_cuda_stream_sync(s); /* the next batch's copies, before the buffer goes */
            return st;
        }
        if (st) result = st;
        h ^= 1;
        copied = next_copied;
    }
    return result;
}

/* READs of one device's slices: the host-to-device copy of batch k runs on
 * the stream while batch k+1 is on the wire. */
static kvp_status pass_reads(stage_pass *ps)
{
    stage_batch bt[2];
    kvpi_cuda_stream *s = ps->b->stream;
    stage_batch *pending = NULL; /* copies enqueued, not yet waited for */
    kvp_status pending_run = KVP_OK, result = KVP_OK, stop = KVP_OK;
    int h = 0;
    batch_fill(ps, &bt[h], ps->half[h]);
    while (bt[h].m) {
        stage_batch *cur = &bt[h];
        kvp_status st = ps->run(ps->peer, cur->ptr, cur->m, ps->start, ps->deadline);
        if (pending) {
            kvp_status synced = kvpi_cuda_stream_sync(s);
            if (synced) batch_fail_copies(pending, 0, synced);
            batch_merge(ps, pending, pending_run);
            pending = NULL;
            if (synced) {
                batch_fail_copies(cur, 0, synced); /* its bytes are never copied */
                batch_merge(ps, cur, st ? st : synced);
                return synced;
            }
        }
        kvp_status copied = batch_enqueue(cur, s, 0);
        pending = cur;
        pending_run = st;
        if (copied || fatal(st)) {
            stop = copied ? copied : st;
            break;
        }
        if (st) result = st;
        h ^= 1;
        batch_fill(ps, &bt[h], ps->half[h]);
    }
    if (pending) {
        kvp_status synced = kvpi_cuda_stream_sync(s);
        if (synced) batch_fail_copies(pending, 0, synced);
        batch_merge(ps, pending, pending_run);
        if (synced && !stop) stop = synced;
    }
    return stop ? stop : result;
}

kvp_status kvpi_stage_run(kvpi_run_fn run, void *peer, kvpi_slice *const *slices, size_t n,
                          uint64_t start_ns, uint64_t deadline)
{
    size_t first = 0;
    while (first < n && slices[first]->local_kind == KVP_MEM_HOST)
        first++;
    if (first == n) return run(peer, slices, n, start_ns, deadline);
    stage_pass ps = {.run = run,
                     .peer = peer,
                     .start = start_ns,
                     .deadline = deadline,
                     .slices = slices,
                     .n = n};
    for (size_t k = 0; k < n; k++)
        ps.agg[k] = KVP_OK;
    int write = slices[0]->opcode == KVP_OP_WRITE;
    kvp_status result = KVP_OK, st = KVP_OK;
    while (ps.i < n) {
        /* A buffer with a stream of the device of the next device slice (a
         * group's are normally all on one device). */
        size_t d = ps.i;
        while (d < n && slices[d]->local_kind == KVP_MEM_HOST)
            d++;
        int device = d < n ? slices[d]->local_device : slices[first]->local_device;
        if (ps.b && kvpi_cuda_stream_device(ps.b->stream) != device) {
            release(INITIATOR, ps.b);
            ps.b = NULL;
        }
        if (!ps.b && (st = acquire(INITIATOR, device, &ps.b))) break;
        pthread_once(&knobs_once, read_knobs);
        ps.half_bytes = buf_bytes / 2;
        ps.half[0] = ps.b->host;
        ps.half[1] = ps.b->host + ps.half_bytes;
        st = write ? pass_writes(&ps) : pass_reads(&ps);
        if (fatal(st)) break;
        if (st) result = st;
    }
    if (ps.b) release(INITIATOR, ps.b);
    if (fatal(st)) result = st;
    for (size_t k = 0; k < n; k++) {
        kvp_status ks = k < ps.done ? ps.agg[k] : result;
        slices[k]->status = ks == KVP_EINPROGRESS ? result : ks;
    }
    return result;
}

/* --------------------------------------------------------------- target --- */

/* Serve [addr, +len) through the two halves of b: a READ copies the next
 * half device to host while io sends this one; a WRITE copies this half host
 * to device while io receives the next. */
kvp_status kvpi_stage_serve(kvp_opcode op, int device, uint64_t addr, uint64_t len,
                            kvpi_stage_io io, void *ctx, uint64_t *moved, int *copy_failed)
{
    *moved = 0;
    *copy_failed = 0;
    bounce *b;
    kvp_status st = acquire(TARGET, device, &b);
    if (st) {
        *copy_failed = 1;
        return st;
    }
    size_t half = buf_bytes / 2;
    char *host[2] = {b->host, b->host + half};
    kvpi_cuda_stream *s = b->stream;
    int h = 0;
    uint64_t off = 0;
    size_t c = len < half ? (size_t)len : half;
    if (op == KVP_OP_READ) {
        st = c ? kvpi_cuda_copy_d2h_async(s, host[h], (void *)(uintptr_t)addr, c) : KVP_OK;
        while (c && !st) {
            if ((st = kvpi_cuda_stream_sync(s))) break;
            uint64_t next_off = off + c;
            size_t next = len - next_off < half ? (size_t)(len - next_off) : half;
            kvp_status next_st =
                next ? kvpi_cuda_copy_d2h_async(s, host[h ^ 1],
                                                (void *)(uintptr_t)(addr + next_off), next)
                     : KVP_OK;
            kvp_status sent = io(ctx, host[h], c, off);
            if (sent) {
                kvpi_cuda_stream_sync(s);
                release(TARGET, b);
                return sent;
            }
            *moved += c;
            st = next_st;
            off = next_off;
            c = next;
            h ^= 1;
        }
        *copy_failed = st != KVP_OK;
    } else {
        kvp_status copied = KVP_OK;
        while (c) {
            if ((st = io(ctx, host[h], c, off))) break;
            *moved += c;
            /* The previous half's copy must be done before it is reused. */
            if (!copied) copied = kvpi_cuda_stream_sync(s);
            if (!copied)
                copied = kvpi_cuda_copy_h2d_async(s, (void *)(uintptr_t)(addr + off), host[h], c);
            off += c;
            c = len - off < half ? (size_t)(len - off) : half;
            h ^= 1;
        }
        kvp_status synced = kvpi_cuda_stream_sync(s);
        if (!copied) copied = synced;
        /* A failed copy is the answer, the I/O's failure aside: the peer's
         * bytes are then still to be drained by the caller. */
        if (!st && copied) {
            st = copied;
            *copy_failed = 1;
        }
    }
    release(TARGET, b);
    return st;
}
