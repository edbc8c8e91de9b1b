/* Connection churn (issue 23 item 5, SGLang #31208; issue 24 item 5): many
 * short transfers to many peers must never exhaust ephemeral ports or
 * descriptors. One initiator engine (this process) runs TRANSFERS small
 * transfers (a 4 KiB WRITE and the READ that checks it, over THREADS threads)
 * spread over PEERS targets, each an engine in a process of its own (50
 * processes: forked, no exec, a few MiB each, which two cores start in a few
 * seconds). While they run, and after, the test counts
 *  - the initiator's descriptors (/proc/self/fd): at most PEERS *
 *    conns_per_peer over what it held before the first transfer;
 *  - its ESTABLISHED connections to the targets' data ports (/proc/net/tcp):
 *    at most PEERS * conns_per_peer, never one per transfer;
 *  - sockets in TIME_WAIT toward or from the targets' data and handshake
 *    ports: a pool that closed a connection per transfer leaves one per
 *    transfer (thousands); a pool leaves at most the connections it closed
 *    when idle (tw_bound);
 * then sits idle: the pooled connections must still be there at half the
 * initiator's idle_timeout_ms (reused, not closed at once) and gone, on
 * both sides, within idle_timeout_ms + the reaper's period + margin, with
 * the descriptors back where they were; a transfer to every target after
 * that reconnects and moves the right bytes.
 *
 * TRANSFERS is KVPT_CHURN_TRANSFERS: by default the 100,000 in the
 * normal build (about 5 s here), 20,000 under the sanitizers
 * (tests/CMakeLists.txt; docs/reliability.md). */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "peer.h"
#include "test.h"

#define MAX_PEERS 50
#define CONNS 4 /* conns_per_peer */
#define MAX_THREADS 16
#define XFER 4096
#define LEN (MAX_THREADS * XFER) /* each thread its own slot in every target */
#define IDLE_MS 2000             /* the initiator's idle_timeout_ms */
#define REAP_MS 500              /* its reaper's period: IDLE_MS / 4 */
#define SLACK_FDS 16             /* handshakes in flight, the test's own files */

/* The 100,000 in the normal build, 20,000 under the sanitizers
 * (KVPT_CHURN_TRANSFERS overrides either). */
#define KVPT_CHURN_DEFAULT_TRANSFERS (KVPT_SANITIZED ? 20000 : 100000)

static long transfers(void)
{
    const char *e = getenv("KVPT_CHURN_TRANSFERS");
    return e && atol(e) > 0 ? atol(e) : KVPT_CHURN_DEFAULT_TRANSFERS;
}

/* Ports of the targets' listeners: data ports (index 0..PEERS-1) and
 * handshake ports (PEERS..2*PEERS-1). */
static int ports[2 * MAX_PEERS];
static int PEERS, THREADS; /* this case's */

static int is_target_port(unsigned port, int data_only)
{
    for (int i = 0; i < PEERS; i++)
        if ((unsigned)ports[i] == port || (!data_only && (unsigned)ports[PEERS + i] == port))
            return 1;
    return 0;
}

typedef struct sock_counts {
    int established_out; /* the initiator's: remote port a target's data port */
    int established_in;  /* the targets' accepted ones: local port a data port */
    int time_wait;       /* either end a target's data or handshake port */
} sock_counts;

/* Count sockets in /proc/net/tcp and tcp6 (the namespace's: the targets run
 * in this one). State 01 is ESTABLISHED, 06 TIME_WAIT. */
static sock_counts count_sockets(void)
{
    sock_counts c = {0};
    const char *files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    for (int f = 0; f < 2; f++) {
        FILE *fp = fopen(files[f], "r");
        if (!fp) continue;
        char line[512];
        if (!fgets(line, sizeof line, fp)) { /* the header */
            fclose(fp);
            continue;
        }
        while (fgets(line, sizeof line, fp)) {
            char local[64], remote[64];
            unsigned st;
            if (sscanf(line, " %*d: %63s %63s %x", local, remote, &st) != 3) continue;
            char *lc = strrchr(local, ':'), *rc = strrchr(remote, ':');
            if (!lc || !rc) continue;
            unsigned lport = (unsigned)strtoul(lc + 1, NULL, 16);
            unsigned rport = (unsigned)strtoul(rc + 1, NULL, 16);
            if (st == 0x01 && is_target_port(rport, 1)) c.established_out++;
            if (st == 0x01 && is_target_port(lport, 1)) c.established_in++;
            if (st == 0x06 && (is_target_port(lport, 0) || is_target_port(rport, 0))) c.time_wait++;
        }
        fclose(fp);
    }
    return c;
}

/* The most sockets in TIME_WAIT that elapsed_ms of the run may leave (on
 * top of what was there before: other tests' sockets cannot use these
 * ports): a handshake per peer looked up, and each pooled connection closed
 * once per idle period it sat unused, then reopened - at most PEERS * CONNS
 * per IDLE_MS, plus those closed at the end. A connection per transfer
 * would leave one per transfer. */
static int tw_bound(uint64_t elapsed_ms)
{
    return PEERS + PEERS * CONNS * (2 + (int)(elapsed_ms / IDLE_MS));
}

typedef struct churn_run {
    kvp_engine *e;
    kvp_segment_id seg[MAX_PEERS];
    kvpt_target *t;
    long n; /* transfers in all, WRITE and READ counted apart */
    atomic_long done, failed, wrong;
    atomic_int stop;
} churn_run;

typedef struct worker {
    churn_run *c;
    int id;
} worker;

/* This thread's share: pairs of a WRITE of a fresh pattern into its slot of
 * a target and a READ of it back, the target changing every pair. */
static void *worker_main(void *arg)
{
    worker *w = arg;
    churn_run *c = w->c;
    char *out = malloc(XFER), *in = malloc(XFER);
    long pairs = c->n / 2 / THREADS;
    for (long i = 0; out && in && i < pairs && !atomic_load(&c->stop); i++) {
        int peer = (int)((i * 7 + w->id * 13) % PEERS);
        uint64_t seed = ((uint64_t)w->id << 32) | (uint64_t)i;
        uint64_t remote = (uint64_t)(uintptr_t)c->t[peer].buf + (uint64_t)w->id * XFER;
        kvpt_fill(out, XFER, seed);
        kvp_status st = kvp_engine_write(c->e, c->seg[peer], out, remote, XFER);
        if (!st) st = kvp_engine_read(c->e, c->seg[peer], in, remote, XFER);
        atomic_fetch_add(&c->done, 2);
        if (st) {
            if (atomic_fetch_add(&c->failed, 1) < 5)
                fprintf(stderr, "  transfer to %s failed: %s\n", c->t[peer].name, kvp_last_error());
            if (atomic_load(&c->failed) > 100) atomic_store(&c->stop, 1);
        } else if (kvpt_verify(in, XFER, seed) != (size_t)-1) {
            atomic_fetch_add(&c->wrong, 1);
        }
    }
    free(out);
    free(in);
    return NULL;
}

static void stop_targets(kvpt_target *t, int n)
{
    /* Last first: a later child holds the earlier ones' command pipes (it
     * was forked with them open), so their end-of-file waits for it. */
    for (int i = n - 1; i >= 0; i--)
        CHECK(kvpt_target_stop(&t[i], 0) == 0);
}

static void churn(int peers, int threads, long n)
{
    PEERS = peers;
    THREADS = threads;
    REQUIRE(kvpt_raise_nofile(8192) == 0);
    static kvpt_target t[MAX_PEERS];
    kvpt_target_opts o = {.len = LEN, .seed = 0xc4, .disable_shm = 1};
    int started = 0;
    uint64_t t0 = kvpi_now_ms();
    for (; started < PEERS; started++)
        if (kvpt_target_start(&o, &t[started]) != 0) break;
    fprintf(stderr, "  %d target processes started in %llu ms\n", started,
            (unsigned long long)(kvpi_now_ms() - t0));
    if (started < PEERS) {
        stop_targets(t, started);
        REQUIRE(started == PEERS);
    }
    for (int i = 0; i < PEERS; i++) {
        ports[i] = t[i].data_port;
        ports[PEERS + i] = t[i].rpc_port;
    }

    churn_run c = {.t = t, .n = n};
    char name[64];
    kvp_engine_opts eo;
    kvpt_engine_opts(&eo, name);
    eo.disable_shm = 1;
    eo.conns_per_peer = CONNS;
    eo.idle_timeout_ms = IDLE_MS;
    if (kvp_engine_create(&eo, &c.e) != KVP_OK) {
        fprintf(stderr, "  initiator: %s\n", kvp_last_error());
        stop_targets(t, PEERS);
        REQUIRE(0);
    }
    int fds0 = kvpt_count_fds();
    sock_counts s0 = count_sockets();
    fprintf(stderr, "  before: %d descriptors, %d TIME_WAIT\n", fds0, s0.time_wait);
    int opened = 1;
    for (int i = 0; i < PEERS; i++)
        if (kvp_engine_open_segment(c.e, t[i].name, &c.seg[i]) != KVP_OK) opened = 0;
    CHECK(opened);

    pthread_t th[MAX_THREADS];
    worker w[MAX_THREADS];
    t0 = kvpi_now_ms();
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker){&c, i};
        REQUIRE(pthread_create(&th[i], NULL, worker_main, &w[i]) == 0);
    }
    /* Sample while they run. */
    int fds_max = 0;
    sock_counts smax = {0};
    long expect = c.n / 2 / THREADS * 2 * THREADS;
    while (atomic_load(&c.done) < expect && !atomic_load(&c.stop)) {
        usleep(200000);
        int f = kvpt_count_fds();
        sock_counts s = count_sockets();
        if (f > fds_max) fds_max = f;
        if (s.established_out > smax.established_out) smax.established_out = s.established_out;
        if (s.established_in > smax.established_in) smax.established_in = s.established_in;
        if (s.time_wait > smax.time_wait) smax.time_wait = s.time_wait;
    }
    for (int i = 0; i < THREADS; i++)
        pthread_join(th[i], NULL);
    uint64_t ms = kvpi_now_ms() - t0;
    sock_counts s1 = count_sockets();
    int fds1 = kvpt_count_fds();
    fprintf(stderr,
            "  %ld transfers to %d peers in %llu ms (%ld failed, %ld wrong); peak: %d "
            "descriptors (+%d), %d ESTABLISHED out, %d in, %d TIME_WAIT; after: %d "
            "ESTABLISHED out, %d TIME_WAIT\n",
            atomic_load(&c.done), PEERS, (unsigned long long)ms, atomic_load(&c.failed),
            atomic_load(&c.wrong), fds_max, fds_max - fds0, smax.established_out,
            smax.established_in, smax.time_wait, s1.established_out, s1.time_wait);
    CHECK(atomic_load(&c.done) == expect);
    CHECK(atomic_load(&c.failed) == 0);
    CHECK(atomic_load(&c.wrong) == 0);
    CHECK(fds_max - fds0 <= PEERS * CONNS + SLACK_FDS);
    CHECK(fds1 - fds0 <= PEERS * CONNS + SLACK_FDS);
    CHECK(smax.established_out <= PEERS * CONNS);
    CHECK(s1.established_out <= PEERS * CONNS);
    CHECK(smax.time_wait - s0.time_wait <= tw_bound(ms));
    CHECK(s1.time_wait - s0.time_wait <= tw_bound(ms));

    /* Idle: still pooled at half the idle time, gone after it. */
    usleep(IDLE_MS / 2 * 1000);
    sock_counts half = count_sockets();
    fprintf(stderr, "  idle %d ms: %d ESTABLISHED out, %d descriptors\n", IDLE_MS / 2,
            half.established_out, kvpt_count_fds());
    CHECK(half.established_out > 0);
    uint64_t until = kvpi_now_ms() + IDLE_MS / 2 + REAP_MS + 1500;
    sock_counts after;
    int fds2;
    do {
        usleep(100000);
        after = count_sockets();
        fds2 = kvpt_count_fds();
    } while ((after.established_out || after.established_in || fds2 > fds0 + 2) &&
             kvpi_now_ms() < until);
    fprintf(stderr,
            "  idle %d ms + reaper + 1.5 s: %d ESTABLISHED out, %d in, %d descriptors (%+d), "
            "%d TIME_WAIT\n",
            IDLE_MS, after.established_out, after.established_in, fds2, fds2 - fds0,
            after.time_wait);
    CHECK(after.established_out == 0);
    CHECK(after.established_in == 0);
    CHECK(fds2 <= fds0 + 2);
    CHECK(after.time_wait - s0.time_wait <= tw_bound(kvpi_now_ms() - t0));

    /* And every peer is reached again afterwards. */
    char buf[XFER];
    int again = 0;
    for (int i = 0; i < PEERS; i++) {
        uint64_t remote = (uint64_t)(uintptr_t)t[i].buf;
        kvpt_fill(buf, XFER, 0xa9 + (uint64_t)i);
        if (kvp_engine_write(c.e, c.seg[i], buf, remote, XFER) == KVP_OK &&
            kvpt_verify(t[i].buf, XFER, 0xa9 + (uint64_t)i) == (size_t)-1)
            again++;
    }
    CHECK(again == PEERS);
    kvp_engine_destroy(c.e);
    stop_targets(t, PEERS);
}

/* The case: short transfers from 8 threads spread over 50 peers. */
static void churn_many_peers(void)
{
    churn(MAX_PEERS, 8, transfers());
}

/* A burst of more callers than connections at one peer (16 threads,
 * conns_per_peer 4): they share the 4 connections, waiting for one to come
 * back, instead of opening more only to close them after (before, each
 * burst left its extra connections in TIME_WAIT). */
static void burst_one_peer(void)
{
    churn(1, MAX_THREADS, transfers() / 5);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(churn_many_peers, 600);
    RUN_T(burst_one_peer, 300);
    return kvpt_summary();
}
