/* ucx_auth_setup: what the authenticated mode adds to setting up a ucx link.
 *
 * Two target engines in child processes (P2PHANDSHAKE, shm off), one plain
 * and one with the key file given; this process reads each one's descriptor
 * once, then opens --count links to each through the ucx transport's ops, in
 * alternating rounds so that both see the same machine: a link is a UCP
 * worker and endpoint to the target's worker, the HELLO exchange (plain: one
 * round trip; authenticated: the challenge-response, two), one 8-byte READ
 * and the close. UCX_TLS chooses UCX's transport as usual. Prints one JSON
 * line {"plain_us": median, "auth_us": median, "ratio": auth / plain}. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/clock.h"
#include "engine/descriptor.h"
#include "kvpipe/kvpipe.h"
#include "metadata/metadata.h"
#include "transport/transport.h"

typedef struct target {
    pid_t pid;
    int ctl; /* closing it stops the child */
    int rpc_port;
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
        o.protocol = "rdma";
        o.disable_shm = 1;
        o.auth_key_file = key;
        kvp_engine *e;
        static char buf[4096];
        if (kvp_engine_create(&o, &e) || kvp_engine_register(e, buf, sizeof buf)) {
            fprintf(stderr, "ucx_auth_setup: target: %s\n", kvp_last_error());
            _exit(1);
        }
        int port = kvp_engine_rpc_port(e);
        if (write(up[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(1);
        char c;
        while (read(ctl[0], &c, 1) > 0) {
        }
        kvp_engine_destroy(e);
        _exit(0);
    }
    close(up[1]);
    close(ctl[0]);
    int ok = read(up[0], &t->rpc_port, sizeof t->rpc_port) == (ssize_t)sizeof t->rpc_port;
    close(up[0]);
    t->ctl = ctl[1];
    return ok ? 0 : -1;
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
        fprintf(stderr, "ucx_auth_setup: descriptor: %s\n", kvp_last_error());
        free(text);
        return -1;
    }
    free(text);
    kvpi_region_table_init(&s->regions);
    kvpi_server_ctx sc = {.segment = "ucx_auth_setup", .host = "127.0.0.1",
                          .regions = &s->regions, .auth = a};
    if (ucx->server_start(&sc, &s->server)) {
        fprintf(stderr, "ucx_auth_setup: %s\n", kvp_last_error());
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
static double one(side *s)
{
    uint64_t t0 = kvpi_now_ns();
    kvpi_peer_ctx pc = {.segment = s->desc.name, .host = "127.0.0.1", .desc = s->desc.json,
                        .regions = s->desc.regions, .buffers = s->desc.buffers,
                        .n_regions = s->desc.n_regions, .server = s->server,
                        .timeout_ms = 5000, .auth = s->auth};
    void *peer;
    if (ucx->peer_open(&pc, &peer)) {
        fprintf(stderr, "ucx_auth_setup: %s\n", kvp_last_error());
        return -1;
    }
    char local[8];
    kvpi_slice sl = {.opcode = KVP_OP_READ, .local = local, .remote = s->desc.regions[0].addr,
                     .length = sizeof local, .remote_region = 0};
    kvpi_slice *slices[1] = {&sl};
    kvp_status st = ucx->peer_xfer(peer, slices, 1);
    if (!st) st = sl.status;
    ucx->peer_close(peer);
    if (st) {
        fprintf(stderr, "ucx_auth_setup: READ: %s\n", kvp_strerror(st));
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
    int count = 200;
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
        fprintf(stderr, "usage: ucx_auth_setup --key FILE [--count N]\n");
        return 2;
    }
    if (!(ucx = kvpi_transport_lookup("ucx"))) {
        fprintf(stderr, "ucx_auth_setup: this build has no ucx transport\n");
        return 77;
    }
    kvpi_auth *a;
    if (kvpi_auth_load(key, &a)) {
        fprintf(stderr, "ucx_auth_setup: %s\n", kvp_last_error());
        return 1;
    }
    target plain, authed;
    if (start_target("", &plain) || start_target(key, &authed)) return 1;
    side sp = {0}, sa = {0};
    int bad = side_open(&sp, &plain, NULL) || side_open(&sa, &authed, a);
    double *tp = calloc((size_t)count, sizeof *tp), *ta = calloc((size_t)count, sizeof *ta);
    int n = 0;
    for (int round = 0; n < count && !bad; round++)
        for (int i = 0; i < 10 && n < count; i++, n++) {
            tp[n] = one(&sp);
            ta[n] = one(&sa);
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
    printf("{\"links\": %d, \"UCX_TLS\": \"%s\", \"plain_us\": %.1f, \"auth_us\": %.1f, "
           "\"ratio\": %.2f}\n",
           n, getenv("UCX_TLS") ? getenv("UCX_TLS") : "all", mp, ma, ma / mp);
    free(tp);
    free(ta);
    kvpi_auth_free(a);
    return 0;
}
