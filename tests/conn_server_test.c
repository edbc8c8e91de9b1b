/* The connection server (src/common/conn_server.c) with a small echo
 * protocol, and the monotonic clock and deadline I/O it stands on. Peers are
 * real sockets on loopback: idle, trickling, slow-reading and flooding ones.
 *
 * Echo protocol: an 8-byte little-endian header n. With the top bit clear the
 * client then sends n bytes and the server sends them back; with it set the
 * server sends n (without the bit) zero bytes, whether or not anyone reads. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/conn_server.h"
#include "common/net.h"
#include "test.h"

#define SEND_ONLY (1ull << 63)

static atomic_int setups;

static void echo_serve(kvpi_conn *c)
{
    uint8_t hdr[8];
    while (kvpi_conn_next(c, hdr, sizeof hdr) == KVP_OK) {
        uint64_t n = kvpi_get_le64(hdr);
        if (n & SEND_ONLY) {
            n &= ~SEND_ONLY;
            /* Untouched anonymous memory: the kernel sends its zero page. */
            char *zeros =
                mmap(NULL, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            int ok = zeros != MAP_FAILED && kvpi_conn_busy(c, n) &&
                     kvpi_conn_send(c, zeros, n) == KVP_OK;
            if (zeros != MAP_FAILED) munmap(zeros, n);
            if (!ok) return;
            continue;
        }
        char *body = malloc(n ? n : 1);
        int ok = body && kvpi_conn_expect(c, n) && kvpi_conn_recv(c, body, n) == KVP_OK &&
                 kvpi_conn_busy(c, n) && kvpi_conn_send(c, body, n) == KVP_OK;
        free(body);
        if (!ok) return;
    }
}

/* A setup step that wants the 4 bytes "helo" and answers "ok". */
static kvp_status hello_setup(kvpi_conn *c)
{
    char h[4];
    kvp_status st = kvpi_conn_recv(c, h, sizeof h);
    if (st) return st;
    if (memcmp(h, "helo", 4) != 0) return KVP_EPROTO;
    atomic_fetch_add(&setups, 1);
    return kvpi_conn_send(c, "ok", 2);
}

static const kvpi_conn_handler echo = {.serve = echo_serve};
static const kvpi_conn_handler echo_with_hello = {.setup = hello_setup, .serve = echo_serve};

static kvpi_conn_server *start(const kvpi_conn_limits *lim, const kvpi_conn_handler *h, int *port)
{
    int fd;
    if (kvpi_tcp_listen("127.0.0.1", 0, &fd, port) != KVP_OK) return NULL;
    kvpi_conn_server *s = NULL;
    if (kvpi_conn_server_start(fd, "test server", lim, h, NULL, &s) != KVP_OK) {
        fprintf(stderr, "  start: %s\n", kvp_last_error());
        return NULL;
    }
    return s;
}

/* A case's server, s on port, with handler h and the kvpi_conn_limits
 * members given. */
#define SERVER(h, ...)                                                                             \
    int port;                                                                                      \
    kvpi_conn_server *s = start(&(kvpi_conn_limits){__VA_ARGS__}, h, &port);                       \
    REQUIRE(s)

static int dial(int port)
{
    int fd = -1;
    return kvpi_tcp_connect("127.0.0.1", port, 3000, &fd) == KVP_OK ? fd : -1;
}

/* One echo round trip on fd; non-zero on success. */
static int echo_ok(int fd)
{
    uint8_t hdr[8];
    char out[100], in[100];
    kvpt_fill(out, sizeof out, 42);
    kvpi_put_le64(hdr, sizeof out);
    return kvpi_send_all(fd, hdr, 8) == KVP_OK && kvpi_send_all(fd, out, sizeof out) == KVP_OK &&
           kvpi_recv_all(fd, in, sizeof in) == KVP_OK && memcmp(in, out, sizeof in) == 0;
}

static int echo_fresh(int port)
{
    int fd = dial(port);
    int ok = fd >= 0 && echo_ok(fd);
    if (fd >= 0) close(fd);
    return ok;
}

/* Non-zero if the server closed fd (end of stream or reset) within ms. Reads
 * nothing, so that a connection the server is busy sending on stays busy. */
static int closed_within(int fd, int ms)
{
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    int rc;
    do
        rc = poll(&p, 1, ms);
    while (rc < 0 && errno == EINTR);
    return rc > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* The same for a connection the server was sending on: read until the end of
 * the stream (what the server had queued comes first). */
static int drained_within(int fd, int ms)
{
    static char buf[1 << 16];
    uint64_t until = kvpi_now_ms() + (uint64_t)ms;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    while (kvpi_now_ms() < until) {
        if (poll(&p, 1, 50) <= 0) continue;
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN)) return 1;
    }
    return 0;
}

static int still_open(int fd)
{
    return !closed_within(fd, 200);
}

static kvpi_conn_stats stats(kvpi_conn_server *s)
{
    kvpi_conn_stats st;
    kvpi_conn_server_stats(s, &st);
    return st;
}

/* Wait until the server has accepted n connections in all. */
static void wait_accepted(kvpi_conn_server *s, uint64_t n)
{
    for (int i = 0; i < 200 && stats(s).accepted < n; i++)
        usleep(10000);
}

/* ---- the clock and deadline I/O ---- */

/* A timed wait on a kvpi_cond_init condition variable until a deadline from
 * kvpi_deadline_after_ms ends on time: both on CLOCK_MONOTONIC. (With a
 * CLOCK_REALTIME deadline it would wait for decades.) */
static void clock_timed_wait(void)
{
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c;
    REQUIRE(kvpi_cond_init(&c) == 0);
    uint64_t t0 = kvpi_now_ms();
    struct timespec dl = kvpi_deadline_after_ms(200);
    pthread_mutex_lock(&m);
    int rc = 0;
    while (rc == 0)
        rc = pthread_cond_timedwait(&c, &m, &dl);
    pthread_mutex_unlock(&m);
    uint64_t took = kvpi_now_ms() - t0;
    CHECK(rc == ETIMEDOUT);
    CHECK(took >= 190 && took < 3000);
    CHECK(kvpi_remaining_ms(0) == -1);
    CHECK(kvpi_remaining_ms(kvpi_now_ns() - 1) == 0);
    int left = kvpi_remaining_ms(kvpi_deadline_ns(1000));
    CHECK(left > 900 && left <= 1000);
    pthread_cond_destroy(&c);
    /* timeout_ms + bytes at the rate; no overflow for absurd sizes. */
    uint64_t now = kvpi_now_ns();
    uint64_t d = kvpi_transfer_deadline(1000, 1u << 20, 2u << 20);
    CHECK(d - now >= 2990000000u && d - now < 3100000000u);
    CHECK(kvpi_transfer_deadline(1000, 1, UINT64_MAX) > now);
}

typedef struct trickle_arg {
    int fd, n, period_ms;
} trickle_arg;

static void *trickle_main(void *arg)
{
    trickle_arg *t = arg;
    for (int i = 0; i < t->n && send(t->fd, "x", 1, MSG_NOSIGNAL) == 1; i++)
        usleep((useconds_t)t->period_ms * 1000);
    return NULL;
}

/* A receive under a deadline ends by it however the peer paces its bytes;
 * the old per-call timeout would have waited for the whole trickle. */
static void deadline_io(void)
{
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    trickle_arg a = {sv[1], 50, 100};
    pthread_t t;
    pthread_create(&t, NULL, trickle_main, &a);
    char buf[50];
    uint64_t t0 = kvpi_now_ms();
    CHECK_ST(kvpi_recv_all_by(sv[0], buf, sizeof buf, kvpi_deadline_ns(500)), KVP_ETIMEDOUT);
    uint64_t took = kvpi_now_ms() - t0;
    CHECK(took >= 450 && took < 2000);
    CHECK(strstr(kvp_last_error(), "deadline") != NULL);
    pthread_join(t, NULL);
    /* A send into a socket nobody drains, likewise. */
    int small = 4096;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
    char *big = calloc(1, 1 << 20);
    REQUIRE(big);
    t0 = kvpi_now_ms();
    CHECK_ST(kvpi_send_all_by(sv[0], big, 1 << 20, kvpi_deadline_ns(300)), KVP_ETIMEDOUT);
    took = kvpi_now_ms() - t0;
    CHECK(took >= 250 && took < 2000);
    /* Enough time: it all arrives. */
    CHECK_OK(kvpi_send_all_by(sv[1], "abc", 3, kvpi_deadline_ns(1000)));
    char got[3];
    close(sv[0]);
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    CHECK_OK(kvpi_send_all_by(sv[1], "abc", 3, kvpi_deadline_ns(1000)));
    CHECK_OK(kvpi_recv_all_by(sv[0], got, 3, kvpi_deadline_ns(1000)));
    CHECK(memcmp(got, "abc", 3) == 0);
    free(big);
    close(sv[0]);
    close(sv[1]);
}

/* ---- the server ---- */

static void serves_many(void)
{
    int port;
    kvpi_conn_server *s = start(NULL, &echo, &port);
    REQUIRE(s);
    int fds[20];
    for (int i = 0; i < 20; i++) {
        fds[i] = dial(port);
        REQUIRE(fds[i] >= 0);
    }
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < 20; i++)
            CHECK(echo_ok(fds[i]));
    CHECK(stats(s).open == 20);
    for (int i = 0; i < 20; i++)
        close(fds[i]);
    kvpi_conn_server_stop(s);
}

/* Full: a newcomer evicts the connection idle the longest. */
static void evicts_oldest_idle(void)
{
    SERVER(&echo, .max_conns = 3);
    int a = dial(port), b = dial(port), c = dial(port);
    REQUIRE(a >= 0 && b >= 0 && c >= 0);
    /* Each server thread goes idle just after its reply: pause so that the
     * order of going idle is the order of the replies, on a loaded machine too. */
    CHECK(echo_ok(a));
    usleep(100000);
    CHECK(echo_ok(b));
    usleep(100000);
    CHECK(echo_ok(c));
    usleep(100000);
    CHECK(echo_ok(a)); /* now b has been idle the longest */
    usleep(100000);
    CHECK(echo_fresh(port));
    CHECK(closed_within(b, 2000));
    CHECK(still_open(a) && still_open(c));
    CHECK(echo_ok(a) && echo_ok(c));
    kvpi_conn_stats st = stats(s);
    CHECK(st.evicted == 1 && st.refused == 0);
    close(a);
    close(b);
    close(c);
    kvpi_conn_server_stop(s);
}

/* The order of eviction, by the progress a connection made: first one that
 * never completed a request (a stranger), though it came last; then the
 * longest idle of the peers that did; then one whose later request is
 * incomplete; never a young busy one (a full server of those refuses); a
 * busy one older than timeout_ms at last. */
static void eviction_order(void)
{
    SERVER(&echo, .max_conns = 3, .timeout_ms = 1500);
    uint8_t hdr[8];
    int idle = dial(port), part = dial(port);
    REQUIRE(idle >= 0 && part >= 0);
    CHECK(echo_ok(idle)); /* one request done: a peer, idle from now */
    CHECK(echo_ok(part)); /* one done, the next incomplete: a header, 10 of 100 bytes */
    kvpi_put_le64(hdr, 100);
    CHECK_OK(kvpi_send_all(part, hdr, 8));
    CHECK_OK(kvpi_send_all(part, "0123456789", 10));
    usleep(100000);
    int stranger = dial(port); /* the youngest, 4 bytes of its first header */
    REQUIRE(stranger >= 0);
    CHECK_OK(kvpi_send_all(stranger, hdr, 4));
    usleep(100000);
    int d = dial(port); /* evicts the stranger */
    REQUIRE(d >= 0);
    CHECK(closed_within(stranger, 2000));
    CHECK(still_open(idle) && still_open(part));
    kvpi_put_le64(hdr, (4ull << 30) | SEND_ONLY); /* 4 GiB that nobody reads: busy */
    CHECK_OK(kvpi_send_all(d, hdr, 8));
    usleep(100000);
    int e = dial(port); /* evicts idle */
    REQUIRE(e >= 0);
    CHECK(closed_within(idle, 2000));
    CHECK(still_open(part));
    CHECK_OK(kvpi_send_all(e, hdr, 8));
    usleep(100000);
    int f = dial(port); /* evicts part */
    REQUIRE(f >= 0);
    CHECK(closed_within(part, 2000));
    CHECK_OK(kvpi_send_all(f, hdr, 8)); /* now all three are busy and young */
    usleep(100000);
    int g = dial(port);
    REQUIRE(g >= 0);
    CHECK(closed_within(g, 2000)); /* refused */
    CHECK(stats(s).refused == 1);
    usleep(1600000); /* busy for longer than timeout_ms: the oldest may go now */
    int h = dial(port);
    REQUIRE(h >= 0);
    CHECK(drained_within(d, 5000));
    CHECK(echo_ok(h));
    CHECK(stats(s).evicted == 4);
    int all[] = {idle, part, stranger, d, e, f, g, h};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        close(all[i]);
    kvpi_conn_server_stop(s);
}

static void idle_reaped(void)
{
    SERVER(&echo, .idle_timeout_ms = 300);
    int fd = dial(port);
    REQUIRE(fd >= 0);
    CHECK(echo_ok(fd));
    uint64_t t0 = kvpi_now_ms();
    CHECK(closed_within(fd, 3000));
    uint64_t took = kvpi_now_ms() - t0;
    CHECK(took >= 250);
    CHECK(stats(s).idle_closed == 1);
    close(fd);
    kvpi_conn_server_stop(s);
}

/* A header that trickles is cut timeout_ms after its first byte; a body that
 * trickles, timeout_ms + its size at min_rate after the header. */
static void request_deadlines(void)
{
    SERVER(&echo, .timeout_ms = 400, .min_rate = 1000);
    for (int body = 0; body < 2; body++) {
        int fd = dial(port);
        REQUIRE(fd >= 0);
        uint8_t hdr[8];
        kvpi_put_le64(hdr, 600); /* body: 400 ms + 600 bytes at 1000/s = 1 s */
        if (body) CHECK_OK(kvpi_send_all(fd, hdr, 8));
        trickle_arg a = {fd, 100, 100};
        pthread_t t;
        uint64_t t0 = kvpi_now_ms();
        pthread_create(&t, NULL, trickle_main, &a);
        CHECK(closed_within(fd, 5000));
        uint64_t took = kvpi_now_ms() - t0;
        fprintf(stderr, "  %s trickle cut after %llu ms\n", body ? "body" : "header",
                (unsigned long long)took);
        CHECK(took >= (body ? 900u : 350u) && took < (body ? 2500u : 1800u));
        shutdown(fd, SHUT_RDWR);
        pthread_join(t, NULL);
        close(fd);
    }
    CHECK(echo_fresh(port));
    kvpi_conn_server_stop(s);
}

static void setup_step(void)
{
    int port;
    kvpi_conn_limits lim = {.setup_timeout_ms = 300};
    atomic_store(&setups, 0);
    kvpi_conn_server *s = start(&lim, &echo_with_hello, &port);
    REQUIRE(s);
    int good = dial(port), bad = dial(port), mute = dial(port);
    REQUIRE(good >= 0 && bad >= 0 && mute >= 0);
    char ok[2];
    CHECK_OK(kvpi_send_all(good, "helo", 4));
    CHECK_OK(kvpi_recv_all(good, ok, 2));
    CHECK(echo_ok(good));
    CHECK_OK(kvpi_send_all(bad, "nope", 4));
    CHECK(closed_within(bad, 2000));
    uint64_t t0 = kvpi_now_ms();
    CHECK(closed_within(mute, 3000)); /* the setup deadline */
    CHECK(kvpi_now_ms() - t0 < 2000);
    CHECK(atomic_load(&setups) == 1);
    CHECK(echo_ok(good));
    close(good);
    close(bad);
    close(mute);
    kvpi_conn_server_stop(s);
}

/* Out of descriptors: accept backs off instead of spinning, sheds, and the
 * server serves again once descriptors are free. */
static void out_of_descriptors(void)
{
    SERVER(&echo, .max_conns = 4096, .idle_timeout_ms = 60000);
    int probe = dup(0);
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = (rlim_t)probe + 40;
    close(probe);
    REQUIRE(setrlimit(RLIMIT_NOFILE, &rl) == 0);
    int fds[30], n = 0;
    for (int i = 0; i < 30; i++) /* 30 here and their 30 server ends: more than 40 */
        if ((fds[n] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0)) >= 0) {
            struct sockaddr_in sa = {.sin_family = AF_INET,
                                     .sin_port = htons((uint16_t)port),
                                     .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
            connect(fds[n], (struct sockaddr *)&sa, sizeof sa);
            n++;
        }
    usleep(300000);
    struct rusage r0, r1;
    getrusage(RUSAGE_SELF, &r0);
    usleep(1000000);
    getrusage(RUSAGE_SELF, &r1);
    long cpu_ms = (r1.ru_utime.tv_sec - r0.ru_utime.tv_sec) * 1000 +
                  (r1.ru_utime.tv_usec - r0.ru_utime.tv_usec) / 1000 +
                  (r1.ru_stime.tv_sec - r0.ru_stime.tv_sec) * 1000 +
                  (r1.ru_stime.tv_usec - r0.ru_stime.tv_usec) / 1000;
    fprintf(stderr, "  CPU while out of descriptors: %ld ms in 1000 ms\n", cpu_ms);
    CHECK(cpu_ms < 300);
    kvpi_conn_stats st = stats(s);
    CHECK(st.accept_errors > 0);
    CHECK(st.accept_errors < 200); /* backing off, not spinning */
    for (int i = 0; i < n; i++)
        close(fds[i]);
    uint64_t until = kvpi_now_ms() + 5000;
    int ok = 0;
    while (!ok && kvpi_now_ms() < until) {
        ok = echo_fresh(port);
        if (!ok) usleep(100000);
    }
    CHECK(ok);
    kvpi_conn_server_stop(s);
}

/* Stop ends connections blocked in any phase at once, whatever their
 * deadlines. */
static void stop_never_waits(void)
{
    SERVER(&echo_with_hello, .timeout_ms = 600000, .idle_timeout_ms = 600000,
           .setup_timeout_ms = 600000);
    int in_setup = dial(port), in_header = dial(port), sending = dial(port);
    REQUIRE(in_setup >= 0 && in_header >= 0 && sending >= 0);
    char ok[2];
    CHECK_OK(kvpi_send_all(in_header, "helo", 4));
    CHECK_OK(kvpi_recv_all(in_header, ok, 2));
    CHECK_OK(kvpi_send_all(in_header, "1234", 4));
    CHECK_OK(kvpi_send_all(sending, "helo", 4));
    CHECK_OK(kvpi_recv_all(sending, ok, 2));
    uint8_t hdr[8];
    kvpi_put_le64(hdr, (4ull << 30) | SEND_ONLY);
    CHECK_OK(kvpi_send_all(sending, hdr, 8));
    wait_accepted(s, 3);
    usleep(200000);
    uint64_t t0 = kvpi_now_ms();
    kvpi_conn_server_stop(s);
    CHECK(kvpi_now_ms() - t0 < 2000);
    CHECK(closed_within(in_setup, 2000));
    CHECK(closed_within(in_header, 2000));
    CHECK(drained_within(sending, 5000));
    int fd;
    CHECK_ST(kvpi_tcp_connect("127.0.0.1", port, 1000, &fd), KVP_ECONNREFUSED);
    close(in_setup);
    close(in_header);
    close(sending);
    kvpi_conn_server_stop(NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(clock_timed_wait, 30);
    RUN_T(deadline_io, 30);
    RUN_T(serves_many, 30);
    RUN_T(evicts_oldest_idle, 30);
    RUN_T(eviction_order, 30);
    RUN_T(idle_reaped, 30);
    RUN_T(request_deadlines, 30);
    RUN_T(setup_step, 30);
    RUN_T(out_of_descriptors, 30);
    RUN_T(stop_never_waits, 30);
    return kvpt_summary();
}
