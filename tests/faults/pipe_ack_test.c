/* A hostile or broken receiver on a sender's ACK link: a raw peer (a real
 * engine plus bare libzmq sockets on decode's ports) reads a real prefill
 * pipe's tensors and answers with malformed ACKs, an oversized frame, and a
 * flood of stray ACKs. Only a 3-byte "ACK" may free a buffer, the link must
 * survive the oversized frame, the in-flight count must stay exact, and the
 * log must stay short. */
#include "pipe_raw.h"

typedef struct script {
    raw_chan to_peer, to_pipe;
} script;

#define GARBAGE_ACKS 6
#define STRAY_ACKS 10000

/* Wait until the pipe has counted want bad ACKs (or the wait runs out). */
static kvp_pipe_stats wait_bad_acks(kvp_pipe *pipe, uint64_t want)
{
    kvp_pipe_stats s;
    uint64_t deadline = kvpi_now_ms() + RAW_WAIT_MS;
    do {
        kvp_pipe_get_stats(pipe, &s);
        if (s.bad_acks >= want) break;
        usleep(10000);
    } while (kvpi_now_ms() < deadline);
    if (s.bad_acks != want)
        fprintf(stderr, "  prefill: bad_acks %llu, want %llu\n", (unsigned long long)s.bad_acks,
                (unsigned long long)want);
    return s;
}

static void step_or_fail(raw_chan *c, char want)
{
    char got = raw_wait_step(c, RAW_SIDE_MS);
    if (got != want) fprintf(stderr, "  step '%c' never came (got %d)\n", want, got);
    CHECK(got == want);
}

/* The prefill pipe's part of the script. */
static void sender(kvp_pipe *pipe, void *arg)
{
    script *sc = arg;
    for (int i = 0; i < 4; i++)
        raw_send_good(pipe, i);
    raw_step(&sc->to_peer, 'a');

    /* Malformed ACKs free nothing. */
    step_or_fail(&sc->to_pipe, 'b');
    kvp_pipe_stats s = wait_bad_acks(pipe, GARBAGE_ACKS);
    CHECK(s.bad_acks == GARBAGE_ACKS);
    CHECK(s.acks == 0 && s.inflight_count == 4 && s.inflight_bytes > 0);
    raw_step(&sc->to_peer, 'c');

    /* After an oversized frame cut the link, the real ACKs still arrive. */
    step_or_fail(&sc->to_pipe, 'd');
    CHECK_OK(kvp_pipe_flush(pipe, RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &s);
    CHECK(s.acks == 4 && s.inflight_count == 0 && s.inflight_bytes == 0);
    raw_step(&sc->to_peer, 'e');

    /* Stray ACKs with nothing in flight are counted and dropped. */
    step_or_fail(&sc->to_pipe, 'f');
    s = wait_bad_acks(pipe, GARBAGE_ACKS + STRAY_ACKS);
    CHECK(s.bad_acks == GARBAGE_ACKS + STRAY_ACKS);
    CHECK(s.acks == 4 && s.inflight_count == 0);

    /* And the pipe goes on. */
    raw_send_good(pipe, 4);
    raw_step(&sc->to_peer, 'g');
    step_or_fail(&sc->to_pipe, 'h');
    CHECK_OK(kvp_pipe_flush(pipe, RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &s);
    CHECK(s.acks == 5 && s.inflight_count == 0 && s.sent == 5);
}

/* Take announcement i, READ it from prefill's engine and check it. */
static void read_announced(kvp_engine *e, kvp_segment_id seg, void *pull, int i)
{
    uint8_t f[2][16];
    size_t sz[2];
    int frames = raw_recv_message(pull, f, sz, RAW_WAIT_MS);
    REQUIRE(frames == 2 && sz[0] == 8 && sz[1] == 8);
    uint64_t addr = kvpi_get_be64(f[0]), len = kvpi_get_be64(f[1]);
    void *buf;
    REQUIRE_OK(kvp_engine_alloc(e, len, &buf));
    CHECK_OK(kvp_engine_read(e, seg, buf, addr, len));
    kvp_tensor t;
    CHECK_OK(kvpi_safetensors_parse(buf, len, &t));
    CHECK(raw_tensor_check(&t, i));
    kvp_engine_free(e, buf);
}

static void send_ack(void *push, const char *text, size_t len)
{
    CHECK(zmq_send(push, text, len, 0) == (int)len);
}

static void test_malformed_oversized_and_stray_acks(void)
{
    raw_setup s;
    REQUIRE(raw_setup_init(&s) == 0);
    script sc;
    REQUIRE(raw_chan_init(&sc.to_peer) == 0 && raw_chan_init(&sc.to_pipe) == 0);
    char err[128];
    raw_err_path(err, sizeof err, "ack_prefill");
    pid_t prefill = raw_spawn_side(&s, 0, sender, &sc, err);

    /* The raw decode: an engine to READ with, a PULL for the announcements and
     * a PUSH (watched) on decode's ACK port. */
    kvp_engine *e;
    REQUIRE_OK(raw_engine(&s, 1, &e));
    void *ctx = zmq_ctx_new();
    void *pull = raw_socket(ctx, ZMQ_PULL), *push = raw_socket(ctx, ZMQ_PUSH);
    void *mon = raw_monitor(ctx, push, "ack");
    REQUIRE(mon && raw_connect(pull, s.side[0].data_port) == 0 &&
            raw_bind(push, s.side[1].ack_port) == 0);

    step_or_fail(&sc.to_peer, 'a');
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, s.side[0].local_segment, &seg));
    for (int i = 0; i < 4; i++)
        read_announced(e, seg, pull, i);
    send_ack(push, "ACX", 3);
    send_ack(push, "ACKK", 4);
    send_ack(push, "", 0);
    send_ack(push, "ack", 3);
    const void *two[2] = {"ACK", "ACK"};
    size_t two_sz[2] = {3, 3}, ack_empty_sz[2] = {3, 0};
    CHECK(raw_send_frames(push, two, two_sz, 2) == 0);
    CHECK(raw_send_frames(push, two, ack_empty_sz, 2) == 0);
    raw_step(&sc.to_pipe, 'b');

    step_or_fail(&sc.to_peer, 'c');
    static char big[5000];
    memset(big, 'A', sizeof big);
    send_ack(push, big, sizeof big);
    CHECK(raw_wait_event(mon, ZMQ_EVENT_DISCONNECTED, RAW_WAIT_MS) == 0);
    int back = raw_wait_event(mon, ZMQ_EVENT_HANDSHAKE_SUCCEEDED, RAW_WAIT_MS);
    if (back != 0) {
        /* Every ACK from here on would wait for a link that is gone. */
        fprintf(stderr, "  the pipe did not reconnect its ACK link; its stderr:\n");
        raw_show(err, "prefill");
        kill(prefill, SIGKILL);
    }
    REQUIRE(back == 0);
    for (int i = 0; i < 4; i++)
        send_ack(push, "ACK", 3);
    raw_step(&sc.to_pipe, 'd');

    step_or_fail(&sc.to_peer, 'e');
    for (int i = 0; i < STRAY_ACKS; i++)
        send_ack(push, "ACK", 3);
    raw_step(&sc.to_pipe, 'f');

    step_or_fail(&sc.to_peer, 'g');
    read_announced(e, seg, pull, 4);
    send_ack(push, "ACK", 3);
    raw_step(&sc.to_pipe, 'h');

    int rc = kvpt_wait_child(prefill, RAW_SIDE_MS);
    if (rc != 0) {
        fprintf(stderr, "  prefill side exit %d; its stderr:\n", rc);
        raw_show(err, "prefill");
    }
    CHECK(rc == 0);
    /* One line per kind (malformed, oversized, stray), not one per frame. */
    int lines = raw_count_lines(err, " kvpipe[");
    if (lines > 4) fprintf(stderr, "  %d log lines\n", lines);
    CHECK(lines >= 2 && lines <= 4);
    unlink(err);
    zmq_close(mon);
    zmq_close(pull);
    zmq_close(push);
    zmq_ctx_term(ctx);
    kvp_engine_destroy(e);
}

int main(void)
{
    RUN_T(test_malformed_oversized_and_stray_acks, 240);
    return kvpt_summary();
}
