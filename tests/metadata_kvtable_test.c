/* The HTTP metadata server's rules and memory budget, called directly
 * (src/metadata/kv_table.c): Mooncake's rules, kvpipe's extensions, and that
 * every byte is charged and given back. */
#include <stdlib.h>
#include <string.h>

#include "metadata/kv_table.h"
#include "test.h"

#define MIB ((size_t)1 << 20)

static kvpi_kvt *table(size_t max_value, size_t max_total)
{
    kvpi_kvt_limits l = {max_value, max_total};
    kvpi_kvt *t = NULL;
    if (kvpi_kvt_create(&l, &t) != KVP_OK) return NULL;
    return t;
}

/* Send one request; returns the status and, in *body (malloc'ed), the body. */
static unsigned ask(kvpi_kvt *t, const char *method, const char *path, const char *key,
                    const char *list, const char *value, char **body)
{
    kvpi_kvt_request req = {.method = method,
                            .path = path,
                            .key = key,
                            .list = list,
                            .content_length = value ? (long long)strlen(value) : -1};
    kvpi_kvt_reply r;
    kvpi_kvt_handle(t, &req, value, value ? strlen(value) : 0, &r);
    if (body) {
        const char *text = r.blob ? kvpi_kvt_blob_data(r.blob) : r.text;
        size_t n = r.blob ? kvpi_kvt_blob_len(r.blob) : strlen(r.text);
        *body = strndup(text, n);
    }
    kvpi_kvt_blob_release(r.blob);
    return r.status;
}

static unsigned put(kvpi_kvt *t, const char *key, const char *value)
{
    return ask(t, "PUT", "/metadata", key, NULL, value, NULL);
}

static int holds(kvpi_kvt *t, const char *key, const char *want)
{
    char *got = NULL;
    unsigned st = ask(t, "GET", "/metadata", key, NULL, NULL, &got);
    int ok = st == 200 && got && strcmp(got, want) == 0;
    if (!ok) fprintf(stderr, "  GET %s: %u %.80s, want %.80s\n", key, st, got ? got : "", want);
    free(got);
    return ok;
}

static void test_mooncake_rules(void)
{
    kvpi_kvt *t = table(MIB, 16 * MIB);
    REQUIRE(t);
    char *body = NULL;
    CHECK(ask(t, "GET", "/metadata", "k", NULL, NULL, &body) == 404);
    CHECK(body && strstr(body, "metadata not found"));
    free(body);
    CHECK(put(t, "k", "{\"v\":1}") == 200);
    CHECK(put(t, "k", "{\"v\":2}") == 200); /* other keys may be overwritten */
    CHECK(holds(t, "k", "{\"v\":2}"));
    /* A second PUT of an rpc_meta key is refused, even with the same value,
     * as mooncake-wheel/mooncake/http_metadata_server.py does: any key that
     * contains "rpc_meta". */
    const char *rpc = "{\"ip_or_host_name\":\"h\",\"rpc_port\":1}";
    CHECK(put(t, "mooncake/rpc_meta/h:1", rpc) == 200);
    body = NULL;
    CHECK(ask(t, "PUT", "/metadata", "mooncake/rpc_meta/h:1", NULL, rpc, &body) == 400);
    CHECK(body && strstr(body, "Duplicate rpc_meta key not allowed"));
    free(body);
    CHECK(put(t, "mooncake/rpc_meta/h:1", "{}") == 400);
    CHECK(holds(t, "mooncake/rpc_meta/h:1", rpc));
    CHECK(put(t, "x/rpc_meta_y", "1") == 200);
    CHECK(put(t, "x/rpc_meta_y", "2") == 400);
    /* Deleted, it may be written again. */
    CHECK(ask(t, "DELETE", "/metadata", "mooncake/rpc_meta/h:1", NULL, NULL, NULL) == 200);
    CHECK(put(t, "mooncake/rpc_meta/h:1", "{}") == 200);
    /* DELETE of a missing key: 404, as Mooncake. */
    CHECK(ask(t, "DELETE", "/metadata", "nope", NULL, NULL, NULL) == 404);
    /* No key, an empty key, another method, another path. */
    CHECK(ask(t, "GET", "/metadata", NULL, NULL, NULL, NULL) == 400);
    CHECK(ask(t, "PUT", "/metadata", "", NULL, "x", NULL) == 400);
    CHECK(ask(t, "POST", "/metadata", "k", NULL, "x", NULL) == 405);
    CHECK(ask(t, "PATCH", "/metadata", "k", NULL, NULL, NULL) == 405);
    CHECK(ask(t, "GET", "/", "k", NULL, NULL, NULL) == 404);
    CHECK(ask(t, "GET", "/metadata/", "k", NULL, NULL, NULL) == 404);
    CHECK(ask(t, "GET", "/other", "k", NULL, NULL, NULL) == 404);
    /* A value of exactly the limit is taken; one byte more is 413. */
    char *big = malloc(MIB + 2);
    REQUIRE(big);
    memset(big, 'a', MIB + 1);
    big[MIB] = '\0';
    CHECK(put(t, "big", big) == 200);
    big[MIB] = 'a';
    big[MIB + 1] = '\0';
    CHECK(put(t, "big2", big) == 413);
    free(big);
    kvpi_kvt_destroy(t);
}

static void test_health_and_list(void)
{
    kvpi_kvt *t = table(MIB, 16 * MIB);
    REQUIRE(t);
    char *body = NULL;
    CHECK(ask(t, "GET", "/health", NULL, NULL, NULL, &body) == 200);
    CHECK(body && strcmp(body, "OK\n") == 0);
    free(body);
    CHECK(ask(t, "PUT", "/health", NULL, NULL, "x", NULL) == 405);
    CHECK(put(t, "mooncake/ram/b:2", "{}") == 200);
    CHECK(put(t, "mooncake/ram/a:1", "{}") == 200);
    CHECK(put(t, "mooncake/rpc_meta/a:1", "{}") == 200);
    CHECK(put(t, "other", "{}") == 200);
    CHECK(put(t, "mooncake/ram/q\"uote\\\x01\xff", "{}") == 200);
    body = NULL;
    CHECK(ask(t, "GET", "/metadata", NULL, "mooncake/ram/", NULL, &body) == 200);
    /* Sorted, JSON-escaped, bytes that are not UTF-8 replaced. */
    CHECK(body && strcmp(body, "[\"mooncake/ram/a:1\",\"mooncake/ram/b:2\","
                               "\"mooncake/ram/q\\\"uote\\\\\\u0001\\ufffd\"]") == 0);
    free(body);
    body = NULL;
    CHECK(ask(t, "GET", "/metadata", NULL, "", NULL, &body) == 200); /* every key */
    CHECK(body && strstr(body, "\"other\"") && strstr(body, "rpc_meta/a:1"));
    free(body);
    body = NULL;
    CHECK(ask(t, "GET", "/metadata", NULL, "zzz", NULL, &body) == 200);
    CHECK(body && strcmp(body, "[]") == 0);
    free(body);
    /* Read-only, and not mixed with key. */
    CHECK(ask(t, "DELETE", "/metadata", NULL, "mooncake/", NULL, NULL) == 405);
    CHECK(ask(t, "GET", "/metadata", "other", "mooncake/", NULL, NULL) == 400);
    CHECK(holds(t, "other", "{}"));
    kvpi_kvt_destroy(t);
}

/* Every byte is charged, and all of it comes back. */
static void test_budget(void)
{
    kvpi_kvt *t = table(MIB, 4 * MIB);
    REQUIRE(t);
    size_t empty = kvpi_kvt_bytes_used(t);
    char *v = malloc(MIB / 2 + 1);
    REQUIRE(v);
    memset(v, 'v', MIB / 2);
    v[MIB / 2] = '\0';
    char key[32];
    int stored = 0;
    for (int i = 0; i < 20; i++) {
        snprintf(key, sizeof key, "k%d", i);
        unsigned st = put(t, key, v);
        CHECK(st == 200 || st == 507);
        if (st == 200) stored++;
    }
    /* 4 MiB holds seven half-MiB values and their keys, not eight. */
    CHECK(stored == 7);
    CHECK(kvpi_kvt_bytes_used(t) <= 4 * MIB);
    char *body = NULL;
    CHECK(ask(t, "PUT", "/metadata", "k19", NULL, v, &body) == 507);
    CHECK(body && strstr(body, "memory limit"));
    free(body);
    /* Reading is not refused and not charged: answers share the value. */
    kvpi_kvt_request get = {
        .method = "GET", .path = "/metadata", .key = "k0", .content_length = -1};
    kvpi_kvt_reply held[10];
    size_t before = kvpi_kvt_bytes_used(t);
    for (int i = 0; i < 10; i++) {
        kvpi_kvt_handle(t, &get, NULL, 0, &held[i]);
        CHECK(held[i].status == 200 && held[i].blob);
    }
    CHECK(kvpi_kvt_bytes_used(t) == before);
    /* Overwritten or deleted while answers still send it, the old value stays
     * charged until the last answer lets go. */
    CHECK(ask(t, "DELETE", "/metadata", "k0", NULL, NULL, NULL) == 200);
    CHECK(kvpi_kvt_bytes_used(t) > before - MIB / 2);
    for (int i = 0; i < 10; i++) {
        CHECK(memcmp(kvpi_kvt_blob_data(held[i].blob), v, MIB / 2) == 0);
        kvpi_kvt_blob_release(held[i].blob);
    }
    CHECK(kvpi_kvt_bytes_used(t) < before - MIB / 2);
    /* An upload reserves its Content-Length before its body is read: with
     * four values stored, one 1 MiB upload fits and a second does not. */
    CHECK(ask(t, "DELETE", "/metadata", "k1", NULL, NULL, NULL) == 200);
    CHECK(ask(t, "DELETE", "/metadata", "k2", NULL, NULL, NULL) == 200);
    kvpi_kvt_request up = {
        .method = "PUT", .path = "/metadata", .key = "up", .content_length = (long long)MIB};
    kvpi_kvt_blob *a = NULL, *b = NULL;
    kvpi_kvt_reply r;
    CHECK(kvpi_kvt_begin(t, &up, &a, &r) == 0 && a);
    CHECK(kvpi_kvt_begin(t, &up, &b, &r) == 1 && r.status == 507 && !b);
    kvpi_kvt_blob_release(a); /* the client went away */
    /* Without a Content-Length, a body grows within the limits. */
    up.content_length = -1;
    REQUIRE(kvpi_kvt_begin(t, &up, &a, &r) == 0);
    CHECK(kvpi_kvt_upload_append(t, &a, v, MIB / 2) == 0);
    CHECK(kvpi_kvt_upload_append(t, &a, v, MIB / 2) == 0);
    CHECK(kvpi_kvt_upload_append(t, &a, "x", 1) == -1); /* past the value limit */
    kvpi_kvt_blob_release(a);
    /* Everything deleted: the budget is as it was. */
    for (int i = 0; i < 20; i++) {
        snprintf(key, sizeof key, "k%d", i);
        ask(t, "DELETE", "/metadata", key, NULL, NULL, NULL);
    }
    CHECK(kvpi_kvt_bytes_used(t) == empty);
    free(v);
    kvpi_kvt_destroy(t);
}

/* A listing is charged too: a table full of keys cannot list past its budget. */
static void test_list_budget(void)
{
    kvpi_kvt *t = table(4096, 64 << 10);
    REQUIRE(t);
    char key[200];
    int n = 0;
    for (;; n++) {
        snprintf(key, sizeof key, "mooncake/ram/%0160d", n);
        if (put(t, key, "1") != 200) break;
    }
    CHECK(n > 100);
    char *body = NULL;
    CHECK(ask(t, "GET", "/metadata", NULL, "mooncake/", NULL, &body) == 507);
    free(body);
    for (int i = 0; i < n / 2; i++) {
        snprintf(key, sizeof key, "mooncake/ram/%0160d", i);
        CHECK(ask(t, "DELETE", "/metadata", key, NULL, NULL, NULL) == 200);
    }
    body = NULL;
    CHECK(ask(t, "GET", "/metadata", NULL, "mooncake/", NULL, &body) == 200);
    CHECK(body && body[0] == '[');
    free(body);
    kvpi_kvt_destroy(t);
}

int main(void)
{
    RUN(test_mooncake_rules);
    RUN(test_health_and_list);
    RUN(test_budget);
    RUN(test_list_budget);
    return kvpt_summary();
}
