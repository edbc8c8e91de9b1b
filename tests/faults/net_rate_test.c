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

/* The engine bench's READs or WRITEs (what: its operation), or the pipe
 * bench (what: "pipe"), over the slow link: clean, at no more than its rate. */
static void rate_case(const char *what)
{
    kvpt_netns n;
    REQUIRE(slow_pair(&n) == 0);
    if (strcmp(what, "pipe") == 0) {
        /* 24 x 256 KiB: about 2.5 s at the limit. */
        kvpt_pipe_bench b = {.tensor_size = "256K", .count = 24, .timeout_ms = TIMEOUT_MS};
        kvpt_pipe_bench_case(&b, &n, NULL, 0, BOUND_MS);
        kvpt_pipe_bench_check_clean(&b);
        CHECK(b.gbps > 0 && b.gbps <= MAX_GBPS);
    } else {
        kvpt_engine_bench b = {
            .operation = what, .duration_s = DURATION_S, .timeout_ms = TIMEOUT_MS};
        if (kvpt_engine_bench_case(&b, &n, NULL, 0, BOUND_MS))
            CHECK(b.gbps > 0 && b.gbps <= MAX_GBPS);
    }
    kvpt_netns_destroy(&n);
}

int main(void)
{
    kvpt_run_with("test_rate_engine_read", rate_case, "read", 150);
    kvpt_run_with("test_rate_engine_write", rate_case, "write", 150);
    kvpt_run_with("test_rate_pipe", rate_case, "pipe", 150);
    return kvpt_summary();
}
