/* The handshake (RPC) port: Mooncake's P2P handshake framing.
 *
 *   u64 length (little-endian; counts the type byte and the JSON) | u8 type | JSON
 *
 * One request per connection. The server has a listening thread and a thread
 * per connection; connection threads never close their own socket (only shut
 * it down), so that kvpi_rpc_server_stop can shut down every open socket
 * without racing a close and a reuse of its number. The listening thread
 * reaps finished connections. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "metadata/metadata.h"

#define RPC_DEFAULT_TIMEOUT_MS 5000
#define RPC_MAX_CONNS 256 /* concurrent handshakes; more are refused */
#define RPC_POLL_MS 1000  /* the listener re-checks for stop and reaps this often */
#define RPC_HDR 9         /* u64 length + u8 type */

typedef struct rpc_conn {
    struct kvpi_rpc_server *srv;
    pthread_t thread;
    int fd;
    int done; /* the thread has finished; guarded by srv->lock */
    struct rpc_conn *next;
} rpc_conn;

struct kvpi_rpc_server {
    int listen_fd;
    int wake[2]; /* a byte written here wakes the listener at stop */
    pthread_t listener;
    int timeout_ms;
    kvpi_rpc_desc_fn desc_fn;
    void *ctx;
    char addr[KVPI_HOST_MAX + 8];
    int port; /* the bound port, also when started with port 0 */
    pthread_mutex_t lock; /* guards conns, n_conns, warned */
    rpc_conn *conns;
    int n_conns;
    int warned; /* a malformed frame was logged at WARN once */
};

static int valid_type(unsigned type)
{
    return type <= KVPI_RPC_PROBE;
}

/* Copy the current detail so it can be wrapped in a new message. */
static kvp_status wrap(kvp_status st, const char *what, const char *addr)
{
    char detail[512];
    snprintf(detail, sizeof detail, "%s", kvp_last_error());
    return kvpi_error(st, "%s %s: %s", what, addr, detail);
}

static kvp_status send_frame(int fd, int type, const char *json)
{
    size_t n = strlen(json);
    uint8_t hdr[RPC_HDR];
    kvpi_put_le64(hdr, (uint64_t)n + 1);
    hdr[8] = (uint8_t)type;
    kvp_status st = kvpi_send_all(fd, hdr, sizeof hdr);
    return st ? st : kvpi_send_all(fd, json, n);
}

/* Read one frame; *json is malloc'ed and NUL-terminated. */
static kvp_status recv_frame(int fd, int *type, char **json)
{
    uint8_t hdr[RPC_HDR];
    kvp_status st = kvpi_recv_all(fd, hdr, 8);
    if (st) return st;
    uint64_t len = kvpi_get_le64(hdr);
    if (len == 0 || len > KVPI_RPC_MAX_FRAME)
        return kvpi_error(KVP_EPROTO, "frame length %llu is not in 1..%u", (unsigned long long)len,
                          KVPI_RPC_MAX_FRAME);
    st = kvpi_recv_all(fd, hdr + 8, 1);
    if (st) return st;
    if (!valid_type(hdr[8])) return kvpi_error(KVP_EPROTO, "unknown frame type %u", hdr[8]);
    char *text = malloc(len);
    if (!text)
        return kvpi_error(KVP_ENOMEM, "out of memory for a %llu-byte frame",
                          (unsigned long long)len);
    st = kvpi_recv_all(fd, text, len - 1);
    if (st) {
        free(text);
        return st;
    }
    text[len - 1] = '\0';
    *type = hdr[8];
    *json = text;
    return KVP_OK;
}

/* ---- server ---- */

static void warn_once(kvpi_rpc_server *srv, const char *what)
{
    pthread_mutex_lock(&srv->lock);
    int first = !srv->warned;
    srv->warned = 1;
    pthread_mutex_unlock(&srv->lock);
    if (first)
        KVPI_WARN("handshake server %s: %s; closing that connection (further ones logged at "
                  "debug)",
                  srv->addr, what);
    else
        KVPI_DEBUG("handshake server %s: %s; closing that connection", srv->addr, what);
}

static void serve_one(kvpi_rpc_server *srv, int fd)
{
    int type = 0;
    char *request = NULL, *reply = NULL;
    kvp_status st = recv_frame(fd, &type, &request);
    if (st == KVP_EPROTO) warn_once(srv, kvp_last_error());
    if (st) {
        KVPI_DEBUG("handshake server %s: %s", srv->addr, kvp_last_error());
        return;
    }
    reply = type == KVPI_RPC_METADATA ? srv->desc_fn(srv->ctx) : strdup("{}");
    if (!reply) {
        KVPI_WARN("handshake server %s: no local descriptor to answer with", srv->addr);
    } else if (strlen(reply) + 1 > KVPI_RPC_MAX_FRAME) {
        KVPI_WARN("handshake server %s: local descriptor exceeds %u bytes", srv->addr,
                  KVPI_RPC_MAX_FRAME);
    } else if (send_frame(fd, type, reply) != KVP_OK) {
        KVPI_DEBUG("handshake server %s: reply: %s", srv->addr, kvp_last_error());
    }
    free(request);
    free(reply);
}

static void *conn_main(void *arg)
{
    rpc_conn *c = arg;
    serve_one(c->srv, c->fd);
    /* The peer sees EOF now; the fd itself is closed when the thread is reaped. */
    shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_lock(&c->srv->lock);
    c->done = 1;
    pthread_mutex_unlock(&c->srv->lock);
    return NULL;
}

static void conn_free(rpc_conn *c)
{
    pthread_join(c->thread, NULL);
    close(c->fd);
    free(c);
}

/* Join the connection threads that finished and close their sockets. */
static void reap(kvpi_rpc_server *srv)
{
    rpc_conn *done = NULL;
    pthread_mutex_lock(&srv->lock);
    for (rpc_conn **p = &srv->conns; *p;) {
        rpc_conn *c = *p;
        if (c->done) {
            *p = c->next;
            c->next = done;
            done = c;
            srv->n_conns--;
        } else {
            p = &c->next;
        }
    }
    pthread_mutex_unlock(&srv->lock);
    while (done) {
        rpc_conn *next = done->next;
        conn_free(done);
        done = next;
    }
}

static void spawn_conn(kvpi_rpc_server *srv, int fd)
{
    rpc_conn *c = calloc(1, sizeof *c);
    pthread_mutex_lock(&srv->lock);
    int full = srv->n_conns >= RPC_MAX_CONNS;
    if (c && !full) {
        c->srv = srv;
        c->fd = fd;
        if (pthread_create(&c->thread, NULL, conn_main, c) == 0) {
            c->next = srv->conns;
            srv->conns = c;
            srv->n_conns++;
            fd = -1;
            c = NULL;
        }
    }
    pthread_mutex_unlock(&srv->lock);
    if (fd >= 0) {
        KVPI_WARN_LIMITED("handshake server %s: refusing a connection (%s)", srv->addr,
                          full ? "too many open handshakes" : "cannot start a thread");
        close(fd);
    }
    free(c);
}

static void *listener_main(void *arg)
{
    kvpi_rpc_server *srv = arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = srv->listen_fd, .events = POLLIN},
                              {.fd = srv->wake[0], .events = POLLIN}};
        int rc = poll(p, 2, RPC_POLL_MS);
        if (rc < 0 && errno != EINTR) {
            KVPI_ERROR("handshake server %s: poll: %s", srv->addr, strerror(errno));
            break;
        }
        if (p[1].revents) break;
        reap(srv);
        if (rc <= 0 || !(p[0].revents & POLLIN)) continue;
        int fd;
        /* The listening socket is non-blocking: a client that left between
         * poll and accept costs an EAGAIN, not a stuck listener. */
        if (kvpi_tcp_accept(srv->listen_fd, srv->timeout_ms, &fd) == KVP_OK)
            spawn_conn(srv, fd);
        else
            usleep(10000); /* out of fds, say: do not spin on a listener that stays readable */
    }
    return NULL;
}

static void server_free(kvpi_rpc_server *srv)
{
    if (srv->listen_fd >= 0) close(srv->listen_fd);
    if (srv->wake[0] >= 0) close(srv->wake[0]);
    if (srv->wake[1] >= 0) close(srv->wake[1]);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
}

kvp_status kvpi_rpc_server_start(const char *host, int port, int timeout_ms,
                                 kvpi_rpc_desc_fn desc_fn, void *ctx, kvpi_rpc_server **out)
{
    if (!host || !desc_fn || !out)
        return kvpi_error(KVP_EINVAL, "handshake server: host, desc_fn and out are required");
    kvpi_rpc_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "out of memory");
    srv->listen_fd = srv->wake[0] = srv->wake[1] = -1;
    srv->timeout_ms = timeout_ms > 0 ? timeout_ms : RPC_DEFAULT_TIMEOUT_MS;
    srv->desc_fn = desc_fn;
    srv->ctx = ctx;
    pthread_mutex_init(&srv->lock, NULL);
    int bound = 0;
    kvp_status st = kvpi_tcp_listen(host, port, &srv->listen_fd, &bound);
    if (st) goto fail;
    srv->port = bound;
    kvpi_hostport_format(host, bound, srv->addr, sizeof srv->addr);
    fcntl(srv->listen_fd, F_SETFL, fcntl(srv->listen_fd, F_GETFL) | O_NONBLOCK);
    if (pipe2(srv->wake, O_CLOEXEC) != 0) {
        st = kvpi_error(KVP_EIO, "handshake server %s: pipe: %s", srv->addr, strerror(errno));
        goto fail;
    }
    if (pthread_create(&srv->listener, NULL, listener_main, srv) != 0) {
        st = kvpi_error(KVP_EIO, "handshake server %s: cannot start its thread", srv->addr);
        goto fail;
    }
    KVPI_INFO("handshake server listening on %s", srv->addr);
    *out = srv;
    return KVP_OK;
fail:
    server_free(srv);
    return st;
}

int kvpi_rpc_server_port(const kvpi_rpc_server *server)
{
    return server->port;
}

void kvpi_rpc_server_stop(kvpi_rpc_server *server)
{
    if (!server) return;
    char byte = 1;
    while (write(server->wake[1], &byte, 1) < 0 && errno == EINTR) {
    }
    pthread_join(server->listener, NULL);
    /* Wake connection threads blocked in recv/send, then join them all. */
    pthread_mutex_lock(&server->lock);
    for (rpc_conn *c = server->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    rpc_conn *conns = server->conns;
    server->conns = NULL;
    pthread_mutex_unlock(&server->lock);
    while (conns) {
        rpc_conn *next = conns->next;
        conn_free(conns);
        conns = next;
    }
    server_free(server);
}

/* ---- client ---- */

static kvp_status call_on(int fd, int type, const char *json, char **reply)
{
    kvp_status st = send_frame(fd, type, json);
    if (st) return st;
    int got = -1;
    char *text = NULL;
    st = recv_frame(fd, &got, &text);
    if (st) return st;
    if (got != type) {
        free(text);
        return kvpi_error(KVP_EPROTO, "reply has frame type %d, expected %d", got, type);
    }
    *reply = text;
    return KVP_OK;
}

kvp_status kvpi_rpc_call(const char *host, int port, int type, const char *json, int timeout_ms,
                         char **reply)
{
    char addr[KVPI_HOST_MAX + 8];
    if (!host || !json || !reply)
        return kvpi_error(KVP_EINVAL, "handshake: host, json and reply are required");
    kvpi_hostport_format(host, port, addr, sizeof addr);
    if (type < 0 || !valid_type((unsigned)type))
        return kvpi_error(KVP_EINVAL, "handshake with %s: unknown frame type %d", addr, type);
    if (strlen(json) + 1 > KVPI_RPC_MAX_FRAME)
        return kvpi_error(KVP_EINVAL, "handshake with %s: request of %zu bytes exceeds %u", addr,
                          strlen(json), KVPI_RPC_MAX_FRAME);
    if (timeout_ms <= 0) timeout_ms = RPC_DEFAULT_TIMEOUT_MS;
    int fd;
    kvp_status st = kvpi_tcp_connect(host, port, timeout_ms, &fd);
    if (st) return wrap(st, "handshake with", addr);
    char *text = NULL;
    st = call_on(fd, type, json, &text);
    close(fd);
    if (st) return wrap(st, "handshake with", addr);
    *reply = text;
    return KVP_OK;
}
