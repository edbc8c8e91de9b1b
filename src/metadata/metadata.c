/* The store registry and kvpi_meta: Mooncake's metadata keys on top of a
 * store's get/put/del, or the P2P handshake when there is no store. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "metadata/metadata.h"

#define META_DEFAULT_TIMEOUT_MS 5000

/* Schemed stores first: etcd also accepts a bare "h:p". */
static const kvpi_store_ops *const stores[] = {
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
};

const kvpi_store_ops *kvpi_store_lookup(const char *conn)
{
    if (!conn) return NULL;
    for (size_t i = 0; stores[i]; i++)
        if (stores[i]->accepts(conn)) return stores[i];
    return NULL;
}

/* Prefix the current detail with context, keeping it intact (the detail
 * buffer is also kvpi_error's target, hence the copy). */
static kvp_status wrap(kvp_status st, const char *prefix)
{
    char detail[512];
    snprintf(detail, sizeof detail, "%s", kvp_last_error());
    return kvpi_error(st, "%s: %s", prefix, detail);
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

static kvp_status open_store(kvpi_meta *m, const char *conn)
{
    m->ops = kvpi_store_lookup(conn);
    if (!m->ops)
        return kvpi_error(KVP_EINVAL,
                          "unknown metadata connection string '%s' (expected http://, etcd://, "
                          "redis://, host:port or " KVPI_P2P_CONN ")",
                          m->conn);
    kvp_status st = m->ops->open(conn, m->timeout_ms, &m->store);
    /* A store left out of this build says so itself (store_absent.c). */
    if (st == KVP_OK || st == KVP_ENOMEM || st == KVP_ENOTSUP) return st;
    if (strstr(kvp_last_error(), conn)) return KVP_EMETADATA; /* the detail names it already */
    char prefix[512];
    snprintf(prefix, sizeof prefix, "cannot open %s metadata store %s", m->ops->name, m->conn);
    return wrap(KVP_EMETADATA, prefix);
}

kvp_status kvpi_meta_open(const char *conn, int timeout_ms, kvpi_meta **out)
{
    if (!conn || !*conn) return kvpi_error(KVP_EINVAL, "empty metadata connection string");
    if (!out) return kvpi_error(KVP_EINVAL, "kvpi_meta_open: out is NULL");
    kvpi_meta *m = calloc(1, sizeof *m);
    if (!m || !(m->conn = mask_credentials(conn))) {
        free(m);
        return kvpi_error(KVP_ENOMEM, "out of memory");
    }
    m->timeout_ms = timeout_ms > 0 ? timeout_ms : META_DEFAULT_TIMEOUT_MS;
    if (strcmp(conn, KVPI_P2P_CONN) != 0) {
        kvp_status st = open_store(m, conn);
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

char *kvpi_meta_key(const char *kind, const char *segment)
{
    const char *cluster = getenv("MC_METADATA_CLUSTER_ID");
    int has = cluster && *cluster;
    size_t n = strlen("mooncake/") + (has ? strlen(cluster) + 1 : 0) + strlen(kind) + 1 +
               strlen(segment) + 1;
    char *key = malloc(n);
    if (!key) return NULL;
    if (has)
        snprintf(key, n, "mooncake/%s/%s/%s", cluster, kind, segment);
    else
        snprintf(key, n, "mooncake/%s/%s", kind, segment);
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

/* Put one key; kind names it in the message. */
static kvp_status put_kind(kvpi_meta *m, const char *kind, const char *segment, const char *value)
{
    char *key = kvpi_meta_key(kind, segment);
    if (!key) return kvpi_error(KVP_ENOMEM, "out of memory");
    kvp_status st = m->ops->put(m->store, key, value);
    free(key);
    return st;
}

kvp_status kvpi_meta_publish(kvpi_meta *meta, const char *segment, const char *desc_json,
                             const char *rpc_host, int rpc_port)
{
    if (!meta) return kvpi_error(KVP_EINVAL, "kvpi_meta_publish: meta is NULL");
    if (!meta->ops) return KVP_OK; /* P2P: peers ask this process directly */
    kvp_status st = check_segment(segment);
    if (st) return st;
    if (!desc_json || !rpc_host || !*rpc_host || rpc_port < 0 || rpc_port > 65535)
        return kvpi_error(KVP_EINVAL,
                          "publish of segment '%s': descriptor, rpc host and a port "
                          "in 0..65535 are required",
                          segment);
    char *rpc = rpc_meta_json(rpc_host, rpc_port);
    if (!rpc) return kvpi_error(KVP_ENOMEM, "out of memory");
    /* rpc_meta first: a reader that finds the descriptor then finds its host. */
    st = put_kind(meta, "rpc_meta", segment, rpc);
    if (st == KVP_OK) st = put_kind(meta, "ram", segment, desc_json);
    free(rpc);
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

kvp_status kvpi_meta_remove(kvpi_meta *meta, const char *segment)
{
    if (!meta) return kvpi_error(KVP_EINVAL, "kvpi_meta_remove: meta is NULL");
    if (!meta->ops) return KVP_OK;
    kvp_status st = check_segment(segment);
    if (st) return st;
    /* The descriptor first, so no reader finds it without its rpc_meta. */
    st = del_kind(meta, "ram", segment);
    kvp_status st2 = del_kind(meta, "rpc_meta", segment);
    return st ? st : st2;
}

static kvp_status get_kind(kvpi_meta *m, const char *kind, const char *segment, char **value)
{
    char *key = kvpi_meta_key(kind, segment);
    if (!key) return kvpi_error(KVP_ENOMEM, "out of memory");
    kvp_status st = m->ops->get(m->store, key, value);
    free(key);
    return st;
}

/* Validate rpc_meta text and take its host (malloc'ed). */
static kvp_status parse_rpc_meta(kvpi_meta *m, const char *segment, const char *text, char **host)
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
    char *out = why ? NULL : strdup(h->valuestring);
    cJSON_Delete(o);
    if (why)
        return kvpi_error(KVP_EPROTO, "rpc_meta of segment '%s' in %s: %s", segment, m->conn, why);
    if (!out) return kvpi_error(KVP_ENOMEM, "out of memory");
    *host = out;
    return KVP_OK;
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

static kvp_status fetch_store(kvpi_meta *m, const char *segment, char **desc, char **host)
{
    char *d = NULL, *rpc = NULL, *h = NULL;
    kvp_status st = get_kind(m, "ram", segment, &d);
    if (st == KVP_ENOTFOUND)
        st = kvpi_error(KVP_ENOTFOUND, "segment '%s' is not registered in %s", segment, m->conn);
    if (st) goto out;
    st = get_kind(m, "rpc_meta", segment, &rpc);
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

static kvp_status fetch_p2p(kvpi_meta *m, const char *segment, const char *own, char **desc,
                            char **host)
{
    kvpi_hostport hp;
    if (kvpi_hostport_parse(segment, -1, &hp) != KVP_OK)
        return kvpi_error(KVP_EINVAL,
                          "segment name '%s' must be host:port in " KVPI_P2P_CONN " mode", segment);
    char *h = strdup(hp.host);
    if (!h) return kvpi_error(KVP_ENOMEM, "out of memory");
    char *reply = NULL;
    kvp_status st =
        kvpi_rpc_call(hp.host, hp.port, KVPI_RPC_METADATA, own ? own : "{}", m->timeout_ms, &reply);
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

kvp_status kvpi_meta_fetch(kvpi_meta *meta, const char *segment, const char *own_desc_json,
                           char **desc_json, char **rpc_host)
{
    if (!meta || !desc_json || !rpc_host)
        return kvpi_error(KVP_EINVAL, "kvpi_meta_fetch: meta, desc_json and rpc_host are required");
    kvp_status st = check_segment(segment);
    if (st) return st;
    if (!meta->ops) return fetch_p2p(meta, segment, own_desc_json, desc_json, rpc_host);
    return fetch_store(meta, segment, desc_json, rpc_host);
}
