/* The embedded HTTP metadata store: libmicrohttpd carries requests to the
 * table and its rules (kv_table.c).
 *
 * Slow and hostile clients: MHD runs one internal thread with poll() and
 * non-blocking sockets, so no client holds a thread. What a client can hold
 * is a connection slot and memory, and each is bounded:
 *   - connections, deadlines and who is admitted under pressure: the HTTP
 *     listener (common/http_listener.h): max_connections in all and
 *     max_connections_per_ip from one address, a newcomer evicting the
 *     connection that has waited longest for a complete request header;
 *     idle_timeout_s for the request line and headers however they trickle,
 *     request_timeout_s for a whole request;
 *   - header memory per connection (MHD_OPTION_CONNECTION_MEMORY_LIMIT), and
 *     every body, value and listing in the table's one budget. */
#include <microhttpd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/http_listener.h"
#include "common/sized.h"
#include "common/log.h"
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
    kvpi_http_listener *listener;
    int port;
    kvpi_kvt *table;
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

/* A request ended (answered, or its connection failed): free its state. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)c, (void)toe;
    request *r = *con_cls;
    if (r) {
        kvpi_kvt_blob_release(r->upload);
        free(r);
        *con_cls = NULL;
    }
}

/* ---- start and stop ---- */

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
 * limit. */
static void resolve_opts(kvp_metadata_server_opts *o)
{
    kvp_metadata_server_opts d = default_opts();
    if (!o->max_value_bytes) o->max_value_bytes = d.max_value_bytes;
    if (!o->max_total_bytes) o->max_total_bytes = d.max_total_bytes;
    if (!o->max_connections) o->max_connections = d.max_connections;
    if (!o->max_connections_per_ip) o->max_connections_per_ip = d.max_connections_per_ip;
    if (!o->idle_timeout_s) o->idle_timeout_s = d.idle_timeout_s;
    if (!o->request_timeout_s) o->request_timeout_s = d.request_timeout_s;
    o->max_connections =
        kvpi_http_conns_within_fd_limit(o->max_connections, FD_RESERVE, "metadata server");
}

static void server_free(kvp_metadata_server *srv)
{
    /* Closing the listener releases every answer still holding a value, so
     * the table goes after it. */
    kvpi_http_listener_stop(srv->listener);
    kvpi_kvt_destroy(srv->table);
    free(srv);
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
    kvpi_http_limits hl = {
        .max_conns = o.max_connections,
        .max_conns_per_ip = o.max_connections_per_ip,
        .idle_s = o.idle_timeout_s,
        .header_ms = (uint64_t)o.idle_timeout_s * 1000,
        .request_ms = (uint64_t)o.request_timeout_s * 1000,
        .conn_memory = CONN_MEMORY,
    };
    if (hl.header_ms > hl.request_ms) hl.header_ms = hl.request_ms;
    kvpi_kvt_limits limits = {o.max_value_bytes, o.max_total_bytes};
    st = kvpi_kvt_create(&limits, &srv->table);
    if (!st)
        st = kvpi_http_listener_start("metadata server", host, o.port, &hl, on_request,
                                      on_completed, srv, &srv->listener, &srv->port);
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
