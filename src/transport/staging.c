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
    while (!p->idle && p->made >= max_bufs) pthread_cond_wait(&p->freed, &p->lock);
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

/* One call of run: pieces of the group, device ones in the bounce buffer. */
typedef struct stage_batch {
    kvpi_slice piece[KVPI_XFER_MAX];
    kvpi_slice *ptr[KVPI_XFER_MAX];
    size_t owner[KVPI_XFER_MAX]; /* index of the slice it is part of */
    void *device[KVPI_XFER_MAX]; /* its device memory; NULL for host pieces */
    size_t m;
} stage_batch;

/* Fill batch from slices[*i] at offset *off on; advances both. */
static void batch_fill(stage_batch *bt, bounce *b, kvpi_slice *const *slices, size_t n, size_t *i,
                       size_t *off)
{
    size_t used = 0;
    bt->m = 0;
    while (*i < n && bt->m < KVPI_XFER_MAX) {
        const kvpi_slice *s = slices[*i];
        size_t m = bt->m;
        bt->piece[m] = *s;
        bt->piece[m].status = KVP_EINPROGRESS;
        bt->owner[m] = *i;
        bt->device[m] = NULL;
        if (s->local_kind == KVP_MEM_HOST) {
            bt->ptr[m] = &bt->piece[m];
            bt->m++;
            (*i)++;
            continue;
        }
        if (used == buf_bytes || s->local_device != kvpi_cuda_stream_device(b->stream)) break;
        size_t piece = s->length - *off < buf_bytes - used ? s->length - *off : buf_bytes - used;
        bt->piece[m].local = b->host + used;
        bt->piece[m].local_kind = KVP_MEM_HOST;
        bt->piece[m].remote = s->remote + *off;
        bt->piece[m].length = piece;
        bt->device[m] = (char *)s->local + *off;
        bt->ptr[m] = &bt->piece[m];
        bt->m++;
        used += piece;
        if ((*off += piece) == s->length) {
            (*i)++;
            *off = 0;
        }
    }
}

static kvp_status batch_copy(stage_batch *bt, bounce *b, int d2h)
{
    for (size_t k = 0; k < bt->m; k++) {
        kvpi_slice *p = &bt->piece[k];
        if (!bt->device[k] || (!d2h && p->status != KVP_OK)) continue;
        kvp_status st = d2h ? kvpi_cuda_copy_d2h(b->stream, p->local, bt->device[k], p->length)
                            : kvpi_cuda_copy_h2d(b->stream, bt->device[k], p->local, p->length);
        if (st) {
            /* Nothing after a failed copy is copied: those pieces fail too. */
            for (size_t j = k; j < bt->m; j++)
                if (bt->device[j]) bt->piece[j].status = st;
            return st;
        }
    }
    return KVP_OK;
}

/* Every slice's status: its first failed piece's, else KVP_OK; a slice not
 * (wholly) run gets fail. */
static void merge(kvp_status *agg, kvpi_slice *const *slices, size_t n, size_t ran, kvp_status fail)
{
    for (size_t i = 0; i < n; i++) {
        kvp_status st = i < ran ? agg[i] : fail;
        if (st == KVP_EINPROGRESS) st = fail;
        slices[i]->status = st;
    }
}

kvp_status kvpi_stage_run(kvpi_run_fn run, void *peer, kvpi_slice *const *slices, size_t n)
{
    size_t first = 0;
    while (first < n && slices[first]->local_kind == KVP_MEM_HOST) first++;
    if (first == n) return run(peer, slices, n);
    bounce *b;
    kvp_status st = acquire(INITIATOR, slices[first]->local_device, &b);
    if (st) {
        merge(NULL, slices, n, 0, st);
        return st;
    }
    int write = slices[0]->opcode == KVP_OP_WRITE;
    kvp_status agg[KVPI_XFER_MAX], result = KVP_OK;
    for (size_t k = 0; k < n; k++) agg[k] = KVP_OK;
    size_t i = 0, off = 0, done = 0;
    while (i < n) {
        stage_batch bt;
        /* A group's device slices are on one device (the engine groups
         * requests); a slice of another gets a stream of its own. */
        if (slices[i]->local_kind != KVP_MEM_HOST &&
            kvpi_cuda_stream_device(b->stream) != slices[i]->local_device) {
            release(INITIATOR, b);
            if ((st = acquire(INITIATOR, slices[i]->local_device, &b))) {
                merge(agg, slices, n, done, st);
                return st;
            }
        }
        batch_fill(&bt, b, slices, n, &i, &off);
        st = write ? batch_copy(&bt, b, 1) : KVP_OK;
        if (!st) {
            st = run(peer, bt.ptr, bt.m);
            if (!write && batch_copy(&bt, b, 0) && !st) st = KVP_EIO;
        }
        for (size_t k = 0; k < bt.m; k++) {
            size_t o = bt.owner[k];
            kvp_status ps = bt.piece[k].status;
            if (ps == KVP_EINPROGRESS) ps = st ? st : KVP_OK;
            if (agg[o] == KVP_OK) agg[o] = ps;
        }
        done = i; /* slices wholly run; a partly run one fails with a break */
        if (st == KVP_ERANGE) {
            result = KVP_ERANGE;
        } else if (st) {
            result = st;
            break;
        }
    }
    release(INITIATOR, b);
    merge(agg, slices, n, done, result);
    return result;
}

/* --------------------------------------------------------------- target --- */

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
    for (uint64_t off = 0; off < len && !st;) {
        size_t c = len - off < buf_bytes ? (size_t)(len - off) : buf_bytes;
        void *dev = (void *)(uintptr_t)(addr + off);
        if (op == KVP_OP_READ) {
            if ((st = kvpi_cuda_copy_d2h(b->stream, b->host, dev, c))) {
                *copy_failed = 1;
                break;
            }
            st = io(ctx, b->host, c, off);
        } else {
            st = io(ctx, b->host, c, off);
            if (!st && (st = kvpi_cuda_copy_h2d(b->stream, dev, b->host, c))) *copy_failed = 1;
        }
        if (!st || *copy_failed) *moved += c;
        off += c;
    }
    release(TARGET, b);
    return st;
}
