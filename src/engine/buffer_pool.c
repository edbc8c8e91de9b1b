#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "common/error.h"
#include "common/log.h"
#include "common/util.h"
#include "engine/buffer_pool.h"

#define MIN_CLASS 256u
#define SMALL_LIMIT (64u * 1024u)
#define MAP_ALIGN (2u * 1024u * 1024u)

typedef struct extent {
    size_t off, len;
} extent;

typedef struct chunk {
    char *base;
    size_t size;
    extent *free; /* sorted by off, coalesced */
    size_t n_free, cap_free;
    size_t used;                /* bytes allocated from it */
    struct chunk *next_release; /* taken out of the pool, to release unlocked */
} chunk;

typedef struct allocation {
    uintptr_t addr;
    size_t len;
    chunk *owner;
} allocation;

struct kvpi_pool {
    pthread_mutex_t lock;
    kvpi_pool_opts opts;
    kvpi_pool_hooks hooks;
    chunk **chunks;
    size_t n_chunks, cap_chunks;
    allocation *allocs; /* sorted by addr */
    size_t n_allocs, cap_allocs;
    size_t mapped, allocated;
};

size_t kvpi_pool_size_class(size_t length)
{
    if (length <= MIN_CLASS) return MIN_CLASS;
    if (length <= SMALL_LIMIT) {
        size_t c = MIN_CLASS;
        while (c < length)
            c <<= 1;
        return c;
    }
    if (length > SIZE_MAX - SMALL_LIMIT) return 0;
    return (length + SMALL_LIMIT - 1) / SMALL_LIMIT * SMALL_LIMIT;
}

kvp_status kvpi_pool_create(const kvpi_pool_opts *opts, const kvpi_pool_hooks *hooks,
                            kvpi_pool **out)
{
    kvpi_pool *p = calloc(1, sizeof *p);
    if (!p) return kvpi_error(KVP_ENOMEM, "buffer pool: out of memory");
    pthread_mutex_init(&p->lock, NULL);
    p->opts = *opts;
    if (!p->opts.chunk_size) p->opts.chunk_size = 64u << 20;
    if (!p->opts.retain_bytes) p->opts.retain_bytes = (size_t)1 << 30;
    p->opts.chunk_size = (p->opts.chunk_size + MAP_ALIGN - 1) / MAP_ALIGN * MAP_ALIGN;
    p->hooks = *hooks;
    *out = p;
    return KVP_OK;
}

/* Map size bytes (a multiple of MAP_ALIGN) at a MAP_ALIGN boundary and ask for
 * transparent huge pages: first-touch faults then come 2 MiB at a time, which
 * matters for chunks of tens of MiB (page faults dominated the pipe's first
 * pass over fresh buffers otherwise). */
kvp_status kvpi_pool_map_default(size_t size, void **addr)
{
    size_t span = size + MAP_ALIGN;
    char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return kvpi_error(KVP_ENOMEM, "buffer pool: cannot map %zu bytes: %s", size,
                          strerror(errno));
    char *base = (char *)(((uintptr_t)raw + MAP_ALIGN - 1) & ~(uintptr_t)(MAP_ALIGN - 1));
    if (base > raw) munmap(raw, (size_t)(base - raw));
    size_t tail = (size_t)(raw + span - (base + size));
    if (tail) munmap(base + size, tail);
    madvise(base, size, MADV_HUGEPAGE);
    *addr = base;
    return KVP_OK;
}

void kvpi_pool_unmap_default(void *addr, size_t length)
{
    munmap(addr, length);
}

static kvp_status map_chunk(kvpi_pool *p, size_t size, void **addr)
{
    return p->hooks.map_chunk ? p->hooks.map_chunk(p->hooks.ctx, size, addr)
                              : kvpi_pool_map_default(size, addr);
}

static void unmap_chunk(kvpi_pool *p, void *addr, size_t size)
{
    if (p->hooks.map_chunk)
        p->hooks.unmap_chunk(p->hooks.ctx, addr, size);
    else
        kvpi_pool_unmap_default(addr, size);
}

/* Unregister and unmap a chunk that is no longer in the pool's list. Called
 * without the pool's lock: unregistering waits for server requests that still
 * touch the chunk, which must not hold up allocations from other chunks. */
static void chunk_release(kvpi_pool *p, chunk *c)
{
    KVPI_DEBUG("buffer pool: releasing a chunk of %zu bytes", c->size);
    p->hooks.unregister_chunk(p->hooks.ctx, c->base);
    unmap_chunk(p, c->base, c->size);
    free(c->free);
    free(c);
}

kvp_mem_kind kvpi_pool_kind(const kvpi_pool *p, int *device)
{
    *device = p->opts.device;
    return p->opts.kind;
}

void kvpi_pool_destroy(kvpi_pool *p)
{
    if (!p) return;
    for (size_t i = 0; i < p->n_chunks; i++) {
        p->mapped -= p->chunks[i]->size;
        chunk_release(p, p->chunks[i]);
    }
    free(p->chunks);
    free(p->allocs);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

static kvp_status chunk_new(kvpi_pool *p, size_t need, chunk **out)
{
    size_t size = need > p->opts.chunk_size ? (need + MAP_ALIGN - 1) / MAP_ALIGN * MAP_ALIGN
                                            : p->opts.chunk_size;
    if (p->opts.max_bytes && p->mapped + size > p->opts.max_bytes)
        return kvpi_error(KVP_ENOMEM, "buffer pool: %zu more bytes would pass the cap of %zu", size,
                          p->opts.max_bytes);
    if (kvpi_grow((void **)&p->chunks, &p->cap_chunks, p->n_chunks + 1, sizeof *p->chunks))
        return kvpi_error(KVP_ENOMEM, "buffer pool: out of memory");
    chunk *c = calloc(1, sizeof *c);
    if (!c || kvpi_grow((void **)&c->free, &c->cap_free, 1, sizeof *c->free)) {
        if (c) free(c);
        return kvpi_error(KVP_ENOMEM, "buffer pool: out of memory");
    }
    void *base = NULL;
    kvp_status st = map_chunk(p, size, &base);
    if (st) {
        free(c->free);
        free(c);
        return st;
    }
    st = p->hooks.register_chunk(p->hooks.ctx, base, size);
    if (st) {
        unmap_chunk(p, base, size);
        free(c->free);
        free(c);
        return st;
    }
    KVPI_DEBUG("buffer pool: new chunk of %zu bytes (%zu mapped before)", size, p->mapped);
    c->base = base;
    c->size = size;
    c->free[0] = (extent){0, size};
    c->n_free = 1;
    p->chunks[p->n_chunks++] = c;
    p->mapped += size;
    *out = c;
    return KVP_OK;
}

/* First fit inside one chunk; returns the offset or SIZE_MAX. */
static size_t chunk_take(chunk *c, size_t len)
{
    for (size_t i = 0; i < c->n_free; i++) {
        extent *e = &c->free[i];
        if (e->len < len) continue;
        size_t off = e->off;
        e->off += len;
        e->len -= len;
        if (e->len == 0) {
            memmove(e, e + 1, (c->n_free - i - 1) * sizeof *e);
            c->n_free--;
        }
        c->used += len;
        return off;
    }
    return SIZE_MAX;
}

static int chunk_give(chunk *c, size_t off, size_t len)
{
    size_t i = 0;
    while (i < c->n_free && c->free[i].off < off)
        i++;
    int join_prev = i > 0 && c->free[i - 1].off + c->free[i - 1].len == off;
    int join_next = i < c->n_free && off + len == c->free[i].off;
    if (join_prev && join_next) {
        c->free[i - 1].len += len + c->free[i].len;
        memmove(&c->free[i], &c->free[i + 1], (c->n_free - i - 1) * sizeof *c->free);
        c->n_free--;
    } else if (join_prev) {
        c->free[i - 1].len += len;
    } else if (join_next) {
        c->free[i].off = off;
        c->free[i].len += len;
    } else {
        if (kvpi_grow((void **)&c->free, &c->cap_free, c->n_free + 1, sizeof *c->free)) return -1;
        memmove(&c->free[i + 1], &c->free[i], (c->n_free - i) * sizeof *c->free);
        c->free[i] = (extent){off, len};
        c->n_free++;
    }
    c->used -= len;
    return 0;
}

static size_t alloc_index(const kvpi_pool *p, uintptr_t addr)
{
    size_t lo = 0, hi = p->n_allocs;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p->allocs[mid].addr < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

kvp_status kvpi_pool_alloc(kvpi_pool *p, size_t length, void **out)
{
    size_t len = kvpi_pool_size_class(length);
    if (length == 0 || len == 0)
        return kvpi_error(KVP_EINVAL, "buffer pool: cannot allocate %zu bytes", length);
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&p->lock);
    if (kvpi_grow((void **)&p->allocs, &p->cap_allocs, p->n_allocs + 1, sizeof *p->allocs)) {
        st = kvpi_error(KVP_ENOMEM, "buffer pool: out of memory");
        goto out;
    }
    chunk *c = NULL;
    size_t off = SIZE_MAX;
    for (size_t i = 0; i < p->n_chunks && off == SIZE_MAX; i++)
        if (p->chunks[i]->size - p->chunks[i]->used >= len) {
            c = p->chunks[i];
            off = chunk_take(c, len);
        }
    if (off == SIZE_MAX) {
        if ((st = chunk_new(p, len, &c))) goto out;
        off = chunk_take(c, len);
    }
    uintptr_t addr = (uintptr_t)c->base + off;
    size_t i = alloc_index(p, addr);
    memmove(&p->allocs[i + 1], &p->allocs[i], (p->n_allocs - i) * sizeof *p->allocs);
    p->allocs[i] = (allocation){addr, len, c};
    p->n_allocs++;
    p->allocated += len;
    *out = (void *)addr;
out:
    pthread_mutex_unlock(&p->lock);
    return st;
}

/* Take fully free chunks beyond the retention budget out of the pool;
 * returns them as a list for chunk_release() once the lock is dropped. */
static chunk *trim(kvpi_pool *p)
{
    size_t retained = 0;
    chunk *out = NULL;
    for (size_t i = 0; i < p->n_chunks;) {
        chunk *c = p->chunks[i];
        if (c->used == 0 && retained + c->size > p->opts.retain_bytes) {
            p->mapped -= c->size;
            c->next_release = out;
            out = c;
            p->chunks[i] = p->chunks[--p->n_chunks];
            continue;
        }
        if (c->used == 0) retained += c->size;
        i++;
    }
    return out;
}

kvp_status kvpi_pool_free(kvpi_pool *p, void *addr)
{
    kvp_status st = KVP_OK;
    chunk *released = NULL;
    pthread_mutex_lock(&p->lock);
    size_t i = alloc_index(p, (uintptr_t)addr);
    if (i == p->n_allocs || p->allocs[i].addr != (uintptr_t)addr) {
        st = kvpi_error(KVP_EINVAL, "buffer pool: %p is not a live managed buffer", addr);
        goto out;
    }
    allocation a = p->allocs[i];
    if (chunk_give(a.owner, a.addr - (uintptr_t)a.owner->base, a.len)) {
        st = kvpi_error(KVP_ENOMEM, "buffer pool: out of memory");
        goto out;
    }
    memmove(&p->allocs[i], &p->allocs[i + 1], (p->n_allocs - i - 1) * sizeof *p->allocs);
    p->n_allocs--;
    p->allocated -= a.len;
    released = trim(p);
out:
    pthread_mutex_unlock(&p->lock);
    while (released) {
        chunk *next = released->next_release;
        chunk_release(p, released);
        released = next;
    }
    return st;
}

void kvpi_pool_get_stats(kvpi_pool *p, kvpi_pool_stats *out)
{
    pthread_mutex_lock(&p->lock);
    out->chunks = p->n_chunks;
    out->mapped = p->mapped;
    out->allocated = p->allocated;
    out->allocations = p->n_allocs;
    pthread_mutex_unlock(&p->lock);
}
