/* The inline path never reaches a peer that did not offer it (issue 15): a
 * raw MooncakePipe-wire receiver (a real engine, bare libzmq sockets) gets
 * every message of a kvpipe pipe as an announcement of two 8-byte frames,
 * READs it and ACKs it; and when a kvpipe receiver that took inline messages
 * is replaced on the same ports by such a raw receiver while the sender is
 * waiting to send, nothing after the swap goes inline. */
#include <sys/wait.h>
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

#define BEFORE 8 /* inline messages to the kvpipe receiver */
#define AFTER 12 /* announced messages to the raw receiver */

/* Wait until the pipe has read its peer's descriptor. */
static kvp_pipe_stats wait_lookup(kvp_pipe *pipe)
{
    kvp_pipe_stats st = {0};
    uint64_t deadline = kvpi_now_ms() + KVPT_RAW_WAIT_MS;
    while (kvp_pipe_get_stats(pipe, &st), st.peer_lookups == 0 && kvpi_now_ms() < deadline)
        usleep(10000);
    return st;
}

/* The raw receiver: a real engine under decode's segment name, a PULL on
 * prefill's announce port and a PUSH bound on decode's ACK port. */
typedef struct raw_decode {
    kvp_engine *engine;
    void *ctx, *pull, *push;
    kvp_segment_id prefill;
    int opened;
} raw_decode;

static int raw_decode_start(raw_decode *r, const kvpt_raw_setup *s)
{
    if (kvpt_raw_engine(s, 1, &r->engine)) return -1;
    r->ctx = zmq_ctx_new();
    r->pull = kvpt_zmq_socket(r->ctx, ZMQ_PULL);
    r->push = kvpt_zmq_socket(r->ctx, ZMQ_PUSH);
    return kvpt_zmq_bind(r->push, s->side[1].ack_port);
}

/* Connect the PULL once prefill's pipe listens on its announce port. */
static int raw_decode_connect(raw_decode *r, const kvpt_raw_setup *s)
{
    if (kvpt_wait_port("127.0.0.1", s->side[0].data_port, KVPT_RAW_WAIT_MS) != 0) return -1;
    return kvpt_zmq_connect(r->pull, s->side[0].data_port);
}

static void raw_decode_stop(raw_decode *r)
{
    zmq_close(r->pull);
    zmq_close(r->push);
    zmq_ctx_term(r->ctx);
    kvp_engine_destroy(r->engine);
}

/* Take one message as MooncakePipe does: two 8-byte frames, the READ of
 * the range, the tensor in it, then "ACK". 1 when it was tensor i. */
static int raw_take(raw_decode *r, const kvpt_raw_setup *s, int i)
{
    zmq_msg_t f[2];
    zmq_msg_init(&f[0]);
    zmq_msg_init(&f[1]);
    int frames = 0, more = 1;
    size_t size[2] = {0, 0};
    int tmo = KVPT_RAW_WAIT_MS;
    zmq_setsockopt(r->pull, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    while (more && frames < 2) {
        if (zmq_msg_recv(&f[frames], r->pull, 0) < 0) break;
        size[frames] = zmq_msg_size(&f[frames]);
        more = zmq_msg_more(&f[frames]);
        frames++;
    }
    int ok = frames == 2 && !more && size[0] == 8 && size[1] == 8;
    if (!ok)
        fprintf(stderr, "  message %d: %d frame(s) of %zu and %zu bytes%s, not an announcement\n",
                i, frames, size[0], size[1], more ? " and more" : "");
    uint64_t addr = ok ? kvpi_get_be64(zmq_msg_data(&f[0])) : 0;
    uint64_t len = ok ? kvpi_get_be64(zmq_msg_data(&f[1])) : 0;
    zmq_msg_close(&f[0]);
    zmq_msg_close(&f[1]);
    if (!ok) return 0;
    if (!r->opened) {
        if (kvp_engine_open_segment(r->engine, s->side[0].local_segment, &r->prefill)) {
            fprintf(stderr, "  open %s: %s\n", s->side[0].local_segment, kvp_last_error());
            return 0;
        }
        r->opened = 1;
    }
    uint8_t *buf = malloc(len ? len : 1);
    kvp_tensor t;
    int good = buf && kvp_engine_read(r->engine, r->prefill, buf, addr, len) == KVP_OK &&
               kvpi_safetensors_parse(buf, len, &t) == KVP_OK && kvpt_raw_tensor_check(&t, i);
    if (!good) fprintf(stderr, "  message %d: bad READ or tensor: %s\n", i, kvp_last_error());
    free(buf);
    zmq_send(r->push, "ACK", 3, 0);
    return good;
}

/* ------------------------------------------------- a raw receiver only --- */

static void send_after_lookup(kvp_pipe *pipe, void *arg)
{
    (void)arg;
    kvp_pipe_stats st = wait_lookup(pipe);
    CHECK(st.peer_lookups > 0 && st.peer_inline_max == 0);
    for (int i = 0; i < AFTER; i++)
        kvpt_raw_send_good(pipe, i);
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.sent == AFTER && st.acks == AFTER && st.inline_sent == 0);
}

static void test_raw_receiver_gets_announcements(void)
{
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    char err[128];
    kvpt_err_path(err, sizeof err, "fallback_prefill");
    /* The side is forked before this process starts threads of its own (the
     * raw receiver's engine and ZeroMQ): a fork of a threaded process can
     * inherit a lock some other thread held, and hang. */
    pid_t prefill = kvpt_raw_spawn_side(&s, 0, send_after_lookup, NULL, err);
    raw_decode r = {0};
    REQUIRE(raw_decode_start(&r, &s) == 0);
    CHECK(raw_decode_connect(&r, &s) == 0);
    int good = 0;
    for (int i = 0; i < AFTER && good == i; i++)
        good += raw_take(&r, &s, i);
    CHECK(good == AFTER);
    if (good != AFTER) kill(prefill, SIGKILL); /* and show why below */
    int rc = kvpt_wait_child(prefill, KVPT_RAW_SIDE_MS);
    if (rc) kvpt_file_show(err, "prefill");
    CHECK(rc == 0);
    raw_decode_stop(&r);
    unlink(err);
}

/* ----------------------------------------------- a receiver replaced --- */

typedef struct swap {
    kvpt_chan go;   /* parent -> prefill: 'g' once the kvpipe decode is gone */
    kvpt_chan done; /* decode -> parent: 'd' when it took its messages */
} swap;

static void prefill_swap(kvp_pipe *pipe, void *arg)
{
    swap *w = arg;
    kvp_pipe_stats st = {0};
    uint64_t deadline = kvpi_now_ms() + KVPT_RAW_WAIT_MS;
    while (kvp_pipe_get_stats(pipe, &st), st.peer_inline_max == 0 && kvpi_now_ms() < deadline)
        usleep(10000);
    CHECK(st.peer_inline_max > 0);
    for (int i = 0; i < BEFORE; i++)
        kvpt_raw_send_good(pipe, i);
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.inline_sent == BEFORE);
    CHECK(kvpt_wait_step(&w->go, KVPT_RAW_SIDE_MS) == 'g');
    /* The first of these waits for a receiver: the raw one comes. */
    for (int i = 0; i < AFTER; i++)
        kvpt_raw_send_good(pipe, BEFORE + i);
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &st);
    if (st.inline_sent != BEFORE)
        fprintf(stderr, "  %llu messages went inline, want %d\n",
                (unsigned long long)st.inline_sent, BEFORE);
    CHECK(st.inline_sent == BEFORE && st.sent == BEFORE + AFTER && st.acks == st.sent);
}

static void decode_then_leave(kvp_pipe *pipe, void *arg)
{
    swap *w = arg;
    for (int i = 0; i < BEFORE; i++) {
        kvp_tensor *t = NULL;
        CHECK_OK(kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t));
        CHECK(kvpt_raw_tensor_check(t, i));
        kvp_tensor_free(t);
    }
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.inline_received == BEFORE);
    kvpt_step(&w->done, 'd');
}

static void test_receiver_replaced_by_raw_peer(void)
{
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    swap w;
    REQUIRE(kvpt_chan_init(&w.go) == 0 && kvpt_chan_init(&w.done) == 0);
    kvpt_raw_sides p;
    kvpt_raw_sides_spawn(&p, &s, "swap", prefill_swap, decode_then_leave, &w);
    CHECK(kvpt_wait_step(&w.done, KVPT_RAW_SIDE_MS) == 'd');
    int rd = kvpt_wait_child(p.pid[1], KVPT_RAW_SIDE_MS);
    if (rd) kvpt_file_show(p.err[1], "decode");
    CHECK(rd == 0);
    /* The kvpipe decode is gone (its ports free): let the sender wait, then
     * bring the raw one up on the same ports. */
    kvpt_step(&w.go, 'g');
    usleep(200000);
    raw_decode r = {0};
    REQUIRE(raw_decode_start(&r, &s) == 0);
    CHECK(raw_decode_connect(&r, &s) == 0); /* prefill listens already */
    int good = 0;
    for (int i = 0; i < AFTER; i++)
        good += raw_take(&r, &s, BEFORE + i);
    CHECK(good == AFTER);
    int rp = kvpt_wait_child(p.pid[0], KVPT_RAW_SIDE_MS);
    if (rp) kvpt_file_show(p.err[0], "prefill");
    CHECK(rp == 0);
    raw_decode_stop(&r);
    kvpt_raw_sides_unlink(&p);
}

int main(void)
{
    RUN_T(test_raw_receiver_gets_announcements, 180);
    RUN_T(test_receiver_replaced_by_raw_peer, 180);
    return kvpt_summary();
}
