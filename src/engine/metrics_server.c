/* The metrics endpoint: libmicrohttpd answers GET /metrics with the
 * Prometheus text of every attached source.
 *
 * A scraper is a trusted operator's tool, but the port is still a socket:
 * MHD runs one internal thread with epoll, so a slow client holds no thread;
 * connections are capped (CONNS_MAX in all, within the open-file limit;
 * CONNS_PER_IP from one address), closed after IDLE_S without a byte, and a
 * request's headers get CONN_MEMORY bytes. A client that trickles its
 * header a byte at a time defeats the idle timeout, so every connection has
 * deadlines too (common/conn_deadline.c): HEADER_S for its request line and
 * headers, from connecting or from its previous answer, and REQUEST_S until
 * its answer is sent. Requests carry no body worth reading: anything but GET
 * or HEAD of /metrics is answered 404 or 405 at once. */
#include <microhttpd.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/conn_deadline.h"
#include "common/error.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/net.h"
#include "engine/metrics_server.h"

#define CONNS_MAX 1024u
#define CONNS_PER_IP 64u
#define IDLE_S 10u
#define HEADER_S 10u
#define REQUEST_S 30u
#define FD_RESERVE 64 /* descriptors left to the engine besides this endpoint */
#define CONN_MEMORY (16u << 10)
#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

typedef struct source {
    kvpi_metrics_collect_fn fn;
    void *ctx;
} source;

struct kvpi_metrics_server {
    struct kvpi_metrics_server *next; /* in the process's list */
    char *host;
    int port, asked_port;
    int refs;
    struct MHD_Daemon *daemon;
    kvpi_deadlines *deadlines;
    pthread_mutex_t lock; /* guards sources; held while a scrape collects */
    source *sources;
    size_t n_sources, cap_sources;
};

static pthread_mutex_t servers_lock = PTHREAD_MUTEX_INITIALIZER;
static kvpi_metrics_server *servers;

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, char *body, size_t len,
                             enum MHD_ResponseMemoryMode mode, const char *type)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, mode);
    if (!resp) {
        if (mode == MHD_RESPMEM_MUST_FREE) free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result rc = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return rc;
}

static enum MHD_Result reply_text(struct MHD_Connection *c, unsigned status, const char *text)
{
    return reply(c, status, (char *)text, strlen(text), MHD_RESPMEM_PERSISTENT,
                 "text/plain; charset=utf-8");
}

static enum MHD_Result scrape(kvpi_metrics_server *srv, struct MHD_Connection *c)
{
    kvp_metrics *m = kvpi_metrics_new();
    if (!m) return reply_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    pthread_mutex_lock(&srv->lock);
    for (size_t i = 0; i < srv->n_sources; i++)
        srv->sources[i].fn(srv->sources[i].ctx, m);
    pthread_mutex_unlock(&srv->lock);
    char *text = NULL;
    size_t len = 0;
    kvp_status st = kvpi_metrics_status(m);
    if (!st) st = kvp_metrics_format_prometheus(m, &text, &len);
    kvp_metrics_free(m);
    if (st) return reply_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
    return reply(c, MHD_HTTP_OK, text, len, MHD_RESPMEM_MUST_FREE, CONTENT_TYPE);
}

static kvpi_deadline_conn *conn_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info ? info->socket_context : NULL;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls)
{
    (void)version, (void)upload_data;
    /* Answer on the first call: a body, if any, is not read. */
    *upload_size = 0;
    if (*con_cls) return MHD_YES;
    *con_cls = c;
    kvpi_metrics_server *srv = cls;
    kvpi_deadlines_set(srv->deadlines, conn_of(c), (uint64_t)REQUEST_S * 1000, "answer", 0);
    if (strcmp(url, "/metrics") != 0)
        return reply_text(c, MHD_HTTP_NOT_FOUND, "not found: the metrics are at /metrics\n");
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return reply_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n");
    return scrape(srv, c);
}

/* The next request's header has HEADER_S from now. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)toe;
    kvpi_metrics_server *srv = cls;
    *con_cls = NULL;
    kvpi_deadlines_set(srv->deadlines, conn_of(c), (uint64_t)HEADER_S * 1000, "request header", 1);
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    kvpi_metrics_server *srv = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *info =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        /* Untracked when out of memory: it still has the idle timeout. */
        if (info)
            *socket_context = kvpi_deadlines_add(srv->deadlines, info->connect_fd,
                                                 (uint64_t)HEADER_S * 1000, "request header");
        return;
    }
    /* MHD closes the socket after this returns: the reaper never shuts down
     * a reused descriptor. */
    kvpi_deadlines_remove(srv->deadlines, *socket_context);
    *socket_context = NULL;
}

/* At most CONNS_MAX, and within the open-file limit: MHD stops accepting
 * for good once accept() fails with EMFILE. */
static unsigned conns_max(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
        rl.rlim_cur >= (rlim_t)CONNS_MAX + 2 * FD_RESERVE)
        return CONNS_MAX;
    unsigned cap = rl.rlim_cur > 2 * FD_RESERVE ? (unsigned)rl.rlim_cur / 2 : 16;
    KVPI_INFO("metrics endpoint: serving at most %u connections (open-file limit %llu)", cap,
              (unsigned long long)rl.rlim_cur);
    return cap;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char line[256];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n')
        line[--n] = '\0';
    KVPI_DEBUG("metrics endpoint: %s", line);
}

static kvp_status server_start(kvpi_metrics_server *srv)
{
    int fd = -1;
    kvp_status st = kvpi_tcp_listen(srv->host, srv->asked_port, &fd, &srv->port);
    if (st) {
        return kvpi_error(st, "metrics endpoint: %s", kvp_last_error());
    }
    if ((st = kvpi_deadlines_start("metrics endpoint", &srv->deadlines))) {
        close(fd);
        return st;
    }
    srv->daemon = MHD_start_daemon(
        MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL, on_request, srv,
        MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd, MHD_OPTION_CONNECTION_LIMIT, conns_max(),
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, CONNS_PER_IP, MHD_OPTION_CONNECTION_TIMEOUT, IDLE_S,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)CONN_MEMORY, MHD_OPTION_NOTIFY_COMPLETED,
        on_completed, srv, MHD_OPTION_NOTIFY_CONNECTION, on_connection, srv,
        MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, srv, MHD_OPTION_END);
    if (!srv->daemon) {
        close(fd);
        return kvpi_error(KVP_EIO, "metrics endpoint: libmicrohttpd failed to start on %s:%d",
                          srv->host, srv->port);
    }
    return KVP_OK;
}

static void server_free(kvpi_metrics_server *srv)
{
    /* Stopping the daemon closes its listening socket too. */
    if (srv->daemon) MHD_stop_daemon(srv->daemon);
    kvpi_deadlines_stop(srv->deadlines);
    pthread_mutex_destroy(&srv->lock);
    free(srv->sources);
    free(srv->host);
    free(srv);
}

kvp_status kvpi_metrics_server_acquire(const char *host, int port, kvpi_metrics_server **out)
{
    if (!host || !*host) host = "127.0.0.1";
    if (port < 0 || port > 65535)
        return kvpi_error(KVP_EINVAL, "metrics endpoint: port %d is not in 0..65535", port);
    pthread_mutex_lock(&servers_lock);
    kvpi_metrics_server *srv = servers;
    while (port && srv && !(srv->asked_port == port && strcmp(srv->host, host) == 0))
        srv = srv->next;
    if (port && srv) {
        srv->refs++;
        pthread_mutex_unlock(&servers_lock);
        *out = srv;
        return KVP_OK;
    }
    kvp_status st = KVP_OK;
    srv = calloc(1, sizeof *srv);
    if (!srv || !(srv->host = strdup(host))) {
        free(srv);
        st = kvpi_error(KVP_ENOMEM, "metrics endpoint: out of memory");
        goto out;
    }
    pthread_mutex_init(&srv->lock, NULL);
    srv->asked_port = port;
    srv->refs = 1;
    if ((st = server_start(srv))) {
        server_free(srv);
        goto out;
    }
    srv->next = servers;
    servers = srv;
    KVPI_INFO("metrics endpoint: serving http://%s:%d/metrics", host, srv->port);
    *out = srv;
out:
    pthread_mutex_unlock(&servers_lock);
    return st;
}

void kvpi_metrics_server_release(kvpi_metrics_server *srv)
{
    if (!srv) return;
    pthread_mutex_lock(&servers_lock);
    int last = --srv->refs == 0;
    if (last) {
        kvpi_metrics_server **p = &servers;
        while (*p != srv)
            p = &(*p)->next;
        *p = srv->next;
    }
    pthread_mutex_unlock(&servers_lock);
    if (last) server_free(srv);
}

int kvpi_metrics_server_port(const kvpi_metrics_server *srv)
{
    return srv->port;
}

kvp_status kvpi_metrics_server_add(kvpi_metrics_server *srv, kvpi_metrics_collect_fn fn, void *ctx)
{
    pthread_mutex_lock(&srv->lock);
    kvp_status st = KVP_OK;
    if (srv->n_sources == srv->cap_sources) {
        size_t cap = srv->cap_sources ? 2 * srv->cap_sources : 4;
        source *grown = realloc(srv->sources, cap * sizeof *grown);
        if (!grown) {
            st = kvpi_error(KVP_ENOMEM, "metrics endpoint: out of memory");
            goto out;
        }
        srv->sources = grown;
        srv->cap_sources = cap;
    }
    srv->sources[srv->n_sources++] = (source){fn, ctx};
out:
    pthread_mutex_unlock(&srv->lock);
    return st;
}

void kvpi_metrics_server_remove(kvpi_metrics_server *srv, void *ctx)
{
    pthread_mutex_lock(&srv->lock);
    for (size_t i = 0; i < srv->n_sources; i++) {
        if (srv->sources[i].ctx != ctx) continue;
        memmove(&srv->sources[i], &srv->sources[i + 1],
                (srv->n_sources - i - 1) * sizeof srv->sources[0]);
        srv->n_sources--;
        break;
    }
    pthread_mutex_unlock(&srv->lock);
}
