/* Internal: the transport ops table.
 *
 * A transport moves bytes between local memory and a peer's registered memory,
 * and owns everything about itself: its listener, the fields it publishes in
 * the segment descriptor (top-level and per buffer), how it registers memory,
 * and how it reads a peer's descriptor. The engine knows nothing of sockets,
 * shared memory or remote keys; it
 *   - starts every transport's server at creation (server_start), in the
 *     order of kvpi_transports[]; the index of a transport in that list is
 *     its slot (kvpi_region.handle[slot]);
 *   - calls mem_reg on every running server for each region registered
 *     (kvp_engine_register_mem, and each chunk of the buffer pool), before
 *     the region is visible to anyone, rolling back in reverse order when
 *     one fails; mem_dereg on each after the region's last pin dropped;
 *   - renders the descriptor: the core fields (name, protocol, timestamp,
 *     buffers with name/addr/length, descriptor.h), then each running
 *     server's server_describe and, for each region, buffer_describe;
 *   - for a peer, picks transports by capability, protocol and memory kind
 *     (never by name; engine/segment.c) and opens them with peer_open; a
 *     transport that cannot serve that peer returns KVP_ENOTSUP with the
 *     reason in kvp_last_error(), and the engine tries the next.
 *
 * Threads (for every op): server_start and server_stop run on the thread
 * that creates or destroys the engine, never concurrently with any other op
 * on that server. Every other op may run on any thread, concurrently with
 * itself and with every other op except server_stop: mem_reg/mem_dereg on
 * the application's threads (kvp_engine_register and the pool), the describe
 * ops on whichever thread publishes, peer_open and peer_close on the
 * engine's workers, peer_post on whichever thread submits (the
 * application's, or an engine worker after a lookup; several at once on one
 * peer), peer_run on the thread of a synchronous transfer, server_progress
 * and server_wait_fd on the threads that wait for transfers. A server's own
 * threads (its listener, its progress or I/O threads) are its business; they
 * must stop in server_stop.
 *
 * Transfers are asynchronous: peer_post hands the transport an xfer (a
 * group of slices) and returns; the transport calls the xfer's completion
 * once, later, from a thread that moves or progresses it, or at once when it
 * refuses it. peer_run is the synchronous form: the xfer on the calling
 * thread, complete when it returns; the engine runs the last xfer of a
 * synchronous transfer (kvp_engine_read/write) so, which saves the thread
 * wake-ups that cost most of a small request's time (a 4 KiB READ over
 * loopback tcp: 8 us at the median in the caller, 15 us through a runner
 * thread). Two kinds of transport:
 *   - Blocking I/O (tcp, shm): the transport runs each posted xfer on
 *     threads it owns (transport/runner.h); peer_run does its I/O on the
 *     caller's. Nothing else drives them: their progress is a no-op (they
 *     leave server_progress and server_wait_fd out).
 *   - Manual progress (ucx; UCT's uct_iface_progress, libfabric's
 *     FI_PROGRESS_MANUAL): peer_post issues nonblocking requests, and the
 *     completions come when something drives the transport's progress
 *     (server_progress). Who drives: peer_run's caller, until its xfer
 *     completed; kvp_batch_wait, for the transports its batch posted to,
 *     while that makes progress, sleeping in poll() on their server_wait_fd
 *     and the batch's own wake-up in between; and the transport's own
 *     thread, for what no one waits on as it runs (a posted xfer: a batch
 *     nobody waits on yet, as the pipe's) and what the server does as a
 *     target.
 * Cancel is a flag the poster sets (kvpi_xfer.canceled), then server_cancel
 * to complete at once what waits unstarted.
 *
 * Errors: every fallible op returns a kvp_status and, on failure, sets
 * kvp_last_error() to one line naming the peer, region or field; outputs are
 * set only on success. No op may block beyond the deadlines its context
 * gives (timeout_ms + bytes / min_rate).
 */
#ifndef KVPI_TRANSPORT_H
#define KVPI_TRANSPORT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/auth.h"
#include "common/conn_server.h"
#include "common/metrics.h"
#include "common/region.h"
#include "kvpipe/engine.h"

/* One contiguous piece of a request, posted in an xfer. The engine checked
 * [remote, remote+length) against the peer's descriptor before the call: it
 * lies inside regions[remote_region] of the peer's context, whatever the
 * transport (for one-sided transports, KVPI_CAP_RDMA, that check is the only
 * one: the target's CPU sees nothing). */
typedef struct kvpi_slice {
    kvp_opcode opcode;
    void *local;
    uint64_t remote;
    size_t length;
    kvp_status status;    /* the transport sets it: KVP_OK or the slice's error */
    size_t remote_region; /* index into kvpi_peer_ctx.regions */
    /* KVPI_CAP_NEEDS_LOCAL_REG transports only: this transport's mem_reg
     * handle of the registered local region that holds [local, +length)
     * whole, pinned (its unregistration waits) until the xfer completes; NULL
     * when the local memory is not registered as one region. A transport
     * that gets NULL copes (registers or bounces it) or fails the slice with
     * KVP_EINVAL saying why. Always NULL for other transports. */
    void *local_handle;
    /* What the local memory is (the engine's classification, cached per
     * registered region, gpu/cuda.h): a transport whose mem_kinds holds
     * KVP_MEM_CUDA must never touch device memory with the CPU (tcp and shm
     * stage it, transport/staging.h). Zero-initialised: host memory. */
    kvp_mem_kind local_kind;
    int local_device;
} kvpi_slice;

/* A group of slices posted to a peer (peer_post): all READ or all WRITE,
 * n <= KVPI_XFER_MAX, at most the transport's group_bytes together unless
 * n == 1. Ownership: the poster owns x, the slices and the memory they
 * name; the transport uses them from peer_post until it calls done, and
 * after done touches none of them again - not the local memory, not the
 * slices, not x (the poster may free it in done). */
typedef struct kvpi_xfer kvpi_xfer;
struct kvpi_xfer {
    kvpi_slice *const *slices;
    size_t n;
    /* Set by the poster at any time before done runs. A slice the transport
     * has not started completes with KVP_ECANCELED without touching memory;
     * a started one finishes, or fails at its deadline, first. So done's
     * promise holds for a cancelled xfer too: once it ran, nothing of it is
     * in flight. */
    atomic_int canceled;
    /* Called exactly once, every slice's status set, with: KVP_OK; the
     * connection-level error that failed some slices (KVP_ECONNRESET,
     * KVP_ECONNREFUSED, KVP_ETIMEDOUT); KVP_ERANGE when the peer refused a
     * slice (outside its registered memory now: its registrations changed)
     * and the others still ran; KVP_ECANCELED when cancelled slices are its
     * only failures. kvp_last_error() on the calling thread describes a
     * failure. done must neither block nor call this peer's ops (it may run
     * inside the transport's progress): the engine hands what follows (a
     * lookup, a retry, closing the peer) to its own workers. After a failure
     * the engine closes this peer (once nothing uses it) and looks the
     * segment up again before the next transfer. */
    void (*done)(kvpi_xfer *x, kvp_status st);
    /* The transport's, between peer_post and done. */
    kvpi_xfer *next;
    void *peer;
    kvp_status (*run)(void *peer, kvpi_slice *const *slices, size_t n, uint64_t start_ns,
                      uint64_t deadline);
    void *lane;
};

/* The statuses that say the peer, not a slice, failed: the peer timed out,
 * reset or refused. */
static inline int kvpi_connection_level(kvp_status st)
{
    return st == KVP_ETIMEDOUT || st == KVP_ECONNRESET || st == KVP_ECONNREFUSED;
}

#define KVPI_XFER_MAX 64

typedef struct kvpi_server_ctx {
    const char *segment;        /* the local segment name, for messages */
    const char *host;           /* the engine's host, to bind on */
    kvpi_region_table *regions; /* check every remote request against it */
    const char *device_names;   /* kvp_engine_opts.device_names, or NULL */
    /* The listener's limits (common/conn_server.h; 0: its default). */
    int timeout_ms;
    int idle_timeout_ms;
    int max_conns;
    uint64_t min_rate;
    /* Non-NULL in the authenticated mode (common/auth.h): the server must
     * refuse a connection whose peer does not prove the key, before serving
     * any request on it - with a conn_server, setup = kvpi_auth_conn_setup. */
    const kvpi_auth *auth;
    /* Where the server counts the requests it serves (may be NULL). */
    kvpi_served *served;
} kvpi_server_ctx;

typedef struct kvpi_peer_ctx {
    const char *segment; /* the peer's segment name, for messages */
    const char *host;    /* where the peer's servers listen (rpc_meta) */
    const cJSON *desc;   /* the peer's whole descriptor: read your own fields */
    /* The descriptor's buffers, sorted by addr and non-overlapping, and the
     * JSON object of each (aligned: buffers[i] is regions[i]'s entry), for
     * per-buffer fields such as remote keys. */
    const kvpi_region *regions;
    const cJSON *const *buffers;
    size_t n_regions;
    /* This transport's local server, or NULL when it did not start here (a
     * transport that needs its server to reach peers refuses: KVP_ENOTSUP). */
    void *server;
    /* Each xfer must complete within timeout_ms + its bytes / min_rate
     * (bytes per second; 0: the default) from when the transport starts it,
     * waiting for a connection included; a transport that hands every
     * posted xfer to the wire at once (ucx) counts the bytes posted before
     * it and not completed too, since they go first. */
    int timeout_ms;
    uint64_t min_rate;
    int conns; /* connections to keep */
    /* Non-NULL in the authenticated mode: run kvpi_auth_client on every new
     * connection before any request (its failure is the peer's error). */
    const kvpi_auth *auth;
    /* Counts the requests run again on a new connection (may be NULL). */
    kvpi_counter *retries;
    /* Non-zero: integrity with this peer (this engine and the peer both
     * have it on, common/digest.h): digest every slice moved, and fail one
     * whose digests differ with KVP_ECORRUPT. A transport that cannot
     * ignores it (docs/reliability.md says which). */
    int integrity;
} kvpi_peer_ctx;

/* Everything in the contexts is valid only during the call; copy what a
 * server or peer keeps (the region table stays valid until server_stop). */

/* The connection-server limits of a listener started with ctx. */
static inline kvpi_conn_limits kvpi_server_limits(const kvpi_server_ctx *ctx)
{
    kvpi_conn_limits l = {.timeout_ms = ctx->timeout_ms,
                          .idle_timeout_ms = ctx->idle_timeout_ms,
                          .max_conns = ctx->max_conns,
                          .min_rate = ctx->min_rate};
    return l;
}

/* Capability flags (kvpi_transport_ops.caps), read by the selection in
 * engine/segment.c and the engine's registration path. */
/* Reaches only peers on this host; used automatically for them on top of a
 * network protocol, unless kvp_engine_opts.disable_shm. */
#define KVPI_CAP_SAME_HOST 0x1u
/* Local buffers of a request should be registered with this transport: the
 * engine looks each slice's local region up and passes its handle
 * (kvpi_slice.local_handle). */
#define KVPI_CAP_NEEDS_LOCAL_REG 0x2u
/* One-sided: the target's CPU checks nothing, what its registrations allow
 * (published per buffer by buffer_describe) is all it serves; the engine's
 * range check against the descriptor before each peer_post is mandatory. */
#define KVPI_CAP_RDMA 0x4u
/* Authenticates its connections in the authenticated mode (server_ctx and
 * peer_ctx .auth, common/auth.h). An engine with a key runs only such
 * transports: one without it would let a peer without the key in. */
#define KVPI_CAP_AUTH 0x8u

/* Small requests submitted back to back for one peer are posted in one xfer
 * together, up to this many bytes, so that the transport can pipeline them;
 * larger requests go one per call, spread over workers and connections. */
#define KVPI_GROUP_BYTES_DEFAULT ((size_t)1 << 20)

/* server_wait_fd: nothing to watch, the transport's own thread drives. */
#define KVPI_WAIT_FD_NONE (-2)

typedef struct kvpi_transport_ops {
    const char *name; /* "tcp", "shm": logs, kvp_engine_segment_transport() */
    /* Set for the transport whose wire Mooncake speaks: the descriptor's
     * "protocol" is this value, taken from the first running server (in
     * kvpi_transports[] order) that has one. Such a transport's server is
     * mandatory (the engine fails without it); other servers that fail to
     * start are left out (INFO), unless theirs is the protocol asked for. */
    const char *mooncake_protocol;
    unsigned caps;      /* KVPI_CAP_* */
    unsigned mem_kinds; /* KVPI_MEM_BIT() of each kvp_mem_kind it can move; not 0 */
    /* Bytes per xfer; 0 means KVPI_GROUP_BYTES_DEFAULT. Measured on
     * loopback TCP, 1 MiB requests ran 30% faster one per connection than
     * pipelined four to one; shm, whose round trips cost more than its copies
     * of small slices, does best with large groups. */
    size_t group_bytes;

    /* Required. Start serving peers: listen, take ctx->regions for checking
     * requests. *server is opaque to the engine. KVP_ENOTSUP when this
     * transport cannot run here (the reason in kvp_last_error()). */
    kvp_status (*server_start)(const kvpi_server_ctx *ctx, void **server);
    /* Required. Stop the listener and its threads, close its connections,
     * free the server. Called after every peer of the engine was closed and
     * every region registered with it was deregistered (mem_dereg), so a
     * server may own what its handles and peers use (a UCX context). */
    void (*server_stop)(void *server);
    /* Optional. The port this server listens on (for kvp_engine_data_port(),
     * which is the Mooncake transport's, and logs); NULL when it has none. */
    int (*server_port)(void *server);

    /* Required. Add this transport's top-level fields to the local
     * descriptor doc (tcp: tcp_data_port, tcp_proto_version; shm: its
     * endpoint). Only fields under keys the transport owns: never "name",
     * "buffers", "timestamp" or (except through mooncake_protocol)
     * "protocol". KVP_ENOMEM when cJSON cannot allocate. */
    kvp_status (*server_describe)(void *server, cJSON *doc);
    /* Optional. Add this transport's fields for one registered region to its
     * buffer entry (for example a packed remote key), handle being what its
     * mem_reg returned for it. The region stays pinned during the call. */
    kvp_status (*buffer_describe)(void *server, const kvpi_region *region, void *handle,
                                  cJSON *buffer);

    /* Optional (then regions need no registration with this transport).
     * Register a region (of a kind in mem_kinds; others are not passed) so
     * that peers can reach it through this server; *handle is kept in the
     * region's slot and given back to buffer_describe, peer_post
     * (local_handle) and mem_dereg. The region is not yet visible to peers
     * or pinnable during the call. On failure nothing stays registered; the
     * engine then deregisters what other transports registered and fails
     * the registration with this status. */
    kvp_status (*mem_reg)(void *server, const kvpi_region *region, void **handle);
    /* With mem_reg, required. Undo one mem_reg, after every pin of the
     * region dropped (no request through the engine touches it any more). A
     * peer that still holds a remote key for it must fail cleanly on its next
     * access, never reach the memory. Cannot fail. */
    void (*mem_dereg)(void *server, void *handle);

    /* Optional: the memory of the buffer pool's chunks (kvp_engine_alloc),
     * for a transport that moves special memory faster (ucx: memory UCX
     * allocates, which a same-host peer maps). The engine uses it when this
     * transport is its protocol's and its server runs, else anonymous 2
     * MiB-aligned mappings with transparent huge pages
     * (kvpi_pool_map_default). length is a multiple of 2 MiB; *addr must be
     * host memory that every other transport can serve. Chunks are then
     * registered like any region (all transports' mem_reg, this one's
     * included: it knows its chunks by their address and length). */
    kvp_status (*chunk_map)(void *server, size_t length, void **addr);
    /* With chunk_map, required: unmap a chunk after its unregistration. */
    void (*chunk_unmap)(void *server, void *addr, size_t length);

    /* Required. Prepare to reach the peer described by ctx: read this
     * transport's own fields of the descriptor (and of each buffer), check
     * it can serve this peer, and set up what a transfer needs (it may
     * connect once, within ctx->timeout_ms, to prove the peer reachable).
     * KVP_ENOTSUP when it cannot serve this peer (its fields are absent: a
     * Mooncake peer of another protocol, another host for a same-host
     * transport), saying why and what would work; the engine then tries the
     * next transport. Other errors (KVP_EPROTO for malformed fields of its
     * own, KVP_ECONNREFUSED, ...) fail the lookup when no other transport
     * serves. */
    kvp_status (*peer_open)(const kvpi_peer_ctx *ctx, void **peer);
    /* Required. Start moving x (see kvpi_xfer) within one deadline (see
     * kvpi_peer_ctx), in order or overlapped, and return without waiting for
     * the peer. Never fails: every outcome, an xfer refused at once
     * included, comes through x->done. */
    void (*peer_post)(void *peer, kvpi_xfer *x);
    /* Optional: move x on the calling thread, within its deadline, and call
     * x->done before returning (tcp, shm: the blocking I/O here; ucx: issue,
     * then drive progress until x completed). The engine calls it instead of
     * peer_post for the last xfer of a synchronous transfer, whose caller
     * waits for it anyway. */
    void (*peer_run)(void *peer, kvpi_xfer *x);
    /* Optional (for a transport that can hold xfers unstarted: a queue for
     * its threads). Complete now, with KVP_ECANCELED and without touching
     * their memory, the xfers of any peer of this server that wait unstarted
     * with their cancel flag set. Called after the poster set flags, on its
     * thread, holding no lock: the completions may run on it. Without this
     * op a flagged xfer completes when the transport would have started it. */
    void (*server_cancel)(void *server);
    /* Optional: manual progress (see the top of this file). Drive this
     * server's progress on the calling thread: at most budget rounds of each
     * thing it progresses (ucx: each UCP worker), then what came due (the
     * deadlines of its xfers, its peers' control messages). Completions
     * (kvpi_xfer.done) run inside it, on this thread. Returns how many
     * events it handled, 0 when nothing was ready or another thread is
     * progressing it right now. Any thread, concurrently with itself and
     * every op but server_stop, never from inside a completion; it never
     * waits for a peer. */
    unsigned (*server_progress)(void *server, unsigned budget);
    /* With server_progress, required. Arm the server for a sleep: returns a
     * descriptor that poll() reports readable once server_progress has
     * something to do, -1 when it has something now (call it, then arm
     * again), or KVPI_WAIT_FD_NONE when the transport's own thread drives it
     * until what is in flight completed (the caller then waits for its
     * completions only). Threads as server_progress. The same descriptor every time,
     * valid until server_stop: the caller polls it, never reads or closes
     * it. Readable may be spurious (another thread took the event first):
     * the caller progresses, and arms again before its next sleep. */
    int (*server_wait_fd)(void *server);
    /* Required. Close and free; called once every xfer posted on it has
     * completed, from an engine worker or the destroying thread (never from
     * a completion). */
    void (*peer_close)(void *peer);
} kvpi_transport_ops;

extern const kvpi_transport_ops kvpi_transport_tcp;
extern const kvpi_transport_ops kvpi_transport_shm;
extern const kvpi_transport_ops kvpi_transport_ucx; /* where built (KVP_HAVE_UCX) */

/* This build's transports, in order of preference for a peer (same-host
 * ones first); NULL-terminated, at most KVPI_MAX_TRANSPORTS. */
extern const kvpi_transport_ops *const kvpi_transports[];

/* The transport that serves a protocol name ("tcp", "shm"; "rdma" and "ucx"
 * where built), or NULL. The one place that maps names to transports. */
const kvpi_transport_ops *kvpi_transport_lookup(const char *name);

/* Why a protocol name this build knows has no transport ("rdma" without
 * UCX), or NULL for a name it does not know or serves. */
const char *kvpi_transport_missing(const char *name);

/* Run x (peer_run where the transport has it, else peer_post) and wait for
 * its completion; returns done's status. For callers with no completion of
 * their own (tests, tools); a transport with manual progress is progressed
 * by its own thread meanwhile. */
kvp_status kvpi_transport_xfer_sync(const kvpi_transport_ops *ops, void *peer,
                                    kvpi_slice *const *slices, size_t n);

/* KVP_EINVAL naming the first mandatory op or field ops lacks. */
kvp_status kvpi_transport_check(const kvpi_transport_ops *ops);

#endif
