/* engine_lat: the latency of one engine READ (or WRITE) at a time, against
 * bench/raw_tcp.c --request.
 *
 *   engine_lat --segment-id H:P [--block-size 4096] [--count N] [--warmup N]
 *              [--operation read|write] [--protocol tcp] [--no-shm]
 *
 * An initiator engine (P2PHANDSHAKE, or --metadata-server) opens the segment
 * of a running target (`kvpipe bench --mode target`) and times kvp_engine_read()
 * of --block-size bytes from its first buffer, one after the other. Prints one
 * JSON line: median, p99, mean and min in microseconds. */
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpipe/kvpipe.h"

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    const char *segment = NULL, *metadata = "P2PHANDSHAKE", *protocol = "tcp", *op = "read";
    size_t block = 4096;
    long count = 5000, warmup = 500;
    int no_shm = 0;
    static const struct option opts[] = {{"segment-id", required_argument, 0, 's'},
                                         {"metadata-server", required_argument, 0, 'm'},
                                         {"protocol", required_argument, 0, 'p'},
                                         {"operation", required_argument, 0, 'o'},
                                         {"block-size", required_argument, 0, 'b'},
                                         {"count", required_argument, 0, 'c'},
                                         {"warmup", required_argument, 0, 'w'},
                                         {"no-shm", no_argument, 0, 'n'},
                                         {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            segment = optarg;
            break;
        case 'm':
            metadata = optarg;
            break;
        case 'p':
            protocol = optarg;
            break;
        case 'o':
            op = optarg;
            break;
        case 'b':
            block = strtoull(optarg, NULL, 10);
            break;
        case 'c':
            count = atol(optarg);
            break;
        case 'w':
            warmup = atol(optarg);
            break;
        case 'n':
            no_shm = 1;
            break;
        default:
            return 2;
        }
    }
    int is_read = strcmp(op, "read") == 0;
    if (!segment || block == 0 || count < 1 || warmup < 0 || (!is_read && strcmp(op, "write"))) {
        fprintf(stderr, "usage: engine_lat --segment-id H:P [--block-size B] [--count N] "
                        "[--warmup N] [--operation read|write] [--protocol P] [--no-shm]\n");
        return 2;
    }
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = "127.0.0.1:0";
    eo.metadata = metadata;
    eo.protocol = protocol;
    eo.disable_shm = no_shm;
    kvp_engine *e;
    kvp_segment_id seg;
    kvp_remote_buffer rb;
    size_t nb = 0;
    if (kvp_engine_create(&eo, &e) || kvp_engine_open_segment(e, segment, &seg) ||
        kvp_engine_segment_buffers(e, seg, &rb, 1, &nb) || nb == 0 || rb.length < block) {
        fprintf(stderr, "engine_lat: %s\n", nb == 0 ? "no buffer of that size" : kvp_last_error());
        return 1;
    }
    char *local = malloc(block);
    double *lat = calloc((size_t)count, sizeof *lat);
    if (!local || !lat) return 1;
    memset(local, 0x33, block);
    for (long i = -warmup; i < count; i++) {
        double t0 = now_us();
        kvp_status st = is_read ? kvp_engine_read(e, seg, local, rb.addr, block)
                                : kvp_engine_write(e, seg, local, rb.addr, block);
        if (st) {
            fprintf(stderr, "engine_lat: %s\n", kvp_last_error());
            return 1;
        }
        if (i >= 0) lat[i] = now_us() - t0;
    }
    double sum = 0;
    for (long i = 0; i < count; i++)
        sum += lat[i];
    qsort(lat, (size_t)count, sizeof *lat, cmp_double);
    printf("{\"median_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f, \"min_us\": %.1f, "
           "\"count\": %ld, \"size\": %zu, \"operation\": \"%s\", \"transport\": \"%s\"}\n",
           lat[count / 2], lat[count * 99 / 100], sum / (double)count, lat[0], count, block, op,
           kvp_engine_segment_transport(e, seg));
    free(local);
    free(lat);
    kvp_engine_destroy(e);
    return 0;
}
