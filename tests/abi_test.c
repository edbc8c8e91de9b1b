/* The extensible structs (docs/abi.md): a program passes the size of each
 * options or output struct as it was built, and the library reads and writes
 * only that many bytes. Each struct here ends flush against a PROT_NONE page,
 * so a library that touched a byte past the program's struct would crash the
 * case. A shorter struct stands for a program built against an older
 * kvpipe (the fields it lacks take their defaults), a longer one for a
 * program built against a newer kvpipe (fields this library lacks must be 0,
 * else KVP_ENOTSUP). tests/packaging/abi.sh runs the same across two builds. */
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvpipe/kvpipe.h"
#include "peer.h"
#include "test.h"

/* The sizeof of an older release's T that ended before field f: offsetof
 * rounded up to T's alignment, as the compiler pads a struct. */
#define OLDER_SIZE(T, f) ((offsetof(T, f) + _Alignof(T) - 1) / _Alignof(T) * _Alignof(T))

/* size bytes that end where a PROT_NONE page begins; freed with unguard. */
static void *guarded(size_t size)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), span = (size + page - 1) / page * page;
    char *m = mmap(NULL, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    mprotect(m + span, page, PROT_NONE);
    return m + span - size;
}

static void unguard(void *p, size_t size)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), span = (size + page - 1) / page * page;
    munmap((char *)p + size - span, span + page);
}

/* An older program's kvp_engine_opts: everything before metrics_host. */
static void engine_opts_older(void)
{
    size_t size = OLDER_SIZE(kvp_engine_opts, metrics_host);
    kvp_engine_opts *o = guarded(size);
    REQUIRE(o);
    kvp_engine_opts_init_size(o, size);
    CHECK(o->timeout_ms == 5000 && !strcmp(o->protocol, "tcp"));
    o->local_server_name = "127.0.0.1:0";
    o->metadata = "P2PHANDSHAKE";
    kvp_engine *e = NULL;
    CHECK_OK(kvp_engine_create_size(o, size, &e));
    /* metrics_host took its default (metrics_port is 0: no endpoint). */
    CHECK(e && kvp_engine_metrics_port(e) == 0);
    kvp_engine_destroy(e);
    unguard(o, size);
}

/* A newer program's: 16 more bytes, 0 (their defaults) or set. */
static void engine_opts_newer(void)
{
    size_t size = sizeof(kvp_engine_opts) + 16;
    kvp_engine_opts *o = guarded(size);
    REQUIRE(o);
    memset(o, 0x5a, size);
    kvp_engine_opts_init_size(o, size);
    CHECK(((unsigned char *)o)[size - 1] == 0); /* the library zeroed what it does not know */
    o->local_server_name = "127.0.0.1:0";
    o->metadata = "P2PHANDSHAKE";
    kvp_engine *e = NULL;
    CHECK_OK(kvp_engine_create_size(o, size, &e));
    kvp_engine_destroy(e);
    ((unsigned char *)o)[sizeof *o + 3] = 1;
    e = NULL;
    CHECK_ST(kvp_engine_create_size(o, size, &e), KVP_ENOTSUP);
    CHECK(e == NULL);
    CHECK(strstr(kvp_last_error(), "kvp_engine_opts") &&
          strstr(kvp_last_error(), "built against a newer kvpipe"));
    CHECK_ST(kvp_engine_create_size(o, 0, &e), KVP_EINVAL);
    CHECK_ST(kvp_engine_create_size(o, 1u << 20, &e), KVP_EINVAL);
    unguard(o, size);
}

/* kvp_batch_opts of an older program (before instance: it takes its default,
 * any instance) and of a newer one (a field set that this library lacks:
 * KVP_ENOTSUP, nothing submitted). */
static void batch_opts_sizes(void)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = "127.0.0.1:0";
    eo.metadata = "P2PHANDSHAKE";
    kvp_engine *e = NULL;
    REQUIRE_OK(kvp_engine_create(&eo, &e));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, kvp_engine_segment_name(e), &seg));
    size_t size = OLDER_SIZE(kvp_batch_opts, instance);
    kvp_batch_opts *o = guarded(size);
    REQUIRE(o);
    memset(o, 0x5a, size);
    kvp_batch_opts_init_size(o, size);
    CHECK(o->on_complete == NULL && o->user_data == NULL && o->reap == 0);
    o->reap = 1;
    kvp_batch *b = NULL;
    CHECK_OK(kvp_batch_submit_with_size(e, seg, NULL, 0, o, size, &b));
    kvp_completion c;
    CHECK(kvp_engine_reap(e, &c, 1) == 1 && c.batch == b);
    kvp_batch_free(b);
    unguard(o, size);

    size = sizeof(kvp_batch_opts) + 16;
    o = guarded(size);
    REQUIRE(o);
    memset(o, 0x5a, size);
    kvp_batch_opts_init_size(o, size);
    CHECK(((unsigned char *)o)[size - 1] == 0);
    o->reap = 1;
    b = NULL;
    CHECK_OK(kvp_batch_submit_with_size(e, seg, NULL, 0, o, size, &b));
    CHECK(kvp_engine_reap(e, &c, 1) == 1 && c.batch == b);
    kvp_batch_free(b);
    ((unsigned char *)o)[sizeof *o + 3] = 1;
    b = NULL;
    CHECK_ST(kvp_batch_submit_with_size(e, seg, NULL, 0, o, size, &b), KVP_ENOTSUP);
    CHECK(b == NULL && kvp_engine_reap(e, &c, 1) == 0);
    CHECK(strstr(kvp_last_error(), "kvp_batch_opts") != NULL);
    unguard(o, size);
    kvp_engine_destroy(e);
}

static void pipe_opts_and_stats_older(void)
{
    kvpt_raw_setup rs; /* a P2P tcp config at 127.0.0.1:B for both sides */
    REQUIRE(kvpt_raw_setup_init(&rs) == 0);
    const char *json = rs.json;
    int base = rs.base;
    kvp_pipe_config *cfg;
    REQUIRE_OK(kvp_pipe_config_parse(json, strlen(json), &cfg));
    /* Options without their last field (metrics_host). */
    size_t osize = OLDER_SIZE(kvp_pipe_opts, metrics_host);
    kvp_pipe_opts *o = guarded(osize);
    REQUIRE(o);
    kvp_pipe_opts_init_size(o, osize);
    CHECK(o->recv_window == 32);
    kvp_pipe *p = NULL;
    CHECK_OK(kvp_pipe_open_size(cfg, 0, 0, o, osize, &p));
    REQUIRE(p);
    /* Stats without peer_lookups: the library writes only what the program has. */
    size_t ssize = OLDER_SIZE(kvp_pipe_stats, peer_lookups);
    kvp_pipe_stats *s = guarded(ssize);
    REQUIRE(s);
    memset(s, 0x5a, ssize);
    kvp_pipe_get_stats_size(p, s, ssize);
    CHECK(s->sent == 0 && s->inflight_count == 0 && s->peer_inline_max == 0);
    size_t esize = OLDER_SIZE(kvp_pipe_endpoints, peer_ack_port);
    kvp_pipe_endpoints *ep = guarded(esize);
    REQUIRE(ep);
    CHECK_OK(kvp_pipe_config_endpoints_size(cfg, 0, 1, ep, esize));
    CHECK(ep->engine_port == base + 100 && ep->peer_engine_port == base);
    kvp_pipe_close(p);
    unguard(ep, esize);
    unguard(s, ssize);
    unguard(o, osize);
    kvp_pipe_config_free(cfg);
}

static void metadata_server_opts_sizes(void)
{
    size_t size = OLDER_SIZE(kvp_metadata_server_opts, request_timeout_s);
    kvp_metadata_server_opts *o = guarded(size);
    REQUIRE(o);
    kvp_metadata_server_opts_init_size(o, size);
    kvp_metadata_server *srv = NULL;
    CHECK_OK(kvp_metadata_server_start_opts_size(o, size, &srv));
    CHECK(srv && kvp_metadata_server_port(srv) > 0);
    kvp_metadata_server_stop(srv);
    unguard(o, size);
    size = sizeof(kvp_metadata_server_opts) + 8;
    o = guarded(size);
    REQUIRE(o);
    kvp_metadata_server_opts_init_size(o, size);
    ((unsigned char *)o)[size - 1] = 7;
    srv = NULL;
    CHECK_ST(kvp_metadata_server_start_opts_size(o, size, &srv), KVP_ENOTSUP);
    CHECK(srv == NULL);
    unguard(o, size);
}

int main(void)
{
    RUN(engine_opts_older);
    RUN(engine_opts_newer);
    RUN(batch_opts_sizes);
    RUN(pipe_opts_and_stats_older);
    RUN(metadata_server_opts_sizes);
    return kvpt_summary();
}
