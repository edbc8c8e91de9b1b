/* The metrics endpoint: libmicrohttpd answers GET /metrics with the
 * Prometheus text of every attached source.
 *
 * A scraper is a trusted operator's tool, but the port is still a socket: it
 * is served by the HTTP listener (common/http_listener.h), as the metadata
 * store is: CONNS_MAX connections in all (within the open-file limit) and
 * CONNS_PER_IP from one address, a newcomer evicting the connection that has
 * waited longest for a complete request header; HEADER_S for a request line
 * and headers, from connecting or from the previous answer, however they
 * trickle, REQUEST_S until the answer is sent, IDLE_S without a byte; a
 * request's headers get CONN_MEMORY bytes. Requests carry no body worth
 * reading: anything but GET or HEAD of /metrics is answered 404 or 405 at
 * once. */
#include <microhttpd.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <limits.h>

#include "common/error.h"
#include "common/http_listener.h"
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
    kvpi_http_listener *listener;
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
    if (strcmp(url, "/metrics") != 0)
        return reply_text(c, MHD_HTTP_NOT_FOUND, "not found: the metrics are at /metrics\n");
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return reply_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n");
    return scrape(srv, c);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)c, (void)toe;
    *con_cls = NULL;
}

/* At most CONNS_MAX, and at most half the open-file limit: the other half
 * is the engine's own sockets'. */
static unsigned conns_max(void)
{
    struct rlimit rl;
    unsigned reserve = FD_RESERVE;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur / 2 > reserve)
        reserve = rl.rlim_cur / 2 > UINT_MAX ? UINT_MAX : (unsigned)(rl.rlim_cur / 2);
    return kvpi_http_conns_within_fd_limit(CONNS_MAX, reserve, "metrics endpoint");
}

static kvp_status server_start(kvpi_metrics_server *srv)
{
    kvpi_http_limits hl = {
        .max_conns = conns_max(),
        .max_conns_per_ip = CONNS_PER_IP,
        .idle_s = IDLE_S,
        .header_ms = (uint64_t)HEADER_S * 1000,
        .request_ms = (uint64_t)REQUEST_S * 1000,
        .conn_memory = CONN_MEMORY,
    };
    kvp_status st =
        kvpi_http_listener_start("metrics endpoint", srv->host, srv->asked_port, &hl, on_request,
                                 on_completed, srv, &srv->listener, &srv->port);
    if (st) return kvpi_error(st, "metrics endpoint on %s: %s", srv->host, kvp_last_error());
    return KVP_OK;
}
static void server_free(kvpi_metrics_server *srv)
{
    kvpi_http_listener_stop(srv->listener);
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
