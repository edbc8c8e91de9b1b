/* What the engine's metrics cost per request: the counting a transfer request
 * does (at submit: the in-flight gauges and the clock, once per batch; at
 * completion: requests, bytes, the latency histogram, the gauges back) run
 * in a loop by THREADS threads at once on one engine's counters, as the
 * engine's workers do, against the same loop with the counting left out.
 *
 *   metrics_cost [--threads N] [--requests N] [--batch N]
 *
 * Prints one JSON line: {"threads", "cpus", "requests", "batch",
 * "cpu_ns_per_request", "counted"}: the CPU time the counting adds to one
 * request. Set beside a request's CPU time in `kvpipe bench` it gives the
 * share of the counting (docs/metrics.md). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "engine/metrics.h"
#include "transport/transport.h"

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
            if (r->count)
                kvpi_metrics_request_done(r->m, KVP_OP_READ, 4096, &kvpi_transport_tcp, KVP_OK,
                                          done - submit);
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
    uint64_t t0 = kvpi_now_ns();
    for (int i = 0; i < threads; i++)
        pthread_join(th[i], NULL);
    uint64_t ns = kvpi_now_ns() - t0;
    pthread_barrier_destroy(&start);
    return (double)ns;
}

int main(int argc, char **argv)
{
    int threads = 4;
    long requests = 2000000, batch = 128;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--requests"))
            requests = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch"))
            batch = atol(argv[i + 1]);
        else {
            fprintf(stderr, "usage: metrics_cost [--threads N] [--requests N] [--batch N]\n");
            return 2;
        }
    }
    if (threads < 1 || threads > 64 || requests < 1 || batch < 1) {
        fprintf(stderr, "metrics_cost: --threads 1..64, --requests and --batch >= 1\n");
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
        counted += kvpi_counter_get(&m->shards[k].requests[0][1]);
    /* CPU time per request: the wall time the counting added, times the cores
     * the threads ran on, over every thread's requests. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    double busy = (double)(threads < cpus ? threads : cpus);
    double per = (with - without) * busy / ((double)threads * (double)requests);
    printf("{\"threads\": %d, \"cpus\": %ld, \"requests\": %ld, \"batch\": %ld, "
           "\"cpu_ns_per_request\": %.1f, \"counted\": %llu}\n",
           threads, cpus, requests, batch, per, (unsigned long long)counted);
    free(m);
    return 0;
}
