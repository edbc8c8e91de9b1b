#include "bench_util.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

uint64_t bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int bench_parse(int argc, char **argv, const bench_opt *opts, int n)
{
    struct option lo[33] = {{0}};
    char shorts[2 * 32 + 1] = "", *sp = shorts;
    if (n > 32) return -1;
    for (int i = 0; i < n; i++) {
        int arg = opts[i].kind == BENCH_FLAG ? no_argument : required_argument;
        lo[i] = (struct option){opts[i].name, arg, 0, 256 + i};
        if (opts[i].short_name) {
            *sp++ = opts[i].short_name;
            if (arg == required_argument) *sp++ = ':';
        }
    }
    *sp = '\0';
    int c;
    while ((c = getopt_long(argc, argv, shorts, lo, NULL)) != -1) {
        int i = c >= 256 && c < 256 + n ? c - 256 : -1;
        for (int k = 0; k < n && i < 0; k++)
            if (opts[k].short_name && c == opts[k].short_name) i = k;
        if (i < 0) return -1;
        const bench_opt *o = &opts[i];
        switch (o->kind) {
        case BENCH_STR:
            *(const char **)o->to = optarg;
            break;
        case BENCH_LONG:
            *(long *)o->to = atol(optarg);
            break;
        case BENCH_INT:
            *(int *)o->to = atoi(optarg);
            break;
        case BENCH_UINT:
            *(unsigned *)o->to = (unsigned)strtoul(optarg, NULL, 10);
            break;
        case BENCH_SIZE:
            *(size_t *)o->to = strtoull(optarg, NULL, 10);
            break;
        case BENCH_DOUBLE:
            *(double *)o->to = atof(optarg);
            break;
        case BENCH_FLAG:
            *(int *)o->to = 1;
            break;
        }
    }
    return 0;
}

int bench_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

void bench_print_latency(uint64_t *ns, long n)
{
    double sum = 0;
    for (long i = 0; i < n; i++)
        sum += (double)ns[i];
    qsort(ns, (size_t)n, sizeof *ns, bench_cmp_u64);
    printf("{\"median_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f, \"min_us\": %.1f, "
           "\"count\": %ld, ",
           (double)ns[n / 2] / 1e3, (double)ns[n * 99 / 100] / 1e3, sum / (double)n / 1e3,
           (double)ns[0] / 1e3, n);
}

void *bench_zmq_with_child(void *ctx, int type, const char *who,
                           int (*child)(const char *ep, const void *arg), const void *arg,
                           pid_t *pid)
{
    void *s = zmq_socket(ctx, type);
    char ep[64];
    size_t len = sizeof ep;
    if (!s || zmq_bind(s, "tcp://127.0.0.1:*") != 0 ||
        zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len) != 0) {
        fprintf(stderr, "%s: %s\n", who, zmq_strerror(zmq_errno()));
        return NULL;
    }
    *pid = fork();
    if (*pid == 0) _exit(child(ep, arg));
    return s;
}
