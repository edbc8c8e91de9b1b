/* Hostile raw peers against the TCP data plane of a target engine in another
 * process: a WRITE whose body trickles in, a reader that never drains its
 * READ, garbage and oversized headers, headers that stop half-way, and
 * registered memory unmapped behind the engine's back (EFAULT). Each case
 * checks that the peer holds up no one else and that what it holds is let go
 * by the server's deadline. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "test.h"
#include "transport/tcp_wire.h"

#define SEED 0x5eed
#define MIB ((size_t)1 << 20)

static int send_header(int fd, uint8_t opcode, uint64_t addr, uint64_t size)
{
    uint8_t raw[KVPI_TCP_HDR_LEN];
    kvpi_tcp_hdr h = {size, addr, opcode, 1};
    kvpi_tcp_hdr_encode(&h, raw);
    return kvpi_send_all(fd, raw, sizeof raw) == KVP_OK ? 0 : -1;
}

/* Non-zero once the server has closed fd (end of stream or reset); reads and
 * drops whatever came before. */
static int closed_by_peer(int fd)
{
    char buf[4096];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0) return 1;
        if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
    }
}

/* A peer that sends one byte every period_ms until the server closes the
 * connection or max_ms pass; cut_ms says when the server closed it (-1:
 * never). */
typedef struct trickler {
    int fd;
    int period_ms, max_ms;
    atomic_long cut_ms;
    pthread_t thread;
} trickler;

static void *trickle_main(void *arg)
{
    trickler *t = arg;
    uint64_t t0 = kvpi_now_ms();
    while (kvpi_now_ms() - t0 < (uint64_t)t->max_ms) {
        if (closed_by_peer(t->fd) || send(t->fd, "x", 1, MSG_NOSIGNAL) != 1) {
            atomic_store(&t->cut_ms, (long)(kvpi_now_ms() - t0));
            break;
        }
        struct pollfd p = {.fd = t->fd, .events = POLLIN | POLLRDHUP};
        poll(&p, 1, t->period_ms);
    }
    return NULL;
}

static void trickle_start(trickler *t, int fd, int period_ms, int max_ms)
{
    *t = (trickler){.fd = fd, .period_ms = period_ms, .max_ms = max_ms};
    atomic_init(&t->cut_ms, -1);
    pthread_create(&t->thread, NULL, trickle_main, t);
}

static void trickle_stop(trickler *t)
{
    pthread_join(t->thread, NULL);
    close(t->fd);
}

static int read_ok(kvp_engine *e, kvp_segment_id seg, const kvpt_target *t, size_t off, size_t len)
{
    char *buf = malloc(len);
    int ok = buf &&
             kvp_engine_read(e, seg, buf, (uint64_t)(uintptr_t)t->buf + off, len) == KVP_OK &&
             kvpt_verify(buf, len, SEED + off) == (size_t)-1;
    if (!ok) fprintf(stderr, "  READ at +%zu: %s\n", off, kvp_last_error());
    free(buf);
    return ok;
}

/* Issue 11, item 1: a WRITE whose body trickles in (each byte is progress)
 * pins its region. Registering and allocating other memory, and other
 * connections' requests, go on meanwhile; the server cuts the trickler at its
 * deadline (timeout_ms + size / min_transfer_rate), which also bounds how long
 * unregistering the pinned region waits. Before, register and alloc waited
 * for the trickle to end, and the trickle was never cut. */
static void write_trickle(void)
{
    kvpt_target t;
    kvpt_target_opts o = {.len = 4 * MIB, .seed = SEED, .timeout_ms = 2000, .disable_shm = 1};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    int fd = kvpt_raw_connect(t.data_port);
    REQUIRE(fd >= 0);
    REQUIRE(send_header(fd, KVPI_TCP_OP_WRITE, (uint64_t)(uintptr_t)t.buf, 64 << 10) == 0);
    trickler tr;
    trickle_start(&tr, fd, 250, 12000);
    usleep(500000);
    int64_t reg_ms = kvpt_target_cmd(&t, KVPT_T_REGISTER, MIB, 1500);
    int64_t alloc_ms = kvpt_target_cmd(&t, KVPT_T_ALLOC, MIB, 1500);
    CHECK(reg_ms >= 0 && reg_ms < 1000);
    CHECK(alloc_ms >= 0 && alloc_ms < 1000);
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start(NULL, "tcp", 1, 2000, &e) == 0);
    kvp_segment_id seg;
    CHECK_OK(kvp_engine_open_segment(e, t.name, &seg));
    CHECK(read_ok(e, seg, &t, MIB, MIB)); /* another connection, the same region */
    /* The pinned region itself: unregistering waits for the pin, which lasts
     * no longer than the trickler's deadline (2 s + 4 ms). */
    int64_t unreg_ms = kvpt_target_cmd(&t, KVPT_T_UNREGISTER, 0, 8000);
    CHECK(unreg_ms >= 0 && unreg_ms < 5000);
    trickle_stop(&tr);
    long cut = atomic_load(&tr.cut_ms);
    CHECK(cut > 0 && cut < 6000);
    fprintf(stderr,
            "  register %lld ms, alloc %lld ms, unregister %lld ms, trickler cut at %ld ms\n",
            (long long)reg_ms, (long long)alloc_ms, (long long)unreg_ms, cut);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* A reader that drains 64 KiB every 100 ms (steady progress, 48 MiB in over
 * a minute) until told to stop. */
typedef struct slow_reader_ctl {
    int fd;
    atomic_int stop;
} slow_reader_ctl;

static void *slow_read_main(void *arg)
{
    slow_reader_ctl *r = arg;
    static char buf[65536];
    while (!atomic_load(&r->stop)) {
        ssize_t n = recv(r->fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN)) break;
        usleep(100000);
    }
    return NULL;
}

/* A READ of 48 MiB that its reader drains slowly holds the region's
 * pin for at most the request's deadline, 2 s + 48 MiB at 64 MiB/s: then
 * unregistering the region goes through, while the reader still reads.
 * Before, the pin lasted as long as the reader kept reading. */
static void slow_reader(void)
{
    kvpt_target t;
    kvpt_target_opts o = {.len = 48 * MIB,
                          .seed = SEED,
                          .timeout_ms = 2000,
                          .disable_shm = 1,
                          .min_transfer_rate = 64 * MIB};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    slow_reader_ctl r = {.fd = kvpt_raw_connect(t.data_port)};
    REQUIRE(r.fd >= 0);
    REQUIRE(send_header(r.fd, KVPI_TCP_OP_READ, (uint64_t)(uintptr_t)t.buf, 48 * MIB) == 0);
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, slow_read_main, &r) == 0);
    usleep(500000);
    int64_t unreg_ms = kvpt_target_cmd(&t, KVPT_T_UNREGISTER, 0, 9000);
    CHECK(unreg_ms >= 0 && unreg_ms < 7000);
    fprintf(stderr, "  unregister under a slow reader took %lld ms\n", (long long)unreg_ms);
    atomic_store(&r.stop, 1);
    pthread_join(th, NULL);
    close(r.fd);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* A 4 MiB target (its I/O timeout timeout_ms) and a tcp initiator (3 s)
 * with the target's segment open; 0, or -1 with the reason printed. */
static int target_and_initiator(int timeout_ms, kvpt_target *t, kvp_engine **e, kvp_segment_id *seg)
{
    kvpt_target_opts o = {.len = 4 * MIB, .seed = SEED, .timeout_ms = timeout_ms, .disable_shm = 1};
    if (kvpt_target_start(&o, t) != 0) return -1;
    if (kvpt_initiator_start(NULL, "tcp", 1, 3000, e) != 0) return -1;
    kvp_status st = kvp_engine_open_segment(*e, t->name, seg);
    if (st) fprintf(stderr, "  open %s: %s\n", t->name, kvp_last_error());
    return st ? -1 : 0;
}

/* Garbage, oversized and truncated requests close that connection only; a
 * legitimate initiator is served after each. */
static void hostile_frames(void)
{
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(target_and_initiator(1000, &t, &e, &seg) == 0);
    uint64_t base = (uint64_t)(uintptr_t)t.buf;
    struct {
        const char *what;
        uint8_t opcode;
        uint64_t addr, size;
        size_t send;         /* header bytes sent before the peer goes quiet or leaves */
        int leave;           /* close at once instead of waiting for the server */
        int64_t want_status; /* -1: no status, the server just closes */
    } cases[] = {
        {"unknown opcode", 7, base, 16, KVPI_TCP_HDR_LEN, 0, -1},
        {"READ of 2^40 bytes", KVPI_TCP_OP_READ, base, (uint64_t)1 << 40, KVPI_TCP_HDR_LEN, 0,
         KVPI_TCP_STATUS_REJECTED},
        {"READ of a wrapping range", KVPI_TCP_OP_READ, base, UINT64_MAX, KVPI_TCP_HDR_LEN, 0,
         KVPI_TCP_STATUS_REJECTED},
        {"WRITE outside", KVPI_TCP_OP_WRITE, 4096, 4096, KVPI_TCP_HDR_LEN, 0,
         KVPI_TCP_STATUS_REJECTED},
        {"half a header, then silence", KVPI_TCP_OP_READ, base, 16, 10, 0, -1},
        {"half a header, then gone", KVPI_TCP_OP_READ, base, 16, 10, 1, -1},
        {"a WRITE header, then gone", KVPI_TCP_OP_WRITE, base, MIB, KVPI_TCP_HDR_LEN, 1, -1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int fd = kvpt_raw_connect(t.data_port);
        REQUIRE(fd >= 0);
        uint8_t raw[KVPI_TCP_HDR_LEN];
        kvpi_tcp_hdr h = {cases[i].size, cases[i].addr, 0, 1};
        kvpi_tcp_hdr_encode(&h, raw);
        raw[16] = (uint8_t)(cases[i].opcode | KVPI_TCP_OP_V2);
        CHECK_OK(kvpi_send_all(fd, raw, cases[i].send));
        if (cases[i].leave) {
            close(fd);
        } else {
            /* The server answers (or not) and closes, within its 1 s deadline. */
            kvpi_socket_set_timeout(fd, 5000);
            uint8_t st[8];
            ssize_t n = recv(fd, st, sizeof st, MSG_WAITALL);
            if (cases[i].want_status >= 0) {
                CHECK(n == 8 && kvpi_tcp_status_decode(st) == cases[i].want_status);
                n = recv(fd, st, 1, 0);
            }
            if (n != 0) fprintf(stderr, "  %s: not closed (recv %zd)\n", cases[i].what, n);
            CHECK(n == 0);
            close(fd);
        }
        CHECK(read_ok(e, seg, &t, 8192, 65536));
    }
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* Issue 10, item 6: registered memory that is unmapped behind the engine's
 * back. A READ or WRITE of it gets v2 status 1 ("address rejected") from the
 * target, which the initiator reports as such, and the target serves on.
 * Before, the target dropped the connection and the initiator said only
 * "peer closed the connection". */
static void efault_reaches_peer(void)
{
    kvpt_target t;
    kvp_engine *e;
    kvp_segment_id seg;
    REQUIRE(target_and_initiator(2000, &t, &e, &seg) == 0);
    CHECK(read_ok(e, seg, &t, 0, 4096));
    REQUIRE(kvpt_target_cmd(&t, KVPT_T_UNMAP, 0, 3000) == 0);
    char *buf = malloc(MIB);
    REQUIRE(buf);
    uint64_t base = (uint64_t)(uintptr_t)t.buf;
    CHECK_ST(kvp_engine_read(e, seg, buf, base + 4096, MIB), KVP_ERANGE);
    CHECK(strstr(kvp_last_error(), "status 1") != NULL);
    CHECK(strstr(kvp_last_error(), "rejected") != NULL);
    kvpt_fill(buf, MIB, 1);
    CHECK_ST(kvp_engine_write(e, seg, buf, base, MIB), KVP_ERANGE);
    CHECK(strstr(kvp_last_error(), "status 1") != NULL);
    /* It still serves: handshakes, and requests on the data port. */
    char *reply = NULL;
    CHECK_OK(kvpi_rpc_call("127.0.0.1", t.rpc_port, KVPI_RPC_METADATA, "{}", 3000, &reply));
    free(reply);
    int fd = kvpt_raw_connect(t.data_port);
    REQUIRE(fd >= 0);
    CHECK(send_header(fd, KVPI_TCP_OP_READ, base, 0) == 0);
    uint8_t st[8];
    CHECK_OK(kvpi_recv_all(fd, st, sizeof st));
    CHECK(kvpi_tcp_status_decode(st) == KVPI_TCP_STATUS_OK);
    close(fd);
    free(buf);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* Issue 10, item 6: kvp_engine_register() refuses memory the engine could not
 * serve (an unmapped range, or one mapped without read access, as a GPU
 * device pointer's is from the CPU) and says what memory it can serve. */
static void register_refuses_unreadable(void)
{
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start(NULL, "tcp", 1, 1000, &e) == 0);
    size_t len = 4 * MIB;
    char *gone = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(gone != MAP_FAILED);
    munmap(gone, len);
    CHECK_ST(kvp_engine_register(e, gone, len), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "host (CPU) memory") != NULL);
    CHECK(strstr(kvp_last_error(), "not mapped") != NULL);
    char *none = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    REQUIRE(none != MAP_FAILED);
    CHECK_ST(kvp_engine_register(e, none, len), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "cannot be read") != NULL);
    CHECK(strstr(kvp_last_error(), "GPU") != NULL);
    /* A hole at the end of otherwise good memory. */
    char *part = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(part != MAP_FAILED);
    munmap(part + len - 4096, 4096);
    CHECK_ST(kvp_engine_register(e, part, len), KVP_EINVAL);
    CHECK_OK(kvp_engine_register(e, part, len - 4096));
    munmap(none, len);
    kvp_engine_destroy(e);
    munmap(part, len - 4096);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(write_trickle, 60);
    RUN_T(slow_reader, 60);
    RUN_T(hostile_frames, 60);
    RUN_T(efault_reaches_peer, 60);
    RUN_T(register_refuses_unreadable, 30);
    return kvpt_summary();
}
