/* kvpipe's HTTP metadata store under slow and hostile clients (issue 11, item
 * 5): connections that trickle an unfinished request must not keep others
 * from being answered.
 *
 * Three processes per case: the store (`kvpipe metadata-server`), an attacker
 * (a child of the case holding hundreds of unfinished requests, each sending
 * one more header byte now and then, from addresses of its own in 127/8), and
 * the case itself as the legitimate client, whose GETs must each be answered
 * within a bound far above a normal answer (milliseconds) and below what the
 * attack costs without the protections (the whole attack).
 *
 * On efddc24 (before the limits), slowloris_one_address failed: 520
 * unfinished requests filled the server's 512 connections, and none of the
 * 10 legitimate GETs was answered within its 3 s timeout. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"

#define LEGIT_GETS 10

/* ---- the attacker ---- */

typedef struct attack {
    int get_timeout_ms; /* bound on each legitimate GET, connect included */
    int port;           /* the store's */
    int conns;          /* connections per source address */
    int addrs;          /* source addresses 127.0.0.2, 127.0.0.3, ... */
    int trickle_ms;     /* one more header byte on each connection this often */
} attack;

static int connect_from(const char *src, int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, src, &a.sin_addr);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        connect(fd, (struct sockaddr *)&to, sizeof to) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The attacker process: open every connection, send the start of a request,
 * say so on ready_fd, then trickle one header byte per connection per period
 * until killed. A connection the server closed is not reopened. */
static void attacker_main(const attack *a, int ready_fd)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGPIPE, SIG_IGN);
    int n = a->conns * a->addrs;
    int *fds = calloc((size_t)n, sizeof *fds);
    if (!fds) _exit(2);
    for (int i = 0; i < n; i++) {
        char src[32];
        snprintf(src, sizeof src, "127.0.0.%d", 2 + i / a->conns);
        fds[i] = connect_from(src, a->port);
        if (fds[i] >= 0) send(fds[i], "GET /metadata?key=slow", 22, MSG_NOSIGNAL);
    }
    if (write(ready_fd, "R", 1) != 1) _exit(2);
    for (;;) {
        usleep((useconds_t)a->trickle_ms * 1000);
        for (int i = 0; i < n; i++)
            if (fds[i] >= 0 && send(fds[i], "x", 1, MSG_NOSIGNAL) != 1) {
                close(fds[i]);
                fds[i] = -1;
            }
    }
}

static pid_t attacker_start(const attack *a)
{
    int p[2];
    if (pipe(p) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(p[0]);
        attacker_main(a, p[1]);
    }
    close(p[1]);
    char c;
    ssize_t got = read(p[0], &c, 1); /* every connection is open */
    close(p[0]);
    if (got != 1) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    usleep(300 * 1000); /* let the server take in what it will */
    return pid;
}

static void attacker_stop(pid_t pid)
{
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

/* ---- the legitimate client ---- */

/* LEGIT_GETS GETs, each on a fresh connection (a new client), each bounded by
 * GET_TIMEOUT_MS; returns how many were answered, and the slowest in *worst. */
static int legit_gets(const char *conn, int timeout_ms, uint64_t *worst)
{
    int ok = 0;
    *worst = 0;
    for (int i = 0; i < LEGIT_GETS; i++) {
        uint64_t t0 = kvpi_now_ms();
        void *s = NULL;
        kvp_status st = kvpi_store_http.open(conn, timeout_ms, &s);
        char *v = NULL;
        if (st == KVP_OK) st = kvpi_store_http.get(s, "mooncake/ram/legit", &v);
        uint64_t took = kvpi_now_ms() - t0;
        if (took > *worst) *worst = took;
        if (st == KVP_OK && v && strcmp(v, "{\"ok\":true}") == 0)
            ok++;
        else
            fprintf(stderr, "  GET %d after %llu ms: %s\n", i, (unsigned long long)took,
                    kvp_last_error());
        free(v);
        if (s) kvpi_store_http.close(s);
    }
    return ok;
}

static int seed(const char *conn)
{
    void *s = NULL;
    if (kvpi_store_http.open(conn, 3000, &s) != KVP_OK) return -1;
    kvp_status st = kvpi_store_http.put(s, "mooncake/ram/legit", "{\"ok\":true}");
    kvpi_store_http.close(s);
    return st == KVP_OK ? 0 : -1;
}

static void run_attack(const char *const *server_args, const attack *a)
{
    kvpt_server srv;
    if (kvpt_http_cli_start(&srv, server_args) != KVPT_SERVER_OK) {
        fprintf(stderr, "  cannot start the store: %s\n", srv.why);
        kvpt_failures++;
        return;
    }
    attack at = *a;
    at.port = srv.port;
    REQUIRE(seed(srv.conn) == 0);
    pid_t attacker = attacker_start(&at);
    CHECK(attacker > 0);
    uint64_t worst = 0;
    int answered = attacker > 0 ? legit_gets(srv.conn, at.get_timeout_ms, &worst) : 0;
    fprintf(stderr, "  %d unfinished requests: %d of %d GETs answered, slowest %llu ms\n",
            at.conns * at.addrs, answered, LEGIT_GETS, (unsigned long long)worst);
    CHECK(answered == LEGIT_GETS);
    if (attacker > 0) attacker_stop(attacker);
    /* The store is whole afterwards. */
    CHECK(legit_gets(srv.conn, at.get_timeout_ms, &worst) == LEGIT_GETS);
    kvpt_server_stop(&srv);
}

/* The case of the issue: 520 unfinished requests from one address, with the
 * default limits. The per-address limit (256) keeps them from taking every
 * connection; the rest wait outside, and legitimate clients are served. */
static void slowloris_one_address(void)
{
    attack a = {.get_timeout_ms = 3000, .conns = 520, .addrs = 1, .trickle_ms = 2000};
    run_attack(NULL, &a);
}

/* Unfinished requests from many addresses fill every connection (64): only
 * the request deadline (2 s) frees them, however steadily each trickles
 * (every 300 ms, well inside the idle timeout), and legitimate clients get
 * the connections it frees. */
static void slowloris_many_addresses(void)
{
    static const char *const args[] = {"--max-connections",
                                       "64",
                                       "--max-connections-per-ip",
                                       "32",
                                       "--request-timeout",
                                       "2",
                                       "--idle-timeout",
                                       "30",
                                       NULL};
    /* The first GET waits for one deadline (about 2 s): bound it at 8 s. */
    attack a = {.get_timeout_ms = 8000, .conns = 24, .addrs = 4, .trickle_ms = 300};
    run_attack(args, &a);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(slowloris_one_address, 120);
    RUN_T(slowloris_many_addresses, 120);
    return kvpt_summary();
}
