/* Mooncake's C API (transfer_engine_c.h) on kvpipe's public engine API.
 *
 * This library sees only the headers in include/kvpipe/: it is a client of libkvpipe.so
 * like any program, and exports Mooncake's names alone (libkvpipe_mooncake.map).
 * docs/mooncake-c-api.md is the behaviour, function by function.
 *
 * What Mooncake has that kvpipe's API does not - segment ids, batches of a
 * capacity over several submits, the region table, the notification a
 * status call sends - is compat/mooncake/mooncake_core.h, which the Python
 * module shares: this file only spells it in Mooncake's C signatures and
 * return codes. remote_accessible = 0: kvpipe moves unregistered local
 * memory, so such a region is only remembered (for unregisterLocalMemory and
 * overlap checks) and never published to peers.
 */
#include "transfer_engine_c.h"

#include "mooncake_core.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpipe/engine.h"
#include "kvpipe/log.h"
#include "kvpipe/status.h"

typedef struct mc_engine {
    kvmc_engine *core;
    char transport_token[2]; /* installTransport's non-NULL handles */
    int graceful;
} mc_engine;

/* Lines in kvpipe's stderr style, under kvpipe's log threshold. (A handler set
 * with kvp_log_set_handler does not see them: the public API has no call to
 * log through.) */
__attribute__((format(printf, 2, 3))) static void mc_log(kvp_log_level level, const char *fmt, ...)
{
    if (level > kvp_log_get_level()) return;
    static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s kvpipe mooncake_c: %s\n", names[level], text);
}

static int not_supported(int code, const char *what)
{
    mc_log(KVP_LOG_WARN, "not supported by kvpipe: %s (docs/mooncake-c-api.md)", what);
    return code;
}

/* A failed call's Mooncake code, logged with kvpipe's detail. */
static int logged(int code, kvp_status st, const char *what)
{
    if (code) mc_log(KVP_LOG_WARN, "%s: %s: %s", what, kvp_strerror(st), kvmc_last_error());
    return code;
}

transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                       const char *local_server_name, const char *ip_or_host_name,
                                       uint64_t rpc_port, int auto_discover)
{
    (void)ip_or_host_name;
    (void)rpc_port;
    (void)auto_discover;
    mc_engine *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    /* Stacks written for Mooncake name their transport in code; kvpipe's
     * KVPIPE_PROTOCOL picks it, as for the Python module. */
    kvp_status st = kvmc_create(local_server_name, metadata_conn_string, NULL, NULL, &e->core);
    if (st) {
        mc_log(KVP_LOG_ERROR, "createTransferEngine(%s, %s): %s: %s",
               metadata_conn_string ? metadata_conn_string : "NULL",
               local_server_name ? local_server_name : "NULL", kvp_strerror(st), kvmc_last_error());
        free(e);
        return NULL;
    }
    return e;
}

int discoverTopology(transfer_engine_t engine)
{
    /* kvpipe has no NIC topology to discover: a no-op, as on Mooncake's tcp. */
    return engine ? 0 : KVMC_ERR_INVALID_ARGUMENT;
}

int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len)
{
    mc_engine *e = engine;
    if (!e || !buf_out || !buf_len) return KVMC_ERR_INVALID_ARGUMENT;
    snprintf(buf_out, buf_len, "%s", kvp_engine_segment_name(kvmc_kvp(e->core)));
    return 0;
}

static int is_ucx(const char *proto)
{
    return strcmp(proto, "rdma") == 0 || strcmp(proto, "ucx") == 0;
}

transport_t installTransport(transfer_engine_t engine, const char *proto, void **args)
{
    mc_engine *e = engine;
    if (!e || !proto) return NULL;
    if (args && args[0])
        mc_log(KVP_LOG_INFO,
               "installTransport(%s): the NIC priority matrix is not used by "
               "kvpipe (UCX_NET_DEVICES chooses the devices)",
               proto);
    const char *own = kvmc_protocol(e->core);
    if (strcmp(proto, "tcp") == 0) return &e->transport_token[0];
    if (strcmp(proto, own) == 0 || (is_ucx(proto) && is_ucx(own))) return &e->transport_token[1];
    char what[160];
    snprintf(what, sizeof what,
             "installTransport(\"%s\"): this engine runs \"%s\" (and tcp); set KVPIPE_PROTOCOL "
             "before createTransferEngine to choose rdma or shm",
             proto, own);
    not_supported(0, what);
    return NULL;
}

int uninstallTransport(transfer_engine_t engine, const char *proto)
{
    /* Mooncake's is a no-op too: transports stay until the engine goes. */
    return engine && proto ? 0 : KVMC_ERR_INVALID_ARGUMENT;
}

/* ------------------------------------------------------------ segments --- */

segment_id_t openSegment(transfer_engine_t engine, const char *segment_name)
{
    mc_engine *e = engine;
    if (!e || !segment_name) return -1;
    int32_t id;
    kvp_status st = kvmc_open(e->core, segment_name, &id, NULL);
    if (st) {
        mc_log(KVP_LOG_WARN, "openSegment(%s): %s: %s", segment_name, kvp_strerror(st),
               kvmc_last_error());
        return -1;
    }
    return id;
}

segment_id_t openSegmentNoCache(transfer_engine_t engine, const char *segment_name)
{
    mc_engine *e = engine;
    if (!e || !segment_name) return -1;
    int32_t id;
    kvp_status st = kvmc_probe(e->core, segment_name, &id, NULL);
    if (st == KVP_EINVAL) return -1;
    return st ? logged(kvmc_err(st), st, "openSegmentNoCache") : id;
}

int closeSegment(transfer_engine_t engine, segment_id_t segment_id)
{
    /* As Mooncake: the cached descriptor stays, a no-op. */
    (void)segment_id;
    return engine ? 0 : KVMC_ERR_INVALID_ARGUMENT;
}

int warmupEfaSegment(transfer_engine_t engine, const char *segment_name)
{
    /* No EFA transport in kvpipe: Mooncake's answer on a non-EFA install. */
    (void)engine;
    (void)segment_name;
    return 0;
}

int removeLocalSegment(transfer_engine_t engine, const char *segment_name)
{
    if (!engine || !segment_name) return KVMC_ERR_INVALID_ARGUMENT;
    while (*segment_name == '/')
        segment_name++;
    if (!*segment_name) return KVMC_ERR_INVALID_ARGUMENT;
    return not_supported(KVMC_ERR_NOT_IMPLEMENTED,
                         "removeLocalSegment: the segment stays published until "
                         "destroyTransferEngine");
}

int syncSegmentCache(transfer_engine_t engine)
{
    mc_engine *e = engine;
    if (!e) return KVMC_ERR_INVALID_ARGUMENT;
    kvp_status st = kvmc_probe_all(e->core);
    return logged(kvmc_err(st), st, "syncSegmentCache");
}

/* -------------------------------------------------------------- memory --- */

int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length, const char *location,
                        int remote_accessible)
{
    /* location ("cpu:0", "cuda:0", "*") is not needed: kvpipe asks the
     * memory itself what it is (host, or CUDA device memory). */
    (void)location;
    mc_engine *e = engine;
    if (!e || !addr || !length) return KVMC_ERR_INVALID_ARGUMENT;
    kvmc_rc rc = kvmc_register(e->core, addr, length, remote_accessible);
    return logged(rc.mc, rc.st, "registerLocalMemory");
}

int unregisterLocalMemory(transfer_engine_t engine, void *addr)
{
    mc_engine *e = engine;
    if (!e) return KVMC_ERR_INVALID_ARGUMENT;
    kvmc_rc rc = kvmc_unregister(e->core, addr);
    return rc.mc == KVMC_ERR_ADDRESS_NOT_REGISTERED ? rc.mc
                                                    : logged(rc.mc, rc.st, "unregisterLocalMemory");
}

int registerLocalMemoryBatch(transfer_engine_t engine, buffer_entry_t *buffer_list,
                             size_t buffer_len, const char *location)
{
    (void)location;
    mc_engine *e = engine;
    if (!e || (buffer_len && !buffer_list)) return KVMC_ERR_INVALID_ARGUMENT;
    void **addrs = malloc((buffer_len ? buffer_len : 1) * sizeof *addrs);
    size_t *lens = malloc((buffer_len ? buffer_len : 1) * sizeof *lens);
    int rc = addrs && lens ? 0 : KVMC_ERR_MEMORY;
    for (size_t i = 0; i < buffer_len && !rc; i++) {
        if (!buffer_list[i].addr || !buffer_list[i].length) rc = KVMC_ERR_INVALID_ARGUMENT;
        addrs[i] = buffer_list[i].addr;
        lens[i] = buffer_list[i].length;
    }
    if (!rc) {
        kvmc_rc r = kvmc_register_all(e->core, addrs, lens, buffer_len);
        rc = logged(r.mc, r.st, "registerLocalMemoryBatch");
    }
    free(addrs);
    free(lens);
    return rc;
}

int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list, size_t addr_len)
{
    mc_engine *e = engine;
    if (!e || (addr_len && !addr_list)) return KVMC_ERR_INVALID_ARGUMENT;
    int first = 0;
    for (size_t i = 0; i < addr_len; i++) {
        int rc = unregisterLocalMemory(engine, addr_list[i]);
        if (rc && !first) first = rc;
    }
    return first;
}

/* ------------------------------------------------------------- batches --- */

batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size)
{
    mc_engine *e = engine;
    uint64_t id = e ? kvmc_batch_new(e->core, batch_size) : 0;
    return id ? id : INVALID_BATCH;
}

static int submit(mc_engine *e, batch_id_t batch_id, struct transfer_request *entries, size_t count,
                  const notify_msg_t *notify)
{
    if (!e || (count && !entries)) return kvmc_code(KVMC_ERR_INVALID_ARGUMENT);
    if (notify && (!notify->name || !notify->msg)) return kvmc_code(KVMC_ERR_INVALID_ARGUMENT);
    kvmc_request *reqs = malloc((count ? count : 1) * sizeof *reqs);
    if (!reqs) return kvmc_code(KVMC_ERR_MEMORY);
    for (size_t i = 0; i < count; i++)
        reqs[i] = (kvmc_request){.opcode = entries[i].opcode == OPCODE_READ    ? KVP_OP_READ
                                           : entries[i].opcode == OPCODE_WRITE ? KVP_OP_WRITE
                                                                               : (kvp_opcode)-1,
                                 .local = entries[i].source,
                                 .target = entries[i].target_id,
                                 .remote = entries[i].target_offset,
                                 .length = entries[i].length};
    kvmc_rc rc = kvmc_batch_submit(e->core, batch_id, reqs, count, notify ? notify->name : NULL,
                                   notify ? notify->msg : NULL);
    free(reqs);
    return logged(rc.mc, rc.st, "submitTransfer");
}

int submitTransfer(transfer_engine_t engine, batch_id_t batch_id, struct transfer_request *entries,
                   size_t count)
{
    return submit(engine, batch_id, entries, count, NULL);
}

int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id,
                             struct transfer_request *entries, size_t count,
                             notify_msg_t notify_msg)
{
    return submit(engine, batch_id, entries, count, &notify_msg);
}

int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id, size_t task_id,
                      struct transfer_status *status)
{
    mc_engine *e = engine;
    if (!e || !status) return kvmc_code(KVMC_ERR_INVALID_ARGUMENT);
    kvp_status st;
    uint64_t bytes = 0;
    if (kvmc_task_status(e->core, batch_id, task_id, &st, &bytes))
        return kvmc_code(KVMC_ERR_INVALID_ARGUMENT);
    status->transferred_bytes = st == KVP_OK ? bytes : 0;
    status->status = st == KVP_EINPROGRESS ? STATUS_WAITING
                     : st == KVP_OK        ? STATUS_COMPLETED
                     : st == KVP_ECANCELED ? STATUS_CANCELED
                                           : STATUS_FAILED;
    return 0;
}

int freeBatchID(transfer_engine_t engine, batch_id_t batch_id)
{
    mc_engine *e = engine;
    if (!e) return kvmc_code(KVMC_ERR_INVALID_ARGUMENT);
    return kvmc_batch_free(e->core, batch_id, 0).mc;
}

/* ------------------------------------------------------- notifications --- */

notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size)
{
    mc_engine *e = engine;
    if (size) *size = 0;
    if (!e || !size) return NULL;
    kvp_notify *got;
    size_t n;
    kvp_status st = kvp_engine_get_notifies(kvmc_kvp(e->core), &got, &n);
    if (st) {
        mc_log(KVP_LOG_WARN, "getNotifsFromEngine: %s", kvp_last_error());
        return NULL;
    }
    if (!n) return NULL;
    /* Each string malloc'ed on its own: freeNotifsMsgBuf frees them so. */
    notify_msg_t *out = calloc(n, sizeof *out);
    size_t i = 0;
    if (out)
        for (; i < n; i++)
            if (!(out[i].name = strdup(got[i].name)) || !(out[i].msg = strdup(got[i].msg))) break;
    kvp_engine_notifies_free(got, n);
    if (!out || i < n) {
        mc_log(KVP_LOG_ERROR, "getNotifsFromEngine: out of memory; %zu notifications lost", n);
        if (out) freeNotifsMsgBuf(out, (int)n);
        return NULL;
    }
    *size = (int)n;
    return out;
}

int freeNotifsMsgBuf(notify_msg_t *msg, int size)
{
    if (!msg) return 0;
    for (int i = 0; i < size; i++) {
        free(msg[i].name);
        free(msg[i].msg);
    }
    free(msg);
    return 0;
}

int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id, notify_msg_t notify_msg)
{
    mc_engine *e = engine;
    if (!e || !notify_msg.name || !notify_msg.msg) return KVMC_ERR_INVALID_ARGUMENT;
    kvp_segment_id seg;
    if (target_id > INT32_MAX || kvmc_resolve(e->core, (int64_t)target_id, &seg)) {
        mc_log(KVP_LOG_ERROR, "genNotifyInEngine: invalid segment ID %" PRIu64, target_id);
        return KVMC_ERR_METADATA;
    }
    kvp_status st = kvp_engine_notify(kvmc_kvp(e->core), seg, notify_msg.name, notify_msg.msg);
    return logged(kvmc_err(st), st, "genNotifyInEngine");
}

/* ---------------------------------------------------------------- rest --- */

int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats, size_t *count)
{
    if (!engine || !stats || !count) return -1;
    /* kvpipe keeps no per-NIC load: no NICs to report. */
    *count = 0;
    return 0;
}

void enableGracefulShutdown(transfer_engine_t engine)
{
    mc_engine *e = engine;
    /* Read by destroyTransferEngine, the engine's last call. */
    if (e) e->graceful = 1;
}

/* Append to buf as snprintf would, keeping *used at most cap - 1. */
__attribute__((format(printf, 4, 5))) static void append(char *buf, size_t cap, size_t *used,
                                                         const char *fmt, ...)
{
    if (*used + 1 >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *used, cap - *used, fmt, ap);
    va_end(ap);
    if (n > 0) *used = *used + (size_t)n < cap ? *used + (size_t)n : cap - 1;
}

typedef struct links {
    kvp_engine *kvp;
    char *buf;
    size_t cap, used;
    int json, first;
} links;

static void link_line(void *arg, int32_t id, const char *name)
{
    links *l = arg;
    const char *transport = kvp_engine_segment_transport(l->kvp, (kvp_segment_id)(id - 1));
    if (!transport) transport = "none";
    if (l->json)
        append(l->buf, l->cap, &l->used, "%s{\"id\":%d,\"name\":\"%s\",\"transport\":\"%s\"}",
               l->first ? "" : ",", (int)id, name, transport);
    else
        append(l->buf, l->cap, &l->used, "%d %s %s\n", (int)id, name, transport);
    l->first = 0;
}

int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len, int json)
{
    mc_engine *e = engine;
    if (!e || !buf_out || !buf_len) return -1;
    links l = {kvmc_kvp(e->core), buf_out, buf_len, 0, json, 1};
    buf_out[0] = '\0';
    if (json)
        append(buf_out, buf_len, &l.used, "{\"local\":\"%s\",\"segments\":[",
               kvp_engine_segment_name(l.kvp));
    kvmc_each_segment(e->core, link_line, &l);
    if (json) append(buf_out, buf_len, &l.used, "]}");
    return 0;
}

void destroyTransferEngine(transfer_engine_t engine)
{
    mc_engine *e = engine;
    if (!e) return;
    /* Graceful: what was submitted finishes (each request bounded by the
     * engine's deadlines) before the engine goes; otherwise it is canceled. */
    kvmc_destroy(e->core, e->graceful);
    free(e);
}
