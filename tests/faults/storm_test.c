/* The stranger storm (issue 35): every listener kvpipe runs keeps serving its
 * real peers while 500 strangers hammer it, with authentication off and on.
 *
 * A case runs its listener's real traffic twice in one run, first alone,
 * then while a storm process (a child of the case) holds 500 connections to
 * the listener: a quarter half-open (connected, silent), a quarter trickling
 * a request's first bytes one a second, a quarter sending garbage, a quarter
 * failing the authentication handshake (a wrong key id or a wrong proof on
 * the engine's listeners, a CURVE handshake with a wrong server key on the
 * pipe's ZeroMQ ports; without authentication, more garbage). Each stranger
 * the listener closes comes back after REOPEN_MS, so the storm never lets up;
 * it is bounded in count (500 connections at a time) and in time (it dies
 * with its case), and runs on loopback only.
 *
 * The real traffic and its listener:
 *   tcp_data     64 KiB READs from a target engine in another process
 *   rpc          send_probe handshakes (a fresh connection each) to it
 *   shm          64 KiB READs over shm, storm on the shm socket
 *   http_store   GETs of a key from `kvpipe metadata-server`
 *   metrics      GETs of an engine's /metrics, each on a fresh connection
 *   pipe         64 KiB tensors through a pipe pair (two processes), storm
 *                on all four ZeroMQ ports
 * A case passes when every operation of both runs completed with the right
 * bytes and the storm's p99 latency is within 2x of the quiet run's (the
 * quiet p99 taken as at least FLOOR_MS, so that a sub-millisecond p99 does
 * not turn scheduler noise into failures); both are printed.
 *
 * pipe_auth_ten is the issue's acceptance loop: an authenticated pipe pair
 * delivers 10 of 10 tensors at once (within ONCE_MS) in each of 50 runs,
 * every other one with a refused stranger connected to each of the four
 * ZeroMQ ports. */
#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/auth.h"
#include "common/clock.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"
#include "transport/shm_internal.h"

#define STRANGERS 500
#define REOPEN_MS 1000 /* a stranger the listener closed comes back after this */
#define TRICKLE_MS 1000
#define OPS 300      /* timed operations alone, and as many beside the storm */
#define ROUNDS 3     /* alternations of the two: OPS / ROUNDS each */
#define WARMUP 10    /* untimed operations before a case's first */
#define PACE_US 3000 /* between operations: connections idle meanwhile, as a server's */
#define FLOOR_MS 2.0 /* the quiet p99 counts as at least this */
#define ONCE_MS 1000 /* "at once": 10 tensors within this */
#define SEED 0x570e
#define MIB ((size_t)1 << 20)
#define MSG_BYTES ((size_t)64 << 10)

/* ------------------------------------------------------------ the storm --- */

enum kind { HALF_OPEN, TRICKLE, GARBAGE, AUTH_FAIL, KINDS };

typedef struct storm {
    int ports[4]; /* TCP ports on 127.0.0.1 */
    int n_ports;
    char unix_name[KVPI_SHM_SOCKET_MAX]; /* or an abstract Unix socket */
    int zmq;                             /* the ports are a pipe's ZeroMQ ports */
    int auth;                            /* authentication on: AUTH_FAIL strangers */
    uint8_t kid[KVPI_AUTH_KID_LEN];      /* the real key id, for wrong proofs */
    const char *prefix;                  /* what a trickler trickles */
    int zmq_only; /* only one refused libzmq stranger per port (pipe_auth_ten) */
} storm;

typedef struct stranger {
    int fd;
    enum kind kind;
    int target;         /* which port */
    uint64_t reopen_at; /* closed: reopen then */
    size_t sent;        /* of the prefix */
    uint64_t next_byte; /* tricklers */
    int proved;         /* AUTH_FAIL with the real key id: proof sent */
} stranger;

static int connect_nb(const storm *s, int target)
{
    int fd;
    if (s->unix_name[0]) {
        struct sockaddr_un sa;
        socklen_t len = kvpi_shm_sockaddr(s->unix_name, &sa);
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, len) != 0 && errno != EINPROGRESS &&
            errno != EAGAIN) {
            close(fd);
            return -1;
        }
        return fd;
    }
    struct sockaddr_in to = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)s->ports[target % s->n_ports])};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&to, sizeof to) != 0 && errno != EINPROGRESS) {
        close(fd);
        return -1;
    }
    return fd;
}

static void put(int fd, const void *buf, size_t len)
{
    if (send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
    }
}

/* A KVPAUTH1 HELLO (common/auth.h): a random key id, or the real one (whose
 * CHAL then gets a wrong proof). */
static void auth_hello(int fd, const storm *s, int real_kid)
{
    uint8_t h[8 + KVPI_AUTH_KID_LEN + 8 + KVPI_AUTH_NONCE_LEN] = "KVPAUTH1";
    if (real_kid)
        memcpy(h + 8, s->kid, KVPI_AUTH_KID_LEN);
    else if (getrandom(h + 8, KVPI_AUTH_KID_LEN, 0) < 0)
        memset(h + 8, 0x5a, KVPI_AUTH_KID_LEN);
    h[8 + KVPI_AUTH_KID_LEN] = 0xff;
    if (getrandom(h + 16 + KVPI_AUTH_KID_LEN, KVPI_AUTH_NONCE_LEN, 0) < 0)
        memset(h + 16 + KVPI_AUTH_KID_LEN, 0xa5, KVPI_AUTH_NONCE_LEN);
    put(fd, h, sizeof h);
}

static void opened(stranger *x, const storm *s, int i, uint64_t now)
{
    x->sent = 0;
    x->proved = 0;
    x->next_byte = now + TRICKLE_MS;
    if (x->kind == GARBAGE || (x->kind == AUTH_FAIL && !s->auth)) {
        uint8_t junk[256];
        if (getrandom(junk, sizeof junk, 0) < 0) memset(junk, 0xee, sizeof junk);
        put(x->fd, junk, sizeof junk);
    } else if (x->kind == AUTH_FAIL) {
        auth_hello(x->fd, s, i & 4);
    }
}

/* Read what the listener sent: 0 while open, -1 once it closed. */
static int drain(stranger *x)
{
    uint8_t buf[4096];
    for (;;) {
        ssize_t n = recv(x->fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n == 0) return -1;
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOTCONN ? 0 : -1;
        if (x->kind == AUTH_FAIL && !x->proved) {
            /* The CHAL to our real key id: a wrong proof. */
            uint8_t mac[KVPI_AUTH_MAC_LEN];
            memset(mac, 0x42, sizeof mac);
            put(x->fd, mac, sizeof mac);
            x->proved = 1;
        }
    }
}

/* libzmq strangers failing CURVE again and again (libzmq redials them), in a
 * context of their own that lives as long as the process that calls this
 * (the storm's, never one that forks real peers afterwards: see
 * storm_peer_main()). 0, or -1 when a socket could not be made. */
static int zmq_strangers(const storm *s, int n)
{
    void *ctx = zmq_ctx_new();
    if (!ctx) return -1;
    zmq_ctx_set(ctx, ZMQ_MAX_SOCKETS, n + 16);
    char pub[41], sec[41], spub[41], ssec[41];
    for (int i = 0; i < n; i++) {
        void *x = zmq_socket(ctx, i & 1 ? ZMQ_PULL : ZMQ_PUSH);
        if (!x) return -1;
        zmq_curve_keypair(pub, sec);
        zmq_curve_keypair(spub, ssec);
        int ivl = REOPEN_MS, zero = 0;
        zmq_setsockopt(x, ZMQ_CURVE_SERVERKEY, spub, 40);
        zmq_setsockopt(x, ZMQ_CURVE_PUBLICKEY, pub, 40);
        zmq_setsockopt(x, ZMQ_CURVE_SECRETKEY, sec, 40);
        zmq_setsockopt(x, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
        zmq_setsockopt(x, ZMQ_LINGER, &zero, sizeof zero);
        char ep[64];
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", s->ports[i % s->n_ports]);
        zmq_connect(x, ep);
    }
    return 0;
}

static void storm_main(const storm *s, int ready_fd)
{
    alarm(600); /* bounded even if the case forgets it */
    if (s->zmq_only) {
        if (zmq_strangers(s, s->n_ports) != 0 || write(ready_fd, "R", 1) != 1) _exit(2);
        for (;;)
            pause();
    }
    /* The strangers take what CPU is left (see favoured()). */
    if (setpriority(PRIO_PROCESS, 0, 19) != 0) {
    }
    signal(SIGPIPE, SIG_IGN);
    int n = STRANGERS, n_zmq = 0;
    if (s->zmq && s->auth) n_zmq = STRANGERS / KINDS, n -= n_zmq;
    stranger *xs = calloc((size_t)n, sizeof *xs);
    if (!xs) _exit(2);
    if (n_zmq && zmq_strangers(s, n_zmq) != 0) _exit(2);
    uint64_t now = kvpi_now_ms();
    for (int i = 0; i < n; i++) {
        xs[i].kind = (enum kind)(i % (n_zmq ? KINDS - 1 : KINDS));
        xs[i].target = i / KINDS;
        xs[i].fd = connect_nb(s, xs[i].target);
        if (xs[i].fd < 0)
            xs[i].reopen_at = now + REOPEN_MS;
        else
            opened(&xs[i], s, i, now);
    }
    if (write(ready_fd, "R", 1) != 1) _exit(2);
    close(ready_fd);
    struct pollfd *p = calloc((size_t)n, sizeof *p);
    if (!p) _exit(2);
    for (;;) {
        for (int i = 0; i < n; i++)
            p[i] = (struct pollfd){.fd = xs[i].fd, .events = POLLIN};
        poll(p, (nfds_t)n, 100);
        now = kvpi_now_ms();
        for (int i = 0; i < n; i++) {
            stranger *x = &xs[i];
            if (x->fd < 0) {
                if (now < x->reopen_at) continue;
                if ((x->fd = connect_nb(s, x->target)) >= 0)
                    opened(x, s, i, now);
                else
                    x->reopen_at = now + REOPEN_MS;
                continue;
            }
            if (p[i].revents && drain(x) < 0) {
                close(x->fd);
                x->fd = -1;
                x->reopen_at = now + REOPEN_MS;
                continue;
            }
            if (x->kind == TRICKLE && now >= x->next_byte) {
                const char *pre = s->prefix ? s->prefix : "";
                size_t len = strlen(pre);
                put(x->fd, x->sent < len ? pre + x->sent : "\0", 1);
                x->sent++;
                x->next_byte = now + TRICKLE_MS;
            }
        }
    }
}

/* The storm runs in a fresh exec of this program: the case that starts it
 * runs threads (an engine's, ZeroMQ's), and a bare fork of it can inherit a
 * lock one of them held (ASan's allocator's among them) and hang. The storm
 * comes over the command channel, its prefix after it. */
static void storm_peer_main(int cmd, int resp)
{
    storm s;
    static char prefix[256];
    uint32_t len = 0;
    if (kvpt_read_full(cmd, &s, sizeof s, 10000) != 0 ||
        kvpt_read_full(cmd, &len, sizeof len, 10000) != 0 || len >= sizeof prefix ||
        kvpt_read_full(cmd, prefix, len, 10000) != 0)
        _exit(2);
    s.prefix = len ? prefix : NULL;
    storm_main(&s, resp);
}
KVPT_PEER_KIND("storm", storm_peer_main)

/* Start the storm; returns once its connections are open: 0, or -1. */
static int storm_start(const storm *s, kvpt_peer *p)
{
    if (kvpt_raise_nofile(4096) != 0 || kvpt_peer_exec(p, NULL, "storm", NULL, NULL) != 0)
        return -1;
    uint32_t len = s->prefix ? (uint32_t)strlen(s->prefix) : 0;
    char ready;
    if (kvpt_peer_send(p, s, sizeof *s) != 0 || kvpt_peer_send(p, &len, sizeof len) != 0 ||
        kvpt_peer_send(p, s->prefix ? s->prefix : "", len) != 0 ||
        kvpt_peer_recv(p, &ready, 1, 30000) != 0) {
        kvpt_peer_kill(p);
        return -1;
    }
    if (!s->zmq_only) usleep(500 * 1000); /* the listener takes them in */
    return 0;
}

static void storm_stop(kvpt_peer *p)
{
    if (p->pid > 0) kvpt_peer_kill(p);
}

/* ---------------------------------------------------------- measuring --- */

/* The case and the real peers it forks run at nice -20 where allowed
 * (root, as in CI), the storm at nice 19: the comparison is of what the
 * listener does with strangers, which runs in the real peers' processes at
 * their priority, not of what the machine's other tenants (tests beside
 * this one, the strangers' own process, which a real attacker runs
 * elsewhere) take from the CPU. Without the privilege it runs as it is.
 * (Not a real-time class: libraries' spinlocks, UCX's memory hooks among
 * them, livelock between SCHED_FIFO threads of one priority.) */
static void favoured(void)
{
    if (setpriority(PRIO_PROCESS, 0, -20) != 0)
        fprintf(stderr, "  (not favoured: %s; other load may weigh on the latencies)\n",
                strerror(errno));
}
static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The p-th percentile of n latencies (sorts them). */
static double pct(double *ms, int n, int p)
{
    if (n <= 0) return 0;
    qsort(ms, (size_t)n, sizeof *ms, cmp_double);
    return ms[(n * p + 99) / 100 - 1];
}

/* One operation of a case's real traffic: 0 when it completed right. */
typedef int (*op_fn)(void *ctx, int i);

/* n operations from first, PACE_US apart, their latencies in ms. */
static int run_ops(op_fn op, void *ctx, int first, int n, double *ms)
{
    int failed = 0;
    for (int i = first; i < first + n; i++) {
        usleep(PACE_US);
        uint64_t t0 = kvpi_now_ns();
        if (op(ctx, i) != 0) failed++;
        ms[i - first] = (double)(kvpi_now_ns() - t0) / 1e6;
    }
    return failed;
}

/* The verdict on OPS operations alone and OPS beside the storm. A p99 over
 * the bound fails the case on its last try only; judge returns 1 then, so
 * that the caller measures again. A storm that stalls real peers does so on
 * every try; a neighbour's burst on a shared host (4.2 to 4.7 ms against
 * 4.0 once, in 3 of 11 cases of one clean-clone run) seldom twice. */
static int judge(const char *what, int failed_quiet, double *quiet, int failed_storm,
                 double *stormy, int last)
{
    double q = pct(quiet, OPS, 99), s = pct(stormy, OPS, 99);
    double bound = 2 * (q > FLOOR_MS ? q : FLOOR_MS);
    fprintf(stderr,
            "  %s: p99 %.3f ms alone, %.3f ms beside %d strangers (bound %.3f ms); p50 %.3f and "
            "%.3f ms, max %.3f and %.3f ms; %d + %d of %d operations failed\n",
            what, q, s, STRANGERS, bound, pct(quiet, OPS, 50), pct(stormy, OPS, 50), quiet[OPS - 1],
            stormy[OPS - 1], failed_quiet, failed_storm, OPS);
    CHECK(failed_quiet == 0);
    CHECK(failed_storm == 0);
    /* Under the sanitizers the storm is there for the errors and races it
     * may show: a p99 of a few milliseconds there is the sanitizer's own
     * slowness, uneven between threads (libzmq's and libmicrohttpd's run
     * uninstrumented), more than the listener's. Beside the storm, TSan
     * gave the pipe 2 to 6 times its p99 alone, and ASan the metadata
     * server and /metrics 4 and 3.5 times, with the machine quiet. The
     * normal build judges it. */
    if (KVPT_SANITIZED) {
        fprintf(stderr, "  (sanitizer build: the p99 is shown, not judged)\n");
        return 0;
    }
    if (s > bound && !last) {
        fprintf(stderr, "  over the bound: measured again\n");
        return 1;
    }
    CHECK(s <= bound);
    return 0;
}

/* The case's real traffic, alone and beside the storm s in turns (ROUNDS of
 * each, so that the machine's other load weighs on both alike), after
 * WARMUP untimed operations. */
/* The initiator engine of an engine case, whose retries count while the storm
 * blows (NULL: not an engine case). */
static kvp_engine *initiator;

/* Its pooled connections found closed by the listener so far (each made a
 * request retry on a new connection). */
static double retries_of(kvp_engine *e)
{
    kvp_metrics *m = NULL;
    double v = -1;
    if (e && kvp_engine_metrics(e, &m) == KVP_OK) {
        const kvp_metric *x = kvp_metrics_find(m, "kvpipe_engine_retries_total", NULL);
        if (x) v = x->value;
        kvp_metrics_free(m);
    }
    return v;
}

static void weather(const char *what, op_fn op, void *ctx, const storm *s)
{
    static double quiet[OPS], stormy[OPS];
    double retries = 0;
    for (int last = 0, again = 1; again; last++) {
        int fq = 0, fs = 0, n = OPS / ROUNDS, i = 0;
        for (int k = 0; k < WARMUP; k++)
            fq += op(ctx, i++) != 0;
        for (int r = 0; r < ROUNDS; r++) {
            fq += run_ops(op, ctx, i, n, quiet + r * n);
            i += n;
            kvpt_peer storm_peer;
            REQUIRE(storm_start(s, &storm_peer) == 0);
            double before = retries_of(initiator);
            fs += run_ops(op, ctx, i, n, stormy + r * n);
            retries += retries_of(initiator) - before;
            i += n;
            storm_stop(&storm_peer);
        }
        again = judge(what, fq, quiet, fs, stormy, last);
    }
    if (initiator) {
        /* A real peer's pooled connection, idle between its requests, is
         * never what a stranger displaces. */
        fprintf(stderr, "  pooled connections lost to the storm: %.0f\n", retries);
        CHECK(retries == 0);
    }
}

/* ------------------------------------------------- authentication on/off --- */

static char key_path[64];

/* Authentication on for this case and its children (KVPIPE_AUTH_KEY_FILE);
 * the key id in kid. */
static int auth_on(uint8_t kid[KVPI_AUTH_KID_LEN])
{
    snprintf(key_path, sizeof key_path, "/tmp/kvpt_storm_key_%d_XXXXXX", (int)getpid());
    int fd = mkstemp(key_path);
    static const char key[] = "storm-test-0123456789abcdef0123456789abcdef\n";
    int ok = fd >= 0 && write(fd, key, sizeof key - 1) == (ssize_t)(sizeof key - 1);
    if (fd >= 0) close(fd);
    if (!ok) return -1;
    setenv(KVPI_AUTH_ENV, key_path, 1);
    kvpi_auth *a = NULL;
    if (kvpi_auth_load(key_path, &a) != KVP_OK) return -1;
    kvpi_auth_kid_bytes(a, kid);
    kvpi_auth_free(a);
    return 0;
}

static void auth_off(void)
{
    if (key_path[0]) unlink(key_path);
    key_path[0] = '\0';
    unsetenv(KVPI_AUTH_ENV);
}

/* ------------------------------------------------ the engine's listeners --- */

typedef struct engine_traffic {
    kvp_engine *e;
    double retries; /* the initiator's pooled connections found closed, during the storms */
    kvp_segment_id seg;
    const kvpt_target *t;
    uint8_t buf[MSG_BYTES];
} engine_traffic;

static int read_op(void *ctx, int i)
{
    engine_traffic *x = ctx;
    size_t off = (size_t)(i % 48) * MSG_BYTES;
    if (kvp_engine_read(x->e, x->seg, x->buf, (uint64_t)(uintptr_t)x->t->buf + off, MSG_BYTES) !=
        KVP_OK) {
        fprintf(stderr, "  READ %d: %s\n", i, kvp_last_error());
        return -1;
    }
    return kvpt_verify(x->buf, MSG_BYTES, SEED + off) == (size_t)-1 ? 0 : -1;
}

static int probe_op(void *ctx, int i)
{
    engine_traffic *x = ctx;
    kvp_status st = kvp_engine_probe(x->e, x->t->name);
    if (st) fprintf(stderr, "  probe %d: %s\n", i, kvp_last_error());
    return st ? -1 : 0;
}

/* The target's shm socket, from its descriptor. */
static int shm_socket_of(const kvpt_target *t, char *name, size_t len)
{
    kvpi_auth *a = NULL;
    if (key_path[0] && kvpi_auth_load(key_path, &a) != KVP_OK) return -1;
    int rc = kvpt_target_shm_socket(t, a, name, len);
    kvpi_auth_free(a);
    return rc;
}

enum listener { TCP_DATA, RPC, SHM };

static void engine_case(enum listener which, int authenticated)
{
    favoured();
    storm s = {.auth = authenticated};
    if (authenticated) REQUIRE(auth_on(s.kid) == 0);
    kvpt_target t;
    kvpt_target_opts o = {.len = 4 * MIB, .seed = SEED, .disable_shm = which != SHM};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    static engine_traffic x;
    x.t = &t;
    REQUIRE(kvpt_initiator_start(NULL, which == SHM ? "shm" : "tcp", which != SHM, 0, &x.e) == 0);
    REQUIRE_OK(kvp_engine_open_segment(x.e, t.name, &x.seg));
    initiator = which == RPC ? NULL : x.e;
    const char *what = "tcp data listener";
    if (which == TCP_DATA) {
        s.ports[s.n_ports++] = t.data_port;
    } else if (which == RPC) {
        s.ports[s.n_ports++] = t.rpc_port;
        what = "handshake listener";
    } else {
        REQUIRE(shm_socket_of(&t, s.unix_name, sizeof s.unix_name) == 0);
        what = "shm socket";
    }
    weather(what, which == RPC ? probe_op : read_op, &x, &s);
    kvp_engine_destroy(x.e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    auth_off();
}

static void tcp_data(void)
{
    engine_case(TCP_DATA, 0);
}
static void tcp_data_auth(void)
{
    engine_case(TCP_DATA, 1);
}
static void rpc(void)
{
    engine_case(RPC, 0);
}
static void rpc_auth(void)
{
    engine_case(RPC, 1);
}
static void shm(void)
{
    engine_case(SHM, 0);
}
static void shm_auth(void)
{
    engine_case(SHM, 1);
}

/* ------------------------------------------------- the HTTP listeners --- */

typedef struct http_traffic {
    char url[128];
    const char *want; /* the body's start */
} http_traffic;

static size_t keep(char *data, size_t size, size_t n, void *user)
{
    char *got = user;
    size_t have = strlen(got), take = size * n;
    if (have + take > 255) take = 255 - have;
    memcpy(got + have, data, take);
    got[have + take] = '\0';
    return size * n;
}

/* A GET on a fresh connection (a new client each time). */
static int get_op(void *ctx, int i)
{
    http_traffic *x = ctx;
    char got[256] = "";
    CURL *c = curl_easy_init();
    if (!c) return -1;
    curl_easy_setopt(c, CURLOPT_URL, x->url);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 5000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_FORBID_REUSE, 1L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, keep);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, got);
    long status = 0;
    CURLcode rc = curl_easy_perform(c);
    if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    if (status == 200 && strncmp(got, x->want, strlen(x->want)) == 0) return 0;
    fprintf(stderr, "  GET %d: %s, status %ld\n", i, curl_easy_strerror(rc), status);
    return -1;
}

static const char HTTP_PREFIX[] = "GET /metadata?key=slow HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";

static void http_store(void)
{
    favoured();
    kvpt_server srv;
    REQUIRE(kvpt_raise_nofile(4096) == 0); /* the store inherits it */
    REQUIRE(kvpt_http_cli_start(&srv, NULL) == KVPT_SERVER_OK);
    void *h = NULL;
    REQUIRE_OK(kvpi_store_http.open(srv.conn, 3000, &h));
    CHECK_OK(kvpi_store_http.put(h, "mooncake/ram/legit", "{\"ok\":true}"));
    kvpi_store_http.close(h);
    static http_traffic x = {.want = "{\"ok\":true}"};
    snprintf(x.url, sizeof x.url, "http://%s/metadata?key=mooncake/ram/legit", srv.addr);
    storm s = {.n_ports = 1, .ports = {srv.port}, .prefix = HTTP_PREFIX};
    weather("metadata server", get_op, &x, &s);
    kvpt_server_stop(&srv);
}

static void metrics(void)
{
    favoured();
    REQUIRE(kvpt_raise_nofile(4096) == 0);
    char name[64];
    kvp_engine_opts o;
    kvpt_engine_opts(&o, name);
    o.metrics_port = KVP_METRICS_PORT_ANY;
    kvp_engine *e = NULL;
    REQUIRE_OK(kvp_engine_create(&o, &e));
    static http_traffic x = {.want = "# HELP"};
    int port = kvp_engine_metrics_port(e);
    snprintf(x.url, sizeof x.url, "http://127.0.0.1:%d/metrics", port);
    storm s = {.n_ports = 1,
               .ports = {port},
               .prefix = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "};
    weather("metrics endpoint", get_op, &x, &s);
    kvp_engine_destroy(e);
}

/* ----------------------------------------------------------- the pipe --- */

/* Shared with both sides (made before the fork). */
typedef struct pipe_shared {
    volatile int go;   /* the sender may send block go - 1 (blocks alternate quiet, storm) */
    volatile int done; /* blocks the receiver has taken */
    double ms[2][OPS]; /* the receiver's latency of each tensor, quiet and beside the storm */
    volatile int failed[2];
} pipe_shared;

static pipe_shared *shared;
static const kvpt_pipe_row tcp_row = {"", "tcp", NULL};

/* The first 16 bytes: when it was sent and its number. */
static void stamp(kvp_tensor *t, int i)
{
    uint64_t w[2] = {kvpi_now_ns(), (uint64_t)i};
    memcpy(t->data, w, sizeof w);
}

static void wait_for(volatile int *v, int want)
{
    while (*v < want)
        usleep(1000);
}

/* Blocks of tensors: WARMUP first (block 0 sends them before its own), then
 * 2 * ROUNDS blocks of OPS / ROUNDS, each when the case says go. */
static int pipe_sender(kvp_pipe *p, int rank)
{
    (void)rank;
    static uint8_t data[MSG_BYTES];
    kvp_tensor t;
    int64_t shape[1] = {(int64_t)MSG_BYTES};
    if (kvp_tensor_init(&t, KVP_DTYPE_U8, 1, shape, data) != KVP_OK) return 1;
    int n = OPS / ROUNDS, i = 0;
    for (int b = 0; b < 2 * ROUNDS; b++) {
        wait_for(&shared->go, b + 1);
        for (int k = 0; k < n + (b ? 0 : WARMUP); k++, i++) {
            usleep(PACE_US);
            kvpt_fill(data, MSG_BYTES, SEED + (uint64_t)i);
            stamp(&t, i);
            CHECK_OK(kvp_pipe_send(p, &t));
        }
    }
    return 0;
}

static int pipe_receiver(kvp_pipe *p, int rank)
{
    (void)rank;
    int n = OPS / ROUNDS, i = 0;
    for (int b = 0; b < 2 * ROUNDS; b++) {
        int stormy = b & 1, warm = b ? 0 : WARMUP;
        for (int k = 0; k < n + warm; k++, i++) {
            kvp_tensor *t = NULL;
            kvp_status st = kvp_pipe_recv(p, 20000, &t);
            uint64_t now = kvpi_now_ns();
            if (st || !t || t->nbytes != MSG_BYTES) {
                fprintf(stderr, "  recv %d: %s\n", i, st ? kvp_last_error() : "wrong tensor");
                shared->failed[stormy]++;
                if (st) return 1;
                kvp_tensor_free(t);
                continue;
            }
            uint64_t w[2];
            memcpy(w, t->data, sizeof w);
            if (k >= warm) shared->ms[stormy][(b / 2) * n + k - warm] = (double)(now - w[0]) / 1e6;
            /* Past the stamp, the pattern of tensor i. */
            if (w[1] != (uint64_t)i || kvpt_verify((uint8_t *)t->data + 16, MSG_BYTES - 16,
                                                   SEED + (uint64_t)i + 16) != (size_t)-1)
                shared->failed[stormy]++;
            kvp_tensor_free(t);
        }
        shared->done = b + 1;
    }
    return 0;
}

/* One pipe case; *again set when judge asks for another try (not the last).
 * (REQUIRE returns from a void function, so the answer is an argument.) */
static void pipe_case(int authenticated, int last, int *again)
{
    *again = 0;
    favoured();
    storm s = {.auth = authenticated, .zmq = 1, .n_ports = 4};
    if (authenticated) REQUIRE(auth_on(s.kid) == 0);
    kvpt_row = &tcp_row;
    shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(shared != MAP_FAILED);
    memset(shared, 0, sizeof *shared);
    kvpt_pipe_setup ps;
    REQUIRE(kvpt_pipe_setup_make(&ps, 1) == 0);
    int offsets[4] = {9, 10, 109, 110};
    for (int i = 0; i < 4; i++)
        s.ports[i] = ps.base + offsets[i];
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    pid_t a = kvpt_pipe_spawn(&ps, 0, &o, pipe_sender);
    pid_t b = kvpt_pipe_spawn(&ps, 1, &o, pipe_receiver);
    int stormed = 1;
    for (int blk = 0; blk < 2 * ROUNDS; blk++) {
        kvpt_peer storm_peer = {.pid = -1};
        stormed &= !(blk & 1) || storm_start(&s, &storm_peer) == 0;
        shared->go = blk + 1;
        uint64_t t0 = kvpi_now_ms();
        while (shared->done <= blk && kvpi_now_ms() - t0 < 60000)
            usleep(2000);
        storm_stop(&storm_peer);
    }
    CHECK(stormed);
    CHECK(kvpt_wait_child(a, KVPT_SIDE_TIMEOUT) == 0);
    CHECK(kvpt_wait_child(b, KVPT_SIDE_TIMEOUT) == 0);
    *again = judge(authenticated ? "pipe (CURVE)" : "pipe", shared->failed[0], shared->ms[0],
                   shared->failed[1], shared->ms[1], last);
    munmap(shared, sizeof *shared);
    auth_off();
}

/* A pipe case, measured again once when its p99 is over the bound. */
static void pipe_tries(int authenticated)
{
    int again;
    pipe_case(authenticated, 0, &again);
    if (again) pipe_case(authenticated, 1, &again);
}
static void pipe_plain(void)
{
    pipe_tries(0);
}
static void pipe_auth(void)
{
    pipe_tries(1);
}

/* The issue's loop: 10 tensors back to back arrive at once, in 50 runs of an
 * authenticated pair, every other one with a refused stranger (a CURVE
 * client with a wrong server key) connected to each of the four ports. */
static int ten_sender(kvp_pipe *p, int rank)
{
    (void)rank;
    static uint8_t data[MSG_BYTES];
    kvp_tensor t;
    int64_t shape[1] = {(int64_t)MSG_BYTES};
    if (kvp_tensor_init(&t, KVP_DTYPE_U8, 1, shape, data) != KVP_OK) return 1;
    wait_for(&shared->go, 1);
    for (int i = 0; i < 10; i++)
        CHECK_OK(kvp_pipe_send(p, &t));
    return 0;
}

static int ten_receiver(kvp_pipe *p, int rank)
{
    (void)rank;
    shared->go = 1; /* open: the sender may go */
    uint64_t t0 = kvpi_now_ms();
    int got = 0;
    for (int i = 0; i < 10; i++) {
        kvp_tensor *t = NULL;
        if (kvp_pipe_recv(p, 10000, &t) != KVP_OK) break;
        if (kvpi_now_ms() - t0 <= ONCE_MS) got++;
        kvp_tensor_free(t);
    }
    shared->failed[0] = 10 - got;
    shared->ms[0][0] = (double)(kvpi_now_ms() - t0);
    return 0;
}

static void pipe_auth_ten(void)
{
    favoured();
    storm s = {.auth = 1, .zmq = 1, .n_ports = 4, .zmq_only = 1};
    REQUIRE(auth_on(s.kid) == 0);
    kvpt_row = &tcp_row;
    shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(shared != MAP_FAILED);
    int late_runs = 0;
    for (int run = 0; run < 50; run++) {
        memset(shared, 0, sizeof *shared);
        kvpt_pipe_setup ps;
        REQUIRE(kvpt_pipe_setup_make(&ps, 1) == 0);
        kvpt_peer zs = {.pid = -1};
        if (run & 1) {
            int offsets[4] = {9, 10, 109, 110};
            for (int i = 0; i < 4; i++)
                s.ports[i] = ps.base + offsets[i];
            REQUIRE(storm_start(&s, &zs) == 0);
        }
        kvp_pipe_opts o = kvpt_pipe_tcp_opts();
        pid_t a = kvpt_pipe_spawn(&ps, 0, &o, ten_sender);
        pid_t b = kvpt_pipe_spawn(&ps, 1, &o, ten_receiver);
        CHECK(kvpt_wait_child(a, 30000) == 0);
        CHECK(kvpt_wait_child(b, 30000) == 0);
        if (shared->failed[0]) {
            late_runs++;
            fprintf(stderr, "  run %d (%s): %d of 10 at once, the tenth after %.0f ms\n", run,
                    run & 1 ? "strangers" : "alone", 10 - shared->failed[0], shared->ms[0][0]);
        }
        storm_stop(&zs);
    }
    fprintf(stderr, "  50 runs, half with a refused stranger on each port: %d late\n", late_runs);
    CHECK(late_runs == 0);
    munmap(shared, sizeof *shared);
    auth_off();
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    RUN_T(tcp_data, 240);
    RUN_T(tcp_data_auth, 240);
    RUN_T(rpc, 240);
    RUN_T(rpc_auth, 240);
    RUN_T(shm, 240);
    RUN_T(shm_auth, 240);
    RUN_T(http_store, 240);
    RUN_T(metrics, 240);
    RUN_T(pipe_plain, 240);
    RUN_T(pipe_auth, 240);
    RUN_T(pipe_auth_ten, 300);
    return kvpt_summary();
}
