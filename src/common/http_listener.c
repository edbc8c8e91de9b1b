/* The HTTP listener: see http_listener.h for what it does and why.
 *
 * Locking: l->lock guards the list of connections and the statistics.
 *
 * Descriptors: the listener keeps a descriptor of its own for every
 * connection (a dup of the one MHD gets), closed only when it forgets the
 * connection, and shuts sockets down through it: so it may shut down any
 * connection it tracks, one MHD has not announced yet included, without
 * ever touching a descriptor number MHD closed and the process reused. A
 * connection MHD announced is forgotten when MHD says it closed it (MHD's
 * notification comes before its close); one MHD never announced (it took
 * it, then dropped it) after PENDING_MS. Each connection costs two
 * descriptors (kvpi_http_conns_within_fd_limit counts them).
 *
 * The list is kept in the order of each connection's start (its connect, or
 * its previous answer), oldest first: the first waiting connection found is
 * the one to evict. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/http_listener.h"
#include "common/log.h"
#include "common/net.h"

#define TICK_MS 250
/* Connections MHD may hold beyond max_conns: those shut down and not closed
 * by MHD yet. */
#define SHUT_SLACK 64
/* How long a connection handed to MHD may stay unannounced before the
 * listener stops counting it (MHD dropped it). */
#define PENDING_MS 2000
#define BACKOFF_FIRST_MS 10
#define BACKOFF_MAX_MS 1000

typedef struct hconn {
    int fd;            /* MHD's: to match its notification */
    int own;           /* ours (a dup): for shutdown and FIONREAD */
    int family;        /* AF_INET or AF_INET6 (v4-mapped addresses as AF_INET) */
    uint8_t addr[16];  /* the client's address, for max_conns_per_ip */
    uint64_t since_ms; /* connected, or last answered */
    uint64_t added_ms; /* handed to MHD */
    int started;       /* MHD announced it */
    int in_request;    /* its header is complete and it is not answered yet */
    int shut;          /* shut down; MHD will close it */
    struct hconn *prev, *next;
} hconn;

struct kvpi_http_listener {
    char what[64];
    kvpi_http_limits lim;
    MHD_AccessHandlerCallback on_request;
    MHD_RequestCompletedCallback on_completed;
    void *cls;
    struct MHD_Daemon *daemon;
    int listen_fd;
    int wake_fd; /* eventfd: stop */
    pthread_t acceptor;
    int acceptor_started;
    pthread_mutex_t lock;
    pthread_cond_t closed; /* a shut connection was closed */
    hconn *head, *tail;
    unsigned n_shut; /* shut, not closed yet */
    kvpi_http_listener_stats stats;
};

/* ------------------------------------------------------------- the list --- */

static void unlink_conn(kvpi_http_listener *l, hconn *c)
{
    if (c->prev)
        c->prev->next = c->next;
    else
        l->head = c->next;
    if (c->next)
        c->next->prev = c->prev;
    else
        l->tail = c->prev;
    c->prev = c->next = NULL;
}

static void append_conn(kvpi_http_listener *l, hconn *c)
{
    c->prev = l->tail;
    c->next = NULL;
    if (l->tail)
        l->tail->next = c;
    else
        l->head = c;
    l->tail = c;
}

/* Forget c: unlinked and our descriptor closed. Under the lock. */
static void drop_conn(kvpi_http_listener *l, hconn *c)
{
    unlink_conn(l, c);
    if (c->own >= 0) close(c->own);
    free(c);
}

/* Under the lock: shut c down; MHD closes it. */
static void shut_conn(kvpi_http_listener *l, hconn *c)
{
    shutdown(c->own, SHUT_RDWR);
    c->shut = 1;
    l->n_shut++;
}

static void key_of(const struct sockaddr *sa, int *family, uint8_t addr[16])
{
    memset(addr, 0, 16);
    *family = sa->sa_family;
    if (sa->sa_family == AF_INET) {
        memcpy(addr, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    } else if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a6 = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(a6)) {
            *family = AF_INET;
            memcpy(addr, a6->s6_addr + 12, 4);
        } else {
            memcpy(addr, a6->s6_addr, 16);
        }
    }
}

static void addr_text(const hconn *c, char *buf, size_t len)
{
    if (!inet_ntop(c->family, c->addr, buf, (socklen_t)len)) snprintf(buf, len, "?");
}

/* ------------------------------------------------------------ admission --- */

/* Whether c is a request on its way in: bytes MHD has not read yet, on a
 * connection that started (connected, or was last answered) within
 * UNREAD_GRACE_MS. Such a request, waiting for MHD's thread (a busy one), is
 * progress, and is not evicted for a newcomer. Past the grace its bytes are
 * no shield: MHD may leave a stranger's partial header unread until more
 * comes (seen with libmicrohttpd 0.9.75 under ASan: 256 trickling strangers
 * held 22 unread bytes each for seconds, and every newcomer was refused). */
#define UNREAD_GRACE_MS 200
static int unread(const hconn *c, uint64_t now)
{
    int n = 0;
    return now - c->since_ms < UNREAD_GRACE_MS && ioctl(c->own, FIONREAD, &n) == 0 && n > 0;
}

/* Under the lock: shut down victim to admit a newcomer; n connections
 * (from the newcomer's address when per_ip) were open. */
static int evict(kvpi_http_listener *l, hconn *victim, unsigned n, int per_ip)
{
    uint64_t waited = kvpi_now_ms() - victim->since_ms;
    char who[INET6_ADDRSTRLEN];
    addr_text(victim, who, sizeof who);
    shut_conn(l, victim);
    l->stats.evicted++;
    KVPI_WARN_LIMITED("%s: full (%u connections%s): closed a connection from %s that had waited "
                      "%llu ms without completing a request header, to admit a newcomer",
                      l->what, n, per_ip ? " from that address" : "", who,
                      (unsigned long long)waited);
    return 0;
}

/* Under the lock: make room for a newcomer from (family, addr). Returns 0
 * when it may be served (a connection evicted if need be), -1 when every
 * connection it would displace is in a request or has a request waiting. */
static int make_room(kvpi_http_listener *l, int family, const uint8_t addr[16])
{
    unsigned total = 0, same = 0;
    for (hconn *c = l->head; c; c = c->next) {
        if (c->shut) continue;
        total++;
        same += c->family == family && memcmp(c->addr, addr, 16) == 0;
    }
    int per_ip = same >= l->lim.max_conns_per_ip;
    if (!per_ip && total < l->lim.max_conns) return 0;
    uint64_t now = kvpi_now_ms();
    for (hconn *c = l->head; c; c = c->next)
        if (!c->shut && !c->in_request && !unread(c, now) &&
            (!per_ip || (c->family == family && memcmp(c->addr, addr, 16) == 0)))
            return evict(l, c, per_ip ? same : total, per_ip);
    return -1;
}

/* While MHD still holds more shut connections than its slack, wait a little
 * for it to close them (it does on its next loop), so that MHD's own cap
 * never refuses a newcomer the listener admitted. Under the lock. */
static void wait_for_closes(kvpi_http_listener *l)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 100 * 1000000L;
    if (until.tv_nsec >= 1000000000L) until.tv_sec++, until.tv_nsec -= 1000000000L;
    while (l->n_shut >= SHUT_SLACK)
        if (pthread_cond_timedwait(&l->closed, &l->lock, &until) != 0) break;
}

static void admit(kvpi_http_listener *l, int fd, const struct sockaddr *sa, socklen_t salen)
{
    int family;
    uint8_t addr[16];
    key_of(sa, &family, addr);
    hconn *c = calloc(1, sizeof *c);
    int own = c ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_lock(&l->lock);
    if (own < 0 || make_room(l, family, addr) != 0) {
        l->stats.refused++;
        pthread_mutex_unlock(&l->lock);
        free(c);
        if (own >= 0) close(own);
        close(fd);
        KVPI_WARN_LIMITED("%s: refused a connection: %s", l->what,
                          own >= 0 ? "every connection it could displace is in a request"
                                   : "out of memory or descriptors");
        return;
    }
    wait_for_closes(l);
    /* An unannounced entry with this descriptor number is stale: MHD dropped
     * it and the kernel reused the number. */
    for (hconn *o = l->head; o; o = o->next)
        if (!o->started && o->fd == fd) {
            drop_conn(l, o);
            break;
        }
    c->fd = fd;
    c->own = own;
    c->family = family;
    memcpy(c->addr, addr, 16);
    c->since_ms = c->added_ms = kvpi_now_ms();
    append_conn(l, c);
    l->stats.accepted++;
    pthread_mutex_unlock(&l->lock);
    if (MHD_add_connection(l->daemon, fd, sa, salen) != MHD_YES) {
        /* MHD closed fd; only this thread shuts sockets down, so nothing
         * touched the number since. */
        pthread_mutex_lock(&l->lock);
        if (!c->started) drop_conn(l, c);
        l->stats.accepted--;
        l->stats.refused++;
        pthread_mutex_unlock(&l->lock);
        KVPI_WARN_LIMITED("%s: libmicrohttpd did not take a connection: %s", l->what,
                          strerror(errno));
    }
}

/* Shut down what is past its deadline; forget pending entries MHD never
 * announced. Returns the milliseconds until the next deadline (at most
 * TICK_MS). */
static int reap(kvpi_http_listener *l)
{
    uint64_t now = kvpi_now_ms(), next = now + TICK_MS;
    unsigned n = 0;
    uint64_t limit = 0;
    pthread_mutex_lock(&l->lock);
    for (hconn *c = l->head, *nx; c; c = nx) {
        nx = c->next;
        if (!c->started && now - c->added_ms > PENDING_MS) {
            drop_conn(l, c);
            continue;
        }
        if (c->shut) continue;
        uint64_t lim = c->in_request ? l->lim.request_ms : l->lim.header_ms;
        if (now - c->since_ms > lim) {
            shut_conn(l, c);
            if (!n++) limit = lim;
        } else if (c->since_ms + lim + 1 < next) {
            next = c->since_ms + lim + 1;
        }
    }
    l->stats.overdue += n;
    pthread_mutex_unlock(&l->lock);
    if (n)
        KVPI_WARN_LIMITED("%s: closed %u connection(s) that did not complete a request (header "
                          "within %llu ms, answer within %llu ms) in time; the first after %llu "
                          "ms",
                          l->what, n, (unsigned long long)l->lim.header_ms,
                          (unsigned long long)l->lim.request_ms, (unsigned long long)limit);
    return (int)(next - now);
}

/* Out of descriptors: evict the oldest waiting connection, so that this
 * listener serves again soon. */
static void shed(kvpi_http_listener *l)
{
    pthread_mutex_lock(&l->lock);
    for (hconn *c = l->head; c; c = c->next)
        if (!c->shut && !c->in_request) {
            shut_conn(l, c);
            l->stats.evicted++;
            break;
        }
    pthread_mutex_unlock(&l->lock);
}

static void *acceptor_main(void *arg)
{
    kvpi_http_listener *l = arg;
    int backoff = 0;
    for (;;) {
        int wait = reap(l);
        if (backoff) wait = wait < backoff ? wait : backoff;
        struct pollfd p[2] = {{.fd = l->wake_fd, .events = POLLIN},
                              {.fd = l->listen_fd, .events = backoff ? 0 : POLLIN}};
        int r = poll(p, 2, wait);
        if (r > 0 && p[0].revents) break;
        if (backoff && r == 0) backoff = 0; /* retry accepting after the pause */
        if (r <= 0 || !p[1].revents) continue;
        for (;;) {
            struct sockaddr_storage ss;
            socklen_t len = sizeof ss;
            int fd =
                accept4(l->listen_fd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd >= 0) {
                backoff = 0;
                admit(l, fd, (struct sockaddr *)&ss, len);
                continue;
            }
            if (errno == EINTR || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                pthread_mutex_lock(&l->lock);
                l->stats.accept_errors++;
                pthread_mutex_unlock(&l->lock);
                KVPI_WARN_LIMITED("%s: cannot accept: %s; closing the oldest waiting "
                                  "connection and pausing",
                                  l->what, strerror(errno));
                shed(l);
                backoff = backoff ? (backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : backoff * 2)
                                  : BACKOFF_FIRST_MS;
            }
            break; /* EAGAIN, or paused */
        }
    }
    return NULL;
}

/* ---------------------------------------------------- MHD's callbacks --- */

static hconn *conn_of(struct MHD_Connection *mc)
{
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info ? info->socket_context : NULL;
}

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    kvpi_http_listener *l = cls;
    pthread_mutex_lock(&l->lock);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *info =
            MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
        hconn *c = l->head;
        while (c && !(info && !c->started && c->fd == info->connect_fd))
            c = c->next;
        /* Untracked when not found (dropped as stale): it keeps MHD's idle
         * timeout. */
        if (c) c->started = 1;
        *socket_context = c;
    } else if (*socket_context) {
        /* Closed: MHD closes the socket after this returns. */
        hconn *c = *socket_context;
        if (c->shut) {
            l->n_shut--;
            pthread_cond_broadcast(&l->closed);
        }
        drop_conn(l, c);
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&l->lock);
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *mc, const char *url,
                                 const char *method, const char *version, const char *upload_data,
                                 size_t *upload_size, void **con_cls)
{
    kvpi_http_listener *l = cls;
    hconn *c = conn_of(mc);
    if (c && !c->in_request) {
        pthread_mutex_lock(&l->lock);
        c->in_request = 1;
        pthread_mutex_unlock(&l->lock);
    }
    return l->on_request(l->cls, mc, url, method, version, upload_data, upload_size, con_cls);
}

/* A request ended: the connection waits for its next header, from now. */
static void completed_hook(void *cls, struct MHD_Connection *mc, void **con_cls,
                           enum MHD_RequestTerminationCode toe)
{
    kvpi_http_listener *l = cls;
    if (l->on_completed) l->on_completed(l->cls, mc, con_cls, toe);
    hconn *c = conn_of(mc);
    if (!c) return;
    pthread_mutex_lock(&l->lock);
    c->in_request = 0;
    c->since_ms = kvpi_now_ms();
    unlink_conn(l, c);
    append_conn(l, c);
    pthread_mutex_unlock(&l->lock);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    kvpi_http_listener *l = cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n')
        line[--n] = '\0';
    KVPI_DEBUG("%s (libmicrohttpd): %s", l->what, line);
}

/* ------------------------------------------------------ start and stop --- */

unsigned kvpi_http_conns_within_fd_limit(unsigned max_conns, unsigned reserve, const char *what)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return max_conns;
    /* Two descriptors a connection (MHD's and ours), and MHD may hold
     * SHUT_SLACK connections more: those being closed. */
    rlim_t other = (rlim_t)reserve + 2 * SHUT_SLACK;
    rlim_t room = rl.rlim_cur > other + 32 ? (rl.rlim_cur - other) / 2 : 16;
    if (room >= max_conns) return max_conns;
    KVPI_INFO("%s: serving at most %llu connections (open-file limit %llu)", what,
              (unsigned long long)room, (unsigned long long)rl.rlim_cur);
    return (unsigned)room;
}

void kvpi_http_listener_stop(kvpi_http_listener *l)
{
    if (!l) return;
    if (l->acceptor_started) {
        if (kvpi_eventfd_signal(l->wake_fd))
            KVPI_WARN("%s: cannot wake the acceptor: %s", l->what, strerror(errno));
        pthread_join(l->acceptor, NULL);
    }
    /* Closing MHD closes every connection it serves; each leaves the list
     * on its way. What is left was never announced. */
    if (l->daemon) MHD_stop_daemon(l->daemon);
    while (l->head)
        drop_conn(l, l->head);
    if (l->listen_fd >= 0) close(l->listen_fd);
    if (l->wake_fd >= 0) close(l->wake_fd);
    pthread_cond_destroy(&l->closed);
    pthread_mutex_destroy(&l->lock);
    free(l);
}

kvp_status kvpi_http_listener_start(const char *what, const char *host, int port,
                                    const kvpi_http_limits *limits,
                                    MHD_AccessHandlerCallback on_request,
                                    MHD_RequestCompletedCallback on_completed, void *cls,
                                    kvpi_http_listener **out, int *port_out)
{
    kvpi_http_listener *l = calloc(1, sizeof *l);
    if (!l) return kvpi_error(KVP_ENOMEM, "%s: out of memory", what);
    snprintf(l->what, sizeof l->what, "%s", what);
    l->lim = *limits;
    if (!l->lim.max_conns_per_ip || l->lim.max_conns_per_ip > l->lim.max_conns)
        l->lim.max_conns_per_ip = l->lim.max_conns;
    l->on_request = on_request;
    l->on_completed = on_completed;
    l->cls = cls;
    l->listen_fd = -1;
    pthread_mutex_init(&l->lock, NULL);
    pthread_cond_init(&l->closed, NULL);
    kvp_status st;
    if ((l->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
        st = kvpi_error(KVP_EIO, "%s: eventfd: %s", what, strerror(errno));
        goto fail;
    }
    if ((st = kvpi_tcp_listen(host, port, &l->listen_fd, port_out))) goto fail;
    fcntl(l->listen_fd, F_SETFL, fcntl(l->listen_fd, F_GETFL) | O_NONBLOCK);
    /* poll(), not epoll: with epoll (MHD_USE_AUTO_INTERNAL_THREAD picks it),
     * libmicrohttpd 0.9.75 now and then slept through a connection handed
     * to it, and through hundreds of closures, until its next connection
     * timeout: http_store_slow_clients_test's slowloris_same_address, just
     * after its 520 trickling strangers were killed, saw a GET wait 14.5 s
     * in 3 of 60 runs beside other tests; with poll(), none of 120 past
     * 100 ms. poll() has no FD_SETSIZE limit, and a few hundred sockets
     * cost it nothing that matters here. */
    l->daemon = MHD_start_daemon(
        MHD_USE_POLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC,
        0, NULL, NULL, on_access, l, MHD_OPTION_CONNECTION_LIMIT, l->lim.max_conns + SHUT_SLACK,
        MHD_OPTION_CONNECTION_TIMEOUT, l->lim.idle_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT,
        l->lim.conn_memory, MHD_OPTION_NOTIFY_COMPLETED, completed_hook, l,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, l, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, l,
        MHD_OPTION_END);
    if (!l->daemon) {
        st = kvpi_error(KVP_EIO, "%s: libmicrohttpd failed to start", what);
        goto fail;
    }
    if (pthread_create(&l->acceptor, NULL, acceptor_main, l) != 0) {
        st = kvpi_error(KVP_EIO, "%s: cannot start a thread", what);
        goto fail;
    }
    l->acceptor_started = 1;
    *out = l;
    return KVP_OK;
fail:
    kvpi_http_listener_stop(l);
    return st;
}

void kvpi_http_listener_stats_get(kvpi_http_listener *l, kvpi_http_listener_stats *out)
{
    pthread_mutex_lock(&l->lock);
    *out = l->stats;
    out->open = 0;
    for (hconn *c = l->head; c; c = c->next)
        if (c->started && !c->shut) out->open++;
    pthread_mutex_unlock(&l->lock);
}
