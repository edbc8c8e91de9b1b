/* The embedded HTTP metadata store, with the rules of Mooncake's own server
 * (mooncake-wheel/mooncake/http_metadata_server.py), so that kvpipe and
 * Mooncake engines can share it and kvpipe's tests meet Mooncake's rules:
 *
 *   GET|PUT|DELETE /metadata?key=<url-encoded key>
 *   PUT stores the body as the key's value; GET returns it (404 when
 *   missing); DELETE removes it (404 when missing). A second PUT of an
 *   existing key that contains "rpc_meta" is refused with 400 "Duplicate
 *   rpc_meta key not allowed". Other paths are 404.
 *
 * kvpipe extensions (read-only): GET /health answers 200 "OK"; GET
 * /metadata?list=PREFIX answers a JSON array of the keys that start with
 * PREFIX. docs/metadata-http.md has every rule and limit.
 *
 * Values are kept in memory, within the limits below. Thread-safe: the server
 * runs its own threads; start, port and stop may be called from any thread.
 */
#ifndef KVPIPE_METADATA_SERVER_H
#define KVPIPE_METADATA_SERVER_H

#include <stddef.h>

#include "kvpipe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_metadata_server kvp_metadata_server;

/* Limits of one server. Zero fields take their defaults. */
typedef struct kvp_metadata_server_opts {
    const char *host; /* address to bind; NULL: 127.0.0.1 */
    int port;         /* 0: any free port */
    /* Largest value one PUT may store (default 16 MiB); a larger body is
     * refused with 413, from its Content-Length before it is read. */
    size_t max_value_bytes;
    /* All the memory the store may hold (default 256 MiB): stored keys and
     * values, bodies being received (reserved from their Content-Length) and
     * listings being sent. A PUT that would pass it is refused with 507. */
    size_t max_total_bytes;
    /* Connections served at once (default 1024, and at most the process's
     * open-file limit less 32); more wait in the kernel's listen queue. */
    unsigned max_connections;
    /* Connections served at once from one client address (default 256);
     * more are closed as they arrive. */
    unsigned max_connections_per_ip;
    /* A connection that sends nothing for this long is closed (default 15 s).
     * Also the header deadline: a connection must finish its request line and
     * headers within this long (at most request_timeout_s) of connecting or
     * of its previous answer, however slowly it trickles; else it is closed. */
    unsigned idle_timeout_s;
    /* A connection must complete each request - headers, body and answer -
     * within this many seconds of its previous one (or of connecting), however
     * slowly it trickles; else it is closed (default 30 s). */
    unsigned request_timeout_s;
} kvp_metadata_server_opts;

/* Fill opts with the defaults above (host NULL, port 0). The struct grows
 * at its end (docs/abi.md): the inline wrappers pass its size. */
KVP_API void kvp_metadata_server_opts_init_size(kvp_metadata_server_opts *opts, size_t size);
static inline void kvp_metadata_server_opts_init(kvp_metadata_server_opts *opts)
{
    kvp_metadata_server_opts_init_size(opts, sizeof *opts);
}

/* Start serving with opts (NULL: the defaults). KVP_EINVAL for a port outside
 * 0..65535, KVP_EIO when the address cannot be bound. *out is set only on
 * success. */
KVP_API kvp_status kvp_metadata_server_start_opts_size(const kvp_metadata_server_opts *opts,
                                                       size_t size, kvp_metadata_server **out);
static inline kvp_status kvp_metadata_server_start_opts(const kvp_metadata_server_opts *opts,
                                                        kvp_metadata_server **out)
{
    return kvp_metadata_server_start_opts_size(opts, sizeof *opts, out);
}

/* Start serving on host:port with the default limits (port 0: any free port;
 * host NULL: 127.0.0.1). */
KVP_API kvp_status kvp_metadata_server_start(const char *host, int port, kvp_metadata_server **out);

/* The port it listens on; -1 for NULL. */
KVP_API int kvp_metadata_server_port(const kvp_metadata_server *server);

/* Bytes of the memory budget in use now (see max_total_bytes); 0 for NULL. */
KVP_API size_t kvp_metadata_server_bytes_used(const kvp_metadata_server *server);

/* Stop serving, close every connection and free every stored value. NULL is a
 * no-op. Blocks until the server's threads have finished. */
KVP_API void kvp_metadata_server_stop(kvp_metadata_server *server);

#ifdef __cplusplus
}
#endif
#endif
