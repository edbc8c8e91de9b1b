/* kvpipe demo: disaggregated prefill and decode on this host. A prefill process
 * sends the KV cache of N requests through the pipe as vLLM's v0 connector
 * does (per request: input tokens, roi, keys, values, hidden states); a decode
 * process receives them and checks every byte. See docs/demo.md. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "cli.h"
#include "cli_opts.h"
#include "kvpipe/kvpipe.h"
#include "kvpipe/pipe.h"
#include "pattern.h"
#include "pipe_launch.h"

#define N_PARTS 5
#define VOCAB 128256 /* Llama-3's vocabulary */
#define RECV_TIMEOUT_MS 60000

typedef struct demo_opts {
    int tokens, requests, layers, kv_heads, head_dim, hidden;
    int tokens_min, tokens_max; /* --tokens-mix MIN..MAX (tokens_min 0: every request --tokens) */
    unsigned long long seed;    /* of the mix */
    int decode_lag_ms;          /* decode's pause between requests */
    kvp_dtype dtype;
    const char *protocol, *metadata;
    int no_shm, json, port, timeout_ms, prefault, baseline, in_place;
    const char *role, *run_dir; /* set for the two child processes */
} demo_opts;

static const char *part_names[N_PARTS] = {"input_tokens", "roi", "keys", "values", "hidden"};

/* dtype names: safetensors' (any case) and torch's. */
static const struct {
    const char *name;
    kvp_dtype dtype;
} dtype_names[] = {
    {"bool", KVP_DTYPE_BOOL},
    {"u8", KVP_DTYPE_U8},
    {"uint8", KVP_DTYPE_U8},
    {"i8", KVP_DTYPE_I8},
    {"int8", KVP_DTYPE_I8},
    {"i16", KVP_DTYPE_I16},
    {"int16", KVP_DTYPE_I16},
    {"short", KVP_DTYPE_I16},
    {"u16", KVP_DTYPE_U16},
    {"uint16", KVP_DTYPE_U16},
    {"i32", KVP_DTYPE_I32},
    {"int32", KVP_DTYPE_I32},
    {"int", KVP_DTYPE_I32},
    {"u32", KVP_DTYPE_U32},
    {"uint32", KVP_DTYPE_U32},
    {"i64", KVP_DTYPE_I64},
    {"int64", KVP_DTYPE_I64},
    {"long", KVP_DTYPE_I64},
    {"u64", KVP_DTYPE_U64},
    {"uint64", KVP_DTYPE_U64},
    {"f16", KVP_DTYPE_F16},
    {"float16", KVP_DTYPE_F16},
    {"half", KVP_DTYPE_F16},
    {"bf16", KVP_DTYPE_BF16},
    {"bfloat16", KVP_DTYPE_BF16},
    {"f32", KVP_DTYPE_F32},
    {"float32", KVP_DTYPE_F32},
    {"float", KVP_DTYPE_F32},
    {"f64", KVP_DTYPE_F64},
    {"float64", KVP_DTYPE_F64},
    {"double", KVP_DTYPE_F64},
    {"f8_e4m3", KVP_DTYPE_F8_E4M3},
    {"float8_e4m3fn", KVP_DTYPE_F8_E4M3},
    {"f8_e5m2", KVP_DTYPE_F8_E5M2},
    {"float8_e5m2", KVP_DTYPE_F8_E5M2},
};

#define DTYPE_HELP                                                                                 \
    "element type of keys, values and hidden states (default\n"                                    \
    "bf16): bool, u8, i8, i16, u16, i32, u32, i64, u64, f16,\n"                                    \
    "bf16, f32, f64, f8_e4m3, f8_e5m2 (any case), or torch's\n"                                    \
    "names: bfloat16, float16 (half), float32 (float),\n"                                          \
    "float64 (double), int8, uint8, int16, uint16, int32, int64,\n"                                \
    "uint32, uint64, float8_e4m3fn, float8_e5m2, with or\n"                                        \
    "without \"torch.\""

static int parse_dtype(const char *s, kvp_dtype *out)
{
    if (!strncmp(s, "torch.", 6)) s += 6;
    for (size_t i = 0; i < sizeof dtype_names / sizeof dtype_names[0]; i++)
        if (!strcasecmp(s, dtype_names[i].name)) {
            *out = dtype_names[i].dtype;
            return 0;
        }
    return -1;
}

enum {
    O_TOKENS = 1,
    O_TOKENS_MIX,
    O_DTYPE,
    O_NO_PREFAULT,
};

static const cli_opt opts[] = {
    {"tokens", CLI_ARG_INT, "T", "tokens per request (default 1024)", 1, 1 << 20, .id = O_TOKENS},
    {"tokens-mix", CLI_ARG_STRING, "MIN..MAX",
     "tokens per request drawn from MIN..MAX, log-uniformly:\n"
     "an octave [MIN*2^k, MIN*2^(k+1)) uniformly (the last\n"
     "one up to MAX), then a count in it uniformly; the same\n"
     "--seed draws the same counts (instead of --tokens)",
     .id = O_TOKENS_MIX},
    {"seed", CLI_ARG_INT, "S", "seed of --tokens-mix (default 1)", 0, 4294967295LL,
     CLI_TO(demo_opts, seed)},
    {"decode-lag-ms", CLI_ARG_INT, "MS",
     "decode pauses MS between requests, so that prefill runs\nahead, as far as kv_buffer_size "
     "lets it (default 0)",
     0, 10000, CLI_TO(demo_opts, decode_lag_ms)},
    {"requests", CLI_ARG_INT, "N", "requests (default 8)", 1, 1 << 20, CLI_TO(demo_opts, requests)},
    {"layers", CLI_ARG_INT, "L", "layers (default 32: Llama-3-8B)", 1, 4096,
     CLI_TO(demo_opts, layers)},
    {"kv-heads", CLI_ARG_INT, "H", "KV heads (default 8)", 1, 4096, CLI_TO(demo_opts, kv_heads)},
    {"head-dim", CLI_ARG_INT, "D", "head dimension (default 128)", 1, 65536,
     CLI_TO(demo_opts, head_dim)},
    {"hidden-size", CLI_ARG_INT, "S", "hidden size (default 4096; 0: an empty hidden tensor)", 0,
     1 << 20, CLI_TO(demo_opts, hidden)},
    {"dtype", CLI_ARG_STRING, "T", DTYPE_HELP, .id = O_DTYPE},
    {"protocol", CLI_ARG_STRING, "P", "engine protocol in the config (default tcp)",
     CLI_TO(demo_opts, protocol)},
    {"no-shm", CLI_ARG_FLAG, NULL, "never use the same-host transport", CLI_TO(demo_opts, no_shm)},
    {"metadata-server", CLI_ARG_STRING, "M",
     "http (an embedded store, default), p2p (P2PHANDSHAKE),\nor a connection string such as "
     "etcd://127.0.0.1:2379",
     .aliases = "metadata", CLI_TO(demo_opts, metadata)},
    {"port", CLI_ARG_INT, "P", "base port of prefill_url/decode_url (default: a free one)", 1,
     65000, CLI_TO(demo_opts, port)},
    {"timeout-ms", CLI_ARG_INT, "MS", "the engines' I/O timeout (default 5000)", 1, 86400000,
     CLI_TO(demo_opts, timeout_ms)},
    {"no-prefault", CLI_ARG_FLAG, NULL,
     "do not touch the engines' buffer memory before the run:\nthe first requests then pay the "
     "page faults of fresh\nmemory, as in a process that just started",
     .id = O_NO_PREFAULT},
    {"send", CLI_ARG_CHOICE, "copy|in-place",
     "copy: kvp_pipe_send() copies each tensor into registered\nmemory, as vLLM's connector "
     "does (default); in-place:\nprefill builds each tensor in a pipe buffer\n"
     "(kvp_pipe_tensor_alloc) before its clock starts, and\nkvp_pipe_send_take() sends it "
     "with no copy",
     .choices = "copy|in-place", CLI_TO(demo_opts, in_place)},
    {"baseline", CLI_ARG_FLAG, NULL,
     "also time memcpy of the same bytes (one thread, memory\npre-faulted) after the run, for "
     "comparison",
     CLI_TO(demo_opts, baseline)},
    {"json", CLI_ARG_FLAG, NULL, "last stdout line: a JSON object with the results",
     CLI_TO(demo_opts, json)},
    {"role", CLI_ARG_CHOICE, NULL, NULL, .choices = "prefill|decode", CLI_TO(demo_opts, role)},
    {"run-dir", CLI_ARG_STRING, NULL, NULL, CLI_TO(demo_opts, run_dir)},
};

static const cli_spec spec = {
    .cmd = "demo",
    .synopsis = "usage: kvpipe demo [options]\n",
    .about = "Run a prefill and a decode process on this host and move the KV cache of\n"
             "--requests requests through the tensor pipe, as vLLM's v0 connector sends it\n"
             "(per request: input tokens, roi, keys [layers, tokens, kv-heads, head-dim],\n"
             "values, hidden states [tokens, hidden-size]). Decode checks every byte. Both\n"
             "sides pre-fault the buffer memory they will use before the clock starts.\n"
             "Prints the first request's latency apart from the steady state's (p50/p99,\n"
             "first send to last receipt of a request), GB/s, and each side's peak RSS.\n",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .epilog = "docs/demo.md explains every figure.\n",
};

static const char *set_opt(void *p, const cli_opt *opt, const cli_value *v)
{
    demo_opts *o = p;
    switch (opt->id) {
    case O_TOKENS:
        o->tokens = (int)v->i;
        o->tokens_min = o->tokens_max = 0; /* the last of --tokens and --tokens-mix counts */
        break;
    case O_TOKENS_MIX: {
        const char *bad = "MIN..MAX, integers with 1 <= MIN <= MAX <= 1048576";
        char *end;
        long lo = strtol(v->text, &end, 10);
        if (end == v->text || strncmp(end, "..", 2) != 0) return bad;
        const char *rest = end + 2;
        long hi = strtol(rest, &end, 10);
        if (end == rest || *end || lo < 1 || hi < lo || hi > 1 << 20) return bad;
        o->tokens_min = (int)lo;
        o->tokens_max = (int)hi;
        break;
    }
    case O_DTYPE:
        if (parse_dtype(v->text, &o->dtype))
            return "a dtype: bool, u8, i8, i16, u16, i32, u32, i64, u64, f16, bf16, f32, f64, "
                   "f8_e4m3, f8_e5m2, or torch's name (bfloat16, float16, ...)";
        break;
    case O_NO_PREFAULT:
        o->prefault = !v->i;
        break;
    }
    return NULL;
}

/* 0 to go on, otherwise 1 + the exit code. */
static int parse_args(int argc, char **argv, demo_opts *o)
{
    *o = (demo_opts){.tokens = 1024,
                     .requests = 8,
                     .layers = 32,
                     .kv_heads = 8,
                     .head_dim = 128,
                     .hidden = 4096,
                     .dtype = KVP_DTYPE_BF16,
                     .protocol = "tcp",
                     .metadata = "http",
                     .seed = 1,
                     .prefault = 1};
    int r = cli_parse(&spec, argc, argv, 0, set_opt, o);
    if (r) return r;
    if (!strcmp(o->metadata, "P2PHANDSHAKE")) o->metadata = "p2p";
    return 0;
}

/* --------------------------------------------------------- the tensors --- */

typedef struct part {
    kvp_dtype dtype;
    int ndim;
    int64_t shape[4];
    size_t nbytes;
} part;

static int parts_of(const demo_opts *o, int tokens, part p[N_PARTS])
{
    int64_t T = tokens;
    p[0] = (part){KVP_DTYPE_I64, 1, {T}, 0};
    p[1] = (part){KVP_DTYPE_BOOL, 1, {T}, 0};
    p[2] = (part){o->dtype, 4, {o->layers, T, o->kv_heads, o->head_dim}, 0};
    p[3] = p[2];
    p[4] = (part){o->dtype, 2, {T, o->hidden}, 0};
    for (int k = 0; k < N_PARTS; k++)
        if (kvp_tensor_size(p[k].dtype, p[k].ndim, p[k].shape, NULL, &p[k].nbytes)) return -1;
    return 0;
}

/* ------------------------------------------------------ the token counts --- */

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

/* Request r's tokens: --tokens, or with --tokens-mix an octave of MIN..MAX
 * drawn uniformly (octave k holds MIN*2^k .. MIN*2^(k+1)-1; there are
 * floor(log2((MAX+1)/MIN)) of them, at least one, and the last reaches up
 * to MAX), then a count in it uniformly. Every process of the run draws the
 * same counts from the seed. */
static int tokens_of(const demo_opts *o, int r)
{
    if (!o->tokens_min) return o->tokens;
    int64_t lo = o->tokens_min, hi = o->tokens_max, n_oct = 0;
    while (lo << (n_oct + 1) <= hi + 1)
        n_oct++;
    if (n_oct == 0) n_oct = 1;
    uint64_t x = splitmix64(o->seed * 0x100000001b3ULL ^ (uint64_t)r);
    int64_t k = (int64_t)(x % (uint64_t)n_oct);
    int64_t a = lo << k, b = k == n_oct - 1 ? hi : (lo << (k + 1)) - 1;
    if (b > hi) b = hi;
    return (int)(a + (int64_t)(splitmix64(x) % (uint64_t)(b - a + 1)));
}

/* The largest token count of the run. */
static int tokens_most(const demo_opts *o)
{
    int most = 0;
    for (int r = 0; r < o->requests; r++) {
        int t = tokens_of(o, r);
        if (t > most) most = t;
    }
    return most;
}

/* This process's peak resident set, KiB. */
static long peak_rss_kib(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? ru.ru_maxrss : -1;
}

static uint64_t seed_of(int request, int k)
{
    return PATTERN_WRITE ^ ((uint64_t)request << 8) ^ (uint64_t)k;
}

/* The content of part k of a request: token ids, an all-true roi, or the
 * pattern (words, then the tail bytes of one more word). */
static void fill_part(void *buf, size_t n, int k, uint64_t seed)
{
    uint8_t *b = buf;
    if (k == 0) {
        for (size_t i = 0; i < n / 8; i++) {
            int64_t id = (int64_t)(pattern_word(seed, i) % VOCAB);
            memcpy(b + 8 * i, &id, 8);
        }
    } else if (k == 1) {
        memset(b, 1, n);
    } else {
        size_t whole = n / 8 * 8;
        pattern_fill(b, whole, seed, 0);
        uint64_t w = pattern_word(seed, whole);
        memcpy(b + whole, &w, n - whole);
    }
}

static int check_part(const void *buf, size_t n, int k, uint64_t seed)
{
    const uint8_t *b = buf;
    if (k == 0) {
        for (size_t i = 0; i < n / 8; i++) {
            int64_t id;
            memcpy(&id, b + 8 * i, 8);
            if (id != (int64_t)(pattern_word(seed, i) % VOCAB)) return -1;
        }
        return 0;
    }
    if (k == 1) {
        for (size_t i = 0; i < n; i++)
            if (b[i] != 1) return -1;
        return 0;
    }
    size_t whole = n / 8 * 8;
    if (pattern_check(b, whole, seed, 0) != 0) return -1;
    uint64_t w = pattern_word(seed, whole);
    return memcmp(b + whole, &w, n - whole) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------ the sides --- */

static kvp_pipe *open_pipe(const demo_opts *o, int kv_rank)
{
    kvp_pipe_config *cfg = NULL;
    kvp_pipe *pipe = NULL;
    kvp_status st = kvp_pipe_config_load_env(&cfg);
    if (st == KVP_OK) {
        kvp_pipe_opts po;
        kvp_pipe_opts_init(&po);
        po.disable_shm = o->no_shm;
        if (o->timeout_ms) po.io_timeout_ms = o->timeout_ms;
        st = kvp_pipe_open(cfg, 0, kv_rank, &po, &pipe);
    }
    kvp_pipe_config_free(cfg);
    if (st) cli_error("%s: %s", o->role, kvp_last_error());
    return pipe;
}

static FILE *open_report(const demo_opts *o)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s.txt", o->run_dir, o->role);
    FILE *f = fopen(path, "w");
    if (!f) cli_error("%s: cannot write %s", o->role, path);
    return f;
}

/* Write one byte per page, so that every page is mapped now. */
static void touch(void *buf, size_t n)
{
    volatile char *b = buf;
    for (size_t off = 0; off < n; off += 4096)
        b[off] = 0;
    if (n) b[n - 1] = 0;
}

/* Pre-fault the engine memory this side will use: hold managed buffers of
 * every part of `copies` requests at once (rounded up for the message
 * header: the pool hands out the same memory for the smaller real ones),
 * touch every page, and free them into the pool, which keeps them (the
 * pipe's engine retains twice kv_buffer_size of free chunks). Fresh pages
 * would otherwise be faulted in during the first requests: by the sender's
 * copy into them, and on decode by the transport writing into them. */
static int prefault(kvp_pipe *pipe, const part *p, int copies)
{
    kvp_engine *e = kvp_pipe_engine(pipe);
    size_t n = (size_t)copies * N_PARTS;
    void **bufs = calloc(n, sizeof *bufs);
    int rc = bufs ? 0 : -1;
    for (size_t i = 0; i < n && !rc; i++) {
        size_t len = p[i % N_PARTS].nbytes + 4096;
        if (kvp_engine_alloc(e, len, &bufs[i]) != KVP_OK) {
            cli_error("cannot pre-fault %zu bytes of engine memory: %s", len, kvp_last_error());
            rc = -1;
            break;
        }
        touch(bufs[i], len);
    }
    for (size_t i = 0; bufs && i < n; i++)
        kvp_engine_free(e, bufs[i]);
    free(bufs);
    return rc;
}

static double request_bytes(const part *p)
{
    double per = 0;
    for (int k = 0; k < N_PARTS; k++)
        per += (double)p[k].nbytes;
    return per;
}

static double bytes_of(const demo_opts *o, int r)
{
    part p[N_PARTS];
    parts_of(o, tokens_of(o, r), p);
    return request_bytes(p);
}

/* Bytes of requests from..requests-1. */
static double bytes_from(const demo_opts *o, int from)
{
    double sum = 0;
    for (int r = from; r < o->requests; r++)
        sum += bytes_of(o, r);
    return sum;
}

/* The sides tell each other through files in the run directory how far
 * they are, so that nothing but the transfers runs on prefill's clock:
 * ROLE.open once its pipe is open, decode.ready once decode's memory is
 * pre-faulted. */
static void mark(const demo_opts *o, const char *what)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", o->run_dir, what);
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
}

static int wait_mark(const demo_opts *o, const char *what)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", o->run_dir, what);
    for (uint64_t until = cli_now_ms() + RECV_TIMEOUT_MS; cli_now_ms() < until;) {
        if (access(path, F_OK) == 0) return 0;
        usleep(2000);
    }
    cli_error("%s: the other side did not get to %s in %d s", o->role, what,
              RECV_TIMEOUT_MS / 1000);
    return -1;
}

/* Both pipes open: each side's ZeroMQ links reach the other's ports, those
 * that tried before the peer listened after ZeroMQ's reconnect interval
 * (100 ms): give it three. */
#define LINKS_SETTLE_MS 300

static int meet(const demo_opts *o, const char *self, const char *peer)
{
    mark(o, self);
    if (wait_mark(o, peer)) return -1;
    usleep(LINKS_SETTLE_MS * 1000);
    return 0;
}

/* Request r as vLLM's connector sends it: each part filled in our memory,
 * then kvp_pipe_send() copies it into registered memory (on the clock). */
static int send_copying(kvp_pipe *pipe, const part *p, void *const bufs[N_PARTS], int r,
                        FILE *report)
{
    for (int k = 0; k < N_PARTS; k++)
        fill_part(bufs[k], p[k].nbytes, k, seed_of(r, k));
    fprintf(report, "start %d %llu\n", r, (unsigned long long)cli_now_ns());
    for (int k = 0; k < N_PARTS; k++) {
        kvp_tensor t;
        kvp_tensor_init(&t, p[k].dtype, p[k].ndim, p[k].shape, bufs[k]);
        if (kvp_pipe_send(pipe, &t) != KVP_OK) {
            cli_error("prefill: request %d %s: %s", r, part_names[k], kvp_last_error());
            return 1;
        }
    }
    return 0;
}

/* Request r built in pipe buffers (the producer's writing: off the clock),
 * then sent as it lies. */
static int send_in_place(const demo_opts *o, kvp_pipe *pipe, const part *p, int r, FILE *report)
{
    kvp_tensor *t[N_PARTS] = {0};
    int rc = 0;
    for (int k = 0; k < N_PARTS && !rc; k++) {
        if (kvp_pipe_tensor_alloc(pipe, p[k].dtype, p[k].ndim, p[k].shape, &t[k]) != KVP_OK) {
            cli_error("%s: request %d %s: %s", o->role, r, part_names[k], kvp_last_error());
            rc = 1;
            break;
        }
        fill_part(t[k]->data, p[k].nbytes, k, seed_of(r, k));
    }
    if (!rc) fprintf(report, "start %d %llu\n", r, (unsigned long long)cli_now_ns());
    for (int k = 0; k < N_PARTS && !rc; k++) {
        if (kvp_pipe_send_take(pipe, t[k]) != KVP_OK) {
            cli_error("prefill: request %d %s: %s", r, part_names[k], kvp_last_error());
            rc = 1;
            break;
        }
        t[k] = NULL; /* the pipe's now */
    }
    for (int k = 0; k < N_PARTS; k++)
        kvp_tensor_free(t[k]);
    return rc;
}

static int run_prefill(const demo_opts *o)
{
    part p[N_PARTS]; /* of the largest request: the buffers' sizes */
    parts_of(o, tokens_most(o), p);
    kvp_pipe *pipe = open_pipe(o, 0);
    FILE *report = open_report(o);
    void *bufs[N_PARTS] = {0};
    int rc = !pipe || !report;
    for (int k = 0; k < N_PARTS && !rc && !o->in_place; k++)
        if (!(bufs[k] = malloc(p[k].nbytes ? p[k].nbytes : 1))) rc = 1;
    /* As many requests as the pipe lets be in flight, plus the one being sent. */
    kvp_pipe_opts po;
    kvp_pipe_opts_init(&po);
    int inflight = (int)((double)po.kv_buffer_size / request_bytes(p)) + 1;
    if (inflight > o->requests) inflight = o->requests;
    if (!rc && meet(o, "prefill.open", "decode.open")) rc = 1;
    if (!rc && o->prefault && prefault(pipe, p, inflight)) rc = 1;
    if (!rc && wait_mark(o, "decode.ready")) rc = 1;
    for (int r = 0; r < o->requests && !rc; r++) {
        part pr[N_PARTS];
        parts_of(o, tokens_of(o, r), pr);
        rc = o->in_place ? send_in_place(o, pipe, pr, r, report)
                         : send_copying(pipe, pr, bufs, r, report);
    }
    /* Stay until decode has read everything: closing frees the buffers. A
     * lagging decode takes its pause before each request still queued. */
    long long lag_ms = (long long)o->decode_lag_ms * o->requests;
    int flush_ms = RECV_TIMEOUT_MS + (int)(lag_ms > 1000000000 ? 1000000000 : lag_ms);
    if (!rc && kvp_pipe_flush(pipe, flush_ms) != KVP_OK) {
        cli_error("prefill: %s", kvp_last_error());
        rc = 1;
    }
    for (int k = 0; k < N_PARTS; k++)
        free(bufs[k]);
    if (report) fprintf(report, "rss 0 %ld\n", peak_rss_kib());
    if (report) fclose(report);
    kvp_pipe_close(pipe);
    return rc;
}

static void progress(int done, int total)
{
    if (!isatty(STDERR_FILENO)) return;
    int width = 40, fill = total ? done * width / total : width;
    fprintf(stderr, "\r  [%.*s%*s] %d/%d requests", fill,
            "########################################", width - fill, "", done, total);
    if (done == total) fprintf(stderr, "\n");
}

/* Receive one request's parts, check their shapes, then every byte. */
static int receive_request(kvp_pipe *pipe, const part *p, int r, uint64_t *done_ns)
{
    kvp_tensor *got[N_PARTS] = {0};
    int rc = 0;
    for (int k = 0; k < N_PARTS && !rc; k++) {
        kvp_status st = kvp_pipe_recv(pipe, RECV_TIMEOUT_MS, &got[k]);
        if (st || !got[k]) {
            cli_error("decode: request %d %s: %s", r, part_names[k],
                      st ? kvp_last_error() : "got None");
            rc = 1;
        }
    }
    *done_ns = cli_now_ns();
    for (int k = 0; k < N_PARTS && !rc; k++) {
        kvp_tensor want;
        kvp_tensor_init(&want, p[k].dtype, p[k].ndim, p[k].shape, got[k]->data);
        if (got[k]->dtype != want.dtype || got[k]->ndim != want.ndim ||
            memcmp(got[k]->shape, want.shape, sizeof want.shape) != 0 ||
            check_part(got[k]->data, got[k]->nbytes, k, seed_of(r, k)) != 0) {
            cli_error("decode: request %d %s: MISMATCH", r, part_names[k]);
            rc = 1;
        }
    }
    for (int k = 0; k < N_PARTS; k++)
        kvp_tensor_free(got[k]);
    return rc;
}

static int run_decode(const demo_opts *o)
{
    part p[N_PARTS]; /* of the largest request */
    parts_of(o, tokens_most(o), p);
    kvp_pipe *pipe = open_pipe(o, 1);
    FILE *report = open_report(o);
    int rc = !pipe || !report;
    if (!rc && meet(o, "decode.open", "prefill.open")) rc = 1;
    /* Decode holds one request's tensors at a time. */
    if (!rc && o->prefault && prefault(pipe, p, 1)) rc = 1;
    if (!rc) mark(o, "decode.ready");
    progress(0, o->requests);
    for (int r = 0; r < o->requests && !rc; r++) {
        uint64_t done;
        part pr[N_PARTS];
        parts_of(o, tokens_of(o, r), pr);
        rc = receive_request(pipe, pr, r, &done);
        fprintf(report, "done %d %llu\n", r, (unsigned long long)done);
        progress(r + 1, o->requests);
        /* A decode busy with other work: prefill runs ahead meanwhile. */
        if (!rc && o->decode_lag_ms && r + 1 < o->requests)
            usleep((useconds_t)o->decode_lag_ms * 1000);
    }
    if (!rc) {
        kvp_pipe_stats ps;
        kvp_pipe_get_stats(pipe, &ps);
        fprintf(report, "transport %s\n", launch_recv_transport(pipe, &ps));
        fprintf(report, "inline %llu %llu\n", (unsigned long long)ps.inline_received,
                (unsigned long long)ps.received);
    }
    if (report) fprintf(report, "rss 1 %ld\n", peak_rss_kib());
    if (report) fclose(report);
    kvp_pipe_close(pipe);
    return rc;
}

/* ------------------------------------------------------------- the run --- */

typedef struct results {
    uint64_t *start, *done;
    char transport[32];
    long long inline_msgs, msgs; /* of the messages decode received, those inline (-1: unknown) */
    long rss_kib[2]; /* peak RSS of prefill and decode, as each reported it (-1: unknown) */
} results;

static int read_reports(const launch_pair *l, int n, results *res)
{
    const char *names[2] = {"prefill", "decode"};
    for (int i = 0; i < 2; i++) {
        char path[256], kind[32], val[64];
        snprintf(path, sizeof path, "%s/%s.txt", l->dir, names[i]);
        FILE *f = fopen(path, "r");
        if (!f) return -1;
        int r;
        while (fscanf(f, "%31s", kind) == 1) {
            if (strcmp(kind, "transport") == 0 && fscanf(f, "%31s", res->transport) == 1) continue;
            if (fscanf(f, "%d %63s", &r, val) != 2 || r < 0) break;
            if (strcmp(kind, "inline") == 0) { /* "inline INLINE RECEIVED" */
                res->inline_msgs = r;
                res->msgs = strtoll(val, NULL, 10);
                continue;
            }
            if (strcmp(kind, "rss") == 0) { /* "rss SIDE KiB" */
                if (r < 2) res->rss_kib[r] = strtol(val, NULL, 10);
                continue;
            }
            if (r >= n) break;
            (strcmp(kind, "start") == 0 ? res->start : res->done)[r] = strtoull(val, NULL, 10);
        }
        fclose(f);
    }
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of n sorted values (n > 0). */
static double percentile(const double *v, int n, double q)
{
    int i = (int)(q * n + 0.999999) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* memcpy of the run's bytes (total), part by part, between two pre-faulted
 * buffers of the largest part (p: the largest request's); *ms is per
 * request. */
static double memcpy_gbps(const demo_opts *o, const part *p, double total, double *ms)
{
    size_t big = 1;
    for (int k = 0; k < N_PARTS; k++)
        if (p[k].nbytes > big) big = p[k].nbytes;
    char *src =
        mmap(NULL, big, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    char *dst =
        mmap(NULL, big, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    double gbps = 0;
    if (src != MAP_FAILED && dst != MAP_FAILED) {
        memset(src, 0x5a, big);
        uint64_t t0 = cli_now_ns();
        for (int r = 0; r < o->requests; r++) {
            part pr[N_PARTS];
            parts_of(o, tokens_of(o, r), pr);
            for (int k = 0; k < N_PARTS; k++)
                memcpy(dst, src, pr[k].nbytes);
        }
        double secs = (double)(cli_now_ns() - t0) / 1e9;
        gbps = secs > 0 ? total / secs / 1e9 : 0;
        *ms = secs * 1e3 / o->requests;
    }
    if (src != MAP_FAILED) munmap(src, big);
    if (dst != MAP_FAILED) munmap(dst, big);
    return gbps;
}

typedef struct summary {
    double bytes, secs, gbps, p50, p99;         /* every request */
    double first_ms;                            /* request 0 */
    double steady_p50, steady_p99, steady_gbps; /* requests 1.. (NAN with one request) */
    double memcpy_gbps, memcpy_ms;              /* --baseline */
    int max_ahead; /* most requests prefill had started beyond one decode was still receiving */
} summary;

static void compute(const demo_opts *o, const part *p, const results *res, summary *s)
{
    int n = o->requests;
    double *lat = malloc((size_t)n * sizeof *lat);
    uint64_t first = res->start[0], last = 0;
    for (int r = 0; r < n; r++) {
        lat[r] = (double)(res->done[r] - res->start[r]) / 1e6;
        if (res->done[r] > last) last = res->done[r];
    }
    s->first_ms = lat[0];
    s->bytes = bytes_from(o, 0);
    s->secs = (double)(last - first) / 1e9;
    s->gbps = s->secs > 0 ? s->bytes / s->secs / 1e9 : 0;
    s->steady_p50 = s->steady_p99 = s->steady_gbps = NAN;
    if (n > 1) {
        /* Requests 1.. finish between request 0's receipt and the last. */
        double secs = (double)(last - res->done[0]) / 1e9;
        s->steady_gbps = secs > 0 ? bytes_from(o, 1) / secs / 1e9 : 0;
        qsort(lat + 1, (size_t)n - 1, sizeof *lat, cmp_double);
        s->steady_p50 = percentile(lat + 1, n - 1, 0.5);
        s->steady_p99 = percentile(lat + 1, n - 1, 0.99);
    }
    qsort(lat, (size_t)n, sizeof *lat, cmp_double);
    s->p50 = percentile(lat, n, 0.5);
    s->p99 = percentile(lat, n, 0.99);
    free(lat);
    /* How far prefill ran ahead: for each request, the later ones whose
     * sending began before decode held all of it. */
    s->max_ahead = 0;
    for (int r = 0; r < n; r++) {
        int ahead = 0;
        for (int j = r + 1; j < n; j++)
            ahead += res->start[j] < res->done[r];
        if (ahead > s->max_ahead) s->max_ahead = ahead;
    }
    s->memcpy_gbps = s->memcpy_ms = NAN;
    if (o->baseline) s->memcpy_gbps = memcpy_gbps(o, p, s->bytes, &s->memcpy_ms);
}

/* A JSON number, or null for NAN. */
static void json_num(const char *key, double v, int last)
{
    if (isnan(v))
        printf("\"%s\": null%s", key, last ? "" : ", ");
    else
        printf("\"%s\": %.3f%s", key, v, last ? "" : ", ");
}

static void summarize(const demo_opts *o, const part *p, const results *res)
{
    summary s;
    compute(o, p, res, &s);
    int n = o->requests;
    /* How the bytes went: the engine's transport, inline on the pipe's
     * ZeroMQ link (messages up to inline_max_bytes), or both. */
    char how[128];
    if (res->msgs > 0 && res->inline_msgs == res->msgs)
        snprintf(how, sizeof how, ", all %lld messages inline on the pipe's ZeroMQ link",
                 res->msgs);
    else if (res->inline_msgs > 0)
        snprintf(how, sizeof how, " over %s, %lld of %lld messages inline", res->transport,
                 res->inline_msgs, res->msgs);
    else
        snprintf(how, sizeof how, " over %s", res->transport);
    printf("moved %.2f GB in %.3f s%s: %.2f GB/s; every byte verified\n", s.bytes / 1e9, s.secs,
           how, s.gbps);
    printf("  first request %.1f ms (%s%s)\n", s.first_ms, o->in_place ? "in-place send; " : "",
           o->prefault ? "connections and lookups; memory pre-faulted"
                       : "page faults of fresh memory, connections and lookups");
    if (n > 1)
        printf("  steady state, requests 2..%d: p50 %.1f ms, p99 %.1f ms per request, %.2f GB/s\n",
               n, s.steady_p50, s.steady_p99, s.steady_gbps);
    if (o->baseline)
        printf("  memcpy of the same bytes (one thread, pre-faulted): %.1f ms per request, "
               "%.2f GB/s\n",
               s.memcpy_ms, s.memcpy_gbps);
    double rss[2];
    for (int i = 0; i < 2; i++)
        rss[i] = res->rss_kib[i] >= 0 ? res->rss_kib[i] / 1024.0 : NAN;
    printf("  peak RSS: prefill %.1f MiB, decode %.1f MiB; prefill ran up to %d request%s ahead\n",
           rss[0], rss[1], s.max_ahead, s.max_ahead == 1 ? "" : "s");
    if (!o->json) return;
    printf("{\"gbps\": %.4f, \"bytes\": %.0f, \"requests\": %d, ", s.gbps, s.bytes, n);
    if (o->tokens_min)
        printf("\"tokens\": null, \"tokens_min\": %d, \"tokens_max\": %d, \"seed\": %llu, ",
               o->tokens_min, o->tokens_max, o->seed);
    else
        printf("\"tokens\": %d, \"tokens_min\": %d, \"tokens_max\": %d, ", o->tokens, o->tokens,
               o->tokens);
    printf("\"decode_lag_ms\": %d, ", o->decode_lag_ms);
    json_num("prefill_rss_mib", rss[0], 0);
    json_num("decode_rss_mib", rss[1], 0);
    printf("\"max_ahead\": %d, ", s.max_ahead);
    kvp_pipe_opts po;
    kvp_pipe_opts_init(&po);
    printf("\"largest_request_bytes\": %.0f, \"kv_buffer_size\": %zu, ", request_bytes(p),
           po.kv_buffer_size);
    json_num("p50_ms", s.p50, 0);
    json_num("p99_ms", s.p99, 0);
    json_num("first_ms", s.first_ms, 0);
    json_num("steady_p50_ms", s.steady_p50, 0);
    json_num("steady_p99_ms", s.steady_p99, 0);
    json_num("steady_gbps", s.steady_gbps, 0);
    json_num("memcpy_gbps", s.memcpy_gbps, 0);
    json_num("memcpy_ms", s.memcpy_ms, 0);
    printf("\"prefault\": %s, \"send\": \"%s\", \"seconds\": %.3f, \"transport\": \"%s\", "
           "\"messages\": %lld, \"inline_messages\": %lld, \"errors\": 0}\n",
           o->prefault ? "true" : "false", o->in_place ? "in-place" : "copy", s.secs,
           res->transport, res->msgs, res->inline_msgs);
}

static void describe(const demo_opts *o, const part *p, const launch_pair *l)
{
    char tokens[96];
    if (o->tokens_min)
        snprintf(tokens, sizeof tokens, "%d..%d tokens (log-uniform, seed %llu)", o->tokens_min,
                 o->tokens_max, o->seed);
    else
        snprintf(tokens, sizeof tokens, "%d tokens", o->tokens);
    printf("kvpipe demo: %d requests x %s; model shape %d layers, %d KV heads, head dim "
           "%d, hidden %d, %s\n",
           o->requests, tokens, o->layers, o->kv_heads, o->head_dim, o->hidden,
           kvp_dtype_name(o->dtype));
    if (o->tokens_min)
        printf("  largest request, %d tokens: keys %.1f MiB, values %.1f MiB, hidden %.1f MiB, "
               "tokens+roi %.1f KiB (%.1f MiB); %.2f GB in all\n",
               tokens_most(o), p[2].nbytes / 1048576.0, p[3].nbytes / 1048576.0,
               p[4].nbytes / 1048576.0, (p[0].nbytes + p[1].nbytes) / 1024.0,
               request_bytes(p) / 1048576.0, bytes_from(o, 0) / 1e9);
    else
        printf("  per request: keys %.1f MiB, values %.1f MiB, hidden %.1f MiB, tokens+roi %.1f "
               "KiB (%.1f MiB)\n",
               p[2].nbytes / 1048576.0, p[3].nbytes / 1048576.0, p[4].nbytes / 1048576.0,
               (p[0].nbytes + p[1].nbytes) / 1024.0, request_bytes(p) / 1048576.0);
    if (o->decode_lag_ms)
        printf("  decode pauses %d ms between requests (prefill runs ahead)\n", o->decode_lag_ms);
    printf("  prefill 127.0.0.1:%d, decode 127.0.0.1:%d, metadata %s, protocol %s%s\n",
           l->base_port, l->base_port + 100, l->metadata, o->protocol,
           o->no_shm ? " (no shm)" : "");
    fflush(stdout);
}

static int run_both(int argc, char **argv, const demo_opts *o)
{
    part p[N_PARTS]; /* of the largest request */
    if (parts_of(o, tokens_most(o), p) != 0) {
        cli_error("the model shape is too large");
        return 2;
    }
    launch_pair l;
    if (launch_prepare(&l, o->metadata, o->protocol, o->port) != 0) {
        launch_cleanup(&l);
        return 1;
    }
    describe(o, p, &l);
    const char *roles[2] = {"decode", "prefill"};
    const char *sides[2][LAUNCH_SIDE_ARGS] = {{"--role", roles[0], "--run-dir", l.dir},
                                              {"--role", roles[1], "--run-dir", l.dir}};
    double total = bytes_from(o, 0);
    double extra = total / 20e6 * 1000 + (double)o->decode_lag_ms * o->requests;
    int limit_ms = 120000 + (int)(extra > 1e9 ? 1e9 : extra);
    int rc = launch_run(&l, "demo", argc, argv, roles, sides, limit_ms);
    results res = {
        calloc((size_t)o->requests, 8), calloc((size_t)o->requests, 8), "?", -1, -1, {-1, -1}};
    if (rc == 0 && read_reports(&l, o->requests, &res) == 0)
        summarize(o, p, &res);
    else if (rc == 0)
        rc = 1;
    free(res.start);
    free(res.done);
    launch_cleanup(&l);
    if (rc) cli_error("FAILED");
    return rc;
}

int cmd_demo(int argc, char **argv)
{
    demo_opts o;
    int r = parse_args(argc, argv, &o);
    if (r) return r - 1;
    if (!o.role) return run_both(argc, argv, &o);
    launch_child_init();
    if (!o.run_dir) {
        cli_error("--role needs --run-dir");
        return 2;
    }
    return strcmp(o.role, "prefill") == 0 ? run_prefill(&o) : run_decode(&o);
}
