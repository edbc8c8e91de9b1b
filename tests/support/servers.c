/* Test fixtures that run real redis-server and etcd (and kvpipe's own HTTP
 * metadata server) on free loopback ports. */
#include <curl/curl.h>
#include <sys/prctl.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/conn_server.h"
#include "kvpipe/metadata_server.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"

#define START_TIMEOUT_MS 30000
#define STOP_TIMEOUT_MS 10000

static int fail(kvpt_server *s, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(kvpt_server *s, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->why, sizeof s->why, fmt, ap);
    va_end(ap);
    return rc;
}

const char *kvpt_find_binary(const char *name)
{
    static char path[4096];
    const char *env = getenv("PATH");
    char dirs[4096];
    snprintf(dirs, sizeof dirs, "%s:/usr/bin:/usr/sbin:/usr/local/bin", env ? env : "");
    char *save = NULL;
    for (char *d = strtok_r(dirs, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
        snprintf(path, sizeof path, "%s/%s", d, name);
        if (access(path, X_OK) == 0) return path;
    }
    return NULL;
}

/* The last bytes of the server's log, to say why it did not come up. */
static void log_tail(const kvpt_server *s, char *buf, size_t len)
{
    char path[300];
    snprintf(path, sizeof path, "%s/log", s->dir);
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f) return;
    long want = (long)len - 1;
    if (fseek(f, -want, SEEK_END) != 0) fseek(f, 0, SEEK_SET);
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = '\0';
    fclose(f);
}

/* Fork and exec argv with stdout and stderr in <dir>/log. The child stays in
 * the caller's process group, so the harness kills it with a failed case. */
static pid_t spawn_logged(const kvpt_server *s, char *const argv[])
{
    char path[300];
    snprintf(path, sizeof path, "%s/log", s->dir);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the test */
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
        int in = open("/dev/null", O_RDONLY);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        if (in >= 0) dup2(in, 0);
        /* Nothing of the test's (pipes to other children) may stay open in a
         * server that outlives them. */
        close_range(3, ~0u, 0);
        execv(argv[0], argv);
        _exit(127);
    }
    return pid;
}

static int exited(kvpt_server *s)
{
    int status;
    if (waitpid(s->pid, &status, WNOHANG) == s->pid) {
        s->pid = 0;
        return 1;
    }
    return 0;
}

static int redis_ping(const kvpt_server *s)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", s->port, tv);
    int ok = 0;
    if (c && !c->err && s->password[0]) {
        redisReply *r = redisCommand(c, "AUTH %s", s->password);
        if (r) freeReplyObject(r);
    }
    if (c && !c->err) {
        redisReply *r = redisCommand(c, "PING");
        ok = r && r->type == REDIS_REPLY_STATUS && strcmp(r->str, "PONG") == 0;
        if (r) freeReplyObject(r);
    }
    if (c) redisFree(c);
    return ok;
}

static size_t sink(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    char *buf = userdata;
    size_t n = size * nmemb, have = strlen(buf);
    size_t room = 255 - have;
    memcpy(buf + have, ptr, n < room ? n : room);
    buf[have + (n < room ? n : room)] = '\0';
    return n;
}

/* GET http://127.0.0.1:port/health; 1 if the body holds want. */
static int health_says(int port, const char *want)
{
    char url[64], body[256] = "";
    snprintf(url, sizeof url, "http://127.0.0.1:%d/health", port);
    CURL *h = curl_easy_init();
    if (!h) return 0;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 1000L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, sink);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, body);
    CURLcode rc = curl_easy_perform(h);
    curl_easy_cleanup(h);
    return rc == CURLE_OK && strstr(body, want) != NULL;
}

/* etcd listens before it has elected itself leader; /health says when it can
 * serve. */
static int etcd_healthy(const kvpt_server *s)
{
    return health_says(s->port, "\"health\":\"true\"");
}

static int http_healthy(const kvpt_server *s)
{
    return health_says(s->port, "OK");
}

static int wait_ready(kvpt_server *s, int (*ready)(const kvpt_server *s))
{
    for (int waited = 0; waited < START_TIMEOUT_MS; waited += 50) {
        if (exited(s)) {
            char tail[400];
            log_tail(s, tail, sizeof tail);
            return fail(s, KVPT_SERVER_FAILED, "%s on port %d exited at start: %s", s->kind,
                        s->port, tail);
        }
        if (ready(s)) return KVPT_SERVER_OK;
        usleep(50000);
    }
    kvpt_server_down(s);
    return fail(s, KVPT_SERVER_FAILED, "%s on port %d did not answer within %d ms", s->kind,
                s->port, START_TIMEOUT_MS);
}

static int redis_launch(kvpt_server *s)
{
    const char *bin = kvpt_find_binary("redis-server");
    if (!bin) return fail(s, KVPT_SERVER_ABSENT, "redis-server not found in PATH or /usr/bin");
    char port[16];
    snprintf(port, sizeof port, "%d", s->port);
    char *argv[] = {(char *)bin, "--port",       port, "--bind", "127.0.0.1", "--save",
                    "",          "--appendonly", "no", "--dir",  s->dir,      "--daemonize",
                    "no",        NULL,           NULL, NULL};
    if (s->password[0]) {
        argv[13] = "--requirepass";
        argv[14] = (char *)s->password;
    }
    s->pid = spawn_logged(s, argv);
    if (s->pid < 0) return fail(s, KVPT_SERVER_FAILED, "fork: %s", strerror(errno));
    return wait_ready(s, redis_ping);
}

void kvpt_etcd_args_make(kvpt_etcd_args *a, const char *bin, const char *host, int port,
                         int peer_port, const char *data_dir, const char *const extra[])
{
    snprintf(a->data, sizeof a->data, "%s", data_dir);
    snprintf(a->client, sizeof a->client, "http://%s:%d", host, port);
    snprintf(a->peer, sizeof a->peer, "http://%s:%d", host, peer_port);
    snprintf(a->cluster, sizeof a->cluster, "default=%s", a->peer);
    const char *const args[] = {bin,        "--name",
                                "default",  "--data-dir",
                                a->data,    "--listen-client-urls",
                                a->client,  "--advertise-client-urls",
                                a->client,  "--listen-peer-urls",
                                a->peer,    "--initial-advertise-peer-urls",
                                a->peer,    "--initial-cluster",
                                a->cluster, "--log-level",
                                "warn"};
    size_t n = 0;
    for (; n < sizeof args / sizeof args[0]; n++)
        a->argv[n] = (char *)args[n];
    for (size_t i = 0; extra && extra[i] && i < 8; i++)
        a->argv[n++] = (char *)extra[i];
    a->argv[n] = NULL;
}

static int etcd_launch(kvpt_server *s)
{
    const char *bin = kvpt_find_binary("etcd");
    if (!bin) return fail(s, KVPT_SERVER_ABSENT, "etcd not found in PATH or /usr/bin");
    char data[300];
    snprintf(data, sizeof data, "%s/data", s->dir);
    kvpt_etcd_args a;
    kvpt_etcd_args_make(&a, bin, "127.0.0.1", s->port, s->peer_port, data, NULL);
    s->pid = spawn_logged(s, a.argv);
    if (s->pid < 0) return fail(s, KVPT_SERVER_FAILED, "fork: %s", strerror(errno));
    return wait_ready(s, etcd_healthy);
}

/* kvpipe metadata-server as a process of its own, with s->args. */
static int http_cli_launch(kvpt_server *s)
{
    char port[16];
    snprintf(port, sizeof port, "%d", s->port);
    char *argv[40] = {(char *)kvpt_cli(), "metadata-server", "--port", port};
    size_t n = 4;
    for (size_t i = 0; s->args && s->args[i] && n < 39; i++)
        argv[n++] = (char *)s->args[i];
    argv[n] = NULL;
    s->pid = spawn_logged(s, argv);
    if (s->pid < 0) return fail(s, KVPT_SERVER_FAILED, "fork: %s", strerror(errno));
    return wait_ready(s, http_healthy);
}

static int http_launch(kvpt_server *s)
{
    if (s->cli) return http_cli_launch(s);
    kvp_metadata_server *srv;
    kvp_status st = kvp_metadata_server_start("127.0.0.1", s->port, &srv);
    if (st)
        return fail(s, KVPT_SERVER_FAILED, "kvp_metadata_server_start on port %d: %s", s->port,
                    kvp_last_error());
    s->http = srv;
    s->port = kvp_metadata_server_port(srv);
    return KVPT_SERVER_OK;
}

static int make_dir(kvpt_server *s)
{
    snprintf(s->dir, sizeof s->dir, "/tmp/kvpt-%s-XXXXXX", s->kind);
    if (!mkdtemp(s->dir)) {
        s->dir[0] = '\0';
        return fail(s, KVPT_SERVER_FAILED, "mkdtemp: %s", strerror(errno));
    }
    return KVPT_SERVER_OK;
}

static int start(kvpt_server *out, const char *kind, const char *scheme, const char *suffix)
{
    kvpt_server keep = *out; /* the options the caller set */
    memset(out, 0, sizeof *out);
    out->cli = keep.cli;
    out->args = keep.args;
    memcpy(out->password, keep.password, sizeof out->password);
    out->kind = kind;
    out->port = kvpt_free_port();
    snprintf(out->addr, sizeof out->addr, "127.0.0.1:%d", out->port);
    snprintf(out->conn, sizeof out->conn, "%s%s%s", scheme, out->addr, suffix);
    if ((strcmp(kind, "http") != 0 || out->cli) && make_dir(out) != KVPT_SERVER_OK)
        return KVPT_SERVER_FAILED;
    if (strcmp(kind, "etcd") == 0) {
        do
            out->peer_port = kvpt_free_port();
        while (out->peer_port == out->port);
    }
    int rc = kvpt_server_up(out);
    if (rc != KVPT_SERVER_OK) {
        char why[sizeof out->why];
        memcpy(why, out->why, sizeof why);
        kvpt_server_stop(out);
        memcpy(out->why, why, sizeof why);
    }
    return rc;
}

int kvpt_redis_start(kvpt_server *out)
{
    memset(out, 0, sizeof *out);
    return start(out, "redis", "redis://", "");
}

int kvpt_redis_start_auth(kvpt_server *out, const char *password)
{
    memset(out, 0, sizeof *out);
    snprintf(out->password, sizeof out->password, "%s", password);
    return start(out, "redis", "redis://", "");
}

int kvpt_etcd_start(kvpt_server *out)
{
    memset(out, 0, sizeof *out);
    return start(out, "etcd", "etcd://", "");
}

int kvpt_http_start(kvpt_server *out)
{
    memset(out, 0, sizeof *out);
    return start(out, "http", "http://", "/metadata");
}

int kvpt_http_cli_start(kvpt_server *out, const char *const *args)
{
    memset(out, 0, sizeof *out);
    out->cli = 1;
    out->args = args;
    return start(out, "http", "http://", "/metadata");
}

int kvpt_server_up(kvpt_server *s)
{
    if (strcmp(s->kind, "redis") == 0) return redis_launch(s);
    if (strcmp(s->kind, "etcd") == 0) return etcd_launch(s);
    return http_launch(s);
}

void kvpt_server_down(kvpt_server *s)
{
    if (s->http) {
        kvp_metadata_server_stop(s->http);
        s->http = NULL;
    }
    if (s->pid > 0) {
        kill(s->pid, SIGTERM);
        kvpt_wait_child(s->pid, STOP_TIMEOUT_MS); /* SIGKILLs past the bound */
        s->pid = 0;
    }
}

void kvpt_server_kill(kvpt_server *s)
{
    if (s->pid > 0) {
        kill(s->pid, SIGKILL);
        kvpt_wait_child(s->pid, STOP_TIMEOUT_MS);
        s->pid = 0;
    }
    kvpt_server_down(s);
}

int kvpt_server_restart(kvpt_server *s)
{
    kvpt_server_down(s);
    return kvpt_server_up(s);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

void kvpt_server_stop(kvpt_server *s)
{
    if (!s || !s->kind) return;
    kvpt_server_down(s);
    if (s->dir[0]) nftw(s->dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
    s->dir[0] = '\0';
}

static char *responder_reply(void *ctx)
{
    return strdup(ctx);
}

/* The responder runs in a fresh image of this test program (fork, then exec
 * of /proc/self/exe with RESPONDER_ENV set): a child forked from a process
 * with threads may not start threads of its own (ThreadSanitizer refuses). */
#define RESPONDER_ENV "KVPT_RESPONDER" /* "port" */
#define RESPONDER_ENV_REPLY "KVPT_RESPONDER_REPLY"

__attribute__((constructor)) static void responder_entry(void)
{
    const char *spec = getenv(RESPONDER_ENV), *reply = getenv(RESPONDER_ENV_REPLY);
    if (!spec) return;
    int port = atoi(spec);
    kvpi_rpc_server *srv;
    if (!reply || port <= 0 ||
        kvpi_rpc_server_start("127.0.0.1", port, &(kvpi_conn_limits){.timeout_ms = 2000},
                              responder_reply, (void *)reply, &srv)) {
        fprintf(stderr, "  handshake responder on 127.0.0.1:%d: %s\n", port,
                reply && port > 0 ? kvp_last_error() : "no port or reply given");
        _exit(3);
    }
    for (;;)
        pause();
}

/* Fork and exec this program as a responder; its pid, or -1. */
static pid_t responder_spawn(const char *exe, int port, const char *reply)
{
    extern char **environ;
    size_t n = 0;
    while (environ[n])
        n++;
    char **env = calloc(n + 3, sizeof *env);
    if (!env) return -1;
    memcpy(env, environ, n * sizeof *env);
    if (asprintf(&env[n], "%s=%d", RESPONDER_ENV, port) < 0) env[n] = NULL;
    if (asprintf(&env[n + 1], "%s=%s", RESPONDER_ENV_REPLY, reply) < 0) env[n + 1] = NULL;
    pid_t pid = -1;
    if (env[n] && env[n + 1]) {
        fflush(NULL);
        pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            char *argv[] = {(char *)exe, NULL};
            execve(exe, argv, env);
            fprintf(stderr, "  handshake responder: exec %s: %s\n", exe, strerror(errno));
            _exit(127);
        }
    }
    free(env[n]);
    free(env[n + 1]);
    free(env);
    return pid;
}

pid_t kvpt_handshake_responder(int port, const char *reply)
{
    char exe[4096];
    ssize_t exe_len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (exe_len <= 0) return -1;
    exe[exe_len] = '\0';
    /* A responder that exits before it listens has said why on stderr. */
    pid_t pid = responder_spawn(exe, port, reply);
    if (pid < 0) return -1;
    int status = 0;
    for (int waited = 0; waited < 10000; waited += 200) {
        if (kvpt_wait_port("127.0.0.1", port, 200) == 0) return pid;
        if (waitpid(pid, &status, WNOHANG) == pid) {
            fprintf(stderr, "  handshake responder on 127.0.0.1:%d: exited (%s %d)\n", port,
                    WIFSIGNALED(status) ? "signal" : "status",
                    WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
            return -1;
        }
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    fprintf(stderr, "  handshake responder on 127.0.0.1:%d: not listening after 10 s\n", port);
    return -1;
}

void *kvpt_http_store_open(const char *conn, int timeout_ms)
{
    void *s = NULL;
    if (kvpi_store_http.open(conn, timeout_ms, &s) != KVP_OK) {
        fprintf(stderr, "  open %s: %s\n", conn, kvp_last_error());
        return NULL;
    }
    return s;
}
