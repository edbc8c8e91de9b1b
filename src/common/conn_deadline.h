/* Internal: deadlines on the connections of an event-driven server, for
 * libmicrohttpd's listeners (metadata/http_server.c, engine/metrics_server.c).
 *
 * libmicrohttpd closes a connection that sends nothing for its
 * MHD_OPTION_CONNECTION_TIMEOUT, which a client trickling one byte every few
 * seconds defeats (slowloris). A kvpi_deadlines holds the server's open
 * connections, each with a deadline, and a reaper thread that shuts down
 * (shutdown(2), never close) the socket of each connection past its
 * deadline; the server's own thread sees the socket end and closes it.
 *
 * Thread-safe. The caller removes a connection before its socket is closed
 * (libmicrohttpd's MHD_CONNECTION_NOTIFY_CLOSED comes before the close), so
 * the reaper never shuts down a descriptor reused for something else.
 */
#ifndef KVPI_COMMON_CONN_DEADLINE_H
#define KVPI_COMMON_CONN_DEADLINE_H

#include <stdint.h>

#include "kvpipe/status.h"

typedef struct kvpi_deadlines kvpi_deadlines;
typedef struct kvpi_deadline_conn kvpi_deadline_conn;

/* Start the reaper; what names the server in its log lines (e.g. "metadata
 * server"). KVP_ENOMEM or KVP_EIO (no thread). */
kvp_status kvpi_deadlines_start(const char *what, kvpi_deadlines **out);

/* Stop the reaper and free every tracked connection (their sockets are the
 * server's). NULL is a no-op. */
void kvpi_deadlines_stop(kvpi_deadlines *d);

/* Track fd with a deadline limit_ms from now; why names the deadline in the
 * reaper's log line ("request header", ...). NULL when out of memory (the
 * connection then goes untracked). */
kvpi_deadline_conn *kvpi_deadlines_add(kvpi_deadlines *d, int fd, uint64_t limit_ms,
                                       const char *why);

/* A new deadline for c: limit_ms from now when restart, else from when its
 * clock last (re)started. NULL c is a no-op. */
void kvpi_deadlines_set(kvpi_deadlines *d, kvpi_deadline_conn *c, uint64_t limit_ms,
                        const char *why, int restart);

/* Stop tracking c (before its socket is closed). NULL c is a no-op. */
void kvpi_deadlines_remove(kvpi_deadlines *d, kvpi_deadline_conn *c);

/* Connections shut down for their deadline so far. */
unsigned long kvpi_deadlines_reaped(kvpi_deadlines *d);

#endif
