#include "netbench.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "test.h"

#define STORE_PORT 8080
#define TARGET_PORT 17100
#define INITIATOR_PORT 17200 /* + the run's number: a new name for each run */
#define PIPE_PORT 17300
#define START_TIMEOUT_MS 30000
#define STOP_TIMEOUT_MS 30000

/* The whole of a small output file, or NULL. Free it. */
static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len < 2) {
            char *p = realloc(buf, cap *= 2);
            if (!p) free(buf);
            buf = p;
        }
    }
    fclose(f);
    if (buf) buf[len] = '\0';
    return buf;
}

/* Wait until path holds text, while pid lives; 0 when it does. */
static int wait_for_text(const char *path, const char *text, pid_t pid, int timeout_ms)
{
    for (int waited = 0; waited < timeout_ms; waited += 50) {
        char *s = slurp(path);
        int found = s && strstr(s, text);
        free(s);
        if (found) return 0;
        if (waitpid(pid, NULL, WNOHANG) == pid) return -1;
        usleep(50000);
    }
    return -1;
}

/* The JSON object on the last line that starts one, or NULL. */
static cJSON *last_json(const char *path)
{
    char *s = slurp(path);
    char *brace = s ? strrchr(s, '{') : NULL;
    cJSON *j = brace ? cJSON_Parse(brace) : NULL;
    free(s);
    return j;
}

static long json_long(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsNumber(v) ? (long)v->valuedouble : -1;
}

static double json_double(const cJSON *j, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

static void json_string(const cJSON *j, const char *key, char *out, size_t len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    snprintf(out, len, "%s", cJSON_IsString(v) ? v->valuestring : "");
}

static void out_path(const char *dir, const char *name, char *buf, size_t len)
{
    snprintf(buf, len, "%s/%s", dir, name);
}

static void remove_dir(const char *dir)
{
    static const char *files[] = {"store.out",     "target.out", "initiator.out",
                                  "mooncake.json", "sender.out", "receiver.out"};
    char path[128];
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        out_path(dir, files[i], path, sizeof path);
        unlink(path);
    }
    rmdir(dir);
}

static int make_dir(char *dir, size_t len)
{
    snprintf(dir, len, "/tmp/kvpt-netbench-XXXXXX");
    if (mkdtemp(dir)) return 0;
    fprintf(stderr, "  netbench: mkdtemp: %s\n", strerror(errno));
    return -1;
}

/* --------------------------------------------------------------- engine --- */

static char *str(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static char *str(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
    return buf;
}

int kvpt_engine_bench_start(kvpt_engine_bench *b, kvpt_netns *net)
{
    b->net = net;
    b->store = b->target = b->initiator = -1;
    b->target_rc = b->initiator_rc = -1;
    b->written = -1;
    if (make_dir(b->dir, sizeof b->dir)) return -1;
    char cli[512], port[16], path[128], meta[128], name[64], tmo[16];
    snprintf(cli, sizeof cli, "%s", kvpt_cli());
    char *store[] = {cli,          "metadata-server", "--host",
                     net->addr[0], "--port",          str(port, sizeof port, "%d", STORE_PORT),
                     NULL};
    out_path(b->dir, "store.out", path, sizeof path);
    b->store = kvpt_netns_spawn(net, 0, store, path);
    if (b->store < 0 || kvpt_netns_wait_port(net, 0, net->addr[0], STORE_PORT, START_TIMEOUT_MS)) {
        fprintf(stderr, "  netbench: the metadata server did not come up\n");
        return -1;
    }
    char *target[] = {cli,
                      "bench",
                      "--mode",
                      "target",
                      "--metadata-server",
                      str(meta, sizeof meta, "http://%s:%d/metadata", net->addr[0], STORE_PORT),
                      "--local-server-name",
                      str(name, sizeof name, "%s:%d", net->addr[0], TARGET_PORT),
                      "--buffer-size",
                      "4M",
                      "--verify",
                      "--no-shm",
                      "--timeout-ms",
                      str(tmo, sizeof tmo, "%d", b->timeout_ms),
                      NULL};
    out_path(b->dir, "target.out", path, sizeof path);
    b->target = kvpt_netns_spawn(net, 0, target, path);
    if (b->target < 0 || wait_for_text(path, "serving segment", b->target, START_TIMEOUT_MS)) {
        fprintf(stderr, "  netbench: the target did not come up\n");
        return -1;
    }
    return 0;
}

int kvpt_engine_bench_run(kvpt_engine_bench *b)
{
    static int runs;
    kvpt_netns *net = b->net;
    char cli[512], path[128], meta[128], name[64], seg[64], dur[32], tmo[16];
    snprintf(cli, sizeof cli, "%s", kvpt_cli());
    char *initiator[] = {cli,
                         "bench",
                         "--mode",
                         "initiator",
                         "--metadata-server",
                         str(meta, sizeof meta, "http://%s:%d/metadata", net->addr[0], STORE_PORT),
                         "--local-server-name",
                         str(name, sizeof name, "%s:%d", net->addr[1], INITIATOR_PORT + runs++),
                         "--segment-id",
                         str(seg, sizeof seg, "%s:%d", net->addr[0], TARGET_PORT),
                         "--operation",
                         (char *)b->operation,
                         "--block-size",
                         "64K",
                         "--batch-size",
                         "16",
                         "--threads",
                         "2",
                         "--buffer-size",
                         "4M",
                         "--duration",
                         str(dur, sizeof dur, "%.3f", b->duration_s),
                         "--verify",
                         "--no-shm",
                         "--json",
                         "--timeout-ms",
                         str(tmo, sizeof tmo, "%d", b->timeout_ms),
                         NULL};
    out_path(b->dir, "initiator.out", path, sizeof path);
    /* Right after a link comes back up, side 1 may not reach side 0 yet (its
     * neighbour entry failed during the outage): start once the store
     * answers from there. */
    if (kvpt_netns_wait_port(net, 1, net->addr[0], STORE_PORT, START_TIMEOUT_MS)) return -1;
    b->initiator_start_ns = kvpi_now_ns();
    b->initiator = kvpt_netns_spawn(net, 1, initiator, path);
    return b->initiator < 0 ? -1 : 0;
}

int kvpt_engine_bench_wait(kvpt_engine_bench *b, int timeout_ms)
{
    b->initiator_rc = kvpt_wait_child(b->initiator, timeout_ms);
    b->initiator = -1;
    b->initiator_s = (double)(kvpi_now_ns() - b->initiator_start_ns) / 1e9;
    char path[128];
    out_path(b->dir, "initiator.out", path, sizeof path);
    cJSON *j = last_json(path);
    b->ops = json_long(j, "ops");
    b->errors = json_long(j, "errors");
    b->mismatches = json_long(j, "mismatches");
    b->read_back = json_long(j, "read_back");
    b->gbps = json_double(j, "gbps");
    json_string(j, "transport", b->transport, sizeof b->transport);
    cJSON_Delete(j);
    fprintf(stderr,
            "  initiator %s: exit %d after %.2f s, %ld ops, %ld errors, %ld mismatches, "
            "%ld read back, %.4f GB/s via %s\n",
            b->operation, b->initiator_rc, b->initiator_s, b->ops, b->errors, b->mismatches,
            b->read_back, b->gbps, b->transport);
    return b->initiator_rc;
}

int kvpt_engine_bench_stop(kvpt_engine_bench *b)
{
    if (b->initiator > 0) kvpt_wait_child(b->initiator, 0);
    if (b->target > 0) {
        kill(b->target, SIGTERM);
        b->target_rc = kvpt_wait_child(b->target, STOP_TIMEOUT_MS);
        char path[128];
        out_path(b->dir, "target.out", path, sizeof path);
        char *s = slurp(path);
        const char *ok = s ? strstr(s, "verify OK (") : NULL;
        b->written = ok ? strtol(ok + strlen("verify OK ("), NULL, 10) : -1;
        free(s);
        fprintf(stderr, "  target: exit %d, %ld bytes found written\n", b->target_rc, b->written);
    }
    if (b->store > 0) {
        kill(b->store, SIGTERM);
        kvpt_wait_child(b->store, STOP_TIMEOUT_MS);
    }
    b->target = b->store = -1;
    if (b->dir[0]) remove_dir(b->dir);
    b->dir[0] = '\0';
    return b->target_rc;
}

void kvpt_engine_bench_check_clean(const kvpt_engine_bench *b)
{
    CHECK(b->initiator_rc == 0);
    CHECK(strcmp(b->transport, "tcp") == 0);
    CHECK(b->ops > 0);
    CHECK(b->errors == 0);
    CHECK(b->mismatches == 0);
    if (strcmp(b->operation, "write") == 0) CHECK(b->read_back > 0);
}

/* ----------------------------------------------------------------- pipe --- */

static int write_config(const kvpt_pipe_bench *b, char *path, size_t len)
{
    out_path(b->dir, "mooncake.json", path, len);
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fprintf(
        f,
        "{\"prefill_url\": \"%s:%d\", \"decode_url\": \"%s:%d\", "
        "\"metadata_server\": \"P2PHANDSHAKE\", \"protocol\": \"tcp\", \"device_name\": \"\"}\n",
        b->net->addr[0], PIPE_PORT, b->net->addr[1], PIPE_PORT);
    return fclose(f);
}

int kvpt_pipe_bench_start(kvpt_pipe_bench *b, kvpt_netns *net)
{
    b->net = net;
    b->sender = b->receiver = -1;
    if (make_dir(b->dir, sizeof b->dir)) return -1;
    char cli[512], config[128], path[128], count[32], tmo[16];
    snprintf(cli, sizeof cli, "%s", kvpt_cli());
    if (write_config(b, config, sizeof config)) {
        fprintf(stderr, "  netbench: cannot write %s\n", config);
        return -1;
    }
    b->start_ns = kvpi_now_ns();
    /* Receiver first: the sender's first send waits for it anyway. */
    for (int rank = 1; rank >= 0; rank--) {
        char *argv[] = {cli,
                        "bench",
                        "--pipe",
                        "--config",
                        config,
                        "--kv-rank",
                        rank ? "1" : "0",
                        "--tensor-size",
                        (char *)b->tensor_size,
                        "--count",
                        str(count, sizeof count, "%ld", b->count),
                        "--kv-buffer-size",
                        "4M",
                        "--warmup",
                        "2",
                        "--verify",
                        "--no-shm",
                        "--json",
                        "--timeout-ms",
                        str(tmo, sizeof tmo, "%d", b->timeout_ms),
                        NULL};
        out_path(b->dir, rank ? "receiver.out" : "sender.out", path, sizeof path);
        pid_t pid = kvpt_netns_spawn(net, rank ? 1 : 0, argv, path);
        if (pid < 0) return -1;
        *(rank ? &b->receiver : &b->sender) = pid;
    }
    return 0;
}

int kvpt_pipe_bench_wait(kvpt_pipe_bench *b, int timeout_ms)
{
    b->receiver_rc = kvpt_wait_child(b->receiver, timeout_ms);
    b->seconds = (double)(kvpi_now_ns() - b->start_ns) / 1e9;
    int left = timeout_ms - (int)(b->seconds * 1000);
    b->sender_rc = kvpt_wait_child(b->sender, left > 0 ? left : 0);
    b->receiver = b->sender = -1;
    char path[128];
    out_path(b->dir, "receiver.out", path, sizeof path);
    cJSON *j = last_json(path);
    b->ops = json_long(j, "ops");
    b->errors = json_long(j, "errors");
    b->lost = json_long(j, "lost");
    b->duplicated = json_long(j, "duplicated");
    b->reordered = json_long(j, "reordered");
    b->corrupt = json_long(j, "corrupt");
    b->failed = json_long(j, "failed");
    b->gbps = json_double(j, "gbps");
    json_string(j, "transport", b->transport, sizeof b->transport);
    cJSON_Delete(j);
    remove_dir(b->dir);
    fprintf(stderr,
            "  pipe: receiver exit %d, sender exit %d after %.2f s: %ld received, "
            "%ld lost, %ld duplicated, %ld reordered, %ld corrupt, %ld failed, %.4f GB/s via %s\n",
            b->receiver_rc, b->sender_rc, b->seconds, b->ops, b->lost, b->duplicated, b->reordered,
            b->corrupt, b->failed, b->gbps, b->transport);
    return b->receiver_rc;
}

void kvpt_pipe_bench_check_clean(const kvpt_pipe_bench *b)
{
    CHECK(b->receiver_rc == 0);
    CHECK(b->sender_rc == 0);
    CHECK(strcmp(b->transport, "tcp") == 0);
    CHECK(b->ops == b->count);
    CHECK(b->errors == 0);
    CHECK(b->lost == 0 && b->duplicated == 0 && b->reordered == 0);
    CHECK(b->corrupt == 0 && b->failed == 0);
}

/* ---- the network fault tests' fixture ---- */

#include "test.h"

int kvpt_netns_pair(kvpt_netns *n, kvpt_net_unavailable_fn unavailable, kvpt_net_fault_fn fault,
                    int amount)
{
    const char *why = kvpt_netns_unavailable();
    if (why) kvpt_skip("%s", why);
    if (kvpt_netns_create(n)) {
        fprintf(stderr, "  %s\n", n->why);
        return -1;
    }
    if (!fault) return 0;
    if (unavailable && (why = unavailable(n))) kvpt_skip("%s", why);
    if (fault(n, amount) == 0) return 0;
    fprintf(stderr, "  %s\n", n->why);
    kvpt_netns_destroy(n);
    return -1;
}

int kvpt_engine_bench_case(kvpt_engine_bench *b, kvpt_netns *n, kvpt_net_fault_fn during, int arg,
                           int bound_ms)
{
    int started = kvpt_engine_bench_start(b, n) == 0 && kvpt_engine_bench_run(b) == 0;
    CHECK(started);
    if (started) {
        if (during) CHECK(during(n, arg) == 0);
        kvpt_engine_bench_wait(b, bound_ms);
        kvpt_engine_bench_check_clean(b);
    }
    CHECK(kvpt_engine_bench_stop(b) == 0);
    CHECK(b->written >= 0);
    return started;
}

void kvpt_pipe_bench_case(kvpt_pipe_bench *b, kvpt_netns *n, kvpt_net_fault_fn during, int arg,
                          int bound_ms)
{
    CHECK(kvpt_pipe_bench_start(b, n) == 0);
    if (during) CHECK(during(n, arg) == 0);
    kvpt_pipe_bench_wait(b, bound_ms);
}
