/* The embedded HTTP metadata store: libmicrohttpd carries requests to the
 * table and its rules (kv_table.c).
 *
 * Slow and hostile clients: MHD runs one internal thread with epoll and
 * non-blocking sockets, so no client holds a thread. What a client can hold
 * is a connection slot and memory, and each is bounded:
 *   - max_connections in all (MHD_OPTION_CONNECTION_LIMIT; more wait in the
 *     kernel's listen queue), max_connections_per_ip from one address
 *     (MHD_OPTION_PER_IP_CONNECTION_LIMIT; more are closed at once);
 *   - idle_timeout_s without a byte (MHD_OPTION_CONNECTION_TIMEOUT);
 *   - request_timeout_s for a whole request, however it trickles: MHD has no
 *     such deadline, so a reaper thread shuts down (shutdown(2), never close)
 *     the socket of a connection whose request is overdue, and MHD, seeing
 *     the socket end, closes it on its own thread;
 *   - header memory per connection (MHD_OPTION_CONNECTION_MEMORY_LIMIT), and
 *     every body, value and listing in the table's one budget. */
#include <microhttpd.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/sized.h"
#include "common/log.h"
#include "common/net.h"
#include "kvpipe/metadata_server.h"
#include "metadata/kv_table.h"

#define DEFAULT_MAX_VALUE ((size_t)16 << 20)
#define DEFAULT_MAX_TOTAL ((size_t)256 << 20)
#define DEFAULT_MAX_CONNS 1024u
#define DEFAULT_MAX_CONNS_PER_IP 256u
#define DEFAULT_IDLE_S 15u
#define DEFAULT_REQUEST_S 30u
#define FD_RESERVE 32           /* descriptors kept for the process besides connections */
#define CONN_MEMORY (32u << 10) /* request line and headers of one connection */
#define REAPER_TICK_MS 250

/* One accepted connection, for the request deadline. */
typedef struct conn {
    int fd;
    uint64_t since_ms; /* accepted, or finished its previous request */
    int reaped;
    struct conn *prev, *next;
} conn;

struct kvp_metadata_server {
    struct MHD_Daemon *daemon;
    int port;
    kvpi_kvt *table;
    unsigned request_timeout_s;

    pthread_mutex_t lock; /* guards conns, and each conn's since_ms and reaped */
    conn *conns;
    unsigned long reaped; /* connections shut down for their deadline */

    pthread_t reaper;
    int reaper_started;
    int wake[2]; /* a byte here stops the reaper */
};

/* Per-request state: the request as the table sees it and its body so far. */
typedef struct request {
    kvpi_kvt_request req;
    kvpi_kvt_blob *upload;
} request;

/* ---- answers ---- */

static void release_blob(void *blob)
{
    kvpi_kvt_blob_release(blob);
}

static enum MHD_Result send_reply(struct MHD_Connection *c, kvpi_kvt_reply *r)
{
    struct MHD_Response *resp;
    if (r->blob) {
        /* The answer shares the stored value; it lets go when sent. */
        resp = MHD_create_response_from_buffer_with_free_callback_cls(
            kvpi_kvt_blob_len(r->blob), (void *)kvpi_kvt_blob_data(r->blob), release_blob, r->blob);
        if (!resp) kvpi_kvt_blob_release(r->blob);
    } else {
        resp = MHD_create_response_from_buffer(strlen(r->text), (void *)r->text,
                                               MHD_RESPMEM_PERSISTENT);
    }
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r->content_type);
    if (r->allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, PUT, DELETE");
    enum MHD_Result rc = MHD_queue_response(c, r->status, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* ---- requests ---- */

/* -1: none; -2: not a number. */
static long long content_length(struct MHD_Connection *c)
{
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (!cl) return -1;
    char *end;
    unsigned long long n = strtoull(cl, &end, 10);
    if (end == cl || *end || n > (unsigned long long)INT64_MAX) return -2;
    return (long long)n;
}

static enum MHD_Result begin(kvp_metadata_server *srv, struct MHD_Connection *c, const char *url,
                             const char *method, void **con_cls)
{
    kvpi_kvt_request req = {
        .method = method,
        .path = url,
        .key = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "key"),
        .list = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "list"),
        .content_length = content_length(c),
    };
    kvpi_kvt_reply reply;
    if (req.content_length == -2) {
        reply = (kvpi_kvt_reply){
            .status = 400, .text = "bad Content-Length\n", .content_type = "text/plain"};
        return send_reply(c, &reply);
    }
    kvpi_kvt_blob *upload = NULL;
    if (kvpi_kvt_begin(srv->table, &req, &upload, &reply)) return send_reply(c, &reply);
    request *r = malloc(sizeof *r);
    if (!r) {
        kvpi_kvt_blob_release(upload);
        return MHD_NO;
    }
    *r = (request){.req = req, .upload = upload};
    *con_cls = r;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls)
{
    (void)version;
    kvp_metadata_server *srv = cls;
    request *r = *con_cls;
    if (!r) return begin(srv, c, url, method, con_cls);
    if (*upload_size) {
        if (kvpi_kvt_upload_append(srv->table, &r->upload, upload_data, *upload_size) != 0) {
            /* Only a body without Content-Length gets here (a declared one
             * was refused or reserved up front). */
            KVPI_DEBUG("metadata server: dropping a request whose body passes the limits");
            return MHD_NO;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    kvpi_kvt_reply reply;
    kvpi_kvt_finish(srv->table, &r->req, r->upload, &reply);
    r->upload = NULL;
    return send_reply(c, &reply);
}

static conn *conn_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info ? info->socket_context : NULL;
}

/* A request ended (answered, or its connection failed): free its state and
 * restart the connection's deadline for the next request. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)toe;
    kvp_metadata_server *srv = cls;
    request *r = *con_cls;
    if (r) {
        kvpi_kvt_blob_release(r->upload);
        free(r);
        *con_cls = NULL;
    }
    conn *k = conn_of(c);
    if (k) {
        pthread_mutex_lock(&srv->lock);
        k->since_ms = kvpi_now_ms();
        pthread_mutex_unlock(&srv->lock);
    }
}

/* ---- connections and their deadline ---- */

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    kvp_metadata_server *srv = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *info =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        conn *k = info ? calloc(1, sizeof *k) : NULL;
        if (!k) return; /* untracked: it still has the idle timeout */
        k->fd = info->connect_fd;
        pthread_mutex_lock(&srv->lock);
        k->since_ms = kvpi_now_ms();
        k->next = srv->conns;
        if (srv->conns) srv->conns->prev = k;
        srv->conns = k;
        pthread_mutex_unlock(&srv->lock);
        *socket_context = k;
        return;
    }
    /* Closed: MHD closes the socket only after this returns, so the reaper,
     * which shuts sockets down under the lock, never touches a reused one. */
    conn *k = *socket_context;
    if (!k) return;
    pthread_mutex_lock(&srv->lock);
    if (k->prev)
        k->prev->next = k->next;
    else
        srv->conns = k->next;
    if (k->next) k->next->prev = k->prev;
    pthread_mutex_unlock(&srv->lock);
    free(k);
    *socket_context = NULL;
}

static unsigned reap_overdue(kvp_metadata_server *srv)
{
    uint64_t now = kvpi_now_ms(), limit = (uint64_t)srv->request_timeout_s * 1000;
    unsigned n = 0;
    pthread_mutex_lock(&srv->lock);
    for (conn *k = srv->conns; k; k = k->next) {
        if (k->reaped || now - k->since_ms <= limit) continue;
        shutdown(k->fd, SHUT_RDWR);
        k->reaped = 1;
        n++;
    }
    srv->reaped += n;
    pthread_mutex_unlock(&srv->lock);
    return n;
}

static void *reaper_main(void *arg)
{
    kvp_metadata_server *srv = arg;
    int warned = 0;
    for (;;) {
        struct pollfd p = {.fd = srv->wake[0], .events = POLLIN};
        if (poll(&p, 1, REAPER_TICK_MS) > 0) break;
        unsigned n = reap_overdue(srv);
        if (n && !warned) {
            KVPI_WARN("metadata server: closed %u connection(s) that did not complete a request "
                      "within %u s (request_timeout_s)",
                      n, srv->request_timeout_s);
            warned = 1;
        } else if (n) {
            KVPI_DEBUG("metadata server: closed %u more overdue connection(s)", n);
        }
    }
    return NULL;
}

/* ---- start and stop ---- */

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    if (n && line[n - 1] == '\n') line[n - 1] = '\0';
    KVPI_DEBUG("metadata server (libmicrohttpd): %s", line);
}

static kvp_metadata_server_opts default_opts(void)
{
    return (kvp_metadata_server_opts){
        .max_value_bytes = DEFAULT_MAX_VALUE,
        .max_total_bytes = DEFAULT_MAX_TOTAL,
        .max_connections = DEFAULT_MAX_CONNS,
        .max_connections_per_ip = DEFAULT_MAX_CONNS_PER_IP,
        .idle_timeout_s = DEFAULT_IDLE_S,
        .request_timeout_s = DEFAULT_REQUEST_S,
    };
}

void kvp_metadata_server_opts_init_size(kvp_metadata_server_opts *o, size_t size)
{
    kvp_metadata_server_opts d = default_opts();
    if (o) kvpi_sized_out(o, size, &d, sizeof d);
}

/* Zero fields take their defaults; connections stay within the open-file
 * limit, since MHD stops accepting for good once accept() fails with EMFILE. */
static void resolve_opts(kvp_metadata_server_opts *o)
{
    kvp_metadata_server_opts d = default_opts();
    if (!o->max_value_bytes) o->max_value_bytes = d.max_value_bytes;
    if (!o->max_total_bytes) o->max_total_bytes = d.max_total_bytes;
    if (!o->max_connections) o->max_connections = d.max_connections;
    if (!o->max_connections_per_ip) o->max_connections_per_ip = d.max_connections_per_ip;
    if (!o->idle_timeout_s) o->idle_timeout_s = d.idle_timeout_s;
    if (!o->request_timeout_s) o->request_timeout_s = d.request_timeout_s;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur < (rlim_t)o->max_connections + 2 * FD_RESERVE) {
        unsigned cap = rl.rlim_cur > 2 * FD_RESERVE ? (unsigned)rl.rlim_cur - FD_RESERVE : 16;
        if (cap < o->max_connections) {
            KVPI_INFO("metadata server: serving at most %u connections (open-file limit %llu)", cap,
                      (unsigned long long)rl.rlim_cur);
            o->max_connections = cap;
        }
    }
}

static kvp_status start_daemon(kvp_metadata_server *srv, int fd, const kvp_metadata_server_opts *o)
{
    unsigned per_ip =
        o->max_connections_per_ip < o->max_connections ? o->max_connections_per_ip : 0;
    srv->daemon = MHD_start_daemon(
        MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL, on_request, srv,
        MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd, MHD_OPTION_CONNECTION_LIMIT, o->max_connections,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, per_ip, MHD_OPTION_CONNECTION_TIMEOUT,
        o->idle_timeout_s, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)CONN_MEMORY,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv, MHD_OPTION_NOTIFY_CONNECTION, on_connection,
        srv, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, srv, MHD_OPTION_END);
    if (!srv->daemon)
        return kvpi_error(KVP_EIO, "metadata server: libmicrohttpd failed to start on port %d",
                          srv->port);
    return KVP_OK;
}

static void server_free(kvp_metadata_server *srv)
{
    if (srv->reaper_started) {
        if (write(srv->wake[1], "x", 1) != 1) KVPI_WARN("metadata server: cannot wake the reaper");
        pthread_join(srv->reaper, NULL);
    }
    /* Closing the daemon releases every answer still holding a value, so the
     * table goes after it. */
    if (srv->daemon) MHD_stop_daemon(srv->daemon);
    kvpi_kvt_destroy(srv->table);
    if (srv->wake[0] >= 0) close(srv->wake[0]);
    if (srv->wake[1] >= 0) close(srv->wake[1]);
    pthread_mutex_destroy(&srv->lock);
    free(srv);
}

static kvp_status start_threads(kvp_metadata_server *srv, const char *host,
                                const kvp_metadata_server_opts *o)
{
    int fd = -1;
    kvp_status st = kvpi_tcp_listen(host, o->port, &fd, &srv->port);
    if (st) return st;
    /* MHD polls the listening socket; accept must not block if a client left. */
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    /* From here MHD owns fd and closes it in MHD_stop_daemon. On a start
     * failure it is left open rather than risk closing it twice. */
    if ((st = start_daemon(srv, fd, o))) return st;
    if (pthread_create(&srv->reaper, NULL, reaper_main, srv) != 0)
        return kvpi_error(KVP_EIO, "metadata server: cannot start a thread");
    srv->reaper_started = 1;
    return KVP_OK;
}

kvp_status kvp_metadata_server_start_opts_size(const kvp_metadata_server_opts *opts, size_t size,
                                               kvp_metadata_server **out)
{
    if (!out) return kvpi_error(KVP_EINVAL, "metadata server: out is NULL");
    kvp_metadata_server_opts o = default_opts();
    kvp_status st = opts ? kvpi_sized_in(&o, sizeof o, opts, size, "kvp_metadata_server_opts")
                         : KVP_OK;
    if (st) return st;
    if (o.port < 0 || o.port > 65535)
        return kvpi_error(KVP_EINVAL, "metadata server: port %d is not in 0..65535", o.port);
    resolve_opts(&o);
    const char *host = o.host && *o.host ? o.host : "127.0.0.1";
    kvp_metadata_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "metadata server: out of memory");
    srv->wake[0] = srv->wake[1] = -1;
    srv->request_timeout_s = o.request_timeout_s;
    pthread_mutex_init(&srv->lock, NULL);
    kvpi_kvt_limits limits = {o.max_value_bytes, o.max_total_bytes};
    st = kvpi_kvt_create(&limits, &srv->table);
    if (!st && pipe2(srv->wake, O_CLOEXEC) != 0)
        st = kvpi_error(KVP_EIO, "metadata server: cannot create a pipe");
    if (!st) st = start_threads(srv, host, &o);
    if (st) {
        kvpi_error_kept detail = kvpi_error_keep();
        server_free(srv);
        return kvpi_error(st, "%s", detail.text);
    }
    KVPI_INFO("metadata server listening on %s port %d", host, srv->port);
    *out = srv;
    return KVP_OK;
}

kvp_status kvp_metadata_server_start(const char *host, int port, kvp_metadata_server **out)
{
    kvp_metadata_server_opts o;
    kvp_metadata_server_opts_init(&o);
    o.host = host;
    o.port = port;
    return kvp_metadata_server_start_opts(&o, out);
}

int kvp_metadata_server_port(const kvp_metadata_server *server)
{
    return server ? server->port : -1;
}

size_t kvp_metadata_server_bytes_used(const kvp_metadata_server *server)
{
    return server ? kvpi_kvt_bytes_used(server->table) : 0;
}

void kvp_metadata_server_stop(kvp_metadata_server *server)
{
    if (server) server_free(server);
}
