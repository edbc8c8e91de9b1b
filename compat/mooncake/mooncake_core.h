/* Internal: Mooncake Transfer Engine's semantics on kvpipe's public engine
 * API, once, for both of kvpipe's Mooncake facades: the C API
 * (transfer_engine_c.c, libkvpipe_mooncake.so) and Python's
 * kvpipe.TransferEngine / mooncake.engine (python/engine_py.c), which bind to
 * it thinly. It holds what Mooncake has and kvpipe's engine does not:
 *
 *  - one region table: the memory registered through the facade
 *    (published or only remembered, as the C API's remote_accessible = 0)
 *    and the managed buffers it allocated, with Mooncake's overlap check,
 *    all-or-nothing batch registration, and what the CPU may copy
 *    (Python's read/write_bytes);
 *  - one segment-id map: Mooncake's ids are int32 with 0 this engine's own
 *    segment; id n > 0 is kvpipe's n - 1; names have their leading '/'
 *    stripped as Mooncake does;
 *  - one batch-id map: a Mooncake batch has a capacity, takes several
 *    submits, and each request names its own segment; here it is a list of
 *    kvpipe batches ("chunks"), one per run of consecutive requests to one
 *    segment, whose completions (kvp_batch_opts.on_complete) count down
 *    without polling; task ids count across submits; the notification of
 *    submitTransferWithNotify is sent by the status call that first finds
 *    every request completed, as Mooncake sends it;
 *  - Mooncake's error codes (kvmc_err, kvmc_code).
 *
 * It sees only include/kvpipe/ (a client of libkvpipe like any program).
 * Every function is thread-safe, except kvmc_destroy (the last call). None
 * touches Python; the facades add their conventions (Python returns
 * -kvp_status, the C API Mooncake's codes) on top. */
#ifndef KVPIPE_MOONCAKE_CORE_H
#define KVPIPE_MOONCAKE_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/engine.h"

/* The detail of this thread's last failed call here: the core's own words
 * where it refused something itself, else kvp_last_error(). */
const char *kvmc_last_error(void);

/* Mooncake's error.h values (negative) and its Status codes (positive). */
enum {
    KVMC_ERR_INVALID_ARGUMENT = -1,
    KVMC_ERR_TOO_MANY_REQUESTS = -2,
    KVMC_ERR_ADDRESS_NOT_REGISTERED = -3,
    KVMC_ERR_BATCH_BUSY = -4,
    KVMC_ERR_ADDRESS_OVERLAPPED = -7,
    KVMC_ERR_SOCKET = -102,
    KVMC_ERR_MALFORMED_JSON = -103,
    KVMC_ERR_REJECT_HANDSHAKE = -104,
    KVMC_ERR_METADATA = -200,
    KVMC_ERR_MEMORY = -302,
    KVMC_ERR_NOT_IMPLEMENTED = -303,
};
#define KVMC_STATUS_NOT_IMPLEMENTED 999

/* A kvpipe status as Mooncake's negative error (docs/mooncake-c-api.md). */
int kvmc_err(kvp_status st);
/* A Mooncake error as the positive Status code the batch calls return. */
int kvmc_code(int err);

/* What a call did: Mooncake's error (0, or negative) and kvpipe's status
 * (KVP_OK, or why, with kvp_last_error() set on this thread). */
typedef struct kvmc_rc {
    int mc;
    kvp_status st;
} kvmc_rc;

typedef struct kvmc_engine kvmc_engine;

/* ---- the engine ---- */

/* Create the engine: local_server_name "host:port", or a bare host
 * ("10.0.0.1", "::1", "[::1]"), which gets a free port as Mooncake picks
 * one; protocol NULL or "" is "tcp"; env KVPIPE_PROTOCOL replaces it (stacks
 * written for Mooncake hard-code "rdma"), env KVPIPE_DISABLE_SHM (anything
 * but "" or "0") keeps same-host peers off shm; devices NULL or "": none.
 * Blocks for kvp_engine_create. */
kvp_status kvmc_create(const char *local_server_name, const char *metadata, const char *protocol,
                       const char *devices, kvmc_engine **out);
/* Free every batch (running requests cancelled, or with graceful waited
 * for, each bounded by the engine's deadlines), then destroy the engine.
 * NULL is a no-op. */
void kvmc_destroy(kvmc_engine *e, int graceful);
kvp_engine *kvmc_kvp(const kvmc_engine *e);
/* The protocol the engine was created with. */
const char *kvmc_protocol(const kvmc_engine *e);

/* ---- the region table ---- */

/* Register [addr, +length): published (kvp_engine_register) unless
 * publish is 0 (only remembered, as remote_accessible = 0). A range
 * overlapping one in the table: KVMC_ERR_ADDRESS_OVERLAPPED, KVP_EINVAL. */
kvmc_rc kvmc_register(kvmc_engine *e, void *addr, size_t length, int publish);
/* Register n regions, all or nothing: on a failure the ones this call
 * registered are unregistered again. */
kvmc_rc kvmc_register_all(kvmc_engine *e, void *const *addrs, const size_t *lengths, size_t n);
/* Unregister the region that starts at addr (not a managed buffer):
 * KVMC_ERR_ADDRESS_NOT_REGISTERED, KVP_ENOTFOUND when there is none. */
kvmc_rc kvmc_unregister(kvmc_engine *e, void *addr);
/* A managed buffer (kvp_engine_alloc), in the table. */
kvp_status kvmc_alloc(kvmc_engine *e, size_t length, void **out);
/* Free a managed buffer (kvp_engine_free). */
kvp_status kvmc_free(kvmc_engine *e, void *addr);
/* Why the CPU may not copy [addr, +length), or NULL: it must lie whole in a
 * region or managed buffer of the table that is not GPU memory. *st says
 * KVP_ERANGE (outside) or KVP_ENOTSUP (GPU memory). */
const char *kvmc_copy_refusal(kvmc_engine *e, uint64_t addr, size_t length, kvp_status *st);

/* ---- the segment-id map ---- */

/* Open a segment by name (leading '/' stripped; kvp_engine_open_segment,
 * which looks it up the first time): Mooncake's id (> 0) in *mc_id and
 * kvpipe's in *out (either may be NULL). Names opened before are answered
 * from the map without a lookup. */
kvp_status kvmc_open(kvmc_engine *e, const char *name, int32_t *mc_id, kvp_segment_id *out);
/* kvpipe's segment of a Mooncake id: 0 (LOCAL_SEGMENT) opens this engine's
 * own segment on first use; an id never opened is KVP_EINVAL. */
kvp_status kvmc_resolve(kvmc_engine *e, int64_t mc_id, kvp_segment_id *out);
/* The kvpipe id of a name opened before, without a lookup: 0 if none. */
int kvmc_lookup(kvmc_engine *e, const char *name, kvp_segment_id *out);
/* kvp_engine_probe of name, then kvmc_open. */
kvp_status kvmc_probe(kvmc_engine *e, const char *name, int32_t *mc_id, kvp_segment_id *out);
/* kvp_engine_probe of every segment opened; every one is tried, the first
 * failure returned. */
kvp_status kvmc_probe_all(kvmc_engine *e);
/* Call fn for each segment opened, by Mooncake id, under the map's lock (fn
 * must not call back in). */
void kvmc_each_segment(kvmc_engine *e, void (*fn)(void *arg, int32_t mc_id, const char *name),
                       void *arg);

/* ---- the batch-id map ---- */

/* One request of a Mooncake batch. */
typedef struct kvmc_request {
    kvp_opcode opcode;
    void *local;
    int64_t target;  /* Mooncake segment id (kvmc_open; 0: own segment) */
    uint64_t remote; /* address in the peer's registered memory */
    uint64_t length;
} kvmc_request;

/* A batch of up to capacity requests: its id (never 0), or 0 when out of
 * memory. */
uint64_t kvmc_batch_new(kvmc_engine *e, size_t capacity);
/* Submit n requests (runs of one segment each become kvpipe batches);
 * notify (name and msg not NULL, n > 0) replaces the batch's notification.
 * One bad request (opcode, no local memory, a segment never opened) or no
 * room left submits nothing. Returns Mooncake's Status code (0; 1 invalid
 * argument, 2 too many requests, ...) with kvpipe's status. */
kvmc_rc kvmc_batch_submit(kvmc_engine *e, uint64_t id, const kvmc_request *reqs, size_t n,
                          const char *notify_name, const char *notify_msg);
/* A task's status: kvp_batch_request_status (KVP_EINPROGRESS while it
 * runs), with its length in *bytes. The call that first finds every
 * request completed successfully sends the batch's notification, before it
 * returns. KVP_EINVAL for an unknown batch or task. */
kvp_status kvmc_task_status(kvmc_engine *e, uint64_t id, size_t task, kvp_status *status,
                            uint64_t *bytes);
/* Whether every request submitted to the batch completed (counted by the
 * completion callbacks, not polled), and then the first failed one's status
 * (KVP_OK if none). KVP_EINVAL for an unknown batch. Does not block. */
kvp_status kvmc_batch_progress(kvmc_engine *e, uint64_t id, int *complete, kvp_status *first_error);
/* Have 1 added to eventfd fd once every request submitted to the batch so
 * far completed (at once if they have): a waiter polls fd. fd -1 takes the
 * batch's watch away. One fd per batch: KVP_EBUSY while another is set. */
kvp_status kvmc_batch_watch(kvmc_engine *e, uint64_t id, int fd);
/* Free the batch: KVMC_ERR_BATCH_BUSY (KVP_EBUSY) while a request runs,
 * unless force (then its requests are cancelled and waited for).
 * KVMC_ERR_INVALID_ARGUMENT for an unknown batch. */
kvmc_rc kvmc_batch_free(kvmc_engine *e, uint64_t id, int force);

#endif
