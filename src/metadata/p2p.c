/* The handshake (RPC) port: Mooncake's P2P handshake framing.
 *
 *   u64 length (little-endian; counts the type byte and the JSON) | u8 type | JSON
 *
 * One request per connection. The server is a connection server
 * (common/conn_server.h): a thread per connection, a cap on connections that
 * evicts the oldest idle or incomplete one when full, and deadlines, so that
 * connections that trickle their frames cannot deny handshakes to others.
 * The client bounds the whole exchange, reply included, by its timeout. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/conn_server.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "metadata/metadata.h"

struct kvpi_rpc_server {
    kvpi_conn_server *conns;
    kvpi_rpc_desc_fn desc_fn;
    kvpi_rpc_notify_fn notify_fn; /* NULL: notifications are refused */
    void *ctx;
    const kvpi_auth *auth; /* NULL: unauthenticated */
    char addr[KVPI_HOST_MAX + 8];
    int port;             /* the bound port, also when started with port 0 */
    pthread_mutex_t lock; /* guards warned */
    int warned;           /* a malformed frame was logged at WARN once */
};

static int valid_type(unsigned type)
{
    return type <= KVPI_RPC_PROBE;
}

/* Copy the current detail so it can be wrapped in a new message. */
static kvp_status wrap(kvp_status st, const char *what, const char *addr)
{
    return kvpi_error(st, "%s %s: %s", what, addr, kvp_last_error());
}

void kvpi_rpc_frame_header(int type, size_t json_len, uint8_t hdr[KVPI_RPC_HDR_LEN])
{
    kvpi_put_le64(hdr, (uint64_t)json_len + 1);
    hdr[8] = (uint8_t)type;
}

kvp_status kvpi_rpc_frame_decode(const uint8_t *buf, size_t have, int *type, size_t *json_len)
{
    uint64_t len = kvpi_get_le64(buf);
    if (len == 0 || len > KVPI_RPC_MAX_FRAME)
        return kvpi_error(KVP_EPROTO, "frame length %llu is not in 1..%u", (unsigned long long)len,
                          KVPI_RPC_MAX_FRAME);
    if (have > 8 && !valid_type(buf[8]))
        return kvpi_error(KVP_EPROTO, "unknown frame type %u", buf[8]);
    *type = have > 8 ? buf[8] : -1;
    *json_len = (size_t)len - 1;
    return KVP_OK;
}

/* ---- server ---- */

static void warn_once(kvpi_rpc_server *srv, const char *what)
{
    pthread_mutex_lock(&srv->lock);
    int first = !srv->warned;
    srv->warned = 1;
    pthread_mutex_unlock(&srv->lock);
    if (first)
        KVPI_WARN("handshake server %s: %s; closing that connection (further ones logged at "
                  "debug)",
                  srv->addr, what);
    else
        KVPI_DEBUG("handshake server %s: %s; closing that connection", srv->addr, what);
}

/* Read the request frame under the connection's deadlines: its header within
 * timeout_ms of the first byte, its body within timeout_ms + length / min_rate.
 * The request counts as incomplete until the whole frame is in, so a flood of
 * connections that trickle their frames is evicted before anyone waiting for
 * a reply. */
static kvp_status serve_recv(kvpi_conn *c, int *type, char **json)
{
    uint8_t hdr[KVPI_RPC_HDR_LEN];
    int got;
    size_t n;
    kvp_status st = kvpi_conn_next(c, hdr, 8);
    if (st) return st;
    if ((st = kvpi_rpc_frame_decode(hdr, 8, &got, &n))) return st;
    if ((st = kvpi_conn_recv(c, hdr + 8, 1))) return st;
    if ((st = kvpi_rpc_frame_decode(hdr, sizeof hdr, &got, &n))) return st;
    if (!kvpi_conn_expect(c, n + 1)) return KVP_ECLOSED;
    char *text = malloc(n + 1);
    if (!text)
        return kvpi_error(KVP_ENOMEM, "out of memory for a %llu-byte frame",
                          (unsigned long long)n + 1);
    if ((st = kvpi_conn_recv(c, text, n))) {
        free(text);
        return st;
    }
    text[n] = '\0';
    *type = got;
    *json = text;
    return KVP_OK;
}

char *kvpi_rpc_notify_json(const char *name, const char *msg)
{
    cJSON *o = cJSON_CreateObject();
    char *text = NULL;
    if (o && cJSON_AddStringToObject(o, "name", name ? name : "") &&
        cJSON_AddStringToObject(o, "notify_msg", msg ? msg : ""))
        text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return text;
}

/* The refusal of a notification: an empty notify_msg, which is what Mooncake's
 * sender checks, and why. */
static char *notify_refusal(kvp_status st, const char *why)
{
    cJSON *o = cJSON_CreateObject();
    char *text = NULL;
    if (o && cJSON_AddStringToObject(o, "name", "") &&
        cJSON_AddStringToObject(o, "notify_msg", "") &&
        cJSON_AddStringToObject(o, KVPI_RPC_REFUSED_FIELD, why) &&
        cJSON_AddNumberToObject(o, KVPI_RPC_STATUS_FIELD, (double)st))
        text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return text;
}

/* A string member, or "" where it is absent (Mooncake reads both fields with
 * asString, which makes an absent one ""). NULL: present and not a string. */
static const char *string_or_empty(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!v) return "";
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* A NOTIFY request: hand it to the owner; the reply says whether it took it. */
static char *serve_notify(kvpi_rpc_server *srv, const char *request)
{
    cJSON *o = cJSON_Parse(request);
    const char *name = cJSON_IsObject(o) ? string_or_empty(o, "name") : NULL;
    const char *msg = cJSON_IsObject(o) ? string_or_empty(o, "notify_msg") : NULL;
    char *reply;
    if (!name || !msg) {
        reply = notify_refusal(KVP_EPROTO, "a notification must be a JSON object whose 'name' "
                                           "and 'notify_msg' are strings");
        KVPI_WARN_LIMITED("handshake server %s: refused a notification that is not "
                          "{\"name\": str, \"notify_msg\": str}",
                          srv->addr);
    } else if (!srv->notify_fn) {
        reply = notify_refusal(KVP_ENOTSUP, "this handshake server takes no notifications");
    } else {
        kvp_status st = srv->notify_fn(srv->ctx, name, msg);
        reply = st ? notify_refusal(st, kvp_last_error()) : strdup(KVPI_RPC_NOTIFY_OK);
    }
    cJSON_Delete(o);
    return reply;
}

kvp_status kvpi_rpc_notify_reply_check(const char *reply)
{
    cJSON *o = cJSON_Parse(reply ? reply : "");
    kvp_status st = KVP_OK;
    if (!cJSON_IsObject(o)) {
        st = kvpi_error(KVP_EPROTO, "the notification's reply is not a JSON object");
        goto out;
    }
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(o, "notify_msg");
    if (cJSON_IsString(m) && *m->valuestring) goto out;
    const cJSON *why = cJSON_GetObjectItemCaseSensitive(o, KVPI_RPC_REFUSED_FIELD);
    const cJSON *code = cJSON_GetObjectItemCaseSensitive(o, KVPI_RPC_STATUS_FIELD);
    st = KVP_ENOTSUP;
    if (cJSON_IsNumber(code) && code->valuedouble >= 1 && code->valuedouble <= KVP_EAUTH)
        st = (kvp_status)code->valueint;
    st = kvpi_error(st, "the peer refused the notification: %s",
                    cJSON_IsString(why) ? why->valuestring
                                        : "its reply has no notify_msg (a peer that does not "
                                          "queue notifications)");
out:
    cJSON_Delete(o);
    return st;
}

static char *reply_for(kvpi_rpc_server *srv, int type, const char *request)
{
    switch (type) {
    case KVPI_RPC_METADATA:
        return srv->desc_fn(srv->ctx);
    case KVPI_RPC_NOTIFY:
        return serve_notify(srv, request);
    case KVPI_RPC_PROBE:
        return strdup(KVPI_RPC_PROBE_OK);
    default:
        return strdup("{}");
    }
}

static void serve(kvpi_conn *c)
{
    kvpi_rpc_server *srv = kvpi_conn_ctx(c);
    int type = 0;
    char *request = NULL, *reply = NULL;
    kvp_status st = serve_recv(c, &type, &request);
    if (st == KVP_EPROTO) warn_once(srv, kvp_last_error());
    if (st) {
        if (st != KVP_ECLOSED) KVPI_DEBUG("handshake server %s: %s", srv->addr, kvp_last_error());
        return;
    }
    reply = reply_for(srv, type, request);
    size_t n = reply ? strlen(reply) : 0;
    if (!reply) {
        KVPI_WARN("handshake server %s: no local descriptor to answer with", srv->addr);
    } else if (n + 1 > KVPI_RPC_MAX_FRAME) {
        KVPI_WARN("handshake server %s: local descriptor exceeds %u bytes", srv->addr,
                  KVPI_RPC_MAX_FRAME);
    } else if (kvpi_conn_busy(c, n + KVPI_RPC_HDR_LEN)) {
        uint8_t hdr[KVPI_RPC_HDR_LEN];
        kvpi_rpc_frame_header(type, n, hdr);
        if ((st = kvpi_conn_send(c, hdr, sizeof hdr)) == KVP_OK) st = kvpi_conn_send(c, reply, n);
        if (st) KVPI_DEBUG("handshake server %s: reply: %s", srv->addr, kvp_last_error());
    }
    free(request);
    free(reply);
}

/* Refused connections of every listener of this kind, for the log. */
static kvpi_log_limit auth_log;

/* An unauthenticated request gets a reply frame of its own type that says
 * why (a kvpipe peer without the key reports it; Mooncake's cannot parse it
 * as a descriptor), then the close. */
static void refuse_unauthenticated(kvpi_conn *c, kvpi_rpc_server *srv)
{
    uint8_t hdr[KVPI_RPC_HDR_LEN];
    static const char why[] =
        "{\"" KVPI_AUTH_FIELD "\":\"required\",\"error\":\"this kvpipe engine is "
        "authenticated: its peers must hold its key (docs/security.md)\"}";
    kvpi_log_limited(&auth_log, KVP_LOG_WARN, KVPI_LOG_SUBSYS,
                     "handshake server %s: refused a connection: the peer sent a handshake frame "
                     "without authenticating: a Mooncake peer or a kvpipe peer without the key",
                     srv->addr);
    int type;
    size_t len;
    if (kvpi_conn_recv(c, hdr, sizeof hdr) || kvpi_rpc_frame_decode(hdr, sizeof hdr, &type, &len))
        return;
    kvpi_rpc_frame_header(type, sizeof why - 1, hdr);
    if (kvpi_conn_send(c, hdr, sizeof hdr) == KVP_OK) kvpi_conn_send(c, why, sizeof why - 1);
}

static kvp_status auth_setup(kvpi_conn *c)
{
    kvpi_rpc_server *srv = kvpi_conn_ctx(c);
    int hello = kvpi_auth_peek(kvpi_conn_fd(c), kvpi_conn_deadline(c));
    if (hello == 1) return kvpi_auth_conn_setup(c, srv->auth, "rpc", &auth_log);
    if (hello == 0) refuse_unauthenticated(c, srv);
    return kvpi_error(KVP_EAUTH, "handshake server %s: an unauthenticated connection", srv->addr);
}

static const kvpi_conn_handler rpc_handler = {.serve = serve};
static const kvpi_conn_handler rpc_auth_handler = {.setup = auth_setup, .serve = serve};

kvp_status kvpi_rpc_server_start(const char *host, int port, const kvpi_conn_limits *limits,
                                 kvpi_rpc_desc_fn desc_fn, void *ctx, kvpi_rpc_server **out)
{
    return kvpi_rpc_server_start_auth(host, port, limits, NULL, desc_fn, ctx, out);
}

kvp_status kvpi_rpc_server_start_auth(const char *host, int port, const kvpi_conn_limits *limits,
                                      const kvpi_auth *auth, kvpi_rpc_desc_fn desc_fn, void *ctx,
                                      kvpi_rpc_server **out)
{
    return kvpi_rpc_server_start_notify(host, port, limits, auth, desc_fn, NULL, ctx, out);
}

kvp_status kvpi_rpc_server_start_notify(const char *host, int port, const kvpi_conn_limits *limits,
                                        const kvpi_auth *auth, kvpi_rpc_desc_fn desc_fn,
                                        kvpi_rpc_notify_fn notify_fn, void *ctx,
                                        kvpi_rpc_server **out)
{
    if (!host || !desc_fn || !out)
        return kvpi_error(KVP_EINVAL, "handshake server: host, desc_fn and out are required");
    kvpi_rpc_server *srv = calloc(1, sizeof *srv);
    if (!srv) return kvpi_error(KVP_ENOMEM, "out of memory");
    srv->desc_fn = desc_fn;
    srv->notify_fn = notify_fn;
    srv->ctx = ctx;
    srv->auth = auth;
    pthread_mutex_init(&srv->lock, NULL);
    int fd, bound = 0;
    kvp_status st = kvpi_tcp_listen(host, port, &fd, &bound);
    if (st) goto fail;
    srv->port = bound;
    kvpi_hostport_format(host, bound, srv->addr, sizeof srv->addr);
    /* One request per connection: it must begin, like every part of it,
     * within timeout_ms; idle_timeout_ms is for persistent connections. */
    kvpi_conn_limits lim = kvpi_conn_limits_resolve(limits);
    lim.idle_timeout_ms = lim.timeout_ms;
    char name[KVPI_HOST_MAX + 32];
    snprintf(name, sizeof name, "handshake server %s", srv->addr);
    if ((st = kvpi_conn_server_start(fd, name, &lim, auth ? &rpc_auth_handler : &rpc_handler, srv,
                                     &srv->conns)))
        goto fail;
    KVPI_INFO("handshake server listening on %s", srv->addr);
    *out = srv;
    return KVP_OK;
fail:
    pthread_mutex_destroy(&srv->lock);
    free(srv);
    return st;
}

int kvpi_rpc_server_port(const kvpi_rpc_server *server)
{
    return server->port;
}

void kvpi_rpc_server_stop(kvpi_rpc_server *server)
{
    if (!server) return;
    kvpi_conn_server_stop(server->conns);
    pthread_mutex_destroy(&server->lock);
    free(server);
}

/* ---- client ---- */

static kvp_status call_on(int fd, int type, const char *json, uint64_t deadline, char **reply)
{
    size_t n = strlen(json);
    uint8_t hdr[KVPI_RPC_HDR_LEN];
    kvpi_rpc_frame_header(type, n, hdr);
    kvp_status st = kvpi_send_all_by(fd, hdr, sizeof hdr, deadline);
    if (!st) st = kvpi_send_all_by(fd, json, n, deadline);
    if (!st) st = kvpi_recv_all_by(fd, hdr, sizeof hdr, deadline);
    if (st) return st;
    int got;
    if ((st = kvpi_rpc_frame_decode(hdr, sizeof hdr, &got, &n))) return st;
    if (got != type)
        return kvpi_error(KVP_EPROTO, "reply has frame type %d, expected %d", got, type);
    char *text = malloc(n + 1);
    if (!text)
        return kvpi_error(KVP_ENOMEM, "out of memory for a %llu-byte frame",
                          (unsigned long long)n + 1);
    if ((st = kvpi_recv_all_by(fd, text, n, deadline))) {
        free(text);
        return st;
    }
    text[n] = '\0';
    *reply = text;
    return KVP_OK;
}

kvp_status kvpi_rpc_call(const char *host, int port, int type, const char *json, int timeout_ms,
                         char **reply)
{
    return kvpi_rpc_call_auth(host, port, NULL, type, json, timeout_ms, reply);
}

kvp_status kvpi_rpc_call_auth(const char *host, int port, const kvpi_auth *auth, int type,
                              const char *json, int timeout_ms, char **reply)
{
    char addr[KVPI_HOST_MAX + 8];
    if (!host || !json || !reply)
        return kvpi_error(KVP_EINVAL, "handshake: host, json and reply are required");
    kvpi_hostport_format(host, port, addr, sizeof addr);
    if (type < 0 || !valid_type((unsigned)type))
        return kvpi_error(KVP_EINVAL, "handshake with %s: unknown frame type %d", addr, type);
    if (strlen(json) + 1 > KVPI_RPC_MAX_FRAME)
        return kvpi_error(KVP_EINVAL, "handshake with %s: request of %zu bytes exceeds %u", addr,
                          strlen(json), KVPI_RPC_MAX_FRAME);
    if (timeout_ms <= 0) timeout_ms = KVPI_DEFAULT_TIMEOUT_MS;
    /* The whole exchange, reply included, within timeout_ms: a peer that
     * trickles its reply cannot hold the caller longer. */
    uint64_t deadline = kvpi_deadline_ns(timeout_ms);
    int fd;
    kvp_status st = kvpi_tcp_connect(host, port, timeout_ms, &fd);
    if (st) return wrap(st, "handshake with", addr);
    char *text = NULL;
    if (auth) st = kvpi_auth_client(auth, fd, "rpc", deadline);
    if (!st) st = call_on(fd, type, json, deadline, &text);
    close(fd);
    if (st == KVP_ETIMEDOUT) {
        return kvpi_error(st, "handshake with %s: no complete reply within %d ms: %s", addr,
                          timeout_ms, kvp_last_error());
    }
    if (st) return wrap(st, "handshake with", addr);
    *reply = text;
    return KVP_OK;
}
