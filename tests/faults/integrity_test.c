/* End-to-end integrity (issue 38; docs/reliability.md, "Integrity"): with
 * kvp_engine_opts.integrity on at both ends, a request that succeeds
 * delivered exactly the bytes its source held at one instant, and one whose
 * bytes were corrupted fails with KVP_ECORRUPT.
 *
 *   tcp_proxy_reads / tcp_proxy_writes: a proxy on the wire between the
 *     initiator and the target's data port (it reads Mooncake's framing)
 *     flips one payload byte of every CORRUPT_EVERY-th READ answer or WRITE
 *     body: each flipped request fails with ECORRUPT, every other one
 *     succeeds with the right bytes, and the corruption counter says as
 *     many. The initiator finds the proxy through a metadata store of its
 *     own, which holds the target's keys with the data port changed.
 *   tcp_proxy_device: the same, READs then WRITEs, with device memory (the
 *     CUDA driver's double) at both ends: the staged path, where each side
 *     digests its bounce buffers.
 *   tcp_source_rewritten_read / shm_source_rewritten_read: the target's
 *     memory is rewritten, one 8-byte generation number at a time, front to
 *     back, over and over, while READs of it run: a READ either fails with
 *     ECORRUPT or delivers a copy the memory held at one instant (its
 *     generations never rise along the buffer, and differ by at most one).
 *   tcp_source_rewritten_write: the same for the initiator's source of a
 *     WRITE, checked in the target's memory.
 *   tcp_source_rewritten_read_device / shm_source_rewritten_read_device:
 *     the READs land in device memory (the CUDA double), staged through the
 *     initiator's bounce buffers, whose digest is the one compared.
 *   pipe_corrupt_messages: a raw sender on a pipe's wire sends messages whose
 *     tags carry their digest, right or wrong, announced (READ) and inline:
 *     the receiving pipe hands out the right ones and fails the wrong ones
 *     with ECORRUPT, ACKing each, and counts them.
 *   pipe_buffer_rewritten: a sender rewrites its tensor's buffer after
 *     send_take handed it over and before the receiver READs it (the pipe
 *     sender's buffer reused too early): recv fails it with ECORRUPT.
 *   tcp_late_write / shm_late_write: a WRITE to a stopped target times out;
 *     the target resumes, and a second WRITE of other bytes to the same range
 *     succeeds; a READ much later (any late bytes of the first would have
 *     landed by then) gets the second WRITE's bytes, whole (the cancel fence,
 *     docs/reliability.md "Cancel", checked with integrity on).
 *   clean_soak_tcp / clean_soak_shm: 10^6 transfers (10^5 under the
 *     sanitizers) of mixed sizes, READ and WRITE, with integrity on: no
 *     request fails, none flagged.
 *   mooncake_wire_unchanged: with integrity on only at the initiator, the
 *     target (an engine with it off: what a Mooncake or an older kvpipe peer
 *     looks like) is sent plain requests: no digest bit, no trailer.
 *
 * Each case sets KVPIPE_INTEGRITY for both engines (the target inherits the
 * environment); with it off, the proxy cases and the rewriting cases fail
 * (undetected corruption and torn copies). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <zmq.h>
#include <fcntl.h>

#include "common/clock.h"
#include "common/net.h"
#include "common/tsan.h"
#include "common/digest.h"
#include "metadata/metadata.h"
#include "pipe/safetensors.h"
#include "peer.h"
#include "test.h"
#include "transport/tcp_wire.h"

#define MIB ((size_t)1 << 20)
#define SEED 0x1e5
#define CORRUPT_EVERY 7
#define OPS 140
#define BLOCK ((size_t)64 << 10)

static void integrity(int on)
{
    setenv("KVPIPE_INTEGRITY", on ? "1" : "0", 1);
}

/* ---------------------------------------------------------- the proxy --- */

/* Requests seen on the way to the target, for reading the answers. */
typedef struct pending {
    uint8_t opcode;
    uint64_t size;
    int digest;
} pending;

typedef struct proxy {
    int listen_fd, port, target_port;
    atomic_int stop;
    atomic_int reads_flipped, writes_flipped, reads_seen, writes_seen;
    atomic_int digest_bits; /* requests that carried the digest bit */
    pthread_t thread;
    struct leg *legs; /* the proxy thread's; proxy_stop's once it is joined */
} proxy;

typedef struct leg {
    proxy *px;
    int client, server;
    pthread_t up, down;
    struct leg *next;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    pending q[4096];
    size_t head, count;
    int done;
} leg;

static int fwd(int from, int to, size_t n, int flip_at)
{
    char buf[65536];
    size_t off = 0;
    while (off < n) {
        size_t k = n - off < sizeof buf ? n - off : sizeof buf;
        if (kvpi_recv_all_by(from, buf, k, kvpi_deadline_ns(20000)) != KVP_OK) return -1;
        if (flip_at >= 0 && (size_t)flip_at >= off && (size_t)flip_at < off + k)
            buf[(size_t)flip_at - off] ^= 0x5a;
        if (kvpi_send_all_by(to, buf, k, kvpi_deadline_ns(20000)) != KVP_OK) return -1;
        off += k;
    }
    return 0;
}

/* Forward a payload of size bytes (and its digest) counted in seen; every
 * CORRUPT_EVERY-th non-empty one with its byte size / part flipped, counted
 * in flipped. fwd's result. */
static int fwd_counted(int from, int to, uint64_t size, int digest, atomic_int *seen,
                       atomic_int *flipped, int part)
{
    int n = atomic_fetch_add(seen, 1) + 1;
    int flip = size && n % CORRUPT_EVERY == 0 ? (int)(size / (uint64_t)part) : -1;
    if (flip >= 0) atomic_fetch_add(flipped, 1);
    return fwd(from, to, size + (digest ? 8 : 0), flip);
}

/* Client to target: each header, and a WRITE's body (and digest). */
static void *upstream(void *arg)
{
    leg *l = arg;
    proxy *px = l->px;
    uint8_t raw[KVPI_TCP_HDR_LEN];
    for (;;) {
        if (kvpi_recv_all_by(l->client, raw, sizeof raw, kvpi_deadline_ns(60000)) != KVP_OK) break;
        kvpi_tcp_hdr h;
        if (kvpi_tcp_hdr_decode(raw, &h) != 0) break;
        if (h.digest) atomic_fetch_add(&px->digest_bits, 1);
        pthread_mutex_lock(&l->lock);
        l->q[(l->head + l->count++) % 4096] = (pending){h.opcode, h.size, h.digest};
        pthread_cond_signal(&l->cond);
        pthread_mutex_unlock(&l->lock);
        if (kvpi_send_all_by(l->server, raw, sizeof raw, kvpi_deadline_ns(20000)) != KVP_OK) break;
        if (h.opcode != KVPI_TCP_OP_WRITE) continue;
        if (fwd_counted(l->client, l->server, h.size, h.digest, &px->writes_seen,
                        &px->writes_flipped, 2) != 0)
            break;
    }
    shutdown(l->server, SHUT_WR);
    return NULL;
}

/* Target to client: each answer in order: a status frame, and a READ's
 * payload (and digest). */
static void *downstream(void *arg)
{
    leg *l = arg;
    proxy *px = l->px;
    for (;;) {
        pthread_mutex_lock(&l->lock);
        while (!l->count && !l->done) {
            struct timespec at = kvpi_deadline_after_ms(100);
            pthread_cond_timedwait(&l->cond, &l->lock, &at);
            if (atomic_load(&px->stop)) l->done = 1;
        }
        if (!l->count) {
            pthread_mutex_unlock(&l->lock);
            break;
        }
        pending p = l->q[l->head];
        l->head = (l->head + 1) % 4096;
        l->count--;
        pthread_mutex_unlock(&l->lock);
        uint8_t frame[8];
        if (kvpi_recv_all_by(l->server, frame, 8, kvpi_deadline_ns(60000)) != KVP_OK) break;
        if (kvpi_send_all_by(l->client, frame, 8, kvpi_deadline_ns(20000)) != KVP_OK) break;
        if (p.opcode != KVPI_TCP_OP_READ || kvpi_tcp_status_decode(frame) != KVPI_TCP_STATUS_OK)
            continue;
        if (fwd_counted(l->server, l->client, p.size, p.digest, &px->reads_seen, &px->reads_flipped,
                        3) != 0)
            break;
    }
    shutdown(l->client, SHUT_WR);
    return NULL;
}

static void *proxy_main(void *arg)
{
    proxy *px = arg;
    while (!atomic_load(&px->stop)) {
        struct pollfd pf = {.fd = px->listen_fd, .events = POLLIN};
        if (poll(&pf, 1, 100) <= 0) continue;
        int c = accept(px->listen_fd, NULL, NULL);
        if (c < 0) continue;
        int s = -1;
        if (kvpi_tcp_connect("127.0.0.1", px->target_port, 5000, &s) != KVP_OK) {
            close(c);
            continue;
        }
        leg *l = calloc(1, sizeof *l);
        if (!l) abort();
        *l = (leg){.px = px, .client = c, .server = s, .next = px->legs};
        pthread_mutex_init(&l->lock, NULL);
        pthread_cond_init(&l->cond, NULL);
        pthread_create(&l->up, NULL, upstream, l);
        pthread_create(&l->down, NULL, downstream, l);
        px->legs = l;
    }
    return NULL;
}

/* After the engine and the target are gone (their sockets closed, so each
 * leg's reads end): join and free every leg. */
static void proxy_stop(proxy *px)
{
    while (px->legs) {
        leg *l = px->legs;
        px->legs = l->next;
        pthread_join(l->up, NULL);
        pthread_join(l->down, NULL);
        close(l->client);
        close(l->server);
        pthread_mutex_destroy(&l->lock);
        pthread_cond_destroy(&l->cond);
        free(l);
    }
    close(px->listen_fd);
}

static int proxy_start(proxy *px, int target_port)
{
    memset(px, 0, sizeof *px);
    px->target_port = target_port;
    if (kvpi_tcp_listen("127.0.0.1", 0, &px->listen_fd, &px->port) != KVP_OK) return -1;
    return pthread_create(&px->thread, NULL, proxy_main, px);
}

/* ------------------------------------------- the target behind a proxy --- */

/* Copy the target's two keys from its store to ours (again, once its
 * descriptor changed), the data port replaced by the proxy's, and point the
 * initiator at ours. */
static int divert(const char *their_store, const char *our_store, const char *name, int port)
{
    void *a = NULL, *b = NULL;
    char key_ram[160], key_rpc[160], *ram = NULL, *rpc = NULL;
    snprintf(key_ram, sizeof key_ram, "mooncake/ram/%s", name);
    snprintf(key_rpc, sizeof key_rpc, "mooncake/rpc_meta/%s", name);
    int rc = -1;
    if (kvpi_store_http.open(their_store, 3000, &a) || kvpi_store_http.open(our_store, 3000, &b) ||
        kvpi_store_http.get(a, key_ram, &ram) || kvpi_store_http.get(a, key_rpc, &rpc))
        goto out;
    cJSON *doc = cJSON_Parse(ram);
    cJSON_ReplaceItemInObjectCaseSensitive(doc, "tcp_data_port", cJSON_CreateNumber(port));
    char *text = cJSON_PrintUnformatted(doc);
    cJSON_Delete(doc);
    kvpi_store_http.del(b, key_rpc); /* absent unless diverted before */
    if (text && !kvpi_store_http.put(b, key_rpc, rpc) && !kvpi_store_http.put(b, key_ram, text))
        rc = 0;
    free(text);
out:
    free(ram);
    free(rpc);
    if (a) kvpi_store_http.close(a);
    if (b) kvpi_store_http.close(b);
    return rc;
}

typedef struct rig {
    kvpt_target t;
    proxy px;
    kvp_engine *e;
    kvp_segment_id seg;
    char their[128], ours[128];
} rig;

static int rig_start(rig *r)
{
    if (kvpt_http_store_start(r->their, sizeof r->their) < 0 ||
        kvpt_http_store_start(r->ours, sizeof r->ours) < 0)
        return -1;
    kvpt_target_opts o = {.metadata = r->their, .len = 4 * MIB, .seed = SEED, .disable_shm = 1};
    if (kvpt_target_start(&o, &r->t) != 0 || proxy_start(&r->px, r->t.data_port) != 0 ||
        divert(r->their, r->ours, r->t.name, r->px.port) != 0)
        return -1;
    if (kvpt_initiator_start(r->ours, "tcp", 1, 0, &r->e) != 0) return -1;
    return kvp_engine_open_segment(r->e, r->t.name, &r->seg) == KVP_OK ? 0 : -1;
}

static void rig_stop(rig *r)
{
    atomic_store(&r->px.stop, 1);
    pthread_join(r->px.thread, NULL);
    kvp_engine_destroy(r->e);
    kvpt_target_stop(&r->t, 0);
    proxy_stop(&r->px);
}

static double corrupt_count(kvp_engine *e)
{
    kvp_metrics *m = NULL;
    double v = 0;
    if (kvp_engine_metrics(e, &m) == KVP_OK) {
        const kvp_metric *x = kvp_metrics_find(m, "kvpipe_engine_corrupt_total", "transport=tcp");
        if (x) v = x->value;
        kvp_metrics_free(m);
    }
    return v;
}

/* -------------------------------------------------- the proxy's cases --- */

/* Every flipped transfer (about one in CORRUPT_EVERY) failed with
 * ECORRUPT and was counted so; none came through wrong or failed otherwise. */
static void proxy_verdict(rig *r, int flipped, int corrupt, int wrong, int other)
{
    CHECK(flipped >= OPS / CORRUPT_EVERY - 1);
    CHECK(corrupt == flipped);
    CHECK(wrong == 0);
    CHECK(other == 0);
    CHECK(corrupt_count(r->e) == flipped);
}

static void tcp_proxy_reads(void)
{
    integrity(1);
    rig r;
    REQUIRE(rig_start(&r) == 0);
    static uint8_t buf[BLOCK];
    int corrupt = 0, wrong = 0, other = 0;
    for (int i = 0; i < OPS; i++) {
        size_t off = (size_t)(i % 60) * BLOCK;
        kvp_status st = kvp_engine_read(r.e, r.seg, buf, (uint64_t)(uintptr_t)r.t.buf + off, BLOCK);
        if (st == KVP_ECORRUPT) {
            if (!corrupt++) fprintf(stderr, "  the first: %s\n", kvp_last_error());
            CHECK(strstr(kvp_last_error(), "arrived corrupted") != NULL);
        } else if (st) {
            other++;
            fprintf(stderr, "  READ %d: %s\n", i, kvp_last_error());
        } else if (kvpt_verify(buf, BLOCK, SEED + off) != (size_t)-1) {
            wrong++;
        }
    }
    int flipped = atomic_load(&r.px.reads_flipped);
    fprintf(stderr,
            "  %d READs through the proxy: %d flipped, %d failed with ECORRUPT, %d succeeded "
            "with wrong bytes, %d failed otherwise; corrupt_total %.0f\n",
            OPS, flipped, corrupt, wrong, other, corrupt_count(r.e));
    proxy_verdict(&r, flipped, corrupt, wrong, other);
    CHECK(atomic_load(&r.px.digest_bits) >= OPS);
    rig_stop(&r);
}

static void tcp_proxy_writes(void)
{
    integrity(1);
    rig r;
    REQUIRE(rig_start(&r) == 0);
    static uint8_t buf[BLOCK];
    int corrupt = 0, other = 0, wrong = 0;
    for (int i = 0; i < OPS; i++) {
        size_t off = (size_t)(i % 60) * BLOCK;
        kvpt_fill(buf, BLOCK, 77 + (uint64_t)i);
        kvp_status st =
            kvp_engine_write(r.e, r.seg, buf, (uint64_t)(uintptr_t)r.t.buf + off, BLOCK);
        if (st == KVP_ECORRUPT)
            corrupt++;
        else if (st)
            other++, fprintf(stderr, "  WRITE %d: %s\n", i, kvp_last_error());
        else if (memcmp((uint8_t *)r.t.buf + off, buf, BLOCK) != 0)
            wrong++; /* the target's memory is shared with this process */
    }
    int flipped = atomic_load(&r.px.writes_flipped);
    fprintf(stderr,
            "  %d WRITEs through the proxy: %d flipped, %d failed with ECORRUPT, %d succeeded "
            "but landed wrong, %d failed otherwise\n",
            OPS, flipped, corrupt, wrong, other);
    proxy_verdict(&r, flipped, corrupt, wrong, other);
    rig_stop(&r);
}

/* Device memory at both ends (the CUDA double), so each side stages its
 * bytes through bounce buffers and digests those: READs of the target's
 * device memory into ours, then WRITEs of ours into its, through the proxy. */
static void tcp_proxy_device(void)
{
    integrity(1);
    setenv("KVPIPE_LIBCUDA", KVPT_FAKECUDA_PATH, 1); /* here and in the target */
    kvpt_fakecuda fc;
    kvpt_fakecuda_load(&fc, KVPT_FAKECUDA_PATH);
    rig r;
    REQUIRE(rig_start(&r) == 0);
    const size_t len = 60 * BLOCK;
    int64_t there = kvpt_peer_call(&r.t.peer, KVPT_T_DEVICE, len, SEED, 0, 20000);
    REQUIRE(there > 0);
    /* the target's descriptor now lists the device region: ours again */
    REQUIRE(divert(r.their, r.ours, r.t.name, r.px.port) == 0);
    REQUIRE_OK(kvp_engine_probe(r.e, r.t.name));
    void *here = fc.alloc(1, BLOCK);
    REQUIRE(here != NULL);
    REQUIRE_OK(kvp_engine_register(r.e, here, BLOCK));
    static uint8_t host[BLOCK];
    int corrupt = 0, wrong = 0, other = 0;
    for (int i = 0; i < 2 * OPS; i++) {
        int write = i >= OPS;
        size_t off = (size_t)(i % 60) * BLOCK;
        uint64_t seed = write ? 77 + (uint64_t)i : SEED + off;
        if (write) {
            kvpt_fill(host, BLOCK, seed);
            REQUIRE(fc.poke(here, host, BLOCK) == 0);
        }
        kvp_status st = write ? kvp_engine_write(r.e, r.seg, here, (uint64_t)there + off, BLOCK)
                              : kvp_engine_read(r.e, r.seg, here, (uint64_t)there + off, BLOCK);
        if (st == KVP_ECORRUPT) {
            corrupt++;
        } else if (st) {
            other++;
            fprintf(stderr, "  %s %d: %s\n", write ? "WRITE" : "READ", i, kvp_last_error());
        } else if (write) {
            wrong += kvpt_peer_call(&r.t.peer, KVPT_T_CHECK, (uint64_t)there + off, BLOCK, seed,
                                    20000) != -2;
        } else {
            REQUIRE(fc.peek(host, here, BLOCK) == 0);
            wrong += kvpt_verify(host, BLOCK, seed) != (size_t)-1;
        }
    }
    int flipped = atomic_load(&r.px.reads_flipped) + atomic_load(&r.px.writes_flipped);
    fprintf(stderr,
            "  %d READs and %d WRITEs of device memory through the proxy: %d flipped, %d failed "
            "with ECORRUPT, %d succeeded with wrong bytes, %d failed otherwise\n",
            OPS, OPS, flipped, corrupt, wrong, other);
    CHECK(flipped >= 2 * (OPS / CORRUPT_EVERY - 1));
    CHECK(corrupt == flipped);
    CHECK(wrong == 0);
    CHECK(other == 0);
    CHECK(corrupt_count(r.e) == flipped);
    CHECK_OK(kvp_engine_unregister(r.e, here));
    rig_stop(&r);
    unsetenv("KVPIPE_LIBCUDA");
}

/* ----------------------------------------- sources rewritten meanwhile --- */

/* Generation g in every 8-byte word of [p, +len), front to back: at every
 * instant the memory holds a prefix of generation g and the rest of g - 1. */
typedef struct rewriter {
    uint64_t *words;
    size_t n;
    atomic_int stop;
    pthread_t thread;
} rewriter;

/* Another actor's writes, racing the engine's copies on purpose: hidden
 * from ThreadSanitizer as a peer's are (common/tsan.h). */
static void *rewrite_main(void *arg)
{
    rewriter *w = arg;
    KVPI_PEER_COPY_BEGIN();
    for (uint64_t g = 1; !atomic_load(&w->stop); g++)
        for (size_t i = 0; i < w->n; i++)
            __atomic_store_n(&w->words[i], g, __ATOMIC_RELAXED);
    KVPI_PEER_COPY_END();
    return NULL;
}

/* Generation 0 first, so that a copy taken while generation 1 is written is
 * one instant too (a target's buffer starts with kvpt_fill's pattern, whose
 * words are no generation: a READ racing the first pass looked torn). */
static void rewriter_start(rewriter *w, void *p, size_t len)
{
    memset(p, 0, len);
    *w = (rewriter){.words = p, .n = len / 8};
    pthread_create(&w->thread, NULL, rewrite_main, w);
}

static void rewriter_stop(rewriter *w)
{
    atomic_store(&w->stop, 1);
    pthread_join(w->thread, NULL);
}

/* Whether a copy is one the memory held at one instant: generations never
 * rise along it and differ by at most one. */
static int one_instant(const uint64_t *w, size_t n)
{
    for (size_t i = 1; i < n; i++)
        if (w[i] > w[i - 1] || w[0] - w[i] > 1) return 0;
    return 1;
}

typedef struct tally {
    int ok, corrupt, torn, other;
} tally;

/* The tally printed; none torn, none failed otherwise, and more than 10
 * that came through (consistent or flagged). */
static void tally_check(const char *what, const tally *t)
{
    fprintf(stderr,
            "  %s: %d consistent, %d failed with ECORRUPT, %d succeeded torn (no instant "
            "held them), %d failed otherwise\n",
            what, t->ok, t->corrupt, t->torn, t->other);
    CHECK(t->torn == 0);
    CHECK(t->other == 0);
    CHECK(t->ok + t->corrupt > 10);
}

/* A target of len bytes and an initiator, both on protocol (tcp: shm off)
 * with I/O timeout timeout_ms (0: the default), the target's segment open;
 * 0, or -1 with the reason printed. */
static int open_pair(const char *protocol, size_t len, int timeout_ms, kvpt_target *t,
                     kvp_engine **e, kvp_segment_id *seg)
{
    int tcp = strcmp(protocol, "shm") != 0;
    kvpt_target_opts o = {.len = len, .seed = SEED, .disable_shm = tcp, .timeout_ms = timeout_ms};
    if (kvpt_target_start(&o, t) != 0) return -1;
    if (kvpt_initiator_start(NULL, protocol, tcp, timeout_ms, e) != 0) return -1;
    kvp_status st = kvp_engine_open_segment(*e, t->name, seg);
    if (st) fprintf(stderr, "  open %s: %s\n", t->name, kvp_last_error());
    return st ? -1 : 0;
}

/* READs of the target's first MiB while it is rewritten; over protocol,
 * into host memory or (device) device memory of the CUDA double, which the
 * initiator stages through its bounce buffers. */
static void rewritten_read(const char *protocol, int device)
{
    integrity(1);
    kvpt_fakecuda fc;
    void *dev = NULL;
    if (device) {
        setenv("KVPIPE_LIBCUDA", KVPT_FAKECUDA_PATH, 1);
        kvpt_fakecuda_load(&fc, KVPT_FAKECUDA_PATH);
        REQUIRE((dev = fc.alloc(1, MIB)) != NULL);
    }
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(open_pair(protocol, 4 * MIB, 0, &t, &e, &seg) == 0);
    if (dev) REQUIRE_OK(kvp_engine_register(e, dev, MIB));
    rewriter w;
    rewriter_start(&w, t.buf, MIB); /* the target's memory, shared with this process */
    static uint64_t copy[MIB / 8];
    tally n = {0};
    uint64_t until = kvpi_now_ms() + (KVPT_SANITIZED ? 8000 : 4000);
    while (kvpi_now_ms() < until) {
        kvp_status st = kvp_engine_read(e, seg, dev ? dev : copy, (uint64_t)(uintptr_t)t.buf, MIB);
        if (!st && dev) REQUIRE(fc.peek(copy, dev, MIB) == 0);
        if (st == KVP_ECORRUPT)
            n.corrupt++;
        else if (st)
            n.other++, fprintf(stderr, "  READ: %s\n", kvp_last_error());
        else if (one_instant(copy, MIB / 8))
            n.ok++;
        else
            n.torn++;
    }
    rewriter_stop(&w);
    const char *moved = kvp_engine_segment_transport(e, seg);
    CHECK(moved && strcmp(moved, protocol) == 0);
    tally_check(dev ? "into device memory" : protocol, &n);
    kvp_engine_destroy(e);
    kvpt_target_stop(&t, 0);
    unsetenv("KVPIPE_LIBCUDA");
}

static void source_rewritten_read(const char *protocol)
{
    rewritten_read(protocol, 0);
}

static void source_rewritten_read_device(const char *protocol)
{
    rewritten_read(protocol, 1);
}

/* WRITEs of a local MiB rewritten meanwhile; each one that succeeds must
 * have landed as a copy of one instant. */
static void source_rewritten_write(const char *protocol)
{
    integrity(1);
    int shm = strcmp(protocol, "shm") == 0;
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(open_pair(protocol, 4 * MIB, 0, &t, &e, &seg) == 0);
    static uint64_t src[MIB / 8];
    rewriter w;
    rewriter_start(&w, src, MIB);
    tally n = {0};
    uint64_t until = kvpi_now_ms() + (KVPT_SANITIZED ? 8000 : 4000);
    while (kvpi_now_ms() < until) {
        kvp_status st = kvp_engine_write(e, seg, src, (uint64_t)(uintptr_t)t.buf, MIB);
        if (st == KVP_ECORRUPT)
            n.corrupt++;
        else if (st)
            n.other++, fprintf(stderr, "  WRITE: %s\n", kvp_last_error());
        else if (one_instant(t.buf, MIB / 8))
            n.ok++;
        else
            n.torn++;
    }
    rewriter_stop(&w);
    tally_check(shm ? "shm WRITE" : "tcp WRITE", &n);
    kvp_engine_destroy(e);
    kvpt_target_stop(&t, 0);
}

/* ------------------------------------------------------- late writes --- */

#define LATE_LEN (4 * MIB)

static void late_write(const char *protocol)
{
    integrity(1);
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(open_pair(protocol, 16 * MIB, 1000, &t, &e, &seg) == 0);
    uint8_t *a = malloc(LATE_LEN), *b = malloc(LATE_LEN), *got = malloc(LATE_LEN);
    REQUIRE(a && b && got);
    kvpt_fill(a, LATE_LEN, 0xa);
    kvpt_fill(b, LATE_LEN, 0xb);
    uint64_t at = (uint64_t)(uintptr_t)t.buf + MIB;
    CHECK_OK(kvp_engine_read(e, seg, got, at, LATE_LEN)); /* links open */
    REQUIRE(kvpt_stop(t.pid, 5000) == 0);
    kvp_status st = kvp_engine_write(e, seg, a, at, LATE_LEN), first = st;
    CHECK(st == KVP_ETIMEDOUT || st == KVP_ECONNRESET);
    kill(t.pid, SIGCONT);
    int tries = 0;
    while ((st = kvp_engine_write(e, seg, b, at, LATE_LEN)) != KVP_OK && ++tries < 3) {
    }
    CHECK_OK(st);
    usleep(800000); /* a late write of the first would have landed */
    CHECK_OK(kvp_engine_read(e, seg, got, at, LATE_LEN));
    int whole = memcmp(got, b, LATE_LEN) == 0 && memcmp((uint8_t *)t.buf + MIB, b, LATE_LEN) == 0;
    fprintf(stderr, "  %s: the first WRITE failed (%s); the range holds the second's bytes: %s\n",
            protocol, kvp_strerror(first), whole ? "yes" : "NO");
    CHECK(whole);
    free(a);
    free(b);
    free(got);
    kvp_engine_destroy(e);
    kvpt_target_stop(&t, 0);
}

/* ------------------------------------------------------ a clean soak --- */

/* A size for request i: mostly small, log-uniform up to 64 KiB, one in 64 of
 * 256 KiB to 1 MiB. */
static size_t soak_size(uint64_t *x)
{
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t r = *x >> 33;
    if (r % 64 == 0) return (size_t)(256 << 10) << (r / 64 % 3);
    return (size_t)1 << (r % 17) | (size_t)(r >> 20) % ((size_t)1 << (r % 17));
}

static void clean_soak(const char *protocol)
{
    integrity(1);
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(open_pair(protocol, 64 * MIB, 0, &t, &e, &seg) == 0);
    enum { BATCH = 128 };
    const size_t total = KVPT_SANITIZED ? 100000 : 1000000;
    uint8_t *local = malloc(64 * MIB);
    REQUIRE(local);
    memset(local, 0x77, 64 * MIB);
    static kvp_request reqs[BATCH];
    uint64_t x = 42, bytes = 0;
    size_t failed = 0, corrupt = 0;
    uint64_t t0 = kvpi_now_ms();
    for (size_t done = 0; done < total; done += BATCH) {
        size_t off = 0;
        for (int i = 0; i < BATCH; i++) {
            size_t n = soak_size(&x);
            if (off + n > 64 * MIB) off = 0;
            kvp_opcode op = (x >> 40) & 1 ? KVP_OP_WRITE : KVP_OP_READ;
            reqs[i] = (kvp_request){op, local + off, (uint64_t)(uintptr_t)t.buf + off, n};
            off += n;
            bytes += n;
        }
        kvp_batch *b;
        REQUIRE_OK(kvp_batch_submit(e, seg, reqs, BATCH, &b));
        kvp_batch_wait(b, -1);
        for (int i = 0; i < BATCH; i++) {
            kvp_status st = kvp_batch_request_status(b, (size_t)i);
            failed += st != KVP_OK;
            corrupt += st == KVP_ECORRUPT;
        }
        kvp_batch_free(b);
    }
    fprintf(stderr, "  %s: %zu transfers, %.2f GB, in %.1f s: %zu failed, %zu flagged corrupt\n",
            protocol, total, (double)bytes / 1e9, (double)(kvpi_now_ms() - t0) / 1000, failed,
            corrupt);
    CHECK(failed == 0);
    CHECK(corrupt == 0);
    free(local);
    kvp_engine_destroy(e);
    kvpt_target_stop(&t, 0);
}

/* ------------------------------------------------------------ the pipe --- */

#define PIPE_MSGS 8

static void corrupt_receiver(kvp_pipe *pipe, void *arg)
{
    (void)arg;
    for (int i = 0; i < PIPE_MSGS; i++) {
        kvp_tensor *t = NULL;
        kvp_status st = kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t);
        int bad = i & 1; /* odd ones carry a wrong digest */
        if (bad) {
            if (st != KVP_ECORRUPT)
                fprintf(stderr, "  message %d: %s, want ECORRUPT\n", i,
                        st ? kvp_last_error() : "handed out");
            CHECK(st == KVP_ECORRUPT);
            CHECK(st != KVP_ECORRUPT || strstr(kvp_last_error(), "arrived corrupted"));
        } else {
            CHECK_OK(st);
            CHECK(kvpt_raw_tensor_check(t, i));
        }
        kvp_tensor_free(t);
    }
    kvp_metrics *m = NULL;
    REQUIRE_OK(kvp_pipe_metrics(pipe, &m));
    const kvp_metric *x = kvp_metrics_find(m, "kvpipe_pipe_corrupt_total", NULL);
    CHECK(x && x->value == PIPE_MSGS / 2);
    kvp_metrics_free(m);
}

/* Messages from a raw sender: even ones with their digest, odd ones with it
 * off by one; the first half announced, the rest inline. */
static void pipe_corrupt_messages(void)
{
    setenv("KVPIPE_INTEGRITY", "1", 1); /* the pipe's default: off */
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    char err[128];
    kvpt_err_path(err, sizeof err, "integrity_decode");
    pid_t decode = kvpt_raw_spawn_side(&s, 1, corrupt_receiver, NULL, err);
    kvp_engine *e;
    REQUIRE_OK(kvpt_raw_engine(&s, 0, &e));
    kvpt_raw_peer r;
    REQUIRE(kvpt_raw_peer_start(&r, &s, 0, KVPT_RAW_WATCH_NONE) == 0);
    r.e = e;
    void *push = r.push;
    for (int i = 0; i < PIPE_MSGS; i++) {
        void *buf;
        size_t len;
        REQUIRE_OK(kvpt_raw_message(e, i, &buf, &len));
        kvpi_msg_tag t = {.seq = (uint64_t)i + 1, .has_digest = 1};
        t.digest = kvpi_digest(buf, len) + (uint64_t)(i & 1);
        memcpy(t.instance, kvp_engine_instance(e), KVPI_TAG_INSTANCE_LEN);
        uint8_t tag[KVPI_TAG_DIGEST_LEN], a[8], l[8];
        size_t tag_len = kvpi_tag_encode(&t, tag);
        if (i < PIPE_MSGS / 2) {
            kvpi_put_be64(a, (uint64_t)(uintptr_t)buf);
            kvpi_put_be64(l, len);
            const void *f[3] = {a, l, tag};
            size_t sz[3] = {8, 8, tag_len};
            CHECK(kvpt_zmq_send_frames(push, f, sz, 3) == 0);
        } else {
            static uint8_t frame[KVPI_INLINE_TAG_LEN + 8192];
            memcpy(kvpi_inline_put_tag(frame), buf, len);
            const void *f[2] = {frame, tag};
            size_t sz[2] = {KVPI_INLINE_TAG_LEN + len, tag_len};
            CHECK(kvpt_zmq_send_frames(push, f, sz, 2) == 0);
        }
    }
    int rc = kvpt_wait_child(decode, KVPT_RAW_SIDE_MS);
    if (rc != 0) kvpt_file_show(err, "decode");
    CHECK(rc == 0);
    unlink(err);
    kvpt_raw_peer_stop(&r);
}

/* The receiver READs only once the sender says its buffer was rewritten. */
static kvpt_chan rewritten;

static void late_receiver(kvp_pipe *pipe, void *arg)
{
    (void)arg;
    kvp_tensor *t = NULL;
    CHECK_OK(kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t));
    CHECK(kvpt_raw_tensor_check(t, 0));
    kvp_tensor_free(t);
    t = NULL;
    CHECK(kvpt_wait_step(&rewritten, KVPT_RAW_WAIT_MS) == 'w');
    kvp_status st = kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t);
    if (st != KVP_ECORRUPT)
        fprintf(stderr, "  the rewritten message: %s, want ECORRUPT\n",
                st ? kvp_last_error() : "handed out");
    CHECK(st == KVP_ECORRUPT);
    kvp_tensor_free(t);
    /* The next one, left alone, arrives whole. */
    CHECK_OK(kvp_pipe_recv(pipe, KVPT_RAW_WAIT_MS, &t));
    CHECK(kvpt_raw_tensor_check(t, 1));
    kvp_tensor_free(t);
}

static void pipe_buffer_rewritten(void)
{
    setenv("KVPIPE_INTEGRITY", "1", 1);
    kvpt_raw_setup s;
    REQUIRE(kvpt_raw_setup_init(&s) == 0);
    REQUIRE(kvpt_chan_init(&rewritten) == 0);
    char err[128];
    kvpt_err_path(err, sizeof err, "rewritten_decode");
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.inline_max_bytes = 0; /* announced, so that it is READ later */
    pid_t decode = kvpt_raw_spawn_side_with(&s, 1, &o, late_receiver, NULL, err);
    kvp_pipe *pipe;
    REQUIRE_OK(kvpt_pipe_open(s.json, 0, &o, &pipe));
    /* Digests go in tags, once the sender has read the peer's descriptor. */
    kvpt_raw_send_good(pipe, 0);
    kvp_pipe_stats st;
    uint64_t until = kvpi_now_ms() + KVPT_RAW_WAIT_MS;
    do
        kvp_pipe_get_stats(pipe, &st);
    while (!st.peer_lookups && kvpi_now_ms() < until && !usleep(1000));
    CHECK(st.peer_lookups > 0);
    int64_t n = 1 << 20;
    kvp_tensor *t;
    REQUIRE_OK(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_U8, 1, &n, &t));
    uint8_t *data = t->data;
    kvpt_fill(data, (size_t)n, 5);
    REQUIRE_OK(kvp_pipe_send_take(pipe, t));
    data[n / 2] ^= 1; /* the buffer is the pipe's now: a bug, as users make it */
    kvpt_step(&rewritten, 'w');
    kvpt_raw_send_good(pipe, 1);
    CHECK_OK(kvp_pipe_flush(pipe, KVPT_RAW_WAIT_MS));
    kvp_pipe_close(pipe);
    int rc = kvpt_wait_child(decode, KVPT_RAW_SIDE_MS);
    if (rc != 0) kvpt_file_show(err, "decode");
    CHECK(rc == 0);
    unlink(err);
}

/* ------------------------------------------------- a peer without it --- */

/* Integrity on here, off at the target: the requests go as before (no
 * digest bit), and succeed. */
static void mooncake_wire_unchanged(void)
{
    integrity(0);
    rig r;
    REQUIRE(rig_start(&r) == 0);
    kvp_engine_destroy(r.e);
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    o.local_server_name = name;
    o.metadata = r.ours;
    o.disable_shm = 1;
    o.integrity = 1;
    REQUIRE_OK(kvp_engine_create(&o, &r.e));
    REQUIRE_OK(kvp_engine_open_segment(r.e, r.t.name, &r.seg));
    static uint8_t buf[BLOCK];
    int bad = 0;
    for (int i = 0; i < 20; i++)
        bad += kvp_engine_read(r.e, r.seg, buf, (uint64_t)(uintptr_t)r.t.buf, BLOCK) != KVP_OK;
    fprintf(stderr,
            "  %d READs of a peer without integrity: %d failed, %d carried the digest bit\n", 20,
            bad, atomic_load(&r.px.digest_bits));
    CHECK(bad == 0); /* the proxy's two flips go unchecked: the peer does not digest */
    CHECK(atomic_load(&r.px.digest_bits) == 0);
    rig_stop(&r);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(tcp_proxy_reads, 180);
    RUN_T(tcp_proxy_writes, 180);
    RUN_T(tcp_proxy_device, 180);
    kvpt_run_with("tcp_source_rewritten_read", source_rewritten_read, "tcp", 120);
    kvpt_run_with("shm_source_rewritten_read", source_rewritten_read, "shm", 120);
    kvpt_run_with("tcp_source_rewritten_read_device", source_rewritten_read_device, "tcp", 120);
    kvpt_run_with("shm_source_rewritten_read_device", source_rewritten_read_device, "shm", 120);
    kvpt_run_with("tcp_source_rewritten_write", source_rewritten_write, "tcp", 120);
    kvpt_run_with("shm_source_rewritten_write", source_rewritten_write, "shm", 120);
    kvpt_run_with("tcp_late_write", late_write, "tcp", 120);
    kvpt_run_with("shm_late_write", late_write, "shm", 120);
    kvpt_run_with("clean_soak_tcp", clean_soak, "tcp", 600);
    kvpt_run_with("clean_soak_shm", clean_soak, "shm", 600);
    RUN_T(pipe_corrupt_messages, 120);
    RUN_T(pipe_buffer_rewritten, 120);
    RUN_T(mooncake_wire_unchanged, 120);
    return kvpt_summary();
}
