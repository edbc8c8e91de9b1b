/* Internal: the listener behind kvpipe's two HTTP servers (the metadata
 * store, metadata/http_server.c, and the metrics endpoint,
 * engine/metrics_server.c), on libmicrohttpd.
 *
 * libmicrohttpd (MHD) parses and answers; this listener decides who gets a
 * connection, because MHD alone hands a listener to whoever fills it first:
 * at its connection cap it stops accepting (newcomers wait in the kernel's
 * queue, then time out), at its per-address cap it closes newcomers, and it
 * closes a connection only after a whole idle timeout without a byte, which
 * a client trickling one byte now and then (slowloris) never reaches.
 *
 *  - Accepting is ours: one thread accepts, then hands each connection to
 *    MHD (MHD_add_connection; MHD runs without a listening socket).
 *  - Eviction instead of refusal. When a newcomer finds max_conns
 *    connections open, or max_conns_per_ip from its address, the listener
 *    shuts down the connection from that set that has waited longest for a
 *    complete request header (connected, or answered, longest ago and not in
 *    a request since) and has no bytes waiting unread: a half-open
 *    connection, a trickling one, or an idle keep-alive one. Progress is
 *    spared: a connection whose header is complete (MHD is reading its body
 *    or answering it) is never evicted, nor one whose bytes wait for MHD's
 *    thread to read them (a request sent whole while that thread was busy
 *    with a flood); only when every connection of the set is spared is the
 *    newcomer closed. So a flood of unfinished requests cannot lock a
 *    legitimate client out: each newcomer pushes out the oldest of them, and
 *    a client that sends its request at once is served.
 *  - Deadlines: a connection's request line and headers must arrive within
 *    header_ms of connecting or of its previous answer, and its request must
 *    be answered within request_ms of the same start, however slowly it
 *    trickles; MHD's own idle timeout (idle_s) closes a connection silent
 *    that long.
 *  - Shutting down, never closing: evicted and overdue connections are
 *    shut down (shutdown(2)) through a descriptor of the listener's own (a
 *    dup of MHD's, closed only once MHD has closed its own), and MHD, seeing
 *    the socket end, closes them on its own thread. So any connection can be
 *    evicted, one MHD has not taken up yet included, and the listener never
 *    touches a descriptor number the process reused. Each connection costs
 *    two descriptors.
 *  - Out of descriptors (EMFILE and the like): the oldest waiting connection
 *    is evicted and accepting pauses 10 ms, doubling up to 1 s while the
 *    shortage lasts; never a busy loop.
 *
 * Thread safety: start and stop from one thread; the access handler and the
 * completed callback run on MHD's thread. */
#ifndef KVPI_COMMON_HTTP_LISTENER_H
#define KVPI_COMMON_HTTP_LISTENER_H

#include <microhttpd.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpipe/status.h"

typedef struct kvpi_http_limits {
    unsigned max_conns;        /* connections at once (within the open-file limit) */
    unsigned max_conns_per_ip; /* from one client address; 0: max_conns */
    unsigned idle_s;           /* close a connection silent this long */
    uint64_t header_ms;        /* request line and headers, however they trickle */
    uint64_t request_ms;       /* the whole request, until answered */
    size_t conn_memory;        /* MHD's memory per connection (request line, headers) */
} kvpi_http_limits;

typedef struct kvpi_http_listener kvpi_http_listener;

/* What the listener has done, for its log lines and the tests. */
typedef struct kvpi_http_listener_stats {
    unsigned open;          /* connections MHD serves now */
    uint64_t accepted;      /* handed to MHD */
    uint64_t evicted;       /* shut down to admit a newcomer */
    uint64_t refused;       /* newcomers closed: every connection of theirs in a request */
    uint64_t overdue;       /* shut down past header_ms or request_ms */
    uint64_t accept_errors; /* accept failures (EMFILE and the like) */
} kvpi_http_listener_stats;

/* Listen on host:port (0: any free port; the port taken in *port_out) and
 * serve each request with on_request / on_completed (MHD's access handler
 * and completed callback; on_completed may be NULL) and cls. what names the
 * server in log lines ("metadata server"). KVP_EIO when the address cannot
 * be bound or MHD cannot start, KVP_ENOMEM. */
kvp_status kvpi_http_listener_start(const char *what, const char *host, int port,
                                    const kvpi_http_limits *limits,
                                    MHD_AccessHandlerCallback on_request,
                                    MHD_RequestCompletedCallback on_completed, void *cls,
                                    kvpi_http_listener **out, int *port_out);

/* Stop accepting, close every connection, stop MHD and free. NULL: no-op. */
void kvpi_http_listener_stop(kvpi_http_listener *l);

void kvpi_http_listener_stats_get(kvpi_http_listener *l, kvpi_http_listener_stats *out);

/* max_conns within the process's open-file limit, leaving reserve
 * descriptors to everything else the process opens. */
unsigned kvpi_http_conns_within_fd_limit(unsigned max_conns, unsigned reserve, const char *what);

#endif
