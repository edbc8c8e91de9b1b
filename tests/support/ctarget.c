#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "ctarget.h"
#include "test.h"

typedef struct ct_cmd {
    int64_t op;
    uint64_t arg;
} ct_cmd;

static int read_full(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int64_t timed_ms(uint64_t t0)
{
    return (int64_t)((kvpi_now_ns() - t0) / 1000000u);
}

static int64_t child_do(kvp_engine *e, kvpt_ctarget *t, const ct_cmd *c)
{
    static void *pool; /* the last KVPT_CT_POOL buffer */
    uint64_t t0 = kvpi_now_ns();
    switch (c->op) {
    case KVPT_CT_REGISTER: {
        void *p = malloc(c->arg);
        if (!p || kvp_engine_register(e, p, c->arg) != KVP_OK) return -1;
        return timed_ms(t0); /* the region stays registered until the child exits */
    }
    case KVPT_CT_ALLOC: {
        void *p;
        return kvp_engine_alloc(e, c->arg, &p) == KVP_OK ? timed_ms(t0) : -1;
    }
    case KVPT_CT_POOL: {
        void *p;
        if (kvp_engine_alloc(e, c->arg, &p) != KVP_OK) return -1;
        kvpt_fill(p, c->arg, c->arg); /* the pattern's seed is the length */
        pool = p;
        return (int64_t)(uintptr_t)p;
    }
    case KVPT_CT_POOL_FREE:
        if (!pool || kvp_engine_free(e, pool) != KVP_OK) return -1;
        pool = NULL;
        return timed_ms(t0);
    case KVPT_CT_UNREGISTER:
        return kvp_engine_unregister(e, t->buf) == KVP_OK ? timed_ms(t0) : -1;
    case KVPT_CT_REREGISTER:
        if (kvp_engine_unregister(e, t->buf) != KVP_OK) return -1;
        kvpt_fill(t->buf, t->len, c->arg);
        return kvp_engine_register(e, t->buf, t->len) == KVP_OK ? 0 : -1;
    case KVPT_CT_UNMAP:
        return munmap(t->buf, t->len) == 0 ? 0 : -1;
    case KVPT_CT_FDS:
        return kvpt_count_fds();
    default:
        return -1;
    }
}

static void child_main(const kvpt_ctarget_opts *o, kvpt_ctarget *t, int cmd_fd, int resp_fd)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    signal(SIGPIPE, SIG_IGN);
    if (o->stderr_path) {
        int fd = open(o->stderr_path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
        if (fd < 0 || dup2(fd, STDERR_FILENO) < 0) _exit(2);
        close(fd);
    }
    if (o->nofile) {
        struct rlimit rl;
        getrlimit(RLIMIT_NOFILE, &rl);
        rl.rlim_cur = (rlim_t)o->nofile;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(2);
    }
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = t->name;
    eo.metadata = o->metadata ? o->metadata : "P2PHANDSHAKE";
    if (o->protocol) eo.protocol = o->protocol;
    eo.disable_shm = o->disable_shm;
    if (o->timeout_ms) eo.timeout_ms = o->timeout_ms;
    if (o->idle_timeout_ms) eo.idle_timeout_ms = o->idle_timeout_ms;
    if (o->max_connections) eo.max_connections = o->max_connections;
    if (o->min_transfer_rate) eo.min_transfer_rate = o->min_transfer_rate;
    if (o->pool_retain_bytes) eo.pool_retain_bytes = o->pool_retain_bytes;
    kvp_engine *e;
    if (kvp_engine_create(&eo, &e) != KVP_OK) {
        fprintf(stderr, "ctarget: engine: %s\n", kvp_last_error());
        _exit(3);
    }
    if (kvp_engine_register(e, t->buf, t->len) != KVP_OK) {
        fprintf(stderr, "ctarget: register: %s\n", kvp_last_error());
        _exit(4);
    }
    int64_t port = kvp_engine_data_port(e);
    if (write(resp_fd, &port, sizeof port) != (ssize_t)sizeof port) _exit(5);
    ct_cmd c;
    while (read_full(cmd_fd, &c, sizeof c) == 0) {
        int64_t r = child_do(e, t, &c);
        if (write(resp_fd, &r, sizeof r) != (ssize_t)sizeof r) break;
    }
    kvp_engine_destroy(e);
    _exit(0);
}

int kvpt_ctarget_start(const kvpt_ctarget_opts *o, kvpt_ctarget *t)
{
    memset(t, 0, sizeof *t);
    t->len = o->len;
    t->rpc_port = kvpt_free_port();
    snprintf(t->name, sizeof t->name, "127.0.0.1:%d", t->rpc_port);
    t->buf = mmap(NULL, o->len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (t->buf == MAP_FAILED) return -1;
    kvpt_fill(t->buf, o->len, o->seed);
    int c[2], r[2];
    if (pipe(c) || pipe(r)) return -1;
    fflush(NULL);
    t->pid = fork();
    if (t->pid == 0) {
        close(c[1]);
        close(r[0]);
        child_main(o, t, c[0], r[1]);
    }
    close(c[0]);
    close(r[1]);
    t->cmd = c[1];
    t->resp = r[0];
    struct pollfd p = {.fd = t->resp, .events = POLLIN};
    int64_t port = 0;
    if (poll(&p, 1, 20000) != 1 || read_full(t->resp, &port, sizeof port) != 0) {
        kvpt_wait_child(t->pid, 1000);
        return -1;
    }
    t->data_port = (int)port;
    return 0;
}

int64_t kvpt_ctarget_cmd(kvpt_ctarget *t, int op, uint64_t arg, int timeout_ms)
{
    if (t->stuck) return -1;
    ct_cmd c = {op, arg};
    if (write(t->cmd, &c, sizeof c) != (ssize_t)sizeof c) return -1;
    struct pollfd p = {.fd = t->resp, .events = POLLIN};
    int64_t r = -1;
    if (poll(&p, 1, timeout_ms) != 1 || read_full(t->resp, &r, sizeof r) != 0) {
        fprintf(stderr, "  target: command '%c' not answered within %d ms\n", op, timeout_ms);
        t->stuck = 1;
        return -1;
    }
    return r;
}

int kvpt_ctarget_said(const char *stderr_path, const char *text)
{
    FILE *f = fopen(stderr_path, "r");
    if (!f) return 0;
    int found = 0;
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        fputs(line, stderr);
        found |= strstr(line, text) != NULL;
    }
    fclose(f);
    unlink(stderr_path);
    return found;
}

int64_t kvpt_ctarget_cpu_ms(const kvpt_ctarget *t)
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

int kvpt_ctarget_stop(kvpt_ctarget *t)
{
    close(t->cmd);
    int rc = kvpt_wait_child(t->pid, t->stuck ? 1000 : 20000);
    close(t->resp);
    munmap(t->buf, t->len);
    return rc;
}

int kvpt_initiator_start(const char *protocol, int disable_shm, int timeout_ms, kvp_engine **out)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = name;
    eo.metadata = "P2PHANDSHAKE";
    if (protocol) eo.protocol = protocol;
    eo.disable_shm = disable_shm;
    if (timeout_ms) eo.timeout_ms = timeout_ms;
    if (kvp_engine_create(&eo, out) != KVP_OK) {
        fprintf(stderr, "  initiator engine: %s\n", kvp_last_error());
        return -1;
    }
    return 0;
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
