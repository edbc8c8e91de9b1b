/* The ucx transport's runtime (runtime.h): the UCP context, the workers
 * and their lock, manual progress and the thread that drives it when no
 * waiter does, the devices, start and stop.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <sodium.h>
#include <uct/api/uct.h>

#define KVPI_LOG_SUBSYS "ucx"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "transport/ucx/runtime.h"

/* Progress calls per worker per round of the thread. */
#define ROUNDS 64
/* After its last work the thread keeps progressing this long, yielding the
 * CPU between rounds, before it sleeps: a stream of requests (the target's
 * side of UCX's emulated RMA above all) is then served without a wake-up
 * each. Without it, WRITEs of 1 MiB 32 per batch to registered memory over
 * UCX's shared memory moved 0.1 GB/s instead of 0.7 here. */
#define SPIN_NS (1000 * 1000)
#define DEFAULT_TIMEOUT_MS 5000
/* The end of a message saying why the ucx transport cannot run here. */
#define TCP_HINT                                                                                   \
    "; protocol 'rdma' (and 'ucx') cannot run here: to run over TCP, ask for protocol 'tcp' (in "  \
    "a "                                                                                           \
    "mooncake config file: \"protocol\": \"tcp\") or set MC_FORCE_TCP=1"

/* ---- small helpers ---- */

kvp_status kvpi_ucx_status(ucs_status_t st)
{
    switch (st) {
    case UCS_OK:
        return KVP_OK;
    case UCS_ERR_NO_MEMORY:
        return KVP_ENOMEM;
    case UCS_ERR_TIMED_OUT:
        return KVP_ETIMEDOUT;
    case UCS_ERR_CANCELED:
        return KVP_ECANCELED;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
        return KVP_ECONNREFUSED;
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_IO_ERROR:
        return KVP_ECONNRESET;
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_NO_RESOURCE:
        return KVP_ENOTSUP;
    default:
        return KVP_EIO;
    }
}

char *kvpi_ucx_hex(const void *bytes, size_t n)
{
    char *s = malloc(2 * n + 1);
    if (s) sodium_bin2hex(s, 2 * n + 1, bytes, n);
    return s;
}

kvp_status kvpi_ucx_unhex(const char *text, void **out, size_t *n)
{
    size_t len = strlen(text), got;
    uint8_t *b = len && len % 2 == 0 ? malloc(len / 2) : NULL;
    if (b && sodium_hex2bin(b, len / 2, text, len, NULL, &got, NULL) == 0 && got == len / 2) {
        *out = b;
        *n = got;
        return KVP_OK;
    }
    free(b);
    return len && len % 2 == 0 && !b ? KVP_ENOMEM : KVP_EPROTO;
}

static void sent(void *request, ucs_status_t st, void *user_data)
{
    (void)st;
    free(user_data);
    ucp_request_free(request);
}

kvp_status kvpi_ucx_am_send(ucp_ep_h ep, unsigned id, const void *bytes, size_t len, uint32_t flags)
{
    void *copy = malloc(len);
    if (!copy) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    memcpy(copy, bytes, len);
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = flags,
                               .cb.send = sent,
                               .user_data = copy};
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, NULL, 0, copy, len, &prm);
    if (UCS_PTR_IS_PTR(r)) return KVP_OK; /* sent() frees both */
    free(copy);
    ucs_status_t st = UCS_PTR_STATUS(r);
    if (st == UCS_OK) return KVP_OK;
    return kvpi_error(kvpi_ucx_status(st), "ucx: cannot send a control message: %s",
                      ucs_status_string(st));
}

void kvpi_ucx_ep_close_force(ucp_ep_h ep)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &prm);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
}

kvp_status kvpi_ucx_set_handler(ucp_worker_h w, unsigned id, ucp_am_recv_callback_t cb, void *arg)
{
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = id,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = cb,
        .arg = arg};
    ucs_status_t st = ucp_worker_set_am_recv_handler(w, &hp);
    if (st != UCS_OK)
        return kvpi_error(kvpi_ucx_status(st), "ucx: ucp_worker_set_am_recv_handler: %s",
                          ucs_status_string(st));
    return KVP_OK;
}

kvp_status kvpi_ucx_worker_create(kvpi_ucx_rt *rt, ucp_worker_h *out)
{
    /* One thread at a time (runtime.h), not always the same one. */
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t st = ucp_worker_create(rt->ctx, &wp, out);
    if (st != UCS_OK)
        return kvpi_error(kvpi_ucx_status(st), "ucx: ucp_worker_create: %s", ucs_status_string(st));
    return KVP_OK;
}

/* ---- the workers ---- */

/* Wake the thread (to arm a new worker, or to stop). */
static void wake(kvpi_ucx_rt *rt)
{
    uint64_t one = 1;
    if (write(rt->evfd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVPI_WARN("ucx: cannot wake the progress thread: %s", strerror(errno));
}

kvp_status kvpi_ucx_poller_add(kvpi_ucx_rt *rt, kvpi_ucx_poller *p)
{
    ucs_status_t st = ucp_worker_get_efd(p->worker, &p->efd);
    if (st != UCS_OK)
        return kvpi_error(kvpi_ucx_status(st), "ucx: ucp_worker_get_efd: %s",
                          ucs_status_string(st));
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = p};
    if (epoll_ctl(rt->epfd, EPOLL_CTL_ADD, p->efd, &ev) != 0)
        return kvpi_error(KVP_EIO, "ucx: epoll_ctl: %s", strerror(errno));
    p->next = rt->pollers;
    rt->pollers = p;
    p->listed = 1;
    wake(rt); /* a sleeper armed the others, not this one */
    return KVP_OK;
}

void kvpi_ucx_inflight_add(kvpi_ucx_rt *rt)
{
    if (atomic_fetch_add(&rt->inflight, 1) == 0 && atomic_load(&rt->sleeping)) wake(rt);
}

void kvpi_ucx_poller_remove(kvpi_ucx_rt *rt, kvpi_ucx_poller *p)
{
    for (kvpi_ucx_poller **pp = &rt->pollers; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            p->listed = 0;
            epoll_ctl(rt->epfd, EPOLL_CTL_DEL, p->efd, NULL);
            return;
        }
}

/* ---- progress ---- */

static unsigned drain(ucp_worker_h w, unsigned budget)
{
    unsigned n = 0, did;
    for (unsigned i = 0; i < budget && (did = ucp_worker_progress(w)) != 0; i++)
        n += did;
    return n;
}

unsigned kvpi_ucx_progress(void *server, unsigned budget)
{
    kvpi_ucx_rt *rt = server;
    unsigned did = 0;
    if (pthread_mutex_trylock(&rt->lock) != 0) return 0; /* another thread progresses */
    for (kvpi_ucx_poller *p = rt->pollers, *next; p; p = next) {
        next = p->next; /* a service may remove its own */
        did += drain(p->worker, budget);
        did += p->service(p);
    }
    kvpi_ucx_unlock(rt);
    return did;
}

unsigned kvpi_ucx_progress_one(kvpi_ucx_rt *rt, kvpi_ucx_poller *p, unsigned budget)
{
    unsigned did = 0;
    if (pthread_mutex_trylock(&rt->lock) != 0) return 0;
    /* Removed meanwhile: another thread froze it, and completed (or is
     * about to complete) what its caller waits for. */
    for (unsigned i = 0; p->listed && i < budget && !did; i++)
        did = ucp_worker_progress(p->worker);
    if (!did && p->listed) did = p->service(p); /* idle: what came due */
    kvpi_ucx_unlock(rt);
    return did;
}

void kvpi_ucx_defer(kvpi_ucx_rt *rt, kvpi_ucx_later *l)
{
    l->next = NULL;
    *rt->later_tail = l;
    rt->later_tail = &l->next;
}

void kvpi_ucx_unlock(kvpi_ucx_rt *rt)
{
    kvpi_ucx_later *l = rt->later;
    rt->later = NULL;
    rt->later_tail = &rt->later;
    pthread_mutex_unlock(&rt->lock);
    for (kvpi_ucx_later *next; l; l = next) {
        next = l->next; /* run may free l */
        l->run(l);
    }
}

int kvpi_ucx_wait_fd(void *server)
{
    kvpi_ucx_rt *rt = server;
    if (atomic_load(&rt->inflight) > 0) return KVPI_WAIT_FD_NONE; /* the thread polls */
    int busy = 0;
    pthread_mutex_lock(&rt->lock);
    for (kvpi_ucx_poller *p = rt->pollers; p && !busy; p = p->next)
        busy = ucp_worker_arm(p->worker) == UCS_ERR_BUSY;
    pthread_mutex_unlock(&rt->lock);
    return busy ? -1 : rt->epfd;
}

/* Drive progress while there is any, while requests are in flight and
 * SPIN_NS after the last work; then sleep on the workers' events and the
 * wake-up, KVPI_UCX_TICK_MS at most. */
static void *progress_main(void *arg)
{
    kvpi_ucx_rt *rt = arg;
    uint64_t active = kvpi_now_ns();
    while (!atomic_load(&rt->stop)) {
        uint64_t now = kvpi_now_ns();
        if (kvpi_ucx_progress(rt, ROUNDS)) {
            active = now;
            continue;
        }
        if (now - active < SPIN_NS || atomic_load(&rt->inflight) > 0) {
            sched_yield();
            continue;
        }
        atomic_store(&rt->sleeping, 1); /* before inflight is read again: no wake is lost */
        if (atomic_load(&rt->inflight) == 0 && kvpi_ucx_wait_fd(rt) >= 0) {
            struct pollfd fds[2] = {{.fd = rt->epfd, .events = POLLIN},
                                    {.fd = rt->evfd, .events = POLLIN}};
            uint64_t v;
            if (poll(fds, 2, KVPI_UCX_TICK_MS) > 0 && fds[1].revents &&
                read(rt->evfd, &v, sizeof v) < 0 && errno != EAGAIN)
                KVPI_WARN("ucx: progress thread: read: %s", strerror(errno));
        }
        atomic_store(&rt->sleeping, 0);
    }
    return NULL;
}

/* ---- devices ---- */

typedef struct dev_list {
    char **names;
    size_t n, cap;
} dev_list;

static int dev_add(dev_list *l, const char *name)
{
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->names[i], name) == 0) return 0;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        char **grown = realloc(l->names, cap * sizeof *grown);
        if (!grown) return -1;
        l->names = grown;
        l->cap = cap;
    }
    return (l->names[l->n] = strdup(name)) ? (l->n++, 0) : -1;
}

static void dev_free(dev_list *l)
{
    for (size_t i = 0; i < l->n; i++)
        free(l->names[i]);
    free(l->names);
}

/* The network devices UCX's transports find here ("mlx5_0:1", "eth0"). */
static kvp_status net_devices(dev_list *out)
{
    uct_component_h *comps;
    unsigned n_comps;
    ucs_status_t st = uct_query_components(&comps, &n_comps);
    if (st != UCS_OK)
        return kvpi_error(KVP_ENOTSUP, "ucx: uct_query_components: %s", ucs_status_string(st));
    kvp_status ret = KVP_OK;
    for (unsigned c = 0; c < n_comps && !ret; c++) {
        uct_component_attr_t a = {.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT};
        if (uct_component_query(comps[c], &a) != UCS_OK || !a.md_resource_count) continue;
        uct_md_resource_desc_t *mds = calloc(a.md_resource_count, sizeof *mds);
        if (!mds) {
            ret = kvpi_error(KVP_ENOMEM, "ucx: out of memory");
            break;
        }
        a.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
        a.md_resources = mds;
        unsigned n_mds = uct_component_query(comps[c], &a) == UCS_OK ? a.md_resource_count : 0;
        for (unsigned m = 0; m < n_mds && !ret; m++) {
            uct_md_config_t *cfg;
            uct_md_h md;
            if (uct_md_config_read(comps[c], NULL, NULL, &cfg) != UCS_OK) continue;
            st = uct_md_open(comps[c], mds[m].md_name, cfg, &md);
            uct_config_release(cfg);
            if (st != UCS_OK) continue;
            uct_tl_resource_desc_t *tls;
            unsigned n_tls;
            if (uct_md_query_tl_resources(md, &tls, &n_tls) == UCS_OK) {
                for (unsigned t = 0; t < n_tls && !ret; t++)
                    if (tls[t].dev_type == UCT_DEVICE_TYPE_NET && dev_add(out, tls[t].dev_name))
                        ret = kvpi_error(KVP_ENOMEM, "ucx: out of memory");
                uct_release_tl_resource_list(tls);
            }
            uct_md_close(md);
        }
        free(mds);
    }
    uct_release_component_list(comps);
    return ret;
}

/* UCX_NET_DEVICES for device_name: each name (Mooncake's, an RDMA device
 * like "mlx5_0", or a network interface) is taken as UCX spells it where it
 * exists, else as every port of that device ("mlx5_0:1"). */
static kvp_status map_devices(const char *names, char **out)
{
    dev_list have = {0}, want = {0};
    kvp_status st = net_devices(&have);
    char *copy = strdup(names), *save = NULL;
    if (!st && !copy) st = kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    for (char *tok = st ? NULL : strtok_r(copy, ", ", &save); tok && !st;
         tok = strtok_r(NULL, ", ", &save)) {
        size_t found = 0, len = strlen(tok);
        for (size_t i = 0; i < have.n && !st; i++) {
            const char *d = have.names[i];
            if (strcmp(d, tok) == 0 || (strncmp(d, tok, len) == 0 && d[len] == ':')) {
                found++;
                if (dev_add(&want, d)) st = kvpi_error(KVP_ENOMEM, "ucx: out of memory");
            }
        }
        if (!found && !st) {
            char list[512] = "";
            for (size_t i = 0, used = 0; i < have.n && used < sizeof list; i++)
                used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "",
                                         have.names[i]);
            st = kvpi_error(KVP_ENOTSUP,
                            "ucx: device '%s' (device_name) is not a network device "
                            "UCX finds here (it finds: %s)" TCP_HINT,
                            tok, have.n ? list : "none");
        }
    }
    size_t total = 1;
    for (size_t i = 0; i < want.n; i++)
        total += strlen(want.names[i]) + 1;
    char *joined = st ? NULL : calloc(1, total);
    if (!st && !joined) st = kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    for (size_t i = 0; joined && i < want.n; i++) {
        if (i) strcat(joined, ",");
        strcat(joined, want.names[i]);
    }
    free(copy);
    dev_free(&have);
    dev_free(&want);
    if (!st) *out = joined;
    return st;
}

/* ---- start and stop ---- */

static kvp_status config_set(ucp_config_t *cfg, const char *name, const char *value)
{
    ucs_status_t st = ucp_config_modify(cfg, name, value);
    if (st != UCS_OK)
        return kvpi_error(KVP_ENOTSUP, "ucx: cannot set %s=%s: %s", name, value,
                          ucs_status_string(st));
    return KVP_OK;
}

/* Might UCX_TLS let UCX use its shared-memory transports? */
static int may_use_mm(void)
{
    static const char *const mm[] = {"all", "sm", "shm", "mm", "posix", "sysv"};
    const char *tls = getenv("UCX_TLS");
    if (!tls || tls[0] == '^') return 1;
    for (size_t i = 0; i < sizeof mm / sizeof mm[0]; i++)
        if (strstr(tls, mm[i])) return 1;
    return 0;
}

/* UCX's configuration: its environment (UCX_*), plus what kvpipe needs
 * where the environment says nothing:
 *  - peer failure handling on the shared-memory transports (posix, sysv):
 *    off in UCX 1.13, and without it UCP refuses them for endpoints that
 *    handle peer failure, as every endpoint here does;
 *  - keepalive every second (UCX: 20 s), so that a dead same-host peer fails
 *    its endpoint well within an engine's deadline;
 *  - the devices, from device_name. */
static kvp_status configure(const kvpi_server_ctx *ctx, ucp_config_t *cfg)
{
    kvp_status st = KVP_OK;
    if (may_use_mm() && !getenv("UCX_POSIX_ERROR_HANDLING") && !getenv("UCX_SYSV_ERROR_HANDLING") &&
        !getenv("UCX_MM_ERROR_HANDLING"))
        st = config_set(cfg, "MM_ERROR_HANDLING", "y");
    if (!st && !getenv("UCX_KEEPALIVE_INTERVAL")) st = config_set(cfg, "KEEPALIVE_INTERVAL", "1s");
    if (st || !ctx->device_names || !*ctx->device_names) return st;
    if (getenv("UCX_NET_DEVICES")) {
        KVPI_INFO("ucx %s: UCX_NET_DEVICES=%s is set: device_name '%s' is not used", ctx->segment,
                  getenv("UCX_NET_DEVICES"), ctx->device_names);
        return KVP_OK;
    }
    char *devices;
    if ((st = map_devices(ctx->device_names, &devices))) return st;
    KVPI_INFO("ucx %s: device_name '%s': UCX_NET_DEVICES=%s", ctx->segment, ctx->device_names,
              devices);
    st = config_set(cfg, "NET_DEVICES", devices);
    free(devices);
    return st;
}

static kvp_status start_context(kvpi_ucx_rt *rt, const kvpi_server_ctx *ctx)
{
    ucp_config_t *cfg;
    ucs_status_t ust = ucp_config_read(NULL, NULL, &cfg);
    if (ust != UCS_OK)
        return kvpi_error(KVP_ENOTSUP, "ucx: ucp_config_read: %s", ucs_status_string(ust));
    kvp_status st = configure(ctx, cfg);
    if (!st) {
        ucp_params_t p = {.field_mask =
                              UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                          .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                          .mt_workers_shared = 1};
        if ((ust = ucp_init(&p, cfg, &rt->ctx)) != UCS_OK) {
            rt->ctx = NULL;
            st = kvpi_error(KVP_ENOTSUP, "ucx: UCX cannot start here (UCX_TLS=%s): %s" TCP_HINT,
                            getenv("UCX_TLS") ? getenv("UCX_TLS") : "all", ucs_status_string(ust));
        }
    }
    ucp_config_release(cfg);
    return st;
}

static kvp_status start_worker(kvpi_ucx_rt *rt)
{
    kvp_status st = kvpi_ucx_worker_create(rt, &rt->target.worker);
    if (st) {
        rt->target.worker = NULL;
        return st;
    }
    ucp_address_t *addr;
    size_t len;
    ucs_status_t ust = ucp_worker_get_address(rt->target.worker, &addr, &len);
    if (ust != UCS_OK)
        return kvpi_error(kvpi_ucx_status(ust), "ucx: ucp_worker_get_address: %s",
                          ucs_status_string(ust));
    rt->worker_hex = kvpi_ucx_hex(addr, len);
    ucp_worker_release_address(rt->target.worker, addr);
    if (!rt->worker_hex) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    if ((rt->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
        (rt->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
        return kvpi_error(KVP_EIO, "ucx: epoll/eventfd: %s", strerror(errno));
    return kvpi_ucx_poller_add(rt, &rt->target);
}

kvp_status kvpi_ucx_rt_start(kvpi_ucx_rt *rt, const kvpi_server_ctx *ctx,
                             unsigned (*target_service)(kvpi_ucx_poller *))
{
    rt->epfd = rt->evfd = -1;
    rt->later_tail = &rt->later;
    pthread_mutex_init(&rt->lock, NULL);
    atomic_init(&rt->stop, 0);
    atomic_init(&rt->inflight, 0);
    atomic_init(&rt->sleeping, 0);
    rt->timeout_ms = ctx->timeout_ms > 0 ? ctx->timeout_ms : DEFAULT_TIMEOUT_MS;
    rt->auth = ctx->auth;
    rt->target.service = target_service;
    if (!(rt->segment = strdup(ctx->segment ? ctx->segment : "")))
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    if (kvpi_shm_host_id(rt->host_id, sizeof rt->host_id)) rt->host_id[0] = '\0';
    kvp_status st = start_context(rt, ctx);
    return st ? st : start_worker(rt);
}

kvp_status kvpi_ucx_rt_run(kvpi_ucx_rt *rt)
{
    int rc = pthread_create(&rt->thread, NULL, progress_main, rt);
    if (rc != 0) return kvpi_error(KVP_EIO, "ucx: cannot start a thread: %s", strerror(rc));
    rt->thread_started = 1;
    KVPI_INFO("ucx %s: serving (UCX %s, UCX_TLS=%s%s)", rt->segment, ucp_get_version_string(),
              getenv("UCX_TLS") ? getenv("UCX_TLS") : "all", rt->auth ? ", authenticated" : "");
    return KVP_OK;
}

void kvpi_ucx_rt_halt(kvpi_ucx_rt *rt)
{
    if (!rt->thread_started) return;
    atomic_store(&rt->stop, 1);
    wake(rt);
    pthread_join(rt->thread, NULL);
    rt->thread_started = 0;
}

void kvpi_ucx_rt_free(kvpi_ucx_rt *rt)
{
    /* Every peer was closed before, and what used the target's worker. */
    if (rt->target.worker) {
        drain(rt->target.worker, ROUNDS);
        ucp_worker_destroy(rt->target.worker);
    }
    if (rt->ctx) ucp_cleanup(rt->ctx);
    if (rt->epfd >= 0) close(rt->epfd);
    if (rt->evfd >= 0) close(rt->evfd);
    pthread_mutex_destroy(&rt->lock);
    free(rt->worker_hex);
    free(rt->segment);
}
