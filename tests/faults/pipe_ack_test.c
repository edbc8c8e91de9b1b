/* A hostile or broken receiver on a sender's ACK link: a raw peer (a real
 * engine plus bare libzmq sockets on decode's ports) reads a real prefill
 * pipe's tensors and answers with malformed ACKs, an oversized frame, and a
 * flood of stray ACKs. Only a 3-byte "ACK" may free a buffer, the link must
 * survive the oversized frame, the in-flight count must stay exact, and the
 * log must stay short.
 *
 * Tags (src/pipe/pipe_internal.h, "Tags"): a raw receiver that offers them
 * gets tagged announcements and answers with tagged ACKs of another instance,
 * of a message never sent, cumulative and repeated ones; a raw sender
 * announces with the tag of another instance (as a dead predecessor's
 * message left queued would be), its own, and none, to a real receiver. */
#include "engine/engine_ext.h"
#include "pipe/announce.h"
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/net.h"
#include "pipe/safetensors.h"
#include "test.h"
#include "peer.h"

typedef struct script {
    kvpt_chan to_peer, to_pipe;
} script;

#define GARBAGE_ACKS 6
#define STRAY_ACKS 10000

/* Wait until the pipe has counted want bad ACKs (or the wait runs out). */
static kvp_pipe_stats wait_bad_acks(kvp_pipe *pipe, uint64_t want)
{
    kvp_pipe_stats s;
    uint64_t deadline = kvpi_now_ms() + KVPT_RAW_WAIT_MS;
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

static void step_or_fail(kvpt_chan *c, char want)
{
    char got = kvpt_wait_step(c, KVPT_RAW_SIDE_MS);
    if (got != want) fprintf(stderr, "  step '%c' never came (got %d)\n", want, got);
    CHECK(got == want);
}

/* The setup, the script's channels and the kvpipe prefill running fn, its
 * stderr in err (128 bytes, named what); -1 if any fails. The child comes
 * first: it must not inherit this process's engine or sockets. */
static pid_t script_start(kvpt_raw_setup *s, script *sc, const char *what, kvpt_side_fn fn,
                          char *err)
{
    if (kvpt_raw_setup_init(s) || kvpt_chan_init(&sc->to_peer) || kvpt_chan_init(&sc->to_pipe))
        return -1;
    kvpt_err_path(err, 128, what);
    return kvpt_raw_spawn_side(s, 0, fn, sc, err);
}

/* The prefill pipe's part of the script. */
static void sender(kvp_pipe *pipe, void *arg)
{
    script *sc = arg;
    for (int i = 0; i < 4; i++)
        kvpt_raw_send_good(pipe, i);
    kvpt_step(&sc->to_peer, 'a');

    /* Malformed ACKs free nothing. */
    step_or_fail(&sc->to_pipe, 'b');
    kvp_pipe_stats s = wait_bad_acks(pipe, GARBAGE_ACKS);
    CHECK(s.bad_acks == GARBAGE_ACKS);
    CHECK(s.acks == 0 && s.inflight_count == 4 && s.inflight_bytes > 0);
    kvpt_step(&sc->to_peer, 'c');

    /* After an oversized frame cut the link, the real ACKs still arrive. */
    step_or_fail(&sc->to_pipe, 'd');
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &s);
    CHECK(s.acks == 4 && s.inflight_count == 0 && s.inflight_bytes == 0);
    kvpt_step(&sc->to_peer, 'e');

    /* Stray ACKs with nothing in flight are counted and dropped. */
    step_or_fail(&sc->to_pipe, 'f');
    s = wait_bad_acks(pipe, GARBAGE_ACKS + STRAY_ACKS);
    CHECK(s.bad_acks == GARBAGE_ACKS + STRAY_ACKS);
    CHECK(s.acks == 4 && s.inflight_count == 0);

    /* And the pipe goes on. */
    kvpt_raw_send_good(pipe, 4);
    kvpt_step(&sc->to_peer, 'g');
    step_or_fail(&sc->to_pipe, 'h');
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &s);
    CHECK(s.acks == 5 && s.inflight_count == 0 && s.sent == 5);
}

/* READ message i, announced at [addr, +len), from prefill's engine and
 * check it. */
static void read_checked(kvp_engine *e, kvp_segment_id seg, uint64_t addr, uint64_t len, int i)
{
    void *buf;
    REQUIRE_OK(kvp_engine_alloc(e, len, &buf));
    CHECK_OK(kvp_engine_read(e, seg, buf, addr, len));
    kvp_tensor t;
    CHECK_OK(kvpi_safetensors_parse(buf, len, &t));
    CHECK(kvpt_raw_tensor_check(&t, i));
    kvp_engine_free(e, buf);
}

/* Take announcement i, READ it and check it. */
static void read_announced(kvp_engine *e, kvp_segment_id seg, void *pull, int i)
{
    uint8_t f[KVPT_RAW_MSG_FRAMES][KVPT_RAW_MSG_HEAD];
    size_t sz[KVPT_RAW_MSG_FRAMES];
    int frames = kvpt_zmq_recv_message(pull, f, sz, KVPT_RAW_WAIT_MS);
    REQUIRE(frames == 2 && sz[0] == 8 && sz[1] == 8);
    read_checked(e, seg, kvpi_get_be64(f[0]), kvpi_get_be64(f[1]), i);
}

static void send_ack(void *push, const char *text, size_t len)
{
    CHECK(zmq_send(push, text, len, 0) == (int)len);
}

static void test_malformed_oversized_and_stray_acks(void)
{
    kvpt_raw_setup s;
    script sc;
    char err[128];
    pid_t prefill = script_start(&s, &sc, "ack_prefill", sender, err);
    REQUIRE(prefill > 0);

    /* The raw decode: an engine to READ with, a PULL for the announcements and
     * a PUSH (watched) on decode's ACK port. */
    kvp_engine *e;
    REQUIRE_OK(kvpt_raw_engine(&s, 1, &e));
    kvpt_raw_peer r;
    REQUIRE(kvpt_raw_peer_start(&r, &s, 1, KVPT_RAW_WATCH_PUSH) == 0);
    r.e = e;
    void *pull = r.pull, *push = r.push, *mon = r.mon;

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
    CHECK(kvpt_zmq_send_frames(push, two, two_sz, 2) == 0);
    CHECK(kvpt_zmq_send_frames(push, two, ack_empty_sz, 2) == 0);
    kvpt_step(&sc.to_pipe, 'b');

    step_or_fail(&sc.to_peer, 'c');
    static char big[5000];
    memset(big, 'A', sizeof big);
    send_ack(push, big, sizeof big);
    CHECK(kvpt_zmq_wait_event(mon, ZMQ_EVENT_DISCONNECTED, KVPT_RAW_WAIT_MS) == 0);
    int back = kvpt_zmq_wait_event(mon, ZMQ_EVENT_HANDSHAKE_SUCCEEDED, KVPT_RAW_WAIT_MS);
    if (back != 0) {
        /* Every ACK from here on would wait for a link that is gone. */
        fprintf(stderr, "  the pipe did not reconnect its ACK link; its stderr:\n");
        kvpt_file_show(err, "prefill");
        kill(prefill, SIGKILL);
    }
    REQUIRE(back == 0);
    for (int i = 0; i < 4; i++)
        send_ack(push, "ACK", 3);
    kvpt_step(&sc.to_pipe, 'd');

    step_or_fail(&sc.to_peer, 'e');
    for (int i = 0; i < STRAY_ACKS; i++)
        send_ack(push, "ACK", 3);
    kvpt_step(&sc.to_pipe, 'f');

    step_or_fail(&sc.to_peer, 'g');
    read_announced(e, seg, pull, 4);
    send_ack(push, "ACK", 3);
    kvpt_step(&sc.to_pipe, 'h');

    int rc = kvpt_wait_child(prefill, KVPT_RAW_SIDE_MS);
    if (rc != 0) {
        fprintf(stderr, "  prefill side exit %d; its stderr:\n", rc);
        kvpt_file_show(err, "prefill");
    }
    CHECK(rc == 0);
    /* One line per kind (malformed, oversized, stray), not one per frame. */
    int lines = kvpt_file_lines(err, " kvpipe[");
    if (lines > 4) fprintf(stderr, "  %d log lines\n", lines);
    CHECK(lines >= 2 && lines <= 4);
    unlink(err);
    kvpt_raw_peer_stop(&r);
}

/* ------------------------------------------------------------- tags --- */

#define TAGGED 3

static kvp_pipe_stats wait_stats(kvp_pipe *pipe, int (*done)(const kvp_pipe_stats *))
{
    kvp_pipe_stats s;
    uint64_t deadline = kvpi_now_ms() + KVPT_RAW_WAIT_MS;
    do {
        kvp_pipe_get_stats(pipe, &s);
        if (done(&s)) break;
        usleep(10000);
    } while (kvpi_now_ms() < deadline);
    return s;
}

static int negotiated(const kvp_pipe_stats *s)
{
    return s->peer_lookups >= 1;
}

static int two_bad(const kvp_pipe_stats *s)
{
    return s->bad_acks >= 2;
}

static int one_left(const kvp_pipe_stats *s)
{
    return s->inflight_count <= 1;
}

/* The real prefill pipe of the tagged-ACK script. */
static void tagged_sender(kvp_pipe *pipe, void *arg)
{
    script *sc = arg;
    /* Tags go once the negotiator read the peer's descriptor. */
    kvp_pipe_stats s = wait_stats(pipe, negotiated);
    CHECK(s.peer_lookups >= 1);
    for (int i = 0; i < TAGGED; i++)
        kvpt_raw_send_good(pipe, i);
    kvpt_step(&sc->to_peer, 'a');

    /* Another instance's ACK and one of a message never sent free nothing. */
    step_or_fail(&sc->to_pipe, 'b');
    s = wait_stats(pipe, two_bad);
    CHECK(s.bad_acks == 2 && s.acks == 0 && s.inflight_count == TAGGED);
    kvpt_step(&sc->to_peer, 'c');

    /* A tagged ACK frees every message up to its number. */
    step_or_fail(&sc->to_pipe, 'd');
    s = wait_stats(pipe, one_left);
    CHECK(s.acks == 2 && s.inflight_count == 1);
    kvpt_step(&sc->to_peer, 'e');

    /* A repeated one frees nothing more; the last frees the last. */
    step_or_fail(&sc->to_pipe, 'f');
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_get_stats(pipe, &s);
    CHECK(s.acks == TAGGED && s.bad_acks == 2 && s.inflight_count == 0);
}

static void send_tagged_ack(void *push, const char *instance, uint64_t seq)
{
    kvpi_msg_tag t = {.seq = seq};
    memcpy(t.instance, instance, KVPI_TAG_INSTANCE_LEN);
    uint8_t tag[KVPI_TAG_DIGEST_LEN];
    size_t len = kvpi_tag_encode(&t, tag);
    const void *f[2] = {"ACK", tag};
    size_t sz[2] = {3, len};
    CHECK(kvpt_zmq_send_frames(push, f, sz, 2) == 0);
}

/* The descriptor field of a pipe that reads tags and takes nothing inline. */
static kvp_status tag_reader_engine(const kvpt_raw_setup *s, int rank, kvp_engine **out)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = s->side[rank].local_segment;
    eo.metadata = "P2PHANDSHAKE";
    eo.disable_shm = 1;
    cJSON *fields = cJSON_Parse("{\"kvpipe_pipe\": {\"version\": 2, \"inline_max_bytes\": 0}}");
    kvp_status st = kvpi_engine_create_with_fields(&eo, fields, out);
    cJSON_Delete(fields);
    return st;
}

static void test_tagged_acks(void)
{
    kvpt_raw_setup s;
    script sc;
    char err[128];
    pid_t prefill = script_start(&s, &sc, "tag_prefill", tagged_sender, err);
    REQUIRE(prefill > 0);
    kvp_engine *e;
    REQUIRE_OK(tag_reader_engine(&s, 1, &e));
    kvpt_raw_peer r;
    REQUIRE(kvpt_raw_peer_start(&r, &s, 1, KVPT_RAW_WATCH_NONE) == 0);
    r.e = e;
    void *pull = r.pull, *push = r.push;

    step_or_fail(&sc.to_peer, 'a');
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, s.side[0].local_segment, &seg));
    cJSON *id = NULL;
    REQUIRE_OK(kvpi_engine_lookup_field(e, s.side[0].local_segment, "kvpipe_instance", &id));
    REQUIRE(cJSON_IsString(id) && strlen(id->valuestring) == KVPI_TAG_INSTANCE_LEN);
    for (int i = 0; i < TAGGED; i++) {
        uint8_t f[KVPT_RAW_MSG_FRAMES][KVPT_RAW_MSG_HEAD];
        size_t sz[KVPT_RAW_MSG_FRAMES];
        int frames = kvpt_zmq_recv_message(pull, f, sz, KVPT_RAW_WAIT_MS);
        /* An announcement, then its tag: the prefill engine's instance, and
         * the message's number from 1. */
        CHECK(frames == 3 && sz[0] == 8 && sz[1] == 8 && sz[2] == KVPI_TAG_LEN);
        if (frames != 3) break;
        CHECK(memcmp(f[2], id->valuestring, KVPI_TAG_INSTANCE_LEN) == 0);
        CHECK(kvpi_get_be64(f[2] + KVPI_TAG_INSTANCE_LEN) == (uint64_t)i + 1);
        read_checked(e, seg, kvpi_get_be64(f[0]), kvpi_get_be64(f[1]), i);
    }
    char other[KVPI_TAG_INSTANCE_LEN + 1];
    snprintf(other, sizeof other, "%s", id->valuestring);
    other[0] = other[0] == 'a' ? 'b' : 'a';
    send_tagged_ack(push, other, TAGGED);
    send_tagged_ack(push, id->valuestring, 99);
    kvpt_step(&sc.to_pipe, 'b');

    step_or_fail(&sc.to_peer, 'c');
    send_tagged_ack(push, id->valuestring, 2);
    kvpt_step(&sc.to_pipe, 'd');

    step_or_fail(&sc.to_peer, 'e');
    send_tagged_ack(push, id->valuestring, 2);
    send_tagged_ack(push, id->valuestring, 3);
    kvpt_step(&sc.to_pipe, 'f');

    int rc = kvpt_wait_child(prefill, KVPT_RAW_SIDE_MS);
    if (rc != 0) {
        fprintf(stderr, "  prefill side exit %d; its stderr:\n", rc);
        kvpt_file_show(err, "prefill");
    }
    CHECK(rc == 0);
    unlink(err);
    cJSON_Delete(id);
    kvpt_raw_peer_stop(&r);
}

/* The real decode pipe of the stale-instance script: message 0 came from
 * another instance than the prefill engine's, 1 and 2 are good. */
static void stale_receiver(kvp_pipe *pipe, void *arg)
{
    (void)arg;
    kvp_tensor *t = NULL;
    kvp_status st = kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t);
    CHECK(st == KVP_ECONNRESET && strstr(kvp_last_error(), "restarted"));
    if (st != KVP_ECONNRESET) fprintf(stderr, "  recv: %s\n", kvp_last_error());
    for (int i = 1; i <= 2; i++) {
        t = NULL;
        CHECK_OK(kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t));
        CHECK(kvpt_raw_tensor_check(t, i));
        kvp_tensor_free(t);
    }
}

static void test_stale_instance_announcement(void)
{
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    char err[128];
    kvpt_err_path(err, sizeof err, "tag_decode");
    /* The child first: it must not inherit this process's engine or sockets. */
    pid_t decode = kvpt_raw_spawn_side(&s, 1, stale_receiver, NULL, err);
    kvp_engine *e;
    REQUIRE_OK(kvpt_raw_engine(&s, 0, &e));
    kvpt_raw_peer r;
    REQUIRE(kvpt_raw_peer_start(&r, &s, 0, KVPT_RAW_WATCH_PULL) == 0);
    r.e = e;
    void *push = r.push, *pull = r.pull, *mon = r.mon;

    const char *mine = kvp_engine_instance(e);
    char other[KVPI_TAG_INSTANCE_LEN + 1];
    snprintf(other, sizeof other, "%s", mine);
    other[0] = other[0] == 'a' ? 'b' : 'a';
    /* One message at a time, with the ACK link up: each is answered alone
     * (ACKs owed together would leave as the newest, which covers them). */
    CHECK(kvpt_zmq_wait_event(mon, ZMQ_EVENT_HANDSHAKE_SUCCEEDED, KVPT_RAW_WAIT_MS) == 0);
    for (int i = 0; i < 3; i++) {
        void *buf;
        size_t len;
        REQUIRE_OK(kvpt_raw_message(e, i, &buf, &len));
        uint8_t a[8], l[8], tag[KVPI_TAG_DIGEST_LEN];
        kvpi_put_be64(a, (uint64_t)(uintptr_t)buf);
        kvpi_put_be64(l, len);
        kvpi_msg_tag t = {.seq = (uint64_t)i + 1};
        memcpy(t.instance, i == 0 ? other : mine, KVPI_TAG_INSTANCE_LEN);
        size_t tag_len = kvpi_tag_encode(&t, tag);
        const void *f[3] = {a, l, tag};
        size_t sz[3] = {8, 8, tag_len};
        /* The last one untagged: MooncakePipe's wire still works. */
        CHECK(kvpt_zmq_send_frames(push, f, sz, i == 2 ? 2 : 3) == 0);
        /* Answered with a tagged ACK echoing its tag, the untagged one
         * plainly. */
        uint8_t ack[KVPT_RAW_MSG_FRAMES][KVPT_RAW_MSG_HEAD];
        size_t asz[KVPT_RAW_MSG_FRAMES];
        int frames = kvpt_zmq_recv_message(pull, ack, asz, KVPT_RAW_WAIT_MS);
        int want = i == 2 ? 1 : 2;
        CHECK(frames == want && asz[0] == 3 && memcmp(ack[0], "ACK", 3) == 0);
        if (frames != 2 || want != 2) continue;
        CHECK(asz[1] == KVPI_TAG_LEN &&
              memcmp(ack[1], i == 0 ? other : mine, KVPI_TAG_INSTANCE_LEN) == 0 &&
              kvpi_get_be64(ack[1] + KVPI_TAG_INSTANCE_LEN) == (uint64_t)i + 1);
    }
    int rc = kvpt_wait_child(decode, KVPT_RAW_SIDE_MS);
    if (rc != 0) {
        fprintf(stderr, "  decode side exit %d; its stderr:\n", rc);
        kvpt_file_show(err, "decode");
    }
    CHECK(rc == 0);
    unlink(err);
    kvpt_raw_peer_stop(&r);
}

int main(void)
{
    RUN_T(test_malformed_oversized_and_stray_acks, 240);
    RUN_T(test_tagged_acks, 120);
    RUN_T(test_stale_instance_announcement, 120);
    return kvpt_summary();
}
