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

int kvpt_target_start(const kvpt_target_opts *o, kvpt_target *t)
{
    memset(t, 0, sizeof *t);
    t->len = o->len;
    snprintf(t->name, sizeof t->name, "127.0.0.1:%d", o->port ? o->port : kvpt_free_port());
    t->buf = mmap(NULL, o->len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (t->buf == MAP_FAILED) return -1;
    kvpt_fill(t->buf, o->len, o->seed);
    int ready[2], ctl[2];
    if (pipe(ready) || pipe(ctl)) return -1;
    fflush(NULL);
    t->pid = fork();
    if (t->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(ready[0]);
        close(ctl[1]);
        target_child(o, t, ready[1], ctl[0]);
    }
    close(ready[1]);
    close(ctl[0]);
    t->ctl = ctl[1];
    char c;
    ssize_t n = read(ready[0], &c, 1);
    close(ready[0]);
    if (n != 1) {
        kvpt_wait_child(t->pid, 5000);
        return -1;
    }
    return 0;
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
