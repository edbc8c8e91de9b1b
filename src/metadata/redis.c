/* The Redis metadata store over hiredis: plain SET, GET and DEL of a key to
 * its JSON text, as Mooncake's redis backend does. Credentials and database
 * come from the connection string, else from Mooncake's MC_REDIS_PASSWORD,
 * MC_REDIS_USERNAME and MC_REDIS_DB_INDEX.
 *
 * One connection per store, guarded by a mutex (a redisContext is not
 * thread-safe). A command that fails with an I/O error (the server restarted,
 * or dropped an idle connection) reconnects once and is retried, so a restarted
 * redis is picked up again without the caller noticing; errors the server
 * reports (NOAUTH, WRONGTYPE, ...) are returned as they are. */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "common/util.h"
#include "metadata/metadata.h"

#define REDIS_SCHEME "redis://"
#define REDIS_DEFAULT_PORT 6379
#define REDIS_CRED_MAX 256

typedef struct redis_store {
    pthread_mutex_t lock;
    redisContext *ctx; /* NULL after a failed reconnect; next call tries again */
    kvpi_hostport hp;
    char addr[KVPI_HOST_MAX + 16]; /* "h:p", for messages */
    char user[REDIS_CRED_MAX];
    char password[REDIS_CRED_MAX];
    int db;
    int timeout_ms;
} redis_store;

/* ---- connection string: redis://[user:password@]host[:port][/db] ---- */

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Percent-decode [s, s+len) into out, so that a password may hold '@' or ':'. */
static int url_decode(const char *s, size_t len, char *out, size_t out_len)
{
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        int c = (unsigned char)s[i];
        if (c == '%') {
            int hi = i + 2 < len ? hex_value(s[i + 1]) : -1;
            int lo = hi >= 0 ? hex_value(s[i + 2]) : -1;
            if (lo < 0) return -1;
            c = hi * 16 + lo;
            i += 2;
        }
        if (o + 1 >= out_len) return -1;
        out[o++] = (char)c;
    }
    out[o] = '\0';
    return 0;
}

/* "user:password", ":password" or "password" (a lone word is a password, as
 * with redis-cli's -a). */
static kvp_status parse_userinfo(redis_store *s, const char *conn, const char *ui, size_t len)
{
    const char *colon = memchr(ui, ':', len);
    int bad;
    if (colon) {
        size_t ulen = (size_t)(colon - ui);
        bad = url_decode(ui, ulen, s->user, sizeof s->user) ||
              url_decode(colon + 1, len - ulen - 1, s->password, sizeof s->password);
    } else {
        bad = url_decode(ui, len, s->password, sizeof s->password);
    }
    if (bad)
        return kvpi_error(KVP_EMETADATA,
                          "redis connection string '%s': bad or too long user:password", conn);
    return KVP_OK;
}

static kvp_status parse_db(redis_store *s, const char *conn, const char *text)
{
    long db;
    if (kvpi_parse_long(text, 0, 1000000, &db))
        return kvpi_error(KVP_EMETADATA,
                          "redis connection string '%s': database '%s' is not a number", conn,
                          text);
    s->db = (int)db;
    return KVP_OK;
}

/* Mooncake's environment variables (transfer_metadata_plugin.cpp), for what
 * the connection string leaves out: MC_REDIS_PASSWORD (AUTH when not empty),
 * MC_REDIS_USERNAME (with a password only, as in Mooncake) and
 * MC_REDIS_DB_INDEX (0..255). */
static kvp_status env_credentials(redis_store *s)
{
    const char *pw = getenv("MC_REDIS_PASSWORD"), *user = getenv("MC_REDIS_USERNAME");
    if (!pw || !*pw) return KVP_OK;
    if (strlen(pw) >= sizeof s->password || (user && strlen(user) >= sizeof s->user))
        return kvpi_error(KVP_EMETADATA,
                          "redis at %s: MC_REDIS_USERNAME or MC_REDIS_PASSWORD "
                          "is longer than %d bytes",
                          s->addr, REDIS_CRED_MAX - 1);
    snprintf(s->password, sizeof s->password, "%s", pw);
    snprintf(s->user, sizeof s->user, "%s", user ? user : "");
    return KVP_OK;
}

/* Mooncake warns and uses database 0 for a bad value; kvpipe refuses it, since
 * engines writing to another database than meant would silently miss each
 * other. */
static kvp_status env_db(redis_store *s)
{
    const char *text = getenv("MC_REDIS_DB_INDEX");
    if (!text) return KVP_OK;
    long db;
    if (kvpi_parse_long(text, 0, 255, &db))
        return kvpi_error(KVP_EMETADATA,
                          "redis at %s: MC_REDIS_DB_INDEX '%s' is not a database number in 0..255",
                          s->addr, text);
    s->db = (int)db;
    return KVP_OK;
}

static kvp_status parse_conn(redis_store *s, const char *conn)
{
    const char *rest = conn + strlen(REDIS_SCHEME);
    const char *slash = strchr(rest, '/');
    size_t auth_end = slash ? (size_t)(slash - rest) : strlen(rest);
    /* The last '@' before the path ends the credentials. */
    const char *at = NULL;
    for (size_t i = 0; i < auth_end; i++)
        if (rest[i] == '@') at = rest + i;
    kvp_status st = KVP_OK;
    if (at) {
        st = parse_userinfo(s, conn, rest, (size_t)(at - rest));
        if (st) return st;
    }
    const char *host = at ? at + 1 : rest;
    size_t host_len = (size_t)(rest + auth_end - host);
    char hostport[KVPI_HOST_MAX + 16];
    if (host_len == 0 || host_len >= sizeof hostport)
        return kvpi_error(KVP_EMETADATA, "redis connection string '%s': expected host:port", conn);
    memcpy(hostport, host, host_len);
    hostport[host_len] = '\0';
    if (kvpi_hostport_parse(hostport, REDIS_DEFAULT_PORT, &s->hp) != KVP_OK)
        return kvpi_error(KVP_EMETADATA, "redis connection string '%s': %s", conn,
                          kvp_last_error());
    kvpi_hostport_format(s->hp.host, s->hp.port, s->addr, sizeof s->addr);
    /* What the string says wins; Mooncake's variables fill in the rest. */
    if (!at && (st = env_credentials(s))) return st;
    return slash && slash[1] ? parse_db(s, conn, slash + 1) : env_db(s);
}

/* ---- SIGPIPE ----
 * hiredis writes with write(2), so a write to a connection the server already
 * reset would raise SIGPIPE and kill the process. A library must not change the
 * process's signal disposition, so the signal is blocked on this thread around
 * each command and a pending one is consumed before unblocking. */

typedef struct sigpipe_guard {
    sigset_t old;
    int was_pending;
} sigpipe_guard;

static void sigpipe_block(sigpipe_guard *g)
{
    sigset_t pipe_set, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    sigpending(&pending);
    g->was_pending = sigismember(&pending, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &g->old);
}

static void sigpipe_restore(sigpipe_guard *g)
{
    sigset_t pipe_set, pending;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    sigpending(&pending);
    if (!g->was_pending && sigismember(&pending, SIGPIPE)) {
        struct timespec zero = {0, 0};
        while (sigtimedwait(&pipe_set, NULL, &zero) < 0 && errno == EINTR) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* ---- connection ---- */

static struct timeval to_timeval(int ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    return tv;
}

/* Run one command during setup; fails on an error reply. */
static kvp_status setup_command(redis_store *s, redisContext *c, const char *what, int argc,
                                const char **argv)
{
    redisReply *r = redisCommandArgv(c, argc, argv, NULL);
    kvp_status st = KVP_OK;
    if (!r)
        st = kvpi_error(KVP_EMETADATA, "redis at %s: %s: %s", s->addr, what, c->errstr);
    else if (r->type == REDIS_REPLY_ERROR)
        st = kvpi_error(KVP_EMETADATA, "redis at %s: %s refused: %s", s->addr, what, r->str);
    if (r) freeReplyObject(r);
    return st;
}

static kvp_status authenticate(redis_store *s, redisContext *c)
{
    if (!s->password[0] && !s->user[0]) return KVP_OK;
    if (s->user[0]) {
        const char *argv[] = {"AUTH", s->user, s->password};
        return setup_command(s, c, "AUTH", 3, argv);
    }
    const char *argv[] = {"AUTH", s->password};
    return setup_command(s, c, "AUTH", 2, argv);
}

static kvp_status select_db(redis_store *s, redisContext *c)
{
    if (s->db == 0) return KVP_OK;
    char db[16];
    snprintf(db, sizeof db, "%d", s->db);
    const char *argv[] = {"SELECT", db};
    return setup_command(s, c, "SELECT", 2, argv);
}

/* A new connection, authenticated, on the store's database. */
static kvp_status dial(redis_store *s, redisContext **out)
{
    struct timeval tv = to_timeval(s->timeout_ms);
    redisContext *c = redisConnectWithTimeout(s->hp.host, s->hp.port, tv);
    if (!c) return kvpi_error(KVP_EMETADATA, "redis at %s unreachable: out of memory", s->addr);
    kvp_status st = KVP_OK;
    if (c->err)
        st = kvpi_error(KVP_EMETADATA, "redis at %s unreachable: %s", s->addr, c->errstr);
    else if (redisSetTimeout(c, tv) != REDIS_OK)
        st = kvpi_error(KVP_EMETADATA, "redis at %s: cannot set timeout: %s", s->addr, c->errstr);
    if (!st) st = authenticate(s, c);
    if (!st) st = select_db(s, c);
    if (!st) {
        /* A server that wants a password we lack answers PING with NOAUTH. */
        const char *argv[] = {"PING"};
        st = setup_command(s, c, "PING", 1, argv);
    }
    if (st) {
        redisFree(c);
        return st;
    }
    *out = c;
    return KVP_OK;
}

/* Called with the lock held. */
static kvp_status connect_locked(redis_store *s)
{
    return dial(s, &s->ctx);
}

static void disconnect_locked(redis_store *s)
{
    if (s->ctx) redisFree(s->ctx);
    s->ctx = NULL;
}

/* Run a command; on an I/O error reconnect once and retry it. Returns the reply
 * (never an error reply: that becomes KVP_EMETADATA). Called with the lock. */
static kvp_status command_locked(redis_store *s, int argc, const char **argv, const size_t *lens,
                                 redisReply **out)
{
    kvp_status st = KVP_OK;
    redisReply *r = NULL;
    for (int attempt = 0; attempt < 2 && !r; attempt++) {
        if (!s->ctx && (st = connect_locked(s)) != KVP_OK) return st;
        r = redisCommandArgv(s->ctx, argc, argv, lens);
        if (!r) {
            st = kvpi_error(KVP_EMETADATA, "redis at %s: %s: %s", s->addr, argv[0],
                            s->ctx->errstr[0] ? s->ctx->errstr : "connection lost");
            KVPI_INFO("%s; reconnecting", kvp_last_error());
            disconnect_locked(s);
        }
    }
    if (!r) return st;
    if (r->type == REDIS_REPLY_ERROR) {
        st = kvpi_error(KVP_EMETADATA, "redis at %s: %s refused: %s", s->addr, argv[0], r->str);
        freeReplyObject(r);
        return st;
    }
    *out = r;
    return KVP_OK;
}

static kvp_status command(redis_store *s, int argc, const char **argv, const size_t *lens,
                          redisReply **out)
{
    sigpipe_guard g;
    sigpipe_block(&g);
    pthread_mutex_lock(&s->lock);
    kvp_status st = command_locked(s, argc, argv, lens, out);
    pthread_mutex_unlock(&s->lock);
    sigpipe_restore(&g);
    return st;
}

/* ---- ops ---- */

static void redis_close(void *store)
{
    redis_store *s = store;
    if (!s) return;
    disconnect_locked(s);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static kvp_status redis_open(const char *conn, int timeout_ms, void **out)
{
    redis_store *s = calloc(1, sizeof *s);
    if (!s) return kvpi_error(KVP_ENOMEM, "redis: out of memory");
    pthread_mutex_init(&s->lock, NULL);
    s->timeout_ms = timeout_ms > 0 ? timeout_ms : KVPI_DEFAULT_TIMEOUT_MS;
    kvp_status st = parse_conn(s, conn);
    if (!st) {
        /* Connect now, so that a store that is down is reported at open. */
        sigpipe_guard g;
        sigpipe_block(&g);
        st = connect_locked(s);
        sigpipe_restore(&g);
    }
    if (st) {
        redis_close(s);
        return st;
    }
    *out = s;
    return KVP_OK;
}

static kvp_status redis_get(void *store, const char *key, char **value)
{
    redis_store *s = store;
    const char *argv[] = {"GET", key};
    size_t lens[] = {3, strlen(key)};
    redisReply *r = NULL;
    kvp_status st = command(s, 2, argv, lens, &r);
    if (st) return st;
    if (r->type == REDIS_REPLY_NIL) {
        st = kvpi_error(KVP_ENOTFOUND, "redis at %s: no key '%s'", s->addr, key);
    } else if (r->type != REDIS_REPLY_STRING || memchr(r->str, '\0', r->len)) {
        st = kvpi_error(KVP_EMETADATA, "redis at %s: value of '%s' is not text", s->addr, key);
    } else {
        *value = strndup(r->str, r->len);
        if (!*value) st = kvpi_error(KVP_ENOMEM, "redis: out of memory");
    }
    freeReplyObject(r);
    return st;
}

static kvp_status redis_get_many(void *store, const char *const *keys, size_t n, char **values)
{
    redis_store *s = store;
    const char **argv = malloc((n + 1) * sizeof *argv);
    size_t *lens = malloc((n + 1) * sizeof *lens);
    if (!argv || !lens) {
        free(argv);
        free(lens);
        return kvpi_error(KVP_ENOMEM, "redis: out of memory");
    }
    argv[0] = "MGET";
    lens[0] = 4;
    for (size_t i = 0; i < n; i++) {
        argv[i + 1] = keys[i];
        lens[i + 1] = strlen(keys[i]);
        values[i] = NULL;
    }
    redisReply *r = NULL;
    kvp_status st = command(s, (int)n + 1, argv, lens, &r);
    free(argv);
    free(lens);
    if (st) return st;
    if (r->type != REDIS_REPLY_ARRAY || r->elements != n)
        st = kvpi_error(KVP_EMETADATA, "redis at %s: malformed MGET answer", s->addr);
    for (size_t i = 0; i < n && !st; i++) {
        const redisReply *e = r->element[i];
        if (e->type == REDIS_REPLY_NIL) continue;
        if (e->type != REDIS_REPLY_STRING || memchr(e->str, '\0', e->len))
            st = kvpi_error(KVP_EMETADATA, "redis at %s: value of '%s' is not text", s->addr,
                            keys[i]);
        else if (!(values[i] = strndup(e->str, e->len)))
            st = kvpi_error(KVP_ENOMEM, "redis: out of memory");
    }
    freeReplyObject(r);
    if (st) kvpi_store_values_free(values, n);
    return st;
}

static kvp_status redis_put(void *store, const char *key, const char *value)
{
    const char *argv[] = {"SET", key, value};
    size_t lens[] = {3, strlen(key), strlen(value)};
    redisReply *r = NULL;
    kvp_status st = command(store, 3, argv, lens, &r);
    if (!st) freeReplyObject(r);
    return st;
}

static kvp_status redis_del(void *store, const char *key)
{
    const char *argv[] = {"DEL", key};
    size_t lens[] = {3, strlen(key)};
    redisReply *r = NULL;
    kvp_status st = command(store, 2, argv, lens, &r);
    if (!st) freeReplyObject(r);
    return st;
}

/* ---- watch: keyspace notifications ----
 * Redis publishes "set", "del", "expired"... on __keyspace@DB__:KEY for every
 * write of KEY, by any client (Mooncake's too), once notify-keyspace-events
 * holds K (keyspace channel) and the classes of those commands ($ strings, g
 * generic). The watch adds them to what the server has (CONFIG GET, then
 * CONFIG SET, keeping the other flags), then PSUBSCRIBEs to the prefix. A
 * server that refuses CONFIG (ACLs, a managed redis, a renamed command) and
 * has not these flags already cannot be watched: KVP_ENOTSUP. */

#define KEYSPACE_FLAGS "K$g"

/* 1 if flags cover KEYSPACE_FLAGS ('A' is every class but key-miss and new). */
static int keyspace_enough(const char *flags)
{
    if (!strchr(flags, 'K')) return 0;
    return strchr(flags, 'A') || (strchr(flags, '$') && strchr(flags, 'g'));
}

static kvp_status enable_keyspace(redis_store *s, redisContext *c)
{
    const char *get[] = {"CONFIG", "GET", "notify-keyspace-events"};
    redisReply *r = redisCommandArgv(c, 3, get, NULL);
    char flags[64] = "";
    kvp_status st = KVP_OK;
    if (!r) return kvpi_error(KVP_EMETADATA, "redis at %s: CONFIG GET: %s", s->addr, c->errstr);
    if (r->type == REDIS_REPLY_ARRAY && r->elements == 2 &&
        r->element[1]->type == REDIS_REPLY_STRING)
        snprintf(flags, sizeof flags, "%s", r->element[1]->str);
    else if (r->type == REDIS_REPLY_ERROR)
        st = kvpi_error(KVP_ENOTSUP, "CONFIG GET notify-keyspace-events refused: %s", r->str);
    freeReplyObject(r);
    if (st || keyspace_enough(flags)) return st;
    char want[80];
    snprintf(want, sizeof want, "%s", flags);
    for (const char *f = KEYSPACE_FLAGS; *f; f++) {
        size_t n = strlen(want);
        if (!strchr(want, *f) && n + 1 < sizeof want) want[n] = *f, want[n + 1] = '\0';
    }
    const char *set[] = {"CONFIG", "SET", "notify-keyspace-events", want};
    r = redisCommandArgv(c, 4, set, NULL);
    if (!r) return kvpi_error(KVP_EMETADATA, "redis at %s: CONFIG SET: %s", s->addr, c->errstr);
    if (r->type == REDIS_REPLY_ERROR)
        st = kvpi_error(KVP_ENOTSUP, "CONFIG SET notify-keyspace-events %s refused: %s", want,
                        r->str);
    else
        KVPI_INFO("redis at %s: notify-keyspace-events set to '%s' (was '%s'), to follow "
                  "descriptor changes",
                  s->addr, want, flags);
    freeReplyObject(r);
    return st;
}

/* One pmessage: its channel is "__keyspace@DB__:KEY". */
static void keyspace_message(redisReply *r, void (*changed)(void *ctx, const char *key), void *ctx)
{
    if (r->type != REDIS_REPLY_ARRAY) return;
    if (r->elements == 3 && r->element[0]->type == REDIS_REPLY_STRING &&
        strcmp(r->element[0]->str, "psubscribe") == 0) {
        changed(ctx, NULL); /* subscribed: from now on nothing is missed */
        return;
    }
    if (r->elements != 4 || r->element[2]->type != REDIS_REPLY_STRING) return;
    const char *colon = strchr(r->element[2]->str, ':');
    if (colon) changed(ctx, colon + 1);
}

static kvp_status redis_watch(void *store, const char *prefix, int stop_fd,
                              void (*changed)(void *ctx, const char *key), void *ctx)
{
    redis_store *s = store;
    redisContext *c = NULL;
    sigpipe_guard g;
    sigpipe_block(&g);
    kvp_status st = dial(s, &c);
    /* A server that vanishes without a reset is noticed (hiredis: 15 s idle). */
    if (!st && redisEnableKeepAlive(c) != REDIS_OK)
        KVPI_DEBUG("redis at %s: watch: no TCP keepalive: %s", s->addr, c->errstr);
    if (!st) st = enable_keyspace(s, c);
    if (st == KVP_ENOTSUP)
        st = kvpi_error(KVP_ENOTSUP, "redis at %s: %s", s->addr, kvp_last_error());
    char pattern[KVPI_HOST_MAX + 64];
    snprintf(pattern, sizeof pattern, "__keyspace@%d__:%s*", s->db, prefix);
    if (!st && redisAppendCommand(c, "PSUBSCRIBE %s", pattern) != REDIS_OK)
        st = kvpi_error(KVP_EMETADATA, "redis at %s: PSUBSCRIBE: %s", s->addr, c->errstr);
    int done = 0;
    while (!st) {
        /* Write what is pending, hand out what arrived, then wait. */
        while (!done && !c->err)
            if (redisBufferWrite(c, &done) != REDIS_OK) break;
        void *reply;
        while (!c->err && redisGetReplyFromReader(c, &reply) == REDIS_OK && reply) {
            redisReply *r = reply;
            if (r->type == REDIS_REPLY_ERROR)
                st = kvpi_error(KVP_EMETADATA, "redis at %s: PSUBSCRIBE refused: %s", s->addr,
                                r->str);
            else
                keyspace_message(r, changed, ctx);
            freeReplyObject(r);
        }
        if (st) break;
        if (c->err) {
            st = kvpi_error(KVP_EMETADATA, "redis at %s: watch: %s", s->addr,
                            c->errstr[0] ? c->errstr : "connection lost");
            break;
        }
        struct pollfd p[2] = {{.fd = c->fd, .events = POLLIN}, {.fd = stop_fd, .events = POLLIN}};
        int rc = poll(p, 2, -1);
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0 || p[1].revents) break; /* stopped */
        if (redisBufferRead(c) != REDIS_OK)
            st = kvpi_error(KVP_EMETADATA, "redis at %s: watch: %s", s->addr,
                            c->errstr[0] ? c->errstr : "connection lost");
    }
    if (c) redisFree(c);
    sigpipe_restore(&g);
    return st;
}

const kvpi_store_ops kvpi_store_redis = {
    .open = redis_open,
    .get = redis_get,
    .get_many = redis_get_many,
    .put = redis_put,
    .del = redis_del,
    .watch = redis_watch,
    .close = redis_close,
    KVPI_STORE_REDIS,
};
