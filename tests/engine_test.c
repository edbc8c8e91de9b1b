/* Engine conformance: the same cases on every transport (tcp, shm, ucx) and with
 * the HTTP store and P2PHANDSHAKE. The target runs in a child process; this
 * process is the initiator. (etcd and Redis run the store-level cases in
 * engine_store_test.c.) */
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "peer.h"
#include "test.h"
#include "metadata/metadata.h"
#include "transport/transport.h"

typedef struct mode {
    /* The protocol of both engines, and the transport that must serve: every
     * protocol but shm runs with shm disabled on both sides, so that its own
     * transport is what runs. A row per transport; a transport this build
     * lacks skips its rows. */
    const char *protocol;
    int p2p;
    /* ucx rows: UCX_TLS for both engines (the target inherits it) */
    const char *ucx_tls;
    int auth; /* both engines in the authenticated mode (a key file in the env) */
} mode;

static const mode *M;
static char meta[160];
static char key_file[64]; /* the auth modes' key, made in main */

#define SEED 0x1234

/* Is the mode's transport a same-host one (shm)? */
static int same_host(void)
{
    const kvpi_transport_ops *ops = kvpi_transport_lookup(M->protocol);
    return ops && (ops->caps & KVPI_CAP_SAME_HOST);
}

/* The name of the transport that serves the mode's protocol. */
static const char *transport_name(void)
{
    return kvpi_transport_lookup(M->protocol)->name;
}

/* Set up the metadata store of the mode; 0 on success. */
static int setup(void)
{
    if (kvpi_transport_lookup(M->protocol) == NULL) {
        kvpt_skip("%s transport not built", M->protocol); /* does not return */
        return -1;
    }
    if (M->ucx_tls) setenv("UCX_TLS", M->ucx_tls, 1); /* each case runs in a child */
    /* This case's process and the target it starts inherit it. */
    if (M->auth) setenv("KVPIPE_AUTH_KEY_FILE", key_file, 1);
    if (M->p2p) {
        snprintf(meta, sizeof meta, "P2PHANDSHAKE");
        return 0;
    }
    return kvpt_http_store_start(meta, sizeof meta) > 0 ? 0 : -1;
}

static int start_target(size_t len, kvpt_target *t)
{
    kvpt_target_opts o = {.metadata = meta,
                          .protocol = M->protocol,
                          .len = len,
                          .seed = SEED,
                          .disable_shm = !same_host()};
    return kvpt_target_start(&o, t);
}

static int start_initiator(kvp_engine **e)
{
    return kvpt_initiator_start(meta, M->protocol, !same_host(), 0, e);
}

/* Common prologue: store, target of len bytes, initiator, open segment. */
#define PROLOGUE(len)                                                                              \
    kvpt_target t;                                                                                 \
    kvp_engine *e;                                                                                 \
    kvp_segment_id seg;                                                                            \
    REQUIRE(setup() == 0);                                                                         \
    REQUIRE(start_target(len, &t) == 0);                                                           \
    REQUIRE(start_initiator(&e) == 0);                                                             \
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));                                          \
    CHECK(strcmp(kvp_engine_segment_transport(e, seg), transport_name()) == 0)

/* The end of a case PROLOGUE began: the initiator gone, the target stopped. */
#define EPILOGUE()                                                                                 \
    do {                                                                                           \
        kvp_engine_destroy(e);                                                                     \
        CHECK(kvpt_target_stop(&t, 0) == 0);                                                       \
    } while (0)

static void sizes(void)
{
    static const size_t lens[] = {1, 4096, 1u << 20, 64u << 20};
    PROLOGUE(64u << 20);
    char *local = malloc(64u << 20);
    REQUIRE(local);
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        size_t len = lens[i];
        /* READ from an 8-aligned offset that keeps the range inside. */
        uint64_t off = len == (64u << 20) ? 0 : 8 * 1000;
        memset(local, 0, len);
        CHECK_OK(kvp_engine_read(e, seg, local, (uint64_t)(uintptr_t)t.buf + off, len));
        CHECK(kvpt_verify(local, len, SEED + off) == (size_t)-1);
        /* WRITE a different pattern and look at the target's memory. */
        kvpt_fill(local, len, 99 + i);
        CHECK_OK(kvp_engine_write(e, seg, local, (uint64_t)(uintptr_t)t.buf + off, len));
        CHECK(kvpt_verify((char *)t.buf + off, len, 99 + i) == (size_t)-1);
        kvpt_fill(t.buf, t.len, SEED);
    }
    /* Zero-length requests complete at once. */
    CHECK_OK(kvp_engine_read(e, seg, local, (uint64_t)(uintptr_t)t.buf, 0));
    free(local);
    EPILOGUE();
}

static void batches(void)
{
    static const size_t counts[] = {1, 7, 64, 1024};
    const size_t block = 4096, span = 8u << 20;
    PROLOGUE(span);
    char *local = malloc(1024 * block);
    kvp_request *reqs = calloc(1024, sizeof *reqs);
    uint64_t *offs = calloc(1024, sizeof *offs);
    REQUIRE(local && reqs && offs);
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        size_t n = counts[c];
        for (int op = 0; op < 2; op++) {
            for (size_t i = 0; i < n; i++) {
                /* Scattered, non-overlapping blocks: a permutation of the span. */
                offs[i] = ((i * 97 + c * 13) % (span / block)) * block;
                char *l = local + i * block;
                if (op == KVP_OP_WRITE) kvpt_fill(l, block, 7000 + offs[i]);
                reqs[i] =
                    (kvp_request){(kvp_opcode)op, l, (uint64_t)(uintptr_t)t.buf + offs[i], block};
            }
            kvp_batch *b;
            REQUIRE_OK(kvp_batch_submit(e, seg, reqs, n, &b));
            CHECK_OK(kvp_batch_wait(b, 30000));
            CHECK(kvp_batch_pending(b) == 0);
            for (size_t i = 0; i < n; i++) {
                CHECK_ST(kvp_batch_request_status(b, i), KVP_OK);
                if (op == KVP_OP_READ)
                    CHECK(kvpt_verify(local + i * block, block, SEED + offs[i]) == (size_t)-1);
                else
                    CHECK(kvpt_verify((char *)t.buf + offs[i], block, 7000 + offs[i]) ==
                          (size_t)-1);
            }
            CHECK_ST(kvp_batch_request_status(b, n), KVP_EINVAL);
            kvp_batch_free(b);
            /* Restore the READ pattern for the next round. */
            kvpt_fill(t.buf, span, SEED);
        }
    }
    free(local);
    free(reqs);
    free(offs);
    EPILOGUE();
}

static void out_of_range(void)
{
    const size_t len = 1u << 20;
    PROLOGUE(len);
    char local[8192];
    uint64_t base = (uint64_t)(uintptr_t)t.buf;
    CHECK_ST(kvp_engine_read(e, seg, local, base + len - 100, 200), KVP_ERANGE);
    CHECK_ST(kvp_engine_write(e, seg, local, base - 4096, 4096), KVP_ERANGE);
    CHECK_ST(kvp_engine_read(e, seg, local, UINT64_MAX - 10, 100), KVP_ERANGE);
    /* A batch with one bad request: the others still succeed. */
    kvp_request reqs[3] = {{KVP_OP_READ, local, base, 4096},
                           {KVP_OP_READ, local + 4096, base + len, 1},
                           {KVP_OP_READ, local + 4096, base + 4096, 4096}};
    kvp_batch *b;
    REQUIRE_OK(kvp_batch_submit(e, seg, reqs, 3, &b));
    CHECK_ST(kvp_batch_wait(b, 30000), KVP_ERANGE);
    CHECK_ST(kvp_batch_request_status(b, 0), KVP_OK);
    CHECK_ST(kvp_batch_request_status(b, 1), KVP_ERANGE);
    CHECK_ST(kvp_batch_request_status(b, 2), KVP_OK);
    kvp_batch_free(b);
    CHECK(kvpt_verify(local, 8192, SEED) == (size_t)-1);
    /* The target still serves. */
    CHECK_OK(kvp_engine_read(e, seg, local, base + 8192, 4096));
    CHECK(kvpt_verify(local, 4096, SEED + 8192) == (size_t)-1);
    EPILOGUE();
}

/* A READ of 256 MiB while the target is SIGKILLed fails within seconds. */
static void target_killed(void)
{
    const size_t len = 256u << 20;
    PROLOGUE(len);
    char *local = malloc(len);
    REQUIRE(local);
    int errors = 0;
    uint64_t killed_at = 0, failed_at = 0;
    for (int round = 0; round < 200 && !failed_at; round++) {
        kvp_request r = {KVP_OP_READ, local, (uint64_t)(uintptr_t)t.buf, len};
        kvp_batch *b;
        REQUIRE_OK(kvp_batch_submit(e, seg, &r, 1, &b));
        if (round == 1) {
            usleep(2000);
            kill(t.pid, SIGKILL);
            killed_at = kvpi_now_ms();
        }
        kvp_status st = kvp_batch_wait(b, 20000);
        CHECK(st != KVP_ETIMEDOUT);
        if (st != KVP_OK) {
            errors++;
            failed_at = kvpi_now_ms();
        }
        kvp_batch_free(b);
    }
    CHECK(errors == 1);
    CHECK(failed_at && failed_at - killed_at < 8000);
    waitpid(t.pid, NULL, 0);
    close(t.peer.cmd);
    free(local);
    kvp_engine_destroy(e);
}

/* The target killed, and a new one started at its port as t2: len bytes
 * of pattern SEED + 1, shm as disable_shm says. 0, or -1. */
static int restart_target(kvpt_target *t, size_t len, int disable_shm, kvpt_target *t2)
{
    int port = atoi(strchr(t->name, ':') + 1);
    kvpt_target_kill(t);
    kvpt_target_opts o = {.metadata = meta,
                          .protocol = M->protocol,
                          .port = port,
                          .len = len,
                          .seed = SEED + 1,
                          .disable_shm = disable_shm};
    return kvpt_target_start(&o, t2);
}

/* A restarted target (same name, new buffer) is found again: the stale
 * descriptor costs one failed transfer at most. */
static void target_restarted(void)
{
    const size_t len = 1u << 20;
    PROLOGUE(len);
    char local[4096];
    CHECK_OK(kvp_engine_read(e, seg, local, (uint64_t)(uintptr_t)t.buf, sizeof local));
    kvpt_target t2;
    REQUIRE(restart_target(&t, 2 * len, strcmp(M->protocol, "tcp") == 0, &t2) == 0);
    uint64_t addr = (uint64_t)(uintptr_t)t2.buf + len;
    int failures = 0;
    kvp_status st;
    while ((st = kvp_engine_read(e, seg, local, addr, sizeof local)) != KVP_OK && failures < 3)
        failures++;
    CHECK_OK(st);
    CHECK(failures <= 1);
    CHECK(kvpt_verify(local, sizeof local, SEED + 1 + len) == (size_t)-1);
    munmap(t.buf, t.len);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t2, 0) == 0);
}

/* Managed buffers of the initiator and remote managed memory. */
static void managed_buffers(void)
{
    const size_t len = 4u << 20;
    PROLOGUE(len);
    void *a, *b2;
    REQUIRE_OK(kvp_engine_alloc(e, 3u << 20, &a));
    REQUIRE_OK(kvp_engine_alloc(e, 1000, &b2));
    CHECK(a != b2);
    CHECK_OK(kvp_engine_read(e, seg, a, (uint64_t)(uintptr_t)t.buf, 3u << 20));
    CHECK(kvpt_verify(a, 3u << 20, SEED) == (size_t)-1);
    CHECK_OK(kvp_engine_free(e, a));
    CHECK_ST(kvp_engine_free(e, a), KVP_EINVAL);
    CHECK_OK(kvp_engine_free(e, b2));
    kvp_remote_buffer rb[4];
    size_t n = 0;
    CHECK_OK(kvp_engine_segment_buffers(e, seg, rb, 4, &n));
    CHECK(n == 1 && rb[0].addr == (uint64_t)(uintptr_t)t.buf && rb[0].length == len);
    EPILOGUE();
}

/* Several threads transferring at once from one segment. */
typedef struct thr {
    pthread_t th;
    kvp_engine *e;
    kvp_segment_id seg;
    uint64_t base;
    int id;
    int bad;
} thr;

/* Even threads read one block at a time (on their own thread), odd ones a
 * batch of four quarters (through the engine's workers), so that requests
 * of callers and of workers meet on one peer. */
static void *thr_main(void *arg)
{
    thr *x = arg;
    char buf[65536];
    enum { Q = sizeof buf / 4 };
    for (int i = 0; i < 50; i++) {
        uint64_t off = (uint64_t)((x->id * 50 + i) % 64) * sizeof buf;
        kvp_status st;
        if (x->id % 2 == 0) {
            st = kvp_engine_read(x->e, x->seg, buf, x->base + off, sizeof buf);
        } else {
            kvp_request r[4];
            for (int q = 0; q < 4; q++)
                r[q] = (kvp_request){KVP_OP_READ, buf + q * Q, x->base + off + q * Q, Q};
            kvp_batch *b;
            st = kvp_batch_submit(x->e, x->seg, r, 4, &b);
            if (st == KVP_OK) {
                st = kvp_batch_wait(b, -1);
                kvp_batch_free(b);
            }
        }
        if (st != KVP_OK || kvpt_verify(buf, sizeof buf, SEED + off) != (size_t)-1) x->bad++;
    }
    return NULL;
}

static void threads(void)
{
    PROLOGUE(4u << 20);
    thr xs[6];
    for (int i = 0; i < 6; i++) {
        xs[i] = (thr){.e = e, .seg = seg, .base = (uint64_t)(uintptr_t)t.buf, .id = i};
        pthread_create(&xs[i].th, NULL, thr_main, &xs[i]);
    }
    for (int i = 0; i < 6; i++) {
        pthread_join(xs[i].th, NULL);
        CHECK(xs[i].bad == 0);
    }
    EPILOGUE();
}

static void unknown_segment(void)
{
    REQUIRE(setup() == 0);
    kvp_engine *e;
    REQUIRE(start_initiator(&e) == 0);
    kvp_segment_id seg;
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    kvp_status st = kvp_engine_open_segment(e, name, &seg);
    CHECK(st == (M->p2p ? KVP_ECONNREFUSED : KVP_ENOTFOUND));
    CHECK(strstr(kvp_last_error(), name) != NULL);
    kvp_engine_destroy(e);
}

/* Creation errors name what failed. */
static void create_errors(void)
{
    char url[96], name[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metadata", kvpt_free_port());
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = name;
    o.metadata = url;
    kvp_engine *e = NULL;
    CHECK_ST(kvp_engine_create(&o, &e), KVP_EMETADATA);
    CHECK(strstr(kvp_last_error(), url) != NULL);
    CHECK(e == NULL);
    o.metadata = "P2PHANDSHAKE";
    o.protocol = "rdma";
    if (!kvpi_transport_lookup("rdma")) { /* a build without UCX */
        CHECK_ST(kvp_engine_create(&o, &e), KVP_ENOTSUP);
        CHECK(strstr(kvp_last_error(), "rdma") != NULL);
        CHECK(strstr(kvp_last_error(), "MC_FORCE_TCP=1") != NULL);
    }
    o.protocol = "carrier-pigeon";
    CHECK_ST(kvp_engine_create(&o, &e), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "'carrier-pigeon'") != NULL);
    o.protocol = "tcp";
    o.local_server_name = "127.0.0.1";
    CHECK_ST(kvp_engine_create(&o, &e), KVP_EINVAL);
    /* Port 0: the system picks the handshake port, and the name says which. */
    o.local_server_name = "127.0.0.1:0";
    REQUIRE_OK(kvp_engine_create(&o, &e));
    CHECK(strncmp(kvp_engine_segment_name(e), "127.0.0.1:", 10) == 0);
    CHECK(kvp_engine_rpc_port(e) > 0);
    CHECK(atoi(kvp_engine_segment_name(e) + 10) == kvp_engine_rpc_port(e));
    kvp_engine_destroy(e);
    e = NULL;
    o.metadata = "gopher://x";
    o.local_server_name = name;
    CHECK_ST(kvp_engine_create(&o, &e), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "gopher://x") != NULL);
    /* Two engines cannot share a segment name: the second cannot bind it. */
    o.metadata = "P2PHANDSHAKE";
    REQUIRE_OK(kvp_engine_create(&o, &e));
    kvp_engine *e2 = NULL;
    CHECK(kvp_engine_create(&o, &e2) != KVP_OK);
    CHECK(strstr(kvp_last_error(), name) != NULL);
    kvp_engine_destroy(e);
}

/* ---- completion: callbacks, the completion fd, reaping ---- */

#define NB 32 /* batches in flight at once */

typedef struct done_log {
    atomic_int calls[NB + 2]; /* on_complete calls, by batch index (user_data) */
    atomic_int order;         /* on_complete calls in all */
} done_log;

static done_log *LOG;

static void on_done(kvp_batch *b, void *arg)
{
    size_t i = (size_t)(uintptr_t)arg;
    /* The callback may read its batch: it is complete. */
    if (kvp_batch_pending(b) != 0) atomic_fetch_add(&LOG->calls[NB + 1], 1);
    atomic_fetch_add(&LOG->calls[i], 1);
    atomic_fetch_add(&LOG->order, 1);
}

static int fd_readable(int fd, int timeout_ms)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLIN);
}

/* NB batches of READs and WRITEs in flight at once, one with a request
 * outside the target's buffer: each calls its callback once and is reaped
 * once, with its status, through the fd a poll(2) waits on; the fd stays
 * readable until the queue is empty (level-triggered), and not after. */
static void completion(void)
{
    const size_t block = 64 * 1024, per = 4;
    PROLOGUE(NB * per * block);
    done_log log = {0};
    LOG = &log;
    char *local = malloc(NB * per * block);
    REQUIRE(local);
    kvpt_fill(local, NB * per * block, 77);
    int fd = kvp_engine_completion_fd(e);
    REQUIRE(fd >= 0);
    CHECK(!fd_readable(fd, 0));
    kvp_batch *bs[NB];
    const size_t bad = 5; /* its last request lies past the buffer */
    for (size_t i = 0; i < NB; i++) {
        kvp_request r[4];
        for (size_t q = 0; q < per; q++) {
            size_t off = (i * per + q) * block;
            /* Odd batches WRITE the second half of their span. */
            kvp_opcode op = (i % 2 && q >= per / 2) ? KVP_OP_WRITE : KVP_OP_READ;
            r[q] = (kvp_request){op, local + off, (uint64_t)(uintptr_t)t.buf + off, block};
        }
        if (i == bad) r[per - 1].remote = (uint64_t)(uintptr_t)t.buf + t.len;
        kvp_batch_opts o;
        kvp_batch_opts_init(&o);
        o.on_complete = on_done;
        o.user_data = (void *)(uintptr_t)i;
        o.reap = 1;
        REQUIRE_OK(kvp_batch_submit_with(e, seg, r, per, &o, &bs[i]));
    }
    size_t reaped = 0;
    int seen[NB] = {0};
    uint64_t deadline = kvpi_now_ms() + 30000;
    while (reaped < NB && kvpi_now_ms() < deadline) {
        if (!fd_readable(fd, 1000)) continue;
        /* Level-triggered: still readable while nothing was taken. */
        CHECK(fd_readable(fd, 0));
        kvp_completion c[4];
        size_t n = kvp_engine_reap(e, c, 4);
        CHECK(n > 0);
        for (size_t k = 0; k < n; k++) {
            size_t i = (size_t)(uintptr_t)c[k].user_data;
            REQUIRE(i < NB);
            CHECK(c[k].batch == bs[i]);
            CHECK(seen[i]++ == 0);
            CHECK(atomic_load(&log.calls[i]) == 1); /* before it was queued */
            CHECK(kvp_batch_pending(c[k].batch) == 0);
            CHECK_ST(c[k].status, i == bad ? KVP_ERANGE : KVP_OK);
            CHECK_ST(kvp_batch_wait(c[k].batch, 0), i == bad ? KVP_ERANGE : KVP_OK);
        }
        reaped += n;
    }
    CHECK(reaped == NB);
    CHECK(!fd_readable(fd, 0));
    kvp_completion none;
    CHECK(kvp_engine_reap(e, &none, 1) == 0);
    CHECK(atomic_load(&log.order) == NB);
    CHECK(atomic_load(&log.calls[NB + 1]) == 0);
    for (size_t i = 0; i < NB; i++) {
        kvp_batch_free(bs[i]);
        CHECK(atomic_load(&log.calls[i]) == 1);
    }
    /* What the READs brought and the WRITEs left. */
    for (size_t i = 0; i < NB; i++)
        for (size_t q = 0; q < per; q++) {
            size_t off = (i * per + q) * block;
            if (i == bad && q == per - 1) continue;
            if (i % 2 && q >= per / 2)
                CHECK(kvpt_verify((char *)t.buf + off, block, 77 + off) == (size_t)-1);
            else
                CHECK(kvpt_verify(local + off, block, SEED + off) == (size_t)-1);
        }
    free(local);
    EPILOGUE();
}

/* kvp_batch_wait returns only after the batch's on_complete returned
 * (engine.h), whichever thread completed it. Over ucx the waiter drives
 * UCX's progress and wakes for more than its batch's end (a round that
 * found work, a worker that cannot be armed), so it may look while the
 * thread that completed the last request is still in the callback. */
static atomic_int slow_calls;

static void slow_done(kvp_batch *b, void *arg)
{
    (void)b;
    (void)arg;
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    atomic_fetch_add(&slow_calls, 1);
}

static void wait_after_callback(void)
{
    const size_t len = 1u << 20, rounds = 40;
    PROLOGUE(len);
    char *local = malloc(len);
    REQUIRE(local);
    size_t early = 0;
    for (size_t i = 0; i < rounds; i++) {
        kvp_request r = {i % 2 ? KVP_OP_WRITE : KVP_OP_READ, local, (uint64_t)(uintptr_t)t.buf,
                         len};
        kvp_batch_opts o;
        kvp_batch_opts_init(&o);
        o.on_complete = slow_done;
        atomic_store(&slow_calls, 0);
        kvp_batch *b;
        REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &o, &b));
        CHECK_OK(kvp_batch_wait(b, 10000));
        early += atomic_load(&slow_calls) == 0;
        kvp_batch_free(b);
        CHECK(atomic_load(&slow_calls) == 1);
    }
    if (early)
        fprintf(stderr, "  %zu of %zu waits returned before on_complete did\n", early, rounds);
    CHECK(early == 0);
    free(local);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

typedef struct reaper {
    pthread_t th;
    kvp_engine *e;
    atomic_int *stop;
    size_t got;
    int *seen; /* shared: a batch reaped twice shows as 2 */
} reaper;

static void *reaper_main(void *arg)
{
    reaper *r = arg;
    int fd = kvp_engine_completion_fd(r->e);
    while (!atomic_load(r->stop)) {
        if (!fd_readable(fd, 50)) continue;
        kvp_completion c[3];
        size_t n = kvp_engine_reap(r->e, c, 3);
        for (size_t k = 0; k < n; k++) {
            __atomic_fetch_add(&r->seen[(size_t)(uintptr_t)c[k].user_data], 1, __ATOMIC_RELAXED);
            kvp_batch_free(c[k].batch);
        }
        __atomic_fetch_add(&r->got, n, __ATOMIC_RELAXED); /* read by the main thread */
    }
    return NULL;
}

/* The completion queue's edges: a batch of no requests completes before
 * kvp_batch_submit_with returns; a batch freed unreaped leaves the queue
 * (the fd turns unreadable); a cancelled batch completes once; threads
 * reaping at once get each batch once. */
static void completion_edges(void)
{
    const size_t block = 1u << 20, nreq = 64;
    PROLOGUE(nreq * block);
    done_log log = {0};
    LOG = &log;
    int fd = kvp_engine_completion_fd(e);
    kvp_batch_opts o;
    kvp_batch_opts_init(&o);
    o.on_complete = on_done;
    o.reap = 1;
    o.user_data = (void *)(uintptr_t)0;
    kvp_batch *b;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, NULL, 0, &o, &b));
    CHECK(atomic_load(&log.calls[0]) == 1);
    CHECK(fd_readable(fd, 0));
    /* Freed without reaping: off the queue. */
    kvp_batch_free(b);
    CHECK(!fd_readable(fd, 0));
    kvp_completion c[2];
    CHECK(kvp_engine_reap(e, c, 2) == 0);

    /* Freed unreaped behind one reaped later: the queue keeps the other. */
    char *local = malloc(nreq * block);
    REQUIRE(local);
    kvp_request r = {KVP_OP_READ, local, (uint64_t)(uintptr_t)t.buf, 4096};
    kvp_batch *b1, *b2;
    o.user_data = (void *)(uintptr_t)1;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &o, &b1));
    CHECK_OK(kvp_batch_wait(b1, 10000));
    o.user_data = (void *)(uintptr_t)2;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &o, &b2));
    CHECK_OK(kvp_batch_wait(b2, 10000));
    CHECK(fd_readable(fd, 0));
    kvp_batch_free(b1);
    CHECK(fd_readable(fd, 0));
    CHECK(kvp_engine_reap(e, c, 2) == 1);
    CHECK(c[0].batch == b2 && c[0].user_data == (void *)(uintptr_t)2);
    CHECK(!fd_readable(fd, 0));
    kvp_batch_free(b2);
    /* A callback without the queue; the queue without a callback. */
    kvp_batch_opts only_cb = o;
    only_cb.reap = 0;
    only_cb.user_data = (void *)(uintptr_t)3;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &only_cb, &b));
    CHECK_OK(kvp_batch_wait(b, 10000));
    kvp_batch_free(b); /* returns after the callback */
    CHECK(atomic_load(&log.calls[3]) == 1);
    CHECK(!fd_readable(fd, 0));

    /* Cancelled at once: it completes, once, most requests KVP_ECANCELED. */
    kvp_request *rs = calloc(nreq, sizeof *rs);
    REQUIRE(rs);
    for (size_t i = 0; i < nreq; i++)
        rs[i] = (kvp_request){KVP_OP_READ, local + i * block,
                              (uint64_t)(uintptr_t)t.buf + i * block, block};
    o.user_data = (void *)(uintptr_t)4;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, rs, nreq, &o, &b));
    kvp_batch_cancel(b);
    CHECK(fd_readable(fd, 20000));
    CHECK(kvp_engine_reap(e, c, 2) == 1);
    CHECK(c[0].batch == b);
    CHECK(c[0].status == KVP_OK || c[0].status == KVP_ECANCELED);
    CHECK(kvp_batch_request_status(b, nreq - 1) == KVP_ECANCELED ||
          kvp_batch_request_status(b, nreq - 1) == KVP_OK);
    CHECK(atomic_load(&log.calls[4]) == 1);
    kvp_batch_free(b);
    CHECK(atomic_load(&log.calls[4]) == 1);

    /* Four threads reap 400 batches at once. */
    enum { MANY = 400 };
    REQUIRE(MANY * 4096 <= nreq * block);
    int *seen = calloc(MANY, sizeof *seen);
    REQUIRE(seen);
    atomic_int stop = 0;
    reaper rp[4];
    for (int i = 0; i < 4; i++) {
        rp[i] = (reaper){.e = e, .stop = &stop, .seen = seen};
        pthread_create(&rp[i].th, NULL, reaper_main, &rp[i]);
    }
    kvp_batch_opts q;
    kvp_batch_opts_init(&q);
    q.reap = 1;
    for (size_t i = 0; i < MANY; i++) {
        q.user_data = (void *)(uintptr_t)i;
        /* Each into a place of its own: batches run at once. */
        kvp_request ri = {KVP_OP_READ, local + i * 4096, (uint64_t)(uintptr_t)t.buf + i * 4096,
                          4096};
        kvp_batch *bi;
        REQUIRE_OK(kvp_batch_submit_with(e, seg, &ri, 1, &q, &bi));
    }
    uint64_t deadline = kvpi_now_ms() + 30000;
    size_t total = 0;
    while (kvpi_now_ms() < deadline) {
        total = 0;
        for (int i = 0; i < 4; i++)
            total += __atomic_load_n(&rp[i].got, __ATOMIC_RELAXED);
        if (total >= MANY) break;
        usleep(10000);
    }
    atomic_store(&stop, 1);
    total = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(rp[i].th, NULL);
        total += rp[i].got;
    }
    CHECK(total == MANY);
    for (size_t i = 0; i < MANY; i++)
        CHECK(seen[i] == 1);
    free(seen);
    free(rs);
    free(local);
    EPILOGUE();
}

/* The instance guard: requests that name the target's instance run; after
 * the target restarted under the same name they fail with KVP_ECONNRESET,
 * never touching the new process's memory, until the new instance is named. */
static void instance_guard(void)
{
    const size_t len = 1u << 20;
    PROLOGUE(len);
    const char *mine = kvp_engine_instance(e);
    REQUIRE(mine && strlen(mine) == KVP_INSTANCE_LEN);
    char id[KVP_INSTANCE_LEN + 1], id2[KVP_INSTANCE_LEN + 1];
    CHECK_ST(kvp_engine_segment_instance(e, seg, id, sizeof id - 1), KVP_EINVAL);
    REQUIRE_OK(kvp_engine_segment_instance(e, seg, id, sizeof id));
    CHECK(strlen(id) == KVP_INSTANCE_LEN && strcmp(id, mine) != 0);
    char local[4096];
    kvp_request r = {KVP_OP_READ, local, (uint64_t)(uintptr_t)t.buf, sizeof local};
    kvp_batch_opts o;
    kvp_batch_opts_init(&o);
    o.instance = id;
    kvp_batch *b;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &o, &b));
    CHECK_OK(kvp_batch_wait(b, 10000));
    kvp_batch_free(b);
    char other[KVP_INSTANCE_LEN + 1];
    memcpy(other, id, sizeof other);
    other[0] = other[0] == 'a' ? 'b' : 'a';
    o.instance = other;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &o, &b));
    CHECK_ST(kvp_batch_wait(b, 10000), KVP_ECONNRESET);
    kvp_batch_free(b);
    char toolong[KVP_INSTANCE_LEN + 2];
    memset(toolong, 'a', sizeof toolong - 1);
    toolong[sizeof toolong - 1] = '\0';
    o.instance = toolong;
    CHECK_ST(kvp_batch_submit_with(e, seg, &r, 1, &o, &b), KVP_EINVAL);

    /* The target restarts under its name: the old instance is refused. */
    kvpt_target t2;
    REQUIRE(restart_target(&t, len, !same_host(), &t2) == 0);
    r.remote = (uint64_t)(uintptr_t)t2.buf;
    o.instance = id;
    kvp_status st = KVP_OK;
    for (int i = 0; i < 3; i++) { /* the first may fail on the dead connection */
        REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &o, &b));
        st = kvp_batch_wait(b, 10000);
        kvp_batch_free(b);
        if (st == KVP_ECONNRESET && strstr(kvp_last_error(), "restarted")) break;
    }
    CHECK_ST(st, KVP_ECONNRESET);
    REQUIRE_OK(kvp_engine_segment_instance(e, seg, id2, sizeof id2));
    CHECK(strcmp(id2, id) != 0);
    o.instance = id2;
    REQUIRE_OK(kvp_batch_submit_with(e, seg, &r, 1, &o, &b));
    CHECK_OK(kvp_batch_wait(b, 10000));
    kvp_batch_free(b);
    CHECK(kvpt_verify(local, sizeof local, SEED + 1) == (size_t)-1);
    munmap(t.buf, t.len);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t2, 0) == 0);
}

/* A Mooncake segment of protocol rdma in the store (as Mooncake's RDMA
 * transport writes it: no tcp_data_port, devices, rkeys): opening it fails
 * with KVP_ENOTSUP saying how to reach it, not as a malformed descriptor. */
static void mooncake_rdma_segment(void)
{
    char url[160];
    REQUIRE(kvpt_http_store_start(url, sizeof url) > 0);
    const char *seg = "127.0.0.1:1";
    const char *desc =
        "{\"name\":\"127.0.0.1:1\",\"protocol\":\"rdma\",\"devices\":[{\"name\":"
        "\"mlx5_0\",\"lid\":0,\"gid\":\"fe80:0000:0000:0000:0000:0000:0000:0001\"}],"
        "\"priority_matrix\":{},\"timestamp\":\"2025-01-31 17:04:05.012345\","
        "\"buffers\":[{\"name\":\"cpu:0\",\"addr\":4096,\"length\":4096,\"rkey\":[5],"
        "\"lkey\":[5]}]}";
    void *store;
    REQUIRE_OK(kvpi_store_http.open(url, 3000, &store));
    char *key = kvpi_meta_key("ram", seg);
    REQUIRE_OK(kvpi_store_http.put(store, key, desc));
    free(key);
    kvpi_store_http.close(store);
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start(url, "tcp", 0, 0, &e) == 0);
    kvp_segment_id id;
    CHECK_ST(kvp_engine_open_segment(e, seg, &id), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "is a Mooncake rdma segment") != NULL);
    CHECK(strstr(kvp_last_error(), "protocol tcp or MC_FORCE_TCP=1") != NULL);
    kvp_engine_destroy(e);
}

/* ucx runs on UCX's own transports here: tcp, and shared memory (UCX 1.13's
 * "sm": posix and sysv for messages, cma; self for loopback). */
/* Each mode plain (sfx empty, auth 0) and with authentication (_auth, 1). */
/* clang-format off */
#define MODES_AUTH(X, sfx, auth)                                                                   \
    X(tcp_http##sfx, "tcp", 0, NULL, auth)                                                         \
    X(tcp_p2p##sfx, "tcp", 1, NULL, auth)                                                          \
    X(shm_http##sfx, "shm", 0, NULL, auth)                                                         \
    X(shm_p2p##sfx, "shm", 1, NULL, auth)                                                          \
    X(ucx_tcp_http##sfx, "rdma", 0, "tcp", auth)                                                   \
    X(ucx_tcp_p2p##sfx, "ucx", 1, "tcp", auth)                                                     \
    X(ucx_sm_http##sfx, "rdma", 0, "sm,self", auth)                                                \
    X(ucx_sm_p2p##sfx, "ucx", 1, "sm,self", auth)
#define MODES(X) MODES_AUTH(X, , 0) MODES_AUTH(X, _auth, 1)
/* clang-format on */

/* clang-format off */
#define CASES(X, m)                                                                          \
    X(m, sizes) X(m, batches) X(m, out_of_range) X(m, target_killed) X(m, target_restarted)  \
    X(m, managed_buffers) X(m, threads) X(m, unknown_segment) X(m, completion)               \
    X(m, instance_guard)
/* clang-format on */

#define DEFINE_MODE(m, proto, p2p_, tls, auth_)                                                    \
    static const mode mode_##m = {proto, p2p_, tls, auth_};
MODES(DEFINE_MODE)

#define DEFINE_CASE(m, c)                                                                          \
    static void m##__##c(void)                                                                     \
    {                                                                                              \
        M = &mode_##m;                                                                             \
        c();                                                                                       \
    }
#define DEFINE_MODE_CASES(m, proto, p2p_, tls, auth_) CASES(DEFINE_CASE, m)
MODES(DEFINE_MODE_CASES)

static void tcp_p2p__completion_edges(void)
{
    M = &mode_tcp_p2p;
    completion_edges();
}

static void tcp_p2p__wait_after_callback(void)
{
    M = &mode_tcp_p2p;
    wait_after_callback();
}

static void ucx_tcp_p2p__wait_after_callback(void)
{
    M = &mode_ucx_tcp_p2p;
    wait_after_callback();
}

static void ucx_sm_p2p__wait_after_callback(void)
{
    M = &mode_ucx_sm_p2p;
    wait_after_callback();
}

#define RUN_CASE(m, c) RUN(m##__##c);
#define RUN_MODE_CASES(m, proto, p2p_, tls, auth_) CASES(RUN_CASE, m)
/* The key of the auth modes: a file of mode 0600 for the whole run. */
static int make_key(void)
{
    kvpt_key_file(key_file, sizeof key_file, "engine-test-0123456789abcdef0123456789abcdef\n",
                  0600);
    return access(key_file, R_OK);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    unsetenv("KVPIPE_AUTH_KEY_FILE"); /* the plain modes are plain */
    if (make_key() != 0) return 1;
    RUN(create_errors);
    RUN(mooncake_rdma_segment);
    MODES(RUN_MODE_CASES)
    RUN(tcp_p2p__completion_edges);
    RUN(tcp_p2p__wait_after_callback);
    RUN(ucx_tcp_p2p__wait_after_callback);
    RUN(ucx_sm_p2p__wait_after_callback);
    unlink(key_file);
    return kvpt_summary();
}
