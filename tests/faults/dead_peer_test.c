/* A dead or black-holed peer never holds up transfers to live peers (issue 23
 * item 5). One initiator engine transfers to two targets at once, each in a
 * process of its own: a live one, which a thread reads from in a loop, and
 * one that stops answering, to which batches of READs are submitted from
 * other threads. Transfers to the live target must keep flowing, each within
 * LIVE_BOUND_MS, while every request to the dead one fails within its
 * deadline (timeout_ms + its bytes at min_transfer_rate, plus margin) with
 * an error that names the peer.
 *
 * The dead peer, two ways:
 *  - stopped: SIGSTOP after the initiator's connections to it are pooled;
 *    the requests go out and nothing answers;
 *  - black-holed: SIGSTOPped before the initiator ever connected, and its
 *    data port's listen queue filled with connections nobody accepts, so the
 *    kernel drops further SYNs: each connect() of the initiator blocks.
 *
 *  - black-holed by the network: in a kvpt_netns pair, both targets on side
 *    0 (bound to its veth address through MC_TCP_BIND_ADDRESS), the
 *    initiator on side 1, and an nftables rule on side 0 dropping every
 *    packet to the dead target's data port - the SYNs of every connect, as a
 *    firewall or a vanished host does; its handshake port still answers, so
 *    the lookup succeeds and the connects are what blocks. The target runs
 *    on, unstopped.
 *
 * The live loop alternates a synchronous READ (which runs on its own
 * thread) and a batch of one (which runs on the tcp transport's threads,
 * beside the dead peer's), so that a dead peer tying up those threads would
 * show. The dead batches must all fail within DEAD_BOUND_MS: before each
 * xfer's deadline was fixed when it was posted, they failed one after
 * another, a deadline apart (2.3, 4.6, ... 13.8 s for six), as the peer's
 * four connections took them four at a time. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sched.h>

#include "common/clock.h"
#include "peer.h"
#include "netns.h"
#include "test.h"

#define SEED 0x7d
#define MIB ((size_t)1 << 20)
#define LEN (8 * MIB)
#define TIMEOUT_MS 2000
#define DEAD_THREADS 6 /* more than the engine's 4 workers */
#define DEAD_REQS 4
/* timeout_ms + 1 MiB at 16 MiB/s, a queue of the dead requests ahead, and
 * margin; what matters is that it is bounded. */
#define DEAD_BOUND_MS (4 * TIMEOUT_MS)
#define LIVE_BOUND_MS 500
#define FILL_CONNS 400 /* more than any listen backlog the target asks for */

typedef struct live_loop {
    kvp_engine *e;
    kvp_segment_id seg;
    uint64_t remote;
    atomic_int stop;
    atomic_long done, failed;
    atomic_llong worst_ms;
    pthread_t thread;
} live_loop;

static void *live_main(void *arg)
{
    live_loop *l = arg;
    char *buf = malloc(MIB);
    while (buf && !atomic_load(&l->stop)) {
        uint64_t t0 = kvpi_now_ms();
        kvp_status st;
        if (atomic_load(&l->done) % 2) {
            st = kvp_engine_read(l->e, l->seg, buf, l->remote, MIB);
        } else {
            kvp_request r = {KVP_OP_READ, buf, l->remote, MIB};
            kvp_batch *b = NULL;
            st = kvp_batch_submit(l->e, l->seg, &r, 1, &b);
            if (!st) st = kvp_batch_wait(b, -1);
            kvp_batch_free(b);
        }
        long long took = (long long)(kvpi_now_ms() - t0);
        if (took > atomic_load(&l->worst_ms)) atomic_store(&l->worst_ms, took);
        if (st || kvpt_verify(buf, MIB, SEED) != (size_t)-1) {
            if (atomic_fetch_add(&l->failed, 1) == 0)
                fprintf(stderr, "  live READ failed: %s\n", st ? kvp_last_error() : "bad bytes");
        } else {
            atomic_fetch_add(&l->done, 1);
        }
    }
    free(buf);
    return NULL;
}

typedef struct dead_caller {
    kvp_engine *e;
    kvp_segment_id seg;
    uint64_t remote;
    const char *name; /* the dead segment's, which errors must name */
    int port;         /* its data port, which they may name instead */
    long long took_ms;
    kvp_status st;
    int named;
    char why[512];
    pthread_t thread;
} dead_caller;

/* A batch of DEAD_REQS READs of 1 MiB to the dead peer, waited for without
 * a limit of our own: the engine's deadlines must end it. */
static void *dead_main(void *arg)
{
    dead_caller *d = arg;
    char *buf = malloc(DEAD_REQS * MIB);
    kvp_request reqs[DEAD_REQS];
    for (int i = 0; i < DEAD_REQS; i++)
        reqs[i] = (kvp_request){KVP_OP_READ, buf + i * MIB, d->remote + (uint64_t)i * MIB, MIB};
    uint64_t t0 = kvpi_now_ms();
    kvp_batch *b = NULL;
    d->st = buf ? kvp_batch_submit(d->e, d->seg, reqs, DEAD_REQS, &b) : KVP_ENOMEM;
    if (!d->st) d->st = kvp_batch_wait(b, -1);
    snprintf(d->why, sizeof d->why, "%s", kvp_last_error());
    kvp_batch_free(b);
    d->took_ms = (long long)(kvpi_now_ms() - t0);
    char port[16];
    snprintf(port, sizeof port, ":%d", d->port);
    d->named = strstr(d->why, d->name) != NULL || strstr(d->why, port) != NULL;
    free(buf);
    return NULL;
}

/* Fill port's listen queue with connections nobody accepts (the target is
 * stopped); returns how many were made. Non-blocking, so the ones whose SYN
 * is dropped do not wait. */
static int fill_backlog(int port, int *fds, int n)
{
    int made = 0;
    for (int i = 0; i < n; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
        if (fds[i] >= 0 &&
            (connect(fds[i], (struct sockaddr *)&to, sizeof to) == 0 || errno == EINPROGRESS))
            made++;
    }
    usleep(200 * 1000);
    return made;
}

/* Whether a connect to port now goes unanswered (its SYN dropped). */
static int connect_blackholed(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    int pending = connect(fd, (struct sockaddr *)&to, sizeof to) != 0 && errno == EINPROGRESS;
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    pending = pending && poll(&p, 1, 1000) == 0;
    close(fd);
    return pending;
}

/* Packets the black-hole rule dropped (its counter), or -1. */
static long nft_dropped(kvpt_netns *n)
{
    char path[] = "/tmp/kvpt_bhXXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    close(fd);
    const char *list[] = {"list", "table", "inet", "kvpt_bh", NULL};
    long packets = -1;
    if (kvpt_netns_run(n, 0, "nft", list, path) == 0) {
        FILE *f = fopen(path, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            char *at = strstr(line, "packets ");
            if (at) packets = atol(at + 8);
        }
        if (f) fclose(f);
    }
    unlink(path);
    return packets;
}

enum { STOPPED, BACKLOG_HOLE, NETWORK_HOLE };

static void run(int mode)
{
    int blackhole = mode != STOPPED;
    REQUIRE(kvpt_raise_nofile(4096) == 0);
    kvpt_netns n = {.fd = {-1, -1}, .home = -1};
    if (mode == NETWORK_HOLE) {
        const char *why = kvpt_netns_unavailable();
        if (why) SKIP("%s", why);
        if (kvpt_netns_create(&n) != 0) {
            fprintf(stderr, "  %s\n", n.why);
            kvpt_netns_destroy(&n);
            REQUIRE(0);
        }
        if ((why = kvpt_net_loss_unavailable(&n))) {
            kvpt_netns_destroy(&n);
            SKIP("%s", why);
        }
        /* The targets are forked from this thread: on side 0, bound to its
         * address. */
        REQUIRE(setns(n.fd[0], CLONE_NEWNET) == 0);
        setenv("MC_TCP_BIND_ADDRESS", n.addr[0], 1);
    }
    kvpt_target_opts o = {.disable_shm = 1, .len = LEN, .seed = SEED, .timeout_ms = TIMEOUT_MS};
    kvpt_target live, dead;
    REQUIRE(kvpt_target_start(&o, &live) == 0);
    if (kvpt_target_start(&o, &dead) != 0) {
        kvpt_target_stop(&live, 0);
        REQUIRE(0);
    }
    if (mode == NETWORK_HOLE) {
        unsetenv("MC_TCP_BIND_ADDRESS");
        REQUIRE(setns(n.home, CLONE_NEWNET) == 0);
        snprintf(live.name, sizeof live.name, "%s:%d", n.addr[0], live.rpc_port);
        snprintf(dead.name, sizeof dead.name, "%s:%d", n.addr[0], dead.rpc_port);
        char port[16];
        snprintf(port, sizeof port, "%d", dead.data_port);
        const char *table[] = {"add", "table", "inet", "kvpt_bh", NULL};
        const char *chain[] = {"add",  "chain", "inet",     "kvpt_bh", "in", "{", "type", "filter",
                               "hook", "input", "priority", "0",       ";",  "}", NULL};
        const char *rule[] = {"add",   "rule", "inet",    "kvpt_bh", "in", "tcp",
                              "dport", port,   "counter", "drop",    NULL};
        if (kvpt_netns_run(&n, 0, "nft", table, NULL) ||
            kvpt_netns_run(&n, 0, "nft", chain, NULL) || kvpt_netns_run(&n, 0, "nft", rule, NULL))
            fprintf(stderr, "  nft: %s\n", n.why);
        /* The initiator (its engine's threads too) runs on side 1. */
        REQUIRE(setns(n.fd[1], CLONE_NEWNET) == 0);
    }
    kvp_engine *e = NULL;
    kvp_segment_id live_seg = 0, dead_seg = 0;
    int *fill = calloc(FILL_CONNS, sizeof *fill);
    live_loop l = {0};
    dead_caller d[DEAD_THREADS];
    int started = 0;
    const char *skip = NULL; /* after the clean-up below: kvpt_skip exits */
    if (!fill || kvpt_initiator_start(NULL, "tcp", 1, TIMEOUT_MS, &e) != 0 ||
        kvp_engine_open_segment(e, live.name, &live_seg) != KVP_OK ||
        kvp_engine_open_segment(e, dead.name, &dead_seg) != KVP_OK) {
        fprintf(stderr, "  setup: %s\n", kvp_last_error());
        kvpt_failures++;
        goto out;
    }
    char *warm = malloc(MIB);
    if (!blackhole) /* the connections to the dead peer are pooled first */
        CHECK(warm &&
              kvp_engine_read(e, dead_seg, warm, (uint64_t)(uintptr_t)dead.buf, MIB) == KVP_OK);
    free(warm);
    if (mode != NETWORK_HOLE) CHECK(kvpt_stop(dead.pid, 5000) == 0);
    if (mode == BACKLOG_HOLE) {
        int made = fill_backlog(dead.data_port, fill, FILL_CONNS);
        int holed = connect_blackholed(dead.data_port);
        fprintf(stderr,
                "  %d connections fill the stopped target's listen queue; a new "
                "connect %s\n",
                made, holed ? "goes unanswered" : "is still answered");
        if (!holed) {
            skip = "the kernel answers connects to a full listen queue here";
            goto out;
        }
    }
    l = (live_loop){.e = e, .seg = live_seg, .remote = (uint64_t)(uintptr_t)live.buf};
    REQUIRE(pthread_create(&l.thread, NULL, live_main, &l) == 0);
    usleep(300 * 1000);
    long before = atomic_load(&l.done);
    atomic_store(&l.worst_ms, 0);
    for (; started < DEAD_THREADS; started++) {
        d[started] = (dead_caller){.e = e,
                                   .seg = dead_seg,
                                   .remote = (uint64_t)(uintptr_t)dead.buf,
                                   .name = dead.name,
                                   .port = dead.data_port};
        if (pthread_create(&d[started].thread, NULL, dead_main, &d[started]) != 0) break;
    }
    long long worst_dead = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(d[i].thread, NULL);
        if (d[i].took_ms > worst_dead) worst_dead = d[i].took_ms;
        fprintf(stderr, "  batch %d: %s after %lld ms: %.160s\n", i, kvp_strerror(d[i].st),
                d[i].took_ms, d[i].why);
        CHECK(d[i].st != KVP_OK);
        CHECK(d[i].took_ms <= DEAD_BOUND_MS);
        if (!d[i].named) fprintf(stderr, "  the error names no peer: %s\n", d[i].why);
        CHECK(d[i].named);
    }
    long during = atomic_load(&l.done) - before;
    atomic_store(&l.stop, 1);
    pthread_join(l.thread, NULL);
    fprintf(stderr,
            "  %s peer: %d batches failed, the last after %lld ms (%s: %s); meanwhile %ld "
            "READs of 1 MiB from the live peer, slowest %lld ms, %ld failed\n",
            mode == NETWORK_HOLE ? "black-holed (nftables)"
            : blackhole          ? "black-holed (listen queue)"
                                 : "stopped",
            started, worst_dead, started ? kvp_strerror(d[0].st) : "-", started ? d[0].why : "-",
            during, (long long)atomic_load(&l.worst_ms), atomic_load(&l.failed));
    CHECK(started == DEAD_THREADS);
    CHECK(atomic_load(&l.failed) == 0);
    CHECK(during > 0);
    CHECK(atomic_load(&l.worst_ms) <= LIVE_BOUND_MS);
    if (mode == NETWORK_HOLE) {
        long dropped = nft_dropped(&n);
        fprintf(stderr, "  %ld packets to the dead data port dropped\n", dropped);
        CHECK(dropped > 0);
    }
out:
    kvp_engine_destroy(e);
    for (int i = 0; fill && i < FILL_CONNS; i++)
        if (fill[i] >= 0) close(fill[i]);
    free(fill);
    kill(dead.pid, SIGCONT);
    kvpt_target_stop(&dead, 0);
    CHECK(kvpt_target_stop(&live, 0) == 0);
    if (mode == NETWORK_HOLE) kvpt_netns_destroy(&n);
    if (skip) kvpt_skip("%s", skip);
}

static void stopped_peer(void)
{
    run(STOPPED);
}

static void blackholed_peer(void)
{
    run(BACKLOG_HOLE);
}

static void network_blackholed_peer(void)
{
    run(NETWORK_HOLE);
}

int main(void)
{
    RUN_T(stopped_peer, 120);
    RUN_T(blackholed_peer, 120);
    RUN_T(network_blackholed_peer, 120);
    return kvpt_summary();
}
