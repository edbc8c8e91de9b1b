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
 *   - idle_timeout_s too for the request line and headers, however they
 *     trickle, and request_timeout_s for a whole request: MHD has no such
 *     deadlines, so a reaper thread (common/conn_deadline.c) shuts down
 *     (shutdown(2), never close) the socket of a connection whose header or
 *     request is overdue, and MHD, seeing the socket end, closes it on its
 *     own thread;
 *   - header memory per connection (MHD_OPTION_CONNECTION_MEMORY_LIMIT), and
 *     every body, value and listing in the table's one budget. */
#include <microhttpd.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "common/conn_deadline.h"
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

struct kvp_metadata_server {
    struct MHD_Daemon *daemon;
    int port;
    kvpi_kvt *table;
    uint64_t header_ms, request_ms; /* the deadlines: idle_timeout_s, request_timeout_s */
    kvpi_deadlines *deadlines;
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
    (void)version;
    kvp_metadata_server *srv = cls;
    request *r = *con_cls;
    if (!r) {
        /* The header is in: the rest of the request has until its deadline,
         * counted from the same start. */
        kvpi_deadlines_set(srv->deadlines, conn_of(c), srv->request_ms, "request", 0);
        return begin(srv, c, url, method, con_cls);
    }
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

/* A request ended (answered, or its connection failed): free its state and
 * give the connection's next request header its deadline from now. */
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
    kvpi_deadlines_set(srv->deadlines, conn_of(c), srv->header_ms, "request header", 1);
}

/* ---- connections and their deadline ---- */

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    kvp_metadata_server *srv = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *info =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        /* Untracked when out of memory: it still has the idle timeout. */
        if (info)
            *socket_context = kvpi_deadlines_add(srv->deadlines, info->connect_fd, srv->header_ms,
                                                 "request header");
        return;
    }
    /* Closed: MHD closes the socket only after this returns, so the reaper,
     * which shuts sockets down under its lock, never touches a reused one. */
    kvpi_deadlines_remove(srv->deadlines, *socket_context);
    *socket_context = NULL;
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
    /* Closing the daemon releases every answer still holding a value, so the
     * table goes after it; its connections leave the deadlines as they close. */
    if (srv->daemon) MHD_stop_daemon(srv->daemon);
    kvpi_deadlines_stop(srv->deadlines);
    kvpi_kvt_destroy(srv->table);
    free(srv);
}

static kvp_status start_listening(kvp_metadata_server *srv, const char *host,
                                  const kvp_metadata_server_opts *o)
{
    int fd = -1;
    kvp_status st = kvpi_tcp_listen(host, o->port, &fd, &srv->port);
    if (st) return st;
    /* MHD polls the listening socket; accept must not block if a client left. */
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    /* From here MHD owns fd and closes it in MHD_stop_daemon. On a start
     * failure it is left open rather than risk closing it twice. */
    return start_daemon(srv, fd, o);
}

kvp_status kvp_metadata_server_start_opts_size(const kvp_metadata_server_opts *opts, size_t size,
                                               kvp_metadata_server **out)
{
    if (!out) return kvpi_error(KVP_EINVAL, "metadata server: out is NULL");
    kvp_metadata_server_opts o = default_opts();
    kvp_status st =
        opts ? kvpi_sized_in(&o, sizeof o, opts, size, "kvp_metadata_server_opts") : KVP_OK;
    if (st) return st;
    if (o.port < 0 || o.port > 65535)
        return kvpi_error(KVP_EINVAL, "metadata server: port %d is not in 0..65535", o.port);
    resolve_opts(&o);
    const char *host = o.host && *o.host ? o.host : "127.0.0.1";
    kvp_metadata_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "metadata server: out of memory");
    srv->request_ms = (uint64_t)o.request_timeout_s * 1000;
    srv->header_ms = (uint64_t)o.idle_timeout_s * 1000;
    if (srv->header_ms > srv->request_ms) srv->header_ms = srv->request_ms;
    kvpi_kvt_limits limits = {o.max_value_bytes, o.max_total_bytes};
    st = kvpi_kvt_create(&limits, &srv->table);
    if (!st) st = kvpi_deadlines_start("metadata server", &srv->deadlines);
    if (!st) st = start_listening(srv, host, &o);
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
