/* Unit tests of the engine's parts: buffer pool, region table, descriptor
 * codec, host:port parsing. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/net.h"
#include "common/region.h"
#include "engine/buffer_pool.h"
#include "engine/descriptor.h"
#include "transport/transport.h"
#include "test.h"

/* Add and activate, or remove whole, as the engine does around its
 * transports' registrations. */
static kvp_status region_add(kvpi_region_table *t, uint64_t addr, uint64_t len)
{
    kvpi_region r = {.addr = addr, .length = len, .kind = KVP_MEM_HOST};
    kvpi_region_entry *e;
    kvp_status st = kvpi_region_add(t, &r, &e);
    if (!st) kvpi_region_activate(t, e);
    return st;
}

static kvp_status region_remove(kvpi_region_table *t, uint64_t addr)
{
    kvpi_region_entry *e;
    kvp_status st = kvpi_region_remove_begin(t, addr, &e);
    if (!st) kvpi_region_remove_end(t, e);
    return st;
}

/* Pool hooks that record registrations in a region table, as the engine does. */
static kvpi_region_table reg;
/* The pool calls its hooks outside its lock, from whichever thread frees. */
static _Atomic int registered, unregistered;

static kvp_status hook_reg(void *ctx, void *addr, size_t len)
{
    (void)ctx;
    registered++;
    return region_add(&reg, (uint64_t)(uintptr_t)addr, len);
}

static void hook_unreg(void *ctx, void *addr)
{
    (void)ctx;
    unregistered++;
    region_remove(&reg, (uint64_t)(uintptr_t)addr);
}

static kvpi_pool *make_pool(size_t chunk, size_t retain, size_t max)
{
    kvpi_region_table_init(&reg);
    registered = unregistered = 0;
    kvpi_pool_opts o = {chunk, retain, max};
    kvpi_pool_hooks h = {.register_chunk = hook_reg, .unregister_chunk = hook_unreg};
    kvpi_pool *p = NULL;
    kvpi_pool_create(&o, &h, &p);
    return p;
}

static void pool_size_classes(void)
{
    CHECK(kvpi_pool_size_class(1) == 256);
    CHECK(kvpi_pool_size_class(257) == 512);
    CHECK(kvpi_pool_size_class(65536) == 65536);
    CHECK(kvpi_pool_size_class(65537) == 131072);
    CHECK(kvpi_pool_size_class(100000) == 131072);
    CHECK(kvpi_pool_size_class(SIZE_MAX) == 0);
}

static void pool_reuse(void)
{
    kvpi_pool *p = make_pool(4u << 20, 4u << 20, 0);
    REQUIRE(p);
    void *a, *b, *c;
    REQUIRE_OK(kvpi_pool_alloc(p, 1000, &a));
    REQUIRE_OK(kvpi_pool_alloc(p, 1000, &b));
    CHECK(a != b);
    CHECK(registered == 1);
    /* Every allocation lies in registered memory. */
    kvpi_pin pin;
    CHECK(kvpi_region_pin(&reg, (uint64_t)(uintptr_t)a, 1000, KVPI_MEM_HOST_BIT, &pin) == KVP_OK);
    kvpi_region_unpin(&reg, pin);
    CHECK_OK(kvpi_pool_free(p, a));
    REQUIRE_OK(kvpi_pool_alloc(p, 900, &c));
    CHECK(c == a); /* freed memory is reused */
    CHECK_ST(kvpi_pool_free(p, (char *)b + 8), KVP_EINVAL);
    CHECK_OK(kvpi_pool_free(p, b));
    CHECK_ST(kvpi_pool_free(p, b), KVP_EINVAL);
    CHECK_OK(kvpi_pool_free(p, c));
    CHECK_ST(kvpi_pool_alloc(p, 0, &c), KVP_EINVAL);
    kvpi_pool_stats s;
    kvpi_pool_get_stats(p, &s);
    CHECK(s.allocations == 0 && s.allocated == 0 && s.chunks == 1);
    kvpi_pool_destroy(p);
    CHECK(unregistered == 1);
    CHECK(reg.count == 0);
    kvpi_region_table_destroy(&reg);
}

/* Free every other block, then the rest: extents must coalesce so that one
 * allocation of the whole chunk fits again without a new chunk. */
static void pool_fragmentation(void)
{
    const size_t chunk = 4u << 20, blk = 64u << 10, n = chunk / blk;
    kvpi_pool *p = make_pool(chunk, chunk, 0);
    REQUIRE(p);
    void *ptrs[64];
    for (size_t i = 0; i < n; i++)
        REQUIRE_OK(kvpi_pool_alloc(p, blk, &ptrs[i]));
    CHECK(registered == 1);
    for (size_t i = 0; i < n; i += 2)
        CHECK_OK(kvpi_pool_free(p, ptrs[i]));
    void *big;
    /* 128 KiB does not fit in the 64 KiB holes: a second chunk. */
    REQUIRE_OK(kvpi_pool_alloc(p, 2 * blk, &big));
    CHECK(registered == 2);
    CHECK_OK(kvpi_pool_free(p, big));
    for (size_t i = 1; i < n; i += 2)
        CHECK_OK(kvpi_pool_free(p, ptrs[i]));
    /* Only one fully free chunk is retained (retain = one chunk). */
    kvpi_pool_stats s;
    kvpi_pool_get_stats(p, &s);
    CHECK(s.chunks == 1);
    REQUIRE_OK(kvpi_pool_alloc(p, chunk, &big));
    kvpi_pool_get_stats(p, &s);
    CHECK(s.chunks == 1 && registered == 2);
    CHECK_OK(kvpi_pool_free(p, big));
    kvpi_pool_destroy(p);
    kvpi_region_table_destroy(&reg);
}

static void pool_bounds(void)
{
    kvpi_pool *p = make_pool(2u << 20, 2u << 20, 8u << 20);
    REQUIRE(p);
    void *a, *b;
    /* Larger than a chunk: a chunk of its own, released when freed beyond the
     * retention budget. */
    REQUIRE_OK(kvpi_pool_alloc(p, 6u << 20, &a));
    CHECK_ST(kvpi_pool_alloc(p, 4u << 20, &b), KVP_ENOMEM);
    CHECK(strstr(kvp_last_error(), "cap") != NULL);
    CHECK_OK(kvpi_pool_free(p, a));
    kvpi_pool_stats s;
    kvpi_pool_get_stats(p, &s);
    CHECK(s.mapped <= (2u << 20));
    REQUIRE_OK(kvpi_pool_alloc(p, 4u << 20, &b));
    CHECK_OK(kvpi_pool_free(p, b));
    kvpi_pool_destroy(p);
    kvpi_region_table_destroy(&reg);
}

typedef struct pool_thread {
    pthread_t th;
    kvpi_pool *p;
    int id, bad;
} pool_thread;

static void *pool_thread_main(void *arg)
{
    pool_thread *t = arg;
    void *held[32] = {0};
    for (int i = 0; i < 4000; i++) {
        int k = (i * 7 + t->id) % 32;
        if (held[k]) {
            /* The bytes we wrote are still ours: nobody else got this block. */
            if (*(int *)held[k] != t->id * 100000 + k) t->bad++;
            if (kvpi_pool_free(t->p, held[k])) t->bad++;
            held[k] = NULL;
        } else {
            size_t len = 64 + (size_t)((i * 131 + t->id * 17) % 200000);
            if (kvpi_pool_alloc(t->p, len, &held[k])) {
                t->bad++;
                continue;
            }
            *(int *)held[k] = t->id * 100000 + k;
        }
    }
    for (int k = 0; k < 32; k++)
        if (held[k] && kvpi_pool_free(t->p, held[k])) t->bad++;
    return NULL;
}

static void pool_threads(void)
{
    kvpi_pool *p = make_pool(4u << 20, 8u << 20, 0);
    REQUIRE(p);
    pool_thread ts[4];
    for (int i = 0; i < 4; i++) {
        ts[i] = (pool_thread){.p = p, .id = i};
        pthread_create(&ts[i].th, NULL, pool_thread_main, &ts[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(ts[i].th, NULL);
        CHECK(ts[i].bad == 0);
    }
    kvpi_pool_stats s;
    kvpi_pool_get_stats(p, &s);
    CHECK(s.allocations == 0 && s.allocated == 0);
    CHECK(s.mapped <= (8u << 20)); /* freed chunks went back beyond retention */
    kvpi_pool_destroy(p);
    kvpi_region_table_destroy(&reg);
}

static void registry_ranges(void)
{
    kvpi_region_table r;
    kvpi_region_table_init(&r);
    CHECK_OK(region_add(&r, 1000, 100));
    CHECK_OK(region_add(&r, 2000, 100));
    CHECK_ST(region_add(&r, 1050, 10), KVP_EINVAL);
    CHECK_ST(region_add(&r, 900, 101), KVP_EINVAL);
    CHECK_ST(region_add(&r, 1099, 2), KVP_EINVAL);
    CHECK_ST(region_add(&r, 5, 0), KVP_EINVAL);
    CHECK_ST(region_add(&r, UINT64_MAX - 5, 10), KVP_EINVAL);
    CHECK_OK(region_add(&r, 1100, 100)); /* adjacent is fine */
    kvpi_pin *pins;
    size_t rn;
    REQUIRE_OK(kvpi_region_pin_all(&r, &pins, &rn));
    REQUIRE(rn == 3);
    kvpi_region rs[3];
    for (size_t i = 0; i < rn; i++)
        rs[i] = *kvpi_pin_region(pins[i]);
    kvpi_region_unpin_all(&r, pins, rn);
    CHECK(kvpi_regions_contain(rs, rn, 1000, 100));
    CHECK(!kvpi_regions_contain(rs, rn, 1000, 101)); /* spans two regions */
    CHECK(!kvpi_regions_contain(rs, rn, 1099, 2));
    CHECK(kvpi_regions_contain(rs, rn, 2099, 1));
    CHECK(kvpi_regions_find(rs, rn, 2099, 1) == 2);
    CHECK(kvpi_regions_find(rs, rn, 1100, 100) == 1);
    CHECK(!kvpi_regions_contain(rs, rn, 2099, 2));
    CHECK(!kvpi_regions_contain(rs, rn, 999, 1));
    CHECK(!kvpi_regions_contain(rs, rn, 2050, UINT64_MAX));
    kvpi_pin pin;
    CHECK(kvpi_region_pin(&r, 2000, 100, KVPI_MEM_HOST_BIT, &pin) == KVP_OK);
    kvpi_region_unpin(&r, pin);
    CHECK(kvpi_region_pin(&r, 3000, 1, KVPI_MEM_HOST_BIT, &pin) == KVP_ERANGE);
    CHECK(kvpi_region_pin(&r, 2050, UINT64_MAX, KVPI_MEM_HOST_BIT, &pin) == KVP_ERANGE);
    CHECK_ST(region_remove(&r, 1001), KVP_ENOTFOUND);
    CHECK_OK(region_remove(&r, 1000));
    CHECK(kvpi_region_pin(&r, 1000, 1, KVPI_MEM_HOST_BIT, &pin) == KVP_ERANGE);
    kvpi_region_table_destroy(&r);
}

/* A reserved region blocks overlapping adds but is neither pinnable nor
 * listed until activated; a server that moves only some kinds of memory
 * cannot pin the others. */
static void registry_phases_and_kinds(void)
{
    kvpi_region_table r;
    kvpi_region_table_init(&r);
    kvpi_region cuda = {.addr = 1000, .length = 100, .kind = KVP_MEM_CUDA, .device = 3};
    kvpi_region_entry *entry;
    REQUIRE_OK(kvpi_region_add(&r, &cuda, &entry));
    kvpi_region_of(entry)->handle[2] = &cuda;
    CHECK_ST(region_add(&r, 1050, 10), KVP_EINVAL);
    kvpi_pin pin;
    unsigned all = KVPI_MEM_HOST_BIT | KVPI_MEM_BIT(KVP_MEM_CUDA);
    CHECK_ST(kvpi_region_pin(&r, 1000, 10, all, &pin), KVP_ERANGE);
    kvpi_pin *pins;
    size_t n;
    REQUIRE_OK(kvpi_region_pin_all(&r, &pins, &n));
    CHECK(n == 0);
    kvpi_region_unpin_all(&r, pins, n);
    int dev = -1;
    CHECK(kvpi_region_kind_at(&r, 1000, 10, &dev) == KVP_MEM_HOST && dev == 0);
    kvpi_region_activate(&r, entry);
    CHECK(kvpi_region_kind_at(&r, 1000, 10, &dev) == KVP_MEM_CUDA && dev == 3);
    CHECK(kvpi_region_kind_at(&r, 1000, 101, &dev) == KVP_MEM_HOST);
    CHECK_ST(kvpi_region_pin(&r, 1000, 10, KVPI_MEM_HOST_BIT, &pin), KVP_ERANGE);
    REQUIRE_OK(kvpi_region_pin(&r, 1000, 10, all, &pin));
    CHECK(kvpi_pin_region(pin)->handle[2] == &cuda && kvpi_pin_region(pin)->device == 3);
    kvpi_region_unpin(&r, pin);
    CHECK_OK(region_remove(&r, 1000));
    CHECK(kvpi_region_kind_at(&r, 1000, 10, &dev) == KVP_MEM_HOST);
    /* Discarding a reserved entry frees its range. */
    REQUIRE_OK(kvpi_region_add(&r, &cuda, &entry));
    kvpi_region_discard(&r, entry);
    CHECK_OK(region_add(&r, 1000, 100));
    kvpi_region_table_destroy(&r);
}

/* A pin holds its own region only: other regions come and go meanwhile, and
 * removing the pinned one refuses new pins at once and returns when the pin
 * drops. */
typedef struct remover {
    kvpi_region_table *r;
    atomic_int done;
} remover;

static void *remove_main(void *arg)
{
    remover *m = arg;
    region_remove(m->r, 1000);
    atomic_store(&m->done, 1);
    return NULL;
}

static void registry_pins(void)
{
    kvpi_region_table r;
    kvpi_region_table_init(&r);
    REQUIRE_OK(region_add(&r, 1000, 100));
    kvpi_pin held, other;
    REQUIRE_OK(kvpi_region_pin(&r, 1010, 10, KVPI_MEM_HOST_BIT, &held));
    CHECK_OK(region_add(&r, 5000, 100)); /* would block behind a read lock before */
    CHECK_OK(kvpi_region_pin(&r, 5000, 100, KVPI_MEM_HOST_BIT, &other));
    kvpi_region_unpin(&r, other);
    CHECK_OK(region_remove(&r, 5000));
    remover m = {.r = &r};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, remove_main, &m) == 0);
    kvpi_pin again;
    kvp_status st;
    while ((st = kvpi_region_pin(&r, 1000, 1, KVPI_MEM_HOST_BIT, &again)) == KVP_OK)
        kvpi_region_unpin(&r, again); /* until removal starts */
    CHECK_ST(st, KVP_ERANGE);
    usleep(100000);
    CHECK(!atomic_load(&m.done)); /* still held by our pin */
    CHECK_OK(region_add(&r, 7000, 100));
    kvpi_pin *pins;
    size_t rn;
    REQUIRE_OK(kvpi_region_pin_all(&r, &pins, &rn));
    /* the region being removed is not published */
    CHECK(rn == 1 && kvpi_pin_region(pins[0])->addr == 7000);
    kvpi_region_unpin_all(&r, pins, rn);
    kvpi_region_unpin(&r, held);
    pthread_join(t, NULL);
    CHECK(atomic_load(&m.done));
    kvpi_region_table_destroy(&r);
}

/* Every message and descriptor names the kinds alike: "host", "cuda", a
 * mask as "host and cuda" (registration's refusal once wrote "host, cuda",
 * which read as part of its list of transports). */
static void mem_kind_names(void)
{
    char buf[64];
    CHECK(strcmp(kvpi_mem_kind_name(KVP_MEM_HOST), "host") == 0);
    CHECK(strcmp(kvpi_mem_kind_name(KVP_MEM_CUDA), "cuda") == 0);
    CHECK(strcmp(kvpi_mem_kind_name((kvp_mem_kind)7), "unknown") == 0);
    CHECK(kvpi_mem_kind_parse("host") == KVP_MEM_HOST);
    CHECK(kvpi_mem_kind_parse("cuda") == KVP_MEM_CUDA);
    CHECK(kvpi_mem_kind_parse("CUDA") == KVPI_MEM_KIND_UNKNOWN);
    CHECK(kvpi_mem_kind_parse("unknown") == KVPI_MEM_KIND_UNKNOWN);
    CHECK(strcmp(kvpi_mem_kinds_names(0, buf, sizeof buf), "") == 0);
    CHECK(strcmp(kvpi_mem_kinds_names(KVPI_MEM_HOST_BIT, buf, sizeof buf), "host") == 0);
    CHECK(strcmp(kvpi_mem_kinds_names(KVPI_MEM_BIT(KVP_MEM_CUDA), buf, sizeof buf), "cuda") == 0);
    unsigned both = KVPI_MEM_HOST_BIT | KVPI_MEM_BIT(KVP_MEM_CUDA);
    CHECK(strcmp(kvpi_mem_kinds_names(both, buf, sizeof buf), "host and cuda") == 0);
    CHECK(strcmp(kvpi_mem_kinds_names(both | KVPI_MEM_BIT(KVPI_MEM_KIND_UNKNOWN), buf, sizeof buf),
                 "host, cuda and unknown") == 0);
    CHECK(strcmp(kvpi_mem_kinds_names(both, buf, 6), "host ") == 0); /* truncated, terminated */
}

static void descriptor_round_trip(void)
{
    kvpi_region regions[3] = {
        {.addr = 0x7f0000001000ull, .length = 4096},
        {.addr = 0x7f0000100000ull, .length = 64, .kind = KVP_MEM_CUDA, .device = 2},
        {.addr = 0x1fffffffffffffull, .length = 1}};
    cJSON *doc = kvpi_descriptor_build("127.0.0.1:1234", "tcp", regions, 3);
    REQUIRE(doc);
    char *text = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    /* Addresses are written as exact integers; the core writes no transport's
     * fields, and only non-host memory says its kind. */
    CHECK(strstr(text, "\"addr\":139637976731648") != NULL);
    CHECK(strstr(text, "\"addr\":9007199254740991") != NULL);
    CHECK(strstr(text, "\"protocol\":\"tcp\"") != NULL);
    CHECK(strstr(text, "tcp_data_port") == NULL && strstr(text, "tcp_proto_version") == NULL);
    CHECK(strstr(text, "\"kind\":\"cuda\",\"device\":2") != NULL);
    CHECK(strstr(text, "\"kind\":\"host\"") == NULL);
    kvpi_descriptor d;
    REQUIRE_OK(kvpi_descriptor_parse(text, &d));
    free(text);
    CHECK(strcmp(d.name, "127.0.0.1:1234") == 0 && strcmp(d.protocol, "tcp") == 0);
    REQUIRE(d.n_regions == 3);
    for (size_t i = 0; i < 3; i++) {
        CHECK(d.regions[i].addr == regions[i].addr && d.regions[i].length == regions[i].length);
        CHECK(d.regions[i].kind == regions[i].kind && d.regions[i].device == regions[i].device);
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(d.buffers[i], "name");
        CHECK(cJSON_IsString(name) && strcmp(name->valuestring, "127.0.0.1:1234") == 0);
    }
    kvpi_descriptor_free(&d);
}

/* A peer context for the tcp and shm transports' peer_open over d. */
static kvpi_peer_ctx peer_ctx_of(const kvpi_descriptor *d)
{
    return (kvpi_peer_ctx){.segment = d->name,
                           .host = "127.0.0.1",
                           .desc = d->json,
                           .regions = d->regions,
                           .buffers = d->buffers,
                           .n_regions = d->n_regions,
                           .timeout_ms = 1000,
                           .conns = 1};
}

static void descriptor_mooncake(void)
{
    /* A Mooncake TCP descriptor: no tcp_proto_version (v1), extra fields,
     * buffers out of order; each buffer's entry stays with its region. */
    const char *mc = "{\"name\":\"10.0.0.1:12345\",\"protocol\":\"tcp\",\"tcp_data_port\":15000,"
                     "\"timestamp\":\"2024\",\"devices\":[],\"priority_matrix\":{},"
                     "\"buffers\":[{\"name\":\"cpu:0\",\"addr\":8192,\"length\":100,\"rkey\":[]},"
                     "{\"name\":\"cpu:0\",\"addr\":4096,\"length\":10}]}";
    kvpi_descriptor d;
    REQUIRE_OK(kvpi_descriptor_parse(mc, &d));
    CHECK(d.n_regions == 2 && d.regions[0].addr == 4096 && d.regions[1].addr == 8192);
    CHECK(cJSON_GetObjectItemCaseSensitive(d.buffers[0], "rkey") == NULL);
    CHECK(cJSON_GetObjectItemCaseSensitive(d.buffers[1], "rkey") != NULL);
    CHECK(d.regions[0].kind == KVP_MEM_HOST && d.regions[1].kind == KVP_MEM_HOST);
    kvpi_peer_ctx ctx = peer_ctx_of(&d);
    void *peer = NULL;
    REQUIRE_OK(kvpi_transport_tcp.peer_open(&ctx, &peer));
    kvpi_transport_tcp.peer_close(peer);
    kvpi_descriptor_free(&d);
}

/* What Mooncake's RDMA transport publishes parses; tcp refuses it saying
 * how to reach that peer, and shm finds no endpoint of its own. */
static void descriptor_mooncake_rdma(void)
{
    const char *mc =
        "{\"name\":\"10.0.0.2:12345\",\"protocol\":\"rdma\","
        "\"devices\":[{\"name\":\"mlx5_0\",\"lid\":0,\"gid\":\"fe80:0000:0000:0000:0000:0000:0000:"
        "0001\"}],\"priority_matrix\":{\"cpu:0\":[[\"mlx5_0\"],[]]},"
        "\"timestamp\":\"2025-01-31 17:04:05.012345\","
        "\"buffers\":[{\"name\":\"cuda:1\",\"addr\":1048576,\"length\":4096,\"rkey\":[7],"
        "\"lkey\":[7]},{\"name\":\"cpu:0\",\"addr\":4096,\"length\":4096,\"rkey\":[5],"
        "\"lkey\":[5]}]}";
    kvpi_descriptor d;
    REQUIRE_OK(kvpi_descriptor_parse(mc, &d));
    CHECK(strcmp(d.protocol, "rdma") == 0 && d.n_regions == 2);
    CHECK(d.regions[0].kind == KVP_MEM_HOST);
    CHECK(d.regions[1].kind == KVP_MEM_CUDA && d.regions[1].device == 1);
    kvpi_peer_ctx ctx = peer_ctx_of(&d);
    void *peer = NULL;
    CHECK_ST(kvpi_transport_tcp.peer_open(&ctx, &peer), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "segment 10.0.0.2:12345 is a Mooncake rdma segment") != NULL);
    CHECK(strstr(kvp_last_error(), "protocol tcp or MC_FORCE_TCP=1") != NULL);
    CHECK_ST(kvpi_transport_shm.peer_open(&ctx, &peer), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "kvpipe_shm") != NULL);
    kvpi_descriptor_free(&d);
}

static void descriptor_malformed(void)
{
    static const struct {
        const char *text;
        kvp_status want;
    } bad[] = {
        {"", KVP_EPROTO},
        {"[1]", KVP_EPROTO},
        {"{\"protocol\":\"tcp\",\"buffers\":[]}", KVP_EPROTO},
        {"{\"name\":\"a\",\"buffers\":[]}", KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":7,\"buffers\":[]}", KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\"}", KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":[1]}", KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":[{\"addr\":-1,\"length\":1}]}",
         KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":[{\"addr\":1.5,\"length\":1}]}",
         KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":[{\"addr\":1e300,\"length\":1}]}",
         KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":"
         "[{\"addr\":100,\"length\":50},{\"addr\":120,\"length\":5}]}",
         KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":[{\"addr\":100}]}", KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":"
         "[{\"addr\":100,\"length\":1,\"kind\":3}]}",
         KVP_EPROTO},
        {"{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":"
         "[{\"addr\":100,\"length\":1,\"kind\":\"cuda\",\"device\":-1}]}",
         KVP_EPROTO},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvpi_descriptor d;
        kvp_status st = kvpi_descriptor_parse(bad[i].text, &d);
        if (st != bad[i].want) fprintf(stderr, "  case %zu: got %d\n", i, (int)st);
        CHECK(st == bad[i].want);
        CHECK(*kvp_last_error() != '\0');
    }
    /* A kind this build does not know parses, as memory nothing here moves. */
    kvpi_descriptor d;
    REQUIRE_OK(kvpi_descriptor_parse("{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":"
                                     "[{\"addr\":100,\"length\":1,\"kind\":\"rocm\"}]}",
                                     &d));
    CHECK(d.regions[0].kind == KVPI_MEM_KIND_UNKNOWN);
    kvpi_descriptor_free(&d);
}

/* tcp reads its own fields: a tcp descriptor without a usable port is
 * malformed (not "another protocol"). */
static void tcp_fields_malformed(void)
{
    static const char *const bad[] = {
        "{\"name\":\"a\",\"protocol\":\"tcp\",\"buffers\":[]}",
        "{\"name\":\"a\",\"protocol\":\"tcp\",\"tcp_data_port\":0,\"buffers\":[]}",
        "{\"name\":\"a\",\"protocol\":\"tcp\",\"tcp_data_port\":70000,\"buffers\":[]}",
        "{\"name\":\"a\",\"protocol\":\"tcp\",\"tcp_data_port\":\"1\",\"buffers\":[]}",
        "{\"name\":\"a\",\"protocol\":\"tcp\",\"tcp_data_port\":1.5,\"buffers\":[]}",
        "{\"name\":\"a\",\"protocol\":\"rdma\",\"tcp_data_port\":-4,\"buffers\":[]}",
        "{\"name\":\"a\",\"protocol\":\"tcp\",\"tcp_data_port\":1,\"tcp_proto_version\":\"2\","
        "\"buffers\":[]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvpi_descriptor d;
        REQUIRE_OK(kvpi_descriptor_parse(bad[i], &d));
        kvpi_peer_ctx ctx = peer_ctx_of(&d);
        void *peer = NULL;
        kvp_status st = kvpi_transport_tcp.peer_open(&ctx, &peer);
        if (st != KVP_EPROTO) fprintf(stderr, "  case %zu: got %d\n", i, (int)st);
        CHECK_ST(st, KVP_EPROTO);
        CHECK(strstr(kvp_last_error(), "segment a") != NULL);
        kvpi_descriptor_free(&d);
    }
}

static void hostport(void)
{
    kvpi_hostport hp;
    CHECK_OK(kvpi_hostport_parse("127.0.0.1:80", -1, &hp));
    CHECK(strcmp(hp.host, "127.0.0.1") == 0 && hp.port == 80);
    CHECK_OK(kvpi_hostport_parse("[::1]:12345", -1, &hp));
    CHECK(strcmp(hp.host, "::1") == 0 && hp.port == 12345);
    CHECK_OK(kvpi_hostport_parse("[fe80::1%eth0]:1", -1, &hp));
    CHECK(strcmp(hp.host, "fe80::1%eth0") == 0 && hp.port == 1);
    CHECK_OK(kvpi_hostport_parse("localhost", 17, &hp));
    CHECK(strcmp(hp.host, "localhost") == 0 && hp.port == 17);
    CHECK_OK(kvpi_hostport_parse("::1", 9, &hp));
    CHECK(strcmp(hp.host, "::1") == 0 && hp.port == 9);
    CHECK_OK(kvpi_hostport_parse("host.example:0", -1, &hp));
    CHECK(hp.port == 0);
    /* Refused, each with its default port. */
    static const struct {
        const char *text;
        int port;
    } bad[] = {
        {"localhost", -1},
        {"h:", -1},
        {":80", -1},
        {"h:65536", -1},
        {"h:-1", -1},
        {"h:8x", -1},
        {"[::1", -1},
        {"[::1]x", -1},
        {"[]:80", -1},
        {"", -1},
        /* Found by fuzz_config: such a host formats to text that does not parse. */
        {"[[e02]:14000", -1},
        {"[a[b]:1", -1},
        {"a]:1", -1},
        {"a:b]", 5},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvp_status st = kvpi_hostport_parse(bad[i].text, bad[i].port, &hp);
        if (st != KVP_EINVAL) fprintf(stderr, "  \"%s\" parsed: %d\n", bad[i].text, (int)st);
        CHECK(st == KVP_EINVAL);
    }
    char buf[64];
    kvpi_hostport_format("::1", 5, buf, sizeof buf);
    CHECK(strcmp(buf, "[::1]:5") == 0);
    kvpi_hostport_format("a.b", 5, buf, sizeof buf);
    CHECK(strcmp(buf, "a.b:5") == 0);
}

/* The status table: values run 0, 1, 2, ... (append-only, no holes), every
 * code has its own text and kvp_strerror() gives it. */
static void status_text(void)
{
    static const struct {
        kvp_status code;
        int value;
        const char *text;
    } table[] = {
#define ROW(name, value, text) {name, value, text},
        KVP_STATUS_LIST(ROW)
#undef ROW
    };
    size_t n = sizeof table / sizeof table[0];
    CHECK(n >= 18 && table[17].code == KVP_EINTR); /* codes are never taken away */
    for (size_t i = 0; i < n; i++) {
        CHECK(table[i].value == (int)i && (int)table[i].code == table[i].value);
        CHECK(strcmp(kvp_strerror(table[i].code), table[i].text) == 0);
        CHECK(strcmp(table[i].text, "unknown status") != 0 && table[i].text[0]);
        for (size_t k = 0; k < i; k++)
            CHECK(strcmp(table[i].text, table[k].text) != 0);
    }
    CHECK(strcmp(kvp_strerror(KVP_OK), "success") == 0);
    CHECK(strcmp(kvp_strerror((kvp_status)n), "unknown status") == 0);
    CHECK(strcmp(kvp_strerror((kvp_status)9999), "unknown status") == 0);
    CHECK(strcmp(kvp_strerror((kvp_status)-1), "unknown status") == 0);
}

int main(void)
{
    RUN(pool_size_classes);
    RUN(pool_reuse);
    RUN(pool_fragmentation);
    RUN(pool_bounds);
    RUN(pool_threads);
    RUN(registry_ranges);
    RUN(registry_phases_and_kinds);
    RUN(registry_pins);
    RUN(mem_kind_names);
    RUN(descriptor_round_trip);
    RUN(descriptor_mooncake);
    RUN(descriptor_mooncake_rdma);
    RUN(descriptor_malformed);
    RUN(tcp_fields_malformed);
    RUN(hostport);
    RUN(status_text);
    return kvpt_summary();
}
