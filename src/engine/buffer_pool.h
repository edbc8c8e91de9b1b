/* Internal: managed buffers, carved from engine-owned registered chunks.
 *
 * Chunks are mappings of at least chunk_size bytes (larger for a larger
 * request), made by the map hook (default: anonymous 2 MiB-aligned mappings
 * with transparent huge pages, kvpi_pool_map_default), registered through the
 * register hook when created and unregistered, then unmapped, when released.
 * Allocation sizes are rounded to size classes (powers of two up to 64 KiB,
 * then multiples of 64 KiB) and served first-fit from each chunk's free
 * extents, which coalesce on free. Allocator state lives outside the chunks,
 * so a peer writing into registered memory cannot corrupt it. Fully free
 * chunks are kept up to retain_bytes and returned to the system beyond that,
 * so the pool does not grow without bound. Thread-safe.
 */
#ifndef KVPI_ENGINE_BUFFER_POOL_H
#define KVPI_ENGINE_BUFFER_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/engine.h"
#include "kvpipe/status.h"

typedef struct kvpi_pool kvpi_pool;

/* Called with the pool's lock held (register_chunk, map_chunk) or without it
 * (unregister_chunk, unmap_chunk: releasing waits for requests on the chunk),
 * never for a chunk the pool still hands out. */
typedef struct kvpi_pool_hooks {
    void *ctx;
    /* Map length bytes (a multiple of 2 MiB) of the pool's kind of memory;
     * NULL: kvpi_pool_map_default(). */
    kvp_status (*map_chunk)(void *ctx, size_t length, void **addr);
    /* With map_chunk, required; NULL: kvpi_pool_unmap_default(). */
    void (*unmap_chunk)(void *ctx, void *addr, size_t length);
    /* Register a new chunk (of the pool's kind) / unregister it. */
    kvp_status (*register_chunk)(void *ctx, void *addr, size_t length);
    void (*unregister_chunk)(void *ctx, void *addr);
} kvpi_pool_hooks;

typedef struct kvpi_pool_opts {
    size_t chunk_size;   /* default 64 MiB */
    size_t retain_bytes; /* fully free chunks kept, default 1 GiB */
    size_t max_bytes;    /* cap on all chunks, 0 = none */
    kvp_mem_kind kind;   /* what memory the chunks are (the map hook's) */
    int device;
} kvpi_pool_opts;

/* Anonymous private mapping of length bytes at a 2 MiB boundary, with
 * transparent huge pages asked for; KVP_ENOMEM when it cannot be mapped. */
kvp_status kvpi_pool_map_default(size_t length, void **addr);
void kvpi_pool_unmap_default(void *addr, size_t length);

kvp_status kvpi_pool_create(const kvpi_pool_opts *opts, const kvpi_pool_hooks *hooks,
                            kvpi_pool **out);
/* Releases every chunk, allocated or not. */
void kvpi_pool_destroy(kvpi_pool *pool);

/* The kind (and device) of memory the pool holds. */
kvp_mem_kind kvpi_pool_kind(const kvpi_pool *pool, int *device);

kvp_status kvpi_pool_alloc(kvpi_pool *pool, size_t length, void **out);
/* KVP_EINVAL for an address not handed out by this pool (or already freed). */
kvp_status kvpi_pool_free(kvpi_pool *pool, void *addr);

typedef struct kvpi_pool_stats {
    size_t chunks;      /* chunks mapped */
    size_t mapped;      /* bytes in chunks */
    size_t allocated;   /* bytes handed out (after rounding) */
    size_t allocations; /* live allocations */
} kvpi_pool_stats;
void kvpi_pool_get_stats(kvpi_pool *pool, kvpi_pool_stats *out);

/* The size class a request of length bytes is rounded to (0 on overflow). */
size_t kvpi_pool_size_class(size_t length);

#endif
