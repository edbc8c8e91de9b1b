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
 * (etcd), "redis://[user:pass@]h:p[/db]" (or credentials and db from Mooncake's
 * MC_REDIS_PASSWORD, MC_REDIS_USERNAME, MC_REDIS_DB_INDEX), "P2PHANDSHAKE".
 *
 * Every function sets kvp_last_error() on failure, naming the store and its
 * address. All are thread-safe.
 */
#ifndef KVPI_METADATA_H
#define KVPI_METADATA_H

#include <stddef.h>
#include <stdint.h>

#include "common/net.h"
#include "kvpipe/status.h"

#define KVPI_STORE_SCHEMES 2

typedef struct kvpi_store_ops {
    /* The store's facts, the same whether this build has it or not: its
     * table has KVPI_STORE_HTTP (..._ETCD, ..._REDIS). */
    const char *name; /* "http", "etcd", "redis" */
    /* The connection strings it takes start with one of these (any case)... */
    const char *schemes[KVPI_STORE_SCHEMES];
    /* ...or, where bare, have no "://" at all (and are not P2PHANDSHAKE):
     * Mooncake treats such a string as etcd endpoints. */
    int bare;
    /* vLLM's mooncake config may name it in metadata_backend. */
    int backend;
    const char *syntax; /* for kvp_info: "http://h:p/path" */
    const char *option; /* the CMake option that builds it in, "KVP_WITH_HTTP" */
    const char *needs;  /* the library that option needs, "libcurl" */
    /* Mooncake writes its values to this store with a trailing newline (its
     * jsoncpp FastWriter does; its HTTP client does not), and so does kvpipe. */
    int newline_values;
    /* The functions: all NULL in a build that leaves the store out (CMake
     * KVP_WITH_* OFF, or its library not found). Its facts still claim its
     * connection strings, and kvpi_meta_open answers them with KVP_ENOTSUP
     * naming the option, not with "unknown connection string" or by sending
     * them to another store (a bare h:p is etcd's). */
    /* Connect (or prepare to). Must fail with KVP_EMETADATA, naming the address,
     * when the store cannot be reached. timeout_ms bounds every request. */
    kvp_status (*open)(const char *conn, int timeout_ms, void **store);
    /* *value is malloc'ed text owned by the caller. KVP_ENOTFOUND if missing. */
    kvp_status (*get)(void *store, const char *key, char **value);
    /* KVP_EBUSY when the store refuses to overwrite an existing key (Mooncake's
     * HTTP servers do so for rpc_meta keys); KVP_ENOMEM when it is full. */
    kvp_status (*put)(void *store, const char *key, const char *value);
    /* Deleting a missing key succeeds. */
    kvp_status (*del)(void *store, const char *key);
    /* Optional (NULL: one get per key): the values of n keys, read together
     * in one round trip; values[i] is malloc'ed text, or NULL where key i is
     * missing. Fails (all values NULL) only when the store does. */
    kvp_status (*get_many)(void *store, const char *const *keys, size_t n, char **values);
    /* Optional (NULL: the store cannot be watched, and kvpi_meta_watch polls).
     * Follow the changes of the keys that start with prefix on a connection
     * of its own: changed(ctx, NULL) once the stream is established (changes
     * before that may have been missed), then changed(ctx, key) for every key
     * put or deleted, until stop_fd is readable (KVP_OK) or the stream breaks
     * (KVP_EMETADATA, naming the store: the caller retries). KVP_ENOTSUP when
     * the store refuses to be watched (for good: the caller polls, and
     * kvp_last_error() says why). Blocks, on the caller's thread. */
    kvp_status (*watch)(void *store, const char *prefix, int stop_fd,
                        void (*changed)(void *ctx, const char *key), void *ctx);
    void (*close)(void *store);
} kvpi_store_ops;

/* Each store's facts, once: in its ops table (http.c, etcd.c, redis.c;
 * metadata.c's in a build without it). */
#define KVPI_STORE_HTTP                                                                            \
    .name = "http", .schemes = {"http://", "https://"}, .syntax = "http://h:p/path",               \
    .option = "KVP_WITH_HTTP", .needs = "libcurl",                                                 \
    .newline_values = 0 /* Mooncake's HTTP client writes none */
#define KVPI_STORE_ETCD                                                                            \
    .name = "etcd", .schemes = {"etcd://"}, .bare = 1, .backend = 1,                               \
    .syntax = "etcd://h:p[,h:p] (or h:p)", .option = "KVP_WITH_ETCD", .needs = "libcurl",          \
    .newline_values = 1
#define KVPI_STORE_REDIS                                                                           \
    .name = "redis", .schemes = {"redis://"}, .backend = 1,                                        \
    .syntax = "redis://[user:pass@]h:p[/db]", .option = "KVP_WITH_REDIS", .needs = "hiredis",      \
    .newline_values = 1

extern const kvpi_store_ops kvpi_store_http;
extern const kvpi_store_ops kvpi_store_etcd;
extern const kvpi_store_ops kvpi_store_redis;

/* Every store, schemed ones first (etcd also takes a bare "h:p"), then NULL. */
#define KVPI_N_STORES 3
extern const kvpi_store_ops *const kvpi_stores[KVPI_N_STORES + 1];

/* A get_many that failed: free values[0..n) and leave them NULL. */
void kvpi_store_values_free(char **values, size_t n);

/* Find the store for a connection string; NULL for P2PHANDSHAKE or unknown.
 * A store this build leaves out is found all the same (its open is NULL). */
const kvpi_store_ops *kvpi_store_lookup(const char *conn);

typedef struct kvpi_meta kvpi_meta;

#define KVPI_P2P_CONN "P2PHANDSHAKE"

/* The descriptor field in which a kvpipe engine writes its instance id: a
 * random token drawn at creation, which tells this engine's descriptor from
 * that of an earlier process with the same segment name. Mooncake readers
 * ignore it. */
#define KVPI_INSTANCE_FIELD "kvpipe_instance"

/* Returns the malloc'ed JSON text of the local segment descriptor, or NULL
 * (none yet). Called from the metadata layer's and the handshake server's
 * threads; must not block on them. */
typedef char *(*kvpi_rpc_desc_fn)(void *ctx);

/* Open the metadata layer of a connection string. desc_fn(desc_ctx) gives the
 * local descriptor where a lookup sends it (P2PHANDSHAKE handshakes); NULL,
 * or a NULL result, sends "{}". */
kvp_status kvpi_meta_open(const char *conn, int timeout_ms, kvpi_rpc_desc_fn desc_fn,
                          void *desc_ctx, kvpi_meta **out);
void kvpi_meta_close(kvpi_meta *meta);

/* Non-zero in P2PHANDSHAKE mode (no store; descriptors come by handshake). */
int kvpi_meta_is_p2p(const kvpi_meta *meta);

/* The authenticated mode (common/auth.h; call before any other use, auth
 * outlives meta): the handshakes meta makes prove the key, and kvpi_meta_check
 * judges the segment's keys by the key: a descriptor without a valid
 * signature of this key (forged, garbage, unsigned, stale: max_age_ms) is
 * nobody's and is put back (lost->forged), and so is an rpc_meta pointing
 * elsewhere while the descriptor is this engine's or forged. */
struct kvpi_auth;
void kvpi_meta_set_auth(kvpi_meta *meta, const struct kvpi_auth *auth, int max_age_ms);

/* An engine, as its keys show it. */
typedef struct kvpi_meta_self {
    const char *segment;   /* the segment name */
    const char *desc_json; /* its current descriptor, holding instance */
    const char *rpc_host;  /* where it answers handshakes */
    int rpc_port;
    const char *instance; /* its KVPI_INSTANCE_FIELD */
} kvpi_meta_self;

/* Take the segment's name in the store and publish it, as Mooncake does when
 * an engine starts: rpc_meta is written here, once, and the descriptor after
 * it. When an rpc_meta of the name exists already, its owner is asked for its
 * descriptor by handshake at the rpc_meta's address:
 *   - nobody answers, or the answer is not an engine's descriptor of this
 *     name, or it is this engine's own (the address is now this engine's): the
 *     keys are stale (their engine died): this engine replaces them - the
 *     descriptor first, so the dead process's buffers are gone at once, then
 *     rpc_meta if it differs (on a store that refuses to overwrite rpc_meta,
 *     by deleting it and writing it anew);
 *   - a descriptor of this name from another instance, or an answer without a
 *     name (Mooncake answers a metadata handshake with null outside P2P
 *     mode): a live engine holds the name: KVP_EBUSY, and nothing is written.
 * Handshakes are bounded by the store's timeout. No-op in P2P mode. */
kvp_status kvpi_meta_claim(kvpi_meta *meta, const kvpi_meta_self *self);

/* Publish a new descriptor of a claimed segment: only its descriptor key is
 * written, as Mooncake does on (un)registration. No-op in P2P mode. */
kvp_status kvpi_meta_publish(kvpi_meta *meta, const char *segment, const char *desc_json);

/* What of a claimed segment the store has lost (a restarted store). */
typedef struct kvpi_meta_lost {
    int rpc_meta;   /* missing (or, authenticated, overwritten: then deleted first) */
    int descriptor; /* missing, or this instance's but not self->desc_json */
    /* Authenticated mode: what was there instead was not genuine. */
    int forged;      /* the descriptor */
    int rpc_foreign; /* rpc_meta pointed elsewhere */
} kvpi_meta_lost;

/* Look (only reads) at what the store lost. KVP_EBUSY when the keys now belong
 * to another engine. *lost is all zero in P2P mode and on failure. */
kvp_status kvpi_meta_check(kvpi_meta *meta, const kvpi_meta_self *self, kvpi_meta_lost *lost);

/* Write back what lost says (self's rpc_meta, self's descriptor). Split from
 * kvpi_meta_check so that a caller can read without holding the lock under
 * which its descriptor changes, and write under it. No-op in P2P mode. */
kvp_status kvpi_meta_restore(kvpi_meta *meta, const kvpi_meta_self *self,
                             const kvpi_meta_lost *lost);

/* kvpi_meta_check, then kvpi_meta_restore. */
kvp_status kvpi_meta_repair(kvpi_meta *meta, const kvpi_meta_self *self);

/* Remove the segment's keys, but only those that are this engine's: the
 * descriptor when it holds self->instance, and rpc_meta when it is self's
 * address and the descriptor was this engine's or is gone. Keys another
 * engine wrote are left alone. No-op in P2P mode. */
kvp_status kvpi_meta_release(kvpi_meta *meta, const kvpi_meta_self *self);

/* ---- Following descriptor changes (docs/metadata-segments.md) ----
 * One thread per watch. It follows the store's keys below "mooncake/[CLUSTER/]"
 * with the store's watch op (etcd's watch stream, redis keyspace
 * notifications) and calls changed(ctx, segment) for the segment of each key
 * put or deleted (both readings of an ambiguous key), or changed(ctx, NULL)
 * where changes may have been missed: once each stream is established, and
 * at each reconnection attempt after it broke (backoff from 100 ms to 2 s).
 * A store that cannot be watched (the HTTP store; a redis that refuses
 * CONFIG SET notify-keyspace-events) is polled instead: changed(ctx, NULL)
 * every poll_ms, logged once. changed runs on the watch's thread and may
 * block on the store (it is how the caller revalidates). */
typedef void (*kvpi_meta_change_fn)(void *ctx, const char *segment);
typedef struct kvpi_meta_watch kvpi_meta_watch;

enum kvpi_watch_state {
    KVPI_WATCH_STARTING = 0, /* connecting (first time) */
    KVPI_WATCH_STREAMING,    /* the store's watch stream is established */
    KVPI_WATCH_BROKEN,       /* the stream broke: reconnecting, revalidating meanwhile */
    KVPI_WATCH_POLLING,      /* the store cannot be watched: polling */
};

/* Start following meta's store (not in P2P mode: KVP_EINVAL). meta outlives
 * the watch. A negative poll_ms polls every -poll_ms without trying the
 * store's watch. KVP_EIO when the thread cannot start. */
kvp_status kvpi_meta_watch_start(kvpi_meta *meta, int poll_ms, kvpi_meta_change_fn changed,
                                 void *ctx, kvpi_meta_watch **out);
/* Stop the thread (within one store request's timeout at worst; a waiting
 * stream is woken at once) and free the watch. NULL is a no-op. */
void kvpi_meta_watch_stop(kvpi_meta_watch *watch);
/* enum kvpi_watch_state, now. Thread-safe. */
int kvpi_meta_watch_state(const kvpi_meta_watch *watch);

/* Fetch a peer segment's descriptor (malloc'ed JSON text) and the host its RPC
 * and data ports listen on (malloc'ed). In P2P mode this is a handshake to the
 * host:port of the segment name, sending the local descriptor (the desc_fn
 * given to kvpi_meta_open). KVP_ENOTFOUND when the store has no such
 * segment. */
kvp_status kvpi_meta_fetch(kvpi_meta *meta, const char *segment, char **desc_json, char **rpc_host);

/* One handshake of the given type (NOTIFY, PROBE) with a peer segment's
 * handshake port, as Mooncake's TransferMetadata finds it: in P2P mode the
 * host:port of the segment name; else the segment's rpc_meta in the store
 * (KVP_ENOTFOUND when it has none). Bounded by the store's timeout, in the
 * authenticated mode when meta is. *reply: the answer's JSON (malloc'ed). */
kvp_status kvpi_meta_call(kvpi_meta *meta, const char *segment, int type, const char *json,
                          char **reply);

/* The key under which kind ("ram" or "rpc_meta") of a segment is stored, as
 * Mooncake names it: "mooncake/[CLUSTER/]ram/<segment>" (a segment name that
 * holds a '/' is used as the rest of the key: "mooncake/[CLUSTER/]<segment>"),
 * "mooncake/[CLUSTER/]rpc_meta/<segment>", where CLUSTER is env
 * MC_METADATA_CLUSTER_ID (one trailing '/' of it is not doubled). Returns
 * malloc'ed text, NULL when out of memory. */
char *kvpi_meta_key(const char *kind, const char *segment);

/* ---- Pure parsers and decisions (no I/O), for tests and fuzzers ---- */

/* Parse rpc_meta text {"ip_or_host_name": str, "rpc_port": int}; other fields
 * are ignored. host gets a NUL-terminated copy. KVP_EPROTO naming the bad
 * field. */
kvp_status kvpi_rpc_meta_parse(const char *text, char host[KVPI_HOST_MAX], int *port);

/* The owner of an rpc_meta, judged from the handshake with its address:
 * st is the handshake's status, reply its answer (when st is KVP_OK). */
typedef enum kvpi_meta_owner {
    KVPI_OWNER_GONE, /* nothing (or no engine) answers there: stale */
    KVPI_OWNER_SELF, /* this very engine answers: stale */
    KVPI_OWNER_ELSE, /* an engine of another name answers: stale */
    KVPI_OWNER_LIVE, /* another engine of this name, or one that does not
                        say its name: live */
} kvpi_meta_owner;

kvpi_meta_owner kvpi_meta_judge_owner(kvp_status st, const char *reply, const char *segment,
                                      const char *instance);

/* The KVPI_INSTANCE_FIELD of descriptor text (malloc'ed), or NULL when it has
 * none or is not JSON. */
char *kvpi_meta_instance_of(const char *desc_json);

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
#define KVPI_RPC_HDR_LEN 9 /* u64 length + u8 type */

/* The header of a frame holding json_len bytes of JSON. */
void kvpi_rpc_frame_header(int type, size_t json_len, uint8_t hdr[KVPI_RPC_HDR_LEN]);

/* Check the header at the start of buf, of which have bytes (8 or more) have
 * arrived: the length word (1..KVPI_RPC_MAX_FRAME), and the type byte too when
 * have > 8. On success *json_len is the JSON's length (the frame's less the
 * type byte), which follows the 9-byte header, and *type the type (-1 while
 * have == 8). KVP_EPROTO, with a message, otherwise. Pure; thread-safe. */
kvp_status kvpi_rpc_frame_decode(const uint8_t *buf, size_t have, int *type, size_t *json_len);

typedef struct kvpi_rpc_server kvpi_rpc_server;

/* A NOTIFY request's contents (Mooncake's NotifyDesc), for the handshake
 * server's owner to queue: KVP_OK when taken, else a status whose
 * kvp_last_error() says why (KVP_EBUSY: the queue is full), which the
 * server passes back to the sender in its refusal. Called from the server's
 * connection threads; must not block. */
typedef kvp_status (*kvpi_rpc_notify_fn)(void *ctx, const char *name, const char *msg);

/* Mooncake's replies (TransferMetadata::receivePeerNotify and
 * receivePeerProbe at 3b5a594): a sender takes a NOTIFY reply whose
 * notify_msg is empty as a refusal. */
#define KVPI_RPC_NOTIFY_OK "{\"name\":\"\",\"notify_msg\":\"success\"}"
#define KVPI_RPC_PROBE_OK "{\"status\":\"success\"}"
/* kvpipe's refusal adds these fields (Mooncake ignores them): why, and the
 * kvp_status the sender reports. */
#define KVPI_RPC_REFUSED_FIELD "kvpipe_refused"
#define KVPI_RPC_STATUS_FIELD "kvpipe_status"

/* The request JSON of a NOTIFY frame: {"name": name, "notify_msg": msg}, as
 * Mooncake's sender writes it. Malloc'ed; NULL when out of memory. */
char *kvpi_rpc_notify_json(const char *name, const char *msg);

/* Judge a NOTIFY reply: KVP_OK when its notify_msg is a non-empty string (as
 * Mooncake's sendNotify does); else the status a kvpipe server's refusal
 * carries (KVP_EBUSY for a full queue), KVP_ENOTSUP for any other refusal
 * (an older kvpipe answers "{}"), KVP_EPROTO for a reply that is not a JSON
 * object; kvp_last_error() says which. Pure; thread-safe. */
kvp_status kvpi_rpc_notify_reply_check(const char *reply);

/* Serve handshakes on host:port until stopped. A METADATA request is answered
 * with a METADATA frame holding desc_fn()'s text; a NOTIFY request (a JSON
 * object whose "name" and "notify_msg" are strings or absent) is handed to
 * notify_fn and answered KVPI_RPC_NOTIFY_OK when it takes it, else (no
 * notify_fn, a malformed request, notify_fn refuses) with a refusal:
 * {"name":"","notify_msg":"","kvpipe_refused":why,"kvpipe_status":n}; a PROBE
 * with KVPI_RPC_PROBE_OK; a CONNECT with "{}". Malformed or oversized frames
 * close that connection only. limits (NULL: defaults) caps connections and bounds each
 * request (common/conn_server.h): it must begin and be read within
 * timeout_ms (+ its length at min_rate). */
struct kvpi_conn_limits;
kvp_status kvpi_rpc_server_start(const char *host, int port, const struct kvpi_conn_limits *limits,
                                 kvpi_rpc_desc_fn desc_fn, void *ctx, kvpi_rpc_server **out);
/* The same in the authenticated mode (auth non-NULL, common/auth.h): every
 * connection proves the key (channel "rpc") within timeout_ms of its accept,
 * before its request is read; one that does not is closed, and logged
 * (rate-limited). */
struct kvpi_auth;
kvp_status kvpi_rpc_server_start_auth(const char *host, int port,
                                      const struct kvpi_conn_limits *limits,
                                      const struct kvpi_auth *auth, kvpi_rpc_desc_fn desc_fn,
                                      void *ctx, kvpi_rpc_server **out);
/* The same with a NOTIFY handler (NULL: notifications are refused); the
 * engine's server. */
kvp_status kvpi_rpc_server_start_notify(const char *host, int port,
                                        const struct kvpi_conn_limits *limits,
                                        const struct kvpi_auth *auth, kvpi_rpc_desc_fn desc_fn,
                                        kvpi_rpc_notify_fn notify_fn, void *ctx,
                                        kvpi_rpc_server **out);
void kvpi_rpc_server_stop(kvpi_rpc_server *server);

/* The port the server listens on (the one chosen when started with port 0). */
int kvpi_rpc_server_port(const kvpi_rpc_server *server);

/* One request/response exchange; *reply is malloc'ed JSON text. The whole
 * exchange (connect, request, the complete reply) must finish within
 * timeout_ms, else KVP_ETIMEDOUT. */
kvp_status kvpi_rpc_call(const char *host, int port, int type, const char *json, int timeout_ms,
                         char **reply);
/* The same, proving the key first when auth is non-NULL (KVP_EAUTH when the
 * server does not prove it back, or refuses). */
kvp_status kvpi_rpc_call_auth(const char *host, int port, const struct kvpi_auth *auth, int type,
                              const char *json, int timeout_ms, char **reply);

#endif
