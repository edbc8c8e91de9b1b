/* auth_setup: what the authenticated mode adds to setting up a connection
 * (--transport tcp, the default) or a ucx link (--transport ucx).
 *
 * Two target engines in child processes (P2PHANDSHAKE, shm off), one plain
 * and one with the key file given; this process opens --count connections
 * (or links) to each, in alternating rounds so that both see the same
 * machine, and times each:
 *   tcp: connect() to the TCP data port, the authentication handshake (the
 *        authenticated target only), one 8-byte v2 READ and its answer,
 *        close();
 *   ucx: the target's descriptor is read once; a link is a UCP worker and
 *        endpoint to the target's worker through the ucx transport's ops,
 *        the HELLO exchange (plain: one round trip; authenticated: the
 *        challenge-response, two), one 8-byte READ and the close. UCX_TLS
 *        chooses UCX's transport as usual; exits 77 in a build without ucx.
 * Prints one JSON line {"transport", "count", "plain_us": median, "auth_us":
 * median, "ratio": auth / plain} (ucx: with "UCX_TLS"). */
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
#include "engine/descriptor.h"
#include "kvpipe/kvpipe.h"
#include "metadata/metadata.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

typedef struct target {
    pid_t pid;
    int ctl; /* closing it stops the child */
    int port, rpc_port;
    uint64_t addr;
} target;

/* A target engine serving protocol ("tcp" or "rdma") with key (empty: plain). */
static int start_target(const char *key, const char *protocol, target *t)
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
        o.protocol = protocol;
        o.disable_shm = 1;
        o.auth_key_file = key;
        kvp_engine *e;
        static char buf[4096];
        if (kvp_engine_create(&o, &e) || kvp_engine_register(e, buf, sizeof buf)) {
            fprintf(stderr, "auth_setup: target: %s\n", kvp_last_error());
            _exit(1);
        }
        uint64_t msg[3] = {(uint64_t)kvp_engine_data_port(e), (uint64_t)kvp_engine_rpc_port(e),
                           (uint64_t)(uintptr_t)buf};
        if (write(up[1], msg, sizeof msg) != (ssize_t)sizeof msg) _exit(1);
        char c;
        while (read(ctl[0], &c, 1) > 0) {
        }
        kvp_engine_destroy(e);
        _exit(0);
    }
    close(up[1]);
    close(ctl[0]);
    uint64_t msg[3];
    int ok = read(up[0], msg, sizeof msg) == (ssize_t)sizeof msg;
    close(up[0]);
    t->ctl = ctl[1];
    t->port = (int)msg[0];
    t->rpc_port = (int)msg[1];
    t->addr = msg[2];
    return ok ? 0 : -1;
}

/* One connection's setup and first request; its time in microseconds, or
 * -1 on failure. */
static double tcp_one(const target *t, const kvpi_auth *a)
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

/* What a link to one target needs: its descriptor and a local ucx server
 * in the target's mode. */
typedef struct side {
    const kvpi_auth *auth;
    kvpi_descriptor desc;
    kvpi_region_table regions;
    void *server;
} side;

static const kvpi_transport_ops *ucx;

static int side_open(side *s, const target *t, const kvpi_auth *a)
{
    char *text = NULL;
    s->auth = a;
    if (kvpi_rpc_call_auth("127.0.0.1", t->rpc_port, a, KVPI_RPC_METADATA, "{}", 5000, &text) ||
        kvpi_descriptor_parse(text, &s->desc)) {
        fprintf(stderr, "auth_setup: descriptor: %s\n", kvp_last_error());
        free(text);
        return -1;
    }
    free(text);
    kvpi_region_table_init(&s->regions);
    kvpi_server_ctx sc = {
        .segment = "auth_setup", .host = "127.0.0.1", .regions = &s->regions, .auth = a};
    if (ucx->server_start(&sc, &s->server)) {
        fprintf(stderr, "auth_setup: %s\n", kvp_last_error());
        return -1;
    }
    return 0;
}

static void side_close(side *s)
{
    ucx->server_stop(s->server);
    kvpi_region_table_destroy(&s->regions);
    kvpi_descriptor_free(&s->desc);
}

/* One link's setup and first READ; its time in microseconds, or -1. */
static double ucx_one(side *s)
{
    uint64_t t0 = kvpi_now_ns();
    kvpi_peer_ctx pc = {.segment = s->desc.name,
                        .host = "127.0.0.1",
                        .desc = s->desc.json,
                        .regions = s->desc.regions,
                        .buffers = s->desc.buffers,
                        .n_regions = s->desc.n_regions,
                        .server = s->server,
                        .timeout_ms = 5000,
                        .auth = s->auth};
    void *peer;
    if (ucx->peer_open(&pc, &peer)) {
        fprintf(stderr, "auth_setup: %s\n", kvp_last_error());
        return -1;
    }
    char local[8];
    kvpi_slice sl = {.opcode = KVP_OP_READ,
                     .local = local,
                     .remote = s->desc.regions[0].addr,
                     .length = sizeof local,
                     .remote_region = 0};
    kvpi_slice *slices[1] = {&sl};
    kvp_status st = kvpi_transport_xfer_sync(ucx, peer, slices, 1);
    if (!st) st = sl.status;
    ucx->peer_close(peer);
    if (st) {
        fprintf(stderr, "auth_setup: READ: %s\n", kvp_strerror(st));
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
    const char *key = NULL, *transport = "tcp";
    int count = 0;
    static const struct option opts[] = {{"key", required_argument, NULL, 'k'},
                                         {"count", required_argument, NULL, 'n'},
                                         {"transport", required_argument, NULL, 't'},
                                         {0}};
    for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        if (c == 'k')
            key = optarg;
        else if (c == 'n')
            count = atoi(optarg);
        else if (c == 't')
            transport = optarg;
        else
            return 2;
    }
    int over_ucx = strcmp(transport, "ucx") == 0;
    if (!count) count = over_ucx ? 200 : 2000;
    if (!key || count < 10 || (!over_ucx && strcmp(transport, "tcp") != 0)) {
        fprintf(stderr, "usage: auth_setup --key FILE [--count N] [--transport tcp|ucx]\n");
        return 2;
    }
    if (over_ucx && !(ucx = kvpi_transport_lookup("ucx"))) {
        fprintf(stderr, "auth_setup: this build has no ucx transport\n");
        return 77;
    }
    kvpi_auth *a;
    if (kvpi_auth_load(key, &a)) {
        fprintf(stderr, "auth_setup: %s\n", kvp_last_error());
        return 1;
    }
    const char *protocol = over_ucx ? "rdma" : "tcp";
    target plain, authed;
    if (start_target("", protocol, &plain) || start_target(key, protocol, &authed)) return 1;
    side sp = {0}, sa = {0};
    int bad = over_ucx && (side_open(&sp, &plain, NULL) || side_open(&sa, &authed, a));
    double *tp = calloc((size_t)count, sizeof *tp), *ta = calloc((size_t)count, sizeof *ta);
    /* Rounds of a few of each: a ucx link takes milliseconds, a connection
     * tens of microseconds. */
    int n = 0, per_round = over_ucx ? 10 : 50;
    while (n < count && !bad)
        for (int i = 0; i < per_round && n < count; i++, n++) {
            tp[n] = over_ucx ? ucx_one(&sp) : tcp_one(&plain, NULL);
            ta[n] = over_ucx ? ucx_one(&sa) : tcp_one(&authed, a);
            bad = tp[n] < 0 || ta[n] < 0;
        }
    if (sp.server) side_close(&sp);
    if (sa.server) side_close(&sa);
    close(plain.ctl);
    close(authed.ctl);
    waitpid(plain.pid, NULL, 0);
    waitpid(authed.pid, NULL, 0);
    if (bad) return 1;
    qsort(tp, (size_t)n, sizeof *tp, cmp);
    qsort(ta, (size_t)n, sizeof *ta, cmp);
    double mp = tp[n / 2], ma = ta[n / 2];
    const char *tls = getenv("UCX_TLS");
    printf("{\"transport\": \"%s\", \"count\": %d", transport, n);
    if (over_ucx) printf(", \"UCX_TLS\": \"%s\"", tls ? tls : "all");
    printf(", \"plain_us\": %.1f, \"auth_us\": %.1f, \"ratio\": %.2f}\n", mp, ma, ma / mp);
    free(tp);
    free(ta);
    kvpi_auth_free(a);
    return 0;
}
