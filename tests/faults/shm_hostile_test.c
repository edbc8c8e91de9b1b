/* The shm transport's abstract Unix socket under hostile local peers, and the
 * shm client against a target that trickles its answers. The target engine
 * runs in a child; attackers connect to the socket its descriptor names. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "test.h"
#include "transport/shm_internal.h"
#include "transport/transport.h"

#define SEED 0x3a
#define MIB ((size_t)1 << 20)

static int unix_connect(const char *name)
{
    struct sockaddr_un sa;
    socklen_t len = kvpi_shm_sockaddr(name, &sa);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, len) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static int start(kvpt_target *t, char *sock, int timeout_ms)
{
    kvpt_target_opts o = {.len = 4 * MIB, .seed = SEED, .timeout_ms = timeout_ms};
    if (kvpt_target_start(&o, t) != 0) return -1;
    return kvpt_target_shm_socket(t, NULL, sock, KVPI_SHM_SOCKET_MAX);
}

/* An initiator that must use shm opens the segment and READs it correctly. */
static int shm_read_ok(const kvpt_target *t)
{
    kvp_engine *e;
    if (kvpt_initiator_start(NULL, "shm", 0, 3000, &e) != 0) return 0;
    kvp_segment_id seg;
    char buf[65536];
    int ok =
        kvp_engine_open_segment(e, t->name, &seg) == KVP_OK &&
        kvp_engine_read(e, seg, buf, (uint64_t)(uintptr_t)t->buf + MIB, sizeof buf) == KVP_OK &&
        kvpt_verify(buf, sizeof buf, SEED + MIB) == (size_t)-1;
    if (!ok) fprintf(stderr, "  shm READ: %s\n", kvp_last_error());
    kvp_engine_destroy(e);
    return ok;
}

/* Non-zero once the server closed fd, waiting up to ms. */
static int closed_within(int fd, int ms)
{
    kvpi_socket_set_timeout(fd, ms);
    char buf[64];
    for (;;) {
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n == 0) return 1;
        if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
    }
}

/* 300 idle connections on the socket (256 is the cap): each newcomer evicts
 * the oldest one still in setup, and a real initiator gets through. Before,
 * connections past 256 were refused for as long as the idle ones stayed. */
static void idle_flood(void)
{
    kvpt_target t;
    char sock[KVPI_SHM_SOCKET_MAX];
    REQUIRE(start(&t, sock, 30000) == 0);
    int fds[300];
    for (int i = 0; i < 300; i++)
        fds[i] = unix_connect(sock);
    usleep(300000);
    CHECK(shm_read_ok(&t));
    for (int i = 0; i < 300; i++)
        if (fds[i] >= 0) close(fds[i]);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* A hello sent a byte every 300 ms is cut at the setup deadline (1 s), and
 * so is a request header that trickles after a good hello. Before, each byte
 * restarted the timeout. */
static void trickles(void)
{
    kvpt_target t;
    char sock[KVPI_SHM_SOCKET_MAX];
    REQUIRE(start(&t, sock, 1000) == 0);
    /* A good hello: our magic, and 8 bytes of our memory with their value. */
    static uint64_t probe = 0x1122334455667788u;
    uint8_t hello[KVPI_SHM_HELLO_LEN];
    kvpi_put_le64(hello, (uint64_t)KVPI_SHM_MAGIC << 32 | KVPI_SHM_VERSION);
    kvpi_put_le64(hello + 8, (uint64_t)(uintptr_t)&probe);
    kvpi_put_le64(hello + 16, probe);
    for (int phase = 0; phase < 2; phase++) {
        int fd = unix_connect(sock);
        REQUIRE(fd >= 0);
        if (phase == 1) {
            uint8_t st[KVPI_SHM_STATUS_LEN];
            kvp_status remote;
            int err;
            CHECK_OK(kvpi_send_all(fd, hello, sizeof hello));
            CHECK_OK(kvpi_recv_all(fd, st, sizeof st));
            CHECK_OK(kvpi_shm_get_status(st, &remote, &err));
            CHECK_OK(remote);
        }
        const uint8_t *bytes = phase == 0 ? hello : (const uint8_t *)"\x01\x02\x03\x04";
        uint64_t t0 = kvpi_now_ms();
        int i = 0, cut = 0;
        while (!cut && kvpi_now_ms() - t0 < 8000) {
            if (send(fd, bytes + (i++ % 4), 1, MSG_NOSIGNAL) != 1) break;
            cut = closed_within(fd, 300);
        }
        uint64_t took = kvpi_now_ms() - t0;
        fprintf(stderr, "  %s trickle cut after %llu ms\n", phase ? "request" : "hello",
                (unsigned long long)took);
        CHECK(took < 3500);
        close(fd);
    }
    CHECK(shm_read_ok(&t));
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* Garbage where the hello goes, and a bad opcode after a good hello: an
 * error status, that connection closed, everyone else served. */
static void garbage(void)
{
    kvpt_target t;
    char sock[KVPI_SHM_SOCKET_MAX];
    REQUIRE(start(&t, sock, 2000) == 0);
    int fd = unix_connect(sock);
    REQUIRE(fd >= 0);
    uint8_t junk[KVPI_SHM_HELLO_LEN];
    memset(junk, 0xab, sizeof junk);
    CHECK_OK(kvpi_send_all(fd, junk, sizeof junk));
    uint8_t st[KVPI_SHM_STATUS_LEN];
    kvp_status remote = KVP_OK;
    int err;
    CHECK_OK(kvpi_recv_all(fd, st, sizeof st));
    CHECK_OK(kvpi_shm_get_status(st, &remote, &err));
    CHECK_ST(remote, KVP_EPROTO);
    CHECK(closed_within(fd, 3000));
    close(fd);
    CHECK(shm_read_ok(&t));
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

/* ---- the client against a target that trickles its statuses ---- */

/* A shm "target" (a child: SO_PEERCRED names who listens on the socket
 * name): answers the hello, then sends each request's status a byte every
 * 150 ms. */
static void trickling_main(const void *arg, int ready_fd)
{
    const char *name = arg;
    signal(SIGPIPE, SIG_IGN);
    struct sockaddr_un sa;
    socklen_t len = kvpi_shm_sockaddr(name, &sa);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, len) != 0 || listen(lfd, 16) != 0) _exit(3);
    if (write(ready_fd, "r", 1) != 1) _exit(4);
    close(ready_fd);
    for (;;) {
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) continue;
        uint8_t buf[64], st[KVPI_SHM_STATUS_LEN];
        kvpi_shm_put_status(st, KVP_OK, 0);
        if (kvpi_recv_all(fd, buf, KVPI_SHM_HELLO_LEN) == KVP_OK &&
            kvpi_send_all(fd, st, sizeof st) == KVP_OK) {
            while (kvpi_recv_all(fd, buf, KVPI_SHM_REQ_LEN) == KVP_OK) {
                int ok = 1;
                for (size_t i = 0; ok && i < sizeof st; i++) {
                    ok = send(fd, st + i, 1, MSG_NOSIGNAL) == 1;
                    usleep(150000);
                }
                if (!ok) break;
            }
        }
        close(fd);
    }
}

/* Four READs whose statuses trickle in (1.2 s each): the call fails within
 * its deadline, timeout_ms (1 s) + the bytes at min_rate. Before, every byte
 * restarted the timeout and the call took 4.8 s, then succeeded. */
static void client_status_trickle(void)
{
    char name[KVPI_SHM_SOCKET_MAX], host[KVPI_SHM_HOST_ID_MAX];
    snprintf(name, sizeof name, "kvpipe-test-trickle/%d", (int)getpid());
    pid_t pid = kvpt_fork_ready(trickling_main, name);
    REQUIRE(pid > 0);
    REQUIRE_OK(kvpi_shm_host_id(host, sizeof host));
    static char remote_mem[4 * 4096];
    cJSON *desc = cJSON_CreateObject();
    cJSON *o = cJSON_AddObjectToObject(desc, KVPI_SHM_FIELD);
    cJSON_AddNumberToObject(o, "version", KVPI_SHM_VERSION);
    cJSON_AddStringToObject(o, "host_id", host);
    cJSON_AddNumberToObject(o, "pid", pid);
    cJSON_AddStringToObject(o, "socket", name);
    kvpi_region region = {(uint64_t)(uintptr_t)remote_mem, sizeof remote_mem};
    kvpi_peer_ctx ctx = {.host = "127.0.0.1",
                         .desc = desc,
                         .regions = &region,
                         .n_regions = 1,
                         .timeout_ms = 1000,
                         .conns = 1};
    void *peer = NULL;
    REQUIRE_OK(kvpi_transport_shm.peer_open(&ctx, &peer));
    char local[4 * 4096];
    kvpi_slice s[4], *ps[4];
    for (int i = 0; i < 4; i++) {
        s[i] = (kvpi_slice){KVP_OP_READ, local + i * 4096, region.addr + (uint64_t)i * 4096, 4096,
                            KVP_EIO};
        ps[i] = &s[i];
    }
    uint64_t t0 = kvpi_now_ms();
    CHECK_ST(kvpi_transport_xfer_sync(&kvpi_transport_shm, peer, ps, 4), KVP_ETIMEDOUT);
    uint64_t took = kvpi_now_ms() - t0;
    fprintf(stderr, "  trickled statuses: %s after %llu ms\n", kvp_last_error(),
            (unsigned long long)took);
    CHECK(took >= 900 && took < 2500);
    kvpi_transport_shm.peer_close(peer);
    cJSON_Delete(desc);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    if (kvpi_transport_lookup("shm") == NULL) {
        printf("shm transport not built\n");
        return KVPT_SKIP_EXIT;
    }
    RUN_T(idle_flood, 60);
    RUN_T(trickles, 60);
    RUN_T(garbage, 60);
    RUN_T(client_status_trickle, 30);
    return kvpt_summary();
}
