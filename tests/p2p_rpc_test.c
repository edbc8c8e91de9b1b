/* The handshake (RPC) port: kvpi_rpc_server_* and kvpi_rpc_call against each
 * other, across processes, and each against a hand-written peer that speaks
 * (or breaks) the wire format byte by byte. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/conn_server.h"
#include "common/net.h"
#include "metadata/metadata.h"
#include "test.h"

static const char *const server_desc =
    "{\"name\":\"127.0.0.1:1\",\"protocol\":\"tcp\",\"tcp_data_port\":2,\"buffers\":[]}";
static const char *const client_desc = "{\"name\":\"caller:9\",\"protocol\":\"tcp\"}";

typedef struct desc_ctx {
    const char *desc; /* NULL: desc_fn has nothing */
    atomic_int calls;
} desc_ctx;

static char *desc_fn(void *arg)
{
    desc_ctx *c = arg;
    atomic_fetch_add(&c->calls, 1);
    return c->desc ? strdup(c->desc) : NULL;
}

static kvpi_rpc_server *start(desc_ctx *ctx, int timeout_ms, int *port)
{
    kvpi_rpc_server *srv = NULL;
    *port = kvpt_free_port();
    if (kvpi_rpc_server_start("127.0.0.1", *port, &(kvpi_conn_limits){.timeout_ms = timeout_ms},
                              desc_fn, ctx, &srv) != KVP_OK) {
        fprintf(stderr, "  server start: %s\n", kvp_last_error());
        return NULL;
    }
    return srv;
}

/* A case's server: ctx describes it with descriptor d, its I/O timeout
 * timeout_ms, srv on port. */
#define SERVER(d, timeout_ms)                                                                      \
    desc_ctx ctx = {.desc = d};                                                                    \
    int port;                                                                                      \
    kvpi_rpc_server *srv = start(&ctx, timeout_ms, &port);                                         \
    REQUIRE(srv)

/* Non-zero if a normal METADATA call to port gets server_desc. */
static int call_works(int port)
{
    char *reply = NULL;
    kvp_status st = kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, client_desc, 3000, &reply);
    int ok = st == KVP_OK && strcmp(reply, server_desc) == 0;
    if (!ok) fprintf(stderr, "  call: %s (%s)\n", kvp_strerror(st), kvp_last_error());
    free(reply);
    return ok;
}

static void put_header(uint8_t *hdr, uint64_t len, uint8_t type)
{
    kvpi_put_le64(hdr, len);
    hdr[8] = type;
}

/* Non-zero if the server closes fd without sending a byte. */
static int closed_without_reply(int fd)
{
    kvpi_socket_set_timeout(fd, 5000);
    char b;
    ssize_t n = recv(fd, &b, 1, 0);
    return n == 0;
}

static int connect_raw(int port)
{
    int fd = -1;
    if (kvpi_tcp_connect("127.0.0.1", port, 3000, &fd) != KVP_OK) return -1;
    return fd;
}

/* ---- server and client together ---- */

static void test_roundtrip_all_types(void)
{
    SERVER(server_desc, 3000);
    CHECK(call_works(port));
    CHECK(atomic_load(&ctx.calls) == 1);
    /* CONNECT gets "{}"; PROBE Mooncake's answer; NOTIFY, to a server with no
     * handler for it, a refusal Mooncake's sender reads as one (an empty
     * notify_msg) and kvpipe's as KVP_ENOTSUP. */
    const char *const want[] = {"{}", NULL, NULL, KVPI_RPC_PROBE_OK};
    for (int type = KVPI_RPC_CONNECT; type <= KVPI_RPC_PROBE; type++) {
        if (type == KVPI_RPC_METADATA) continue;
        char *reply = NULL;
        CHECK_OK(kvpi_rpc_call("127.0.0.1", port, type, "{\"x\":1}", 3000, &reply));
        if (want[type])
            CHECK(reply && strcmp(reply, want[type]) == 0);
        else
            CHECK(reply && kvpi_rpc_notify_reply_check(reply) == KVP_ENOTSUP &&
                  strstr(reply, "\"notify_msg\":\"\""));
        free(reply);
    }
    CHECK(atomic_load(&ctx.calls) == 1); /* only METADATA asks for the descriptor */
    /* The largest request that fits a frame is served; one byte more is refused
     * by the client before it sends anything. */
    char *big = malloc(KVPI_RPC_MAX_FRAME + 1);
    REQUIRE(big);
    memset(big, ' ', KVPI_RPC_MAX_FRAME);
    big[KVPI_RPC_MAX_FRAME - 1] = '\0';
    char *reply = NULL;
    CHECK_OK(kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_PROBE, big, 3000, &reply));
    free(reply);
    big[KVPI_RPC_MAX_FRAME - 1] = ' ';
    big[KVPI_RPC_MAX_FRAME] = '\0';
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_PROBE, big, 3000, &reply), KVP_EINVAL);
    free(big);
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, 4, "{}", 3000, &reply), KVP_EINVAL);
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, -1, "{}", 3000, &reply), KVP_EINVAL);
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, 1, NULL, 3000, &reply), KVP_EINVAL);
    kvpi_rpc_server_stop(srv);
}

static void test_cross_process(void)
{
    int port = kvpt_free_port();
    pid_t pid = fork();
    if (pid == 0) {
        desc_ctx ctx = {.desc = server_desc};
        kvpi_rpc_server *srv;
        if (kvpi_rpc_server_start("127.0.0.1", port, &(kvpi_conn_limits){.timeout_ms = 3000},
                                  desc_fn, &ctx, &srv) != KVP_OK)
            _exit(3);
        sleep(60); /* until the parent kills it */
        _exit(0);
    }
    REQUIRE(pid > 0);
    REQUIRE(kvpt_wait_port("127.0.0.1", port, 10000) == 0);
    CHECK(call_works(port));
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    char *reply = NULL;
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, client_desc, 3000, &reply),
             KVP_ECONNREFUSED);
    CHECK(reply == NULL);
}

static void test_server_refuses_bad_frames(void)
{
    SERVER(server_desc, 3000);
    uint8_t hdr[9 + 16];
    int served = 0;
    struct {
        uint64_t len;
        uint8_t type;
        size_t send; /* bytes of hdr to send */
    } cases[] = {
        {0, 1, 9},                      /* zero length */
        {KVPI_RPC_MAX_FRAME + 1, 1, 9}, /* oversize: refused before the body */
        {UINT64_MAX, 1, 9},             /* absurd length */
        {3, 9, 11},                     /* unknown type */
        {3, 255, 11},                   /* unknown type */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int fd = connect_raw(port);
        REQUIRE(fd >= 0);
        put_header(hdr, cases[i].len, cases[i].type);
        memcpy(hdr + 9, "{}{}{}{}", 8);
        CHECK_OK(kvpi_send_all(fd, hdr, cases[i].send));
        CHECK(closed_without_reply(fd));
        close(fd);
        CHECK(call_works(port));
        served++;
    }
    /* Truncated frames: the header, or the body, stops short and the peer leaves. */
    for (size_t cut = 1; cut < 20; cut += 6) {
        int fd = connect_raw(port);
        REQUIRE(fd >= 0);
        put_header(hdr, 100, 1);
        memcpy(hdr + 9, "{\"truncated\":", 13);
        CHECK_OK(kvpi_send_all(fd, hdr, cut));
        shutdown(fd, SHUT_WR);
        CHECK(closed_without_reply(fd));
        close(fd);
        CHECK(call_works(port));
        served++;
    }
    CHECK(atomic_load(&ctx.calls) == served); /* bad frames never reach desc_fn */
    kvpi_rpc_server_stop(srv);
}

static void test_server_drops_silent_client(void)
{
    SERVER(server_desc, 300);
    int idle = connect_raw(port);
    int half = connect_raw(port);
    REQUIRE(idle >= 0 && half >= 0);
    uint8_t hdr[9];
    put_header(hdr, 50, 1);
    CHECK_OK(kvpi_send_all(half, hdr, 9)); /* promises 49 bytes that never come */
    CHECK(call_works(port));               /* others are served meanwhile */
    CHECK(closed_without_reply(idle));     /* closed after the server's I/O timeout */
    CHECK(closed_without_reply(half));
    close(idle);
    close(half);
    CHECK(call_works(port));
    kvpi_rpc_server_stop(srv);
}

static void test_no_descriptor(void)
{
    SERVER(NULL, 3000);
    char *reply = NULL;
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, client_desc, 3000, &reply),
             KVP_ECONNRESET);
    CHECK(reply == NULL);
    CHECK_OK(kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_PROBE, "{}", 3000, &reply));
    free(reply);
    kvpi_rpc_server_stop(srv);
}

static void test_stop_with_open_connections(void)
{
    SERVER(server_desc, 600000); /* only stop can end these */
    int fds[4];
    for (int i = 0; i < 4; i++) {
        fds[i] = connect_raw(port);
        REQUIRE(fds[i] >= 0);
        uint8_t hdr[9];
        put_header(hdr, 10, 1);
        if (i % 2) kvpi_send_all(fds[i], hdr, 9);
    }
    CHECK(call_works(port));   /* the server has accepted all of them by now */
    kvpi_rpc_server_stop(srv); /* must not wait for the clients */
    for (int i = 0; i < 4; i++) {
        CHECK(closed_without_reply(fds[i]));
        close(fds[i]);
    }
    int fd;
    CHECK_ST(kvpi_tcp_connect("127.0.0.1", port, 1000, &fd), KVP_ECONNREFUSED);
    kvpi_rpc_server_stop(NULL);
}

#define N_CALLERS 8
#define N_CALLS 25

static void *caller(void *arg)
{
    int port = *(int *)arg;
    long bad = 0;
    for (int i = 0; i < N_CALLS; i++)
        bad += !call_works(port);
    return (void *)(intptr_t)bad;
}

static void test_concurrent_callers(void)
{
    SERVER(server_desc, 3000);
    pthread_t t[N_CALLERS];
    for (int i = 0; i < N_CALLERS; i++)
        REQUIRE(pthread_create(&t[i], NULL, caller, &port) == 0);
    CHECK(kvpt_join_bad(t, N_CALLERS) == 0);
    CHECK(atomic_load(&ctx.calls) == N_CALLERS * N_CALLS);
    kvpi_rpc_server_stop(srv);
}

static void test_start_errors(void)
{
    SERVER(server_desc, 3000);
    kvpi_rpc_server *second = NULL;
    CHECK(kvpi_rpc_server_start("127.0.0.1", port, &(kvpi_conn_limits){.timeout_ms = 3000}, desc_fn,
                                &ctx, &second) != KVP_OK);
    CHECK(second == NULL);
    CHECK_ST(kvpi_rpc_server_start("127.0.0.1", 0, &(kvpi_conn_limits){.timeout_ms = 3000}, NULL,
                                   &ctx, &second),
             KVP_EINVAL);
    kvpi_rpc_server_stop(srv);
}

/* ---- the client against a hand-written peer ---- */

enum fake_mode {
    FAKE_ECHO_TYPE,  /* check the request, answer correctly */
    FAKE_WRONG_TYPE, /* answer with another type */
    FAKE_ZERO_LEN,   /* answer with length 0 */
    FAKE_HUGE_LEN,   /* answer with a length over 1 MiB */
    FAKE_TRUNCATED,  /* answer half a frame, then close */
    FAKE_SILENT,     /* read the request, never answer */
};

typedef struct fake {
    int listen_fd;
    enum fake_mode mode;
    int request_ok; /* the request was exactly the frame expected */
} fake;

static int read_request(int fd)
{
    uint8_t hdr[9];
    size_t n = strlen(client_desc);
    char body[256];
    if (kvpi_recv_all(fd, hdr, 9) != KVP_OK) return 0;
    if (kvpi_get_le64(hdr) != n + 1 || hdr[8] != KVPI_RPC_METADATA) return 0;
    if (kvpi_recv_all(fd, body, n) != KVP_OK) return 0;
    return memcmp(body, client_desc, n) == 0;
}

static void *fake_main(void *arg)
{
    fake *f = arg;
    int fd;
    if (kvpi_tcp_accept(f->listen_fd, 5000, &fd) != KVP_OK) return NULL;
    f->request_ok = read_request(fd);
    uint8_t hdr[9 + 64];
    size_t n = strlen(server_desc);
    switch (f->mode) {
    case FAKE_ECHO_TYPE:
    case FAKE_WRONG_TYPE:
        put_header(hdr, n + 1, f->mode == FAKE_ECHO_TYPE ? KVPI_RPC_METADATA : KVPI_RPC_PROBE);
        kvpi_send_all(fd, hdr, 9);
        kvpi_send_all(fd, server_desc, n);
        break;
    case FAKE_ZERO_LEN:
    case FAKE_HUGE_LEN:
        put_header(hdr, f->mode == FAKE_ZERO_LEN ? 0 : KVPI_RPC_MAX_FRAME + 1, KVPI_RPC_METADATA);
        kvpi_send_all(fd, hdr, 9);
        break;
    case FAKE_TRUNCATED:
        put_header(hdr, n + 1, KVPI_RPC_METADATA);
        memcpy(hdr + 9, server_desc, 10);
        kvpi_send_all(fd, hdr, 19);
        break;
    case FAKE_SILENT: {
        char b;
        recv(fd, &b, 1, 0); /* until the client gives up and closes */
        break;
    }
    }
    close(fd);
    return NULL;
}

static kvp_status call_fake(enum fake_mode mode, int timeout_ms, char **reply, int *request_ok)
{
    fake f = {.mode = mode};
    int port;
    if (kvpi_tcp_listen("127.0.0.1", 0, &f.listen_fd, &port) != KVP_OK) return KVP_EIO;
    pthread_t t;
    pthread_create(&t, NULL, fake_main, &f);
    kvp_status st =
        kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, client_desc, timeout_ms, reply);
    char detail[512];
    snprintf(detail, sizeof detail, "%s", kvp_last_error());
    pthread_join(t, NULL);
    close(f.listen_fd);
    *request_ok = f.request_ok;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    if (st && !strstr(detail, addr)) {
        fprintf(stderr, "  error does not name %s: %s\n", addr, detail);
        return KVP_EINVAL; /* fails the caller's CHECK_ST */
    }
    return st;
}

static void test_client_against_fake_peer(void)
{
    char *reply = NULL;
    int ok = 0;
    CHECK_OK(call_fake(FAKE_ECHO_TYPE, 3000, &reply, &ok));
    CHECK(ok); /* the server saw the caller's descriptor, framed as specified */
    CHECK(reply && strcmp(reply, server_desc) == 0);
    free(reply);
    reply = NULL;
    CHECK_ST(call_fake(FAKE_WRONG_TYPE, 3000, &reply, &ok), KVP_EPROTO);
    CHECK_ST(call_fake(FAKE_ZERO_LEN, 3000, &reply, &ok), KVP_EPROTO);
    CHECK_ST(call_fake(FAKE_HUGE_LEN, 3000, &reply, &ok), KVP_EPROTO);
    CHECK_ST(call_fake(FAKE_TRUNCATED, 3000, &reply, &ok), KVP_ECONNRESET);
    CHECK_ST(call_fake(FAKE_SILENT, 300, &reply, &ok), KVP_ETIMEDOUT);
    CHECK(ok);
    CHECK(reply == NULL);
}

static void test_client_unreachable(void)
{
    int port = kvpt_free_port();
    char *reply = NULL;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    CHECK_ST(kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, "{}", 3000, &reply),
             KVP_ECONNREFUSED);
    CHECK(strstr(kvp_last_error(), addr) != NULL);
    /* Accepted by the kernel (backlog) but never served: a timeout, not a hang. */
    int lfd, lport;
    REQUIRE_OK(kvpi_tcp_listen("127.0.0.1", 0, &lfd, &lport));
    CHECK_ST(kvpi_rpc_call("127.0.0.1", lport, KVPI_RPC_METADATA, "{}", 300, &reply),
             KVP_ETIMEDOUT);
    CHECK(reply == NULL);
    close(lfd);
}

/* ---- kvpi_meta in P2PHANDSHAKE mode ---- */

/* Fetch seg's descriptor through m: server_desc, from host. */
static void fetch_server_desc(kvpi_meta *m, const char *seg, const char *host)
{
    char *d = NULL, *h = NULL;
    CHECK_OK(kvpi_meta_fetch(m, seg, &d, &h));
    CHECK(d && strcmp(d, server_desc) == 0);
    CHECK(h && strcmp(h, host) == 0);
    free(d);
    free(h);
}

static void test_p2p_meta_fetch(void)
{
    SERVER(server_desc, 3000);
    kvpi_meta *m = NULL;
    desc_ctx mine = {.desc = client_desc}; /* what a handshake sends of ours */
    REQUIRE_OK(kvpi_meta_open(KVPI_P2P_CONN, 3000, desc_fn, &mine, &m));
    char seg[64], *d = NULL, *h = NULL;
    snprintf(seg, sizeof seg, "127.0.0.1:%d", port);
    fetch_server_desc(m, seg, "127.0.0.1");
    CHECK(atomic_load(&mine.calls) == 1);
    mine.desc = NULL;
    CHECK_OK(kvpi_meta_fetch(m, seg, &d, &h)); /* no own descriptor yet: "{}" */
    CHECK(atomic_load(&mine.calls) == 2);
    free(d);
    free(h);
    d = h = NULL;
    CHECK_ST(kvpi_meta_fetch(m, "no-port-here", &d, &h), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "no-port-here") != NULL);
    kvpi_rpc_server_stop(srv);
    CHECK_ST(kvpi_meta_fetch(m, seg, &d, &h), KVP_ECONNREFUSED);
    CHECK(strstr(kvp_last_error(), seg) != NULL);
    CHECK(d == NULL && h == NULL);
    kvpi_meta_close(m);
}

static void test_p2p_ipv6(void)
{
    desc_ctx ctx = {.desc = server_desc};
    kvpi_rpc_server *srv = NULL;
    int port = kvpt_free_port();
    if (kvpi_rpc_server_start("::1", port, &(kvpi_conn_limits){.timeout_ms = 3000}, desc_fn, &ctx,
                              &srv) != KVP_OK)
        SKIP("no IPv6 loopback");
    kvpi_meta *m = NULL;
    desc_ctx mine = {.desc = client_desc};
    REQUIRE_OK(kvpi_meta_open(KVPI_P2P_CONN, 3000, desc_fn, &mine, &m));
    char seg[64];
    snprintf(seg, sizeof seg, "[::1]:%d", port);
    fetch_server_desc(m, seg, "::1");
    kvpi_meta_close(m);
    kvpi_rpc_server_stop(srv);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN(test_roundtrip_all_types);
    RUN(test_cross_process);
    RUN(test_server_refuses_bad_frames);
    RUN(test_server_drops_silent_client);
    RUN(test_no_descriptor);
    RUN_T(test_stop_with_open_connections, 30);
    RUN(test_concurrent_callers);
    RUN(test_start_errors);
    RUN(test_client_against_fake_peer);
    RUN(test_client_unreachable);
    RUN(test_p2p_meta_fetch);
    RUN(test_p2p_ipv6);
    return kvpt_summary();
}
