/* The engine's metrics: the samples of a snapshot, the endpoint, and
 * Mooncake's MC_TE_METRIC throughput line. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/util.h"
#include "engine/engine_internal.h"
#include "engine/metrics.h"
#include "engine/metrics_server.h"

#define REPORT_INTERVAL_S 5 /* Mooncake's default */

static const char *const op_names[2] = {"read", "write"};

static size_t transport_index(const void *ops)
{
    for (size_t i = 0; kvpi_transports[i] && i < KVPI_TRANSPORTS_MAX; i++)
        if (kvpi_transports[i] == ops) return i;
    return KVPI_TRANSPORTS_MAX;
}

kvpi_engine_shard *kvpi_metrics_shard(kvpi_engine_metrics *m)
{
    static atomic_uint next;
    static _Thread_local unsigned mine = UINT_MAX;
    if (mine == UINT_MAX) mine = atomic_fetch_add(&next, 1) % KVPI_METRIC_SHARDS;
    return &m->shards[mine];
}

void kvpi_metrics_submitted(kvpi_engine_metrics *m, size_t n, uint64_t bytes)
{
    kvpi_engine_shard *s = kvpi_metrics_shard(m);
    kvpi_gauge_add(&s->inflight_requests, (int64_t)n);
    kvpi_gauge_add(&s->inflight_bytes, (int64_t)bytes);
}

void kvpi_metrics_request_done(kvpi_engine_metrics *m, kvp_opcode op, size_t len, const void *ops,
                               kvp_status st, uint64_t latency_ns)
{
    kvpi_engine_shard *sh = kvpi_metrics_shard(m);
    int o = op == KVP_OP_WRITE;
    kvpi_gauge_add(&sh->inflight_requests, -1);
    kvpi_gauge_add(&sh->inflight_bytes, -(int64_t)len);
    size_t t = transport_index(ops);
    if (st == KVP_OK && t < KVPI_TRANSPORTS_MAX) {
        kvpi_counter_add(&sh->bytes[o][t], len);
        kvpi_histogram_observe_ns(&sh->latency[o][t], latency_ns);
    } else {
        unsigned s = (unsigned)(st ? st : KVP_EIO);
        kvpi_counter_add(&sh->errors[o][s < KVPI_STATUS_SLOTS ? s : 0], 1);
    }
}

void kvpi_metrics_corrupt(kvpi_segment *seg, const void *ops)
{
    size_t t = transport_index(ops);
    if (t < KVPI_TRANSPORTS_MAX) kvpi_counter_add(&seg->corrupt[t], 1);
}

/* The shards added up. */
typedef struct totals {
    uint64_t requests[2][KVPI_TRANSPORTS_MAX], bytes[2][KVPI_TRANSPORTS_MAX];
    uint64_t errors[2][KVPI_STATUS_SLOTS];
    kvpi_histogram latency[2];
    int64_t inflight_requests, inflight_bytes;
} totals;

static void add_up(const kvpi_engine_metrics *m, totals *t)
{
    memset(t, 0, sizeof *t);
    for (size_t k = 0; k < KVPI_METRIC_SHARDS; k++) {
        const kvpi_engine_shard *s = &m->shards[k];
        for (int o = 0; o < 2; o++) {
            for (size_t i = 0; i < KVPI_TRANSPORTS_MAX; i++) {
                t->requests[o][i] += kvpi_histogram_merge(&t->latency[o], &s->latency[o][i]);
                t->bytes[o][i] += kvpi_counter_get(&s->bytes[o][i]);
            }
            for (size_t i = 0; i < KVPI_STATUS_SLOTS; i++)
                t->errors[o][i] += kvpi_counter_get(&s->errors[o][i]);
        }
        t->inflight_requests += kvpi_gauge_get(&s->inflight_requests);
        t->inflight_bytes += kvpi_gauge_get(&s->inflight_bytes);
    }
}

/* ---- the samples ---- */

static const kvpi_metric_family
    f_requests = {"kvpipe_engine_requests_total",
                  "Transfer requests this engine completed as initiator, by opcode and transport",
                  KVP_METRIC_COUNTER},
    f_bytes = {"kvpipe_engine_bytes_total",
               "Bytes of the transfer requests this engine completed as initiator",
               KVP_METRIC_COUNTER},
    f_errors = {"kvpipe_engine_errors_total", "Transfer requests that failed, by opcode and status",
                KVP_METRIC_COUNTER},
    f_latency = {"kvpipe_engine_request_duration_seconds",
                 "Time from a request's submission to its completion, completed requests",
                 KVP_METRIC_HISTOGRAM},
    f_inflight_req = {"kvpipe_engine_inflight_requests", "Requests submitted and not yet completed",
                      KVP_METRIC_GAUGE},
    f_inflight_bytes = {"kvpipe_engine_inflight_bytes",
                        "Bytes of the requests submitted and not yet completed", KVP_METRIC_GAUGE},
    f_corrupt = {"kvpipe_engine_corrupt_total",
                 "Slices moved to or from a peer whose digests differed (integrity on: the "
                 "request failed with ECORRUPT), by peer segment and transport",
                 KVP_METRIC_COUNTER},
    f_retries = {"kvpipe_engine_retries_total",
                 "Requests a transport ran again on a new connection (an idle one had been "
                 "closed by the peer)",
                 KVP_METRIC_COUNTER},
    f_lookups = {"kvpipe_engine_descriptor_lookups_total",
                 "Peer segment descriptors fetched from the metadata store or by handshake",
                 KVP_METRIC_COUNTER},
    f_refreshes = {"kvpipe_engine_descriptor_refreshes_total",
                   "Lookups that replaced a descriptor dropped after a connection error, a "
                   "range outside it or a change in the store",
                   KVP_METRIC_COUNTER},
    f_changes = {"kvpipe_engine_descriptor_changes_total",
                 "Cached peer descriptors dropped because the metadata store held another "
                 "(seen by the metadata watch or poll)",
                 KVP_METRIC_COUNTER},
    f_notifies_received = {"kvpipe_engine_notifies_received_total",
                           "Notifications peers sent this engine that it queued",
                           KVP_METRIC_COUNTER},
    f_notifies_refused = {"kvpipe_engine_notifies_refused_total",
                          "Notifications peers sent this engine that it refused (its queue "
                          "full, or malformed)",
                          KVP_METRIC_COUNTER},
    f_notifies_sent = {"kvpipe_engine_notifies_sent_total",
                       "Notifications this engine sent that the peer queued", KVP_METRIC_COUNTER},
    f_notifies_queued = {"kvpipe_engine_notifies_queued",
                         "Notifications received and not yet collected (get_notifies)",
                         KVP_METRIC_GAUGE},
    f_served_req = {"kvpipe_engine_served_requests_total",
                    "Requests this engine served to peers as target, by opcode and transport",
                    KVP_METRIC_COUNTER},
    f_served_bytes = {"kvpipe_engine_served_bytes_total",
                      "Bytes this engine served to peers as target", KVP_METRIC_COUNTER},
    f_refused = {"kvpipe_engine_refused_requests_total",
                 "Peer requests refused as target (outside registered memory), by transport",
                 KVP_METRIC_COUNTER},
    f_registered = {"kvpipe_engine_registered_bytes",
                    "Bytes of memory registered (the managed pool's chunks included)",
                    KVP_METRIC_GAUGE},
    f_regions = {"kvpipe_engine_registered_regions", "Registered memory regions", KVP_METRIC_GAUGE},
    f_pool = {"kvpipe_engine_pool_bytes", "Bytes mapped by the managed-buffer pool",
              KVP_METRIC_GAUGE},
    f_pool_free = {"kvpipe_engine_pool_free_bytes",
                   "Bytes of the pool not handed out (free for kvp_engine_alloc)",
                   KVP_METRIC_GAUGE},
    f_pool_allocs = {"kvpipe_engine_pool_allocations", "Managed buffers handed out and not freed",
                     KVP_METRIC_GAUGE},
    f_segments = {"kvpipe_engine_open_segments", "Peer segments opened", KVP_METRIC_GAUGE};

static void collect_initiator(const kvpi_engine_metrics *m, kvp_metrics *out)
{
    totals *t = malloc(sizeof *t);
    if (!t) return;
    add_up(m, t);
    for (int o = 0; o < 2; o++)
        for (size_t i = 0; kvpi_transports[i] && i < KVPI_TRANSPORTS_MAX; i++)
            kvpi_metrics_add(out, &f_requests, (double)t->requests[o][i], "op", op_names[o],
                             "transport", kvpi_transports[i]->name, NULL);
    for (int o = 0; o < 2; o++)
        for (size_t i = 0; kvpi_transports[i] && i < KVPI_TRANSPORTS_MAX; i++)
            kvpi_metrics_add(out, &f_bytes, (double)t->bytes[o][i], "op", op_names[o], "transport",
                             kvpi_transports[i]->name, NULL);
    /* Every status that occurred; zero samples for the usual connection
     * failures, so that their series exist before the first one. */
    for (int o = 0; o < 2; o++)
        for (unsigned s = 1; s < KVPI_STATUS_SLOTS; s++) {
            uint64_t v = t->errors[o][s];
            int usual = s == KVP_ETIMEDOUT || s == KVP_ECONNRESET || s == KVP_ECONNREFUSED;
            if (v || usual)
                kvpi_metrics_add(out, &f_errors, (double)v, "op", op_names[o], "status",
                                 kvpi_metrics_status_name((kvp_status)s), NULL);
        }
    for (int o = 0; o < 2; o++)
        kvpi_metrics_add_histogram(out, &f_latency, &t->latency[o], "op", op_names[o], NULL);
    kvpi_metrics_add(out, &f_inflight_req, (double)t->inflight_requests, NULL);
    kvpi_metrics_add(out, &f_inflight_bytes, (double)t->inflight_bytes, NULL);
    kvpi_metrics_add(out, &f_retries, (double)kvpi_counter_get(&m->retries), NULL);
    kvpi_metrics_add(out, &f_lookups, (double)kvpi_counter_get(&m->lookups), NULL);
    kvpi_metrics_add(out, &f_refreshes, (double)kvpi_counter_get(&m->refreshes), NULL);
    kvpi_metrics_add(out, &f_changes, (double)kvpi_counter_get(&m->changes), NULL);
    free(t);
}

static void collect_target(const kvpi_engine_metrics *m, kvp_metrics *out)
{
    for (int o = 0; o < 2; o++)
        for (size_t t = 0; kvpi_transports[t] && t < KVPI_TRANSPORTS_MAX; t++)
            kvpi_metrics_add(out, &f_served_req,
                             (double)kvpi_counter_get(&m->served[t].requests[o]), "op", op_names[o],
                             "transport", kvpi_transports[t]->name, NULL);
    for (int o = 0; o < 2; o++)
        for (size_t t = 0; kvpi_transports[t] && t < KVPI_TRANSPORTS_MAX; t++)
            kvpi_metrics_add(out, &f_served_bytes, (double)kvpi_counter_get(&m->served[t].bytes[o]),
                             "op", op_names[o], "transport", kvpi_transports[t]->name, NULL);
    for (size_t t = 0; kvpi_transports[t] && t < KVPI_TRANSPORTS_MAX; t++)
        kvpi_metrics_add(out, &f_refused, (double)kvpi_counter_get(&m->served[t].refused),
                         "transport", kvpi_transports[t]->name, NULL);
}

static void collect_memory(kvp_engine *e, kvp_metrics *out)
{
    size_t n;
    uint64_t registered;
    kvpi_region_totals(&e->regions, &n, &registered);
    kvpi_metrics_add(out, &f_registered, (double)registered, NULL);
    kvpi_metrics_add(out, &f_regions, (double)n, NULL);
    kvpi_pool_stats ps = {0};
    if (e->pool) kvpi_pool_get_stats(e->pool, &ps);
    kvpi_metrics_add(out, &f_pool, (double)ps.mapped, NULL);
    kvpi_metrics_add(out, &f_pool_free, (double)(ps.mapped - ps.allocated), NULL);
    kvpi_metrics_add(out, &f_pool_allocs, (double)ps.allocations, NULL);
    pthread_mutex_lock(&e->segments_lock);
    size_t segs = e->n_segments;
    /* Integrity failures, by peer: a series once one occurred. */
    for (size_t i = 0; i < e->n_segments; i++)
        for (size_t t = 0; t < KVPI_TRANSPORTS_MAX && kvpi_transports[t]; t++) {
            uint64_t v = kvpi_counter_get(&e->segments[i]->corrupt[t]);
            if (v)
                kvpi_metrics_add(out, &f_corrupt, (double)v, "peer", e->segments[i]->name,
                                 "transport", kvpi_transports[t]->name, NULL);
        }
    pthread_mutex_unlock(&e->segments_lock);
    kvpi_metrics_add(out, &f_segments, (double)segs, NULL);
}

void kvpi_engine_metrics_collect(kvp_engine *e, kvp_metrics *out)
{
    collect_initiator(&e->metrics, out);
    collect_target(&e->metrics, out);
    collect_memory(e, out);
    kvpi_metrics_add(out, &f_notifies_received,
                     (double)kvpi_counter_get(&e->metrics.notifies_received), NULL);
    kvpi_metrics_add(out, &f_notifies_refused,
                     (double)kvpi_counter_get(&e->metrics.notifies_refused), NULL);
    kvpi_metrics_add(out, &f_notifies_sent, (double)kvpi_counter_get(&e->metrics.notifies_sent),
                     NULL);
    kvpi_metrics_add(out, &f_notifies_queued, (double)kvpi_notify_queued(e), NULL);
}

kvp_status kvp_engine_metrics(kvp_engine *e, kvp_metrics **out)
{
    if (!e || !out) return kvpi_error(KVP_EINVAL, "engine_metrics: NULL argument");
    kvp_metrics *m = kvpi_metrics_new();
    if (!m) return kvpi_error(KVP_ENOMEM, "engine_metrics: out of memory");
    kvpi_engine_metrics_collect(e, m);
    kvp_status st = kvpi_metrics_status(m);
    if (st) {
        kvp_metrics_free(m);
        return st;
    }
    *out = m;
    return KVP_OK;
}

int kvp_engine_metrics_port(const kvp_engine *e)
{
    return e && e->metrics_srv ? kvpi_metrics_server_port(e->metrics_srv) : 0;
}

/* ---- the endpoint ---- */

/* The endpoint's view of the engine: its samples under engine="name". */
static void serve_engine(void *ctx, kvp_metrics *into)
{
    kvp_engine *e = ctx;
    kvpi_metrics_base_labels(into, "engine", e->name, NULL);
    kvpi_engine_metrics_collect(e, into);
    kvpi_metrics_base_labels(into, NULL);
}

/* The port asked for: opts.metrics_port, else env KVPIPE_METRICS_PORT; 0 for
 * none, -1 for any free one. */
static kvp_status endpoint_port(const kvp_engine *e, int *port)
{
    if (e->opts.metrics_port) {
        *port = e->opts.metrics_port == KVP_METRICS_PORT_ANY ? -1 : e->opts.metrics_port;
        if (*port < -1 || *port == 0 || *port > 65535)
            return kvpi_error(KVP_EINVAL,
                              "engine: metrics_port %d is not a port (1..65535) or "
                              "KVP_METRICS_PORT_ANY",
                              e->opts.metrics_port);
        return KVP_OK;
    }
    const char *env = getenv("KVPIPE_METRICS_PORT");
    *port = 0;
    if (!env || !*env) return KVP_OK;
    long v;
    if (kvpi_parse_long(env, 0, 65535, &v))
        return kvpi_error(KVP_ECONFIG,
                          "KVPIPE_METRICS_PORT='%s': expected a port, 1..65535 (0: "
                          "any free port)",
                          env);
    *port = v ? (int)v : -1;
    return KVP_OK;
}

static kvp_status endpoint_start(kvp_engine *e)
{
    int port;
    kvp_status st = endpoint_port(e, &port);
    if (st || port == 0) return st;
    const char *host = e->opts.metrics_host;
    if (!host || !*host) host = getenv("KVPIPE_METRICS_HOST");
    if (!host || !*host) host = "127.0.0.1";
    if ((st = kvpi_metrics_server_acquire(host, port < 0 ? 0 : port, &e->metrics_srv))) return st;
    if ((st = kvpi_metrics_server_add(e->metrics_srv, serve_engine, e))) {
        kvpi_metrics_server_release(e->metrics_srv);
        e->metrics_srv = NULL;
    }
    return st;
}

kvp_status kvpi_engine_metrics_attach(kvp_engine *e, kvpi_engine_metrics_fn fn, void *ctx)
{
    return e->metrics_srv ? kvpi_metrics_server_add(e->metrics_srv, fn, ctx) : KVP_OK;
}

void kvpi_engine_metrics_detach(kvp_engine *e, void *ctx)
{
    if (e->metrics_srv) kvpi_metrics_server_remove(e->metrics_srv, ctx);
}

/* ---- MC_TE_METRIC ---- */

static int env_true(const char *name)
{
    const char *v = getenv(name);
    if (!v) return 0;
    static const char *const yes[] = {"1", "true", "yes", "on"};
    for (size_t i = 0; i < 4; i++)
        if (strcasecmp(v, yes[i]) == 0) return 1;
    return 0;
}

/* Latency buckets as Mooncake prints them, in microseconds. */
static int append_bucket(char *line, size_t cap, size_t used, size_t i, double pct, int first)
{
    const char *sep = first ? "" : ", ";
    if (i == KVPI_LATENCY_BUCKETS)
        return snprintf(line + used, cap - used, "%s>%lluμs:%.1f%%", sep,
                        (unsigned long long)(kvpi_latency_bounds_ns[i - 1] / 1000), pct);
    unsigned long long lo = i ? kvpi_latency_bounds_ns[i - 1] / 1000 : 0;
    return snprintf(line + used, cap - used, "%s%llu-%lluμs:%.1f%%", sep, lo,
                    (unsigned long long)(kvpi_latency_bounds_ns[i] / 1000), pct);
}

typedef struct report_state {
    uint64_t bytes;
    uint64_t buckets[KVPI_LATENCY_BUCKETS + 1];
} report_state;

static void report_read(const kvpi_engine_metrics *m, report_state *s)
{
    memset(s, 0, sizeof *s);
    totals *t = malloc(sizeof *t);
    if (!t) return;
    add_up(m, t);
    for (int o = 0; o < 2; o++) {
        for (size_t i = 0; i < KVPI_TRANSPORTS_MAX; i++)
            s->bytes += t->bytes[o][i];
        uint64_t b[KVPI_LATENCY_BUCKETS + 1];
        kvpi_histogram_read(&t->latency[o], b);
        for (size_t i = 0; i <= KVPI_LATENCY_BUCKETS; i++)
            s->buckets[i] += b[i];
    }
    free(t);
}

/* One line for the interval since prev, in Mooncake's words; nothing when
 * nothing moved. */
static void report_once(kvp_engine *e, report_state *prev)
{
    report_state now;
    report_read(&e->metrics, &now);
    uint64_t bytes = now.bytes - prev->bytes, count = 0;
    uint64_t delta[KVPI_LATENCY_BUCKETS + 1];
    for (size_t i = 0; i <= KVPI_LATENCY_BUCKETS; i++)
        count += delta[i] = now.buckets[i] - prev->buckets[i];
    *prev = now;
    if (!bytes && !count) return;
    char line[1024];
    size_t used =
        (size_t)snprintf(line, sizeof line,
                         "[Metrics] Transfer Engine Stats (over last %ds):", e->report_interval_s);
    if (bytes)
        used += (size_t)snprintf(line + used, sizeof line - used, " Throughput: %.2f MB/s",
                                 (double)bytes / e->report_interval_s / (1024.0 * 1024.0));
    if (count) {
        used +=
            (size_t)snprintf(line + used, sizeof line - used,
                             " | Latency Distribution (count=%llu): ", (unsigned long long)count);
        int first = 1;
        for (size_t i = 0; i <= KVPI_LATENCY_BUCKETS && used < sizeof line; i++) {
            double pct = 100.0 * (double)delta[i] / (double)count;
            if (!delta[i] || pct < 0.1) continue;
            used += (size_t)append_bucket(line, sizeof line, used, i, pct, first);
            first = 0;
        }
    }
    if (used < sizeof line) snprintf(line + used, sizeof line - used, " [segment %s]", e->name);
    /* Asked for by MC_TE_METRIC: shown at any log level, as Mooncake (whose
     * default level is INFO) shows it. */
    kvpi_log_always(KVP_LOG_INFO, KVPI_LOG_SUBSYS, line);
}

static void *reporter_main(void *arg)
{
    kvp_engine *e = arg;
    report_state prev;
    report_read(&e->metrics, &prev);
    uint64_t next = kvpi_now_ns();
    pthread_mutex_lock(&e->report_lock);
    while (!e->report_stop) {
        next += (uint64_t)e->report_interval_s * 1000000000u;
        struct timespec at = kvpi_timespec_at_ns(next);
        while (!e->report_stop &&
               pthread_cond_timedwait(&e->report_cond, &e->report_lock, &at) != ETIMEDOUT) {
        }
        if (e->report_stop) break;
        pthread_mutex_unlock(&e->report_lock);
        report_once(e, &prev);
        pthread_mutex_lock(&e->report_lock);
    }
    pthread_mutex_unlock(&e->report_lock);
    return NULL;
}

static kvp_status reporter_start(kvp_engine *e)
{
    if (!env_true("MC_TE_METRIC")) return KVP_OK;
    e->report_interval_s = REPORT_INTERVAL_S;
    const char *env = getenv("MC_TE_METRIC_INTERVAL_SECONDS");
    if (env && *env) {
        long v;
        if (kvpi_parse_long(env, 1, 86400, &v))
            return kvpi_error(KVP_ECONFIG,
                              "MC_TE_METRIC_INTERVAL_SECONDS='%s': expected seconds, "
                              "1..86400 (default %d)",
                              env, REPORT_INTERVAL_S);
        e->report_interval_s = (int)v;
    }
    pthread_mutex_init(&e->report_lock, NULL);
    kvpi_cond_init(&e->report_cond);
    e->report_stop = 0;
    if (pthread_create(&e->reporter, NULL, reporter_main, e) != 0) {
        pthread_mutex_destroy(&e->report_lock);
        pthread_cond_destroy(&e->report_cond);
        return kvpi_error(KVP_EIO, "engine: cannot start the metrics reporter: %s",
                          strerror(errno));
    }
    e->reporter_started = 1;
    KVPI_INFO("engine %s: MC_TE_METRIC: a throughput line every %d s", e->name,
              e->report_interval_s);
    return KVP_OK;
}

kvp_status kvpi_engine_metrics_start(kvp_engine *e)
{
    kvp_status st = endpoint_start(e);
    e->opts.metrics_host = NULL; /* the caller's string: not kept */
    if (!st) st = reporter_start(e);
    return st;
}

void kvpi_engine_metrics_stop(kvp_engine *e)
{
    if (e->reporter_started) {
        kvpi_thread_stop(e->reporter, &e->report_lock, &e->report_cond, &e->report_stop);
        pthread_mutex_destroy(&e->report_lock);
        pthread_cond_destroy(&e->report_cond);
        e->reporter_started = 0;
    }
    if (e->metrics_srv) {
        kvpi_metrics_server_remove(e->metrics_srv, e);
        kvpi_metrics_server_release(e->metrics_srv);
        e->metrics_srv = NULL;
    }
}
