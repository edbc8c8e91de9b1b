/* Internal: memory regions, and the table of a segment's registered ones.
 *
 * Layer-neutral: the engine fills the table (kvp_engine_register and the
 * buffer pool), transport servers check every remote request against it and
 * pin the region a request touches while its bytes move, and the engine pins
 * a local region while a transport that registered it uses its handle.
 *
 * A pin is a count on that one region, taken and dropped under a short lock
 * that is never held across I/O: pinning never blocks registering,
 * unregistering or pinning any other memory, however long the pinned request
 * lasts. Unregistering a region stops new pins of it at once and waits only
 * for its own pins to drop; the servers' request deadlines bound how long a
 * pin can last. Thread-safe.
 *
 * Adding and removing are two-phase, so that the transports' registrations of
 * a region (kvpi_transport_ops.mem_reg) happen while the region is reserved
 * but not yet visible, and their deregistrations after the last pin dropped:
 *   add:    kvpi_region_add (reserved: blocks overlapping adds, not pinnable,
 *           not listed) -> fill handle[] -> kvpi_region_activate, or
 *           kvpi_region_discard on failure;
 *   remove: kvpi_region_remove_begin (no new pins; waits for pins) ->
 *           deregister -> kvpi_region_remove_end.
 */
#ifndef KVPI_COMMON_REGION_H
#define KVPI_COMMON_REGION_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpipe/engine.h"
#include "kvpipe/status.h"

/* Transports one engine runs at most: the size of a region's handle slots. */
#define KVPI_MAX_TRANSPORTS 8

/* The bit of a memory kind in a kind mask (kvpi_transport_ops.mem_kinds). */
#define KVPI_MEM_BIT(kind) (1u << (unsigned)(kind))
#define KVPI_MEM_HOST_BIT KVPI_MEM_BIT(KVP_MEM_HOST)

typedef struct kvpi_region {
    uint64_t addr;
    uint64_t length;
    kvp_mem_kind kind;
    int device; /* the kind's device (the CUDA ordinal); 0 for host memory */
    /* In the local table: what each transport's mem_reg returned, indexed by
     * the transport's slot (its place in the engine's transport list); NULL
     * where a transport keeps none. Always NULL in a peer's regions. */
    void *handle[KVPI_MAX_TRANSPORTS];
} kvpi_region;

/* A kind a peer's descriptor names that this build does not know; no
 * transport's mem_kinds holds it. */
#define KVPI_MEM_KIND_UNKNOWN ((kvp_mem_kind)31)

/* The kinds this build knows are 0 .. KVPI_N_MEM_KINDS - 1. */
#define KVPI_N_MEM_KINDS 2

/* The names of the kinds, in messages and descriptors alike. */

/* "host", "cuda"; "unknown" for a value this build does not know. */
const char *kvpi_mem_kind_name(kvp_mem_kind kind);
/* The kind of a name; KVPI_MEM_KIND_UNKNOWN for one this build does not know. */
kvp_mem_kind kvpi_mem_kind_parse(const char *name);
/* The kinds of a mask (KVPI_MEM_BIT) in buf: "host", "host and cuda" (and
 * "a, b and c" for three); "" for none. Returns buf. */
const char *kvpi_mem_kinds_names(unsigned kinds, char *buf, size_t size);

typedef struct kvpi_region_entry kvpi_region_entry;

typedef struct kvpi_region_table {
    pthread_mutex_t lock;
    pthread_cond_t unpinned;     /* a region being removed lost its last pin */
    kvpi_region_entry **entries; /* sorted by addr, non-overlapping */
    size_t count, cap;           /* count includes reserved and removing ones */
    atomic_size_t non_host;      /* active regions of a kind other than host */
} kvpi_region_table;

/* A pinned region, to hand back to kvpi_region_unpin(). */
typedef kvpi_region_entry *kvpi_pin;

void kvpi_region_table_init(kvpi_region_table *t);
/* Frees every entry; their handles must have been deregistered. */
void kvpi_region_table_destroy(kvpi_region_table *t);

/* Reserve r (addr, length, kind, device; its handles are copied as given).
 * KVP_EINVAL if it is empty, wraps around or overlaps a region of the table
 * (reserved, active or being removed). *out is the entry, to fill with
 * kvpi_region_of() and then activate or discard; only its adder touches it
 * until then. */
kvp_status kvpi_region_add(kvpi_region_table *t, const kvpi_region *r, kvpi_region_entry **out);
/* The region of an entry the caller reserved or is removing. */
kvpi_region *kvpi_region_of(kvpi_region_entry *e);
/* Make a reserved entry pinnable and listed. */
void kvpi_region_activate(kvpi_region_table *t, kvpi_region_entry *e);
/* Drop a reserved entry that was never activated. */
void kvpi_region_discard(kvpi_region_table *t, kvpi_region_entry *e);

/* Start removing the active region that starts at addr: refuses new pins of
 * it at once, then waits for its pins to drop; other regions stay usable.
 * The entry stays reserved (its range cannot be added again) until
 * kvpi_region_remove_end(). KVP_ENOTFOUND if no active region starts there. */
kvp_status kvpi_region_remove_begin(kvpi_region_table *t, uint64_t addr, kvpi_region_entry **out);
void kvpi_region_remove_end(kvpi_region_table *t, kvpi_region_entry *e);

/* Pin: on KVP_OK, [addr, addr+length) lies inside one active region whose
 * kind is in the mask kinds (KVPI_MEM_BIT), *pin holds it, and the caller
 * must kvpi_region_unpin() it when done touching the memory or its handles.
 * KVP_ERANGE otherwise (nothing to unpin). Never waits for I/O. */
kvp_status kvpi_region_pin(kvpi_region_table *t, uint64_t addr, uint64_t length, unsigned kinds,
                           kvpi_pin *pin);
/* The pinned region; valid until the pin is dropped. */
const kvpi_region *kvpi_pin_region(kvpi_pin pin);
void kvpi_region_unpin(kvpi_region_table *t, kvpi_pin pin);

/* How many regions are active, and their bytes (for the metrics). */
void kvpi_region_totals(kvpi_region_table *t, size_t *count, uint64_t *bytes);

/* Pin every active region, in address order, for publishing them with their
 * handles: *pins (malloc'ed) holds *count pins, to drop with
 * kvpi_region_unpin_all(). Regions reserved or being removed are left out. */
kvp_status kvpi_region_pin_all(kvpi_region_table *t, kvpi_pin **pins, size_t *count);
void kvpi_region_unpin_all(kvpi_region_table *t, kvpi_pin *pins, size_t count);

/* The kind (and device) of local memory [addr, addr+length): that of the
 * active region holding it whole; host where none does. Costs nothing while
 * every region is host memory. */
kvp_mem_kind kvpi_region_kind_at(kvpi_region_table *t, uint64_t addr, uint64_t length, int *device);
/* The same, always looking: non-zero when an active region holds the range
 * whole (then *kind and *device are its), 0 otherwise (host, 0). */
int kvpi_region_kind_find(kvpi_region_table *t, uint64_t addr, uint64_t length, kvp_mem_kind *kind,
                          int *device);

/* Index of the one of the n sorted regions that holds [addr, addr+length)
 * whole, or -1; a pure helper, also for the client-side check against a
 * peer's descriptor. */
long kvpi_regions_find(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length);
/* Non-zero if one of the n sorted regions holds [addr, addr+length). */
int kvpi_regions_contain(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length);

/* Is [addr, addr+length) host memory this process can serve to peers? Checks
 * that every page of the range is mapped (msync MS_ASYNC: one system call, no
 * page touched, microseconds for a GiB) and that its first and last bytes can
 * be read (written to a pipe, so a fault is an EFAULT and not a crash).
 * Catches unmapped ranges and GPU device pointers (their address space is
 * reserved but not readable from the CPU); a PROT_NONE hole inside an
 * otherwise readable range passes. KVP_EINVAL with a message saying what
 * memory kvpipe can serve. */
kvp_status kvpi_memory_check_host(const void *addr, size_t length);

/* Only the mapping part of that check, cheap enough for every request:
 * non-zero if every page of the range is mapped. */
int kvpi_memory_mapped(const void *addr, size_t length);

/* Can the CPU read the first and last byte of [addr, addr+length)? For a
 * tensor the pipe copies (GPU memory is not readable): one system call
 * (process_vm_readv of this process). 1 yes, 0 no (a fault), -1 when it
 * cannot tell (the call is not allowed here). length 0: 1. */
int kvpi_memory_readable(const void *addr, size_t length);

#endif
