/* The pipe's control links in the authenticated mode (CURVE, keys derived
 * from the key; docs/security.md): a third party that connects a PULL socket
 * to a sender's announce port or a receiver's ACK port - with no security, or
 * with CURVE and keys of its own - gets nothing and costs nothing (every
 * tensor arrives, in order; nothing stays in flight); and two sides with
 * different keys, or one without a key, never connect: each says so in its
 * log (rate-limited), and send and recv end with their timeouts, not a hang.
 * Without authentication such a PULL takes every other announcement (the
 * issue's finding; pipe_listen_test.c leaves it undefended). */
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <zmq.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/net.h"
#include "pipe/safetensors.h"
#include "test.h"
#include "peer.h"

#define ROUNDS 60

static char key1[64], key2[64];

static void write_key(char *path, size_t len, const char *text)
{
    snprintf(path, len, "/tmp/kvpt_pipekey_%d_XXXXXX", (int)getpid());
    int fd = mkstemp(path);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) kvpt_failures++;
    if (fd >= 0) close(fd);
}

static void make_keys(void)
{
    write_key(key1, sizeof key1, "0123456789abcdef0123456789abcdef-pipe-one\n");
    write_key(key2, sizeof key2, "fedcba9876543210fedcba9876543210-pipe-two\n");
}

static void drop_keys(void)
{
    unlink(key1);
    unlink(key2);
}

/* Spawn side rank with the key file key (NULL: none). */
static pid_t spawn_with_key(const kvpt_raw_setup *s, int rank, kvpt_side_fn fn, void *arg,
                            const char *err, const char *key)
{
    if (key)
        setenv(KVPI_AUTH_ENV, key, 1);
    else
        unsetenv(KVPI_AUTH_ENV);
    pid_t pid = kvpt_raw_spawn_side(s, rank, fn, arg, err);
    unsetenv(KVPI_AUTH_ENV);
    return pid;
}

static void sender(kvp_pipe *pipe, void *arg)
{
    CHECK(kvpt_wait_step(arg, KVPT_RAW_SIDE_MS) == 'g');
    static uint8_t data[KVPT_RAW_TENSOR];
    for (int i = 0; i < ROUNDS; i++) {
        kvpt_raw_tensor_fill(data, i);
        kvp_tensor t = kvpt_u8_tensor(data, KVPT_RAW_TENSOR);
        CHECK_OK(kvp_pipe_send(pipe, &t));
    }
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.sent == ROUNDS && st.acks == ROUNDS);
    CHECK(st.inflight_count == 0 && st.inflight_bytes == 0);
    fprintf(stderr, "sender: sent %llu, acks %llu, in flight %zu\n", (unsigned long long)st.sent,
            (unsigned long long)st.acks, st.inflight_count);
}

static void receiver(kvp_pipe *pipe, void *arg)
{
    CHECK(kvpt_wait_step(arg, KVPT_RAW_SIDE_MS) == 'g');
    int got = 0;
    for (int i = 0; i < ROUNDS; i++) {
        kvp_tensor *t = NULL;
        kvp_status st = kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t);
        if (st) fprintf(stderr, "  recv %d: %s\n", i, kvp_last_error());
        if (st == KVP_OK && kvpt_raw_tensor_check(t, i)) got++;
        kvp_tensor_free(t);
        if (st == KVP_ETIMEDOUT) break;
    }
    CHECK(got == ROUNDS);
    fprintf(stderr, "receiver: %d of %d in order\n", got, ROUNDS);
}

/* Messages waiting on any of the strangers, taken. */
static int drain(void *const *socks, int n)
{
    int taken = 0;
    char buf[64];
    for (int i = 0; i < n; i++)
        while (zmq_recv(socks[i], buf, sizeof buf, ZMQ_DONTWAIT) >= 0)
            taken++;
    return taken;
}

static void third_party_gets_nothing(void)
{
    make_keys();
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    kvpt_chan go0, go1;
    REQUIRE(kvpt_chan_init(&go0) == 0 && kvpt_chan_init(&go1) == 0);
    char err0[128], err1[128];
    kvpt_err_path(err0, sizeof err0, "auth_sender");
    kvpt_err_path(err1, sizeof err1, "auth_receiver");
    pid_t p0 = spawn_with_key(&s, 0, sender, &go0, err0, key1);
    pid_t p1 = spawn_with_key(&s, 1, receiver, &go1, err1, key1);
    REQUIRE(kvpt_wait_port("127.0.0.1", s.side[0].data_port, KVPT_RAW_WAIT_MS) == 0);
    REQUIRE(kvpt_wait_port("127.0.0.1", s.side[1].ack_port, KVPT_RAW_WAIT_MS) == 0);

    /* Strangers on the sender's announce port and the receiver's ACK port:
     * a PULL with no security, and one with CURVE and keys of its own. */
    void *ctx = zmq_ctx_new();
    void *socks[4], *mons[4];
    const int ports[4] = {s.side[0].data_port, s.side[1].ack_port, s.side[0].data_port,
                          s.side[1].ack_port};
    for (int i = 0; i < 4; i++) {
        socks[i] = kvpt_zmq_socket(ctx, ZMQ_PULL);
        if (i >= 2) {
            char pub[41], sec[41], srv[41], srv_sec[41];
            zmq_curve_keypair(pub, sec);
            zmq_curve_keypair(srv, srv_sec);
            zmq_setsockopt(socks[i], ZMQ_CURVE_SERVERKEY, srv, 40);
            zmq_setsockopt(socks[i], ZMQ_CURVE_PUBLICKEY, pub, 40);
            zmq_setsockopt(socks[i], ZMQ_CURVE_SECRETKEY, sec, 40);
        }
        char name[32];
        snprintf(name, sizeof name, "stranger-%d", i);
        mons[i] = kvpt_zmq_monitor(ctx, socks[i], name);
        REQUIRE(mons[i] && kvpt_zmq_connect(socks[i], ports[i]) == 0);
    }
    /* Each reached its port and was dropped before it joined. */
    for (int i = 0; i < 4; i++) {
        CHECK(kvpt_zmq_wait_event(mons[i], ZMQ_EVENT_CONNECTED, KVPT_RAW_WAIT_MS) == 0);
        CHECK(kvpt_zmq_wait_event(mons[i],
                                  ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                      ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                                      ZMQ_EVENT_HANDSHAKE_FAILED_AUTH,
                                  KVPT_RAW_WAIT_MS) == 0);
    }
    kvpt_step(&go0, 'g');
    kvpt_step(&go1, 'g');
    int taken = 0;
    pid_t pids[2] = {p0, p1};
    int rc[2] = {-1, -1};
    uint64_t deadline = kvpi_now_ms() + KVPT_RAW_SIDE_MS;
    while ((rc[0] < 0 || rc[1] < 0) && kvpi_now_ms() < deadline) {
        taken += drain(socks, 4);
        for (int i = 0; i < 2; i++) {
            int status;
            if (rc[i] < 0 && waitpid(pids[i], &status, WNOHANG) == pids[i])
                rc[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
        }
        usleep(20000);
    }
    for (int i = 0; i < 2; i++)
        if (rc[i] < 0) rc[i] = kvpt_wait_child(pids[i], 1000);
    taken += drain(socks, 4);
    CHECK(taken == 0);
    CHECK(rc[0] == 0 && rc[1] == 0);
    /* Both sides saw the strangers, and said so briefly. */
    int refused0 = kvpt_file_lines(err0, "refused a connection to its announce port");
    int refused1 = kvpt_file_lines(err1, "refused a connection to its ACK port");
    CHECK(refused0 >= 1 && refused0 <= 3);
    CHECK(refused1 >= 1 && refused1 <= 3);
    if (kvpt_failures) {
        fprintf(stderr, "  strangers took %d messages\n", taken);
        kvpt_file_show(err0, "sender");
        kvpt_file_show(err1, "receiver");
    }
    unlink(err0);
    unlink(err1);
    for (int i = 0; i < 4; i++) {
        zmq_close(mons[i]);
        zmq_close(socks[i]);
    }
    zmq_ctx_term(ctx);
    drop_keys();
}

/* Sides that cannot agree: each tries to send one tensor and to receive one;
 * both time out (send at send_timeout_ms, naming the authenticated mode). */
static void try_one(kvp_pipe *pipe, void *arg)
{
    (void)arg;
    static uint8_t data[KVPT_RAW_TENSOR];
    kvp_tensor t = kvpt_u8_tensor(data, KVPT_RAW_TENSOR);
    kvp_tensor *got = NULL;
    kvp_status st = kvp_pipe_send(pipe, &t);
    CHECK(st == KVP_ETIMEDOUT);
    fprintf(stderr, "send: %s\n", kvp_last_error());
    CHECK_ST(kvp_pipe_recv(pipe, 2000, &got), KVP_ETIMEDOUT);
    kvp_pipe_stats ps;
    kvp_pipe_get_stats(pipe, &ps);
    CHECK(ps.sent == 0 && ps.received == 0 && ps.inflight_count == 0);
}

static void mismatched_sides(const char *k0, const char *k1)
{
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    char err0[128], err1[128];
    kvpt_err_path(err0, sizeof err0, "auth_side0");
    kvpt_err_path(err1, sizeof err1, "auth_side1");
    uint64_t t0 = kvpi_now_ms();
    pid_t p0 = spawn_with_key(&s, 0, try_one, NULL, err0, k0);
    pid_t p1 = spawn_with_key(&s, 1, try_one, NULL, err1, k1);
    int rc0 = kvpt_wait_child(p0, KVPT_RAW_SIDE_MS), rc1 = kvpt_wait_child(p1, KVPT_RAW_SIDE_MS);
    CHECK(rc0 == 0 && rc1 == 0);
    CHECK(kvpi_now_ms() - t0 < 3u * KVPT_RAW_WAIT_MS);
    /* Each authenticated side says why, in a few lines. */
    const char *errs[2] = {err0, err1}, *keys[2] = {k0, k1};
    for (int i = 0; i < 2; i++) {
        if (!keys[i]) {
            /* Without a key: the link ZeroMQ closed, with the hint. */
            CHECK(kvpt_file_lines(errs[i], "an authenticated peer refuses") >= 1);
            continue;
        }
        int curve = kvpt_file_lines(errs[i], "CURVE handshake");
        int refused = kvpt_file_lines(errs[i], "refused a connection to its");
        CHECK(kvpt_file_lines(errs[i], "The pipe is authenticated") == 1);
        CHECK(refused >= 1 && refused <= 6); /* a line per 10 s and port at most */
        CHECK(keys[1 - i] == NULL || (curve >= 1 && curve <= 6));
        if (curve > 6 || refused > 6) fprintf(stderr, "  %d + %d lines\n", curve, refused);
    }
    if (kvpt_failures) {
        kvpt_file_show(err0, "side 0");
        kvpt_file_show(err1, "side 1");
    }
    unlink(err0);
    unlink(err1);
}

static void wrong_key_refused(void)
{
    make_keys();
    mismatched_sides(key1, key2);
    drop_keys();
}

static void no_key_peer_refused(void)
{
    make_keys();
    mismatched_sides(key1, NULL);
    drop_keys();
}

int main(void)
{
    unsetenv(KVPI_AUTH_ENV);
    RUN_T(third_party_gets_nothing, 150);
    RUN_T(wrong_key_refused, 150);
    RUN_T(no_key_peer_refused, 150);
    return kvpt_summary();
}
