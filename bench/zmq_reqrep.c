/* zmq_reqrep: the message-queue baseline for the tensor pipe's ping round
 * trip.
 *
 * A child process runs a REP socket that echoes each message; this process
 * sends --size bytes on a REQ socket over loopback TCP and waits for the
 * echo, --count times after --warmup untimed ones. Prints one JSON line with
 * the round trip's median, p99, mean and min in microseconds. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench_util.h"

static int echoer(const char *ep, const void *arg)
{
    (void)arg;
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_REP);
    if (!s || zmq_connect(s, ep) != 0) return 1;
    zmq_msg_t m;
    zmq_msg_init(&m);
    for (;;) {
        if (zmq_msg_recv(&m, s, 0) < 0 || zmq_msg_send(&m, s, 0) < 0) return 0;
    }
}

int main(int argc, char **argv)
{
    size_t size = 4096;
    long count = 20000, warmup = 1000;
    const bench_opt opts[] = {{"size", BENCH_SIZE, &size},
                              {"count", BENCH_LONG, &count},
                              {"warmup", BENCH_LONG, &warmup}};
    if (bench_parse(argc, argv, opts, sizeof opts / sizeof opts[0])) return 2;
    if (count < 1 || warmup < 0) return 2;
    void *ctx = zmq_ctx_new();
    pid_t pid;
    void *s = bench_zmq_with_child(ctx, ZMQ_REQ, "zmq_reqrep", echoer, NULL, &pid);
    if (!s) return 1;
    char *buf = calloc(1, size ? size : 1);
    uint64_t *rtt = calloc((size_t)count, sizeof *rtt);
    if (!buf || !rtt) return 1;
    zmq_msg_t m;
    zmq_msg_init(&m);
    for (long i = -warmup; i < count; i++) {
        uint64_t t0 = bench_now_ns();
        if (zmq_send(s, buf, size, 0) < 0 || zmq_msg_recv(&m, s, 0) != (int)size) {
            fprintf(stderr, "zmq_reqrep: %s\n", zmq_strerror(zmq_errno()));
            return 1;
        }
        if (i >= 0) rtt[i] = bench_now_ns() - t0;
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    bench_print_latency(rtt, count);
    printf("\"size\": %zu}\n", size);
    zmq_msg_close(&m);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return 0;
}
