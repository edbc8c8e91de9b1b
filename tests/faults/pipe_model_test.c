/* A model-based random stress test of the tensor pipe (issue 21): random
 * sequences of tensors sent through a pipe and checked against an oracle.
 *
 * A batch is one pair of processes (a sender on rank 0, a kvpipe receiver on
 * rank 1) with one draw of settings (recv_window, recv_window_bytes,
 * inline_max_bytes, kv_buffer_size, ack_delay_us), running many sequences
 * back to back over pipes opened once (an open costs ~100 ms). The sender is
 * a kvpipe pipe ("kvpipe" path: the inline path and deferred ACKs in play)
 * or a raw MooncakePipe-wire peer ("raw" path: a real engine and a bare
 * libzmq PUSH/PULL pair, as support/peer_raw.c builds, announcing buffers allocated
 * in its engine and taking exactly one ACK per message, in order).
 *
 * A sequence is a list of messages whose sizes spread across the thresholds
 * that matter (None, 0-byte tensors, just under/over inline_max_bytes, just
 * under/over recv_window_bytes, over kv_buffer_size), each with the
 * receiver's pacing (sleeps, lagging whole messages behind, stopping itself
 * with SIGSTOP until the parent continues it) and, now and then, a sender
 * stopped (SIGSTOP, by the receiver) while the receiver waits for its
 * announced message with a short timeout. Both processes draw the batch's
 * settings and each sequence from (batch seed, index), and the contents of
 * each tensor from its seed, so nothing but the seed crosses between them.
 *
 * The oracle: each tensor arrives once, in order, byte-exact (dtype, shape,
 * bytes); every ACK exactly once (the kvpipe sender's acks == sent,
 * bad_acks == 0, inflight_count 0 after each sequence's flush; the raw
 * sender takes one "ACK" frame per message and no stray one); no recv, send
 * or flush blocks past its timeout + a margin; each message arrives within a
 * progress deadline (a stalled window fails here); and the window's bytes
 * (rx_bytes_peak, src/pipe/pipe_internal.h) stay within recv_window_bytes +
 * the largest message + recv_window inline copies.
 *
 * Seeds: each run prints its base seed; a failure prints the batch seed and
 * the sequence, how to replay it (KVPT_SEED, KVPT_SEQUENCES), and shrinks the
 * failing sequence alone by removing messages while it still fails, printing
 * the shortest (KVPT_MODEL_OPS). Sizes: KVPT_MODEL_SEQUENCES per path
 * (default 1000; 200 in sanitizer builds), or KVPT_MODEL_MINUTES of batches
 * per path. See docs/reliability.md. */
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/wait.h>
#include <time.h>
#include <zmq.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pipe/pipe_internal.h"
#include "common/clock.h"
#include "common/net.h"
#include "pipe/safetensors.h"
#include "test.h"
#include "peer.h"

/* Sequences per path; the sanitizer builds run fewer, with wider margins. */
#define KVPT_MODEL_DEFAULT_SEQUENCES (KVPT_SANITIZED ? 200 : 1000)
#define KVPT_MODEL_SLOW KVPT_SANITIZED

#define MAX_OPS 20
#define PER_BATCH 50                                 /* sequences per pair of processes */
#define MAX_TENSOR ((size_t)5 << 20)                 /* data bytes of the largest tensor */
#define MARGIN_MS (KVPT_MODEL_SLOW ? 1500 : 300)     /* a call may overrun its timeout by */
#define PROGRESS_MS (KVPT_MODEL_SLOW ? 20000 : 6000) /* each message arrives within */
#define RECV_LONG_MS 2000
#define SEND_TIMEOUT_MS 8000
#define FLUSH_MS 8000
#define SHRINK_S 150 /* shrinking stops after this */

/* ------------------------------------------------------------ random --- */

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t rnext(rng *r)
{
    return mix64(r->s++ * 0x2545f4914f6cdd1dull);
}

static uint64_t rbelow(rng *r, uint64_t n)
{
    return n ? rnext(r) % n : 0;
}

/* Uniform in [lo, hi]. */
static uint64_t rrange(rng *r, uint64_t lo, uint64_t hi)
{
    return hi <= lo ? lo : lo + rbelow(r, hi - lo + 1);
}

/* Log-uniform in [lo, hi]. */
static size_t rlog(rng *r, size_t lo, size_t hi)
{
    int bits = 0;
    while ((lo << bits) < hi)
        bits++;
    size_t v = lo << rbelow(r, (uint64_t)bits + 1);
    v += rbelow(r, v);
    return v < lo ? lo : v > hi ? hi : v;
}

/* ------------------------------------------------------- the model --- */

typedef struct settings {
    int recv_window;
    size_t recv_window_bytes, inline_max, kv_buffer;
    int ack_delay_us;
} settings;

typedef struct op {
    int orig; /* index in the drawn sequence: its tensor's seed */
    int none, take;
    kvp_dtype dtype;
    int ndim;
    int64_t shape[3];
    size_t bytes, encoded;
    int send_sleep_us, recv_sleep_us, recv_timeout_ms, recv_stop, stall_ms;
} op;

typedef struct seq {
    int n;
    op ops[MAX_OPS];
    size_t max_encoded;
} seq;

static void draw_settings(uint64_t bseed, settings *s)
{
    rng r = {mix64(bseed ^ 0x5e771795ull)};
    static const int windows[] = {1, 2, 3, 4, 8, 16, 32};
    static const size_t inlines[] = {0, 256, 4096, 16384, 65536, 131072, 262144};
    static const int delays[] = {0, 200, 1000, 3000};
    s->recv_window = windows[rbelow(&r, 7)];
    s->recv_window_bytes = rlog(&r, (size_t)64 << 10, (size_t)4 << 20);
    s->inline_max = inlines[rbelow(&r, 7)];
    s->kv_buffer = rbelow(&r, 3) ? rlog(&r, (size_t)64 << 10, (size_t)8 << 20) : 1000000000;
    s->ack_delay_us = delays[rbelow(&r, 4)];
}

static void settings_str(const settings *s, char *buf, size_t len)
{
    snprintf(buf, len,
             "recv_window=%d recv_window_bytes=%zu inline_max_bytes=%zu kv_buffer_size=%zu "
             "ack_delay_us=%d",
             s->recv_window, s->recv_window_bytes, s->inline_max, s->kv_buffer, s->ack_delay_us);
}

static size_t encoded_size(kvp_dtype dt, int ndim, const int64_t *shape)
{
    static uint8_t dummy[1];
    kvp_tensor t;
    size_t n = 0;
    if (kvp_tensor_init(&t, dt, ndim, shape, dummy) || kvpi_safetensors_size(&t, &n)) return 0;
    return n;
}

static void set_shape(op *o, size_t numel, int k)
{
    if (o->ndim == 1) {
        o->shape[0] = (int64_t)numel;
    } else {
        o->shape[0] = k;
        o->shape[1] = (int64_t)(numel / (size_t)k);
        o->shape[2] = 1;
    }
    size_t n = 1;
    for (int i = 0; i < o->ndim; i++)
        n *= (size_t)o->shape[i];
    o->bytes = n * kvp_dtype_size(o->dtype);
    o->encoded = encoded_size(o->dtype, o->ndim, o->shape);
}

/* A tensor of about target data bytes, or whose encoded message is about
 * target bytes (enc). */
static void size_op(rng *r, op *o, size_t target, int enc)
{
    static const kvp_dtype dts[] = {KVP_DTYPE_U8,  KVP_DTYPE_BF16, KVP_DTYPE_F32,
                                    KVP_DTYPE_I64, KVP_DTYPE_F16,  KVP_DTYPE_F8_E4M3};
    o->dtype = dts[rbelow(r, 6)];
    o->ndim = (int)rrange(r, 1, 3);
    int k = (int)rrange(r, 1, 8);
    size_t es = kvp_dtype_size(o->dtype);
    if (target > MAX_TENSOR) target = MAX_TENSOR;
    set_shape(o, target / es, k);
    if (enc && o->encoded) {
        /* The header's length barely depends on the numbers: one correction
         * lands within an element or two of the target. */
        size_t hdr = o->encoded - o->bytes;
        size_t data = target > hdr ? target - hdr : 0;
        set_shape(o, data / es, k);
    }
}

static void draw_seq(uint64_t bseed, int index, const settings *s, seq *q)
{
    rng r = {mix64(bseed ^ mix64((uint64_t)index + 1))};
    q->n = (int)rrange(&r, 1, MAX_OPS);
    q->max_encoded = 0;
    size_t inl = s->inline_max ? s->inline_max : 4096, rwb = s->recv_window_bytes;
    int stall_at = rbelow(&r, 100) < 8 ? (int)rbelow(&r, (uint64_t)q->n) : -1;
    for (int j = 0; j < q->n; j++) {
        op *o = &q->ops[j];
        memset(o, 0, sizeof *o);
        o->orig = j;
        uint64_t c = rbelow(&r, 100);
        if (c < 6) {
            o->none = 1;
            o->encoded = encoded_size(KVP_DTYPE_I64, 1, (int64_t[]){1});
        } else if (c < 12) {
            size_op(&r, o, 0, 0);
        } else if (c < 40) {
            size_op(&r, o, rrange(&r, 1, 512), 0);
        } else if (c < 58) {
            size_op(&r, o, rrange(&r, 512, inl), 0);
        } else if (c < 72) {
            size_op(&r, o, inl + rrange(&r, 0, 96) - 48, 1);
        } else if (c < 84) {
            size_op(&r, o, rrange(&r, 1, rwb / 2), 0);
        } else if (c < 92) {
            size_op(&r, o, rwb + rrange(&r, 0, 128) - 64, 1);
        } else if (c < 97 || s->kv_buffer > MAX_TENSOR) {
            size_op(&r, o, rwb + rrange(&r, 1, rwb), 0);
        } else {
            size_op(&r, o, s->kv_buffer + rrange(&r, 1, 65536), 1);
        }
        o->take = !o->none && rbelow(&r, 3) == 0;
        uint64_t p = rbelow(&r, 100);
        o->send_sleep_us = p < 85   ? 0
                           : p < 97 ? (int)rrange(&r, 1, 2000)
                                    : (int)rrange(&r, 5000, 20000);
        p = rbelow(&r, 1000);
        /* Mostly none; short sleeps; lags of whole messages (the sender runs
         * ahead up to kv_buffer_size); a stop of the whole process. */
        o->recv_sleep_us = p < 780   ? 0
                           : p < 900 ? (int)rrange(&r, 1, 2000)
                           : p < 985 ? (int)rrange(&r, 5000, 30000)
                                     : (int)rrange(&r, 50000, 120000);
        o->recv_stop = rbelow(&r, 200) == 0;
        o->recv_timeout_ms = rbelow(&r, 10) ? RECV_LONG_MS : (int)rrange(&r, 0, 20);
        if (j == stall_at) o->stall_ms = (int)rrange(&r, 20, 60);
        if (o->encoded > q->max_encoded) q->max_encoded = o->encoded;
    }
}

/* Apply a mask of kept ops (NULL: all). */
static void keep_ops(seq *q, const int *keep, int nkeep)
{
    if (!keep) return;
    seq out = {0};
    for (int i = 0; i < nkeep; i++)
        if (keep[i] < q->n) out.ops[out.n++] = q->ops[keep[i]];
    for (int j = 0; j < out.n; j++)
        if (out.ops[j].encoded > out.max_encoded) out.max_encoded = out.ops[j].encoded;
    *q = out;
}

static uint64_t tensor_seed(uint64_t bseed, int index, int orig)
{
    return mix64(bseed + mix64(((uint64_t)index << 8) + (uint64_t)orig));
}

/* ------------------------------------------------ the two processes --- */

typedef struct batch {
    int raw;
    uint64_t bseed;
    settings s;
    int from, to;    /* sequences [from, to) */
    const int *keep; /* ops kept of each sequence (shrinking) */
    int nkeep;
    kvpt_raw_setup setup;
    kvpt_chan s2r, r2s, result;
    pid_t sender;
    int seq_index, op_index; /* where a side is, for its failure message */
} batch;

static batch B;

/* A side's failure: say where, tell the parent which sequence, and end. */
__attribute__((format(printf, 1, 2), noreturn)) static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "  FAIL sequence %d, message %d: ", B.seq_index, B.op_index);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    int32_t i = B.seq_index;
    if (write(B.result.fd[1], &i, sizeof i) != sizeof i) perror("result");
    _exit(1);
}

static uint64_t since_ms(uint64_t t0)
{
    return kvpi_now_ms() - t0;
}

/* When a timed call began: the clock, and how long this process's threads
 * had waited for a CPU by then (kvpt_runq_wait_ms). */
typedef struct mark {
    uint64_t ms;
    int64_t waited;
} mark;

static mark mark_now(void)
{
    return (mark){kvpi_now_ms(), kvpt_runq_wait_ms(getpid())};
}

/* Did a call begun at m overrun timeout (its time in *took)? By more than
 * MARGIN_MS, plus what the process waited for a CPU since: load delays a
 * wake-up at the deadline by that much. */
static int overran(mark m, int timeout, uint64_t *took)
{
    *took = since_ms(m.ms);
    if (*took <= (uint64_t)timeout + MARGIN_MS) return 0;
    int64_t waited = kvpt_runq_wait_ms(getpid()) - m.waited;
    return *took > (uint64_t)timeout + MARGIN_MS + (uint64_t)(waited > 0 ? waited : 0);
}

static kvp_pipe_opts model_opts(void)
{
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.send_timeout_ms = SEND_TIMEOUT_MS;
    o.recv_window = B.s.recv_window;
    o.recv_window_bytes = B.s.recv_window_bytes;
    o.inline_max_bytes = B.s.inline_max;
    o.kv_buffer_size = B.s.kv_buffer;
    o.ack_delay_us = B.s.ack_delay_us;
    return o;
}

static kvp_pipe *open_side(int rank)
{
    kvp_pipe *p = NULL;
    kvp_pipe_opts o = model_opts();
    if (kvpt_pipe_open(B.setup.json, rank, &o, &p))
        fail("open rank %d: %s", rank, kvp_last_error());
    return p;
}

static void sleep_us(int us)
{
    if (us > 0) usleep((useconds_t)us);
}

static int read_step(kvpt_chan *c, char want, int timeout_ms)
{
    return kvpt_wait_step(c, timeout_ms) == want ? 0 : -1;
}

/* ------------------------------------------------------- receiver --- */

static void check_tensor(const op *o, const kvp_tensor *t, uint64_t seed)
{
    if (o->none) {
        if (t) fail("None arrived as a tensor of %zu bytes", kvp_tensor_numel(t));
        return;
    }
    if (!t) fail("a tensor of %zu bytes arrived as None", o->bytes);
    if (t->dtype != o->dtype || t->ndim != o->ndim)
        fail("dtype %d ndim %d, sent %d and %d", t->dtype, t->ndim, o->dtype, o->ndim);
    for (int i = 0; i < o->ndim; i++)
        if (t->shape[i] != o->shape[i])
            fail("shape[%d] = %" PRId64 ", sent %" PRId64, i, t->shape[i], o->shape[i]);
    size_t bad = kvpt_verify(t->data, o->bytes, seed);
    if (bad != (size_t)-1) fail("byte %zu of %zu differs", bad, o->bytes);
}

/* recv with o's pacing, retried on time-outs until the progress deadline. */
static kvp_tensor *receive(kvp_pipe *p, const op *o)
{
    uint64_t deadline = kvpi_now_ms() + PROGRESS_MS;
    int timeout = o->recv_timeout_ms;
    for (;;) {
        kvp_tensor *t = NULL;
        mark m = mark_now();
        kvp_status st = kvp_pipe_recv(p, timeout, &t);
        uint64_t took;
        if (overran(m, timeout, &took))
            fail("recv(%d ms) took %" PRIu64 " ms (%s)", timeout, took,
                 st ? kvp_last_error() : "ok");
        if (st == KVP_OK) return t;
        if (st != KVP_ETIMEDOUT) fail("recv: %s: %s", kvp_strerror(st), kvp_last_error());
        if (kvpi_now_ms() > deadline)
            fail("no message within %d ms (recv: %s)", PROGRESS_MS, kvp_last_error());
        timeout = RECV_LONG_MS;
    }
}

static void receiver(void)
{
    kvp_pipe *p = open_side(1);
    uint64_t received = 0;
    for (int i = B.from; i < B.to; i++) {
        B.seq_index = i;
        seq q, next;
        draw_seq(B.bseed, i, &B.s, &q);
        draw_seq(B.bseed, i + 1, &B.s, &next);
        keep_ops(&q, B.keep, B.nkeep);
        /* What the window may hold: recv_window_bytes, the head (which
         * always starts), and the inline copies. The next sequence's
         * messages may be taken while this one's last is handed out. */
        size_t big = q.max_encoded > next.max_encoded ? q.max_encoded : next.max_encoded;
        size_t bound = B.s.recv_window_bytes + big + (size_t)B.s.recv_window * B.s.inline_max;
        for (int j = 0; j < q.n; j++) {
            const op *o = &q.ops[j];
            B.op_index = o->orig;
            sleep_us(o->recv_sleep_us);
            if (o->recv_stop) raise(SIGSTOP); /* the parent continues it */
            kvp_tensor *t = NULL;
            int got = 0;
            if (o->stall_ms) {
                /* The sender announced this message and waits: stop it so
                 * that the READ cannot finish, and recv must still return
                 * at its deadline, leaving the window intact. */
                if (read_step(&B.s2r, 'S', PROGRESS_MS)) fail("the sender never announced");
                /* Not before the first READ has opened the peer's segment:
                 * that handshake runs inside recv, bounded by the engine's
                 * timeout (5 s), not recv's (a known limit: the report of
                 * issue 21, item 4). */
                pthread_mutex_lock(&p->recv_lock);
                int opened = p->peer_open;
                pthread_mutex_unlock(&p->recv_lock);
                if (opened) kill(B.sender, SIGSTOP);
                usleep(2000);
                mark m = mark_now();
                kvp_status st = kvp_pipe_recv(p, o->stall_ms, &t);
                uint64_t took;
                int over = overran(m, o->stall_ms, &took);
                if (opened) kill(B.sender, SIGCONT);
                kvpt_step(&B.r2s, 'G');
                if (over)
                    fail("recv(%d ms) with its sender stopped took %" PRIu64 " ms (%s)",
                         o->stall_ms, took, st ? kvp_last_error() : "ok");
                if (st != KVP_OK && st != KVP_ETIMEDOUT)
                    fail("recv with its sender stopped: %s", kvp_last_error());
                got = st == KVP_OK;
            }
            if (!got) t = receive(p, o);
            check_tensor(o, t, tensor_seed(B.bseed, i, o->orig));
            kvp_tensor_free(t);
            received++;
            pthread_mutex_lock(&p->recv_lock);
            size_t peak = p->rx_bytes_peak;
            p->rx_bytes_peak = p->rx_bytes;
            pthread_mutex_unlock(&p->recv_lock);
            if (peak > bound)
                fail("the window held %zu bytes, bound %zu (recv_window_bytes %zu + %zu + "
                     "%d x %zu)",
                     peak, bound, B.s.recv_window_bytes, big, B.s.recv_window, B.s.inline_max);
        }
    }
    B.op_index = -1;
    /* Nothing more arrives, and every message was counted once. */
    kvp_tensor *t = NULL;
    kvp_status st = kvp_pipe_recv(p, 100, &t);
    if (st != KVP_ETIMEDOUT) fail("a message beyond the last arrived (%d)", st);
    kvp_pipe_stats ps;
    kvp_pipe_get_stats(p, &ps);
    if (ps.received != received || ps.bad_messages)
        fail("received %" PRIu64 " (want %" PRIu64 "), bad_messages %" PRIu64, ps.received,
             received, ps.bad_messages);
    /* Deferred ACKs leave before the sender's last flush; wait for its end. */
    read_step(&B.s2r, 'E', PROGRESS_MS);
    kvp_pipe_close(p);
}

/* ---------------------------------------------------- kvpipe sender --- */

static uint8_t *scratch(void)
{
    static uint8_t *buf;
    if (!buf) buf = malloc(MAX_TENSOR + 64);
    return buf;
}

static void timed(const char *what, int timeout, mark m, kvp_status st)
{
    uint64_t took;
    if (overran(m, timeout, &took))
        fail("%s took %" PRIu64 " ms, timeout %d ms", what, took, timeout);
    if (st) fail("%s: %s: %s", what, kvp_strerror(st), kvp_last_error());
}

static void stall_wait(const op *o)
{
    if (!o->stall_ms) return;
    kvpt_step(&B.s2r, 'S');
    if (read_step(&B.r2s, 'G', PROGRESS_MS)) fail("the receiver never let go");
}

static void pipe_sender(void)
{
    kvp_pipe *p = open_side(0);
    uint64_t sent = 0;
    for (int i = B.from; i < B.to; i++) {
        B.seq_index = i;
        seq q;
        draw_seq(B.bseed, i, &B.s, &q);
        keep_ops(&q, B.keep, B.nkeep);
        for (int j = 0; j < q.n; j++) {
            const op *o = &q.ops[j];
            B.op_index = o->orig;
            sleep_us(o->send_sleep_us);
            uint64_t seed = tensor_seed(B.bseed, i, o->orig);
            mark m = mark_now();
            kvp_status st;
            if (o->none) {
                st = kvp_pipe_send(p, NULL);
            } else if (o->take) {
                kvp_tensor *t;
                st = kvp_pipe_tensor_alloc(p, o->dtype, o->ndim, o->shape, &t);
                if (st) timed("tensor_alloc", SEND_TIMEOUT_MS, m, st);
                kvpt_fill(t->data, o->bytes, seed);
                m = mark_now();
                st = kvp_pipe_send_take(p, t);
                if (st) kvp_tensor_free(t);
            } else {
                kvp_tensor t;
                kvpt_fill(scratch(), o->bytes, seed);
                kvp_tensor_init(&t, o->dtype, o->ndim, o->shape, scratch());
                m = mark_now();
                st = kvp_pipe_send(p, &t);
            }
            timed("send", SEND_TIMEOUT_MS, m, st);
            sent++;
            stall_wait(o);
        }
        B.op_index = -1;
        mark m = mark_now();
        timed("flush", FLUSH_MS, m, kvp_pipe_flush(p, FLUSH_MS));
        kvp_pipe_stats ps;
        kvp_pipe_get_stats(p, &ps);
        if (ps.sent != sent || ps.acks != sent || ps.bad_acks || ps.inflight_count ||
            ps.inflight_bytes)
            fail("after flush: sent %" PRIu64 " (want %" PRIu64 "), acks %" PRIu64
                 ", bad_acks %" PRIu64 ", inflight %zu (%zu bytes)",
                 ps.sent, sent, ps.acks, ps.bad_acks, ps.inflight_count, ps.inflight_bytes);
    }
    usleep(50000); /* a stray ACK would show here */
    kvp_pipe_stats ps;
    kvp_pipe_get_stats(p, &ps);
    if (ps.acks != sent || ps.bad_acks)
        fail("at the end: acks %" PRIu64 " of %" PRIu64 ", bad_acks %" PRIu64, ps.acks, sent,
             ps.bad_acks);
    kvpt_step(&B.s2r, 'E');
    kvp_pipe_close(p);
}

/* ------------------------------------------------------- raw sender --- */

typedef struct raw_q {
    void *buf[4096];
    size_t len[4096];
    size_t head, count, bytes;
} raw_q;

/* Take one ACK (waiting up to timeout_ms); 1 when one came. */
static int raw_take_ack(kvp_engine *e, void *pull, raw_q *q, int timeout_ms)
{
    uint8_t f[KVPT_RAW_MSG_FRAMES][KVPT_RAW_MSG_HEAD];
    size_t sz[KVPT_RAW_MSG_FRAMES];
    uint64_t t0 = kvpi_now_ms();
    int frames = kvpt_zmq_recv_message(pull, f, sz, timeout_ms);
    if (frames < 0) {
        if (timeout_ms > 0 && since_ms(t0) + 5 < (uint64_t)timeout_ms) fail("ACK link failed");
        return 0;
    }
    if (frames != 1 || sz[0] != 3 || memcmp(f[0], "ACK", 3) != 0)
        fail("not an ACK: %d frames, %zu bytes", frames, sz[0]);
    if (!q->count) fail("an ACK with nothing in flight");
    size_t h = q->head % 4096;
    kvp_engine_free(e, q->buf[h]);
    q->bytes -= q->len[h];
    q->head++;
    q->count--;
    return 1;
}

static void raw_sender(void)
{
    kvp_engine *e;
    if (kvpt_raw_engine(&B.setup, 0, &e)) fail("engine: %s", kvp_last_error());
    kvpt_raw_peer r;
    if (kvpt_raw_peer_start(&r, &B.setup, 0, KVPT_RAW_WATCH_NONE)) fail("sockets");
    r.e = e;
    void *push = r.push, *pull = r.pull;
    static raw_q q;
    for (int i = B.from; i < B.to; i++) {
        B.seq_index = i;
        seq s;
        draw_seq(B.bseed, i, &B.s, &s);
        keep_ops(&s, B.keep, B.nkeep);
        for (int j = 0; j < s.n; j++) {
            const op *o = &s.ops[j];
            B.op_index = o->orig;
            sleep_us(o->send_sleep_us);
            kvp_tensor t;
            int64_t none = KVP_PIPE_NONE_VALUE, one = 1;
            if (o->none) {
                kvp_tensor_init(&t, KVP_DTYPE_I64, 1, &one, &none);
            } else {
                kvpt_fill(scratch(), o->bytes, tensor_seed(B.bseed, i, o->orig));
                kvp_tensor_init(&t, o->dtype, o->ndim, o->shape, scratch());
            }
            size_t size, len;
            void *buf;
            if (kvpi_safetensors_size(&t, &size) || kvp_engine_alloc(e, size, &buf) ||
                kvpi_safetensors_write(&t, buf, size, &len))
                fail("encode: %s", kvp_last_error());
            /* MooncakePipe's flow control: wait for ACKs while in-flight
             * bytes would pass kv_buffer_size. */
            while (q.count && q.bytes + len > B.s.kv_buffer)
                if (!raw_take_ack(e, pull, &q, PROGRESS_MS)) fail("no ACK for room");
            if (q.count == 4096) fail("queue full");
            size_t tail = (q.head + q.count) % 4096;
            q.buf[tail] = buf;
            q.len[tail] = len;
            q.count++;
            q.bytes += len;
            if (kvpt_raw_send_announcement(push, (uint64_t)(uintptr_t)buf, len))
                fail("announce: %s", zmq_strerror(zmq_errno()));
            while (raw_take_ack(e, pull, &q, 0)) {
            }
            stall_wait(o);
        }
        B.op_index = -1;
        while (q.count)
            if (!raw_take_ack(e, pull, &q, PROGRESS_MS)) fail("%zu ACKs missing", q.count);
        raw_take_ack(e, pull, &q, 0); /* a stray one fails */
    }
    raw_take_ack(e, pull, &q, 100);
    kvpt_step(&B.s2r, 'E');
    kvpt_raw_peer_stop(&r);
}

/* -------------------------------------------------------- the parent --- */

static void spawned(void *arg, int cmd, int resp)
{
    (void)cmd, (void)resp;
    ((void (*)(void))arg)();
    _exit(0);
}

static pid_t spawn(void (*fn)(void), const char *path)
{
    kvpt_peer p;
    if (kvpt_peer_fork(&p, path, spawned, (void *)fn) != 0) return -1;
    close(p.cmd);
    close(p.resp);
    return p.pid;
}

/* Run one batch; -1 when it passed, else the failing sequence. The parent
 * never starts a thread, so its forks are safe under TSan too. */
static int run_batch(int raw, uint64_t bseed, int from, int to, const int *keep, int nkeep,
                     int show)
{
    memset(&B, 0, sizeof B);
    B.raw = raw;
    B.bseed = bseed;
    draw_settings(bseed, &B.s);
    B.from = from;
    B.to = to;
    B.keep = keep;
    B.nkeep = nkeep;
    if (kvpt_raw_setup_init(&B.setup) || kvpt_chan_init(&B.s2r) || kvpt_chan_init(&B.r2s) ||
        kvpt_chan_init(&B.result)) {
        fprintf(stderr, "  set-up failed\n");
        return from;
    }
    char sp[128], rp[128];
    kvpt_err_path(sp, sizeof sp, "model_send");
    kvpt_err_path(rp, sizeof rp, "model_recv");
    B.sender = spawn(raw ? raw_sender : pipe_sender, sp);
    pid_t recv_pid = spawn(receiver, rp);
    rng r = {bseed};
    int failed = -1, live = 2, bad = 0;
    uint64_t deadline = kvpi_now_ms() + 60000 + (uint64_t)(to - from) * 3000, kill_at = 0;
    pid_t pids[2] = {B.sender, recv_pid};
    while (live) {
        for (int k = 0; k < 2; k++) {
            if (!pids[k]) continue;
            int ws;
            pid_t w = waitpid(pids[k], &ws, WNOHANG | WUNTRACED);
            if (w != pids[k]) continue;
            if (WIFSTOPPED(ws)) {
                /* The receiver stopped itself: continue it after a while
                 * (the sender is stopped and continued by the receiver). */
                if (k == 1) {
                    usleep((useconds_t)rrange(&r, 10000, 80000));
                    kill(pids[k], SIGCONT);
                }
                continue;
            }
            if (!WIFEXITED(ws) || WEXITSTATUS(ws)) {
                bad = 1;
                if (show)
                    fprintf(stderr, "  %s %s\n", k ? "receiver" : "sender",
                            WIFEXITED(ws) ? "failed" : "was killed");
                if (!kill_at) kill_at = kvpi_now_ms() + 1000;
            }
            pids[k] = 0;
            live--;
        }
        uint64_t now = kvpi_now_ms();
        if ((kill_at && now > kill_at) || now > deadline) {
            if (now > deadline && show) fprintf(stderr, "  the batch ran out of time\n");
            bad = 1;
            for (int k = 0; k < 2; k++)
                if (pids[k]) {
                    kill(pids[k], SIGCONT);
                    kill(pids[k], SIGKILL);
                    waitpid(pids[k], NULL, 0);
                    pids[k] = 0;
                    live--;
                }
        }
        usleep(1000);
    }
    if (bad) {
        int32_t i;
        struct pollfd pf = {.fd = B.result.fd[0], .events = POLLIN};
        failed = poll(&pf, 1, 0) == 1 && read(B.result.fd[0], &i, sizeof i) == sizeof i ? i : from;
        if (show) {
            kvpt_file_show(rp, "receiver");
            kvpt_file_show(sp, "sender");
        }
    }
    int fds[] = {B.s2r.fd[0], B.s2r.fd[1],    B.r2s.fd[0],
                 B.r2s.fd[1], B.result.fd[0], B.result.fd[1]};
    for (int k = 0; k < 6; k++)
        close(fds[k]);
    unlink(sp);
    unlink(rp);
    return failed;
}

static const char *path_name(int raw)
{
    return raw ? "raw" : "kvpipe";
}

static void print_ops(const seq *q)
{
    for (int j = 0; j < q->n; j++) {
        const op *o = &q->ops[j];
        fprintf(stderr, "    op %d: %s", o->orig, o->none ? "None" : kvp_dtype_name(o->dtype));
        if (!o->none)
            for (int d = 0; d < o->ndim; d++)
                fprintf(stderr, "%s%" PRId64 "%s", d ? "," : "[", o->shape[d],
                        d + 1 == o->ndim ? "]" : "");
        fprintf(stderr, " %zu bytes encoded%s; send sleep %d us, recv sleep %d us%s, recv %d ms",
                o->encoded, o->take ? " (send_take)" : "", o->send_sleep_us, o->recv_sleep_us,
                o->recv_stop ? " + stop" : "", o->recv_timeout_ms);
        if (o->stall_ms) fprintf(stderr, ", sender stopped under a %d ms recv", o->stall_ms);
        fprintf(stderr, "\n");
    }
}

/* Remove ops of sequence index while it still fails alone; print the
 * shortest. */
static void shrink(int raw, uint64_t bseed, int index)
{
    settings s;
    seq q;
    draw_settings(bseed, &s);
    draw_seq(bseed, index, &s, &q);
    int keep[MAX_OPS], n = q.n, trials = 0;
    for (int j = 0; j < n; j++)
        keep[j] = j;
    uint64_t t0 = kvpi_now_ms();
    fprintf(stderr, "  shrinking sequence %d (%d messages) alone...\n", index, n);
    if (run_batch(raw, bseed, index, index + 1, keep, n, 0) < 0 &&
        run_batch(raw, bseed, index, index + 1, keep, n, 0) < 0) {
        fprintf(stderr,
                "  sequence %d alone passed twice: it needs the ones before it; replay "
                "the batch up to it (above)\n",
                index);
        return;
    }
    for (int chunk = n / 2 > 0 ? n / 2 : 1; chunk >= 1; chunk /= 2) {
        for (int start = 0; start < n && n > 1;) {
            if (since_ms(t0) > SHRINK_S * 1000) goto done;
            int c = start + chunk > n ? n - start : chunk, trial[MAX_OPS], m = 0;
            for (int j = 0; j < n; j++)
                if (j < start || j >= start + c) trial[m++] = keep[j];
            trials++;
            if (m > 0 && run_batch(raw, bseed, index, index + 1, trial, m, 0) >= 0) {
                memcpy(keep, trial, sizeof trial);
                n = m;
            } else {
                start += c;
            }
        }
    }
done:;
    char list[MAX_OPS * 4] = "";
    for (int j = 0; j < n; j++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", j ? "," : "", keep[j]);
    int all = q.n;
    keep_ops(&q, keep, n);
    fprintf(stderr,
            "  shortest failing (%d of %d messages, %d trials, %.1f s):\n"
            "    KVPT_FILTER=test_model_%s KVPT_SEED=%#" PRIx64
            " KVPT_SEQUENCES=%d KVPT_MODEL_OPS=%s build/tests/pipe_model_test\n",
            n, all, trials, since_ms(t0) / 1000.0, path_name(raw), bseed, index, list);
    print_ops(&q);
    /* Show that run's output. */
    run_batch(raw, bseed, index, index + 1, keep, n, 1);
}

static long env_long(const char *name, long dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtol(v, NULL, 0) : dflt;
}

static void report(int raw, uint64_t bseed, int failed)
{
    char st[256];
    settings s;
    draw_settings(bseed, &s);
    settings_str(&s, st, sizeof st);
    fprintf(stderr,
            "  pipe_model %s: FAILED at batch seed %#" PRIx64 ", sequence %d (%s)\n"
            "  replay: KVPT_FILTER=test_model_%s KVPT_SEED=%#" PRIx64
            " KVPT_SEQUENCES=0-%d build/tests/pipe_model_test\n",
            path_name(raw), bseed, failed, st, path_name(raw), bseed, failed);
    CHECK(failed < 0);
}

static void run_path(int raw)
{
    const char *seed_env = getenv("KVPT_SEED");
    if (seed_env && *seed_env) {
        /* Replay: one batch, the given sequences, the given ops. */
        uint64_t bseed = strtoull(seed_env, NULL, 0);
        int from = 0, to = PER_BATCH - 1, keep[MAX_OPS], nkeep = 0;
        const char *sq = getenv("KVPT_SEQUENCES"), *ops = getenv("KVPT_MODEL_OPS");
        if (sq && *sq && sscanf(sq, "%d-%d", &from, &to) < 2) to = from;
        for (const char *c = ops; c && *c && nkeep < MAX_OPS;) {
            keep[nkeep++] = (int)strtol(c, (char **)&c, 10);
            if (*c == ',')
                c++;
            else
                break;
        }
        fprintf(stderr, "  pipe_model %s: replaying batch seed %#" PRIx64 ", sequences %d-%d\n",
                path_name(raw), bseed, from, to);
        int failed = run_batch(raw, bseed, from, to + 1, nkeep ? keep : NULL, nkeep, 1);
        if (failed >= 0) report(raw, bseed, failed);
        return;
    }
    long total = env_long("KVPT_MODEL_SEQUENCES", KVPT_MODEL_DEFAULT_SEQUENCES);
    long minutes = env_long("KVPT_MODEL_MINUTES", 0);
    uint64_t base = mix64((uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32) ^ kvpi_now_ns());
    if (getenv("KVPT_MODEL_BASE")) base = strtoull(getenv("KVPT_MODEL_BASE"), NULL, 0);
    fprintf(stderr, "  pipe_model %s: base seed %#" PRIx64 " (KVPT_MODEL_BASE), %s\n",
            path_name(raw), base, minutes ? "timed" : "counted");
    uint64_t t0 = kvpi_now_ms();
    long done = 0;
    for (uint64_t b = 0;; b++) {
        if (minutes ? since_ms(t0) >= (uint64_t)minutes * 60000 : done >= total) break;
        uint64_t bseed = mix64(base + b);
        int n = minutes ? PER_BATCH : (int)(total - done < PER_BATCH ? total - done : PER_BATCH);
        int failed = run_batch(raw, bseed, 0, n, NULL, 0, 1);
        if (failed >= 0) {
            report(raw, bseed, failed);
            shrink(raw, bseed, failed);
            return;
        }
        done += n;
    }
    fprintf(stderr, "  pipe_model %s: %ld sequences passed in %.1f s\n", path_name(raw), done,
            since_ms(t0) / 1000.0);
}

static void test_model_kvpipe(void)
{
    run_path(0);
}

static void test_model_raw(void)
{
    run_path(1);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    int secs = (int)env_long("KVPT_MODEL_MINUTES", 0) * 60 + 600;
    RUN_T(test_model_kvpipe, secs);
    RUN_T(test_model_raw, secs);
    return kvpt_summary();
}
