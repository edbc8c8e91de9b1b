/* The ucx transport's engine-wide runtime: the UCP context, the progress
 * thread that owns every worker and serves the target's (its connections,
 * registrations and descriptor fields are ucx_target.c's), the hand-offs of
 * work to that thread, the devices, start and stop. ucx_server.h holds the
 * state both files share.
 */
#include <errno.h>
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

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "transport/ucx/runtime.h"

/* After its last piece of work the progress thread keeps polling this long
 * (yielding the CPU between rounds) before it sleeps on the workers' event
 * descriptors, so that a stream of requests is served without a wake-up
 * each. */
#define SPIN_NS (1000 * 1000)
/* Progress calls per worker per round of the thread. */
#define ROUNDS 64
/* The thread's longest sleep, so that failed connections are reaped. */
#define SLEEP_MS 1000
/* A pollee a caller let go of this recently is not armed before a sleep,
 * which then lasts this long at most (sleep_once). */
#define DRIVEN_NS (10 * 1000 * 1000)
#define DRIVEN_SLEEP_MS 2
/* How long a retired worker's closing endpoint may take. */
#define CLOSE_MS 1000
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

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

kvp_status kvpi_ucx_unhex(const char *text, void **out, size_t *n)
{
    size_t len = strlen(text);
    if (len == 0 || len % 2) return KVP_EPROTO;
    uint8_t *b = malloc(len / 2);
    if (!b) return KVP_ENOMEM;
    for (size_t i = 0; i < len / 2; i++) {
        int hi = hexval(text[2 * i]), lo = hexval(text[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            free(b);
            return KVP_EPROTO;
        }
        b[i] = (uint8_t)(hi << 4 | lo);
    }
    *out = b;
    *n = len / 2;
    return KVP_OK;
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

kvp_status kvpi_ucx_worker_create(kvpi_ucx_server *s, ucp_worker_h *out)
{
    /* One thread at a time (ucx_internal.h), not always the same one. */
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    ucs_status_t st = ucp_worker_create(s->ctx, &wp, out);
    if (st != UCS_OK)
        return kvpi_error(kvpi_ucx_status(st), "ucx: ucp_worker_create: %s", ucs_status_string(st));
    return KVP_OK;
}

/* ---- handing work to the progress thread ---- */

/* Wake the thread if wake; called after the queue lock was let go. */
static void wake_if(kvpi_ucx_server *s, int wake)
{
    uint64_t one = 1;
    if (wake && write(s->evfd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVPI_WARN("ucx: cannot wake the progress thread: %s", strerror(errno));
}

/* Under the queue lock: is the thread asleep? It is not, after this. */
static int rouse(kvpi_ucx_server *s)
{
    int wake = s->sleeping;
    s->sleeping = 0;
    return wake;
}

void kvpi_ucx_submit(kvpi_ucx_server *s, kvpi_ucx_cmd *cmd)
{
    cmd->next = NULL;
    pthread_mutex_lock(&s->queue_lock);
    *s->queue_tail = cmd;
    s->queue_tail = &cmd->next;
    int wake = rouse(s);
    pthread_mutex_unlock(&s->queue_lock);
    wake_if(s, wake);
}

void kvpi_ucx_post(kvpi_ucx_server *s, kvpi_ucx_pollee *p, kvpi_ucx_cmd *cmd)
{
    cmd->next = NULL;
    pthread_mutex_lock(&s->queue_lock);
    *p->pending_tail = cmd;
    p->pending_tail = &cmd->next;
    atomic_fetch_add(&p->npending, 1);
    int wake = rouse(s);
    pthread_mutex_unlock(&s->queue_lock);
    wake_if(s, wake);
}

/* Run a detached list of commands; returns how many. */
static unsigned run_cmds(kvpi_ucx_server *s, kvpi_ucx_cmd *cmd)
{
    unsigned n = 0;
    for (kvpi_ucx_cmd *next; cmd; cmd = next, n++) {
        next = cmd->next; /* run may free cmd */
        cmd->run(s, cmd);
    }
    return n;
}

unsigned kvpi_ucx_run_posted(kvpi_ucx_server *s, kvpi_ucx_pollee *p)
{
    if (atomic_load_explicit(&p->npending, memory_order_relaxed) == 0) return 0;
    pthread_mutex_lock(&s->queue_lock);
    kvpi_ucx_cmd *cmd = p->pending;
    p->pending = NULL;
    p->pending_tail = &p->pending;
    atomic_store(&p->npending, 0);
    pthread_mutex_unlock(&s->queue_lock);
    return run_cmds(s, cmd);
}

void kvpi_ucx_let_go(kvpi_ucx_server *s, kvpi_ucx_pollee *p, int more)
{
    pthread_mutex_lock(&s->queue_lock);
    atomic_store_explicit(&p->driven_ns, kvpi_now_ns(), memory_order_relaxed);
    int wake = (more || p->pending) && rouse(s);
    pthread_mutex_unlock(&s->queue_lock);
    wake_if(s, wake);
}

void kvpi_ucx_pollee_init(kvpi_ucx_pollee *p)
{
    pthread_mutex_init(&p->lock, NULL);
    p->pending = NULL;
    p->pending_tail = &p->pending;
    atomic_init(&p->npending, 0);
    atomic_init(&p->driven_ns, 0);
    atomic_init(&p->by_progress, 0);
    atomic_init(&p->frozen, 0);
}

void kvpi_ucx_pollee_destroy(kvpi_ucx_pollee *p)
{
    pthread_mutex_destroy(&p->lock);
}

typedef struct ucx_call {
    kvpi_ucx_cmd cmd; /* first */
    void (*fn)(kvpi_ucx_server *s, void *arg);
    void *arg;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int done;
} ucx_call;

static void call_run(kvpi_ucx_server *s, kvpi_ucx_cmd *cmd)
{
    ucx_call *c = (ucx_call *)cmd;
    c->fn(s, c->arg);
    pthread_mutex_lock(&c->lock);
    c->done = 1;
    pthread_cond_signal(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

void kvpi_ucx_call(kvpi_ucx_server *s, void (*fn)(kvpi_ucx_server *s, void *arg), void *arg)
{
    /* The thread runs each command in a bounded time (UCP calls that do not
     * block), so the wait is bounded too. */
    ucx_call c = {.cmd = {.run = call_run}, .fn = fn, .arg = arg};
    pthread_mutex_init(&c.lock, NULL);
    pthread_cond_init(&c.cond, NULL);
    kvpi_ucx_submit(s, &c.cmd);
    pthread_mutex_lock(&c.lock);
    while (!c.done)
        pthread_cond_wait(&c.cond, &c.lock);
    pthread_mutex_unlock(&c.lock);
    pthread_cond_destroy(&c.cond);
    pthread_mutex_destroy(&c.lock);
}

void kvpi_ucx_busy_add(kvpi_ucx_server *s, long n)
{
    s->busy += n;
}

kvp_status kvpi_ucx_poll_add(kvpi_ucx_server *s, kvpi_ucx_pollee *p)
{
    ucs_status_t st = ucp_worker_get_efd(p->worker, &p->efd);
    if (st != UCS_OK)
        return kvpi_error(kvpi_ucx_status(st), "ucx: ucp_worker_get_efd: %s",
                          ucs_status_string(st));
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = p};
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, p->efd, &ev) != 0)
        return kvpi_error(KVP_EIO, "ucx: epoll_ctl: %s", strerror(errno));
    p->watched = 1;
    p->next = s->pollees;
    s->pollees = p;
    return KVP_OK;
}

void kvpi_ucx_poll_remove(kvpi_ucx_server *s, kvpi_ucx_pollee *p)
{
    for (kvpi_ucx_pollee **pp = &s->pollees; *pp; pp = &(*pp)->next)
        if (*pp == p) {
            *pp = p->next;
            epoll_ctl(s->epfd, EPOLL_CTL_DEL, p->efd, NULL);
            return;
        }
}

void kvpi_ucx_retire(kvpi_ucx_server *s, ucp_worker_h w, void *req, void (*done)(void *arg),
                     void *arg)
{
    ucx_retiree *r = calloc(1, sizeof *r);
    if (!r) {
        /* No room to wait: end it now. */
        if (req) ucp_request_free(req);
        ucp_worker_destroy(w);
        if (done) done(arg);
        return;
    }
    *r = (ucx_retiree){.next = s->retirees,
                       .worker = w,
                       .req = req,
                       .deadline = kvpi_deadline_ns(CLOSE_MS),
                       .done = done,
                       .arg = arg};
    s->retirees = r;
}

/* ---- the progress thread ---- */

static unsigned drain(ucp_worker_h w)
{
    unsigned n = 0, did;
    for (int i = 0; i < ROUNDS && (did = ucp_worker_progress(w)) != 0; i++)
        n += did;
    return n;
}

static unsigned run_queue(kvpi_ucx_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    kvpi_ucx_cmd *cmd = s->queue;
    s->queue = NULL;
    s->queue_tail = &s->queue;
    pthread_mutex_unlock(&s->queue_lock);
    return run_cmds(s, cmd);
}

static void retiree_end(ucx_retiree *r)
{
    if (r->req) ucp_request_free(r->req);
    ucp_worker_destroy(r->worker);
    if (r->done) r->done(r->arg);
    free(r);
}

static unsigned serve_retirees(kvpi_ucx_server *s)
{
    unsigned n = 0;
    for (ucx_retiree **pr = &s->retirees; *pr;) {
        ucx_retiree *r = *pr;
        n += drain(r->worker);
        if (r->req && ucp_request_check_status(r->req) == UCS_INPROGRESS &&
            kvpi_now_ns() < r->deadline) {
            pr = &r->next;
            continue;
        }
        *pr = r->next;
        retiree_end(r);
        n++;
    }
    return n;
}

/* Close the endpoints of failed connections and forget them. */
/* Have the sleep wake on p's event descriptor, or not. */
static void watch(kvpi_ucx_server *s, kvpi_ucx_pollee *p, int on)
{
    if (p->watched == on) return;
    struct epoll_event ev = {.events = on ? EPOLLIN : 0, .data.ptr = p};
    if (epoll_ctl(s->epfd, EPOLL_CTL_MOD, p->efd, &ev) == 0) p->watched = on;
}

/* Arm every worker and sleep until one has an event, work is queued, or
 * SLEEP_MS passed. A pollee that a caller holds, or let go of within
 * DRIVEN_NS, is not armed (a caller streaming requests on it would wake us
 * at each one): the sleep is then DRIVEN_SLEEP_MS at most, after which it is
 * served, and armed, once idle. */
static void sleep_once(kvpi_ucx_server *s)
{
    int busy = ucp_worker_arm(s->worker) == UCS_ERR_BUSY, driven = 0;
    uint64_t now = kvpi_now_ns();
    pthread_mutex_lock(&s->queue_lock);
    for (kvpi_ucx_pollee *p = s->pollees; p; p = p->next) {
        if (atomic_load(&p->frozen)) {
            watch(s, p, 0);
            continue;
        }
        busy |= p->pending != NULL;
        if (now - atomic_load_explicit(&p->driven_ns, memory_order_relaxed) < DRIVEN_NS ||
            pthread_mutex_trylock(&p->lock) != 0) {
            driven = 1;
            /* Unarmed, its descriptor may stay readable: not watched. */
            watch(s, p, 0);
            continue;
        }
        busy |= p->busy || ucp_worker_arm(p->worker) == UCS_ERR_BUSY;
        pthread_mutex_unlock(&p->lock);
        watch(s, p, 1);
    }
    busy |= s->queue != NULL || s->stop;
    s->sleeping = !busy;
    pthread_mutex_unlock(&s->queue_lock);
    if (busy) return;
    struct epoll_event ev[8];
    int n = epoll_wait(s->epfd, ev, 8, driven ? DRIVEN_SLEEP_MS : SLEEP_MS);
    for (int i = 0; i < n; i++) {
        uint64_t v;
        if (ev[i].data.ptr == NULL && read(s->evfd, &v, sizeof v) < 0 && errno != EAGAIN)
            KVPI_WARN("ucx: progress thread: read: %s", strerror(errno));
    }
    pthread_mutex_lock(&s->queue_lock);
    s->sleeping = 0;
    pthread_mutex_unlock(&s->queue_lock);
}

/* One round on each pollee no caller holds: what was posted, progress, its
 * service. *busy is set where one has requests in flight. */
static unsigned serve_pollees(kvpi_ucx_server *s, int *busy)
{
    unsigned did = 0;
    for (kvpi_ucx_pollee *p = s->pollees; p; p = p->next) {
        if (atomic_load(&p->frozen)) continue;
        if (pthread_mutex_trylock(&p->lock) != 0) continue; /* a caller leads it */
        atomic_store_explicit(&p->by_progress, 1, memory_order_relaxed);
        did += kvpi_ucx_run_posted(s, p);
        did += drain(p->worker);
        did += p->service(s, p);
        *busy |= p->busy;
        atomic_store_explicit(&p->by_progress, 0, memory_order_relaxed);
        pthread_mutex_unlock(&p->lock);
    }
    return did;
}

static int stopping(kvpi_ucx_server *s)
{
    pthread_mutex_lock(&s->queue_lock);
    int stop = s->stop && !s->queue;
    pthread_mutex_unlock(&s->queue_lock);
    return stop;
}

static void *progress_main(void *arg)
{
    kvpi_ucx_server *s = arg;
    uint64_t idle_since = kvpi_now_ns();
    while (!stopping(s)) {
        int busy = 0;
        /* Work as a target (and commands) keeps the thread polling for
         * SPIN_NS; a peer's worker, only while requests are in flight on it
         * (a caller leads it otherwise, or nobody waits). */
        unsigned did = run_queue(s) + drain(s->worker);
        did += serve_retirees(s) + kvpi_ucx_reap(s) + kvpi_ucx_expire_challenges(s);
        unsigned peers = serve_pollees(s, &busy);
        uint64_t now = kvpi_now_ns();
        if (did) {
            idle_since = now;
        } else if (peers || busy || s->busy > 0 || s->retirees || now - idle_since < SPIN_NS) {
            /* Waiting on a peer: let other threads have the CPU meanwhile. */
            sched_yield();
        } else {
            /* Woken, it spins again only once it found work. */
            sleep_once(s);
        }
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

static kvp_status start_context(kvpi_ucx_server *s, const kvpi_server_ctx *ctx)
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
        if ((ust = ucp_init(&p, cfg, &s->ctx)) != UCS_OK) {
            s->ctx = NULL;
            st = kvpi_error(KVP_ENOTSUP, "ucx: UCX cannot start here (UCX_TLS=%s): %s" TCP_HINT,
                            getenv("UCX_TLS") ? getenv("UCX_TLS") : "all", ucs_status_string(ust));
        }
    }
    ucp_config_release(cfg);
    return st;
}

static kvp_status start_worker(kvpi_ucx_server *s)
{
    kvp_status st = kvpi_ucx_worker_create(s, &s->worker);
    if (st) {
        s->worker = NULL;
        return st;
    }
    ucp_address_t *addr;
    size_t len;
    ucs_status_t ust = ucp_worker_get_address(s->worker, &addr, &len);
    if (ust != UCS_OK)
        return kvpi_error(kvpi_ucx_status(ust), "ucx: ucp_worker_get_address: %s",
                          ucs_status_string(ust));
    s->worker_hex = kvpi_ucx_hex(addr, len);
    ucp_worker_release_address(s->worker, addr);
    if (!s->worker_hex) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    return kvpi_ucx_target_handlers(s);
}

/* The worker is created here, then only the progress thread touches it. */
static kvp_status start_thread(kvpi_ucx_server *s)
{
    int wefd;
    ucs_status_t ust = ucp_worker_get_efd(s->worker, &wefd);
    if (ust != UCS_OK)
        return kvpi_error(kvpi_ucx_status(ust), "ucx: ucp_worker_get_efd: %s",
                          ucs_status_string(ust));
    if ((s->epfd = epoll_create1(EPOLL_CLOEXEC)) < 0 ||
        (s->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
        return kvpi_error(KVP_EIO, "ucx: epoll/eventfd: %s", strerror(errno));
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    struct epoll_event wev = {.events = EPOLLIN, .data.ptr = s};
    if (epoll_ctl(s->epfd, EPOLL_CTL_ADD, s->evfd, &ev) != 0 ||
        epoll_ctl(s->epfd, EPOLL_CTL_ADD, wefd, &wev) != 0)
        return kvpi_error(KVP_EIO, "ucx: epoll_ctl: %s", strerror(errno));
    int rc = pthread_create(&s->thread, NULL, progress_main, s);
    if (rc != 0) return kvpi_error(KVP_EIO, "ucx: cannot start a thread: %s", strerror(rc));
    s->thread_started = 1;
    return KVP_OK;
}

kvp_status kvpi_ucx_server_start(const kvpi_server_ctx *ctx, void **server)
{
    kvpi_ucx_server *s = calloc(1, sizeof *s);
    if (!s) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    s->epfd = s->evfd = -1;
    s->queue_tail = &s->queue;
    pthread_mutex_init(&s->queue_lock, NULL);
    pthread_mutex_init(&s->conns_lock, NULL);
    pthread_mutex_init(&s->dereg_lock, NULL);
    pthread_mutex_init(&s->chunks_lock, NULL);
    kvpi_cond_init(&s->conns_cond);
    s->timeout_ms = ctx->timeout_ms > 0 ? ctx->timeout_ms : DEFAULT_TIMEOUT_MS;
    s->auth = ctx->auth;
    s->max_chals = ctx->max_conns > 0 ? ctx->max_conns : KVPI_UCX_CHALLENGES_DEFAULT;
    kvp_status st = KVP_OK;
    if (!(s->segment = strdup(ctx->segment ? ctx->segment : "")))
        st = kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    if (!st && kvpi_shm_host_id(s->host_id, sizeof s->host_id)) s->host_id[0] = '\0';
    if (!st) st = start_context(s, ctx);
    if (!st) st = start_worker(s);
    if (!st) st = start_thread(s);
    if (st) {
        kvpi_ucx_server_stop(s);
        return st;
    }
    KVPI_INFO("ucx %s: serving (UCX %s, UCX_TLS=%s%s)", s->segment, ucp_get_version_string(),
              getenv("UCX_TLS") ? getenv("UCX_TLS") : "all", s->auth ? ", authenticated" : "");
    *server = s;
    return KVP_OK;
}

void kvpi_ucx_server_stop(void *server)
{
    kvpi_ucx_server *s = server;
    if (!s) return;
    if (s->thread_started) {
        pthread_mutex_lock(&s->queue_lock);
        s->stop = 1;
        pthread_mutex_unlock(&s->queue_lock);
        uint64_t one = 1;
        if (write(s->evfd, &one, sizeof one) < 0)
            KVPI_WARN("ucx: cannot wake the progress thread: %s", strerror(errno));
        pthread_join(s->thread, NULL);
    }
    /* The thread is gone: this one owns the workers now. Every peer was
     * closed and every region deregistered before; what is left are the
     * connections from initiators and workers still closing. */
    kvpi_ucx_target_close(s);
    while (s->retirees) {
        ucx_retiree *r = s->retirees;
        s->retirees = r->next;
        retiree_end(r);
    }
    if (s->worker) {
        drain(s->worker);
        ucp_worker_destroy(s->worker);
    }
    if (s->ctx) ucp_cleanup(s->ctx);
    if (s->epfd >= 0) close(s->epfd);
    if (s->evfd >= 0) close(s->evfd);
    pthread_cond_destroy(&s->conns_cond);
    pthread_mutex_destroy(&s->chunks_lock);
    pthread_mutex_destroy(&s->dereg_lock);
    pthread_mutex_destroy(&s->conns_lock);
    pthread_mutex_destroy(&s->queue_lock);
    free(s->worker_hex);
    free(s->segment);
    free(s);
}
