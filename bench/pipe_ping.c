/* pipe_ping: the tensor pipe's round trip, against bench/zmq_reqrep.c.
 *
 * Two processes on loopback, each one side of a pipe (an embedded HTTP
 * metadata store, as `kvpipe bench --pipe` uses): this one sends a U8 tensor
 * of --size bytes, the other receives it and sends it back, and this one
 * receives the echo and checks every byte; --count times after --warmup
 * untimed ones. One thread per side alternates send and recv, one tensor in
 * flight. Prints one JSON line: the round trip's median, p99, mean and min in
 * microseconds, and the path the pair used ("inline" or "announced", from
 * kvp_pipe_stats). Options: --no-shm, --protocol P, --inline-max-bytes B
 * (0: MooncakePipe's path), --busy-poll-us N, --ack-delay-us N, as
 * kvp_pipe_opts. The echo side runs as this program with --echo JSON (the
 * pipe's config). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "kvpipe/kvpipe.h"
#include "kvpipe/metadata_server.h"
#include "kvpipe/pipe.h"
#include "../tools/pipe_ports.h"

#define RECV_TIMEOUT_MS 30000

typedef struct ping_opts {
    size_t size;
    long count, warmup;
    const char *protocol;
    int no_shm, busy_poll_us;
    long inline_max;       /* < 0: the default */
    long ack_delay;        /* < 0: the default */
    const char *echo_json; /* --echo JSON: be rank 1 of that pipe (the child) */
} ping_opts;

static kvp_pipe *open_side(const char *json, int rank, const ping_opts *o)
{
    kvp_pipe_config *cfg;
    kvp_pipe *p = NULL;
    kvp_status st = kvp_pipe_config_parse(json, strlen(json), &cfg);
    if (st == KVP_OK) {
        kvp_pipe_opts po;
        kvp_pipe_opts_init(&po);
        po.disable_shm = o->no_shm;
        po.busy_poll_us = o->busy_poll_us;
        if (o->ack_delay >= 0) po.ack_delay_us = (int)o->ack_delay;
        if (o->inline_max >= 0) po.inline_max_bytes = (size_t)o->inline_max;
        st = kvp_pipe_open(cfg, 0, rank, &po, &p);
        kvp_pipe_config_free(cfg);
    }
    if (st) fprintf(stderr, "pipe_ping: rank %d: %s\n", rank, kvp_last_error());
    return p;
}

/* Rank 1: echo every tensor until None. */
static int echo(const char *json, const ping_opts *o)
{
    kvp_pipe *p = open_side(json, 1, o);
    if (!p) return 1;
    int rc = 0;
    for (;;) {
        kvp_tensor *t;
        if (kvp_pipe_recv(p, RECV_TIMEOUT_MS, &t) != KVP_OK) {
            fprintf(stderr, "pipe_ping: echo: %s\n", kvp_last_error());
            rc = 1;
            break;
        }
        if (!t) break;
        kvp_status st = kvp_pipe_send(p, t);
        kvp_tensor_free(t);
        if (st) {
            fprintf(stderr, "pipe_ping: echo: %s\n", kvp_last_error());
            rc = 1;
            break;
        }
    }
    if (!rc && kvp_pipe_flush(p, RECV_TIMEOUT_MS) != KVP_OK) rc = 1;
    kvp_pipe_close(p);
    return rc;
}

/* One round trip of tensor t; the echo must hold the bytes of t. */
static int round_trip(kvp_pipe *p, const kvp_tensor *t)
{
    kvp_tensor *back;
    if (kvp_pipe_send(p, t) != KVP_OK || kvp_pipe_recv(p, RECV_TIMEOUT_MS, &back) != KVP_OK) {
        fprintf(stderr, "pipe_ping: %s\n", kvp_last_error());
        return -1;
    }
    int bad = !back || back->nbytes != t->nbytes || memcmp(back->data, t->data, t->nbytes) != 0;
    kvp_tensor_free(back);
    if (bad) fprintf(stderr, "pipe_ping: the echo differs from what was sent\n");
    return bad ? -1 : 0;
}

static int ping(const char *json, const ping_opts *o)
{
    kvp_pipe *p = open_side(json, 0, o);
    if (!p) return 1;
    uint8_t *data = malloc(o->size);
    uint64_t *rtt = calloc((size_t)o->count, sizeof *rtt);
    int rc = data && rtt ? 0 : 1;
    int64_t n = (int64_t)o->size;
    kvp_tensor t;
    for (long i = -o->warmup; i < o->count && !rc; i++) {
        for (size_t k = 0; k < o->size; k++)
            data[k] = (uint8_t)(k * 31 + (uint64_t)i);
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, data);
        uint64_t t0 = bench_now_ns();
        rc = round_trip(p, &t) != 0;
        if (i >= 0) rtt[i] = bench_now_ns() - t0;
    }
    kvp_pipe_stats s;
    kvp_pipe_get_stats(p, &s);
    if (!rc && kvp_pipe_send(p, NULL) != KVP_OK) rc = 1;
    if (!rc && kvp_pipe_flush(p, RECV_TIMEOUT_MS) != KVP_OK) rc = 1;
    if (!rc) {
        /* The path of the timed round trips: every one inline, or none. */
        const char *path =
            s.inline_received >= (uint64_t)o->count && s.inline_sent >= (uint64_t)o->count
                ? "inline"
            : s.inline_sent == 0 ? "announced"
                                 : "mixed";
        bench_print_latency(rtt, o->count);
        printf("\"size\": %zu, \"path\": \"%s\"}\n", o->size, path);
    }
    free(data);
    free(rtt);
    kvp_pipe_close(p);
    return rc;
}

static int parse(int argc, char **argv, ping_opts *o)
{
    *o = (ping_opts){.size = 4096,
                     .count = 5000,
                     .warmup = 500,
                     .protocol = "tcp",
                     .inline_max = -1,
                     .ack_delay = -1};
    const bench_opt opts[] = {{"size", BENCH_SIZE, &o->size},
                              {"count", BENCH_LONG, &o->count},
                              {"warmup", BENCH_LONG, &o->warmup},
                              {"protocol", BENCH_STR, &o->protocol},
                              {"no-shm", BENCH_FLAG, &o->no_shm},
                              {"inline-max-bytes", BENCH_LONG, &o->inline_max},
                              {"busy-poll-us", BENCH_INT, &o->busy_poll_us},
                              {"ack-delay-us", BENCH_LONG, &o->ack_delay},
                              {"echo", BENCH_STR, &o->echo_json}};
    if (bench_parse(argc, argv, opts, sizeof opts / sizeof opts[0])) return -1;
    return o->size == 0 || o->count < 1 || o->warmup < 0 || strlen(o->protocol) > 16 ? -1 : 0;
}

int main(int argc, char **argv)
{
    ping_opts o;
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "usage: pipe_ping [--size B] [--count N] [--warmup N] [--protocol P] "
                        "[--no-shm] [--inline-max-bytes B] [--busy-poll-us N] "
                        "[--ack-delay-us N]\n");
        return 2;
    }
    if (o.echo_json) return echo(o.echo_json, &o);
    kvp_metadata_server *store;
    int base = pick_pipe_base();
    if (base < 0 || kvp_metadata_server_start("127.0.0.1", 0, &store) != KVP_OK) {
        fprintf(stderr, "pipe_ping: no ports or no metadata store: %s\n", kvp_last_error());
        return 1;
    }
    char json[512];
    snprintf(json, sizeof json,
             "{\"prefill_url\":\"127.0.0.1:%d\",\"decode_url\":\"127.0.0.1:%d\","
             "\"metadata_server\":\"http://127.0.0.1:%d/metadata\",\"protocol\":\"%s\"}",
             base, base, kvp_metadata_server_port(store), o.protocol);
    /* The echo side is this program again, executed afresh: a child forked
     * from threads (the store's) may only exec (a lock one of them held,
     * UCX's memory-event lock say, would stay held in the child for ever). */
    char **args = calloc((size_t)argc + 3, sizeof *args);
    if (!args) return 1;
    for (int i = 0; i < argc; i++)
        args[i] = argv[i];
    args[argc] = "--echo";
    args[argc + 1] = json;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    free(args);
    int rc = ping(json, &o);
    int status = 0;
    if (rc) kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    kvp_metadata_server_stop(store);
    return rc || !WIFEXITED(status) || WEXITSTATUS(status) ? 1 : 0;
}
