/* kvpipe bench --pipe: tensor pipe throughput. Rank 0 sends --count tensors of
 * --tensor-size bytes; rank 1 receives them, checks them on a second thread
 * (each block's stamp; with --verify every byte), counts tensors lost,
 * duplicated, reordered or corrupted, and reports GB/s from the first send to
 * the last receipt. Without --config both ranks run here as two processes on
 * loopback. */
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_opts.h"
#include "kvpipe/kvpipe.h"
#include "kvpipe/pipe.h"
#include "pattern.h"
#include "pipe_launch.h"

#define START_TIMEOUT_MS 60000
#define RECV_TIMEOUT_MS 30000
#define FLUSH_TIMEOUT_MS 120000
#define VERIFY_QUEUE 8

typedef struct bp_opts {
    size_t tensor_size, kv_buffer_size;
    long count, warmup; /* warmup < 0: choose */
    const char *protocol, *metadata, *config;
    int kv_rank, json, no_shm, port;
    int timeout_ms;  /* the engine's I/O timeout; 0: the pipe's default */
    long inline_max; /* --inline-max-bytes; < 0: the pipe's default */
    int in_place;    /* --send in-place: kvp_pipe_tensor_alloc + kvp_pipe_send_take */
    int verify;      /* compare every byte, not only the stamps */
} bp_opts;

enum { O_TENSOR_SIZE = 1 };

static const cli_opt opts[] = {
    {"pipe", CLI_ARG_FLAG, NULL, "measure the tensor pipe (this mode)"},
    {"tensor-size", CLI_ARG_SIZE, "BYTES",
     "bytes per tensor, a multiple of 8, at least 16 (required)", 16, 1ll << 40,
     .id = O_TENSOR_SIZE, CLI_TO(bp_opts, tensor_size)},
    {"count", CLI_ARG_INT, "N", "tensors to send (default 100)", 1, 1ll << 40,
     CLI_TO(bp_opts, count)},
    {"protocol", CLI_ARG_STRING, "P", "engine protocol for the two-process run (default tcp)",
     CLI_TO(bp_opts, protocol)},
    {"send", CLI_ARG_CHOICE, "copy|in-place",
     "copy: kvp_pipe_send() copies each tensor into registered\nmemory (default); in-place: "
     "tensors are built in pipe\nbuffers (kvp_pipe_tensor_alloc) and sent with no copy",
     .choices = "copy|in-place", CLI_TO(bp_opts, in_place)},
    {"no-shm", CLI_ARG_FLAG, NULL, "never use the same-host transport", CLI_TO(bp_opts, no_shm)},
    {"verify", CLI_ARG_FLAG, NULL,
     "receiver compares every byte (default: the stamp at the\nstart of each 64 KiB block, "
     "which catches lost, repeated,\nreordered and misplaced blocks)",
     CLI_TO(bp_opts, verify)},
    {"metadata-server", CLI_ARG_STRING, "M",
     "two-process run: http (an embedded store, default), p2p\n(P2PHANDSHAKE), or a connection "
     "string",
     .aliases = "metadata", CLI_TO(bp_opts, metadata)},
    {"kv-buffer-size", CLI_ARG_SIZE, "BYTES", "bytes in flight before send waits (default 1e9)", 1,
     LLONG_MAX, CLI_TO(bp_opts, kv_buffer_size)},
    {"timeout-ms", CLI_ARG_INT, "MS",
     "the engines' I/O timeout, which bounds each READ\n(default 5000)", 1, 86400000,
     CLI_TO(bp_opts, timeout_ms)},
    {"warmup", CLI_ARG_INT, "N",
     "untimed tensors first, so that both engines' buffer\npools hold their memory (default: "
     "kv-buffer-size worth,\nat most 32)",
     0, 1000000, CLI_TO(bp_opts, warmup)},
    {"inline-max-bytes", CLI_ARG_INT, "B",
     "both ranks' kvp_pipe_opts.inline_max_bytes: messages up to\nB bytes travel inline "
     "(default: the pipe's, 128 KiB); 0:\nevery message is announced and READ (MooncakePipe's "
     "path)",
     0, 1 << 30, CLI_TO(bp_opts, inline_max)},
    {"config", CLI_ARG_STRING, "FILE", "run one rank with this mooncake config",
     CLI_TO(bp_opts, config)},
    {"kv-rank", CLI_ARG_INT, "0|1", "the rank to run with --config (0 sends, 1 receives)", 0, 1,
     CLI_TO(bp_opts, kv_rank)},
    {"port", CLI_ARG_INT, "P", "two-process run: base port (default: a free one)", 1, 65000,
     CLI_TO(bp_opts, port)},
    {"json", CLI_ARG_FLAG, NULL,
     "receiver: last stdout line is a JSON object with gbps,\nbytes, ops, errors, lost, "
     "duplicated, reordered,\ncorrupt, failed, seconds, tensor_size, transport\n(\"inline\": "
     "no message READ), messages and\ninline_messages (warm-up included), send",
     CLI_TO(bp_opts, json)},
};

static const cli_spec spec = {
    .cmd = "bench",
    .synopsis = "usage: kvpipe bench --pipe --tensor-size BYTES [--count N] [options]\n"
                "       kvpipe bench --pipe --config FILE --kv-rank 0|1 --tensor-size BYTES "
                "[--count N]\n",
    .about = "Measure the tensor pipe: rank 0 sends N uint8 tensors of BYTES bytes, rank 1\n"
             "receives and checks them and reports GB/s from the first send to the last\n"
             "receipt. Without --config both ranks run here, as two processes on\n"
             "loopback; with --config (a mooncake JSON file) only the given rank runs.\n",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .epilog = "The receiver reports tensors lost (never received intact), duplicated\n"
              "(received again), reordered (received after a later one), corrupt (wrong\n"
              "bytes, size or stamp) and failed (receipts that returned an error; the\n"
              "receiver goes on after one). It exits 1 unless all of these are 0.\n",
};

static const char *set_opt(void *p, const cli_opt *opt, const cli_value *v)
{
    (void)p;
    if (opt->id == O_TENSOR_SIZE && v->size % 8)
        return "a multiple of 8, at least 16 (K, M, G suffixes)";
    return NULL;
}

/* 0 to go on, otherwise 1 + the exit code. */
static int parse_args(int argc, char **argv, bp_opts *o)
{
    *o = (bp_opts){.count = 100,
                   .warmup = -1,
                   .inline_max = -1,
                   .protocol = "tcp",
                   .metadata = "http",
                   .kv_rank = -1,
                   .kv_buffer_size = 1000000000u};
    int r = cli_parse(&spec, argc, argv, 0, set_opt, o);
    if (r) return r;
    const char *bad = !o->tensor_size ? "--tensor-size is required: bytes per tensor, a "
                                        "multiple of 8, at least 16"
                      : o->config && o->kv_rank < 0   ? "--config needs --kv-rank 0|1"
                      : !o->config && o->kv_rank >= 0 ? "--kv-rank needs --config"
                                                      : NULL;
    if (bad) {
        cli_error("%s", bad);
        return 3;
    }
    if (o->warmup < 0) {
        size_t fill = o->kv_buffer_size / o->tensor_size + 1;
        o->warmup = fill > 32 ? 32 : (long)fill;
    }
    return 0;
}

/* ------------------------------------------------------------ content --- */

/* Tensor content: 64 KiB blocks, each a copy of one reference block whose
 * first 8 bytes are replaced by a stamp of (tensor index, block index). The
 * stamps catch a lost, repeated, reordered or misplaced block as the byte
 * comparison catches corruption, and comparing against a block that stays in
 * cache reads each received byte once: the check must stay cheap next to the
 * transfer, since on a 2-core machine it competes with it for the cores. */
#define BLOCK 65536u

static uint64_t stamp_of(uint64_t tensor, uint64_t block)
{
    return (tensor << 32) ^ block ^ 0x5a5a000000000000ull;
}

static void stamp(uint8_t *buf, size_t n, uint64_t i)
{
    for (size_t off = 0, k = 0; off + 8 <= n; off += BLOCK, k++) {
        uint64_t v = stamp_of(i, k);
        memcpy(buf + off, &v, 8);
    }
}

/* Fill buf (n bytes) with the reference block repeated; ref holds BLOCK bytes. */
static void fill_blocks(uint8_t *buf, size_t n, const uint8_t *ref)
{
    for (size_t off = 0; off < n; off += BLOCK)
        memcpy(buf + off, ref, n - off < BLOCK ? n - off : BLOCK);
}

/* The index the first block's stamp names, or -1 when it names none below
 * count (a corrupt tensor). */
static long index_of(const kvp_tensor *t, size_t n, long count)
{
    if (t->dtype != KVP_DTYPE_U8 || t->ndim != 1 || t->nbytes != n) return -1;
    uint64_t v;
    memcpy(&v, t->data, 8);
    v ^= stamp_of(0, 0);
    return (v & 0xffffffffu) == 0 && (v >> 32) < (uint64_t)count ? (long)(v >> 32) : -1;
}

/* Check the stamps of tensor i, and with full every byte. */
static int check(const kvp_tensor *t, const uint8_t *ref, size_t n, uint64_t i, int full)
{
    if (t->dtype != KVP_DTYPE_U8 || t->ndim != 1 || t->nbytes != n) return -1;
    const uint8_t *b = t->data;
    for (size_t off = 0, k = 0; off < n; off += BLOCK, k++) {
        size_t len = n - off < BLOCK ? n - off : BLOCK;
        if (len >= 8) {
            uint64_t want = stamp_of(i, k), got;
            memcpy(&got, b + off, 8);
            if (got != want || (full && memcmp(b + off + 8, ref + 8, len - 8) != 0)) return -1;
        } else if (full && memcmp(b + off, ref, len) != 0) {
            return -1;
        }
    }
    return 0;
}

static kvp_pipe *open_pipe(const bp_opts *o, int kv_rank)
{
    kvp_pipe_config *cfg = NULL;
    kvp_pipe *pipe = NULL;
    kvp_status st = kvp_pipe_config_load(o->config, &cfg);
    if (st == KVP_OK) {
        kvp_pipe_opts po;
        kvp_pipe_opts_init(&po);
        po.disable_shm = o->no_shm;
        po.kv_buffer_size = o->kv_buffer_size;
        if (o->timeout_ms) po.io_timeout_ms = o->timeout_ms;
        if (o->inline_max >= 0) po.inline_max_bytes = (size_t)o->inline_max;
        st = kvp_pipe_open(cfg, 0, kv_rank, &po, &pipe);
    }
    kvp_pipe_config_free(cfg);
    if (st) cli_error("%s", kvp_last_error());
    return pipe;
}

/* ------------------------------------------------------------- sender --- */

/* --send in-place. A producer writes its tensor into the pipe's buffer in
 * place of its own; that write is the producer's work, as it is with the
 * copying send (where the bench fills its tensor once). So, to time only the
 * pipe, a recycled buffer that still holds the blocks is only re-stamped.
 *
 * That is sound because every write into the sender's buffers is tracked: in
 * this mode the bench allocates every message itself (None included), the
 * pipe writes only the header in front of the data, and the engine serves
 * nothing else. A region's content is known as long as no later message
 * overlapped it (header room included). Were it wrong, the receiver's byte
 * check would fail the run. */
#define FILLED_MAX 64
#define HEADER_ROOM 2048 /* at least the pipe's header room in front of the data */

typedef struct filled_set {
    uintptr_t addr[FILLED_MAX]; /* data addresses holding the blocks */
    size_t n, size;
} filled_set;

/* Note a write to [lo, hi): forget regions it overlaps; 1 if one was exactly
 * this data address (its content is still there). */
static int filled_touch(filled_set *f, uintptr_t data, size_t len)
{
    uintptr_t lo = data - HEADER_ROOM, hi = data + len;
    int known = 0;
    for (size_t k = 0; k < f->n;) {
        uintptr_t a = f->addr[k];
        if (a == data && len == f->size) {
            known = 1;
            k++;
        } else if (a - HEADER_ROOM < hi && lo < a + f->size) {
            f->addr[k] = f->addr[--f->n];
        } else {
            k++;
        }
    }
    return known;
}

/* Make data (size bytes) hold the blocks, writing them only if it may not. */
static void fill_unless_known(filled_set *f, uint8_t *data, size_t size, const uint8_t *ref)
{
    if (filled_touch(f, (uintptr_t)data, size)) return;
    fill_blocks(data, size, ref);
    if (f->n < FILLED_MAX) f->addr[f->n++] = (uintptr_t)data;
}

static int send_in_place(kvp_pipe *pipe, filled_set *f, const uint8_t *ref, size_t size, uint64_t i)
{
    int64_t n = (int64_t)size;
    kvp_tensor *t;
    if (kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_U8, 1, &n, &t) != KVP_OK) return -1;
    fill_unless_known(f, t->data, size, ref);
    stamp(t->data, size, i);
    if (kvp_pipe_send_take(pipe, t) == KVP_OK) return 0;
    kvp_tensor_free(t);
    return -1;
}

static int send_none_in_place(kvp_pipe *pipe, filled_set *f)
{
    int64_t one = 1, none = KVP_PIPE_NONE_VALUE;
    kvp_tensor *t;
    if (kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_I64, 1, &one, &t) != KVP_OK) return -1;
    filled_touch(f, (uintptr_t)t->data, 8);
    memcpy(t->data, &none, 8);
    if (kvp_pipe_send_take(pipe, t) == KVP_OK) return 0;
    kvp_tensor_free(t);
    return -1;
}

/* Fresh engine memory is paid for in page faults once, and slowly on some VMs
 * (under 1 GB/s); a long-running sender has grown its pool already. So before
 * anything is timed the sender holds as many buffers at once as it can have
 * in flight plus the one being prepared, touches them all, and frees them into
 * its pool (which keeps twice kv_buffer_size). */
static int prewarm(kvp_pipe *pipe, const bp_opts *o, filled_set *f, const uint8_t *ref)
{
    size_t k = o->kv_buffer_size / o->tensor_size + 2;
    if (k > 4096) k = 4096;
    kvp_tensor **held = calloc(k, sizeof *held);
    int rc = held ? 0 : -1;
    int64_t n = (int64_t)o->tensor_size;
    for (size_t i = 0; i < k && !rc; i++) {
        if (kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_U8, 1, &n, &held[i]) != KVP_OK) {
            rc = -1;
            break;
        }
        fill_unless_known(f, held[i]->data, o->tensor_size, ref);
    }
    for (size_t i = 0; held && i < k; i++)
        kvp_tensor_free(held[i]);
    free(held);
    return rc;
}

static int run_sender(const bp_opts *o)
{
    kvp_pipe *pipe = open_pipe(o, 0);
    if (!pipe) return 1;
    filled_set filled = {.n = 0, .size = o->tensor_size};
    uint8_t ref[BLOCK];
    pattern_fill(ref, BLOCK, PATTERN_WRITE, 0);
    /* The copying send's source, filled once. */
    uint8_t *buf = o->in_place ? NULL : malloc(o->tensor_size);
    int rc = o->in_place || buf ? 0 : 1;
    if (buf) fill_blocks(buf, o->tensor_size, ref);
    int64_t n = (int64_t)o->tensor_size;
    if (!rc) rc = prewarm(pipe, o, &filled, ref) != 0;
    /* Then warm-up tensors, so that the receiver's pool grows too. */
    for (long i = 0; i < o->warmup && !rc; i++) {
        kvp_tensor t;
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, buf);
        if (o->in_place)
            rc = send_in_place(pipe, &filled, ref, o->tensor_size, 0) != 0;
        else if (kvp_pipe_send(pipe, &t) != KVP_OK)
            rc = 1;
    }
    /* The warm-up acknowledged first, so that nothing is in flight when the
     * clock starts: a receiver READs several announcements at once, and
     * those started before the None would be moved off the clock. */
    if (!rc && o->warmup > 0 && kvp_pipe_flush(pipe, FLUSH_TIMEOUT_MS) != KVP_OK) rc = 1;
    /* None next: the receiver starts its clock when it arrives. */
    if (!rc && (o->in_place ? send_none_in_place(pipe, &filled) != 0
                            : kvp_pipe_send(pipe, NULL) != KVP_OK))
        rc = 1;
    for (long i = 0; i < o->count && !rc; i++) {
        kvp_tensor t;
        if (o->in_place) {
            rc = send_in_place(pipe, &filled, ref, o->tensor_size, (uint64_t)i) != 0;
            continue;
        }
        stamp(buf, o->tensor_size, (uint64_t)i);
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, buf);
        if (kvp_pipe_send(pipe, &t) != KVP_OK) rc = 1;
    }
    if (!rc && kvp_pipe_flush(pipe, FLUSH_TIMEOUT_MS) != KVP_OK) rc = 1;
    if (rc) cli_error("sender: %s", kvp_last_error());
    free(buf);
    kvp_pipe_close(pipe);
    return rc;
}

/* ----------------------------------------------------------- receiver --- */

/* What the receiver saw, tensor by tensor in arrival order. */
typedef struct tally {
    uint8_t *seen; /* per index: received intact */
    long count;    /* tensors sent */
    long highest;  /* highest index received intact so far, -1 before */
    uint64_t intact, duplicated, reordered, corrupt;
} tally;

static void tally_add(tally *y, const kvp_tensor *t, const uint8_t *ref, size_t n, int full)
{
    long i = index_of(t, n, y->count);
    if (i < 0 || check(t, ref, n, (uint64_t)i, full) != 0) {
        if (!y->corrupt)
            cli_error("pipe: tensor %" PRIu64 " received: MISMATCH",
                      y->intact + y->duplicated + y->corrupt);
        y->corrupt++;
    } else if (y->seen[i]) {
        if (!y->duplicated) cli_error("pipe: tensor %ld: DUPLICATE", i);
        y->duplicated++;
    } else {
        y->seen[i] = 1;
        y->intact++;
        if (i < y->highest) {
            if (!y->reordered) cli_error("pipe: tensor %ld after %ld: REORDERED", i, y->highest);
            y->reordered++;
        } else {
            y->highest = i;
        }
    }
}

typedef struct verifier {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    kvp_tensor *q[VERIFY_QUEUE];
    size_t head, count, n;
    uint8_t *ref; /* the reference block, BLOCK bytes */
    int full;     /* --verify */
    int done;
    tally tally; /* the verifier thread's until verify_finish() */
} verifier;

static void *verify_main(void *arg)
{
    verifier *v = arg;
    for (;;) {
        pthread_mutex_lock(&v->lock);
        while (v->count == 0 && !v->done)
            pthread_cond_wait(&v->cond, &v->lock);
        if (v->count == 0) {
            pthread_mutex_unlock(&v->lock);
            return NULL;
        }
        kvp_tensor *t = v->q[v->head];
        v->head = (v->head + 1) % VERIFY_QUEUE;
        v->count--;
        pthread_cond_broadcast(&v->cond);
        pthread_mutex_unlock(&v->lock);
        tally_add(&v->tally, t, v->ref, v->n, v->full);
        kvp_tensor_free(t);
    }
}

static void verify_push(verifier *v, kvp_tensor *t)
{
    pthread_mutex_lock(&v->lock);
    while (v->count == VERIFY_QUEUE)
        pthread_cond_wait(&v->cond, &v->lock);
    v->q[(v->head + v->count++) % VERIFY_QUEUE] = t;
    pthread_cond_broadcast(&v->cond);
    pthread_mutex_unlock(&v->lock);
}

static void verify_finish(verifier *v, pthread_t th)
{
    pthread_mutex_lock(&v->lock);
    v->done = 1;
    pthread_cond_broadcast(&v->cond);
    pthread_mutex_unlock(&v->lock);
    pthread_join(th, NULL);
}

/* ops: tensors received; failed: receipts that returned an error. */
static void report(const bp_opts *o, kvp_pipe *pipe, long ops, uint64_t failed, const tally *y,
                   double secs)
{
    uint64_t lost = (uint64_t)y->count - y->intact;
    uint64_t errors = failed + lost + y->duplicated + y->reordered + y->corrupt;
    uint64_t bytes = (uint64_t)ops * o->tensor_size;
    double gbps = secs > 0 ? (double)bytes / secs / 1e9 : 0;
    kvp_pipe_stats ps; /* warm-up messages included */
    kvp_pipe_get_stats(pipe, &ps);
    const char *tr = launch_recv_transport(pipe, &ps);
    char via[96];
    if (strcmp(tr, "inline") == 0)
        snprintf(via, sizeof via, "inline messages on the pipe's ZeroMQ link");
    else if (ps.inline_received)
        snprintf(via, sizeof via, "%s (%" PRIu64 " of %" PRIu64 " messages inline)", tr,
                 ps.inline_received, ps.received);
    else
        snprintf(via, sizeof via, "%s", tr);
    printf("kvpipe bench --pipe: %ld x %zu B via %s, %s send: %.3f GB/s in %.3f s, %" PRIu64
           " errors (%" PRIu64 " lost, %" PRIu64 " duplicated, %" PRIu64 " reordered, %" PRIu64
           " corrupt, %" PRIu64 " failed)%s\n",
           ops, o->tensor_size, via, o->in_place ? "in-place" : "copying", gbps, secs, errors, lost,
           y->duplicated, y->reordered, y->corrupt, failed,
           errors      ? ""
           : o->verify ? ", every byte verified"
                       : ", every block's stamp verified");
    if (o->json)
        printf("{\"gbps\": %.4f, \"bytes\": %" PRIu64 ", \"ops\": %ld, \"errors\": %" PRIu64
               ", \"lost\": %" PRIu64 ", \"duplicated\": %" PRIu64 ", \"reordered\": %" PRIu64
               ", \"corrupt\": %" PRIu64 ", \"failed\": %" PRIu64
               ", \"seconds\": %.3f, \"tensor_size\": %zu, \"transport\": \"%s\", "
               "\"messages\": %" PRIu64 ", \"inline_messages\": %" PRIu64 ", \"send\": \"%s\"}\n",
               gbps, bytes, ops, errors, lost, y->duplicated, y->reordered, y->corrupt, failed,
               secs, o->tensor_size, tr, ps.received, ps.inline_received,
               o->in_place ? "in-place" : "copy");
    fflush(stdout);
}

/* Take the untimed warm-up tensors, then the None that starts the clock. The
 * last few warm-up tensors are held together, as the verification queue will
 * hold them, so that the pool already has that much memory. Says on stderr
 * what went wrong. */
static kvp_status receive_preamble(const bp_opts *o, kvp_pipe *pipe)
{
    kvp_tensor *held[VERIFY_QUEUE + 2] = {0}, *t = NULL;
    kvp_status st = KVP_OK;
    const char *why = NULL;
    for (long i = 0; i < o->warmup && st == KVP_OK; i++) {
        kvp_tensor **slot = &held[i % (VERIFY_QUEUE + 2)];
        kvp_tensor_free(*slot);
        *slot = NULL;
        st = kvp_pipe_recv(pipe, START_TIMEOUT_MS, slot);
        if (st == KVP_OK && (!*slot || (*slot)->nbytes != o->tensor_size)) {
            st = KVP_EPROTO;
            why = "a warm-up tensor has the wrong size";
        }
    }
    for (size_t i = 0; i < VERIFY_QUEUE + 2; i++)
        kvp_tensor_free(held[i]);
    if (st == KVP_OK) st = kvp_pipe_recv(pipe, START_TIMEOUT_MS, &t);
    if (st == KVP_OK && t) {
        st = KVP_EPROTO;
        why = "expected None, got a tensor";
    }
    kvp_tensor_free(t);
    if (st) cli_error("pipe: no start marker: %s", why ? why : kvp_last_error());
    return st;
}

static int run_receiver(const bp_opts *o)
{
    verifier v = {.n = o->tensor_size,
                  .ref = malloc(BLOCK),
                  .full = o->verify,
                  .tally = {.seen = calloc((size_t)o->count, 1), .count = o->count, .highest = -1}};
    kvp_pipe *pipe = v.ref && v.tally.seen ? open_pipe(o, 1) : NULL;
    if (!pipe) {
        free(v.ref);
        free(v.tally.seen);
        return 1;
    }
    pattern_fill(v.ref, BLOCK, PATTERN_WRITE, 0);
    kvp_status st = receive_preamble(o, pipe);
    if (st) {
        free(v.ref);
        free(v.tally.seen);
        kvp_pipe_close(pipe);
        return 1;
    }
    uint64_t t0 = cli_now_ns(), t1 = t0;
    pthread_mutex_init(&v.lock, NULL);
    pthread_cond_init(&v.cond, NULL);
    pthread_t th;
    pthread_create(&th, NULL, verify_main, &v);
    /* One receipt per tensor sent. A receipt that fails having taken the
     * message (its READ failed: a lost tensor, reported) is counted and the
     * next one is tried; one that took nothing (nothing announced in time, the
     * pipe broken) ends the run. */
    long ops = 0;
    uint64_t failed = 0;
    while (ops + (long)failed < o->count) {
        kvp_tensor *t = NULL;
        kvp_pipe_stats before, after;
        kvp_pipe_get_stats(pipe, &before);
        st = kvp_pipe_recv(pipe, RECV_TIMEOUT_MS, &t);
        if (st == KVP_OK && t) {
            ops++;
            t1 = cli_now_ns();
            verify_push(&v, t);
            continue;
        }
        cli_error("pipe: receipt %ld: %s", ops + (long)failed, st ? kvp_last_error() : "got None");
        kvp_pipe_get_stats(pipe, &after);
        failed++;
        if (st != KVP_OK && after.bad_messages == before.bad_messages) break;
    }
    verify_finish(&v, th);
    free(v.ref);
    report(o, pipe, ops, failed, &v.tally, (double)(t1 - t0) / 1e9);
    free(v.tally.seen);
    kvp_pipe_close(pipe);
    return failed || v.tally.intact < (uint64_t)o->count || v.tally.duplicated ||
                   v.tally.reordered || v.tally.corrupt
               ? 1
               : 0;
}

/* ------------------------------------------------------ both, locally --- */

static int run_both(int argc, char **argv, const bp_opts *o)
{
    launch_pair l;
    if (launch_prepare(&l, o->metadata, o->protocol, o->port) != 0) {
        launch_cleanup(&l);
        return 1;
    }
    const char *names[2] = {"receiver", "sender"};
    const char *sides[2][LAUNCH_SIDE_ARGS] = {{"--config", l.config_path, "--kv-rank", "1"},
                                              {"--config", l.config_path, "--kv-rank", "0"}};
    /* A backstop only: each side bounds its own waits. */
    double slow_ms = (double)o->tensor_size * (double)o->count / 20e6 * 1000;
    int limit = FLUSH_TIMEOUT_MS + 60000 + (slow_ms > 1e9 ? 1000000000 : (int)slow_ms);
    int rc = launch_run(&l, "bench", argc, argv, names, sides, limit);
    launch_cleanup(&l);
    return rc;
}

int cmd_bench_pipe(int argc, char **argv)
{
    bp_opts o;
    int r = parse_args(argc, argv, &o);
    if (r) return r - 1;
    if (!o.config) return run_both(argc, argv, &o);
    launch_child_init();
    return o.kv_rank == 0 ? run_sender(&o) : run_receiver(&o);
}
