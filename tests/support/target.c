#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "target.h"
#include "test.h"

/* The target child is a fresh exec of the test program, not a bare fork: the
 * test may run threads already (an initiator engine), and starting an engine
 * in a fork of a threaded process is unsafe (a lock another thread held at
 * the fork stays held in the child) and refused by ThreadSanitizer. The
 * program learns that it is a target child before main runs, from
 * CHILD_ENV, and maps the buffer (a memfd) at the parent's address, so that
 * the test's view of the buffer and the address peers use stay one. */
#define CHILD_ENV "KVPT_TARGET_CHILD"     /* "mem_fd ready_fd ctl_fd addr len shm_off" */
#define CHILD_ENV_NAME "KVPT_TARGET_NAME" /* segment name */
#define CHILD_ENV_META "KVPT_TARGET_METADATA"
#define CHILD_ENV_PROTO "KVPT_TARGET_PROTOCOL" /* unset: the default */
/* The child's exit status when the parent's address is taken in it. */
#define ADDR_TAKEN_EXIT 7
#define ADDR_TRIES 4

static void target_child(const kvpt_target_opts *o, kvpt_target *t, int ready_fd, int ctl_fd)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = t->name;
    eo.metadata = o->metadata;
    if (o->protocol) eo.protocol = o->protocol;
    eo.disable_shm = o->disable_shm;
    kvp_engine *e;
    if (kvp_engine_create(&eo, &e) != KVP_OK) {
        fprintf(stderr, "target: engine: %s\n", kvp_last_error());
        _exit(3);
    }
    if (kvp_engine_register(e, t->buf, t->len) != KVP_OK) {
        fprintf(stderr, "target: register: %s\n", kvp_last_error());
        _exit(4);
    }
    char ok = 1;
    if (write(ready_fd, &ok, 1) != 1) _exit(5);
    close(ready_fd);
    char c;
    while (read(ctl_fd, &c, 1) > 0) {
    }
    kvp_engine_destroy(e);
    _exit(0);
}

__attribute__((constructor)) static void target_child_entry(void)
{
    const char *spec = getenv(CHILD_ENV);
    if (!spec) return;
    int mem_fd, ready_fd, ctl_fd, shm_off;
    uint64_t addr, len;
    if (sscanf(spec, "%d %d %d %" SCNx64 " %" SCNu64 " %d", &mem_fd, &ready_fd, &ctl_fd, &addr,
               &len, &shm_off) != 6) {
        fprintf(stderr, "target: bad %s '%s'\n", CHILD_ENV, spec);
        _exit(2);
    }
    kvpt_target t = {.len = len};
    snprintf(t.name, sizeof t.name, "%s", getenv(CHILD_ENV_NAME));
    kvpt_target_opts o = {.metadata = getenv(CHILD_ENV_META),
                          .protocol = getenv(CHILD_ENV_PROTO),
                          .len = len,
                          .disable_shm = shm_off};
    t.buf = mmap((void *)(uintptr_t)addr, len, PROT_READ | PROT_WRITE,
                 MAP_SHARED | MAP_FIXED_NOREPLACE, mem_fd, 0);
    if (t.buf != (void *)(uintptr_t)addr) {
        /* Something of ours landed there (address layout is random): the
         * parent tries another address. */
        int taken = t.buf == MAP_FAILED && errno == EEXIST;
        perror("target: mapping the buffer at the parent's address");
        _exit(taken ? ADDR_TAKEN_EXIT : 6);
    }
    close(mem_fd);
    target_child(&o, &t, ready_fd, ctl_fd);
}

/* The environment of the child: ours and the CHILD_ENV* variables. NULL on
 * failure; free the strings from index first_own on, and the array. */
static char **child_env(const kvpt_target_opts *o, const kvpt_target *t, int mem_fd, int ready_fd,
                        int ctl_fd, size_t *first_own)
{
    extern char **environ;
    size_t n = 0;
    while (environ[n])
        n++;
    char **env = calloc(n + 5, sizeof *env);
    if (!env) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "KVPT_TARGET_", strlen("KVPT_TARGET_")) != 0) env[k++] = environ[i];
    *first_own = k;
    int ok = asprintf(&env[k++], "%s=%d %d %d %" PRIx64 " %zu %d", CHILD_ENV, mem_fd, ready_fd,
                      ctl_fd, (uint64_t)(uintptr_t)t->buf, t->len, o->disable_shm) > 0;
    ok = ok && asprintf(&env[k++], "%s=%s", CHILD_ENV_NAME, t->name) > 0;
    ok = ok && asprintf(&env[k++], "%s=%s", CHILD_ENV_META, o->metadata) > 0;
    if (ok && o->protocol) ok = asprintf(&env[k++], "%s=%s", CHILD_ENV_PROTO, o->protocol) > 0;
    if (ok) return env;
    for (size_t i = *first_own; i < k; i++)
        free(env[i]);
    free(env);
    return NULL;
}

/* Map the memfd and start the child on it; 0 once it is ready, else the
 * child's exit status (ADDR_TAKEN_EXIT: try another address), or -1. */
static int spawn_at(const kvpt_target_opts *o, kvpt_target *t, const char *exe, int mem_fd)
{
    t->buf = mmap(NULL, o->len, PROT_READ | PROT_WRITE, MAP_SHARED, mem_fd, 0);
    if (t->buf == MAP_FAILED) return -1;
    /* Close-on-exec everywhere, so that a target holds no other target's
     * control pipe; the child clears it on the three it keeps. */
    int ready[2], ctl[2];
    if (pipe2(ready, O_CLOEXEC)) return -1;
    if (pipe2(ctl, O_CLOEXEC)) {
        close(ready[0]), close(ready[1]);
        return -1;
    }
    size_t first_own;
    char **env = child_env(o, t, mem_fd, ready[1], ctl[0], &first_own);
    if (!env) return -1;
    fflush(NULL);
    t->pid = fork();
    if (t->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int keep[] = {mem_fd, ready[1], ctl[0]};
        for (size_t i = 0; i < 3; i++)
            fcntl(keep[i], F_SETFD, 0);
        char *argv[] = {(char *)exe, NULL};
        execve(exe, argv, env);
        perror(exe);
        _exit(127);
    }
    for (size_t i = first_own; env[i]; i++)
        free(env[i]);
    free(env);
    close(ready[1]);
    close(ctl[0]);
    t->ctl = ctl[1];
    char c;
    ssize_t n = read(ready[0], &c, 1);
    close(ready[0]);
    if (n == 1) return 0;
    close(t->ctl);
    int rc = kvpt_wait_child(t->pid, 5000);
    return rc ? rc : -1;
}

int kvpt_target_start(const kvpt_target_opts *o, kvpt_target *t)
{
    memset(t, 0, sizeof *t);
    t->len = o->len;
    snprintf(t->name, sizeof t->name, "127.0.0.1:%d", o->port ? o->port : kvpt_free_port());
    char exe[4096];
    ssize_t exe_len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    int mem_fd = memfd_create("kvpt-target", MFD_CLOEXEC);
    if (exe_len <= 0 || mem_fd < 0 || ftruncate(mem_fd, (off_t)o->len) != 0) return -1;
    exe[exe_len] = '\0';
    void *fill = mmap(NULL, o->len, PROT_READ | PROT_WRITE, MAP_SHARED, mem_fd, 0);
    if (fill == MAP_FAILED) return -1;
    kvpt_fill(fill, o->len, o->seed);
    munmap(fill, o->len);
    /* A mapping whose address the child had taken stays mapped here until
     * the end, so that the next try gets another address. */
    void *taken[ADDR_TRIES];
    int n_taken = 0, rc;
    while ((rc = spawn_at(o, t, exe, mem_fd)) == ADDR_TAKEN_EXIT && n_taken + 1 < ADDR_TRIES)
        taken[n_taken++] = t->buf;
    for (int i = 0; i < n_taken; i++)
        munmap(taken[i], o->len);
    close(mem_fd);
    if (rc != 0 && t->buf != MAP_FAILED) munmap(t->buf, o->len);
    return rc == 0 ? 0 : -1;
}

int kvpt_target_stop(kvpt_target *t, int keep_buffer)
{
    close(t->ctl);
    int rc = kvpt_wait_child(t->pid, 20000);
    if (!keep_buffer) munmap(t->buf, t->len);
    return rc;
}

void kvpt_target_kill(kvpt_target *t)
{
    kill(t->pid, SIGKILL);
    waitpid(t->pid, NULL, 0);
    close(t->ctl);
}

int kvpt_engine_start(const char *metadata, const char *protocol, int disable_shm, kvp_engine **out)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = name;
    eo.metadata = metadata;
    if (protocol) eo.protocol = protocol;
    eo.disable_shm = disable_shm;
    if (kvp_engine_create(&eo, out) != KVP_OK) {
        fprintf(stderr, "  initiator engine: %s\n", kvp_last_error());
        return -1;
    }
    return 0;
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
