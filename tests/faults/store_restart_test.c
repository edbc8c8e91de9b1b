/* A metadata store killed (SIGKILL) and restarted under live engines (issue
 * 10, issue 11's process faults): while it is down, registration fails at
 * once with a clear error and changes nothing; once it is back, each engine's
 * segment is published again, both keys, and a peer that opens it afresh
 * transfers to it. Every store: kvpipe's HTTP store as a process of its own,
 * etcd, redis. The target engine runs in another process. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "peer.h"
#include "test.h"

#define LEN (((size_t)512 << 10) + 77)
#define SEED 31
#define BACK_WITHIN_MS 20000 /* the keepers look every 2 s */

typedef struct store_kind {
    const char *name;
    int (*start)(kvpt_server *out);
} store_kind;

static int http_cli(kvpt_server *out)
{
    return kvpt_http_cli_start(out, NULL);
}

static const store_kind kinds[] = {
    {"http", http_cli},
    {"etcd", kvpt_etcd_start},
    {"redis", kvpt_redis_start},
};
static const store_kind *cur;

static int has_key(const kvpi_store_ops *ops, void *raw, const char *kind, const char *seg)
{
    char *key = kvpi_meta_key(kind, seg), *v = NULL;
    int ok = key && ops->get(raw, key, &v) == KVP_OK;
    free(key);
    free(v);
    return ok;
}

static int all_keys(const kvpi_store_ops *ops, void *raw, const char *a, const char *b)
{
    return has_key(ops, raw, "ram", a) && has_key(ops, raw, "rpc_meta", a) &&
           has_key(ops, raw, "ram", b) && has_key(ops, raw, "rpc_meta", b);
}

static int reads_back(kvp_engine *e, const char *seg, const kvpt_target *t)
{
    kvp_segment_id id;
    if (kvp_engine_open_segment(e, seg, &id) != KVP_OK) {
        fprintf(stderr, "  open %s: %s\n", seg, kvp_last_error());
        return 0;
    }
    char *buf = malloc(t->len);
    if (!buf) return 0;
    kvp_status st = kvp_engine_read(e, id, buf, (uint64_t)(uintptr_t)t->buf, t->len);
    int ok = st == KVP_OK && kvpt_verify(buf, t->len, SEED) == (size_t)-1;
    if (st) fprintf(stderr, "  read %s: %s\n", seg, kvp_last_error());
    free(buf);
    return ok;
}

static void restart_under_live_engines(void)
{
    kvpt_server srv;
    int rc = cur->start(&srv);
    if (rc == KVPT_SERVER_ABSENT) SKIP("%s", srv.why);
    REQUIRE(rc == KVPT_SERVER_OK);
    const kvpi_store_ops *ops = kvpi_store_lookup(srv.conn);
    void *raw = NULL;
    REQUIRE(ops && ops->open(srv.conn, 3000, &raw) == KVP_OK);
    kvpt_target_opts to = {.metadata = srv.conn, .len = LEN, .seed = SEED, .disable_shm = 1};
    kvpt_target t;
    REQUIRE(kvpt_target_start(&to, &t) == 0);
    kvp_engine *ini = NULL;
    REQUIRE(kvpt_initiator_start(srv.conn, NULL, 1, 0, &ini) == 0);
    const char *ini_name = kvp_engine_segment_name(ini);
    CHECK(all_keys(ops, raw, t.name, ini_name));
    CHECK(reads_back(ini, t.name, &t));

    kvpt_server_kill(&srv);
    usleep(2500 * 1000); /* the keepers find it gone */
    /* Down: registering fails at once, saying where, and registers nothing. */
    static char region[4096];
    uint64_t t0 = kvpi_now_ms();
    CHECK_ST(kvp_engine_register(ini, region, sizeof region), KVP_EMETADATA);
    CHECK(strstr(kvp_last_error(), srv.addr) != NULL);
    CHECK(kvpi_now_ms() - t0 < 15000);
    /* Transfers between running engines do not need the store. */
    CHECK(reads_back(ini, t.name, &t));

    REQUIRE(kvpt_server_up(&srv) == KVPT_SERVER_OK);
    ops->close(raw);
    REQUIRE(ops->open(srv.conn, 3000, &raw) == KVP_OK);
    /* etcd kept its keys on disk: drop them, as a store that lost them. */
    const char *names[] = {t.name, ini_name};
    for (int i = 0; i < 2; i++) {
        char *k1 = kvpi_meta_key("ram", names[i]), *k2 = kvpi_meta_key("rpc_meta", names[i]);
        CHECK(ops->del(raw, k1) == KVP_OK && ops->del(raw, k2) == KVP_OK);
        free(k1);
        free(k2);
    }
    uint64_t back = kvpi_now_ms();
    int published = 0;
    while (!(published = all_keys(ops, raw, t.name, ini_name)) &&
           kvpi_now_ms() - back < BACK_WITHIN_MS)
        usleep(100 * 1000);
    fprintf(stderr, "  %s: both engines' keys back %llu ms after the store\n", cur->name,
            (unsigned long long)(kvpi_now_ms() - back));
    CHECK(published);
    /* The region whose registration failed is not in the descriptor. */
    char *key = kvpi_meta_key("ram", ini_name), *desc = NULL, addr[32];
    snprintf(addr, sizeof addr, "%llu", (unsigned long long)(uintptr_t)region);
    CHECK(key && ops->get(raw, key, &desc) == KVP_OK && !strstr(desc, addr));
    free(key);
    free(desc);
    /* A peer that looks the target up afresh transfers to it; so does the
     * running one. */
    kvp_engine *fresh = NULL;
    REQUIRE(kvpt_initiator_start(srv.conn, NULL, 1, 0, &fresh) == 0);
    CHECK(reads_back(fresh, t.name, &t));
    CHECK(reads_back(ini, t.name, &t));
    /* And the store is written to again. */
    CHECK_OK(kvp_engine_register(ini, region, sizeof region));
    kvp_engine_destroy(fresh);
    kvp_engine_destroy(ini);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    ops->close(raw);
    kvpt_server_stop(&srv);
}

int main(void)
{
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s/restart_under_live_engines", kinds[i].name);
        cur = &kinds[i];
        kvpt_run(name, restart_under_live_engines, 120);
    }
    return kvpt_summary();
}
