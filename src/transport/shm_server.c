/* The target side of the shm transport: an abstract Unix socket that takes
 * requests from initiators on this host, checks each against the live registry
 * and copies with process_vm_readv/writev straight between the registered
 * memory and the initiator's memory. One thread per connection; an initiator
 * keeps a few connections so that its slices run in parallel. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "transport/shm_internal.h"

/* A local process that opens connections without end must not exhaust our
 * threads; beyond this, new connections are refused. */
#define MAX_CONNS 256
/* One process_vm_* call at most; the kernel copies in page batches anyway. */
#define COPY_CHUNK ((size_t)1 << 30)
/* Statuses of requests that arrived together go back together, so that the
 * initiator wakes once per window and not once per request; but never more
 * than these, so that it hears from us within its timeout. */
#define DEFER_MAX 128
#define DEFER_BYTES ((uint64_t)64 << 20)

typedef struct shm_server shm_server;

typedef struct shm_conn {
    shm_server *srv;
    int fd;
    pid_t peer; /* the initiator, from SO_PEERCRED at accept */
    pthread_t thread;
    atomic_int done;
    struct shm_conn *next;
    size_t n_out;       /* statuses deferred in out */
    uint64_t out_bytes; /* bytes their requests moved */
    uint8_t out[DEFER_MAX * KVPI_SHM_STATUS_LEN];
} shm_conn;

struct shm_server {
    kvpi_registry *registry;
    int timeout_ms;
    int listen_fd;
    int wake_fd; /* eventfd; readable once the server stops */
    pthread_t acceptor;
    pthread_mutex_t lock; /* guards conns, n_conns */
    shm_conn *conns;
    size_t n_conns;
    pid_t pid;
    char host_id[KVPI_SHM_HOST_ID_MAX];
    char name[KVPI_SHM_SOCKET_MAX];
};

/* 1 when fd is readable; 0 when the server stops first (or the timeout,
 * negative for none, passes). */
static int wait_readable(const shm_server *srv, int fd, int timeout_ms)
{
    struct pollfd p[2] = {{.fd = fd, .events = POLLIN}, {.fd = srv->wake_fd, .events = POLLIN}};
    for (;;) {
        int rc = poll(p, 2, timeout_ms);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0 || (p[1].revents & POLLIN)) return 0;
        return (p[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0;
    }
}

static kvp_status flush(shm_conn *c)
{
    kvp_status st = kvpi_send_all(c->fd, c->out, c->n_out * KVPI_SHM_STATUS_LEN);
    c->n_out = 0;
    c->out_bytes = 0;
    return st;
}

/* Another request already waiting? Then its status can go with this one. */
static int more_queued(const shm_conn *c)
{
    int avail = 0;
    return ioctl(c->fd, FIONREAD, &avail) == 0 && avail >= KVPI_SHM_REQ_LEN;
}

/* Queue a status; send the queue unless more requests are waiting. */
static kvp_status answer(shm_conn *c, kvp_status st, int err, uint64_t bytes)
{
    kvpi_shm_put_status(c->out + c->n_out * KVPI_SHM_STATUS_LEN, st, err);
    c->n_out++;
    c->out_bytes += bytes;
    if (c->n_out < DEFER_MAX && c->out_bytes < DEFER_BYTES && more_queued(c)) return KVP_OK;
    return flush(c);
}

static kvp_status reply(shm_conn *c, kvp_status st, int err)
{
    return answer(c, st, err, 0) ? KVP_ECONNRESET : flush(c);
}

/* Copy len bytes between our memory at mine and the initiator's at theirs.
 * Returns 0 or the errno that stopped it. */
static int copy_with_peer(pid_t peer, kvp_opcode op, uint64_t mine, uint64_t theirs, uint64_t len)
{
    uint64_t done = 0;
    while (done < len) {
        size_t n = len - done > COPY_CHUNK ? COPY_CHUNK : (size_t)(len - done);
        struct iovec local = {(void *)(uintptr_t)(mine + done), n};
        struct iovec remote = {(void *)(uintptr_t)(theirs + done), n};
        /* READ moves our registered bytes into the initiator, WRITE the reverse. */
        ssize_t k = op == KVP_OP_READ ? process_vm_writev(peer, &local, 1, &remote, 1, 0)
                                      : process_vm_readv(peer, &local, 1, &remote, 1, 0);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return errno;
        if (k == 0) return EFAULT;
        done += (uint64_t)k;
    }
    return 0;
}

/* Check that the initiator speaks our protocol, is the same user, and lets us
 * reach its memory: it names 8 bytes of its memory and their value. */
static kvp_status serve_hello(shm_conn *c)
{
    uint8_t h[KVPI_SHM_HELLO_LEN];
    kvp_status st = kvpi_recv_all(c->fd, h, sizeof h);
    if (st) return st;
    if (kvpi_get_le64(h) != ((uint64_t)KVPI_SHM_MAGIC << 32 | KVPI_SHM_VERSION)) {
        reply(c, KVP_EPROTO, 0);
        return kvpi_error(KVP_EPROTO, "shm server: bad hello from pid %d", (int)c->peer);
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != geteuid() ||
        cred.pid <= 0) {
        reply(c, KVP_ENOTSUP, EPERM);
        return kvpi_error(KVP_ENOTSUP, "shm server: initiator is another user or pid namespace");
    }
    uint64_t probe = 0;
    int err = copy_with_peer(c->peer, KVP_OP_WRITE, (uint64_t)(uintptr_t)&probe,
                             kvpi_get_le64(h + 8), sizeof probe);
    if (!err && probe != kvpi_get_le64(h + 16)) err = EFAULT;
    if (err) {
        reply(c, KVP_ENOTSUP, err);
        return kvpi_error(KVP_ENOTSUP, "shm server: cannot reach the memory of pid %d: %s",
                          (int)c->peer, strerror(err));
    }
    return reply(c, KVP_OK, 0);
}

static kvp_status copy_status(int err, int *fatal)
{
    switch (err) {
    case 0: return KVP_OK;
    case EFAULT: return KVP_EINVAL; /* the initiator's local address is not mapped */
    case ESRCH: *fatal = 1; return KVP_ECONNRESET;
    case EPERM: *fatal = 1; return KVP_ENOTSUP;
    default: return KVP_EIO;
    }
}

/* One request: a bad frame closes the connection, a rejected range or a
 * failed copy is answered and the connection keeps serving. */
static kvp_status serve_request(shm_conn *c)
{
    uint8_t h[KVPI_SHM_REQ_LEN];
    kvp_status st = kvpi_recv_all(c->fd, h, sizeof h);
    if (st) return st;
    uint64_t remote = kvpi_get_le64(h), len = kvpi_get_le64(h + 8), local = kvpi_get_le64(h + 16);
    uint8_t op = h[24];
    if (op > KVP_OP_WRITE) {
        reply(c, KVP_EPROTO, 0);
        return kvpi_error(KVP_EPROTO, "shm server: bad opcode %u from pid %d", op, (int)c->peer);
    }
    if (len == 0) return answer(c, KVP_OK, 0, 0);
    if (kvpi_registry_pin(c->srv->registry, remote, len) != KVP_OK) {
        KVPI_DEBUG("shm server: pid %d asked for [0x%" PRIx64 ", +%" PRIu64 ") outside registered "
                   "memory", (int)c->peer, remote, len);
        return answer(c, KVP_ERANGE, 0, 0);
    }
    int err = copy_with_peer(c->peer, (kvp_opcode)op, remote, local, len);
    kvpi_registry_unpin(c->srv->registry);
    int fatal = 0;
    st = copy_status(err, &fatal);
    kvp_status sent = fatal ? reply(c, st, err) : answer(c, st, err, len);
    if (fatal) return kvpi_error(st, "shm server: pid %d: %s", (int)c->peer, strerror(err));
    return sent;
}

static void *conn_main(void *arg)
{
    shm_conn *c = arg;
    if (serve_hello(c) == KVP_OK)
        while (wait_readable(c->srv, c->fd, -1) && serve_request(c) == KVP_OK) {
        }
    /* The initiator sees end-of-stream at once; the fd is closed when reaped. */
    shutdown(c->fd, SHUT_RDWR);
    atomic_store(&c->done, 1);
    return NULL;
}

static void conn_free(shm_conn *c)
{
    pthread_join(c->thread, NULL);
    close(c->fd);
    free(c);
}

/* Join and free connections whose thread has ended. Call with srv->lock. */
static void reap_done(shm_server *srv)
{
    for (shm_conn **pp = &srv->conns; *pp;) {
        shm_conn *c = *pp;
        if (!atomic_load(&c->done)) {
            pp = &c->next;
            continue;
        }
        *pp = c->next;
        srv->n_conns--;
        conn_free(c);
    }
}

static void conn_start(shm_server *srv, int fd)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    shm_conn *c = NULL;
    pthread_mutex_lock(&srv->lock);
    reap_done(srv);
    if (srv->n_conns >= MAX_CONNS) {
        KVPI_WARN_LIMITED("shm server: %d connections already; refusing another", MAX_CONNS);
        goto refuse;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) goto refuse;
    if (!(c = calloc(1, sizeof *c))) goto refuse;
    *c = (shm_conn){.srv = srv, .fd = fd, .peer = cred.pid};
    kvpi_socket_set_timeout(fd, srv->timeout_ms);
    if (pthread_create(&c->thread, NULL, conn_main, c) != 0) goto refuse;
    c->next = srv->conns;
    srv->conns = c;
    srv->n_conns++;
    pthread_mutex_unlock(&srv->lock);
    return;
refuse:
    pthread_mutex_unlock(&srv->lock);
    free(c);
    close(fd);
}

static void *accept_main(void *arg)
{
    shm_server *srv = arg;
    while (wait_readable(srv, srv->listen_fd, -1)) {
        int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) {
            conn_start(srv, fd);
        } else if (errno == EMFILE || errno == ENFILE || errno == ENOMEM) {
            KVPI_WARN("shm server: accept: %s", strerror(errno));
            poll(NULL, 0, 100); /* let descriptors free up instead of spinning */
        }
    }
    return NULL;
}

/* Can this process use cross-memory attach at all? A seccomp filter or an old
 * kernel turns it off; then shm is unavailable and the engine uses tcp. */
static kvp_status self_probe(void)
{
    uint64_t src = 0x6b7670697065u, dst = 0;
    struct iovec l = {&dst, sizeof dst}, r = {&src, sizeof src};
    if (process_vm_readv(getpid(), &l, 1, &r, 1, 0) != (ssize_t)sizeof dst || dst != src)
        return kvpi_error(KVP_ENOTSUP, "shm: process_vm_readv is unavailable here: %s",
                          strerror(errno));
    return KVP_OK;
}

static kvp_status listen_abstract(shm_server *srv)
{
    uint64_t token = 0;
    if (getrandom(&token, sizeof token, 0) != (ssize_t)sizeof token)
        token = (uint64_t)getpid() * 0x9e3779b97f4a7c15u ^ (uint64_t)(uintptr_t)srv;
    snprintf(srv->name, sizeof srv->name, "kvpipe-shm/%d/%016" PRIx64, (int)srv->pid, token);
    struct sockaddr_un sa;
    socklen_t len = kvpi_shm_sockaddr(srv->name, &sa);
    srv->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (srv->listen_fd < 0)
        return kvpi_error(KVP_EIO, "shm server: socket: %s", strerror(errno));
    if (bind(srv->listen_fd, (struct sockaddr *)&sa, len) != 0 || listen(srv->listen_fd, 128) != 0)
        return kvpi_error(KVP_EIO, "shm server: cannot listen on @%s: %s", srv->name,
                          strerror(errno));
    return KVP_OK;
}

kvp_status kvpi_shm_server_start(const kvpi_server_ctx *ctx, void **server)
{
    kvp_status st = self_probe();
    if (st) return st;
    shm_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "shm server: out of memory");
    *srv = (shm_server){.registry = ctx->registry, .timeout_ms = ctx->timeout_ms,
                        .listen_fd = -1, .pid = getpid()};
    pthread_mutex_init(&srv->lock, NULL);
    srv->wake_fd = eventfd(0, EFD_CLOEXEC);
    if (srv->wake_fd < 0) {
        st = kvpi_error(KVP_EIO, "shm server: eventfd: %s", strerror(errno));
        goto fail;
    }
    if ((st = kvpi_shm_host_id(srv->host_id, sizeof srv->host_id))) goto fail;
    if ((st = listen_abstract(srv))) goto fail;
    if (pthread_create(&srv->acceptor, NULL, accept_main, srv) != 0) {
        st = kvpi_error(KVP_EIO, "shm server: cannot start a thread");
        goto fail;
    }
    *server = srv;
    return KVP_OK;
fail:
    if (srv->listen_fd >= 0) close(srv->listen_fd);
    if (srv->wake_fd >= 0) close(srv->wake_fd);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
    return st;
}

void kvpi_shm_server_describe(void *server, cJSON *desc)
{
    shm_server *srv = server;
    cJSON *o = cJSON_CreateObject();
    if (!o) return;
    cJSON_AddNumberToObject(o, "version", KVPI_SHM_VERSION);
    cJSON_AddStringToObject(o, "host_id", srv->host_id);
    cJSON_AddNumberToObject(o, "pid", srv->pid);
    cJSON_AddStringToObject(o, "socket", srv->name);
    cJSON_DeleteItemFromObjectCaseSensitive(desc, KVPI_SHM_FIELD);
    cJSON_AddItemToObject(desc, KVPI_SHM_FIELD, o);
}

void kvpi_shm_server_stop(void *server)
{
    shm_server *srv = server;
    if (!srv) return;
    uint64_t one = 1;
    if (write(srv->wake_fd, &one, sizeof one) != (ssize_t)sizeof one)
        KVPI_WARN("shm server: cannot wake threads: %s", strerror(errno));
    pthread_join(srv->acceptor, NULL);
    close(srv->listen_fd);
    /* New connections cannot arrive now; wake threads inside a request. */
    pthread_mutex_lock(&srv->lock);
    for (shm_conn *c = srv->conns; c; c = c->next) shutdown(c->fd, SHUT_RDWR);
    while (srv->conns) {
        shm_conn *c = srv->conns;
        srv->conns = c->next;
        conn_free(c);
    }
    pthread_mutex_unlock(&srv->lock);
    close(srv->wake_fd);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
}
