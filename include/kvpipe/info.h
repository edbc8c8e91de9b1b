/* What this build of kvpipe and this host offer, in the spirit of libfabric's
 * fi_getinfo: which transports can serve here, which metadata stores are built
 * in, which libraries (and versions) the build uses. Plus the two checks an
 * operator makes of a deployment: does a metadata store answer, and what does
 * it hold for a segment. `kvpipe info` prints all of it.
 *
 *   kvp_info *info;
 *   if (kvp_info_get(NULL, 0, &info) == KVP_OK) {
 *       const kvp_transport_info *t;
 *       for (size_t i = 0; (t = kvp_info_transport(info, i)); i++)
 *           printf("%s: %s\n", t->name, t->status ? t->detail : "available");
 *       kvp_info_free(info);
 *   }
 *
 * The structs are the library's: a later version may append fields, never
 * reorder them, so read them through the pointers handed out and never
 * allocate one yourself.
 *
 * Threads: every function is thread-safe; an info object may be read from
 * several threads at once and is freed once, after the last read.
 */
#ifndef KVPIPE_INFO_H
#define KVPIPE_INFO_H

#include <stddef.h>

#include "kvpipe/export.h"
#include "kvpipe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_info kvp_info;

/* Capability: the transport reaches only peers on this host (shm). */
#define KVP_TRANSPORT_SAME_HOST 0x1u

typedef struct kvp_transport_info {
    const char *name; /* "tcp", "shm", "rdma": the engine's protocol names */
    /* KVP_OK: it can serve on the host asked about. KVP_ENOTSUP: not in this
     * build. Another code: built in, but its server failed to start here. */
    kvp_status status;
    const char *detail; /* why, when status is not KVP_OK; "" otherwise */
    unsigned caps;      /* KVP_TRANSPORT_* flags */
} kvp_transport_info;

/* Flag: no store at all; engines exchange descriptors by handshake (P2PHANDSHAKE). */
#define KVP_STORE_PEER_TO_PEER 0x1u

typedef struct kvp_store_info {
    const char *name;   /* "http", "etcd", "redis", "p2p" */
    const char *syntax; /* its connection strings, e.g. "redis://[user:pass@]h:p[/db]" */
    kvp_status status;  /* KVP_OK: built in; KVP_ENOTSUP: not in this build */
    const char *detail; /* for KVP_ENOTSUP: the CMake option that builds it in; else "" */
    unsigned flags;     /* KVP_STORE_* flags */
} kvp_store_info;

typedef struct kvp_component_info {
    const char *name;    /* "kvpipe", "libzmq", "libcurl", "libmicrohttpd", "hiredis", "cJSON" */
    const char *version; /* of the library in use at run time where it tells, else the
                          * one built against; "" when not built in */
    const char *purpose; /* what kvpipe uses it for */
    kvp_status status;   /* KVP_OK: built in; KVP_ENOTSUP: not in this build */
} kvp_component_info;

/* A kind of memory the engine can register and move (kvp_mem_kind). */
typedef struct kvp_memory_info {
    const char *name; /* "host", "cuda" */
    /* KVP_OK: this build and host serve it. KVP_ENOTSUP: not here (for cuda:
     * no driver, or cuInit failed), detail says why. */
    kvp_status status;
    /* For KVP_OK, what serves it ("CUDA driver 12.4, 2 devices"); else why
     * not ("CUDA: libcuda.so.1 not found ..."). */
    const char *detail;
    const char *transports; /* the transports of this build that move it: "tcp, shm" */
} kvp_memory_info;

/* The address an engine would give its peers on this host when named with a
 * wildcard host ("0.0.0.0:port"), or the one env MC_TCP_BIND_ADDRESS forces
 * (kvp_engine_opts.bind_address; docs/transport-tcp.md). */
typedef struct kvp_address_info {
    kvp_status status;   /* KVP_OK, or why none could be chosen */
    const char *address; /* "10.0.0.2"; "" unless status is KVP_OK */
    /* One line: where it came from (the interface, and the container
     * bridges and loopback passed over), or the error. */
    const char *reason;
} kvp_address_info;

/* Find out what this build offers and whether each transport can serve on
 * host (NULL: "127.0.0.1"): each built-in transport's server is started there
 * and stopped again, as an engine would, each bounded by timeout_ms (0: 2000).
 * Blocks for that. *out is freed with kvp_info_free(). Errors: KVP_EINVAL (out
 * NULL), KVP_ENOMEM. A transport that cannot serve is not an error: its entry
 * says so. */
KVP_API kvp_status kvp_info_get(const char *host, int timeout_ms, kvp_info **out);

/* Free an info object and every string it handed out. NULL is a no-op. */
KVP_API void kvp_info_free(kvp_info *info);

/* Entry i (from 0) of each list, or NULL past the end; valid until the info
 * is freed. Transports come in the engine's order of preference. */
KVP_API const kvp_transport_info *kvp_info_transport(const kvp_info *info, size_t i);
KVP_API const kvp_store_info *kvp_info_store(const kvp_info *info, size_t i);
KVP_API const kvp_component_info *kvp_info_component(const kvp_info *info, size_t i);
/* Memory kinds: host always first, then cuda (available where the CUDA driver
 * loads: it is loaded, and cuInit run, by kvp_info_get; docs/gpu.md). */
KVP_API const kvp_memory_info *kvp_info_memory(const kvp_info *info, size_t i);

/* The advertised address (kvp_address_info above), chosen by kvp_info_get
 * as an engine created now would choose it. Never NULL for a non-NULL info. */
KVP_API const kvp_address_info *kvp_info_address(const kvp_info *info);

/* The store that handles connection string conn (as an engine would pick it),
 * or NULL when no store accepts it. Does not connect. */
KVP_API const kvp_store_info *kvp_info_store_for(const kvp_info *info, const char *conn);

/* Check that the metadata store named by conn answers: connect as an engine
 * would, each request bounded by timeout_ms (0: 5000). P2PHANDSHAKE has no
 * store and passes at once. Errors: KVP_EMETADATA naming the store and its
 * address, KVP_EINVAL for a connection string no store accepts, KVP_ENOTSUP
 * for a store not built in; the detail is in kvp_last_error(). */
KVP_API kvp_status kvp_info_store_check(const char *conn, int timeout_ms);

/* Fetch the descriptor the metadata store conn holds for segment (with
 * P2PHANDSHAKE: by a handshake to the engine at the segment name, host:port).
 * *descriptor is its JSON text as stored and *host the host its servers listen
 * on (rpc_meta); both malloc'ed, the caller frees them with free(); both set
 * only on success. Blocks at most timeout_ms (0: 5000) per request. Errors: as
 * kvp_info_store_check(), plus KVP_ENOTFOUND (no such segment) and the
 * handshake's connection errors; kvp_last_error() names the segment. With env
 * KVPIPE_AUTH_KEY_FILE set, the handshake proves that key (an authenticated
 * engine answers nothing else; docs/security.md), and KVP_ECONFIG when the
 * file is unusable; the descriptor is returned as stored, signature and all,
 * without checking it. */
KVP_API kvp_status kvp_info_segment(const char *conn, const char *segment, int timeout_ms,
                                    char **descriptor, char **host);

#ifdef __cplusplus
}
#endif
#endif
