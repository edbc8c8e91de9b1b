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
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kvpipe/kvpipe.h"

int main(int argc, char **argv)
{
    const char *segment = NULL, *metadata = "P2PHANDSHAKE", *protocol = "tcp", *op = "read";
    size_t block = 4096;
    long count = 5000, warmup = 500;
    int no_shm = 0;
    const bench_opt opts[] = {
        {"segment-id", BENCH_STR, &segment}, {"metadata-server", BENCH_STR, &metadata},
        {"protocol", BENCH_STR, &protocol},  {"operation", BENCH_STR, &op},
        {"block-size", BENCH_SIZE, &block},  {"count", BENCH_LONG, &count},
        {"warmup", BENCH_LONG, &warmup},     {"no-shm", BENCH_FLAG, &no_shm}};
    if (bench_parse(argc, argv, opts, sizeof opts / sizeof opts[0])) return 2;
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
    uint64_t *lat = calloc((size_t)count, sizeof *lat);
    if (!local || !lat) return 1;
    memset(local, 0x33, block);
    for (long i = -warmup; i < count; i++) {
        uint64_t t0 = bench_now_ns();
        kvp_status st = is_read ? kvp_engine_read(e, seg, local, rb.addr, block)
                                : kvp_engine_write(e, seg, local, rb.addr, block);
        if (st) {
            fprintf(stderr, "engine_lat: %s\n", kvp_last_error());
            return 1;
        }
        if (i >= 0) lat[i] = bench_now_ns() - t0;
    }
    bench_print_latency(lat, count);
    printf("\"size\": %zu, \"operation\": \"%s\", \"transport\": \"%s\"}\n", block, op,
           kvp_engine_segment_transport(e, seg));
    free(local);
    free(lat);
    kvp_engine_destroy(e);
    return 0;
}
