/* What the engine's metrics cost per request, beside what a request costs.
 *
 * 1. The counting one request does, on both sides: the initiator's (at
 *    submit: the in-flight gauges and the clock, once per batch; at
 *    completion: requests, bytes, the latency histogram, the gauges back) and
 *    the target's (requests and bytes served), run in a loop by THREADS
 *    threads at once on one engine's counters, as the engine's threads do,
 *    against the same loop with the counting left out.
 * 2. Real requests: a target and an initiator engine in this process
 *    (P2PHANDSHAKE on loopback), one thread reading batches of --batch
 *    requests of --block bytes, over tcp and over shm. These requests are
 *    counted as every request is, so their cost includes the counting.
 *
 * Both are process CPU time (CLOCK_PROCESS_CPUTIME_ID: every thread, both
 * engines), so load from other programs on the host adds little.
 *
 *   metrics_cost [--threads N] [--requests N] [--batch N] [--transfers N]
 *                [--block BYTES]
 *
 * Prints one JSON line: {"threads", "cpus", "requests", "batch",
 * "cpu_ns_per_request" (what the counting adds), "counted", "block",
 * "transfers", and per transport ("tcp", "shm") {"cpu_ns_per_request",
 * "wall_ns_per_request", "counting_share"}: counting over the request's CPU
 * time} (docs/metrics.md). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "kvpipe/kvpipe.h"
#include "engine/metrics.h"
#include "transport/transport.h"

static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

typedef struct run {
    kvpi_engine_metrics *m;
    long requests, batch;
    int count; /* 0: the loop alone */
    pthread_barrier_t *start;
    volatile uint64_t sink;
} run;

static void *body(void *arg)
{
    run *r = arg;
    pthread_barrier_wait(r->start);
    uint64_t acc = 0;
    for (long i = 0; i < r->requests; i += r->batch) {
        uint64_t submit = 0;
        if (r->count) {
            submit = kvpi_now_ns();
            kvpi_metrics_submitted(r->m, (size_t)r->batch, (uint64_t)r->batch * 4096);
        }
        /* A worker reads the clock once per group it runs (up to 64 slices). */
        uint64_t done = 0;
        for (long k = 0; k < r->batch; k++) {
            if (r->count && k % 64 == 0) done = kvpi_now_ns();
            if (r->count) {
                kvpi_metrics_request_done(r->m, KVP_OP_READ, 4096, &kvpi_transport_tcp, KVP_OK,
                                          done - submit);
                kvpi_served_add(&r->m->served[0], 0, 4096); /* the target's count */
            }
            acc += (uint64_t)k; /* the loop itself, in both runs */
        }
    }
    r->sink = acc;
    return NULL;
}

static double measure(kvpi_engine_metrics *m, int threads, long requests, long batch, int count)
{
    pthread_t th[64];
    run rs[64];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
    for (int i = 0; i < threads; i++) {
        rs[i] =
            (run){.m = m, .requests = requests, .batch = batch, .count = count, .start = &start};
        pthread_create(&th[i], NULL, body, &rs[i]);
    }
    pthread_barrier_wait(&start);
    uint64_t t0 = cpu_ns();
    for (int i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
    uint64_t ns = cpu_ns() - t0;
    pthread_barrier_destroy(&start);
    return (double)ns;
}

/* ---- real requests ---- */

typedef struct request_cost {
    const char *transport;  /* the one the initiator used */
    double cpu_ns, wall_ns; /* per request */
} request_cost;

static kvp_engine *engine(int no_shm)
{
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = "127.0.0.1:0";
    o.metadata = "P2PHANDSHAKE";
    o.disable_shm = no_shm;
    kvp_engine *e = NULL;
    if (kvp_engine_create(&o, &e) != KVP_OK) {
        fprintf(stderr, "metrics_cost: cannot start an engine: %s\n", kvp_last_error());
        return NULL;
    }
    return e;
}

/* transfers requests of block bytes, READ in batches of batch from target
 * into initiator; best of three. Returns 0 on success. */
static int time_requests(int no_shm, long transfers, long batch, size_t block, request_cost *out)
{
    int rc = 1;
    kvp_engine *target = engine(no_shm), *init = engine(no_shm);
    void *remote = NULL, *local = NULL;
    kvp_request *reqs = calloc((size_t)batch, sizeof *reqs);
    kvp_segment_id seg;
    size_t bytes = (size_t)batch * block;
    if (!target || !init || !reqs || kvp_engine_alloc(target, bytes, &remote) ||
        kvp_engine_alloc(init, bytes, &local) ||
        kvp_engine_open_segment(init, kvp_engine_segment_name(target), &seg)) {
        fprintf(stderr, "metrics_cost: cannot set up the transfers: %s\n", kvp_last_error());
        goto out;
    }
    memset(remote, 1, bytes);
    memset(local, 0, bytes);
    for (long k = 0; k < batch; k++)
        reqs[k] = (kvp_request){.opcode = KVP_OP_READ,
                                .local = (char *)local + (size_t)k * block,
                                .remote = (uint64_t)(uintptr_t)remote + (uint64_t)k * block,
                                .length = block};
    double best_cpu = 1e30, best_wall = 1e30;
    long batches = (transfers + batch - 1) / batch;
    for (int round = -1; round < 3; round++) { /* round -1: warm-up */
        uint64_t c0 = cpu_ns(), w0 = kvpi_now_ns();
        for (long i = 0; i < (round < 0 ? 16 : batches); i++) {
            kvp_batch *b = NULL;
            kvp_status st = kvp_batch_submit(init, seg, reqs, (size_t)batch, &b);
            if (st == KVP_OK) st = kvp_batch_wait(b, -1);
            kvp_batch_free(b);
            if (st) {
                fprintf(stderr, "metrics_cost: a transfer failed: %s\n", kvp_last_error());
                goto out;
            }
        }
        double n = (double)(batches * batch);
        double c = (double)(cpu_ns() - c0) / n, w = (double)(kvpi_now_ns() - w0) / n;
        if (round >= 0 && c < best_cpu) best_cpu = c;
        if (round >= 0 && w < best_wall) best_wall = w;
    }
    const char *tr = kvp_engine_segment_transport(init, seg);
    *out = (request_cost){.transport = tr ? tr : "?", .cpu_ns = best_cpu, .wall_ns = best_wall};
    rc = 0;
out:
    free(reqs);
    if (local) kvp_engine_free(init, local);
    if (remote) kvp_engine_free(target, remote);
    kvp_engine_destroy(init);
    kvp_engine_destroy(target);
    return rc;
}

int main(int argc, char **argv)
{
    int threads = 4;
    long requests = 2000000, batch = 128, transfers = 65536;
    size_t block = 4096;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--requests"))
            requests = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch"))
            batch = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--transfers"))
            transfers = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--block"))
            block = (size_t)atol(argv[i + 1]);
        else {
            fprintf(stderr, "usage: metrics_cost [--threads N] [--requests N] [--batch N] "
                            "[--transfers N] [--block BYTES]\n");
            return 2;
        }
    }
    if (threads < 1 || threads > 64 || requests < 1 || batch < 1 || batch > 4096 || transfers < 1 ||
        block < 1 || block > (64u << 20)) {
        fprintf(stderr, "metrics_cost: --threads 1..64, --requests and --transfers >= 1, "
                        "--batch 1..4096, --block 1..64M\n");
        return 2;
    }
    kvpi_engine_metrics *m = calloc(1, sizeof *m);
    if (!m) return 1;
    /* Best of three each: other load only ever adds time. */
    double with = 1e30, without = 1e30;
    for (int k = 0; k < 3; k++) {
        double w = measure(m, threads, requests, batch, 1);
        double wo = measure(m, threads, requests, batch, 0);
        if (w < with) with = w;
        if (wo < without) without = wo;
    }
    uint64_t counted = 0;
    for (int k = 0; k < KVPI_METRIC_SHARDS; k++)
        for (int t = 0; t < KVPI_TRANSPORTS_MAX; t++)
            counted += kvpi_histogram_merge(&(kvpi_histogram){0}, &m->shards[k].latency[0][t]);
    /* The CPU time the counting added, over every thread's requests. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    double per = (with - without) / ((double)threads * (double)requests);
    free(m);
    request_cost rq[2];
    if (time_requests(1, transfers, batch, block, &rq[0]) ||
        time_requests(0, transfers, batch, block, &rq[1]))
        return 1;
    printf("{\"threads\": %d, \"cpus\": %ld, \"requests\": %ld, \"batch\": %ld, "
           "\"cpu_ns_per_request\": %.1f, \"counted\": %llu, \"block\": %zu, "
           "\"transfers\": %ld",
           threads, cpus, requests, batch, per, (unsigned long long)counted, block, transfers);
    for (int i = 0; i < 2; i++)
        printf(", \"%s\": {\"cpu_ns_per_request\": %.1f, \"wall_ns_per_request\": %.1f, "
               "\"counting_share\": %.4f}",
               rq[i].transport, rq[i].cpu_ns, rq[i].wall_ns, per / rq[i].cpu_ns);
    printf("}\n");
    return 0;
}
