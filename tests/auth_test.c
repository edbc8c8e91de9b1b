/* The authenticated mode (docs/security.md) against real listeners: a target
 * engine in another process holds a key, and strangers try each of its
 * listeners (the TCP data port, the handshake port, the shm socket) without a
 * key, with a wrong key, with Mooncake's raw frames and with a recorded
 * handshake replayed; all are refused, and it keeps serving an initiator with
 * the key. Descriptors in an HTTP store that are forged, garbage, unsigned or
 * stale are refused by an authenticated initiator, naming the segment, and
 * the target's keeper puts its genuine ones back. Key files are checked. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/net.h"
#include "peer.h"
#include "engine/engine_internal.h"
#include "kvpipe/info.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"
#include "transport/shm_internal.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"
#if KVP_HAVE_UCX
#include "engine/descriptor.h"
#include "transport/ucx_internal.h"
#endif

#define SEED 0xa17
#define LEN ((size_t)1 << 20)
#define WAIT_MS 10000 /* bounds a wait that succeeds at once when the code is right */

/* ------------------------------------------------------------ helpers --- */

static char key1[64], key2[64];

/* A key file holding text, mode 0600 unless mode says otherwise. */
static void write_file(char *path, size_t len, const char *text, mode_t mode)
{
    snprintf(path, len, "/tmp/kvpt_auth_%d_XXXXXX", (int)getpid());
    int fd = mkstemp(path);
    if (fd < 0) return;
    if (write(fd, text, strlen(text)) != (ssize_t)strlen(text)) kvpt_failures++;
    fchmod(fd, mode);
    close(fd);
}

static void make_keys(void)
{
    write_file(key1, sizeof key1, "# the current key\n0123456789abcdef0123456789abcdef-one\n",
               0600);
    write_file(key2, sizeof key2, "fedcba9876543210fedcba9876543210-two\n", 0600);
}

static void drop_keys(void)
{
    unlink(key1);
    unlink(key2);
}

static kvpi_auth *load(const char *path)
{
    kvpi_auth *a = NULL;
    if (kvpi_auth_load(path, &a) != KVP_OK)
        fprintf(stderr, "  load %s: %s\n", path, kvp_last_error());
    return a;
}

/* An initiator engine with the given key file ("" for none). */
static kvp_engine *initiator(const char *metadata, const char *key, int disable_shm, int max_age_ms)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = name;
    eo.metadata = metadata;
    eo.disable_shm = disable_shm;
    eo.auth_key_file = key;
    if (max_age_ms) eo.auth_max_age_ms = max_age_ms;
    kvp_engine *e = NULL;
    if (kvp_engine_create(&eo, &e) != KVP_OK)
        fprintf(stderr, "  initiator engine: %s\n", kvp_last_error());
    return e;
}

static int read_ok(kvp_engine *e, const char *segment, const kvpt_target *t, const char *want_tp)
{
    kvp_segment_id seg;
    char buf[4096];
    if (kvp_engine_open_segment(e, segment, &seg) != KVP_OK ||
        kvp_engine_read(e, seg, buf, (uint64_t)(uintptr_t)t->buf, sizeof buf) != KVP_OK) {
        fprintf(stderr, "  read: %s\n", kvp_last_error());
        return 0;
    }
    const char *tp = kvp_engine_segment_transport(e, seg);
    if (want_tp && (!tp || strcmp(tp, want_tp) != 0)) {
        fprintf(stderr, "  read went through %s, not %s\n", tp ? tp : "?", want_tp);
        return 0;
    }
    return kvpt_verify(buf, sizeof buf, SEED) == (size_t)-1;
}

/* The target child's stderr goes to a file, for its log lines. */
static int start_target(kvpt_target_opts *o, kvpt_target *t, const char *key, char *log,
                        size_t loglen)
{
    snprintf(log, loglen, "/tmp/kvpt_auth_target_%d.err", (int)getpid());
    if (key)
        setenv(KVPI_AUTH_ENV, key, 1);
    else
        unsetenv(KVPI_AUTH_ENV);
    int saved = dup(STDERR_FILENO);
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    fflush(stderr);
    dup2(fd, STDERR_FILENO);
    close(fd);
    int rc = kvpt_target_start(o, t);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    unsetenv(KVPI_AUTH_ENV);
    return rc;
}

static int count_lines(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, needle)) n++;
    fclose(f);
    return n;
}

/* A case's target log: named on stderr when the case failed, removed when
 * it passed. */
static void keep_log_if_failed(const char *log)
{
    if (kvpt_failures)
        fprintf(stderr, "  target log: %s\n", log);
    else
        unlink(log);
}

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

/* The shm socket named in the target's descriptor, asked for by an
 * authenticated handshake. */
static int shm_socket_of(const kvpt_target *t, const kvpi_auth *a, char *out, size_t len)
{
    char *reply = NULL;
    if (kvpi_rpc_call_auth("127.0.0.1", t->rpc_port, a, KVPI_RPC_METADATA, "{}", WAIT_MS, &reply) !=
        KVP_OK)
        return -1;
    cJSON *d = cJSON_Parse(reply);
    const cJSON *shm = cJSON_GetObjectItemCaseSensitive(d, KVPI_SHM_FIELD);
    const cJSON *sock = cJSON_GetObjectItemCaseSensitive(shm, "socket");
    int ok = cJSON_IsString(sock);
    if (ok) snprintf(out, len, "%s", sock->valuestring);
    cJSON_Delete(d);
    free(reply);
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------- key files --- */

static void key_files(void)
{
    make_keys();
    kvpi_auth *a = NULL;
    char path[64];
    CHECK_ST(kvpi_auth_load("/nonexistent/kvpipe.key", &a), KVP_ECONFIG);
    write_file(path, sizeof path, "0123456789abcdef0123456789abcdef\n", 0644);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "chmod 600"));
    unlink(path);
    write_file(path, sizeof path, "short\n", 0600);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "line 1"));
    unlink(path);
    write_file(path, sizeof path, "# nothing but a comment\n\n", 0600);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "holds no key"));
    unlink(path);
    write_file(path, sizeof path,
               "0123456789abcdef0123456789abcdef1\n0123456789abcdef0123456789abcdef2\n"
               "0123456789abcdef0123456789abcdef3\n0123456789abcdef0123456789abcdef4\n"
               "0123456789abcdef0123456789abcdef5\n",
               0600);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    unlink(path);
    CHECK(a == NULL);
    /* Off unless asked for: "" and an unset env. */
    unsetenv(KVPI_AUTH_ENV);
    CHECK_OK(kvpi_auth_resolve(NULL, &a));
    CHECK(a == NULL);
    setenv(KVPI_AUTH_ENV, key1, 1);
    CHECK_OK(kvpi_auth_resolve("", &a));
    CHECK(a == NULL);
    CHECK_OK(kvpi_auth_resolve(NULL, &a));
    CHECK(a != NULL);
    kvpi_auth_free(a);
    unsetenv(KVPI_AUTH_ENV);
    /* An engine with an unusable key file does not start. */
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = "127.0.0.1:0";
    eo.metadata = "P2PHANDSHAKE";
    eo.auth_key_file = "/nonexistent/kvpipe.key";
    kvp_engine *e = NULL;
    CHECK_ST(kvp_engine_create(&eo, &e), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "/nonexistent/kvpipe.key"));
    drop_keys();
}

/* The rotation story: a process whose file holds (new, old) proves with new
 * and accepts both; one holding only old then still gets in, and signs
 * descriptors the other accepts. */
static void rotation(void)
{
    make_keys();
    char both[64];
    write_file(both, sizeof both,
               "fedcba9876543210fedcba9876543210-two\n0123456789abcdef0123456789abcdef-one\n",
               0600);
    kvpi_auth *old = load(key1), *rotated = load(both), *other = load(key2);
    REQUIRE(old && rotated && other);
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    pid_t pid = fork();
    if (pid == 0) _exit(kvpi_auth_server(rotated, sv[1], "tcp", kvpi_deadline_ns(WAIT_MS)));
    CHECK_OK(kvpi_auth_client(old, sv[0], "tcp", kvpi_deadline_ns(WAIT_MS)));
    CHECK(kvpt_wait_child(pid, WAIT_MS) == 0);
    char *signed_old = kvpi_auth_desc_sign(old, "{\"name\":\"h:1\"}");
    char *signed_new = kvpi_auth_desc_sign(rotated, "{\"name\":\"h:1\"}");
    CHECK_OK(kvpi_auth_desc_verify(rotated, signed_old, "h:1", 0));
    CHECK_OK(kvpi_auth_desc_verify(other, signed_new, "h:1", 0)); /* "two" is other's key */
    CHECK_ST(kvpi_auth_desc_verify(old, signed_new, "h:1", 0), KVP_EAUTH);
    free(signed_old);
    free(signed_new);
    close(sv[0]);
    close(sv[1]);
    unlink(both);
    kvpi_auth_free(old);
    kvpi_auth_free(rotated);
    kvpi_auth_free(other);
    drop_keys();
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
    make_keys();
    kvpi_auth *good = load(key1), *bad = load(key2);
    REQUIRE(good && bad);
    kvpt_target t;
    kvpt_target_opts o = {.len = LEN, .seed = SEED, .timeout_ms = 3000};
    char log[128];
    REQUIRE(start_target(&o, &t, key1, log, sizeof log) == 0);
    char shm_name[KVPI_SHM_SOCKET_MAX];
    REQUIRE(shm_socket_of(&t, good, shm_name, sizeof shm_name) == 0);
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
        setenv(KVPI_AUTH_ENV, key1, 1);
        CHECK_OK(kvp_info_segment("P2PHANDSHAKE", t.name, WAIT_MS, &desc, &host));
        unsetenv(KVPI_AUTH_ENV);
        CHECK(desc && strstr(desc, "\"buffers\""));
        free(desc);
        free(host);
    }
    /* Engines: with the key through tcp and shm; without it, or with another. */
    kvp_engine *tcp = initiator("P2PHANDSHAKE", key1, 1, 0);
    kvp_engine *shm = initiator("P2PHANDSHAKE", key1, 0, 0);
    kvp_engine *none = initiator("P2PHANDSHAKE", "", 1, 0);
    kvp_engine *other = initiator("P2PHANDSHAKE", key2, 1, 0);
    REQUIRE(tcp && shm && none && other);
    CHECK(read_ok(tcp, t.name, &t, "tcp"));
    CHECK(read_ok(shm, t.name, &t, "shm"));
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
    int data_lines = count_lines(log, "tcp data server");
    CHECK(count_lines(log, "refused a connection") >= 3);
    CHECK(data_lines >= 1 && data_lines <= 3);
    keep_log_if_failed(log);
    kvpi_auth_free(good);
    kvpi_auth_free(bad);
    drop_keys();
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
    make_keys();
    kvpi_auth *good = load(key1);
    REQUIRE(good);
    kvpt_target t;
    kvpt_target_opts o = {.len = LEN, .seed = SEED, .disable_shm = 1};
    char log[128];
    REQUIRE(start_target(&o, &t, key1, log, sizeof log) == 0);
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
    kvp_engine *e = initiator("P2PHANDSHAKE", key1, 1, 0);
    REQUIRE(e);
    CHECK(read_ok(e, t.name, &t, "tcp"));
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    CHECK(count_lines(log, "replayed handshake") >= 1);
    unlink(log);
    kvpi_auth_free(good);
    drop_keys();
}

/* -------------------------------------------------------- descriptors --- */

typedef struct store {
    kvpt_server srv;
    void *raw; /* kvpi_store_http handle */
} store;

static char *store_get(store *s, const char *kind, const char *segment)
{
    char *key = kvpi_meta_key(kind, segment), *val = NULL;
    if (key && kvpi_store_http.get(s->raw, key, &val) != KVP_OK) val = NULL;
    free(key);
    return val;
}

static int store_put(store *s, const char *kind, const char *segment, const char *value)
{
    char *key = kvpi_meta_key(kind, segment);
    kvpi_store_http.del(s->raw, key);
    int rc = key && kvpi_store_http.put(s->raw, key, value) == KVP_OK ? 0 : -1;
    free(key);
    return rc;
}

/* A copy of text with the first `from` replaced by `to`. */
static char *replace(const char *text, const char *from, const char *to)
{
    const char *at = strstr(text, from);
    if (!at) return NULL;
    size_t n = strlen(text) - strlen(from) + strlen(to) + 1;
    char *out = malloc(n);
    snprintf(out, n, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    return out;
}

/* Put bad under the target's descriptor key and open the segment with an
 * authenticated initiator at once: refused, with want in the message. The
 * keeper may put the genuine one back before the lookup; then try again. */
static void refused_then_repaired(store *s, const kvpt_target *t, const char *bad, const char *want,
                                  const kvpi_auth *good)
{
    int refused = 0;
    for (int attempt = 0; attempt < 3 && !refused; attempt++) {
        REQUIRE(store_put(s, "ram", t->name, bad) == 0);
        kvp_engine *e = initiator(s->srv.conn, key1, 1, 0);
        REQUIRE(e);
        kvp_segment_id seg;
        kvp_status st = kvp_engine_open_segment(e, t->name, &seg);
        char *now = store_get(s, "ram", t->name);
        if (st == KVP_EAUTH) {
            refused = 1;
            CHECK(strstr(kvp_last_error(), t->name) && strstr(kvp_last_error(), want));
            if (!strstr(kvp_last_error(), want)) fprintf(stderr, "  got: %s\n", kvp_last_error());
        } else if (now && strcmp(now, bad) == 0) {
            fprintf(stderr, "  %s descriptor accepted: %s\n", want, kvp_strerror(st));
            kvpt_failures++;
            refused = 1;
        }
        free(now);
        kvp_engine_destroy(e);
    }
    CHECK(refused);
    /* The keeper (every 2 s) puts the genuine descriptor back. */
    uint64_t deadline = kvpi_now_ms() + WAIT_MS;
    int repaired = 0;
    while (!repaired && kvpi_now_ms() < deadline) {
        char *now = store_get(s, "ram", t->name);
        repaired = now && kvpi_auth_desc_verify(good, now, t->name, 0) == KVP_OK &&
                   strstr(now, "\"tcp_data_port\"");
        free(now);
        if (!repaired) usleep(100000);
    }
    CHECK(repaired);
    kvp_engine *e = initiator(s->srv.conn, key1, 1, 0);
    REQUIRE(e);
    CHECK(read_ok(e, t->name, t, "tcp"));
    kvp_engine_destroy(e);
}

static void descriptors_refused_and_repaired(void)
{
    make_keys();
    kvpi_auth *good = load(key1);
    REQUIRE(good);
    store s;
    REQUIRE(kvpt_http_start(&s.srv) == KVPT_SERVER_OK);
    REQUIRE(kvpi_store_http.open(s.srv.conn, 3000, &s.raw) == KVP_OK);
    kvpt_target t;
    kvpt_target_opts o = {.metadata = s.srv.conn, .len = LEN, .seed = SEED, .disable_shm = 1};
    char log[128];
    REQUIRE(start_target(&o, &t, key1, log, sizeof log) == 0);
    char *genuine = store_get(&s, "ram", t.name);
    REQUIRE(genuine);
    CHECK_OK(kvpi_auth_desc_verify(good, genuine, t.name, 0));

    /* Forged: the genuine descriptor, its data port redirected. */
    char port[32], fake[32];
    snprintf(port, sizeof port, "\"tcp_data_port\":%d", t.data_port);
    snprintf(fake, sizeof fake, "\"tcp_data_port\":%d", t.data_port == 1 ? 2 : 1);
    char *forged = replace(genuine, port, fake);
    REQUIRE(forged);
    refused_then_repaired(&s, &t, forged, "forged", good);
    /* Garbage. */
    refused_then_repaired(&s, &t, "{\"name\":\"x\",\"kvpipe_auth\":{\"ts\":\"no\"}}", "garbage",
                          good);
    /* Unsigned: what a Mooncake engine (or kvpipe without the key) writes. */
    char *field = strstr(genuine, ",\"kvpipe_auth\"");
    REQUIRE(field);
    char *unsigned_desc = strdup(genuine);
    strcpy(unsigned_desc + (field - genuine), "}");
    refused_then_repaired(&s, &t, unsigned_desc, "unsigned", good);
    /* Moved: a genuine descriptor under another segment's key. */
    char other[64];
    snprintf(other, sizeof other, "127.0.0.1:%d", kvpt_free_port());
    REQUIRE(store_put(&s, "ram", other, genuine) == 0);
    REQUIRE(store_put(&s, "rpc_meta", other,
                      "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":1}") == 0);
    kvp_engine *e = initiator(s.srv.conn, key1, 1, 0);
    REQUIRE(e);
    kvp_segment_id seg;
    CHECK_ST(kvp_engine_open_segment(e, other, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "names another segment"));
    kvp_engine_destroy(e);
    /* Stale: older than the initiator accepts (the target signs anew only
     * every 30 s with the default age). */
    usleep(1500 * 1000);
    e = initiator(s.srv.conn, key1, 1, 1000);
    REQUIRE(e);
    CHECK_ST(kvp_engine_open_segment(e, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "stale") && strstr(kvp_last_error(), t.name));
    kvp_engine_destroy(e);
    /* rpc_meta pointed elsewhere: put back too. */
    REQUIRE(store_put(&s, "rpc_meta", t.name,
                      "{\"ip_or_host_name\":\"127.0.0.1\",\"rpc_port\":1}") == 0);
    uint64_t deadline = kvpi_now_ms() + WAIT_MS;
    int back = 0;
    while (!back && kvpi_now_ms() < deadline) {
        char *rpc = store_get(&s, "rpc_meta", t.name);
        char want[32];
        snprintf(want, sizeof want, "%d", t.rpc_port);
        back = rpc && strstr(rpc, want);
        free(rpc);
        if (!back) usleep(100000);
    }
    CHECK(back);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    CHECK(count_lines(log, "putting the genuine one back") >= 1);
    unlink(log);
    free(genuine);
    free(forged);
    free(unsigned_desc);
    kvpi_store_http.close(s.raw);
    kvpt_server_down(&s.srv);
    kvpi_auth_free(good);
    drop_keys();
}

/* An authenticated initiator and a target without the key (a Mooncake
 * engine, as far as the wire goes): refused before any byte moves. */
static void unauthenticated_target_refused(void)
{
    make_keys();
    store s;
    REQUIRE(kvpt_http_start(&s.srv) == KVPT_SERVER_OK);
    kvpt_target t;
    kvpt_target_opts o = {.metadata = s.srv.conn, .len = LEN, .seed = SEED, .disable_shm = 1};
    char log[128];
    REQUIRE(start_target(&o, &t, NULL, log, sizeof log) == 0);
    kvp_engine *e = initiator(s.srv.conn, key1, 1, 0);
    REQUIRE(e);
    kvp_segment_id seg;
    CHECK_ST(kvp_engine_open_segment(e, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "unsigned") && strstr(kvp_last_error(), t.name));
    kvp_engine_destroy(e);
    /* P2P: the target's handshake port does not answer the auth hello. */
    e = initiator("P2PHANDSHAKE", key1, 1, 0);
    REQUIRE(e);
    CHECK_ST(kvp_engine_open_segment(e, t.name, &seg), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "not an authenticated kvpipe peer"));
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    unlink(log);
    kvpt_server_down(&s.srv);
    drop_keys();
}

/* ---------------------------------------------------------------- ucx --- */

#if KVP_HAVE_UCX
/* A stranger on the target's UCX worker: a UCP worker of our own that speaks
 * the ucx transport's control messages by hand (ucx_internal.h), so that the
 * test sees every byte the target answers. */
typedef struct raw_msg {
    unsigned id;
    size_t len;
    uint8_t data[4096];
} raw_msg;

typedef struct raw_ucx {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_ep_h ep;
    raw_msg got[8];
    int n_got;
    struct raw_handler {
        struct raw_ucx *r;
        unsigned id;
    } h[8];
} raw_ucx;

static ucs_status_t raw_recv(void *arg, const void *header, size_t header_length, void *data,
                             size_t length, const ucp_am_recv_param_t *param)
{
    (void)header, (void)header_length, (void)param;
    struct raw_handler *h = arg;
    raw_ucx *r = h->r;
    if (r->n_got < 8 && length <= sizeof r->got[0].data) {
        r->got[r->n_got].id = h->id;
        r->got[r->n_got].len = length;
        memcpy(r->got[r->n_got].data, data, length);
        r->n_got++;
    }
    return UCS_OK;
}

static void raw_failed(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)arg, (void)ep, (void)st;
}

/* A worker with an endpoint to the target's worker (hex, from its descriptor). */
static int raw_open(raw_ucx *r, const char *worker_hex)
{
    memset(r, 0, sizeof *r);
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_AM | UCP_FEATURE_RMA};
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) return -1;
    const char *tls = getenv("UCX_TLS");
    if (tls && strstr(tls, "sm")) ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y");
    ucs_status_t st = ucp_init(&p, cfg, &r->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) return -1;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(r->ctx, &wp, &r->w) != UCS_OK) return -1;
    for (unsigned id = 1; id < 8; id++) {
        r->h[id] = (struct raw_handler){r, id};
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
            .id = id,
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = raw_recv,
            .arg = &r->h[id]};
        if (ucp_worker_set_am_recv_handler(r->w, &hp) != UCS_OK) return -1;
    }
    void *addr;
    size_t len;
    if (kvpi_ucx_unhex(worker_hex, &addr, &len) != KVP_OK) return -1;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = raw_failed}};
    st = ucp_ep_create(r->w, &ep, &r->ep);
    free(addr);
    return st == UCS_OK ? 0 : -1;
}

static void raw_close(raw_ucx *r)
{
    if (r->ep) kvpi_ucx_ep_close_force(r->ep);
    if (r->w) {
        for (int i = 0; i < 100; i++)
            ucp_worker_progress(r->w);
        ucp_worker_destroy(r->w);
    }
    if (r->ctx) ucp_cleanup(r->ctx);
}

/* Progress until a message of id arrived (its index) or ms passed (-1). */
static int raw_wait(raw_ucx *r, unsigned id, int ms)
{
    uint64_t deadline = kvpi_deadline_ns(ms);
    int seen = 0;
    while (kvpi_now_ns() < deadline) {
        ucp_worker_progress(r->w);
        for (; seen < r->n_got; seen++)
            if (r->got[seen].id == id) return seen;
        usleep(100);
    }
    return -1;
}

static void raw_send(raw_ucx *r, unsigned id, const void *msg, size_t len)
{
    CHECK_OK(kvpi_ucx_am_send(r->ep, id, msg, len, UCP_AM_SEND_FLAG_REPLY));
}

/* A HELLO of epoch 0 with our worker address; authenticated (flag set) with
 * kid and nc when kid is non-NULL. */
static void raw_hello(raw_ucx *r, const uint8_t *kid, const uint8_t *nc)
{
    ucp_address_t *addr;
    size_t len;
    REQUIRE(ucp_worker_get_address(r->w, &addr, &len) == UCS_OK);
    uint8_t msg[4096];
    size_t head = kid ? KVPI_UCX_HELLO_AUTH_LEN : KVPI_UCX_HELLO_LEN;
    REQUIRE(head + len <= sizeof msg);
    uint64_t flags = kid ? KVPI_UCX_HELLO_FLAG_AUTH : 0;
    kvpi_put_le64(msg, KVPI_UCX_MAGIC | (uint64_t)KVPI_UCX_VERSION << 32 | flags << 48);
    kvpi_put_le64(msg + 8, 0);
    if (kid) {
        memcpy(msg + KVPI_UCX_HELLO_LEN, kid, KVPI_AUTH_KID_LEN);
        memcpy(msg + KVPI_UCX_HELLO_LEN + KVPI_AUTH_KID_LEN, nc, KVPI_AUTH_NONCE_LEN);
    }
    memcpy(msg + head, addr, len);
    ucp_worker_release_address(r->w, addr);
    raw_send(r, KVPI_UCX_AM_HELLO, msg, head + len);
}

/* The status of a HELLO_ACK. */
static unsigned ack_status(const raw_msg *m)
{
    return (unsigned)(kvpi_get_le64(m->data) >> 32 & 0xffff);
}

/* The HELLO_ACK a stranger got is a bare refusal of status want: no
 * connection, no rkey (16 bytes, nothing after). */
static void refused_bare(raw_ucx *r, unsigned want)
{
    int i = raw_wait(r, KVPI_UCX_AM_HELLO_ACK, WAIT_MS);
    CHECK(i >= 0);
    if (i < 0) return;
    CHECK(ack_status(&r->got[i]) == want);
    CHECK(r->got[i].len == KVPI_UCX_HELLO_ACK_LEN);
    if (ack_status(&r->got[i]) != want)
        fprintf(stderr, "  HELLO_ACK status %u, want %u\n", ack_status(&r->got[i]), want);
}

/* The target's descriptor, asked for with the key; its worker address. */
static cJSON *ucx_desc(const kvpt_target *t, const kvpi_auth *a, char *worker, size_t len)
{
    char *reply = NULL;
    if (kvpi_rpc_call_auth("127.0.0.1", t->rpc_port, a, KVPI_RPC_METADATA, "{}", WAIT_MS, &reply) !=
        KVP_OK)
        return NULL;
    cJSON *d = cJSON_Parse(reply);
    free(reply);
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(d, KVPI_UCX_FIELD);
    const cJSON *w = cJSON_GetObjectItemCaseSensitive(u, "worker");
    if (!cJSON_IsString(w)) {
        cJSON_Delete(d);
        return NULL;
    }
    snprintf(worker, len, "%s", w->valuestring);
    return d;
}

/* A challenge answered with the key: the CHALLENGE's MAC checks, and the
 * PROOF (written into proof) gets the rkeys. Returns the HELLO_ACK's index. */
static int raw_prove(raw_ucx *r, const kvpi_auth *a, const uint8_t *kid, const uint8_t *nc,
                     uint8_t chal[KVPI_UCX_CHALLENGE_LEN], uint8_t proof[KVPI_UCX_PROOF_LEN])
{
    raw_hello(r, kid, nc);
    int i = raw_wait(r, KVPI_UCX_AM_CHALLENGE, WAIT_MS);
    CHECK(i >= 0 && r->got[i].len == KVPI_UCX_CHALLENGE_LEN);
    if (i < 0 || r->got[i].len != KVPI_UCX_CHALLENGE_LEN) return -1;
    memcpy(chal, r->got[i].data, KVPI_UCX_CHALLENGE_LEN);
    const uint8_t *ns = chal + 16;
    CHECK(kvpi_auth_mac_check(a, kid, "server", "ucx", nc, ns, ns + KVPI_AUTH_NONCE_LEN) == 0);
    kvpi_put_le64(proof, KVPI_UCX_MAGIC);
    memcpy(proof + 8, chal + 8, 8);
    CHECK(kvpi_auth_mac(a, kid, "client", "ucx", nc, ns, proof + 16) == 0);
    raw_send(r, KVPI_UCX_AM_PROOF, proof, KVPI_UCX_PROOF_LEN);
    return raw_wait(r, KVPI_UCX_AM_HELLO_ACK, WAIT_MS);
}

/* Whether a HELLO_ACK holds an rkey entry for [addr, +len). */
static int ack_has_rkey(const raw_msg *m, uint64_t addr, uint64_t len)
{
    size_t n = (size_t)(kvpi_get_le64(m->data) >> 48);
    size_t at = KVPI_UCX_HELLO_ACK_LEN + 16 * n;
    if (at + 8 > m->len) return 0;
    uint64_t count = kvpi_get_le64(m->data + at);
    at += 8;
    for (uint64_t j = 0; j < count && at + 24 <= m->len; j++) {
        uint64_t klen = kvpi_get_le64(m->data + at + 16);
        if (kvpi_get_le64(m->data + at) == addr && kvpi_get_le64(m->data + at + 8) == len &&
            klen > 0)
            return 1;
        at += 24 + (klen + 7) / 8 * 8;
    }
    return 0;
}

/* The ucx transport of this process opened on the target's descriptor
 * directly (what an engine's lookup does once the descriptor passed), with
 * key a (NULL: none). */
static kvp_status ucx_peer_try(const cJSON *desc_json, const kvpi_auth *a, const char *segment)
{
    char *text = cJSON_PrintUnformatted(desc_json);
    kvpi_descriptor d;
    kvp_status st = text ? kvpi_descriptor_parse(text, &d) : KVP_ENOMEM;
    free(text);
    if (st) return st;
    kvpi_region_table regions;
    kvpi_region_table_init(&regions);
    kvpi_server_ctx sc = {.segment = "auth-test",
                          .host = "127.0.0.1",
                          .regions = &regions,
                          .timeout_ms = 3000,
                          .auth = a};
    void *server = NULL;
    if ((st = kvpi_transport_ucx.server_start(&sc, &server))) {
        kvpi_region_table_destroy(&regions);
        kvpi_descriptor_free(&d);
        return st;
    }
    kvpi_peer_ctx pc = {.segment = segment,
                        .host = "127.0.0.1",
                        .desc = d.json,
                        .regions = d.regions,
                        .buffers = d.buffers,
                        .n_regions = d.n_regions,
                        .server = server,
                        .timeout_ms = 3000,
                        .auth = a};
    void *peer = NULL;
    st = kvpi_transport_ucx.peer_open(&pc, &peer);
    char why[512];
    snprintf(why, sizeof why, "%s", kvp_last_error());
    if (peer) kvpi_transport_ucx.peer_close(peer);
    kvpi_transport_ucx.server_stop(server);
    kvpi_region_table_destroy(&regions);
    kvpi_descriptor_free(&d);
    if (st) kvpi_error(st, "%s", why);
    return st;
}

/* The ucx transport in the authenticated mode, on UCX's tcp or shared
 * memory: its descriptor carries no rkey; a stranger on its worker gets no
 * rkey without the key (a plain HELLO, a key it does not hold, a wrong
 * proof); a recorded proof replayed fails on the fresh nonce; our
 * transport without the key, or with another, is refused with KVP_EAUTH;
 * an engine with the key reads through ucx. */
static void ucx_refuses_strangers(const char *tls)
{
    if (!kvpi_transport_lookup("ucx")) SKIP("no ucx transport in this build");
    setenv("UCX_TLS", tls, 1); /* the target inherits it */
    make_keys();
    kvpi_auth *good = load(key1), *bad = load(key2);
    REQUIRE(good && bad);
    kvpt_target t;
    kvpt_target_opts o = {
        .protocol = "rdma", .len = LEN, .seed = SEED, .disable_shm = 1, .timeout_ms = 3000};
    char log[128];
    REQUIRE(start_target(&o, &t, key1, log, sizeof log) == 0);
    uint64_t addr = (uint64_t)(uintptr_t)t.buf;
    char worker[4096];
    cJSON *desc = ucx_desc(&t, good, worker, sizeof worker);
    REQUIRE(desc);
    /* The descriptor: the endpoint says it authenticates, no buffer has an rkey. */
    {
        char *text = cJSON_PrintUnformatted(desc);
        CHECK(text && strstr(text, "\"" KVPI_UCX_FIELD "\":{") && strstr(text, "\"auth\":true"));
        CHECK(text && !strstr(text, KVPI_UCX_RKEY_FIELD) && strstr(text, "\"buffers\""));
        free(text);
    }
    uint8_t kid[KVPI_AUTH_KID_LEN], bad_kid[KVPI_AUTH_KID_LEN], nc[KVPI_AUTH_NONCE_LEN];
    kvpi_auth_kid_bytes(good, kid);
    kvpi_auth_kid_bytes(bad, bad_kid);
    kvpi_auth_nonce(nc);
    raw_ucx r;
    /* A plain HELLO (kvpipe without the key, or an older one). */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, NULL, NULL);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_REQUIRED);
    raw_close(&r);
    /* A key the target does not hold. */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, bad_kid, nc);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_KEY);
    CHECK(raw_wait(&r, KVPI_UCX_AM_CHALLENGE, 0) < 0);
    raw_close(&r);
    /* The right key id, a proof that is not the key's. */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, kid, nc);
    int i = raw_wait(&r, KVPI_UCX_AM_CHALLENGE, WAIT_MS);
    REQUIRE(i >= 0);
    uint8_t forged[KVPI_UCX_PROOF_LEN];
    kvpi_put_le64(forged, KVPI_UCX_MAGIC);
    memcpy(forged + 8, r.got[i].data + 8, 8);
    kvpi_auth_nonce(forged + 16);
    raw_send(&r, KVPI_UCX_AM_PROOF, forged, sizeof forged);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_PROOF);
    raw_close(&r);
    /* With the key: the rkey of the buffer comes with the answer. */
    uint8_t chal[KVPI_UCX_CHALLENGE_LEN], proof[KVPI_UCX_PROOF_LEN];
    REQUIRE(raw_open(&r, worker) == 0);
    i = raw_prove(&r, good, kid, nc, chal, proof);
    CHECK(i >= 0 && ack_status(&r.got[i]) == KVPI_UCX_HELLO_OK);
    CHECK(i >= 0 && ack_has_rkey(&r.got[i], addr, LEN));
    raw_close(&r);
    /* That HELLO and PROOF replayed: a fresh nonce of the target's, so the
     * recorded proof (as recorded, and with the new challenge's id) fails. */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, kid, nc);
    i = raw_wait(&r, KVPI_UCX_AM_CHALLENGE, WAIT_MS);
    REQUIRE(i >= 0);
    CHECK(memcmp(r.got[i].data + 16, chal + 16, KVPI_AUTH_NONCE_LEN) != 0);
    raw_send(&r, KVPI_UCX_AM_PROOF, proof, sizeof proof);
    CHECK(raw_wait(&r, KVPI_UCX_AM_HELLO_ACK, 300) < 0); /* not its challenge: ignored */
    memcpy(proof + 8, r.got[i].data + 8, 8);
    raw_send(&r, KVPI_UCX_AM_PROOF, proof, sizeof proof);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_PROOF);
    raw_close(&r);
    /* Our own transport: without a key it says the segment is
     * authenticated; with another key the target refuses it. */
    CHECK_ST(ucx_peer_try(desc, NULL, t.name), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "is authenticated") && strstr(kvp_last_error(), t.name));
    CHECK_ST(ucx_peer_try(desc, bad, t.name), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "refused our key") && strstr(kvp_last_error(), t.name));
    CHECK_OK(ucx_peer_try(desc, good, t.name));
    /* Engines: with the key through ucx, and still after all that - with
     * the rkeys of a thousand regions in the HELLO's answer, more than an
     * eager message of UCX carries in one fragment. */
    for (int k = 0; k < 1000; k++)
        REQUIRE(kvpt_target_cmd(&t, KVPT_T_REGISTER, 4096, WAIT_MS) >= 0);
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    eo.local_server_name = name;
    eo.metadata = "P2PHANDSHAKE";
    eo.protocol = "rdma";
    eo.disable_shm = 1;
    eo.auth_key_file = key1;
    kvp_engine *e = NULL;
    REQUIRE_OK(kvp_engine_create(&eo, &e));
    CHECK(read_ok(e, t.name, &t, "ucx"));
    kvp_engine_destroy(e);
    cJSON_Delete(desc);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    /* Refusals logged, rate-limited: one line for the lot. */
    int lines = count_lines(log, "refused a connection");
    CHECK(lines >= 1 && lines <= 2);
    keep_log_if_failed(log);
    kvpi_auth_free(good);
    kvpi_auth_free(bad);
    drop_keys();
}

/* An impostor at the worker address an authenticated descriptor names
 * cannot pass as the target: it answers our HELLO with a CHALLENGE it
 * recorded from the genuine target, which fails on our fresh nonce; our
 * transport sends it no proof and fails with KVP_EAUTH. */
typedef struct open_run {
    const cJSON *desc;
    const kvpi_auth *auth;
    kvp_status st;
    char err[512];
    int done;
} open_run;

static void *open_main(void *arg)
{
    open_run *o = arg;
    o->st = ucx_peer_try(o->desc, o->auth, "impostor");
    snprintf(o->err, sizeof o->err, "%s", kvp_last_error());
    __atomic_store_n(&o->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void ucx_replayed_challenge_fails(const char *tls)
{
    if (!kvpi_transport_lookup("ucx")) SKIP("no ucx transport in this build");
    setenv("UCX_TLS", tls, 1);
    make_keys();
    kvpi_auth *good = load(key1);
    REQUIRE(good);
    kvpt_target t;
    kvpt_target_opts o = {.protocol = "rdma", .len = LEN, .seed = SEED, .disable_shm = 1};
    char log[128];
    REQUIRE(start_target(&o, &t, key1, log, sizeof log) == 0);
    char worker[4096];
    cJSON *desc = ucx_desc(&t, good, worker, sizeof worker);
    REQUIRE(desc);
    /* Record a genuine challenge. */
    uint8_t kid[KVPI_AUTH_KID_LEN], nc[KVPI_AUTH_NONCE_LEN];
    uint8_t chal[KVPI_UCX_CHALLENGE_LEN], proof[KVPI_UCX_PROOF_LEN];
    kvpi_auth_kid_bytes(good, kid);
    kvpi_auth_nonce(nc);
    raw_ucx r;
    REQUIRE(raw_open(&r, worker) == 0);
    CHECK(raw_prove(&r, good, kid, nc, chal, proof) >= 0);
    raw_close(&r);
    /* The impostor: a worker of ours, named in a copy of the descriptor. */
    raw_ucx imp;
    REQUIRE(raw_open(&imp, worker) == 0);
    ucp_address_t *addr;
    size_t len;
    REQUIRE(ucp_worker_get_address(imp.w, &addr, &len) == UCS_OK);
    char *hex = kvpi_ucx_hex(addr, len);
    ucp_worker_release_address(imp.w, addr);
    cJSON *fake = cJSON_Duplicate(desc, 1);
    cJSON *u = cJSON_GetObjectItemCaseSensitive(fake, KVPI_UCX_FIELD);
    cJSON_ReplaceItemInObjectCaseSensitive(u, "worker", cJSON_CreateString(hex));
    free(hex);
    open_run run = {.desc = fake, .auth = good};
    pthread_t th;
    pthread_create(&th, NULL, open_main, &run);
    int i = raw_wait(&imp, KVPI_UCX_AM_HELLO, WAIT_MS);
    REQUIRE(i >= 0 && imp.got[i].len > KVPI_UCX_HELLO_AUTH_LEN);
    const uint8_t *h = imp.got[i].data;
    CHECK(kvpi_get_le64(h) >> 48 & KVPI_UCX_HELLO_FLAG_AUTH);
    CHECK(memcmp(h + KVPI_UCX_HELLO_LEN + KVPI_AUTH_KID_LEN, nc, KVPI_AUTH_NONCE_LEN) != 0);
    /* Answer on an endpoint back to the initiator's worker. */
    ucp_ep_h back;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = (const ucp_address_t *)(h + KVPI_UCX_HELLO_AUTH_LEN),
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = raw_failed}};
    REQUIRE(ucp_ep_create(imp.w, &ep, &back) == UCS_OK);
    CHECK_OK(kvpi_ucx_am_send(back, KVPI_UCX_AM_CHALLENGE, chal, sizeof chal, 0));
    uint64_t deadline = kvpi_deadline_ns(WAIT_MS);
    while (!__atomic_load_n(&run.done, __ATOMIC_ACQUIRE) && kvpi_now_ns() < deadline) {
        ucp_worker_progress(imp.w);
        usleep(100);
    }
    pthread_join(th, NULL);
    CHECK(run.st == KVP_EAUTH && strstr(run.err, "failed to prove"));
    if (run.st != KVP_EAUTH) fprintf(stderr, "  impostor: %s\n", run.err);
    for (int k = 0; k < 50; k++) /* whatever else came in */
        ucp_worker_progress(imp.w);
    CHECK(raw_wait(&imp, KVPI_UCX_AM_PROOF, 0) < 0); /* no proof went to it */
    kvpi_ucx_ep_close_force(back);
    raw_close(&imp);
    cJSON_Delete(fake);
    cJSON_Delete(desc);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    unlink(log);
    kvpi_auth_free(good);
    drop_keys();
}

static void ucx_tcp_refuses_strangers(void)
{
    ucx_refuses_strangers("tcp");
}

static void ucx_sm_refuses_strangers(void)
{
    ucx_refuses_strangers("sm,self");
}

static void ucx_tcp_replayed_challenge_fails(void)
{
    ucx_replayed_challenge_fails("tcp");
}

static void ucx_sm_replayed_challenge_fails(void)
{
    ucx_replayed_challenge_fails("sm,self");
}
#endif

/* A transport that does not declare KVPI_CAP_AUTH is not run in the
 * authenticated mode: the engine leaves it out of its descriptor, so no peer
 * without the key finds a way in through it. Every transport built
 * authenticates, so shown with a copy of the shm transport's table without
 * the flag. */
static int describes(const kvpi_transport_ops *const *list, const char *key, const char *field)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = "127.0.0.1:0";
    eo.metadata = "P2PHANDSHAKE";
    eo.auth_key_file = key;
    kvp_engine *e = NULL;
    if (kvpi_engine_create_with(&eo, list, &e) != KVP_OK) {
        fprintf(stderr, "  engine: %s\n", kvp_last_error());
        return -1;
    }
    static char buf[4096];
    kvpi_auth *a = *key ? load(key) : NULL;
    char *reply = NULL;
    kvp_status st = kvp_engine_register(e, buf, sizeof buf);
    if (!st)
        st = kvpi_rpc_call_auth("127.0.0.1", kvp_engine_rpc_port(e), a, KVPI_RPC_METADATA, "{}",
                                WAIT_MS, &reply);
    int has = !st && reply && strstr(reply, "\"buffers\"") ? strstr(reply, field) != NULL : -1;
    free(reply);
    kvpi_auth_free(a);
    kvp_engine_destroy(e);
    return has;
}

static void unauthenticated_transport_left_out(void)
{
    make_keys();
    kvpi_transport_ops plain = kvpi_transport_shm;
    plain.caps &= ~KVPI_CAP_AUTH;
    const kvpi_transport_ops *with[] = {&kvpi_transport_tcp, &kvpi_transport_shm, NULL};
    const kvpi_transport_ops *without[] = {&kvpi_transport_tcp, &plain, NULL};
    const char *field = "\"" KVPI_SHM_FIELD "\"";
    CHECK(describes(with, key1, field) == 1);
    CHECK(describes(without, "", field) == 1);
    CHECK(describes(without, key1, field) == 0);
    drop_keys();
}

int main(void)
{
    unsetenv(KVPI_AUTH_ENV);
    RUN(key_files);
    RUN(rotation);
    RUN(listeners_refuse_strangers);
    RUN(replay_fails);
    RUN(descriptors_refused_and_repaired);
    RUN(unauthenticated_target_refused);
    RUN(unauthenticated_transport_left_out);
#if KVP_HAVE_UCX
    RUN(ucx_tcp_refuses_strangers);
    RUN(ucx_sm_refuses_strangers);
    RUN(ucx_tcp_replayed_challenge_fails);
    RUN(ucx_sm_replayed_challenge_fails);
#endif
    return kvpt_summary();
}
