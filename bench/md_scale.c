/* md_scale: segment lookups and descriptor changes with many segments in one
 * metadata store (docs/bench.md, "Metadata at scale").
 *
 *   md_scale --metadata-server etcd://127.0.0.1:2379 [--segments 1000]
 *            [--changes 100] [--rounds 5]
 *
 * A target engine registers one buffer; N segments "md_scale-<pid>-<i>" are
 * written to the store as copies of its descriptor under their own names
 * (ram and rpc_meta keys, as an engine publishes them). An initiator engine
 * then opens every segment:
 *   cold  the first kvp_engine_open_segment() of each: the engine's lookup
 *         (the store's ram and rpc_meta keys, parse, the transport's peer
 *         state; tcp connects lazily, so no connection is made);
 *   warm  each segment opened again, --rounds times: the cached descriptor.
 * Then --changes times a cached segment's descriptor is rewritten in the
 * store and the time until the initiator's cache has dropped it (its watch
 * saw the change and revalidated) is taken from just before the write.
 * Baselines from the same run: one GET of a segment's key through the same
 * store client (the round trip a cold lookup makes twice) and one PUT (the
 * write a change is). Prints a table and, last, one JSON line. The keys are
 * deleted at the end. */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench_util.h"
#include "common/clock.h"
#include "engine/engine_internal.h"
#include "kvpipe/kvpipe.h"
#include "metadata/metadata.h"

#define BUF_LEN 65536

/* Nearest-rank percentile of n samples (sorted here), in ms. */
static double pct_ms(uint64_t *ns, size_t n, double p)
{
    if (!n) return -1;
    qsort(ns, n, sizeof *ns, bench_cmp_u64);
    size_t rank = (size_t)(p / 100.0 * (double)n + 0.999999);
    if (rank < 1) rank = 1;
    if (rank > n) rank = n;
    return (double)ns[rank - 1] / 1e6;
}

static void die(const char *what)
{
    fprintf(stderr, "md_scale: %s: %s\n", what, kvp_last_error());
    exit(1);
}

/* An engine on a free port (a ":0" name is named after the port it gets). */
static kvp_engine *engine(const char *conn)
{
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = "127.0.0.1:0";
    o.metadata = conn;
    o.disable_shm = 1;
    o.conns_per_peer = 1;
    kvp_engine *e;
    if (kvp_engine_create(&o, &e) != KVP_OK) die("engine");
    return e;
}

/* The target's descriptor under another name, as a store holds it. */
static char *renamed(const char *desc, const char *name, int gen)
{
    cJSON *d = cJSON_Parse(desc);
    if (!d) return NULL;
    cJSON_ReplaceItemInObjectCaseSensitive(d, "name", cJSON_CreateString(name));
    if (gen) cJSON_AddNumberToObject(d, "md_scale_gen", gen);
    char *text = cJSON_PrintUnformatted(d);
    cJSON_Delete(d);
    size_t n = text ? strlen(text) : 0;
    char *line = text ? malloc(n + 2) : NULL;
    if (line) snprintf(line, n + 2, "%s\n", text); /* as Mooncake and kvpipe write it */
    free(text);
    return line;
}

static void put(const kvpi_store_ops *ops, void *raw, const char *kind, const char *seg,
                const char *value)
{
    char *key = kvpi_meta_key(kind, seg);
    if (!key || ops->put(raw, key, value) != KVP_OK) die("store put");
    free(key);
}

int main(int argc, char **argv)
{
    const char *conn = NULL;
    long n = 1000, changes = 100, rounds = 5;
    const bench_opt opts[] = {{"metadata-server", BENCH_STR, &conn},
                              {"segments", BENCH_LONG, &n},
                              {"changes", BENCH_LONG, &changes},
                              {"rounds", BENCH_LONG, &rounds}};
    if (bench_parse(argc, argv, opts, sizeof opts / sizeof opts[0])) return 2;
    if (!conn || n < 1 || changes < 0 || rounds < 1) {
        fprintf(stderr, "usage: md_scale --metadata-server CONN [--segments N] [--changes K] "
                        "[--rounds R]\n");
        return 2;
    }
    const kvpi_store_ops *ops = kvpi_store_lookup(conn);
    void *raw = NULL;
    if (!ops || ops->open(conn, 5000, &raw) != KVP_OK) die("open the store");

    /* The target and its descriptor; the N segments copy it. */
    kvp_engine *tgt = engine(conn);
    void *buf = mmap(NULL, BUF_LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED || kvp_engine_register(tgt, buf, BUF_LEN) != KVP_OK) die("register");
    char *desc = kvpi_engine_descriptor_text(tgt);
    char rpc[400];
    snprintf(rpc, sizeof rpc, "{\"ip_or_host_name\":\"%s\",\"rpc_port\":%d}\n", tgt->self.host,
             tgt->self.port);
    char(*names)[64] = calloc((size_t)n, sizeof *names);
    uint64_t *cold = calloc((size_t)n, sizeof *cold);
    uint64_t *warm = calloc((size_t)(n * rounds), sizeof *warm);
    uint64_t *get_ns = calloc((size_t)n, sizeof *get_ns);
    uint64_t *prop = calloc((size_t)changes + 1, sizeof *prop);
    uint64_t *put_ns = calloc((size_t)changes + 1, sizeof *put_ns);
    if (!desc || !names || !cold || !warm || !get_ns || !prop || !put_ns) die("out of memory");
    uint64_t t0 = kvpi_now_ns();
    for (long i = 0; i < n; i++) {
        snprintf(names[i], sizeof names[i], "md_scale-%d-%ld", (int)getpid(), i);
        char *text = renamed(desc, names[i], 0);
        if (!text) die("out of memory");
        put(ops, raw, "rpc_meta", names[i], rpc);
        put(ops, raw, "ram", names[i], text);
        free(text);
    }
    double register_s = (double)(kvpi_now_ns() - t0) / 1e9;

    /* Baseline: one GET of each segment's descriptor key, same client. */
    for (long i = 0; i < n; i++) {
        char *key = kvpi_meta_key("ram", names[i]), *val = NULL;
        uint64_t a = kvpi_now_ns();
        if (!key || ops->get(raw, key, &val) != KVP_OK) die("store get");
        get_ns[i] = kvpi_now_ns() - a;
        free(key);
        free(val);
    }

    kvp_engine *ini = engine(conn);
    kvp_segment_id id;
    for (long i = 0; i < n; i++) {
        uint64_t a = kvpi_now_ns();
        if (kvp_engine_open_segment(ini, names[i], &id) != KVP_OK) die("cold open_segment");
        cold[i] = kvpi_now_ns() - a;
    }
    for (long r = 0; r < rounds; r++)
        for (long i = 0; i < n; i++) {
            uint64_t a = kvpi_now_ns();
            if (kvp_engine_open_segment(ini, names[i], &id) != KVP_OK) die("warm open_segment");
            warm[r * n + i] = kvpi_now_ns() - a;
        }

    /* Changes: wait for the watch, then rewrite one cached descriptor at a
     * time and time until the initiator's cache lets it go. */
    const char *mode = "none";
    for (int w = 0; w < 1000 && kvpi_engine_watch_state(ini) != KVPI_WATCH_STREAMING &&
                    kvpi_engine_watch_state(ini) != KVPI_WATCH_POLLING;
         w++)
        usleep(10000);
    int state = kvpi_engine_watch_state(ini);
    mode = state == KVPI_WATCH_STREAMING ? "watch" : state == KVPI_WATCH_POLLING ? "poll" : "none";
    long missed = 0, done = 0;
    for (long k = 0; k < changes; k++) {
        long i = (k * 7919) % n;
        kvpi_segment *seg = kvpi_segment_find(ini, names[i]);
        char *text = renamed(desc, names[i], (int)k + 1);
        char *key = kvpi_meta_key("ram", names[i]);
        if (!seg || !text || !key) die("out of memory");
        uint64_t a = kvpi_now_ns();
        if (ops->put(raw, key, text) != KVP_OK) die("store put");
        put_ns[done] = kvpi_now_ns() - a;
        int gone = 0;
        while (!gone && kvpi_now_ns() - a < 5000000000u) {
            pthread_mutex_lock(&seg->lock);
            gone = seg->peer == NULL;
            pthread_mutex_unlock(&seg->lock);
            if (!gone) usleep(50);
        }
        if (gone)
            prop[done++] = kvpi_now_ns() - a;
        else
            missed++;
        free(text);
        free(key);
        if (kvp_engine_open_segment(ini, names[i], &id) != KVP_OK) die("open_segment again");
    }

    double get50 = pct_ms(get_ns, (size_t)n, 50), get99 = pct_ms(get_ns, (size_t)n, 99);
    double c50 = pct_ms(cold, (size_t)n, 50), c99 = pct_ms(cold, (size_t)n, 99);
    double w50 = pct_ms(warm, (size_t)(n * rounds), 50),
           w99 = pct_ms(warm, (size_t)(n * rounds), 99);
    double p50 = pct_ms(prop, (size_t)done, 50), p99 = pct_ms(prop, (size_t)done, 99);
    double pmax = pct_ms(prop, (size_t)done, 100);
    double put50 = pct_ms(put_ns, (size_t)done, 50);
    printf("md_scale: %s, %ld segments (registered in %.2f s)\n", ops->name, n, register_s);
    printf("  %-34s %10s %10s\n", "", "p50 ms", "p99 ms");
    printf("  %-34s %10.3f %10.3f\n", "store GET, one key (baseline)", get50, get99);
    printf("  %-34s %10.3f %10.3f   (%.2fx / %.2fx the GET)\n", "lookup, cold (open_segment)", c50,
           c99, c50 / get50, c99 / get99);
    printf("  %-34s %10.4f %10.4f   (x%ld rounds)\n", "lookup, warm (cached)", w50, w99, rounds);
    printf("  %-34s %10.3f %10.3f   (%s; max %.3f ms; %ld of %ld missed in 5 s)\n",
           "change reaches the cache", p50, p99, mode, pmax, missed, changes);
    printf("  %-34s %10.3f\n", "store PUT (baseline of a change)", put50);
    printf("{\"store\":\"%s\",\"segments\":%ld,\"get_p50_ms\":%.4f,\"get_p99_ms\":%.4f,"
           "\"cold_p50_ms\":%.4f,\"cold_p99_ms\":%.4f,\"warm_p50_ms\":%.5f,\"warm_p99_ms\":%.5f,"
           "\"change_mode\":\"%s\",\"change_p50_ms\":%.4f,\"change_p99_ms\":%.4f,"
           "\"change_max_ms\":%.4f,\"changes_missed\":%ld,\"put_p50_ms\":%.4f}\n",
           ops->name, n, get50, get99, c50, c99, w50, w99, mode, p50, p99, pmax, missed, put50);

    kvp_engine_destroy(ini);
    kvp_engine_destroy(tgt);
    for (long i = 0; i < n; i++) {
        char *k1 = kvpi_meta_key("ram", names[i]), *k2 = kvpi_meta_key("rpc_meta", names[i]);
        if (k1) ops->del(raw, k1);
        if (k2) ops->del(raw, k2);
        free(k1);
        free(k2);
    }
    ops->close(raw);
    free(desc);
    free(names);
    free(cold);
    free(warm);
    free(get_ns);
    free(prop);
    free(put_ns);
    return missed ? 1 : 0;
}
