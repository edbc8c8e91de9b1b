/* Network faults: a rate-limited link between two network namespaces.
 *
 * A token bucket filter (tc tbf) on both veth ends limits the link to
 * RATE_KBIT. A slow link is no error: the expected outcome is a clean run at
 * no more than the link's rate, the engine bench's READs and WRITEs and the
 * pipe bench with 0 errors, 0 wrong bytes and every tensor received once and
 * in order. The measured rate staying under the limit proves the limit was in
 * place (a busy machine can only make it slower). See docs/reliability.md. */
#include "netbench.h"
#include "netns.h"
#include "test.h"

#define RATE_KBIT 20000  /* 2.5 MB/s */
#define TIMEOUT_MS 10000 /* the engines' I/O timeout */
#define DURATION_S 3.0   /* engine bench */
#define BOUND_MS 90000   /* a run that takes longer than this has hung */
/* Payload cannot pass the link's rate; allow for the token bucket's burst. */
#define MAX_GBPS (RATE_KBIT * 1000.0 / 8 / 1e9 * 1.25)

static int slow_pair(kvpt_netns *n)
{
    return kvpt_netns_pair(n, kvpt_net_rate_unavailable, kvpt_net_rate, RATE_KBIT);
}

static void engine_case(const char *operation)
{
    kvpt_netns n;
    REQUIRE(slow_pair(&n) == 0);
    kvpt_engine_bench b = {
        .operation = operation, .duration_s = DURATION_S, .timeout_ms = TIMEOUT_MS};
    if (kvpt_engine_bench_case(&b, &n, NULL, 0, BOUND_MS)) CHECK(b.gbps > 0 && b.gbps <= MAX_GBPS);
    kvpt_netns_destroy(&n);
}

static void test_rate_engine_read(void)
{
    engine_case("read");
}

static void test_rate_engine_write(void)
{
    engine_case("write");
}

static void test_rate_pipe(void)
{
    kvpt_netns n;
    REQUIRE(slow_pair(&n) == 0);
    /* 24 x 256 KiB: about 2.5 s at the limit. */
    kvpt_pipe_bench b = {.tensor_size = "256K", .count = 24, .timeout_ms = TIMEOUT_MS};
    kvpt_pipe_bench_case(&b, &n, NULL, 0, BOUND_MS);
    kvpt_pipe_bench_check_clean(&b);
    CHECK(b.gbps > 0 && b.gbps <= MAX_GBPS);
    kvpt_netns_destroy(&n);
}

int main(void)
{
    RUN_T(test_rate_engine_read, 150);
    RUN_T(test_rate_engine_write, 150);
    RUN_T(test_rate_pipe, 150);
    return kvpt_summary();
}
