/* Internal: the registered regions of the local segment.
 *
 * Transport servers check every remote request against it. A region being read
 * or written by a server is pinned by a read lock, so unregistering waits until
 * no request touches it. Thread-safe.
 */
#ifndef KVPI_ENGINE_REGISTRY_H
#define KVPI_ENGINE_REGISTRY_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpipe/status.h"

typedef struct kvpi_region {
    uint64_t addr;
    uint64_t length;
} kvpi_region;

typedef struct kvpi_registry {
    pthread_rwlock_t lock;
    kvpi_region *regions; /* sorted by addr, non-overlapping */
    size_t count, cap;
} kvpi_registry;

void kvpi_registry_init(kvpi_registry *r);
void kvpi_registry_destroy(kvpi_registry *r);

/* KVP_EINVAL if it overlaps a registered region or wraps around. */
kvp_status kvpi_registry_add(kvpi_registry *r, uint64_t addr, uint64_t length);
/* KVP_ENOTFOUND if no region starts at addr. Waits for pinned requests. */
kvp_status kvpi_registry_remove(kvpi_registry *r, uint64_t addr);

/* Pin: on KVP_OK, [addr, addr+length) lies inside one region and the caller
 * must call kvpi_registry_unpin() when done touching it. KVP_ERANGE otherwise
 * (nothing to unpin). */
kvp_status kvpi_registry_pin(kvpi_registry *r, uint64_t addr, uint64_t length);
void kvpi_registry_unpin(kvpi_registry *r);

/* Copy of the regions (malloc'ed, caller frees) for publishing. */
kvp_status kvpi_registry_snapshot(kvpi_registry *r, kvpi_region **out, size_t *count);

/* Non-zero if [addr, addr+length) lies inside one of the n regions; a pure
 * helper shared with the client-side check against a peer's descriptor. */
int kvpi_regions_contain(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length);

#endif
