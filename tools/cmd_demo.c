/* kvpipe demo: disaggregated prefill and decode on this host. A prefill process
 * sends the KV cache of N requests through the pipe as vLLM's v0 connector
 * does (per request: input tokens, roi, keys, values, hidden states); a decode
 * process receives them and checks every byte. See docs/demo.md. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "kvpipe/kvpipe.h"
#include "kvpipe/pipe.h"
#include "pattern.h"
#include "pipe_launch.h"

#define N_PARTS 5
#define VOCAB 128256 /* Llama-3's vocabulary */
#define RECV_TIMEOUT_MS 60000

typedef struct demo_opts {
    int tokens, requests, layers, kv_heads, head_dim, hidden;
    kvp_dtype dtype;
    const char *protocol, *metadata;
    int no_shm, json, port;
    const char *role, *run_dir; /* set for the two child processes */
} demo_opts;

static const char *part_names[N_PARTS] = {"input_tokens", "roi", "keys", "values", "hidden"};

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpipe demo [options]\n"
                 "\n"
                 "Run a prefill and a decode process on this host and move the KV cache of\n"
                 "--requests requests through the tensor pipe, as vLLM's v0 connector sends it\n"
                 "(per request: input tokens, roi, keys [layers, tokens, kv-heads, head-dim],\n"
                 "values, hidden states [tokens, hidden-size]). Decode checks every byte. Prints\n"
                 "per-request latency (p50/p99, first send to last receipt) and GB/s.\n"
                 "\n"
                 "  --tokens T         tokens per request (default 1024)\n"
                 "  --requests N       requests (default 8)\n"
                 "  --layers L         layers (default 32: Llama-3-8B)\n"
                 "  --kv-heads H       KV heads (default 8)\n"
                 "  --head-dim D       head dimension (default 128)\n"
                 "  --hidden-size S    hidden size (default 4096)\n"
                 "  --dtype T          bf16 (default), f16, f32, f8_e4m3, ...\n"
                 "  --protocol P       engine protocol in the config (default tcp)\n"
                 "  --no-shm           never use the same-host transport\n"
                 "  --metadata M       http (embedded store, default), p2p (P2PHANDSHAKE), or a\n"
                 "                     connection string such as etcd://127.0.0.1:2379\n"
                 "  --port P           base port of prefill_url/decode_url (default: a free one)\n"
                 "  --json             last stdout line: a JSON object with the results\n"
                 "  --help             show this text\n");
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

static int parse_dtype(const char *s, kvp_dtype *out)
{
    char up[32];
    size_t i = 0;
    for (; s[i] && i + 1 < sizeof up; i++)
        up[i] = (char)(s[i] >= 'a' && s[i] <= 'z' ? s[i] - 32 : s[i]);
    up[i] = '\0';
    return kvp_dtype_from_name(up, out) == KVP_OK ? 0 : -1;
}

static int parse_opt(void *opts, int c, const char *arg)
{
    demo_opts *o = opts;
    switch (c) {
    case 't':
        return parse_int(arg, 1, 1 << 20, &o->tokens);
    case 'r':
        return parse_int(arg, 1, 1 << 20, &o->requests);
    case 'L':
        return parse_int(arg, 1, 4096, &o->layers);
    case 'H':
        return parse_int(arg, 1, 4096, &o->kv_heads);
    case 'D':
        return parse_int(arg, 1, 65536, &o->head_dim);
    case 'S':
        return parse_int(arg, 0, 1 << 20, &o->hidden);
    case 'd':
        return parse_dtype(arg, &o->dtype);
    case 'p':
        o->protocol = arg;
        return 0;
    case 'm':
        o->metadata = arg;
        return 0;
    case 'P':
        return parse_int(arg, 1, 65000, &o->port);
    case 'n':
        o->no_shm = 1;
        return 0;
    case 'j':
        o->json = 1;
        return 0;
    case 'R':
        o->role = arg;
        return 0;
    case 'X':
        o->run_dir = arg;
        return 0;
    default:
        return -1;
    }
}

/* 0 to go on, otherwise 1 + the exit code. */
static int parse_args(int argc, char **argv, demo_opts *o)
{
    static const struct option opts[] = {
        {"tokens", required_argument, 0, 't'},   {"requests", required_argument, 0, 'r'},
        {"layers", required_argument, 0, 'L'},   {"kv-heads", required_argument, 0, 'H'},
        {"head-dim", required_argument, 0, 'D'}, {"hidden-size", required_argument, 0, 'S'},
        {"dtype", required_argument, 0, 'd'},    {"protocol", required_argument, 0, 'p'},
        {"metadata", required_argument, 0, 'm'}, {"port", required_argument, 0, 'P'},
        {"no-shm", no_argument, 0, 'n'},         {"json", no_argument, 0, 'j'},
        {"role", required_argument, 0, 'R'},     {"run-dir", required_argument, 0, 'X'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0},
    };
    *o = (demo_opts){.tokens = 1024,
                     .requests = 8,
                     .layers = 32,
                     .kv_heads = 8,
                     .head_dim = 128,
                     .hidden = 4096,
                     .dtype = KVP_DTYPE_BF16,
                     .protocol = "tcp",
                     .metadata = "http"};
    int r = kvp_cli_getopt(argc, argv, opts, "kvpipe demo", usage, parse_opt, o);
    if (r) return r;
    if (optind < argc) {
        fprintf(stderr, "kvpipe demo: unexpected argument '%s'\n", argv[optind]);
        return 3;
    }
    return 0;
}

/* --------------------------------------------------------- the tensors --- */

typedef struct part {
    kvp_dtype dtype;
    int ndim;
    int64_t shape[4];
    size_t nbytes;
} part;

static int parts_of(const demo_opts *o, part p[N_PARTS])
{
    int64_t T = o->tokens;
    p[0] = (part){KVP_DTYPE_I64, 1, {T}, 0};
    p[1] = (part){KVP_DTYPE_BOOL, 1, {T}, 0};
    p[2] = (part){o->dtype, 4, {o->layers, T, o->kv_heads, o->head_dim}, 0};
    p[3] = p[2];
    p[4] = (part){o->dtype, 2, {T, o->hidden}, 0};
    for (int k = 0; k < N_PARTS; k++)
        if (kvp_tensor_size(p[k].dtype, p[k].ndim, p[k].shape, NULL, &p[k].nbytes)) return -1;
    return 0;
}

static uint64_t seed_of(int request, int k)
{
    return KVP_PATTERN_WRITE ^ ((uint64_t)request << 8) ^ (uint64_t)k;
}

/* The content of part k of a request: token ids, an all-true roi, or the
 * pattern (words, then the tail bytes of one more word). */
static void fill_part(void *buf, size_t n, int k, uint64_t seed)
{
    uint8_t *b = buf;
    if (k == 0) {
        for (size_t i = 0; i < n / 8; i++) {
            int64_t id = (int64_t)(kvp_pattern_word(seed, i) % VOCAB);
            memcpy(b + 8 * i, &id, 8);
        }
    } else if (k == 1) {
        memset(b, 1, n);
    } else {
        size_t whole = n / 8 * 8;
        kvp_pattern_fill(b, whole, seed, 0);
        uint64_t w = kvp_pattern_word(seed, whole);
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
            if (id != (int64_t)(kvp_pattern_word(seed, i) % VOCAB)) return -1;
        }
        return 0;
    }
    if (k == 1) {
        for (size_t i = 0; i < n; i++)
            if (b[i] != 1) return -1;
        return 0;
    }
    size_t whole = n / 8 * 8;
    if (kvp_pattern_check(b, whole, seed, 0) != 0) return -1;
    uint64_t w = kvp_pattern_word(seed, whole);
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
        st = kvp_pipe_open(cfg, 0, kv_rank, &po, &pipe);
    }
    kvp_pipe_config_free(cfg);
    if (st) fprintf(stderr, "kvpipe demo (%s): %s\n", o->role, kvp_last_error());
    return pipe;
}

static FILE *open_report(const demo_opts *o)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s.txt", o->run_dir, o->role);
    FILE *f = fopen(path, "w");
    if (!f) fprintf(stderr, "kvpipe demo (%s): cannot write %s\n", o->role, path);
    return f;
}

static int run_prefill(const demo_opts *o)
{
    part p[N_PARTS];
    parts_of(o, p);
    kvp_pipe *pipe = open_pipe(o, 0);
    FILE *report = open_report(o);
    void *bufs[N_PARTS] = {0};
    int rc = !pipe || !report;
    for (int k = 0; k < N_PARTS && !rc; k++)
        if (!(bufs[k] = malloc(p[k].nbytes ? p[k].nbytes : 1))) rc = 1;
    for (int r = 0; r < o->requests && !rc; r++) {
        for (int k = 0; k < N_PARTS; k++)
            fill_part(bufs[k], p[k].nbytes, k, seed_of(r, k));
        fprintf(report, "start %d %llu\n", r, (unsigned long long)kvp_cli_now_ns());
        for (int k = 0; k < N_PARTS && !rc; k++) {
            kvp_tensor t;
            kvp_tensor_init(&t, p[k].dtype, p[k].ndim, p[k].shape, bufs[k]);
            if (kvp_pipe_send(pipe, &t) != KVP_OK) {
                fprintf(stderr, "kvpipe demo (prefill): request %d %s: %s\n", r, part_names[k],
                        kvp_last_error());
                rc = 1;
            }
        }
    }
    /* Stay until decode has read everything: closing frees the buffers. */
    if (!rc && kvp_pipe_flush(pipe, RECV_TIMEOUT_MS) != KVP_OK) {
        fprintf(stderr, "kvpipe demo (prefill): %s\n", kvp_last_error());
        rc = 1;
    }
    for (int k = 0; k < N_PARTS; k++)
        free(bufs[k]);
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
            fprintf(stderr, "kvpipe demo (decode): request %d %s: %s\n", r, part_names[k],
                    st ? kvp_last_error() : "got None");
            rc = 1;
        }
    }
    *done_ns = kvp_cli_now_ns();
    for (int k = 0; k < N_PARTS && !rc; k++) {
        kvp_tensor want;
        kvp_tensor_init(&want, p[k].dtype, p[k].ndim, p[k].shape, got[k]->data);
        if (got[k]->dtype != want.dtype || got[k]->ndim != want.ndim ||
            memcmp(got[k]->shape, want.shape, sizeof want.shape) != 0 ||
            check_part(got[k]->data, got[k]->nbytes, k, seed_of(r, k)) != 0) {
            fprintf(stderr, "kvpipe demo (decode): request %d %s: MISMATCH\n", r, part_names[k]);
            rc = 1;
        }
    }
    for (int k = 0; k < N_PARTS; k++)
        kvp_tensor_free(got[k]);
    return rc;
}

static int run_decode(const demo_opts *o)
{
    part p[N_PARTS];
    parts_of(o, p);
    kvp_pipe *pipe = open_pipe(o, 1);
    FILE *report = open_report(o);
    int rc = !pipe || !report;
    progress(0, o->requests);
    for (int r = 0; r < o->requests && !rc; r++) {
        uint64_t done;
        rc = receive_request(pipe, p, r, &done);
        fprintf(report, "done %d %llu\n", r, (unsigned long long)done);
        progress(r + 1, o->requests);
    }
    if (!rc) {
        kvp_segment_id seg;
        kvp_engine *e = kvp_pipe_engine(pipe);
        const char *tr = NULL;
        if (kvp_engine_open_segment(e, kvp_pipe_get_endpoints(pipe)->peer_segment, &seg) == 0)
            tr = kvp_engine_segment_transport(e, seg);
        fprintf(report, "transport %s\n", tr ? tr : "?");
    }
    if (report) fclose(report);
    kvp_pipe_close(pipe);
    return rc;
}

/* ------------------------------------------------------------- the run --- */

typedef struct results {
    uint64_t *start, *done;
    char transport[32];
} results;

static int read_reports(const kvp_launch *l, int n, results *res)
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
            if (fscanf(f, "%d %63s", &r, val) != 2 || r < 0 || r >= n) break;
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

/* Nearest-rank percentile of sorted values. */
static double percentile(const double *v, int n, double q)
{
    int i = (int)(q * n + 0.999999) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

static void summarize(const demo_opts *o, const part *p, const results *res)
{
    int n = o->requests;
    double *lat = malloc((size_t)n * sizeof *lat);
    uint64_t first = res->start[0], last = 0;
    for (int r = 0; r < n; r++) {
        lat[r] = (double)(res->done[r] - res->start[r]) / 1e6;
        if (res->done[r] > last) last = res->done[r];
    }
    qsort(lat, (size_t)n, sizeof *lat, cmp_double);
    double per = 0;
    for (int k = 0; k < N_PARTS; k++)
        per += (double)p[k].nbytes;
    double bytes = per * n, secs = (double)(last - first) / 1e9;
    double gbps = secs > 0 ? bytes / secs / 1e9 : 0;
    printf("moved %.2f GB in %.3f s over %s: %.2f GB/s; per-request latency p50 %.1f ms, "
           "p99 %.1f ms; every byte verified\n",
           bytes / 1e9, secs, res->transport, gbps, percentile(lat, n, 0.5),
           percentile(lat, n, 0.99));
    if (o->json)
        printf("{\"gbps\": %.4f, \"bytes\": %.0f, \"requests\": %d, \"tokens\": %d, "
               "\"p50_ms\": %.3f, \"p99_ms\": %.3f, \"seconds\": %.3f, \"transport\": \"%s\", "
               "\"errors\": 0}\n",
               gbps, bytes, n, o->tokens, percentile(lat, n, 0.5), percentile(lat, n, 0.99), secs,
               res->transport);
    free(lat);
}

static void describe(const demo_opts *o, const part *p, const kvp_launch *l)
{
    double per = 0;
    for (int k = 0; k < N_PARTS; k++)
        per += (double)p[k].nbytes;
    printf("kvpipe demo: %d requests x %d tokens; model shape %d layers, %d KV heads, head dim "
           "%d, hidden %d, %s\n",
           o->requests, o->tokens, o->layers, o->kv_heads, o->head_dim, o->hidden,
           kvp_dtype_name(o->dtype));
    printf("  per request: keys %.1f MiB, values %.1f MiB, hidden %.1f MiB, tokens+roi %.1f KiB "
           "(%.1f MiB)\n",
           p[2].nbytes / 1048576.0, p[3].nbytes / 1048576.0, p[4].nbytes / 1048576.0,
           (p[0].nbytes + p[1].nbytes) / 1024.0, per / 1048576.0);
    printf("  prefill 127.0.0.1:%d, decode 127.0.0.1:%d, metadata %s, protocol %s%s\n",
           l->base_port, l->base_port + 100, l->metadata, o->protocol,
           o->no_shm ? " (no shm)" : "");
    fflush(stdout);
}

static int run_both(int argc, char **argv, const demo_opts *o)
{
    part p[N_PARTS];
    if (parts_of(o, p) != 0) {
        fprintf(stderr, "kvpipe demo: the model shape is too large\n");
        return 2;
    }
    kvp_launch l;
    if (kvp_launch_prepare(&l, o->metadata, o->protocol, o->port) != 0) {
        kvp_launch_cleanup(&l);
        return 1;
    }
    describe(o, p, &l);
    char **args = calloc((size_t)argc + 6, sizeof *args);
    const char *roles[2] = {"decode", "prefill"};
    pid_t pids[2];
    for (int i = 0; i < 2; i++) {
        int n = 0;
        args[n++] = "kvpipe";
        args[n++] = "demo";
        for (int a = 1; a < argc; a++)
            args[n++] = argv[a];
        args[n++] = "--role";
        args[n++] = (char *)roles[i];
        args[n++] = "--run-dir";
        args[n++] = l.dir;
        args[n] = NULL;
        pids[i] = kvp_launch_spawn(&l, args);
    }
    free(args);
    double total = 0;
    for (int k = 0; k < N_PARTS; k++)
        total += (double)p[k].nbytes * o->requests;
    int limit_ms = 120000 + (int)(total / 20e6 * 1000 > 1e9 ? 1e9 : total / 20e6 * 1000);
    int rc = kvp_launch_wait(pids, roles, 2, limit_ms);
    results res = {calloc((size_t)o->requests, 8), calloc((size_t)o->requests, 8), "?"};
    if (rc == 0 && read_reports(&l, o->requests, &res) == 0)
        summarize(o, p, &res);
    else if (rc == 0)
        rc = 1;
    free(res.start);
    free(res.done);
    kvp_launch_cleanup(&l);
    if (rc) fprintf(stderr, "kvpipe demo: FAILED\n");
    return rc;
}

int kvp_cmd_demo(int argc, char **argv)
{
    demo_opts o;
    int r = parse_args(argc, argv, &o);
    if (r) return r - 1;
    if (!o.role) return run_both(argc, argv, &o);
    kvp_launch_child_init();
    if (!o.run_dir) {
        fprintf(stderr, "kvpipe demo: --role needs --run-dir\n");
        return 2;
    }
    if (strcmp(o.role, "prefill") == 0) return run_prefill(&o);
    if (strcmp(o.role, "decode") == 0) return run_decode(&o);
    fprintf(stderr, "kvpipe demo: --role must be prefill or decode\n");
    return 2;
}
