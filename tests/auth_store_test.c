/* The authenticated mode (docs/security.md) through the metadata: descriptors
 * in an HTTP store that are forged, garbage, unsigned or stale are refused
 * by an authenticated initiator, naming the segment, and the target's keeper
 * puts its genuine ones back; a target without the key is refused, through
 * the store and through its handshake port. */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"
#include "transport/transport.h"

#define SEED 0xa17
#define LEN ((size_t)1 << 20)
#define WAIT_MS 10000 /* bounds a wait that succeeds at once when the code is right */

/* -------------------------------------------------------- descriptors --- */

typedef struct store {
    kvpt_server srv;
    void *raw; /* kvpi_store_http handle */
} store;

static char *store_get(store *s, const char *kind, const char *segment)
{
    char *key = kvpi_meta_key(kind, segment), *val = NULL;
    if (key && kvpi_store_http.get(s->raw, key, &val) != KVP_OK) val = NULL;
    free(key);
    return val;
}

static int store_put(store *s, const char *kind, const char *segment, const char *value)
{
    char *key = kvpi_meta_key(kind, segment);
    kvpi_store_http.del(s->raw, key);
    int rc = key && kvpi_store_http.put(s->raw, key, value) == KVP_OK ? 0 : -1;
    free(key);
    return rc;
}

/* A copy of text with the first `from` replaced by `to`. */
static char *replace(const char *text, const char *from, const char *to)
{
    const char *at = strstr(text, from);
    if (!at) return NULL;
    size_t n = strlen(text) - strlen(from) + strlen(to) + 1;
    char *out = malloc(n);
    snprintf(out, n, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    return out;
}

/* Put bad under the target's descriptor key and open the segment with an
 * authenticated initiator at once: refused, with want in the message. The
 * keeper may put the genuine one back before the lookup; then try again. */
static void refused_then_repaired(store *s, const kvpt_target *t, const char *bad, const char *want,
                                  const kvpi_auth *good)
{
    int refused = 0;
    for (int attempt = 0; attempt < 3 && !refused; attempt++) {
        REQUIRE(store_put(s, "ram", t->name, bad) == 0);
        kvp_engine *e = kvpt_auth_initiator(s->srv.conn, kvpt_key1, 1, 0);
        REQUIRE(e);
        kvp_segment_id seg;
        kvp_status st = kvp_engine_open_segment(e, t->name, &seg);
        char *now = store_get(s, "ram", t->name);
        if (st == KVP_EAUTH) {
            refused = 1;
            CHECK(strstr(kvp_last_error(), t->name) && strstr(kvp_last_error(), want));
            if (!strstr(kvp_last_error(), want)) fprintf(stderr, "  got: %s\n", kvp_last_error());
        } else if (now && strcmp(now, bad) == 0) {
            fprintf(stderr, "  %s descriptor accepted: %s\n", want, kvp_strerror(st));
            kvpt_failures++;
            refused = 1;
        }
        free(now);
        kvp_engine_destroy(e);
    }
    CHECK(refused);
    /* The keeper (every 2 s) puts the genuine descriptor back. */
    uint64_t deadline = kvpi_now_ms() + WAIT_MS;
    int repaired = 0;
    while (!repaired && kvpi_now_ms() < deadline) {
        char *now = store_get(s, "ram", t->name);
        repaired = now && kvpi_auth_desc_verify(good, now, t->name, 0) == KVP_OK &&
                   strstr(now, "\"tcp_data_port\"");
        free(now);
        if (!repaired) usleep(100000);
    }
    CHECK(repaired);
    kvp_engine *e = kvpt_auth_initiator(s->srv.conn, kvpt_key1, 1, 0);
    REQUIRE(e);
    CHECK(kvpt_read_ok(e, t->name, t, SEED, "tcp"));
    kvp_engine_destroy(e);
}

static void descriptors_refused_and_repaired(void)
{
    kvpt_keys_make();
    kvpi_auth *good = kvpt_auth_load(kvpt_key1);
    REQUIRE(good);
    store s;
    REQUIRE(kvpt_http_start(&s.srv) == KVPT_SERVER_OK);
    REQUIRE(kvpi_store_http.open(s.srv.conn, 3000, &s.raw) == KVP_OK);
    kvpt_target t;
    kvpt_target_opts o = {.metadata = s.srv.conn, .len = LEN, .seed = SEED, .disable_shm = 1};
    REQUIRE(kvpt_auth_target(&o, &t, kvpt_key1) == 0);
    const char *log = t.peer.err;
    char *genuine = store_get(&s, "ram", t.name);
    REQUIRE(genuine);
    CHECK_OK(kvpi_auth_desc_verify(good, genuine, t.name, 0));

    /* Forged: the genuine descriptor, its data port redirected. */
    char port[32], fake[32];
    snprintf(port, sizeof port, "\"tcp_data_port\":%d", t.data_port);
    snprintf(fake, sizeof fake, "\"tcp_data_port\":%d", t.data_port == 1 ? 2 : 1);
    char *forged = replace(genuine, port, fake);
    REQUIRE(forged);
    refused_then_repaired(&s, &t, forged, "forged", good);
    /* Garbage. */
    refused_then_repaired(&s, &t, "{\"name\":\"x\",\"kvpipe_auth\":{\"ts\":\"no\"}}", "garbage",
                          good);
    /* Unsigned: what a Mooncake engine (or kvpipe without the key) writes. */
    char *field = strstr(genuine, ",\"kvpipe_auth\"");
    REQUIRE(field);
    char *unsigned_desc = strdup(genuine);
    strcpy(unsigned_desc + (field - genuine), "}");
    refused_then_repaired(&s, &t, unsigned_desc, "unsigned", good);
    /* Moved: a genuine descriptor under another segment's key. */
    char other[64];
    snprintf(other, sizeof other, "127.0.0.1:%d", kvpt_free_port());
    REQUIRE(store_put(&s, "ram", other, genuine) == 0);
    REQUIRE(store_put(&s, "rpc_meta", other,
                      "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":1}") == 0);
    kvp_engine *e = kvpt_auth_initiator(s.srv.conn, kvpt_key1, 1, 0);
    REQUIRE(e);
    kvp_segment_id seg;
    CHECK_ST(kvp_engine_open_segment(e, other, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "names another segment"));
    kvp_engine_destroy(e);
    /* Stale: older than the initiator accepts (the target signs anew only
     * every 30 s with the default age). */
    usleep(1500 * 1000);
    e = kvpt_auth_initiator(s.srv.conn, kvpt_key1, 1, 1000);
    REQUIRE(e);
    CHECK_ST(kvp_engine_open_segment(e, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "stale") && strstr(kvp_last_error(), t.name));
    kvp_engine_destroy(e);
    /* rpc_meta pointed elsewhere: put back too. */
    REQUIRE(store_put(&s, "rpc_meta", t.name,
                      "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":1}") == 0);
    uint64_t deadline = kvpi_now_ms() + WAIT_MS;
    int back = 0;
    while (!back && kvpi_now_ms() < deadline) {
        char *rpc = store_get(&s, "rpc_meta", t.name);
        char want[32];
        snprintf(want, sizeof want, "%d", t.rpc_port);
        back = rpc && strstr(rpc, want);
        free(rpc);
        if (!back) usleep(100000);
    }
    CHECK(back);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    CHECK(kvpt_file_lines(log, "putting the genuine one back") >= 1);
    unlink(log);
    free(genuine);
    free(forged);
    free(unsigned_desc);
    kvpi_store_http.close(s.raw);
    kvpt_server_down(&s.srv);
    kvpi_auth_free(good);
    kvpt_keys_drop();
}

/* An authenticated initiator and a target without the key (a Mooncake
 * engine, as far as the wire goes): refused before any byte moves. */
static void unauthenticated_target_refused(void)
{
    kvpt_keys_make();
    store s;
    REQUIRE(kvpt_http_start(&s.srv) == KVPT_SERVER_OK);
    kvpt_target t;
    kvpt_target_opts o = {.metadata = s.srv.conn, .len = LEN, .seed = SEED, .disable_shm = 1};
    REQUIRE(kvpt_auth_target(&o, &t, NULL) == 0);
    const char *log = t.peer.err;
    kvp_engine *e = kvpt_auth_initiator(s.srv.conn, kvpt_key1, 1, 0);
    REQUIRE(e);
    kvp_segment_id seg;
    CHECK_ST(kvp_engine_open_segment(e, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "unsigned") && strstr(kvp_last_error(), t.name));
    kvp_engine_destroy(e);
    /* P2P: the target's handshake port does not answer the auth hello. */
    e = kvpt_auth_initiator("P2PHANDSHAKE", kvpt_key1, 1, 0);
    REQUIRE(e);
    CHECK_ST(kvp_engine_open_segment(e, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "not an authenticated kvpipe peer"));
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    unlink(log);
    kvpt_server_down(&s.srv);
    kvpt_keys_drop();
}

int main(void)
{
    unsetenv(KVPI_AUTH_ENV);
    RUN(descriptors_refused_and_repaired);
    RUN(unauthenticated_target_refused);
    return kvpt_summary();
}
