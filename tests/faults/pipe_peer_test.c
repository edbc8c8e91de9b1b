/* The tensor pipe with a dead or misbehaving peer, across processes on
 * loopback, on every row (support/peer.h): a receiver or a sender killed
 * mid-stream (an error, not a hang), no peer at all, a received tensor
 * outliving its pipe, a raw ZeroMQ peer announcing garbage, and stray ACKs
 * while a send waits. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/net.h"
#include "peer.h"
#include "test.h"

/* ------------------------------------------------------- dead peers --- */

static int send_until_error(kvp_pipe *pipe, int rank)
{
    (void)rank;
    static uint8_t buf[256u << 10];
    kvp_tensor t = kvpt_u8_tensor(buf, sizeof buf);
    kvp_status st = KVP_OK;
    int sent = 0;
    kvpt_pipe_expect(pipe, NULL); /* the receiver is up */
    uint64_t t0 = kvpi_now_ms();
    while (sent < 2000 && (st = kvp_pipe_send(pipe, &t)) == KVP_OK)
        sent++;
    CHECK(st != KVP_OK); /* the peer died: an error, not a hang */
    CHECK(kvpi_now_ms() - t0 < 60000);
    kvp_pipe_stats s;
    kvp_pipe_get_stats(pipe, &s);
    CHECK(s.inflight_count > 0); /* freed by close, below */
    return 1;
}

static int recv_then_die(kvp_pipe *pipe, int rank)
{
    (void)rank;
    CHECK_OK(kvp_pipe_send(pipe, NULL));
    for (int i = 0; i < 5; i++)
        kvp_tensor_free(kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT));
    raise(SIGKILL);
    return 1;
}

static void test_receiver_killed(void)
{
    /* The receiver dies with READs in flight (its window READs ahead); over
     * UCX's tcp, UCX older than 1.14 then aborts the sender in the GET it
     * emulates (docs/transport-ucx.md, "Known UCX 1.13.1 bugs";
     * ucx_faults_test's initiator_killed skips alike). */
    if (kvpt_row->ucx_tls && strcmp(kvpt_row->ucx_tls, "tcp") == 0 && kvpt_ucx_older_than(1, 14))
        SKIP("UCX older than 1.14 over tcp can abort the sender when a reader dies mid-READ "
             "(ucp_get_req_handler: \"unexpected error: Endpoint timeout\")");
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 0) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.kv_buffer_size = 2u << 20;
    o.send_timeout_ms = 2000;
    pid_t a = kvpt_pipe_spawn(&s, 0, &o, send_until_error);
    pid_t b = kvpt_pipe_spawn(&s, 1, &o, recv_then_die);
    CHECK(kvpt_wait_child(a, KVPT_SIDE_TIMEOUT) == 0);
    CHECK(kvpt_wait_child(b, KVPT_SIDE_TIMEOUT) == 128 + SIGKILL);
}

static int send_then_die(kvp_pipe *pipe, int rank)
{
    (void)rank;
    static uint8_t buf[1u << 20];
    kvp_tensor t = kvpt_u8_tensor(buf, sizeof buf);
    for (int i = 0; i < 3; i++)
        CHECK_OK(kvp_pipe_send(pipe, &t));
    CHECK_OK(kvp_pipe_flush(pipe, 20000));
    /* Announce more, then die before the receiver can READ them. */
    for (int i = 0; i < 3; i++)
        CHECK_OK(kvp_pipe_send(pipe, &t));
    raise(SIGKILL);
    return 1;
}

static int recv_until_error(kvp_pipe *pipe, int rank)
{
    (void)rank;
    for (int i = 0; i < 3; i++)
        kvp_tensor_free(kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT));
    usleep(500000); /* the sender is dead by now */
    uint64_t t0 = kvpi_now_ms();
    kvp_status st = KVP_OK;
    for (int i = 0; i < 5 && st == KVP_OK; i++) {
        kvp_tensor *t = NULL;
        st = kvp_pipe_recv(pipe, 2000, &t);
        kvp_tensor_free(t);
    }
    CHECK(st != KVP_OK);
    CHECK(kvpi_now_ms() - t0 < 30000);
    /* Later calls fail too, within their timeout. */
    kvp_tensor *t = NULL;
    CHECK(kvp_pipe_recv(pipe, 200, &t) != KVP_OK);
    CHECK(t == NULL);
    return 1;
}

static void test_sender_killed(void)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 0) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.io_timeout_ms = 2000;
    pid_t a = kvpt_pipe_spawn(&s, 0, &o, send_then_die);
    pid_t b = kvpt_pipe_spawn(&s, 1, &o, recv_until_error);
    CHECK(kvpt_wait_child(a, KVPT_SIDE_TIMEOUT) == 128 + SIGKILL);
    CHECK(kvpt_wait_child(b, KVPT_SIDE_TIMEOUT) == 0);
}

/* A pipe alone: send times out (no peer), recv times out, close is quick, and
 * a received tensor would outlive close (checked in test_tensor_outlives_close). */
static void test_no_peer(void)
{
    kvpt_pipe_setup s;
    kvp_pipe_opts o;
    kvp_pipe *pipe = kvpt_pipe_alone(&s, &o);
    REQUIRE(pipe != NULL);
    float v = 1;
    int64_t one = 1;
    kvp_tensor t;
    kvp_tensor_init(&t, KVP_DTYPE_F32, 1, &one, &v);
    CHECK_ST(kvp_pipe_send(pipe, &t), KVP_ETIMEDOUT);
    CHECK(strstr(kvp_last_error(), "127.0.0.1") != NULL);
    kvp_tensor *got = (kvp_tensor *)&got;
    CHECK_ST(kvp_pipe_recv(pipe, 100, &got), KVP_ETIMEDOUT);
    CHECK(got == (kvp_tensor *)&got); /* untouched on failure */
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.inflight_count == 0 && st.sent == 0);
    uint64_t t0 = kvpi_now_ms();
    kvp_pipe_close(pipe);
    CHECK(kvpi_now_ms() - t0 < 3000);
    /* A second open on the same ports works at once (nothing lingers). */
    REQUIRE_OK(kvpt_pipe_open(s.json, 0, &o, &pipe));
    kvp_pipe_close(pipe);
}

static int send_one_y(kvp_pipe *pipe, int rank)
{
    (void)rank;
    kvp_tensor x, y;
    kvpt_pipe_xy(&x, &y);
    CHECK_OK(kvp_pipe_send(pipe, &y));
    return 0;
}

static int recv_close_then_read(kvp_pipe *pipe, int rank)
{
    (void)rank;
    kvp_tensor x, y;
    kvpt_pipe_xy(&x, &y);
    kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
    kvp_pipe_close(pipe);
    /* The engine lives on until the tensor is freed. */
    CHECK(t && kvp_tensor_equal(t, &y));
    kvp_tensor_free(t);
    _exit(kvpt_failures ? 1 : 0);
}

static void test_tensor_outlives_close(void)
{
    kvpt_pipe_run(0, send_one_y, recv_close_then_read);
}

/* ------------------------------------------------- a raw ZeroMQ peer --- */

/* The decode side: the fake prefill sends these, in order, after three
 * malformed messages (one frame, three frames, a 7-byte frame) that the pipe
 * drops unanswered (tests/faults/pipe_announce_test.c). */
#define RAW_DROPPED 3
static const kvp_status raw_expect[] = {
    KVP_EPROTO, /* length 0 */
    KVP_EPROTO, /* absurd length */
    KVP_ERANGE, /* address outside registered memory */
    KVP_EPROTO, /* registered, but not safetensors */
    KVP_EPROTO, /* safetensors with two tensors */
    KVP_OK,     /* a good one: the pipe went on */
};
#define RAW_N (sizeof raw_expect / sizeof raw_expect[0])

static int raw_receiver(kvp_pipe *pipe, int rank)
{
    (void)rank;
    kvp_tensor x, y;
    kvpt_pipe_xy(&x, &y);
    for (size_t i = 0; i < RAW_N; i++) {
        kvp_tensor *t = NULL;
        kvp_status st = kvp_pipe_recv(pipe, KVPT_RECV_TIMEOUT, &t);
        if (st != raw_expect[i])
            fprintf(stderr, "  message %zu: %s (%s)\n", i, kvp_strerror(st), kvp_last_error());
        CHECK(st == raw_expect[i]);
        if (st) CHECK(kvp_last_error()[0] != '\0');
        if (st == KVP_OK) CHECK(t && kvp_tensor_equal(t, &y));
        kvp_tensor_free(t);
        CHECK(kvp_pipe_usable(pipe));
    }
    kvp_pipe_stats s;
    kvp_pipe_get_stats(pipe, &s);
    CHECK(s.bad_messages == RAW_N - 1 + RAW_DROPPED && s.received == 1);
    usleep(300000); /* let the last ACK leave */
    return 0;
}

static void zsend_frames(void *sock, const void *const *frames, const size_t *sizes, int n)
{
    for (int i = 0; i < n; i++)
        zmq_send(sock, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0);
}

static void announce_raw(void *sock, uint64_t addr, uint64_t len)
{
    uint8_t a[8], l[8];
    kvpi_put_be64(a, addr);
    kvpi_put_be64(l, len);
    const void *f[2] = {a, l};
    size_t s[2] = {8, 8};
    zsend_frames(sock, f, s, 2);
}

/* Copy a safetensors message with the given header and data into buf. */
static size_t put_message(uint8_t *buf, const char *header, const void *data, size_t n)
{
    size_t h = strlen(header);
    kvpi_put_le64(buf, h);
    memcpy(buf + 8, header, h);
    memcpy(buf + 8 + h, data, n);
    return 8 + h + n;
}

static void test_malformed_from_raw_peer(void)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 0) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    pid_t dec = kvpt_pipe_spawn(&s, 1, &o, raw_receiver);
    kvp_tensor x, y;
    kvpt_pipe_xy(&x, &y);

    /* The fake prefill: a real engine under prefill's segment name, and bare
     * ZeroMQ sockets on prefill's ports. */
    kvp_pipe_config *cfg;
    REQUIRE_OK(kvp_pipe_config_parse(s.json, strlen(s.json), &cfg));
    kvp_pipe_endpoints ep;
    REQUIRE_OK(kvp_pipe_config_endpoints(cfg, 0, 0, &ep));
    char *conn;
    REQUIRE_OK(kvp_pipe_config_metadata_conn(cfg, &conn));
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = ep.local_segment;
    eo.metadata = conn;
    eo.protocol = kvpt_row->protocol;
    eo.disable_shm = 1;
    kvp_engine *engine;
    REQUIRE_OK(kvp_engine_create(&eo, &engine));
    uint8_t *mem;
    REQUIRE_OK(kvp_engine_alloc(engine, 4096, (void **)&mem));
    kvpt_fill(mem, 4096, 1);
    size_t garbage_len = 100;
    uint8_t *good = mem + 1024, *two = mem + 2048;
    size_t good_len = put_message(
        good, "{\"tensor\":{\"dtype\":\"F32\",\"shape\":[1,4],\"data_offsets\":[0,16]}}", y.data,
        16);
    size_t two_len =
        put_message(two,
                    "{\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                    "\"more\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                    "ab", 2);

    void *ctx = zmq_ctx_new();
    void *push = zmq_socket(ctx, ZMQ_PUSH), *pull = zmq_socket(ctx, ZMQ_PULL);
    int zero = 0, tmo = KVPT_RECV_TIMEOUT;
    zmq_setsockopt(push, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(pull, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(push, ZMQ_SNDTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(pull, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    char ep_push[64], ep_pull[64];
    snprintf(ep_push, sizeof ep_push, "tcp://127.0.0.1:%d", ep.data_port);
    snprintf(ep_pull, sizeof ep_pull, "tcp://127.0.0.1:%d", ep.peer_ack_port);
    REQUIRE(zmq_bind(push, ep_push) == 0);
    REQUIRE(zmq_connect(pull, ep_pull) == 0);

    uint8_t b8[8] = {0}, b7[7] = {0};
    const void *f3[3] = {b8, b8, b8};
    size_t s3[3] = {8, 8, 8}, s2b[2] = {8, 7};
    const void *f2b[2] = {b8, b7};
    zsend_frames(push, f3, s3, 1);
    zsend_frames(push, f3, s3, 3);
    zsend_frames(push, f2b, s2b, 2);
    announce_raw(push, (uint64_t)(uintptr_t)mem, 0);
    announce_raw(push, (uint64_t)(uintptr_t)mem, 1ull << 62);
    announce_raw(push, 0x1000, 64);
    announce_raw(push, (uint64_t)(uintptr_t)mem, garbage_len);
    announce_raw(push, (uint64_t)(uintptr_t)two, two_len);
    announce_raw(push, (uint64_t)(uintptr_t)good, good_len);

    /* One ACK per announcement, refused ones included. */
    int acks = 0;
    char ack[8];
    for (size_t i = 0; i < RAW_N; i++) {
        int n = zmq_recv(pull, ack, sizeof ack, 0);
        if (n != 3 || memcmp(ack, "ACK", 3) != 0) break;
        acks++;
    }
    CHECK(acks == (int)RAW_N);
    CHECK(kvpt_wait_child(dec, KVPT_SIDE_TIMEOUT) == 0);
    zmq_close(push);
    zmq_close(pull);
    zmq_ctx_term(ctx);
    kvp_engine_destroy(engine);
    free(conn);
    kvp_pipe_config_free(cfg);
}

/* ACKs from a misbehaving peer. A fake decode binds only its ACK socket and
 * never takes announcements, so each send waits for ZeroMQ to take its
 * announcement until the send timeout; ACKs arriving meanwhile are strays
 * (the message is queued for its ACK only as it leaves) and must free
 * nothing: the failed send keeps its buffer (send_take: the caller's tensor
 * stays intact and allocated), and frees it once (copying send). */
typedef struct ack_later {
    void *sock;
    int delay_ms;
} ack_later;

static void *send_ack_later(void *arg)
{
    ack_later *a = arg;
    usleep((useconds_t)a->delay_ms * 1000);
    zmq_send(a->sock, "ACK", 3, 0);
    return NULL;
}

static void ack_during(void *sock, pthread_t *th, ack_later *a)
{
    a->sock = sock;
    a->delay_ms = 500;
    REQUIRE(pthread_create(th, NULL, send_ack_later, a) == 0);
}

static void test_ack_while_announcing(void)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 1) == 0);
    kvp_pipe_config *cfg;
    REQUIRE_OK(kvp_pipe_config_parse(s.json, strlen(s.json), &cfg));
    kvp_pipe_endpoints dec;
    REQUIRE_OK(kvp_pipe_config_endpoints(cfg, 0, 1, &dec));
    kvp_pipe_config_free(cfg);
    void *ctx = zmq_ctx_new();
    void *ack = zmq_socket(ctx, ZMQ_PUSH);
    int zero = 0;
    zmq_setsockopt(ack, ZMQ_LINGER, &zero, sizeof zero);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", dec.ack_port);
    REQUIRE(zmq_bind(ack, ep) == 0);

    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.send_timeout_ms = 2000;
    kvp_pipe *pipe;
    REQUIRE_OK(kvpt_pipe_open(s.json, 0, &o, &pipe));
    /* A stray ACK with nothing in flight is counted and ignored. */
    zmq_send(ack, "ACK", 3, 0);
    kvp_pipe_stats st = {0};
    for (int i = 0; i < 100 && st.bad_acks == 0; i++) {
        usleep(20000);
        kvp_pipe_get_stats(pipe, &st);
    }
    CHECK(st.bad_acks == 1 && st.acks == 0);

    int64_t n = 1 << 20;
    kvp_tensor *t;
    REQUIRE_OK(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_U8, 1, &n, &t));
    kvpt_fill(t->data, t->nbytes, 21);
    pthread_t th;
    ack_later a;
    ack_during(ack, &th, &a);
    CHECK_ST(kvp_pipe_send_take(pipe, t), KVP_ETIMEDOUT);
    pthread_join(th, NULL);
    kvp_pipe_get_stats(pipe, &st);
    /* The message never left (no peer took it), so it was never queued for an
     * ACK: this one is a stray too, whichever moment it came. */
    CHECK(st.acks == 0 && st.bad_acks == 2 && st.inflight_count == 0 && st.inflight_bytes == 0 &&
          st.sent == 0);
    /* Still the caller's: intact, and not handed out again by the pool. */
    CHECK(kvpt_verify(t->data, t->nbytes, 21) == (size_t)-1);
    kvp_tensor *other;
    REQUIRE_OK(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_U8, 1, &n, &other));
    CHECK(other->data != t->data);
    kvp_tensor_free(other);
    kvp_tensor_free(t);

    /* The copying send: its buffer is freed once, by the send (ASan/valgrind
     * would see a double free). */
    static uint8_t buf[4096];
    int64_t m = sizeof buf;
    kvp_tensor c;
    kvp_tensor_init(&c, KVP_DTYPE_U8, 1, &m, buf);
    ack_during(ack, &th, &a);
    CHECK_ST(kvp_pipe_send(pipe, &c), KVP_ETIMEDOUT);
    pthread_join(th, NULL);
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.acks == 0 && st.bad_acks == 3 && st.inflight_count == 0 && st.sent == 0);
    kvp_pipe_close(pipe);
    zmq_close(ack);
    zmq_ctx_term(ctx);
}

static const kvpt_pipe_case cases[] = {
    KVPT_PIPE_CASE(test_no_peer, 120, 0),
    KVPT_PIPE_CASE(test_tensor_outlives_close, 120, 0),
    KVPT_PIPE_CASE(test_malformed_from_raw_peer, 120, 0),
    KVPT_PIPE_CASE(test_receiver_killed, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_sender_killed, 120, 0),
    KVPT_PIPE_CASE(test_ack_while_announcing, 60, 0),
};

int main(int argc, char **argv)
{
    return kvpt_pipe_main(argc, argv, cases, sizeof cases / sizeof cases[0]);
}
