/* zmq_pushpull: the message-queue baseline for the tensor pipe's small
 * tensors.
 *
 * A child process PUSHes messages of --size bytes (each built from a buffer
 * and sent, as a producer would) as fast as ZeroMQ takes them; this process
 * PULLs them over loopback TCP (the path the pipe's control plane uses) for
 * --duration seconds, touching the first byte of each. Default socket options,
 * one I/O thread per side. Prints one JSON line {"msgs_per_s": ..., "gbps":
 * ..., ...}; gbps is decimal GB/s of payload. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench_util.h"

static double now(void)
{
    return (double)bench_now_ns() / 1e9;
}

static int pusher(const char *ep, const void *arg)
{
    size_t size = *(const size_t *)arg;
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_PUSH);
    if (!s || zmq_connect(s, ep) != 0) return 1;
    char *buf = malloc(size ? size : 1);
    if (!buf) return 1;
    memset(buf, 0x5a, size);
    for (uint64_t i = 0;; i++) {
        if (size >= 8) memcpy(buf, &i, 8);
        if (zmq_send(s, buf, size, 0) < 0) return 0;
    }
}

int main(int argc, char **argv)
{
    size_t size = 4096;
    double duration = 3;
    const bench_opt opts[] = {{"size", BENCH_SIZE, &size}, {"duration", BENCH_DOUBLE, &duration}};
    if (bench_parse(argc, argv, opts, sizeof opts / sizeof opts[0])) return 2;
    if (!(duration > 0)) return 2;
    void *ctx = zmq_ctx_new();
    pid_t pid;
    void *s = bench_zmq_with_child(ctx, ZMQ_PULL, "zmq_pushpull", pusher, &size, &pid);
    if (!s) return 1;
    zmq_msg_t m;
    zmq_msg_init(&m);
    /* The clock starts at the first message: connecting is not timed. */
    if (zmq_msg_recv(&m, s, 0) < 0) return 1;
    uint64_t msgs = 0, sum = 0;
    double start = now(), end = start + duration, t = start;
    while (t < end) {
        for (int k = 0; k < 256; k++) {
            if (zmq_msg_recv(&m, s, 0) < 0) return 1;
            sum += *(const uint8_t *)zmq_msg_data(&m);
            msgs++;
        }
        t = now();
    }
    double secs = t - start;
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    zmq_msg_close(&m);
    printf("{\"msgs_per_s\": %.0f, \"gbps\": %.4f, \"msgs\": %llu, \"seconds\": %.3f, \"size\": "
           "%zu, \"check\": %llu}\n",
           (double)msgs / secs, (double)msgs * (double)size / secs / 1e9, (unsigned long long)msgs,
           secs, size, (unsigned long long)(sum & 0xff));
    zmq_close(s);
    zmq_ctx_term(ctx);
    return 0;
}
