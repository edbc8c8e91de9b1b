/* File-descriptor exhaustion (issue 11, item 2): a target engine in a child
 * with a low RLIMIT_NOFILE, flooded with idle connections. The server must
 * neither spin on accept nor stay dead: with the default cap, the flood pushes
 * out only its own oldest connections and a legitimate initiator is served
 * throughout; with a cap above the descriptor limit, accept backs off, idle
 * connections are reaped, and the server serves again once descriptors free
 * up. Before, 1100 idle connections left the target at 100% CPU with every
 * descriptor held, for good. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/tsan.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "test.h"

#define SEED 0xfd
#define MIB ((size_t)1 << 20)

/* Open n connections to 127.0.0.1:port without waiting for any to complete
 * (a server that stops accepting must not stall the flood), 50 at a time so
 * that a server that does accept is not handed more than its listen queue. */
static int *flood(int port, int n)
{
    int *fds = calloc((size_t)n, sizeof *fds);
    if (!fds) return NULL;
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    for (int i = 0; i < n; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fds[i] >= 0) connect(fds[i], (struct sockaddr *)&sa, sizeof sa);
        if (i % 50 == 49) usleep(20000);
    }
    return fds;
}

static void unflood(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0) close(fds[i]);
    free(fds);
}

/* CPU the target burns over ms of wall time, in ms. */
static int64_t cpu_over(const kvpt_target *t, int ms)
{
    int64_t c0 = kvpt_target_cpu_ms(t);
    usleep((useconds_t)ms * 1000);
    int64_t c1 = kvpt_target_cpu_ms(t);
    return c0 < 0 || c1 < 0 ? -1 : c1 - c0;
}

/* Whether a fresh initiator opens the segment and READs it correctly, trying
 * for up to within_ms (descriptors may still be freeing up). */
static int served_within(const kvpt_target *t, int within_ms)
{
    uint64_t until = kvpi_now_ms() + (uint64_t)within_ms;
    char *buf = malloc(MIB);
    int ok = 0;
    while (buf && !ok && kvpi_now_ms() < until) {
        kvp_engine *e;
        if (kvpt_initiator_start(NULL, "tcp", 1, 2000, &e) != 0) break;
        kvp_segment_id seg;
        ok = kvp_engine_open_segment(e, t->name, &seg) == KVP_OK &&
             kvp_engine_read(e, seg, buf, (uint64_t)(uintptr_t)t->buf + MIB, MIB) == KVP_OK &&
             kvpt_verify(buf, MIB, SEED + MIB) == (size_t)-1;
        if (!ok) fprintf(stderr, "  not served yet: %s\n", kvp_last_error());
        kvp_engine_destroy(e);
        if (!ok) usleep(300000);
    }
    free(buf);
    return ok;
}

/* The descriptor limit raised, a target started with o and a flood of n
 * connections to its data port, settled for settle_us; the flood's
 * descriptors, or NULL. */
static int *flooded_target(const kvpt_target_opts *o, kvpt_target *t, int n, useconds_t settle_us)
{
    if (kvpt_raise_nofile(4096) != 0 || kvpt_target_start(o, t) != 0) return NULL;
    int *fds = flood(t->data_port, n);
    if (fds) usleep(settle_us);
    return fds;
}

/* 1100 idle connections against a descriptor limit of 1024 and the default
 * cap of 256: the flood evicts its own oldest connections, the target stays
 * idle, and a legitimate initiator is served while the flood stands. */
static void idle_flood_default_cap(void)
{
    kvpt_target t;
    kvpt_target_opts o = {
        .len = 4 * MIB, .seed = SEED, .timeout_ms = 2000, .disable_shm = 1, .nofile = 1024};
    int *fds = flooded_target(&o, &t, 1100, 1000000);
    REQUIRE(fds);
    int64_t cpu = cpu_over(&t, 2000);
    fprintf(stderr, "  target CPU under the flood: %lld ms in 2000 ms\n", (long long)cpu);
#ifndef KVPI_TSAN
    /* Under TSan its own cost of 256 parked threads is 1.3 s in 2 (the
     * normal build: 10 ms); the other passes hold the bound. */
    CHECK(cpu >= 0 && cpu < 600);
#endif
    CHECK(served_within(&t, 8000));
    int64_t fds_open = kvpt_target_cmd(&t, KVPT_T_FDS, 0, 3000);
    CHECK(fds_open > 0 && fds_open < 1000);
    unflood(fds, 1100);
    CHECK(served_within(&t, 8000));
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* The target's CPU in the second it is out of descriptors: shedding the
 * flood's waiting and idle connections costs some (50 ms in the normal
 * build); a spinning accept loop takes all 1000. Under ThreadSanitizer the
 * shedding alone took 530, then 920-970 ms of the second (2026-12-03), which
 * tells a spin from TSan's cost no more: there the figure is only reported,
 * and the normal and ASan passes hold the bound. */
#define BACKOFF_CPU_MS 500

/* A cap above the descriptor limit (4096 against 512), so that accept does
 * run out of descriptors: it backs off instead of spinning, idle connections
 * are reaped after idle_timeout_ms, and the target serves again while the
 * attacker still holds its end of every connection. */
static void exhaustion_backoff_and_recovery(void)
{
    kvpt_target t;
    kvpt_target_opts o = {.len = 4 * MIB,
                          .seed = SEED,
                          .timeout_ms = 2000,
                          .disable_shm = 1,
                          .nofile = 512,
                          .max_connections = 4096,
                          .idle_timeout_ms = 1500};
    int *fds = flooded_target(&o, &t, 700, 500000);
    REQUIRE(fds);
    int64_t cpu = cpu_over(&t, 1000);
    fprintf(stderr, "  target CPU while out of descriptors: %lld ms in 1000 ms\n", (long long)cpu);
#ifndef KVPI_TSAN
    CHECK(cpu >= 0 && cpu < BACKOFF_CPU_MS); /* spinning burns all of it (1000 ms) */
#endif
    CHECK(served_within(&t, 10000));
    char *reply = NULL;
    CHECK_OK(kvpi_rpc_call("127.0.0.1", t.rpc_port, KVPI_RPC_METADATA, "{}", 3000, &reply));
    free(reply);
    usleep(2000000); /* one more idle period: everything the flood left is reaped */
    int64_t fds_open = kvpt_target_cmd(&t, KVPT_T_FDS, 0, 3000);
    fprintf(stderr, "  target descriptors after reaping: %lld\n", (long long)fds_open);
    CHECK(fds_open > 0 && fds_open < 300); /* far from the 512 the flood held */
    unflood(fds, 700);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(idle_flood_default_cap, 90);
    RUN_T(exhaustion_backoff_and_recovery, 90);
    return kvpt_summary();
}
