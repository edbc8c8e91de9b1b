/* The shm transport between two real processes: a forked target registers
 * memory in a region table and runs the shm server; the test process opens it as a
 * peer from the target's own descriptor and READs and WRITEs, checking every
 * byte on both sides. The target is a kvpt_peer (support/peer.h) obeying
 * commands (fill, verify, unregister, stop) so that both ends of each transfer
 * are observed. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/net.h"
#include "common/region.h"
#include "peer.h"
#include "test.h"
#include "transport/shm_internal.h"
#include "transport/transport.h"

#define BIG ((size_t)65 << 20) /* region A: room for 64 MiB at an offset */
#define SMALL ((size_t)4096)   /* region B */
#define MIB ((size_t)1 << 20)

typedef struct target {
    kvpt_peer peer;
    cJSON *desc;
    kvpi_region regions[2]; /* sorted by address, as descriptors are */
    uint64_t a, b;          /* region A and B addresses */
} target;

/* Commands: F fill, V verify [a, a + b) with seed c; U unregister B; S stop
 * the server; the channel's end quits. Replies are uint64_t. */
#define REPLY_MS 20000

/* ---- the target process ---- */

static kvp_status region_add(kvpi_region_table *t, void *addr, size_t len)
{
    kvpi_region r = {.addr = (uint64_t)(uintptr_t)addr, .length = len, .kind = KVP_MEM_HOST};
    kvpi_region_entry *e;
    kvp_status st = kvpi_region_add(t, &r, &e);
    if (!st) kvpi_region_activate(t, e);
    return st;
}

static kvp_status region_remove(kvpi_region_table *t, void *addr)
{
    kvpi_region_entry *e;
    kvp_status st = kvpi_region_remove_begin(t, (uint64_t)(uintptr_t)addr, &e);
    if (!st) kvpi_region_remove_end(t, e);
    return st;
}

static uint64_t target_do(const kvpt_cmd *c, char *a, kvpi_region_table *reg, void **server)
{
    switch (c->op) {
    case 'F':
        kvpt_fill(a + c->a, c->b, c->c);
        return 0;
    case 'V':
        return kvpt_verify(a + c->a, c->b, c->c);
    case 'U':
        return region_remove(reg, a + BIG);
    case 'S':
        kvpi_transport_shm.server_stop(*server);
        *server = NULL;
        return 0;
    default:
        return (uint64_t)-2;
    }
}

static void target_main(void *arg, int cmd_fd, int resp_fd)
{
    (void)arg;
    /* A and B adjacent, so that a range across both is "touching two regions". */
    char *a = malloc(BIG + SMALL);
    kvpi_region_table reg;
    kvpi_region_table_init(&reg);
    void *server = NULL;
    kvpi_server_ctx ctx = {.host = "127.0.0.1", .regions = &reg, .timeout_ms = 5000};
    if (!a || region_add(&reg, a, BIG) || region_add(&reg, a + BIG, SMALL) ||
        kvpi_transport_shm.server_start(&ctx, &server))
        _exit(3);
    cJSON *desc = cJSON_CreateObject();
    cJSON_AddStringToObject(desc, "name", "target");
    if (kvpi_transport_shm.server_describe(server, desc)) _exit(4);
    char *text = cJSON_PrintUnformatted(desc);
    uint64_t hdr[2] = {(uintptr_t)a, strlen(text)};
    if (write(resp_fd, hdr, sizeof hdr) != (ssize_t)sizeof hdr ||
        write(resp_fd, text, hdr[1]) != (ssize_t)hdr[1])
        _exit(4);
    kvpt_cmd c;
    while (kvpt_peer_next(cmd_fd, &c) == 0)
        if (kvpt_peer_answer(resp_fd, (int64_t)target_do(&c, a, &reg, &server))) break;
    if (server) kvpi_transport_shm.server_stop(server);
    _exit(0);
}

static int target_start(target *t)
{
    t->desc = NULL;
    if (kvpt_peer_fork(&t->peer, NULL, target_main, NULL)) return -1;
    uint64_t hdr[2];
    if (kvpt_peer_recv(&t->peer, hdr, sizeof hdr, REPLY_MS) || hdr[1] > 4096) return -1;
    char text[4097] = {0};
    if (kvpt_peer_recv(&t->peer, text, hdr[1], REPLY_MS)) return -1;
    t->desc = cJSON_Parse(text);
    t->a = hdr[0];
    t->b = hdr[0] + BIG;
    t->regions[0] = (kvpi_region){.addr = t->a, .length = BIG};
    t->regions[1] = (kvpi_region){.addr = t->b, .length = SMALL};
    return t->desc ? 0 : -1;
}

static uint64_t target_cmd(target *t, char op, uint64_t off, uint64_t len, uint64_t seed)
{
    return (uint64_t)kvpt_peer_call(&t->peer, op, off, len, seed, REPLY_MS);
}

/* Ask the target to exit and reap it (pid 0: already reaped). */
static void target_stop(target *t)
{
    if (t->peer.pid > 0) CHECK(kvpt_peer_wait(&t->peer, 10000) == 0);
    cJSON_Delete(t->desc);
}

static kvp_status open_peer(const target *t, const cJSON *desc, const kvpi_region *regions,
                            void **peer)
{
    kvpi_peer_ctx ctx = {.host = "127.0.0.1",
                         .desc = desc,
                         .regions = regions,
                         .n_regions = 2,
                         .timeout_ms = 3000,
                         .conns = 4};
    (void)t;
    return kvpi_transport_shm.peer_open(&ctx, peer);
}

/* The target started and a peer opened to it (NULL, the reason printed,
 * if either fails). */
static void *target_and_peer(target *t)
{
    void *peer = NULL;
    if (target_start(t) != 0) return NULL;
    if (open_peer(t, t->desc, t->regions, &peer) != KVP_OK)
        fprintf(stderr, "  open the peer: %s\n", kvp_last_error());
    return peer;
}

static void peer_and_target_stop(void *peer, target *t)
{
    kvpi_transport_shm.peer_close(peer);
    target_stop(t);
}

static kvp_status xfer1(void *peer, kvp_opcode op, void *local, uint64_t remote, size_t len,
                        kvp_status *slice_st)
{
    kvpi_slice s = {.opcode = op, .local = local, .remote = remote, .length = len};
    kvpi_slice *ps = &s;
    kvp_status st = kvpi_transport_xfer_sync(&kvpi_transport_shm, peer, &ps, 1);
    *slice_st = s.status;
    return st;
}

/* ---- cases ---- */

static void test_read_write_every_byte(void)
{
    target t;
    void *peer = target_and_peer(&t);
    REQUIRE(peer);
    const size_t sizes[] = {1, 4096, MIB, 64 * MIB};
    char *local = malloc(64 * MIB);
    REQUIRE(local);
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        size_t n = sizes[i], off = 4093; /* unaligned on both sides */
        kvp_status sst;
        REQUIRE(target_cmd(&t, 'F', off, n, 10 + i) == 0);
        memset(local, 0, n);
        CHECK_OK(xfer1(peer, KVP_OP_READ, local, t.a + off, n, &sst));
        CHECK_OK(sst);
        CHECK(kvpt_verify(local, n, 10 + i) == (size_t)-1);
        kvpt_fill(local, n, 100 + i);
        CHECK_OK(xfer1(peer, KVP_OP_WRITE, local, t.a + off, n, &sst));
        CHECK_OK(sst);
        CHECK(target_cmd(&t, 'V', off, n, 100 + i) == (uint64_t)-1);
    }
    /* A zero-length slice completes without touching anything. */
    kvp_status sst = KVP_EIO;
    CHECK_OK(xfer1(peer, KVP_OP_READ, NULL, t.a, 0, &sst));
    CHECK_OK(sst);
    kvpi_transport_shm.peer_close(peer);
    free(local);
    target_stop(&t);
}

/* Many small slices in one call are pipelined (more than one window); one
 * slice the initiator refuses fails alone. */
static void test_many_slices_one_bad(void)
{
    target t;
    void *peer = target_and_peer(&t);
    REQUIRE(peer);
    enum { N = 700, LEN = 3000 };
    REQUIRE(target_cmd(&t, 'F', 0, (uint64_t)N * LEN, 7) == 0);
    char *local = calloc(N, LEN);
    kvpi_slice s[N], *ps[N];
    for (size_t i = 0; i < N; i++) {
        s[i] = (kvpi_slice){KVP_OP_READ, local + i * LEN, t.a + i * LEN, LEN, KVP_EIO};
        ps[i] = &s[i];
    }
    s[333].remote = t.a + BIG - 10; /* crosses the end of region A */
    CHECK_OK(kvpi_transport_xfer_sync(&kvpi_transport_shm, peer, ps, N));
    for (size_t i = 0; i < N; i++)
        CHECK_ST(s[i].status, i == 333 ? KVP_ERANGE : KVP_OK);
    CHECK(kvpt_verify(local, 333 * LEN, 7) == (size_t)-1);
    for (size_t i = 0; i < LEN; i++)
        CHECK(local[333 * LEN + i] == 0); /* failed: untouched */
    char *rest = local + 334 * LEN;
    char *want = malloc((size_t)N * LEN);
    kvpt_fill(want, (size_t)N * LEN, 7);
    CHECK(memcmp(rest, want + 334 * LEN, (size_t)(N - 334) * LEN) == 0);
    kvpi_transport_shm.peer_close(peer);
    free(want);
    free(local);
    target_stop(&t);
}

/* The initiator refuses what the descriptor does not cover; the target
 * refuses what its live registry does not cover, even when the initiator's
 * view is wrong (stale or forged). */
static void test_out_of_range(void)
{
    target t;
    REQUIRE(target_start(&t) == 0);
    void *peer = NULL, *forged = NULL;
    REQUIRE_OK(open_peer(&t, t.desc, t.regions, &peer));
    char buf[8192];
    kvp_status sst;
    CHECK_OK(xfer1(peer, KVP_OP_READ, buf, t.b + SMALL, 1, &sst));
    CHECK_ST(sst, KVP_ERANGE);
    CHECK_OK(xfer1(peer, KVP_OP_WRITE, buf, t.b - 8, 16, &sst)); /* spans A and B */
    CHECK_ST(sst, KVP_ERANGE);
    CHECK_OK(xfer1(peer, KVP_OP_READ, buf, 0, 1, &sst));
    CHECK_ST(sst, KVP_ERANGE);

    kvpi_region lies[2] = {{t.a, BIG + SMALL + 8192}, {0, 0}};
    lies[1] = lies[0];
    kvpi_peer_ctx ctx = {
        .desc = t.desc, .regions = lies, .n_regions = 1, .timeout_ms = 3000, .conns = 2};
    REQUIRE_OK(kvpi_transport_shm.peer_open(&ctx, &forged));
    CHECK_OK(xfer1(forged, KVP_OP_READ, buf, t.b + SMALL, 8, &sst));
    CHECK_ST(sst, KVP_ERANGE);
    CHECK_OK(xfer1(forged, KVP_OP_WRITE, buf, t.b - 8, 16, &sst));
    CHECK_ST(sst, KVP_ERANGE);
    /* The target refuses one slice in the middle of a pipelined window; its
     * neighbours' statuses (sent back together) stay in order. */
    enum { N = 200 };
    kvpi_slice s[N], *ps[N];
    for (size_t i = 0; i < N; i++) {
        s[i] = (kvpi_slice){KVP_OP_READ, buf + (i % 64) * 64, t.a + i * 64, 64, KVP_EIO};
        ps[i] = &s[i];
    }
    s[150].remote = t.b + SMALL; /* outside, but inside the forged region */
    CHECK_OK(kvpi_transport_xfer_sync(&kvpi_transport_shm, forged, ps, N));
    for (size_t i = 0; i < N; i++)
        CHECK_ST(s[i].status, i == 150 ? KVP_ERANGE : KVP_OK);

    /* B unregistered at the target: our cached view still lists it. */
    REQUIRE(target_cmd(&t, 'U', 0, 0, 0) == KVP_OK);
    CHECK_OK(xfer1(peer, KVP_OP_WRITE, buf, t.b, 16, &sst));
    CHECK_ST(sst, KVP_ERANGE);
    /* And the connection still serves good requests. */
    REQUIRE(target_cmd(&t, 'F', 0, 4096, 5) == 0);
    CHECK_OK(xfer1(peer, KVP_OP_READ, buf, t.a, 4096, &sst));
    CHECK_OK(sst);
    CHECK(kvpt_verify(buf, 4096, 5) == (size_t)-1);
    kvpi_transport_shm.peer_close(forged);
    peer_and_target_stop(peer, &t);
}

/* A local address we do not map fails that slice only. */
static void test_bad_local_address(void)
{
    target t;
    void *peer = target_and_peer(&t);
    REQUIRE(peer);
    kvp_status sst;
    CHECK_OK(xfer1(peer, KVP_OP_READ, (void *)(uintptr_t)4096, t.a, 64, &sst));
    CHECK_ST(sst, KVP_EINVAL);
    char buf[64];
    REQUIRE(target_cmd(&t, 'F', 0, 64, 9) == 0);
    CHECK_OK(xfer1(peer, KVP_OP_READ, buf, t.a, 64, &sst));
    CHECK_OK(sst);
    CHECK(kvpt_verify(buf, 64, 9) == (size_t)-1);
    peer_and_target_stop(peer, &t);
}

static void test_peer_killed(void)
{
    target t;
    void *peer = target_and_peer(&t);
    REQUIRE(peer);
    kill(t.peer.pid, SIGKILL);
    REQUIRE(kvpt_wait_child(t.peer.pid, 5000) == 128 + SIGKILL);
    t.peer.pid = 0;
    char buf[16];
    kvp_status sst;
    kvp_status st = xfer1(peer, KVP_OP_READ, buf, t.a, sizeof buf, &sst);
    CHECK(st == KVP_ECONNRESET || st == KVP_ECONNREFUSED);
    CHECK(sst == st);
    /* Again, now that the connection is known dead: still an error, no hang. */
    st = xfer1(peer, KVP_OP_WRITE, buf, t.a, sizeof buf, &sst);
    CHECK(st == KVP_ECONNRESET || st == KVP_ECONNREFUSED);
    peer_and_target_stop(peer, &t);
}

/* Stopping the target's server while we hold connections: stop returns, and
 * our next transfer fails instead of hanging. */
static void test_server_stop_with_peer(void)
{
    target t;
    void *peer = target_and_peer(&t);
    REQUIRE(peer);
    CHECK(target_cmd(&t, 'S', 0, 0, 0) == 0);
    char buf[16];
    kvp_status sst;
    kvp_status st = xfer1(peer, KVP_OP_READ, buf, t.a, sizeof buf, &sst);
    CHECK(st == KVP_ECONNRESET || st == KVP_ECONNREFUSED);
    peer_and_target_stop(peer, &t);
}

static kvp_status open_with(const target *t, const char *key, cJSON *value)
{
    cJSON *d = cJSON_Duplicate(t->desc, 1);
    cJSON *o = cJSON_GetObjectItemCaseSensitive(d, KVPI_SHM_FIELD);
    if (value)
        cJSON_ReplaceItemInObjectCaseSensitive(o, key, value);
    else
        cJSON_DeleteItemFromObjectCaseSensitive(d, KVPI_SHM_FIELD);
    void *peer = NULL;
    kvp_status st = open_peer(t, d, t->regions, &peer);
    if (st == KVP_OK) kvpi_transport_shm.peer_close(peer);
    cJSON_Delete(d);
    return st;
}

static void test_not_same_host(void)
{
    target t;
    REQUIRE(target_start(&t) == 0);
    CHECK_ST(open_with(&t, "host_id", cJSON_CreateString("0000-other-host/pid:1/net:1")),
             KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "another host") != NULL);
    CHECK_ST(open_with(&t, NULL, NULL), KVP_ENOTSUP); /* a Mooncake peer: no field */
    CHECK_ST(open_with(&t, "socket", cJSON_CreateString("kvpipe-shm/nobody")), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "connect") != NULL);
    CHECK_ST(open_with(&t, "pid", cJSON_CreateString("12")), KVP_ENOTSUP);
    CHECK_ST(open_with(&t, "version", cJSON_CreateNumber(99)), KVP_ENOTSUP);
    /* A descriptor naming another pid for the socket: refused, not trusted. */
    CHECK_ST(open_with(&t, "pid", cJSON_CreateNumber(getpid())), KVP_ENOTSUP);
    /* The real one works. */
    CHECK_OK(open_with(&t, "version", cJSON_CreateNumber(KVPI_SHM_VERSION)));
    target_stop(&t);
}

/* Garbage on the target's socket closes that connection only. */
static void test_bad_frames(void)
{
    target t;
    REQUIRE(target_start(&t) == 0);
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(t.desc, KVPI_SHM_FIELD);
    const char *name = cJSON_GetObjectItemCaseSensitive(o, "socket")->valuestring;
    struct sockaddr_un sa;
    socklen_t len = kvpi_shm_sockaddr(name, &sa);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    REQUIRE(connect(fd, (struct sockaddr *)&sa, len) == 0);
    kvpi_socket_set_timeout(fd, 3000);
    uint8_t junk[KVPI_SHM_HELLO_LEN] = "GET / HTTP/1.0\r\n\r\n";
    uint8_t s[KVPI_SHM_STATUS_LEN];
    CHECK_OK(kvpi_send_all(fd, junk, sizeof junk));
    CHECK_OK(kvpi_recv_all(fd, s, sizeof s));
    kvp_status remote = KVP_OK;
    int err;
    CHECK_OK(kvpi_shm_get_status(s, &remote, &err));
    CHECK_ST(remote, KVP_EPROTO);
    CHECK_ST(kvpi_recv_all(fd, s, 1), KVP_ECONNRESET); /* then closed */
    close(fd);
    void *peer = NULL;
    REQUIRE_OK(open_peer(&t, t.desc, t.regions, &peer));
    char buf[32];
    kvp_status sst;
    CHECK_OK(xfer1(peer, KVP_OP_READ, buf, t.a, sizeof buf, &sst));
    CHECK_OK(sst);
    peer_and_target_stop(peer, &t);
}

typedef struct worker_arg {
    void *peer;
    const target *t;
    int id;
    int bad;
} worker_arg;

/* Each thread WRITEs its own 4 MiB then READs it back, several times. */
static void *worker(void *p)
{
    worker_arg *w = p;
    size_t n = 4 * MIB;
    char *src = malloc(n), *dst = malloc(n);
    uint64_t remote = w->t->a + (uint64_t)w->id * n;
    for (int round = 0; round < 3 && src && dst; round++) {
        kvp_status sst;
        uint64_t seed = (uint64_t)w->id * 1000 + (uint64_t)round;
        kvpt_fill(src, n, seed);
        if (xfer1(w->peer, KVP_OP_WRITE, src, remote, n, &sst) || sst) w->bad++;
        memset(dst, 0, n);
        if (xfer1(w->peer, KVP_OP_READ, dst, remote, n, &sst) || sst) w->bad++;
        if (kvpt_verify(dst, n, seed) != (size_t)-1) w->bad++;
    }
    free(src);
    free(dst);
    return NULL;
}

static void test_concurrent_xfers(void)
{
    target t;
    void *peer = target_and_peer(&t);
    REQUIRE(peer);
    enum { T = 6 }; /* more threads than connections: some wait for one */
    pthread_t th[T];
    worker_arg w[T];
    for (int i = 0; i < T; i++) {
        w[i] = (worker_arg){peer, &t, i, 0};
        REQUIRE(pthread_create(&th[i], NULL, worker, &w[i]) == 0);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        CHECK(w[i].bad == 0);
    }
    for (int i = 0; i < T; i++)
        CHECK(target_cmd(&t, 'V', (uint64_t)i * 4 * MIB, 4 * MIB, (uint64_t)i * 1000 + 2) ==
              (uint64_t)-1);
    peer_and_target_stop(peer, &t);
}

int main(void)
{
    RUN(test_read_write_every_byte);
    RUN(test_many_slices_one_bad);
    RUN(test_out_of_range);
    RUN(test_bad_local_address);
    RUN_T(test_peer_killed, 30);
    RUN_T(test_server_stop_with_peer, 30);
    RUN(test_not_same_host);
    RUN(test_bad_frames);
    RUN(test_concurrent_xfers);
    return kvpt_summary();
}
