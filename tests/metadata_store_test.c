/* One conformance suite for every metadata store: the same cases run against
 * the HTTP store (kvpipe's own server), a real etcd and a real redis-server,
 * each started fresh on a free loopback port for each case. Case names are
 * "<store>/<behaviour>". */
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"

#define TIMEOUT_MS 3000

typedef struct store_kind {
    const char *name;
    int (*start)(kvpt_server *out);
} store_kind;

static const store_kind kinds[] = {
    {"http", kvpt_http_start},
    {"etcd", kvpt_etcd_start},
    {"redis", kvpt_redis_start},
};

/* The case being run: set by main before kvpt_run forks the case. */
static const store_kind *cur_kind;
static void (*cur_body)(kvpt_server *srv, const kvpi_store_ops *ops);

static void store_case(void)
{
    kvpt_server srv;
    int rc = cur_kind->start(&srv);
    if (rc == KVPT_SERVER_ABSENT) SKIP("%s", srv.why);
    if (rc != KVPT_SERVER_OK) {
        fprintf(stderr, "  cannot start %s: %s\n", cur_kind->name, srv.why);
        kvpt_failures++;
        return;
    }
    const kvpi_store_ops *ops = kvpi_store_lookup(srv.conn);
    CHECK(ops && strcmp(ops->name, cur_kind->name) == 0);
    if (ops && strcmp(ops->name, cur_kind->name) == 0) cur_body(&srv, ops);
    kvpt_server_stop(&srv);
}

static void *open_store(const kvpi_store_ops *ops, const char *conn)
{
    void *store = NULL;
    kvp_status st = ops->open(conn, TIMEOUT_MS, &store);
    if (st) fprintf(stderr, "  open %s: %s\n", conn, kvp_last_error());
    return st ? NULL : store;
}

/* 1 if key holds exactly want. */
static int holds(const kvpi_store_ops *ops, void *store, const char *key, const char *want)
{
    char *got = NULL;
    kvp_status st = ops->get(store, key, &got);
    int ok = st == KVP_OK && strcmp(got, want) == 0;
    if (!ok)
        fprintf(stderr, "  get '%.60s': %s (%s), got %.60s..., want %.60s...\n", key,
                kvp_strerror(st), kvp_last_error(), got ? got : "-", want);
    free(got);
    return ok;
}

static int missing(const kvpi_store_ops *ops, void *store, const char *key)
{
    char *got = NULL;
    kvp_status st = ops->get(store, key, &got);
    free(got);
    return st == KVP_ENOTFOUND;
}

/* ---- store level ---- */

static void put_get_overwrite_del(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    const char *k = "mooncake/ram/127.0.0.1:1000";
    CHECK(missing(ops, s, k));
    CHECK_OK(ops->put(s, k, "{\"v\":1}"));
    CHECK(holds(ops, s, k, "{\"v\":1}"));
    CHECK_OK(ops->put(s, k, "{\"v\":2,\"more\":[1,2,3]}"));
    CHECK(holds(ops, s, k, "{\"v\":2,\"more\":[1,2,3]}"));
    CHECK(missing(ops, s, "mooncake/ram/127.0.0.1:100")); /* a prefix is another key */
    CHECK_OK(ops->del(s, k));
    CHECK(missing(ops, s, k));
    CHECK_OK(ops->del(s, k)); /* deleting a missing key succeeds */
    char *got = (char *)0x1;
    CHECK_ST(ops->get(s, "no/such/key", &got), KVP_ENOTFOUND);
    CHECK(got == (char *)0x1); /* outputs set only on success */
    ops->close(s);
}

static void large_value(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    size_t n = (size_t)1 << 20;
    char *v = malloc(n + 1);
    REQUIRE(v);
    strcpy(v, "{\"blob\":\"");
    size_t i = strlen(v);
    for (; i < n - 2; i++)
        v[i] = (char)('a' + (i * 7 + i / 26) % 26);
    strcpy(v + i, "\"}");
    CHECK_OK(ops->put(s, "big", v));
    CHECK(holds(ops, s, "big", v));
    v[100] = 'Z'; /* overwrite with a value that differs in one byte */
    CHECK_OK(ops->put(s, "big", v));
    CHECK(holds(ops, s, "big", v));
    free(v);
    ops->close(s);
}

static void odd_keys_and_text(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    /* Keys that a careless encoder would merge or mangle. */
    static const char *keys[] = {
        "mooncake/ram/host:1234",
        "mooncake/ram/host 1234",
        "mooncake/ram/host+1234",
        "mooncake/ram/host%201234",
        "a?key=b&c=d#e",
        "k/with/many//slashes/",
        "ключ/鍵/🔑",
        "[::1]:5000",
    };
    size_t nk = sizeof keys / sizeof keys[0];
    char vals[8][128];
    for (size_t i = 0; i < nk; i++) {
        snprintf(
            vals[i], sizeof vals[i],
            "{\"i\":%zu,\"t\":\"é漢🙂 \\\"q\\\" \\\\ \\n\\t \\u0000 \\u00e9\",\"k\":\"%s\"}", i,
            i == 4 ? "x" : "y");
        CHECK_OK(ops->put(s, keys[i], vals[i]));
    }
    for (size_t i = 0; i < nk; i++)
        CHECK(holds(ops, s, keys[i], vals[i]));
    /* Multi-line, non-ASCII JSON stays byte-exact. */
    const char *pretty = "{\n\t\"name\": \"Ünïcødé\",\n\t\"list\": [1, 2.5e3, null, true]\n}";
    CHECK_OK(ops->put(s, keys[0], pretty));
    CHECK(holds(ops, s, keys[0], pretty));
    CHECK(holds(ops, s, keys[1], vals[1]));
    for (size_t i = 0; i < nk; i++)
        CHECK_OK(ops->del(s, keys[i]));
    for (size_t i = 0; i < nk; i++)
        CHECK(missing(ops, s, keys[i]));
    ops->close(s);
}

typedef struct worker_arg {
    const kvpi_store_ops *ops;
    void *store;
    int id;
    int errors;
} worker_arg;

#define WORKERS 8
#define ROUNDS 25

static void *worker(void *p)
{
    worker_arg *a = p;
    char key[64], val[96], *got;
    snprintf(key, sizeof key, "mooncake/ram/worker-%d", a->id);
    for (int r = 0; r < ROUNDS; r++) {
        snprintf(val, sizeof val, "{\"worker\":%d,\"round\":%d}", a->id, r);
        if (a->ops->put(a->store, key, val) != KVP_OK) a->errors++;
        got = NULL;
        if (a->ops->get(a->store, key, &got) != KVP_OK || strcmp(got, val) != 0) a->errors++;
        free(got);
        got = NULL;
        if (a->ops->get(a->store, "shared", &got) != KVP_OK || strcmp(got, "{\"shared\":true}"))
            a->errors++;
        free(got);
    }
    if (a->ops->del(a->store, key) != KVP_OK) a->errors++;
    return NULL;
}

static void concurrent_threads(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    REQUIRE_OK(ops->put(s, "shared", "{\"shared\":true}"));
    pthread_t t[WORKERS];
    worker_arg args[WORKERS];
    for (int i = 0; i < WORKERS; i++) {
        args[i] = (worker_arg){ops, s, i, 0};
        REQUIRE(pthread_create(&t[i], NULL, worker, &args[i]) == 0);
    }
    for (int i = 0; i < WORKERS; i++) {
        pthread_join(t[i], NULL);
        CHECK(args[i].errors == 0);
        char key[64];
        snprintf(key, sizeof key, "mooncake/ram/worker-%d", i);
        CHECK(missing(ops, s, key));
    }
    ops->close(s);
}

/* ---- kvpi_meta level ---- */

static const char *desc_json =
    "{\"name\":\"127.0.0.1:12345\",\"protocol\":\"tcp\",\"tcp_data_port\":23456,"
    "\"tcp_proto_version\":2,\"timestamp\":\"1700000000\",\"buffers\":[{\"name\":\"b0\","
    "\"addr\":140000000000,\"length\":4096}],\"kvpipe_instance\":\"me\"}";

static int same_json(const char *a, const char *b)
{
    cJSON *ja = cJSON_Parse(a), *jb = cJSON_Parse(b);
    int same = ja && jb && cJSON_Compare(ja, jb, 1);
    cJSON_Delete(ja);
    cJSON_Delete(jb);
    return same;
}

static kvpi_meta_self self_of(const char *seg, const char *desc, const char *host, int port,
                              const char *instance)
{
    return (kvpi_meta_self){.segment = seg,
                            .desc_json = desc,
                            .rpc_host = host,
                            .rpc_port = port,
                            .instance = instance};
}

/* Values as Mooncake writes them to this store: with a trailing newline to
 * etcd and redis, without one to the HTTP store. */
static int newline_as_mooncake(const kvpi_store_ops *ops, const char *got)
{
    size_t n = strlen(got);
    int has = n && got[n - 1] == '\n';
    int want = strcmp(ops->name, "http") != 0;
    if (has != want)
        fprintf(stderr, "  %s value %s a trailing newline\n", ops->name, has ? "has" : "lacks");
    return has == want;
}

/* Claim, read the raw keys through the store ops, fetch, release. */
static void meta_round_trip(kvpt_server *srv, const kvpi_store_ops *ops, const char *prefix)
{
    const char *seg = "127.0.0.1:12345";
    char ram[128], rpc[128];
    snprintf(ram, sizeof ram, "%sram/%s", prefix, seg);
    snprintf(rpc, sizeof rpc, "%srpc_meta/%s", prefix, seg);
    char *key = kvpi_meta_key("ram", seg);
    CHECK(key && strcmp(key, ram) == 0);
    free(key);

    kvpi_meta *meta = NULL;
    REQUIRE_OK(kvpi_meta_open(srv->conn, TIMEOUT_MS, NULL, NULL, &meta));
    CHECK(!kvpi_meta_is_p2p(meta));
    void *raw = open_store(ops, srv->conn);
    REQUIRE(raw);
    kvpi_meta_self me = self_of(seg, desc_json, "127.0.0.1", 12345, "me");
    CHECK_OK(kvpi_meta_claim(meta, &me));

    char *got = NULL;
    CHECK_OK(ops->get(raw, ram, &got));
    CHECK(got && same_json(got, desc_json) && newline_as_mooncake(ops, got));
    free(got);
    got = NULL;
    CHECK_OK(ops->get(raw, rpc, &got));
    CHECK(got && same_json(got, "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":12345}"));
    CHECK(got && newline_as_mooncake(ops, got));
    free(got);

    char *desc = NULL, *host = NULL;
    CHECK_OK(kvpi_meta_fetch(meta, seg, &desc, &host));
    CHECK(desc && same_json(desc, desc_json));
    CHECK(host && strcmp(host, "127.0.0.1") == 0);
    free(desc);
    free(host);

    CHECK_OK(kvpi_meta_release(meta, &me));
    CHECK(missing(ops, raw, ram));
    CHECK(missing(ops, raw, rpc));
    desc = host = NULL;
    CHECK_ST(kvpi_meta_fetch(meta, seg, &desc, &host), KVP_ENOTFOUND);
    CHECK(desc == NULL && host == NULL);
    ops->close(raw);
    kvpi_meta_close(meta);
}

static void meta_publish_fetch_remove(kvpt_server *srv, const kvpi_store_ops *ops)
{
    unsetenv("MC_METADATA_CLUSTER_ID");
    meta_round_trip(srv, ops, "mooncake/");
}

static void meta_cluster_id_prefix(kvpt_server *srv, const kvpi_store_ops *ops)
{
    setenv("MC_METADATA_CLUSTER_ID", "clusterA", 1);
    meta_round_trip(srv, ops, "mooncake/clusterA/");
    /* Nothing leaks to the unprefixed keys. */
    void *raw = open_store(ops, srv->conn);
    REQUIRE(raw);
    kvpi_meta *meta = NULL;
    REQUIRE_OK(kvpi_meta_open(srv->conn, TIMEOUT_MS, NULL, NULL, &meta));
    kvpi_meta_self me = self_of("h:1", desc_json, "h", 1, "me");
    CHECK_OK(kvpi_meta_claim(meta, &me));
    CHECK(missing(ops, raw, "mooncake/ram/h:1"));
    char *got = NULL;
    CHECK_OK(ops->get(raw, "mooncake/clusterA/ram/h:1", &got));
    CHECK(got && same_json(got, desc_json));
    free(got);
    /* Another cluster id does not see it. */
    setenv("MC_METADATA_CLUSTER_ID", "clusterB", 1);
    char *d = NULL, *h = NULL;
    CHECK_ST(kvpi_meta_fetch(meta, "h:1", &d, &h), KVP_ENOTFOUND);
    /* Mooncake adds the '/' only when the id lacks it. */
    setenv("MC_METADATA_CLUSTER_ID", "clusterA/", 1);
    CHECK_OK(kvpi_meta_fetch(meta, "h:1", &d, &h));
    free(d);
    free(h);
    kvpi_meta_close(meta);
    ops->close(raw);
}

static int names(const char *msg, const char *a, const char *b)
{
    int ok = strstr(msg, a) && (!b || strstr(msg, b));
    if (!ok)
        fprintf(stderr, "  message '%s' should name '%s'%s%s\n", msg, a, b ? " and " : "",
                b ? b : "");
    return ok;
}

/* ---- names: stale and live owners ---- */

#define SEG "127.0.0.1:12345"

static const char *other_desc =
    "{\"name\":\"127.0.0.1:12345\",\"protocol\":\"tcp\",\"tcp_data_port\":1,"
    "\"buffers\":[{\"name\":\"x\",\"addr\":4096,\"length\":4096}],"
    "\"kvpipe_instance\":\"other\"}";

/* Plant a name's keys as another engine would have left them: rpc_meta
 * pointing at host:port and that engine's descriptor. */
static void plant(const kvpi_store_ops *ops, void *raw, int port, const char *desc)
{
    char *rk = kvpi_meta_key("rpc_meta", SEG), *dk = kvpi_meta_key("ram", SEG), rpc[96];
    snprintf(rpc, sizeof rpc, "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":%d}", port);
    CHECK_OK(ops->put(raw, rk, rpc));
    CHECK_OK(ops->put(raw, dk, desc));
    free(rk);
    free(dk);
}

static int key_is(const kvpi_store_ops *ops, void *raw, const char *kind, const char *want)
{
    char *key = kvpi_meta_key(kind, SEG), *got = NULL;
    int ok = key && ops->get(raw, key, &got) == KVP_OK && same_json(got, want);
    if (!ok) fprintf(stderr, "  %s is %.200s, want %.200s\n", kind, got ? got : "(none)", want);
    free(key);
    free(got);
    return ok;
}

static const char *own_rpc = "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":12345}";

/* The engine that wrote the keys is gone (nothing answers at its rpc_meta's
 * address): the keys are taken over, its buffers are gone at once. On the
 * HTTP store, whose server refuses to overwrite rpc_meta, that takes a
 * delete. */
static void meta_claim_takes_stale_keys(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *raw = open_store(ops, srv->conn);
    REQUIRE(raw);
    plant(ops, raw, kvpt_free_port(), other_desc);
    kvpi_meta *meta = NULL;
    REQUIRE_OK(kvpi_meta_open(srv->conn, TIMEOUT_MS, NULL, NULL, &meta));
    kvpi_meta_self me = self_of(SEG, desc_json, "127.0.0.1", 12345, "me");
    CHECK_OK(kvpi_meta_claim(meta, &me));
    CHECK(key_is(ops, raw, "ram", desc_json));
    CHECK(key_is(ops, raw, "rpc_meta", own_rpc));
    /* An rpc_meta that is not even JSON holds no live engine either. */
    char *rk = kvpi_meta_key("rpc_meta", SEG);
    CHECK_OK(ops->del(raw, rk));
    CHECK_OK(ops->put(raw, rk, "garbage"));
    free(rk);
    CHECK_OK(kvpi_meta_claim(meta, &me));
    CHECK(key_is(ops, raw, "rpc_meta", own_rpc));
    kvpi_meta_close(meta);
    ops->close(raw);
}

/* Another live engine holds the name (it answers at its rpc_meta's address
 * as this segment, with another instance id; or as Mooncake does, with null):
 * refused, and its keys are left as they are. An engine of another name
 * answering there means the keys are stale. */
static void meta_claim_refuses_live_owner(kvpt_server *srv, const kvpi_store_ops *ops)
{
    static const struct {
        const char *reply;
        int live;
    } owners[] = {
        {"{\"name\":\"127.0.0.1:12345\",\"kvpipe_instance\":\"other\",\"buffers\":[]}", 1},
        {"{\"name\":\"127.0.0.1:12345\",\"protocol\":\"tcp\",\"buffers\":[]}", 1},
        {"null", 1},
        {"{\"name\":\"10.9.9.9:1\",\"kvpipe_instance\":\"other\"}", 0},
    };
    void *raw = open_store(ops, srv->conn);
    REQUIRE(raw);
    kvpi_meta *meta = NULL;
    REQUIRE_OK(kvpi_meta_open(srv->conn, TIMEOUT_MS, NULL, NULL, &meta));
    kvpi_meta_self me = self_of(SEG, desc_json, "127.0.0.1", 12345, "me");
    for (size_t i = 0; i < sizeof owners / sizeof owners[0]; i++) {
        int port = kvpt_free_port();
        pid_t owner = kvpt_handshake_responder(port, owners[i].reply);
        REQUIRE(owner > 0);
        char *rk = kvpi_meta_key("rpc_meta", SEG), rpc[96];
        CHECK_OK(ops->del(raw, rk));
        free(rk);
        plant(ops, raw, port, other_desc);
        snprintf(rpc, sizeof rpc, "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":%d}", port);
        kvp_status st = kvpi_meta_claim(meta, &me);
        if (owners[i].live) {
            CHECK_ST(st, KVP_EBUSY);
            CHECK(names(kvp_last_error(), "'127.0.0.1:12345' is in use", NULL));
            char addr[32];
            snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
            CHECK(names(kvp_last_error(), addr, srv->addr)); /* its address, and the store's */
            if (i == 0) fprintf(stderr, "  refused: %s\n", kvp_last_error());
            CHECK(key_is(ops, raw, "ram", other_desc));
            CHECK(key_is(ops, raw, "rpc_meta", rpc));
        } else {
            CHECK_OK(st);
            CHECK(key_is(ops, raw, "ram", desc_json));
            CHECK(key_is(ops, raw, "rpc_meta", own_rpc));
        }
        kill(owner, SIGKILL);
        waitpid(owner, NULL, 0);
    }
    kvpi_meta_close(meta);
    ops->close(raw);
}

/* The raw store, and a meta on it that claimed SEG as self "me"; 0, or -1
 * with the reason printed. */
static int claim_seg(kvpt_server *srv, const kvpi_store_ops *ops, void **raw, kvpi_meta **meta,
                     kvpi_meta_self *me)
{
    *raw = open_store(ops, srv->conn);
    *meta = NULL;
    *me = self_of(SEG, desc_json, "127.0.0.1", 12345, "me");
    kvp_status st = *raw ? kvpi_meta_open(srv->conn, TIMEOUT_MS, NULL, NULL, meta) : KVP_EIO;
    if (st == KVP_OK) st = kvpi_meta_claim(*meta, me);
    if (st) fprintf(stderr, "  claim %s: %s\n", SEG, kvp_last_error());
    return st ? -1 : 0;
}

/* Release deletes only what is this engine's. */
static void meta_release_leaves_foreign_keys(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *raw;
    kvpi_meta *meta;
    kvpi_meta_self me;
    REQUIRE(claim_seg(srv, ops, &raw, &meta, &me) == 0);
    /* Another engine took the name meanwhile: both keys are its now. */
    char *dk = kvpi_meta_key("ram", SEG);
    CHECK_OK(ops->put(raw, dk, other_desc));
    CHECK_OK(kvpi_meta_release(meta, &me));
    CHECK(key_is(ops, raw, "ram", other_desc));
    CHECK(key_is(ops, raw, "rpc_meta", own_rpc));
    /* The descriptor is gone, rpc_meta points elsewhere: not ours either. */
    CHECK_OK(ops->del(raw, dk));
    char *rk = kvpi_meta_key("rpc_meta", SEG);
    CHECK_OK(ops->del(raw, rk));
    const char *elsewhere = "{\"ip_or_host_name\":\"10.0.0.9\",\"rpc_port\":12345}";
    CHECK_OK(ops->put(raw, rk, elsewhere));
    CHECK_OK(kvpi_meta_release(meta, &me));
    CHECK(key_is(ops, raw, "rpc_meta", elsewhere));
    free(dk);
    free(rk);
    kvpi_meta_close(meta);
    ops->close(raw);
}

/* The keeper's repair puts back what the store lost, rewrites a descriptor of
 * this instance that differs, and leaves keys another engine took. */
static void meta_repair(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *raw;
    kvpi_meta *meta;
    kvpi_meta_self me;
    REQUIRE(claim_seg(srv, ops, &raw, &meta, &me) == 0);
    CHECK_OK(kvpi_meta_repair(meta, &me)); /* nothing lost: nothing to do */
    char *dk = kvpi_meta_key("ram", SEG), *rk = kvpi_meta_key("rpc_meta", SEG);
    CHECK_OK(ops->del(raw, dk));
    CHECK_OK(ops->del(raw, rk));
    CHECK_OK(kvpi_meta_repair(meta, &me));
    CHECK(key_is(ops, raw, "ram", desc_json));
    CHECK(key_is(ops, raw, "rpc_meta", own_rpc));
    const char *older = "{\"name\":\"127.0.0.1:12345\",\"kvpipe_instance\":\"me\",\"v\":0}";
    CHECK_OK(ops->put(raw, dk, older));
    CHECK_OK(kvpi_meta_repair(meta, &me));
    CHECK(key_is(ops, raw, "ram", desc_json));
    CHECK_OK(ops->put(raw, dk, other_desc));
    CHECK_OK(ops->del(raw, rk));
    CHECK_ST(kvpi_meta_repair(meta, &me), KVP_EBUSY);
    CHECK(names(kvp_last_error(), "another engine", SEG));
    CHECK(key_is(ops, raw, "ram", other_desc));
    CHECK(missing(ops, raw, rk));
    free(dk);
    free(rk);
    kvpi_meta_close(meta);
    ops->close(raw);
}

/* ---- failure and recovery ---- */

static void down_at_open(kvpt_server *srv, const kvpi_store_ops *ops)
{
    kvpt_server_down(srv);
    void *s = (void *)0x1;
    CHECK_ST(ops->open(srv->conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(s == (void *)0x1);
    CHECK(names(kvp_last_error(), srv->kind, srv->addr));
    kvpi_meta *meta = NULL;
    CHECK_ST(kvpi_meta_open(srv->conn, TIMEOUT_MS, NULL, NULL, &meta), KVP_EMETADATA);
    CHECK(meta == NULL);
    CHECK(names(kvp_last_error(), srv->kind, srv->addr));
}

static void restart_in_use(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    CHECK_OK(ops->put(s, "before", "{\"v\":1}"));
    kvpt_server_down(srv);
    /* While it is down, calls fail (they do not hang) and say where. */
    char *got = NULL;
    CHECK_ST(ops->get(s, "before", &got), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), srv->kind, srv->addr));
    CHECK_ST(ops->put(s, "during", "{}"), KVP_EMETADATA);
    REQUIRE(kvpt_server_up(srv) == KVPT_SERVER_OK);
    /* The same handle works again: redis reconnects, http and etcd open a new
     * connection. etcd keeps its data on disk; redis (no persistence) and the
     * in-memory HTTP store come back empty. */
    if (strcmp(srv->kind, "etcd") == 0)
        CHECK(holds(ops, s, "before", "{\"v\":1}"));
    else
        CHECK(missing(ops, s, "before"));
    CHECK_OK(ops->put(s, "after", "{\"v\":2}"));
    CHECK(holds(ops, s, "after", "{\"v\":2}"));
    /* And again, without an intervening failed call: the first call after the
     * restart must itself succeed (the reconnect is transparent). */
    REQUIRE(kvpt_server_restart(srv) == KVPT_SERVER_OK);
    CHECK_OK(ops->put(s, "after2", "{\"v\":3}"));
    CHECK(holds(ops, s, "after2", "{\"v\":3}"));
    ops->close(s);
}

/* A server that accepts connections and never answers: open fails with the
 * store's error instead of hanging (the case's alarm would catch a hang). */
static void silent_server(kvpt_server *srv, const kvpi_store_ops *ops)
{
    int fd, port;
    REQUIRE_OK(kvpi_tcp_listen("127.0.0.1", 0, &fd, &port));
    char addr[32], conn[300];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    const char *at = strstr(srv->conn, srv->addr);
    REQUIRE(at);
    snprintf(conn, sizeof conn, "%.*s%s%s", (int)(at - srv->conn), srv->conn, addr,
             at + strlen(srv->addr));
    void *s = NULL;
    CHECK_ST(ops->open(conn, 500, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), srv->kind, addr));
    close(fd);
}

/* ---- store-specific ---- */

static void etcd_failover(kvpt_server *srv, const kvpi_store_ops *ops)
{
    int dead = kvpt_free_port();
    char conn[300], dead_addr[32];
    snprintf(dead_addr, sizeof dead_addr, "127.0.0.1:%d", dead);
    snprintf(conn, sizeof conn, "etcd://%s,%s", dead_addr, srv->addr);
    void *s = open_store(ops, conn);
    REQUIRE(s);
    CHECK_OK(ops->put(s, "k", "{\"via\":\"second\"}"));
    CHECK(holds(ops, s, "k", "{\"via\":\"second\"}"));
    /* The live endpoint serves the same data to a plain client. */
    void *direct = open_store(ops, srv->conn);
    REQUIRE(direct);
    CHECK(holds(ops, direct, "k", "{\"via\":\"second\"}"));
    ops->close(direct);
    /* A bare h:p list (Mooncake's form, ';' separated too) is etcd as well. */
    snprintf(conn, sizeof conn, "%s;%s", dead_addr, srv->addr);
    CHECK(kvpi_store_lookup(conn) == ops);
    void *bare = open_store(ops, conn);
    CHECK(bare && holds(ops, bare, "k", "{\"via\":\"second\"}"));
    if (bare) ops->close(bare);
    /* Both down: the error names every endpoint tried. */
    kvpt_server_down(srv);
    char *got = NULL;
    CHECK_ST(ops->get(s, "k", &got), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), dead_addr, srv->addr));
    CHECK(names(kvp_last_error(), "etcd", "unreachable"));
    ops->close(s);
    snprintf(conn, sizeof conn, "etcd://%s,%s", srv->addr, dead_addr);
    CHECK_ST(ops->open(conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), dead_addr, srv->addr));
}

static size_t discard(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    (void)ptr;
    (void)userdata;
    return size * nmemb;
}

/* Put a raw gateway body, bypassing the store (to plant values kvpipe would
 * never write). */
static int etcd_raw_put(const kvpt_server *srv, const char *body)
{
    char url[128];
    snprintf(url, sizeof url, "http://%s/v3/kv/put", srv->addr);
    CURL *h = curl_easy_init();
    if (!h) return -1;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 3000L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard);
    long code = 0;
    CURLcode rc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(h);
    return rc == CURLE_OK && code == 200 ? 0 : -1;
}

static void etcd_non_text_values(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    /* key "nul" = bnVs, value bytes 00 01 02 = AAEC */
    REQUIRE(etcd_raw_put(srv, "{\"key\":\"bnVs\",\"value\":\"AAEC\"}") == 0);
    char *got = NULL;
    CHECK_ST(ops->get(s, "nul", &got), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "etcd", "'nul'"));
    CHECK(got == NULL);
    /* An empty value: the gateway leaves "value" out. */
    REQUIRE(etcd_raw_put(srv, "{\"key\":\"ZW1wdHk=\"}") == 0);
    CHECK(holds(ops, s, "empty", ""));
    ops->close(s);
}

static void etcd_bad_conn(kvpt_server *srv, const kvpi_store_ops *ops)
{
    (void)srv;
    void *s = NULL;
    CHECK_ST(ops->open("etcd://", TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK_ST(ops->open("etcd://127.0.0.1:99999", TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "99999", NULL));
    CHECK(kvpi_store_lookup("P2PHANDSHAKE") == NULL);
    CHECK(kvpi_store_lookup("127.0.0.1:2379") == &kvpi_store_etcd);
    CHECK(kvpi_store_lookup("etcd://a:1,b:2") == &kvpi_store_etcd);
    CHECK(kvpi_store_lookup("redis://a:1") == &kvpi_store_redis);
    CHECK(kvpi_store_lookup("http://a:1/metadata") == &kvpi_store_http);
}

/* An HTTP metadata store given as a bare h:p (which means etcd, as in
 * Mooncake): the error says what was assumed and what was probably meant. */
static void etcd_bare_hp_at_http_store(kvpt_server *unused, const kvpi_store_ops *ops)
{
    (void)unused;
    kvpt_server http;
    REQUIRE(kvpt_http_start(&http) == KVPT_SERVER_OK);
    kvpi_meta *meta = (kvpi_meta *)0x1;
    CHECK(kvpi_store_lookup(http.addr) == ops);
    CHECK_ST(kvpi_meta_open(http.addr, TIMEOUT_MS, NULL, NULL, &meta), KVP_EMETADATA);
    CHECK(meta == (kvpi_meta *)0x1);
    char want[128];
    snprintf(want, sizeof want, "http://%s/metadata", http.addr);
    CHECK(names(kvp_last_error(), "does not answer like etcd", want));
    CHECK(names(kvp_last_error(), "without a scheme means etcd", "HTTP 404"));
    fprintf(stderr, "  %s\n", kvp_last_error());
    char conn[128];
    snprintf(conn, sizeof conn, "etcd://%s", http.addr);
    CHECK_ST(kvpi_meta_open(conn, TIMEOUT_MS, NULL, NULL, &meta), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "etcd:// says so", want));
    kvpt_server_stop(&http);
}

/* A raw hiredis connection to the fixture, for server-side setup. */
static redisReply *redis_raw(const kvpt_server *srv, const char *cmd)
{
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", srv->port, tv);
    redisReply *r = c && !c->err ? redisCommand(c, cmd) : NULL;
    if (c) redisFree(c);
    return r;
}

static void redis_non_text_values(kvpt_server *srv, const kvpi_store_ops *ops)
{
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    redisReply *r = redis_raw(srv, "LPUSH alist x");
    REQUIRE(r && r->type == REDIS_REPLY_INTEGER);
    freeReplyObject(r);
    char *got = NULL;
    CHECK_ST(ops->get(s, "alist", &got), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "WRONGTYPE", srv->addr));
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", srv->port, tv);
    REQUIRE(c && !c->err);
    r = redisCommand(c, "SET %s %b", "nul", "a\0b", (size_t)3);
    CHECK(r && r->type == REDIS_REPLY_STATUS);
    if (r) freeReplyObject(r);
    redisFree(c);
    CHECK_ST(ops->get(s, "nul", &got), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "not text", "nul"));
    CHECK(got == NULL);
    ops->close(s);
}

static void redis_db_select(kvpt_server *srv, const kvpi_store_ops *ops)
{
    char conn[300];
    snprintf(conn, sizeof conn, "%s/3", srv->conn);
    void *db3 = open_store(ops, conn), *db0 = open_store(ops, srv->conn);
    REQUIRE(db3 && db0);
    CHECK_OK(ops->put(db3, "k", "{\"db\":3}"));
    CHECK(holds(ops, db3, "k", "{\"db\":3}"));
    CHECK(missing(ops, db0, "k"));
    ops->close(db3);
    ops->close(db0);
    void *s = NULL;
    snprintf(conn, sizeof conn, "%s/notanumber", srv->conn);
    CHECK_ST(ops->open(conn, TIMEOUT_MS, &s), KVP_EMETADATA);
}

static void redis_auth(kvpt_server *srv, const kvpi_store_ops *ops)
{
    redisReply *r = redis_raw(srv, "ACL SETUSER alice on >s3cr@t:x ~* +@all");
    REQUIRE(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    r = redis_raw(srv, "CONFIG SET requirepass topsecret");
    REQUIRE(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    char conn[300];
    void *s = NULL;
    /* No password: the server's NOAUTH surfaces at open. */
    CHECK_ST(ops->open(srv->conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "redis", srv->addr));
    snprintf(conn, sizeof conn, "redis://:wrong@%s", srv->addr);
    CHECK_ST(ops->open(conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "AUTH", srv->addr));
    /* Password only (the default user). */
    snprintf(conn, sizeof conn, "redis://:topsecret@%s", srv->addr);
    s = open_store(ops, conn);
    CHECK(s && ops->put(s, "k", "{\"by\":\"default\"}") == KVP_OK);
    if (s) ops->close(s);
    /* ACL user, with '@' and ':' percent-encoded in the password. */
    snprintf(conn, sizeof conn, "redis://alice:s3cr%%40t%%3Ax@%s/0", srv->addr);
    s = open_store(ops, conn);
    CHECK(s && holds(ops, s, "k", "{\"by\":\"default\"}"));
    if (s) ops->close(s);
}

/* Mooncake's MC_REDIS_* variables, against a redis-server started with a
 * password (--requirepass): the same connection string works for Mooncake
 * and kvpipe. */
static void redis_env_password(kvpt_server *unused, const kvpi_store_ops *ops)
{
    (void)unused;
    kvpt_server srv;
    REQUIRE(kvpt_redis_start_auth(&srv, "pw-env") == KVPT_SERVER_OK);
    unsetenv("MC_REDIS_PASSWORD");
    unsetenv("MC_REDIS_USERNAME");
    void *s = NULL;
    CHECK_ST(ops->open(srv.conn, TIMEOUT_MS, &s), KVP_EMETADATA); /* NOAUTH */
    CHECK(names(kvp_last_error(), "NOAUTH", srv.addr));
    setenv("MC_REDIS_PASSWORD", "wrong", 1);
    CHECK_ST(ops->open(srv.conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "AUTH", srv.addr));
    CHECK(strstr(kvp_last_error(), "wrong") == NULL); /* never the password */
    setenv("MC_REDIS_PASSWORD", "pw-env", 1);
    s = open_store(ops, srv.conn);
    CHECK(s && ops->put(s, "k", "{\"by\":\"env\"}") == KVP_OK);
    if (s) ops->close(s);
    /* A password in the string wins over the variables. */
    char conn[300];
    snprintf(conn, sizeof conn, "redis://:wrong@%s", srv.addr);
    CHECK_ST(ops->open(conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    setenv("MC_REDIS_PASSWORD", "wrong", 1);
    snprintf(conn, sizeof conn, "redis://:pw-env@%s", srv.addr);
    s = open_store(ops, conn);
    CHECK(s && holds(ops, s, "k", "{\"by\":\"env\"}"));
    if (s) ops->close(s);
    /* An empty MC_REDIS_PASSWORD sends no AUTH, as in Mooncake. */
    setenv("MC_REDIS_PASSWORD", "", 1);
    CHECK_ST(ops->open(srv.conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "NOAUTH", NULL));
    /* The engine-level path: kvpi_meta over the same string. */
    setenv("MC_REDIS_PASSWORD", "pw-env", 1);
    kvpi_meta *meta = NULL;
    CHECK_OK(kvpi_meta_open(srv.conn, TIMEOUT_MS, NULL, NULL, &meta));
    kvpi_meta_close(meta);
    unsetenv("MC_REDIS_PASSWORD");
    kvpt_server_stop(&srv);
}

static void redis_env_username(kvpt_server *unused, const kvpi_store_ops *ops)
{
    (void)unused;
    kvpt_server srv;
    REQUIRE(kvpt_redis_start_auth(&srv, "admin-pw") == KVPT_SERVER_OK);
    char conn[300];
    snprintf(conn, sizeof conn, "redis://:admin-pw@%s", srv.addr);
    void *admin = open_store(ops, conn);
    REQUIRE(admin);
    /* An ACL user that may only touch mooncake/ keys. */
    redisContext *c = redisConnect("127.0.0.1", srv.port);
    REQUIRE(c && !c->err);
    redisReply *r = redisCommand(c, "AUTH admin-pw");
    if (r) freeReplyObject(r);
    r = redisCommand(c, "ACL SETUSER mc on >mc-pw ~mooncake/* +@all");
    CHECK(r && r->type == REDIS_REPLY_STATUS);
    if (r) freeReplyObject(r);
    redisFree(c);
    setenv("MC_REDIS_USERNAME", "mc", 1);
    setenv("MC_REDIS_PASSWORD", "mc-pw", 1);
    void *s = open_store(ops, srv.conn);
    REQUIRE(s);
    CHECK_OK(ops->put(s, "mooncake/ram/x:1", "{}"));
    CHECK_ST(ops->put(s, "elsewhere", "{}"), KVP_EMETADATA); /* NOPERM: it is user mc */
    CHECK(names(kvp_last_error(), "NOPERM", NULL));
    ops->close(s);
    /* A username without a password is not used (Mooncake's rule). */
    unsetenv("MC_REDIS_PASSWORD");
    CHECK_ST(ops->open(srv.conn, TIMEOUT_MS, &s), KVP_EMETADATA);
    CHECK(names(kvp_last_error(), "NOAUTH", NULL));
    unsetenv("MC_REDIS_USERNAME");
    ops->close(admin);
    kvpt_server_stop(&srv);
}

static void redis_env_db_index(kvpt_server *srv, const kvpi_store_ops *ops)
{
    char conn[300];
    snprintf(conn, sizeof conn, "%s/3", srv->conn);
    unsetenv("MC_REDIS_DB_INDEX");
    void *db3 = open_store(ops, conn);
    REQUIRE(db3);
    setenv("MC_REDIS_DB_INDEX", "3", 1);
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    CHECK_OK(ops->put(s, "k", "{\"db\":3}"));
    CHECK(holds(ops, db3, "k", "{\"db\":3}"));
    ops->close(s);
    /* The string's database wins. */
    snprintf(conn, sizeof conn, "%s/0", srv->conn);
    s = open_store(ops, conn);
    CHECK(s && missing(ops, s, "k"));
    if (s) ops->close(s);
    /* A value Mooncake would warn about and replace with 0 is refused. */
    static const char *const bad[] = {"x", "256", "-1", "", "3x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("MC_REDIS_DB_INDEX", bad[i], 1);
        s = (void *)0x1;
        CHECK_ST(ops->open(srv->conn, TIMEOUT_MS, &s), KVP_EMETADATA);
        CHECK(s == (void *)0x1);
        CHECK(names(kvp_last_error(), "MC_REDIS_DB_INDEX", "0..255"));
    }
    unsetenv("MC_REDIS_DB_INDEX");
    ops->close(db3);
}

/* ---- the table ---- */

typedef struct behaviour {
    const char *name;
    void (*body)(kvpt_server *srv, const kvpi_store_ops *ops);
    const char *only; /* run for this store only; NULL: every store */
} behaviour;

/* get_many: present keys' values, NULL for missing ones, one round trip. */
static void get_many(kvpt_server *srv, const kvpi_store_ops *ops)
{
    if (!ops->get_many) SKIP("%s reads one key at a time", ops->name);
    void *s = open_store(ops, srv->conn);
    REQUIRE(s);
    CHECK_OK(ops->put(s, "mooncake/ram/a", "{\"a\":1}\n"));
    CHECK_OK(ops->put(s, "mooncake/rpc_meta/b", "B"));
    const char *keys[] = {"mooncake/ram/a", "mooncake/rpc_meta/a", "mooncake/rpc_meta/b"};
    char *v[3] = {(char *)0x1, (char *)0x1, (char *)0x1};
    CHECK_OK(ops->get_many(s, keys, 3, v));
    CHECK(v[0] && strcmp(v[0], "{\"a\":1}\n") == 0);
    CHECK(v[1] == NULL);
    CHECK(v[2] && strcmp(v[2], "B") == 0);
    free(v[0]);
    free(v[2]);
    ops->close(s);
}

/* What a watch hands its caller, collected. */
typedef struct seen {
    pthread_mutex_t lock;
    char names[64][128];
    int n, resyncs;
} seen;

static void on_change(void *ctx, const char *segment)
{
    seen *w = ctx;
    pthread_mutex_lock(&w->lock);
    if (!segment)
        w->resyncs++;
    else if (w->n < 64)
        snprintf(w->names[w->n++], sizeof w->names[0], "%s", segment);
    pthread_mutex_unlock(&w->lock);
}

static int saw(seen *w, const char *name)
{
    for (int waited = 0; waited < 3000; waited += 5, usleep(5000)) {
        pthread_mutex_lock(&w->lock);
        int found = 0;
        for (int i = 0; i < w->n && !found; i++)
            found = strcmp(w->names[i], name) == 0;
        pthread_mutex_unlock(&w->lock);
        if (found) return 1;
    }
    fprintf(stderr, "  no change of '%s' seen\n", name);
    return 0;
}

/* kvpi_meta_watch: changes of any writer's keys, named by segment (etcd,
 * redis); a store without a watch is polled (http). */
static void meta_watch(kvpt_server *srv, const kvpi_store_ops *ops)
{
    kvpi_meta *m;
    REQUIRE_OK(kvpi_meta_open(srv->conn, TIMEOUT_MS, NULL, NULL, &m));
    void *raw = open_store(ops, srv->conn);
    REQUIRE(raw);
    seen w = {.lock = PTHREAD_MUTEX_INITIALIZER};
    kvpi_meta_watch *watch;
    REQUIRE_OK(kvpi_meta_watch_start(m, 200, on_change, &w, &watch));
    int want = ops->watch ? KVPI_WATCH_STREAMING : KVPI_WATCH_POLLING;
    for (int i = 0; i < 500 && kvpi_meta_watch_state(watch) != want; i++)
        usleep(10000);
    CHECK(kvpi_meta_watch_state(watch) == want);
    if (ops->watch) {
        pthread_mutex_lock(&w.lock);
        int resyncs = w.resyncs;
        pthread_mutex_unlock(&w.lock);
        CHECK(resyncs >= 1); /* established: the caller revalidates once */
        CHECK_OK(ops->put(raw, "mooncake/ram/seg-a", "{}"));
        CHECK(saw(&w, "seg-a"));
        CHECK_OK(ops->put(raw, "mooncake/rpc_meta/seg-b", "{}"));
        CHECK(saw(&w, "seg-b"));
        pthread_mutex_lock(&w.lock);
        w.n = 0;
        pthread_mutex_unlock(&w.lock);
        CHECK_OK(ops->del(raw, "mooncake/ram/seg-a"));
        CHECK(saw(&w, "seg-a"));                       /* deleted */
        CHECK_OK(ops->put(raw, "mooncake/x/y", "{}")); /* a name with a '/' */
        CHECK(saw(&w, "x/y"));
        CHECK_OK(ops->put(raw, "other/ram/seg-c", "{}")); /* not below the prefix */
        usleep(200000);
        pthread_mutex_lock(&w.lock);
        for (int i = 0; i < w.n; i++)
            CHECK(strcmp(w.names[i], "seg-c") != 0);
        pthread_mutex_unlock(&w.lock);
    } else {
        pthread_mutex_lock(&w.lock);
        int before = w.resyncs;
        pthread_mutex_unlock(&w.lock);
        usleep(700000);
        pthread_mutex_lock(&w.lock);
        int after = w.resyncs;
        pthread_mutex_unlock(&w.lock);
        CHECK(after >= before + 2); /* every 200 ms */
    }
    uint64_t t = kvpi_now_ns();
    kvpi_meta_watch_stop(watch);
    CHECK(kvpi_now_ns() - t < 500000000u); /* a waiting stream stops at once */
    ops->close(raw);
    kvpi_meta_close(m);
}

static const behaviour behaviours[] = {
    {"put_get_overwrite_del", put_get_overwrite_del, NULL},
    {"large_value", large_value, NULL},
    {"odd_keys_and_text", odd_keys_and_text, NULL},
    {"concurrent_threads", concurrent_threads, NULL},
    {"meta_publish_fetch_remove", meta_publish_fetch_remove, NULL},
    {"meta_cluster_id_prefix", meta_cluster_id_prefix, NULL},
    {"meta_claim_takes_stale_keys", meta_claim_takes_stale_keys, NULL},
    {"meta_claim_refuses_live_owner", meta_claim_refuses_live_owner, NULL},
    {"meta_release_leaves_foreign_keys", meta_release_leaves_foreign_keys, NULL},
    {"meta_repair", meta_repair, NULL},
    {"down_at_open", down_at_open, NULL},
    {"restart_in_use", restart_in_use, NULL},
    {"silent_server", silent_server, NULL},
    {"get_many", get_many, NULL},
    {"meta_watch", meta_watch, NULL},
    {"failover", etcd_failover, "etcd"},
    {"bad_conn", etcd_bad_conn, "etcd"},
    {"bare_hp_at_http_store", etcd_bare_hp_at_http_store, "etcd"},
    {"non_text_values", etcd_non_text_values, "etcd"},
    {"non_text_values", redis_non_text_values, "redis"},
    {"db_select", redis_db_select, "redis"},
    {"auth", redis_auth, "redis"},
    {"env_password", redis_env_password, "redis"},
    {"env_username", redis_env_username, "redis"},
    {"env_db_index", redis_env_db_index, "redis"},
};

int main(int argc, char **argv)
{
    /* Optional filter: run only cases whose name contains argv[1]. */
    const char *filter = argc > 1 ? argv[1] : NULL;
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        for (size_t b = 0; b < sizeof behaviours / sizeof behaviours[0]; b++) {
            const behaviour *bh = &behaviours[b];
            if (bh->only && strcmp(bh->only, kinds[k].name) != 0) continue;
            char name[128];
            snprintf(name, sizeof name, "%s/%s", kinds[k].name, bh->name);
            if (filter && !strstr(name, filter)) continue;
            cur_kind = &kinds[k];
            cur_body = bh->body;
            kvpt_run(name, store_case, 90);
        }
    }
    return kvpt_summary();
}
