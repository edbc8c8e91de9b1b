/* TCP transport: Mooncake's data plane (see tcp_wire.h).
 *
 * Server: one accept thread and one thread per connection; every request is
 * checked against the registry and the region stays pinned while its bytes
 * move, straight between the socket and registered memory.
 * Client: a small pool of persistent connections per peer; a group of slices
 * is pipelined on one connection (all headers first for READs).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

#define DRAIN_LIMIT (64u << 20)

/* ------------------------------------------------------------------ server */

typedef struct tcp_conn {
    struct tcp_server *srv;
    int fd;
    pthread_t thread;
    atomic_int done;
    struct tcp_conn *next;
} tcp_conn;

typedef struct tcp_server {
    int listen_fd;
    int port;
    int wake[2];
    kvpi_registry *registry;
    int timeout_ms;
    pthread_t accept_thread;
    pthread_mutex_t lock;
    tcp_conn *conns;
    int stopping;
} tcp_server;

static kvp_status send_status(int fd, uint32_t code)
{
    uint8_t frame[8];
    kvpi_tcp_status_encode(code, frame);
    return kvpi_send_all(fd, frame, sizeof frame);
}

/* After rejecting a WRITE, let the client finish sending so that it reads our
 * status frame instead of a reset, within bounds. */
static void drain(int fd, uint64_t size)
{
    char sink[65536];
    uint64_t left = size < DRAIN_LIMIT ? size : DRAIN_LIMIT;
    shutdown(fd, SHUT_WR);
    while (left > 0) {
        ssize_t n = recv(fd, sink, left < sizeof sink ? left : sizeof sink, 0);
        if (n <= 0) break;
        left -= (uint64_t)n;
    }
}

/* Serve one request; returns 0 to keep the connection, -1 to close it. */
static int serve_request(tcp_server *srv, int fd, const kvpi_tcp_hdr *h)
{
    if (h->size == 0) return h->v2 && send_status(fd, KVPI_TCP_STATUS_OK) ? -1 : 0;
    if (kvpi_registry_pin(srv->registry, h->addr, h->size) != KVP_OK) {
        KVPI_WARN_LIMITED("tcp server: rejected %s of [0x%llx, +%llu): outside registered memory",
                          h->opcode == KVPI_TCP_OP_READ ? "READ" : "WRITE",
                          (unsigned long long)h->addr, (unsigned long long)h->size);
        if (h->v2 && send_status(fd, KVPI_TCP_STATUS_REJECTED) == KVP_OK &&
            h->opcode == KVPI_TCP_OP_WRITE)
            drain(fd, h->size);
        return -1;
    }
    kvp_status st;
    void *mem = (void *)(uintptr_t)h->addr;
    if (h->opcode == KVPI_TCP_OP_READ) {
        uint8_t frame[8];
        kvpi_tcp_status_encode(KVPI_TCP_STATUS_OK, frame);
        struct iovec iov[2] = {{frame, sizeof frame}, {mem, h->size}};
        st = h->v2 ? kvpi_sendv_all(fd, iov, 2) : kvpi_sendv_all(fd, iov + 1, 1);
        kvpi_registry_unpin(srv->registry);
    } else {
        st = kvpi_recv_all(fd, mem, h->size);
        kvpi_registry_unpin(srv->registry);
        if (st == KVP_OK && h->v2) st = send_status(fd, KVPI_TCP_STATUS_OK);
    }
    if (st) KVPI_DEBUG("tcp server: connection dropped: %s", kvp_last_error());
    return st ? -1 : 0;
}

/* Read the next header. Idle connections wait without a timeout (stop shuts
 * the socket down); a header already queued is read without polling. Returns
 * 0, or -1 when the connection is closed or broken. */
static int next_header(int fd, uint8_t raw[KVPI_TCP_HDR_LEN])
{
    for (;;) {
        ssize_t n = recv(fd, raw, KVPI_TCP_HDR_LEN, MSG_DONTWAIT);
        if (n == KVPI_TCP_HDR_LEN) return 0;
        if (n > 0) return kvpi_recv_all(fd, raw + n, KVPI_TCP_HDR_LEN - (size_t)n) ? -1 : 0;
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, -1) < 0 && errno != EINTR) return -1;
        if (p.revents & (POLLERR | POLLNVAL)) return -1;
    }
}

static void *conn_main(void *arg)
{
    tcp_conn *c = arg;
    uint8_t raw[KVPI_TCP_HDR_LEN];
    while (next_header(c->fd, raw) == 0) {
        kvpi_tcp_hdr h;
        if (kvpi_tcp_hdr_decode(raw, &h) != 0) {
            KVPI_WARN_LIMITED("tcp server: unknown opcode 0x%02x, closing the connection", raw[16]);
            break;
        }
        if (serve_request(c->srv, c->fd, &h) != 0) break;
    }
    shutdown(c->fd, SHUT_RDWR);
    atomic_store(&c->done, 1);
    return NULL;
}

/* Join connection threads that have finished; with all = 1, every one. */
static void reap(tcp_server *srv, int all)
{
    pthread_mutex_lock(&srv->lock);
    tcp_conn **link = &srv->conns;
    while (*link) {
        tcp_conn *c = *link;
        if (all) shutdown(c->fd, SHUT_RDWR);
        if (!all && !atomic_load(&c->done)) {
            link = &c->next;
            continue;
        }
        *link = c->next;
        pthread_mutex_unlock(&srv->lock);
        pthread_join(c->thread, NULL);
        close(c->fd);
        free(c);
        pthread_mutex_lock(&srv->lock);
        link = &srv->conns;
    }
    pthread_mutex_unlock(&srv->lock);
}

static void *accept_main(void *arg)
{
    tcp_server *srv = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = srv->listen_fd, .events = POLLIN},
                              {.fd = srv->wake[0], .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (p[1].revents) break;
        int fd;
        if (kvpi_tcp_accept(srv->listen_fd, srv->timeout_ms, &fd) != KVP_OK) continue;
        reap(srv, 0);
        tcp_conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        c->srv = srv;
        c->fd = fd;
        pthread_mutex_lock(&srv->lock);
        if (pthread_create(&c->thread, NULL, conn_main, c) != 0) {
            pthread_mutex_unlock(&srv->lock);
            KVPI_WARN("tcp server: cannot start a connection thread");
            close(fd);
            free(c);
            continue;
        }
        c->next = srv->conns;
        srv->conns = c;
        pthread_mutex_unlock(&srv->lock);
    }
    return NULL;
}

static kvp_status tcp_server_start(const kvpi_server_ctx *ctx, void **out)
{
    tcp_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "tcp server: out of memory");
    srv->registry = ctx->registry;
    srv->timeout_ms = ctx->timeout_ms;
    srv->wake[0] = srv->wake[1] = -1;
    pthread_mutex_init(&srv->lock, NULL);
    kvp_status st = kvpi_tcp_listen(ctx->host, 0, &srv->listen_fd, &srv->port);
    if (st) goto fail;
    if (pipe2(srv->wake, O_CLOEXEC) != 0) {
        st = kvpi_error(KVP_EIO, "tcp server: pipe: %s", strerror(errno));
        goto fail;
    }
    if (pthread_create(&srv->accept_thread, NULL, accept_main, srv) != 0) {
        st = kvpi_error(KVP_EIO, "tcp server: cannot start a thread");
        goto fail;
    }
    if (ctx->data_port_out) *ctx->data_port_out = srv->port;
    *out = srv;
    return KVP_OK;
fail:
    if (srv->listen_fd > 0) close(srv->listen_fd);
    if (srv->wake[0] >= 0) close(srv->wake[0]);
    if (srv->wake[1] >= 0) close(srv->wake[1]);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
    return st;
}

static void tcp_server_describe(void *server, cJSON *desc)
{
    /* tcp_data_port and tcp_proto_version are part of the base descriptor. */
    (void)server;
    (void)desc;
}

static void tcp_server_stop(void *server)
{
    tcp_server *srv = server;
    if (!srv) return;
    ssize_t w = write(srv->wake[1], "x", 1);
    (void)w;
    pthread_join(srv->accept_thread, NULL);
    reap(srv, 1);
    close(srv->listen_fd);
    close(srv->wake[0]);
    close(srv->wake[1]);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
}

/* ------------------------------------------------------------------ client */

typedef struct tcp_peer {
    char host[KVPI_HOST_MAX];
    int port;
    int v2;
    int timeout_ms;
    int max_idle;
    pthread_mutex_t lock;
    int *idle;
    int n_idle;
} tcp_peer;

static kvp_status tcp_peer_open(const kvpi_peer_ctx *ctx, void **out)
{
    const cJSON *port = cJSON_GetObjectItemCaseSensitive(ctx->desc, "tcp_data_port");
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(ctx->desc, "tcp_proto_version");
    if (!cJSON_IsNumber(port) || port->valueint <= 0 || port->valueint > 65535)
        return kvpi_error(KVP_EPROTO, "peer descriptor has no valid tcp_data_port");
    if (strlen(ctx->host) >= KVPI_HOST_MAX)
        return kvpi_error(KVP_EINVAL, "peer host name too long");
    tcp_peer *p = calloc(1, sizeof *p);
    int conns = ctx->conns > 0 ? ctx->conns : 1;
    if (!p || !(p->idle = calloc((size_t)conns, sizeof *p->idle))) {
        free(p);
        return kvpi_error(KVP_ENOMEM, "tcp peer: out of memory");
    }
    strcpy(p->host, ctx->host);
    p->port = port->valueint;
    p->v2 = cJSON_IsNumber(ver) && ver->valuedouble >= 2;
    p->timeout_ms = ctx->timeout_ms;
    p->max_idle = conns;
    pthread_mutex_init(&p->lock, NULL);
    *out = p;
    return KVP_OK;
}

static void tcp_peer_close(void *peer)
{
    tcp_peer *p = peer;
    for (int i = 0; i < p->n_idle; i++) close(p->idle[i]);
    pthread_mutex_destroy(&p->lock);
    free(p->idle);
    free(p);
}

/* An idle connection (*reused = 1) or a new one. */
static kvp_status conn_take(tcp_peer *p, int *fd, int *reused)
{
    pthread_mutex_lock(&p->lock);
    *reused = p->n_idle > 0;
    if (*reused) *fd = p->idle[--p->n_idle];
    pthread_mutex_unlock(&p->lock);
    if (*reused) return KVP_OK;
    return kvpi_tcp_connect(p->host, p->port, p->timeout_ms, fd);
}

static void conn_give(tcp_peer *p, int fd)
{
    pthread_mutex_lock(&p->lock);
    if (p->n_idle < p->max_idle) {
        p->idle[p->n_idle++] = fd;
        fd = -1;
    }
    pthread_mutex_unlock(&p->lock);
    if (fd >= 0) close(fd);
}

static kvp_status status_error(tcp_peer *p, const uint8_t frame[8], const kvpi_slice *s)
{
    int64_t code = kvpi_tcp_status_decode(frame);
    if (code == KVPI_TCP_STATUS_OK) return KVP_OK;
    if (code == KVPI_TCP_STATUS_REJECTED)
        return kvpi_error(KVP_ERANGE, "%s:%d rejected [0x%llx, +%zu): outside its registered memory",
                          p->host, p->port, (unsigned long long)s->remote, s->length);
    return kvpi_error(KVP_EPROTO, "%s:%d sent a malformed status frame", p->host, p->port);
}

static kvp_status recv_status(tcp_peer *p, int fd, kvpi_slice *s)
{
    uint8_t frame[8];
    kvp_status st = kvpi_recv_all(fd, frame, sizeof frame);
    return st ? st : status_error(p, frame, s);
}

static kvp_status send_headers(tcp_peer *p, int fd, kvpi_slice *const *s, size_t n)
{
    uint8_t buf[64 * KVPI_TCP_HDR_LEN];
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        kvpi_tcp_hdr h = {s[i]->length, s[i]->remote,
                          s[i]->opcode == KVP_OP_READ ? KVPI_TCP_OP_READ : KVPI_TCP_OP_WRITE,
                          p->v2};
        kvpi_tcp_hdr_encode(&h, buf + off);
        off += KVPI_TCP_HDR_LEN;
        if (off == sizeof buf || i + 1 == n) {
            kvp_status st = kvpi_send_all(fd, buf, off);
            if (st) return st;
            off = 0;
        }
    }
    return KVP_OK;
}

/* Pipelined READs: every header, then each status and payload in order.
 * *done counts slices completed (successfully or rejected). */
static kvp_status run_reads(tcp_peer *p, int fd, kvpi_slice *const *s, size_t n, size_t *done)
{
    kvp_status st = send_headers(p, fd, s, n);
    for (size_t i = 0; st == KVP_OK && i < n; i++) {
        if (p->v2) {
            /* Status and payload in one call; a rejection is followed by a
             * close, so the payload read then ends early. */
            uint8_t frame[8];
            struct iovec iov[2] = {{frame, sizeof frame}, {s[i]->local, s[i]->length}};
            if ((st = kvpi_recvv_all(fd, iov, 2)) == KVP_ECONNRESET && iov[0].iov_len == 0 &&
                kvpi_tcp_status_decode(frame) == KVPI_TCP_STATUS_REJECTED)
                st = status_error(p, frame, s[i]);
            if (st == KVP_OK) st = status_error(p, frame, s[i]);
        } else {
            st = kvpi_recv_all(fd, s[i]->local, s[i]->length);
        }
        if (st == KVP_ERANGE) s[*done = i]->status = KVP_ERANGE;
        if (st) return st;
        s[i]->status = KVP_OK;
        *done = i + 1;
    }
    return st;
}

/* Pipelined WRITEs: each header and payload, then every status. A peer that
 * rejects a WRITE closes after its status frame, so a failed send is followed
 * by reading what statuses did arrive. */
static kvp_status run_writes(tcp_peer *p, int fd, kvpi_slice *const *s, size_t n, size_t *done)
{
    kvp_status st = KVP_OK;
    size_t sent = 0;
    for (; sent < n; sent++) {
        uint8_t hdr[KVPI_TCP_HDR_LEN];
        kvpi_tcp_hdr h = {s[sent]->length, s[sent]->remote, KVPI_TCP_OP_WRITE, p->v2};
        kvpi_tcp_hdr_encode(&h, hdr);
        struct iovec iov[2] = {{hdr, sizeof hdr}, {s[sent]->local, s[sent]->length}};
        if ((st = kvpi_sendv_all(fd, iov, 2))) break;
    }
    if (!p->v2) {
        for (size_t i = 0; i < sent; i++) s[i]->status = KVP_OK;
        *done = sent;
        return st;
    }
    kvp_status send_err = st;
    for (size_t i = 0; i < n; i++) {
        kvp_status r = recv_status(p, fd, s[i]);
        if (r == KVP_ERANGE) {
            s[*done = i]->status = KVP_ERANGE;
            return r;
        }
        if (r) return send_err ? send_err : r;
        s[i]->status = KVP_OK;
        *done = i + 1;
    }
    return send_err;
}

static kvp_status tcp_peer_xfer(void *peer, kvpi_slice *const *slices, size_t n)
{
    tcp_peer *p = peer;
    kvp_status result = KVP_OK;
    size_t i = 0;
    int retried = 0;
    while (i < n) {
        int fd, reused;
        kvp_status st = conn_take(p, &fd, &reused);
        if (st) return st;
        size_t done = 0;
        st = slices[i]->opcode == KVP_OP_READ ? run_reads(p, fd, slices + i, n - i, &done)
                                              : run_writes(p, fd, slices + i, n - i, &done);
        if (st == KVP_OK) {
            conn_give(p, fd);
            return result;
        }
        close(fd);
        if (st == KVP_ERANGE) {
            /* The peer rejected one slice and closed; its descriptor may have
             * changed. Run the rest on a new connection. */
            result = KVP_ERANGE;
            i += done + 1;
            continue;
        }
        if (reused && done == 0 && !retried) {
            /* An idle connection the peer had closed: retry once on a new one. */
            retried = 1;
            continue;
        }
        return st;
    }
    return result;
}

const kvpi_transport_ops kvpi_transport_tcp = {
    .name = "tcp",
    .caps = 0,
    .server_start = tcp_server_start,
    .server_describe = tcp_server_describe,
    .server_stop = tcp_server_stop,
    .peer_open = tcp_peer_open,
    .peer_xfer = tcp_peer_xfer,
    .peer_close = tcp_peer_close,
};
