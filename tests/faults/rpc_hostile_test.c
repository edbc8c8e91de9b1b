/* The handshake (RPC) port under hostile peers (issue 11, item 3), across
 * processes: a target engine in a child, attackers and legitimate callers in
 * the test process; and the client side against a peer that trickles its
 * reply. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
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

#define MIB ((size_t)1 << 20)

static int handshake_ok(int port, int timeout_ms)
{
    char *reply = NULL;
    kvp_status st = kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, "{}", timeout_ms, &reply);
    int ok = st == KVP_OK && reply && strstr(reply, "tcp_data_port") != NULL;
    if (!ok) fprintf(stderr, "  handshake: %s\n", kvp_last_error());
    free(reply);
    return ok;
}

/* n connections that each send a frame header promising 100 bytes and then
 * one byte of it per second, from one thread, until stopped. */
typedef struct slowloris {
    int *fds;
    int n;
    atomic_int stop;
    pthread_t thread;
} slowloris;

static void *slowloris_main(void *arg)
{
    slowloris *s = arg;
    while (!atomic_load(&s->stop)) {
        for (int i = 0; i < s->n; i++)
            if (s->fds[i] >= 0 && send(s->fds[i], "{", 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1) {
                close(s->fds[i]); /* the server closed it: reconnect, as an attacker would */
                s->fds[i] = -1;
            }
        for (int i = 0; i < 10 && !atomic_load(&s->stop); i++)
            usleep(100000);
    }
    return NULL;
}

static int slowloris_start(slowloris *s, int port, int n)
{
    *s = (slowloris){.n = n, .fds = calloc((size_t)n, sizeof(int))};
    if (!s->fds) return -1;
    uint8_t hdr[9];
    kvpi_put_le64(hdr, 100);
    hdr[8] = KVPI_RPC_METADATA;
    for (int i = 0; i < n; i++) {
        s->fds[i] = kvpt_raw_connect(port);
        if (s->fds[i] >= 0) kvpi_send_all(s->fds[i], hdr, sizeof hdr);
    }
    atomic_init(&s->stop, 0);
    return pthread_create(&s->thread, NULL, slowloris_main, s);
}

static void slowloris_stop(slowloris *s)
{
    atomic_store(&s->stop, 1);
    pthread_join(s->thread, NULL);
    for (int i = 0; i < s->n; i++)
        if (s->fds[i] >= 0) close(s->fds[i]);
    free(s->fds);
}

/* 260 connections that trickle a frame a byte a second fill the 256 slots;
 * each legitimate handshake pushes out the oldest incomplete one and is
 * served. The target's timeout is long (30 s), so its deadline alone would
 * not save anyone. Before, no legitimate handshake was served while the
 * trickle lasted. */
static void slowloris_260(void)
{
    REQUIRE(kvpt_raise_nofile(4096) == 0);
    kvpt_target t;
    kvpt_target_opts o = {.len = MIB, .timeout_ms = 30000, .disable_shm = 1};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    slowloris s;
    REQUIRE(slowloris_start(&s, t.rpc_port, 260) == 0);
    usleep(1500000);
    int served = 0;
    for (int i = 0; i < 5; i++)
        served += handshake_ok(t.rpc_port, 3000);
    CHECK(served == 5);
    /* An engine finds the segment through the same port. */
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start(NULL, "tcp", 1, 3000, &e) == 0);
    kvp_segment_id seg;
    CHECK_OK(kvp_engine_open_segment(e, t.name, &seg));
    kvp_engine_destroy(e);
    slowloris_stop(&s);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* 300 connections that send nothing: the same, for idle ones. */
static void idle_flood(void)
{
    REQUIRE(kvpt_raise_nofile(4096) == 0);
    kvpt_target t;
    kvpt_target_opts o = {.len = MIB, .timeout_ms = 30000, .disable_shm = 1};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    int fds[300];
    for (int i = 0; i < 300; i++)
        fds[i] = kvpt_raw_connect(t.rpc_port);
    usleep(500000);
    int served = 0;
    for (int i = 0; i < 5; i++)
        served += handshake_ok(t.rpc_port, 3000);
    CHECK(served == 5);
    for (int i = 0; i < 300; i++)
        if (fds[i] >= 0) close(fds[i]);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* Oversized, zero-length and unknown-type frames, and frames cut short, from
 * another process: each closes its connection only. */
static void bad_frames(void)
{
    kvpt_target t;
    kvpt_target_opts o = {.len = MIB, .timeout_ms = 1000, .disable_shm = 1};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    struct {
        uint64_t len;
        uint8_t type;
        size_t send;
    } cases[] = {{(uint64_t)KVPI_RPC_MAX_FRAME + 1, 1, 9},
                 {UINT64_MAX, 1, 9},
                 {0, 1, 9},
                 {10, 200, 9},
                 {100, 1, 30},
                 {100, 1, 5}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int fd = kvpt_raw_connect(t.rpc_port);
        REQUIRE(fd >= 0);
        uint8_t frame[64] = {0};
        kvpi_put_le64(frame, cases[i].len);
        frame[8] = cases[i].type;
        memset(frame + 9, '{', sizeof frame - 9);
        CHECK_OK(kvpi_send_all(fd, frame, cases[i].send));
        kvpi_socket_set_timeout(fd, 5000);
        char b;
        CHECK(recv(fd, &b, 1, 0) == 0); /* closed, no reply, within the 1 s deadline */
        close(fd);
        CHECK(handshake_ok(t.rpc_port, 3000));
    }
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* A handshake peer, in a child, that reads the request and answers with a
 * frame of 1000 bytes sent one byte every 200 ms. */
static pid_t trickling_peer(int *port)
{
    int lfd;
    if (kvpi_tcp_listen("127.0.0.1", 0, &lfd, port) != KVP_OK) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0) {
        close(lfd);
        return pid;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    signal(SIGPIPE, SIG_IGN);
    for (;;) {
        int fd;
        if (kvpi_tcp_accept(lfd, 0, &fd) != KVP_OK) continue;
        uint8_t hdr[9];
        if (kvpi_recv_all(fd, hdr, 9) == KVP_OK) {
            uint64_t len = kvpi_get_le64(hdr);
            char *req = malloc(len);
            if (req && kvpi_recv_all(fd, req, len - 1) == KVP_OK) {
                kvpi_put_le64(hdr, 1000);
                kvpi_send_all(fd, hdr, 9);
                for (int i = 0; i < 999 && send(fd, " ", 1, MSG_NOSIGNAL) == 1; i++)
                    usleep(200000);
            }
            free(req);
        }
        close(fd);
    }
}

/* The client side: a reply that trickles in is bounded by the caller's
 * timeout on the whole exchange, in kvpi_rpc_call and in an engine opening a
 * segment by handshake. Before, each byte restarted the timeout, and the
 * caller waited as long as the peer cared to trickle (200 s here). */
static void client_reply_deadline(void)
{
    int port;
    pid_t pid = trickling_peer(&port);
    REQUIRE(pid > 0);
    char *reply = NULL;
    uint64_t t0 = kvpi_now_ms();
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, "{}", 1500, &reply),
             KVP_ETIMEDOUT);
    uint64_t took = kvpi_now_ms() - t0;
    fprintf(stderr, "  trickled reply: ETIMEDOUT after %llu ms (timeout 1500)\n",
            (unsigned long long)took);
    CHECK(took >= 1400 && took < 3500);
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start(NULL, "tcp", 1, 1500, &e) == 0);
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", port);
    kvp_segment_id seg;
    t0 = kvpi_now_ms();
    CHECK_ST(kvp_engine_open_segment(e, name, &seg), KVP_ETIMEDOUT);
    took = kvpi_now_ms() - t0;
    CHECK(took < 3500);
    kvp_engine_destroy(e);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(slowloris_260, 60);
    RUN_T(idle_flood, 60);
    RUN_T(bad_frames, 60);
    RUN_T(client_reply_deadline, 30);
    return kvpt_summary();
}
