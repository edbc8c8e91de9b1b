/* The HTTP metadata store client (Mooncake's http metadata protocol) over
 * libcurl: GET|PUT|DELETE <conn>?key=<url-encoded key>.
 *
 * Idle CURL handles are kept (kvpi_curl_pool) so that calls reuse
 * keep-alive connections. */
#include <curl/curl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "metadata/curl_common.h"
#include "metadata/metadata.h"

#define HTTP_MAX_BODY ((size_t)16 << 20) /* same bound as the server's */
/* Bodies from this size on ask the store first (Expect: 100-continue). */
#define EXPECT_MIN_BODY ((size_t)64 << 10)
#define HTTP_PROBE_KEY "kvpipe/probe"
#define HTTP_DUPLICATE "Duplicate rpc_meta key" /* Mooncake's refusal, 400 */

typedef struct http_store {
    char *base;     /* the connection string, as given */
    char sep;       /* '?' or '&': how ?key= joins base */
    int timeout_ms; /* bounds every request */
    kvpi_curl_pool handles;
} http_store;

static char *make_url(http_store *s, CURL *h, const char *key)
{
    char *enc = curl_easy_escape(h, key, 0);
    if (!enc) return NULL;
    size_t n = strlen(s->base) + strlen(enc) + 8;
    char *url = malloc(n);
    if (url) snprintf(url, n, "%s%ckey=%s", s->base, s->sep, enc);
    curl_free(enc);
    return url;
}

static void set_method(CURL *h, const char *method, const char *body)
{
    if (strcmp(method, "GET") == 0) {
        curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
        return;
    }
    curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    if (body) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(body));
    }
}

static void set_options(http_store *s, CURL *h, const char *url, kvpi_curl_body *resp, char *errbuf)
{
    kvpi_curl_setup(h, url, s->timeout_ms, resp, HTTP_MAX_BODY, errbuf);
    /* Metadata lives at the URL given; a redirect elsewhere is a misconfiguration. */
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
}

/* One request. *code is the HTTP status; resp gets the body (NUL-terminated
 * when non-empty). Fails only when no HTTP answer came back. */
static kvp_status http_do(http_store *s, const char *method, const char *key, const char *body,
                          long *code, kvpi_curl_body *resp)
{
    CURL *h = kvpi_curl_take(&s->handles);
    if (!h)
        return kvpi_error(KVP_ENOMEM, "metadata store %s: cannot create a curl handle", s->base);
    kvp_status st = KVP_OK;
    struct curl_slist *hdrs = NULL;
    char errbuf[CURL_ERROR_SIZE] = "";
    char *url = make_url(s, h, key);
    if (!url) {
        st = kvpi_error(KVP_ENOMEM, "metadata store %s: cannot build the URL", s->base);
        goto out;
    }
    set_options(s, h, url, resp, errbuf);
    set_method(h, method, body);
    if (body) {
        hdrs = curl_slist_append(hdrs, "Content-Type: application/json");
        /* Small values go at once. A large one asks first (100-continue), so
         * that a store refusing it (over its limits) answers before the body
         * is sent: sent anyway, the refusal can reach us as a broken pipe
         * instead of its status. */
        hdrs = curl_slist_append(hdrs, strlen(body) >= EXPECT_MIN_BODY ? "Expect: 100-continue"
                                                                       : "Expect:");
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
    }
    CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_WRITE_ERROR && resp->too_big) {
        st = kvpi_error(KVP_EPROTO, "metadata store %s: value of key '%s' exceeds %zu bytes",
                        s->base, key, HTTP_MAX_BODY);
    } else if (rc != CURLE_OK) {
        st = kvpi_error(KVP_EMETADATA, "metadata store %s unreachable: %s", s->base,
                        errbuf[0] ? errbuf : curl_easy_strerror(rc));
    } else {
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, code);
    }
out:
    curl_slist_free_all(hdrs);
    free(url);
    kvpi_curl_give(&s->handles, h, st == KVP_OK || st == KVP_EPROTO);
    return st;
}

/* The first line of a server's answer, for a message ("" when none). */
static void answer_text(const kvpi_curl_body *resp, char *out, size_t len)
{
    out[0] = '\0';
    if (!resp->data) return;
    size_t n = strcspn(resp->data, "\r\n");
    if (n > 200) n = 200;
    snprintf(out, len, ": %.*s", (int)n, resp->data);
    if (strlen(out) == 2) out[0] = '\0';
}

static kvp_status bad_status(http_store *s, const char *method, const char *key, long code,
                             const kvpi_curl_body *resp)
{
    char text[256];
    answer_text(resp, text, sizeof text);
    /* Mooncake's servers refuse to overwrite an rpc_meta key: the segment
     * name is taken (see kvpi_store_ops.put). */
    kvp_status st = code == 400 && resp->data && strstr(resp->data, HTTP_DUPLICATE) ? KVP_EBUSY
                    : code == 507                                                   ? KVP_ENOMEM
                                                                                    : KVP_EMETADATA;
    const char *hint = code == 404 && strcmp(method, "GET") != 0
                           ? " (is the path right? Mooncake's servers and kvpipe's serve "
                             "/metadata)"
                           : "";
    return kvpi_error(st, "metadata store %s answered HTTP %ld to %s of key '%s'%s%s", s->base,
                      code, method, key, text, hint);
}

static kvp_status http_get(void *store, const char *key, char **value)
{
    http_store *s = store;
    kvpi_curl_body resp = {0};
    long code = 0;
    kvp_status st = http_do(s, "GET", key, NULL, &code, &resp);
    if (st == KVP_OK && code == 404)
        st = kvpi_error(KVP_ENOTFOUND, "key '%s' not found in metadata store %s", key, s->base);
    else if (st == KVP_OK && code != 200)
        st = bad_status(s, "GET", key, code, &resp);
    if (st == KVP_OK && !resp.data) {
        resp.data = strdup("");
        if (!resp.data) st = kvpi_error(KVP_ENOMEM, "out of memory");
    }
    if (st != KVP_OK) {
        free(resp.data);
        return st;
    }
    *value = resp.data;
    return KVP_OK;
}

static kvp_status http_put(void *store, const char *key, const char *value)
{
    http_store *s = store;
    kvpi_curl_body resp = {0};
    long code = 0;
    kvp_status st = http_do(s, "PUT", key, value, &code, &resp);
    if (st == KVP_OK && (code < 200 || code > 299)) st = bad_status(s, "PUT", key, code, &resp);
    free(resp.data);
    return st;
}

static kvp_status http_del(void *store, const char *key)
{
    http_store *s = store;
    kvpi_curl_body resp = {0};
    long code = 0;
    kvp_status st = http_do(s, "DELETE", key, NULL, &code, &resp);
    /* Deleting a missing key succeeds (Mooncake's servers answer 404). */
    if (st == KVP_OK && code != 404 && (code < 200 || code > 299))
        st = bad_status(s, "DELETE", key, code, &resp);
    free(resp.data);
    return st;
}

static void http_close(void *store)
{
    http_store *s = store;
    if (!s) return;
    kvpi_curl_pool_destroy(&s->handles);
    free(s->base);
    free(s);
}

/* A GET of a probe key: any 200 or 404 proves the store answers, so a store
 * that is down is reported when the engine is created, not at first use. */
static kvp_status probe(http_store *s)
{
    char *value = NULL;
    kvp_status st = http_get(s, HTTP_PROBE_KEY, &value);
    free(value);
    return st == KVP_ENOTFOUND ? KVP_OK : st;
}

static kvp_status http_open(const char *conn, int timeout_ms, void **store)
{
    kvp_status init = kvpi_curl_init(conn);
    if (init) return init;
    http_store *s = calloc(1, sizeof *s);
    if (!s) return kvpi_error(KVP_ENOMEM, "out of memory");
    s->base = strdup(conn);
    s->sep = strchr(conn, '?') ? '&' : '?';
    s->timeout_ms = timeout_ms > 0 ? timeout_ms : KVPI_DEFAULT_TIMEOUT_MS;
    kvpi_curl_pool_init(&s->handles);
    if (!s->base) {
        http_close(s);
        return kvpi_error(KVP_ENOMEM, "out of memory");
    }
    kvp_status st = probe(s);
    if (st != KVP_OK) {
        http_close(s);
        return st == KVP_ENOMEM ? st : KVP_EMETADATA; /* the message names the URL already */
    }
    KVPI_DEBUG("metadata: http store %s answers", conn);
    *store = s;
    return KVP_OK;
}

const kvpi_store_ops kvpi_store_http = {
    .open = http_open,
    .get = http_get,
    .put = http_put,
    .del = http_del,
    .close = http_close,
    KVPI_STORE_HTTP,
};
