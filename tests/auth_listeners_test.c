/* The authenticated mode (docs/security.md) against a target's own
 * listeners: a target engine in another process holds a key, and strangers
 * try each of its listeners (the TCP data port, the handshake port, the shm
 * socket) without a key, with a wrong key, with Mooncake's raw frames and
 * with a recorded handshake replayed; all are refused, and it keeps serving
 * an initiator with the key. */
#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/clock.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "test.h"
#include "transport/shm_internal.h"
#include "transport/tcp_wire.h"

#define SEED 0xa17
#define LEN ((size_t)1 << 20)
#define WAIT_MS 10000 /* bounds a wait that succeeds at once when the code is right */

/* The peer closed fd: end of stream (or a reset) with no byte before it,
 * within WAIT_MS. */
static int closed_silently(int fd)
{
    char c;
    uint64_t deadline = kvpi_deadline_ns(WAIT_MS);
    kvp_status st = kvpi_recv_all_by(fd, &c, 1, deadline);
    return st == KVP_ECONNRESET && kvpi_now_ns() < deadline;
}

static int connect_shm(const char *name)
{
    struct sockaddr_un sa;
    socklen_t len = kvpi_shm_sockaddr(name, &sa);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, len) == 0) return fd;
    if (fd >= 0) close(fd);
    return -1;
}

/* ---------------------------------------------------------- listeners --- */

/* Each listener of an authenticated target: a peer without a key (the
 * listener's own protocol, as Mooncake or kvpipe without the key speaks it),
 * one with the wrong key, and one with the right key but another listener's
 * channel are refused; one with the right key is served. Then an
 * authenticated initiator reads through tcp and through shm, and engines
 * without the key or with another are refused with KVP_EAUTH. */
static void listeners_refuse_strangers(void)
{
    kvpt_keys_make();
    kvpi_auth *good = kvpt_auth_load(kvpt_key1), *bad = kvpt_auth_load(kvpt_key2);
    REQUIRE(good && bad);
    kvpt_target t;
    kvpt_target_opts o = {.len = LEN, .seed = SEED, .timeout_ms = 3000};
    REQUIRE(kvpt_auth_target(&o, &t, kvpt_key1) == 0);
    const char *log = t.peer.err;
    char shm_name[KVPI_SHM_SOCKET_MAX];
    REQUIRE(kvpt_target_shm_socket(&t, good, shm_name, sizeof shm_name) == 0);
    uint64_t addr = (uint64_t)(uintptr_t)t.buf;

    /* A Mooncake-wire peer on the data port: a v2 READ of registered
     * memory gets no status and no byte, just the close. */
    for (int i = 0; i < 20; i++) {
        int fd = kvpt_raw_connect(t.data_port);
        REQUIRE(fd >= 0);
        uint8_t hdr[KVPI_TCP_HDR_LEN];
        kvpi_tcp_hdr h = {64, addr, KVPI_TCP_OP_READ, 1};
        kvpi_tcp_hdr_encode(&h, hdr);
        CHECK_OK(kvpi_send_all(fd, hdr, sizeof hdr));
        CHECK(closed_silently(fd));
        close(fd);
    }
    /* A handshake frame without authentication: a frame saying why, then the close. */
    {
        char *reply = NULL;
        CHECK_OK(kvpi_rpc_call("127.0.0.1", t.rpc_port, KVPI_RPC_METADATA, "{}", WAIT_MS, &reply));
        CHECK(reply && kvpi_auth_desc_signed(reply) && !strstr(reply, "buffers"));
        free(reply);
    }
    /* Half a HELLO, then silence, on the handshake port: cut at the setup
     * deadline (timeout_ms 3000), without spinning meanwhile. */
    {
        int fd = kvpt_raw_connect(t.rpc_port);
        REQUIRE(fd >= 0);
        int64_t cpu0 = kvpt_target_cpu_ms(&t);
        uint64_t t0 = kvpi_now_ms();
        CHECK_OK(kvpi_send_all(fd, "KVPA", 4));
        CHECK(closed_silently(fd));
        uint64_t took = kvpi_now_ms() - t0;
        int64_t cpu = kvpt_target_cpu_ms(&t) - cpu0;
        CHECK(took >= 2500 && took < WAIT_MS);
        CHECK(cpu >= 0 && cpu < 300); /* a spinning thread takes most of a core */
        if (cpu >= 300) fprintf(stderr, "  the target spent %lld ms of CPU\n", (long long)cpu);
        close(fd);
    }
    /* The shm hello without authentication. */
    {
        int fd = connect_shm(shm_name);
        REQUIRE(fd >= 0);
        uint8_t hello[KVPI_SHM_HELLO_LEN] = {0};
        kvpi_put_le64(hello, (uint64_t)KVPI_SHM_MAGIC << 32 | KVPI_SHM_VERSION);
        CHECK_OK(kvpi_send_all(fd, hello, sizeof hello));
        CHECK(closed_silently(fd));
        close(fd);
    }
    /* Wrong key, and the right key on the wrong channel, on each listener. */
    const char *channels[] = {"tcp", "rpc", "shm"};
    for (int i = 0; i < 3; i++) {
        for (int pass = 0; pass < 2; pass++) {
            int fd = i == 2 ? connect_shm(shm_name)
                            : kvpt_raw_connect(i == 0 ? t.data_port : t.rpc_port);
            REQUIRE(fd >= 0);
            const char *ch = pass == 0 ? channels[i] : channels[(i + 1) % 3];
            kvp_status st =
                kvpi_auth_client(pass == 0 ? bad : good, fd, ch, kvpi_deadline_ns(WAIT_MS));
            if (st != KVP_EAUTH)
                fprintf(stderr, "  %s listener, pass %d: %s\n", channels[i], pass,
                        st ? kvp_last_error() : "accepted");
            CHECK(st == KVP_EAUTH);
            CHECK(strstr(kvp_last_error(), pass == 0 ? "refused our key" : "failed to prove"));
            close(fd);
        }
    }
    /* The right key on the data port, then a READ on that connection. */
    {
        int fd = kvpt_raw_connect(t.data_port);
        REQUIRE(fd >= 0);
        CHECK_OK(kvpi_auth_client(good, fd, "tcp", kvpi_deadline_ns(WAIT_MS)));
        uint8_t hdr[KVPI_TCP_HDR_LEN], got[8 + 64];
        kvpi_tcp_hdr h = {64, addr, KVPI_TCP_OP_READ, 1};
        kvpi_tcp_hdr_encode(&h, hdr);
        CHECK_OK(kvpi_send_all(fd, hdr, sizeof hdr));
        CHECK_OK(kvpi_recv_all_by(fd, got, sizeof got, kvpi_deadline_ns(WAIT_MS)));
        CHECK(kvpi_tcp_status_decode(got) == KVPI_TCP_STATUS_OK);
        CHECK(kvpt_verify(got + 8, 64, SEED) == (size_t)-1);
        close(fd);
    }
    /* kvp_info_segment (kvpipe info) proves the key of the env. */
    {
        char *desc = NULL, *host = NULL;
        setenv(KVPI_AUTH_ENV, kvpt_key1, 1);
        CHECK_OK(kvp_info_segment("P2PHANDSHAKE", t.name, WAIT_MS, &desc, &host));
        unsetenv(KVPI_AUTH_ENV);
        CHECK(desc && strstr(desc, "\"buffers\""));
        free(desc);
        free(host);
    }
    /* Engines: with the key through tcp and shm; without it, or with another. */
    kvp_engine *tcp = kvpt_auth_initiator("P2PHANDSHAKE", kvpt_key1, 1, 0);
    kvp_engine *shm = kvpt_auth_initiator("P2PHANDSHAKE", kvpt_key1, 0, 0);
    kvp_engine *none = kvpt_auth_initiator("P2PHANDSHAKE", "", 1, 0);
    kvp_engine *other = kvpt_auth_initiator("P2PHANDSHAKE", kvpt_key2, 1, 0);
    REQUIRE(tcp && shm && none && other);
    CHECK(kvpt_read_ok(tcp, t.name, &t, SEED, "tcp"));
    CHECK(kvpt_read_ok(shm, t.name, &t, SEED, "shm"));
    kvp_segment_id seg;
    CHECK_ST(kvp_engine_open_segment(none, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "is authenticated") && strstr(kvp_last_error(), t.name));
    CHECK_ST(kvp_engine_open_segment(other, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "refused our key"));
    kvp_engine_destroy(tcp);
    kvp_engine_destroy(shm);
    kvp_engine_destroy(none);
    kvp_engine_destroy(other);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    /* Logged, but rate-limited: 20 Mooncake-wire peers on the data port. */
    int data_lines = kvpt_file_lines(log, "tcp data server");
    CHECK(kvpt_file_lines(log, "refused a connection") >= 3);
    CHECK(data_lines >= 1 && data_lines <= 3);
    kvpt_keep_log_if_failed(log);
    kvpi_auth_free(good);
    kvpi_auth_free(bad);
    kvpt_keys_drop();
}

/* A recorded handshake, replayed: the client's half to the target (which
 * draws a fresh nonce, so the recorded proof fails), and the server's half to
 * a fresh client (which draws a fresh nonce, so the recorded MAC fails). */
typedef struct client_run {
    const kvpi_auth *auth;
    int fd;
    kvp_status st;
    char err[512];
} client_run;

static void *client_main(void *arg)
{
    client_run *r = arg;
    r->st = kvpi_auth_client(r->auth, r->fd, "tcp", kvpi_deadline_ns(WAIT_MS));
    snprintf(r->err, sizeof r->err, "%s", kvp_last_error());
    return NULL;
}

/* Move len bytes from one fd to the other, keeping a copy. */
static int relay(int from, int to, uint8_t *copy, size_t len)
{
    uint64_t deadline = kvpi_deadline_ns(WAIT_MS);
    return kvpi_recv_all_by(from, copy, len, deadline) || kvpi_send_all_by(to, copy, len, deadline);
}

static void replay_fails(void)
{
    kvpt_keys_make();
    kvpi_auth *good = kvpt_auth_load(kvpt_key1);
    REQUIRE(good);
    kvpt_target t;
    kvpt_target_opts o = {.len = LEN, .seed = SEED, .disable_shm = 1};
    REQUIRE(kvpt_auth_target(&o, &t, kvpt_key1) == 0);
    const char *log = t.peer.err;
    /* Record a genuine handshake through a relay. */
    enum { HELLO = 56, CHAL = 80, PROOF = 32, DONE = 16 };
    uint8_t hello[HELLO], chal[CHAL], proof[PROOF], done[DONE];
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    int srv = kvpt_raw_connect(t.data_port);
    REQUIRE(srv >= 0);
    client_run run = {.auth = good, .fd = sv[0]};
    pthread_t th;
    pthread_create(&th, NULL, client_main, &run);
    CHECK(relay(sv[1], srv, hello, HELLO) == 0);
    CHECK(relay(srv, sv[1], chal, CHAL) == 0);
    CHECK(relay(sv[1], srv, proof, PROOF) == 0);
    CHECK(relay(srv, sv[1], done, DONE) == 0);
    pthread_join(th, NULL);
    CHECK(run.st == KVP_OK);
    CHECK(done[8] == KVPI_AUTH_ACCEPTED);
    close(srv);
    close(sv[0]);
    close(sv[1]);

    /* The client's half again, to the target. */
    int fd = kvpt_raw_connect(t.data_port);
    REQUIRE(fd >= 0);
    uint8_t chal2[CHAL], done2[DONE];
    uint64_t deadline = kvpi_deadline_ns(WAIT_MS);
    CHECK_OK(kvpi_send_all_by(fd, hello, HELLO, deadline));
    CHECK_OK(kvpi_recv_all_by(fd, chal2, CHAL, deadline));
    CHECK(memcmp(chal2 + 16, chal + 16, 32) != 0); /* a fresh server nonce */
    CHECK_OK(kvpi_send_all_by(fd, proof, PROOF, deadline));
    CHECK_OK(kvpi_recv_all_by(fd, done2, DONE, deadline));
    CHECK(done2[8] == KVPI_AUTH_REFUSED_PROOF);
    CHECK(closed_silently(fd));
    close(fd);

    /* The server's half, to a new client. */
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    client_run again = {.auth = good, .fd = sv[0]};
    pthread_create(&th, NULL, client_main, &again);
    uint8_t hello2[HELLO];
    CHECK_OK(kvpi_recv_all_by(sv[1], hello2, HELLO, kvpi_deadline_ns(WAIT_MS)));
    CHECK(memcmp(hello2 + 24, hello + 24, 32) != 0); /* a fresh client nonce */
    CHECK_OK(kvpi_send_all(sv[1], chal, CHAL));
    pthread_join(th, NULL);
    CHECK(again.st == KVP_EAUTH && strstr(again.err, "failed to prove"));
    close(sv[0]);
    close(sv[1]);

    /* And the target still serves an initiator with the key. */
    kvp_engine *e = kvpt_auth_initiator("P2PHANDSHAKE", kvpt_key1, 1, 0);
    REQUIRE(e);
    CHECK(kvpt_read_ok(e, t.name, &t, SEED, "tcp"));
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    CHECK(kvpt_file_lines(log, "replayed handshake") >= 1);
    unlink(log);
    kvpi_auth_free(good);
    kvpt_keys_drop();
}

int main(void)
{
    unsetenv(KVPI_AUTH_ENV);
    RUN(listeners_refuse_strangers);
    RUN(replay_fails);
    return kvpt_summary();
}
