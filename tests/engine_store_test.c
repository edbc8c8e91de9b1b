/* Engine-level conformance over every metadata store: the same cases run with
 * the HTTP store, a real etcd, a real redis-server and P2PHANDSHAKE.
 *
 * Each case runs an initiator engine in the case process and a target engine
 * in a separate process (support/peer.h's kvpt_target), commanded to register
 * a new region, unregister it, check a range's pattern, and stop (engine
 * destroyed) or be killed. Case names are "<store>/<behaviour>". */
#include <cjson/cJSON.h>
#include <errno.h>
#include <sys/prctl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "engine/engine_internal.h"
#include "kvpipe/metrics.h"
#include "metadata/metadata.h"
#include "peer.h"
#include "servers.h"
#include "test.h"

#define ENGINE_TIMEOUT_MS 2000
#define REPLY_TIMEOUT_MS 20000
#define REPUBLISH_WAIT_MS 20000
#define REGION_LEN (((size_t)1 << 20) + 123)
#define NEW_REGION_LEN (((size_t)256 << 10) + 7)
#define GEN_SHIFT ((size_t)64 << 10)

/* ---- the target ---- */

typedef struct target {
    kvpt_target k;
    pid_t pid; /* 0 once reaped */
    int port, gen;
    char name[64];
    uint64_t addr; /* first region: REGION_LEN bytes of pattern 100 + gen */
    size_t len;
    char err[512]; /* what a target that did not start said */
} target;

/* Start a target engine process; 0 once it serves. */
static int target_start(target *t, const char *conn, int port, int gen)
{
    memset(t, 0, sizeof *t);
    t->port = port;
    t->gen = gen;
    snprintf(t->name, sizeof t->name, "127.0.0.1:%d", port);
    kvpt_target_opts o = {.metadata = conn,
                          .port = port,
                          .disable_shm = 1, /* the TCP path is the one Mooncake peers share */
                          .len = REGION_LEN,
                          .seed = 100 + (uint64_t)gen,
                          .timeout_ms = ENGINE_TIMEOUT_MS,
                          .capture = 1};
    if (kvpt_target_start(&o, &t->k) != 0) {
        snprintf(t->err, sizeof t->err, "target %s: %.400s", t->name, t->k.said);
        return -1;
    }
    t->pid = t->k.pid;
    t->addr = (uint64_t)(uintptr_t)t->k.buf;
    t->len = REGION_LEN;
    return 0;
}

/* Stop the target (engine destroyed) and reap it; 0 on a clean exit. Its
 * buffer stays mapped here, so that a restarted target's lies elsewhere. */
static int target_quit(target *t)
{
    int rc = kvpt_target_stop(&t->k, 1) == 0 ? 0 : -1;
    kvpt_peer_forget(&t->k.peer);
    t->pid = 0;
    return rc;
}

static void target_kill(target *t)
{
    if (t->pid <= 0) return;
    kvpt_target_kill(&t->k);
    kvpt_peer_forget(&t->k.peer);
    t->pid = 0;
}

/* 1 if the target's memory at [addr, addr+len) holds pattern seed. */
static int target_holds(target *t, uint64_t addr, size_t len, uint64_t seed)
{
    int64_t bad = kvpt_peer_call(&t->k.peer, KVPT_T_CHECK, addr, len, seed, REPLY_TIMEOUT_MS);
    if (bad != -2) fprintf(stderr, "  target check: %lld\n", (long long)bad);
    return bad == -2;
}

/* Register a new region of NEW_REGION_LEN bytes of pattern 200 + gen in the
 * target, at a generation-dependent offset; 0 and its address. */
static int target_reg(target *t, unsigned long long *addr, size_t *len)
{
    int64_t r = kvpt_peer_call(&t->k.peer, KVPT_T_NEW, NEW_REGION_LEN, 200 + (uint64_t)t->gen,
                               (uint64_t)(t->gen + 7) * GEN_SHIFT, REPLY_TIMEOUT_MS);
    *addr = (unsigned long long)r;
    *len = NEW_REGION_LEN;
    return r > 0 ? 0 : -1;
}

/* ---- the store and the initiator ---- */

typedef struct store_kind {
    const char *name;
    int (*start)(kvpt_server *out);
} store_kind;

static int p2p_start(kvpt_server *out)
{
    memset(out, 0, sizeof *out);
    out->kind = "p2p";
    snprintf(out->conn, sizeof out->conn, "%s", KVPI_P2P_CONN);
    return KVPT_SERVER_OK;
}

/* A redis that wants a password, given the way Mooncake users give it: in
 * MC_REDIS_PASSWORD (inherited by the target processes), not in the string. */
static int redis_auth_start(kvpt_server *out)
{
    setenv("MC_REDIS_PASSWORD", "engine-store-pw", 1);
    return kvpt_redis_start_auth(out, "engine-store-pw");
}

static const store_kind kinds[] = {
    {"http", kvpt_http_start},   {"etcd", kvpt_etcd_start},
    {"redis", kvpt_redis_start}, {"redis-password", redis_auth_start},
    {"p2p", p2p_start},
};

/* What a case gets: the store, raw access to it (NULL ops for p2p), a running
 * target and an initiator engine. */
typedef struct fixture {
    kvpt_server srv;
    const kvpi_store_ops *ops;
    void *raw;
    target tgt;
    kvp_engine *eng;
    int polled; /* the initiator cannot watch the store: it polls */
} fixture;

static const store_kind *cur_kind;
static void (*cur_body)(fixture *f);
enum { NEEDS_STORE = 1, NEEDS_REDIS = 2 };
static int cur_needs; /* NEEDS_STORE: skipped for p2p; NEEDS_REDIS: the redis row only */

static kvp_status initiator(const char *conn, kvp_engine **out)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = name;
    o.metadata = conn;
    o.disable_shm = 1;
    o.timeout_ms = ENGINE_TIMEOUT_MS;
    return kvp_engine_create(&o, out);
}

static int fixture_setup(fixture *f)
{
    if (f->ops) {
        kvp_status st = f->ops->open(f->srv.conn, ENGINE_TIMEOUT_MS, &f->raw);
        if (st) {
            fprintf(stderr, "  raw open %s: %s\n", f->srv.conn, kvp_last_error());
            return -1;
        }
    }
    if (target_start(&f->tgt, f->srv.conn, kvpt_free_port(), 0) != 0) {
        fprintf(stderr, "  %s\n", f->tgt.err);
        return -1;
    }
    kvp_status st = initiator(f->srv.conn, &f->eng);
    if (st) fprintf(stderr, "  initiator: %s\n", kvp_last_error());
    return st ? -1 : 0;
}

static void fixture_teardown(fixture *f)
{
    kvp_engine_destroy(f->eng);
    target_kill(&f->tgt);
    if (f->raw) f->ops->close(f->raw);
}

static void engine_case(void)
{
    if ((cur_needs & NEEDS_STORE) && strcmp(cur_kind->name, "p2p") == 0)
        SKIP("P2PHANDSHAKE has no store to take down");
    /* Before the fixture's engine exists (a skip leaves it to the exit). */
    if ((cur_needs & NEEDS_REDIS) && strcmp(cur_kind->name, "redis") != 0) SKIP("a redis case");
    fixture f;
    memset(&f, 0, sizeof f);
    int rc = cur_kind->start(&f.srv);
    if (rc == KVPT_SERVER_ABSENT) SKIP("%s", f.srv.why);
    if (rc != KVPT_SERVER_OK) {
        fprintf(stderr, "  cannot start %s: %s\n", cur_kind->name, f.srv.why);
        kvpt_failures++;
        return;
    }
    f.ops = kvpi_store_lookup(f.srv.conn);
    if (fixture_setup(&f) == 0)
        cur_body(&f);
    else
        kvpt_failures++;
    fixture_teardown(&f);
    kvpt_server_stop(&f.srv);
}

/* ---- helpers for the cases ---- */

/* 1 if a descriptor (JSON text) lists a buffer [addr, addr+len). */
static int desc_lists(const char *text, uint64_t addr, size_t len)
{
    cJSON *d = cJSON_Parse(text);
    const cJSON *b, *bufs = cJSON_GetObjectItemCaseSensitive(d, "buffers");
    int found = 0;
    cJSON_ArrayForEach(b, bufs)
    {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(b, "addr");
        const cJSON *l = cJSON_GetObjectItemCaseSensitive(b, "length");
        if (cJSON_IsNumber(a) && cJSON_IsNumber(l) && (uint64_t)a->valuedouble == addr &&
            (size_t)l->valuedouble == len)
            found = 1;
    }
    cJSON_Delete(d);
    return found;
}

/* The segment's descriptor as the store (or the peer, in P2P) has it now. */
static kvp_status lookup_desc(const char *conn, const char *seg, char **desc)
{
    kvpi_meta *m;
    kvp_status st = kvpi_meta_open(conn, ENGINE_TIMEOUT_MS, NULL, NULL, &m);
    if (st) return st;
    char *host = NULL;
    st = kvpi_meta_fetch(m, seg, desc, &host);
    free(host);
    kvpi_meta_close(m);
    return st;
}

/* 1 if the raw ram key of seg holds a descriptor listing [addr, addr+len). */
static int raw_lists(fixture *f, const char *seg, uint64_t addr, size_t len)
{
    char *key = kvpi_meta_key("ram", seg), *val = NULL;
    int ok = key && f->ops->get(f->raw, key, &val) == KVP_OK && desc_lists(val, addr, len);
    free(key);
    free(val);
    return ok;
}

static int raw_missing(fixture *f, const char *kind, const char *seg)
{
    char *key = kvpi_meta_key(kind, seg), *val = NULL;
    int missing = key && f->ops->get(f->raw, key, &val) == KVP_ENOTFOUND;
    free(key);
    free(val);
    return missing;
}

/* len bytes of seed's pattern (kvpt_fill), malloc'd; NULL if out of memory. */
static char *pattern(size_t len, uint64_t seed)
{
    char *p = malloc(len);
    if (p) kvpt_fill(p, len, seed);
    return p;
}

/* READ the whole region and compare every byte with want. */
static int read_matches(kvp_engine *e, kvp_segment_id seg, uint64_t addr, const void *want,
                        size_t len)
{
    char *buf = malloc(len);
    if (!buf) return 0;
    memset(buf, 0xEE, len);
    kvp_status st = kvp_engine_read(e, seg, buf, addr, len);
    int ok = st == KVP_OK && memcmp(buf, want, len) == 0;
    if (st)
        fprintf(stderr, "  read: %s: %s\n", kvp_strerror(st), kvp_last_error());
    else if (!ok)
        fprintf(stderr, "  read: data differ\n");
    free(buf);
    return ok;
}

/* READ [addr, +len) and compare it with seed's pattern. */
static int reads_seed(kvp_engine *e, kvp_segment_id seg, uint64_t addr, size_t len, uint64_t seed)
{
    char *want = pattern(len, seed);
    int ok = want && read_matches(e, seg, addr, want, len);
    free(want);
    return ok;
}

static int poll_until(int (*cond)(fixture *f), fixture *f, int timeout_ms)
{
    for (int waited = 0; waited <= timeout_ms; waited += 100) {
        if (cond(f)) return 1;
        usleep(100000);
    }
    return 0;
}

/* ---- the cases ---- */

static void transfer_read_write(fixture *f)
{
    target *t = &f->tgt;
    kvp_segment_id seg, again;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, t->name, &seg));
    CHECK_OK(kvp_engine_open_segment(f->eng, t->name, &again));
    CHECK(seg == again);
    /* The descriptor the store (or handshake) gives lists the region. */
    char *desc = NULL;
    CHECK_OK(lookup_desc(f->srv.conn, t->name, &desc));
    CHECK(desc && desc_lists(desc, t->addr, t->len));
    free(desc);
    if (f->ops) CHECK(raw_lists(f, t->name, t->addr, t->len));

    char *want = pattern(t->len, 100);
    REQUIRE(want);
    CHECK(read_matches(f->eng, seg, t->addr, want, t->len));
    /* WRITE the whole region, then a piece at an odd offset. */
    kvpt_fill(want, t->len, 2);
    CHECK_OK(kvp_engine_write(f->eng, seg, want, t->addr, t->len));
    CHECK(target_holds(t, t->addr, t->len, 2));
    char piece[1000];
    kvpt_fill(piece, sizeof piece, 5);
    CHECK_OK(kvp_engine_write(f->eng, seg, piece, t->addr + 4099, sizeof piece));
    memcpy(want + 4099, piece, sizeof piece);
    CHECK(read_matches(f->eng, seg, t->addr, want, t->len));
    /* Outside the region: refused, nothing written. */
    CHECK_ST(kvp_engine_write(f->eng, seg, piece, t->addr + t->len - 10, 20), KVP_ERANGE);
    CHECK(read_matches(f->eng, seg, t->addr, want, t->len));
    free(want);
}

/* The target's segment opened and a byte of it READ (its descriptor now
 * cached); the first failure's status. */
static kvp_status open_and_read(fixture *f, kvp_segment_id *seg)
{
    char byte;
    kvp_status st = kvp_engine_open_segment(f->eng, f->tgt.name, seg);
    return st ? st : kvp_engine_read(f->eng, *seg, &byte, f->tgt.addr, 1);
}

static void reregister_publishes(fixture *f)
{
    target *t = &f->tgt;
    unsigned long long addr;
    size_t len;
    REQUIRE(target_reg(t, &addr, &len) == 0);
    /* The store (or the handshake) now lists both regions. */
    char *desc = NULL;
    CHECK_OK(lookup_desc(f->srv.conn, t->name, &desc));
    CHECK(desc && desc_lists(desc, addr, len) && desc_lists(desc, t->addr, t->len));
    free(desc);
    if (f->ops) CHECK(raw_lists(f, t->name, addr, len));
    /* An engine that opens the segment now reaches the new region. */
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, t->name, &seg));
    char *want = pattern(len, 200);
    REQUIRE(want);
    CHECK(read_matches(f->eng, seg, addr, want, len));
    kvpt_fill(want, len, 9);
    CHECK_OK(kvp_engine_write(f->eng, seg, want, addr, len));
    CHECK(target_holds(t, addr, len, 9));
    free(want);
}

/* An initiator that cached the descriptor before the peer registered a new
 * region must still reach that region. */
static void cached_initiator_sees_new_region(fixture *f)
{
    target *t = &f->tgt;
    kvp_segment_id seg;
    REQUIRE_OK(open_and_read(f, &seg)); /* descriptor now cached */
    unsigned long long addr;
    size_t len;
    REQUIRE(target_reg(t, &addr, &len) == 0);
    CHECK(reads_seed(f->eng, seg, addr, len, 200));
}

/* The peer unregistered a region the initiator's cached descriptor still
 * lists: the peer itself refuses the range (its registry is the authority),
 * so READ and WRITE fail with KVP_ERANGE and nothing is written; the rest of
 * the segment keeps working. */
static void stale_descriptor_after_unregister(fixture *f)
{
    target *t = &f->tgt;
    unsigned long long addr;
    size_t len;
    REQUIRE(target_reg(t, &addr, &len) == 0);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, t->name, &seg));
    char *buf = pattern(len, 200);
    REQUIRE(buf);
    CHECK(read_matches(f->eng, seg, addr, buf, len)); /* cached: lists the region */
    REQUIRE(kvpt_peer_call(&t->k.peer, KVPT_T_UNREGISTER, addr, 0, 0, REPLY_TIMEOUT_MS) >= 0);
    CHECK_ST(kvp_engine_read(f->eng, seg, buf, addr, 4096), KVP_ERANGE);
    kvpt_fill(buf, len, 77);
    CHECK_ST(kvp_engine_write(f->eng, seg, buf, addr, 4096), KVP_ERANGE);
    CHECK(target_holds(t, addr, len, 200)); /* the unregistered memory is untouched */
    CHECK(reads_seed(f->eng, seg, t->addr, t->len, 100));
    free(buf);
}

static int tgt_keys_gone(fixture *f)
{
    return raw_missing(f, "ram", f->tgt.name) && raw_missing(f, "rpc_meta", f->tgt.name);
}

static void destroy_removes_keys(fixture *f)
{
    target *t = &f->tgt;
    kvp_segment_id seg;
    REQUIRE_OK(open_and_read(f, &seg));
    if (f->ops) {
        CHECK(raw_lists(f, t->name, t->addr, t->len));
        CHECK(!raw_missing(f, "rpc_meta", t->name));
    }
    char name[64];
    snprintf(name, sizeof name, "%s", t->name);
    CHECK(target_quit(t) == 0);
    if (f->ops) CHECK(tgt_keys_gone(f));
    char *desc = NULL;
    kvp_status st = lookup_desc(f->srv.conn, name, &desc);
    CHECK(st != KVP_OK); /* store: ENOTFOUND; P2P: nobody answers */
    free(desc);
    /* A transfer to the vanished peer fails (it does not hang). */
    char byte;
    CHECK(kvp_engine_read(f->eng, seg, &byte, t->addr, 1) != KVP_OK);
}

static int names(const char *msg, const char *a, const char *b)
{
    int ok = strstr(msg, a) && strstr(msg, b);
    if (!ok) fprintf(stderr, "  message '%s' should name '%s' and '%s'\n", msg, a, b);
    return ok;
}

static void store_down_at_create(fixture *f)
{
    kvpt_server_down(&f->srv);
    char name[64];
    int port = kvpt_free_port();
    snprintf(name, sizeof name, "127.0.0.1:%d", port);
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = name;
    o.metadata = f->srv.conn;
    o.disable_shm = 1;
    o.timeout_ms = ENGINE_TIMEOUT_MS;
    kvp_engine *e = (kvp_engine *)0x1;
    CHECK_ST(kvp_engine_create(&o, &e), KVP_EMETADATA);
    CHECK(e == (kvp_engine *)0x1);
    CHECK(names(kvp_last_error(), f->srv.kind, f->srv.addr));
    /* Nothing was left behind: the same name works once the store is back. */
    REQUIRE(kvpt_server_up(&f->srv) == KVPT_SERVER_OK);
    e = NULL;
    CHECK_OK(kvp_engine_create(&o, &e));
    kvp_engine_destroy(e);
}

/* Both engines' keys, both kinds, are in the store. */
static int both_published(fixture *f)
{
    const char *ini = kvp_engine_segment_name(f->eng);
    return raw_lists(f, f->tgt.name, f->tgt.addr, f->tgt.len) &&
           !raw_missing(f, "rpc_meta", f->tgt.name) && !raw_missing(f, "ram", ini) &&
           !raw_missing(f, "rpc_meta", ini);
}

/* The store restarts (redis and the HTTP store come back empty) while both
 * engines run: they publish again, and an engine that looks the target up
 * afresh transfers to it. */
static void store_restart_while_running(fixture *f)
{
    target *t = &f->tgt;
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, t->name, &seg));
    CHECK(reads_seed(f->eng, seg, t->addr, t->len, 100));

    REQUIRE(kvpt_server_restart(&f->srv) == KVPT_SERVER_OK);
    /* Also drop the keys outright (etcd keeps them across a restart). */
    char *k1 = kvpi_meta_key("ram", t->name), *k2 = kvpi_meta_key("rpc_meta", t->name);
    char *k3 = kvpi_meta_key("ram", kvp_engine_segment_name(f->eng));
    char *k4 = kvpi_meta_key("rpc_meta", kvp_engine_segment_name(f->eng));
    CHECK_OK(f->ops->del(f->raw, k1));
    CHECK_OK(f->ops->del(f->raw, k2));
    CHECK_OK(f->ops->del(f->raw, k3));
    CHECK_OK(f->ops->del(f->raw, k4));
    free(k1);
    free(k2);
    free(k3);
    free(k4);
    CHECK(poll_until(both_published, f, REPUBLISH_WAIT_MS));

    /* Transfers go on: the running initiator, and a fresh one. */
    CHECK(reads_seed(f->eng, seg, t->addr, t->len, 100));
    kvp_engine *fresh = NULL;
    REQUIRE_OK(initiator(f->srv.conn, &fresh));
    kvp_segment_id fseg;
    CHECK_OK(kvp_engine_open_segment(fresh, t->name, &fseg));
    CHECK(reads_seed(fresh, fseg, t->addr, t->len, 100));
    kvp_engine_destroy(fresh);
}

/* The target dies and a new process comes up at the same name with its
 * buffers elsewhere. A transfer to the old buffers fails, and the next one
 * reaches the new process (without the watch: looked up again after the
 * failure; watched_restart_reaches_initiator covers the watch). */
static void restarted_peer_replaces_descriptor(fixture *f)
{
    target *t = &f->tgt;
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, t->name, &seg));
    CHECK(reads_seed(f->eng, seg, t->addr, t->len, 100));

    uint64_t old_addr = t->addr;
    int port = t->port;
    target_kill(t);
    REQUIRE(target_start(t, f->srv.conn, port, 1) == 0);
    REQUIRE(t->addr != old_addr);
    /* It came back by itself over the stale keys, and its descriptor lists
     * its own buffers only, not the dead process's. */
    if (f->ops) {
        CHECK(raw_lists(f, t->name, t->addr, t->len));
        CHECK(!raw_lists(f, t->name, old_addr, t->len));
        CHECK(!raw_missing(f, "rpc_meta", t->name));
    }

    /* The old range fails: through the stale descriptor (a dead data
     * connection), or, once the watch dropped it, as outside the new one... */
    char byte;
    CHECK(kvp_engine_read(f->eng, seg, &byte, old_addr, 1) != KVP_OK);
    /* ...and the next transfer uses the new descriptor. */
    CHECK(reads_seed(f->eng, seg, t->addr, t->len, 101));
    char *want = pattern(t->len, 3);
    REQUIRE(want);
    CHECK_OK(kvp_engine_write(f->eng, seg, want, t->addr, t->len));
    CHECK(target_holds(t, t->addr, t->len, 3));
    /* The old range is no longer the peer's (unless the two overlap). */
    if (old_addr + t->len <= t->addr || t->addr + t->len <= old_addr)
        CHECK_ST(kvp_engine_read(f->eng, seg, &byte, old_addr, 1), KVP_ERANGE);
    free(want);
}

/* ---- following descriptor changes (docs/metadata-segments.md) ---- */

/* The sum of an engine metric's samples, all labels. */
static double metric_sum(kvp_engine *e, const char *name)
{
    kvp_metrics *m;
    double sum = 0;
    if (kvp_engine_metrics(e, &m) != KVP_OK) return -1;
    const kvp_metric *x;
    for (size_t i = 0; (x = kvp_metrics_at(m, i)); i++)
        if (strcmp(x->name, name) == 0) sum += x->value;
    kvp_metrics_free(m);
    return sum;
}

/* The state the initiator's watch should reach: etcd and redis stream, the
 * HTTP store is polled. */
static int watch_ready(fixture *f)
{
    int polled = f->polled || strcmp(f->srv.kind, "http") == 0;
    int want = polled ? KVPI_WATCH_POLLING : KVPI_WATCH_STREAMING;
    return kvpi_engine_watch_state(f->eng) == want;
}

/* 1 if the initiator's cached descriptor of seg lists [addr, addr+len). */
static int cache_lists(kvp_engine *e, kvp_segment_id seg, uint64_t addr, size_t len)
{
    kvp_remote_buffer bufs[16];
    size_t n = 0;
    if (kvp_engine_segment_buffers(e, seg, bufs, 16, &n) != KVP_OK) return 0;
    for (size_t i = 0; i < n && i < 16; i++)
        if (bufs[i].addr == addr && bufs[i].length == len) return 1;
    return 0;
}

/* The target restarts as a new process under its name (new buffers, a new
 * data port): the initiator, which cached the old descriptor, learns the new
 * one from the store within bound_ms of the new process being up, and its
 * next transfer goes to the new process without a failed attempt. */
static void restart_reaches_cache(fixture *f, int bound_ms)
{
    target *t = &f->tgt;
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, t->name, &seg));
    char *want = malloc(t->len);
    REQUIRE(want);
    kvpt_fill(want, t->len, 100 + (uint64_t)t->gen);
    CHECK(read_matches(f->eng, seg, t->addr, want, t->len)); /* cached, and watched */
    CHECK(poll_until(watch_ready, f, 10000));
    double errors = metric_sum(f->eng, "kvpipe_engine_errors_total");
    double retries = metric_sum(f->eng, "kvpipe_engine_retries_total");

    uint64_t old_addr = t->addr;
    int port = t->port, gen = t->gen + 1;
    target_kill(t);
    REQUIRE(target_start(t, f->srv.conn, port, gen) == 0);
    uint64_t up = kvpi_now_ns();
    REQUIRE(t->addr != old_addr);
    /* Looking at the cache does not refresh it: only a watch (or a poll)
     * drops the old descriptor. */
    uint64_t seen = 0;
    while (!seen && kvpi_now_ns() - up < (uint64_t)(bound_ms + 3000) * 1000000u) {
        if (cache_lists(f->eng, seg, t->addr, t->len))
            seen = kvpi_now_ns();
        else
            usleep(1000);
    }
    double ms = seen ? (double)(seen - up) / 1e6 : -1;
    fprintf(stderr,
            "  %s: the new descriptor reached the initiator %.1f ms after the new "
            "process was up (bound %d ms)\n",
            f->srv.kind, ms, bound_ms);
    CHECK(seen && ms < bound_ms);
    /* The next transfer goes to the new process, first time. */
    kvpt_fill(want, t->len, 100 + (uint64_t)gen);
    CHECK(read_matches(f->eng, seg, t->addr, want, t->len));
    kvpt_fill(want, t->len, 4);
    CHECK_OK(kvp_engine_write(f->eng, seg, want, t->addr, t->len));
    CHECK(target_holds(t, t->addr, t->len, 4));
    CHECK(metric_sum(f->eng, "kvpipe_engine_errors_total") == errors);
    CHECK(metric_sum(f->eng, "kvpipe_engine_retries_total") == retries);
    CHECK(metric_sum(f->eng, "kvpipe_engine_descriptor_changes_total") >= 1);
    free(want);
}

/* The HTTP store (and redis without CONFIG) is polled every 2000 ms
 * (KVPIPE_METADATA_POLL_MS's default): the poll and a second. etcd and redis
 * stream, and a streaming watch never polls: half the poll interval, so that
 * only the stream can explain the arrival, and a loaded machine's scheduling
 * cannot fail it (a few ms when quiet; 168 ms was seen in a make test beside
 * a build, against the 100 ms this bound once was). */
static int change_bound_ms(fixture *f)
{
    return f->polled || strcmp(f->srv.kind, "http") == 0 ? 2000 + 1000 : 2000 / 2;
}

/* A redis user without CONFIG (an ACL, as managed redis services give):
 * keyspace notifications cannot be turned on, so the initiator polls, and a
 * restarted peer still reaches it within the poll interval. */
static void redis_without_config_polls(fixture *f)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "redis-cli -p %d ACL SETUSER nocfg on '>nocfg-pw' '~*' '&*' +@all -config "
             ">/dev/null",
             f->srv.port);
    REQUIRE(system(cmd) == 0);
    char conn[300];
    snprintf(conn, sizeof conn, "redis://nocfg:nocfg-pw@%s", f->srv.addr);
    kvp_engine_destroy(f->eng);
    f->eng = NULL;
    REQUIRE_OK(initiator(conn, &f->eng));
    f->polled = 1;
    restart_reaches_cache(f, change_bound_ms(f));
}

static void watched_restart_reaches_initiator(fixture *f)
{
    restart_reaches_cache(f, change_bound_ms(f));
}

/* The store restarts under a running watch: the stream breaks, reconnects,
 * and changes reach the initiator as fast as before. */
static void watch_survives_store_restart(fixture *f)
{
    kvp_segment_id seg;
    REQUIRE_OK(open_and_read(f, &seg));
    CHECK(poll_until(watch_ready, f, 10000));
    REQUIRE(kvpt_server_restart(&f->srv) == KVPT_SERVER_OK);
    /* Redis and the HTTP store come back empty: the keepers put the keys
     * back; the watch reconnects on its own. */
    CHECK(poll_until(both_published, f, REPUBLISH_WAIT_MS));
    CHECK(poll_until(watch_ready, f, 10000));
    restart_reaches_cache(f, change_bound_ms(f));
}

/* A second engine with a live engine's name is refused, with a message that
 * says so, and the first one's keys and transfers are untouched. */
static void second_engine_same_name_refused(fixture *f)
{
    target *t = &f->tgt, again;
    char *before = NULL;
    if (f->ops) {
        char *key = kvpi_meta_key("ram", t->name);
        REQUIRE(key && f->ops->get(f->raw, key, &before) == KVP_OK);
        free(key);
    }
    CHECK(target_start(&again, f->srv.conn, t->port, 1) != 0);
    CHECK(names(again.err, "is in use", t->name));
    if (again.pid > 0) target_kill(&again);
    if (f->ops) {
        char *key = kvpi_meta_key("ram", t->name), *now = NULL;
        CHECK(key && f->ops->get(f->raw, key, &now) == KVP_OK && strcmp(now, before) == 0);
        free(key);
        free(now);
        CHECK(!raw_missing(f, "rpc_meta", t->name));
    }
    free(before);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, t->name, &seg));
    CHECK(reads_seed(f->eng, seg, t->addr, t->len, 100));
}

static void put_raw(fixture *f, const char *kind, const char *seg, const char *value)
{
    char *key = kvpi_meta_key(kind, seg);
    CHECK(key && f->ops->del(f->raw, key) == KVP_OK && f->ops->put(f->raw, key, value) == KVP_OK);
    free(key);
}

static int raw_is(fixture *f, const char *kind, const char *seg, const char *want)
{
    char *key = kvpi_meta_key(kind, seg), *got = NULL;
    int ok = key && f->ops->get(f->raw, key, &got) == KVP_OK && strstr(got, want);
    if (!ok) fprintf(stderr, "  %s of %s: %.200s, want %s\n", kind, seg, got ? got : "-", want);
    free(key);
    free(got);
    return ok;
}

/* The name's rpc_meta points at a live engine elsewhere that does not say its
 * name (a Mooncake engine answers a metadata handshake with null): creation
 * is refused and nothing is written or deleted. Once that engine is gone, the
 * same start succeeds over its stale keys, without any cleanup. */
static void live_owner_elsewhere_then_gone(fixture *f)
{
    int port = kvpt_free_port(), owner_port = kvpt_free_port();
    char name[64], rpc[96], owner_addr[32];
    snprintf(name, sizeof name, "127.0.0.1:%d", port);
    snprintf(owner_addr, sizeof owner_addr, "127.0.0.1:%d", owner_port);
    snprintf(rpc, sizeof rpc, "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":%d}", owner_port);
    pid_t owner = kvpt_handshake_responder(owner_port, "null");
    REQUIRE(owner > 0);
    put_raw(f, "rpc_meta", name, rpc);
    put_raw(f, "ram", name, "{\"name\":\"mooncake-owned\",\"buffers\":[]}");
    target t;
    CHECK(target_start(&t, f->srv.conn, port, 2) != 0);
    CHECK(names(t.err, "is in use", owner_addr));
    if (t.pid > 0) target_kill(&t);
    CHECK(raw_is(f, "rpc_meta", name, rpc));
    CHECK(raw_is(f, "ram", name, "mooncake-owned"));
    kill(owner, SIGKILL);
    waitpid(owner, NULL, 0);
    /* Now its keys are stale: taken over at once. */
    REQUIRE(target_start(&t, f->srv.conn, port, 2) == 0);
    CHECK(raw_lists(f, name, t.addr, t.len));
    snprintf(rpc, sizeof rpc, "\"rpc_port\":%d", port);
    CHECK(raw_is(f, "rpc_meta", name, rpc));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(f->eng, name, &seg));
    CHECK(reads_seed(f->eng, seg, t.addr, t.len, 102));
    CHECK(target_quit(&t) == 0);
    CHECK(raw_missing(f, "ram", name) && raw_missing(f, "rpc_meta", name));
}

/* A clean exit deletes only keys this engine wrote: once another engine has
 * rewritten the name's descriptor, both keys stay. */
static void destroy_leaves_foreign_keys(fixture *f)
{
    target *t = &f->tgt;
    put_raw(f, "ram", t->name,
            "{\"name\":\"x\",\"buffers\":[],\"kvpipe_instance\":\"someone-else\"}");
    CHECK(target_quit(t) == 0);
    CHECK(raw_is(f, "ram", t->name, "someone-else"));
    CHECK(!raw_missing(f, "rpc_meta", t->name));
}

/* The published descriptor holds what Mooncake writes: each buffer named after
 * the segment, a local timestamp with microseconds, and, to etcd and redis,
 * a trailing newline; plus kvpipe's instance id, which a restarted process
 * draws anew. */
static void descriptor_as_mooncake_writes(fixture *f)
{
    target *t = &f->tgt;
    char *desc = NULL;
    REQUIRE_OK(lookup_desc(f->srv.conn, t->name, &desc));
    cJSON *d = cJSON_Parse(desc);
    REQUIRE(d);
    const cJSON *b, *bufs = cJSON_GetObjectItemCaseSensitive(d, "buffers");
    int n = 0;
    cJSON_ArrayForEach(b, bufs)
    {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(b, "name");
        CHECK(cJSON_IsString(name) && strcmp(name->valuestring, t->name) == 0);
        n++;
    }
    CHECK(n == 1);
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(d, "timestamp");
    int y, mo, da, h, mi, se, us, used = 0;
    CHECK(cJSON_IsString(ts) && strlen(ts->valuestring) == 26 &&
          sscanf(ts->valuestring, "%4d-%2d-%2d %2d:%2d:%2d.%6d%n", &y, &mo, &da, &h, &mi, &se, &us,
                 &used) == 7 &&
          used == 26);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(d, KVPI_INSTANCE_FIELD);
    REQUIRE(cJSON_IsString(id) && strlen(id->valuestring) == 32);
    CHECK(strspn(id->valuestring, "0123456789abcdef") == 32);
    if (f->ops) {
        char *key = kvpi_meta_key("ram", t->name), *raw = NULL;
        REQUIRE(key && f->ops->get(f->raw, key, &raw) == KVP_OK);
        size_t len = strlen(raw);
        int newline = len && raw[len - 1] == '\n';
        CHECK(newline == (strcmp(f->srv.kind, "http") != 0));
        free(key);
        free(raw);
    }
    char old_id[40];
    snprintf(old_id, sizeof old_id, "%s", id->valuestring);
    cJSON_Delete(d);
    free(desc);
    int port = t->port;
    target_kill(t);
    REQUIRE(target_start(t, f->srv.conn, port, 1) == 0);
    desc = NULL;
    REQUIRE_OK(lookup_desc(f->srv.conn, t->name, &desc));
    d = cJSON_Parse(desc);
    id = cJSON_GetObjectItemCaseSensitive(d, KVPI_INSTANCE_FIELD);
    CHECK(cJSON_IsString(id) && strcmp(id->valuestring, old_id) != 0);
    cJSON_Delete(d);
    free(desc);
}

/* Mooncake's MC_FORCE_TCP: an engine asked for "rdma" (what SGLang and vLLM's
 * MooncakeConnector pass) runs over TCP; without it, creation says how to. */
static void force_tcp_rdma_protocol(fixture *f)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = name;
    o.metadata = f->srv.conn;
    o.protocol = "rdma";
    /* No such device here: rdma cannot run, whether this build has UCX or not. */
    o.device_names = "mlx5_0";
    o.disable_shm = 1;
    o.timeout_ms = ENGINE_TIMEOUT_MS;
    kvp_engine *e = NULL;
    static const char *const off[] = {NULL, "0", "FALSE", "no", ""};
    for (size_t i = 0; i < sizeof off / sizeof off[0]; i++) {
        if (off[i])
            setenv("MC_FORCE_TCP", off[i], 1);
        else
            unsetenv("MC_FORCE_TCP");
        CHECK_ST(kvp_engine_create(&o, &e), KVP_ENOTSUP);
        CHECK(names(kvp_last_error(), "'rdma'", "MC_FORCE_TCP=1"));
        CHECK(names(kvp_last_error(), "protocol 'tcp'", "\"protocol\": \"tcp\""));
    }
    setenv("MC_FORCE_TCP", "1", 1);
    REQUIRE_OK(kvp_engine_create(&o, &e));
    unsetenv("MC_FORCE_TCP");
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, f->tgt.name, &seg));
    char *want = pattern(f->tgt.len, 100);
    REQUIRE(want);
    CHECK(read_matches(e, seg, f->tgt.addr, want, f->tgt.len));
    const char *via = kvp_engine_segment_transport(e, seg);
    CHECK(via && strcmp(via, "tcp") == 0);
    free(want);
    kvp_engine_destroy(e);
}

/* ---- the table ---- */

typedef struct behaviour {
    const char *name;
    void (*body)(fixture *f);
    int needs; /* NEEDS_* */
} behaviour;

static const behaviour behaviours[] = {
    {"transfer_read_write", transfer_read_write, 0},
    {"reregister_publishes", reregister_publishes, 0},
    {"cached_initiator_sees_new_region", cached_initiator_sees_new_region, 0},
    {"stale_descriptor_after_unregister", stale_descriptor_after_unregister, 0},
    {"destroy_removes_keys", destroy_removes_keys, 0},
    {"store_down_at_create", store_down_at_create, NEEDS_STORE},
    {"store_restart_while_running", store_restart_while_running, NEEDS_STORE},
    {"restarted_peer_replaces_descriptor", restarted_peer_replaces_descriptor, 0},
    {"second_engine_same_name_refused", second_engine_same_name_refused, 0},
    {"descriptor_as_mooncake_writes", descriptor_as_mooncake_writes, 0},
    {"force_tcp_rdma_protocol", force_tcp_rdma_protocol, 0},
    {"live_owner_elsewhere_then_gone", live_owner_elsewhere_then_gone, NEEDS_STORE},
    {"destroy_leaves_foreign_keys", destroy_leaves_foreign_keys, NEEDS_STORE},
    {"watched_restart_reaches_initiator", watched_restart_reaches_initiator, NEEDS_STORE},
    {"watch_survives_store_restart", watch_survives_store_restart, NEEDS_STORE},
    {"redis_without_config_polls", redis_without_config_polls, NEEDS_STORE | NEEDS_REDIS},
};

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN); /* a dead target's pipe must fail a write, not kill us */
    const char *filter = argc > 1 ? argv[1] : NULL;
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        for (size_t b = 0; b < sizeof behaviours / sizeof behaviours[0]; b++) {
            char name[128];
            snprintf(name, sizeof name, "%s/%s", kinds[k].name, behaviours[b].name);
            if (filter && !strstr(name, filter)) continue;
            cur_kind = &kinds[k];
            cur_body = behaviours[b].body;
            cur_needs = behaviours[b].needs;
            kvpt_run(name, engine_case, 120);
        }
    }
    return kvpt_summary();
}
