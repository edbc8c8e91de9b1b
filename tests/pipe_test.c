/* The tensor pipe across two processes on loopback, on every row
 * (support/peer.h): vLLM's pipe test, every dtype, both directions at
 * once, flow control, a 1 GiB tensor, the sender's pool growing, both
 * metadata modes, the same-host transport, and the CLI's pipe journeys.
 * Dead and misbehaving peers are in pipe_peer_test.c, sending without a copy
 * in pipe_inplace_test.c. */
#include <math.h>
#include <pthread.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "peer.h"
#include "test.h"
#include "transport/transport.h"

#define NONE_INT (-150886311LL)

/* ------------------------------------------------ vLLM's pipe test cases --- */

/* vLLM's simple case: rank 0 sends x and y and takes them back, rank 1
 * echoes them. With check_transport, the transport to the peer must be the
 * row's. It is asked while the peer is sure to run (it still waits for a
 * message from this side): tensors this small go inline, so no READ may
 * have connected the transport before, and a peer that has exited cannot be
 * connected to. */
static int simple(kvp_pipe *pipe, int rank, int check_transport)
{
    kvp_tensor x, y;
    kvpt_pipe_xy(&x, &y);
    for (int step = 0; step < 2; step++) {
        if (step == rank) {
            CHECK_OK(kvp_pipe_send(pipe, &x));
            CHECK_OK(kvp_pipe_send(pipe, &y));
        } else {
            kvpt_pipe_expect(pipe, &x);
            kvpt_pipe_expect(pipe, &y);
        }
        if (step == 0 && check_transport)
            CHECK(strcmp(kvpt_pipe_peer_transport(pipe), kvpt_row_transport()) == 0);
    }
    return 0;
}

static int simple_side(kvp_pipe *pipe, int rank)
{
    return simple(pipe, rank, 0);
}

static int simple_side_on_tcp(kvp_pipe *pipe, int rank)
{
    return simple(pipe, rank, 1);
}

static void test_round_trip_x_y(void)
{
    kvpt_pipe_run(0, simple_side_on_tcp, simple_side_on_tcp);
}

/* Round i of the stress test: the same on both sides, from the seed alone. */
typedef struct round_spec {
    int none;
    int rows, cols;
    float lo, span;
    uint64_t seed;
} round_spec;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static round_spec spec_of(int i)
{
    uint64_t s = 0x5eed0000u + (uint64_t)i;
    round_spec r;
    r.none = splitmix(&s) % 100 < 5;
    r.rows = 900 + (int)(splitmix(&s) % 100);
    r.cols = 900 + (int)(splitmix(&s) % 100);
    float mean = (float)(splitmix(&s) % 10000) / 100.0f,
          std = (float)(splitmix(&s) % 10000) / 100.0f;
    r.lo = mean - std;
    r.span = 2 * std;
    r.seed = splitmix(&s);
    return r;
}

static float *make_matrix(const round_spec *r)
{
    size_t n = (size_t)r->rows * (size_t)r->cols;
    float *x = malloc(n * sizeof *x);
    uint64_t s = r->seed;
    for (size_t k = 0; k < n; k++)
        x[k] = r->lo + r->span * (float)(splitmix(&s) >> 40) / (float)(1 << 24);
    return x;
}

static void mean_std(const float *x, size_t n, float *mean, float *std)
{
    double sum = 0, sq = 0;
    for (size_t k = 0; k < n; k++)
        sum += x[k];
    double m = sum / (double)n;
    for (size_t k = 0; k < n; k++)
        sq += ((double)x[k] - m) * ((double)x[k] - m);
    *mean = (float)m;
    *std = (float)sqrt(sq / (double)(n - 1));
}

static void send_round(kvp_pipe *pipe, int i)
{
    round_spec r = spec_of(i);
    if (r.none) {
        for (int k = 0; k < 3; k++)
            CHECK_OK(kvp_pipe_send(pipe, NULL));
        return;
    }
    float *x = make_matrix(&r);
    float m, sd;
    mean_std(x, (size_t)r.rows * (size_t)r.cols, &m, &sd);
    int64_t shape[2] = {r.rows, r.cols}, one = 1;
    kvp_tensor tx, tm, ts;
    kvp_tensor_init(&tx, KVP_DTYPE_F32, 2, shape, x);
    kvp_tensor_init(&tm, KVP_DTYPE_F32, 1, &one, &m);
    kvp_tensor_init(&ts, KVP_DTYPE_F32, 1, &one, &sd);
    CHECK_OK(kvp_pipe_send(pipe, &tx));
    CHECK_OK(kvp_pipe_send(pipe, &tm));
    CHECK_OK(kvp_pipe_send(pipe, &ts));
    free(x); /* the pipe copied it already */
}

static void recv_round(kvp_pipe *pipe, int i)
{
    round_spec r = spec_of(i);
    kvp_tensor *x = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT),
               *m = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT),
               *sd = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
    if (r.none) {
        CHECK(x == NULL && m == NULL && sd == NULL);
    } else if (x && m && sd) {
        float *want = make_matrix(&r);
        CHECK(x->dtype == KVP_DTYPE_F32 && x->ndim == 2 && x->shape[0] == r.rows &&
              x->shape[1] == r.cols);
        CHECK(x->nbytes == (size_t)r.rows * r.cols * 4 && memcmp(x->data, want, x->nbytes) == 0);
        float gm, gs;
        mean_std(x->data, (size_t)r.rows * r.cols, &gm, &gs);
        CHECK(m->ndim == 1 && m->shape[0] == 1 && memcmp(m->data, &gm, 4) == 0);
        CHECK(sd->ndim == 1 && memcmp(sd->data, &gs, 4) == 0);
        free(want);
    } else {
        CHECK(!"a tensor came as None");
    }
    kvp_tensor_free(x);
    kvp_tensor_free(m);
    kvp_tensor_free(sd);
}

/* vLLM's stress test: rounds 0-3 of every 10 go prefill -> decode, 4-9 back.
 * 500 rounds as vLLM's; 100 in the sanitizer builds (KVPT_SANITIZED), whose
 * instrumented checks of every float would take minutes per row. */
#define STRESS_ROUNDS (KVPT_SANITIZED ? 100 : 500)

static int stress_side(kvp_pipe *pipe, int rank)
{
    for (int i = 0; i < STRESS_ROUNDS && !kvpt_failures; i++) {
        if (rank == ((i % 10) > 3))
            send_round(pipe, i);
        else
            recv_round(pipe, i);
    }
    return 0;
}

static void test_stress_500_rounds(void)
{
    kvpt_pipe_run(0, stress_side, stress_side);
}

/* ------------------------------------------------------ an event loop --- */

/* Both sides driven from poll(2) on kvp_pipe_send_fd() and recv_fd(), never
 * waiting in the
 * pipe: the sender with kvp_pipe_send_timeout(0) under a small
 * kv_buffer_size (so it must wait for ACKs' room), the receiver with
 * kvp_pipe_recv(0). Every tensor arrives in order, and the descriptor does
 * not spin: wake-ups after which nothing could be done stay of the order of
 * the messages (an ACK that frees too little room wakes the sender too). */
#define LOOP_MSGS 200

static size_t loop_size(int i)
{
    return i % 3 ? 4096 : 512 << 10; /* inline, and announced */
}

static int poll_once(int fd, int ms)
{
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    return poll(&pf, 1, ms);
}

static int loop_side(kvp_pipe *pipe, int rank)
{
    static uint8_t buf[512 << 10];
    int idle = 0, wakes = 0, woken = 0;
    int fd = rank == 0 ? kvp_pipe_send_fd(pipe) : kvp_pipe_recv_fd(pipe);
    CHECK(fd >= 0);
    for (int i = 0; i < LOOP_MSGS && !kvpt_failures; i++) {
        for (int tries = 0;; tries++) {
            kvp_status st;
            kvp_tensor *t = NULL;
            if (rank == 0) {
                int64_t n = (int64_t)loop_size(i);
                kvp_tensor out;
                kvpt_fill(buf, (size_t)n, (uint64_t)i);
                kvp_tensor_init(&out, KVP_DTYPE_U8, 1, &n, buf);
                st = kvp_pipe_send_timeout(pipe, &out, 0);
            } else {
                st = kvp_pipe_recv(pipe, 0, &t);
                if (!st) {
                    CHECK(t && t->nbytes == loop_size(i) &&
                          kvpt_verify(t->data, t->nbytes, (uint64_t)i) == (size_t)-1);
                    kvp_tensor_free(t);
                }
            }
            if (st == KVP_OK) break;
            if (st != KVP_ETIMEDOUT) {
                fprintf(stderr, "  rank %d, message %d: %s\n", rank, i, kvp_last_error());
                CHECK_OK(st);
                break;
            }
            if (tries && woken) idle++; /* woken by the descriptor, and nothing to do */
            /* Before its first message went, the sender retries now and
             * then: its peer may not be connected yet, which no descriptor
             * says. After that only room (an ACK) holds it back, and the
             * descriptor must say when it comes. */
            int waits = rank == 1 || i > 0;
            int r = poll_once(fd, waits ? 10000 : 20);
            woken = r > 0;
            wakes += woken;
            if (waits) CHECK(r > 0);
        }
    }
    fprintf(stderr, "  rank %d: %d messages, %d wake-ups, %d with nothing to do\n", rank, LOOP_MSGS,
            wakes, idle);
    CHECK(idle <= LOOP_MSGS); /* a descriptor that spins wakes thousands of times */
    return 0;
}

static void test_event_loop(void)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 1) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.kv_buffer_size = 2 << 20; /* four announced messages in flight */
    kvpt_pipe_run_pair(&s, &o, &o, loop_side, loop_side);
}

/* ------------------------------------------------ dtypes, 0-d, empty ---- */

static void dtype_tensor(int d, int kind, kvp_tensor *t, void *mem)
{
    int64_t shapes[3][3] = {{2, 3, 5}, {0}, {4, 0, 3}};
    int ndims[3] = {3, 0, 3};
    kvp_tensor_init(t, (kvp_dtype)d, ndims[kind], shapes[kind], mem);
    kvpt_fill(mem, t->nbytes, (uint64_t)(d * 10 + kind));
}

static int dtypes_side(kvp_pipe *pipe, int rank)
{
    static uint8_t mem[240];
    for (int d = 0; d < KVP_DTYPE_COUNT; d++) {
        for (int kind = 0; kind < 3; kind++) {
            kvp_tensor t;
            dtype_tensor(d, kind, &t, mem);
            if (rank == 0) {
                CHECK_OK(kvp_pipe_send(pipe, &t));
            } else {
                kvp_tensor *got = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
                CHECK(got && kvp_tensor_equal(got, &t));
                CHECK(got && got->ndim == t.ndim);
                kvp_tensor_free(got);
            }
        }
    }
    /* An int64 that only looks like None in another dtype stays a tensor, and
     * None itself arrives as NULL. */
    double fake = (double)NONE_INT;
    int64_t one = 1;
    kvp_tensor f;
    kvp_tensor_init(&f, KVP_DTYPE_F64, 1, &one, &fake);
    if (rank == 0) {
        CHECK_OK(kvp_pipe_send(pipe, &f));
        CHECK_OK(kvp_pipe_send(pipe, NULL));
    } else {
        kvpt_pipe_expect(pipe, &f);
        kvpt_pipe_expect(pipe, NULL);
    }
    return 0;
}

static void test_every_dtype_0d_empty(void)
{
    kvpt_pipe_run(0, dtypes_side, dtypes_side);
}

/* -------------------------------------------- both directions at once --- */

#define DUPLEX_N 300

static void *duplex_sender(void *arg)
{
    kvp_pipe *pipe = arg;
    uint8_t buf[3000];
    for (int i = 0; i < DUPLEX_N; i++) {
        int64_t len = 1 + (i * 37) % 3000;
        kvpt_fill(buf, (size_t)len, (uint64_t)i);
        kvp_tensor t;
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &len, buf);
        if (kvp_pipe_send(pipe, &t) != KVP_OK) return (void *)1;
    }
    return NULL;
}

static int duplex_side(kvp_pipe *pipe, int rank)
{
    (void)rank;
    pthread_t th;
    if (pthread_create(&th, NULL, duplex_sender, pipe) != 0) {
        CHECK(!"pthread_create");
        return 0;
    }
    for (int i = 0; i < DUPLEX_N && !kvpt_failures; i++) {
        kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
        /* FIFO: message i has length and content of index i. */
        CHECK(t && t->nbytes == (size_t)(1 + (i * 37) % 3000));
        CHECK(t && kvpt_verify(t->data, t->nbytes, (uint64_t)i) == (size_t)-1);
        kvp_tensor_free(t);
    }
    void *res;
    pthread_join(th, &res);
    CHECK(res == NULL);
    return 0;
}

static void test_both_directions_at_once(void)
{
    kvpt_pipe_run(0, duplex_side, duplex_side);
}

/* ------------------------------------------------------ flow control --- */

#define BUDGET (1u << 20)

static int budget_sender(kvp_pipe *pipe, int rank)
{
    (void)rank;
    /* The receiver says when it is up, so that startup time under load does not
     * count against the short send timeout below. */
    kvpt_pipe_expect(pipe, NULL);
    static uint8_t buf[3u << 20];
    size_t sizes[] = {256u << 10, 256u << 10, 256u << 10, 256u << 10, 256u << 10,
                      256u << 10, 3u << 20,   100,        256u << 10, 512u << 10};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        int64_t n = (int64_t)sizes[i];
        kvpt_fill(buf, sizes[i], 1000 + i);
        kvp_tensor t;
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, buf);
        CHECK_OK(kvp_pipe_send(pipe, &t));
        kvp_pipe_stats st;
        kvp_pipe_get_stats(pipe, &st);
        /* Never more than the budget in flight, except a big one alone. */
        CHECK(st.inflight_bytes <= BUDGET || st.inflight_count == 1);
    }
    /* The receiver stops taking messages: send times out, then goes on. */
    int64_t n = 900u << 10;
    kvp_tensor t;
    kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, buf);
    kvp_status st = KVP_OK;
    int sent = 0;
    while ((st = kvp_pipe_send(pipe, &t)) == KVP_OK && sent < 10)
        sent++;
    CHECK_ST(st, KVP_ETIMEDOUT);
    CHECK(strstr(kvp_last_error(), "acknowledged nothing") != NULL);
    CHECK(kvp_pipe_usable(pipe));
    /* Tell the receiver how many extra messages to drain. */
    int64_t one = 1, count = sent;
    kvp_tensor c;
    kvp_tensor_init(&c, KVP_DTYPE_I64, 1, &one, &count);
    CHECK_OK(kvp_pipe_send(pipe, &c));
    return 0;
}

static int budget_receiver(kvp_pipe *pipe, int rank)
{
    (void)rank;
    CHECK_OK(kvp_pipe_send(pipe, NULL)); /* ready */
    usleep(200000);                      /* let the sender run into the budget */
    size_t sizes[] = {256u << 10, 256u << 10, 256u << 10, 256u << 10, 256u << 10,
                      256u << 10, 3u << 20,   100,        256u << 10, 512u << 10};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
        CHECK(t && t->nbytes == sizes[i] && kvpt_verify(t->data, sizes[i], 1000 + i) == (size_t)-1);
        kvp_tensor_free(t);
    }
    usleep(4500000); /* longer than the sender's send timeout */
    int extra = -1;
    for (int k = 0; k < 12; k++) {
        kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
        if (!t) break;
        if (t->dtype == KVP_DTYPE_I64) {
            extra = (int)*(int64_t *)t->data;
            CHECK(k == extra);
            kvp_tensor_free(t);
            break;
        }
        kvp_tensor_free(t);
    }
    CHECK(extra >= 1);
    return 0;
}

static void test_flow_control(void)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 0) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.kv_buffer_size = BUDGET;
    o.send_timeout_ms = 3000;
    kvp_pipe_opts r = kvpt_pipe_tcp_opts();
    kvpt_pipe_run_pair(&s, &o, &r, budget_sender, budget_receiver);
}

/* --------------------------------------------------- one 1 GiB tensor --- */

#define GIB ((size_t)1 << 30)

static int gib_side(kvp_pipe *pipe, int rank)
{
    int64_t small = 1000, big = (int64_t)GIB;
    if (rank == 0) {
        uint8_t s[1000];
        kvpt_fill(s, sizeof s, 5);
        kvp_tensor t;
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &small, s);
        CHECK_OK(kvp_pipe_send(pipe, &t)); /* in flight while the big one waits */
        uint8_t *b = malloc(GIB);
        if (!b) {
            CHECK(!"malloc 1 GiB");
            return 0;
        }
        kvpt_fill(b, GIB, 6);
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &big, b);
        CHECK_OK(kvp_pipe_send(pipe, &t));
        free(b);
    } else {
        kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
        CHECK(t && t->nbytes == 1000 && kvpt_verify(t->data, 1000, 5) == (size_t)-1);
        kvp_tensor_free(t);
        /* The sender fills 1 GiB and copies it into fresh memory first: on a
         * loaded VM that takes a while, and this timeout only bounds a hang. */
        t = kvpt_pipe_recv(pipe, 150000);
        CHECK(t && t->nbytes == GIB);
        CHECK(t && kvpt_verify(t->data, GIB, 6) == (size_t)-1);
        kvp_tensor_free(t);
    }
    return 0;
}

static void test_one_gib_tensor(void)
{
    if (KVPT_SANITIZED)
        SKIP("a sanitizer build: filling and checking 1 GiB instrumented takes a minute "
             "per row; the normal build runs it, and the other cases the same code paths");
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 0) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts(); /* kv_buffer_size 1e9 < 1 GiB */
    o.send_timeout_ms = 150000;
    kvpt_pipe_run_pair(&s, &o, &o, gib_side, gib_side);
}

/* Messages past the pool's first chunk land in memory registered after the
 * receiver looked the sender's segment up. */
static int growth_side(kvp_pipe *pipe, int rank)
{
    size_t sizes[] = {1000, 100u << 20, 10, 150u << 20};
    uint8_t *b = malloc(150u << 20);
    for (size_t i = 0; i < 4; i++) {
        int64_t n = (int64_t)sizes[i];
        if (rank == 0) {
            kvpt_fill(b, sizes[i], 77 + i);
            kvp_tensor t;
            kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, b);
            CHECK_OK(kvp_pipe_send(pipe, &t));
            /* Acknowledged: the receiver has looked our segment up by now. */
            CHECK_OK(kvp_pipe_flush(pipe, 20000));
        } else {
            kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
            CHECK(t && t->nbytes == sizes[i] &&
                  kvpt_verify(t->data, sizes[i], 77 + i) == (size_t)-1);
            kvp_tensor_free(t);
        }
    }
    free(b);
    return 0;
}

static void test_sender_pool_grows(void)
{
    kvpt_pipe_run(0, growth_side, growth_side);
}

/* ------------------------------------------------ metadata and shm ----- */

static void test_p2p_handshake(void)
{
    kvpt_pipe_run(1, simple_side, simple_side);
}

static void test_same_host_transport_allowed(void)
{
    kvpt_pipe_run_same_host(dtypes_side, 0);
}

/* ------------------------------------------------------------ the CLI --- */

/* Run the CLI with args; returns its exit code and leaves stdout in out. A
 * pipe pair it launches (demo, bench --pipe) gets ports claimed from the
 * tests' registry (kvpt_pipe_ports). */
static int run_cli(char *const args[], char *out, size_t len)
{
    char path[] = "/tmp/kvp_cli_out_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    close(fd);
    char *argv[32], port[16];
    int n = 0;
    argv[n++] = (char *)kvpt_cli();
    for (int i = 0; args[i] && n < 29; i++)
        argv[n++] = args[i];
    if (strcmp(args[0], "demo") == 0 || (args[1] && strcmp(args[1], "--pipe") == 0)) {
        snprintf(port, sizeof port, "%d", kvpt_pipe_ports());
        argv[n++] = "--port";
        argv[n++] = port;
    }
    argv[n] = NULL;
    int rc = kvpt_wait_child(kvpt_spawn(argv, path), 120000);
    FILE *f = fopen(path, "r");
    size_t got = f ? fread(out, 1, len - 1, f) : 0;
    out[got] = '\0';
    if (f) fclose(f);
    unlink(path);
    return rc;
}

static void test_cli_demo(void)
{
    static char out[8192];
    char *http[] = {"demo", "--requests", "3", "--tokens", "100", "--layers", "4", "--json", NULL};
    CHECK(run_cli(http, out, sizeof out) == 0);
    CHECK(strstr(out, "every byte verified") != NULL);
    CHECK(strstr(out, "\"requests\": 3") != NULL && strstr(out, "\"errors\": 0") != NULL);
    char *p2p[] = {"demo",    "--requests", "2",          "--tokens", "7",        "--layers", "2",
                   "--dtype", "f32",        "--metadata", "p2p",      "--no-shm", NULL};
    CHECK(run_cli(p2p, out, sizeof out) == 0);
    /* Every part of 7 tokens fits inline, unless sent before prefill had
     * read decode's descriptor: the line names the engine's transport only
     * when a message was READ, and never asks a prefill that may be gone. */
    int named = strstr(out, "all 10 messages inline on the pipe's ZeroMQ link") != NULL ||
                strstr(out, " s over tcp, ") != NULL;
    if (!named) fprintf(stderr, "  the demo printed:\n%s", out);
    CHECK(named);
    char *bad[] = {"demo", "--tokens", "0", NULL};
    CHECK(run_cli(bad, out, sizeof out) == 2);
    char *bad_dtype[] = {"demo", "--dtype", "f128", NULL};
    CHECK(run_cli(bad_dtype, out, sizeof out) == 2);
}

/* A mooncake.json with "protocol": "rdma" (what kvpipe demo writes for
 * --protocol rdma) runs the demo over UCX. */
static void test_cli_demo_rdma(void)
{
    static char out[8192];
    char *args[] = {"demo", "--requests", "3",    "--tokens", "100",    "--layers",
                    "4",    "--protocol", "rdma", "--no-shm", "--json", NULL};
    CHECK(run_cli(args, out, sizeof out) == 0);
    CHECK(strstr(out, "every byte verified") != NULL);
    CHECK(strstr(out, "over ucx") != NULL);
    CHECK(strstr(out, "\"requests\": 3") != NULL && strstr(out, "\"errors\": 0") != NULL);
}

static void test_cli_bench_pipe(void)
{
    static char out[8192];
    char *help[] = {"bench", "--pipe", "--help", NULL};
    if (run_cli(help, out, sizeof out) != 0 || !strstr(out, "--tensor-size"))
        SKIP("kvpipe bench does not hand --pipe over yet");
    char *run[] = {"bench", "--pipe", "--tensor-size", "1M", "--count", "20", "--json", NULL};
    CHECK(run_cli(run, out, sizeof out) == 0);
    char *last = strrchr(out, '{');
    CHECK(last && strstr(last, "\"ops\": 20") && strstr(last, "\"errors\": 0") &&
          strstr(last, "\"gbps\": "));
    char *in_place[] = {"bench",    "--pipe",   "--tensor-size", "1M",  "--count", "20", "--send",
                        "in-place", "--verify", "--protocol",    "shm", "--json",  NULL};
    CHECK(run_cli(in_place, out, sizeof out) == 0);
    last = strrchr(out, '{');
    CHECK(last && strstr(last, "\"ops\": 20") && strstr(last, "\"errors\": 0") &&
          strstr(last, "\"send\": \"in-place\""));
    CHECK(strstr(out, "every byte verified") != NULL);
    /* 1 KiB tensors go inline (all but those sent before the sender read
     * the receiver's descriptor): 20 timed, 32 warm-up, the None. The
     * transport is "inline" exactly when no message was READ. How many went
     * before the sender read the descriptor is a race (here about one run
     * in three had some; under a loaded CI, once, all 53), so up to 20 runs
     * look for one that was all inline, and at least one must have sent
     * some inline. */
    char *small[] = {"bench", "--pipe", "--tensor-size", "1K", "--count", "20", "--json", NULL};
    int all_inline = 0, some_inline = 0;
    for (int try = 0; try < 20 && !all_inline; try++) {
        CHECK(run_cli(small, out, sizeof out) == 0);
        last = strrchr(out, '{');
        CHECK(last && strstr(last, "\"ops\": 20") && strstr(last, "\"messages\": 53"));
        if (!last) continue;
        all_inline = strstr(last, "\"inline_messages\": 53,") != NULL;
        CHECK(all_inline == (strstr(last, "\"transport\": \"inline\"") != NULL));
        if (strstr(last, "\"inline_messages\": 0,")) continue;
        some_inline = 1;
        CHECK(strstr(out, " B via inline messages on the pipe's ZeroMQ link, ") ||
              strstr(out, " messages inline), "));
    }
    CHECK(some_inline);
    if (!all_inline)
        printf("  note: no 1 KiB run of 20 went all inline; the inline name unchecked\n");
    char *bad[] = {"bench", "--pipe", "--tensor-size", "12", NULL};
    CHECK(run_cli(bad, out, sizeof out) == 2);
    char *bad_send[] = {"bench", "--pipe", "--tensor-size", "1M", "--send", "zero", NULL};
    CHECK(run_cli(bad_send, out, sizeof out) == 2);
    /* Byte counts: no sign, no overflow (cli_parse_size). */
    char *negative[] = {"bench", "--pipe", "--tensor-size", "-8", NULL};
    CHECK(run_cli(negative, out, sizeof out) == 2);
    char *huge[] = {"bench",        "--pipe", "--tensor-size", "1M", "--kv-buffer-size",
                    "99999999999G", NULL};
    CHECK(run_cli(huge, out, sizeof out) == 2);
    /* Complete otherwise: with a valid size this runs and fails to reach the
     * segment (exit 1), so only the size can make it a usage error. */
    char *block[] = {"bench",       "--mode",       "initiator",    "--local-server-name",
                     "127.0.0.1:0", "--segment-id", "127.0.0.1:1",  "--duration",
                     "1",           "--block-size", "99999999999G", NULL};
    CHECK(run_cli(block, out, sizeof out) == 2);
}

static const kvpt_pipe_case cases[] = {
    KVPT_PIPE_CASE(test_round_trip_x_y, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_p2p_handshake, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_every_dtype_0d_empty, 120, 0),
    KVPT_PIPE_CASE(test_same_host_transport_allowed, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_both_directions_at_once, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_flow_control, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_event_loop, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_sender_pool_grows, 120, 0),
    KVPT_PIPE_CASE(test_cli_demo, 120, KVPT_ROW_TCP_ONLY),
    KVPT_PIPE_CASE(test_cli_bench_pipe, 120, KVPT_ROW_TCP_ONLY | KVPT_AUTH_TCP),
    KVPT_PIPE_CASE(test_cli_demo_rdma, 120, KVPT_ROWS_UCX_ONLY),
    KVPT_PIPE_CASE(test_stress_500_rounds, 240, KVPT_AUTH),
    KVPT_PIPE_CASE(test_one_gib_tensor, 400, 0),
};

int main(int argc, char **argv)
{
    return kvpt_pipe_main(argc, argv, cases, sizeof cases / sizeof cases[0]);
}
