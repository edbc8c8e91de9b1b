/* raw_tcp: the loopback TCP baselines for `kvpipe bench`.
 *
 * Stream (the default): a sender process streams blocks of --block-size
 * bytes over one plain TCP connection to a receiver that recv()s them, for
 * --duration seconds: what the kernel can move with no protocol at all.
 * --streams N: N connections at once, each with a sending thread and a
 * receiving thread of its own (memory of its own too), summed: the baseline
 * of an engine moving with N initiator threads.
 * Each stream first moves --warmup-bytes (default 256 MiB) untimed, so that
 * TCP has opened its window and the kernel has grown the socket buffers
 * (autotuned: neither side sets them) before the receiver's clock starts;
 * without it a 3 s run on loopback measured about half of what the same
 * stream reaches. The receiver takes whatever arrived, up to a block per
 * recv(), as a plain stream reader does.
 * By default both sides use one block of memory over and over, which stays
 * in the CPU's caches; --send-span and --recv-span make each side walk
 * through that many bytes of memory block by block instead, as an engine
 * serving and filling real buffers does (kvpipe bench's target serves its
 * --buffer-size, its initiator fills batch-size x block-size). Prints one
 * JSON line {"gbps": ..., "bytes": ...}; gbps is decimal GB/s.
 *
 * Request/response (--request): the client sends a 24-byte request and the
 * server answers with --block-size bytes, one at a time, --count times after
 * --warmup: the round trip a one-sided READ of that size cannot beat. Prints
 * {"median_us": ..., "p99_us": ..., ...}. */
#include <arpa/inet.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct raw_opts {
    size_t block, send_span, recv_span, warmup_bytes;
    double duration;
    int request, streams;
    long count, warmup;
} raw_opts;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A connection to port; nodelay for request/response (as the engine's
 * sockets), the stream as it always was. */
static int connect_to(int port, int nodelay)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (nodelay) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof nodelay);
    return connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0 ? fd : -1;
}

static int send_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int recv_all(int fd, char *p, size_t n)
{
    while (n > 0) {
        ssize_t k = recv(fd, p, n, 0);
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Memory of span bytes, touched once (no page faults while timed). */
static char *span_alloc(size_t span, int byte)
{
    char *buf = malloc(span);
    if (buf) memset(buf, byte, span);
    return buf;
}

/* The block after off in a span of whole blocks. */
static size_t next_block(size_t off, const raw_opts *o, size_t span)
{
    off += o->block;
    return off + o->block > span ? 0 : off;
}

/* One stream's end: its thread, memory and connection. */
typedef struct stream_end {
    const raw_opts *o;
    int port, fd;
    char *buf;
    double start, end; /* receiver: the clock */
    uint64_t bytes;
    int failed;
} stream_end;

/* Each side touches its memory before the connection is made, so that the
 * receiver's clock, which starts once every stream is accepted, times only
 * the transfer. */
static void *send_stream(void *arg)
{
    stream_end *e = arg;
    const raw_opts *o = e->o;
    e->buf = span_alloc(o->send_span, 0x5a);
    e->fd = e->buf ? connect_to(e->port, 0) : -1;
    if (e->fd < 0) {
        e->failed = 1;
        return NULL;
    }
    for (size_t off = 0;; off = next_block(off, o, o->send_span))
        if (send_all(e->fd, e->buf + off, o->block) != 0) return NULL; /* the receiver is done */
}

static int stream_sender(int port, const raw_opts *o)
{
    stream_end *e = calloc((size_t)o->streams, sizeof *e);
    pthread_t *t = calloc((size_t)o->streams, sizeof *t);
    if (!e || !t) return 1;
    for (int i = 0; i < o->streams; i++) {
        e[i] = (stream_end){.o = o, .port = port};
        if (pthread_create(&t[i], NULL, send_stream, &e[i])) return 1;
    }
    int failed = 0;
    for (int i = 0; i < o->streams; i++) {
        pthread_join(t[i], NULL);
        failed |= e[i].failed;
    }
    return failed;
}

/* What arrives, up to a block per recv(), walking the span; until the clock
 * passes e->end, or n bytes when n is not 0. */
static int recv_for(stream_end *e, uint64_t n)
{
    const raw_opts *o = e->o;
    size_t off = 0, in = 0; /* the block being filled, and how far */
    for (uint64_t got = 0; n ? got < n : now() < e->end;) {
        size_t want = o->block - in;
        if (n && n - got < want) want = (size_t)(n - got);
        ssize_t k = recv(e->fd, e->buf + off + in, want, 0);
        if (k <= 0) {
            perror("raw_tcp: recv");
            return -1;
        }
        got += (uint64_t)k;
        if (!n) e->bytes += (uint64_t)k;
        if ((in += (size_t)k) == o->block) {
            in = 0;
            off = next_block(off, o, o->recv_span);
        }
    }
    return 0;
}

static pthread_barrier_t warm; /* every stream warmed up; then the clock */

static void *recv_stream(void *arg)
{
    stream_end *e = arg;
    e->failed = recv_for(e, e->o->warmup_bytes) != 0;
    pthread_barrier_wait(&warm);
    pthread_barrier_wait(&warm); /* the clock is set */
    if (!e->failed && recv_for(e, 0) != 0) e->failed = 1;
    return NULL;
}

static int stream(int lfd, int port, const raw_opts *o)
{
    pid_t pid = fork();
    if (pid == 0) _exit(stream_sender(port, o));
    stream_end *e = calloc((size_t)o->streams, sizeof *e);
    pthread_t *t = calloc((size_t)o->streams, sizeof *t);
    if (!e || !t) return 1;
    for (int i = 0; i < o->streams; i++) {
        e[i] = (stream_end){.o = o, .buf = span_alloc(o->recv_span, 0)};
        e[i].fd = e[i].buf ? accept(lfd, NULL, NULL) : -1;
        if (e[i].fd < 0) {
            perror("raw_tcp: accept");
            kill(pid, SIGTERM);
            waitpid(pid, NULL, 0);
            return 1;
        }
    }
    pthread_barrier_init(&warm, NULL, (unsigned)o->streams + 1);
    for (int i = 0; i < o->streams; i++)
        if (pthread_create(&t[i], NULL, recv_stream, &e[i])) return 1;
    pthread_barrier_wait(&warm);
    double start = now(), end = start + o->duration;
    for (int i = 0; i < o->streams; i++)
        e[i].end = end;
    pthread_barrier_wait(&warm);
    uint64_t bytes = 0;
    int failed = 0;
    for (int i = 0; i < o->streams; i++) {
        pthread_join(t[i], NULL);
        bytes += e[i].bytes;
        failed |= e[i].failed;
    }
    double secs = now() - start;
    for (int i = 0; i < o->streams; i++)
        close(e[i].fd);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    if (failed) return 1;
    printf("{\"gbps\": %.4f, \"bytes\": %llu, \"seconds\": %.3f, \"block_size\": %zu, "
           "\"send_span\": %zu, \"recv_span\": %zu, \"streams\": %d}\n",
           (double)bytes / secs / 1e9, (unsigned long long)bytes, secs, o->block, o->send_span,
           o->recv_span, o->streams);
    return 0;
}

/* The server of --request: a block for every 24-byte request. */
static int responder(int port, const raw_opts *o)
{
    int fd = connect_to(port, 1);
    char *buf = span_alloc(o->block, 0x5a);
    char req[24];
    if (fd < 0 || !buf) return 1;
    while (recv_all(fd, req, sizeof req) == 0)
        if (send_all(fd, buf, o->block) != 0) break;
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int request(int lfd, int port, const raw_opts *o)
{
    pid_t pid = fork();
    if (pid == 0) _exit(responder(port, o));
    int fd = accept(lfd, NULL, NULL);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char *buf = malloc(o->block);
    double *rtt = calloc((size_t)o->count, sizeof *rtt);
    char req[24] = {0};
    if (fd < 0 || !buf || !rtt) return 1;
    for (long i = -o->warmup; i < o->count; i++) {
        double t0 = now();
        if (send_all(fd, req, sizeof req) || recv_all(fd, buf, o->block)) {
            perror("raw_tcp: request");
            return 1;
        }
        if (i >= 0) rtt[i] = (now() - t0) * 1e6;
    }
    close(fd);
    waitpid(pid, NULL, 0);
    double sum = 0;
    for (long i = 0; i < o->count; i++)
        sum += rtt[i];
    qsort(rtt, (size_t)o->count, sizeof *rtt, cmp_double);
    printf("{\"median_us\": %.1f, \"p99_us\": %.1f, \"mean_us\": %.1f, \"min_us\": %.1f, "
           "\"count\": %ld, \"size\": %zu}\n",
           rtt[o->count / 2], rtt[o->count * 99 / 100], sum / (double)o->count, rtt[0], o->count,
           o->block);
    return 0;
}

static int parse(int argc, char **argv, raw_opts *o)
{
    *o = (raw_opts){.block = 1u << 20,
                    .duration = 3,
                    .count = 5000,
                    .warmup = 500,
                    .streams = 1,
                    .warmup_bytes = (size_t)256 << 20};
    static const struct option opts[] = {{"block-size", required_argument, 0, 'b'},
                                         {"duration", required_argument, 0, 'd'},
                                         {"send-span", required_argument, 0, 's'},
                                         {"recv-span", required_argument, 0, 'r'},
                                         {"request", no_argument, 0, 'q'},
                                         {"count", required_argument, 0, 'c'},
                                         {"warmup", required_argument, 0, 'w'},
                                         {"streams", required_argument, 0, 'n'},
                                         {"warmup-bytes", required_argument, 0, 'W'},
                                         {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'b':
            o->block = strtoull(optarg, NULL, 10);
            break;
        case 'd':
            o->duration = atof(optarg);
            break;
        case 's':
            o->send_span = strtoull(optarg, NULL, 10);
            break;
        case 'r':
            o->recv_span = strtoull(optarg, NULL, 10);
            break;
        case 'q':
            o->request = 1;
            break;
        case 'c':
            o->count = atol(optarg);
            break;
        case 'w':
            o->warmup = atol(optarg);
            break;
        case 'n':
            o->streams = atoi(optarg);
            break;
        case 'W':
            o->warmup_bytes = strtoull(optarg, NULL, 10);
            break;
        default:
            return -1;
        }
    }
    if (o->send_span < o->block) o->send_span = o->block;
    if (o->recv_span < o->block) o->recv_span = o->block;
    return o->block == 0 || !(o->duration > 0) || o->count < 1 || o->warmup < 0 || o->streams < 1 ||
                   o->streams > 256
               ? -1
               : 0;
}

int main(int argc, char **argv)
{
    raw_opts o;
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "usage: raw_tcp [--block-size B] [--duration S] [--send-span B] "
                        "[--recv-span B] [--streams N] [--warmup-bytes B]\n       raw_tcp "
                        "--request [--block-size B] [--count N] "
                        "[--warmup N]\n");
        return 2;
    }
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 256) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        perror("raw_tcp");
        return 1;
    }
    int port = ntohs(sa.sin_port);
    /* A sender that cannot connect must not leave accept() waiting forever
     * (the accepted sockets inherit the timeout: 20 s without a byte fails a
     * run too). */
    struct timeval accept_wait = {.tv_sec = 20};
    setsockopt(lfd, SOL_SOCKET, SO_RCVTIMEO, &accept_wait, sizeof accept_wait);
    return o.request ? request(lfd, port, &o) : stream(lfd, port, &o);
}
