/* kvpipe bench as an operator runs it: the sweep's table and JSON hold every
 * point; latency percentiles come with throughput; Mooncake's command line
 * drives it against a target in another process; both sides in one call. */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "peer.h"
#include "test.h"

static char out[1 << 16];

/* Run `kvpipe ARGS` (shell text), stdout into out; returns the exit status. */
static int run(const char *args)
{
    return kvpt_cli_run(args, out, sizeof out);
}

/* The last line of out, parsed. */
static cJSON *last_json(void)
{
    return cJSON_Parse(kvpt_last_line(out));
}

static double num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

/* A sweep of 2 x 2 x 2 points: each point once in the JSON and once in the
 * table, each with throughput and ordered percentiles. */
static void sweep_has_every_point(void)
{
    REQUIRE(run("bench --sweep --block-size 4K,64K --batch-size 1,8 --threads 1,2 --duration 0.3 "
                "--json") == 0);
    cJSON *doc = last_json();
    REQUIRE(doc);
    const cJSON *points = cJSON_GetObjectItemCaseSensitive(doc, "points");
    CHECK(cJSON_GetArraySize(points) == 8);
    const size_t blocks[] = {4096, 65536}, batches[] = {1, 8}, threads[] = {1, 2};
    int seen[2][2][2] = {{{0}}};
    const cJSON *p;
    cJSON_ArrayForEach(p, points)
    {
        int a = -1, b = -1, c = -1;
        for (int i = 0; i < 2; i++) {
            if (num(p, "block_size") == (double)blocks[i]) a = i;
            if (num(p, "batch_size") == (double)batches[i]) b = i;
            if (num(p, "threads") == (double)threads[i]) c = i;
        }
        REQUIRE(a >= 0 && b >= 0 && c >= 0);
        seen[a][b][c]++;
        double p50 = num(p, "p50_ms"), p99 = num(p, "p99_ms"), p999 = num(p, "p999_ms");
        CHECK(num(p, "gbps") > 0 && num(p, "ops") > 0 && num(p, "errors") == 0);
        CHECK(num(p, "batches") > 0 && num(p, "ops") == num(p, "batches") * batches[b]);
        CHECK(num(p, "bytes") == num(p, "ops") * blocks[a]);
        CHECK(p50 > 0 && p50 <= p99 && p99 <= p999);
    }
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 2; c++)
                CHECK(seen[a][b][c] == 1);
    const cJSON *tr = cJSON_GetObjectItemCaseSensitive(doc, "transport");
    CHECK(cJSON_IsString(tr) &&
          (!strcmp(tr->valuestring, "shm") || !strcmp(tr->valuestring, "tcp")));
    cJSON_Delete(doc);
    /* The table: a header and one row per point. */
    CHECK(strstr(out, "sweep of 8 points") != NULL);
    CHECK(strstr(out, "p50 ms") && strstr(out, "p99 ms") && strstr(out, "p999 ms"));
    int rows = 0;
    for (char *l = out; (l = strstr(l, "\n")); l++)
        rows += !strncmp(l + 1, "     4 KiB", 10) || !strncmp(l + 1, "    64 KiB", 10);
    CHECK(rows == 8);
}

/* Mooncake's transfer_engine_bench flags, target and initiator as two
 * processes through an HTTP store: the unit and precision asked for, and
 * Mooncake's result line. */
static void mooncake_command_line(void)
{
    char url[160], args[1024], target[64];
    pid_t store = kvpt_http_store_start(url, sizeof url);
    REQUIRE(store > 0);
    int port = kvpt_free_port();
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    char *targv[] = {(char *)kvpt_cli(),
                     "bench",
                     "--mode=target",
                     NULL,
                     NULL,
                     "--protocol=tcp",
                     "--buffer_size=16777216",
                     "--no-shm",
                     NULL};
    char l1[96], l2[256];
    snprintf(l1, sizeof l1, "--local_server_name=%s", target);
    snprintf(l2, sizeof l2, "--metadata_server=%s", url);
    targv[3] = l1;
    targv[4] = l2;
    /* It serves once it says so: its ports open before its buffer is
     * registered. */
    pid_t t = kvpt_spawn_until(targv, "serving segment", 10000);
    REQUIRE(t > 0);
    snprintf(args, sizeof args,
             "bench --mode=initiator --local_server_name=127.0.0.1:%d --metadata_server=%s "
             "--segment_id=%s --protocol=tcp --device_name=mlx5_2 --operation=write "
             "--buffer_size=16777216 --batch_size=16 --block_size=65536 --duration=1 --threads=1 "
             "--report_unit=MiB --report_precision=1 --no-shm --json",
             kvpt_free_port(), url, target);
    CHECK(run(args) == 0);
    double mibs = 0, tput = 0, dur = 0;
    unsigned long long batches = 0;
    char *line = strstr(out, "kvpipe bench: write 65536 B x 16 x 1 threads via tcp: ");
    CHECK(line && sscanf(line, "kvpipe bench: write 65536 B x 16 x 1 threads via tcp: %lf MiB/s",
                         &mibs) == 1);
    line = strstr(out, "Test completed: duration ");
    CHECK(line &&
          sscanf(line, "Test completed: duration %lf, batch count %llu, throughput %lf MiB/s", &dur,
                 &batches, &tput) == 3);
    CHECK(batches > 0 && tput == mibs && dur > 0.9);
    /* One digit after the point, as asked. */
    char *dot = line ? strstr(line, "throughput ") : NULL;
    dot = dot ? strchr(dot, '.') : NULL;
    CHECK(dot && dot[2] == ' ');
    cJSON *doc = last_json();
    CHECK(doc && num(doc, "errors") == 0 && num(doc, "batches") == (double)batches);
    /* The same figure in MiB/s (both rounded: to 0.1 MiB/s and 0.0001 GB/s). */
    CHECK(doc && num(doc, "gbps") > 0 && fabs(mibs - num(doc, "gbps") * 1e9 / 1048576) < 0.2);
    cJSON_Delete(doc);
    kill(t, SIGTERM);
    CHECK(kvpt_wait_child(t, 20000) == 0);
    kill(store, SIGTERM);
    kvpt_wait_child(store, 10000);
}

/* Without --mode both sides run here; write --verify checks every byte on
 * both sides, after the warm-up pass read the whole span and wrote it back
 * (the target's check on exit fails if that changed a byte). --no-warmup
 * starts the clock at once. */
static void both_sides_verify(void)
{
    CHECK(run("bench --operation write --verify --duration 0.5 --block-size 64K --batch-size 8 "
              "--json") == 0);
    CHECK(strstr(out, ", verified;") != NULL);
    cJSON *doc = last_json();
    CHECK(doc && num(doc, "mismatches") == 0 && num(doc, "read_back") > 0);
    CHECK(doc && num(doc, "p50_ms") > 0);
    CHECK(doc && num(doc, "warmup_bytes") == 256.0 * 1024 * 1024 && num(doc, "warmup_seconds") > 0);
    CHECK(strstr(out, "warm-up, not timed: read and written back 256 MiB") != NULL);
    cJSON_Delete(doc);
    /* A run too short to write the whole span itself: what it did not
     * write holds what the warm-up wrote back, which must be the target's
     * own pattern. */
    CHECK(run("bench --operation write --verify --duration 0.05 --block-size 4K --batch-size 1 "
              "--threads 1 --json") == 0);
    doc = last_json();
    CHECK(doc && num(doc, "ops") * 4096 < 128.0 * 1024 * 1024);
    cJSON_Delete(doc);
    CHECK(run("bench --protocol tcp --no-shm --duration 0.3 --batch-size 1 --threads 1 "
              "--no-warmup --json") == 0);
    CHECK(strstr(out, "warm-up") == NULL);
    doc = last_json();
    CHECK(doc && num(doc, "warmup_bytes") == 0);
    const cJSON *tr = doc ? cJSON_GetObjectItemCaseSensitive(doc, "transport") : NULL;
    CHECK(cJSON_IsString(tr) && !strcmp(tr->valuestring, "tcp"));
    CHECK(doc && num(doc, "batches") == num(doc, "ops"));
    cJSON_Delete(doc);
}

/* The local memory each initiator thread walks: a block per request of a
 * batch by default, --local-span rounded down to whole blocks (one at
 * least). */
static void local_span(void)
{
    static const struct {
        const char *span;
        double bytes;
    } rows[] = {{"", 8 * 65536.0},
                {"--local-span 64K", 65536.0},
                {"--local-span 200K", 3 * 65536.0},
                {"--local-span 1K", 65536.0}};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        char args[300];
        snprintf(args, sizeof args,
                 "bench --protocol tcp --no-shm --duration 0.2 --block-size 64K --batch-size 8 "
                 "--threads 1 --buffer-size 1M --json %s",
                 rows[i].span);
        CHECK(run(args) == 0);
        cJSON *doc = last_json();
        CHECK(doc && num(doc, "local_bytes") == rows[i].bytes && num(doc, "errors") == 0);
        if (!doc || num(doc, "local_bytes") != rows[i].bytes)
            fprintf(stderr, "  %s: local_bytes %.0f, want %.0f\n", rows[i].span,
                    doc ? num(doc, "local_bytes") : -1, rows[i].bytes);
        cJSON_Delete(doc);
    }
}

int main(void)
{
    RUN_T(sweep_has_every_point, 180);
    RUN(mooncake_command_line);
    RUN(both_sides_verify);
    RUN(local_span);
    return kvpt_summary();
}
