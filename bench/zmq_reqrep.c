/* zmq_reqrep: the message-queue baseline for the tensor pipe's ping round
 * trip.
 *
 * A child process runs a REP socket that echoes each message; this process
 * sends --size bytes on a REQ socket over loopback TCP and waits for the
 * echo, --count times after --warmup untimed ones. Prints one JSON line with
 * the round trip's median, p99, mean and min in microseconds. */
#include <getopt.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int echoer(const char *ep)
{
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_REP);
    if (!s || zmq_connect(s, ep) != 0) return 1;
    zmq_msg_t m;
    zmq_msg_init(&m);
    for (;;) {
        if (zmq_msg_recv(&m, s, 0) < 0 || zmq_msg_send(&m, s, 0) < 0) return 0;
    }
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    size_t size = 4096;
    long count = 20000, warmup = 1000;
    static const struct option opts[] = {{"size", required_argument, 0, 's'},
                                         {"count", required_argument, 0, 'c'},
                                         {"warmup", required_argument, 0, 'w'},
                                         {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 's')
            size = strtoull(optarg, NULL, 10);
        else if (c == 'c')
            count = atol(optarg);
        else if (c == 'w')
            warmup = atol(optarg);
        else
            return 2;
    }
    if (count < 1 || warmup < 0) return 2;
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_REQ);
    char ep[64];
    size_t len = sizeof ep;
    if (!s || zmq_bind(s, "tcp://127.0.0.1:*") != 0 ||
        zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len) != 0) {
        fprintf(stderr, "zmq_reqrep: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    pid_t pid = fork();
    if (pid == 0) _exit(echoer(ep));
    char *buf = calloc(1, size ? size : 1);
    uint64_t *rtt = calloc((size_t)count, sizeof *rtt);
    if (!buf || !rtt) return 1;
    zmq_msg_t m;
    zmq_msg_init(&m);
    for (long i = -warmup; i < count; i++) {
        uint64_t t0 = now_ns();
        if (zmq_send(s, buf, size, 0) < 0 || zmq_msg_recv(&m, s, 0) != (int)size) {
            fprintf(stderr, "zmq_reqrep: %s\n", zmq_strerror(zmq_errno()));
            return 1;
        }
        if (i >= 0) rtt[i] = now_ns() - t0;
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    double sum = 0;
    for (long i = 0; i < count; i++)
        sum += (double)rtt[i];
    qsort(rtt, (size_t)count, sizeof *rtt, cmp_u64);
    printf("{\"median_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f, \"min_us\": %.1f, "
           "\"count\": %ld, \"size\": %zu}\n",
           (double)rtt[count / 2] / 1e3, (double)rtt[count * 99 / 100] / 1e3, sum / count / 1e3,
           (double)rtt[0] / 1e3, count, size);
    zmq_msg_close(&m);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return 0;
}
