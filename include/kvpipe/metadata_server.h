/* The embedded HTTP metadata store (Mooncake's http metadata protocol).
 *
 *   GET|PUT|DELETE <any path>?key=<url-encoded key>
 *   PUT stores the request body as the key's value; GET returns it
 *   (404 when missing); DELETE removes it (200 even when missing).
 *
 * Values are kept in memory. Bodies above 16 MiB are refused with 413.
 * Thread-safe: the server runs its own thread(s).
 */
#ifndef KVPIPE_METADATA_SERVER_H
#define KVPIPE_METADATA_SERVER_H

#include "kvpipe/export.h"
#include "kvpipe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_metadata_server kvp_metadata_server;

/* Start serving on host:port (port 0: any free port; host NULL: 127.0.0.1). */
KVP_API kvp_status kvp_metadata_server_start(const char *host, int port, kvp_metadata_server **out);

/* The port it listens on. */
KVP_API int kvp_metadata_server_port(const kvp_metadata_server *server);

/* Stop serving and free every stored value. NULL is a no-op. */
KVP_API void kvp_metadata_server_stop(kvp_metadata_server *server);

#ifdef __cplusplus
}
#endif
#endif
