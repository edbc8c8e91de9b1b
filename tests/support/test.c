#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "test.h"
#if KVP_HAVE_UCX
#include <ucp/api/ucp.h>
#endif

int kvpt_failures;
static int passed, failed, skipped;
static const char *skip_file = NULL;

void kvpt_skip(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "  skipped: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    /* The case runs in a child; this exit code tells the parent it skipped. */
    exit(KVPT_SKIP_EXIT);
}

/* Whether name contains one of the comma-separated texts of list. */
static int name_in_list(const char *name, const char *list)
{
    for (const char *p = list; *p;) {
        size_t n = strcspn(p, ",");
        char text[128];
        if (n > 0 && n < sizeof text) {
            memcpy(text, p, n);
            text[n] = '\0';
            if (strstr(name, text)) return 1;
        }
        p += n + (p[n] == ',');
    }
    return 0;
}

void kvpt_run(const char *name, void (*fn)(void), int timeout_s)
{
    (void)skip_file;
    /* KVPT_FILTER=text runs only the cases whose name contains text. */
    const char *filter = getenv("KVPT_FILTER");
    if (filter && *filter && !strstr(name, filter)) return;
    /* KVPT_EXCLUDE=text[,text...] skips them instead, and says so. */
    const char *exclude = getenv("KVPT_EXCLUDE");
    if (exclude && *exclude && name_in_list(name, exclude)) {
        printf("SKIP %s (KVPT_EXCLUDE=%s)\n", name, exclude);
        fflush(stdout);
        skipped++;
        return;
    }
    fflush(NULL);
    uint64_t t0 = kvpi_now_ns();
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        alarm((unsigned)timeout_s);
        kvpt_failures = 0;
        fn();
        /* exit, not _exit: LeakSanitizer checks each case at its exit. */
        exit(kvpt_failures ? 1 : 0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    /* Kill anything the case left running in its process group. */
    kill(-pid, SIGKILL);
    double secs = (double)(kvpi_now_ns() - t0) / 1e9;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
        printf("PASS %s (%.1f s)\n", name, secs);
        passed++;
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == KVPT_SKIP_EXIT) {
        printf("SKIP %s (%.1f s)\n", name, secs);
        skipped++;
    } else if (WIFSIGNALED(status)) {
        printf("FAIL %s (signal %d%s, %.1f s)\n", name, WTERMSIG(status),
               WTERMSIG(status) == SIGALRM ? ": timed out" : "", secs);
        failed++;
    } else {
        printf("FAIL %s (%.1f s)\n", name, secs);
        failed++;
    }
    fflush(stdout);
}

static void (*with_fn)(const char *);
static const char *with_arg;

static void run_with_arg(void)
{
    with_fn(with_arg);
}

void kvpt_run_with(const char *name, void (*fn)(const char *arg), const char *arg, int timeout_s)
{
    with_fn = fn;
    with_arg = arg;
    kvpt_run(name, run_with_arg, timeout_s);
}

int kvpt_summary(void)
{
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    if (failed) return 1;
    /* Nothing ran but skips: ctest shows the program as skipped
     * (SKIP_RETURN_CODE), not as passed. */
    return passed == 0 && skipped > 0 ? KVPT_SKIP_EXIT : 0;
}

static int port_bindable(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

/* Ports handed out here lie below Linux's ephemeral range (32768 and up by
 * default), so that the data ports engines bind with port 0, in this or a
 * concurrently running test, cannot take one between our check and its use.
 *
 * Tests run side by side (ctest -j) and a port found free is bound only
 * later, by an engine or a child, so two tests could draw the same free port.
 * A registry shared with the Python tests' free_port_block, a file of
 * "port pid" lines rewritten under flock on every draw, keeps a port handed
 * to a live process from being handed out again; the lines of processes that
 * have exited are dropped at each rewrite. */
struct port_claim {
    int port, pid;
};

static struct port_claim claims[65536];

static FILE *port_registry_open(size_t *n_claims)
{
    const char *dir = getenv("TMPDIR");
    char path[512];
    snprintf(path, sizeof path, "%s/kvpipe-test-ports", dir && *dir ? dir : "/tmp");
    FILE *f = fopen(path, "a+");
    if (!f || flock(fileno(f), LOCK_EX) != 0) {
        fprintf(stderr, "kvpt_free_port: port registry %s: %s\n", path, strerror(errno));
        abort();
    }
    size_t n = 0;
    struct port_claim c;
    rewind(f);
    while (n < 65536 && fscanf(f, "%d %d", &c.port, &c.pid) == 2)
        if (c.port > 0 && c.port < 65536 && (kill(c.pid, 0) == 0 || errno != ESRCH))
            claims[n++] = c;
    *n_claims = n;
    return f;
}

static int port_claimed(size_t n_claims, int port)
{
    for (size_t i = 0; i < n_claims; i++)
        if (claims[i].port == port) return 1;
    return 0;
}

int kvpt_free_port_block(const int *offsets, size_t n)
{
    static unsigned seed;
    static pid_t seeded_by;
    if (seeded_by != getpid()) { /* forked cases must not repeat each other */
        seeded_by = getpid();
        seed = (unsigned)getpid() * 2654435761u ^ (unsigned)time(NULL);
    }
    size_t n_claims;
    FILE *reg = port_registry_open(&n_claims);
    for (int tries = 0; tries < 1000; tries++) {
        int base = 20000 + (int)(rand_r(&seed) % 12000);
        size_t i = 0;
        while (i < n && base + offsets[i] < 32768 && !port_claimed(n_claims, base + offsets[i]) &&
               port_bindable(base + offsets[i]))
            i++;
        if (i < n) continue;
        if (fseek(reg, 0, SEEK_SET) != 0 || ftruncate(fileno(reg), 0) != 0) abort();
        for (i = 0; i < n_claims; i++)
            fprintf(reg, "%d %d\n", claims[i].port, claims[i].pid);
        for (i = 0; i < n; i++)
            fprintf(reg, "%d %d\n", base + offsets[i], (int)getpid());
        fclose(reg); /* flushes, then drops the lock */
        return base;
    }
    fprintf(stderr, "kvpt_free_port: no free ports below 32768\n");
    abort();
}

int kvpt_free_port(void)
{
    static const int one[] = {0};
    return kvpt_free_port_block(one, 1);
}

int kvpt_pipe_ports(void)
{
    static const int offsets[] = {0, 9, 10, 100, 109, 110};
    return kvpt_free_port_block(offsets, sizeof offsets / sizeof offsets[0]);
}

int kvpt_wait_port(const char *host, int port, int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 20) {
        int fd;
        if (kvpi_tcp_connect(host, port, 500, &fd) == KVP_OK) {
            close(fd);
            return 0;
        }
        usleep(20000);
    }
    return -1;
}

int kvpt_wait_file_has(const char *path, const char *text, int timeout_ms)
{
    static char buf[65536];
    for (int waited = 0; waited < timeout_ms; waited += 20) {
        FILE *f = fopen(path, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f) fclose(f);
        buf[n] = '\0';
        if (strstr(buf, text)) return 0;
        usleep(20000);
    }
    return -1;
}

pid_t kvpt_spawn_until(char *const argv[], const char *text, int timeout_ms)
{
    static int n;
    char out[96];
    snprintf(out, sizeof out, "/tmp/kvpt_spawn_%d_%d.out", (int)getpid(), n++);
    pid_t pid = kvpt_spawn(argv, out);
    int said = pid > 0 ? kvpt_wait_file_has(out, text, timeout_ms) : -1;
    unlink(out);
    if (said == 0) return pid;
    if (pid > 0) kill(pid, SIGKILL), waitpid(pid, NULL, 0);
    return -1;
}

long kvpt_join_bad(const pthread_t *t, int n)
{
    long bad = 0;
    for (int i = 0; i < n; i++) {
        void *r;
        pthread_join(t[i], &r);
        bad += (long)(intptr_t)r;
    }
    return bad;
}

pid_t kvpt_spawn(char *const argv[], const char *out_path)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        /* Never outlive the test that started us, even if it is killed. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (out_path) {
            int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (fd >= 0) dup2(fd, 1);
        }
        execv(argv[0], argv);
        perror(argv[0]);
        _exit(127);
    }
    return pid;
}

#if defined(__SANITIZE_THREAD__)
#define KVPT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVPT_TSAN 1
#endif
#endif

#ifdef KVPT_TSAN
/* ThreadSanitizer runs a thread of its own, and checks this itself (a child
 * forked beside threads dies when it starts one). */
int kvpt_fork_alone(const char *who)
{
    (void)who;
    return 0;
}
#else
static int thread_count(void)
{
    DIR *d = opendir("/proc/self/task");
    int n = -2; /* "." and ".." */
    if (!d) return 1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

int kvpt_fork_alone(const char *who)
{
    /* A thread just joined may still be listed for a moment. */
    int n = thread_count();
    for (int waited = 0; n > 1 && waited < 100; waited++) {
        usleep(1000);
        n = thread_count();
    }
    if (n <= 1) return 0;
    fprintf(stderr,
            "  %s: refusing to fork a child that runs code from a process with %d threads "
            "(it may inherit a lock one of them holds and hang); fork before starting "
            "them, or use kvpt_peer_exec\n",
            who, n);
    return -1;
}
#endif

pid_t kvpt_fork_piped(void (*fn)(const void *arg, int fd), const void *arg, int *rfd)
{
    if (kvpt_fork_alone("kvpt_fork_piped") != 0) return -1;
    int p[2];
    if (pipe(p) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(p[0]);
        fn(arg, p[1]);
        _exit(2); /* fn does not return */
    }
    close(p[1]);
    if (pid < 0) close(p[0]);
    *rfd = p[0];
    return pid;
}

pid_t kvpt_fork_ready(void (*fn)(const void *arg, int ready_fd), const void *arg)
{
    int fd;
    pid_t pid = kvpt_fork_piped(fn, arg, &fd);
    if (pid < 0) return -1;
    char c;
    ssize_t got = read(fd, &c, 1);
    close(fd);
    if (got != 1) {
        kill(pid, SIGKILL), waitpid(pid, NULL, 0);
        return -1;
    }
    return pid;
}

int kvpt_wait_child(pid_t pid, int timeout_ms)
{
    for (int waited = 0;; waited += 10) {
        int status;
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid) {
            if (WIFEXITED(status)) return WEXITSTATUS(status);
            return 128 + WTERMSIG(status);
        }
        if (waited >= timeout_ms) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        usleep(10000);
    }
}

static inline uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

void kvpt_fill(void *buf, size_t len, uint64_t seed)
{
    unsigned char *p = buf;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t v = mix(seed + i);
        memcpy(p + i, &v, 8);
    }
    uint64_t v = mix(seed + i);
    for (; i < len; i++)
        p[i] = (unsigned char)(v >> (8 * (i % 8)));
}

size_t kvpt_verify(const void *buf, size_t len, uint64_t seed)
{
    const unsigned char *p = buf;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t v = mix(seed + i);
        if (memcmp(p + i, &v, 8) != 0) {
            for (size_t j = 0; j < 8; j++)
                if (p[i + j] != (unsigned char)(v >> (8 * j))) return i + j;
        }
    }
    uint64_t v = mix(seed + i);
    for (; i < len; i++)
        if (p[i] != (unsigned char)(v >> (8 * (i % 8)))) return i;
    return (size_t)-1;
}

const char *kvpt_cli(void)
{
    return KVP_CLI_PATH;
}

int kvpt_ucx_older_than(unsigned major, unsigned minor)
{
#if KVP_HAVE_UCX
    unsigned ma, mi, rel;
    ucp_get_version(&ma, &mi, &rel);
    return ma < major || (ma == major && mi < minor);
#else
    (void)major, (void)minor;
    return 0;
#endif
}

int64_t kvpt_runq_wait_ms(pid_t pid)
{
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
    DIR *d = opendir(dir);
    if (!d) return -1;
    unsigned long long sum = 0;
    for (struct dirent *t; (t = readdir(d));) {
        if (t->d_name[0] == '.') continue;
        char path[384];
        snprintf(path, sizeof path, "%s/%s/schedstat", dir, t->d_name);
        FILE *f = fopen(path, "r");
        unsigned long long run, wait;
        /* "time on the CPU, time waiting on a run queue, timeslices", in ns */
        if (f && fscanf(f, "%llu %llu", &run, &wait) == 2) sum += wait;
        if (f) fclose(f);
    }
    closedir(d);
    return (int64_t)(sum / 1000000u);
}

int kvpt_stop(pid_t pid, int timeout_ms)
{
    if (kill(pid, SIGSTOP) != 0) return -1;
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", (int)pid);
    uint64_t deadline = kvpi_now_ms() + (uint64_t)timeout_ms;
    do {
        DIR *d = opendir(dir);
        if (!d) return -1;
        int running = 0;
        for (struct dirent *t; (t = readdir(d));) {
            if (t->d_name[0] == '.') continue;
            char path[384], stat[512];
            snprintf(path, sizeof path, "%s/%s/stat", dir, t->d_name);
            FILE *f = fopen(path, "r");
            size_t n = f ? fread(stat, 1, sizeof stat - 1, f) : 0;
            if (f) fclose(f);
            stat[n] = '\0';
            const char *end = strrchr(stat, ')'); /* the state follows the name */
            running += !end || end[1] != ' ' || (end[2] != 'T' && end[2] != 't');
        }
        closedir(d);
        if (!running) return 0;
        usleep(1000);
    } while (kvpi_now_ms() < deadline);
    return -1;
}

int kvpt_cli_run(const char *args, char *out, size_t len)
{
    char err[64], cmd[4096];
    snprintf(err, sizeof err, "/tmp/kvpt_cli_%d.err", (int)getpid());
    snprintf(cmd, sizeof cmd, "%s %s 2>%s", kvpt_cli(), args, err);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, len - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    /* A failure says why: the end of what the command wrote to stderr. */
    if (rc != 0) {
        fprintf(stderr, "  kvpipe %s: exit %d; its stderr ends:\n", args, rc);
        snprintf(cmd, sizeof cmd, "tail -n 40 %s >&2", err);
        if (system(cmd)) {
        }
    }
    unlink(err);
    return rc;
}

char *kvpt_last_line(char *text)
{
    size_t n = strlen(text);
    while (n && text[n - 1] == '\n')
        text[--n] = '\0';
    char *last = strrchr(text, '\n');
    return last ? last + 1 : text;
}

int kvpt_count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (de->d_name[0] != '.') n++;
    closedir(d);
    return n - 1; /* the directory's own descriptor */
}

void kvpt_fakecuda_load(kvpt_fakecuda *fc, const char *path)
{
    void *lib = dlopen(path, RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "cannot load the CUDA double: %s\n", dlerror());
        exit(1);
    }
    *(void **)&fc->alloc = dlsym(lib, "fakecuda_alloc");
    *(void **)&fc->peek = dlsym(lib, "fakecuda_peek");
    *(void **)&fc->poke = dlsym(lib, "fakecuda_poke");
    *(void **)&fc->fail_copy = dlsym(lib, "fakecuda_fail_copy");
    *(void **)&fc->copies = dlsym(lib, "fakecuda_copies");
    *(void **)&fc->ipc_copies = dlsym(lib, "fakecuda_ipc_copies");
}
