/* TCP transport: Mooncake's data plane (see tcp_wire.h).
 *
 * Server: a connection server (common/conn_server.h) with one thread per
 * connection; every request is checked against the region table and the region
 * stays pinned while its bytes move, straight between the socket and
 * registered memory, under the request's deadline.
 * Client: a small pool of persistent connections per peer (at most
 * conns_per_peer, reused most recently returned first); a group of slices is
 * pipelined on one connection (all headers first for READs), under one
 * deadline for the whole group. A pooled connection idle for idle_timeout_ms
 * is closed, and one the peer closed is closed at once: the server's reaper
 * thread looks at every peer's pool every min(idle_timeout_ms / 4, 1 s), so
 * an engine holds at most conns_per_peer connections per peer it talks to,
 * none to peers it stopped talking to, and 100,000 short transfers cost no
 * more ephemeral ports or descriptors than a few (docs/transport-tcp.md,
 * "Connections stay bounded").
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/conn_server.h"
#include "common/digest.h"
#include "common/error.h"
#include "common/log.h"
#include "common/tsan.h"
#include "transport/runner.h"
#include "transport/staging.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

#define DRAIN_LIMIT (64u << 20)
/* The reaper looks at the pools this often: a quarter of the idle time, at
 * most a second and at least 10 ms. */
#define REAP_PERIOD_MAX_MS 1000
#define REAP_PERIOD_MIN_MS 10

/* ------------------------------------------------------------------ server */

typedef struct tcp_peer tcp_peer;

typedef struct tcp_server {
    kvpi_region_table *regions;
    kvpi_served *served; /* may be NULL */
    kvpi_conn_server *conns;
    int port;
    const kvpi_auth *auth; /* NULL: unauthenticated */
    kvpi_runner *runner;   /* the initiator side's threads (peer_post) */
    /* The initiator side's pools: every open peer, and the thread that closes
     * their idle connections (started with the first peer). */
    int idle_ms;
    pthread_mutex_t peers_lock;
    pthread_cond_t reaper_cond;
    tcp_peer *peers;
    pthread_t reaper;
    int reaper_started, reaper_stop;
} tcp_server;

static const char *op_name(const kvpi_tcp_hdr *h)
{
    return h->opcode == KVPI_TCP_OP_READ ? "READ" : "WRITE";
}

static kvp_status send_status(kvpi_conn *c, uint32_t code)
{
    uint8_t frame[8];
    kvpi_tcp_status_encode(code, frame);
    return kvpi_conn_send(c, frame, sizeof frame);
}

/* After refusing a WRITE, let the client finish sending so that it reads our
 * status frame instead of a reset: read and drop what it sends, up to what
 * the request still owed and 64 MiB, until it closes or the deadline. */
static void drain(kvpi_conn *c, uint64_t size)
{
    char sink[65536];
    uint64_t left = size < DRAIN_LIMIT ? size : DRAIN_LIMIT;
    shutdown(kvpi_conn_fd(c), SHUT_WR);
    while (left > 0) {
        size_t n = left < sizeof sink ? (size_t)left : sizeof sink;
        if (kvpi_conn_recv(c, sink, n) != KVP_OK) break;
        left -= n;
    }
}

/* Refuse a request: v2 answers status 1 ("address rejected", the only error
 * Mooncake defines) and, for a WRITE, drains its payload; then the
 * connection closes. Returns -1. */
static int refuse(kvpi_conn *c, const kvpi_tcp_hdr *h)
{
    tcp_server *srv = kvpi_conn_ctx(c);
    if (srv->served) kvpi_counter_add(&srv->served->refused, 1);
    if (h->v2 && send_status(c, KVPI_TCP_STATUS_REJECTED) == KVP_OK &&
        h->opcode == KVPI_TCP_OP_WRITE)
        drain(c, h->size);
    return -1;
}

static void log_fault(kvpi_conn *c, const kvpi_tcp_hdr *h, const char *when)
{
    KVPI_WARN_LIMITED("%s: %s of [0x%llx, +%llu) %s: registered memory is not mapped or not "
                      "readable (EFAULT); was it freed without kvp_engine_unregister()?%s",
                      kvpi_conn_name(c), op_name(h), (unsigned long long)h->addr,
                      (unsigned long long)h->size, when,
                      h->v2 ? " The peer gets status 1 (address rejected)." : "");
}

/* The staged I/O of a request on device memory (staging.h): a READ's first
 * buffer goes with the status frame, which is sent only once the first copy
 * succeeded, so that a failed copy can still be answered. */
typedef struct staged_io {
    kvpi_conn *c;
    int status_due;
    kvpi_digester *digest; /* integrity: of the bounce buffers moved */
} staged_io;

static kvp_status staged_send(void *ctx, void *buf, size_t len, uint64_t off)
{
    staged_io *io = ctx;
    (void)off;
    if (io->digest) kvpi_digester_add(io->digest, buf, len);
    uint8_t frame[8];
    kvpi_tcp_status_encode(KVPI_TCP_STATUS_OK, frame);
    struct iovec iov[2] = {{frame, sizeof frame}, {buf, len}};
    int with_status = io->status_due;
    io->status_due = 0;
    return kvpi_conn_sendv(io->c, with_status ? iov : iov + 1, with_status ? 2 : 1);
}

static kvp_status staged_recv(void *ctx, void *buf, size_t len, uint64_t off)
{
    staged_io *io = ctx;
    (void)off;
    kvp_status st = kvpi_conn_recv(io->c, buf, len);
    if (!st && io->digest) kvpi_digester_add(io->digest, buf, len);
    return st;
}

/* Integrity: a READ's payload is followed by the digest of what was sent,
 * which goes with the connection's next answer (kvpi_conn_send_later). */
static kvp_status send_digest(kvpi_conn *c, uint64_t digest)
{
    uint8_t d[KVPI_DIGEST_LEN];
    kvpi_put_le64(d, digest);
    return kvpi_conn_send_later(c, d, sizeof d);
}

/* Integrity: a WRITE's payload is followed by the digest its sender took;
 * KVP_ECORRUPT (logged) when it is not got, the digest of what landed. */
static kvp_status check_digest(kvpi_conn *c, const kvpi_tcp_hdr *h, uint64_t got)
{
    uint8_t d[KVPI_DIGEST_LEN];
    kvp_status st = kvpi_conn_recv(c, d, sizeof d);
    if (st || kvpi_get_le64(d) == got) return st;
    KVPI_WARN_LIMITED("%s: WRITE of [0x%llx, +%llu) arrived corrupted (its digest differs from "
                      "the sender's); the request fails with status 2",
                      kvpi_conn_name(c), (unsigned long long)h->addr, (unsigned long long)h->size);
    return KVP_ECORRUPT;
}

/* A WRITE's v2 status, OK or 2 for a verdict of KVP_ECORRUPT, sent with the
 * statuses of the WRITEs pipelined behind it (kvpi_conn_send_later). */
static kvp_status write_status(kvpi_conn *c, kvp_status verdict)
{
    uint8_t frame[8];
    kvpi_tcp_status_encode(verdict == KVP_ECORRUPT ? KVPI_TCP_STATUS_CORRUPT : KVPI_TCP_STATUS_OK,
                           frame);
    return kvpi_conn_busy(c, 8) ? kvpi_conn_send_later(c, frame, sizeof frame) : KVP_ECLOSED;
}

/* A request on registered device memory, through bounce buffers. A failed
 * copy is refused as v2's status 1 where the status is still ours to send
 * (the peer sees "address rejected"; our log says why); a READ whose status
 * already went out closes the connection (the peer sees it reset). */
static int serve_staged(kvpi_conn *c, tcp_server *srv, const kvpi_tcp_hdr *h, kvpi_pin pin)
{
    const kvpi_region *r = kvpi_pin_region(pin);
    staged_io io = {.c = c, .status_due = h->v2};
    if (h->digest && !(io.digest = kvpi_digester_new())) {
        kvpi_region_unpin(srv->regions, pin);
        return -1;
    }
    uint64_t moved = 0;
    int copy_failed = 0;
    int read = h->opcode == KVPI_TCP_OP_READ;
    kvp_status st = kvpi_stage_serve(read ? KVP_OP_READ : KVP_OP_WRITE, r->device, h->addr, h->size,
                                     read ? staged_send : staged_recv, &io, &moved, &copy_failed);
    kvpi_region_unpin(srv->regions, pin);
    uint64_t digest = io.digest ? kvpi_digester_value(io.digest) : 0;
    kvpi_digester_free(io.digest);
    if (copy_failed) {
        KVPI_WARN_LIMITED("%s: %s of [0x%llx, +%llu) on cuda device %d failed: %s",
                          kvpi_conn_name(c), op_name(h), (unsigned long long)h->addr,
                          (unsigned long long)h->size, r->device, kvp_last_error());
        if (read && !io.status_due) return -1;
        kvpi_tcp_hdr rest = *h;
        rest.size = h->size - moved;
        return refuse(c, &rest);
    }
    if (st == KVP_OK && read && h->digest) st = send_digest(c, digest);
    kvp_status verdict = st == KVP_OK && !read && h->digest ? check_digest(c, h, digest) : st;
    if (verdict != KVP_ECORRUPT) st = verdict;
    if (st == KVP_OK && !read && h->v2) st = write_status(c, verdict);
    if (st)
        KVPI_DEBUG("%s: connection dropped during %s of %llu bytes: %s", kvpi_conn_name(c),
                   op_name(h), (unsigned long long)h->size, kvp_last_error());
    else if (srv->served)
        kvpi_served_add(srv->served, !read, h->size);
    return st ? -1 : 0;
}

/* Serve one request; returns 0 to keep the connection, -1 to close it. */
static int serve_request(kvpi_conn *c, tcp_server *srv, const kvpi_tcp_hdr *h)
{
    /* A READ is ours to send; a WRITE's body is the peer's to send, and the
     * request is incomplete (first to be evicted) until it is in. */
    int live =
        h->opcode == KVPI_TCP_OP_READ ? kvpi_conn_busy(c, h->size) : kvpi_conn_expect(c, h->size);
    if (!live) return -1;
    if (h->size == 0) return h->v2 && send_status(c, KVPI_TCP_STATUS_OK) ? -1 : 0;
    kvpi_pin pin;
    if (kvpi_region_pin(srv->regions, h->addr, h->size, kvpi_transport_tcp.mem_kinds, &pin) !=
        KVP_OK) {
        KVPI_WARN_LIMITED("%s: rejected %s of [0x%llx, +%llu): outside registered memory",
                          kvpi_conn_name(c), op_name(h), (unsigned long long)h->addr,
                          (unsigned long long)h->size);
        return refuse(c, h);
    }
    if (kvpi_pin_region(pin)->kind != KVP_MEM_HOST) return serve_staged(c, srv, h, pin);
    kvp_status st;
    void *mem = (void *)(uintptr_t)h->addr;
    if (h->opcode == KVPI_TCP_OP_READ) {
        /* v2 promises a status before the data: memory freed behind our back
         * must be found now, while status 1 can still be sent. */
        if (h->v2 && !kvpi_memory_mapped(mem, h->size)) {
            kvpi_region_unpin(srv->regions, pin);
            log_fault(c, h, "refused");
            return refuse(c, h);
        }
        uint8_t frame[8];
        kvpi_tcp_status_encode(KVPI_TCP_STATUS_OK, frame);
        struct iovec iov[2] = {{frame, sizeof frame}, {mem, h->size}};
        KVPI_PEER_COPY_BEGIN();
        st = h->v2 ? kvpi_conn_sendv(c, iov, 2) : kvpi_conn_sendv(c, iov + 1, 1);
        /* Integrity: the digest is taken in a pass of its own, which begins
         * once the send's copy has ended (common/digest.h). */
        if (!st && h->digest) st = send_digest(c, kvpi_digest(mem, h->size));
        KVPI_PEER_COPY_END();
        kvpi_region_unpin(srv->regions, pin);
        if (st == KVP_EINVAL) log_fault(c, h, "cut short"); /* unmapped mid-send */
    } else {
        uint64_t got = 0;
        KVPI_PEER_COPY_BEGIN();
        st = h->digest
                 ? kvpi_digest_recv(kvpi_conn_fd(c), mem, h->size, kvpi_conn_deadline(c), &got)
                 : kvpi_conn_recv(c, mem, h->size);
        KVPI_PEER_COPY_END();
        kvpi_region_unpin(srv->regions, pin);
        if (st == KVP_EINVAL) {
            log_fault(c, h, "refused");
            return refuse(c, h);
        }
        kvp_status verdict = st == KVP_OK && h->digest ? check_digest(c, h, got) : st;
        if (verdict != KVP_ECORRUPT) st = verdict;
        if (st == KVP_OK && h->v2) st = write_status(c, verdict);
    }
    if (st)
        KVPI_DEBUG("%s: connection dropped during %s of %llu bytes: %s", kvpi_conn_name(c),
                   op_name(h), (unsigned long long)h->size, kvp_last_error());
    else if (srv->served)
        kvpi_served_add(srv->served, h->opcode == KVPI_TCP_OP_WRITE, h->size);
    return st ? -1 : 0;
}

static void serve(kvpi_conn *c)
{
    tcp_server *srv = kvpi_conn_ctx(c);
    uint8_t raw[KVPI_TCP_HDR_LEN];
    kvp_status st;
    while ((st = kvpi_conn_next(c, raw, sizeof raw)) == KVP_OK) {
        kvpi_tcp_hdr h;
        if (kvpi_tcp_hdr_decode(raw, &h) != 0) {
            KVPI_WARN_LIMITED("%s: unknown opcode 0x%02x, closing the connection",
                              kvpi_conn_name(c), raw[16]);
            return;
        }
        if (serve_request(c, srv, &h) != 0) return;
    }
    if (st != KVP_ECLOSED)
        KVPI_DEBUG("%s: a request header was cut short: %s", kvpi_conn_name(c), kvp_last_error());
}

/* Refused connections of every listener of this kind, for the log. */
static kvpi_log_limit auth_log;

static kvp_status auth_setup(kvpi_conn *c)
{
    return kvpi_auth_conn_setup(c, ((tcp_server *)kvpi_conn_ctx(c))->auth, "tcp", &auth_log);
}

static const kvpi_conn_handler tcp_handler = {.serve = serve};
static const kvpi_conn_handler tcp_auth_handler = {.setup = auth_setup, .serve = serve};

static void server_free(tcp_server *srv)
{
    pthread_mutex_destroy(&srv->peers_lock);
    pthread_cond_destroy(&srv->reaper_cond);
    free(srv);
}

static kvp_status tcp_server_start(const kvpi_server_ctx *ctx, void **out)
{
    tcp_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "tcp server: out of memory");
    srv->regions = ctx->regions;
    srv->auth = ctx->auth;
    srv->served = ctx->served;
    srv->idle_ms = ctx->idle_timeout_ms > 0 ? ctx->idle_timeout_ms : KVPI_CONN_IDLE_MS_DEFAULT;
    pthread_mutex_init(&srv->peers_lock, NULL);
    kvpi_cond_init(&srv->reaper_cond);
    int fd;
    kvp_status st = kvpi_runner_create(&srv->runner);
    if (!st && (st = kvpi_tcp_listen(ctx->host, 0, &fd, &srv->port))) kvpi_runner_stop(srv->runner);
    if (st) {
        server_free(srv);
        return st;
    }
    char name[KVPI_HOST_MAX + 32], hp[KVPI_HOST_MAX + 8];
    kvpi_hostport_format(ctx->host, srv->port, hp, sizeof hp);
    snprintf(name, sizeof name, "tcp data server %s", hp);
    kvpi_conn_limits lim = kvpi_server_limits(ctx);
    if ((st = kvpi_conn_server_start(fd, name, &lim, srv->auth ? &tcp_auth_handler : &tcp_handler,
                                     srv, &srv->conns))) {
        kvpi_runner_stop(srv->runner);
        server_free(srv);
        return st;
    }
    *out = srv;
    return KVP_OK;
}

static kvp_status tcp_server_describe(void *server, cJSON *desc)
{
    tcp_server *srv = server;
    if (!cJSON_AddNumberToObject(desc, "tcp_data_port", srv->port) ||
        !cJSON_AddNumberToObject(desc, "tcp_proto_version", KVPI_TCP_PROTO_VERSION))
        return kvpi_error(KVP_ENOMEM, "tcp server: out of memory");
    return KVP_OK;
}

static int tcp_server_port(void *server)
{
    return ((tcp_server *)server)->port;
}

static void tcp_server_stop(void *server)
{
    tcp_server *srv = server;
    if (!srv) return;
    kvpi_conn_server_stop(srv->conns);
    kvpi_runner_stop(srv->runner);
    /* Every peer was closed before (transport.h): the reaper has none left. */
    pthread_mutex_lock(&srv->peers_lock);
    srv->reaper_stop = 1;
    pthread_cond_signal(&srv->reaper_cond);
    pthread_mutex_unlock(&srv->peers_lock);
    if (srv->reaper_started) pthread_join(srv->reaper, NULL);
    server_free(srv);
}

/* ------------------------------------------------------------------ client */

/* A pooled connection and when it was last given back. */
typedef struct idle_conn {
    int fd;
    uint64_t since_ns;
} idle_conn;

struct tcp_peer {
    char host[KVPI_HOST_MAX];
    int port;
    int v2;
    int digest; /* integrity with this peer (v2 only) */
    int timeout_ms;
    uint64_t min_rate;
    kvpi_counter *retries; /* may be NULL */
    int max_idle;          /* conns_per_peer: the most connections open at once */
    const kvpi_auth *auth;
    kvpi_runner *runner;   /* the server's; NULL without one */
    kvpi_runner_lane lane; /* as many at once as connections kept */
    pthread_mutex_t lock;
    pthread_cond_t freed; /* a connection came back or closed */
    int open;             /* connections open: idle, in use or connecting */
    idle_conn *idle;      /* oldest first: taken and given back at the end */
    int n_idle;
    uint64_t idle_ns;      /* a pooled connection idle this long is closed */
    tcp_server *srv;       /* whose reaper looks at this pool; NULL without one */
    tcp_peer *prev, *next; /* on srv->peers, under its peers_lock */
};

/* The peer's data port and protocol version from its descriptor. Without a
 * port, the segment is served by another of Mooncake's transports. */
static kvp_status read_fields(const kvpi_peer_ctx *ctx, int *port_out, int *v2)
{
    const cJSON *port = cJSON_GetObjectItemCaseSensitive(ctx->desc, "tcp_data_port");
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(ctx->desc, "tcp_proto_version");
    const cJSON *proto = cJSON_GetObjectItemCaseSensitive(ctx->desc, "protocol");
    const char *p = cJSON_IsString(proto) ? proto->valuestring : "";
    if (!port && strcmp(p, "tcp") != 0)
        return kvpi_error(KVP_ENOTSUP,
                          "segment %s is a Mooncake %s segment (it publishes no tcp_data_port); "
                          "kvpipe reaches Mooncake peers over tcp only - run them with protocol "
                          "tcp or MC_FORCE_TCP=1",
                          ctx->segment, p);
    double d = cJSON_IsNumber(port) ? port->valuedouble : 0;
    if (!(d >= 1 && d <= 65535) || d != (int)d)
        return kvpi_error(KVP_EPROTO,
                          "segment %s: its descriptor's tcp_data_port is missing or not a port "
                          "number",
                          ctx->segment);
    if (ver && !cJSON_IsNumber(ver))
        return kvpi_error(KVP_EPROTO,
                          "segment %s: its descriptor's tcp_proto_version is not a number",
                          ctx->segment);
    *port_out = (int)d;
    *v2 = ver && ver->valuedouble >= 2;
    return KVP_OK;
}

static void conn_close(tcp_peer *p, int fd, int locked, int reset);

/* Whether a pooled connection is still good: nothing may arrive on an idle
 * connection, so anything readable is the peer's close (its idle timeout, a
 * restart) or garbage. */
static int conn_alive(int fd)
{
    struct pollfd pf = {.fd = fd, .events = POLLIN | POLLRDHUP};
    return poll(&pf, 1, 0) == 0;
}

/* Close the pool's connections idle for p->idle_ns or closed by the peer
 * (all of them with check_alive 0: only the aged ones). Called with p->lock. */
static int prune_locked(tcp_peer *p, uint64_t now, int check_alive)
{
    int kept = 0, closed = 0;
    for (int i = 0; i < p->n_idle; i++) {
        idle_conn c = p->idle[i];
        /* since_ns may be later than now: given back since now was read. */
        if (c.since_ns + p->idle_ns <= now || (check_alive && !conn_alive(c.fd))) {
            conn_close(p, c.fd, 1, 0);
            closed++;
        } else {
            p->idle[kept++] = c;
        }
    }
    p->n_idle = kept;
    return closed;
}

static void *reaper_main(void *arg)
{
    tcp_server *srv = arg;
    int period = srv->idle_ms / 4;
    if (period > REAP_PERIOD_MAX_MS) period = REAP_PERIOD_MAX_MS;
    if (period < REAP_PERIOD_MIN_MS) period = REAP_PERIOD_MIN_MS;
    pthread_mutex_lock(&srv->peers_lock);
    while (!srv->reaper_stop) {
        struct timespec at = kvpi_deadline_after_ms(period);
        pthread_cond_timedwait(&srv->reaper_cond, &srv->peers_lock, &at);
        if (srv->reaper_stop) break;
        uint64_t now = kvpi_now_ns();
        int closed = 0;
        for (tcp_peer *p = srv->peers; p; p = p->next) {
            pthread_mutex_lock(&p->lock);
            closed += prune_locked(p, now, 1);
            pthread_mutex_unlock(&p->lock);
        }
        if (closed)
            KVPI_DEBUG("tcp: closed %d pooled connection%s idle for %d ms or closed by their peer",
                       closed, closed == 1 ? "" : "s", srv->idle_ms);
    }
    pthread_mutex_unlock(&srv->peers_lock);
    return NULL;
}

/* Put p on srv's list, starting the reaper with the first peer. */
static kvp_status reaper_add(tcp_server *srv, tcp_peer *p)
{
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&srv->peers_lock);
    if (!srv->reaper_started) {
        int rc = pthread_create(&srv->reaper, NULL, reaper_main, srv);
        if (rc)
            st = kvpi_error(KVP_EIO, "tcp: cannot start a thread: %s", strerror(rc));
        else
            srv->reaper_started = 1;
    }
    if (!st) {
        p->srv = srv;
        p->next = srv->peers;
        if (srv->peers) srv->peers->prev = p;
        srv->peers = p;
    }
    pthread_mutex_unlock(&srv->peers_lock);
    return st;
}

static kvp_status tcp_peer_open(const kvpi_peer_ctx *ctx, void **out)
{
    int port = 0, v2 = 0;
    kvp_status st = read_fields(ctx, &port, &v2);
    if (st) return st;
    if (strlen(ctx->host) >= KVPI_HOST_MAX)
        return kvpi_error(KVP_EINVAL, "peer host name too long");
    tcp_peer *p = calloc(1, sizeof *p);
    int conns = ctx->conns > 0 ? ctx->conns : 1;
    if (!p || !(p->idle = calloc((size_t)conns, sizeof *p->idle))) {
        free(p);
        return kvpi_error(KVP_ENOMEM, "tcp peer: out of memory");
    }
    strcpy(p->host, ctx->host);
    p->port = port;
    p->v2 = v2;
    p->digest = v2 && ctx->integrity;
    p->timeout_ms = ctx->timeout_ms > 0 ? ctx->timeout_ms : KVPI_CONN_TIMEOUT_MS_DEFAULT;
    p->min_rate = ctx->min_rate ? ctx->min_rate : KVPI_MIN_RATE_DEFAULT;
    p->retries = ctx->retries;
    p->max_idle = conns;
    p->auth = ctx->auth;
    p->runner = ctx->server ? ((tcp_server *)ctx->server)->runner : NULL;
    p->lane =
        (kvpi_runner_lane){.limit = conns, .timeout_ms = p->timeout_ms, .min_rate = p->min_rate};
    pthread_mutex_init(&p->lock, NULL);
    kvpi_cond_init(&p->freed);
    tcp_server *srv = ctx->server;
    p->idle_ns = (uint64_t)(srv ? srv->idle_ms : KVPI_CONN_IDLE_MS_DEFAULT) * 1000000u;
    if (srv && (st = reaper_add(srv, p))) {
        pthread_mutex_destroy(&p->lock);
        pthread_cond_destroy(&p->freed);
        free(p->idle);
        free(p);
        return st;
    }
    *out = p;
    return KVP_OK;
}

static void tcp_peer_close(void *peer)
{
    tcp_peer *p = peer;
    if (p->srv) {
        pthread_mutex_lock(&p->srv->peers_lock);
        if (p->prev)
            p->prev->next = p->next;
        else
            p->srv->peers = p->next;
        if (p->next) p->next->prev = p->prev;
        pthread_mutex_unlock(&p->srv->peers_lock);
    }
    for (int i = 0; i < p->n_idle; i++)
        close(p->idle[i].fd);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->freed);
    free(p->idle);
    free(p);
}

/* Close a connection of the pool's (taken, or pruned from the idle list),
 * freeing its place for a caller waiting in conn_take; with a reset (what
 * it still had queued is dropped) when a request on it failed. Any lock. */
static void conn_close(tcp_peer *p, int fd, int locked, int reset)
{
    if (reset)
        kvpi_tcp_abort(fd);
    else
        close(fd);
    if (!locked) pthread_mutex_lock(&p->lock);
    p->open--;
    pthread_cond_signal(&p->freed);
    if (!locked) pthread_mutex_unlock(&p->lock);
}

/* An idle connection (*reused = 1) or a new one, by the deadline. At most
 * conns_per_peer are open at once: with all of them in use, wait for one to
 * come back (a burst of callers beyond it would otherwise open connections
 * only to close them again, each close leaving a port in TIME_WAIT). */
static kvp_status conn_take(tcp_peer *p, uint64_t deadline, int *fd, int *reused)
{
    pthread_mutex_lock(&p->lock);
    while (p->n_idle == 0 && p->open >= p->max_idle) {
        struct timespec at = kvpi_timespec_at_ns(deadline);
        if (kvpi_remaining_ms(deadline) == 0 ||
            (pthread_cond_timedwait(&p->freed, &p->lock, &at) == ETIMEDOUT && p->n_idle == 0 &&
             p->open >= p->max_idle)) {
            pthread_mutex_unlock(&p->lock);
            return kvpi_error(KVP_ETIMEDOUT, "all %d connections busy until the deadline",
                              p->max_idle);
        }
    }
    *reused = p->n_idle > 0;
    if (*reused)
        *fd = p->idle[--p->n_idle].fd;
    else
        p->open++;
    pthread_mutex_unlock(&p->lock);
    if (*reused) return KVP_OK;
    int left = kvpi_remaining_ms(deadline);
    kvp_status st = left == 0 ? kvpi_error(KVP_ETIMEDOUT, "connect: deadline passed")
                              : kvpi_tcp_connect(p->host, p->port,
                                                 left < p->timeout_ms ? left : p->timeout_ms, fd);
    if (st) {
        pthread_mutex_lock(&p->lock);
        p->open--;
        pthread_cond_signal(&p->freed);
        pthread_mutex_unlock(&p->lock);
        return st;
    }
    if (!p->auth) return KVP_OK;
    /* A new connection proves the key before its first request. */
    if ((st = kvpi_auth_client(p->auth, *fd, "tcp", deadline))) {
        conn_close(p, *fd, 0, 0);
        if (st == KVP_EAUTH) {
            st = kvpi_error(st, "tcp peer %s:%d: %s", p->host, p->port, kvp_last_error());
        }
    }
    return st;
}

/* Give a connection back to the pool, and close those aged past the idle
 * time meanwhile (a pool without a reaper relies on this). */
static void conn_give(tcp_peer *p, int fd)
{
    uint64_t now = kvpi_now_ns();
    pthread_mutex_lock(&p->lock);
    prune_locked(p, now, 0);
    p->idle[p->n_idle++] = (idle_conn){.fd = fd, .since_ns = now};
    pthread_cond_signal(&p->freed);
    pthread_mutex_unlock(&p->lock);
}

/* Integrity: slice s moved corrupted (common/digest.h). */
static kvp_status corrupt_error(const tcp_peer *p, const kvpi_slice *s, const char *how)
{
    return kvpi_error(KVP_ECORRUPT,
                      "tcp peer %s:%d: %s of [0x%llx, +%zu) arrived corrupted: %s (the bytes "
                      "changed on the way, or the source changed while they were read)",
                      p->host, p->port, s->opcode == KVP_OP_READ ? "READ" : "WRITE",
                      (unsigned long long)s->remote, s->length, how);
}

static kvp_status status_error(tcp_peer *p, const uint8_t frame[8], const kvpi_slice *s)
{
    int64_t code = kvpi_tcp_status_decode(frame);
    if (code == KVPI_TCP_STATUS_OK) return KVP_OK;
    if (code == KVPI_TCP_STATUS_CORRUPT)
        return corrupt_error(p, s, "its digest of what arrived differs from ours of what we sent");
    if (code == KVPI_TCP_STATUS_REJECTED)
        return kvpi_error(KVP_ERANGE,
                          "%s:%d rejected %s of [0x%llx, +%zu) (status 1, address rejected): "
                          "outside its registered memory, or registered memory it can no "
                          "longer read (its log says which)",
                          p->host, p->port, s->opcode == KVP_OP_READ ? "READ" : "WRITE",
                          (unsigned long long)s->remote, s->length);
    return kvpi_error(KVP_EPROTO, "%s:%d sent a malformed status frame", p->host, p->port);
}

static kvp_status send_headers(tcp_peer *p, int fd, kvpi_slice *const *s, size_t n,
                               uint64_t deadline)
{
    uint8_t buf[64 * KVPI_TCP_HDR_LEN];
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        kvpi_tcp_hdr h = {s[i]->length, s[i]->remote,
                          s[i]->opcode == KVP_OP_READ ? KVPI_TCP_OP_READ : KVPI_TCP_OP_WRITE, p->v2,
                          p->digest && s[i]->length};
        kvpi_tcp_hdr_encode(&h, buf + off);
        off += KVPI_TCP_HDR_LEN;
        if (off == sizeof buf || i + 1 == n) {
            kvp_status st = kvpi_send_all_by(fd, buf, off, deadline);
            if (st) return st;
            off = 0;
        }
    }
    return KVP_OK;
}

/* Integrity: one READ's status, payload (digested as it arrives, a chunk at
 * a time) and the digest the peer sent after it. KVP_ECORRUPT when the two
 * differ; the stream is whole then. */
static kvp_status read_digested(tcp_peer *p, int fd, kvpi_slice *s, uint64_t deadline)
{
    uint8_t frame[8], theirs[KVPI_DIGEST_LEN];
    uint64_t ours;
    kvp_status st = kvpi_recv_all_by(fd, frame, sizeof frame, deadline);
    if (!st) st = status_error(p, frame, s);
    if (!st) st = kvpi_digest_recv(fd, s->local, s->length, deadline, &ours);
    if (!st) st = kvpi_recv_all_by(fd, theirs, sizeof theirs, deadline);
    if (!st && kvpi_get_le64(theirs) != ours)
        st = corrupt_error(p, s, "our digest of what arrived differs from the one it sent");
    return st;
}

/* Pipelined READs: every header, then each status and payload in order.
 * *done counts slices completed (successfully or rejected). */
static kvp_status run_reads(tcp_peer *p, int fd, kvpi_slice *const *s, size_t n, uint64_t deadline,
                            size_t *done)
{
    kvp_status st = send_headers(p, fd, s, n, deadline);
    for (size_t i = 0; st == KVP_OK && i < n; i++) {
        if (p->digest && s[i]->length) {
            if ((st = read_digested(p, fd, s[i], deadline)) == KVP_ERANGE)
                s[ *done = i]->status = st;
            if (st == KVP_ECORRUPT) {
                /* The stream is whole: the next slices go on. */
                s[i]->status = st;
                *done = i + 1;
                st = KVP_OK;
                continue;
            }
            if (st) return st;
            s[i]->status = KVP_OK;
            *done = i + 1;
            continue;
        }
        if (p->v2) {
            /* Status and payload in one call; a rejection is followed by a
             * close, so the payload read then ends early. */
            uint8_t frame[8];
            struct iovec iov[2] = {{frame, sizeof frame}, {s[i]->local, s[i]->length}};
            if ((st = kvpi_recvv_all_by(fd, iov, 2, deadline)) == KVP_ECONNRESET &&
                iov[0].iov_len == 0 && kvpi_tcp_status_decode(frame) == KVPI_TCP_STATUS_REJECTED)
                st = status_error(p, frame, s[i]);
            if (st == KVP_OK) st = status_error(p, frame, s[i]);
        } else {
            st = kvpi_recv_all_by(fd, s[i]->local, s[i]->length, deadline);
        }
        if (st == KVP_ERANGE) s[ *done = i]->status = KVP_ERANGE;
        if (st) return st;
        s[i]->status = KVP_OK;
        *done = i + 1;
    }
    return st;
}

/* Pipelined WRITEs: each header and payload, then every status. A peer that
 * rejects a WRITE closes after its status frame, so a failed send is followed
 * by reading what statuses did arrive. */
static kvp_status run_writes(tcp_peer *p, int fd, kvpi_slice *const *s, size_t n, uint64_t deadline,
                             size_t *done)
{
    kvp_status st = KVP_OK;
    size_t sent = 0;
    /* Integrity: each payload's digest is taken in a pass of its own, which
     * begins once the send's copy of it has ended (common/digest.h), and
     * goes in front of the next WRITE's header (the last one alone). */
    uint8_t digest[KVPI_DIGEST_LEN];
    int owed = 0;
    for (; sent < n; sent++) {
        uint8_t hdr[KVPI_TCP_HDR_LEN];
        int digested = p->digest && s[sent]->length;
        kvpi_tcp_hdr h = {s[sent]->length, s[sent]->remote, KVPI_TCP_OP_WRITE, p->v2, digested};
        kvpi_tcp_hdr_encode(&h, hdr);
        struct iovec iov[3] = {
            {digest, sizeof digest}, {hdr, sizeof hdr}, {s[sent]->local, s[sent]->length}};
        if ((st = kvpi_sendv_all_by(fd, iov + !owed, 2 + owed, deadline))) break;
        if ((owed = digested)) kvpi_put_le64(digest, kvpi_digest(s[sent]->local, s[sent]->length));
    }
    if (!st && owed) st = kvpi_send_all_by(fd, digest, sizeof digest, deadline);
    if (!p->v2) {
        for (size_t i = 0; i < sent; i++)
            s[i]->status = KVP_OK;
        *done = sent;
        return st;
    }
    /* The statuses, up to 64 in one call: most have arrived by now. */
    kvp_status send_err = st;
    uint8_t frames[64][8];
    struct iovec iov[64];
    for (size_t i = 0; i < n;) {
        size_t k = n - i < 64 ? n - i : 64;
        for (size_t j = 0; j < k; j++)
            iov[j] = (struct iovec){frames[j], sizeof frames[j]};
        kvp_status r = kvpi_recvv_all_by(fd, iov, (int)k, deadline);
        /* The frames that arrived whole (a rejection is followed by a close). */
        for (size_t j = 0; j < k && iov[j].iov_len == 0; j++, i++) {
            kvp_status e = status_error(p, frames[j], s[i]);
            if (e == KVP_ECORRUPT) {
                s[i]->status = e;
                *done = i + 1;
                continue;
            }
            if (e == KVP_ERANGE) {
                s[ *done = i]->status = KVP_ERANGE;
                return e;
            }
            if (e) return send_err ? send_err : e;
            s[i]->status = KVP_OK;
            *done = i + 1;
        }
        if (r) return send_err ? send_err : r;
    }
    return send_err;
}

/* Say what the deadline was when it passed. */
static kvp_status deadline_error(tcp_peer *p, kvpi_slice *const *s, size_t n, uint64_t bytes,
                                 uint64_t start, uint64_t deadline)
{
    return kvpi_error(KVP_ETIMEDOUT,
                      "tcp peer %s:%d: %s of %llu bytes (%zu requests) not done within %llu ms "
                      "(timeout_ms %d + the bytes at %llu bytes/s): %s",
                      p->host, p->port, s[0]->opcode == KVP_OP_READ ? "READ" : "WRITE",
                      (unsigned long long)bytes, n,
                      (unsigned long long)((deadline - start) / 1000000u), p->timeout_ms,
                      (unsigned long long)p->min_rate, kvp_last_error());
}

static kvp_status tcp_peer_xfer(void *peer, kvpi_slice *const *slices, size_t n, uint64_t start,
                                uint64_t deadline)
{
    tcp_peer *p = peer;
    uint64_t bytes = 0;
    for (size_t k = 0; k < n; k++)
        bytes += slices[k]->length;
    /* One deadline for the whole call, whatever pace the peer keeps. */
    kvp_status result = KVP_OK;
    size_t i = 0;
    int retried = 0;
    while (i < n) {
        int fd, reused;
        kvp_status st = conn_take(p, deadline, &fd, &reused);
        if (st)
            return st == KVP_ETIMEDOUT ? deadline_error(p, slices, n, bytes, start, deadline) : st;
        size_t done = 0;
        st = slices[i]->opcode == KVP_OP_READ
                 ? run_reads(p, fd, slices + i, n - i, deadline, &done)
                 : run_writes(p, fd, slices + i, n - i, deadline, &done);
        if (st == KVP_OK) {
            conn_give(p, fd);
            return result;
        }
        conn_close(p, fd, 0, 1);
        if (st == KVP_ERANGE) {
            /* The peer rejected one slice and closed; its descriptor may have
             * changed. Run the rest on a new connection. */
            result = KVP_ERANGE;
            i += done + 1;
            continue;
        }
        if (st == KVP_ECONNRESET && reused && done == 0 && !retried) {
            /* An idle connection the peer had closed (servers reap idle
             * connections): retry once on a new one, by the same deadline. */
            retried = 1;
            if (p->retries) kvpi_counter_add(p->retries, 1);
            continue;
        }
        return st == KVP_ETIMEDOUT ? deadline_error(p, slices, n, bytes, start, deadline) : st;
    }
    return result;
}

static void tcp_peer_post(void *peer, kvpi_xfer *x)
{
    tcp_peer *p = peer;
    kvpi_runner_post(p->runner, tcp_peer_xfer, p, &p->lane, x);
}

static void tcp_peer_run(void *peer, kvpi_xfer *x)
{
    tcp_peer *p = peer;
    kvpi_runner_run(tcp_peer_xfer, p, &p->lane, x);
}

static void tcp_server_cancel(void *server)
{
    kvpi_runner_cancel(((tcp_server *)server)->runner);
}

const kvpi_transport_ops kvpi_transport_tcp = {
    .name = "tcp",
    .mooncake_protocol = "tcp",
    .caps = KVPI_CAP_AUTH,
    .mem_kinds = KVPI_MEM_HOST_BIT | KVPI_MEM_BIT(KVP_MEM_CUDA),
    .server_start = tcp_server_start,
    .server_stop = tcp_server_stop,
    .server_port = tcp_server_port,
    .server_describe = tcp_server_describe,
    .peer_open = tcp_peer_open,
    .peer_post = tcp_peer_post,
    .peer_run = tcp_peer_run,
    .server_cancel = tcp_server_cancel,
    .peer_close = tcp_peer_close,
};
