/* The ucx transport as kvpipe selects and publishes it: that the ucx rows of
 * the conformance suites really run through UCX (UCX's own report of the
 * endpoint's lanes names the transport UCX_TLS asked for), its descriptor
 * fields ("protocol" stays "tcp"), the fallback to TCP for a peer that
 * publishes no ucx endpoint, device_name, MC_FORCE_TCP, and who maps the
 * buffer pool's memory. Each case runs
 * with UCX's own transports (tcp, shared memory); it skips in a build
 * without UCX. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "peer.h"
#include "test.h"
#include "transport/transport.h"
#if KVP_HAVE_UCX
#include "engine/engine_internal.h"
#include "transport/ucx/ucx.h"
#endif

#define SEED 0x55
#define LEN ((size_t)4 << 20)

#if KVP_HAVE_UCX

/* The lanes UCX chose for the segment's ucx link ("" if it has none). */
static void lanes_of(kvp_engine *e, kvp_segment_id seg, char *buf, size_t len)
{
    buf[0] = '\0';
    kvpi_segment *s = kvpi_segment_get(e, seg);
    kvpi_peer *p;
    if (!s || kvpi_segment_acquire(e, s, &p)) return;
    if (p->primary && p->primary->ops == &kvpi_transport_ucx)
        kvpi_ucx_peer_lanes(p->primary->handle, buf, len);
    kvpi_segment_release(s, p, 0);
}

static int start_target(const char *protocol, kvpt_target *t)
{
    kvpt_target_opts o = {.metadata = "P2PHANDSHAKE",
                          .protocol = protocol,
                          .len = LEN,
                          .seed = SEED,
                          .disable_shm = 1};
    return kvpt_target_start(&o, t);
}

/* READ all of the target's buffer and WRITE 1 MiB of it, checking bytes. */
static void move_bytes(kvp_engine *e, kvp_segment_id seg, kvpt_target *t)
{
    char *local = malloc(LEN);
    REQUIRE(local);
    CHECK_OK(kvp_engine_read(e, seg, local, (uint64_t)(uintptr_t)t->buf, LEN));
    CHECK(kvpt_verify(local, LEN, SEED) == (size_t)-1);
    kvpt_fill(local, 1u << 20, 7);
    CHECK_OK(kvp_engine_write(e, seg, local, (uint64_t)(uintptr_t)t->buf + 4096, 1u << 20));
    CHECK(kvpt_verify((char *)t->buf + 4096, 1u << 20, 7) == (size_t)-1);
    free(local);
}

/* Both engines ask for rdma with UCX_TLS=tls: the segment's transport is
 * ucx, and UCX says its lanes run on what tls names. */
static void uses_ucx(const char *tls, const char *want, const char *unwanted)
{
    setenv("UCX_TLS", tls, 1);
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(start_target("rdma", &t) == 0);
    REQUIRE(kvpt_initiator_start("P2PHANDSHAKE", "rdma", 1, 0, &e) == 0);
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    CHECK(strcmp(kvp_engine_segment_transport(e, seg), "ucx") == 0);
    char lanes[512];
    lanes_of(e, seg, lanes, sizeof lanes);
    fprintf(stderr, "  UCX_TLS=%s: lanes %s\n", tls, lanes);
    CHECK(strstr(lanes, want) != NULL);
    CHECK(strstr(lanes, unwanted) == NULL);
    move_bytes(e, seg, &t);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

static void uses_ucx_tcp(void)
{
    uses_ucx("tcp", "tcp/", "memory");
}

static void uses_ucx_sm(void)
{
    uses_ucx("sm,self", "/memory", "tcp/");
}

static const char *str_field(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static double num_field(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

/* The engine's descriptor: Mooncake's fields as before, ucx's under its own
 * keys; a deregistration moves the epoch on. */
static void descriptor_fields(void)
{
    setenv("UCX_TLS", "tcp", 1);
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start("P2PHANDSHAKE", "rdma", 1, 0, &e) == 0);
    char *buf = malloc(LEN);
    REQUIRE(buf);
    REQUIRE_OK(kvp_engine_register(e, buf, LEN));
    char *text = kvpi_engine_descriptor_text(e);
    cJSON *doc = cJSON_Parse(text);
    REQUIRE(doc);
    CHECK(strcmp(str_field(doc, "protocol"), "tcp") == 0);
    CHECK(num_field(doc, "tcp_data_port") > 0);
    const cJSON *ucx = cJSON_GetObjectItemCaseSensitive(doc, "ucx");
    REQUIRE(cJSON_IsObject(ucx));
    CHECK(num_field(ucx, "version") == 1);
    CHECK(num_field(ucx, "epoch") == 0);
    CHECK(str_field(ucx, "worker") && strlen(str_field(ucx, "worker")) > 20);
    const cJSON *b = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(doc, "buffers"), 0);
    REQUIRE(b);
    CHECK(num_field(b, "addr") == (double)(uintptr_t)buf && num_field(b, "length") == LEN);
    const char *rkey = str_field(b, "ucx_rkey");
    CHECK(rkey && strlen(rkey) % 2 == 0 && strspn(rkey, "0123456789abcdef") == strlen(rkey));
    cJSON_Delete(doc);
    free(text);
    CHECK_OK(kvp_engine_unregister(e, buf));
    text = kvpi_engine_descriptor_text(e);
    doc = cJSON_Parse(text);
    REQUIRE(doc);
    CHECK(num_field(cJSON_GetObjectItemCaseSensitive(doc, "ucx"), "epoch") == 1);
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(doc, "buffers")) == 0);
    cJSON_Delete(doc);
    free(text);
    kvp_engine_destroy(e);
    free(buf);
}

/* A peer that publishes no ucx endpoint (here a kvpipe engine whose UCX
 * cannot start; a Mooncake TCP peer looks the same) is reached over TCP. */
static void peer_without_ucx(void)
{
    setenv("UCX_TLS", "no-such-transport", 1);
    kvpt_target t;
    REQUIRE(start_target("tcp", &t) == 0);
    setenv("UCX_TLS", "tcp", 1);
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(kvpt_initiator_start("P2PHANDSHAKE", "rdma", 1, 0, &e) == 0);
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    CHECK(strcmp(kvp_engine_segment_transport(e, seg), "tcp") == 0);
    move_bytes(e, seg, &t);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

static kvp_status create_with_devices(const char *devices, kvp_engine **e)
{
    char name[64];
    kvp_engine_opts o;
    kvpt_engine_opts(&o, name);
    o.protocol = "rdma";
    o.disable_shm = 1;
    o.device_names = devices;
    return kvp_engine_create(&o, e);
}

/* device_name picks UCX's network devices; one this host lacks is refused
 * with a message that says how to run over TCP; UCX_NET_DEVICES wins. */
static void device_names(void)
{
    setenv("UCX_TLS", "tcp", 1);
    kvp_engine *e = NULL;
    CHECK_ST(create_with_devices("nosuchnic0", &e), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "nosuchnic0") && strstr(kvp_last_error(), "MC_FORCE_TCP=1"));
    CHECK(e == NULL);
    kvpt_target t;
    REQUIRE(start_target("rdma", &t) == 0);
    REQUIRE_OK(create_with_devices("lo", &e));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    char lanes[512];
    lanes_of(e, seg, lanes, sizeof lanes);
    CHECK(strstr(lanes, "tcp/lo") != NULL);
    move_bytes(e, seg, &t);
    kvp_engine_destroy(e);
    setenv("UCX_NET_DEVICES", "lo", 1);
    REQUIRE_OK(create_with_devices("nosuchnic0", &e));
    kvp_engine_destroy(e);
    unsetenv("UCX_NET_DEVICES");
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* MC_FORCE_TCP=1 runs an rdma engine over TCP, peers that have ucx too. */
static void force_tcp(void)
{
    setenv("UCX_TLS", "tcp", 1);
    kvpt_target t;
    REQUIRE(start_target("rdma", &t) == 0);
    setenv("MC_FORCE_TCP", "1", 1);
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(kvpt_initiator_start("P2PHANDSHAKE", "rdma", 1, 0, &e) == 0);
    unsetenv("MC_FORCE_TCP");
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    CHECK(strcmp(kvp_engine_segment_transport(e, seg), "tcp") == 0);
    move_bytes(e, seg, &t);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* Is the mapping that holds addr shared ('s' in /proc/self/maps)? 1, 0, or
 * -1 when none holds it. */
static int mapping_shared(const void *addr)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    char line[512];
    int shared = -1;
    uintptr_t a = (uintptr_t)addr;
    while (shared < 0 && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && a >= lo && a < hi)
            shared = perms[3] == 's';
    }
    fclose(f);
    return shared;
}

/* A pool buffer (kvp_engine_alloc) of an engine whose protocol is proto,
 * authenticated with the key file key unless NULL (through
 * KVPIPE_AUTH_KEY_FILE): is its memory shared? */
static int pool_shared(const char *proto, const char *key)
{
    if (key) setenv("KVPIPE_AUTH_KEY_FILE", key, 1);
    kvp_engine *e;
    int up = kvpt_initiator_start(NULL, proto, 1, 0, &e) == 0;
    unsetenv("KVPIPE_AUTH_KEY_FILE");
    if (!up) return -1;
    void *p;
    int shared = kvp_engine_alloc(e, 1u << 20, &p) == KVP_OK ? mapping_shared(p) : -1;
    kvp_engine_destroy(e);
    return shared;
}

/* The pool's memory: UCX allocates it (its shared memory, which a same-host
 * peer maps) when ucx is the engine's protocol and UCX_TLS lets it use shared
 * memory; the pool's own private pages for another protocol, and in the
 * authenticated mode (a UCX segment can be attached without the key). */
static void pool_memory(void)
{
    setenv("UCX_TLS", "sm,self", 1);
    CHECK(pool_shared("rdma", NULL) == 1);
    CHECK(pool_shared("tcp", NULL) == 0);
    char key[64];
    snprintf(key, sizeof key, "/tmp/kvpt_ucx_key_%d_XXXXXX", (int)getpid());
    int fd = mkstemp(key);
    REQUIRE(fd >= 0);
    static const char text[] = "0123456789abcdef0123456789abcdef-ucx\n";
    CHECK(write(fd, text, sizeof text - 1) == (ssize_t)(sizeof text - 1));
    close(fd);
    CHECK(pool_shared("rdma", key) == 0);
    unlink(key);
}

#define CASES(X)                                                                                   \
    X(uses_ucx_tcp)                                                                                \
    X(uses_ucx_sm)                                                                                 \
    X(descriptor_fields) X(peer_without_ucx) X(device_names) X(force_tcp) X(pool_memory)

#else

static void not_built(void)
{
    SKIP("built without UCX (KVP_WITH_UCX)");
}
#define CASES(X) X(not_built)

#endif

#define RUN_CASE(c) RUN(c);

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    CASES(RUN_CASE)
    return kvpt_summary();
}
