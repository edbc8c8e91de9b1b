/* kvpipe transfer engine: registered memory and one-sided READ/WRITE.
 *
 * An engine owns a segment: the memory regions its process registered, published
 * under the engine's segment name ("host:port") in a metadata store. Peers open
 * the segment by name and READ or WRITE inside those regions without the owner's
 * involvement. The wire formats are Mooncake Transfer Engine's, so kvpipe and
 * Mooncake peers interoperate over TCP through the same metadata store.
 *
 * Threads: every function here is safe to call from several threads at once,
 * except kvp_engine_destroy(), which must be the last call on an engine. The
 * engine owns its worker and server threads.
 *
 * Blocking: functions block at most for the deadlines opts.timeout_ms sets (see
 * there), or for the timeout they take.
 */
#ifndef KVPIPE_ENGINE_H
#define KVPIPE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/export.h"
#include "kvpipe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_engine kvp_engine;
typedef struct kvp_batch kvp_batch;

/* What memory a registered region is, which decides which transports can
 * move it. Values are append-only, never renumbered. */
typedef enum kvp_mem_kind {
    KVP_MEM_HOST = 0, /* CPU memory: malloc'ed, mmap'ed, kvp_engine_alloc() */
    KVP_MEM_CUDA = 1, /* CUDA device memory; device is the CUDA device ordinal */
} kvp_mem_kind;

/* A peer segment opened with kvp_engine_open_segment(); valid until the engine
 * is destroyed. */
typedef uint32_t kvp_segment_id;

typedef struct kvp_engine_opts {
    /* "host:port" (IPv6: "[::1]:port"). The engine answers handshakes on this
     * port, and it names the segment. Port 0 picks a free port; then
     * kvp_engine_segment_name() tells the name. A wildcard host ("0.0.0.0",
     * "[::]") binds every address and names the segment after the address
     * kvpipe chooses for peers; bind_address (or env MC_TCP_BIND_ADDRESS)
     * replaces the host (see there). Required. */
    const char *local_server_name;
    /* "http://h:p/metadata", "etcd://h:p[,h:p]", "h:p" (etcd), "redis://h:p",
     * or "P2PHANDSHAKE". Required. */
    const char *metadata;
    /* Preferred transport: "tcp" (default), "shm" (same host only), or
     * "rdma" (alias "ucx"): one-sided RMA through UCX in a build with UCX
     * (KVP_WITH_UCX; without it kvp_engine_create fails with KVP_ENOTSUP,
     * saying how to run over TCP), for peers that publish a ucx endpoint,
     * TCP for others (docs/transport-ucx.md). With env MC_FORCE_TCP set
     * (Mooncake's; anything but "", "0", "false", "no", "off") the engine
     * uses "tcp" whatever this says. With "tcp" or "rdma", a same-host peer
     * is still reached through shm unless disable_shm is set. */
    const char *protocol;
    /* Network devices for the ucx transport, comma-separated, as Mooncake's
     * device_name ("mlx5_0,mlx5_1"; "eth0"): UCX_NET_DEVICES, unless that is
     * set; a name UCX does not find fails kvp_engine_create with
     * KVP_ENOTSUP. Ignored by tcp and shm. May be NULL. */
    const char *device_names;
    /* The base of every deadline, in milliseconds (default 5000). Moving N
     * bytes may take timeout_ms + N / min_transfer_rate, measured on the
     * monotonic clock and bounding total progress, not the gap between bytes:
     *  - initiator: each transfer a worker runs (one slice of at most
     *    slice_size bytes, or a group of small requests moved together on one
     *    connection) must finish within timeout_ms + its bytes /
     *    min_transfer_rate of its start, connecting and waiting for a free
     *    connection included, else it fails with KVP_ETIMEDOUT; with the
     *    defaults a 4 MiB slice gets 5.25 s. A request fails with its first
     *    failed slice, and once a batch lost its peer (timeout, reset,
     *    refused) its requests not yet started fail with the same status, so a
     *    stopped or dead target is reported within one such deadline;
     *  - servers (TCP data port, shm socket, handshake port): a request's
     *    header must arrive within timeout_ms of its first byte, and the whole
     *    request within timeout_ms + its size / min_transfer_rate; a
     *    connection's setup (the shm hello) within timeout_ms of its accept;
     *  - a handshake (P2PHANDSHAKE lookup), reply included, within
     *    timeout_ms; the metadata store's clients use it as their request
     *    timeout (docs/metadata-*.md). */
    int timeout_ms;
    /* The engine's workers, which look segments up and open links for
     * transfers that need it (default 4). The transfers themselves run on
     * the transports' threads: tcp and shm run at most conns_per_peer
     * transfers of one peer at once, on threads started as needed
     * (docs/architecture.md, "Threads"). */
    int workers;
    /* The most connections open to one peer at once, kept and reused
     * across requests (default 4): an engine talking to N peers holds at
     * most N * conns_per_peer, however many transfers or threads; a caller
     * that finds them all busy waits for one (within its deadline)
     * (docs/transport-tcp.md, "Connections stay bounded"). */
    int conns_per_peer;
    /* Requests larger than this are split into slices spread over connections
     * (default 4 MiB). */
    size_t slice_size;
    /* Non-zero: never use the same-host transport automatically. */
    int disable_shm;
    /* Bytes of fully free managed-buffer chunks kept mapped for reuse; chunks
     * beyond it are unmapped. 0: the default, 1 GiB. Fresh memory costs page
     * faults on first touch, so keep the memory a workload cycles through. */
    size_t pool_retain_bytes;
    /* Connections each of the engine's listeners (TCP data port, shm socket,
     * handshake port) serves at once (default 256). A new connection that
     * finds a listener full evicts the connection idle the longest, else the
     * one whose request or setup has been incomplete the longest; it is
     * refused only when every connection is mid-transfer. */
    int max_connections;
    /* A server connection with no request in progress for this long is
     * closed (default 60000 ms); kvpipe's clients then reconnect. The
     * handshake port allows a request timeout_ms to begin instead. The
     * initiator's pooled connections (tcp) unused this long are closed too,
     * within idle_timeout_ms + min(idle_timeout_ms / 4, 1 s), and one a peer
     * closed as soon as that is seen. */
    int idle_timeout_ms;
    /* The slowest transfer rate, in bytes per second, that deadlines allow
     * for (default 16 MiB/s): moving N bytes may take timeout_ms + N /
     * min_transfer_rate, on either side (see timeout_ms). Lower it for links
     * slower than that per connection. */
    uint64_t min_transfer_rate;
    /* The authenticated mode (docs/security.md), off by default: the path of
     * a key file (one secret per line, mode 0600; the first is the one this
     * engine proves and signs with, every one is accepted from peers). Then
     * every connection to and from this engine's listeners proves the key
     * first, its descriptor is signed, and peers' descriptors must be signed
     * with an accepted key; peers without it (Mooncake's among them) are
     * refused with KVP_EAUTH. NULL: the file env KVPIPE_AUTH_KEY_FILE names
     * (unset or "": off); "": off whatever the env says. Read once, at
     * kvp_engine_create (KVP_ECONFIG naming the file when it is unusable). */
    const char *auth_key_file;
    /* Authenticated mode: a peer descriptor signed longer ago than this is
     * refused as stale (default 120000 ms); the engine signs its own anew
     * every quarter of it, so clocks must agree to well within it. */
    int auth_max_age_ms;
    /* The metrics endpoint: an HTTP server answering GET /metrics with the
     * engine's metrics as Prometheus text (include/kvpipe/metrics.h,
     * docs/metrics.md). 0 (the default): as env KVPIPE_METRICS_PORT says
     * (unset or "": none; "0": any free port); a port 1..65535; or
     * KVP_METRICS_PORT_ANY: a free port, which kvp_engine_metrics_port()
     * tells. Engines of one process that ask for the same port share one
     * endpoint, their samples told apart by an engine="host:port" label. A
     * port another program holds fails kvp_engine_create() with KVP_EBUSY;
     * a build without libmicrohttpd fails it with KVP_ENOTSUP. */
    int metrics_port;
    /* Address the endpoint binds: NULL (the default) takes env
     * KVPIPE_METRICS_HOST, else 127.0.0.1 (loopback only). */
    const char *metrics_host;
    /* The address peers are given, and the listeners bind (handshake and
     * data ports): an IP address or host name of this host, without a port.
     * It replaces local_server_name's host, in the segment name too
     * ("bind_address:port"). NULL or "" (the default): env
     * MC_TCP_BIND_ADDRESS (Mooncake's, the same meaning), else
     * local_server_name's host as given, except a wildcard: with "0.0.0.0"
     * or "::" the listeners bind every address and peers are given the one
     * kvpipe chooses - an address of the default route's interface, never
     * a container or virtual bridge's (docker0, br-*, veth*, virbr*, cni*,
     * flannel*, ...) or loopback while another exists (docs/transport-tcp.md,
     * "Which address peers are given"). The engine logs the choice and its
     * reason at INFO; `kvpipe info` shows what a wildcard would choose. A
     * port, or a wildcard, here fails kvp_engine_create with KVP_EINVAL; an
     * address not of this host with KVP_EIO (cannot listen). */
    const char *bind_address;
    /* End-to-end integrity (docs/reliability.md, "Integrity"): with it on
     * here and on the peer, every slice a transfer moves is digested where
     * its bytes are copied (XXH3-64), on the side that sends them and on the
     * side that receives them, and a slice whose digests differ fails its
     * request with KVP_ECORRUPT, naming the peer, the remote address and the
     * length (counted in kvpipe_engine_corrupt_total). A peer without it
     * (Mooncake, an older kvpipe, kvpipe with it off) keeps its wire and goes
     * unchecked; the log says so once per peer. KVP_INTEGRITY_ENV (the
     * default): as env KVPIPE_INTEGRITY says ("1": on; unset, "" or "0":
     * off; anything else fails kvp_engine_create with KVP_ECONFIG); 0: off;
     * 1: on. */
    int integrity;
} kvp_engine_opts;

/* kvp_engine_opts.integrity: as env KVPIPE_INTEGRITY says. */
#define KVP_INTEGRITY_ENV (-1)

/* kvp_engine_opts.metrics_port: any free port. */
#define KVP_METRICS_PORT_ANY (-1)

/* Fill opts with the defaults above and NULL strings. Call it before
 * setting fields: kvp_engine_opts grows at its end from release to release,
 * and a program built against an older header passes the smaller struct
 * (the inline wrappers below pass its size; docs/abi.md). */
KVP_API void kvp_engine_opts_init_size(kvp_engine_opts *opts, size_t size);
static inline void kvp_engine_opts_init(kvp_engine_opts *opts)
{
    kvp_engine_opts_init_size(opts, sizeof *opts);
}

/* Create an engine: bind its handshake port and data port, connect to the
 * metadata store and publish the (empty) segment: rpc_meta once, then the
 * descriptor (docs/metadata-segments.md). Keys a killed process of the same
 * name left behind are taken over; a name a live engine holds is refused with
 * KVP_EBUSY. On failure nothing is left behind (and no key another engine
 * wrote is deleted) and kvp_last_error() names the part that failed (for
 * example the metadata store and its address). */
KVP_API kvp_status kvp_engine_create_size(const kvp_engine_opts *opts, size_t size,
                                          kvp_engine **out);
static inline kvp_status kvp_engine_create(const kvp_engine_opts *opts, kvp_engine **out)
{
    return kvp_engine_create_size(opts, sizeof *opts, out);
}

/* Unpublish the segment (its keys, if they are still this engine's), stop all
 * threads, close connections, free managed memory and close the completion
 * fd. Requests still running fail with KVP_ECLOSED first. Batches are not
 * freed here: free each first (kvp_batch_free touches the engine). NULL is a
 * no-op. */
KVP_API void kvp_engine_destroy(kvp_engine *engine);

/* The segment name ("host:port"); owned by the engine. */
KVP_API const char *kvp_engine_segment_name(const kvp_engine *engine);
/* The handshake (RPC) port: the port of the segment name. */
KVP_API int kvp_engine_rpc_port(const kvp_engine *engine);
/* The TCP data port peers connect to. */
KVP_API int kvp_engine_data_port(const kvp_engine *engine);

/* Register [addr, addr+length) so that peers may READ and WRITE it, and publish
 * the updated segment (its descriptor key only): kvp_engine_register_mem() for
 * host memory (KVP_MEM_HOST, device 0). Regions must not overlap. The memory
 * stays the caller's; it must stay valid until kvp_engine_unregister(). A range
 * that is not mapped in this process, or whose first or last byte cannot be
 * read, is asked about of the CUDA driver (loaded at run time, docs/gpu.md):
 * GPU device memory is registered as KVP_MEM_CUDA of its device, as vLLM and
 * SGLang pass it (tensor.data_ptr()); anything else (PROT_NONE memory, or a
 * GPU pointer on a host without a driver) is refused with KVP_EINVAL and a
 * message saying what the memory is not and, for the driver, what is missing
 * (the host check costs about 15 us, whatever the size). Memory
 * unmapped after registration fails the peers' requests that touch it
 * ("address rejected"), never the engine. Does not wait for server requests on
 * other regions. */
KVP_API kvp_status kvp_engine_register(kvp_engine *engine, void *addr, size_t length);

/* Register [addr, addr+length) of memory of the given kind: device is the CUDA
 * device ordinal for KVP_MEM_CUDA, 0 for host memory. Each of the engine's
 * transports that can move that kind registers the region (an RDMA transport
 * pins it and publishes a remote key for it) before any peer can see it; when
 * one fails, the registrations already made are undone and the call fails with
 * that transport's status, leaving nothing registered or published. Errors:
 * KVP_ENOTSUP naming the kind when none of the engine's transports can move it
 * (tcp and shm move host and CUDA memory, ucx host memory only), and for
 * KVP_MEM_CUDA without a usable CUDA driver (saying what is missing);
 * KVP_EINVAL for an unknown kind, a negative device, host memory
 * kvp_engine_register() refuses, or KVP_MEM_CUDA memory the driver says is not
 * device memory of that device; otherwise as kvp_engine_register().
 * Thread-safe; blocks for the transports' registration and the publish. */
KVP_API kvp_status kvp_engine_register_mem(kvp_engine *engine, void *addr, size_t length,
                                           kvp_mem_kind kind, int device);

/* Unregister the region that starts at addr and republish. New server
 * requests to the region are refused at once; the call waits for those
 * already touching it, each of which ends by its deadline (timeout_ms + its
 * size / min_transfer_rate), and for nothing else. KVP_ENOTFOUND if addr does
 * not start a registered region. */
KVP_API kvp_status kvp_engine_unregister(kvp_engine *engine, void *addr);

/* Allocate length bytes (length > 0) of engine-owned registered memory. The
 * pool grows in chunks and reuses freed memory. With the rdma/ucx protocol
 * (unauthenticated) the chunks are shared memory UCX allocates, which a
 * same-host peer copies directly (docs/transport-ucx.md). */
KVP_API kvp_status kvp_engine_alloc(kvp_engine *engine, size_t length, void **out);

/* Return a managed buffer; addr must come from kvp_engine_alloc(). NULL is a
 * no-op. KVP_EINVAL for an address the pool did not hand out. */
KVP_API kvp_status kvp_engine_free(kvp_engine *engine, void *addr);

/* Open a peer's segment by name: fetch its descriptor from the metadata store
 * (or by handshake in P2PHANDSHAKE mode) and cache it. Opening the same name
 * again returns the same id. A transfer that fails with a connection error drops
 * the cached descriptor, so the next transfer looks the peer up again. */
KVP_API kvp_status kvp_engine_open_segment(kvp_engine *engine, const char *name,
                                           kvp_segment_id *out);

typedef struct kvp_remote_buffer {
    uint64_t addr;
    uint64_t length;
} kvp_remote_buffer;

/* The registered buffers of an open segment, as its descriptor lists them,
 * sorted by address: copies up to cap of them into out and sets *count to how
 * many there are. Looks the segment up again if its cached descriptor was
 * dropped. */
KVP_API kvp_status kvp_engine_segment_buffers(kvp_engine *engine, kvp_segment_id seg,
                                              kvp_remote_buffer *out, size_t cap, size_t *count);

/* The transport that reaches an open segment ("tcp", "shm"), or NULL. Valid
 * until the engine is destroyed. */
KVP_API const char *kvp_engine_segment_transport(kvp_engine *engine, kvp_segment_id seg);

typedef enum kvp_opcode {
    KVP_OP_READ = 0,  /* remote -> local */
    KVP_OP_WRITE = 1, /* local -> remote */
} kvp_opcode;

typedef struct kvp_request {
    kvp_opcode opcode;
    void *local;     /* any local memory; need not be registered for tcp */
    uint64_t remote; /* address inside one of the peer's registered regions */
    size_t length;   /* 0 completes at once */
} kvp_request;

/* Submit n requests against one segment and return at once. The local memory of
 * each request must stay valid until the request completes or the batch is
 * freed. n may be 0. */
KVP_API kvp_status kvp_batch_submit(kvp_engine *engine, kvp_segment_id seg, const kvp_request *reqs,
                                    size_t n, kvp_batch **out);

/* Status of request i: KVP_EINPROGRESS while it runs, then KVP_OK or its error.
 * KVP_EINVAL for i out of range. Does not block. */
KVP_API kvp_status kvp_batch_request_status(const kvp_batch *batch, size_t i);

/* Number of requests of the batch not yet completed. Does not block. */
KVP_API size_t kvp_batch_pending(const kvp_batch *batch);

/* Wait until every request has completed or timeout_ms passed (negative: no
 * limit; the engine's deadlines still bound each request, see
 * kvp_engine_opts.timeout_ms). Returns KVP_OK when all succeeded,
 * KVP_ETIMEDOUT, or the first failed request's status. */
KVP_API kvp_status kvp_batch_wait(kvp_batch *batch, int timeout_ms);

/* Cancel what of the batch has not started: those requests complete with
 * KVP_ECANCELED at once; what a transport has started (over ucx: everything
 * posted to UCX) finishes, or fails at its deadline, first. Returns without
 * waiting; thread-safe, also against kvp_batch_wait on another thread. Once
 * kvp_batch_wait (or kvp_batch_pending) says a request completed, nothing
 * of kvpipe's touches its local memory any more, whatever its status
 * (docs/reliability.md, "Cancel"). NULL is a no-op. */
KVP_API void kvp_batch_cancel(kvp_batch *batch);

/* Release a batch: kvp_batch_cancel, then wait for what runs (bounded by its
 * deadlines) and for its on_complete (kvp_batch_submit_with) to return; a
 * batch still on the completion queue leaves it (kvp_engine_reap never
 * returns it). Every batch must be freed before kvp_engine_destroy(), once.
 * NULL is a no-op. */
KVP_API void kvp_batch_free(kvp_batch *batch);

/* ---- Completion without waiting: callbacks and a pollable fd ----
 *
 * kvp_batch_submit_with() submits like kvp_batch_submit() and says what to
 * do when the batch's last request completes: call a function, queue the
 * batch on the engine's completion queue (which an event loop watches
 * through kvp_engine_completion_fd() and empties with kvp_engine_reap()), or
 * both. A batch completes exactly once, whatever ends it: every request
 * done, failed, cancelled (kvp_batch_cancel), or failed with KVP_ECLOSED by
 * kvp_engine_destroy(). */

/* The completion callback: see kvp_batch_opts.on_complete. */
typedef void (*kvp_batch_done_fn)(kvp_batch *batch, void *user_data);

/* The length of an instance id (kvp_engine_instance()): hex digits. */
#define KVP_INSTANCE_LEN 32

typedef struct kvp_batch_opts {
    /* Called once, when the batch's last request completed (a batch of no
     * requests: before kvp_batch_submit_with() returns), with the batch and
     * user_data; NULL: none. It runs on whichever thread completed that
     * request - a transport's thread, an engine worker, or the submitting
     * thread itself (before kvp_batch_submit_with() returns, *out already
     * set) - so it must be short and must not block. It may read the batch
     * (kvp_batch_request_status, kvp_batch_pending, kvp_batch_wait with
     * timeout 0) and do things of its own that do not block (write an
     * eventfd, signal a condition variable, queue the batch for a thread of
     * its own); it must call no other kvpipe function: it may not submit,
     * cancel, free (this or another batch), nor destroy the engine. Nothing
     * of the batch is freed while it runs: kvp_batch_free() and
     * kvp_batch_wait() return only after it returned. */
    kvp_batch_done_fn on_complete;
    /* Given to on_complete, and returned with the batch by kvp_engine_reap(). */
    void *user_data;
    /* Non-zero: once completed (after on_complete returned), the batch is
     * queued on its engine's completion queue until kvp_engine_reap() takes
     * it or kvp_batch_free() frees it. */
    int reap;
    /* An instance id (kvp_engine_instance(), kvp_engine_segment_instance()):
     * the requests run only against a descriptor of the segment that carries
     * this instance id, else fail with KVP_ECONNRESET - addresses one process
     * gave out mean nothing in a process that took its segment name since
     * (restarted). NULL (default): any instance. At most KVP_INSTANCE_LEN
     * characters. Learn the peer's instance before its addresses, so that a
     * restart between the two fails the requests instead of moving bytes to
     * the wrong memory. */
    const char *instance;
} kvp_batch_opts;

/* Fill opts with the defaults (no callback, not queued, any instance).
 * kvp_batch_opts grows at its end like kvp_engine_opts (docs/abi.md): call
 * it before setting fields. */
KVP_API void kvp_batch_opts_init_size(kvp_batch_opts *opts, size_t size);
static inline void kvp_batch_opts_init(kvp_batch_opts *opts)
{
    kvp_batch_opts_init_size(opts, sizeof *opts);
}

/* kvp_batch_submit() with opts (NULL: as kvp_batch_submit). Returns at once;
 * on success the batch completes exactly once as opts says, and is the
 * caller's to free with kvp_batch_free() (also after it was reaped). On an
 * error nothing was submitted, *out is untouched and nothing is called or
 * queued. Errors as kvp_batch_submit(), plus KVP_EINVAL for an instance id
 * too long, KVP_ENOTSUP for fields of a newer kvpipe set. Thread-safe. */
KVP_API kvp_status kvp_batch_submit_with_size(kvp_engine *engine, kvp_segment_id seg,
                                              const kvp_request *reqs, size_t n,
                                              const kvp_batch_opts *opts, size_t size,
                                              kvp_batch **out);
static inline kvp_status kvp_batch_submit_with(kvp_engine *engine, kvp_segment_id seg,
                                               const kvp_request *reqs, size_t n,
                                               const kvp_batch_opts *opts, kvp_batch **out)
{
    return kvp_batch_submit_with_size(engine, seg, reqs, n, opts, sizeof *opts, out);
}

/* The engine's completion fd: it polls readable (POLLIN) exactly while the
 * completion queue holds a batch (level-triggered: it stays readable until
 * kvp_engine_reap() or kvp_batch_free() took every queued batch), for
 * poll(2), epoll (level-triggered), an event loop's add_reader. Owned by the
 * engine, open until kvp_engine_destroy(): do not read, write or close it.
 * Never fails; does not block. */
KVP_API int kvp_engine_completion_fd(const kvp_engine *engine);

/* One batch taken off the completion queue. Fixed layout (an array). */
typedef struct kvp_completion {
    kvp_batch *batch;  /* still the caller's to free */
    void *user_data;   /* kvp_batch_opts.user_data */
    kvp_status status; /* KVP_OK, or the first failed request's status */
} kvp_completion;

/* Take up to cap completed batches off the engine's completion queue, oldest
 * first, into out; returns how many (0 when none). Each queued batch is
 * returned once: concurrent callers get distinct ones. The fd stops being
 * readable when this takes the last one. Thread-safe; does not block. */
KVP_API size_t kvp_engine_reap(kvp_engine *engine, kvp_completion *out, size_t cap);

/* This engine's instance id: KVP_INSTANCE_LEN lower-case hex digits drawn at
 * kvp_engine_create() and published in its descriptor, so that a process
 * that restarts under the same segment name has another. Owned by the
 * engine. */
KVP_API const char *kvp_engine_instance(const kvp_engine *engine);

/* The instance id an open segment's descriptor carries (the cached one;
 * looked up again if it was dropped), into out (cap >= KVP_INSTANCE_LEN + 1).
 * KVP_ENOTFOUND when the descriptor has none (a Mooncake peer), KVP_EINVAL
 * for seg not open or cap too small, the lookup's errors. Thread-safe; may
 * block for a lookup (timeout_ms). */
KVP_API kvp_status kvp_engine_segment_instance(kvp_engine *engine, kvp_segment_id seg, char *out,
                                               size_t cap);

/* Synchronous single transfers: submit, wait without limit, free. */
KVP_API kvp_status kvp_engine_read(kvp_engine *engine, kvp_segment_id seg, void *local,
                                   uint64_t remote, size_t length);
KVP_API kvp_status kvp_engine_write(kvp_engine *engine, kvp_segment_id seg, const void *local,
                                    uint64_t remote, size_t length);

/* ---- Notifications (Mooncake's NotifyDesc; docs/engine.md) ----
 *
 * A notification is a (name, msg) pair of strings one engine sends another
 * over the peer's handshake port, in Mooncake's frame (type 2), so kvpipe and
 * Mooncake engines notify each other. The usual use: the initiator of a
 * WRITE tells the target that the data is in place. kvpipe sends nothing by
 * itself: call kvp_engine_notify() after kvp_batch_wait() (or the sync
 * calls) returned KVP_OK, and the notification is delivered only after the
 * data it follows is in the target's memory (every WRITE request completes
 * only once the target has stored its bytes). */

typedef struct kvp_notify {
    char *name; /* NUL-terminated; owned by the array kvp_engine_get_notifies() returns */
    char *msg;
} kvp_notify;

/* The most notifications an engine keeps uncollected, and the most bytes of
 * their names and messages. A notification that would pass either is refused:
 * the sender's call fails (kvpipe's with KVP_EBUSY; Mooncake's logs "Notify
 * rejected"), nothing queued is dropped, and the engine's
 * notifies_refused_total counts it (docs/metrics.md). */
#define KVP_NOTIFY_QUEUE_MAX 65536
#define KVP_NOTIFY_QUEUE_MAX_BYTES (64u << 20)

/* Send the notification (name, msg) to an open segment's engine and wait for
 * its answer (bounded by opts.timeout_ms). The peer's handshake address is the
 * segment name's host:port in P2PHANDSHAKE mode, its rpc_meta otherwise, as
 * Mooncake finds it. KVP_OK once the peer queued it. Errors: KVP_EINVAL (seg
 * not open, NULL strings, name and msg over 1 MiB together); the connection's
 * (KVP_ECONNREFUSED, KVP_ETIMEDOUT, ...); KVP_EBUSY when the peer's queue is
 * full; KVP_ENOTSUP when the peer takes no notifications; KVP_EPROTO for a
 * reply that is not one. Thread-safe; blocks for one handshake. */
KVP_API kvp_status kvp_engine_notify(kvp_engine *engine, kvp_segment_id seg, const char *name,
                                     const char *msg);

/* Take every notification received and not yet taken, oldest first, as
 * Mooncake's getNotifies: *out is a malloc'ed array of *count entries (NULL
 * and 0 when there are none), which the caller frees with
 * kvp_engine_notifies_free(). Thread-safe: concurrent callers each get
 * distinct notifications. Does not block. KVP_ENOMEM leaves the queue as it
 * was. */
KVP_API kvp_status kvp_engine_get_notifies(kvp_engine *engine, kvp_notify **out, size_t *count);

/* Free what kvp_engine_get_notifies() returned. NULL is a no-op. */
KVP_API void kvp_engine_notifies_free(kvp_notify *notifies, size_t count);

/* Probe a peer segment by name and refresh this engine's session to it
 * (SGLang's send_probe: the warm-up, and the recovery of a peer it had given
 * up on): a PROBE handshake (Mooncake's frame type 3) to the peer's
 * handshake port, then its descriptor is fetched anew and its transports
 * opened, replacing what was cached (a restarted peer's new buffers and
 * ports are used from the next transfer on). Opens the segment when it is
 * not open. KVP_OK when the peer answered and was looked up; else the
 * handshake's or the lookup's status. Thread-safe; blocks for the handshake
 * and the lookup (each bounded by opts.timeout_ms). */
KVP_API kvp_status kvp_engine_probe(kvp_engine *engine, const char *name);

#ifdef __cplusplus
}
#endif
#endif
