/* Pipe sides in child processes and the pipe suites' rows (peer.h). */
#include "peer.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "transport/transport.h"

static const kvpt_pipe_row rows[] = {{"", "tcp", NULL},
                                     {"shm/", "shm", NULL},
                                     {"ucx_tcp/", "rdma", "tcp"},
                                     {"ucx_sm/", "rdma", "sm,self"}};
#define N_ROWS (sizeof rows / sizeof rows[0])
const kvpt_pipe_row *kvpt_row = &rows[0];

const char *kvpt_row_transport(void)
{
    return kvpi_transport_lookup(kvpt_row->protocol)->name;
}

int kvpt_pipe_setup_make(kvpt_pipe_setup *s, int p2p)
{
    char meta[128];
    if (p2p) {
        snprintf(meta, sizeof meta, "P2PHANDSHAKE");
    } else if (kvpt_http_store_start(meta, sizeof meta) < 0) {
        return -1; /* the case's process group takes the store with it */
    }
    /* After the store listens, so that the block cannot include its port. */
    s->base = kvpt_pipe_ports();
    if (s->base < 0) return -1;
    snprintf(s->json, sizeof s->json,
             "{\"prefill_url\":\"127.0.0.1:%d\",\"decode_url\":\"127.0.0.1:%d\","
             "\"metadata_server\":\"%s\",\"protocol\":\"%s\"}",
             s->base, s->base, meta, kvpt_row->protocol);
    return 0;
}

kvp_pipe_opts kvpt_pipe_tcp_opts(void)
{
    kvp_pipe_opts o;
    kvp_pipe_opts_init(&o);
    o.disable_shm = 1;
    o.send_timeout_ms = 20000;
    return o;
}

kvp_status kvpt_pipe_open(const char *json, int rank, const kvp_pipe_opts *o, kvp_pipe **out)
{
    kvp_pipe_config *cfg;
    kvp_status st = kvp_pipe_config_parse(json, strlen(json), &cfg);
    if (st) return st;
    st = kvp_pipe_open(cfg, 0, rank, o, out);
    kvp_pipe_config_free(cfg);
    return st;
}

kvp_pipe *kvpt_pipe_alone(kvpt_pipe_setup *s, kvp_pipe_opts *o)
{
    kvpt_pipe_setup own_s;
    kvp_pipe_opts own_o;
    if (!s) s = &own_s;
    if (!o) o = &own_o;
    kvp_pipe *pipe = NULL;
    if (kvpt_pipe_setup_make(s, 1) != 0) return NULL;
    *o = kvpt_pipe_tcp_opts();
    o->send_timeout_ms = 300;
    if (kvpt_pipe_open(s->json, 0, o, &pipe) != KVP_OK)
        fprintf(stderr, "  open: %s\n", kvp_last_error());
    return pipe;
}

typedef struct side_ctx {
    const char *json;
    int rank;
    const kvp_pipe_opts *o;
    kvpt_side_fn fn;
    void *arg;
} side_ctx;

static void side_body(void *arg, int cmd, int resp)
{
    side_ctx *c = arg;
    (void)cmd, (void)resp;
    kvp_pipe *pipe;
    kvp_status st = kvpt_pipe_open(c->json, c->rank, c->o, &pipe);
    if (st) {
        fprintf(stderr, "  rank %d: open: %s: %s\n", c->rank, kvp_strerror(st), kvp_last_error());
        _exit(2);
    }
    c->fn(pipe, c->arg);
    kvp_pipe_close(pipe);
}

pid_t kvpt_side_spawn(const char *json, int rank, const kvp_pipe_opts *o, kvpt_side_fn fn,
                      void *arg, const char *capture)
{
    side_ctx c = {json, rank, o, fn, arg};
    kvpt_peer p;
    if (kvpt_peer_fork(&p, capture, side_body, &c) != 0) return -1;
    close(p.cmd);
    close(p.resp);
    return p.pid;
}

void kvpt_sides_wait(pid_t a, pid_t b, int timeout_ms)
{
    int ra = kvpt_wait_child(a, timeout_ms), rb = kvpt_wait_child(b, timeout_ms);
    if (ra || rb) fprintf(stderr, "  prefill exit %d, decode exit %d\n", ra, rb);
    CHECK(ra == 0);
    CHECK(rb == 0);
}

/* A row suite's side: fn, then the final flush unless fn said its peer is
 * gone. */
typedef struct row_side_ctx {
    kvpt_row_side_fn fn;
    int rank;
    int same_host; /* then check that the receiver READ over it */
} row_side_ctx;

static void row_side(kvp_pipe *pipe, void *arg)
{
    const row_side_ctx *c = arg;
    int rank = c->rank;
    int gone = c->fn(pipe, rank);
    if (c->same_host) kvpt_pipe_expect_same_host(pipe, rank);
    if (!gone) {
        kvp_status st = kvp_pipe_flush(pipe, 30000);
        if (st) fprintf(stderr, "  rank %d: flush: %s\n", rank, kvp_last_error());
        CHECK_OK(st);
    }
}

static pid_t spawn_row_side(const kvpt_pipe_setup *s, int rank, const kvp_pipe_opts *o,
                            kvpt_row_side_fn fn, int same_host)
{
    row_side_ctx c = {fn, rank, same_host};
    return kvpt_side_spawn(s->json, rank, o, row_side, &c, NULL);
}

pid_t kvpt_pipe_spawn(const kvpt_pipe_setup *s, int rank, const kvp_pipe_opts *o,
                      kvpt_row_side_fn fn)
{
    return spawn_row_side(s, rank, o, fn, 0);
}

void kvpt_pipe_run_pair(const kvpt_pipe_setup *s, const kvp_pipe_opts *o0, const kvp_pipe_opts *o1,
                        kvpt_row_side_fn fn0, kvpt_row_side_fn fn1)
{
    pid_t a = kvpt_pipe_spawn(s, 0, o0, fn0);
    pid_t b = kvpt_pipe_spawn(s, 1, o1, fn1);
    kvpt_sides_wait(a, b, KVPT_SIDE_TIMEOUT);
}

void kvpt_pipe_run(int p2p, kvpt_row_side_fn fn0, kvpt_row_side_fn fn1)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, p2p) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    kvpt_pipe_run_pair(&s, &o, &o, fn0, fn1);
}

void kvpt_pipe_run_same_host(kvpt_row_side_fn fn, size_t kv_buffer_size)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 0) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.disable_shm = 0;
    if (kv_buffer_size) o.kv_buffer_size = kv_buffer_size;
    pid_t a = spawn_row_side(&s, 0, &o, fn, 1), b = spawn_row_side(&s, 1, &o, fn, 1);
    kvpt_sides_wait(a, b, KVPT_SIDE_TIMEOUT);
}

kvp_tensor *kvpt_pipe_recv(kvp_pipe *pipe, int timeout_ms)
{
    kvp_tensor *t = NULL;
    kvp_status st = kvp_pipe_recv(pipe, timeout_ms, &t);
    if (st) fprintf(stderr, "  recv: %s: %s\n", kvp_strerror(st), kvp_last_error());
    CHECK_OK(st);
    return t;
}

void kvpt_pipe_expect(kvp_pipe *pipe, const kvp_tensor *want)
{
    kvp_tensor *t = NULL;
    kvp_status st = kvp_pipe_recv(pipe, KVPT_RECV_TIMEOUT, &t);
    if (st) fprintf(stderr, "  recv: %s: %s\n", kvp_strerror(st), kvp_last_error());
    CHECK_OK(st);
    if (!want) {
        CHECK(st == KVP_OK && t == NULL);
    } else {
        CHECK(t != NULL && kvp_tensor_equal(t, want));
    }
    kvp_tensor_free(t);
}

const char *kvpt_pipe_peer_transport(kvp_pipe *pipe)
{
    kvp_segment_id seg;
    kvp_engine *e = kvp_pipe_engine(pipe);
    if (kvp_engine_open_segment(e, kvp_pipe_get_endpoints(pipe)->peer_segment, &seg)) return "";
    const char *name = kvp_engine_segment_transport(e, seg);
    return name ? name : "";
}

void kvpt_pipe_expect_same_host(kvp_pipe *pipe, int rank)
{
    if (rank == 0) {
        kvpt_pipe_expect(pipe, NULL);
        return;
    }
    const char *want = kvpi_transport_lookup("shm") ? "shm" : "tcp";
    const char *got = kvpt_pipe_peer_transport(pipe);
    if (strcmp(got, want) != 0)
        fprintf(stderr, "  the receiver READ over '%s' (%s), not %s\n", got,
                *got ? "its transport" : kvp_last_error(), want);
    CHECK(strcmp(got, want) == 0);
    CHECK_OK(kvp_pipe_send(pipe, NULL));
}

static int64_t x_val[1] = {1};
static float y_val[4] = {2, 3, 4, 8};

kvp_tensor kvpt_u8_tensor(void *data, size_t len)
{
    int64_t n = (int64_t)len;
    kvp_tensor t;
    kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, data);
    return t;
}

void kvpt_pipe_xy(kvp_tensor *x, kvp_tensor *y)
{
    int64_t sx[1] = {1}, sy[2] = {1, 4};
    kvp_tensor_init(x, KVP_DTYPE_I64, 1, sx, x_val);
    kvp_tensor_init(y, KVP_DTYPE_F32, 2, sy, y_val);
}

/* ------------------------------------------------------------ the rows --- */

static const char *only;
static char key_file[64];
static int authenticated;

static int make_key(void)
{
    kvpt_key_file(key_file, sizeof key_file, "pipe-test-0123456789abcdef0123456789abcdef\n", 0600);
    return access(key_file, R_OK);
}

static void skip_unbuilt(void)
{
    SKIP("protocol %s: %s", kvpt_row->protocol, kvpi_transport_missing(kvpt_row->protocol));
}

static void run_case(const kvpt_pipe_case *c)
{
    char full[128];
    snprintf(full, sizeof full, "%s%s%s", kvpt_row->prefix, c->name, authenticated ? "_auth" : "");
    if (only && (only[0] == '=' ? strcmp(full, only + 1) != 0 : !strstr(full, only))) return;
    kvpt_run(full, kvpi_transport_lookup(kvpt_row->protocol) ? c->fn : skip_unbuilt,
             authenticated ? 2 * c->secs : c->secs);
}

static void use_row(size_t r)
{
    kvpt_row = &rows[r];
    if (kvpt_row->ucx_tls)
        setenv("UCX_TLS", kvpt_row->ucx_tls, 1); /* the sides inherit it */
    else
        unsetenv("UCX_TLS");
}

int kvpt_pipe_main(int argc, char **argv, const kvpt_pipe_case *cases, size_t n)
{
    only = argc > 1 ? argv[1] : NULL;
    signal(SIGPIPE, SIG_IGN);
    unsetenv("KVPIPE_AUTH_KEY_FILE"); /* the plain rows are plain */
    if (make_key() != 0) return 1;
    for (size_t r = 0; r < N_ROWS; r++) {
        use_row(r);
        for (size_t i = 0; i < n; i++) {
            unsigned f = cases[i].flags;
            if ((f & KVPT_ROW_TCP_ONLY) && r != 0) continue;
            if ((f & KVPT_ROWS_UCX_ONLY) && !kvpt_row->ucx_tls) continue;
            run_case(&cases[i]);
        }
    }
    setenv("KVPIPE_AUTH_KEY_FILE", key_file, 1);
    authenticated = 1;
    for (size_t r = 0; r < N_ROWS; r++) {
        use_row(r);
        if (r != 0 && !kvpt_row->ucx_tls) continue; /* not the shm row */
        for (size_t i = 0; i < n; i++) {
            unsigned f = cases[i].flags;
            if ((f & KVPT_AUTH) || ((f & KVPT_AUTH_TCP) && r == 0)) run_case(&cases[i]);
        }
    }
    unlink(key_file);
    return kvpt_summary();
}
