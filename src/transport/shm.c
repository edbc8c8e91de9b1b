/* The shm transport: same-host transfers with one copy, by cross-memory attach.
 *
 * This file is the initiator side and the ops table; shm_server.c is the
 * target side. The initiator sends a 32-byte request per slice over one of a
 * few Unix-socket connections; the target checks the range against its live
 * region table and copies between its memory and ours with process_vm_readv or
 * process_vm_writev. Each worker thread of the engine uses its own connection,
 * so several target threads copy at once. A slice on the target's registered
 * device memory is copied by us instead, with the CUDA driver, through an IPC
 * handle the target gives us for its allocation (staged where the driver
 * refuses). See shm_internal.h for the wire format and docs/transport-shm.md
 * for the reasons and the trust model.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/digest.h"
#include "common/error.h"
#include "common/conn_server.h"
#include "common/log.h"
#include "common/net.h"
#include "transport/shm_internal.h"
#include "transport/staging.h"

/* Requests in flight per connection before their statuses are read; small
 * enough that their headers and statuses fit in the socket buffers. */
#define WINDOW 128
#define MAX_LINKS 64

/* A device allocation of the target, [base, +size) in its address space,
 * mapped here at mapped in device's primary context. */
typedef struct shm_ipc {
    uint64_t base, size;
    char *mapped;
    int device;
} shm_ipc;

typedef struct shm_peer {
    kvpi_region *regions; /* the descriptor's, for the early range check */
    size_t n_regions;
    int timeout_ms;
    uint64_t min_rate;
    const kvpi_auth *auth; /* NULL: unauthenticated */
    pid_t target;
    char name[KVPI_SHM_SOCKET_MAX];
    pthread_mutex_t lock; /* guards busy[], fds[] of idle links */
    pthread_cond_t freed;
    size_t n_links;
    int fds[MAX_LINKS]; /* -1: not connected (yet, or after an error) */
    int busy[MAX_LINKS];
    kvpi_runner *runner;   /* the server's; NULL without one */
    kvpi_runner_lane lane; /* as many at once as links */
    kvpi_counter *retries; /* may be NULL */
    int digest;            /* integrity with this peer (common/digest.h) */
    /* CUDA IPC (the descriptor's "cuda_ipc"): the target's device allocations
     * mapped here, found by asking it on a link. ipc_lock guards them and is
     * held across a request and the mapping, never with a link busy. */
    int cuda_ipc;
    pthread_mutex_t ipc_lock;
    shm_ipc *ipc;
    size_t n_ipc;
    char *ipc_off;   /* per descriptor region: the target has no handle for it */
    int ipc_refused; /* our driver refused a handle (or is missing): stage */
} shm_peer;

/* The initiator's probe: the target proves it can read our memory by
 * reading these bytes. */
static const uint64_t probe_value = 0x6b7670697065736du;

/* ---- helpers shared with shm_server.c ---- */

static kvp_status read_line(const char *path, char *buf, size_t len)
{
    FILE *f = fopen(path, "r");
    if (!f) return KVP_EIO;
    char *got = fgets(buf, (int)len, f);
    fclose(f);
    if (!got) return KVP_EIO;
    buf[strcspn(buf, "\r\n")] = '\0';
    return buf[0] ? KVP_OK : KVP_EIO;
}

kvp_status kvpi_shm_host_id(char *buf, size_t len)
{
    char boot[64];
    struct stat pidns, netns;
    if (read_line("/proc/sys/kernel/random/boot_id", boot, sizeof boot) &&
        read_line("/etc/machine-id", boot, sizeof boot))
        return kvpi_error(KVP_ENOTSUP, "shm: neither boot_id nor machine-id is readable");
    if (stat("/proc/self/ns/pid", &pidns) != 0 || stat("/proc/self/ns/net", &netns) != 0)
        return kvpi_error(KVP_ENOTSUP, "shm: cannot stat /proc/self/ns: %s", strerror(errno));
    snprintf(buf, len, "%s/pid:%llu/net:%llu", boot, (unsigned long long)pidns.st_ino,
             (unsigned long long)netns.st_ino);
    return KVP_OK;
}

socklen_t kvpi_shm_sockaddr(const char *name, struct sockaddr_un *sa)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n > sizeof sa->sun_path - 1) n = sizeof sa->sun_path - 1;
    memcpy(sa->sun_path + 1, name, n); /* sun_path[0] = 0: the abstract namespace */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

void kvpi_shm_put_status(uint8_t *p, kvp_status st, int err)
{
    kvpi_put_le64(p, (uint64_t)KVPI_SHM_MAGIC << 32 | (uint64_t)(err & 0xffff) << 16 |
                         ((unsigned)st & 0xffffu));
}

kvp_status kvpi_shm_get_status(const uint8_t *p, kvp_status *st, int *err)
{
    uint64_t v = kvpi_get_le64(p);
    /* In progress is not an answer; a peer that says so is broken. */
    if (v >> 32 != KVPI_SHM_MAGIC || (v & 0xffff) > 64 || (v & 0xffff) == KVP_EINPROGRESS)
        return kvpi_error(KVP_EPROTO, "shm: bad status frame 0x%016" PRIx64, v);
    *st = (kvp_status)(v & 0xffff);
    *err = (int)(v >> 16 & 0xffff);
    return KVP_OK;
}

/* ---- connecting ---- */

static int yama_scope(void)
{
    char buf[16];
    return read_line("/proc/sys/kernel/yama/ptrace_scope", buf, sizeof buf) ? 0 : atoi(buf);
}

/* The target copies into our memory, which Yama's ptrace_scope 1 allows only
 * to a declared ptracer; declare "any", which for a same-user process is what
 * scope 0 allows anyway (see the trust model in docs/transport-shm.md). */
static void allow_attach_once(void)
{
    if (yama_scope() == 1 && prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0)
        KVPI_WARN("shm: prctl(PR_SET_PTRACER): %s", strerror(errno));
}

static kvp_status hello(const shm_peer *p, int fd, uint64_t deadline)
{
    uint8_t h[KVPI_SHM_HELLO_LEN], s[KVPI_SHM_STATUS_LEN];
    kvpi_shm_hello_encode(&(kvpi_shm_hello){.probe_addr = (uint64_t)(uintptr_t)&probe_value,
                                            .probe_value = probe_value},
                          h);
    kvp_status st = kvpi_send_all_by(fd, h, sizeof h, deadline);
    if (!st) st = kvpi_recv_all_by(fd, s, sizeof s, deadline);
    kvp_status remote;
    int err = 0;
    if (!st) st = kvpi_shm_get_status(s, &remote, &err);
    if (st) {
        return kvpi_error(st, "shm peer @%s: handshake failed: %s", p->name, kvp_last_error());
    }
    if (remote == KVP_ENOTSUP)
        return kvpi_error(KVP_ENOTSUP,
                          "shm peer pid %d cannot reach our memory with "
                          "process_vm_*: %s (same user needed; yama ptrace_scope %d)",
                          (int)p->target, strerror(err), yama_scope());
    if (remote) return kvpi_error(remote, "shm peer @%s refused the handshake", p->name);
    return KVP_OK;
}

/* Connect one link. Errors are KVP_ECONNREFUSED when nothing listens (the
 * peer is gone, or in another network namespace) and KVP_ENOTSUP when the
 * peer cannot use our memory. */
static kvp_status link_connect(const shm_peer *p, uint64_t deadline, int *out)
{
    struct sockaddr_un sa;
    socklen_t len = kvpi_shm_sockaddr(p->name, &sa);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return kvpi_error(KVP_EIO, "shm: socket: %s", strerror(errno));
    kvp_status st = KVP_OK;
    struct ucred cred;
    socklen_t cl = sizeof cred;
    if (connect(fd, (struct sockaddr *)&sa, len) != 0) {
        st = kvpi_error(KVP_ECONNREFUSED, "shm: cannot connect to @%s: %s", p->name,
                        strerror(errno));
    } else if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.pid != p->target) {
        /* The name carries a random token, so this means a confused descriptor. */
        st = kvpi_error(KVP_ENOTSUP, "shm: @%s is served by pid %d, the descriptor says %d",
                        p->name, (int)cred.pid, (int)p->target);
    } else if (!p->auth || (st = kvpi_auth_client(p->auth, fd, "shm", deadline)) == KVP_OK) {
        st = hello(p, fd, deadline);
    } else if (st == KVP_EAUTH) {
        st = kvpi_error(st, "shm peer @%s: %s", p->name, kvp_last_error());
    }
    if (st) {
        close(fd);
        return st;
    }
    *out = fd;
    return KVP_OK;
}

static kvp_status parse_endpoint(const cJSON *desc, shm_peer *p)
{
    const cJSON *o = desc ? cJSON_GetObjectItemCaseSensitive(desc, KVPI_SHM_FIELD) : NULL;
    if (!cJSON_IsObject(o))
        return kvpi_error(KVP_ENOTSUP,
                          "shm: the peer advertises no '%s' endpoint (a Mooncake "
                          "peer, or shm is off there)",
                          KVPI_SHM_FIELD);
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(o, "version");
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(o, "host_id");
    const cJSON *pid = cJSON_GetObjectItemCaseSensitive(o, "pid");
    const cJSON *sock = cJSON_GetObjectItemCaseSensitive(o, "socket");
    if (!cJSON_IsNumber(ver) || !cJSON_IsString(host) || !cJSON_IsNumber(pid) ||
        !cJSON_IsString(sock) || pid->valuedouble < 1 || pid->valuedouble > 0x7fffffff ||
        strlen(sock->valuestring) >= sizeof p->name)
        return kvpi_error(KVP_ENOTSUP, "shm: the peer's '%s' endpoint is malformed",
                          KVPI_SHM_FIELD);
    if (ver->valuedouble != KVPI_SHM_VERSION)
        return kvpi_error(KVP_ENOTSUP, "shm: the peer speaks version %g, we speak %u",
                          ver->valuedouble, KVPI_SHM_VERSION);
    char ours[KVPI_SHM_HOST_ID_MAX];
    kvp_status st = kvpi_shm_host_id(ours, sizeof ours);
    if (st) return st;
    if (strcmp(ours, host->valuestring) != 0)
        return kvpi_error(KVP_ENOTSUP,
                          "shm: the peer is on another host or namespace (host id "
                          "'%s', ours '%s')",
                          host->valuestring, ours);
    p->target = (pid_t)pid->valuedouble;
    snprintf(p->name, sizeof p->name, "%s", sock->valuestring);
    /* The driver opens no IPC handle of this very process: a target here stages. */
    p->cuda_ipc =
        cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "cuda_ipc")) && p->target != getpid();
    return KVP_OK;
}

static void peer_close(void *peer)
{
    shm_peer *p = peer;
    if (!p) return;
    for (size_t i = 0; i < p->n_links; i++)
        if (p->fds[i] >= 0) close(p->fds[i]);
    for (size_t i = 0; i < p->n_ipc; i++)
        kvpi_cuda_ipc_close(p->ipc[i].device, p->ipc[i].mapped);
    free(p->ipc);
    free(p->ipc_off);
    pthread_mutex_destroy(&p->ipc_lock);
    pthread_cond_destroy(&p->freed);
    pthread_mutex_destroy(&p->lock);
    free(p->regions);
    free(p);
}

static kvp_status peer_open(const kvpi_peer_ctx *ctx, void **out)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    shm_peer *p = calloc(1, sizeof *p);
    if (!p) return kvpi_error(KVP_ENOMEM, "shm: out of memory");
    pthread_mutex_init(&p->lock, NULL);
    pthread_mutex_init(&p->ipc_lock, NULL);
    kvpi_cond_init(&p->freed);
    p->timeout_ms = ctx->timeout_ms > 0 ? ctx->timeout_ms : KVPI_CONN_TIMEOUT_MS_DEFAULT;
    p->min_rate = ctx->min_rate ? ctx->min_rate : KVPI_MIN_RATE_DEFAULT;
    p->auth = ctx->auth;
    p->runner = kvpi_shm_server_runner(ctx->server);
    p->retries = ctx->retries;
    p->digest = ctx->integrity;
    p->n_links = ctx->conns < 1 ? 1 : ctx->conns > MAX_LINKS ? MAX_LINKS : (size_t)ctx->conns;
    p->lane = (kvpi_runner_lane){.limit = (int)p->n_links,
                                 .timeout_ms = p->timeout_ms,
                                 .min_rate = p->min_rate,
                                 .own_staging = 1};
    for (size_t i = 0; i < MAX_LINKS; i++)
        p->fds[i] = -1;
    kvp_status st = parse_endpoint(ctx->desc, p);
    if (st) goto fail;
    if (ctx->n_regions && (!(p->regions = malloc(ctx->n_regions * sizeof *p->regions)) ||
                           !(p->ipc_off = calloc(ctx->n_regions, 1)))) {
        st = kvpi_error(KVP_ENOMEM, "shm: out of memory");
        goto fail;
    }
    if (ctx->n_regions) memcpy(p->regions, ctx->regions, ctx->n_regions * sizeof *p->regions);
    p->n_regions = ctx->n_regions;
    pthread_once(&once, allow_attach_once);
    /* One link now proves the peer reachable; the rest connect on demand. */
    if ((st = link_connect(p, kvpi_deadline_ns(p->timeout_ms), &p->fds[0])) == KVP_ECONNREFUSED) {
        st = kvpi_error(KVP_ENOTSUP, "%s (not reachable through shm)", kvp_last_error());
    }
    if (st) goto fail;
    *out = p;
    return KVP_OK;
fail:
    peer_close(p);
    return st;
}

/* ---- transferring ---- */

/* Take an idle link, waiting until the call's deadline; -1 if none came free.
 * One link per call: the engine already spreads slices over the runner's
 * threads, so a call that took more would only make the others wait. */
static int link_acquire(shm_peer *p, uint64_t deadline_ns)
{
    struct timespec deadline = kvpi_timespec_at_ns(deadline_ns);
    int got = -1;
    pthread_mutex_lock(&p->lock);
    while (got < 0) {
        /* A connected link first: an unconnected one costs a handshake. */
        for (int pass = 0; pass < 2 && got < 0; pass++)
            for (size_t i = 0; i < p->n_links && got < 0; i++)
                if (!p->busy[i] && (p->fds[i] >= 0) == (pass == 0)) got = (int)i;
        if (got < 0 && pthread_cond_timedwait(&p->freed, &p->lock, &deadline) == ETIMEDOUT) break;
    }
    if (got >= 0) p->busy[got] = 1;
    pthread_mutex_unlock(&p->lock);
    return got;
}

static void link_release(shm_peer *p, int i)
{
    pthread_mutex_lock(&p->lock);
    p->busy[i] = 0;
    pthread_cond_signal(&p->freed);
    pthread_mutex_unlock(&p->lock);
}

/* Check each slice against the descriptor; those to send are left
 * KVP_EINPROGRESS, the others get their final status. Returns how many to send. */
static size_t check_slices(const shm_peer *p, kvpi_slice *const *slices, size_t n)
{
    size_t todo = 0;
    for (size_t i = 0; i < n; i++) {
        kvpi_slice *s = slices[i];
        s->status = KVP_OK;
        if (s->length == 0) continue;
        if (s->opcode != KVP_OP_READ && s->opcode != KVP_OP_WRITE)
            s->status = kvpi_error(KVP_EINVAL, "shm: bad opcode %d", (int)s->opcode);
        else if (!kvpi_regions_contain(p->regions, p->n_regions, s->remote, s->length))
            s->status = kvpi_error(KVP_ERANGE,
                                   "shm peer pid %d: [0x%" PRIx64 ", +%zu) is not "
                                   "inside one registered buffer",
                                   (int)p->target, s->remote, s->length);
        else {
            s->status = KVP_EINPROGRESS;
            todo++;
        }
    }
    return todo;
}

/* The window's requests. */
static kvp_status link_send(const shm_peer *p, int fd, kvpi_slice *const *win, size_t n,
                            uint64_t deadline)
{
    uint8_t buf[WINDOW * KVPI_SHM_REQ_LEN];
    for (size_t j = 0; j < n; j++) {
        kvpi_shm_req_encode(&(kvpi_shm_req){.remote = win[j]->remote,
                                            .length = win[j]->length,
                                            .local = (uint64_t)(uintptr_t)win[j]->local,
                                            .opcode = (uint8_t)win[j]->opcode,
                                            .digest = p->digest},
                            buf + j * KVPI_SHM_REQ_LEN);
    }
    return kvpi_send_all_by(fd, buf, n * KVPI_SHM_REQ_LEN, deadline);
}

/* Integrity: the target's digest after a status, compared with ours of
 * this side's memory now, after the copy: a READ's destination, a WRITE's
 * source (the pass begins once the copy has ended: common/digest.h). */
static kvp_status check_digest(const shm_peer *p, int fd, kvpi_slice *s, uint64_t deadline)
{
    uint8_t d[KVPI_DIGEST_LEN];
    kvp_status st = kvpi_recv_all_by(fd, d, sizeof d, deadline);
    if (st || s->status != KVP_OK) return st;
    if (kvpi_get_le64(d) != kvpi_digest(s->local, s->length))
        s->status = kvpi_error(KVP_ECORRUPT,
                               "shm peer pid %d: %s of [0x%" PRIx64 ", +%zu) arrived corrupted: "
                               "its digest and ours differ (the source changed while it was "
                               "copied)",
                               (int)p->target, s->opcode == KVP_OP_READ ? "READ" : "WRITE",
                               s->remote, s->length);
    return KVP_OK;
}

static kvp_status link_collect(const shm_peer *p, int fd, kvpi_slice *const *win, size_t n,
                               uint64_t deadline)
{
    for (size_t j = 0; j < n; j++) {
        uint8_t s[KVPI_SHM_STATUS_LEN];
        kvp_status remote;
        int err = 0;
        kvp_status st = kvpi_recv_all_by(fd, s, sizeof s, deadline);
        if (!st) st = kvpi_shm_get_status(s, &remote, &err);
        if (st) return st;
        win[j]->status = remote;
        if (p->digest && (st = check_digest(p, fd, win[j], deadline))) return st;
        if (remote == KVP_OK) continue;
        kvpi_error(remote, "shm peer pid %d: %s of [0x%" PRIx64 ", +%zu) failed%s%s",
                   (int)p->target, win[j]->opcode == KVP_OP_READ ? "READ" : "WRITE", win[j]->remote,
                   win[j]->length,
                   remote == KVP_ERANGE ? ": outside its registered memory"
                   : err                ? ": "
                   : remote == KVP_EIO ? ": its copy of its device memory failed (its log says why)"
                                       : "",
                   remote != KVP_ERANGE && err ? strerror(err) : "");
    }
    return KVP_OK;
}

/* The target copies into our memory itself: before a request it gave up
 * completes, tell it (shut our end down: it checks before each copy of
 * KVPI_SHM_COPY_CHUNK) and wait, up to one copy's time at the floor rate,
 * for it to close its end - then nothing of the request lands in the buffer
 * after the completion. A target that does not answer in time is stopped or
 * hung: a copy it had begun has ended (a stopped process is stopped outside
 * its system calls), and it checks again before the next one. */
static void fence(const shm_peer *p, int fd)
{
    if (shutdown(fd, SHUT_WR) != 0) return; /* already gone */
    uint64_t deadline = kvpi_deadline_ns(100 + (int)(KVPI_SHM_COPY_CHUNK * 1000 / p->min_rate));
    uint8_t sink[256];
    for (;;) {
        int left = (int)((deadline - kvpi_now_ns()) / 1000000u);
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (kvpi_now_ns() >= deadline || poll(&pfd, 1, left > 0 ? left : 0) <= 0) break;
        ssize_t k = recv(fd, sink, sizeof sink, MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR)) return; /* closed */
    }
    KVPI_DEBUG("shm peer pid %d: no answer to the fence within its wait (stopped or hung)",
               (int)p->target);
}

/* A link failed: drop it (it reconnects on its next use) and fail every slice
 * not yet answered with the connection-level status. */
static kvp_status link_failed(shm_peer *p, int i, kvp_status st, kvpi_slice *const *slices,
                              size_t n)
{
    kvp_status conn = st == KVP_ETIMEDOUT || st == KVP_ECONNREFUSED ? st : KVP_ECONNRESET;
    KVPI_DEBUG("shm peer @%s: connection failed: %s", p->name, kvp_last_error());
    if (p->fds[i] >= 0 && conn == KVP_ETIMEDOUT) fence(p, p->fds[i]);
    if (p->fds[i] >= 0) close(p->fds[i]); /* ours while busy: no lock needed */
    p->fds[i] = -1;
    for (size_t j = 0; j < n; j++)
        if (slices[j]->status == KVP_EINPROGRESS) slices[j]->status = conn;
    return conn;
}

/* The slices still KVP_EINPROGRESS, WINDOW at a time on link fd. */
static kvp_status link_run(const shm_peer *p, int fd, kvpi_slice *const *slices, size_t n,
                           uint64_t deadline)
{
    kvp_status st = KVP_OK;
    for (size_t next = 0; !st && next < n;) {
        kvpi_slice *win[WINDOW];
        size_t k = 0;
        for (; next < n && k < WINDOW; next++)
            if (slices[next]->status == KVP_EINPROGRESS) win[k++] = slices[next];
        if (k) st = link_send(p, fd, win, k, deadline);
        if (k && !st) st = link_collect(p, fd, win, k, deadline);
    }
    return st;
}

static size_t in_progress(kvpi_slice *const *slices, size_t n)
{
    size_t k = 0;
    for (size_t j = 0; j < n; j++)
        k += slices[j]->status == KVP_EINPROGRESS;
    return k;
}

/* Slices go out WINDOW at a time on one link, their statuses read after. The
 * whole call, waiting for a link included, has one deadline: timeout_ms plus
 * its bytes at min_rate. A link the target closed while it sat idle is
 * replaced once, when nothing was answered on it. */
static kvp_status peer_xfer(void *peer, kvpi_slice *const *slices, size_t n, uint64_t start,
                            uint64_t deadline)
{
    shm_peer *p = peer;
    size_t todo = check_slices(p, slices, n);
    if (todo == 0) return KVP_OK;
    uint64_t bytes = 0;
    for (size_t j = 0; j < n; j++)
        if (slices[j]->status == KVP_EINPROGRESS) bytes += slices[j]->length;
    int l = link_acquire(p, deadline);
    kvp_status st = KVP_OK;
    if (l < 0) {
        st = kvpi_error(KVP_ETIMEDOUT, "no idle connection came free");
    } else {
        int reused = p->fds[l] >= 0;
        if (!reused) st = link_connect(p, deadline, &p->fds[l]);
        if (!st) st = link_run(p, p->fds[l], slices, n, deadline);
        if (st == KVP_ECONNRESET && reused && in_progress(slices, n) == todo) {
            /* An idle link the target had closed (its idle_timeout_ms) and
             * nothing answered: once more on a new link, by the same deadline,
             * as the tcp transport does. */
            KVPI_DEBUG("shm peer @%s: idle link closed by the peer (%s); reconnecting", p->name,
                       kvp_last_error());
            close(p->fds[l]); /* ours while busy: no lock needed */
            p->fds[l] = -1;
            if (p->retries) kvpi_counter_add(p->retries, 1);
            st = link_connect(p, deadline, &p->fds[l]);
            if (!st) st = link_run(p, p->fds[l], slices, n, deadline);
        }
    }
    if (st == KVP_ETIMEDOUT) {
        kvpi_error(st,
                   "shm peer pid %d: %llu bytes (%zu requests) not done within %llu ms "
                   "(timeout_ms %d + the bytes at %llu bytes/s): %s",
                   (int)p->target, (unsigned long long)bytes, n,
                   (unsigned long long)((deadline - start) / 1000000u), p->timeout_ms,
                   (unsigned long long)p->min_rate, kvp_last_error());
    }
    if (l < 0) {
        for (size_t j = 0; j < n; j++)
            if (slices[j]->status == KVP_EINPROGRESS) slices[j]->status = st;
        return st;
    }
    if (st) st = link_failed(p, l, st, slices, n);
    link_release(p, l);
    return st;
}

/* ---- CUDA IPC ---- */

/* Ask the target for the IPC handle of the device allocation that holds
 * [remote, +len), on an idle link (replaced once if the target had closed
 * it). A refusal is the target's status (KVP_ERANGE, KVP_ENOTSUP). */
static kvp_status ipc_request(shm_peer *p, uint64_t remote, uint64_t len, uint64_t deadline,
                              kvpi_shm_ipc *out)
{
    int l = link_acquire(p, deadline);
    if (l < 0)
        return kvpi_error(KVP_ETIMEDOUT, "shm peer @%s: no idle connection came free", p->name);
    uint8_t req[KVPI_SHM_REQ_LEN], status[KVPI_SHM_STATUS_LEN], body[KVPI_SHM_IPC_LEN];
    kvpi_shm_req_encode(
        &(kvpi_shm_req){.remote = remote, .length = len, .opcode = KVPI_SHM_OP_CUDA_IPC}, req);
    kvp_status st = KVP_ECONNRESET, remote_st = KVP_OK;
    int err = 0;
    for (int attempt = 0; attempt < 2 && st == KVP_ECONNRESET; attempt++) {
        if (p->fds[l] < 0 && (st = link_connect(p, deadline, &p->fds[l]))) break;
        st = kvpi_send_all_by(p->fds[l], req, sizeof req, deadline);
        if (!st) st = kvpi_recv_all_by(p->fds[l], status, sizeof status, deadline);
        if (!st) st = kvpi_shm_get_status(status, &remote_st, &err);
        if (!st && remote_st == KVP_OK)
            st = kvpi_recv_all_by(p->fds[l], body, sizeof body, deadline);
        if (st) { /* ours while busy: no lock needed */
            close(p->fds[l]);
            p->fds[l] = -1;
        }
    }
    link_release(p, l);
    if (st) return kvpi_error(st, "shm peer @%s: CUDA IPC request: %s", p->name, kvp_last_error());
    if (remote_st)
        return kvpi_error(
            remote_st,
            "shm peer pid %d has no CUDA IPC handle for [0x%" PRIx64 ", +%" PRIu64 ") (%s)",
            (int)p->target, remote, len,
            remote_st == KVP_ERANGE ? "not registered device memory there" : "its log says why");
    kvpi_shm_ipc_decode(body, out);
    return KVP_OK;
}

/* Is slice s inside its remote region (the engine's index, checked), and is
 * that device memory? */
static int remote_device(const shm_peer *p, const kvpi_slice *s)
{
    return s->remote_region < p->n_regions && p->regions[s->remote_region].kind == KVP_MEM_CUDA &&
           kvpi_regions_contain(&p->regions[s->remote_region], 1, s->remote, s->length);
}

/* Where slice s's remote memory is mapped here, in the primary context of
 * *device, or NULL when it goes the staged way: the target's memory is not
 * device memory, or has no handle, or our driver refuses (logged once per
 * process). Maps the target's allocation at the first slice in it. Host
 * memory of ours uses IPC only once this process uses the driver anyway: a
 * process without device memory of its own gets no CUDA context for it. */
static char *ipc_remote(shm_peer *p, const kvpi_slice *s, uint64_t deadline, int *device)
{
    static atomic_int refusal_logged;
    if (!p->cuda_ipc || !remote_device(p, s) ||
        (s->local_kind == KVP_MEM_HOST && !kvpi_cuda_active()))
        return NULL;
    pthread_mutex_lock(&p->ipc_lock);
    const shm_ipc *e = NULL;
    for (size_t i = 0; i < p->n_ipc && !e; i++)
        if (s->remote >= p->ipc[i].base && s->remote - p->ipc[i].base < p->ipc[i].size)
            e = &p->ipc[i];
    if (!e && !p->ipc_refused && !p->ipc_off[s->remote_region]) {
        kvpi_shm_ipc m;
        int dev = s->local_kind == KVP_MEM_HOST ? 0 : s->local_device;
        shm_ipc *grown = NULL;
        kvp_status st = ipc_request(p, s->remote, s->length, deadline, &m);
        if (!st && (s->remote < m.base || s->remote - m.base >= m.size))
            st = kvpi_error(KVP_EPROTO,
                            "shm peer pid %d answered for [0x%" PRIx64 ", +%" PRIu64
                            ") with another allocation",
                            (int)p->target, m.base, m.size);
        if (st == KVP_ERANGE || st == KVP_ENOTSUP || st == KVP_EPROTO) {
            KVPI_INFO("%s; staging", kvp_last_error());
            p->ipc_off[s->remote_region] = 1;
        } else if (st) {
            KVPI_DEBUG("%s; staging this time", kvp_last_error());
        } else if (!(grown = realloc(p->ipc, (p->n_ipc + 1) * sizeof *p->ipc))) {
            KVPI_DEBUG("shm: out of memory for CUDA IPC; staging this time");
        } else {
            p->ipc = grown;
            shm_ipc *add = &p->ipc[p->n_ipc];
            *add = (shm_ipc){.base = m.base, .size = m.size, .device = dev};
            if ((st = kvpi_cuda_ipc_open(dev, m.handle, (void **)&add->mapped))) {
                if (!atomic_exchange(&refusal_logged, 1))
                    KVPI_WARN("shm peer pid %d: not using CUDA IPC, device memory is staged "
                              "through host memory (logged once): %s",
                              (int)p->target, kvp_last_error());
                p->ipc_refused = 1;
            } else {
                e = &p->ipc[p->n_ipc++];
            }
        }
    }
    char *at = NULL;
    /* A slice that leaves the allocation it starts in is staged. */
    if (e && s->length <= e->size - (s->remote - e->base)) {
        at = e->mapped + (s->remote - e->base);
        *device = e->device;
    }
    pthread_mutex_unlock(&p->ipc_lock);
    return at;
}

/* The run function (the lane stages nothing for it): slices that CUDA IPC
 * serves first, each one copy by our driver between our memory and the
 * target's mapped allocation (no host memory in between for device memory,
 * and the target's CPU not involved); then the others through the target,
 * staged where they are device memory here. A failed copy fails its slice
 * and every one not done with KVP_EIO; the rest is not attempted. */
static kvp_status peer_move(void *peer, kvpi_slice *const *slices, size_t n, uint64_t start,
                            uint64_t deadline)
{
    shm_peer *p = peer;
    size_t k = 0, i = 0;
    if (p->cuda_ipc)
        while (k < n && !remote_device(p, slices[k]))
            k++;
    /* Nothing for IPC (or more slices than an xfer holds, which only unit
     * tests post, of host memory): the target serves all. */
    if (k == n || n > KVPI_XFER_MAX)
        return kvpi_stage_run(peer_xfer, p, slices, n, start, deadline);
    kvpi_slice *rest[KVPI_XFER_MAX];
    kvp_status st = KVP_OK;
    k = 0;
    for (; i < n && !st; i++) {
        kvpi_slice *s = slices[i];
        int device = 0;
        char *remote = NULL;
        if (check_slices(p, &s, 1) == 1) remote = ipc_remote(p, s, deadline, &device);
        if (!remote) {
            rest[k++] = s;
        } else if (kvpi_now_ns() > deadline) {
            st = s->status = kvpi_error(
                KVP_ETIMEDOUT, "shm peer pid %d: CUDA IPC copies not done within %llu ms",
                (int)p->target, (unsigned long long)((deadline - start) / 1000000u));
        } else {
            int read = s->opcode == KVP_OP_READ;
            st = s->status = kvpi_cuda_copy_ipc(device, read ? s->local : remote,
                                                read ? remote : s->local, s->length);
        }
    }
    if (!st) return k ? kvpi_stage_run(peer_xfer, p, rest, k, start, deadline) : KVP_OK;
    /* Not attempted: the slices left for the target, those after the failure. */
    for (size_t j = 0; j < k; j++)
        if (rest[j]->status == KVP_EINPROGRESS) rest[j]->status = st;
    for (; i < n; i++)
        slices[i]->status = st;
    return st;
}

/* CUDA IPC first; device memory it does not serve goes through bounce
 * buffers (kvpi_stage_run in peer_move): the target then copies between its
 * memory and the bounce buffer. */
static void peer_post(void *peer, kvpi_xfer *x)
{
    shm_peer *p = peer;
    kvpi_runner_post(p->runner, peer_move, p, &p->lane, x);
}

static void peer_run(void *peer, kvpi_xfer *x)
{
    shm_peer *p = peer;
    kvpi_runner_run(peer_move, p, &p->lane, x);
}

static void server_cancel(void *server)
{
    kvpi_runner_cancel(kvpi_shm_server_runner(server));
}

const kvpi_transport_ops kvpi_transport_shm = {
    .name = "shm",
    .caps = KVPI_CAP_SAME_HOST | KVPI_CAP_AUTH,
    .mem_kinds = KVPI_MEM_HOST_BIT | KVPI_MEM_BIT(KVP_MEM_CUDA),
    .group_bytes = (size_t)16 << 20,
    .server_start = kvpi_shm_server_start,
    .server_stop = kvpi_shm_server_stop,
    .server_describe = kvpi_shm_server_describe,
    .peer_open = peer_open,
    .peer_post = peer_post,
    .peer_run = peer_run,
    .server_cancel = server_cancel,
    .peer_close = peer_close,
};
