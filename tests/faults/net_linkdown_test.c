/* Network faults: the link between two network namespaces goes down for a
 * while, then comes back (ip link set down / up on one veth end).
 *
 * What must happen depends on the outage against the engines' I/O timeout
 * (--timeout-ms), and is never a hang nor a wrong byte:
 *
 * - shorter than the timeout (SHORT_OUTAGE_MS against SHORT_TIMEOUT_MS): TCP
 *   retransmits once the link is back, the requests in flight finish late but
 *   finish, and the run is clean: 0 errors, every byte right, every tensor
 *   received once and in order.
 * - longer (LONG_OUTAGE_MS against LONG_TIMEOUT_MS): the requests in flight
 *   fail with a clean error within a few timeouts, while the link is still
 *   down; the engine bench's initiator exits 1 and reports it; the target
 *   serves a new initiator once the link is back. The pipe's receiver reports
 *   each tensor whose READ failed (lost, with an error) and receives the rest
 *   intact and in order once the link is back: nothing is lost silently,
 *   duplicated or reordered.
 *
 * See docs/reliability.md. */
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "netbench.h"
#include "netns.h"
#include "test.h"

#define SHORT_OUTAGE_MS 3000
#define SHORT_TIMEOUT_MS 20000 /* TCP's retransmit backoff after 3 s: under 7 s */
#define LONG_OUTAGE_MS 10000
#define LONG_TIMEOUT_MS 2000
/* A request fails within its timeout; the initiator then stops its engine,
 * whose own calls (unpublishing from the store across the dead link) are
 * bounded by the same timeout. */
#define GIVE_UP_MS (4 * LONG_TIMEOUT_MS + 2000)
#define LEAD_MS 2000    /* traffic flows before the link goes down */
#define BOUND_MS 90000  /* a run that takes longer than this has hung */
#define RATE_KBIT 20000 /* the pipe's link, so that its run spans the outage */

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static int pair(kvpt_netns *n)
{
    return kvpt_netns_pair(n, NULL, NULL, 0);
}

/* The link down for outage_ms, LEAD_MS into a run. */
static int outage(kvpt_netns *n, int outage_ms)
{
    sleep_ms(LEAD_MS);
    if (kvpt_net_link_down(n)) {
        fprintf(stderr, "  %s\n", n->why);
        return -1;
    }
    uint64_t t0 = kvpi_now_ms();
    sleep_ms(outage_ms);
    if (kvpt_net_link_up(n)) {
        fprintf(stderr, "  %s\n", n->why);
        return -1;
    }
    /* Load can stretch it: TCP's retransmit backoff grows with it. */
    fprintf(stderr, "  the link was down %llu ms (%d asked)\n",
            (unsigned long long)(kvpi_now_ms() - t0), outage_ms);
    return 0;
}

static void short_engine_case(const char *operation)
{
    kvpt_netns n;
    REQUIRE(pair(&n) == 0);
    kvpt_engine_bench b = {.operation = operation,
                           .duration_s = (LEAD_MS + SHORT_OUTAGE_MS + 2000) / 1000.0,
                           .timeout_ms = SHORT_TIMEOUT_MS};
    kvpt_engine_bench_case(&b, &n, outage, SHORT_OUTAGE_MS, BOUND_MS);
    kvpt_netns_destroy(&n);
}

static void test_linkdown_short_engine_read(void)
{
    short_engine_case("read");
}

static void test_linkdown_short_engine_write(void)
{
    short_engine_case("write");
}

static void long_engine_case(const char *operation)
{
    kvpt_netns n;
    REQUIRE(pair(&n) == 0);
    kvpt_engine_bench b = {.operation = operation, .duration_s = 60, .timeout_ms = LONG_TIMEOUT_MS};
    int started = kvpt_engine_bench_start(&b, &n) == 0 && kvpt_engine_bench_run(&b) == 0;
    CHECK(started);
    if (started) {
        sleep_ms(LEAD_MS);
        CHECK(kvpt_net_link_down(&n) == 0);
        uint64_t down = kvpi_now_ms();
        /* It gives up, cleanly, before the link is back. */
        kvpt_engine_bench_wait(&b, GIVE_UP_MS);
        uint64_t gave_up = kvpi_now_ms() - down;
        fprintf(stderr, "  gave up %.2f s after the link went down\n", gave_up / 1000.0);
        CHECK(b.initiator_rc == 1);
        CHECK(b.errors > 0);
        CHECK(b.mismatches == 0);
        if (gave_up < LONG_OUTAGE_MS) sleep_ms((int)(LONG_OUTAGE_MS - gave_up));
        CHECK(kvpt_net_link_up(&n) == 0);
        /* The target serves a new initiator (a WRITE one rewrites every
         * block, whatever the failed requests left half-written). */
        b.duration_s = 2;
        CHECK(kvpt_engine_bench_run(&b) == 0);
        kvpt_engine_bench_wait(&b, BOUND_MS);
        kvpt_engine_bench_check_clean(&b);
        if (strcmp(operation, "write") == 0) CHECK(b.read_back == 64);
    }
    CHECK(kvpt_engine_bench_stop(&b) == 0);
    if (strcmp(operation, "write") == 0) CHECK(b.written == 4 << 20);
    kvpt_netns_destroy(&n);
}

static void test_linkdown_long_engine_read(void)
{
    long_engine_case("read");
}

static void test_linkdown_long_engine_write(void)
{
    long_engine_case("write");
}

/* A pipe run over a rate-limited link, long enough to span the outage (60 x
 * 256 KiB: about 6 s at the rate). 0, or -1 when it could not be run. */
static int pipe_case(int outage_ms, int timeout_ms, kvpt_pipe_bench *b)
{
    *b = (kvpt_pipe_bench){.tensor_size = "256K", .count = 60, .timeout_ms = timeout_ms};
    kvpt_netns n;
    if (kvpt_netns_pair(&n, kvpt_net_rate_unavailable, kvpt_net_rate, RATE_KBIT)) return -1;
    if (kvpt_pipe_bench_start(b, &n)) {
        fprintf(stderr, "  %s\n", n.why);
        kvpt_netns_destroy(&n);
        return -1;
    }
    CHECK(outage(&n, outage_ms) == 0);
    kvpt_pipe_bench_wait(b, BOUND_MS);
    kvpt_netns_destroy(&n);
    return 0;
}

static void test_linkdown_short_pipe(void)
{
    kvpt_pipe_bench b;
    REQUIRE(pipe_case(SHORT_OUTAGE_MS, SHORT_TIMEOUT_MS, &b) == 0);
    kvpt_pipe_bench_check_clean(&b);
}

static void test_linkdown_long_pipe(void)
{
    kvpt_pipe_bench b;
    REQUIRE(pipe_case(LONG_OUTAGE_MS, LONG_TIMEOUT_MS, &b) == 0);
    /* Each tensor arrives intact and in order, or its loss is reported. */
    CHECK(b.sender_rc == 0);
    CHECK(b.receiver_rc == (b.failed ? 1 : 0));
    CHECK(b.ops + b.failed == b.count);
    CHECK(b.lost == b.failed);
    CHECK(b.duplicated == 0 && b.reordered == 0 && b.corrupt == 0);
}

int main(void)
{
    RUN_T(test_linkdown_short_engine_read, 150);
    RUN_T(test_linkdown_short_engine_write, 150);
    RUN_T(test_linkdown_short_pipe, 150);
    RUN_T(test_linkdown_long_engine_read, 150);
    RUN_T(test_linkdown_long_engine_write, 150);
    RUN_T(test_linkdown_long_pipe, 150);
    return kvpt_summary();
}
