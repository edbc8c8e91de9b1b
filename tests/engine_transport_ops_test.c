/* The engine's side of the transport ops table, against test transports of
 * its own (internal API, kvpi_engine_create_with): every running server
 * registers each region before peers see it and a failed registration is
 * undone, in reverse, leaving nothing registered or published; pool chunks
 * register once each the same way; teardown deregisters before stopping
 * servers; registering a kind no transport moves is refused naming it; and
 * the selection sends each request through a transport by capability and
 * memory kind, handing NEEDS_LOCAL_REG transports the local region's handle
 * and every transport its per-buffer descriptor fields.
 *
 * The test transports move bytes with memcpy between two engines of this one
 * process (one-sided, as RDMA is: the target's CPU sees nothing), so every
 * byte is checked on both sides. */
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/error.h"
#include "engine/engine_internal.h"
#include "test.h"
#include "transport/transport.h"

#define LEN ((size_t)1 << 20)

/* ------------------------------------------------------ test transports --- */

/* What the test transports did, in order: " reg:NAME:ID", " dereg:NAME:ID",
 * " stop:NAME". */
static char events[8192];
static atomic_int next_id = 1;

static void event(const char *what, const char *name, int id)
{
    size_t used = strlen(events);
    if (id)
        snprintf(events + used, sizeof events - used, " %s:%s:%d", what, name, id);
    else
        snprintf(events + used, sizeof events - used, " %s:%s", what, name);
}

typedef struct test_server {
    const char *name;
    int live_handles;
} test_server;

typedef struct test_handle {
    int id;
    uint64_t addr;
} test_handle;

/* Per transport name: fail its next mem_reg (KVP_EIO) / server_start. */
static const char *fail_reg, *fail_start;
/* The last local_handle a NEEDS_LOCAL_REG transport was given, per slice. */
static void *last_local_handle;
static atomic_int xfers_memkind;

static kvp_status ts_start(const char *name, void **out)
{
    if (fail_start && strcmp(fail_start, name) == 0)
        return kvpi_error(KVP_ENOTSUP, "%s: cannot run here (test)", name);
    test_server *s = calloc(1, sizeof *s);
    s->name = name;
    *out = s;
    return KVP_OK;
}

static void ts_stop(void *server)
{
    test_server *s = server;
    event("stop", s->name, 0);
    CHECK(s->live_handles == 0); /* every registration undone first */
    free(s);
}

/* Field "kvpt_NAME": {"pid": N}; per buffer "kvpt_NAME_key": handle id. */
static kvp_status ts_describe(void *server, cJSON *doc)
{
    test_server *s = server;
    char key[64];
    snprintf(key, sizeof key, "kvpt_%s", s->name);
    cJSON *o = cJSON_AddObjectToObject(doc, key);
    return o && cJSON_AddNumberToObject(o, "pid", getpid()) ? KVP_OK : KVP_ENOMEM;
}

static kvp_status ts_buffer_describe(void *server, const kvpi_region *r, void *handle,
                                     cJSON *buffer)
{
    test_server *s = server;
    test_handle *h = handle;
    CHECK(h && h->addr == r->addr);
    char key[64];
    snprintf(key, sizeof key, "kvpt_%s_key", s->name);
    return cJSON_AddNumberToObject(buffer, key, h->id) ? KVP_OK : KVP_ENOMEM;
}

static kvp_status ts_mem_reg(void *server, const kvpi_region *r, void **handle)
{
    test_server *s = server;
    if (fail_reg && strcmp(fail_reg, s->name) == 0) {
        fail_reg = NULL;
        return kvpi_error(KVP_EIO, "%s: registration failed (test)", s->name);
    }
    test_handle *h = malloc(sizeof *h);
    h->id = atomic_fetch_add(&next_id, 1);
    h->addr = r->addr;
    s->live_handles++;
    event("reg", s->name, h->id);
    *handle = h;
    return KVP_OK;
}

static void ts_mem_dereg(void *server, void *handle)
{
    test_server *s = server;
    test_handle *h = handle;
    event("dereg", s->name, h->id);
    s->live_handles--;
    free(h);
}

/* A peer of a test transport: the keys of the buffers, aligned with the
 * descriptor's regions. */
typedef struct test_peer {
    const char *name;
    unsigned caps;
    size_t n;
    kvpi_region *regions;
    int *keys;
    atomic_int *xfers;
} test_peer;

static kvp_status tp_open(const kvpi_peer_ctx *ctx, const char *name, unsigned kinds, unsigned caps,
                          atomic_int *xfers, void **out)
{
    char field[64], key[64];
    snprintf(field, sizeof field, "kvpt_%s", name);
    snprintf(key, sizeof key, "kvpt_%s_key", name);
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(ctx->desc, field);
    const cJSON *pid = cJSON_GetObjectItemCaseSensitive(o, "pid");
    if (!cJSON_IsNumber(pid) || pid->valueint != getpid())
        return kvpi_error(KVP_ENOTSUP, "%s: segment %s has no %s field of this process", name,
                          ctx->segment, field);
    CHECK(ctx->server != NULL);
    test_peer *p = calloc(1, sizeof *p);
    p->name = name;
    p->caps = caps;
    p->n = ctx->n_regions;
    p->regions = calloc(p->n + 1, sizeof *p->regions);
    p->keys = calloc(p->n + 1, sizeof *p->keys);
    p->xfers = xfers;
    for (size_t i = 0; i < p->n; i++) {
        p->regions[i] = ctx->regions[i];
        const cJSON *k = cJSON_GetObjectItemCaseSensitive(ctx->buffers[i], key);
        /* The peer registered with this transport what it moves. */
        CHECK(cJSON_IsNumber(k) == !!(kinds & KVPI_MEM_BIT(ctx->regions[i].kind)));
        p->keys[i] = cJSON_IsNumber(k) ? k->valueint : 0;
    }
    *out = p;
    return KVP_OK;
}

/* Completes on the posting thread, as a transport may. */
static void tp_post(void *peer, kvpi_xfer *x)
{
    test_peer *p = peer;
    kvpi_slice *const *slices = x->slices;
    size_t n = x->n;
    atomic_fetch_add(p->xfers, 1);
    for (size_t i = 0; i < n; i++) {
        kvpi_slice *s = slices[i];
        /* The engine checked the range and says which region holds it. */
        CHECK(s->remote_region < p->n && p->keys[s->remote_region] != 0);
        CHECK(kvpi_regions_contain(&p->regions[s->remote_region], 1, s->remote, s->length));
        if (p->caps & KVPI_CAP_NEEDS_LOCAL_REG)
            last_local_handle = s->local_handle;
        else
            CHECK(s->local_handle == NULL);
        void *remote = (void *)(uintptr_t)s->remote;
        if (s->opcode == KVP_OP_READ)
            memcpy(s->local, remote, s->length);
        else
            memcpy(remote, s->local, s->length);
        s->status = KVP_OK;
    }
    x->done(x, KVP_OK);
}

static void tp_close(void *peer)
{
    test_peer *p = peer;
    free(p->regions);
    free(p->keys);
    free(p);
}

/* memA, memB: host memory, registering (B can be told to fail), never
 * reaching a peer (so tcp serves). memkind: host and CUDA memory, same host,
 * wants local memory registered, one-sided. */
#define TEST_TRANSPORT(id, kinds, caps_, peer_open_fn)                                             \
    static kvp_status id##_start(const kvpi_server_ctx *ctx, void **out)                           \
    {                                                                                              \
        (void)ctx;                                                                                 \
        return ts_start(#id, out);                                                                 \
    }                                                                                              \
    static const kvpi_transport_ops id = {                                                         \
        .name = #id,                                                                               \
        .caps = caps_,                                                                             \
        .mem_kinds = kinds,                                                                        \
        .server_start = id##_start,                                                                \
        .server_stop = ts_stop,                                                                    \
        .server_describe = ts_describe,                                                            \
        .buffer_describe = ts_buffer_describe,                                                     \
        .mem_reg = ts_mem_reg,                                                                     \
        .mem_dereg = ts_mem_dereg,                                                                 \
        .peer_open = peer_open_fn,                                                                 \
        .peer_post = tp_post,                                                                      \
        .peer_close = tp_close,                                                                    \
    };

static kvp_status refuse_open(const kvpi_peer_ctx *ctx, void **out)
{
    (void)ctx;
    (void)out;
    return kvpi_error(KVP_ENOTSUP, "reaches no peer (test)");
}

#define KIND_BITS (KVPI_MEM_HOST_BIT | KVPI_MEM_BIT(KVP_MEM_CUDA))
#define KIND_CAPS (KVPI_CAP_SAME_HOST | KVPI_CAP_NEEDS_LOCAL_REG | KVPI_CAP_RDMA)

static kvp_status memkind_open(const kvpi_peer_ctx *ctx, void **out)
{
    return tp_open(ctx, "memkind", KIND_BITS, KIND_CAPS, &xfers_memkind, out);
}

TEST_TRANSPORT(memA, KVPI_MEM_HOST_BIT, 0, refuse_open)
TEST_TRANSPORT(memB, KVPI_MEM_HOST_BIT, 0, refuse_open)
TEST_TRANSPORT(memkind, KIND_BITS, KIND_CAPS, memkind_open)

/* tcp as it was before it moved CUDA memory (main() fills it in): these
 * cases test the engine's selection by kind with a test transport that
 * moves "CUDA" memory which is host memory (no driver needed). */
static kvpi_transport_ops tcp_host;
static const kvpi_transport_ops *const two_regs[] = {&memA, &memB, &tcp_host, NULL};
/* tcp first: it is the primary for host memory; memkind takes what tcp cannot. */
static const kvpi_transport_ops *const by_kind[] = {&tcp_host, &memkind, NULL};

/* ---------------------------------------------------------------- setup --- */

/* Memory to register: whole zeroed pages (the host check probes the pages
 * around a range, which malloc'ed memory shares with the allocator). */
static char *mem_new(size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void mem_free(void *p, size_t len)
{
    if (p) munmap(p, len);
}

static kvp_status engine_with(const kvpi_transport_ops *const *list, int disable_shm,
                              kvp_engine **out)
{
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = "127.0.0.1:0";
    o.metadata = "P2PHANDSHAKE";
    o.disable_shm = disable_shm;
    return kvpi_engine_create_with(&o, list, out);
}

/* How often s occurs in events. */
static int count(const char *s)
{
    int n = 0;
    for (const char *p = events; (p = strstr(p, s)); p++)
        n++;
    return n;
}

static cJSON *descriptor(kvp_engine *e)
{
    char *text = kvpi_engine_descriptor_text(e);
    cJSON *d = cJSON_Parse(text);
    free(text);
    return d;
}

static int buffers_listed(kvp_engine *e)
{
    cJSON *d = descriptor(e);
    int n = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(d, "buffers"));
    cJSON_Delete(d);
    return n;
}

/* ---------------------------------------------------------------- cases --- */

/* memB fails: memA's registration is undone, nothing is registered or
 * published, and the same range registers once memB works again. */
static void register_rolls_back(void)
{
    kvp_engine *e;
    REQUIRE_OK(engine_with(two_regs, 1, &e));
    char *buf = mem_new(LEN);
    fail_reg = "memB";
    CHECK_ST(kvp_engine_register(e, buf, LEN), KVP_EIO);
    CHECK(strstr(kvp_last_error(), "memB") && strstr(kvp_last_error(), "(test)"));
    CHECK(count(" reg:memA:") == 1 && count(" dereg:memA:") == 1 && count(" reg:memB:") == 0);
    CHECK(strcmp(events, " reg:memA:1 dereg:memA:1") == 0); /* the same handle */
    CHECK(buffers_listed(e) == 0);
    events[0] = '\0';
    REQUIRE_OK(kvp_engine_register(e, buf, LEN)); /* no reservation left behind */
    CHECK(count(" reg:memA:") == 1 && count(" reg:memB:") == 1 && count(" dereg:") == 0);
    /* Both transports' per-buffer fields are published with it. */
    cJSON *d = descriptor(e);
    const cJSON *b = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(d, "buffers"), 0);
    CHECK(cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(b, "kvpt_memA_key")));
    CHECK(cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(b, "kvpt_memB_key")));
    CHECK(cJSON_GetObjectItemCaseSensitive(d, "kvpt_memA") != NULL);
    CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(d, "protocol")->valuestring, "tcp") == 0);
    cJSON_Delete(d);
    events[0] = '\0';
    CHECK_OK(kvp_engine_unregister(e, buf));
    /* Last registered, first undone. */
    const char *db = strstr(events, " dereg:memB:"), *da = strstr(events, " dereg:memA:");
    CHECK(db && da && db < da);
    CHECK(buffers_listed(e) == 0);
    kvp_engine_destroy(e);
    mem_free(buf, LEN);
}

/* The first transport fails too: nothing was registered, nothing to undo. */
static void register_first_fails(void)
{
    kvp_engine *e;
    REQUIRE_OK(engine_with(two_regs, 1, &e));
    char *buf = mem_new(LEN);
    fail_reg = "memA";
    CHECK_ST(kvp_engine_register(e, buf, LEN), KVP_EIO);
    CHECK(count(" reg:") == 0 && count(" dereg:") == 0);
    REQUIRE_OK(kvp_engine_register(e, buf, LEN));
    CHECK(buffers_listed(e) == 1);
    kvp_engine_destroy(e);
    mem_free(buf, LEN);
}

/* A server that did not start registers nothing; the engine runs without it. */
static void register_only_running_servers(void)
{
    fail_start = "memA";
    kvp_engine *e;
    REQUIRE_OK(engine_with(two_regs, 1, &e));
    char *buf = mem_new(LEN);
    REQUIRE_OK(kvp_engine_register(e, buf, LEN));
    CHECK(count(" reg:memA:") == 0 && count(" reg:memB:") == 1);
    kvp_engine_destroy(e);
    CHECK(count(" stop:memA") == 0 && count(" stop:memB") == 1);
    mem_free(buf, LEN);
}

/* Pool chunks register once each, through every transport, whatever number
 * of buffers they hold; destroying the engine deregisters everything, the
 * application's regions included, before the servers stop. */
static void pool_chunks_and_teardown(void)
{
    kvp_engine *e;
    REQUIRE_OK(engine_with(two_regs, 1, &e));
    void *a, *b;
    REQUIRE_OK(kvp_engine_alloc(e, 4096, &a));
    REQUIRE_OK(kvp_engine_alloc(e, 4096, &b));
    CHECK(count(" reg:memA:") == 1 && count(" reg:memB:") == 1);
    CHECK(buffers_listed(e) == 1);
    char *mine = mem_new(LEN);
    REQUIRE_OK(kvp_engine_register(e, mine, LEN));
    CHECK(kvp_engine_free(e, a) == KVP_OK && kvp_engine_free(e, b) == KVP_OK);
    kvp_engine_destroy(e);
    CHECK(count(" dereg:memA:") == 2 && count(" dereg:memB:") == 2);
    const char *last_dereg = events, *p;
    while ((p = strstr(last_dereg + 1, " dereg:")))
        last_dereg = p;
    const char *stop = strstr(events, " stop:");
    CHECK(stop && stop > last_dereg);
    mem_free(mine, LEN);
}

/* A kind none of the engine's transports moves is refused, naming it. */
static void register_kinds(void)
{
    kvp_engine *e;
    REQUIRE_OK(engine_with(two_regs, 1, &e));
    char *buf = mem_new(LEN);
    CHECK_ST(kvp_engine_register_mem(e, buf, LEN, KVP_MEM_CUDA, 0), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "register: cuda memory (device 0)") &&
          strstr(kvp_last_error(), "move host memory)"));
    CHECK(count(" reg:") == 0);
    CHECK_ST(kvp_engine_register_mem(e, buf, LEN, (kvp_mem_kind)7, 0), KVP_EINVAL);
    CHECK_ST(kvp_engine_register_mem(e, buf, LEN, KVP_MEM_HOST, 1), KVP_EINVAL);
    CHECK_ST(kvp_engine_register_mem(e, buf, LEN, KVP_MEM_CUDA, -1), KVP_EINVAL);
    REQUIRE_OK(kvp_engine_register_mem(e, buf, LEN, KVP_MEM_HOST, 0));
    kvp_engine_destroy(e);
    /* The engine of this build: its tcp and shm move CUDA memory, which
     * must then be device memory by the driver; none here, or not this. */
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = "127.0.0.1:0";
    o.metadata = "P2PHANDSHAKE";
    REQUIRE_OK(kvp_engine_create(&o, &e));
    CHECK_ST(kvp_engine_register_mem(e, buf, LEN, KVP_MEM_CUDA, 0), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "cuda") != NULL);
    kvp_engine_destroy(e);
    mem_free(buf, LEN);
}

typedef struct pair {
    kvp_engine *target, *init;
    kvp_segment_id seg;
    char *host, *dev;       /* the target's host and "CUDA" regions */
    char *local, *devlocal; /* the initiator's unregistered and "CUDA" memory */
} pair;

/* Two engines over by_kind; the target registers host memory and memory it
 * calls CUDA (host memory the test transport copies; only it registers it). */
static int pair_start(pair *p, int init_disable_shm)
{
    memset(p, 0, sizeof *p);
    p->host = mem_new(LEN);
    p->dev = mem_new(LEN);
    p->local = mem_new(LEN);
    p->devlocal = mem_new(LEN);
    if (engine_with(by_kind, 0, &p->target) || engine_with(by_kind, init_disable_shm, &p->init))
        return -1;
    kvpt_fill(p->host, LEN, 1);
    kvpt_fill(p->dev, LEN, 2);
    /* "CUDA" regions of host memory: registered past the driver's check. */
    kvpi_region dev = {.addr = (uint64_t)(uintptr_t)p->dev, .length = LEN, .kind = KVP_MEM_CUDA};
    kvpi_region devlocal = dev;
    devlocal.addr = (uint64_t)(uintptr_t)p->devlocal;
    if (kvp_engine_register(p->target, p->host, LEN) ||
        kvpi_engine_register_region(p->target, &dev) ||
        kvpi_engine_register_region(p->init, &devlocal))
        return -1;
    return kvp_engine_open_segment(p->init, kvp_engine_segment_name(p->target), &p->seg) ? -1 : 0;
}

static void pair_stop(pair *p)
{
    kvp_engine_destroy(p->init);
    kvp_engine_destroy(p->target);
    mem_free(p->host, LEN);
    mem_free(p->dev, LEN);
    mem_free(p->local, LEN);
    mem_free(p->devlocal, LEN);
}

/* The newest "reg:memkind:ID" handle the initiator registered: the one of
 * devlocal (registered last in pair_start). */
static int last_memkind_id(void)
{
    int id = 0;
    for (const char *p = events; (p = strstr(p, " reg:memkind:")); p++)
        id = atoi(p + strlen(" reg:memkind:"));
    return id;
}

/* Host to host goes over tcp (the primary); anything that touches memory tcp
 * cannot move goes through the transport that can, with the local region's
 * handle when the local memory is registered with it. */
static void select_by_kind(void)
{
    pair p;
    REQUIRE(pair_start(&p, 0) == 0);
    CHECK(strcmp(kvp_engine_segment_transport(p.init, p.seg), "tcp") == 0);
    uint64_t host = (uint64_t)(uintptr_t)p.host, dev = (uint64_t)(uintptr_t)p.dev;
    /* The target's descriptor says which buffer is CUDA memory. */
    cJSON *d = descriptor(p.target);
    const cJSON *b;
    int cuda = 0;
    cJSON_ArrayForEach(b, cJSON_GetObjectItemCaseSensitive(d, "buffers"))
    {
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(b, "kind");
        if (cJSON_IsString(kind) && strcmp(kind->valuestring, "cuda") == 0) cuda++;
    }
    cJSON_Delete(d);
    CHECK(cuda == 1);

    CHECK_OK(kvp_engine_read(p.init, p.seg, p.local, host, LEN));
    CHECK(kvpt_verify(p.local, LEN, 1) == (size_t)-1);
    CHECK(atomic_load(&xfers_memkind) == 0);

    /* Unregistered host memory from the target's CUDA region. */
    last_local_handle = &p;
    CHECK_OK(kvp_engine_read(p.init, p.seg, p.local, dev + 4096, 4096));
    CHECK(kvpt_verify(p.local, 4096, 2 + 4096) == (size_t)-1);
    CHECK(atomic_load(&xfers_memkind) >= 1);
    CHECK(last_local_handle == NULL);

    /* Registered CUDA local memory to the target's host region. */
    int id = last_memkind_id();
    kvpt_fill(p.devlocal, LEN, 3);
    int before = atomic_load(&xfers_memkind);
    CHECK_OK(kvp_engine_write(p.init, p.seg, p.devlocal, host, LEN));
    CHECK(kvpt_verify(p.host, LEN, 3) == (size_t)-1);
    CHECK(atomic_load(&xfers_memkind) > before);
    REQUIRE(last_local_handle != NULL);
    CHECK(((test_handle *)last_local_handle)->id == id);
    CHECK(((test_handle *)last_local_handle)->addr == (uint64_t)(uintptr_t)p.devlocal);

    /* A batch across both target regions splits by kind. */
    kvp_request reqs[2] = {{KVP_OP_READ, p.local, host, 4096},
                           {KVP_OP_READ, p.local + 4096, dev, 4096}};
    kvpt_fill(p.host, LEN, 1);
    kvp_batch *batch;
    REQUIRE_OK(kvp_batch_submit(p.init, p.seg, reqs, 2, &batch));
    CHECK_OK(kvp_batch_wait(batch, 10000));
    kvp_batch_free(batch);
    CHECK(kvpt_verify(p.local, 4096, 1) == (size_t)-1);
    CHECK(kvpt_verify(p.local + 4096, 4096, 2) == (size_t)-1);
    pair_stop(&p);
}

/* With the same-host transport off, nothing the initiator may use moves
 * CUDA memory: those requests fail saying so; host ones still run. */
static void select_refuses_kind(void)
{
    pair p;
    REQUIRE(pair_start(&p, 1) == 0);
    uint64_t host = (uint64_t)(uintptr_t)p.host, dev = (uint64_t)(uintptr_t)p.dev;
    CHECK_ST(kvp_engine_read(p.init, p.seg, p.local, dev, 4096), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "moves host and cuda memory") != NULL);
    CHECK_ST(kvp_engine_write(p.init, p.seg, p.devlocal, host, 4096), KVP_ENOTSUP);
    CHECK_OK(kvp_engine_read(p.init, p.seg, p.local, host, LEN));
    CHECK(kvpt_verify(p.local, LEN, 1) == (size_t)-1);
    CHECK(atomic_load(&xfers_memkind) == 0);
    pair_stop(&p);
}

int main(void)
{
    tcp_host = kvpi_transport_tcp;
    tcp_host.mem_kinds = KVPI_MEM_HOST_BIT;
    RUN(register_rolls_back);
    RUN(register_first_fails);
    RUN(register_only_running_servers);
    RUN(pool_chunks_and_teardown);
    RUN(register_kinds);
    RUN(select_by_kind);
    RUN(select_refuses_kind);
    return kvpt_summary();
}
