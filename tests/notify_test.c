/* Notifications (Mooncake's Notify frame, type 2) and probes (type 3):
 *  - across processes: a kvpipe initiator WRITEs, then notifies; the target,
 *    in its own process, finds the bytes in its memory when the notification
 *    arrives;
 *  - a raw socket sends the exact bytes a Mooncake initiator sends (jsoncpp's
 *    FastWriter text, newline included) to a kvpipe engine, and gets
 *    Mooncake's own success reply back;
 *  - the reverse: a kvpipe engine notifies and probes a raw server that
 *    frames and answers as Mooncake's SocketHandShakePlugin does;
 *  - the queue's bound: a notification past it is refused, nothing queued is
 *    dropped. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "test.h"

/* ---- a kvpipe target in a child process ---- */

#define ROUNDS 6
#define ORDER_LEN (16u << 20)

/* The target's process: register a fresh (zeroed) buffer, tell the parent its
 * address, then for each round wait for the notification "round-i" and check,
 * at that moment, that the round's bytes are in its memory. Writes one result
 * byte per round: 'y' (bytes in place) or 'n'. Exit status 0 when all were. */
static int target_main(int port, int to_parent, int from_parent)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", port);
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = name;
    eo.metadata = "P2PHANDSHAKE";
    eo.disable_shm = 1;
    kvp_engine *e;
    if (kvp_engine_create(&eo, &e)) return 2;
    uint8_t *buf = calloc(1, ORDER_LEN);
    if (!buf || kvp_engine_register(e, buf, ORDER_LEN)) return 3;
    uint64_t addr = (uint64_t)(uintptr_t)buf;
    if (write(to_parent, &addr, sizeof addr) != (ssize_t)sizeof addr) return 4;
    int bad = 0;
    for (int r = 0; r < ROUNDS; r++) {
        char want[32];
        snprintf(want, sizeof want, "round-%d", r);
        int got = 0;
        for (int waited = 0; !got && waited < 20000; waited++) {
            kvp_notify *list;
            size_t n;
            if (kvp_engine_get_notifies(e, &list, &n)) return 5;
            for (size_t i = 0; i < n; i++) {
                if (strcmp(list[i].name, want) != 0 || strcmp(list[i].msg, "kv in place") != 0)
                    continue;
                /* The check that matters: the bytes are here now. */
                got = kvpt_verify(buf, ORDER_LEN, 100 + (uint64_t)r) == (size_t)-1 ? 1 : -1;
            }
            kvp_engine_notifies_free(list, n);
            if (!got) usleep(1000);
        }
        char res = got == 1 ? 'y' : 'n';
        if (got != 1) bad = 1;
        if (write(to_parent, &res, 1) != 1) return 6;
        char go;
        if (read(from_parent, &go, 1) != 1) break;
    }
    kvp_engine_destroy(e);
    free(buf);
    return bad ? 1 : 0;
}

static void test_write_then_notify_across_processes(void)
{
    int up[2], down[2];
    REQUIRE(pipe(up) == 0 && pipe(down) == 0);
    int port = kvpt_free_port();
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        _exit(target_main(port, up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    uint64_t remote = 0;
    CHECK(read(up[0], &remote, sizeof remote) == (ssize_t)sizeof remote);
    kvp_engine *ini = NULL;
    uint8_t *src = malloc(ORDER_LEN);
    if (remote && src && kvpt_initiator_start(NULL, "tcp", 1, 0, &ini) == 0) {
        char target[64];
        snprintf(target, sizeof target, "127.0.0.1:%d", port);
        kvp_segment_id seg;
        CHECK_OK(kvp_engine_open_segment(ini, target, &seg));
        for (int r = 0; r < ROUNDS; r++) {
            kvpt_fill(src, ORDER_LEN, 100 + (uint64_t)r);
            CHECK_OK(kvp_engine_write(ini, seg, src, remote, ORDER_LEN));
            char name[32];
            snprintf(name, sizeof name, "round-%d", r);
            CHECK_OK(kvp_engine_notify(ini, seg, name, "kv in place"));
            char res = 0;
            CHECK(read(up[0], &res, 1) == 1);
            if (res != 'y') fprintf(stderr, "  round %d: the bytes were not in place\n", r);
            CHECK(res == 'y');
            CHECK(write(down[1], "g", 1) == 1);
        }
        /* Sent and acknowledged, as counted. */
        kvp_metrics *m;
        CHECK_OK(kvp_engine_metrics(ini, &m));
        kvp_metrics_free(m);
    } else {
        CHECK(!"initiator or buffer");
    }
    close(down[1]);
    CHECK(kvpt_wait_child(pid, 30000) == 0);
    close(up[0]);
    kvp_engine_destroy(ini);
    free(src);
}

/* ---- Mooncake's bytes to a kvpipe engine ---- */

/* What jsoncpp's FastWriter writes for Mooncake's NotifyDesc: members in key
 * order, no spaces, a newline at the end. */
static const char mc_notify[] = "{\"name\":\"mooncake-initiator\",\"notify_msg\":\"req 7 done\"}\n";

/* Send one frame of type with body on a fresh connection; return the reply's
 * type (-1 on failure) and its body in reply (malloc'ed). */
static int raw_exchange(int port, int type, const char *body, size_t len, char **reply)
{
    int fd = kvpt_raw_connect(port);
    if (fd < 0) return -1;
    uint8_t hdr[9];
    kvpi_put_le64(hdr, (uint64_t)len + 1);
    hdr[8] = (uint8_t)type;
    int got = -1;
    if (kvpi_send_all_by(fd, hdr, 9, kvpi_deadline_ns(3000)) ||
        kvpi_send_all_by(fd, body, len, kvpi_deadline_ns(3000)) ||
        kvpi_recv_all_by(fd, hdr, 9, kvpi_deadline_ns(3000)))
        goto out;
    uint64_t n = kvpi_get_le64(hdr);
    if (n == 0 || n > 4096) goto out;
    char *text = calloc(1, n);
    if (!text) goto out;
    if (kvpi_recv_all_by(fd, text, n - 1, kvpi_deadline_ns(3000))) {
        free(text);
        goto out;
    }
    *reply = text;
    got = hdr[8];
out:
    close(fd);
    return got;
}

static void test_mooncake_notify_frame_to_kvpipe(void)
{
    kvp_engine *e = NULL;
    REQUIRE(kvpt_initiator_start(NULL, "tcp", 1, 0, &e) == 0);
    char *reply = NULL;
    int type = raw_exchange(kvp_engine_rpc_port(e), 2, mc_notify, strlen(mc_notify), &reply);
    CHECK(type == 2);
    /* Mooncake's receivePeerNotify answer, which its sendNotify accepts. */
    CHECK(reply && strcmp(reply, "{\"name\":\"\",\"notify_msg\":\"success\"}") == 0);
    if (reply) fprintf(stderr, "  reply: %s\n", reply);
    free(reply);
    kvp_notify *list = NULL;
    size_t n = 0;
    CHECK_OK(kvp_engine_get_notifies(e, &list, &n));
    CHECK(n == 1);
    if (n == 1) {
        CHECK(strcmp(list[0].name, "mooncake-initiator") == 0);
        CHECK(strcmp(list[0].msg, "req 7 done") == 0);
    }
    kvp_engine_notifies_free(list, n);
    /* Taken: the queue is empty now. */
    CHECK_OK(kvp_engine_get_notifies(e, &list, &n));
    CHECK(n == 0 && list == NULL);
    /* A probe gets Mooncake's probe answer; nothing is queued. */
    reply = NULL;
    CHECK(raw_exchange(kvp_engine_rpc_port(e), 3, "{}\n", 3, &reply) == 3);
    CHECK(reply && strcmp(reply, "{\"status\":\"success\"}") == 0);
    free(reply);
    /* A notification that is not one is refused the way Mooncake's sender
     * reads a refusal (an empty notify_msg), and queues nothing. */
    reply = NULL;
    CHECK(raw_exchange(kvp_engine_rpc_port(e), 2, "[1,2]", 5, &reply) == 2);
    CHECK(reply && kvpi_rpc_notify_reply_check(reply) == KVP_EPROTO);
    CHECK(reply && strstr(reply, "\"notify_msg\":\"\""));
    free(reply);
    CHECK_OK(kvp_engine_get_notifies(e, &list, &n));
    CHECK(n == 0);
    kvp_engine_destroy(e);
}

/* ---- a raw server that frames and answers as Mooncake's ---- */

typedef struct mc_server {
    int rpc_fd, data_fd, rpc_port, data_port;
    const char *notify_reply; /* what it answers a Notify with */
    pthread_t thread;
    atomic_int stop;
    char notify_body[2048]; /* the last Notify's JSON, as received */
    atomic_int notifies, probes;
    int bad_frame; /* a length word that does not match what followed */
} mc_server;

static void *mc_main(void *arg)
{
    mc_server *s = arg;
    while (!atomic_load(&s->stop)) {
        struct pollfd p = {s->rpc_fd, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0) continue;
        int fd = accept(s->rpc_fd, NULL, NULL);
        if (fd < 0) continue;
        kvpi_socket_set_timeout(fd, 5000);
        uint8_t hdr[9];
        char body[2048], out[512];
        uint64_t n;
        if (kvpi_recv_all_by(fd, hdr, 9, kvpi_deadline_ns(5000)) || (n = kvpi_get_le64(hdr)) < 1 ||
            n > sizeof body || kvpi_recv_all_by(fd, body, n - 1, kvpi_deadline_ns(5000))) {
            s->bad_frame = 1;
            close(fd);
            continue;
        }
        body[n - 1] = '\0';
        int type = hdr[8];
        if (type == 1)
            snprintf(out, sizeof out,
                     "{\"buffers\":[],\"name\":\"127.0.0.1:%d\",\"protocol\":\"tcp\","
                     "\"tcp_data_port\":%d,\"tcp_proto_version\":2,\"timestamp\":\"1\"}\n",
                     s->rpc_port, s->data_port);
        else if (type == 2) {
            snprintf(s->notify_body, sizeof s->notify_body, "%s", body);
            atomic_fetch_add(&s->notifies, 1);
            snprintf(out, sizeof out, "%s", s->notify_reply);
        } else if (type == 3) {
            atomic_fetch_add(&s->probes, 1);
            snprintf(out, sizeof out, "{\"status\":\"success\"}\n");
        } else {
            snprintf(out, sizeof out, "{}\n");
        }
        size_t len = strlen(out);
        kvpi_put_le64(hdr, (uint64_t)len + 1);
        kvpi_send_all_by(fd, hdr, 9, kvpi_deadline_ns(3000));
        kvpi_send_all_by(fd, out, len, kvpi_deadline_ns(3000));
        /* As Mooncake: half-close, then wait for the client to close. */
        shutdown(fd, SHUT_WR);
        char b;
        (void)!read(fd, &b, 1);
        close(fd);
    }
    return NULL;
}

static int mc_start(mc_server *s, const char *notify_reply)
{
    memset(s, 0, sizeof *s);
    s->notify_reply = notify_reply;
    if (kvpi_tcp_listen("127.0.0.1", 0, &s->rpc_fd, &s->rpc_port) ||
        kvpi_tcp_listen("127.0.0.1", 0, &s->data_fd, &s->data_port))
        return -1;
    return pthread_create(&s->thread, NULL, mc_main, s) == 0 ? 0 : -1;
}

static void mc_stop(mc_server *s)
{
    atomic_store(&s->stop, 1);
    pthread_join(s->thread, NULL);
    close(s->rpc_fd);
    close(s->data_fd);
}

/* The fake server answering notifications with reply, and an initiator
 * with its segment (named peer) open as seg; -1 if either did not start. */
typedef struct mc_pair {
    mc_server s;
    char peer[64];
    kvp_engine *e;
    kvp_segment_id seg;
} mc_pair;

static int mc_pair_start(mc_pair *x, const char *reply)
{
    if (mc_start(&x->s, reply) != 0) return -1;
    snprintf(x->peer, sizeof x->peer, "127.0.0.1:%d", x->s.rpc_port);
    if (kvpt_initiator_start(NULL, "tcp", 1, 0, &x->e) != 0) {
        mc_stop(&x->s);
        return -1;
    }
    CHECK_OK(kvp_engine_open_segment(x->e, x->peer, &x->seg));
    return 0;
}

static void mc_pair_stop(mc_pair *x)
{
    kvp_engine_destroy(x->e);
    mc_stop(&x->s);
}

static void test_kvpipe_notify_to_mooncake_server(void)
{
    mc_pair x;
    REQUIRE(mc_pair_start(&x, "{\"name\":\"\",\"notify_msg\":\"success\"}\n") == 0);
    CHECK_OK(kvp_engine_notify(x.e, x.seg, "kvpipe-initiator", "blocks 3..9 \"written\""));
    CHECK(atomic_load(&x.s.notifies) == 1);
    CHECK(!x.s.bad_frame);
    /* Mooncake's decoder reads these two members as strings. */
    fprintf(stderr, "  received: %s\n", x.s.notify_body);
    CHECK(strcmp(x.s.notify_body, "{\"name\":\"kvpipe-initiator\",\"notify_msg\":\"blocks "
                                  "3..9 \\\"written\\\"\"}") == 0);
    /* A probe, as SGLang's send_probe: answered, and the session refreshed. */
    CHECK_OK(kvp_engine_probe(x.e, x.peer));
    CHECK(atomic_load(&x.s.probes) == 1);
    mc_pair_stop(&x);
}

static void test_refusal_from_mooncake_server(void)
{
    /* An empty notify_msg is a refusal to Mooncake's sender: to kvpipe's too. */
    mc_pair x;
    REQUIRE(mc_pair_start(&x, "{\"name\":\"\",\"notify_msg\":\"\"}\n") == 0);
    CHECK_ST(kvp_engine_notify(x.e, x.seg, "n", "m"), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "refused"));
    mc_pair_stop(&x);
    /* Nobody listening: the connection's error, at once. */
    kvp_engine *e = NULL;
    CHECK_ST(kvpt_initiator_start(NULL, "tcp", 1, 0, &e) == 0 ? kvp_engine_probe(e, "127.0.0.1:1")
                                                              : KVP_EIO,
             KVP_ECONNREFUSED);
    kvp_engine_destroy(e);
}

/* ---- the bound ---- */

static void test_queue_bound_refuses_and_keeps(void)
{
    kvp_engine *a = NULL, *b = NULL;
    REQUIRE(kvpt_initiator_start(NULL, "tcp", 1, 0, &a) == 0);
    if (kvpt_initiator_start(NULL, "tcp", 1, 0, &b) != 0) {
        kvp_engine_destroy(a);
        REQUIRE(!"second engine");
    }
    kvp_segment_id seg;
    CHECK_OK(kvp_engine_open_segment(a, kvp_engine_segment_name(b), &seg));
    size_t big = 1000000;
    char *msg = malloc(big + 1);
    REQUIRE(msg);
    memset(msg, 'k', big);
    msg[big] = '\0';
    /* 67 such messages fit in KVP_NOTIFY_QUEUE_MAX_BYTES, the 68th does not. */
    size_t fit = KVP_NOTIFY_QUEUE_MAX_BYTES / (big + 3);
    for (size_t i = 0; i < fit; i++) {
        char name[16];
        snprintf(name, sizeof name, "n%zu", i);
        kvp_status st = kvp_engine_notify(a, seg, name, msg);
        if (st) {
            CHECK_OK(st);
            break;
        }
    }
    CHECK_ST(kvp_engine_notify(a, seg, "one-too-many", msg), KVP_EBUSY);
    CHECK(strstr(kvp_last_error(), "nobody collected"));
    /* Small ones still fit the count but not the bytes: refused too. */
    kvp_notify *list = NULL;
    size_t n = 0;
    CHECK_OK(kvp_engine_get_notifies(b, &list, &n));
    CHECK(n == fit);
    if (n == fit) {
        CHECK(strcmp(list[0].name, "n0") == 0); /* nothing queued was dropped */
        CHECK(strcmp(list[n - 1].name, "one-too-many") != 0);
    }
    kvp_engine_notifies_free(list, n);
    /* Drained: taken again. */
    CHECK_OK(kvp_engine_notify(a, seg, "after", "drain"));
    CHECK_OK(kvp_engine_get_notifies(b, &list, &n));
    CHECK(n == 1 && strcmp(list[0].name, "after") == 0);
    kvp_engine_notifies_free(list, n);
    /* Bad arguments. */
    CHECK_ST(kvp_engine_notify(a, 999, "x", "y"), KVP_EINVAL);
    CHECK_ST(kvp_engine_notify(a, seg, NULL, "y"), KVP_EINVAL);
    CHECK_ST(kvp_engine_get_notifies(b, NULL, &n), KVP_EINVAL);
    free(msg);
    kvp_engine_destroy(a);
    kvp_engine_destroy(b);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(test_write_then_notify_across_processes, 120);
    RUN(test_mooncake_notify_frame_to_kvpipe);
    RUN(test_kvpipe_notify_to_mooncake_server);
    RUN(test_refusal_from_mooncake_server);
    RUN_T(test_queue_bound_refuses_and_keeps, 120);
    return kvpt_summary();
}
