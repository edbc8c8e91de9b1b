/* The embedded HTTP metadata store: libmicrohttpd with its own polling
 * thread, and an in-memory hash table of key -> value under a mutex.
 *
 * MHD reads sockets without blocking and drops connections idle for
 * CONN_TIMEOUT_S, so a slow or silent client holds no thread; requests with a
 * bad method, no key or a too large body are answered 4xx before their body is
 * read. */
#include <fcntl.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "kvpipe/metadata_server.h"

#define MAX_BODY ((size_t)16 << 20)
#define CONN_TIMEOUT_S 30
#define CONN_LIMIT 512
#define MIN_BUCKETS 64

typedef struct entry {
    char *key;
    char *value;
    size_t len;
    struct entry *next;
} entry;

struct kvp_metadata_server {
    struct MHD_Daemon *daemon;
    int port;
    pthread_mutex_t lock; /* guards the table below */
    entry **buckets;
    size_t n_buckets, count;
};

/* Per-request state: the body received so far. */
typedef struct request {
    char *body;
    size_t len, cap;
} request;

enum method { M_GET, M_PUT, M_DELETE, M_OTHER };

/* ---- the table ---- */

static size_t hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (size_t)h;
}

static entry **find_slot(kvp_metadata_server *srv, const char *key)
{
    entry **e = &srv->buckets[hash(key) & (srv->n_buckets - 1)];
    while (*e && strcmp((*e)->key, key) != 0)
        e = &(*e)->next;
    return e;
}

static void grow(kvp_metadata_server *srv)
{
    size_t n = srv->n_buckets * 2;
    entry **b = calloc(n, sizeof *b);
    if (!b) return; /* keep the old table: slower, still correct */
    for (size_t i = 0; i < srv->n_buckets; i++) {
        for (entry *e = srv->buckets[i], *next; e; e = next) {
            next = e->next;
            entry **slot = &b[hash(e->key) & (n - 1)];
            e->next = *slot;
            *slot = e;
        }
    }
    free(srv->buckets);
    srv->buckets = b;
    srv->n_buckets = n;
}

/* Takes ownership of value. Returns 0, or -1 when out of memory. */
static int table_put(kvp_metadata_server *srv, const char *key, char *value, size_t len)
{
    pthread_mutex_lock(&srv->lock);
    entry **slot = find_slot(srv, key);
    entry *e = *slot;
    if (e) {
        free(e->value);
    } else {
        e = calloc(1, sizeof *e);
        char *k = strdup(key);
        if (!e || !k) {
            free(e);
            free(k);
            pthread_mutex_unlock(&srv->lock);
            free(value);
            return -1;
        }
        e->key = k;
        *slot = e;
        if (++srv->count > 2 * srv->n_buckets) grow(srv);
    }
    e->value = value;
    e->len = len;
    pthread_mutex_unlock(&srv->lock);
    return 0;
}

static void table_del(kvp_metadata_server *srv, const char *key)
{
    pthread_mutex_lock(&srv->lock);
    entry **slot = find_slot(srv, key);
    entry *e = *slot;
    if (e) {
        *slot = e->next;
        srv->count--;
    }
    pthread_mutex_unlock(&srv->lock);
    if (e) {
        free(e->key);
        free(e->value);
        free(e);
    }
}

/* A response holding a copy of the key's value, or NULL if missing. */
static struct MHD_Response *table_get(kvp_metadata_server *srv, const char *key, int *found)
{
    struct MHD_Response *r = NULL;
    pthread_mutex_lock(&srv->lock);
    entry *e = *find_slot(srv, key);
    *found = e != NULL;
    if (e) r = MHD_create_response_from_buffer(e->len, e->value, MHD_RESPMEM_MUST_COPY);
    pthread_mutex_unlock(&srv->lock);
    return r;
}

static void table_free(kvp_metadata_server *srv)
{
    for (size_t i = 0; srv->buckets && i < srv->n_buckets; i++) {
        for (entry *e = srv->buckets[i], *next; e; e = next) {
            next = e->next;
            free(e->key);
            free(e->value);
            free(e);
        }
    }
    free(srv->buckets);
}

/* ---- HTTP ---- */

static enum MHD_Result send_response(struct MHD_Connection *c, unsigned code,
                                     struct MHD_Response *r)
{
    if (!r) return MHD_NO;
    enum MHD_Result rc = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return rc;
}

static enum MHD_Result send_text(struct MHD_Connection *c, unsigned code, const char *text)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
    if (r && code == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, PUT, DELETE");
    return send_response(c, code, r);
}

static enum method method_of(const char *m)
{
    if (strcmp(m, MHD_HTTP_METHOD_GET) == 0) return M_GET;
    if (strcmp(m, MHD_HTTP_METHOD_PUT) == 0) return M_PUT;
    if (strcmp(m, MHD_HTTP_METHOD_DELETE) == 0) return M_DELETE;
    return M_OTHER;
}

static int body_too_large(struct MHD_Connection *c)
{
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (!cl) return 0;
    char *end;
    unsigned long long n = strtoull(cl, &end, 10);
    return *end != '\0' || n > MAX_BODY;
}

/* Returns 0, or -1 when the body passes MAX_BODY (chunked uploads carry no
 * Content-Length to refuse up front) or memory runs out. */
static int append_body(request *req, const char *data, size_t n)
{
    if (n > MAX_BODY - req->len) return -1;
    if (req->len + n + 1 > req->cap) {
        size_t cap = req->cap ? req->cap : 4096;
        while (cap < req->len + n + 1)
            cap *= 2;
        char *p = realloc(req->body, cap);
        if (!p) return -1;
        req->body = p;
        req->cap = cap;
    }
    memcpy(req->body + req->len, data, n);
    req->len += n;
    return 0;
}

/* First call of a request: refuse it before its body is read, or set up. */
static enum MHD_Result begin(struct MHD_Connection *c, const char *method, void **con_cls)
{
    if (method_of(method) == M_OTHER)
        return send_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n");
    const char *key = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "key");
    if (!key || !*key) return send_text(c, MHD_HTTP_BAD_REQUEST, "missing key parameter\n");
    if (body_too_large(c)) return send_text(c, MHD_HTTP_CONTENT_TOO_LARGE, "value too large\n");
    request *req = calloc(1, sizeof *req);
    if (!req) return MHD_NO;
    *con_cls = req;
    return MHD_YES;
}

static enum MHD_Result finish(kvp_metadata_server *srv, struct MHD_Connection *c,
                              const char *method, request *req)
{
    const char *key = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "key");
    switch (method_of(method)) {
    case M_GET: {
        int found;
        struct MHD_Response *r = table_get(srv, key, &found);
        if (!found) return send_text(c, MHD_HTTP_NOT_FOUND, "metadata not found\n");
        if (r) MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
        return send_response(c, MHD_HTTP_OK, r);
    }
    case M_PUT: {
        char *value = req->body ? req->body : strdup("");
        req->body = NULL;
        if (!value || table_put(srv, key, value, req->len) != 0)
            return send_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
        return send_text(c, MHD_HTTP_OK, "metadata updated\n");
    }
    case M_DELETE:
        table_del(srv, key);
        return send_text(c, MHD_HTTP_OK, "metadata deleted\n");
    default:
        return MHD_NO;
    }
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls)
{
    (void)url; /* any path: Mooncake uses /metadata, others use / */
    (void)version;
    request *req = *con_cls;
    if (!req) return begin(c, method, con_cls);
    if (*upload_size) {
        if (append_body(req, upload_data, *upload_size) != 0) {
            KVPI_WARN_LIMITED("metadata server: dropping a connection whose body exceeds %zu bytes",
                              MAX_BODY);
            return MHD_NO;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    return finish(cls, c, method, req);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls;
    (void)c;
    (void)toe;
    request *req = *con_cls;
    if (req) {
        free(req->body);
        free(req);
        *con_cls = NULL;
    }
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    if (n && line[n - 1] == '\n') line[n - 1] = '\0';
    KVPI_DEBUG("metadata server (libmicrohttpd): %s", line);
}

static kvp_status start_daemon(kvp_metadata_server *srv, int fd)
{
    srv->daemon = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL,
                                   on_request, srv, MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd,
                                   MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)CONN_TIMEOUT_S,
                                   MHD_OPTION_CONNECTION_LIMIT, (unsigned)CONN_LIMIT,
                                   MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
                                   MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, srv, MHD_OPTION_END);
    if (!srv->daemon)
        return kvpi_error(KVP_EIO, "metadata server: libmicrohttpd failed to start on port %d",
                          srv->port);
    return KVP_OK;
}

kvp_status kvp_metadata_server_start(const char *host, int port, kvp_metadata_server **out)
{
    if (!out) return kvpi_error(KVP_EINVAL, "metadata server: out is NULL");
    if (port < 0 || port > 65535)
        return kvpi_error(KVP_EINVAL, "metadata server: port %d is not in 0..65535", port);
    if (!host || !*host) host = "127.0.0.1";
    kvp_metadata_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "out of memory");
    srv->n_buckets = MIN_BUCKETS;
    srv->buckets = calloc(srv->n_buckets, sizeof *srv->buckets);
    pthread_mutex_init(&srv->lock, NULL);
    kvp_status st = KVP_ENOMEM;
    int fd = -1;
    if (!srv->buckets) goto fail;
    st = kvpi_tcp_listen(host, port, &fd, &srv->port);
    if (st) goto fail;
    /* MHD polls the listening socket; accept must not block if a client left. */
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    /* From here MHD owns fd and closes it in MHD_stop_daemon. On a start
     * failure it is left open rather than risk closing it twice. */
    st = start_daemon(srv, fd);
    if (st) goto fail;
    KVPI_INFO("metadata server listening on %s port %d", host, srv->port);
    *out = srv;
    return KVP_OK;
fail:
    if (st == KVP_ENOMEM) kvpi_error(st, "metadata server: out of memory");
    pthread_mutex_destroy(&srv->lock);
    table_free(srv);
    free(srv);
    return st;
}

int kvp_metadata_server_port(const kvp_metadata_server *server)
{
    return server ? server->port : -1;
}

void kvp_metadata_server_stop(kvp_metadata_server *server)
{
    if (!server) return;
    MHD_stop_daemon(server->daemon);
    pthread_mutex_destroy(&server->lock);
    table_free(server);
    free(server);
}
