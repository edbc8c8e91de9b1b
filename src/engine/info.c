/* kvp_info: what this build and host offer (include/kvpipe/info.h), and the
 * library's version. Transports are probed by starting their servers as an
 * engine would; stores and components are known at build time (KVP_HAVE_*). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <zmq.h>

#if KVP_HAVE_HTTP || KVP_HAVE_ETCD
#include <curl/curl.h>
#endif
#if KVP_HAVE_REDIS
#include <hiredis/hiredis.h>
#endif
#if KVP_HAVE_HTTP_SERVER
#include <microhttpd.h>
#endif

#include "common/auth.h"
#include "common/error.h"
#include "common/net.h"
#include "common/region.h"
#include "gpu/cuda.h"
#include "kvpipe/info.h"
#include "kvpipe/version.h"
#include "metadata/metadata.h"
#include "transport/transport.h"

#define INFO_PROBE_TIMEOUT_MS 2000
#define INFO_MAX_TRANSPORTS 8
#define INFO_DETAIL_MAX 512

const char *kvp_version(void)
{
    return KVP_VERSION_STRING;
}

unsigned kvp_version_number(void)
{
    return KVP_VERSION_NUMBER;
}

/* Each store's ops table exists in every build, with its facts (metadata.h). */
#define N_STORES KVPI_N_STORES

/* ------------------------------------------------------------ components --- */

enum {
    COMP_KVPIPE,
    COMP_ZMQ,
    COMP_CJSON,
    COMP_XXHASH,
    COMP_CURL,
    COMP_HIREDIS,
    COMP_MHD,
    N_COMPONENTS
};

#define N_MEMORY_KINDS KVPI_N_MEM_KINDS

struct kvp_info {
    kvp_memory_info memory[N_MEMORY_KINDS];
    char memory_detail[N_MEMORY_KINDS][INFO_DETAIL_MAX];
    char memory_transports[N_MEMORY_KINDS][64];
    kvp_transport_info transports[INFO_MAX_TRANSPORTS + 1];
    char details[INFO_MAX_TRANSPORTS + 1][INFO_DETAIL_MAX];
    size_t n_transports;
    kvp_store_info stores[N_STORES + 1];
    char store_detail[N_STORES][INFO_DETAIL_MAX];
    kvp_component_info components[N_COMPONENTS];
    char versions[N_COMPONENTS][32];
    kvp_address_info address;
    kvpi_advert advert;
};

static void set_component(kvp_info *info, int i, const char *name, const char *purpose,
                          int built_in)
{
    kvp_component_info *c = &info->components[i];
    c->name = name;
    c->purpose = purpose;
    c->status = built_in ? KVP_OK : KVP_ENOTSUP;
    c->version = info->versions[i];
}

static void fill_components(kvp_info *info)
{
    set_component(info, COMP_KVPIPE, "kvpipe", "this library", 1);
    snprintf(info->versions[COMP_KVPIPE], sizeof info->versions[0], "%s", kvp_version());

    int major, minor, patch;
    zmq_version(&major, &minor, &patch);
    set_component(info, COMP_ZMQ, "libzmq", "the tensor pipe's control plane (ZeroMQ)", 1);
    snprintf(info->versions[COMP_ZMQ], sizeof info->versions[0], "%d.%d.%d", major, minor, patch);

    set_component(info, COMP_CJSON, "cJSON", "segment descriptors and configs (JSON)", 1);
    snprintf(info->versions[COMP_CJSON], sizeof info->versions[0], "%s", cJSON_Version());

    set_component(info, COMP_XXHASH, "libxxhash",
                  "integrity's digest, XXH3-64 (on: KVPIPE_INTEGRITY=1 or "
                  "kvp_engine_opts.integrity)",
                  1);
    unsigned xv = XXH_versionNumber();
    snprintf(info->versions[COMP_XXHASH], sizeof info->versions[0], "%u.%u.%u", xv / 10000,
             xv / 100 % 100, xv % 100);

    set_component(info, COMP_CURL, "libcurl", "the http and etcd store clients",
                  KVP_HAVE_HTTP || KVP_HAVE_ETCD);
#if KVP_HAVE_HTTP || KVP_HAVE_ETCD
    snprintf(info->versions[COMP_CURL], sizeof info->versions[0], "%s",
             curl_version_info(CURLVERSION_NOW)->version);
#endif

    /* hiredis has no run-time version call: the headers built against. */
    set_component(info, COMP_HIREDIS, "hiredis", "the redis store client", KVP_HAVE_REDIS);
#if KVP_HAVE_REDIS
    snprintf(info->versions[COMP_HIREDIS], sizeof info->versions[0], "%d.%d.%d", HIREDIS_MAJOR,
             HIREDIS_MINOR, HIREDIS_PATCH);
#endif

    set_component(info, COMP_MHD, "libmicrohttpd", "the embedded HTTP metadata server",
                  KVP_HAVE_HTTP_SERVER);
#if KVP_HAVE_HTTP_SERVER
    snprintf(info->versions[COMP_MHD], sizeof info->versions[0], "%s", MHD_get_version());
#endif
}

/* ------------------------------------------------------------ transports --- */

/* Start and stop the transport's server on host, as an engine would. */
static kvp_status probe_transport(const kvpi_transport_ops *ops, const char *host, int timeout_ms)
{
    kvpi_region_table regions;
    kvpi_region_table_init(&regions);
    kvpi_server_ctx ctx = {
        .segment = "kvpipe info", .host = host, .regions = &regions, .timeout_ms = timeout_ms};
    void *srv = NULL;
    kvp_status st = ops->server_start(&ctx, &srv);
    if (st == KVP_OK) ops->server_stop(srv);
    kvpi_region_table_destroy(&regions);
    return st;
}

static void add_transport(kvp_info *info, const char *name, kvp_status st, const char *detail,
                          unsigned caps)
{
    size_t i = info->n_transports++;
    snprintf(info->details[i], INFO_DETAIL_MAX, "%s", st ? detail : "");
    info->transports[i] =
        (kvp_transport_info){.name = name, .status = st, .detail = info->details[i], .caps = caps};
}

static void fill_transports(kvp_info *info, const char *host, int timeout_ms)
{
    for (size_t i = 0; kvpi_transports[i] && info->n_transports < INFO_MAX_TRANSPORTS; i++) {
        const kvpi_transport_ops *ops = kvpi_transports[i];
        kvp_status st = probe_transport(ops, host, timeout_ms);
        add_transport(info, ops->name, st, kvp_last_error(),
                      ops->caps & KVPI_CAP_SAME_HOST ? KVP_TRANSPORT_SAME_HOST : 0);
    }
    /* The protocol Mooncake users configure most; an engine refuses it with
     * KVP_ENOTSUP until a build has a transport of that name. */
    if (!kvpi_transport_lookup("rdma")) {
        char why[160];
        snprintf(why, sizeof why, "not supported in this build (%s)",
                 kvpi_transport_missing("rdma"));
        add_transport(info, "rdma", KVP_ENOTSUP, why, 0);
    }
}

/* ---------------------------------------------------------------- memory --- */

static void fill_memory(kvp_info *info)
{
    for (unsigned k = 0; k < N_MEMORY_KINDS; k++) {
        kvp_mem_kind kind = (kvp_mem_kind)k;
        char *names = info->memory_transports[k];
        size_t used = 0;
        for (size_t i = 0; kvpi_transports[i]; i++)
            if (kvpi_transports[i]->mem_kinds & KVPI_MEM_BIT(kind) &&
                used < sizeof info->memory_transports[k])
                used += (size_t)snprintf(names + used, sizeof info->memory_transports[k] - used,
                                         "%s%s", used ? ", " : "", kvpi_transports[i]->name);
        kvp_status st = KVP_OK;
        char *detail = info->memory_detail[k];
        if (kind == KVP_MEM_HOST) {
            snprintf(detail, INFO_DETAIL_MAX, "CPU memory");
        } else {
            int version = 0, devices = 0;
            st = kvpi_cuda_info(&version, &devices);
            if (st)
                snprintf(detail, INFO_DETAIL_MAX, "%s", kvp_last_error());
            else
                snprintf(detail, INFO_DETAIL_MAX,
                         "CUDA driver %d.%d, %d device%s; staged through pinned host memory, "
                         "or CUDA IPC between kvpipe processes of one host (shm)",
                         version / 1000, version % 1000 / 10, devices, devices == 1 ? "" : "s");
            if (st) st = KVP_ENOTSUP;
        }
        info->memory[k] = (kvp_memory_info){
            .name = kvpi_mem_kind_name(kind), .status = st, .detail = detail, .transports = names};
    }
}

/* ------------------------------------------------------------------ info --- */

kvp_status kvp_info_get(const char *host, int timeout_ms, kvp_info **out)
{
    if (!out) return kvpi_error(KVP_EINVAL, "kvp_info_get: out is NULL");
    kvp_info *info = calloc(1, sizeof *info);
    if (!info) return kvpi_error(KVP_ENOMEM, "kvp_info_get: out of memory");
    fill_transports(info, host ? host : "127.0.0.1",
                    timeout_ms > 0 ? timeout_ms : INFO_PROBE_TIMEOUT_MS);
    for (size_t i = 0; i < N_STORES; i++) {
        const kvpi_store_ops *ops = kvpi_stores[i];
        if (!ops->open)
            snprintf(info->store_detail[i], INFO_DETAIL_MAX, "configure with -D%s=ON (needs %s)",
                     ops->option, ops->needs);
        info->stores[i] = (kvp_store_info){.name = ops->name,
                                           .syntax = ops->syntax,
                                           .status = ops->open ? KVP_OK : KVP_ENOTSUP,
                                           .detail = info->store_detail[i]};
    }
    info->stores[N_STORES] = (kvp_store_info){.name = "p2p",
                                              .syntax = KVPI_P2P_CONN,
                                              .status = KVP_OK,
                                              .detail = "",
                                              .flags = KVP_STORE_PEER_TO_PEER};
    fill_components(info);
    fill_memory(info);
    /* As an engine named 0.0.0.0:port would choose (engine.c, copy_opts). */
    info->address.status = kvpi_advert_choose("0.0.0.0", getenv("MC_TCP_BIND_ADDRESS"),
                                              "env MC_TCP_BIND_ADDRESS", &info->advert);
    info->address.address = info->address.status ? "" : info->advert.host;
    if (info->address.status)
        snprintf(info->advert.why, sizeof info->advert.why, "%s", kvp_last_error());
    info->address.reason = info->advert.why;
    kvpi_error_clear();
    *out = info;
    return KVP_OK;
}

void kvp_info_free(kvp_info *info)
{
    free(info);
}

const kvp_transport_info *kvp_info_transport(const kvp_info *info, size_t i)
{
    return info && i < info->n_transports ? &info->transports[i] : NULL;
}

const kvp_store_info *kvp_info_store(const kvp_info *info, size_t i)
{
    return info && i < N_STORES + 1 ? &info->stores[i] : NULL;
}

const kvp_component_info *kvp_info_component(const kvp_info *info, size_t i)
{
    return info && i < N_COMPONENTS ? &info->components[i] : NULL;
}

const kvp_memory_info *kvp_info_memory(const kvp_info *info, size_t i)
{
    return info && i < N_MEMORY_KINDS ? &info->memory[i] : NULL;
}

const kvp_address_info *kvp_info_address(const kvp_info *info)
{
    return info ? &info->address : NULL;
}

const kvp_store_info *kvp_info_store_for(const kvp_info *info, const char *conn)
{
    if (!info || !conn) return NULL;
    if (strcmp(conn, KVPI_P2P_CONN) == 0) return &info->stores[N_STORES];
    const kvpi_store_ops *ops = kvpi_store_lookup(conn);
    for (size_t i = 0; ops && i < N_STORES; i++)
        if (kvpi_stores[i] == ops) return &info->stores[i];
    return NULL;
}

/* ---------------------------------------------------------------- checks --- */

kvp_status kvp_info_store_check(const char *conn, int timeout_ms)
{
    kvpi_meta *meta;
    kvp_status st = kvpi_meta_open(conn, timeout_ms, NULL, NULL, &meta);
    if (st == KVP_OK) kvpi_meta_close(meta);
    return st;
}

kvp_status kvp_info_segment(const char *conn, const char *segment, int timeout_ms,
                            char **descriptor, char **host)
{
    if (!descriptor || !host)
        return kvpi_error(KVP_EINVAL, "kvp_info_segment: descriptor or host is NULL");
    kvpi_auth *auth = NULL;
    kvp_status st = kvpi_auth_resolve(NULL, &auth);
    if (st) return st;
    kvpi_meta *meta;
    st = kvpi_meta_open(conn, timeout_ms, NULL, NULL, &meta);
    if (st) {
        kvpi_auth_free(auth);
        return st;
    }
    if (auth) kvpi_meta_set_auth(meta, auth, 0);
    char *desc = NULL, *rpc_host = NULL;
    /* A P2P handshake sends our own descriptor; an inspecting tool has none. */
    st = kvpi_meta_fetch(meta, segment, &desc, &rpc_host);
    kvpi_meta_close(meta);
    kvpi_auth_free(auth);
    if (st) return st;
    *descriptor = desc;
    *host = rpc_host;
    return KVP_OK;
}
