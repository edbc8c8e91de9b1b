/* The child-process peer's core and its engine target (peer.h). */
#include "peer.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/net.h"
#include "metadata/metadata.h"
#include "transport/shm_internal.h"
#include "test.h"

/* ================================================================ core === */

static void capture_path(kvpt_peer *p, const char *capture)
{
    static int n;
    p->err[0] = '\0';
    if (capture && capture[0] == '/')
        snprintf(p->err, sizeof p->err, "%s", capture);
    else if (capture)
        snprintf(p->err, sizeof p->err, "/tmp/kvpt_%s_%d_%d.err", capture, (int)getpid(), n++);
}

/* In the child: stderr to the peer's file, and die with the case. */
static void child_setup(const kvpt_peer *p)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (p->err[0]) {
        int fd = open(p->err, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd >= 0) {
            dup2(fd, STDERR_FILENO);
            close(fd);
        }
    }
}

static int open_channel(kvpt_peer *p, int c[2], int r[2])
{
    p->stuck = 0;
    if (pipe2(c, O_CLOEXEC)) return -1;
    if (pipe2(r, O_CLOEXEC) == 0) return 0;
    close(c[0]), close(c[1]);
    return -1;
}

int kvpt_peer_fork(kvpt_peer *p, const char *capture, kvpt_peer_body body, void *arg)
{
    int c[2], r[2];
    if (kvpt_fork_alone("kvpt_peer_fork") != 0) return -1;
    capture_path(p, capture);
    if (open_channel(p, c, r)) return -1;
    fflush(NULL);
    p->pid = fork();
    if (p->pid == 0) {
        child_setup(p);
        close(c[1]);
        close(r[0]);
        kvpt_failures = 0;
        body(arg, c[0], r[1]);
        fflush(NULL);
        _exit(kvpt_failures ? 1 : 0);
    }
    close(c[0]);
    close(r[1]);
    p->cmd = c[1];
    p->resp = r[0];
    return p->pid > 0 ? 0 : -1;
}

#define PEER_ENV "KVPT_PEER" /* "kind cmd resp err-path" in an exec'd peer */

static struct {
    const char *kind;
    kvpt_peer_main fn;
} kinds[8];

void kvpt_peer_register(const char *kind, kvpt_peer_main fn)
{
    size_t i = 0;
    while (i < sizeof kinds / sizeof kinds[0] && kinds[i].kind)
        i++;
    if (i == sizeof kinds / sizeof kinds[0]) abort();
    kinds[i].kind = kind;
    kinds[i].fn = fn;
    const char *spec = getenv(PEER_ENV);
    char k[32];
    int cmd, resp;
    if (!spec || sscanf(spec, "%31s %d %d", k, &cmd, &resp) != 3 || strcmp(k, kind) != 0) return;
    /* This process is that peer: it runs now, before main. */
    unsetenv(PEER_ENV);
    kvpt_failures = 0;
    fn(cmd, resp);
    fflush(NULL);
    _exit(kvpt_failures ? 1 : 0);
}

int kvpt_peer_exec(kvpt_peer *p, const char *capture, const char *kind, char *const env[],
                   const int keep[])
{
    extern char **environ;
    char exe[4096];
    ssize_t exe_len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (exe_len <= 0) return -1;
    exe[exe_len] = '\0';
    int c[2], r[2];
    capture_path(p, capture);
    if (open_channel(p, c, r)) return -1;
    /* The peer's own variables, then ours but those it sets. */
    size_t n = 0, mine = 0;
    while (environ[n])
        n++;
    while (env && env[mine])
        mine++;
    char **all = calloc(n + mine + 2, sizeof *all);
    char spec[128];
    snprintf(spec, sizeof spec, "%s=%s %d %d", PEER_ENV, kind, c[0], r[1]);
    size_t k = 0;
    if (all) {
        all[k++] = spec;
        for (size_t i = 0; i < mine; i++)
            all[k++] = env[i];
        for (size_t i = 0; i < n; i++) {
            size_t eq = strcspn(environ[i], "=");
            int shadowed = strncmp(environ[i], PEER_ENV "=", strlen(PEER_ENV) + 1) == 0;
            for (size_t j = 0; j < mine && !shadowed; j++)
                shadowed = strncmp(env[j], environ[i], eq + 1) == 0;
            if (!shadowed) all[k++] = environ[i];
        }
    }
    fflush(NULL);
    p->pid = all ? fork() : -1;
    if (p->pid == 0) {
        child_setup(p);
        fcntl(c[0], F_SETFD, 0);
        fcntl(r[1], F_SETFD, 0);
        for (size_t i = 0; keep && keep[i] >= 0; i++)
            fcntl(keep[i], F_SETFD, 0);
        char *argv[] = {exe, NULL};
        execve(exe, argv, all);
        perror(exe);
        _exit(127);
    }
    free(all);
    close(c[0]);
    close(r[1]);
    p->cmd = c[1];
    p->resp = r[0];
    return p->pid > 0 ? 0 : -1;
}

int kvpt_read_full(int fd, void *buf, size_t len, int timeout_ms)
{
    char *q = buf;
    uint64_t deadline = kvpi_now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    while (len) {
        if (timeout_ms >= 0) {
            uint64_t now = kvpi_now_ms();
            struct pollfd pf = {.fd = fd, .events = POLLIN};
            int rc = now < deadline ? poll(&pf, 1, (int)(deadline - now)) : 0;
            if (rc < 0 && errno == EINTR) continue;
            if (rc <= 0) return -1;
        }
        ssize_t got = read(fd, q, len);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        q += got;
        len -= (size_t)got;
    }
    return 0;
}

int kvpt_peer_next(int cmd, kvpt_cmd *c)
{
    return kvpt_read_full(cmd, c, sizeof *c, -1);
}

int kvpt_peer_answer(int resp, int64_t value)
{
    return write(resp, &value, sizeof value) == (ssize_t)sizeof value ? 0 : -1;
}

int kvpt_peer_send(kvpt_peer *p, const void *buf, size_t len)
{
    if (p->stuck) return -1;
    return write(p->cmd, buf, len) == (ssize_t)len ? 0 : -1;
}

int kvpt_peer_recv(kvpt_peer *p, void *buf, size_t len, int timeout_ms)
{
    if (p->stuck) return -1;
    if (kvpt_read_full(p->resp, buf, len, timeout_ms) == 0) return 0;
    fprintf(stderr, "  peer %d: no answer within %d ms\n", (int)p->pid, timeout_ms);
    p->stuck = 1;
    return -1;
}

int64_t kvpt_peer_call(kvpt_peer *p, int op, uint64_t a, uint64_t b, uint64_t c, int timeout_ms)
{
    kvpt_cmd cmd = {op, a, b, c};
    int64_t r = -1;
    if (kvpt_peer_send(p, &cmd, sizeof cmd) || kvpt_peer_recv(p, &r, sizeof r, timeout_ms)) {
        fprintf(stderr, "  peer %d: command '%c' not answered\n", (int)p->pid, op);
        return -1;
    }
    return r;
}

int kvpt_peer_wait(kvpt_peer *p, int timeout_ms)
{
    if (p->cmd >= 0) close(p->cmd);
    p->cmd = -1;
    int rc = kvpt_wait_child(p->pid, p->stuck ? 1000 : timeout_ms);
    if (p->resp >= 0) close(p->resp);
    p->resp = -1;
    return rc;
}

void kvpt_peer_kill(kvpt_peer *p)
{
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    kvpt_peer_wait(p, 0);
}

int kvpt_peer_said(const kvpt_peer *p, const char *text)
{
    return p->err[0] ? kvpt_file_lines(p->err, text) : -1;
}

void kvpt_peer_show(const kvpt_peer *p, const char *who)
{
    if (p->err[0]) kvpt_file_show(p->err, who);
}

void kvpt_peer_forget(kvpt_peer *p)
{
    FILE *f = p->err[0] ? fopen(p->err, "r") : NULL;
    if (!f) return;
    char line[4096];
    while (fgets(line, sizeof line, f))
        fputs(line, stderr);
    fclose(f);
    unlink(p->err);
    p->err[0] = '\0';
}

int kvpt_chan_init(kvpt_chan *c)
{
    return pipe(c->fd);
}

void kvpt_step(kvpt_chan *c, char step)
{
    if (write(c->fd[1], &step, 1) != 1) kvpt_failures++;
}

char kvpt_wait_step(kvpt_chan *c, int timeout_ms)
{
    char step = 0;
    return kvpt_read_full(c->fd[0], &step, 1, timeout_ms) == 0 ? step : 0;
}

/* ======================================================= engine target === */

/* The target child is a fresh exec of the test program (kvpt_peer_exec): the
 * test may run threads already (an initiator engine). It maps the buffer (a
 * memfd) at the parent's address, so that the test's view of the buffer and
 * the address peers use stay one. */
#define T_ENV "KVPT_TARGET" /* "mem_fd addr len" and the numeric options */
#define T_ENV_NAME "KVPT_TARGET_NAME"
#define T_ENV_META "KVPT_TARGET_METADATA"
#define T_ENV_PROTO "KVPT_TARGET_PROTOCOL" /* "": the default */
#define T_ENV_KEY "KVPT_TARGET_KEY"        /* unset: the environment's */
/* The child's exit status when the parent's address is taken in it. */
#define ADDR_TAKEN_EXIT 7
#define ADDR_TRIES 4
#define START_MS 20000

static int64_t timed_ms(uint64_t t0)
{
    return (int64_t)((kvpi_now_ns() - t0) / 1000000u);
}

/* [a, +len) holds kvpt_fill(seed)? As KVPT_T_CHECK answers; memory in
 * [dev, +dev_len) is read through the CUDA double fc. */
static int64_t check(uint64_t a, size_t len, uint64_t seed, const kvpt_fakecuda *fc, uint64_t dev,
                     size_t dev_len)
{
    void *p = (void *)(uintptr_t)a, *copy = NULL;
    if (dev_len && a >= dev && a - dev <= dev_len && len <= dev_len - (a - dev)) {
        if (!(copy = malloc(len)) || fc->peek(copy, p, len) != 0) {
            free(copy);
            return -1;
        }
        p = copy;
    }
    size_t bad = kvpt_verify(p, len, seed);
    free(copy);
    return bad == (size_t)-1 ? -2 : (int64_t)bad;
}

static int64_t target_do(kvp_engine *e, kvpt_target *t, const kvpt_cmd *c)
{
    static void *pool; /* the last KVPT_T_POOL buffer */
    static kvpt_fakecuda fc;
    static uint64_t dev; /* the KVPT_T_DEVICE region */
    static size_t dev_len;
    uint64_t t0 = kvpi_now_ns();
    switch (c->op) {
    case KVPT_T_REGISTER: {
        void *p = malloc(c->a);
        if (!p || kvp_engine_register(e, p, c->a) != KVP_OK) return -1;
        return timed_ms(t0); /* the region stays registered until the child exits */
    }
    case KVPT_T_NEW: {
        char *p =
            mmap(NULL, c->a + c->c, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return -1;
        kvpt_fill(p + c->c, c->a, c->b);
        if (kvp_engine_register(e, p + c->c, c->a) != KVP_OK) return -1;
        return (int64_t)(uintptr_t)(p + c->c);
    }
    case KVPT_T_ALLOC: {
        void *p;
        return kvp_engine_alloc(e, c->a, &p) == KVP_OK ? timed_ms(t0) : -1;
    }
    case KVPT_T_POOL: {
        void *p;
        if (kvp_engine_alloc(e, c->a, &p) != KVP_OK) return -1;
        kvpt_fill(p, c->a, c->a); /* the pattern's seed is the length */
        pool = p;
        return (int64_t)(uintptr_t)p;
    }
    case KVPT_T_POOL_FREE:
        if (!pool || kvp_engine_free(e, pool) != KVP_OK) return -1;
        pool = NULL;
        return timed_ms(t0);
    case KVPT_T_UNREGISTER: {
        void *at = c->a ? (void *)(uintptr_t)c->a : t->buf;
        return kvp_engine_unregister(e, at) == KVP_OK ? timed_ms(t0) : -1;
    }
    case KVPT_T_REREGISTER:
        if (kvp_engine_unregister(e, t->buf) != KVP_OK) return -1;
        kvpt_fill(t->buf, t->len, c->a);
        return kvp_engine_register(e, t->buf, t->len) == KVP_OK ? 0 : -1;
    case KVPT_T_UNMAP:
        return munmap(t->buf, t->len) == 0 ? 0 : -1;
    case KVPT_T_FDS:
        return kvpt_count_fds();
    case KVPT_T_CHECK:
        return check(c->a, c->b, c->c, &fc, dev, dev_len);
    case KVPT_T_DEVICE: {
        const char *lib = getenv("KVPIPE_LIBCUDA");
        if (!lib || dev_len) return -1;
        kvpt_fakecuda_load(&fc, lib);
        char *ref = malloc(c->a);
        void *p = fc.alloc(1, c->a);
        int ok = ref && p;
        if (ok) kvpt_fill(ref, c->a, c->b);
        ok = ok && fc.poke(p, ref, c->a) == 0 && kvp_engine_register(e, p, c->a) == KVP_OK;
        free(ref);
        if (!ok) return -1;
        dev = (uint64_t)(uintptr_t)p;
        dev_len = c->a;
        return (int64_t)dev;
    }
    default:
        return -1;
    }
}

typedef struct target_spec {
    int mem_fd, disable_shm, timeout_ms, idle_timeout_ms, max_connections, nofile;
    uint64_t addr, len, min_transfer_rate, pool_retain_bytes;
} target_spec;

static void target_main(int cmd, int resp)
{
    signal(SIGPIPE, SIG_IGN);
    target_spec s;
    const char *spec = getenv(T_ENV);
    if (!spec ||
        sscanf(spec, "%d %" SCNx64 " %" SCNu64 " %d %d %d %d %d %" SCNu64 " %" SCNu64, &s.mem_fd,
               &s.addr, &s.len, &s.disable_shm, &s.timeout_ms, &s.idle_timeout_ms,
               &s.max_connections, &s.nofile, &s.min_transfer_rate, &s.pool_retain_bytes) != 10) {
        fprintf(stderr, "target: bad %s '%s'\n", T_ENV, spec ? spec : "");
        _exit(2);
    }
    kvpt_target t = {.len = s.len};
    t.buf = mmap((void *)(uintptr_t)s.addr, s.len, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED_NOREPLACE, s.mem_fd, 0);
    if (t.buf != (void *)(uintptr_t)s.addr) {
        /* Something of ours landed there (address layout is random): the
         * parent tries another address. */
        int taken = t.buf == MAP_FAILED && errno == EEXIST;
        perror("target: mapping the buffer at the parent's address");
        _exit(taken ? ADDR_TAKEN_EXIT : 6);
    }
    close(s.mem_fd);
    if (s.nofile) {
        struct rlimit rl;
        getrlimit(RLIMIT_NOFILE, &rl);
        rl.rlim_cur = (rlim_t)s.nofile;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(2);
    }
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = getenv(T_ENV_NAME);
    eo.metadata = getenv(T_ENV_META);
    const char *proto = getenv(T_ENV_PROTO);
    if (proto && *proto) eo.protocol = proto;
    eo.disable_shm = s.disable_shm;
    if (s.timeout_ms) eo.timeout_ms = s.timeout_ms;
    if (s.idle_timeout_ms) eo.idle_timeout_ms = s.idle_timeout_ms;
    if (s.max_connections) eo.max_connections = s.max_connections;
    if (s.min_transfer_rate) eo.min_transfer_rate = s.min_transfer_rate;
    if (s.pool_retain_bytes) eo.pool_retain_bytes = s.pool_retain_bytes;
    eo.auth_key_file = getenv(T_ENV_KEY);
    kvp_engine *e;
    if (kvp_engine_create(&eo, &e) != KVP_OK) {
        fprintf(stderr, "target: engine: %s\n", kvp_last_error());
        _exit(3);
    }
    if (kvp_engine_register(e, t.buf, t.len) != KVP_OK) {
        fprintf(stderr, "target: register: %s\n", kvp_last_error());
        _exit(4);
    }
    if (kvpt_peer_answer(resp, kvp_engine_data_port(e))) _exit(5);
    kvpt_cmd c;
    while (kvpt_peer_next(cmd, &c) == 0)
        if (kvpt_peer_answer(resp, target_do(e, &t, &c))) break;
    kvp_engine_destroy(e);
    _exit(0);
}
KVPT_PEER_KIND("target", target_main)

/* Map the memfd and start the child on it; 0 once it serves, else the
 * child's exit status (ADDR_TAKEN_EXIT: try another address), or -1. */
static int spawn_at(const kvpt_target_opts *o, kvpt_target *t, int mem_fd)
{
    t->buf = mmap(NULL, o->len, PROT_READ | PROT_WRITE, MAP_SHARED, mem_fd, 0);
    if (t->buf == MAP_FAILED) return -1;
    char *env[6] = {NULL};
    int ok = asprintf(&env[0], "%s=%d %" PRIx64 " %zu %d %d %d %d %d %" PRIu64 " %zu", T_ENV,
                      mem_fd, (uint64_t)(uintptr_t)t->buf, o->len, o->disable_shm, o->timeout_ms,
                      o->idle_timeout_ms, o->max_connections, o->nofile, o->min_transfer_rate,
                      o->pool_retain_bytes) > 0;
    ok = ok && asprintf(&env[1], "%s=%s", T_ENV_NAME, t->name) > 0;
    ok = ok &&
         asprintf(&env[2], "%s=%s", T_ENV_META, o->metadata ? o->metadata : "P2PHANDSHAKE") > 0;
    ok = ok && asprintf(&env[3], "%s=%s", T_ENV_PROTO, o->protocol ? o->protocol : "") > 0;
    if (ok && o->auth_key_file) ok = asprintf(&env[4], "%s=%s", T_ENV_KEY, o->auth_key_file) > 0;
    int keep[] = {mem_fd, -1};
    int rc = ok ? kvpt_peer_exec(&t->peer, o->capture ? "target" : NULL, "target", env, keep) : -1;
    for (size_t i = 0; i < 5; i++)
        free(env[i]);
    if (rc) return -1;
    t->pid = t->peer.pid;
    int64_t port = 0;
    if (kvpt_read_full(t->peer.resp, &port, sizeof port, START_MS) == 0) {
        t->data_port = (int)port;
        return 0;
    }
    rc = kvpt_peer_wait(&t->peer, 5000);
    return rc ? rc : -1;
}

int kvpt_target_start(const kvpt_target_opts *o, kvpt_target *t)
{
    memset(t, 0, sizeof *t);
    t->len = o->len;
    t->rpc_port = o->port ? o->port : kvpt_free_port();
    snprintf(t->name, sizeof t->name, "127.0.0.1:%d", t->rpc_port);
    int mem_fd = memfd_create("kvpt-target", MFD_CLOEXEC);
    if (mem_fd < 0 || ftruncate(mem_fd, (off_t)o->len) != 0) return -1;
    void *fill = mmap(NULL, o->len, PROT_READ | PROT_WRITE, MAP_SHARED, mem_fd, 0);
    if (fill == MAP_FAILED) return -1;
    kvpt_fill(fill, o->len, o->seed);
    munmap(fill, o->len);
    /* A mapping whose address the child had taken stays mapped here until
     * the end, so that the next try gets another address. */
    void *taken[ADDR_TRIES];
    int n_taken = 0, rc;
    while ((rc = spawn_at(o, t, mem_fd)) == ADDR_TAKEN_EXIT && n_taken + 1 < ADDR_TRIES)
        taken[n_taken++] = t->buf;
    for (int i = 0; i < n_taken; i++)
        munmap(taken[i], o->len);
    close(mem_fd);
    if (rc != 0 && t->buf != MAP_FAILED) munmap(t->buf, o->len);
    if (rc != 0 && t->peer.err[0]) {
        FILE *f = fopen(t->peer.err, "r");
        size_t n = f ? fread(t->said, 1, sizeof t->said - 1, f) : 0;
        t->said[n] = '\0';
        if (f) fclose(f);
        kvpt_peer_forget(&t->peer);
    }
    return rc == 0 ? 0 : -1;
}

int64_t kvpt_target_cmd(kvpt_target *t, int op, uint64_t a, int timeout_ms)
{
    return kvpt_peer_call(&t->peer, op, a, 0, 0, timeout_ms);
}

int kvpt_target_shm_socket(const kvpt_target *t, const kvpi_auth *a, char *name, size_t len)
{
    char *reply = NULL;
    if (kvpi_rpc_call_auth("127.0.0.1", t->rpc_port, a, KVPI_RPC_METADATA, "{}", 10000, &reply) !=
        KVP_OK)
        return -1;
    cJSON *doc = cJSON_Parse(reply);
    free(reply);
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(doc, KVPI_SHM_FIELD);
    const cJSON *sock = cJSON_GetObjectItemCaseSensitive(o, "socket");
    int rc = cJSON_IsString(sock) ? 0 : -1;
    if (!rc) snprintf(name, len, "%s", sock->valuestring);
    cJSON_Delete(doc);
    return rc;
}

int64_t kvpt_target_cpu_ms(const kvpt_target *t)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)t->pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long long ut = 0, st = 0;
    /* After ')': state, then fields 4..13, then utime (14) and stime (15). */
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (int64_t)((ut + st) * 1000 / (unsigned long long)sysconf(_SC_CLK_TCK));
}

int kvpt_target_stop(kvpt_target *t, int keep_buffer)
{
    int rc = kvpt_peer_wait(&t->peer, 20000);
    if (!keep_buffer) munmap(t->buf, t->len);
    return rc;
}

void kvpt_target_kill(kvpt_target *t)
{
    kvpt_peer_kill(&t->peer);
}

void kvpt_engine_opts(kvp_engine_opts *o, char name[64])
{
    snprintf(name, 64, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine_opts_init(o);
    o->local_server_name = name;
    o->metadata = "P2PHANDSHAKE";
}

kvp_engine *kvpt_engine_create(const kvp_engine_opts *o)
{
    kvp_engine *e = NULL;
    if (kvp_engine_create(o, &e) != KVP_OK) {
        fprintf(stderr, "  engine %s: %s\n", o->local_server_name, kvp_last_error());
        return NULL;
    }
    return e;
}

int kvpt_initiator_start(const char *metadata, const char *protocol, int disable_shm,
                         int timeout_ms, kvp_engine **out)
{
    char name[64];
    kvp_engine_opts eo;
    kvpt_engine_opts(&eo, name);
    if (metadata) eo.metadata = metadata;
    if (protocol) eo.protocol = protocol;
    eo.disable_shm = disable_shm;
    if (timeout_ms) eo.timeout_ms = timeout_ms;
    *out = kvpt_engine_create(&eo);
    return *out ? 0 : -1;
}

/* ---- the authenticated mode ---- */

char kvpt_key1[64], kvpt_key2[64];

void kvpt_key_file(char *path, size_t len, const char *text, unsigned mode)
{
    snprintf(path, len, "/tmp/kvpt_auth_%d_XXXXXX", (int)getpid());
    int fd = mkstemp(path);
    if (fd < 0) return;
    if (write(fd, text, strlen(text)) != (ssize_t)strlen(text)) kvpt_failures++;
    fchmod(fd, (mode_t)mode);
    close(fd);
}

void kvpt_keys_make(void)
{
    kvpt_key_file(kvpt_key1, sizeof kvpt_key1,
                  "# the current key\n0123456789abcdef0123456789abcdef-one\n", 0600);
    kvpt_key_file(kvpt_key2, sizeof kvpt_key2, "fedcba9876543210fedcba9876543210-two\n", 0600);
}

void kvpt_keys_drop(void)
{
    unlink(kvpt_key1);
    unlink(kvpt_key2);
}

kvpi_auth *kvpt_auth_load(const char *path)
{
    kvpi_auth *a = NULL;
    if (kvpi_auth_load(path, &a) != KVP_OK)
        fprintf(stderr, "  load %s: %s\n", path, kvp_last_error());
    return a;
}

kvp_engine *kvpt_auth_initiator(const char *metadata, const char *key, int disable_shm,
                                int max_age_ms)
{
    char name[64];
    kvp_engine_opts eo;
    kvpt_engine_opts(&eo, name);
    eo.metadata = metadata;
    eo.disable_shm = disable_shm;
    eo.auth_key_file = key;
    if (max_age_ms) eo.auth_max_age_ms = max_age_ms;
    return kvpt_engine_create(&eo);
}

int kvpt_auth_target(kvpt_target_opts *o, kvpt_target *t, const char *key)
{
    o->auth_key_file = key ? key : "";
    o->capture = 1;
    return kvpt_target_start(o, t);
}

int kvpt_read_ok(kvp_engine *e, const char *segment, const kvpt_target *t, uint64_t seed,
                 const char *want_tp)
{
    kvp_segment_id seg;
    char buf[4096];
    if (kvp_engine_open_segment(e, segment, &seg) != KVP_OK ||
        kvp_engine_read(e, seg, buf, (uint64_t)(uintptr_t)t->buf, sizeof buf) != KVP_OK) {
        fprintf(stderr, "  read: %s\n", kvp_last_error());
        return 0;
    }
    const char *tp = kvp_engine_segment_transport(e, seg);
    if (want_tp && (!tp || strcmp(tp, want_tp) != 0)) {
        fprintf(stderr, "  read went through %s, not %s\n", tp ? tp : "?", want_tp);
        return 0;
    }
    return kvpt_verify(buf, sizeof buf, seed) == (size_t)-1;
}

void kvpt_keep_log_if_failed(const char *log)
{
    if (kvpt_failures)
        fprintf(stderr, "  target log: %s\n", log);
    else
        unlink(log);
}

pid_t kvpt_http_store_start(char *url, size_t len)
{
    int port = kvpt_free_port();
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    char *argv[] = {(char *)kvpt_cli(), "metadata-server", "--port", port_s, NULL};
    pid_t pid = kvpt_spawn(argv, "/dev/null");
    if (kvpt_wait_port("127.0.0.1", port, 10000) != 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    snprintf(url, len, "http://127.0.0.1:%d/metadata", port);
    return pid;
}

void kvpt_accept_forever(int lfd, void *(*conn)(void *))
{
    for (;;) {
        int fd;
        if (kvpi_tcp_accept(lfd, 0, &fd) != KVP_OK) continue;
        pthread_t t;
        pthread_create(&t, NULL, conn, (void *)(intptr_t)fd);
        pthread_detach(t);
    }
}

int kvpt_raw_connect(int port)
{
    int fd = -1;
    if (kvpi_tcp_connect("127.0.0.1", port, 3000, &fd) != KVP_OK) return -1;
    return fd;
}

int kvpt_raise_nofile(int n)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return -1;
    if (rl.rlim_cur >= (rlim_t)n) return 0;
    if (rl.rlim_max < (rlim_t)n) return -1;
    rl.rlim_cur = (rlim_t)n;
    return setrlimit(RLIMIT_NOFILE, &rl);
}
