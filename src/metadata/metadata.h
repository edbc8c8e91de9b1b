/* Internal: where segment descriptors live.
 *
 * Two levels:
 *  - kvpi_store_ops: one ops table per key-value store (http, etcd, redis). A
 *    store only gets, puts and deletes JSON text under a key.
 *  - kvpi_meta: what the engine uses. It maps a segment name to Mooncake's keys
 *    (mooncake/[cluster/]ram/<name>, mooncake/[cluster/]rpc_meta/<name>) on a
 *    store, or, for the connection string "P2PHANDSHAKE", has no store and asks
 *    the peer itself over its handshake port (p2p.c).
 *
 * Connection strings: "http://h:p/path", "etcd://h:p[,h:p]", a bare "h:p"
 * (etcd), "redis://[user:pass@]h:p[/db]", "P2PHANDSHAKE".
 *
 * Every function sets kvp_last_error() on failure, naming the store and its
 * address. All are thread-safe.
 */
#ifndef KVPI_METADATA_H
#define KVPI_METADATA_H

#include "kvpipe/status.h"

typedef struct kvpi_store_ops {
    const char *name; /* "http", "etcd", "redis" */
    /* Non-zero if this store handles the connection string. */
    int (*accepts)(const char *conn);
    /* Connect (or prepare to). Must fail with KVP_EMETADATA, naming the address,
     * when the store cannot be reached. timeout_ms bounds every request. */
    kvp_status (*open)(const char *conn, int timeout_ms, void **store);
    /* *value is malloc'ed text owned by the caller. KVP_ENOTFOUND if missing. */
    kvp_status (*get)(void *store, const char *key, char **value);
    kvp_status (*put)(void *store, const char *key, const char *value);
    /* Deleting a missing key succeeds. */
    kvp_status (*del)(void *store, const char *key);
    void (*close)(void *store);
} kvpi_store_ops;

extern const kvpi_store_ops kvpi_store_http;
extern const kvpi_store_ops kvpi_store_etcd;
extern const kvpi_store_ops kvpi_store_redis;

/* Find the store for a connection string; NULL for P2PHANDSHAKE or unknown. */
const kvpi_store_ops *kvpi_store_lookup(const char *conn);

typedef struct kvpi_meta kvpi_meta;

#define KVPI_P2P_CONN "P2PHANDSHAKE"

kvp_status kvpi_meta_open(const char *conn, int timeout_ms, kvpi_meta **out);
void kvpi_meta_close(kvpi_meta *meta);

/* Non-zero in P2PHANDSHAKE mode (no store; descriptors come by handshake). */
int kvpi_meta_is_p2p(const kvpi_meta *meta);

/* Publish a segment's descriptor (JSON text) and its rpc_meta. No-op in P2P. */
kvp_status kvpi_meta_publish(kvpi_meta *meta, const char *segment, const char *desc_json,
                             const char *rpc_host, int rpc_port);

/* Remove both keys of a segment. No-op in P2P. */
kvp_status kvpi_meta_remove(kvpi_meta *meta, const char *segment);

/* Fetch a peer segment's descriptor (malloc'ed JSON text) and the host its RPC
 * and data ports listen on (malloc'ed). In P2P mode this is a handshake to the
 * host:port of the segment name, sending own_desc_json. KVP_ENOTFOUND when the
 * store has no such segment. */
kvp_status kvpi_meta_fetch(kvpi_meta *meta, const char *segment, const char *own_desc_json,
                           char **desc_json, char **rpc_host);

/* The key under which kind ("ram" or "rpc_meta") of a segment is stored,
 * honouring env MC_METADATA_CLUSTER_ID. Returns malloc'ed text. */
char *kvpi_meta_key(const char *kind, const char *segment);

/* ---- Handshake (RPC) port: p2p.c ----
 * Frame: u64 little-endian length (type byte + JSON), u8 type, JSON text.
 * One request per connection; frames over 1 MiB are refused. */
enum kvpi_rpc_type {
    KVPI_RPC_CONNECT = 0,
    KVPI_RPC_METADATA = 1,
    KVPI_RPC_NOTIFY = 2,
    KVPI_RPC_PROBE = 3,
};
#define KVPI_RPC_MAX_FRAME (1u << 20)

typedef struct kvpi_rpc_server kvpi_rpc_server;

/* Returns the malloc'ed JSON text of the local segment descriptor, or NULL. */
typedef char *(*kvpi_rpc_desc_fn)(void *ctx);

/* Serve handshakes on host:port until stopped. A METADATA request is answered
 * with a METADATA frame holding desc_fn()'s text; other types with a frame of
 * the same type holding "{}". Malformed or oversized frames close that
 * connection only. limits (NULL: defaults) caps connections and bounds each
 * request (common/conn_server.h): it must begin and be read within
 * timeout_ms (+ its length at min_rate). */
struct kvpi_conn_limits;
kvp_status kvpi_rpc_server_start(const char *host, int port, const struct kvpi_conn_limits *limits,
                                 kvpi_rpc_desc_fn desc_fn, void *ctx, kvpi_rpc_server **out);
void kvpi_rpc_server_stop(kvpi_rpc_server *server);

/* The port the server listens on (the one chosen when started with port 0). */
int kvpi_rpc_server_port(const kvpi_rpc_server *server);

/* One request/response exchange; *reply is malloc'ed JSON text. The whole
 * exchange (connect, request, the complete reply) must finish within
 * timeout_ms, else KVP_ETIMEDOUT. */
kvp_status kvpi_rpc_call(const char *host, int port, int type, const char *json, int timeout_ms,
                         char **reply);

#endif
