/* The connection server: see conn_server.h for what it does and why.
 *
 * Locking: srv->lock guards the list of connections, the counts and the
 * statistics. A connection's state is atomic: its own thread moves it between
 * setup, idle, incomplete and busy without the lock; only the accepting
 * thread (under the lock) moves it to evicted, by compare-and-swap, so a
 * connection that has just become busy is never evicted. Connection threads
 * are detached; each unlinks itself under the lock and closes its own socket,
 * so stop (which shuts sockets down under the same lock) never touches a
 * closed descriptor, and waits for the count of threads to reach zero.
 */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/conn_server.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "common/util.h"

#define BACKOFF_FIRST_MS 10
#define BACKOFF_MAX_MS 1000

/* Connection threads block in socket I/O with small frames on their stack; a
 * small stack keeps hundreds of them cheap. Sanitizers need the default. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CONN_STACK 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CONN_STACK 0
#endif
#endif
#ifndef CONN_STACK
#define CONN_STACK ((size_t)256 << 10)
#endif

enum conn_state { ST_SETUP, ST_IDLE, ST_INCOMPLETE, ST_BUSY, ST_EVICTED, ST_DONE };

struct kvpi_conn {
    kvpi_conn_server *srv;
    int fd;
    atomic_int state;
    atomic_uint_fast64_t since_ns; /* when the state was entered */
    uint64_t accepted_ns;          /* immutable */
    atomic_int proven;             /* it completed a request */
    uint64_t deadline_ns;          /* the handler's thread only */
    size_t later_len;              /* bytes in later (the handler's thread only) */
    uint8_t later[KVPI_CONN_LATER_MAX];
    kvpi_conn *prev, *next;
    _Alignas(16) unsigned char data[];
};

struct kvpi_conn_server {
    char name[192];
    kvpi_conn_limits lim;
    kvpi_conn_handler h;
    void *ctx;
    int listen_fd;
    int wake_fd;    /* eventfd: readable once stop begins */
    int reserve_fd; /* given up to shed a connection when out of descriptors */
    pthread_t acceptor;
    pthread_attr_t attr;
    pthread_mutex_t lock;
    pthread_cond_t gone; /* threads reached zero */
    kvpi_conn *conns;
    size_t n_threads; /* connection threads still running, evicted ones included */
    size_t n_live;    /* of those, not evicted: what counts against max_conns */
    kvpi_conn_stats stats;
    atomic_uint_fast64_t idle_closed;
    int warned_full, warned_fds;
    uint64_t accept_failed_ns; /* the last accept failure */
};

kvpi_conn_limits kvpi_conn_limits_resolve(const kvpi_conn_limits *in)
{
    kvpi_conn_limits l = in ? *in : (kvpi_conn_limits){0};
    if (l.timeout_ms <= 0) l.timeout_ms = KVPI_CONN_TIMEOUT_MS_DEFAULT;
    if (l.setup_timeout_ms <= 0) l.setup_timeout_ms = l.timeout_ms;
    if (l.idle_timeout_ms <= 0) l.idle_timeout_ms = KVPI_CONN_IDLE_MS_DEFAULT;
    if (l.max_conns <= 0) l.max_conns = KVPI_CONN_MAX_DEFAULT;
    if (l.min_rate == 0) l.min_rate = KVPI_MIN_RATE_DEFAULT;
    return l;
}

uint64_t kvpi_transfer_deadline(int timeout_ms, uint64_t min_rate, uint64_t bytes)
{
    if (min_rate == 0) min_rate = KVPI_MIN_RATE_DEFAULT;
    const uint64_t cap = (uint64_t)1 << 62; /* ~146 years: no overflow below */
    uint64_t secs = bytes / min_rate;
    uint64_t ns = secs > cap / 1000000000u
                      ? cap
                      : secs * 1000000000u + (bytes % min_rate) * 1000000000u / min_rate;
    ns += (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000u;
    return kvpi_now_ns() + (ns > cap ? cap : ns);
}

/* ---------------------------------------------------------- handler side */

int kvpi_conn_fd(const kvpi_conn *c)
{
    return c->fd;
}

void *kvpi_conn_ctx(const kvpi_conn *c)
{
    return c->srv->ctx;
}

void *kvpi_conn_data(kvpi_conn *c)
{
    return c->data;
}

const char *kvpi_conn_name(const kvpi_conn *c)
{
    return c->srv->name;
}

const kvpi_conn_limits *kvpi_conn_limits_of(const kvpi_conn *c)
{
    return &c->srv->lim;
}

uint64_t kvpi_conn_deadline(const kvpi_conn *c)
{
    return c->deadline_ns;
}

/* Move from the current state to next unless the connection was evicted. */
static int enter(kvpi_conn *c, int next)
{
    int cur = atomic_load(&c->state);
    do {
        if (cur == ST_EVICTED) return 0;
    } while (!atomic_compare_exchange_weak(&c->state, &cur, next));
    atomic_store(&c->since_ns, kvpi_now_ns());
    return 1;
}

/* Send what kvpi_conn_send_later queued. */
static kvp_status flush_later(kvpi_conn *c)
{
    size_t n = c->later_len;
    c->later_len = 0;
    return n ? kvpi_send_all_by(c->fd, c->later, n, c->deadline_ns) : KVP_OK;
}

kvp_status kvpi_conn_next(kvpi_conn *c, void *hdr, size_t len)
{
    /* A header already queued (pipelined requests) is taken without polling,
     * and the answers kept for later stay there. Otherwise they go now, while
     * the connection still counts as busy (an idle one may be evicted), and
     * the connection waits, idle, for the next request. */
    uint64_t idle_until = 0;
    int idle = 0;
    ssize_t got;
    /* Called for a second request: the first is done, the peer speaks the
     * protocol (and holds the key, when the setup asked for it). */
    if (atomic_load(&c->state) != ST_SETUP) atomic_store(&c->proven, 1);
    for (;;) {
        got = recv(c->fd, hdr, len, MSG_DONTWAIT);
        if (got > 0) break;
        if (got == 0) return KVP_ECLOSED; /* the peer closed between requests */
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return KVP_ECLOSED;
        if (!idle) {
            if (flush_later(c) != KVP_OK || !enter(c, ST_IDLE)) return KVP_ECLOSED;
            idle = 1;
            idle_until = kvpi_deadline_ns(c->srv->lim.idle_timeout_ms);
            continue; /* a request may have come meanwhile */
        }
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        int rc = poll(&p, 1, kvpi_remaining_ms(idle_until));
        if (rc < 0 && errno != EINTR) return KVP_ECLOSED;
        if (rc == 0 && kvpi_remaining_ms(idle_until) == 0) {
            atomic_fetch_add(&c->srv->idle_closed, 1);
            KVPI_DEBUG("%s: closing a connection idle for %d ms", c->srv->name,
                       c->srv->lim.idle_timeout_ms);
            return KVP_ECLOSED;
        }
    }
    if (!enter(c, ST_INCOMPLETE)) return KVP_ECLOSED;
    c->deadline_ns = kvpi_deadline_ns(c->srv->lim.timeout_ms);
    if ((size_t)got == len) return KVP_OK;
    return kvpi_recv_all_by(c->fd, (char *)hdr + got, len - (size_t)got, c->deadline_ns);
}

int kvpi_conn_expect(kvpi_conn *c, uint64_t bytes)
{
    if (atomic_load(&c->state) == ST_EVICTED) return 0;
    c->deadline_ns = kvpi_transfer_deadline(c->srv->lim.timeout_ms, c->srv->lim.min_rate, bytes);
    return 1;
}

int kvpi_conn_busy(kvpi_conn *c, uint64_t bytes)
{
    if (!enter(c, ST_BUSY)) return 0;
    c->deadline_ns = kvpi_transfer_deadline(c->srv->lim.timeout_ms, c->srv->lim.min_rate, bytes);
    return 1;
}

kvp_status kvpi_conn_flush(kvpi_conn *c)
{
    return flush_later(c);
}

kvp_status kvpi_conn_send_later(kvpi_conn *c, const void *buf, size_t len)
{
    if (c->later_len + len > sizeof c->later) {
        kvp_status st = flush_later(c);
        if (st) return st;
        if (len > sizeof c->later) return kvpi_send_all_by(c->fd, buf, len, c->deadline_ns);
    }
    memcpy(c->later + c->later_len, buf, len);
    c->later_len += len;
    return KVP_OK;
}

kvp_status kvpi_conn_send(kvpi_conn *c, const void *buf, size_t len)
{
    kvp_status st = flush_later(c);
    return st ? st : kvpi_send_all_by(c->fd, buf, len, c->deadline_ns);
}

kvp_status kvpi_conn_recv(kvpi_conn *c, void *buf, size_t len)
{
    return kvpi_recv_all_by(c->fd, buf, len, c->deadline_ns);
}

kvp_status kvpi_conn_sendv(kvpi_conn *c, struct iovec *iov, int n)
{
    kvp_status st = flush_later(c);
    return st ? st : kvpi_sendv_all_by(c->fd, iov, n, c->deadline_ns);
}

kvp_status kvpi_conn_recvv(kvpi_conn *c, struct iovec *iov, int n)
{
    return kvpi_recvv_all_by(c->fd, iov, n, c->deadline_ns);
}

/* ------------------------------------------------------------ server side */

static void unlink_conn(kvpi_conn_server *srv, kvpi_conn *c)
{
    KVPI_LIST_UNLINK(srv->conns, c);
}

/* Before closing: send our FIN and drop input already queued (a header the
 * handler refused, say), so that the peer reads the end of the stream, and
 * whatever we sent before it, rather than a reset. */
static void quiet_close_prepare(int fd)
{
    char sink[4096];
    shutdown(fd, SHUT_WR);
    for (int i = 0; i < 16 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++) {
    }
}

static void *conn_main(void *arg)
{
    kvpi_conn *c = arg;
    kvpi_conn_server *srv = c->srv;
    c->deadline_ns = kvpi_deadline_ns(srv->lim.setup_timeout_ms);
    kvp_status st = srv->h.setup ? srv->h.setup(c) : KVP_OK;
    if (st == KVP_OK) {
        srv->h.serve(c);
        flush_later(c); /* the answers of the last requests, if the peer still reads */
    } else
        KVPI_DEBUG("%s: connection setup failed: %s", srv->name, kvp_last_error());
    quiet_close_prepare(c->fd);
    pthread_mutex_lock(&srv->lock);
    unlink_conn(srv, c);
    if (atomic_exchange(&c->state, ST_DONE) != ST_EVICTED) srv->n_live--;
    srv->n_threads--;
    /* Closed under the lock, after the unlink: stop's shutdown pass, which
     * holds it, can never see this descriptor once it is closed. */
    close(c->fd);
    if (srv->n_threads == 0) pthread_cond_broadcast(&srv->gone);
    pthread_mutex_unlock(&srv->lock);
    free(c);
    return NULL;
}

/* The connection to push out, by the progress it made: first one that has
 * not completed a request yet (its setup, its first request, or the wait
 * for it), the oldest first: a stranger half-open, trickling, or failing
 * the handshake; then the one a peer that did complete one keeps idle the
 * longest (a pooled connection, reopened at once if it is needed); then one
 * whose later request has been incomplete the longest; then one busy on a
 * request for more than timeout_ms (a slow reader). NULL when every
 * connection is on a request younger than that. Call with the lock held. */
static kvpi_conn *pick_victim(kvpi_conn_server *srv, int *state)
{
    kvpi_conn *best = NULL;
    int best_rank = 4;
    uint64_t best_since = 0;
    uint64_t busy_before = kvpi_now_ns() - (uint64_t)srv->lim.timeout_ms * 1000000u;
    for (kvpi_conn *c = srv->conns; c; c = c->next) {
        int s = atomic_load(&c->state), proven = atomic_load(&c->proven);
        uint64_t since = atomic_load(&c->since_ns);
        int rank = 4, waiting = s == ST_SETUP || s == ST_IDLE || s == ST_INCOMPLETE;
        if (waiting && !proven)
            rank = 0, since = c->accepted_ns;
        else if (s == ST_IDLE)
            rank = 1;
        else if (s == ST_INCOMPLETE)
            rank = 2;
        else if (s == ST_BUSY && since < busy_before)
            rank = 3;
        if (rank < best_rank || (rank == best_rank && rank < 4 && since < best_since)) {
            best = c;
            best_rank = rank;
            best_since = since;
            *state = s;
        }
    }
    return best;
}

/* Evict one connection that is not busy; 0 if there is none. Call with the
 * lock held. */
static int evict_one(kvpi_conn_server *srv)
{
    for (int tries = 0; tries < 4; tries++) {
        int s = 0;
        kvpi_conn *c = pick_victim(srv, &s);
        if (!c) return 0;
        if (!atomic_compare_exchange_strong(&c->state, &s, ST_EVICTED)) continue; /* it moved on */
        shutdown(c->fd, SHUT_RDWR); /* its thread wakes, ends and closes it */
        srv->n_live--;
        srv->stats.evicted++;
        int proven = atomic_load(&c->proven);
        KVPI_DEBUG("%s: evicted a connection %s for %llu ms to make room", srv->name,
                   !proven && s != ST_BUSY ? "without a completed request"
                   : s == ST_IDLE          ? "idle"
                   : s == ST_BUSY          ? "busy on one request"
                                           : "incomplete",
                   (unsigned long long)((kvpi_now_ns() -
                                         (proven ? atomic_load(&c->since_ns) : c->accepted_ns)) /
                                        1000000u));
        return 1;
    }
    return 0;
}

static void refuse(kvpi_conn_server *srv, int fd, const char *why)
{
    srv->stats.refused++;
    if (!srv->warned_full)
        KVPI_WARN("%s: refusing connections: %s (further refusals logged at debug)", srv->name,
                  why);
    else
        KVPI_DEBUG("%s: refused a connection: %s", srv->name, why);
    srv->warned_full = 1;
    close(fd);
}

static void add_conn(kvpi_conn_server *srv, int fd)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); /* fails harmlessly off TCP */
    pthread_mutex_lock(&srv->lock);
    if (srv->n_live >= (size_t)srv->lim.max_conns && !evict_one(srv)) {
        char why[96];
        snprintf(why, sizeof why, "all %d connections are on requests younger than %d ms",
                 srv->lim.max_conns, srv->lim.timeout_ms);
        refuse(srv, fd, why);
        pthread_mutex_unlock(&srv->lock);
        return;
    }
    kvpi_conn *c = calloc(1, sizeof *c + srv->h.data_size);
    if (!c) {
        refuse(srv, fd, "out of memory");
        pthread_mutex_unlock(&srv->lock);
        return;
    }
    c->srv = srv;
    c->fd = fd;
    atomic_init(&c->state, ST_SETUP);
    c->accepted_ns = kvpi_now_ns();
    atomic_init(&c->since_ns, c->accepted_ns);
    atomic_init(&c->proven, 0);
    c->next = srv->conns;
    if (c->next) c->next->prev = c;
    srv->conns = c;
    pthread_t t;
    int err = pthread_create(&t, &srv->attr, conn_main, c);
    if (err) {
        unlink_conn(srv, c);
        free(c);
        char why[96];
        snprintf(why, sizeof why, "cannot start a thread: %s", strerror(err));
        refuse(srv, fd, why);
        pthread_mutex_unlock(&srv->lock);
        return;
    }
    srv->n_threads++;
    srv->n_live++;
    srv->stats.accepted++;
    if (srv->warned_full && srv->n_live < (size_t)srv->lim.max_conns) srv->warned_full = 0;
    pthread_mutex_unlock(&srv->lock);
}

static int fd_shortage(int err)
{
    return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

/* Out of descriptors: turn one waiting client away through the reserved
 * descriptor (it sees a close, not a hang), and evict one of our own idle or
 * incomplete connections so that a descriptor comes free. */
static void shed(kvpi_conn_server *srv)
{
    if (srv->reserve_fd >= 0) {
        close(srv->reserve_fd);
        int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) close(fd);
        srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        pthread_mutex_lock(&srv->lock);
        if (fd >= 0) srv->stats.refused++;
        evict_one(srv);
        pthread_mutex_unlock(&srv->lock);
        return;
    }
    srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    pthread_mutex_lock(&srv->lock);
    evict_one(srv);
    pthread_mutex_unlock(&srv->lock);
}

/* Sleep ms unless stop begins; returns 1 when stopping. */
static int pause_or_stop(kvpi_conn_server *srv, int ms)
{
    struct pollfd p = {.fd = srv->wake_fd, .events = POLLIN};
    int rc;
    do
        rc = poll(&p, 1, ms);
    while (rc < 0 && errno == EINTR);
    return rc > 0;
}

static void *accept_main(void *arg)
{
    kvpi_conn_server *srv = arg;
    int backoff = 0;
    for (;;) {
        struct pollfd p[2] = {{.fd = srv->listen_fd, .events = POLLIN},
                              {.fd = srv->wake_fd, .events = POLLIN}};
        int rc = poll(p, 2, -1);
        if (rc < 0 && errno != EINTR) {
            KVPI_ERROR("%s: poll: %s", srv->name, strerror(errno));
            if (pause_or_stop(srv, BACKOFF_MAX_MS)) break;
            continue;
        }
        if (rc <= 0) continue;
        if (p[1].revents) break;
        int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) {
            /* The back-off only ends once accepting has worked for a second:
             * while descriptors stay short, each success (a descriptor freed
             * by shedding) is followed by a longer pause, not by a new round
             * of shedding every 10 ms. */
            if (kvpi_now_ns() - srv->accept_failed_ns > 1000000000u) {
                if (srv->warned_fds) KVPI_WARN("%s: accepting connections again", srv->name);
                srv->warned_fds = 0;
                backoff = 0;
            }
            add_conn(srv, fd);
            continue;
        }
        int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED ||
            err == EPROTO)
            continue; /* the client left between poll and accept */
        pthread_mutex_lock(&srv->lock);
        srv->stats.accept_errors++;
        pthread_mutex_unlock(&srv->lock);
        srv->accept_failed_ns = kvpi_now_ns();
        if (!srv->warned_fds)
            KVPI_WARN("%s: accept: %s; backing off up to %d ms at a time%s", srv->name,
                      strerror(err), BACKOFF_MAX_MS,
                      fd_shortage(err) ? ", shedding waiting and idle connections" : "");
        srv->warned_fds = 1;
        if (fd_shortage(err)) shed(srv);
        backoff = backoff ? (backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2)
                          : BACKOFF_FIRST_MS;
        if (pause_or_stop(srv, backoff)) break;
    }
    return NULL;
}

static void server_free(kvpi_conn_server *srv)
{
    if (srv->listen_fd >= 0) close(srv->listen_fd);
    if (srv->wake_fd >= 0) close(srv->wake_fd);
    if (srv->reserve_fd >= 0) close(srv->reserve_fd);
    pthread_attr_destroy(&srv->attr);
    pthread_cond_destroy(&srv->gone);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
}

kvp_status kvpi_conn_server_start(int listen_fd, const char *name, const kvpi_conn_limits *limits,
                                  const kvpi_conn_handler *h, void *ctx, kvpi_conn_server **out)
{
    if (!h || !h->serve || !out) {
        close(listen_fd);
        return kvpi_error(KVP_EINVAL, "connection server: a serve handler is required");
    }
    kvpi_conn_server *srv = calloc(1, sizeof *srv);
    if (!srv) {
        close(listen_fd);
        return kvpi_error(KVP_ENOMEM, "connection server: out of memory");
    }
    snprintf(srv->name, sizeof srv->name, "%s", name ? name : "server");
    srv->lim = kvpi_conn_limits_resolve(limits);
    srv->h = *h;
    srv->ctx = ctx;
    srv->listen_fd = listen_fd;
    srv->wake_fd = eventfd(0, EFD_CLOEXEC);
    srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    pthread_mutex_init(&srv->lock, NULL);
    pthread_cond_init(&srv->gone, NULL);
    pthread_attr_init(&srv->attr);
    pthread_attr_setdetachstate(&srv->attr, PTHREAD_CREATE_DETACHED);
    if (CONN_STACK) pthread_attr_setstacksize(&srv->attr, CONN_STACK);
    kvp_status st = KVP_OK;
    if (srv->wake_fd < 0 || srv->reserve_fd < 0)
        st = kvpi_error(KVP_EIO, "%s: cannot open a descriptor: %s", srv->name, strerror(errno));
    else if (fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK) != 0)
        st = kvpi_error(KVP_EIO, "%s: fcntl: %s", srv->name, strerror(errno));
    else if (pthread_create(&srv->acceptor, NULL, accept_main, srv) != 0)
        st = kvpi_error(KVP_EIO, "%s: cannot start its thread", srv->name);
    if (st) {
        server_free(srv);
        return st;
    }
    *out = srv;
    return KVP_OK;
}

void kvpi_conn_server_stop(kvpi_conn_server *srv)
{
    if (!srv) return;
    (void)kvpi_eventfd_signal(srv->wake_fd);
    pthread_join(srv->acceptor, NULL);
    pthread_mutex_lock(&srv->lock);
    for (kvpi_conn *c = srv->conns; c; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    while (srv->n_threads > 0)
        pthread_cond_wait(&srv->gone, &srv->lock);
    pthread_mutex_unlock(&srv->lock);
    server_free(srv);
}

void kvpi_conn_server_stats(kvpi_conn_server *srv, kvpi_conn_stats *out)
{
    pthread_mutex_lock(&srv->lock);
    *out = srv->stats;
    out->open = srv->n_live;
    pthread_mutex_unlock(&srv->lock);
    out->idle_closed = atomic_load(&srv->idle_closed);
}
