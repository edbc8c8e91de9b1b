/* xpyd's worker (bench/xpyd.c runs it as --worker prefill|decode on a host of
 * its own): one engine process (pipe mode: one process holding one pipe per
 * peer) using the public kvpipe API, obeying the router's messages (xpyd.h)
 * over a socket pair: a thread per peer moves the requests, the main thread
 * answers stats and lookups. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench_util.h"
#include "common/clock.h"
#include "kvpipe/kvpipe.h"
#include "test.h"
#include "xpyd.h"

/* ------------------------------------------------------------- patterns --- */

/* The first 8 bytes are the request id; the rest a pattern of the request
 * and the offset (tests/support kvpt_fill). */
static uint64_t seed_of(uint64_t req)
{
    return (req + 1) << 40;
}

static void fill_block(void *buf, size_t len, uint64_t req)
{
    memcpy(buf, &req, 8);
    kvpt_fill((char *)buf + 8, len - 8, seed_of(req));
}

/* 0 when buf holds request req; -2 when it holds another request (its id in
 * *got); -1 when a byte is wrong (its offset in *at). */
static int check_block(const void *buf, size_t len, uint64_t req, uint64_t *got, size_t *at)
{
    memcpy(got, buf, 8);
    if (*got != req) return -2;
    size_t bad = kvpt_verify((const char *)buf + 8, len - 8, seed_of(req));
    if (bad != (size_t)-1) {
        *at = bad + 8;
        return -1;
    }
    return 0;
}

/* --------------------------------------------------------------- worker --- */

typedef struct peer_worker {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    msg q[QCAP];
    int head, n, quit;
    int index;
    atomic_int abandon; /* pipe mode: fail what waits on this peer */
    kvp_segment_id seg;
    int seg_open;
    char seg_name[64];
    kvp_pipe *pipe;
    char *staging;
    /* pipe mode, decode: requests whose receive was given up (timed out,
     * or the prefill died while sending); their tensors may still arrive,
     * in order, before the next ones */
    uint64_t given_up[64];
    int n_given_up;
    uint64_t late;
} peer_worker;

static int was_given_up(peer_worker *p, uint64_t id)
{
    for (int i = 0; i < p->n_given_up; i++)
        if (p->given_up[i] == id) {
            p->given_up[i] = p->given_up[--p->n_given_up];
            return 1;
        }
    return 0;
}

static void give_up(peer_worker *p, uint64_t id)
{
    if (p->n_given_up == 64)
        memmove(p->given_up, p->given_up + 1, 63 * sizeof *p->given_up), p->n_given_up--;
    p->given_up[p->n_given_up++] = id;
}

static struct {
    int prefill; /* 1 prefill, 0 decode */
    int index, peers, ctl;
    char mode[8];
    char addr[32], etcd[64];
    char peer_addr[MAX_SIDE][32]; /* the other side's hosts */
    size_t slot_bytes, slots;
    int timeout_ms;
    kvp_engine *engine;
    char *region;
    pthread_mutex_t ctl_mu;
    peer_worker pw[MAX_SIDE];
} W = {.ctl_mu = PTHREAD_MUTEX_INITIALIZER};

void xpyd_send_msg(int fd, pthread_mutex_t *mu, const msg *m)
{
    if (mu) pthread_mutex_lock(mu);
    ssize_t r;
    do
        r = send(fd, m, sizeof *m, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    if (mu) pthread_mutex_unlock(mu);
}

static void reply(msg *m, int type, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void reply(msg *m, int type, int status, const char *fmt, ...)
{
    m->type = (uint32_t)type;
    m->status = status;
    m->err[0] = '\0';
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m->err, sizeof m->err, fmt, ap);
        va_end(ap);
    }
    xpyd_send_msg(W.ctl, &W.ctl_mu, m);
}

/* Open the peer's segment (once) and find its registered region. */
static kvp_status peer_region(peer_worker *p, const char *name, uint64_t *base)
{
    kvp_status st;
    if (!p->seg_open || strcmp(p->seg_name, name) != 0) {
        if ((st = kvp_engine_open_segment(W.engine, name, &p->seg))) return st;
        snprintf(p->seg_name, sizeof p->seg_name, "%s", name);
        p->seg_open = 1;
    }
    kvp_remote_buffer b[4];
    size_t count = 0;
    if ((st = kvp_engine_segment_buffers(W.engine, p->seg, b, 4, &count))) return st;
    if (count < 1) return KVP_ENOTFOUND;
    *base = b[0].addr;
    return KVP_OK;
}

static void verdict(msg *m, int rc, uint64_t got, size_t at, const char *who)
{
    if (rc == -2)
        reply(m, REP_DONE, -2, "%s: got request %llu where %llu was expected", who,
              (unsigned long long)got, (unsigned long long)m->req);
    else if (rc == -1)
        reply(m, REP_DONE, -1, "%s: request %llu: wrong byte at offset %zu", who,
              (unsigned long long)m->req, at);
    else
        reply(m, REP_DONE, 0, NULL);
}

static void run_cmd(peer_worker *p, msg *m)
{
    size_t len = (size_t)m->tokens * TOKEN_BYTES;
    uint64_t got = 0;
    size_t at = 0;
    kvp_status st;
    uint64_t base;
    switch (m->type) {
    case CMD_WRITE:
        fill_block(p->staging, len, m->req);
        st = peer_region(p, m->name, &base);
        if (!st)
            st = kvp_engine_write(W.engine, p->seg, p->staging, base + m->slot * W.slot_bytes, len);
        if (st)
            reply(m, REP_DONE, st, "WRITE to %s: %s: %s", m->name, kvp_strerror(st),
                  kvp_last_error());
        else
            reply(m, REP_DONE, 0, NULL);
        break;
    case CMD_FILL:
        fill_block(W.region + m->slot * W.slot_bytes, len, m->req);
        reply(m, REP_DONE, 0, NULL);
        break;
    case CMD_VERIFY: {
        int rc = check_block(W.region + m->slot * W.slot_bytes, len, m->req, &got, &at);
        verdict(m, rc, got, at, "decode");
        break;
    }
    case CMD_READ: {
        char *local = W.region + m->slot2 * W.slot_bytes;
        memset(local, 0, 8);
        st = peer_region(p, m->name, &base);
        if (!st) st = kvp_engine_read(W.engine, p->seg, local, base + m->slot * W.slot_bytes, len);
        if (st) {
            reply(m, REP_DONE, st, "READ from %s: %s: %s", m->name, kvp_strerror(st),
                  kvp_last_error());
            break;
        }
        verdict(m, check_block(local, len, m->req, &got, &at), got, at, "decode");
        break;
    }
    case CMD_PSEND: {
        int64_t shape[2] = {m->tokens, TOKEN_ELEMS};
        kvp_tensor *t = NULL;
        st = kvp_pipe_tensor_alloc(p->pipe, KVP_DTYPE_BF16, 2, shape, &t);
        if (!st) {
            fill_block(t->data, t->nbytes, m->req);
            st = kvp_pipe_send_take(p->pipe, t);
            if (st) kvp_tensor_free(t);
        }
        if (st)
            reply(m, REP_DONE, st, "send to decode %u: %s: %s", p->index, kvp_strerror(st),
                  kvp_last_error());
        else
            reply(m, REP_DONE, 0, NULL);
        break;
    }
    case CMD_PRECV: {
        kvp_tensor *t = NULL;
        uint64_t deadline = kvpi_now_ms() + (uint64_t)W.timeout_ms * 4;
        int rc;
        for (;;) {
            if (atomic_load(&p->abandon)) {
                /* Its tensor may still come (the prefill can die between
                 * its send and its reply): late, like a timed-out one's. */
                give_up(p, m->req);
                reply(m, REP_DONE, KVP_ECANCELED, "receive from %s: prefill %u is gone",
                      p->seg_name, p->index);
                return;
            }
            st = kvp_pipe_recv(p->pipe, 200, &t);
            /* recv's own wait ran out, nothing consumed (pipe.h), as
             * against a message whose READ timed out, which is consumed:
             * that one is this request's, lost with an error. */
            const char *e = st == KVP_ETIMEDOUT ? kvp_last_error() : "";
            /* a READ running is bounded by the engine's deadlines */
            if (strstr(e, "nothing consumed")) continue;
            if (strstr(e, "nothing announced") && kvpi_now_ms() <= deadline) continue;
            if (st) break;
            if (!t || t->dtype != KVP_DTYPE_BF16 || t->ndim != 2 || t->shape[1] != TOKEN_ELEMS ||
                t->nbytes < 8) {
                rc = -1;
                at = 0;
            } else {
                rc = check_block(t->data, t->nbytes, m->req, &got, &at);
                if (rc == 0 && t->shape[0] != m->tokens) rc = -1;
            }
            /* A tensor of a request given up earlier arrives late, in its
             * place in the order: drop it and take the next. */
            if (rc == -2 && got < m->req && was_given_up(p, got)) {
                p->late++;
                kvp_tensor_free(t);
                t = NULL;
                continue;
            }
            break;
        }
        if (st) {
            give_up(p, m->req);
            reply(m, REP_DONE, st, "receive from %s: %s: %s", p->seg_name, kvp_strerror(st),
                  kvp_last_error());
            break;
        }
        kvp_tensor_free(t);
        verdict(m, rc, got, at, "decode");
        break;
    }
    case CMD_GIVEUP:
        give_up(p, m->req);
        break;
    default:
        break;
    }
}

static void *peer_main(void *arg)
{
    peer_worker *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->n && !p->quit)
            pthread_cond_wait(&p->cv, &p->mu);
        if (!p->n) break;
        msg m = p->q[p->head];
        p->head = (p->head + 1) % QCAP;
        p->n--;
        pthread_mutex_unlock(&p->mu);
        run_cmd(p, &m);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void enqueue(peer_worker *p, const msg *m)
{
    pthread_mutex_lock(&p->mu);
    if (p->n < QCAP) {
        p->q[(p->head + p->n) % QCAP] = *m;
        p->n++;
        pthread_cond_signal(&p->cv);
        pthread_mutex_unlock(&p->mu);
        return;
    }
    pthread_mutex_unlock(&p->mu);
    msg r = *m;
    reply(&r, REP_DONE, KVP_EBUSY, "worker queue full");
}

/* TCP sockets in this namespace in state st (/proc/net/tcp's hex code: "01"
 * ESTABLISHED, "06" TIME_WAIT): this engine's own, as it is alone on its host
 * (its metadata store client's included). */
static int64_t count_tcp(const char *state)
{
    int64_t n = 0;
    const char *files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(files[i], "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            char st[8];
            if (sscanf(line, "%*s %*s %*s %7s", st) == 1 && strcmp(st, state) == 0) n++;
        }
        if (f) fclose(f);
    }
    return n;
}

static int64_t peak_rss_kib(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int64_t v = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %" SCNd64, &v) == 1) break;
    if (f) fclose(f);
    return v;
}

static double metric(kvp_metrics *m, const char *name)
{
    const kvp_metric *x = m ? kvp_metrics_find(m, name, NULL) : NULL;
    return x ? x->value : 0;
}

static int64_t count_lookups(void)
{
    double n = 0;
    const char *name = "kvpipe_engine_descriptor_lookups_total";
    kvp_metrics *m = NULL;
    if (W.engine && kvp_engine_metrics(W.engine, &m) == KVP_OK) n += metric(m, name);
    kvp_metrics_free(m);
    for (int i = 0; i < W.peers; i++) {
        m = NULL;
        if (W.pw[i].pipe && kvp_pipe_metrics(W.pw[i].pipe, &m) == KVP_OK) n += metric(m, name);
        kvp_metrics_free(m);
    }
    return (int64_t)n;
}

typedef struct lookup_job {
    msg m;
} lookup_job;

static void *lookup_main(void *arg)
{
    lookup_job *j = arg;
    uint64_t t0 = kvpi_now_ms();
    kvp_status st = kvp_engine_probe(W.engine, j->m.name);
    j->m.elapsed_ms = kvpi_now_ms() - t0;
    if (st)
        reply(&j->m, REP_LOOKUP, st, "probe %s: %s: %s", j->m.name, kvp_strerror(st),
              kvp_last_error());
    else
        reply(&j->m, REP_LOOKUP, 0, NULL);
    free(j);
    return NULL;
}

static int worker_setup(char *why, size_t len)
{
    char self[64], meta[96];
    snprintf(self, sizeof self, "%s:%d", W.addr, ENGINE_PORT);
    snprintf(meta, sizeof meta, "etcd://%s", W.etcd);
    kvp_status st = KVP_OK;
    if (strcmp(W.mode, "pipe") != 0) {
        kvp_engine_opts o;
        kvp_engine_opts_init(&o);
        o.local_server_name = self;
        o.metadata = meta;
        o.protocol = "tcp";
        o.timeout_ms = W.timeout_ms;
        o.disable_shm = 1;
        /* etcd may still be electing itself. */
        for (int tries = 0; tries < 50; tries++) {
            if ((st = kvp_engine_create(&o, &W.engine)) == KVP_OK) break;
            usleep(200000);
        }
        if (st) {
            snprintf(why, len, "engine %s: %s: %s", self, kvp_strerror(st), kvp_last_error());
            return -1;
        }
        int need_region = !W.prefill || strcmp(W.mode, "read") == 0;
        if (need_region) {
            size_t bytes = W.slots * W.slot_bytes;
            /* populated now, not at the first requests' cost */
            W.region = mmap(NULL, bytes, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
            if (W.region == MAP_FAILED) {
                snprintf(why, len, "mmap %zu bytes: %s", bytes, strerror(errno));
                return -1;
            }
            if ((st = kvp_engine_register(W.engine, W.region, bytes))) {
                snprintf(why, len, "register: %s: %s", kvp_strerror(st), kvp_last_error());
                return -1;
            }
        }
    }
    for (int i = 0; i < W.peers; i++) {
        peer_worker *p = &W.pw[i];
        p->index = i;
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        if (W.prefill && strcmp(W.mode, "write") == 0) {
            if (!(p->staging = malloc(W.slot_bytes))) {
                snprintf(why, len, "out of memory");
                return -1;
            }
            memset(p->staging, 0, W.slot_bytes); /* touched before the clock runs */
        }
        if (strcmp(W.mode, "pipe") == 0) {
            /* Pair (p, d): the prefill listens on PIPE_PORT + 200 d, the
             * decode on PIPE_PORT + 200 p, each on its own host. */
            char own[64], peer[64];
            snprintf(own, sizeof own, "%s:%d", W.addr, PIPE_PORT + 200 * i);
            snprintf(peer, sizeof peer, "%s:%d", W.peer_addr[i], PIPE_PORT + 200 * W.index);
            kvp_pipe_config cfg = {.prefill_url = W.prefill ? own : peer,
                                   .decode_url = W.prefill ? peer : own,
                                   .metadata_server = meta,
                                   .protocol = "tcp",
                                   .device_name = "",
                                   .auth_key_file = ""};
            kvp_pipe_opts po;
            kvp_pipe_opts_init(&po);
            po.io_timeout_ms = W.timeout_ms;
            po.disable_shm = 1;
            po.inline_max_bytes = 0; /* every tensor by READ, as MooncakePipe */
            for (int tries = 0; tries < 50; tries++) {
                if ((st = kvp_pipe_open(&cfg, 0, W.prefill ? 0 : 1, &po, &p->pipe)) == KVP_OK)
                    break;
                usleep(200000);
            }
            if (st) {
                snprintf(why, len, "pipe %s -> %s: %s: %s", own, peer, kvp_strerror(st),
                         kvp_last_error());
                return -1;
            }
            snprintf(p->seg_name, sizeof p->seg_name, "%s", peer);
        }
        pthread_create(&p->thread, NULL, peer_main, p);
    }
    return 0;
}

static void worker_quit(void)
{
    for (int i = 0; i < W.peers; i++) {
        peer_worker *p = &W.pw[i];
        pthread_mutex_lock(&p->mu);
        p->quit = 1;
        pthread_cond_signal(&p->cv);
        pthread_mutex_unlock(&p->mu);
        pthread_join(p->thread, NULL);
        if (p->pipe) {
            kvp_pipe_flush(p->pipe, 2000);
            kvp_pipe_close(p->pipe);
        }
        free(p->staging);
    }
    kvp_engine_destroy(W.engine);
}

static int worker_main(void)
{
    dup2(1, 2); /* one log per worker */
    setvbuf(stdout, NULL, _IOLBF, 0);
    msg m = {0};
    char why[ERR_LEN];
    if (worker_setup(why, sizeof why) != 0) {
        fprintf(stderr, "xpyd worker: %s\n", why);
        reply(&m, REP_READY, -1, "%s", why);
        return 1;
    }
    if (strcmp(W.mode, "pipe") == 0)
        snprintf(m.name, sizeof m.name, "%s (pipes)", W.addr);
    else
        snprintf(m.name, sizeof m.name, "%s:%d", W.addr, ENGINE_PORT);
    reply(&m, REP_READY, 0, NULL);
    for (;;) {
        ssize_t r = recv(W.ctl, &m, sizeof m, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r != (ssize_t)sizeof m) _exit(r == 0 ? 0 : 1); /* the router is gone */
        switch (m.type) {
        case CMD_STATS:
            m.conns = count_tcp("01");
            m.time_wait = count_tcp("06");
            m.fds = kvpt_count_fds();
            m.lookups = count_lookups();
            m.rss_kib = peak_rss_kib();
            reply(&m, REP_STATS, 0, NULL);
            break;
        case CMD_QUIT:
            worker_quit();
            return 0;
        case CMD_ABANDON: /* slot 1: the peer is back */
            if (m.peer < (uint32_t)W.peers) atomic_store(&W.pw[m.peer].abandon, m.slot ? 0 : 1);
            break;
        case CMD_LOOKUP: {
            lookup_job *j = malloc(sizeof *j);
            pthread_t t;
            if (!j) break;
            j->m = m;
            if (pthread_create(&t, NULL, lookup_main, j) == 0)
                pthread_detach(t);
            else
                free(j);
            break;
        }
        default:
            if (m.peer < (uint32_t)W.peers)
                enqueue(&W.pw[m.peer], &m);
            else
                reply(&m, REP_DONE, KVP_EINVAL, "no peer %u", m.peer);
        }
    }
}

int xpyd_worker(int argc, char **argv)
{
    const char *role = NULL, *peer_addrs = NULL, *mode = "write", *addr = "", *etcd = "";
    const bench_opt lo[] = {{"worker", BENCH_STR, &role},
                            {"index", BENCH_INT, &W.index},
                            {"ctl", BENCH_INT, &W.ctl},
                            {"addr", BENCH_STR, &addr},
                            {"etcd", BENCH_STR, &etcd},
                            {"peers", BENCH_INT, &W.peers},
                            {"peer-addrs", BENCH_STR, &peer_addrs},
                            {"slot-bytes", BENCH_SIZE, &W.slot_bytes},
                            {"slots", BENCH_SIZE, &W.slots},
                            {"timeout-ms", BENCH_INT, &W.timeout_ms},
                            {"mode", BENCH_STR, &mode, 'm'}};
    if (bench_parse(argc, argv, lo, sizeof lo / sizeof lo[0])) return 2;
    snprintf(W.addr, sizeof W.addr, "%s", addr);
    snprintf(W.etcd, sizeof W.etcd, "%s", etcd);
    W.prefill = role && strcmp(role, "prefill") == 0;
    snprintf(W.mode, sizeof W.mode, "%s", mode);
    char list[MAX_SIDE * 32];
    snprintf(list, sizeof list, "%s", peer_addrs ? peer_addrs : "");
    char *save = NULL;
    int i = 0;
    for (char *t = strtok_r(list, ",", &save); t && i < MAX_SIDE; t = strtok_r(NULL, ",", &save))
        snprintf(W.peer_addr[i++], sizeof W.peer_addr[0], "%s", t);
    if (W.peers < 1 || W.peers > MAX_SIDE || i != W.peers) {
        fprintf(stderr, "xpyd worker: bad --peers/--peer-addrs\n");
        return 2;
    }
    return worker_main();
}
