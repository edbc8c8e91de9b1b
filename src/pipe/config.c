/* The mooncake JSON config of vLLM's MooncakePipe, and the ports derived from it. */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/error.h"
#include "common/sized.h"
#include "common/net.h"
#include "engine/protocol.h"
#include "kvpipe/pipe.h"
#include "metadata/metadata.h"

#define CONFIG_FILE_MAX (1u << 20)

/* vLLM keeps ports below base + 8 free for other uses, and ZeroMQ sits above. */
#define ZMQ_OFFSET 8
/* Decode's base port shift when prefill_url == decode_url (same node). */
#define SAME_URL_SHIFT 100

static kvp_status check_url(const char *field, const char *value, kvpi_hostport *hp)
{
    if (!value) return kvpi_error(KVP_ECONFIG, "config field '%s' is missing", field);
    if (kvpi_hostport_parse(value, -1, hp) != KVP_OK) {
        return kvpi_error(KVP_ECONFIG, "config field '%s': '%.300s' is not host:port (%s)", field,
                          value, kvp_last_error());
    }
    if (hp->port < 1)
        return kvpi_error(KVP_ECONFIG, "config field '%s': '%.300s' needs a port in 1..65535",
                          field, value);
    return KVP_OK;
}

/* metadata_backend: the name of a store vLLM takes there, else what is. */
static const char *check_backend(const char *s, char *expected, size_t size)
{
    size_t used = 0;
    for (size_t i = 0; kvpi_stores[i]; i++) {
        if (!kvpi_stores[i]->backend) continue;
        if (strcmp(s, kvpi_stores[i]->name) == 0) return NULL;
        if (used < size)
            used += (size_t)snprintf(expected + used, size - used, "%s%s", used ? ", " : "",
                                     kvpi_stores[i]->name);
    }
    return expected;
}

kvp_status kvp_pipe_config_check(const kvp_pipe_config *cfg)
{
    if (!cfg) return kvpi_error(KVP_EINVAL, "config is NULL");
    kvpi_hostport hp;
    kvp_status st = check_url("prefill_url", cfg->prefill_url, &hp);
    if (st) return st;
    if ((st = check_url("decode_url", cfg->decode_url, &hp))) return st;
    if (!cfg->metadata_server)
        return kvpi_error(KVP_ECONFIG, "config field 'metadata_server' is missing");
    if (!cfg->metadata_server[0])
        return kvpi_error(KVP_ECONFIG, "config field 'metadata_server' is empty");
    /* Built as Mooncake builds it, "p2phandshake" would be an etcd host. */
    if (strcasecmp(cfg->metadata_server, KVPI_P2P_CONN) == 0 &&
        strcmp(cfg->metadata_server, KVPI_P2P_CONN) != 0)
        return kvpi_error(KVP_ECONFIG,
                          "config field 'metadata_server': '%s' would name an etcd host (a "
                          "value without '://' is an etcd address, as in Mooncake); did you mean "
                          "'" KVPI_P2P_CONN "'? It must be written in upper case",
                          cfg->metadata_server);
    char backends[64];
    if (cfg->metadata_backend && check_backend(cfg->metadata_backend, backends, sizeof backends))
        return kvpi_error(KVP_ECONFIG, "config field 'metadata_backend': '%.64s' is not one of %s",
                          cfg->metadata_backend, backends);
    if (!cfg->protocol || !cfg->protocol[0])
        return kvpi_error(KVP_ECONFIG, "config field 'protocol' is empty");
    for (const char *p = cfg->protocol; *p; p++) {
        if (islower((unsigned char)*p) || isdigit((unsigned char)*p) || *p == '_') continue;
        char names[128];
        kvpi_protocol_names(names, sizeof names);
        return kvpi_error(KVP_ECONFIG,
                          "config field 'protocol': '%.64s' is not a protocol name (this build "
                          "serves %s)",
                          cfg->protocol, names);
    }
    if (!cfg->device_name) return kvpi_error(KVP_ECONFIG, "config field 'device_name' is NULL");
    return KVP_OK;
}

/* The config's fields, all strings: the JSON name, where it goes, its value
 * when absent (or null), and whether it must be there. */
static const struct {
    const char *name;
    size_t at;
    const char *def;
    int required;
} fields[] = {
    {"prefill_url", offsetof(kvp_pipe_config, prefill_url), NULL, 1},
    {"decode_url", offsetof(kvp_pipe_config, decode_url), NULL, 1},
    {"metadata_server", offsetof(kvp_pipe_config, metadata_server), NULL, 1},
    {"metadata_backend", offsetof(kvp_pipe_config, metadata_backend), NULL, 0},
    {"protocol", offsetof(kvp_pipe_config, protocol), "tcp", 0},
    {"device_name", offsetof(kvp_pipe_config, device_name), "", 0},
    {"auth_key_file", offsetof(kvp_pipe_config, auth_key_file), NULL, 0},
};
#define N_FIELDS (sizeof fields / sizeof fields[0])

static char **field(kvp_pipe_config *cfg, size_t i)
{
    return (char **)((char *)cfg + fields[i].at);
}

static const char *type_name(const cJSON *v)
{
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    if (cJSON_IsNull(v)) return "null";
    return "not a string";
}

/* Copy string field name of root into *out: def when absent (or null, which is
 * how Python's config.get() sees a JSON null), an error when required. */
static kvp_status get_string(const cJSON *root, const char *name, const char *def, int required,
                             char **out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!v || cJSON_IsNull(v)) {
        if (required) return kvpi_error(KVP_ECONFIG, "config field '%s' is missing", name);
        *out = NULL;
        if (def && !(*out = strdup(def))) return kvpi_error(KVP_ENOMEM, "config: out of memory");
        return KVP_OK;
    }
    if (!cJSON_IsString(v))
        return kvpi_error(KVP_ECONFIG, "config field '%s' must be a string, got %s", name,
                          type_name(v));
    if (!(*out = strdup(v->valuestring))) return kvpi_error(KVP_ENOMEM, "config: out of memory");
    return KVP_OK;
}

static kvp_status fill_config(const cJSON *root, kvp_pipe_config *cfg)
{
    if (!cJSON_IsObject(root)) return kvpi_error(KVP_ECONFIG, "config is not a JSON object");
    for (size_t i = 0; i < N_FIELDS; i++) {
        kvp_status st =
            get_string(root, fields[i].name, fields[i].def, fields[i].required, field(cfg, i));
        if (st) return st;
    }
    /* vLLM lower-cases the backend before checking it. */
    for (char *p = cfg->metadata_backend; p && *p; p++)
        *p = (char)tolower((unsigned char)*p);
    return kvp_pipe_config_check(cfg);
}

kvp_status kvp_pipe_config_parse(const char *json, size_t len, kvp_pipe_config **out)
{
    if (!json || !out) return kvpi_error(KVP_EINVAL, "config parse: NULL argument");
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = at && at >= json && at <= json + len ? (long)(at - json) : -1;
        return kvpi_error(KVP_ECONFIG, "config is not valid JSON (error near byte %ld)", off);
    }
    kvp_pipe_config *cfg = calloc(1, sizeof *cfg);
    kvp_status st = cfg ? fill_config(root, cfg) : kvpi_error(KVP_ENOMEM, "config: out of memory");
    cJSON_Delete(root);
    if (st) {
        kvp_pipe_config_free(cfg);
        return st;
    }
    *out = cfg;
    return KVP_OK;
}

static kvp_status read_file(const char *path, char **text, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return kvpi_error(KVP_ECONFIG, "config file '%s': %s", path, strerror(errno));
    char *buf = malloc(CONFIG_FILE_MAX + 1);
    size_t n = buf ? fread(buf, 1, CONFIG_FILE_MAX + 1, f) : 0;
    int err = ferror(f);
    fclose(f);
    if (!buf) return kvpi_error(KVP_ENOMEM, "config: out of memory");
    if (err || n > CONFIG_FILE_MAX) {
        free(buf);
        return kvpi_error(KVP_ECONFIG, "config file '%s': %s", path,
                          err ? "read error" : "larger than 1 MiB");
    }
    *text = buf;
    *len = n;
    return KVP_OK;
}

kvp_status kvp_pipe_config_load(const char *path, kvp_pipe_config **out)
{
    if (!path || !out) return kvpi_error(KVP_EINVAL, "config load: NULL argument");
    char *text = NULL;
    size_t len = 0;
    kvp_status st = read_file(path, &text, &len);
    if (st) return st;
    st = kvp_pipe_config_parse(text, len, out);
    free(text);
    if (st == KVP_ECONFIG) {
        return kvpi_error(st, "%s: %s", path, kvp_last_error());
    }
    return st;
}

kvp_status kvp_pipe_config_load_env(kvp_pipe_config **out)
{
    const char *path = getenv("MOONCAKE_CONFIG_PATH");
    if (!path || !*path)
        return kvpi_error(KVP_ECONFIG, "environment variable MOONCAKE_CONFIG_PATH is not set");
    return kvp_pipe_config_load(path, out);
}

void kvp_pipe_config_free(kvp_pipe_config *cfg)
{
    if (!cfg) return;
    for (size_t i = 0; i < N_FIELDS; i++)
        free(*field(cfg, i));
    free(cfg);
}

kvp_status kvp_pipe_config_metadata_conn(const kvp_pipe_config *cfg, char **out)
{
    kvp_status st = kvp_pipe_config_check(cfg);
    if (st) return st;
    if (!out) return kvpi_error(KVP_EINVAL, "metadata conn: NULL output");
    const char *server = cfg->metadata_server;
    /* Mooncake's rule (buildConnString): P2PHANDSHAKE and anything with a scheme
     * pass unchanged; a bare address gets the backend's scheme, etcd by default. */
    const char *scheme = NULL;
    if (strcmp(server, KVPI_P2P_CONN) != 0 && !strstr(server, "://"))
        scheme = cfg->metadata_backend ? cfg->metadata_backend : kvpi_store_etcd.name;
    size_t len = strlen(server) + (scheme ? strlen(scheme) + 3 : 0) + 1;
    char *conn = malloc(len);
    if (!conn) return kvpi_error(KVP_ENOMEM, "config: out of memory");
    if (scheme)
        snprintf(conn, len, "%s://%s", scheme, server);
    else
        snprintf(conn, len, "%s", server);
    *out = conn;
    return KVP_OK;
}

/* Base ports of both sides, after the same-URL shift. */
static void base_ports(const kvpi_hostport *p, const kvpi_hostport *d, int *pbase, int *dbase)
{
    *pbase = p->port;
    *dbase = d->port;
    if (strcmp(p->host, d->host) == 0 && p->port == d->port) *dbase += SAME_URL_SHIFT;
}

static kvp_status side_ports(const char *field, const kvpi_hostport *hp, int base, int local_rank,
                             int *engine, int *data, int *ack)
{
    long top = (long)base + ZMQ_OFFSET + 2L * local_rank + 2;
    if (top > 65535)
        return kvpi_error(KVP_ECONFIG,
                          "config field '%s': port %d%s with local_rank %d needs port %ld, above "
                          "65535",
                          field, hp->port, base != hp->port ? " (+100: same URL as prefill)" : "",
                          local_rank, top);
    *engine = base + local_rank;
    *data = base + ZMQ_OFFSET + 2 * local_rank + 1;
    *ack = base + ZMQ_OFFSET + 2 * local_rank + 2;
    return KVP_OK;
}

static kvp_status endpoints(const kvp_pipe_config *cfg, int local_rank, int kv_rank,
                            kvp_pipe_endpoints *out);

kvp_status kvp_pipe_config_endpoints_size(const kvp_pipe_config *cfg, int local_rank, int kv_rank,
                                          kvp_pipe_endpoints *out, size_t size)
{
    kvp_pipe_endpoints ep;
    kvp_status st = out ? endpoints(cfg, local_rank, kv_rank, &ep)
                        : kvpi_error(KVP_EINVAL, "endpoints: NULL output");
    if (!st) kvpi_sized_out(out, size, &ep, sizeof ep);
    return st;
}

static kvp_status endpoints(const kvp_pipe_config *cfg, int local_rank, int kv_rank,
                            kvp_pipe_endpoints *out)
{
    kvp_status st = kvp_pipe_config_check(cfg);
    if (st) return st;
    if (!out) return kvpi_error(KVP_EINVAL, "endpoints: NULL output");
    if (kv_rank != 0 && kv_rank != 1)
        return kvpi_error(KVP_EINVAL, "kv_rank %d: must be 0 (prefill) or 1 (decode)", kv_rank);
    if (local_rank < 0 || local_rank > 4096)
        return kvpi_error(KVP_EINVAL, "local_rank %d outside 0..4096", local_rank);
    kvpi_hostport p, d;
    kvpi_hostport_parse(cfg->prefill_url, -1, &p);
    kvpi_hostport_parse(cfg->decode_url, -1, &d);
    int pbase, dbase;
    base_ports(&p, &d, &pbase, &dbase);
    kvp_pipe_endpoints ep;
    memset(&ep, 0, sizeof ep);
    int pe, pdata, pack, de, ddata, dack;
    if ((st = side_ports("prefill_url", &p, pbase, local_rank, &pe, &pdata, &pack))) return st;
    if ((st = side_ports("decode_url", &d, dbase, local_rank, &de, &ddata, &dack))) return st;
    const kvpi_hostport *own = kv_rank == 0 ? &p : &d, *peer = kv_rank == 0 ? &d : &p;
    ep.engine_port = kv_rank == 0 ? pe : de;
    ep.data_port = kv_rank == 0 ? pdata : ddata;
    ep.ack_port = kv_rank == 0 ? pack : dack;
    ep.peer_engine_port = kv_rank == 0 ? de : pe;
    ep.peer_data_port = kv_rank == 0 ? ddata : pdata;
    ep.peer_ack_port = kv_rank == 0 ? dack : pack;
    snprintf(ep.local_host, sizeof ep.local_host, "%s", own->host);
    snprintf(ep.peer_host, sizeof ep.peer_host, "%s", peer->host);
    kvpi_hostport_format(own->host, ep.engine_port, ep.local_segment, sizeof ep.local_segment);
    kvpi_hostport_format(peer->host, ep.peer_engine_port, ep.peer_segment, sizeof ep.peer_segment);
    *out = ep;
    return KVP_OK;
}
