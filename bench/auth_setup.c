/* auth_setup: what the authenticated mode adds to setting up a connection.
 *
 * Two target engines in child processes on loopback, one plain and one with
 * the key file given; this process opens --count connections to each TCP
 * data port, in alternating rounds so that both see the same machine: a
 * connection is connect(), the authentication handshake (the authenticated
 * target only), one 8-byte v2 READ and its answer, close(). Prints one JSON
 * line {"plain_us": median, "auth_us": median, "ratio": auth / plain}. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/net.h"
#include "kvpipe/kvpipe.h"
#include "transport/tcp_wire.h"

typedef struct target {
    pid_t pid;
    int ctl; /* closing it stops the child */
    int port;
    uint64_t addr;
} target;

static int start_target(const char *key, target *t)
{
    int up[2], ctl[2];
    if (pipe(up) || pipe(ctl)) return -1;
    fflush(NULL);
    t->pid = fork();
    if (t->pid == 0) {
        close(up[0]);
        close(ctl[1]);
        kvp_engine_opts o;
        kvp_engine_opts_init(&o);
        o.local_server_name = "127.0.0.1:0";
        o.metadata = "P2PHANDSHAKE";
        o.disable_shm = 1;
        o.auth_key_file = key;
        kvp_engine *e;
        static char buf[4096];
        if (kvp_engine_create(&o, &e) || kvp_engine_register(e, buf, sizeof buf)) {
            fprintf(stderr, "auth_setup: target: %s\n", kvp_last_error());
            _exit(1);
        }
        uint64_t msg[2] = {(uint64_t)kvp_engine_data_port(e), (uint64_t)(uintptr_t)buf};
        if (write(up[1], msg, sizeof msg) != (ssize_t)sizeof msg) _exit(1);
        char c;
        while (read(ctl[0], &c, 1) > 0) {
        }
        kvp_engine_destroy(e);
        _exit(0);
    }
    close(up[1]);
    close(ctl[0]);
    uint64_t msg[2];
    int ok = read(up[0], msg, sizeof msg) == (ssize_t)sizeof msg;
    close(up[0]);
    t->ctl = ctl[1];
    t->port = (int)msg[0];
    t->addr = msg[1];
    return ok ? 0 : -1;
}

/* One connection's setup and first request; its time in microseconds, or
 * -1 on failure. */
static double one(const target *t, const kvpi_auth *a)
{
    uint64_t t0 = kvpi_now_ns(), deadline = kvpi_deadline_ns(5000);
    int fd;
    if (kvpi_tcp_connect("127.0.0.1", t->port, 5000, &fd)) return -1;
    uint8_t hdr[KVPI_TCP_HDR_LEN], got[16];
    kvpi_tcp_hdr h = {8, t->addr, KVPI_TCP_OP_READ, 1};
    kvpi_tcp_hdr_encode(&h, hdr);
    kvp_status st = a ? kvpi_auth_client(a, fd, "tcp", deadline) : KVP_OK;
    if (!st) st = kvpi_send_all_by(fd, hdr, sizeof hdr, deadline);
    if (!st) st = kvpi_recv_all_by(fd, got, sizeof got, deadline);
    close(fd);
    if (st || kvpi_tcp_status_decode(got) != KVPI_TCP_STATUS_OK) {
        fprintf(stderr, "auth_setup: %s\n", kvp_last_error());
        return -1;
    }
    return (double)(kvpi_now_ns() - t0) / 1000.0;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    const char *key = NULL;
    int count = 2000;
    static const struct option opts[] = {
        {"key", required_argument, NULL, 'k'}, {"count", required_argument, NULL, 'n'}, {0}};
    for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        if (c == 'k')
            key = optarg;
        else if (c == 'n')
            count = atoi(optarg);
        else
            return 2;
    }
    if (!key || count < 10) {
        fprintf(stderr, "usage: auth_setup --key FILE [--count N]\n");
        return 2;
    }
    kvpi_auth *a;
    if (kvpi_auth_load(key, &a)) {
        fprintf(stderr, "auth_setup: %s\n", kvp_last_error());
        return 1;
    }
    target plain, authed;
    if (start_target("", &plain) || start_target(key, &authed)) return 1;
    double *tp = calloc((size_t)count, sizeof *tp), *ta = calloc((size_t)count, sizeof *ta);
    int n = 0, bad = 0;
    for (int round = 0; n < count && !bad; round++)
        for (int i = 0; i < 50 && n < count; i++, n++) {
            tp[n] = one(&plain, NULL);
            ta[n] = one(&authed, a);
            bad = tp[n] < 0 || ta[n] < 0;
        }
    close(plain.ctl);
    close(authed.ctl);
    waitpid(plain.pid, NULL, 0);
    waitpid(authed.pid, NULL, 0);
    if (bad) return 1;
    qsort(tp, (size_t)n, sizeof *tp, cmp);
    qsort(ta, (size_t)n, sizeof *ta, cmp);
    double mp = tp[n / 2], ma = ta[n / 2];
    printf("{\"connections\": %d, \"plain_us\": %.1f, \"auth_us\": %.1f, \"ratio\": %.2f}\n", n, mp,
           ma, ma / mp);
    free(tp);
    free(ta);
    kvpi_auth_free(a);
    return 0;
}
