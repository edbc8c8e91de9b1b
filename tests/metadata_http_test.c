/* The HTTP metadata store: the embedded server (libmicrohttpd), the client
 * (libcurl), kvpi_meta on top of them, and the `kvpipe metadata-server` CLI. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/net.h"
#include "kvpipe/metadata_server.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"

static kvp_metadata_server *server;
static char url[128];

/* The server (with o, NULL: the defaults) in server, its URL in url. */
static void start_server_opts(const kvp_metadata_server_opts *o)
{
    server = NULL;
    kvp_status st = o ? kvp_metadata_server_start_opts(o, &server)
                      : kvp_metadata_server_start(NULL, 0, &server);
    if (st) {
        fprintf(stderr, "  server start: %s\n", kvp_last_error());
        abort();
    }
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metadata", kvp_metadata_server_port(server));
}

static void start_server(void)
{
    start_server_opts(NULL);
}

/* The server started, and a store handle on it (NULL if that fails). */
static void *start_store_opts(const kvp_metadata_server_opts *o)
{
    start_server_opts(o);
    return kvpt_http_store_open(url, 3000);
}

static void *start_store(void)
{
    return start_store_opts(NULL);
}

/* The handle closed, then the server stopped. */
static void stop_store(void *s)
{
    kvpi_store_http.close(s);
    kvp_metadata_server_stop(server);
}

/* start_store(), and a meta on the server in *m; NULL if either fails. */
static void *start_store_meta(kvpi_meta **m)
{
    void *s = start_store();
    *m = NULL;
    if (s && kvpi_meta_open(url, 3000, NULL, NULL, m) != KVP_OK) {
        fprintf(stderr, "  meta open %s: %s\n", url, kvp_last_error());
        kvpi_store_http.close(s);
        return NULL;
    }
    return s;
}

static void stop_store_meta(void *s, kvpi_meta *m)
{
    kvpi_meta_close(m);
    stop_store(s);
}

/* GET key and compare with want (NULL: expect KVP_ENOTFOUND). */
static int value_is(void *s, const char *key, const char *want)
{
    char *v = NULL;
    kvp_status st = kvpi_store_http.get(s, key, &v);
    int ok = want ? st == KVP_OK && strcmp(v, want) == 0 : st == KVP_ENOTFOUND;
    if (!ok)
        fprintf(stderr, "  key '%s': status %d (%s), value %.60s\n", key, st, kvp_last_error(),
                v ? v : "(none)");
    free(v);
    return ok;
}

/* Send raw bytes over a fresh connection; return the HTTP status of the
 * answer, 0 if the server closed without one. */
static int raw_request(int port, const char *text, size_t len)
{
    int fd;
    if (kvpi_tcp_connect("127.0.0.1", port, 3000, &fd) != KVP_OK) return -1;
    kvpi_send_all(fd, text, len);
    char buf[512] = "";
    size_t got = 0;
    while (got < sizeof buf - 1 && !strstr(buf, "\r\n")) {
        ssize_t n = recv(fd, buf + got, sizeof buf - 1 - got, 0);
        if (n <= 0) break;
        got += (size_t)n;
        buf[got] = '\0';
    }
    close(fd);
    int code = 0;
    if (sscanf(buf, "HTTP/1.%*d %d", &code) != 1) code = 0;
    return code;
}

static int raw(int port, const char *text)
{
    return raw_request(port, text, strlen(text));
}

static void test_put_get_del(void)
{
    void *s = start_store();
    REQUIRE(s);
    CHECK(value_is(s, "k1", NULL));
    CHECK_OK(kvpi_store_http.put(s, "k1", "{\"a\":1}"));
    CHECK(value_is(s, "k1", "{\"a\":1}"));
    CHECK_OK(kvpi_store_http.put(s, "k1", "{\"a\":2}"));
    CHECK(value_is(s, "k1", "{\"a\":2}"));
    CHECK_OK(kvpi_store_http.put(s, "k2", ""));
    CHECK(value_is(s, "k2", ""));
    CHECK_OK(kvpi_store_http.del(s, "k1"));
    CHECK(value_is(s, "k1", NULL));
    CHECK(value_is(s, "k2", ""));
    CHECK_OK(kvpi_store_http.del(s, "never-there"));
    char *v = NULL;
    CHECK_ST(kvpi_store_http.get(s, "k1", &v), KVP_ENOTFOUND);
    CHECK(v == NULL);
    CHECK(strstr(kvp_last_error(), url) != NULL);
    stop_store(s);
}

static void test_key_encoding(void)
{
    void *s = start_store();
    REQUIRE(s);
    static const char *const keys[] = {
        "mooncake/ram/127.0.0.1:12345",
        "a?b=c",
        "a&key=other",
        "with space",
        "plus+sign",
        "percent%20",
        "[::1]:80",
        "unicode-\xc3\xa9",
        "a",
        "a&",
    };
    size_t n = sizeof keys / sizeof keys[0];
    char value[64];
    for (size_t i = 0; i < n; i++) {
        snprintf(value, sizeof value, "{\"i\":%zu}", i);
        CHECK_OK(kvpi_store_http.put(s, keys[i], value));
    }
    /* Each key reads back its own value: no two keys collapsed into one. */
    for (size_t i = 0; i < n; i++) {
        snprintf(value, sizeof value, "{\"i\":%zu}", i);
        CHECK(value_is(s, keys[i], value));
    }
    CHECK(value_is(s, "other", NULL));
    CHECK(value_is(s, "a?b", NULL));
    kvpi_store_http.close(s);
    /* A connection string that already has a query string still works. */
    char conn[200];
    snprintf(conn, sizeof conn, "%s?x=1", url);
    s = kvpt_http_store_open(conn, 3000);
    REQUIRE(s);
    CHECK(value_is(s, "with space", "{\"i\":3}"));
    stop_store(s);
}

static void test_large_values(void)
{
    void *s = start_store();
    REQUIRE(s);
    size_t len = 1u << 20;
    char *big = malloc(len + 1);
    REQUIRE(big);
    for (size_t i = 0; i < len; i++)
        big[i] = (char)('a' + (i * 7 + i / 13) % 26);
    big[len] = '\0';
    CHECK_OK(kvpi_store_http.put(s, "big", big));
    char *v = NULL;
    CHECK_OK(kvpi_store_http.get(s, "big", &v));
    CHECK(v && strlen(v) == len && memcmp(v, big, len) == 0);
    free(v);
    free(big);
    /* Above the server's 16 MiB bound: refused, and the server goes on. */
    size_t huge = (16u << 20) + 1;
    char *h = malloc(huge + 1);
    REQUIRE(h);
    memset(h, 'x', huge);
    h[huge] = '\0';
    CHECK_ST(kvpi_store_http.put(s, "huge", h), KVP_EMETADATA);
    free(h);
    CHECK(value_is(s, "huge", NULL));
    CHECK_OK(kvpi_store_http.put(s, "after", "1"));
    CHECK(value_is(s, "after", "1"));
    stop_store(s);
}

#define N_THREADS 6
#define N_OPS 60

static void *worker(void *arg)
{
    void **args = arg;
    void *s = args[0];
    long id = (long)(intptr_t)args[1];
    long bad = 0;
    char key[64], value[64];
    for (int i = 0; i < N_OPS; i++) {
        snprintf(key, sizeof key, "t%ld/k%d", id, i % 10);
        snprintf(value, sizeof value, "{\"t\":%ld,\"i\":%d}", id, i);
        if (kvpi_store_http.put(s, key, value) != KVP_OK || !value_is(s, key, value)) bad++;
        if (i % 3 == 0 && (kvpi_store_http.del(s, key) != KVP_OK || !value_is(s, key, NULL))) bad++;
    }
    return (void *)(intptr_t)bad;
}

static void test_concurrent_clients(void)
{
    start_server();
    void *s = kvpt_http_store_open(url, 3000); /* one handle shared by every thread */
    REQUIRE(s);
    pthread_t t[N_THREADS];
    void *args[N_THREADS][2];
    for (long i = 0; i < N_THREADS; i++) {
        args[i][0] = s;
        args[i][1] = (void *)(intptr_t)i;
        REQUIRE(pthread_create(&t[i], NULL, worker, args[i]) == 0);
    }
    CHECK(kvpt_join_bad(t, N_THREADS) == 0);
    /* Every thread's last write of k9 (i = 59, not deleted) is there. */
    for (long i = 0; i < N_THREADS; i++) {
        char key[64], value[64];
        snprintf(key, sizeof key, "t%ld/k9", i);
        snprintf(value, sizeof value, "{\"t\":%ld,\"i\":59}", i);
        CHECK(value_is(s, key, value));
    }
    stop_store(s);
}

static void test_server_down(void)
{
    char conn[128];
    snprintf(conn, sizeof conn, "http://127.0.0.1:%d/metadata", kvpt_free_port());
    void *s = NULL;
    CHECK_ST(kvpi_store_http.open(conn, 2000, &s), KVP_EMETADATA);
    CHECK(strstr(kvp_last_error(), conn) != NULL);
    kvpi_meta *m = NULL;
    CHECK_ST(kvpi_meta_open(conn, 2000, NULL, NULL, &m), KVP_EMETADATA);
    CHECK(m == NULL);
    CHECK(strstr(kvp_last_error(), conn) != NULL);

    /* A store that goes away after open: each call fails, naming it. */
    start_server();
    s = kvpt_http_store_open(url, 3000);
    REQUIRE(s);
    CHECK_OK(kvpi_store_http.put(s, "k", "1"));
    kvp_metadata_server_stop(server);
    char *v = NULL;
    CHECK_ST(kvpi_store_http.get(s, "k", &v), KVP_EMETADATA);
    CHECK(strstr(kvp_last_error(), url) != NULL);
    CHECK_ST(kvpi_store_http.put(s, "k", "2"), KVP_EMETADATA);
    CHECK_ST(kvpi_store_http.del(s, "k"), KVP_EMETADATA);
    kvpi_store_http.close(s);
}

static void test_malformed_requests(void)
{
    start_server();
    int port = kvp_metadata_server_port(server);
    void *s = kvpt_http_store_open(url, 3000);
    REQUIRE(s);
    CHECK_OK(kvpi_store_http.put(s, "k", "v"));
    CHECK(raw(port, "GET /metadata HTTP/1.1\r\nHost: x\r\n\r\n") == 400);
    CHECK(raw(port, "GET /metadata?key= HTTP/1.1\r\nHost: x\r\n\r\n") == 400);
    CHECK(raw(port, "POST /metadata?key=k HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx") ==
          405);
    CHECK(raw(port, "PATCH /metadata?key=k HTTP/1.1\r\nHost: x\r\n\r\n") == 405);
    CHECK(raw(port, "PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\n"
                    "Content-Length: 100000000\r\n\r\n") == 413);
    CHECK(raw(port, "GET /metadata?key=k HTTP/1.1\r\nHost: x\r\n\r\n") == 200);
    /* Only /metadata (and /health) are served, as by Mooncake's server. */
    CHECK(raw(port, "GET /anything/else?key=k HTTP/1.1\r\nHost: x\r\n\r\n") == 404);
    CHECK(raw(port, "GET /?key=k HTTP/1.1\r\nHost: x\r\n\r\n") == 404);
    CHECK(raw(port, "GET /metadata/?key=k HTTP/1.1\r\nHost: x\r\n\r\n") == 404);
    /* Garbage: a 4xx or a closed connection, never a crash. */
    int g = raw(port, "\x01\x02 garbage \xff\xfe\r\n\r\n");
    CHECK(g == 0 || (g >= 400 && g < 500));
    g = raw_request(port, "\0\0\0\0\0\0\0\0", 8);
    CHECK(g == 0 || (g >= 400 && g < 500));
    /* A body that never arrives does not stop others being served. */
    int slow;
    REQUIRE(kvpi_tcp_connect("127.0.0.1", port, 3000, &slow) == KVP_OK);
    const char *partial =
        "PUT /metadata?key=slow HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab";
    kvpi_send_all(slow, partial, strlen(partial));
    int half;
    REQUIRE(kvpi_tcp_connect("127.0.0.1", port, 3000, &half) == KVP_OK);
    kvpi_send_all(half, "GET /meta", 9);
    CHECK(value_is(s, "k", "v"));
    CHECK(value_is(s, "slow", NULL)); /* a partial body is not stored */
    CHECK_OK(kvpi_store_http.put(s, "k2", "w"));
    CHECK(value_is(s, "k2", "w"));
    close(slow);
    close(half);
    CHECK(value_is(s, "k", "v"));
    stop_store(s);
}

/* Send raw bytes; return the whole answer (status line to body), malloc'ed. */
static char *raw_answer(int port, const char *text)
{
    int fd;
    if (kvpi_tcp_connect("127.0.0.1", port, 3000, &fd) != KVP_OK) return NULL;
    kvpi_send_all(fd, text, strlen(text));
    char *buf = calloc(1, 8192);
    size_t got = 0;
    while (buf && got < 8191) {
        ssize_t n = recv(fd, buf + got, 8191 - got, 0);
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    return buf;
}

/* Mooncake's server rules, over the wire, with its exact texts. */
static void test_mooncake_rules(void)
{
    start_server();
    int port = kvp_metadata_server_port(server);
    void *s = kvpt_http_store_open(url, 3000);
    REQUIRE(s);
    const char *rpc = "{\"ip_or_host_name\":\"10.0.0.1\",\"rpc_port\":17000}";
    CHECK_OK(kvpi_store_http.put(s, "mooncake/rpc_meta/10.0.0.1:17000", rpc));
    char *a = raw_answer(port, "PUT /metadata?key=mooncake%2Frpc_meta%2F10.0.0.1%3A17000 "
                               "HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                               "Content-Length: 2\r\n\r\n{}");
    CHECK(a && strncmp(a, "HTTP/1.1 400", 12) == 0 &&
          strstr(a, "Duplicate rpc_meta key not allowed"));
    free(a);
    /* The client reports the refusal as the name being taken. */
    CHECK_ST(kvpi_store_http.put(s, "mooncake/rpc_meta/10.0.0.1:17000", rpc), KVP_EBUSY);
    CHECK(strstr(kvp_last_error(), "Duplicate rpc_meta key not allowed") != NULL);
    CHECK(value_is(s, "mooncake/rpc_meta/10.0.0.1:17000", rpc));
    CHECK_OK(kvpi_store_http.put(s, "mooncake/ram/10.0.0.1:17000", "{\"v\":1}"));
    CHECK_OK(kvpi_store_http.put(s, "mooncake/ram/10.0.0.1:17000", "{\"v\":2}"));
    /* DELETE of a missing key is 404 on the wire; the client takes it as done. */
    CHECK(raw(port, "DELETE /metadata?key=gone HTTP/1.1\r\nHost: x\r\n\r\n") == 404);
    CHECK_OK(kvpi_store_http.del(s, "gone"));
    /* Health and listing (kvpipe extensions). */
    a = raw_answer(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    CHECK(a && strncmp(a, "HTTP/1.1 200", 12) == 0 && strstr(a, "\r\n\r\nOK\n"));
    free(a);
    a = raw_answer(port, "GET /metadata?list=mooncake%2Fram%2F HTTP/1.1\r\nHost: x\r\n"
                         "Connection: close\r\n\r\n");
    CHECK(a && strncmp(a, "HTTP/1.1 200", 12) == 0 &&
          strstr(a, "\r\n\r\n[\"mooncake/ram/10.0.0.1:17000\"]"));
    CHECK(a && strstr(a, "application/json"));
    free(a);
    /* A client pointed at another path is told so. */
    char other[128];
    snprintf(other, sizeof other, "http://127.0.0.1:%d/", port);
    void *wrong = NULL;
    REQUIRE_OK(kvpi_store_http.open(other, 3000, &wrong)); /* a GET's 404 is "missing" */
    CHECK_ST(kvpi_store_http.put(wrong, "k", "v"), KVP_EMETADATA);
    CHECK(strstr(kvp_last_error(), "404") && strstr(kvp_last_error(), "/metadata"));
    kvpi_store_http.close(wrong);
    stop_store(s);
}

/* Configured limits: the value limit and the total budget. */
static void test_limits(void)
{
    kvp_metadata_server_opts o;
    kvp_metadata_server_opts_init(&o);
    CHECK(o.max_value_bytes == (size_t)16 << 20 && o.max_total_bytes == (size_t)256 << 20);
    CHECK(o.max_connections == 1024 && o.max_connections_per_ip == 256);
    CHECK(o.idle_timeout_s == 15 && o.request_timeout_s == 30);
    o.max_value_bytes = 100 << 10;
    o.max_total_bytes = 1 << 20;
    void *s = start_store_opts(&o);
    REQUIRE(s);
    char *v = malloc((100 << 10) + 2);
    REQUIRE(v);
    memset(v, 'x', (100 << 10) + 1);
    v[(100 << 10) + 1] = '\0';
    CHECK_ST(kvpi_store_http.put(s, "k", v), KVP_EMETADATA); /* 413 */
    CHECK(strstr(kvp_last_error(), "413") != NULL);
    v[100 << 10] = '\0';
    size_t before = kvp_metadata_server_bytes_used(server);
    int stored = 0;
    kvp_status st = KVP_OK;
    for (int i = 0; i < 20 && st == KVP_OK; i++) {
        char key[16];
        snprintf(key, sizeof key, "k%d", i);
        st = kvpi_store_http.put(s, key, v);
        if (st == KVP_OK) stored++;
    }
    CHECK(stored == 10); /* ten 100 KiB values fit in 1 MiB; the eleventh does not */
    CHECK(st == KVP_ENOMEM && strstr(kvp_last_error(), "507"));
    CHECK(kvp_metadata_server_bytes_used(server) <= (size_t)1 << 20);
    CHECK(kvp_metadata_server_bytes_used(server) > before + (size_t)stored * (100 << 10));
    CHECK(value_is(s, "k0", v));
    CHECK_OK(kvpi_store_http.del(s, "k0"));
    CHECK_OK(kvpi_store_http.put(s, "k10", v)); /* room again */
    free(v);
    kvpi_store_http.close(s);
    kvp_metadata_server_stop(server);
    o.port = 70000;
    CHECK_ST(kvp_metadata_server_start_opts(&o, &server), KVP_EINVAL);
}

static void test_start_stop_no_leak(void)
{
    start_server();
    kvp_metadata_server_stop(server);
    int before = kvpt_count_fds();
    int port = 0;
    for (int i = 0; i < 20; i++) {
        start_server();
        port = kvp_metadata_server_port(server);
        void *s = kvpt_http_store_open(url, 3000);
        REQUIRE(s);
        CHECK_OK(kvpi_store_http.put(s, "k", "v"));
        kvpi_store_http.close(s);
        kvp_metadata_server_stop(server);
    }
    CHECK(kvpt_count_fds() == before);
    /* The port of the last one is free again at once. */
    REQUIRE_OK(kvp_metadata_server_start("127.0.0.1", port, &server));
    CHECK(kvp_metadata_server_port(server) == port);
    kvp_metadata_server *second = NULL;
    CHECK(kvp_metadata_server_start("127.0.0.1", port, &second) != KVP_OK);
    CHECK(second == NULL);
    kvp_metadata_server_stop(server);
    CHECK_ST(kvp_metadata_server_start("127.0.0.1", 70000, &second), KVP_EINVAL);
    kvp_metadata_server_stop(NULL);
}

static void test_ipv6(void)
{
    kvp_metadata_server *srv = NULL;
    if (kvp_metadata_server_start("::1", 0, &srv) != KVP_OK) SKIP("no IPv6 loopback");
    char conn[128];
    snprintf(conn, sizeof conn, "http://[::1]:%d/metadata", kvp_metadata_server_port(srv));
    void *s = kvpt_http_store_open(conn, 3000);
    REQUIRE(s);
    CHECK_OK(kvpi_store_http.put(s, "k6", "v6"));
    CHECK(value_is(s, "k6", "v6"));
    kvpi_store_http.close(s);
    kvp_metadata_server_stop(srv);
}

/* ---- kvpi_meta over the HTTP store ---- */

static const char *const desc = "{\"name\":\"127.0.0.1:17000\",\"protocol\":\"tcp\","
                                "\"tcp_data_port\":17001,\"buffers\":[],"
                                "\"kvpipe_instance\":\"t1\"}";

/* An engine named seg with descriptor d, answering handshakes at host:port. */
static kvpi_meta_self self_of(const char *seg, const char *d, const char *host, int port)
{
    return (kvpi_meta_self){
        .segment = seg, .desc_json = d, .rpc_host = host, .rpc_port = port, .instance = "t1"};
}

static void check_rpc_meta(void *s, const char *key, const char *host, int port)
{
    char *v = NULL;
    CHECK_OK(kvpi_store_http.get(s, key, &v));
    char want[128];
    snprintf(want, sizeof want, "\"ip_or_host_name\":\"%s\"", host);
    CHECK(v && strstr(v, want));
    snprintf(want, sizeof want, "\"rpc_port\":%d", port);
    CHECK(v && strstr(v, want));
    free(v);
}

static void test_meta_publish_fetch(void)
{
    kvpi_meta *m;
    void *s = start_store_meta(&m);
    REQUIRE(s);
    CHECK(!kvpi_meta_is_p2p(m));
    const char *seg = "127.0.0.1:17000";
    kvpi_meta_self me = self_of(seg, desc, "10.1.2.3", 17000);
    REQUIRE_OK(kvpi_meta_claim(m, &me));
    CHECK(value_is(s, "mooncake/ram/127.0.0.1:17000", desc));
    check_rpc_meta(s, "mooncake/rpc_meta/127.0.0.1:17000", "10.1.2.3", 17000);
    char *d = NULL, *h = NULL;
    REQUIRE_OK(kvpi_meta_fetch(m, seg, &d, &h));
    CHECK(strcmp(d, desc) == 0);
    CHECK(strcmp(h, "10.1.2.3") == 0);
    free(d);
    free(h);
    /* A new descriptor rewrites only the ram key: the server refuses a second
     * PUT of rpc_meta, so publishing must not send one. */
    const char *v2 = "{\"name\":\"127.0.0.1:17000\",\"v\":2,\"kvpipe_instance\":\"t1\"}";
    CHECK_OK(kvpi_meta_publish(m, seg, v2));
    CHECK(value_is(s, "mooncake/ram/127.0.0.1:17000", v2));
    CHECK_ST(kvpi_store_http.put(s, "mooncake/rpc_meta/127.0.0.1:17000", "{}"), KVP_EBUSY);
    check_rpc_meta(s, "mooncake/rpc_meta/127.0.0.1:17000", "10.1.2.3", 17000);
    me.desc_json = v2;
    CHECK_OK(kvpi_meta_release(m, &me));
    CHECK(value_is(s, "mooncake/ram/127.0.0.1:17000", NULL));
    CHECK(value_is(s, "mooncake/rpc_meta/127.0.0.1:17000", NULL));
    d = h = NULL;
    CHECK_ST(kvpi_meta_fetch(m, seg, &d, &h), KVP_ENOTFOUND);
    CHECK(d == NULL && h == NULL);
    CHECK(strstr(kvp_last_error(), seg) && strstr(kvp_last_error(), url));
    CHECK_OK(kvpi_meta_release(m, &me)); /* releasing twice is fine */
    kvpi_meta_self bad = self_of("", desc, "h", 1);
    CHECK_ST(kvpi_meta_claim(m, &bad), KVP_EINVAL);
    bad = self_of(seg, desc, "h", 70000);
    CHECK_ST(kvpi_meta_claim(m, &bad), KVP_EINVAL);
    CHECK_ST(kvpi_meta_publish(m, "", desc), KVP_EINVAL);
    stop_store_meta(s, m);
}

/* A claim that fails half-way (the descriptor is refused after rpc_meta was
 * written) leaves nothing behind, and says why. */
static void test_meta_claim_half_way(void)
{
    kvp_metadata_server_opts o;
    kvp_metadata_server_opts_init(&o);
    o.max_value_bytes = 100; /* rpc_meta fits, the descriptor does not */
    void *s = start_store_opts(&o);
    REQUIRE(s);
    kvpi_meta *m = NULL;
    REQUIRE_OK(kvpi_meta_open(url, 3000, NULL, NULL, &m));
    kvpi_meta_self me = self_of("127.0.0.1:17000", desc, "127.0.0.1", 17000);
    CHECK_ST(kvpi_meta_claim(m, &me), KVP_EMETADATA);
    CHECK(strstr(kvp_last_error(), "413") && strstr(kvp_last_error(), "mooncake/ram/"));
    CHECK(value_is(s, "mooncake/rpc_meta/127.0.0.1:17000", NULL));
    CHECK(value_is(s, "mooncake/ram/127.0.0.1:17000", NULL));
    kvpi_meta_close(m);
    kvpi_store_http.close(s);
    kvp_metadata_server_stop(server);
}

static void test_meta_cluster_id(void)
{
    setenv("MC_METADATA_CLUSTER_ID", "clusterA", 1); /* this case runs in its own child */
    void *s = start_store();
    REQUIRE(s);
    char *k = kvpi_meta_key("ram", "h:1");
    CHECK(k && strcmp(k, "mooncake/clusterA/ram/h:1") == 0);
    free(k);
    kvpi_meta *m = NULL;
    REQUIRE_OK(kvpi_meta_open(url, 3000, NULL, NULL, &m));
    kvpi_meta_self me = self_of("h:1", desc, "127.0.0.1", 1);
    REQUIRE_OK(kvpi_meta_claim(m, &me));
    CHECK(value_is(s, "mooncake/clusterA/ram/h:1", desc));
    check_rpc_meta(s, "mooncake/clusterA/rpc_meta/h:1", "127.0.0.1", 1);
    CHECK(value_is(s, "mooncake/ram/h:1", NULL));
    char *d = NULL, *h = NULL;
    REQUIRE_OK(kvpi_meta_fetch(m, "h:1", &d, &h));
    CHECK(strcmp(d, desc) == 0);
    free(d);
    free(h);
    /* Another cluster sees nothing. */
    setenv("MC_METADATA_CLUSTER_ID", "clusterB", 1);
    d = h = NULL;
    CHECK_ST(kvpi_meta_fetch(m, "h:1", &d, &h), KVP_ENOTFOUND);
    unsetenv("MC_METADATA_CLUSTER_ID");
    k = kvpi_meta_key("rpc_meta", "h:1");
    CHECK(k && strcmp(k, "mooncake/rpc_meta/h:1") == 0);
    free(k);
    stop_store_meta(s, m);
}

static void test_meta_rpc_meta_variants(void)
{
    kvpi_meta *m;
    void *s = start_store_meta(&m);
    REQUIRE(s);
    char *d = NULL, *h = NULL;
    /* Descriptor only (no rpc_meta): the host comes from the segment name. */
    CHECK_OK(kvpi_store_http.put(s, "mooncake/ram/peer.example:9000", desc));
    CHECK_OK(kvpi_meta_fetch(m, "peer.example:9000", &d, &h));
    CHECK(h && strcmp(h, "peer.example") == 0);
    free(d);
    free(h);
    CHECK_OK(kvpi_store_http.put(s, "mooncake/ram/[::1]:9000", desc));
    d = h = NULL;
    CHECK_OK(kvpi_meta_fetch(m, "[::1]:9000", &d, &h));
    CHECK(h && strcmp(h, "::1") == 0);
    free(d);
    free(h);
    /* Malformed rpc_meta: a protocol error naming the segment. (The server
     * keeps the first rpc_meta of a key: each is deleted before the next.) */
    static const char *const bad[] = {
        "not json",
        "[1,2]",
        "{\"ip_or_host_name\":5,\"rpc_port\":1}",
        "{\"ip_or_host_name\":\"\",\"rpc_port\":1}",
        "{\"ip_or_host_name\":\"h\"}",
        "{\"ip_or_host_name\":\"h\",\"rpc_port\":\"1\"}",
        "{\"ip_or_host_name\":\"h\",\"rpc_port\":1.5}",
        "{\"ip_or_host_name\":\"h\",\"rpc_port\":70000}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_OK(kvpi_store_http.del(s, "mooncake/rpc_meta/peer.example:9000"));
        CHECK_OK(kvpi_store_http.put(s, "mooncake/rpc_meta/peer.example:9000", bad[i]));
        d = h = NULL;
        CHECK_ST(kvpi_meta_fetch(m, "peer.example:9000", &d, &h), KVP_EPROTO);
        CHECK(d == NULL && h == NULL);
        CHECK(strstr(kvp_last_error(), "peer.example:9000") != NULL);
    }
    stop_store_meta(s, m);
}

static void test_meta_connection_strings(void)
{
    kvpi_meta *m = NULL;
    CHECK_ST(kvpi_meta_open("ftp://127.0.0.1:1", 1000, NULL, NULL, &m), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "ftp://127.0.0.1:1") != NULL);
    /* A password in a connection string never reaches a message. */
    CHECK_ST(kvpi_meta_open("ftp://user:secret@127.0.0.1:1/x", 1000, NULL, NULL, &m), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "secret") == NULL);
    CHECK(strstr(kvp_last_error(), "ftp://***@127.0.0.1:1/x") != NULL);
    CHECK_ST(kvpi_meta_open("", 1000, NULL, NULL, &m), KVP_EINVAL);
    CHECK(m == NULL);
    CHECK(kvpi_store_lookup(KVPI_P2P_CONN) == NULL);
    CHECK(kvpi_store_lookup("http://x/metadata") == &kvpi_store_http);
    CHECK(kvpi_store_lookup("https://x/metadata") == &kvpi_store_http);
    REQUIRE_OK(kvpi_meta_open(KVPI_P2P_CONN, 1000, NULL, NULL, &m));
    CHECK(kvpi_meta_is_p2p(m));
    /* P2P: nothing to claim, publish, repair or release. */
    kvpi_meta_self me = self_of("127.0.0.1:1", desc, "127.0.0.1", 1);
    CHECK_OK(kvpi_meta_claim(m, &me));
    CHECK_OK(kvpi_meta_publish(m, "127.0.0.1:1", desc));
    CHECK_OK(kvpi_meta_repair(m, &me));
    CHECK_OK(kvpi_meta_release(m, &me));
    kvpi_meta_close(m);
    kvpi_meta_close(NULL);
}

/* ---- the CLI ---- */

static int file_has(const char *path, const char *text)
{
    char buf[1024] = "";
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    return strstr(buf, text) != NULL;
}

static void test_cli_server(void)
{
    int port = kvpt_free_port();
    char port_s[16], out[64], line[128];
    snprintf(port_s, sizeof port_s, "%d", port);
    snprintf(out, sizeof out, "/tmp/kvpt-mds-%d.out", (int)getpid());
    char *argv[] = {(char *)kvpt_cli(), "metadata-server", "--port", port_s, NULL};
    pid_t pid = kvpt_spawn(argv, out);
    REQUIRE(pid > 0);
    snprintf(line, sizeof line, "kvpipe metadata-server listening on http://127.0.0.1:%d/metadata",
             port);
    int ok = kvpt_wait_port("127.0.0.1", port, 10000) == 0;
    for (int i = 0; ok && i < 200 && !file_has(out, line); i++)
        usleep(10000);
    CHECK(ok && file_has(out, line));
    char conn[128];
    snprintf(conn, sizeof conn, "http://127.0.0.1:%d/metadata", port);
    kvpi_meta *m = NULL;
    if (ok && kvpi_meta_open(conn, 3000, NULL, NULL, &m) == KVP_OK) {
        kvpi_meta_self me = self_of("127.0.0.1:5", desc, "127.0.0.1", 5);
        CHECK_OK(kvpi_meta_claim(m, &me));
        char *d = NULL, *h = NULL;
        CHECK_OK(kvpi_meta_fetch(m, "127.0.0.1:5", &d, &h));
        CHECK(d && strcmp(d, desc) == 0);
        free(d);
        free(h);
        kvpi_meta_close(m);
    } else {
        CHECK(!"cannot reach the CLI's server");
    }
    kill(pid, SIGTERM);
    CHECK(kvpt_wait_child(pid, 10000) == 0);
    unlink(out);
}

static void test_cli_ephemeral_port_and_flags(void)
{
    char out[64];
    snprintf(out, sizeof out, "/tmp/kvpt-mds0-%d.out", (int)getpid());
    char *argv[] = {(char *)kvpt_cli(),
                    "metadata-server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--max-value-bytes",
                    "1K",
                    "--max-total-bytes",
                    "1M",
                    "--max-connections",
                    "8",
                    "--max-connections-per-ip",
                    "4",
                    "--idle-timeout",
                    "5",
                    "--request-timeout",
                    "10",
                    NULL};
    pid_t pid = kvpt_spawn(argv, out);
    REQUIRE(pid > 0);
    int port = 0;
    for (int i = 0; i < 500 && port == 0; i++) {
        FILE *f = fopen(out, "r");
        if (f) {
            if (fscanf(f, "kvpipe metadata-server listening on http://127.0.0.1:%d", &port) != 1)
                port = 0;
            fclose(f);
        }
        if (!port) usleep(10000);
    }
    CHECK(port > 0);
    if (port > 0) {
        char conn[128];
        snprintf(conn, sizeof conn, "http://127.0.0.1:%d/metadata", port);
        void *s = kvpt_http_store_open(conn, 3000);
        CHECK(s != NULL);
        if (s) {
            CHECK_OK(kvpi_store_http.put(s, "k", "v"));
            CHECK(value_is(s, "k", "v"));
            /* --max-value-bytes 1K took effect. */
            char big[1100];
            memset(big, 'b', sizeof big - 1);
            big[sizeof big - 1] = '\0';
            CHECK_ST(kvpi_store_http.put(s, "big", big), KVP_EMETADATA);
            CHECK(strstr(kvp_last_error(), "413") != NULL);
            kvpi_store_http.close(s);
        }
    }
    kill(pid, SIGINT);
    CHECK(kvpt_wait_child(pid, 10000) == 0);
    unlink(out);

    char *bad1[] = {(char *)kvpt_cli(), "metadata-server", "--port", "99999", NULL};
    char *bad2[] = {(char *)kvpt_cli(), "metadata-server", "--bogus", NULL};
    char *bad3[] = {(char *)kvpt_cli(), "metadata-server", "extra", NULL};
    char *bad4[] = {(char *)kvpt_cli(), "metadata-server", "--max-total-bytes", "0", NULL};
    char *bad5[] = {(char *)kvpt_cli(), "metadata-server", "--request-timeout", "soon", NULL};
    char *bad6[] = {(char *)kvpt_cli(),
                    "metadata-server",
                    "--max-value-bytes",
                    "2M",
                    "--max-total-bytes",
                    "1M",
                    NULL};
    CHECK(kvpt_wait_child(kvpt_spawn(bad4, "/dev/null"), 10000) == 2);
    CHECK(kvpt_wait_child(kvpt_spawn(bad5, "/dev/null"), 10000) == 2);
    CHECK(kvpt_wait_child(kvpt_spawn(bad6, "/dev/null"), 10000) == 2);
    char *help[] = {(char *)kvpt_cli(), "metadata-server", "--help", NULL};
    CHECK(kvpt_wait_child(kvpt_spawn(bad1, "/dev/null"), 10000) == 2);
    CHECK(kvpt_wait_child(kvpt_spawn(bad2, "/dev/null"), 10000) == 2);
    CHECK(kvpt_wait_child(kvpt_spawn(bad3, "/dev/null"), 10000) == 2);
    CHECK(kvpt_wait_child(kvpt_spawn(help, "/dev/null"), 10000) == 0);
}

static void test_cli_port_in_use(void)
{
    start_server();
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", kvp_metadata_server_port(server));
    char *argv[] = {(char *)kvpt_cli(), "metadata-server", "--port", port_s, NULL};
    CHECK(kvpt_wait_child(kvpt_spawn(argv, "/dev/null"), 10000) == 1);
    kvp_metadata_server_stop(server);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN(test_put_get_del);
    RUN(test_key_encoding);
    RUN(test_large_values);
    RUN(test_concurrent_clients);
    RUN(test_server_down);
    RUN(test_malformed_requests);
    RUN(test_mooncake_rules);
    RUN(test_limits);
    RUN(test_start_stop_no_leak);
    RUN(test_ipv6);
    RUN(test_meta_publish_fetch);
    RUN(test_meta_claim_half_way);
    RUN(test_meta_cluster_id);
    RUN(test_meta_rpc_meta_variants);
    RUN(test_meta_connection_strings);
    RUN(test_cli_server);
    RUN(test_cli_ephemeral_port_and_flags);
    RUN(test_cli_port_in_use);
    return kvpt_summary();
}
