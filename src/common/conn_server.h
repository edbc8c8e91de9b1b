/* Internal: the one connection server behind every listener.
 *
 * The TCP data plane, the shm transport's Unix socket and the handshake (RPC)
 * port each hand a listening socket and a handler to a kvpi_conn_server, which
 * owns everything a hostile or broken peer could abuse:
 *
 *  - Accepting. The listening socket is non-blocking and polled with a stop
 *    event. When accept fails for want of file descriptors (EMFILE, ENFILE,
 *    ENOBUFS, ENOMEM) the server sheds one waiting connection through a
 *    reserved descriptor (so its client hears a close instead of hanging in
 *    the backlog), evicts its own oldest idle connection, and sleeps 10 ms,
 *    doubling up to 1 s while the shortage lasts (the pause resets only after
 *    a second without failures): never a busy loop, and it serves again as
 *    soon as descriptors free up.
 *  - One thread per connection (a 256 KiB stack). Handlers move bytes with
 *    blocking calls straight between the socket and registered memory, and
 *    the shm handler copies with process_vm_readv/writev; an event loop would
 *    turn each protocol into a state machine to save threads that the cap
 *    below already bounds, and would serialise the copies that threads run in
 *    parallel.
 *  - A cap on connections (max_conns). When a new connection finds the server
 *    full, the server evicts one by the progress it made: first the oldest
 *    connection that has not completed a request yet (in its setup, waiting
 *    for its first request, or in the middle of it: a half-open, trickling
 *    or handshake-failing stranger); failing that, the one a peer that did
 *    complete a request has kept idle the longest (a pooled connection,
 *    which its client reopens at once when it needs it; kvpipe's clients
 *    retry once); failing that, the one whose later request has been
 *    incomplete the longest; failing that, the one that has been busy on one
 *    request the longest, if for more than timeout_ms (a reader that drains
 *    its READ slowly). Only when every connection is on a request younger
 *    than timeout_ms that the server is moving bytes for is the new one
 *    refused. So a flood of idle, trickling or slow-reading connections
 *    cannot lock a legitimate peer out, and strangers displace each other,
 *    not the peers that did their work: each is cut at its deadline anyway.
 *  - Idle reaping: a connection waiting for its next request longer than
 *    idle_timeout_ms is closed.
 *  - Deadlines. Setup must finish within setup_timeout_ms of the accept; a
 *    request's first bytes start a deadline of timeout_ms for its header, and
 *    once its size is known, timeout_ms + size / min_rate for the whole
 *    request. Handlers do their I/O through kvpi_conn_send/recv*, which
 *    enforce it, so a peer that trickles one byte at a time cannot hold a
 *    connection (or what the handler holds for it) beyond that.
 *  - Stop: shuts every connection down and waits for the handlers, which are
 *    all blocked, if at all, in socket I/O that the shutdown ends. It never
 *    waits for a peer.
 *
 * A per-connection setup step (handler.setup) runs first in the connection's
 * thread under its own deadline, before serve: the shm transport's hello, and
 * the place for an authentication handshake. A transport whose connections
 * are set up elsewhere (UCX's own listener) simply does not use this server;
 * one that exchanges addresses over a socket can, with or without setup.
 *
 * Thread safety: start and stop from one thread; the kvpi_conn_* functions
 * are called by handlers, each on its own connection, in its own thread.
 */
#ifndef KVPI_COMMON_CONN_SERVER_H
#define KVPI_COMMON_CONN_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "common/clock.h"
#include "kvpipe/status.h"

/* The deadline base of a server's connections (KVPI_DEFAULT_TIMEOUT_MS). */
#define KVPI_CONN_TIMEOUT_MS_DEFAULT KVPI_DEFAULT_TIMEOUT_MS
#define KVPI_CONN_IDLE_MS_DEFAULT 60000
#define KVPI_CONN_MAX_DEFAULT 256
#define KVPI_MIN_RATE_DEFAULT ((uint64_t)16 << 20) /* bytes per second */

/* Every field: 0 means its default. */
typedef struct kvpi_conn_limits {
    int timeout_ms;       /* deadline base (default 5000) */
    int setup_timeout_ms; /* setup deadline (default: timeout_ms) */
    int idle_timeout_ms;  /* close a connection idle this long (default 60000) */
    int max_conns;        /* connections served at once (default 256) */
    uint64_t min_rate;    /* bytes per second a deadline allows for (default 16 MiB/s) */
} kvpi_conn_limits;

/* The limits with every 0 replaced by its default. */
kvpi_conn_limits kvpi_conn_limits_resolve(const kvpi_conn_limits *limits);

/* The deadline (kvpi_now_ns() clock) for moving bytes that start now:
 * timeout_ms + bytes / min_rate (min_rate 0: the default). */
uint64_t kvpi_transfer_deadline(int timeout_ms, uint64_t min_rate, uint64_t bytes);

typedef struct kvpi_conn kvpi_conn;
typedef struct kvpi_conn_server kvpi_conn_server;

typedef struct kvpi_conn_handler {
    /* Optional: runs first in the connection's thread, under a deadline of
     * setup_timeout_ms; the connection counts as incomplete meanwhile. Any
     * status but KVP_OK closes the connection. */
    kvp_status (*setup)(kvpi_conn *conn);
    /* Serves the connection; the server closes it when serve returns. */
    void (*serve)(kvpi_conn *conn);
    /* Bytes of zeroed per-connection state for the handler (kvpi_conn_data). */
    size_t data_size;
} kvpi_conn_handler;

/* Serve listen_fd (a bound, listening stream socket; the server owns it from
 * now on, also on failure) with handler h. name appears in log lines, for
 * example "tcp data server 10.0.0.2:41000". ctx is passed to the handler. */
kvp_status kvpi_conn_server_start(int listen_fd, const char *name, const kvpi_conn_limits *limits,
                                  const kvpi_conn_handler *h, void *ctx, kvpi_conn_server **out);

/* Stop accepting, end every connection, wait for the handlers, close the
 * listening socket and free. NULL is a no-op. */
void kvpi_conn_server_stop(kvpi_conn_server *server);

typedef struct kvpi_conn_stats {
    size_t open;            /* connections whose handler runs */
    uint64_t accepted;      /* connections handed to a handler */
    uint64_t evicted;       /* pushed out to make room */
    uint64_t refused;       /* turned away: every connection busy, or out of descriptors */
    uint64_t idle_closed;   /* closed after idle_timeout_ms */
    uint64_t accept_errors; /* accept failures, EMFILE and the like */
} kvpi_conn_stats;

void kvpi_conn_server_stats(kvpi_conn_server *server, kvpi_conn_stats *out);

/* ---- for handlers, on their own connection ---- */

int kvpi_conn_fd(const kvpi_conn *conn);
void *kvpi_conn_ctx(const kvpi_conn *conn);
void *kvpi_conn_data(kvpi_conn *conn);
const char *kvpi_conn_name(const kvpi_conn *conn); /* the server's name */
const kvpi_conn_limits *kvpi_conn_limits_of(const kvpi_conn *conn);

/* Read the next request's fixed-size header (len bytes) into hdr. The
 * connection is idle until its first byte arrives (at most idle_timeout_ms),
 * then incomplete: the rest of the header must arrive within timeout_ms.
 * A header already queued is read without waiting. Returns KVP_OK;
 * KVP_ECLOSED when the connection should end before a request began (the
 * peer closed, idle_timeout_ms passed, it was evicted, the server stops);
 * or the error that cut a header short (KVP_ETIMEDOUT, KVP_ECONNRESET). */
kvp_status kvpi_conn_next(kvpi_conn *conn, void *hdr, size_t len);

/* The request's header is complete and the peer sends bytes more (a body):
 * the deadline becomes timeout_ms + bytes / min_rate from now; the request
 * stays incomplete (first in line for eviction after idle connections).
 * Returns 0 if the connection was evicted meanwhile (its I/O then fails). */
int kvpi_conn_expect(kvpi_conn *conn, uint64_t bytes);

/* The request is complete and the server now moves bytes for it (a READ's
 * data, a reply, a copy): the deadline becomes timeout_ms + bytes / min_rate
 * from now, and the connection is busy, evicted only once it has been busy
 * longer than timeout_ms and nothing idle or incomplete is left. Returns 0 if
 * the connection was evicted meanwhile. */
int kvpi_conn_busy(kvpi_conn *conn, uint64_t bytes);

/* The current deadline, for I/O a handler does itself (kvpi_now_ns clock). */
uint64_t kvpi_conn_deadline(const kvpi_conn *conn);

/* kvpi_send_all_by and friends on the connection, under its deadline. The
 * sends first send what kvpi_conn_send_later queued. */
struct iovec;
kvp_status kvpi_conn_send(kvpi_conn *conn, const void *buf, size_t len);
/* Queue len bytes (an answer the peer does not wait for alone) to be sent,
 * in order, before the next send, when kvpi_conn_next finds no request
 * queued and would wait for one, when KVPI_CONN_LATER_MAX bytes are queued,
 * at kvpi_conn_flush, or when the handler returns: answers to pipelined
 * requests then leave together, in one segment, instead of one each. */
#define KVPI_CONN_LATER_MAX 1024
kvp_status kvpi_conn_send_later(kvpi_conn *conn, const void *buf, size_t len);
kvp_status kvpi_conn_flush(kvpi_conn *conn);
kvp_status kvpi_conn_recv(kvpi_conn *conn, void *buf, size_t len);
kvp_status kvpi_conn_sendv(kvpi_conn *conn, struct iovec *iov, int n);
kvp_status kvpi_conn_recvv(kvpi_conn *conn, struct iovec *iov, int n);

#endif
