/* kvpipe demo, as a user runs it (the CLI spawns the prefill and decode
 * processes): the first request is reported apart from the steady state,
 * with what it paid for; --json carries both; --baseline, --send in-place
 * and torch dtype names work. Small shapes: figures are not checked, only
 * that each is there and consistent. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>

#include "test.h"

static char out[1 << 16];

static int run(const char *args)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s demo %s 2>/dev/null", kvpt_cli(), args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static cJSON *last_json(void)
{
    size_t n = strlen(out);
    while (n && out[n - 1] == '\n')
        out[--n] = '\0';
    char *last = strrchr(out, '\n');
    return cJSON_Parse(last ? last + 1 : out);
}

static double num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static void first_and_steady(void)
{
    REQUIRE(run("--requests 4 --tokens 64 --layers 2 --json") == 0);
    CHECK(strstr(out, "every byte verified") != NULL);
    double first = 0, p50 = 0, p99 = 0, gbps = 0;
    const char *l = strstr(out, "  first request ");
    CHECK(l && sscanf(l, "  first request %lf ms", &first) == 1 && first > 0);
    CHECK(l && strstr(l, "(connections and lookups; memory pre-faulted)") != NULL);
    l = strstr(out, "  steady state, requests 2..4: ");
    CHECK(l &&
          sscanf(l, "  steady state, requests 2..4: p50 %lf ms, p99 %lf ms per request, %lf GB/s",
                 &p50, &p99, &gbps) == 3);
    CHECK(p50 > 0 && p50 <= p99 && gbps > 0);
    cJSON *doc = last_json();
    REQUIRE(doc);
    CHECK(num(doc, "requests") == 4 && num(doc, "errors") == 0);
    CHECK(fabs(num(doc, "first_ms") - first) < 0.1);
    CHECK(fabs(num(doc, "steady_p50_ms") - p50) < 0.1 &&
          fabs(num(doc, "steady_p99_ms") - p99) < 0.1);
    CHECK(num(doc, "steady_gbps") > 0 && num(doc, "gbps") > 0);
    CHECK(num(doc, "p50_ms") <= num(doc, "p99_ms")); /* every request, as before */
    CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(doc, "prefault")));
    CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(doc, "memcpy_gbps")));
    const cJSON *send = cJSON_GetObjectItemCaseSensitive(doc, "send");
    CHECK(cJSON_IsString(send) && !strcmp(send->valuestring, "copy"));
    cJSON_Delete(doc);
}

/* With two requests, the first and the steady state's one are the two
 * latencies that the percentiles over every request are made of: p50 of two
 * is the smaller (nearest rank), p99 the larger. */
static void first_is_the_first(void)
{
    REQUIRE(run("--requests 2 --tokens 64 --layers 2 --json") == 0);
    cJSON *doc = last_json();
    REQUIRE(doc);
    double first = num(doc, "first_ms"), steady = num(doc, "steady_p50_ms");
    double lo = first < steady ? first : steady, hi = first < steady ? steady : first;
    CHECK(fabs(num(doc, "p50_ms") - lo) < 0.002 && fabs(num(doc, "p99_ms") - hi) < 0.002);
    CHECK(num(doc, "steady_p99_ms") == steady);
    cJSON_Delete(doc);
}

/* Without pre-faulting the first request says it paid for fresh memory; one
 * request has no steady state. */
static void cold_single_request(void)
{
    REQUIRE(run("--requests 1 --tokens 256 --layers 2 --no-prefault --json") == 0);
    CHECK(strstr(out, "(page faults of fresh memory, connections and lookups)") != NULL);
    CHECK(strstr(out, "steady state") == NULL);
    cJSON *doc = last_json();
    REQUIRE(doc);
    CHECK(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(doc, "prefault")));
    CHECK(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(doc, "steady_p50_ms")));
    CHECK(num(doc, "first_ms") > 0 && num(doc, "first_ms") == num(doc, "p50_ms"));
    cJSON_Delete(doc);
}

/* The memcpy of the same bytes, the in-place send, P2P, a torch dtype name. */
static void baseline_in_place_p2p(void)
{
    REQUIRE(run("--requests 2 --tokens 32 --layers 2 --baseline --send in-place "
                "--metadata-server p2p --dtype torch.bfloat16 --no-shm --json") == 0);
    CHECK(strstr(out, "over tcp") != NULL);
    CHECK(strstr(out, "  memcpy of the same bytes (one thread, pre-faulted): ") != NULL);
    CHECK(strstr(out, "in-place send; ") != NULL);
    CHECK(strstr(out, "BF16") != NULL);
    cJSON *doc = last_json();
    REQUIRE(doc);
    CHECK(num(doc, "memcpy_gbps") > 0 && num(doc, "memcpy_ms") > 0);
    const cJSON *send = cJSON_GetObjectItemCaseSensitive(doc, "send");
    CHECK(cJSON_IsString(send) && !strcmp(send->valuestring, "in-place"));
    cJSON_Delete(doc);
}

/* The README's first command as a user runs it: no arguments, the default
 * Llama-3-8B shape, whose keys and values (64 MiB each) pass the pipe's
 * default recv_window_bytes; it deadlocked in most runs (issue 21). Then the
 * same shape with the variations users reach for. Each must pass, every
 * byte verified. */
static void check_default_shape(const char *args)
{
    char a[256];
    snprintf(a, sizeof a, "%s --json", args);
    int rc = run(a);
    if (rc != 0) fprintf(stderr, "  kvpipe demo %s: exit %d\n%s", a, rc, out);
    REQUIRE(rc == 0);
    CHECK(strstr(out, "every byte verified") != NULL);
    cJSON *doc = last_json();
    REQUIRE(doc);
    CHECK(num(doc, "errors") == 0 && num(doc, "tokens") == 1024);
    cJSON_Delete(doc);
}

static void defaults(void)
{
    int rc = run("");
    if (rc != 0) fprintf(stderr, "  kvpipe demo: exit %d\n%s", rc, out);
    CHECK(rc == 0 && strstr(out, "every byte verified") != NULL);
}

static void default_shape_16_requests(void)
{
    check_default_shape("--requests 16");
}

static void default_shape_no_shm(void)
{
    check_default_shape("--no-shm");
}

static void default_shape_in_place(void)
{
    check_default_shape("--send in-place");
}

static void default_shape_rdma_ucx_tcp(void)
{
    if (!KVP_HAVE_UCX) SKIP("built without UCX");
    check_default_shape("--protocol rdma --no-shm --requests 4");
}

int main(void)
{
    setenv("UCX_TLS", "tcp", 1); /* read by the rdma case's sides only */
    RUN_T(defaults, 240);
    RUN_T(default_shape_16_requests, 240);
    RUN_T(default_shape_no_shm, 240);
    RUN_T(default_shape_in_place, 240);
    RUN_T(default_shape_rdma_ucx_tcp, 240);
    RUN_T(first_and_steady, 180);
    RUN_T(first_is_the_first, 180);
    RUN_T(cold_single_request, 180);
    RUN_T(baseline_in_place_p2p, 180);
    return kvpt_summary();
}
