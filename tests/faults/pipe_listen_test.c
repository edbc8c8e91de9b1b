/* Strangers on the pipe's bound PUSH sockets (the announce and ACK ports of
 * both sides) while a real pair moves tensors: an HTTP probe, raw bytes, ZeroMQ
 * handshakes of the wrong socket type followed by oversized frames, a
 * command frame announcing 1 TiB, connections that stay silent, and a libzmq
 * PUSH connecting to a PUSH. None of them may disturb the pair: every tensor
 * arrives intact and in order, and the logs stay short.
 *
 * Not tested here, because it is not defended: a stranger that completes the
 * handshake as a PULL joins the PUSH's round-robin and takes a share of the
 * announcements or ACKs (docs/pipe.md, "Hostile peers"). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <zmq.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "pipe/safetensors.h"
#include "test.h"
#include "peer.h"

#define ROUNDS 100
#define SILENT 16

static void recv_good(kvp_pipe *pipe, int i)
{
    kvp_tensor *t = NULL;
    kvp_status st = kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t);
    if (st) fprintf(stderr, "  recv %d: %s\n", i, kvp_last_error());
    CHECK_OK(st);
    CHECK(kvpt_raw_tensor_check(t, i));
    kvp_tensor_free(t);
}

/* Prefill sends tensor i and gets it back from decode (sends_first: this
 * is prefill), ROUNDS times, once the strangers are at work (a step on go). */
static void ping_pong(kvp_pipe *pipe, void *go, int sends_first)
{
    CHECK(kvpt_wait_step(go, KVPT_RAW_SIDE_MS) == 'g');
    for (int i = 0; i < ROUNDS; i++)
        for (int turn = 0; turn < 2; turn++) {
            if (turn == !sends_first)
                kvpt_raw_send_good(pipe, i);
            else
                recv_good(pipe, i);
        }
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
}

static void prefill_side(kvp_pipe *pipe, void *arg)
{
    ping_pong(pipe, arg, 1);
}

static void decode_side(kvp_pipe *pipe, void *arg)
{
    ping_pong(pipe, arg, 0);
}

/* ------------------------------------------------------ strangers --- */

static int tcp_to(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) return fd;
    if (fd >= 0) close(fd);
    return -1;
}

/* Write what we have, then read until the other side closes (at most 2 s). */
static void say_and_hang_up(int port, const void *buf, size_t len)
{
    int fd = tcp_to(port);
    if (fd < 0) return;
    struct timeval tv = {.tv_sec = 2};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (send(fd, buf, len, MSG_NOSIGNAL) >= 0) {
        char sink[512];
        while (recv(fd, sink, sizeof sink, 0) > 0) {
        }
    }
    close(fd);
}

/* A ZMTP 3.0 greeting with the NULL mechanism: 64 bytes. */
static size_t zmtp_greeting(uint8_t *out)
{
    memset(out, 0, 64);
    out[0] = 0xFF;
    out[9] = 0x7F;
    out[10] = 3;
    memcpy(out + 12, "NULL", 4);
    return 64;
}

/* The greeting and a READY command naming the socket type; returns the
 * length. */
static size_t zmtp_hello(uint8_t *out, const char *type)
{
    size_t n = zmtp_greeting(out), tl = strlen(type);
    uint8_t *cmd = out + n;
    cmd[0] = 0x04; /* command, short */
    cmd[1] = (uint8_t)(1 + 5 + 1 + 11 + 4 + tl);
    size_t k = 2;
    cmd[k++] = 5;
    memcpy(cmd + k, "READY", 5);
    k += 5;
    cmd[k++] = 11;
    memcpy(cmd + k, "Socket-Type", 11);
    k += 11;
    cmd[k++] = 0;
    cmd[k++] = 0;
    cmd[k++] = 0;
    cmd[k++] = (uint8_t)tl;
    memcpy(cmd + k, type, tl);
    return n + k + tl;
}

/* One round of every kind of stranger against one port. */
static void strangers(int port)
{
    static uint8_t buf[8192];
    /* Not ZeroMQ at all: an HTTP probe, and random bytes. Without care, ZeroMQ
     * takes either for a ZMTP 1.0 peer, which has no socket type to check. */
    static const char probe[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    say_and_hang_up(port, probe, sizeof probe - 1);
    kvpt_fill(buf, 4096, (uint64_t)port);
    buf[0] = 0x01;
    say_and_hang_up(port, buf, 4096);
    /* A PUSH talking to a PUSH, then a 5000-byte message. */
    size_t n = zmtp_hello(buf, "PUSH");
    buf[n++] = 0x02; /* message, long */
    kvpi_put_be64(buf + n, 5000);
    n += 8;
    memset(buf + n, 'x', 5000);
    say_and_hang_up(port, buf, n + 5000);
    /* A greeting, then a command of 1 TiB. */
    n = zmtp_greeting(buf);
    buf[n++] = 0x06; /* command, long */
    kvpi_put_be64(buf + n, 1ull << 40);
    n += 8;
    say_and_hang_up(port, buf, n);
}

typedef struct attack {
    int ports[4];
    atomic_int stop;
    atomic_int rounds;
} attack;

static void *attacker(void *arg)
{
    attack *a = arg;
    void *ctx = zmq_ctx_new();
    void *wrong[4];
    int silent[4 * SILENT];
    for (int i = 0; i < 4; i++) {
        /* A libzmq PUSH connecting to a PUSH: refused at the handshake, and
         * libzmq gives up on it. */
        wrong[i] = kvpt_zmq_socket(ctx, ZMQ_PUSH);
        kvpt_zmq_connect(wrong[i], a->ports[i]);
        for (int k = 0; k < SILENT; k++)
            silent[i * SILENT + k] = tcp_to(a->ports[i]);
    }
    while (!atomic_load(&a->stop)) {
        for (int i = 0; i < 4; i++)
            strangers(a->ports[i]);
        atomic_fetch_add(&a->rounds, 1);
    }
    for (int i = 0; i < 4 * SILENT; i++)
        if (silent[i] >= 0) close(silent[i]);
    for (int i = 0; i < 4; i++)
        zmq_close(wrong[i]);
    zmq_ctx_term(ctx);
    return NULL;
}

static void test_strangers_on_push_ports(void)
{
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    attack a = {.ports = {s.side[0].data_port, s.side[0].ack_port, s.side[1].data_port,
                          s.side[1].ack_port}};
    atomic_init(&a.stop, 0);
    atomic_init(&a.rounds, 0);
    kvpt_chan go;
    REQUIRE(kvpt_chan_init(&go) == 0);
    kvpt_raw_sides p;
    kvpt_raw_sides_spawn(&p, &s, "listen", prefill_side, decode_side, &go);
    /* Strangers arrive once the sides listen; the pair starts once every kind
     * has been at every port a few times, and they go on meanwhile. */
    for (int i = 0; i < 4; i++)
        CHECK(kvpt_wait_port("127.0.0.1", a.ports[i], KVPT_RAW_WAIT_MS) == 0);
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, attacker, &a) == 0);
    uint64_t deadline = kvpi_now_ms() + KVPT_RAW_SIDE_MS;
    while (atomic_load(&a.rounds) < 3 && kvpi_now_ms() < deadline)
        usleep(10000);
    CHECK(atomic_load(&a.rounds) >= 3);
    kvpt_step(&go, 'g');
    kvpt_step(&go, 'g');
    int sides = kvpt_raw_sides_wait(&p);
    atomic_store(&a.stop, 1);
    pthread_join(th, NULL);
    CHECK(sides == 0);
    int lines = kvpt_file_lines(p.err[0], " kvpipe[") + kvpt_file_lines(p.err[1], " kvpipe[");
    if (lines > 10) fprintf(stderr, "  %d log lines\n", lines);
    CHECK(lines <= 10);
    kvpt_raw_sides_unlink(&p);
}

int main(void)
{
    RUN_T(test_strangers_on_push_ports, 240);
    return kvpt_summary();
}
