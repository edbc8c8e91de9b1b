/* The etcd metadata store: etcd's v3 KV API through its JSON gateway over
 * HTTP, with libcurl.
 *
 *   POST /v3/kv/put         {"key": b64, "value": b64}
 *   POST /v3/kv/range       {"key": b64}  -> {"kvs": [{"value": b64}]} or no "kvs"
 *   POST /v3/kv/deleterange {"key": b64}
 *   POST /v3/kv/txn         {"success": [{"request_range": {"key": b64}}, ...]}
 *                           (several keys in one round trip: a segment lookup)
 *   POST /v3/watch          a stream of changes under a prefix (below)
 *
 * /v3/ is the gateway prefix of etcd 3.4 and later (3.3 served /v3beta/, which
 * 3.4 still accepts; 3.5 dropped it), so /v3/ is the one to use.
 *
 * Several endpoints ("etcd://a:p,b:p"): each request starts at the endpoint
 * that last worked and fails over to the next one on a connection-level error
 * or an HTTP 503 (a member without a leader). Each request takes a CURL
 * handle of its endpoint's pool (kvpi_curl_pool: its kept-alive connection,
 * owned for the request), so concurrent calls share nothing but the pools'
 * locks and the preferred index, which is atomic. */
#include <cjson/cJSON.h>
#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "metadata/curl_common.h"
#include "metadata/metadata.h"

#define ETCD_SCHEME "etcd://"
#define ETCD_DEFAULT_PORT 2379
#define ETCD_MAX_ENDPOINTS 16
#define ETCD_MAX_BODY ((size_t)64 << 20) /* far above etcd's own request limit */
#define ETCD_PROBE_KEY "kvpipe/probe"
#define ETCD_ERR_MAX 1024

typedef struct etcd_store {
    char *urls[ETCD_MAX_ENDPOINTS]; /* "http://h:p" */
    char *addrs;                    /* "h:p,h:p", for messages */
    size_t n;
    atomic_size_t preferred;                    /* the endpoint that last answered */
    atomic_size_t watch_next;                   /* the endpoint the next watch stream tries */
    kvpi_curl_pool handles[ETCD_MAX_ENDPOINTS]; /* kept-alive connections, per endpoint */
    int timeout_ms;
    int bare; /* the connection string had no scheme: etcd was assumed */
} etcd_store;

/* ---- base64 (RFC 4648, standard alphabet, padded) ---- */

static const char b64_alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static char *b64_encode(const unsigned char *in, size_t len)
{
    char *out = malloc((len + 2) / 3 * 4 + 1);
    if (!out) return NULL;
    char *p = out;
    for (size_t i = 0; i < len; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16;
        if (i + 1 < len) v |= (uint32_t)in[i + 1] << 8;
        if (i + 2 < len) v |= in[i + 2];
        *p++ = b64_alphabet[(v >> 18) & 63];
        *p++ = b64_alphabet[(v >> 12) & 63];
        *p++ = i + 1 < len ? b64_alphabet[(v >> 6) & 63] : '=';
        *p++ = i + 2 < len ? b64_alphabet[v & 63] : '=';
    }
    *p = '\0';
    return out;
}

static int b64_value(char c)
{
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict: whole quads only, padding only at the very end, no stray bits. An
 * etcd that sends anything else is not speaking the protocol, and a lenient
 * decoder would hand the engine a silently different descriptor. Returns a
 * NUL-terminated buffer and its length, or NULL. */
static unsigned char *b64_decode(const char *in, size_t *out_len)
{
    size_t len = strlen(in);
    if (len % 4) return NULL;
    size_t pad = 0;
    if (len && in[len - 1] == '=') pad++;
    if (pad && len > 1 && in[len - 2] == '=') pad++;
    unsigned char *out = malloc(len / 4 * 3 + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        int last = i + 4 == len;
        int v[4];
        for (int k = 0; k < 4; k++) {
            int is_pad = last && k >= 4 - (int)pad;
            v[k] = is_pad ? 0 : b64_value(in[i + k]);
            if (v[k] < 0) goto bad;
        }
        uint32_t w =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (!last || pad < 2) out[o++] = (unsigned char)(w >> 8);
        if (!last || pad < 1) out[o++] = (unsigned char)w;
        if (last && pad && (w & (pad == 2 ? 0xffffu : 0xffu))) goto bad; /* stray bits */
    }
    out[o] = '\0';
    *out_len = o;
    return out;
bad:
    free(out);
    return NULL;
}

/* ---- connection string ---- */

static kvp_status add_endpoint(etcd_store *s, const char *conn, const char *text)
{
    kvpi_hostport hp;
    if (kvpi_hostport_parse(text, ETCD_DEFAULT_PORT, &hp) != KVP_OK)
        return kvpi_error(KVP_EMETADATA, "etcd connection string '%s': endpoint '%s': %s", conn,
                          text, kvp_last_error());
    if (s->n == ETCD_MAX_ENDPOINTS)
        return kvpi_error(KVP_EMETADATA, "etcd connection string '%s': more than %d endpoints",
                          conn, ETCD_MAX_ENDPOINTS);
    char addr[KVPI_HOST_MAX + 16], url[KVPI_HOST_MAX + 32];
    kvpi_hostport_format(hp.host, hp.port, addr, sizeof addr);
    snprintf(url, sizeof url, "http://%s", addr);
    s->urls[s->n] = strdup(url);
    if (!s->urls[s->n]) return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    s->n++;
    return KVP_OK;
}

/* Endpoints are separated by ',' (or ';', as Mooncake's etcd wrapper writes). */
static kvp_status parse_endpoints(etcd_store *s, const char *conn)
{
    const char *list = conn;
    if (strncasecmp(conn, ETCD_SCHEME, strlen(ETCD_SCHEME)) == 0) list += strlen(ETCD_SCHEME);
    char *copy = strdup(list);
    if (!copy) return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    kvp_status st = KVP_OK;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ",;", &save); tok && !st; tok = strtok_r(NULL, ",;", &save))
        st = add_endpoint(s, conn, tok);
    free(copy);
    if (!st && s->n == 0)
        st = kvpi_error(KVP_EMETADATA, "etcd connection string '%s': no endpoint", conn);
    return st;
}

static kvp_status format_addrs(etcd_store *s)
{
    size_t len = 1;
    for (size_t i = 0; i < s->n; i++)
        len += strlen(s->urls[i]) + 1;
    s->addrs = malloc(len);
    if (!s->addrs) return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    s->addrs[0] = '\0';
    for (size_t i = 0; i < s->n; i++) {
        if (i) strcat(s->addrs, ",");
        strcat(s->addrs, s->urls[i] + strlen("http://"));
    }
    return KVP_OK;
}

/* ---- one request ---- */

/* Errors after which another endpoint may well answer. */
static int is_connection_error(CURLcode rc)
{
    switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
        return 1;
    default:
        return 0;
    }
}

enum attempt_result { ATTEMPT_OK, ATTEMPT_RETRY, ATTEMPT_FAIL };

/* POST body to one endpoint. On failure, appends a description to err. */
static enum attempt_result attempt(etcd_store *s, size_t idx, const char *path, const char *body,
                                   kvpi_curl_body *resp, long *http_code, char *err, size_t err_len)
{
    CURL *h = kvpi_curl_take(&s->handles[idx]);
    if (!h) {
        snprintf(err, err_len, "curl_easy_init failed");
        return ATTEMPT_FAIL;
    }
    char url[KVPI_HOST_MAX + 64], curl_err[CURL_ERROR_SIZE] = "";
    snprintf(url, sizeof url, "%s%s", s->urls[idx], path);
    struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    kvpi_curl_setup(h, url, s->timeout_ms, resp, ETCD_MAX_BODY, curl_err);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
    CURLcode rc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, http_code);
    curl_slist_free_all(hdrs);
    kvpi_curl_give(&s->handles[idx], h, rc == CURLE_OK);
    const char *addr = s->urls[idx] + strlen("http://");
    size_t used = strlen(err);
    if (rc != CURLE_OK) {
        snprintf(err + used, err_len - used, "%s%s: %s", used ? "; " : "", addr,
                 resp->too_big ? "response too large"
                 : curl_err[0] ? curl_err
                               : curl_easy_strerror(rc));
        return is_connection_error(rc) ? ATTEMPT_RETRY : ATTEMPT_FAIL;
    }
    if (*http_code == 503) {
        snprintf(err + used, err_len - used, "%s%s: HTTP 503 (no leader?)", used ? "; " : "", addr);
        return ATTEMPT_RETRY;
    }
    return ATTEMPT_OK;
}

/* etcd's gateway serves every /v3/kv/ path with POST: a 404 or 405 there is
 * another kind of server, most likely an HTTP metadata store given without
 * its scheme. Say what was assumed and what was probably meant. */
static void not_etcd_hint(const etcd_store *s, size_t idx, long code, char *out, size_t len)
{
    out[0] = '\0';
    if (code != 404 && code != 405) return;
    const char *addr = s->urls[idx] + strlen("http://");
    snprintf(out, len,
             "; this does not answer like etcd: %s was taken as etcd endpoints (%s); for an HTTP "
             "metadata store (Mooncake's or `kvpipe metadata-server`) write http://%s/metadata",
             s->addrs,
             s->bare ? "a connection string without a scheme means etcd, as in Mooncake"
                     : "etcd:// says so",
             addr);
}

/* POST to the preferred endpoint, failing over to the others in order. *resp
 * gets the body of a 2xx answer (malloc'ed). */
static kvp_status request(etcd_store *s, const char *path, const char *body, cJSON **resp_out)
{
    char err[ETCD_ERR_MAX] = "";
    size_t first = atomic_load(&s->preferred);
    for (size_t i = 0; i < s->n; i++) {
        size_t idx = (first + i) % s->n;
        kvpi_curl_body resp = {0};
        long code = 0;
        enum attempt_result r = attempt(s, idx, path, body, &resp, &code, err, sizeof err);
        if (r == ATTEMPT_RETRY) {
            free(resp.data);
            continue;
        }
        if (r == ATTEMPT_FAIL) {
            free(resp.data);
            return kvpi_error(KVP_EMETADATA, "etcd at %s: %s failed: %s", s->addrs, path, err);
        }
        if (idx != first) {
            atomic_store(&s->preferred, idx);
            KVPI_INFO("etcd: failed over to %s", s->urls[idx]);
        }
        cJSON *json = resp.data ? cJSON_Parse(resp.data) : NULL;
        kvp_status st = KVP_OK;
        if (code / 100 != 2) {
            const cJSON *msg = cJSON_GetObjectItemCaseSensitive(json, "error");
            char hint[512];
            not_etcd_hint(s, idx, code, hint, sizeof hint);
            const char *text = cJSON_IsString(msg) ? msg->valuestring
                               : resp.data         ? resp.data
                                                   : "(empty body)";
            size_t n = strcspn(text, "\r\n");
            st = kvpi_error(KVP_EMETADATA, "etcd at %s: %s: HTTP %ld: %.*s%s", s->urls[idx] + 7,
                            path, code, (int)(n < 200 ? n : 200), text, hint);
        } else if (!cJSON_IsObject(json)) {
            st = kvpi_error(KVP_EMETADATA, "etcd at %s: %s: answer is not a JSON object",
                            s->urls[idx] + 7, path);
        }
        free(resp.data);
        if (st) {
            cJSON_Delete(json);
            return st;
        }
        *resp_out = json;
        return KVP_OK;
    }
    return kvpi_error(KVP_EMETADATA, "etcd at %s unreachable: %s", s->addrs, err);
}

/* {"key": b64(key)} plus, if value is non-NULL, "value": b64(value). */
static char *request_body(const char *key, const char *value)
{
    char *k = b64_encode((const unsigned char *)key, strlen(key));
    char *v = value ? b64_encode((const unsigned char *)value, strlen(value)) : NULL;
    char *body = NULL;
    if (k && (v || !value)) {
        size_t len = strlen(k) + (v ? strlen(v) : 0) + 32;
        body = malloc(len);
        if (body && v)
            snprintf(body, len, "{\"key\":\"%s\",\"value\":\"%s\"}", k, v);
        else if (body)
            snprintf(body, len, "{\"key\":\"%s\"}", k);
    }
    free(k);
    free(v);
    return body;
}

/* POST {"key", "value" if non-NULL} to path; *resp as request(). */
static kvp_status key_request(etcd_store *s, const char *path, const char *key, const char *value,
                              cJSON **resp)
{
    char *body = request_body(key, value);
    if (!body) return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    kvp_status st = request(s, path, body, resp);
    free(body);
    return st;
}

/* ---- ops ---- */

static void etcd_close(void *store)
{
    etcd_store *s = store;
    if (!s) return;
    for (size_t i = 0; i < ETCD_MAX_ENDPOINTS; i++)
        kvpi_curl_pool_destroy(&s->handles[i]);
    for (size_t i = 0; i < s->n; i++)
        free(s->urls[i]);
    free(s->addrs);
    free(s);
}

static kvp_status etcd_get(void *store, const char *key, char **value);

static kvp_status etcd_open(const char *conn, int timeout_ms, void **out)
{
    kvp_status init = kvpi_curl_init(conn);
    if (init) return init;
    etcd_store *s = calloc(1, sizeof *s);
    if (!s) return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    for (size_t i = 0; i < ETCD_MAX_ENDPOINTS; i++)
        kvpi_curl_pool_init(&s->handles[i]);
    s->timeout_ms = timeout_ms > 0 ? timeout_ms : KVPI_DEFAULT_TIMEOUT_MS;
    s->bare = strncasecmp(conn, ETCD_SCHEME, strlen(ETCD_SCHEME)) != 0;
    kvp_status st = parse_endpoints(s, conn);
    if (!st) st = format_addrs(s);
    if (st) goto fail;
    /* A range on a probe key tells a store that is down at open, not at the
     * first publish. */
    char *probe = NULL;
    st = etcd_get(s, ETCD_PROBE_KEY, &probe);
    free(probe);
    if (st == KVP_ENOTFOUND) st = KVP_OK;
    if (st) goto fail;
    *out = s;
    return KVP_OK;
fail:
    etcd_close(s);
    return st;
}

static kvp_status decode_value(etcd_store *s, const char *key, const cJSON *kv, char **value)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(kv, "value");
    /* proto3 JSON leaves out empty fields: no "value" is the empty string. */
    if (!v) {
        *value = strdup("");
        return *value ? KVP_OK : kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    }
    size_t len = 0;
    unsigned char *raw = cJSON_IsString(v) ? b64_decode(v->valuestring, &len) : NULL;
    if (!raw || memchr(raw, '\0', len)) {
        free(raw);
        return kvpi_error(KVP_EMETADATA, "etcd at %s: value of '%s' is not base64 text", s->addrs,
                          key);
    }
    *value = (char *)raw;
    return KVP_OK;
}

static kvp_status etcd_get(void *store, const char *key, char **value)
{
    etcd_store *s = store;
    cJSON *resp = NULL;
    kvp_status st = key_request(s, "/v3/kv/range", key, NULL, &resp);
    if (st) return st;
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(resp, "kvs");
    const cJSON *kv = cJSON_IsArray(kvs) ? cJSON_GetArrayItem(kvs, 0) : NULL;
    if (!kv)
        st = kvpi_error(KVP_ENOTFOUND, "etcd at %s: no key '%s'", s->addrs, key);
    else if (!cJSON_IsObject(kv))
        st =
            kvpi_error(KVP_EMETADATA, "etcd at %s: malformed range answer for '%s'", s->addrs, key);
    else
        st = decode_value(s, key, kv, value);
    cJSON_Delete(resp);
    return st;
}

/* One txn of range requests, without compares (so its success branch runs):
 *   {"success": [{"request_range": {"key": b64}}, ...]}
 *   -> {"responses": [{"response_range": {"kvs": [...]}}, ...]} */
static kvp_status etcd_get_many(void *store, const char *const *keys, size_t n, char **values)
{
    etcd_store *s = store;
    cJSON *body = cJSON_CreateObject(), *ops = cJSON_AddArrayToObject(body, "success");
    int ok = ops != NULL;
    for (size_t i = 0; i < n && ok; i++) {
        char *k = b64_encode((const unsigned char *)keys[i], strlen(keys[i]));
        cJSON *op = cJSON_CreateObject(), *range = cJSON_AddObjectToObject(op, "request_range");
        ok =
            k && range && cJSON_AddStringToObject(range, "key", k) && cJSON_AddItemToArray(ops, op);
        if (!ok) cJSON_Delete(op);
        free(k);
    }
    char *text = ok ? cJSON_PrintUnformatted(body) : NULL;
    cJSON_Delete(body);
    if (!text) return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    cJSON *resp = NULL;
    kvp_status st = request(s, "/v3/kv/txn", text, &resp);
    free(text);
    if (st) return st;
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(resp, "responses");
    if (!cJSON_IsArray(rs) || cJSON_GetArraySize(rs) != (int)n)
        st = kvpi_error(KVP_EMETADATA, "etcd at %s: malformed txn answer", s->addrs);
    for (size_t i = 0; i < n; i++)
        values[i] = NULL;
    for (size_t i = 0; i < n && !st; i++) {
        const cJSON *r =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(rs, (int)i), "response_range");
        const cJSON *kv = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r, "kvs"), 0);
        if (!cJSON_IsObject(r))
            st = kvpi_error(KVP_EMETADATA, "etcd at %s: malformed txn answer for '%s'", s->addrs,
                            keys[i]);
        else if (kv)
            st = cJSON_IsObject(kv)
                     ? decode_value(s, keys[i], kv, &values[i])
                     : kvpi_error(KVP_EMETADATA, "etcd at %s: malformed range answer for '%s'",
                                  s->addrs, keys[i]);
    }
    cJSON_Delete(resp);
    if (st) kvpi_store_values_free(values, n);
    return st;
}

static kvp_status etcd_put(void *store, const char *key, const char *value)
{
    cJSON *resp = NULL;
    kvp_status st = key_request(store, "/v3/kv/put", key, value, &resp);
    cJSON_Delete(resp);
    return st;
}

static kvp_status etcd_del(void *store, const char *key)
{
    cJSON *resp = NULL;
    kvp_status st = key_request(store, "/v3/kv/deleterange", key, NULL, &resp);
    cJSON_Delete(resp);
    return st;
}

/* ---- watch: POST /v3/watch, a stream of newline-separated JSON ----
 *   -> {"create_request": {"key": b64(prefix), "range_end": b64(prefix+1)}}
 *   <- {"result": {"created": true, ...}}
 *   <- {"result": {"events": [{"type": "DELETE"?, "kv": {"key": b64, ...}}]}}
 * (a put event leaves "type" out: proto3's default). A "canceled" result or
 * an "error" line ends the stream. One curl multi handle, so that the wait
 * also watches stop_fd. */

typedef struct etcd_watch {
    etcd_store *s;
    const char *addr;
    kvpi_curl_body line; /* the part of the stream after the last newline */
    void (*changed)(void *ctx, const char *key);
    void *ctx;
    char err[256]; /* why the stream ended, when it says */
} etcd_watch;

/* One message of the stream; -1 when it ends the stream (err says why). */
static int watch_message(etcd_watch *w, const char *text)
{
    cJSON *msg = cJSON_Parse(text);
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(msg, "result");
    const cJSON *error = cJSON_GetObjectItemCaseSensitive(msg, "error");
    int rc = 0;
    if (!cJSON_IsObject(res)) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(error, "message");
        snprintf(w->err, sizeof w->err, "%.200s",
                 cJSON_IsString(m) ? m->valuestring : "a watch message without a result");
        rc = -1;
    } else if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "canceled"))) {
        const cJSON *why = cJSON_GetObjectItemCaseSensitive(res, "cancel_reason");
        snprintf(w->err, sizeof w->err, "watch canceled%s%.200s", cJSON_IsString(why) ? ": " : "",
                 cJSON_IsString(why) ? why->valuestring : "");
        rc = -1;
    } else {
        if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "created")))
            w->changed(w->ctx, NULL);
        const cJSON *ev;
        cJSON_ArrayForEach(ev, cJSON_GetObjectItemCaseSensitive(res, "events"))
        {
            const cJSON *kv = cJSON_GetObjectItemCaseSensitive(ev, "kv");
            const cJSON *k = cJSON_GetObjectItemCaseSensitive(kv, "key");
            size_t len;
            unsigned char *key = cJSON_IsString(k) ? b64_decode(k->valuestring, &len) : NULL;
            if (key && !memchr(key, '\0', len)) w->changed(w->ctx, (const char *)key);
            free(key);
        }
    }
    cJSON_Delete(msg);
    return rc;
}

static size_t watch_on_data(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    etcd_watch *w = userdata;
    size_t n = size * nmemb;
    if (kvpi_curl_on_data(ptr, size, nmemb, &w->line) != n) return 0;
    char *start = w->line.data, *nl;
    while ((nl = memchr(start, '\n', w->line.len - (size_t)(start - w->line.data)))) {
        *nl = '\0';
        if (start[strspn(start, " \r\t")] && watch_message(w, start) < 0) return 0;
        start = nl + 1;
    }
    size_t left = w->line.len - (size_t)(start - w->line.data);
    memmove(w->line.data, start, left);
    w->line.len = left;
    w->line.data[left] = '\0';
    return n;
}

static kvp_status etcd_watch_run(void *store, const char *prefix, int stop_fd,
                                 void (*changed)(void *ctx, const char *key), void *ctx)
{
    etcd_store *s = store;
    size_t idx = (atomic_load(&s->preferred) + atomic_fetch_add(&s->watch_next, 1)) % s->n;
    size_t plen = strlen(prefix);
    char *end = strdup(prefix);
    if (!end || !plen) {
        free(end);
        return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    }
    end[plen - 1]++; /* the range [prefix, prefix with its last byte + 1) */
    char *k = b64_encode((const unsigned char *)prefix, plen);
    char *e = b64_encode((const unsigned char *)end, plen);
    free(end);
    char *body = NULL;
    if (k && e &&
        asprintf(&body, "{\"create_request\":{\"key\":\"%s\",\"range_end\":\"%s\"}}", k, e) < 0)
        body = NULL;
    free(k);
    free(e);
    CURLM *multi = curl_multi_init();
    CURL *h = curl_easy_init();
    if (!body || !multi || !h) {
        free(body);
        if (h) curl_easy_cleanup(h);
        if (multi) curl_multi_cleanup(multi);
        return kvpi_error(KVP_ENOMEM, "etcd: out of memory");
    }
    etcd_watch w = {
        .s = s, .addr = s->urls[idx] + strlen("http://"), .changed = changed, .ctx = ctx};
    char url[KVPI_HOST_MAX + 64], curl_err[CURL_ERROR_SIZE] = "";
    snprintf(url, sizeof url, "%s/v3/watch", s->urls[idx]);
    struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    kvpi_curl_setup(h, url, s->timeout_ms, &w.line, ETCD_MAX_BODY, curl_err);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 0L); /* a stream: no end */
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, watch_on_data);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &w);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
    /* A store that vanishes without a reset is noticed within about 20 s. */
    curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 10L);
    curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 5L);
    curl_multi_add_handle(multi, h);
    kvp_status st = KVP_OK;
    int running = 1, stopped = 0;
    while (running && !stopped) {
        CURLMcode mc = curl_multi_perform(multi, &running);
        if (mc == CURLM_OK && running) {
            struct curl_waitfd extra = {.fd = stop_fd, .events = CURL_WAIT_POLLIN};
            mc = curl_multi_poll(multi, &extra, 1, 60000, NULL);
            stopped = extra.revents != 0;
        }
        if (mc != CURLM_OK) {
            st =
                kvpi_error(KVP_EMETADATA, "etcd at %s: watch: %s", w.addr, curl_multi_strerror(mc));
            break;
        }
    }
    if (!stopped && !st) {
        CURLMsg *msg;
        int left;
        CURLcode rc = CURLE_OK;
        while ((msg = curl_multi_info_read(multi, &left)))
            if (msg->msg == CURLMSG_DONE) rc = msg->data.result;
        long code = 0;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
        char why[64];
        snprintf(why, sizeof why, "HTTP %ld", code);
        st = kvpi_error(KVP_EMETADATA, "etcd at %s: watch: %s", w.addr,
                        w.err[0]                  ? w.err
                        : code && code / 100 != 2 ? why
                        : rc != CURLE_OK ? (curl_err[0] ? curl_err : curl_easy_strerror(rc))
                                         : "the stream ended");
    }
    curl_multi_remove_handle(multi, h);
    curl_easy_cleanup(h);
    curl_multi_cleanup(multi);
    curl_slist_free_all(hdrs);
    free(body);
    free(w.line.data);
    return st;
}

const kvpi_store_ops kvpi_store_etcd = {
    .open = etcd_open,
    .get = etcd_get,
    .get_many = etcd_get_many,
    .put = etcd_put,
    .del = etcd_del,
    .watch = etcd_watch_run,
    .close = etcd_close,
    KVPI_STORE_ETCD,
};
