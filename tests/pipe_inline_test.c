/* The inline path between two kvpipe pipes (issue 15), across two processes:
 * a pair negotiates it (through the HTTP store and by P2P handshake) and
 * moves a script of tensors - None, zero-size, 0-d, messages one byte below,
 * at and above the inline threshold, small and large mixed, copied and
 * in-place sends - every byte checked, in order, and the ACK accounting exact
 * on both sides; a pair where either side turns the path off moves the same
 * script announced. Deferred ACKs of inline messages: they leave while the
 * receiver is idle or waiting in recv, sixteen at once, along with an
 * announced message's, which never waits, and at close. Also: the pipe's limits as options
 * (bad values refused, degenerate ones working). Raw MooncakePipe peers are in
 * faults/pipe_fallback_test.c. */
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "common/clock.h"
#include "kvpipe/pipe.h"
#include "pipe/safetensors.h"
#include "peer.h"
#include "test.h"

#define WAIT_MS 20000
#define SIDE_MS 120000
#define THRESHOLD 4096 /* both sides' inline_max_bytes in the negotiating cases */

/* ------------------------------------------------------------ harness --- */

static kvp_pipe_opts opts_with(size_t inline_max)
{
    kvp_pipe_opts o;
    kvp_pipe_opts_init(&o);
    o.disable_shm = 1;
    o.send_timeout_ms = WAIT_MS;
    o.inline_max_bytes = inline_max;
    return o;
}

typedef struct side {
    const char *json;
    int rank;
    kvp_pipe_opts opts;
    void (*fn)(kvp_pipe *pipe, const struct side *s);
    size_t peer_inline; /* what the sender expects the peer to offer */
} side;

static void side_main(kvp_pipe *pipe, void *arg)
{
    const side *s = arg;
    s->fn(pipe, s);
}

static void run_pair(const side *prefill, const side *decode)
{
    pid_t a = kvpt_side_spawn(prefill->json, prefill->rank, &prefill->opts, side_main,
                              (void *)prefill, NULL);
    pid_t b =
        kvpt_side_spawn(decode->json, decode->rank, &decode->opts, side_main, (void *)decode, NULL);
    kvpt_sides_wait(a, b, SIDE_MS);
}

/* ------------------------------------------------------------- script --- */

/* A tensor of the script: dtype, shape, and whether it is sent in place. */
typedef struct item {
    kvp_dtype dtype;
    int ndim;
    int64_t shape[2];
    int none, in_place;
} item;

#define MAX_ITEMS 32
static item script[MAX_ITEMS];
static int n_script;

static size_t item_bytes(const item *it)
{
    size_t n;
    if (kvp_tensor_size(it->dtype, it->ndim, it->shape, NULL, &n)) return 0;
    return n;
}

static size_t item_message(const item *it)
{
    static uint8_t any; /* the size does not look at the data */
    int64_t none_value = KVP_PIPE_NONE_VALUE, one = 1;
    kvp_tensor t;
    kvp_status st = it->none ? kvp_tensor_init(&t, KVP_DTYPE_I64, 1, &one, &none_value)
                             : kvp_tensor_init(&t, it->dtype, it->ndim, it->shape, &any);
    size_t size = 0;
    if (st || kvpi_safetensors_size(&t, &size)) return SIZE_MAX;
    return size;
}

/* A U8 vector whose whole message is exactly size bytes (the header's length
 * changes with the digits of the shape, so search). */
static item u8_message_of(size_t size)
{
    item it = {.dtype = KVP_DTYPE_U8, .ndim = 1};
    for (int64_t n = (int64_t)size; n > 0; n--) {
        it.shape[0] = n;
        if (item_message(&it) == size) return it;
    }
    it.shape[0] = 0;
    return it;
}

static void add(item it)
{
    script[n_script++] = it;
}

static void build_script(void)
{
    n_script = 0;
    add((item){.none = 1});
    add((item){.dtype = KVP_DTYPE_U8, .ndim = 1, .shape = {0}});     /* zero-size */
    add((item){.dtype = KVP_DTYPE_F32, .ndim = 0});                  /* 0-d */
    add((item){.dtype = KVP_DTYPE_I64, .ndim = 2, .shape = {0, 7}}); /* zero-size 2-d */
    add(u8_message_of(THRESHOLD - 1));
    add(u8_message_of(THRESHOLD));
    add(u8_message_of(THRESHOLD + 1));
    item big = {.dtype = KVP_DTYPE_F16, .ndim = 2, .shape = {1024, 1024}}; /* 2 MiB */
    add((item){.dtype = KVP_DTYPE_BF16, .ndim = 2, .shape = {16, 64}});    /* 2 KiB */
    add(big);
    add((item){.dtype = KVP_DTYPE_U8, .ndim = 1, .shape = {100}});
    add((item){.dtype = KVP_DTYPE_F64, .ndim = 1, .shape = {70000}}); /* 560 KB */
    add((item){.none = 1});
    item take_small = u8_message_of(THRESHOLD);
    take_small.in_place = 1;
    add(take_small);
    item take_big = big;
    take_big.in_place = 1;
    add(take_big);
    add(u8_message_of(THRESHOLD - 1));
}

/* The script's messages that go inline under a threshold (0: none). */
static uint64_t expected_inline(size_t threshold)
{
    uint64_t n = 0;
    for (int i = 0; i < n_script; i++)
        n += item_message(&script[i]) <= threshold;
    return n;
}

/* Tensor i's bytes: seed i + 1. */
static void fill_item(void *data, size_t n, int i)
{
    kvpt_fill(data, n, (uint64_t)i + 1);
}

static void send_script(kvp_pipe *pipe)
{
    static uint8_t buf[8 << 20];
    for (int i = 0; i < n_script; i++) {
        const item *it = &script[i];
        if (it->none) {
            CHECK_OK(kvp_pipe_send(pipe, NULL));
            continue;
        }
        size_t n = item_bytes(it);
        if (it->in_place) {
            kvp_tensor *t;
            CHECK_OK(kvp_pipe_tensor_alloc(pipe, it->dtype, it->ndim, it->shape, &t));
            fill_item(t->data, n, i);
            kvp_status st = kvp_pipe_send_take(pipe, t);
            CHECK_OK(st);
            if (st) kvp_tensor_free(t);
            continue;
        }
        fill_item(buf, n, i);
        kvp_tensor t;
        kvp_tensor_init(&t, it->dtype, it->ndim, it->shape, buf);
        CHECK_OK(kvp_pipe_send(pipe, &t));
    }
}

static void recv_script(kvp_pipe *pipe)
{
    for (int i = 0; i < n_script; i++) {
        const item *it = &script[i];
        kvp_tensor *t = NULL;
        kvp_status st = kvp_pipe_recv(pipe, WAIT_MS, &t);
        if (st) fprintf(stderr, "  recv %d: %s\n", i, kvp_last_error());
        CHECK_OK(st);
        if (st) return;
        if (it->none) {
            CHECK(t == NULL);
            kvp_tensor_free(t);
            continue;
        }
        int ok = t && t->dtype == it->dtype && t->ndim == it->ndim &&
                 (it->ndim < 1 || t->shape[0] == it->shape[0]) &&
                 (it->ndim < 2 || t->shape[1] == it->shape[1]) && t->nbytes == item_bytes(it) &&
                 kvpt_verify(t->data, t->nbytes, (uint64_t)i + 1) == (size_t)-1;
        if (!ok) fprintf(stderr, "  tensor %d: wrong dtype, shape or bytes\n", i);
        CHECK(ok);
        kvp_tensor_free(t);
    }
}

/* ------------------------------------------------------------- sides --- */

/* Wait until the peer's descriptor was read; returns what it offers. */
static size_t wait_negotiated(kvp_pipe *pipe)
{
    kvp_pipe_stats st = {0};
    uint64_t deadline = kvpi_now_ms() + WAIT_MS;
    for (;;) {
        kvp_pipe_get_stats(pipe, &st);
        if (st.peer_lookups > 0 || kvpi_now_ms() > deadline) break;
        usleep(10000);
    }
    CHECK(st.peer_lookups > 0);
    return st.peer_inline_max;
}

/* Prefill: negotiate, send the script, flush, then take decode's reply. */
static void prefill_side(kvp_pipe *pipe, const side *s)
{
    size_t own = s->opts.inline_max_bytes;
    if (own) {
        size_t peer = wait_negotiated(pipe);
        if (peer != s->peer_inline)
            fprintf(stderr, "  peer offers %zu, want %zu\n", peer, s->peer_inline);
        CHECK(peer == s->peer_inline);
    }
    send_script(pipe);
    CHECK_OK(kvp_pipe_flush(pipe, WAIT_MS));
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    size_t path = own < s->peer_inline ? own : s->peer_inline;
    uint64_t want = expected_inline(path);
    if (st.inline_sent != want)
        fprintf(stderr, "  prefill sent %llu inline, want %llu\n",
                (unsigned long long)st.inline_sent, (unsigned long long)want);
    /* Every message acknowledged exactly once, inline ones included. */
    CHECK(st.sent == (uint64_t)n_script && st.acks == st.sent && st.bad_acks == 0);
    CHECK(st.inline_sent == want);
    CHECK(st.inflight_count == 0 && st.inflight_bytes == 0);
    /* The other direction negotiates on its own. */
    recv_script(pipe);
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.received == (uint64_t)n_script && st.bad_messages == 0);
    CHECK(st.inline_received == want);
}

/* Decode: take the script, then send it back. */
static void decode_side(kvp_pipe *pipe, const side *s)
{
    recv_script(pipe);
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    size_t own = s->opts.inline_max_bytes;
    size_t path = own < s->peer_inline ? own : s->peer_inline;
    uint64_t want = expected_inline(path);
    CHECK(st.received == (uint64_t)n_script && st.bad_messages == 0);
    if (st.inline_received != want)
        fprintf(stderr, "  decode received %llu inline, want %llu\n",
                (unsigned long long)st.inline_received, (unsigned long long)want);
    CHECK(st.inline_received == want);
    if (own) CHECK(wait_negotiated(pipe) == s->peer_inline);
    send_script(pipe);
    CHECK_OK(kvp_pipe_flush(pipe, WAIT_MS));
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.sent == (uint64_t)n_script && st.acks == st.sent && st.inline_sent == want);
}

static void pair(int p2p, size_t prefill_inline, size_t decode_inline)
{
    kvpt_pipe_setup setup;
    REQUIRE(kvpt_pipe_setup_make(&setup, p2p) == 0);
    const char *json = setup.json;
    build_script();
    /* The script straddles the threshold: some inline, some not. */
    REQUIRE(expected_inline(THRESHOLD) > 4 && expected_inline(THRESHOLD) < (uint64_t)n_script);
    side a = {json, 0, opts_with(prefill_inline), prefill_side, decode_inline};
    side b = {json, 1, opts_with(decode_inline), decode_side, prefill_inline};
    run_pair(&a, &b);
}

static void test_pair_negotiates_http_store(void)
{
    pair(0, THRESHOLD, THRESHOLD);
}

static void test_pair_negotiates_p2p(void)
{
    pair(1, THRESHOLD, THRESHOLD);
}

/* The smaller side's threshold rules: decode takes up to 4096, prefill
 * would send up to 1 MiB. */
static void test_smaller_threshold_rules(void)
{
    kvpt_pipe_setup setup;
    REQUIRE(kvpt_pipe_setup_make(&setup, 1) == 0);
    const char *json = setup.json;
    build_script();
    side a = {json, 0, opts_with((size_t)1 << 20), prefill_side, THRESHOLD};
    side b = {json, 1, opts_with(THRESHOLD), decode_side, (size_t)1 << 20};
    run_pair(&a, &b);
}

/* A receiver that turns the path off gets every message announced, and the
 * other way round. */
static void test_receiver_turns_it_off(void)
{
    pair(0, THRESHOLD, 0);
}

static void test_sender_turns_it_off(void)
{
    pair(1, 0, THRESHOLD);
}

/* ------------------------------------------------------ deferred ACKs --- */

enum { ACKS_IDLE, ACKS_WAITING, ACKS_ANNOUNCED, ACKS_SIXTEEN, ACKS_CLOSE, ACKS_NO_FLUSH };
static int acks_case;
static int done_fds[2]; /* prefill -> decode: one byte once prefill has checked */
static int took_fds[2]; /* decode -> prefill: when it took the last (kvpi_now_ns) */
#define NO_FLUSH_N 10
#define NO_FLUSH_SLACK_MS 250  /* beyond ack_delay_us; a loaded 2-core VM's scheduling */
#define SMALL_BYTES 1024       /* inline */
#define LARGE_BYTES (64 << 10) /* announced: above THRESHOLD */
#define LONG_DELAY_US 60000000 /* longer than any wait of the test */
#define SHORT_WAIT_MS 1500     /* a flush that must not succeed meanwhile */

static void send_u8(kvp_pipe *pipe, size_t n, int seed)
{
    static uint8_t buf[LARGE_BYTES];
    int64_t shape[1] = {(int64_t)n};
    kvpt_fill(buf, n, (uint64_t)seed);
    kvp_tensor t;
    kvp_tensor_init(&t, KVP_DTYPE_U8, 1, shape, buf);
    CHECK_OK(kvp_pipe_send(pipe, &t));
}

static void recv_u8(kvp_pipe *pipe, size_t n, int seed)
{
    kvp_tensor *t = NULL;
    kvp_status st = kvp_pipe_recv(pipe, WAIT_MS, &t);
    if (st) fprintf(stderr, "  recv %d: %s\n", seed, kvp_last_error());
    CHECK_OK(st);
    CHECK(t && t->nbytes == n && kvpt_verify(t->data, n, (uint64_t)seed) == (size_t)-1);
    kvp_tensor_free(t);
}

static uint64_t acks_of(kvp_pipe *pipe)
{
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.bad_acks == 0);
    return st.acks;
}

static void acks_prefill(kvp_pipe *pipe, const side *s)
{
    (void)s;
    REQUIRE(wait_negotiated(pipe) == THRESHOLD);
    int n = acks_case == ACKS_SIXTEEN ? 16 : acks_case == ACKS_NO_FLUSH ? NO_FLUSH_N : 3;
    for (int i = 0; i < n; i++)
        send_u8(pipe, SMALL_BYTES, i + 1);
    switch (acks_case) {
    case ACKS_NO_FLUSH: { /* nobody flushes: the ACKs are taken as they come all the same */
        uint64_t took = 0;
        CHECK(read(took_fds[0], &took, sizeof took) == (ssize_t)sizeof took);
        kvp_pipe_stats st;
        uint64_t deadline = kvpi_now_ms() + WAIT_MS;
        do {
            kvp_pipe_get_stats(pipe, &st);
            if (st.inflight_count == 0) break;
            usleep(500);
        } while (kvpi_now_ms() < deadline);
        double after_ms = ((double)kvpi_now_ns() - (double)took) / 1e6;
        fprintf(stderr, "  in flight 0 %.1f ms after decode took the last (ack_delay 1 ms)\n",
                after_ms);
        CHECK(st.inflight_count == 0 && after_ms < 1 + NO_FLUSH_SLACK_MS);
        break;
    }
    case ACKS_IDLE:    /* decode took them and does nothing: the control thread sends them */
    case ACKS_SIXTEEN: /* the sixteenth sends them all, long before they are due */
    case ACKS_CLOSE:   /* owed for a minute, but decode closes at once: close sends them */
        CHECK_OK(kvp_pipe_flush(pipe, WAIT_MS));
        break;
    case ACKS_WAITING: /* decode waits in recv for one more meanwhile */
        CHECK_OK(kvp_pipe_flush(pipe, WAIT_MS));
        send_u8(pipe, SMALL_BYTES, n + 1);
        n++;
        CHECK_OK(kvp_pipe_flush(pipe, WAIT_MS));
        break;
    case ACKS_ANNOUNCED: /* owed for a minute, until an announced message's ACK leaves */
        CHECK(kvp_pipe_flush(pipe, SHORT_WAIT_MS) == KVP_ETIMEDOUT);
        CHECK(acks_of(pipe) == 0);
        send_u8(pipe, LARGE_BYTES, n + 1);
        n++;
        CHECK_OK(kvp_pipe_flush(pipe, WAIT_MS));
        break;
    }
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    if (st.acks != (uint64_t)n)
        fprintf(stderr, "  %llu ACKs, want %d\n", (unsigned long long)st.acks, n);
    CHECK(st.sent == (uint64_t)n && st.acks == (uint64_t)n && st.bad_acks == 0);
    CHECK(st.inline_sent == (uint64_t)(acks_case == ACKS_ANNOUNCED ? n - 1 : n));
    CHECK(write(done_fds[1], "x", 1) == 1);
}

static void acks_decode(kvp_pipe *pipe, const side *s)
{
    (void)s;
    int n = acks_case == ACKS_SIXTEEN ? 16 : acks_case == ACKS_NO_FLUSH ? NO_FLUSH_N : 3;
    if (acks_case == ACKS_NO_FLUSH) usleep(200 * 1000); /* all of them wait on the link */
    for (int i = 0; i < n; i++)
        recv_u8(pipe, SMALL_BYTES, i + 1);
    if (acks_case == ACKS_NO_FLUSH) {
        uint64_t now = kvpi_now_ns();
        CHECK(write(took_fds[1], &now, sizeof now) == (ssize_t)sizeof now);
    }
    if (acks_case == ACKS_WAITING) recv_u8(pipe, SMALL_BYTES, n + 1);
    if (acks_case == ACKS_ANNOUNCED) recv_u8(pipe, LARGE_BYTES, n + 1);
    if (acks_case == ACKS_CLOSE) return;
    /* Open, idle, until prefill has its ACKs (close would send them too). */
    struct pollfd pfd = {.fd = done_fds[0], .events = POLLIN};
    CHECK(poll(&pfd, 1, SIDE_MS) == 1);
}

static void acks_pair(int which, long delay_us)
{
    kvpt_pipe_setup setup;
    REQUIRE(kvpt_pipe_setup_make(&setup, 1) == 0);
    const char *json = setup.json;
    REQUIRE(pipe(done_fds) == 0 && pipe(took_fds) == 0);
    acks_case = which;
    kvp_pipe_opts o = opts_with(THRESHOLD);
    o.ack_delay_us = (int)delay_us;
    side a = {json, 0, o, acks_prefill, THRESHOLD};
    side b = {json, 1, o, acks_decode, THRESHOLD};
    run_pair(&a, &b);
}

static void test_deferred_acks_idle_receiver(void)
{
    acks_pair(ACKS_IDLE, 1000);
}

static void test_deferred_acks_waiting_receiver(void)
{
    acks_pair(ACKS_WAITING, 1000);
}

static void test_deferred_acks_leave_with_announced(void)
{
    acks_pair(ACKS_ANNOUNCED, LONG_DELAY_US);
}

static void test_deferred_acks_sixteen_at_once(void)
{
    acks_pair(ACKS_SIXTEEN, LONG_DELAY_US);
}

/* The receiver takes them all and then does nothing; the sender neither
 * flushes nor sends: its inflight_count still reaches 0 about ack_delay_us
 * after the last was taken (it stayed up for good while ACKs of inline
 * messages waited in ZeroMQ until someone wanted room). */
static void test_deferred_acks_reach_an_idle_sender(void)
{
    acks_pair(ACKS_NO_FLUSH, 1000);
}

static void test_deferred_acks_sent_at_close(void)
{
    acks_pair(ACKS_CLOSE, LONG_DELAY_US);
}

/* ---------------------------------------------------------- options --- */

/* Bad value number i of test_bad_options_refused(). */
static void set_bad(kvp_pipe_opts *o, size_t i)
{
    switch (i) {
    case 0:
        o->recv_window = 0;
        break;
    case 1:
        o->recv_window = 70000;
        break;
    case 2:
        o->recv_window_bytes = 0;
        break;
    case 3:
        o->max_control_frame = 8;
        break;
    case 4:
        o->redial_min_ms = 0;
        break;
    case 5:
        o->redial_max_ms = 100;
        break; /* below redial_min_ms (200) */
    case 6:
        o->ack_timeout_ms = -1;
        break;
    case 7:
        o->ack_linger_ms = -5;
        break;
    case 8:
        o->zmq_hwm = -1;
        break;
    case 9:
        o->busy_poll_us = -1;
        break;
    case 10:
        o->inline_max_bytes = ((size_t)1 << 30) + 1;
        break;
    case 11:
        o->ack_delay_us = -1;
        break;
    case 12:
        o->ack_delay_us = 60000001;
        break;
    default:
        o->io_timeout_ms = 0;
        break;
    }
}

static void test_bad_options_refused(void)
{
    kvpt_pipe_setup setup;
    REQUIRE(kvpt_pipe_setup_make(&setup, 1) == 0);
    const char *json = setup.json;
    kvp_pipe_config *cfg;
    REQUIRE_OK(kvp_pipe_config_parse(json, strlen(json), &cfg));
    static const char *const bad[] = {
        "recv_window 0",
        "recv_window 70000",
        "recv_window_bytes 0",
        "max_control_frame 8",
        "redial_min_ms 0",
        "redial_max_ms 100",
        "ack_timeout_ms -1",
        "ack_linger_ms -5",
        "zmq_hwm -1",
        "busy_poll_us -1",
        "inline_max_bytes 1 GiB + 1",
        "ack_delay_us -1",
        "ack_delay_us 60000001",
        "io_timeout_ms 0",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvp_pipe_opts o;
        kvp_pipe_opts_init(&o);
        set_bad(&o, i);
        kvp_pipe *pipe = NULL;
        kvp_status st = kvp_pipe_open(cfg, 0, 0, &o, &pipe);
        if (st != KVP_EINVAL) fprintf(stderr, "  %s: %s\n", bad[i], kvp_strerror(st));
        CHECK(st == KVP_EINVAL && pipe == NULL);
        CHECK(strstr(kvp_last_error(), "pipe option") != NULL);
        if (pipe) kvp_pipe_close(pipe);
    }
    kvp_pipe_config_free(cfg);
}

/* The defaults are the documented ones. */
static void test_defaults(void)
{
    kvp_pipe_opts o;
    kvp_pipe_opts_init(&o);
    CHECK(o.inline_max_bytes == 131072 && o.recv_window == 32 && o.recv_window_bytes == 64 << 20);
    CHECK(o.max_control_frame == 4096 && o.redial_min_ms == 200 && o.redial_max_ms == 5000);
    CHECK(o.ack_timeout_ms == 2000 && o.ack_linger_ms == 500 && o.zmq_hwm == 1000);
    CHECK(o.busy_poll_us == 0 && o.ack_delay_us == 1000);
}

/* The smallest settings still move everything, in order: one message READ
 * at a time, queues of one message, a recv that polls first. */
static void test_smallest_settings(void)
{
    kvpt_pipe_setup setup;
    REQUIRE(kvpt_pipe_setup_make(&setup, 1) == 0);
    const char *json = setup.json;
    build_script();
    kvp_pipe_opts o = opts_with(THRESHOLD);
    o.recv_window = 1;
    o.recv_window_bytes = 1;
    o.zmq_hwm = 1;
    o.busy_poll_us = 50;
    o.kv_buffer_size = 1; /* one message in flight at a time */
    side a = {json, 0, o, prefill_side, THRESHOLD};
    side b = {json, 1, o, decode_side, THRESHOLD};
    run_pair(&a, &b);
}

int main(void)
{
    RUN(test_defaults);
    RUN(test_bad_options_refused);
    RUN_T(test_pair_negotiates_http_store, 200);
    RUN_T(test_pair_negotiates_p2p, 200);
    RUN_T(test_smaller_threshold_rules, 200);
    RUN_T(test_receiver_turns_it_off, 200);
    RUN_T(test_sender_turns_it_off, 200);
    RUN_T(test_smallest_settings, 200);
    RUN_T(test_deferred_acks_idle_receiver, 200);
    RUN_T(test_deferred_acks_waiting_receiver, 200);
    RUN_T(test_deferred_acks_leave_with_announced, 200);
    RUN_T(test_deferred_acks_sixteen_at_once, 200);
    RUN_T(test_deferred_acks_sent_at_close, 200);
    RUN_T(test_deferred_acks_reach_an_idle_sender, 200);
    return kvpt_summary();
}
