/* The pure parts of naming a segment (src/metadata/metadata.c): Mooncake's
 * key names, rpc_meta parsing, judging who owns an rpc_meta from a
 * handshake's answer, and the connection-string mistakes that get a hint. */
#include <stdlib.h>
#include <string.h>

#include "metadata/metadata.h"
#include "test.h"

static int key_is(const char *kind, const char *seg, const char *want)
{
    char *k = kvpi_meta_key(kind, seg);
    int ok = k && strcmp(k, want) == 0;
    if (!ok) fprintf(stderr, "  key(%s, %s) = %s, want %s\n", kind, seg, k ? k : "-", want);
    free(k);
    return ok;
}

static void test_keys_as_mooncake(void)
{
    unsetenv("MC_METADATA_CLUSTER_ID");
    CHECK(key_is("ram", "10.0.0.1:17000", "mooncake/ram/10.0.0.1:17000"));
    CHECK(key_is("rpc_meta", "10.0.0.1:17000", "mooncake/rpc_meta/10.0.0.1:17000"));
    /* getFullMetadataKey: a name with a '/' is its own key below the prefix;
     * rpc_meta keys always take the rpc_meta/ part. */
    CHECK(key_is("ram", "node/a", "mooncake/node/a"));
    CHECK(key_is("rpc_meta", "node/a", "mooncake/rpc_meta/node/a"));
    setenv("MC_METADATA_CLUSTER_ID", "c1", 1);
    CHECK(key_is("ram", "h:1", "mooncake/c1/ram/h:1"));
    setenv("MC_METADATA_CLUSTER_ID", "c1/", 1); /* Mooncake adds '/' only when missing */
    CHECK(key_is("ram", "h:1", "mooncake/c1/ram/h:1"));
    CHECK(key_is("rpc_meta", "h:1", "mooncake/c1/rpc_meta/h:1"));
    setenv("MC_METADATA_CLUSTER_ID", "", 1);
    CHECK(key_is("ram", "h:1", "mooncake/ram/h:1"));
    unsetenv("MC_METADATA_CLUSTER_ID");
}

static void test_rpc_meta_parse(void)
{
    char host[KVPI_HOST_MAX];
    int port = -1;
    CHECK_OK(
        kvpi_rpc_meta_parse("{\"ip_or_host_name\":\"10.0.0.1\",\"rpc_port\":17000}", host, &port));
    CHECK(strcmp(host, "10.0.0.1") == 0 && port == 17000);
    /* Mooncake's own, with the newline its writer adds and jsoncpp's order;
     * unknown fields are ignored. */
    CHECK_OK(
        kvpi_rpc_meta_parse("{\"ip_or_host_name\":\"h\",\"rpc_port\":1,\"x\":[1]}\n", host, &port));
    CHECK(strcmp(host, "h") == 0 && port == 1);
    static const char *const bad[] = {
        "",
        "null",
        "[]",
        "{}",
        "{\"ip_or_host_name\":\"h\"}",
        "{\"ip_or_host_name\":\"\",\"rpc_port\":1}",
        "{\"ip_or_host_name\":\"h\",\"rpc_port\":-1}",
        "{\"ip_or_host_name\":\"h\",\"rpc_port\":65536}",
        "{\"ip_or_host_name\":\"h\",\"rpc_port\":1e300}",
        "{\"ip_or_host_name\":\"h\",\"rpc_port\":\"80\"}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        port = -7;
        CHECK_ST(kvpi_rpc_meta_parse(bad[i], host, &port), KVP_EPROTO);
        CHECK(port == -7);
    }
    char *longname = malloc(KVPI_HOST_MAX + 64);
    REQUIRE(longname);
    int n = snprintf(longname, KVPI_HOST_MAX + 64, "{\"ip_or_host_name\":\"");
    memset(longname + n, 'a', KVPI_HOST_MAX);
    snprintf(longname + n + KVPI_HOST_MAX, 40, "\",\"rpc_port\":1}");
    CHECK_ST(kvpi_rpc_meta_parse(longname, host, &port), KVP_EPROTO);
    free(longname);
}

static void test_judge_owner(void)
{
    const char *seg = "10.0.0.1:17000";
    const char *mine = "{\"name\":\"10.0.0.1:17000\",\"kvpipe_instance\":\"abc\"}";
    const char *other = "{\"name\":\"10.0.0.1:17000\",\"kvpipe_instance\":\"def\"}";
    const char *mooncake_p2p = "{\"name\":\"10.0.0.1:17000\",\"protocol\":\"tcp\"}";
    const char *elsewhere = "{\"name\":\"10.0.0.2:1\",\"kvpipe_instance\":\"def\"}";
    /* Nobody answers, or not an engine. */
    CHECK(kvpi_meta_judge_owner(KVP_ECONNREFUSED, NULL, seg, "abc") == KVPI_OWNER_GONE);
    CHECK(kvpi_meta_judge_owner(KVP_ETIMEDOUT, NULL, seg, "abc") == KVPI_OWNER_GONE);
    CHECK(kvpi_meta_judge_owner(KVP_EPROTO, NULL, seg, "abc") == KVPI_OWNER_GONE);
    CHECK(kvpi_meta_judge_owner(KVP_OK, "not json", seg, "abc") == KVPI_OWNER_GONE);
    CHECK(kvpi_meta_judge_owner(KVP_OK, "[1]", seg, "abc") == KVPI_OWNER_GONE);
    CHECK(kvpi_meta_judge_owner(KVP_OK, "7", seg, "abc") == KVPI_OWNER_GONE);
    /* This engine itself, or an engine of another name. */
    CHECK(kvpi_meta_judge_owner(KVP_OK, mine, seg, "abc") == KVPI_OWNER_SELF);
    CHECK(kvpi_meta_judge_owner(KVP_OK, elsewhere, seg, "abc") == KVPI_OWNER_ELSE);
    /* Live: another instance, a descriptor without an instance (Mooncake in
     * P2P mode), null (Mooncake with a store), or an object without a name. */
    CHECK(kvpi_meta_judge_owner(KVP_OK, other, seg, "abc") == KVPI_OWNER_LIVE);
    CHECK(kvpi_meta_judge_owner(KVP_OK, mooncake_p2p, seg, "abc") == KVPI_OWNER_LIVE);
    CHECK(kvpi_meta_judge_owner(KVP_OK, "null\n", seg, "abc") == KVPI_OWNER_LIVE);
    CHECK(kvpi_meta_judge_owner(KVP_OK, "{}", seg, "abc") == KVPI_OWNER_LIVE);
    CHECK(kvpi_meta_judge_owner(KVP_OK, mine, seg, NULL) == KVPI_OWNER_LIVE);
}

static void test_instance_of(void)
{
    char *id = kvpi_meta_instance_of("{\"kvpipe_instance\":\"0123abcd\",\"name\":\"x\"}");
    CHECK(id && strcmp(id, "0123abcd") == 0);
    free(id);
    CHECK(kvpi_meta_instance_of("{\"kvpipe_instance\":5}") == NULL);
    CHECK(kvpi_meta_instance_of("{\"name\":\"x\"}") == NULL);
    CHECK(kvpi_meta_instance_of("garbage") == NULL);
    CHECK(kvpi_meta_instance_of(NULL) == NULL);
}

/* "p2phandshake" in another case would be an etcd host: the error says what
 * was assumed and what was meant. */
static void test_p2p_spelling(void)
{
    kvpi_meta *m = (kvpi_meta *)0x1;
    static const char *const wrong[] = {"p2phandshake", "P2pHandshake", "p2pHANDSHAKE"};
    for (size_t i = 0; i < sizeof wrong / sizeof wrong[0]; i++) {
        CHECK_ST(kvpi_meta_open(wrong[i], 1000, NULL, NULL, &m), KVP_EINVAL);
        const char *e = kvp_last_error();
        CHECK(strstr(e, wrong[i]) && strstr(e, "etcd") && strstr(e, "'P2PHANDSHAKE'") &&
              strstr(e, "upper case"));
    }
    CHECK(m == (kvpi_meta *)0x1);
    REQUIRE_OK(kvpi_meta_open("P2PHANDSHAKE", 1000, NULL, NULL, &m));
    CHECK(kvpi_meta_is_p2p(m));
    kvpi_meta_close(m);
}

int main(void)
{
    RUN(test_keys_as_mooncake);
    RUN(test_rpc_meta_parse);
    RUN(test_judge_owner);
    RUN(test_instance_of);
    RUN(test_p2p_spelling);
    return kvpt_summary();
}
