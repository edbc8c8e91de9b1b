/* ucx_close_pending: does UCX complete the RMA requests of an endpoint
 * force-closed while its target is stopped, and if not, what do they do once
 * the target resumes? The question behind the ucx transport's worker per
 * peer (docs/transport-ucx.md, "Known UCX 1.13.1 bugs").
 *
 * Two target processes (forked) each register 256 MiB of their own memory
 * (ucp_mem_map of an mmap'ed range, as kvp_engine_register does) and
 * progress their worker; this process reaches both through ONE worker, as a
 * worker shared by all peers would:
 *   1. issues --requests GETs of --size bytes from target 1, progresses
 *      1 ms, then stops target 1 (SIGSTOP);
 *   2. progresses for --deadline-ms (an xfer's deadline), then force-closes
 *      the endpoint (UCP_EP_CLOSE_FLAG_FORCE, what kvpipe does at a
 *      deadline) and progresses 1 s more: how many GETs completed, how;
 *   3. gives the pending ones up: fills their buffers with a sentinel, as a
 *      caller that got its buffer back would reuse it;
 *   4. reads target 2 through the same worker (does the worker still serve
 *      its other endpoints?), resumes target 1 (SIGCONT) and progresses the
 *      worker for 2 s, as a shared worker must be for its other peers: how
 *      many given-up GETs complete late, and how many sentinel bytes changed.
 * Prints one line per step. UCX_TLS from the environment (sm,self; tcp).
 *
 *   cc -O2 -o /tmp/ucx_close_pending tests/probes/ucx_close_pending.c -lucp -lucs
 *   UCX_TLS=sm,self /tmp/ucx_close_pending --requests 64 --size 4194304
 */
#include <getopt.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define REGION ((size_t)256 << 20)
#define SENTINEL 0xEE

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what, ucs_status_t st)
{
    fprintf(stderr, "ucx_close_pending: %s: %s\n", what, ucs_status_string(st));
    exit(1);
}

static void start(ucp_context_h *ctx, ucp_worker_h *w)
{
    /* As kvpipe's context: peer error handling on shared memory, 1 s
     * keepalive. */
    setenv("UCX_MM_ERROR_HANDLING", "y", 0);
    setenv("UCX_KEEPALIVE_INTERVAL", "1s", 0);
    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
    ucs_status_t st = ucp_init(&cp, NULL, ctx);
    if (st != UCS_OK) die("ucp_init", st);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((st = ucp_worker_create(*ctx, &wp, w)) != UCS_OK) die("ucp_worker_create", st);
}

typedef struct target {
    pid_t pid;
    int fd;
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    uint64_t remote;
    int failed;
} target;

static void serve(int fd, int fill)
{
    ucp_context_h ctx;
    ucp_worker_h w;
    start(&ctx, &w);
    void *buf = mmap(NULL, REGION, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (buf == MAP_FAILED) exit(1);
    memset(buf, fill, REGION);
    ucp_mem_map_params_t mp = {.field_mask =
                                   UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = buf,
                               .length = REGION};
    ucp_mem_h memh;
    ucs_status_t st = ucp_mem_map(ctx, &mp, &memh);
    if (st != UCS_OK) die("ucp_mem_map", st);
    void *rkey;
    size_t rkey_len, addr_len;
    ucp_address_t *addr;
    if ((st = ucp_rkey_pack(ctx, memh, &rkey, &rkey_len)) != UCS_OK) die("ucp_rkey_pack", st);
    if ((st = ucp_worker_get_address(w, &addr, &addr_len)) != UCS_OK) die("address", st);
    uint64_t where = (uint64_t)(uintptr_t)buf, n1 = addr_len, n2 = rkey_len;
    if (write(fd, &n1, 8) != 8 || write(fd, addr, addr_len) != (ssize_t)addr_len ||
        write(fd, &n2, 8) != 8 || write(fd, rkey, rkey_len) != (ssize_t)rkey_len ||
        write(fd, &where, 8) != 8)
        exit(1);
    for (;;)
        ucp_worker_progress(w);
}

static void *recv_blob(int fd, uint64_t *n)
{
    if (read(fd, n, 8) != 8 || *n > (1u << 20)) return NULL;
    char *p = malloc(*n);
    for (uint64_t got = 0; p && got < *n;) {
        ssize_t k = read(fd, p + got, *n - got);
        if (k <= 0) return NULL;
        got += (uint64_t)k;
    }
    return p;
}

static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)ep;
    target *t = arg;
    t->failed = 1;
    fprintf(stderr, "  (endpoint of target %d failed: %s)\n", (int)t->pid, ucs_status_string(st));
}

/* Fork a target (before this process starts UCX). */
static void spawn(target *t, int fill)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) exit(1);
    if ((t->pid = fork()) == 0) {
        close(sv[0]);
        serve(sv[1], fill);
    }
    close(sv[1]);
    t->fd = sv[0];
}

static void connect_to(ucp_worker_h w, target *t)
{
    uint64_t n;
    void *addr = recv_blob(t->fd, &n), *rkey = addr ? recv_blob(t->fd, &n) : NULL;
    if (!rkey || read(t->fd, &t->remote, 8) != 8) exit(1);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_failed, .arg = t}};
    ucs_status_t st = ucp_ep_create(w, &ep, &t->ep);
    if (st != UCS_OK) die("ucp_ep_create", st);
    if ((st = ucp_ep_rkey_unpack(t->ep, rkey, &t->rkey)) != UCS_OK) die("rkey_unpack", st);
    free(addr);
    free(rkey);
}

typedef struct get {
    int done;
    int given_up;
    int late; /* completed after it was given up */
    ucs_status_t status;
} get;

static void get_done(void *request, ucs_status_t st, void *user_data)
{
    get *g = user_data;
    g->done = 1;
    g->status = st;
    g->late = g->given_up;
    ucp_request_free(request);
}

static void progress_for(ucp_worker_h w, double seconds)
{
    for (double end = now() + seconds; now() < end;)
        ucp_worker_progress(w);
}

static int count(const get *g, int n, int what)
{
    int c = 0;
    for (int i = 0; i < n; i++)
        c += what == 0 ? g[i].done : what == 1 ? g[i].done && g[i].status == UCS_OK : g[i].late;
    return c;
}

static ucs_status_t read_sync(ucp_worker_h w, target *t, void *into, size_t len)
{
    ucp_request_param_t prm = {0};
    ucs_status_ptr_t r = ucp_get_nbx(t->ep, into, len, t->remote, t->rkey, &prm);
    if (!UCS_PTR_IS_PTR(r)) return UCS_PTR_STATUS(r);
    ucs_status_t st;
    double end = now() + 5;
    while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS && now() < end)
        ucp_worker_progress(w);
    if (st != UCS_INPROGRESS) ucp_request_free(r);
    return st;
}

int main(int argc, char **argv)
{
    int n = 64, deadline_ms = 1500;
    size_t size = (size_t)4 << 20;
    static const struct option longs[] = {{"requests", required_argument, NULL, 'n'},
                                          {"size", required_argument, NULL, 's'},
                                          {"deadline-ms", required_argument, NULL, 'd'},
                                          {NULL, 0, NULL, 0}};
    for (int c; (c = getopt_long(argc, argv, "", longs, NULL)) != -1;) {
        if (c == 'n')
            n = atoi(optarg);
        else if (c == 's')
            size = strtoull(optarg, NULL, 0);
        else if (c == 'd')
            deadline_ms = atoi(optarg);
        else
            return 2;
    }
    if (n < 1 || size == 0 || (size_t)n * size > REGION) {
        fprintf(stderr, "ucx_close_pending: --requests x --size must fit in 256 MiB\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    target t1 = {0}, t2 = {0};
    spawn(&t1, 0x5a);
    spawn(&t2, 0x33);
    ucp_context_h ctx;
    ucp_worker_h w;
    start(&ctx, &w);
    connect_to(w, &t1);
    connect_to(w, &t2);
    char *local = mmap(NULL, REGION, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (local == MAP_FAILED) return 1;
    /* Warm both endpoints. */
    if (read_sync(w, &t1, local, 4096) != UCS_OK || read_sync(w, &t2, local, 4096) != UCS_OK) {
        fprintf(stderr, "ucx_close_pending: the warm-up read failed\n");
        return 1;
    }
    printf("UCX %s, UCX_TLS=%s: %d GETs of %zu bytes, one worker for both targets\n",
           ucp_get_version_string(), getenv("UCX_TLS") ? getenv("UCX_TLS") : "all", n, size);
    get *g = calloc((size_t)n, sizeof *g);
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = get_done};
    for (int i = 0; i < n; i++) {
        prm.user_data = &g[i];
        ucs_status_ptr_t r = ucp_get_nbx(t1.ep, local + (size_t)i * size, size,
                                         t1.remote + (size_t)i * size, t1.rkey, &prm);
        if (!UCS_PTR_IS_PTR(r)) g[i] = (get){.done = 1, .status = UCS_PTR_STATUS(r)};
    }
    progress_for(w, 0.001);
    kill(t1.pid, SIGSTOP);
    progress_for(w, deadline_ms / 1000.0);
    printf("1. target 1 stopped: %d of %d completed by the deadline (%d ms)\n", count(g, n, 0), n,
           deadline_ms);
    ucp_request_param_t cl = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t close_req = ucp_ep_close_nbx(t1.ep, &cl);
    progress_for(w, 1.0);
    int done = count(g, n, 0);
    printf("2. endpoint force-closed, 1 s of progress: %d of %d completed (%d OK), %d still "
           "pending; the close request %s\n",
           done, n, count(g, n, 1), n - done,
           !UCS_PTR_IS_PTR(close_req)                              ? "completed at once"
           : ucp_request_check_status(close_req) == UCS_INPROGRESS ? "is pending"
                                                                   : "completed");
    size_t given = 0;
    for (int i = 0; i < n; i++)
        if (!g[i].done) {
            g[i].given_up = 1;
            memset(local + (size_t)i * size, SENTINEL, size);
            given++;
        }
    printf("3. gave %zu pending GETs up: their buffers hold the sentinel\n", given);
    char *other = malloc(1 << 20);
    ucs_status_t st2 = read_sync(w, &t2, other, 1 << 20);
    printf("4. target 2 through the same worker meanwhile: %s\n", ucs_status_string(st2));
    kill(t1.pid, SIGCONT);
    progress_for(w, 2.0);
    size_t changed = 0;
    for (int i = 0; i < n; i++)
        if (g[i].given_up)
            for (size_t b = 0; b < size; b++)
                changed += (unsigned char)local[(size_t)i * size + b] != SENTINEL;
    st2 = read_sync(w, &t2, other, 1 << 20);
    printf("5. target 1 resumed, 2 s of progress: %d given-up GETs completed late, %zu bytes of "
           "their buffers changed after they were given up; target 2 then: %s\n",
           count(g, n, 2), changed, ucs_status_string(st2));
    kill(t1.pid, SIGKILL);
    kill(t2.pid, SIGKILL);
    waitpid(t1.pid, NULL, 0);
    waitpid(t2.pid, NULL, 0);
    _exit(0); /* not destroying a worker with requests UCX still holds */
}
