/* The embedded HTTP metadata store (src/metadata/http_server.c), driven as a
 * peer drives it: over loopback, against the real server (libmicrohttpd,
 * kvpipe's request handling and its table).
 *
 * The first input byte picks the mode:
 *  - even: one request whose method, URL, header lines and body come from the
 *    input; the harness owns only the framing (Content-Length, Connection:
 *    close), so the request is always complete. The server must answer it
 *    with an HTTP response and close.
 *  - odd: a list of requests, each u8 kind, u8 key length, key bytes, u16
 *    value length, value bytes, built as well-formed HTTP (plain, chunked,
 *    pipelined, HEAD, POST, no key, a declared body above 16 MiB) and sent on
 *    one keep-alive connection (a new one after each reply that closes it).
 *    The replies are checked against a model of the store, Mooncake's rules
 *    (docs/metadata-http.md): a PUT value comes back byte for byte from GET,
 *    DELETE removes it, a missing key is 404 to GET and DELETE, a second PUT
 *    of a key holding "rpc_meta" is 400 and keeps the first value, other
 *    methods 405, no key 400, a too large body 413; ?list= of the input's
 *    prefix lists exactly the model's keys. Keys carry a random prefix of the
 *    run and the input's number, so no other input can touch them.
 * In both modes a canary value stored at start must still read back intact,
 * and the server must answer within REPLY_TIMEOUT_MS. The server restarts
 * every RESTART_EVERY inputs, which bounds its memory. Since the server holds
 * memory across inputs, run with -detect_leaks=0 (run.sh does): libFuzzer's
 * per-input leak check would scan the heap after nearly every input; LSan
 * still checks at exit.
 *
 * Why not raw bytes on a socket: libmicrohttpd keeps a connection whose
 * client sent an incomplete request and half-closed until its idle timeout
 * (30 s), so each such input would cost that long. libmicrohttpd is not
 * instrumented here: the coverage shown is kvpipe's request handling. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "fuzz.h"
#include "kvpipe/metadata_server.h"

#define RESTART_EVERY 256
#define REPLY_TIMEOUT_MS 10000
#define MAX_REPLY (1u << 20)
#define MAX_MODEL 64
#define MAX_BODY ((size_t)16 << 20) /* the store's documented value limit */

static kvp_metadata_server *server;
static int port;
static unsigned inputs;
static char prefix[40];       /* of every key this harness uses */
static char input_prefix[64]; /* of the keys of the current input */
static const char canary_value[] = "{\"canary\":true}";

typedef struct reply {
    char *buf;
    size_t len;
    int code;
    const char *body;
    size_t body_len;
} reply;

static int connect_server(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FUZZ_CHECK(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int err = connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0 ? 0 : errno;
    if (err == EINTR) {
        /* libFuzzer's timer signal: the connection goes on being made. */
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        socklen_t len = sizeof err;
        int rc;
        while ((rc = poll(&pfd, 1, REPLY_TIMEOUT_MS)) < 0 && errno == EINTR) {
        }
        if (rc == 0)
            err = ETIMEDOUT;
        else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
            err = errno;
    }
    if (err) {
        fprintf(stderr, "fuzz_http_store: connect to port %d: %s\n", port, strerror(err));
        abort();
    }
    return fd;
}

/* Close with a reset once the reply is in: neither side is left in
 * TIME_WAIT, which at thousands of connections a second would use up the
 * ephemeral ports. */
static void close_reset(int fd)
{
    struct linger l = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(fd);
}

/* Send what the server takes; it may answer and close before reading all. */
static void send_some(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        struct pollfd pfd = {.fd = fd, .events = POLLOUT};
        int rc = poll(&pfd, 1, REPLY_TIMEOUT_MS);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0 || (pfd.revents & (POLLERR | POLLHUP))) return;
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n <= 0) return;
        p += n;
        len -= (size_t)n;
    }
}

/* Everything until the server closes; the server must close in time. */
static void read_all(int fd, reply *r)
{
    size_t cap = 4096;
    r->buf = malloc(cap);
    r->len = 0;
    FUZZ_CHECK(r->buf);
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int rc = poll(&pfd, 1, REPLY_TIMEOUT_MS);
        if (rc < 0 && errno == EINTR) continue;
        /* A server that neither answers nor closes holds its peer forever. */
        FUZZ_CHECK(rc > 0);
        if (r->len == cap) {
            FUZZ_CHECK(cap < MAX_REPLY);
            cap *= 2;
            r->buf = realloc(r->buf, cap);
            FUZZ_CHECK(r->buf);
        }
        ssize_t n = recv(fd, r->buf + r->len, cap - r->len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break; /* EOF, or a reset after an early answer */
        r->len += (size_t)n;
    }
}

/* Parse one response at the start of r->buf: status line, headers, and a
 * body of exactly Content-Length bytes. Returns the bytes it spans, 0 if the
 * text is not a response. */
static size_t parse_response(const char *buf, size_t len, int *code, const char **body,
                             size_t *body_len)
{
    if (len < 12 || memcmp(buf, "HTTP/1.", 7) != 0 || buf[8] != ' ') return 0;
    int c = 0;
    for (int i = 9; i < 12; i++) {
        if (buf[i] < '0' || buf[i] > '9') return 0;
        c = c * 10 + (buf[i] - '0');
    }
    const char *end = memmem(buf, len, "\r\n\r\n", 4);
    if (!end) return 0;
    size_t head = (size_t)(end - buf) + 4;
    size_t cl = 0;
    int have_cl = 0;
    for (const char *line = memchr(buf, '\n', head); line && line < end;
         line = memchr(line + 1, '\n', (size_t)(end - line))) {
        if ((size_t)(end - line) > 16 && strncasecmp(line + 1, "Content-Length:", 15) == 0) {
            cl = strtoul(line + 16, NULL, 10);
            have_cl = 1;
        }
    }
    if (!have_cl || cl > len - head) return 0;
    *code = c;
    *body = buf + head;
    *body_len = cl;
    return head + cl;
}

static void expect_response(reply *r)
{
    FUZZ_CHECK(parse_response(r->buf, r->len, &r->code, &r->body, &r->body_len) != 0);
}

/* One request on its own connection. */
static void exchange(const char *head, size_t head_len, const void *body, size_t body_len, reply *r)
{
    int fd = connect_server();
    send_some(fd, head, head_len);
    if (body_len) send_some(fd, body, body_len);
    read_all(fd, r);
    close_reset(fd);
}

/* The ops mode's keep-alive connection, with what was received but not yet
 * taken as a response. */
typedef struct conn {
    int fd;
    char *buf;
    size_t len, cap;
} conn;

static void conn_close(conn *c)
{
    if (c->fd >= 0) close_reset(c->fd);
    c->fd = -1;
    c->len = 0;
}

/* Receive more; 0 at end of stream. The server must answer in time. */
static int conn_fill(conn *c)
{
    if (c->len == c->cap) {
        FUZZ_CHECK(c->cap < MAX_REPLY);
        c->cap = c->cap ? c->cap * 2 : 4096;
        c->buf = realloc(c->buf, c->cap);
        FUZZ_CHECK(c->buf);
    }
    for (;;) {
        struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
        int rc = poll(&pfd, 1, REPLY_TIMEOUT_MS);
        if (rc < 0 && errno == EINTR) continue;
        FUZZ_CHECK(rc > 0);
        ssize_t n = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;
        c->len += (size_t)n;
        return 1;
    }
}

static int has_header(const char *head, size_t len, const char *line)
{
    size_t n = strlen(line);
    for (const char *p = memchr(head, '\n', len); p && (size_t)(p - head) + 1 + n <= len;
         p = memchr(p + 1, '\n', len - (size_t)(p + 1 - head)))
        if (strncasecmp(p + 1, line, n) == 0) return 1;
    return 0;
}

/* Take one response off the connection (with no body when head_only: a reply
 * to HEAD). Returns 0 if the stream ended before it began, which a server may
 * do to an idle keep-alive connection. */
static int conn_read(conn *c, int head_only, reply *r)
{
    const char *end;
    while (!(end = c->len ? memmem(c->buf, c->len, "\r\n\r\n", 4) : NULL)) {
        size_t had = c->len;
        if (!conn_fill(c)) {
            FUZZ_CHECK(had == 0); /* not in the middle of a response */
            return 0;
        }
    }
    size_t head = (size_t)(end - c->buf) + 4;
    FUZZ_CHECK(head >= 12 && memcmp(c->buf, "HTTP/1.", 7) == 0 && c->buf[8] == ' ');
    int code = atoi(c->buf + 9);
    FUZZ_CHECK(code >= 100 && code <= 599);
    size_t need = head;
    if (!head_only) {
        const char *cl = NULL;
        for (const char *p = memchr(c->buf, '\n', head); p && p < end;
             p = memchr(p + 1, '\n', (size_t)(end - p)))
            if (strncasecmp(p + 1, "Content-Length:", 15) == 0) cl = p + 16;
        FUZZ_CHECK(cl);
        need += strtoul(cl, NULL, 10);
    }
    while (c->len < need)
        FUZZ_CHECK(conn_fill(c));
    r->buf = malloc(need ? need : 1);
    FUZZ_CHECK(r->buf);
    memcpy(r->buf, c->buf, need);
    r->len = need;
    r->code = code;
    r->body = r->buf + head;
    r->body_len = need - head;
    int closes = has_header(c->buf, head, "Connection: close");
    memmove(c->buf, c->buf + need, c->len - need);
    c->len -= need;
    if (closes) conn_close(c);
    return 1;
}

static void url_key(char *out, size_t cap, const uint8_t *key, size_t n)
{
    size_t o = (size_t)snprintf(out, cap, "%s", input_prefix);
    for (size_t i = 0; i < n && o + 4 < cap; i++)
        o += (size_t)snprintf(out + o, cap - o, "%%%02X", key[i]);
}

static void start_server(void)
{
    FUZZ_CHECK(kvp_metadata_server_start("127.0.0.1", 0, &server) == KVP_OK);
    port = kvp_metadata_server_port(server);
    char head[256];
    snprintf(head, sizeof head,
             "PUT /metadata?key=%scanary HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
             "Content-Length: %zu\r\n\r\n",
             prefix, sizeof canary_value - 1);
    reply r;
    exchange(head, strlen(head), canary_value, sizeof canary_value - 1, &r);
    expect_response(&r);
    FUZZ_CHECK(r.code == 200);
    free(r.buf);
}

static void check_canary(void)
{
    char head[256];
    snprintf(head, sizeof head,
             "GET /metadata?key=%scanary HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", prefix);
    reply r;
    exchange(head, strlen(head), NULL, 0, &r);
    expect_response(&r);
    FUZZ_CHECK(r.code == 200 && r.body_len == sizeof canary_value - 1 &&
               memcmp(r.body, canary_value, r.body_len) == 0);
    free(r.buf);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvpf_quiet();
    uint64_t nonce = 0;
    FUZZ_CHECK(getrandom(&nonce, sizeof nonce, 0) == (ssize_t)sizeof nonce);
    snprintf(prefix, sizeof prefix, "fuzz-%016llx/", (unsigned long long)nonce);
    start_server();
    return 0;
}

/* ---- request mode ---- */

/* Copy up to cap - 1 bytes of the input up to a NUL, replacing the bytes that
 * would change the request's framing. */
static size_t take_field(kvpf_reader *in, char *out, size_t cap, const char *banned)
{
    size_t n = 0;
    while (in->left) {
        uint8_t c = (uint8_t)kvpf_take(in, 1);
        if (c == 0) break;
        if (n + 1 < cap) out[n++] = strchr(banned, c) ? '_' : (char)c;
    }
    out[n] = '\0';
    return n;
}

/* Headers that decide where the request ends belong to the harness. */
static int framing_header(const char *line, size_t len)
{
    static const char *const names[] = {"content-length", "transfer-encoding", "expect",
                                        "connection", "upgrade"};
    while (len && (*line == ' ' || *line == '\t')) {
        line++;
        len--;
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        size_t n = strlen(names[i]);
        if (len >= n && strncasecmp(line, names[i], n) == 0) return 1;
    }
    return 0;
}

/* Input: method, URL and header lines (each up to a NUL; '\n' separates
 * header lines), then the body. Whatever the server makes of it, the
 * request is complete, so the server must answer it and close. */
static void run_request(const uint8_t *data, size_t size)
{
    kvpf_reader in = {data, size};
    char method[32], url[1024], hdrs[2048], head[4096];
    take_field(&in, method, sizeof method, " \r\n\t");
    take_field(&in, url, sizeof url, " \r\n\t");
    take_field(&in, hdrs, sizeof hdrs, "\r");
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: x\r\n", method[0] ? method : "GET",
                     url[0] ? url : "/");
    for (char *line = hdrs, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        size_t len = next ? (size_t)(next - line) : strlen(line);
        if (next) next++;
        /* A line starting with white space would continue the previous one. */
        if (len == 0 || line[0] == ' ' || line[0] == '\t' || framing_header(line, len)) continue;
        n += snprintf(head + n, sizeof head - (size_t)n, "%.*s\r\n", (int)len, line);
    }
    snprintf(head + n, sizeof head - (size_t)n, "Content-Length: %zu\r\nConnection: close\r\n\r\n",
             in.left);
    reply r;
    exchange(head, strlen(head), in.p, in.left, &r);
    /* The server answers a complete request; a reply to HEAD has no body. */
    int code;
    const char *body;
    size_t body_len;
    FUZZ_CHECK(r.len >= 12);
    if (parse_response(r.buf, r.len, &code, &body, &body_len) == 0) {
        FUZZ_CHECK(strcmp(method, "HEAD") == 0 && memcmp(r.buf, "HTTP/1.", 7) == 0);
        code = atoi(r.buf + 9);
    }
    FUZZ_CHECK(code >= 200 && code <= 599);
    free(r.buf);
}

/* ---- structured mode ---- */

typedef struct model_entry {
    char key[256];
    const uint8_t *value;
    size_t len;
} model_entry;

typedef struct model {
    model_entry e[MAX_MODEL];
    size_t n;
} model;

static model_entry *model_find(model *m, const char *key)
{
    for (size_t i = 0; i < m->n; i++)
        if (strcmp(m->e[i].key, key) == 0) return &m->e[i];
    return NULL;
}

enum kind {
    K_GET,
    K_PUT,
    K_DELETE,
    K_POST,
    K_PUT_CHUNKED,
    K_NO_KEY,
    K_TOO_LARGE,
    K_HEAD,
    K_PIPELINED, /* PUT then GET of the key on one connection */
    K_LIST,      /* GET ?list= of the input's prefix (the key is not sent) */
    K_COUNT
};

/* The key as the server sees it: the URL decoding stops at a NUL. */
static void model_key(char *out, const uint8_t *key, size_t n)
{
    size_t k = strnlen((const char *)key, n);
    snprintf(out, 256, "%s%.*s", input_prefix, (int)k, (const char *)key);
}

typedef struct text {
    char *p;
    size_t len, cap;
} text;

static void text_add(text *t, const void *data, size_t n)
{
    if (t->len + n + 1 > t->cap) {
        t->cap = (t->len + n + 1) * 2;
        t->p = realloc(t->p, t->cap);
        FUZZ_CHECK(t->p);
    }
    memcpy(t->p + t->len, data, n);
    t->len += n;
    t->p[t->len] = '\0';
}

static void text_printf(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void text_printf(text *t, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    FUZZ_CHECK(n >= 0 && (size_t)n < sizeof buf);
    text_add(t, buf, (size_t)n);
}

/* Chunks of up to 7 bytes, then the last chunk. */
static void add_chunked(text *t, const uint8_t *v, size_t n)
{
    for (size_t i = 0; i < n; i += 7) {
        size_t c = n - i < 7 ? n - i : 7;
        text_printf(t, "%zx\r\n", c);
        text_add(t, v + i, c);
        text_add(t, "\r\n", 2);
    }
    text_add(t, "0\r\n\r\n", 5);
}

static void build_request(text *t, enum kind kind, const char *k, const uint8_t *v, size_t vlen)
{
    static const char *const methods[K_COUNT] = {
        [K_GET] = "GET",         [K_PUT] = "PUT",    [K_DELETE] = "DELETE", [K_POST] = "POST",
        [K_PUT_CHUNKED] = "PUT", [K_NO_KEY] = "GET", [K_TOO_LARGE] = "PUT", [K_HEAD] = "HEAD",
        [K_PIPELINED] = "PUT",   [K_LIST] = "GET"};
    if (kind == K_LIST)
        text_printf(t, "GET /metadata?list=%s HTTP/1.1\r\nHost: x\r\n", input_prefix);
    else
        text_printf(t, "%s /metadata?%s%s HTTP/1.1\r\nHost: x\r\n", methods[kind],
                    kind == K_NO_KEY ? "other=" : "key=", k);
    /* The connection is kept across requests, except after the ones the
     * server answers before reading their body. */
    switch (kind) {
    case K_PUT:
        text_printf(t, "Content-Length: %zu\r\n\r\n", vlen);
        text_add(t, v, vlen);
        break;
    case K_POST:
        text_printf(t, "Content-Length: %zu\r\nConnection: close\r\n\r\n", vlen);
        text_add(t, v, vlen);
        break;
    case K_PUT_CHUNKED:
        text_printf(t, "Transfer-Encoding: chunked\r\n\r\n");
        add_chunked(t, v, vlen);
        break;
    case K_TOO_LARGE:
        text_printf(t, "Content-Length: %zu\r\nConnection: close\r\n\r\n", MAX_BODY + 1);
        break;
    case K_PIPELINED:
        text_printf(t, "Content-Length: %zu\r\n\r\n", vlen);
        text_add(t, v, vlen);
        text_printf(t, "GET /metadata?key=%s HTTP/1.1\r\nHost: x\r\n\r\n", k);
        break;
    default:
        text_printf(t, "\r\n");
        break;
    }
}

static void model_put(model *m, model_entry *e, const char *key, const uint8_t *v, size_t vlen)
{
    if (!e) {
        /* An input holds fewer ops than MAX_MODEL, each adding one key at most. */
        FUZZ_CHECK(m->n < MAX_MODEL);
        e = &m->e[m->n++];
        snprintf(e->key, sizeof e->key, "%s", key);
    }
    e->value = v;
    e->len = vlen;
}

/* Send the request and take its reply (two for K_PIPELINED; when the server
 * refused the PUT before its body and closed, the GET goes again on a new
 * connection). A connection the server closed while idle is opened again,
 * once. */
static void send_request(conn *c, enum kind kind, const text *req, const char *k, reply *r,
                         reply *second)
{
    for (int attempt = 0;; attempt++) {
        if (c->fd < 0) c->fd = connect_server();
        send_some(c->fd, req->p, req->len);
        if (conn_read(c, kind == K_HEAD, r)) break;
        conn_close(c);
        FUZZ_CHECK(attempt == 0);
    }
    if (kind == K_PIPELINED && c->fd < 0) {
        FUZZ_CHECK(r->code != 200);
        text get = {0};
        text_printf(&get, "GET /metadata?key=%s HTTP/1.1\r\nHost: x\r\n\r\n", k);
        c->fd = connect_server();
        send_some(c->fd, get.p, get.len);
        free(get.p);
    }
    if (kind == K_PIPELINED) FUZZ_CHECK(c->fd >= 0 && conn_read(c, 0, second));
    if (kind == K_POST || kind == K_TOO_LARGE) conn_close(c);
}

/* Mooncake's rule: a key holding "rpc_meta" is written once. */
static int put_refused(const model_entry *e, const char *key)
{
    return e && strstr(key, "rpc_meta") != NULL;
}

static int printable(const char *key)
{
    for (const unsigned char *p = (const unsigned char *)key; *p; p++)
        if (*p < 0x20 || *p >= 0x7f || *p == '"' || *p == '\\') return 0;
    return 1;
}

/* The listing of the input's prefix: a JSON array of exactly the model's
 * keys (those of plain ASCII compared by name, the others counted). */
static void check_list(const model *m, const reply *r)
{
    FUZZ_CHECK(r->code == 200);
    cJSON *a = cJSON_ParseWithLength(r->body, r->body_len);
    FUZZ_CHECK(cJSON_IsArray(a) && (size_t)cJSON_GetArraySize(a) == m->n);
    size_t plen = strlen(input_prefix);
    const cJSON *item;
    cJSON_ArrayForEach(item, a)
    {
        FUZZ_CHECK(cJSON_IsString(item) && strncmp(item->valuestring, input_prefix, plen) == 0);
    }
    for (size_t i = 0; i < m->n; i++) {
        if (!printable(m->e[i].key)) continue;
        int found = 0;
        cJSON_ArrayForEach(item, a)
        {
            found |= strcmp(item->valuestring, m->e[i].key) == 0;
        }
        FUZZ_CHECK(found);
    }
    cJSON_Delete(a);
}

static void run_op(conn *c, model *m, enum kind kind, const uint8_t *key, size_t klen,
                   const uint8_t *v, size_t vlen)
{
    char k[3 * 256 + 64], mk[256];
    url_key(k, sizeof k, key, klen);
    model_key(mk, key, klen);
    text req = {0};
    build_request(&req, kind, k, v, vlen);
    reply r, g = {0};
    send_request(c, kind, &req, k, &r, &g);
    free(req.p);
    model_entry *e = model_find(m, mk);
    switch (kind) {
    case K_GET:
        if (e)
            FUZZ_CHECK(r.code == 200 && r.body_len == e->len &&
                       (e->len == 0 || memcmp(r.body, e->value, e->len) == 0));
        else
            FUZZ_CHECK(r.code == 404);
        break;
    case K_PUT:
    case K_PUT_CHUNKED:
        if (put_refused(e, mk)) {
            FUZZ_CHECK(r.code == 400);
            break;
        }
        FUZZ_CHECK(r.code == 200);
        model_put(m, e, mk, v, vlen);
        break;
    case K_PIPELINED:
        if (put_refused(e, mk)) {
            FUZZ_CHECK(r.code == 400);
        } else {
            FUZZ_CHECK(r.code == 200);
            model_put(m, e, mk, v, vlen);
            e = model_find(m, mk);
        }
        FUZZ_CHECK(e && g.code == 200 && g.body_len == e->len &&
                   (e->len == 0 || memcmp(g.body, e->value, e->len) == 0));
        break;
    case K_DELETE:
        FUZZ_CHECK(r.code == (e ? 200 : 404));
        if (e) *e = m->e[--m->n];
        break;
    case K_LIST:
        check_list(m, &r);
        break;
    case K_POST:
    case K_HEAD:
        FUZZ_CHECK(r.code == 405);
        break;
    case K_NO_KEY:
        FUZZ_CHECK(r.code == 400);
        break;
    case K_TOO_LARGE:
        FUZZ_CHECK(r.code == 413);
        break;
    default:
        break;
    }
    free(r.buf);
    free(g.buf);
}

static void run_structured(const uint8_t *data, size_t size)
{
    kvpf_reader in = {data, size};
    model m = {.n = 0};
    conn c = {.fd = -1};
    /* Every op costs at least 4 bytes, so an input has at most size / 4. */
    for (int ops = 0; in.left && ops < MAX_MODEL; ops++) {
        enum kind kind = (enum kind)(kvpf_take(&in, 1) % K_COUNT);
        size_t klen = (size_t)kvpf_take(&in, 1);
        if (klen > in.left) klen = in.left;
        const uint8_t *key = in.p;
        in.p += klen;
        in.left -= klen;
        size_t vlen = (size_t)kvpf_take(&in, 2);
        if (vlen > in.left) vlen = in.left;
        const uint8_t *v = in.p;
        in.p += vlen;
        in.left -= vlen;
        run_op(&c, &m, kind, key, klen, v, vlen);
    }
    conn_close(&c);
    free(c.buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    /* Each input has keys of its own: the server outlives inputs. */
    snprintf(input_prefix, sizeof input_prefix, "%s%u/", prefix, inputs);
    if (data[0] & 1)
        run_structured(data + 1, size - 1);
    else
        run_request(data + 1, size - 1);
    if (++inputs % 16 == 0) check_canary();
    if (inputs % RESTART_EVERY == 0) {
        check_canary();
        kvp_metadata_server_stop(server);
        start_server();
    }
    return 0;
}
