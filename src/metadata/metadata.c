/* The store registry and kvpi_meta: Mooncake's metadata keys on top of a
 * store's get/put/del, or the P2P handshake when there is no store. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "metadata/metadata.h"

#if !KVP_HAVE_HTTP
const kvpi_store_ops kvpi_store_http = {KVPI_STORE_HTTP};
#endif
#if !KVP_HAVE_ETCD
const kvpi_store_ops kvpi_store_etcd = {KVPI_STORE_ETCD};
#endif
#if !KVP_HAVE_REDIS
const kvpi_store_ops kvpi_store_redis = {KVPI_STORE_REDIS};
#endif

const kvpi_store_ops *const kvpi_stores[KVPI_N_STORES + 1] = {
    &kvpi_store_http,
    &kvpi_store_etcd,
    &kvpi_store_redis,
    NULL,
};

struct kvpi_meta {
    const kvpi_store_ops *ops; /* NULL in P2P mode */
    void *store;
    char *conn; /* for messages, with any password masked */
    int timeout_ms;
    kvpi_rpc_desc_fn desc_fn; /* the local descriptor, for handshakes */
    void *desc_ctx;
    const kvpi_auth *auth; /* NULL: unauthenticated */
    int auth_max_age_ms;
};

void kvpi_store_values_free(char **values, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(values[i]);
        values[i] = NULL;
    }
}

static int accepts(const kvpi_store_ops *ops, const char *conn)
{
    for (size_t i = 0; i < KVPI_STORE_SCHEMES && ops->schemes[i]; i++)
        if (strncasecmp(conn, ops->schemes[i], strlen(ops->schemes[i])) == 0) return 1;
    return ops->bare && *conn && !strstr(conn, "://") && strcmp(conn, KVPI_P2P_CONN) != 0;
}

const kvpi_store_ops *kvpi_store_lookup(const char *conn)
{
    if (!conn) return NULL;
    for (size_t i = 0; kvpi_stores[i]; i++)
        if (accepts(kvpi_stores[i], conn)) return kvpi_stores[i];
    return NULL;
}

/* Prefix the current detail with context, keeping it intact (the detail
 * buffer is also kvpi_error's target, hence the copy). */
static kvp_status wrap(kvp_status st, const char *prefix)
{
    return kvpi_error(st, "%s: %s", prefix, kvp_last_error());
}

/* Messages get logged, so a URL's "user:pass@" is shown as "***@". */
static char *mask_credentials(const char *conn)
{
    const char *rest = strstr(conn, "://");
    const char *at = rest ? strchr(rest + 3, '@') : NULL;
    const char *slash = rest ? strchr(rest + 3, '/') : NULL;
    if (!at || (slash && slash < at)) return strdup(conn);
    size_t n = (size_t)(rest + 3 - conn) + 4 + strlen(at + 1) + 1;
    char *out = malloc(n);
    if (out) snprintf(out, n, "%.*s***@%s", (int)(rest + 3 - conn), conn, at + 1);
    return out;
}

/* "http://, etcd://, redis://, host:port": what the stores take. */
static void expected_conns(char *buf, size_t size)
{
    size_t used = 0;
    int bare = 0;
    buf[0] = '\0';
    for (size_t i = 0; kvpi_stores[i] && used < size; i++) {
        used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? ", " : "",
                                 kvpi_stores[i]->schemes[0]);
        bare |= kvpi_stores[i]->bare;
    }
    if (bare && used < size) snprintf(buf + used, size - used, ", host:port");
}

static kvp_status open_store(kvpi_meta *m, const char *conn)
{
    m->ops = kvpi_store_lookup(conn);
    if (!m->ops) {
        char expected[128];
        expected_conns(expected, sizeof expected);
        return kvpi_error(KVP_EINVAL,
                          "unknown metadata connection string '%s' (expected %s or " KVPI_P2P_CONN
                          ")",
                          m->conn, expected);
    }
    /* The connection string is not repeated: it may hold a password. */
    if (!m->ops->open)
        return kvpi_error(KVP_ENOTSUP,
                          "the %s metadata store is not built in: reconfigure kvpipe with -D%s=ON "
                          "(needs %s)",
                          m->ops->name, m->ops->option, m->ops->needs);
    kvp_status st = m->ops->open(conn, m->timeout_ms, &m->store);
    if (st == KVP_OK || st == KVP_ENOMEM) return st;
    if (strstr(kvp_last_error(), conn)) return KVP_EMETADATA; /* the detail names it already */
    char prefix[512];
    snprintf(prefix, sizeof prefix, "cannot open %s metadata store %s", m->ops->name, m->conn);
    return wrap(KVP_EMETADATA, prefix);
}

/* "p2phandshake" would be taken as an etcd host: say so rather than trying. */
static kvp_status check_p2p_spelling(const char *conn)
{
    if (strcasecmp(conn, KVPI_P2P_CONN) != 0 || strcmp(conn, KVPI_P2P_CONN) == 0) return KVP_OK;
    return kvpi_error(KVP_EINVAL,
                      "metadata connection string '%s' would name an etcd host (a string "
                      "without '://' lists etcd endpoints, as in Mooncake); did you mean "
                      "'" KVPI_P2P_CONN "'? It must be written in upper case",
                      conn);
}

kvp_status kvpi_meta_open(const char *conn, int timeout_ms, kvpi_rpc_desc_fn desc_fn,
                          void *desc_ctx, kvpi_meta **out)
{
    if (!conn || !*conn) return kvpi_error(KVP_EINVAL, "empty metadata connection string");
    if (!out) return kvpi_error(KVP_EINVAL, "kvpi_meta_open: out is NULL");
    kvp_status st = check_p2p_spelling(conn);
    if (st) return st;
    kvpi_meta *m = calloc(1, sizeof *m);
    if (!m || !(m->conn = mask_credentials(conn))) {
        free(m);
        return kvpi_error(KVP_ENOMEM, "out of memory");
    }
    m->timeout_ms = timeout_ms > 0 ? timeout_ms : KVPI_DEFAULT_TIMEOUT_MS;
    m->desc_fn = desc_fn;
    m->desc_ctx = desc_ctx;
    if (strcmp(conn, KVPI_P2P_CONN) != 0) {
        st = open_store(m, conn);
        if (st) {
            free(m->conn);
            free(m);
            return st;
        }
    }
    *out = m;
    return KVP_OK;
}

void kvpi_meta_close(kvpi_meta *meta)
{
    if (!meta) return;
    if (meta->ops) meta->ops->close(meta->store);
    free(meta->conn);
    free(meta);
}

int kvpi_meta_is_p2p(const kvpi_meta *meta)
{
    return meta && !meta->ops;
}

void kvpi_meta_set_auth(kvpi_meta *meta, const kvpi_auth *auth, int max_age_ms)
{
    meta->auth = auth;
    meta->auth_max_age_ms = max_age_ms;
}

char *kvpi_meta_key(const char *kind, const char *segment)
{
    const char *cluster = getenv("MC_METADATA_CLUSTER_ID");
    size_t clen = cluster ? strlen(cluster) : 0;
    /* Mooncake adds the '/' after the cluster id only when it lacks one. */
    const char *csep = clen && cluster[clen - 1] != '/' ? "/" : "";
    /* Mooncake's getFullMetadataKey: a descriptor of a name with a '/' in it
     * lives at the name itself, below the prefix. */
    int bare = strcmp(kind, "ram") == 0 && strchr(segment, '/');
    size_t n = strlen("mooncake/") + clen + 1 + strlen(kind) + 1 + strlen(segment) + 1;
    char *key = malloc(n);
    if (!key) return NULL;
    snprintf(key, n, "mooncake/%s%s%s%s%s", clen ? cluster : "", csep, bare ? "" : kind,
             bare ? "" : "/", segment);
    return key;
}

static kvp_status check_segment(const char *segment)
{
    if (!segment || !*segment) return kvpi_error(KVP_EINVAL, "empty segment name");
    return KVP_OK;
}

static char *rpc_meta_json(const char *host, int port)
{
    cJSON *o = cJSON_CreateObject();
    char *text = NULL;
    if (o && cJSON_AddStringToObject(o, "ip_or_host_name", host) &&
        cJSON_AddNumberToObject(o, "rpc_port", port))
        text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return text;
}

/* ---- one key ---- */

static kvp_status put_kind(kvpi_meta *m, const char *kind, const char *segment, const char *value)
{
    char *key = kvpi_meta_key(kind, segment);
    char *text = NULL;
    if (key && m->ops->newline_values && (text = malloc(strlen(value) + 2)))
        snprintf(text, strlen(value) + 2, "%s\n", value);
    kvp_status st = !key || (m->ops->newline_values && !text)
                        ? kvpi_error(KVP_ENOMEM, "out of memory")
                        : m->ops->put(m->store, key, text ? text : value);
    free(text);
    free(key);
    return st;
}

static kvp_status del_kind(kvpi_meta *m, const char *kind, const char *segment)
{
    char *key = kvpi_meta_key(kind, segment);
    if (!key) return kvpi_error(KVP_ENOMEM, "out of memory");
    kvp_status st = m->ops->del(m->store, key);
    free(key);
    return st;
}

static kvp_status get_kind(kvpi_meta *m, const char *kind, const char *segment, char **value)
{
    char *key = kvpi_meta_key(kind, segment);
    if (!key) return kvpi_error(KVP_ENOMEM, "out of memory");
    kvp_status st = m->ops->get(m->store, key, value);
    free(key);
    return st;
}

kvp_status kvpi_rpc_meta_parse(const char *text, char host[KVPI_HOST_MAX], int *port)
{
    cJSON *o = cJSON_Parse(text);
    const char *why = NULL;
    cJSON *h = cJSON_GetObjectItemCaseSensitive(o, "ip_or_host_name");
    cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "rpc_port");
    if (!cJSON_IsObject(o))
        why = "not a JSON object";
    else if (!cJSON_IsString(h) || !*h->valuestring)
        why = "'ip_or_host_name' is not a non-empty string";
    else if (!cJSON_IsNumber(p) || p->valuedouble != floor(p->valuedouble) || p->valuedouble < 0 ||
             p->valuedouble > 65535)
        why = "'rpc_port' is not an integer in 0..65535";
    else if (strlen(h->valuestring) >= KVPI_HOST_MAX)
        why = "'ip_or_host_name' is too long";
    if (!why) {
        snprintf(host, KVPI_HOST_MAX, "%s", h->valuestring);
        *port = (int)p->valuedouble;
    }
    cJSON_Delete(o);
    return why ? kvpi_error(KVP_EPROTO, "%s", why) : KVP_OK;
}

/* Validate rpc_meta text and take its host (malloc'ed). */
static kvp_status parse_rpc_meta(kvpi_meta *m, const char *segment, const char *text, char **host)
{
    char h[KVPI_HOST_MAX];
    int port;
    if (kvpi_rpc_meta_parse(text, h, &port) != KVP_OK) {
        char prefix[512];
        snprintf(prefix, sizeof prefix, "rpc_meta of segment '%.200s' in %.200s", segment, m->conn);
        return wrap(KVP_EPROTO, prefix);
    }
    *host = strdup(h);
    return *host ? KVP_OK : kvpi_error(KVP_ENOMEM, "out of memory");
}

/* No rpc_meta (a writer that only publishes descriptors): the segment name is
 * host:port by convention, so its host part is where the peer listens. */
static kvp_status host_of_name(const char *segment, char **host)
{
    kvpi_hostport hp;
    if (kvpi_hostport_parse(segment, 0, &hp) != KVP_OK)
        return kvpi_error(KVP_EPROTO, "segment '%s' has no rpc_meta and its name is not host:port",
                          segment);
    *host = strdup(hp.host);
    return *host ? KVP_OK : kvpi_error(KVP_ENOMEM, "out of memory");
}

/* A segment's descriptor and rpc_meta: in one round trip where the store can
 * (get_many), else one after the other. KVP_ENOTFOUND for either missing. */
static kvp_status get_both(kvpi_meta *m, const char *segment, char **d, char **rpc,
                           kvp_status *rpc_st)
{
    if (!m->ops->get_many) {
        kvp_status st = get_kind(m, "ram", segment, d);
        if (!st) *rpc_st = get_kind(m, "rpc_meta", segment, rpc);
        return st;
    }
    char *keys[2] = {kvpi_meta_key("ram", segment), kvpi_meta_key("rpc_meta", segment)};
    char *values[2] = {NULL, NULL};
    kvp_status st = keys[0] && keys[1]
                        ? m->ops->get_many(m->store, (const char *const *)keys, 2, values)
                        : kvpi_error(KVP_ENOMEM, "out of memory");
    free(keys[0]);
    free(keys[1]);
    if (st) return st;
    *d = values[0];
    *rpc = values[1];
    *rpc_st = values[1] ? KVP_OK : KVP_ENOTFOUND;
    return values[0] ? KVP_OK : KVP_ENOTFOUND;
}

static kvp_status fetch_store(kvpi_meta *m, const char *segment, char **desc, char **host)
{
    char *d = NULL, *rpc = NULL, *h = NULL;
    kvp_status rpc_st = KVP_ENOTFOUND;
    kvp_status st = get_both(m, segment, &d, &rpc, &rpc_st);
    if (st == KVP_ENOTFOUND)
        st = kvpi_error(KVP_ENOTFOUND, "segment '%s' is not registered in %s", segment, m->conn);
    if (st) goto out;
    st = rpc_st;
    if (st == KVP_ENOTFOUND)
        st = host_of_name(segment, &h);
    else if (st == KVP_OK)
        st = parse_rpc_meta(m, segment, rpc, &h);
    if (st) goto out;
    *desc = d;
    *host = h;
    d = NULL;
out:
    free(d);
    free(rpc);
    return st;
}

static kvp_status fetch_p2p(kvpi_meta *m, const char *segment, char **desc, char **host)
{
    kvpi_hostport hp;
    if (kvpi_hostport_parse(segment, -1, &hp) != KVP_OK)
        return kvpi_error(KVP_EINVAL,
                          "segment name '%s' must be host:port in " KVPI_P2P_CONN " mode", segment);
    char *h = strdup(hp.host);
    if (!h) return kvpi_error(KVP_ENOMEM, "out of memory");
    char *reply = NULL;
    char *own = m->desc_fn ? m->desc_fn(m->desc_ctx) : NULL;
    kvp_status st = kvpi_rpc_call_auth(hp.host, hp.port, m->auth, KVPI_RPC_METADATA,
                                       own ? own : "{}", m->timeout_ms, &reply);
    free(own);
    if (st) {
        free(h);
        char prefix[300];
        snprintf(prefix, sizeof prefix, "segment '%.200s'", segment);
        return wrap(st, prefix);
    }
    *desc = reply;
    *host = h;
    return KVP_OK;
}

kvp_status kvpi_meta_fetch(kvpi_meta *meta, const char *segment, char **desc_json, char **rpc_host)
{
    if (!meta || !desc_json || !rpc_host)
        return kvpi_error(KVP_EINVAL, "kvpi_meta_fetch: meta, desc_json and rpc_host are required");
    kvp_status st = check_segment(segment);
    if (st) return st;
    if (!meta->ops) return fetch_p2p(meta, segment, desc_json, rpc_host);
    return fetch_store(meta, segment, desc_json, rpc_host);
}

kvp_status kvpi_meta_call(kvpi_meta *meta, const char *segment, int type, const char *json,
                          char **reply)
{
    if (!meta || !json || !reply)
        return kvpi_error(KVP_EINVAL, "kvpi_meta_call: meta, json and reply are required");
    kvp_status st = check_segment(segment);
    if (st) return st;
    char host[KVPI_HOST_MAX];
    int port;
    char *rpc = NULL;
    if (meta->ops) st = get_kind(meta, "rpc_meta", segment, &rpc);
    if (!meta->ops || st == KVP_ENOTFOUND) {
        /* P2P mode, or a writer that publishes no rpc_meta: the name is
         * host:port by convention, the port the handshake port. */
        kvpi_hostport hp;
        if (kvpi_hostport_parse(segment, -1, &hp) != KVP_OK)
            return kvpi_error(meta->ops ? KVP_ENOTFOUND : KVP_EINVAL,
                              meta->ops ? "segment '%s' has no rpc_meta and its name is not "
                                          "host:port"
                                        : "segment name '%s' must be host:port in " KVPI_P2P_CONN
                                          " mode",
                              segment);
        snprintf(host, sizeof host, "%s", hp.host);
        port = hp.port;
    } else {
        if (st) return st;
        st = kvpi_rpc_meta_parse(rpc, host, &port);
        free(rpc);
        if (st) {
            char prefix[512];
            snprintf(prefix, sizeof prefix, "rpc_meta of segment '%.200s' in %.200s", segment,
                     meta->conn);
            return wrap(st, prefix);
        }
    }
    st = kvpi_rpc_call_auth(host, port, meta->auth, type, json, meta->timeout_ms, reply);
    if (st) {
        char prefix[300];
        snprintf(prefix, sizeof prefix, "segment '%.200s'", segment);
        return wrap(st, prefix);
    }
    return KVP_OK;
}

/* ---- an engine's own keys: claim, publish, repair, release ---- */

char *kvpi_meta_instance_of(const char *desc_json)
{
    cJSON *d = desc_json ? cJSON_Parse(desc_json) : NULL;
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(d, KVPI_INSTANCE_FIELD);
    char *out = cJSON_IsString(id) ? strdup(id->valuestring) : NULL;
    cJSON_Delete(d);
    return out;
}

/* 1 if desc_json is the descriptor of this instance. */
static int is_own_desc(const char *desc_json, const char *instance)
{
    char *id = kvpi_meta_instance_of(desc_json);
    int own = id && strcmp(id, instance) == 0;
    free(id);
    return own;
}

/* 1 if rpc_meta text is self's address. */
static int is_own_rpc(const char *text, const kvpi_meta_self *self)
{
    char host[KVPI_HOST_MAX];
    int port;
    return kvpi_rpc_meta_parse(text, host, &port) == KVP_OK && strcmp(host, self->rpc_host) == 0 &&
           port == self->rpc_port;
}

kvpi_meta_owner kvpi_meta_judge_owner(kvp_status st, const char *reply, const char *segment,
                                      const char *instance)
{
    if (st != KVP_OK) return KVPI_OWNER_GONE;
    cJSON *d = reply ? cJSON_Parse(reply) : NULL;
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(d, "name");
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(d, KVPI_INSTANCE_FIELD);
    kvpi_meta_owner owner;
    if (!d || (!cJSON_IsNull(d) && !cJSON_IsObject(d)))
        owner = KVPI_OWNER_GONE; /* whatever answers there is no engine */
    else if (!cJSON_IsString(name))
        owner = KVPI_OWNER_LIVE; /* an engine that does not say its name */
    else if (strcmp(name->valuestring, segment) != 0)
        owner = KVPI_OWNER_ELSE;
    else if (cJSON_IsString(id) && instance && strcmp(id->valuestring, instance) == 0)
        owner = KVPI_OWNER_SELF;
    else
        owner = KVPI_OWNER_LIVE;
    cJSON_Delete(d);
    return owner;
}

static kvp_status check_self(const kvpi_meta *m, const kvpi_meta_self *self, const char *what)
{
    if (!m || !self || !self->desc_json || !self->rpc_host || !*self->rpc_host || !self->instance ||
        self->rpc_port < 0 || self->rpc_port > 65535)
        return kvpi_error(KVP_EINVAL,
                          "%s: meta, descriptor, instance, rpc host and a port in 0..65535 are "
                          "required",
                          what);
    return check_segment(self->segment);
}

static kvp_status put_rpc_meta(kvpi_meta *m, const kvpi_meta_self *self)
{
    char *rpc = rpc_meta_json(self->rpc_host, self->rpc_port);
    if (!rpc) return kvpi_error(KVP_ENOMEM, "out of memory");
    kvp_status st = put_kind(m, "rpc_meta", self->segment, rpc);
    free(rpc);
    return st;
}

/* Ask the engine at a stale-looking rpc_meta who it is. */
static kvpi_meta_owner probe_owner(kvpi_meta *m, const kvpi_meta_self *self, const char *rpc,
                                   char *where, size_t where_len)
{
    char host[KVPI_HOST_MAX];
    int port;
    if (kvpi_rpc_meta_parse(rpc, host, &port) != KVP_OK) {
        snprintf(where, where_len, "a malformed rpc_meta (%s)", kvp_last_error());
        return KVPI_OWNER_GONE; /* it holds no address anyone could use */
    }
    char *reply = NULL;
    kvp_status st = kvpi_rpc_call_auth(host, port, m->auth, KVPI_RPC_METADATA, self->desc_json,
                                       m->timeout_ms, &reply);
    /* Authenticated, whatever answers there without proving the key holds no
     * name (an attacker's rpc_meta must not keep the real engine out): gone. */
    kvpi_meta_owner owner = kvpi_meta_judge_owner(st, reply, self->segment, self->instance);
    char *id = owner == KVPI_OWNER_LIVE ? kvpi_meta_instance_of(reply) : NULL;
    char hp[KVPI_HOST_MAX + 8];
    kvpi_hostport_format(host, port, hp, sizeof hp);
    if (st == KVP_EAUTH)
        snprintf(where, where_len,
                 "%s, where something answers that does not prove the key, so holds no name "
                 "(%.200s)",
                 hp, kvp_last_error());
    else if (st)
        snprintf(where, where_len, "%s, where no engine answers (%.200s)", hp, kvp_last_error());
    else if (owner == KVPI_OWNER_LIVE)
        snprintf(where, where_len, "%s, where an engine of this name answers (%s%.64s)", hp,
                 id ? "instance " : "one that does not say its instance, as Mooncake's",
                 id ? id : "");
    else
        snprintf(where, where_len, "%s, which now answers as %s", hp,
                 owner == KVPI_OWNER_SELF ? "this engine" : "another segment");
    free(id);
    free(reply);
    return owner;
}

/* A claim failed half-way: delete the key it wrote, keeping the failure's
 * message. */
static void undo(kvpi_meta *m, const char *kind, const char *segment)
{
    kvpi_error_kept detail = kvpi_error_keep();
    if (del_kind(m, kind, segment) != KVP_OK)
        KVPI_INFO("segment %s: cannot remove its %s again: %s", segment, kind, kvp_last_error());
    kvpi_error(KVP_OK, "%s", detail.text);
}

/* The name's keys are stale: replace them, the descriptor first. */
static kvp_status take_over(kvpi_meta *m, const kvpi_meta_self *self, const char *rpc,
                            const char *where)
{
    KVPI_INFO("segment %s: taking the name over from a dead engine: its rpc_meta in %s pointed "
              "at %s",
              self->segment, m->conn, where);
    kvp_status st = put_kind(m, "ram", self->segment, self->desc_json);
    if (st || is_own_rpc(rpc, self)) return st;
    st = put_rpc_meta(m, self);
    if (st == KVP_EBUSY) {
        /* The store refuses to overwrite rpc_meta (Mooncake's HTTP servers):
         * the key is proven stale, so it is deleted and written anew. */
        st = del_kind(m, "rpc_meta", self->segment);
        if (!st) st = put_rpc_meta(m, self);
    }
    if (st) undo(m, "ram", self->segment);
    return st;
}

kvp_status kvpi_meta_claim(kvpi_meta *meta, const kvpi_meta_self *self)
{
    if (meta && !meta->ops) return KVP_OK;
    kvp_status st = check_self(meta, self, "kvpi_meta_claim");
    if (st) return st;
    /* Twice: another engine may write the key between our look and our write. */
    for (int attempt = 0; attempt < 2; attempt++) {
        char *rpc = NULL;
        st = get_kind(meta, "rpc_meta", self->segment, &rpc);
        if (st == KVP_ENOTFOUND) {
            st = put_rpc_meta(meta, self);
            if (st == KVP_EBUSY) continue;
            if (st || (st = put_kind(meta, "ram", self->segment, self->desc_json)) == KVP_OK)
                return st;
            undo(meta, "rpc_meta", self->segment);
            return st;
        }
        if (st) return st;
        char where[700];
        kvpi_meta_owner owner = probe_owner(meta, self, rpc, where, sizeof where);
        if (owner == KVPI_OWNER_LIVE)
            st = kvpi_error(KVP_EBUSY,
                            "segment name '%s' is in use: its rpc_meta in %s points at %s; stop "
                            "that engine or choose another local_server_name",
                            self->segment, meta->conn, where);
        else
            st = take_over(meta, self, rpc, where);
        free(rpc);
        return st;
    }
    return kvpi_error(KVP_EBUSY,
                      "segment name '%s': its rpc_meta in %s keeps changing; is "
                      "another engine starting with this name?",
                      self->segment, meta->conn);
}

kvp_status kvpi_meta_publish(kvpi_meta *meta, const char *segment, const char *desc_json)
{
    if (!meta) return kvpi_error(KVP_EINVAL, "kvpi_meta_publish: meta is NULL");
    if (!meta->ops) return KVP_OK; /* P2P: peers ask this process directly */
    kvp_status st = check_segment(segment);
    if (st) return st;
    if (!desc_json)
        return kvpi_error(KVP_EINVAL, "publish of segment '%s': no descriptor", segment);
    return put_kind(meta, "ram", segment, desc_json);
}

/* text without the trailing whitespace a store's writer may add equals want. */
static int same_text(const char *text, const char *want)
{
    size_t n = strlen(text), w = strlen(want);
    while (n > w && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' '))
        n--;
    return n == w && memcmp(text, want, n) == 0;
}

/* Look a key up; a missing one is not an error (*value stays NULL). */
static kvp_status get_optional(kvpi_meta *m, const char *kind, const char *segment, char **value)
{
    *value = NULL;
    kvp_status st = get_kind(m, kind, segment, value);
    return st == KVP_ENOTFOUND ? KVP_OK : st;
}

kvp_status kvpi_meta_check(kvpi_meta *meta, const kvpi_meta_self *self, kvpi_meta_lost *lost)
{
    *lost = (kvpi_meta_lost){0};
    if (meta && !meta->ops) return KVP_OK;
    kvp_status st = check_self(meta, self, "kvpi_meta_check");
    if (st) return st;
    char *ram = NULL, *rpc = NULL;
    if ((st = get_optional(meta, "ram", self->segment, &ram)) ||
        (st = get_optional(meta, "rpc_meta", self->segment, &rpc)))
        goto out;
    /* Authenticated: only a descriptor signed with the key belongs to anyone;
     * anything else under our name was written by someone without it. */
    if (meta->auth && ram && !is_own_desc(ram, self->instance) &&
        kvpi_auth_desc_verify(meta->auth, ram, self->segment, meta->auth_max_age_ms) != KVP_OK)
        lost->forged = 1;
    if (meta->auth && rpc && !is_own_rpc(rpc, self) &&
        (!ram || lost->forged || is_own_desc(ram, self->instance)))
        lost->rpc_foreign = 1;
    if ((ram && !lost->forged && !is_own_desc(ram, self->instance)) ||
        (rpc && !lost->rpc_foreign && !is_own_rpc(rpc, self))) {
        st = kvpi_error(KVP_EBUSY,
                        "segment %s: its keys in %s now belong to another engine (%s); this "
                        "engine no longer publishes them",
                        self->segment, meta->conn,
                        ram && !is_own_desc(ram, self->instance) ? "another descriptor"
                                                                 : "rpc_meta points elsewhere");
        goto out;
    }
    lost->rpc_meta = !rpc || lost->rpc_foreign;
    lost->descriptor = !ram || lost->forged || !same_text(ram, self->desc_json);
out:
    free(ram);
    free(rpc);
    return st;
}

kvp_status kvpi_meta_restore(kvpi_meta *meta, const kvpi_meta_self *self,
                             const kvpi_meta_lost *lost)
{
    if (meta && !meta->ops) return KVP_OK;
    kvp_status st = check_self(meta, self, "kvpi_meta_restore");
    /* Over a forgery the descriptor goes first, as in a take-over: a reader
     * of a foreign rpc_meta then finds this engine's descriptor at once. A
     * foreign rpc_meta is deleted before it is written (a store may refuse
     * to overwrite one). */
    int desc_first = lost->forged && lost->descriptor;
    if (!st && desc_first) st = put_kind(meta, "ram", self->segment, self->desc_json);
    if (!st && lost->rpc_foreign) st = del_kind(meta, "rpc_meta", self->segment);
    if (!st && lost->rpc_meta) st = put_rpc_meta(meta, self);
    if (desc_first) return st;
    if (!st && lost->descriptor) st = put_kind(meta, "ram", self->segment, self->desc_json);
    return st;
}

kvp_status kvpi_meta_repair(kvpi_meta *meta, const kvpi_meta_self *self)
{
    kvpi_meta_lost lost;
    kvp_status st = kvpi_meta_check(meta, self, &lost);
    return st ? st : kvpi_meta_restore(meta, self, &lost);
}

kvp_status kvpi_meta_release(kvpi_meta *meta, const kvpi_meta_self *self)
{
    if (meta && !meta->ops) return KVP_OK;
    kvp_status st = check_self(meta, self, "kvpi_meta_release");
    if (st) return st;
    char *ram = NULL, *rpc = NULL;
    if ((st = get_optional(meta, "ram", self->segment, &ram))) return st;
    if (ram && !is_own_desc(ram, self->instance)) {
        KVPI_INFO("segment %s: leaving its keys in %s alone: another engine has written them",
                  self->segment, meta->conn);
        free(ram);
        return KVP_OK;
    }
    /* The descriptor first, so no reader finds it without its rpc_meta. */
    if (ram) st = del_kind(meta, "ram", self->segment);
    if (!st) st = get_optional(meta, "rpc_meta", self->segment, &rpc);
    if (!st && rpc && is_own_rpc(rpc, self)) st = del_kind(meta, "rpc_meta", self->segment);
    free(ram);
    free(rpc);
    return st;
}

/* ---- following the store: kvpi_meta_watch ---- */

#define WATCH_BACKOFF_MIN_MS 100
#define WATCH_BACKOFF_MAX_MS 2000

struct kvpi_meta_watch {
    kvpi_meta *meta;
    char *prefix; /* "mooncake/[CLUSTER/]" */
    int poll_ms;
    kvpi_meta_change_fn changed;
    void *ctx;
    int stop_fd; /* eventfd: readable once the watch is to stop */
    atomic_int state;
    pthread_t thread;
};

static int watch_stopping(const kvpi_meta_watch *w)
{
    struct pollfd p = {.fd = w->stop_fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

/* Sleep ms, or less when stopped; 1 if stopped. */
static int watch_sleep(const kvpi_meta_watch *w, int ms)
{
    struct pollfd p = {.fd = w->stop_fd, .events = POLLIN};
    int rc;
    uint64_t deadline = kvpi_deadline_ns(ms);
    while ((rc = poll(&p, 1, kvpi_remaining_ms(deadline))) < 0 && errno == EINTR) {
    }
    return rc > 0;
}

/* A key under the prefix: the segment(s) it belongs to (kvpi_meta_key's
 * layout read backwards). "ram/x" is segment x's descriptor, or the
 * descriptor of a segment named "ram/x": both are told. */
static void watch_key(void *arg, const char *key)
{
    kvpi_meta_watch *w = arg;
    if (!key) {
        atomic_store(&w->state, KVPI_WATCH_STREAMING);
        w->changed(w->ctx, NULL);
        return;
    }
    size_t n = strlen(w->prefix);
    if (strncmp(key, w->prefix, n) != 0) return;
    const char *rest = key + n;
    if (strncmp(rest, "ram/", 4) == 0 && rest[4])
        w->changed(w->ctx, rest + 4);
    else if (strncmp(rest, "rpc_meta/", 9) == 0 && rest[9])
        w->changed(w->ctx, rest + 9);
    if (strchr(rest, '/')) w->changed(w->ctx, rest);
}

static void *watch_main(void *arg)
{
    kvpi_meta_watch *w = arg;
    kvpi_meta *m = w->meta;
    int backoff = WATCH_BACKOFF_MIN_MS;
    kvp_status last = KVP_OK;
    while (!watch_stopping(w)) {
        if (m->ops->watch && atomic_load(&w->state) != KVPI_WATCH_POLLING) {
            int was = atomic_load(&w->state);
            kvp_status st = m->ops->watch(m->store, w->prefix, w->stop_fd, watch_key, w);
            if (watch_stopping(w)) break;
            if (st == KVP_ENOTSUP) {
                KVPI_WARN("metadata store %s cannot be watched (%s): polling the descriptors "
                          "this engine uses every %d ms instead",
                          m->conn, kvp_last_error(), w->poll_ms);
                atomic_store(&w->state, KVPI_WATCH_POLLING);
                continue;
            }
            if (atomic_load(&w->state) == KVPI_WATCH_STREAMING || was == KVPI_WATCH_STREAMING)
                backoff = WATCH_BACKOFF_MIN_MS; /* it had worked: start over */
            atomic_store(&w->state, KVPI_WATCH_BROKEN);
            if (st != last)
                KVPI_WARN("metadata store %s: watch: %s; reconnecting (cached descriptors are "
                          "revalidated meanwhile)",
                          m->conn, st ? kvp_last_error() : "the stream ended");
            last = st;
            /* Changes may be missed while the stream is down. */
            w->changed(w->ctx, NULL);
            if (watch_sleep(w, backoff)) break;
            backoff = backoff * 2 > WATCH_BACKOFF_MAX_MS ? WATCH_BACKOFF_MAX_MS : backoff * 2;
        } else {
            if (!m->ops->watch && atomic_load(&w->state) != KVPI_WATCH_POLLING) {
                KVPI_INFO("metadata store %s (%s) cannot be watched: polling the descriptors "
                          "this engine uses every %d ms",
                          m->conn, m->ops->name, w->poll_ms);
                atomic_store(&w->state, KVPI_WATCH_POLLING);
            }
            if (watch_sleep(w, w->poll_ms)) break;
            w->changed(w->ctx, NULL);
        }
    }
    return NULL;
}

kvp_status kvpi_meta_watch_start(kvpi_meta *meta, int poll_ms, kvpi_meta_change_fn changed,
                                 void *ctx, kvpi_meta_watch **out)
{
    if (!meta || !meta->ops || !changed || !out)
        return kvpi_error(KVP_EINVAL, "kvpi_meta_watch_start: a store, changed and out are "
                                      "required");
    kvpi_meta_watch *w = calloc(1, sizeof *w);
    char *key = kvpi_meta_key("x", "y"); /* "mooncake/[CLUSTER/]x/y" */
    if (!w || !key) {
        free(w);
        free(key);
        return kvpi_error(KVP_ENOMEM, "out of memory");
    }
    key[strlen(key) - 3] = '\0';
    w->prefix = key;
    w->meta = meta;
    w->poll_ms = poll_ms > 0 ? poll_ms : poll_ms < 0 ? -poll_ms : 1000;
    w->changed = changed;
    w->ctx = ctx;
    atomic_init(&w->state, poll_ms < 0 ? KVPI_WATCH_POLLING : KVPI_WATCH_STARTING);
    if (poll_ms < 0)
        KVPI_INFO("metadata store %s: polling the descriptors this engine uses every %d ms "
                  "(asked not to watch)",
                  meta->conn, w->poll_ms);
    w->stop_fd = eventfd(0, EFD_CLOEXEC);
    if (w->stop_fd < 0 || pthread_create(&w->thread, NULL, watch_main, w) != 0) {
        kvp_status st = kvpi_error(KVP_EIO, "metadata watch: cannot start: %s", strerror(errno));
        if (w->stop_fd >= 0) close(w->stop_fd);
        free(w->prefix);
        free(w);
        return st;
    }
    *out = w;
    return KVP_OK;
}

void kvpi_meta_watch_stop(kvpi_meta_watch *w)
{
    if (!w) return;
    if (kvpi_eventfd_signal(w->stop_fd))
        KVPI_WARN("metadata watch: cannot wake its thread: %s", strerror(errno));
    pthread_join(w->thread, NULL);
    close(w->stop_fd);
    free(w->prefix);
    free(w);
}

int kvpi_meta_watch_state(const kvpi_meta_watch *w)
{
    return w ? atomic_load(&w->state) : KVPI_WATCH_STARTING;
}
