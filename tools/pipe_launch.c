#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "cli_opts.h"
#include "kvpipe/kvpipe.h"
#include "pipe_launch.h"
#include "pipe_ports.h"

static int start_metadata(launch_pair *l, const char *metadata)
{
    if (strcmp(metadata, "p2p") == 0) {
        snprintf(l->metadata, sizeof l->metadata, "P2PHANDSHAKE");
        return 0;
    }
    if (strcmp(metadata, "http") != 0) {
        snprintf(l->metadata, sizeof l->metadata, "%s", metadata);
        return 0;
    }
    kvp_status st = kvp_metadata_server_start("127.0.0.1", 0, &l->store);
    if (st) {
        cli_error("cannot start the metadata store: %s", kvp_last_error());
        return -1;
    }
    snprintf(l->metadata, sizeof l->metadata, "http://127.0.0.1:%d/metadata",
             kvp_metadata_server_port(l->store));
    return 0;
}

static int write_config(launch_pair *l, const char *protocol)
{
    snprintf(l->config_path, sizeof l->config_path, "%s/mooncake.json", l->dir);
    FILE *f = fopen(l->config_path, "w");
    if (!f) {
        cli_error("cannot write %s: %s", l->config_path, strerror(errno));
        return -1;
    }
    fprintf(f,
            "{\n  \"prefill_url\": \"127.0.0.1:%d\",\n  \"decode_url\": \"127.0.0.1:%d\",\n"
            "  \"metadata_server\": \"%s\",\n  \"protocol\": \"%s\",\n  \"device_name\": \"\"\n}\n",
            l->base_port, l->base_port, l->metadata, protocol);
    return fclose(f) == 0 ? 0 : -1;
}

int launch_prepare(launch_pair *l, const char *metadata, const char *protocol, int base_port)
{
    memset(l, 0, sizeof *l);
    snprintf(l->dir, sizeof l->dir, "/tmp/kvpipe-run-XXXXXX");
    if (!mkdtemp(l->dir)) {
        cli_error("cannot create a temporary directory: %s", strerror(errno));
        l->dir[0] = '\0';
        return -1;
    }
    l->base_port = base_port ? base_port : pick_pipe_base();
    if (l->base_port <= 0) {
        cli_error("found no free port range for the pipe");
        return -1;
    }
    if (start_metadata(l, metadata) != 0) return -1;
    return write_config(l, protocol);
}

const char *launch_recv_transport(kvp_pipe *pipe, const kvp_pipe_stats *ps)
{
    if (ps->received == ps->inline_received) return "inline";
    kvp_engine *e = kvp_pipe_engine(pipe);
    kvp_segment_id seg;
    const char *tr = NULL;
    if (kvp_engine_open_segment(e, kvp_pipe_get_endpoints(pipe)->peer_segment, &seg) == KVP_OK)
        tr = kvp_engine_segment_transport(e, seg);
    return tr ? tr : "?";
}

void launch_child_init(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
    /* Only a side this module started dies with its parent; one an operator
     * started by hand (bench --config) must not die with their shell. */
    if (getenv("KVPIPE_LAUNCHED")) prctl(PR_SET_PDEATHSIG, SIGKILL);
}

static pid_t spawn(const launch_pair *l, char *const args[])
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0) return pid;
    setenv("MOONCAKE_CONFIG_PATH", l->config_path, 1);
    setenv("KVPIPE_LAUNCHED", "1", 1);
    execv("/proc/self/exe", args);
    cli_error("cannot run /proc/self/exe: %s", strerror(errno));
    _exit(127);
}

static void kill_all(pid_t *pids, int n)
{
    for (int i = 0; i < n; i++)
        if (pids[i] > 0) kill(pids[i], SIGKILL);
}

static int wait_all(pid_t *pids, const char *const *names, int n, int timeout_ms)
{
    int failed = 0, left = n;
    uint64_t deadline = cli_now_ms() + (uint64_t)timeout_ms;
    while (left > 0) {
        int status;
        pid_t r = waitpid(-1, &status, WNOHANG);
        if (r < 0 && errno != EINTR) break;
        if (r <= 0) {
            if (cli_now_ms() > deadline) {
                cli_error("the run took longer than %d s; stopping it", timeout_ms / 1000);
                kill_all(pids, n);
                failed = 1;
                deadline = UINT64_MAX;
            }
            usleep(20000);
            continue;
        }
        for (int i = 0; i < n; i++) {
            if (pids[i] != r) continue;
            pids[i] = -1;
            left--;
            int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
            if (!ok && !failed) {
                if (WIFSIGNALED(status))
                    cli_error("the %s side died of signal %d", names[i], WTERMSIG(status));
                else
                    cli_error("the %s side failed (exit %d)", names[i], WEXITSTATUS(status));
                failed = 1;
                kill_all(pids, n); /* its peer would only wait for timeouts */
            }
        }
    }
    return failed;
}

int launch_run(const launch_pair *l, const char *cmd, int argc, char **argv,
               const char *const names[2], const char *const side_args[2][LAUNCH_SIDE_ARGS],
               int timeout_ms)
{
    pid_t pids[2] = {-1, -1};
    char **args = calloc((size_t)argc + 2 + LAUNCH_SIDE_ARGS, sizeof *args);
    for (int i = 0; i < 2 && args; i++) {
        int n = 0;
        args[n++] = "kvpipe";
        args[n++] = (char *)cmd;
        for (int a = 1; a < argc; a++)
            args[n++] = argv[a];
        for (int a = 0; a < LAUNCH_SIDE_ARGS; a++)
            args[n++] = (char *)side_args[i][a];
        args[n] = NULL;
        pids[i] = spawn(l, args);
    }
    free(args);
    for (int i = 0; i < 2; i++)
        if (pids[i] < 0) {
            cli_error("cannot start the %s side: %s", names[i], strerror(errno));
            kill_all(pids, 2);
            for (int k = 0; k < 2; k++)
                if (pids[k] > 0) waitpid(pids[k], NULL, 0);
            return 1;
        }
    return wait_all(pids, names, 2, timeout_ms);
}

void launch_cleanup(launch_pair *l)
{
    kvp_metadata_server_stop(l->store);
    l->store = NULL;
    if (!l->dir[0]) return;
    /* Only this run's own files live there: the config and the sides' reports. */
    DIR *d = opendir(l->dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[sizeof l->dir + 256];
        snprintf(path, sizeof path, "%s/%s", l->dir, e->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    rmdir(l->dir);
}
