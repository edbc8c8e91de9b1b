/* Cancel and deadlines: a completion is a fence. On every transport (tcp,
 * shm, ucx over UCX's tcp) against a target stopped with SIGSTOP:
 *
 * - cancel_queued: kvp_batch_cancel completes at once, with KVP_ECANCELED,
 *   every request no transport has started; what was started fails at its
 *   deadline; nothing is left pending after that.
 * - fence_after_timeout: a READ that timed out has stopped writing into the
 *   caller's buffer when it returns: the test fills the buffer with a
 *   sentinel, resumes the target (which then finds the request it was sent
 *   and may still answer it) and checks, 800 ms later, that the sentinel is
 *   whole; then the initiator reads again and gets the target's bytes. This
 *   is what Mooncake #4247 asks for (docs/reliability.md, "Cancel").
 * - fence_after_abandon: the same for a batch of 64 READs, the target
 *   resumed as soon as the batch is given back (while the engine closes
 *   the failed peer). Over ucx most of them are still pending in UCX when
 *   they are given up; with their peer's worker progressed after that (no
 *   freeze, and a close that drains the worker for 1 s), 8200 bytes of the
 *   buffers changed.
 *
 * ucx (on UCX's shared memory, where memory the target registered needs
 * the target's progress) has no unstarted requests to cancel: posting issues
 * them to UCX at once, so its cancel case checks only that every request
 * completes by its deadline. (Over UCX's tcp, UCX 1.13 aborts a resumed
 * target that answers a request given up: docs/transport-ucx.md.) */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "peer.h"
#include "test.h"
#include "transport/transport.h"

#define SEED 0x5a
#define MIB ((size_t)1 << 20)
#define LEN (64 * MIB)
#define TIMEOUT_MS 1500
/* timeout_ms + 1 MiB at the default floor rate, and margin (ucx gives up on
 * requests of a closed endpoint 1 s after their deadline: ucx.c, abandon). */
#define BOUND_MS (TIMEOUT_MS + 2500)
#define SENTINEL 0xEE

typedef struct mode {
    const char *name;
    const char *protocol;
    const char *transport; /* what must serve */
    const char *ucx_tls;   /* NULL: not ucx */
} mode;

static const mode modes[] = {
    {"tcp", "tcp", "tcp", NULL},
    {"shm", "shm", "shm", NULL},
    {"ucx_sm", "rdma", "ucx", "sm,self"},
};
static const mode *M;

typedef struct fixture {
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    uint64_t base;
} fixture;

static int setup(fixture *f)
{
    if (!kvpi_transport_lookup(M->transport)) {
        kvpt_skip("built without %s", M->transport);
        return -1;
    }
    if (M->ucx_tls) setenv("UCX_TLS", M->ucx_tls, 1); /* the target inherits it */
    int shm = strcmp(M->transport, "shm") == 0;
    kvpt_target_opts o = {.protocol = M->protocol,
                          .disable_shm = !shm,
                          .len = LEN,
                          .seed = SEED,
                          .timeout_ms = TIMEOUT_MS};
    if (kvpt_target_start(&o, &f->t) != 0) return -1;
    if (kvpt_initiator_start(NULL, M->protocol, !shm, TIMEOUT_MS, &f->e) != 0) return -1;
    if (kvp_engine_open_segment(f->e, f->t.name, &f->seg) != KVP_OK) return -1;
    if (strcmp(kvp_engine_segment_transport(f->e, f->seg), M->transport) != 0) return -1;
    f->base = (uint64_t)(uintptr_t)f->t.buf;
    return 0;
}

static void teardown(fixture *f)
{
    kvp_engine_destroy(f->e);
    CHECK(kvpt_target_stop(&f->t, 0) == 0);
}

/* One READ first, so that the links are open and warm. */
static void warm(fixture *f, char *local)
{
    CHECK_OK(kvp_engine_read(f->e, f->seg, local, f->base, MIB));
    CHECK(kvpt_verify(local, MIB, SEED) == (size_t)-1);
}

/* Warm the links, stop the target, then submit n READs of 1 MiB into
 * local, of the target's first `spread` MiB in turn: the batch, or NULL. */
static kvp_batch *submit_to_stopped(fixture *f, char *local, size_t n, size_t spread)
{
    static kvp_request reqs[256];
    kvp_batch *b = NULL;
    warm(f, local);
    if (n > 256 || kvpt_stop(f->t.pid, 5000) != 0) return NULL;
    for (size_t i = 0; i < n; i++)
        reqs[i] = (kvp_request){KVP_OP_READ, local + i * MIB, f->base + (i % spread) * MIB, MIB};
    return kvp_batch_submit(f->e, f->seg, reqs, n, &b) == KVP_OK ? b : NULL;
}

static void cancel_queued(void)
{
    fixture f;
    REQUIRE(setup(&f) == 0);
    /* 256 requests of 1 MiB: shm groups 16 of them in an xfer, tcp posts
     * each alone; either way the 4 threads of the transport start at most 4
     * xfers, a quarter of the requests at most. */
    enum { N = 256 };
    char *local = malloc(N * MIB);
    REQUIRE(local);
    kvp_batch *b = submit_to_stopped(&f, local, N, 64);
    REQUIRE(b);
    usleep(100000); /* the transport's threads take what they can */
    uint64_t t0 = kvpi_now_ms();
    kvp_batch_cancel(b);
    uint64_t cancel_ms = kvpi_now_ms() - t0;
    size_t left = kvp_batch_pending(b);
    kvp_status st = kvp_batch_wait(b, BOUND_MS);
    uint64_t wait_ms = kvpi_now_ms() - t0;
    size_t canceled = 0, timed_out = 0, other = 0;
    for (size_t i = 0; i < N; i++) {
        kvp_status r = kvp_batch_request_status(b, i);
        if (r == KVP_ECANCELED)
            canceled++;
        else if (r == KVP_ETIMEDOUT)
            timed_out++;
        else
            other++;
    }
    fprintf(stderr,
            "  %s: cancel took %llu ms; %zu pending after it; all done after %llu ms: %zu "
            "cancelled, %zu timed out, %zu other (wait: %s)\n",
            M->name, (unsigned long long)cancel_ms, left, (unsigned long long)wait_ms, canceled,
            timed_out, other, kvp_strerror(st));
    CHECK(cancel_ms < 100);
    CHECK(kvp_batch_pending(b) == 0); /* all completed within the bound */
    CHECK(wait_ms < BOUND_MS);
    CHECK(st == KVP_ECANCELED || st == KVP_ETIMEDOUT);
    CHECK(other == 0);
    CHECK(canceled + timed_out == N);
    if (!M->ucx_tls) {
        CHECK(left <= N / 4);
        CHECK(canceled >= N - N / 4);
    }
    kvp_batch_free(b);
    kill(f.t.pid, SIGCONT);
    free(local);
    teardown(&f);
}

static void fence_after_timeout(void)
{
    fixture f;
    REQUIRE(setup(&f) == 0);
    size_t len = 8 * MIB;
    char *local = malloc(len);
    REQUIRE(local);
    warm(&f, local);
    REQUIRE(kvpt_stop(f.t.pid, 5000) == 0);
    uint64_t t0 = kvpi_now_ms();
    kvp_status st = kvp_engine_read(f.e, f.seg, local, f.base + MIB, len);
    uint64_t took = kvpi_now_ms() - t0;
    fprintf(stderr, "  %s: READ of a stopped target: %s after %llu ms: %s\n", M->name,
            kvp_strerror(st), (unsigned long long)took, kvp_last_error());
    CHECK_ST(st, KVP_ETIMEDOUT);
    CHECK(took < BOUND_MS + 2000);
    /* The caller owns the buffer again: whatever the target does now must
     * not reach it. */
    memset(local, SENTINEL, len);
    kill(f.t.pid, SIGCONT);
    usleep(800000);
    size_t bad = 0;
    for (size_t i = 0; i < len; i++)
        bad += (unsigned char)local[i] != SENTINEL;
    fprintf(stderr, "  %s: %zu bytes of the buffer changed after the READ returned\n", M->name,
            bad);
    CHECK(bad == 0);
    /* And the peer serves again. */
    int tries = 0;
    while ((st = kvp_engine_read(f.e, f.seg, local, f.base + MIB, len)) != KVP_OK && ++tries < 3) {
    }
    CHECK_OK(st);
    CHECK(kvpt_verify(local, len, SEED + MIB) == (size_t)-1);
    free(local);
    teardown(&f);
}

/* As fence_after_timeout, with a batch of many READs in flight: UCX 1.13
 * on shared memory keeps most of them pending after the endpoint was
 * closed, and delivers them once the target resumes unless the peer's
 * worker is never progressed again (docs/transport-ucx.md, "Worker per
 * peer"). The target resumes as soon as the batch is given back, while the
 * engine still closes the failed peer. */
static void fence_after_abandon(void)
{
    fixture f;
    REQUIRE(setup(&f) == 0);
    enum { N = 64 };
    char *local = malloc(N * MIB);
    REQUIRE(local);
    kvp_batch *b = submit_to_stopped(&f, local, N, N);
    REQUIRE(b);
    kvp_status st = kvp_batch_wait(b, BOUND_MS + 2000);
    CHECK(kvp_batch_pending(b) == 0);
    kvp_batch_free(b);
    fprintf(stderr, "  %s: a batch of %d READs of a stopped target: %s\n", M->name, N,
            kvp_strerror(st));
    CHECK(st == KVP_ETIMEDOUT || st == KVP_ECANCELED);
    memset(local, SENTINEL, N * MIB);
    kill(f.t.pid, SIGCONT);
    usleep(1500000);
    size_t bad = 0;
    for (size_t i = 0; i < N * MIB; i++)
        bad += (unsigned char)local[i] != SENTINEL;
    fprintf(stderr, "  %s: %zu bytes of the buffers changed after the batch was given back\n",
            M->name, bad);
    CHECK(bad == 0);
    free(local);
    teardown(&f);
}

#define CASES(X)                                                                                   \
    X(cancel_queued)                                                                               \
    X(fence_after_timeout)                                                                         \
    X(fence_after_abandon)

#define DEFINE(c)                                                                                  \
    static void tcp__##c(void)                                                                     \
    {                                                                                              \
        M = &modes[0];                                                                             \
        c();                                                                                       \
    }                                                                                              \
    static void shm__##c(void)                                                                     \
    {                                                                                              \
        M = &modes[1];                                                                             \
        c();                                                                                       \
    }                                                                                              \
    static void ucx_sm__##c(void)                                                                  \
    {                                                                                              \
        M = &modes[2];                                                                             \
        c();                                                                                       \
    }
CASES(DEFINE)

#define RUN_ALL(c)                                                                                 \
    RUN(tcp__##c);                                                                                 \
    RUN(shm__##c);                                                                                 \
    RUN(ucx_sm__##c);

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    CASES(RUN_ALL)
    return kvpt_summary();
}
