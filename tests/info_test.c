/* kvp_info (include/kvpipe/info.h) and kvp_version(): what the build and host
 * offer, as the public API tells it. */
#include <stdlib.h>
#include <string.h>

#include "kvpipe/kvpipe.h"
#include "test.h"

static const kvp_transport_info *transport(const kvp_info *info, const char *name)
{
    const kvp_transport_info *t;
    for (size_t i = 0; (t = kvp_info_transport(info, i)); i++)
        if (strcmp(t->name, name) == 0) return t;
    return NULL;
}

static void version(void)
{
    CHECK(strcmp(kvp_version(), KVP_VERSION_STRING) == 0);
    CHECK(kvp_version_number() == KVP_VERSION_NUMBER);
    CHECK(KVP_VERSION_NUMBER ==
          KVP_MAKE_VERSION(KVP_VERSION_MAJOR, KVP_VERSION_MINOR, KVP_VERSION_PATCH));
    CHECK(KVP_MAKE_VERSION(0, 2, 0) < KVP_MAKE_VERSION(0, 10, 0));
}

static void lists(void)
{
    kvp_info *info = NULL;
    REQUIRE_OK(kvp_info_get(NULL, 0, &info));
    const kvp_transport_info *tcp = transport(info, "tcp"), *shm = transport(info, "shm");
    REQUIRE(tcp && shm);
    CHECK_OK(tcp->status);
    CHECK(strcmp(tcp->detail, "") == 0);
    CHECK(!(tcp->caps & KVP_TRANSPORT_SAME_HOST));
    CHECK(shm->caps & KVP_TRANSPORT_SAME_HOST);
    /* rdma: the ucx transport where built, else listed as not supported. */
    const kvp_transport_info *ucx = transport(info, "ucx");
    if (ucx) {
        CHECK_OK(ucx->status);
        CHECK(transport(info, "rdma") == NULL);
    } else {
        const kvp_transport_info *rdma = transport(info, "rdma");
        REQUIRE(rdma);
        CHECK_ST(rdma->status, KVP_ENOTSUP);
    }
    CHECK(kvp_info_transport(info, 3) == NULL);

    /* This build has every store (the tests need them all). */
    const kvp_store_info *s;
    size_t n = 0;
    for (; (s = kvp_info_store(info, n)); n++)
        CHECK_OK(s->status);
    CHECK(n == 4);
    const kvp_component_info *c = kvp_info_component(info, 0);
    REQUIRE(c);
    CHECK(strcmp(c->name, "kvpipe") == 0 && strcmp(c->version, KVP_VERSION_STRING) == 0);
    for (size_t i = 0; (c = kvp_info_component(info, i)); i++) {
        CHECK_OK(c->status);
        CHECK(c->version[0] >= '0' && c->version[0] <= '9');
    }
    kvp_info_free(info);
    kvp_info_free(NULL);
    CHECK_ST(kvp_info_get(NULL, 0, NULL), KVP_EINVAL);
}

/* Each connection string maps to the store an engine would use. */
static void store_for(void)
{
    kvp_info *info;
    REQUIRE_OK(kvp_info_get(NULL, 0, &info));
    static const struct {
        const char *conn, *name, *syntax;
    } cases[] = {
        {"http://127.0.0.1:1/metadata", "http", "http://h:p/path"},
        {"HTTPS://127.0.0.1:1/metadata", "http", "http://h:p/path"},
        {"etcd://127.0.0.1:1", "etcd", "etcd://h:p[,h:p] (or h:p)"},
        {"127.0.0.1:2379", "etcd", "etcd://h:p[,h:p] (or h:p)"},
        {"redis://u:p@127.0.0.1:1/2", "redis", "redis://[user:pass@]h:p[/db]"},
        {"P2PHANDSHAKE", "p2p", "P2PHANDSHAKE"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const kvp_store_info *s = kvp_info_store_for(info, cases[i].conn);
        REQUIRE(s);
        CHECK(strcmp(s->name, cases[i].name) == 0);
        CHECK(strcmp(s->syntax, cases[i].syntax) == 0);
        CHECK(!(s->flags & KVP_STORE_PEER_TO_PEER) == (strcmp(cases[i].name, "p2p") != 0));
    }
    CHECK(kvp_info_store_for(info, "ftp://127.0.0.1:1") == NULL);
    CHECK(kvp_info_store_for(info, NULL) == NULL);
    kvp_info_free(info);
}

/* A host this machine does not have: the transports say why they cannot serve. */
static void host_not_here(void)
{
    kvp_info *info;
    REQUIRE_OK(kvp_info_get("192.0.2.1", 1000, &info)); /* TEST-NET-1: never local */
    const kvp_transport_info *tcp = transport(info, "tcp");
    REQUIRE(tcp);
    CHECK(tcp->status != KVP_OK && tcp->status != KVP_ENOTSUP);
    CHECK(strstr(tcp->detail, "192.0.2.1") != NULL);
    kvp_info_free(info);
}

static void checks(void)
{
    CHECK_OK(kvp_info_store_check("P2PHANDSHAKE", 0));
    CHECK_ST(kvp_info_store_check("ftp://127.0.0.1:1", 0), KVP_EINVAL);
    CHECK(strcmp(kvp_last_error(), "unknown metadata connection string 'ftp://127.0.0.1:1' "
                                   "(expected http://, etcd://, redis://, host:port or "
                                   "P2PHANDSHAKE)") == 0);
    CHECK_ST(kvp_info_store_check("", 0), KVP_EINVAL);
    char *desc = NULL, *host = NULL;
    CHECK_ST(kvp_info_segment("P2PHANDSHAKE", "127.0.0.1:1", 0, NULL, &host), KVP_EINVAL);
    /* Nothing listens on port 1: the handshake fails, outputs untouched. */
    CHECK(kvp_info_segment("P2PHANDSHAKE", "127.0.0.1:1", 1000, &desc, &host) != KVP_OK);
    CHECK(desc == NULL && host == NULL);
    CHECK(strstr(kvp_last_error(), "127.0.0.1:1") != NULL);
}

int main(void)
{
    RUN(version);
    RUN(lists);
    RUN(store_for);
    RUN(host_not_here);
    RUN(checks);
    return kvpt_summary();
}
