/* The data-plane client against a target that stalls (issue 11, item 4): a
 * hand-written target in a child process answers handshakes with a
 * descriptor of its own and serves READs and WRITEs badly on purpose. The
 * initiator must fail each request within its deadline (timeout_ms + bytes /
 * min_transfer_rate, here 3 s + 1 MiB at 16 MiB/s), whatever pace the target
 * keeps: before, partial data restarted the timeout, a timed-out reused
 * connection was retried with a fresh one, and a trickle held the initiator
 * for as long as it lasted. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "test.h"
#include "transport/tcp_wire.h"

#define MIB ((size_t)1 << 20)
#define TIMEOUT_MS 3000

enum stall {
    STALL_PARTIAL, /* the status and half the data, then silence */
    STALL_TRICKLE, /* the status, then a byte every 200 ms */
    STALL_SILENT,  /* nothing at all after the header */
};

typedef struct fake {
    enum stall mode;
    int served; /* requests answered in full before stalling */
    char desc[512];
} fake;

static fake F;
static char *region; /* what the fake serves: its "registered" memory */

static char *fake_desc(void *ctx)
{
    (void)ctx;
    return strdup(F.desc);
}

static void stall(int fd, const kvpi_tcp_hdr *h)
{
    uint8_t st[8];
    kvpi_tcp_status_encode(KVPI_TCP_STATUS_OK, st);
    if (F.mode == STALL_SILENT) {
        sleep(120);
        return;
    }
    if (h->opcode == KVPI_TCP_OP_WRITE) {
        /* Take part of the payload, then stop reading. */
        char *sink = malloc(h->size);
        if (sink) recv(fd, sink, h->size / 2, MSG_WAITALL);
        free(sink);
        sleep(120);
        return;
    }
    kvpi_send_all(fd, st, sizeof st);
    if (F.mode == STALL_PARTIAL) {
        kvpi_send_all(fd, region, h->size / 2);
        sleep(120);
        return;
    }
    for (uint64_t i = 0; i < h->size && send(fd, region + i, 1, MSG_NOSIGNAL) == 1; i++)
        usleep(200000);
}

static void *fake_conn(void *arg)
{
    int fd = (int)(intptr_t)arg;
    uint8_t raw[KVPI_TCP_HDR_LEN], st[8];
    kvpi_tcp_hdr h;
    while (kvpi_recv_all(fd, raw, sizeof raw) == KVP_OK && kvpi_tcp_hdr_decode(raw, &h) == 0) {
        if (__atomic_fetch_add(&F.served, 1, __ATOMIC_SEQ_CST) > 0) {
            stall(fd, &h);
            break;
        }
        /* The first request of all is served properly. */
        kvpi_tcp_status_encode(KVPI_TCP_STATUS_OK, st);
        if (h.opcode == KVPI_TCP_OP_READ) {
            kvpi_send_all(fd, st, sizeof st);
            kvpi_send_all(fd, region, h.size);
        } else {
            kvpi_recv_all(fd, region, h.size);
            kvpi_send_all(fd, st, sizeof st);
        }
    }
    close(fd);
    return NULL;
}

/* Start the fake in a child; returns its pid and the segment name. */
static pid_t fake_start(enum stall mode, char *name, size_t len)
{
    int lfd, data_port;
    if (kvpi_tcp_listen("127.0.0.1", 0, &lfd, &data_port) != KVP_OK) return -1;
    int rpc_port = kvpt_free_port();
    snprintf(name, 64, "127.0.0.1:%d", rpc_port);
    region = malloc(MIB);
    if (!region) return -1;
    kvpt_fill(region, MIB, 7);
    F.mode = mode;
    F.served = 0;
    snprintf(F.desc, sizeof F.desc,
             "{\"name\":\"%s\",\"protocol\":\"tcp\",\"tcp_data_port\":%d,\"tcp_proto_version\":2,"
             "\"timestamp\":\"0\",\"buffers\":[{\"name\":\"x\",\"addr\":%llu,\"length\":%zu}]}",
             name, data_port, (unsigned long long)(uintptr_t)region, len);
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0) {
        close(lfd);
        if (pid > 0 && kvpt_wait_port("127.0.0.1", rpc_port, 10000) != 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            return -1;
        }
        return pid;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    signal(SIGPIPE, SIG_IGN);
    kvpi_rpc_server *rpc;
    if (kvpi_rpc_server_start("127.0.0.1", rpc_port, NULL, fake_desc, NULL, &rpc) != KVP_OK)
        _exit(3);
    kvpt_accept_forever(lfd, fake_conn);
}

/* One good transfer (so that the next reuses its connection), then one the
 * fake stalls; returns how long the stalled one took to fail, in ms. */
static long stalled(enum stall mode, kvp_opcode op)
{
    char name[64];
    pid_t pid = fake_start(mode, name, MIB);
    if (pid < 0) return -1;
    kvp_engine *e;
    long took = -1;
    if (kvpt_initiator_start(NULL, "tcp", 1, TIMEOUT_MS, &e) == 0) {
        kvp_segment_id seg;
        char *buf = malloc(MIB);
        uint64_t remote = (uint64_t)(uintptr_t)region;
        if (buf && kvp_engine_open_segment(e, name, &seg) == KVP_OK &&
            kvp_engine_read(e, seg, buf, remote, MIB) == KVP_OK) {
            uint64_t t0 = kvpi_now_ms();
            kvp_status st = op == KVP_OP_READ ? kvp_engine_read(e, seg, buf, remote, MIB)
                                              : kvp_engine_write(e, seg, buf, remote, MIB);
            took = (long)(kvpi_now_ms() - t0);
            fprintf(stderr, "  %s, mode %d: %s after %ld ms: %s\n",
                    op == KVP_OP_READ ? "READ" : "WRITE", (int)mode, kvp_strerror(st), took,
                    kvp_last_error());
            if (st != KVP_ETIMEDOUT || !strstr(kvp_last_error(), "not done within")) took = -1;
        } else {
            fprintf(stderr, "  the fake's first, good READ failed: %s\n", kvp_last_error());
        }
        free(buf);
        kvp_engine_destroy(e);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    free(region);
    return took;
}

/* Within the deadline of 3.06 s, with a second of margin for a loaded
 * machine; never twice the timeout. */
#define WITHIN(ms) ((ms) >= TIMEOUT_MS - 100 && (ms) < TIMEOUT_MS + 1500)

/* One case a line: the peer's stall and the operation it stalls. */
#define STALLED_CASE(name, how, op)                                                                \
    static void name(void)                                                                         \
    {                                                                                              \
        long ms = stalled(how, op);                                                                \
        CHECK(WITHIN(ms));                                                                         \
    }
STALLED_CASE(read_partial_then_silent, STALL_PARTIAL, KVP_OP_READ)
STALLED_CASE(read_trickle, STALL_TRICKLE, KVP_OP_READ)
STALLED_CASE(read_silent, STALL_SILENT, KVP_OP_READ)
STALLED_CASE(write_half_taken, STALL_PARTIAL, KVP_OP_WRITE)

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(read_partial_then_silent, 30);
    RUN_T(read_trickle, 30);
    RUN_T(read_silent, 30);
    RUN_T(write_half_taken, 30);
    return kvpt_summary();
}
