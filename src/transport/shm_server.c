/* The target side of the shm transport: an abstract Unix socket that takes
 * requests from initiators on this host, checks each against the live region
 * table and copies with process_vm_readv/writev straight between the
 * registered memory and the initiator's memory (device memory: staged, or
 * the initiator copies itself through a CUDA IPC handle it asks for). The
 * socket is served by a connection server (common/conn_server.h): one thread
 * per connection, a cap on connections, idle reaping and deadlines; the hello
 * is its setup step. An initiator keeps a few connections so that its slices
 * run in parallel. */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/conn_server.h"
#include "common/digest.h"
#include "common/error.h"
#include "common/log.h"
#include "common/tsan.h"
#include "common/net.h"
#include "transport/shm_internal.h"
#include "transport/staging.h"

/* One process_vm_* call at most. Before each, the server checks that the
 * initiator has not given the request up (see copy_with_peer). */
#define COPY_CHUNK KVPI_SHM_COPY_CHUNK
/* Statuses of requests that arrived together go back together
 * (kvpi_conn_send_later), so that the initiator wakes once per window and not
 * once per request; but not after more than this many bytes moved, so that
 * it hears from us within its timeout. */
#define DEFER_BYTES ((uint64_t)64 << 20)

typedef struct shm_server {
    kvpi_region_table *regions;
    kvpi_served *served; /* may be NULL */
    kvpi_conn_server *conns;
    const kvpi_auth *auth; /* NULL: unauthenticated */
    pid_t pid;
    char host_id[KVPI_SHM_HOST_ID_MAX];
    char name[KVPI_SHM_SOCKET_MAX];
    kvpi_runner *runner; /* the initiator side's threads (shm.c's peer_post) */
} shm_server;

/* Per connection (kvpi_conn_data). */
typedef struct shm_conn {
    kvpi_conn *conn;
    int fd;
    pid_t peer;         /* the initiator, from SO_PEERCRED */
    uint64_t out_bytes; /* bytes moved since this connection last forced its statuses out */
} shm_conn;

/* Queue a status, and the digest after it for a request that asked for one
 * (digest non-NULL): it leaves with those of the requests queued behind it,
 * or at once past DEFER_BYTES moved. */
static kvp_status answer_digest(shm_conn *c, kvp_status st, int err, uint64_t bytes,
                                const uint64_t *digest)
{
    uint8_t frame[KVPI_SHM_STATUS_LEN + KVPI_DIGEST_LEN];
    kvpi_shm_put_status(frame, st, err);
    if (digest) kvpi_put_le64(frame + KVPI_SHM_STATUS_LEN, *digest);
    kvp_status sent =
        kvpi_conn_send_later(c->conn, frame, KVPI_SHM_STATUS_LEN + (digest ? KVPI_DIGEST_LEN : 0));
    if (sent || (c->out_bytes += bytes) < DEFER_BYTES) return sent;
    c->out_bytes = 0;
    return kvpi_conn_flush(c->conn);
}

static kvp_status answer(shm_conn *c, kvp_status st, int err, uint64_t bytes)
{
    return answer_digest(c, st, err, bytes, NULL);
}

/* A status sent now: the last before the connection closes. */
static kvp_status reply(shm_conn *c, kvp_status st, int err)
{
    return answer(c, st, err, 0) ? KVP_ECONNRESET : kvpi_conn_flush(c->conn);
}

/* Has the initiator closed or shut down its end? It does when it gives a
 * request up (its deadline passed): its memory is the caller's again. */
static int initiator_gone(int fd)
{
    struct pollfd pfd = {.fd = fd, .events = POLLRDHUP};
    return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* Copy len bytes between our memory at mine and the initiator's at theirs,
 * COPY_CHUNK at a time, as long as the initiator holds the connection (fd)
 * open: a copy into memory it gave back would corrupt whatever the caller
 * put there since. Returns 0 or the errno that stopped it (ECONNABORTED:
 * the initiator gave up). */
static int copy_with_peer(int fd, pid_t peer, kvp_opcode op, uint64_t mine, uint64_t theirs,
                          uint64_t len)
{
    uint64_t done = 0;
    while (done < len) {
        if (initiator_gone(fd)) return ECONNABORTED;
        size_t n = len - done > COPY_CHUNK ? COPY_CHUNK : (size_t)(len - done);
        struct iovec local = {(void *)(uintptr_t)(mine + done), n};
        struct iovec remote = {(void *)(uintptr_t)(theirs + done), n};
        /* READ moves our registered bytes into the initiator, WRITE the reverse. */
        KVPI_PEER_COPY_BEGIN();
        ssize_t k = op == KVP_OP_READ ? process_vm_writev(peer, &local, 1, &remote, 1, 0)
                                      : process_vm_readv(peer, &local, 1, &remote, 1, 0);
        KVPI_PEER_COPY_END();
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return errno;
        if (k == 0) return EFAULT;
        done += (uint64_t)k;
    }
    return 0;
}

/* Refused connections of every listener of this kind, for the log. */
static kvpi_log_limit auth_log;

/* The connection's setup step: in the authenticated mode the initiator proves
 * the key first; then check that it speaks our protocol, is the same user,
 * and lets us reach its memory (it names 8 bytes of its memory and their
 * value). Bounded by the setup deadline. */
static kvp_status serve_hello(kvpi_conn *conn)
{
    shm_conn *c = kvpi_conn_data(conn);
    c->conn = conn;
    c->fd = kvpi_conn_fd(conn);
    const shm_server *srv = kvpi_conn_ctx(conn);
    kvp_status st = srv->auth ? kvpi_auth_conn_setup(conn, srv->auth, "shm", &auth_log) : KVP_OK;
    if (st) return st;
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return kvpi_error(KVP_EIO, "shm server: SO_PEERCRED: %s", strerror(errno));
    c->peer = cred.pid;
    uint8_t raw[KVPI_SHM_HELLO_LEN];
    kvpi_shm_hello h;
    st = kvpi_conn_recv(conn, raw, sizeof raw);
    if (st) return st;
    if (kvpi_shm_hello_decode(raw, &h) != 0) {
        reply(c, KVP_EPROTO, 0);
        return kvpi_error(KVP_EPROTO, "shm server: bad hello from pid %d", (int)c->peer);
    }
    if (cred.uid != geteuid() || cred.pid <= 0) {
        reply(c, KVP_ENOTSUP, EPERM);
        return kvpi_error(KVP_ENOTSUP, "shm server: initiator is another user or pid namespace");
    }
    uint64_t probe = 0;
    int err = copy_with_peer(c->fd, c->peer, KVP_OP_WRITE, (uint64_t)(uintptr_t)&probe,
                             h.probe_addr, sizeof probe);
    if (!err && probe != h.probe_value) err = EFAULT;
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
    case 0:
        return KVP_OK;
    case EFAULT:
        return KVP_EINVAL; /* the initiator's local address is not mapped */
    case ESRCH:
        *fatal = 1;
        return KVP_ECONNRESET;
    case EPERM:
        *fatal = 1;
        return KVP_ENOTSUP;
    default:
        return KVP_EIO;
    }
}

/* The staged copy of a request on registered device memory (staging.h):
 * between the device and a bounce buffer by the driver, between the bounce
 * buffer and the initiator's memory by process_vm_*. */
typedef struct staged_io {
    int fd; /* the connection, to stop if the initiator gives up */
    pid_t peer;
    kvp_opcode op;
    uint64_t theirs;
    int err;               /* what stopped process_vm_*, for the status */
    kvpi_digester *digest; /* integrity: of the bounce buffers' bytes moved */
} staged_io;

static kvp_status staged_copy(void *ctx, void *buf, size_t len, uint64_t off)
{
    staged_io *io = ctx;
    if (io->digest && io->op == KVP_OP_READ) kvpi_digester_add(io->digest, buf, len);
    io->err =
        copy_with_peer(io->fd, io->peer, io->op, (uint64_t)(uintptr_t)buf, io->theirs + off, len);
    if (!io->err && io->digest && io->op == KVP_OP_WRITE) kvpi_digester_add(io->digest, buf, len);
    return io->err ? KVP_EIO : KVP_OK;
}

/* Returns the request's status; *err and *fatal as copy_status() sets them.
 * A failed driver copy is KVP_EIO (errno 0), logged here. */
static kvp_status serve_staged(shm_conn *c, const kvpi_shm_req *r, int device, int *err, int *fatal,
                               uint64_t *digest)
{
    staged_io io = {.fd = c->fd, .peer = c->peer, .op = (kvp_opcode)r->opcode, .theirs = r->local};
    uint64_t moved;
    int copy_failed;
    *err = 0;
    if (r->digest && !(io.digest = kvpi_digester_new()))
        return kvpi_error(KVP_ENOMEM, "shm server: out of memory");
    kvpi_stage_serve(io.op, device, r->remote, r->length, staged_copy, &io, &moved, &copy_failed);
    if (io.digest) *digest = kvpi_digester_value(io.digest);
    kvpi_digester_free(io.digest);
    *err = io.err;
    if (copy_failed) {
        KVPI_WARN_LIMITED("shm server: %s of [0x%" PRIx64 ", +%" PRIu64 ") on cuda device %d for "
                          "pid %d failed: %s",
                          io.op == KVP_OP_READ ? "READ" : "WRITE", r->remote, r->length, device,
                          (int)c->peer, kvp_last_error());
        return KVP_EIO;
    }
    return copy_status(io.err, fatal);
}

/* A CUDA IPC request: the handle of the device allocation that holds the
 * registered device memory [remote, +length), so that the initiator copies
 * with the driver itself. A range outside registered device memory is
 * KVP_ERANGE; an allocation the driver cannot export (KVP_ENOTSUP) is logged
 * here; either way the initiator stages instead. */
static kvp_status serve_ipc(shm_conn *c, const kvpi_shm_req *r, shm_server *srv)
{
    kvpi_pin pin;
    if (!kvpi_conn_busy(c->conn, 0)) return KVP_ECLOSED;
    if (r->length == 0 ||
        kvpi_region_pin(srv->regions, r->remote, r->length, KVPI_MEM_BIT(KVP_MEM_CUDA), &pin))
        return answer(c, KVP_ERANGE, 0, 0);
    kvpi_shm_ipc ipc;
    int device = kvpi_pin_region(pin)->device;
    kvp_status st = kvpi_cuda_ipc_export(device, (const void *)(uintptr_t)r->remote, &ipc.base,
                                         &ipc.size, ipc.handle);
    kvpi_region_unpin(srv->regions, pin);
    if (st) {
        KVPI_WARN_LIMITED("shm server: no CUDA IPC for pid %d (it stages instead): %s",
                          (int)c->peer, kvp_last_error());
        return answer(c, KVP_ENOTSUP, 0, 0);
    }
    /* The status, after those deferred (kvpi_conn_send sends them first),
     * then the handle. */
    uint8_t out[KVPI_SHM_STATUS_LEN + KVPI_SHM_IPC_LEN];
    kvpi_shm_put_status(out, KVP_OK, 0);
    kvpi_shm_ipc_encode(&ipc, out + KVPI_SHM_STATUS_LEN);
    return kvpi_conn_send(c->conn, out, sizeof out);
}

/* One request: a bad frame closes the connection, a rejected range or a
 * failed copy is answered and the connection keeps serving. */
static kvp_status serve_request(shm_conn *c, const uint8_t h[KVPI_SHM_REQ_LEN], shm_server *srv)
{
    kvpi_region_table *reg = srv->regions;
    kvpi_shm_req r;
    if (kvpi_shm_req_decode(h, &r) != 0) {
        reply(c, KVP_EPROTO, 0);
        return kvpi_error(KVP_EPROTO, "shm server: bad opcode %u from pid %d", r.opcode,
                          (int)c->peer);
    }
    if (r.opcode == KVPI_SHM_OP_CUDA_IPC) return serve_ipc(c, &r, srv);
    uint64_t remote = r.remote, len = r.length, local = r.local, digest = 0;
    uint8_t op = r.opcode;
    const uint64_t *dp = r.digest ? &digest : NULL; /* what the answer carries */
    if (!kvpi_conn_busy(c->conn, len)) return KVP_ECLOSED;
    if (len == 0) return answer_digest(c, KVP_OK, 0, 0, dp);
    kvpi_pin pin;
    if (kvpi_region_pin(reg, remote, len, kvpi_transport_shm.mem_kinds, &pin) != KVP_OK) {
        KVPI_DEBUG("shm server: pid %d asked for [0x%" PRIx64 ", +%" PRIu64 ") outside registered "
                   "memory",
                   (int)c->peer, remote, len);
        if (srv->served) kvpi_counter_add(&srv->served->refused, 1);
        return answer_digest(c, KVP_ERANGE, 0, 0, dp);
    }
    int fatal = 0;
    kvp_status st;
    int err;
    if (kvpi_pin_region(pin)->kind != KVP_MEM_HOST) {
        st = serve_staged(c, &r, kvpi_pin_region(pin)->device, &err, &fatal, &digest);
        kvpi_region_unpin(reg, pin);
    } else {
        /* Integrity: the digest is taken in a pass of its own once the copy
         * has ended, over our side of it (common/digest.h). */
        const void *mem = (const void *)(uintptr_t)remote;
        err = copy_with_peer(c->fd, c->peer, (kvp_opcode)op, remote, local, len);
        KVPI_PEER_COPY_BEGIN();
        if (r.digest && !err) digest = kvpi_digest(mem, len);
        KVPI_PEER_COPY_END();
        kvpi_region_unpin(reg, pin);
        st = copy_status(err, &fatal);
    }
    if (err == ECONNABORTED)
        return kvpi_error(KVP_ECLOSED, "shm server: pid %d gave the request up", (int)c->peer);
    if (st == KVP_OK && srv->served) kvpi_served_add(srv->served, op == KVP_OP_WRITE, len);
    if (st) digest = 0;
    kvp_status sent = fatal ? reply(c, st, err) : answer_digest(c, st, err, len, dp);
    if (fatal) return kvpi_error(st, "shm server: pid %d: %s", (int)c->peer, strerror(err));
    return sent;
}

static void serve(kvpi_conn *conn)
{
    shm_conn *c = kvpi_conn_data(conn);
    shm_server *srv = kvpi_conn_ctx(conn);
    uint8_t h[KVPI_SHM_REQ_LEN];
    kvp_status st;
    while ((st = kvpi_conn_next(conn, h, sizeof h)) == KVP_OK &&
           (st = serve_request(c, h, srv)) == KVP_OK) {
    }
    if (st != KVP_ECLOSED)
        KVPI_DEBUG("shm server: connection from pid %d ends: %s", (int)c->peer, kvp_last_error());
}

static const kvpi_conn_handler shm_handler = {
    .setup = serve_hello, .serve = serve, .data_size = sizeof(shm_conn)};

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

static kvp_status listen_abstract(shm_server *srv, int *fd_out)
{
    uint64_t token = 0;
    if (getrandom(&token, sizeof token, 0) != (ssize_t)sizeof token)
        token = (uint64_t)getpid() * 0x9e3779b97f4a7c15u ^ (uint64_t)(uintptr_t)srv;
    snprintf(srv->name, sizeof srv->name, "kvpipe-shm/%d/%016" PRIx64, (int)srv->pid, token);
    struct sockaddr_un sa;
    socklen_t len = kvpi_shm_sockaddr(srv->name, &sa);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return kvpi_error(KVP_EIO, "shm server: socket: %s", strerror(errno));
    if (bind(fd, (struct sockaddr *)&sa, len) != 0 || listen(fd, KVPI_LISTEN_BACKLOG) != 0) {
        kvp_status st =
            kvpi_error(KVP_EIO, "shm server: cannot listen on @%s: %s", srv->name, strerror(errno));
        close(fd);
        return st;
    }
    *fd_out = fd;
    return KVP_OK;
}

kvp_status kvpi_shm_server_start(const kvpi_server_ctx *ctx, void **server)
{
    kvp_status st = self_probe();
    if (st) return st;
    shm_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "shm server: out of memory");
    *srv = (shm_server){
        .regions = ctx->regions, .served = ctx->served, .auth = ctx->auth, .pid = getpid()};
    int fd = -1;
    if ((st = kvpi_shm_host_id(srv->host_id, sizeof srv->host_id)) ||
        (st = kvpi_runner_create(&srv->runner))) {
        free(srv);
        return st;
    }
    if ((st = listen_abstract(srv, &fd))) {
        kvpi_runner_stop(srv->runner);
        free(srv);
        return st;
    }
    char name[KVPI_SHM_SOCKET_MAX + 32];
    snprintf(name, sizeof name, "shm server @%s", srv->name);
    kvpi_conn_limits lim = kvpi_server_limits(ctx);
    if ((st = kvpi_conn_server_start(fd, name, &lim, &shm_handler, srv, &srv->conns))) {
        kvpi_runner_stop(srv->runner);
        free(srv);
        return st;
    }
    *server = srv;
    return KVP_OK;
}

kvp_status kvpi_shm_server_describe(void *server, cJSON *desc)
{
    shm_server *srv = server;
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddNumberToObject(o, "version", KVPI_SHM_VERSION) ||
        !cJSON_AddStringToObject(o, "host_id", srv->host_id) ||
        !cJSON_AddNumberToObject(o, "pid", srv->pid) ||
        !cJSON_AddStringToObject(o, "socket", srv->name) ||
        !cJSON_AddBoolToObject(o, "cuda_ipc", 1)) {
        cJSON_Delete(o);
        return kvpi_error(KVP_ENOMEM, "shm server: out of memory");
    }
    cJSON_DeleteItemFromObjectCaseSensitive(desc, KVPI_SHM_FIELD);
    cJSON_AddItemToObject(desc, KVPI_SHM_FIELD, o);
    return KVP_OK;
}

void kvpi_shm_server_stop(void *server)
{
    shm_server *srv = server;
    if (!srv) return;
    kvpi_conn_server_stop(srv->conns);
    kvpi_runner_stop(srv->runner);
    free(srv);
}

kvpi_runner *kvpi_shm_server_runner(void *server)
{
    return server ? ((shm_server *)server)->runner : NULL;
}
