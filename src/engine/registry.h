/* Internal: the registered regions of the local segment.
 *
 * Transport servers check every remote request against it and pin the region
 * the request touches while its bytes move. A pin is a count on that one
 * region, taken and dropped under a short lock that is never held across
 * I/O: pinning never blocks registering, unregistering or pinning any other
 * memory, however long the pinned request lasts. Unregistering a region stops
 * new pins of it at once and waits only for its own pins to drop; the servers'
 * request deadlines bound how long a pin can last. Thread-safe.
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

typedef struct kvpi_reg_entry kvpi_reg_entry;

typedef struct kvpi_registry {
    pthread_mutex_t lock;
    pthread_cond_t unpinned;  /* a region being removed lost its last pin */
    kvpi_reg_entry **entries; /* sorted by addr, non-overlapping */
    size_t count, cap;        /* count includes regions being removed */
} kvpi_registry;

/* A pinned region, to hand back to kvpi_registry_unpin(). */
typedef kvpi_reg_entry *kvpi_pin;

void kvpi_registry_init(kvpi_registry *r);
void kvpi_registry_destroy(kvpi_registry *r);

/* KVP_EINVAL if it overlaps a registered region (also one being removed) or
 * wraps around. */
kvp_status kvpi_registry_add(kvpi_registry *r, uint64_t addr, uint64_t length);
/* KVP_ENOTFOUND if no region starts at addr. Refuses new pins of the region at
 * once, then waits for its pins to drop; other regions stay usable. */
kvp_status kvpi_registry_remove(kvpi_registry *r, uint64_t addr);

/* Pin: on KVP_OK, [addr, addr+length) lies inside one region, *pin holds it and
 * the caller must kvpi_registry_unpin() it when done touching the memory.
 * KVP_ERANGE otherwise (nothing to unpin). Never waits for I/O. */
kvp_status kvpi_registry_pin(kvpi_registry *r, uint64_t addr, uint64_t length, kvpi_pin *pin);
void kvpi_registry_unpin(kvpi_registry *r, kvpi_pin pin);

/* Copy of the regions (malloc'ed, caller frees) for publishing; regions being
 * removed are left out. */
kvp_status kvpi_registry_snapshot(kvpi_registry *r, kvpi_region **out, size_t *count);

/* Non-zero if [addr, addr+length) lies inside one of the n regions; a pure
 * helper shared with the client-side check against a peer's descriptor. */
int kvpi_regions_contain(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length);

/* Is [addr, addr+length) memory this process can serve to peers? Checks that
 * every page of the range is mapped (msync MS_ASYNC: one system call, no page
 * touched, microseconds for a GiB) and that its first and last bytes can be
 * read (written to a pipe, so a fault is an EFAULT and not a crash). Catches
 * unmapped ranges and GPU device pointers (their address space is reserved
 * but not readable from the CPU); a PROT_NONE hole inside an otherwise
 * readable range passes. KVP_EINVAL with a message saying what memory kvpipe
 * can serve. */
kvp_status kvpi_memory_check_host(const void *addr, size_t length);

/* Only the mapping part of that check, cheap enough for every request:
 * non-zero if every page of the range is mapped. */
int kvpi_memory_mapped(const void *addr, size_t length);

#endif
