/* Internal: the transport ops table.
 *
 * A transport moves bytes between local memory and a peer's registered memory.
 * The engine knows nothing of sockets or shared memory; it starts each
 * transport's server, lets each add its fields to the segment descriptor, and,
 * for a peer, opens the first transport (in preference order) whose peer_open
 * accepts that peer. A transport that cannot serve a peer (for example shm and a
 * peer on another host) returns KVP_ENOTSUP from peer_open with the reason in
 * kvp_last_error(), and the engine falls back to the next.
 *
 * Threads: server functions are called by the engine only; peer_xfer is called
 * from several worker threads at once on the same peer.
 */
#ifndef KVPI_TRANSPORT_H
#define KVPI_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/auth.h"
#include "common/conn_server.h"
#include "engine/metrics.h"
#include "engine/registry.h"
#include "kvpipe/engine.h"

/* One contiguous piece of a request; the transport sets status. */
typedef struct kvpi_slice {
    kvp_opcode opcode;
    void *local;
    uint64_t remote;
    size_t length;
    kvp_status status;
} kvpi_slice;

typedef struct kvpi_server_ctx {
    const char *host;        /* the engine's host, to bind on */
    kvpi_registry *registry; /* check every request against it */
    /* The listener's limits (common/conn_server.h; 0: its default). */
    int timeout_ms;
    int idle_timeout_ms;
    int max_conns;
    uint64_t min_rate;
    /* A transport that serves Mooncake's TCP data port stores its port here;
     * the engine publishes it as tcp_data_port. */
    int *data_port_out;
    /* Non-NULL in the authenticated mode (common/auth.h): the server must
     * refuse a connection whose peer does not prove the key, before serving
     * any request on it - with a conn_server, setup = kvpi_auth_conn_setup. */
    const kvpi_auth *auth;
    /* Where the server counts the requests it serves (may be NULL). */
    kvpi_served *served;
} kvpi_server_ctx;

typedef struct kvpi_peer_ctx {
    const char *host;   /* where the peer's servers listen (rpc_meta) */
    const cJSON *desc;  /* the peer's parsed segment descriptor */
    const kvpi_region *regions; /* the descriptor's buffers */
    size_t n_regions;
    /* Each peer_xfer call must finish within timeout_ms + its bytes /
     * min_rate (bytes per second; 0: the default), waiting for a connection
     * included. */
    int timeout_ms;
    uint64_t min_rate;
    int conns;          /* connections to keep */
    /* Non-NULL in the authenticated mode: run kvpi_auth_client on every new
     * connection before any request (its failure is the peer's error). */
    const kvpi_auth *auth;
    /* Counts the requests run again on a new connection (may be NULL). */
    kvpi_counter *retries;
} kvpi_peer_ctx;

/* The connection-server limits of a listener started with ctx. */
static inline kvpi_conn_limits kvpi_server_limits(const kvpi_server_ctx *ctx)
{
    kvpi_conn_limits l = {.timeout_ms = ctx->timeout_ms,
                          .idle_timeout_ms = ctx->idle_timeout_ms,
                          .max_conns = ctx->max_conns,
                          .min_rate = ctx->min_rate};
    return l;
}

/* Capability flags. */
#define KVPI_TRANSPORT_SAME_HOST 0x1u /* only reaches peers on this host */

/* Small requests queued back to back for one peer are handed to peer_xfer
 * together, up to this many bytes, so that the transport can pipeline them;
 * larger requests go one per call, spread over workers and connections. */
#define KVPI_GROUP_BYTES_DEFAULT ((size_t)1 << 20)

typedef struct kvpi_transport_ops {
    const char *name;
    unsigned caps;
    /* Bytes per peer_xfer group; 0 means KVPI_GROUP_BYTES_DEFAULT. Measured on
     * loopback TCP, 1 MiB requests ran 30% faster one per connection than
     * pipelined four to one; shm, whose round trips cost more than its copies
     * of small slices, does best with large groups. */
    size_t group_bytes;
    kvp_status (*server_start)(const kvpi_server_ctx *ctx, void **server);
    /* Add this transport's fields to the local segment descriptor. */
    void (*server_describe)(void *server, cJSON *desc);
    void (*server_stop)(void *server);
    kvp_status (*peer_open)(const kvpi_peer_ctx *ctx, void **peer);
    /* Run n slices against the peer, in order or overlapped, and set each
     * slice's status. Returns KVP_OK, or the connection-level error that failed
     * some slices (KVP_ECONNRESET, KVP_ECONNREFUSED, KVP_ETIMEDOUT), so the
     * engine can drop the peer's cached descriptor. */
    kvp_status (*peer_xfer)(void *peer, kvpi_slice *const *slices, size_t n);
    void (*peer_close)(void *peer);
} kvpi_transport_ops;

extern const kvpi_transport_ops kvpi_transport_tcp;
extern const kvpi_transport_ops kvpi_transport_shm;

/* Transports in order of preference for a peer; NULL-terminated. */
extern const kvpi_transport_ops *const kvpi_transports[];

/* The transport of that name, or NULL. */
const kvpi_transport_ops *kvpi_transport_lookup(const char *name);

#endif
