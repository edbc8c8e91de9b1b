/* Mooncake's C API (transfer_engine_c.h) on kvpipe's public engine API.
 *
 * This library sees only the headers in include/kvpipe/: it is a client of libkvpipe.so
 * like any program, and exports Mooncake's names alone (libkvpipe_mooncake.map).
 * docs/mooncake-c-api.md is the behaviour, function by function.
 *
 * What Mooncake has that kvpipe's API does not, and how it is made here:
 *  - segment ids: Mooncake's are int32 with 0 meaning this engine's own
 *    segment; kvpipe's start at 0. Id n > 0 here is kvpipe's n - 1; 0 opens
 *    this engine's own segment by name on first use;
 *  - batches: a Mooncake batch has a capacity, takes several submits, and
 *    each request names its own segment. One batch here is a list of kvpipe
 *    batches ("chunks"), one per run of consecutive requests to one segment;
 *    task ids count across the submits;
 *  - submitTransferWithNotify: as Mooncake, the notification is sent by the
 *    getTransferStatus call that first finds every request of the batch
 *    completed, and only then; a failed request means no notification;
 *  - remote_accessible = 0: kvpipe moves unregistered local memory, so such
 *    a region is only remembered (for unregisterLocalMemory and overlap
 *    checks) and never published to peers.
 */
#include "transfer_engine_c.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpipe/engine.h"
#include "kvpipe/log.h"
#include "kvpipe/status.h"

/* Mooncake's error.h values (negative ints) and Status codes (positive). */
enum {
    MC_ERR_INVALID_ARGUMENT = -1,
    MC_ERR_TOO_MANY_REQUESTS = -2,
    MC_ERR_ADDRESS_NOT_REGISTERED = -3,
    MC_ERR_BATCH_BUSY = -4,
    MC_ERR_ADDRESS_OVERLAPPED = -7,
    MC_ERR_SOCKET = -102,
    MC_ERR_MALFORMED_JSON = -103,
    MC_ERR_REJECT_HANDSHAKE = -104,
    MC_ERR_METADATA = -200,
    MC_ERR_MEMORY = -302,
    MC_ERR_NOT_IMPLEMENTED = -303,
};
#define MC_STATUS_NOT_IMPLEMENTED 999

typedef struct mc_chunk {
    kvp_batch *batch;
    size_t first; /* task id of its first request */
    size_t n;
} mc_chunk;

typedef struct mc_batch {
    uint64_t id;
    size_t capacity;
    size_t count;      /* requests submitted */
    uint64_t *lengths; /* per task, for transferred_bytes */
    size_t cap_lengths;
    mc_chunk *chunks;
    size_t n_chunks, cap_chunks;
    pthread_mutex_t lock;
    /* the notification to send once every request completed */
    char *notify_name, *notify_msg;
    int32_t notify_target;
} mc_batch;

typedef struct mc_region {
    uintptr_t addr;
    size_t length;
    int published; /* registered with kvpipe (remote_accessible) */
} mc_region;

typedef struct mc_engine {
    kvp_engine *kvp;
    char protocol[16];
    char transport_token[2]; /* installTransport's non-NULL handles */

    pthread_mutex_t lock; /* batches and segment names */
    mc_batch **batches;
    size_t n_batches, cap_batches;
    uint64_t next_batch_id;
    char **seg_names; /* by kvpipe segment id */
    size_t n_seg_names;
    int local_seg; /* kvpipe id of this engine's own segment + 1; 0: not opened */

    pthread_mutex_t regions_lock;
    mc_region *regions;
    size_t n_regions, cap_regions;

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

/* A kvpipe status as Mooncake's negative error. */
static int mc_err(kvp_status st)
{
    switch (st) {
    case KVP_OK:
        return 0;
    case KVP_ENOMEM:
        return MC_ERR_MEMORY;
    case KVP_ETIMEDOUT:
    case KVP_ECONNREFUSED:
    case KVP_ECONNRESET:
    case KVP_EIO:
    case KVP_ECLOSED:
    case KVP_EINTR:
        return MC_ERR_SOCKET;
    case KVP_EPROTO:
        return MC_ERR_MALFORMED_JSON;
    case KVP_EMETADATA:
        return MC_ERR_METADATA;
    case KVP_EBUSY:
    case KVP_EAUTH:
        return MC_ERR_REJECT_HANDSHAKE;
    case KVP_ENOTSUP:
        return MC_ERR_NOT_IMPLEMENTED;
    default:
        return MC_ERR_INVALID_ARGUMENT;
    }
}

/* A Mooncake error as the Status code the batch calls return. */
static int mc_code(int err)
{
    return err == MC_ERR_NOT_IMPLEMENTED ? MC_STATUS_NOT_IMPLEMENTED : -err;
}

static int has_port(const char *name)
{
    if (name[0] == '[') return strstr(name, "]:") != NULL;
    const char *colon = strchr(name, ':');
    return colon && !strchr(colon + 1, ':');
}

transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                       const char *local_server_name, const char *ip_or_host_name,
                                       uint64_t rpc_port, int auto_discover)
{
    (void)ip_or_host_name;
    (void)rpc_port;
    (void)auto_discover;
    if (!metadata_conn_string || !local_server_name || !*local_server_name) {
        mc_log(KVP_LOG_ERROR, "createTransferEngine: metadata and local_server_name are required");
        return NULL;
    }
    char name[512];
    int n;
    if (has_port(local_server_name))
        n = snprintf(name, sizeof name, "%s", local_server_name);
    else if (strchr(local_server_name, ':')) /* a bare IPv6 address */
        n = snprintf(name, sizeof name, "[%s]:0", local_server_name);
    else
        n = snprintf(name, sizeof name, "%s:0", local_server_name);
    if (n < 0 || (size_t)n >= sizeof name) {
        mc_log(KVP_LOG_ERROR, "createTransferEngine: local_server_name too long");
        return NULL;
    }
    mc_engine *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    /* Stacks written for Mooncake name their transport in code; kvpipe's
     * KVPIPE_PROTOCOL picks it, as for the Python module. */
    const char *protocol = getenv("KVPIPE_PROTOCOL");
    if (!protocol || !*protocol) protocol = "tcp";
    snprintf(e->protocol, sizeof e->protocol, "%s", protocol);
    kvp_engine_opts opts;
    kvp_engine_opts_init(&opts);
    opts.local_server_name = name;
    opts.metadata = metadata_conn_string;
    opts.protocol = e->protocol;
    /* Same-host peers go through shm unless asked not to (Mooncake's API has
     * no parameter for it); read as the Python module reads it. */
    const char *no_shm = getenv("KVPIPE_DISABLE_SHM");
    opts.disable_shm = no_shm && *no_shm && strcmp(no_shm, "0") != 0;
    kvp_status st = kvp_engine_create(&opts, &e->kvp);
    if (st) {
        mc_log(KVP_LOG_ERROR, "createTransferEngine(%s, %s): %s: %s", metadata_conn_string,
               local_server_name, kvp_strerror(st), kvp_last_error());
        free(e);
        return NULL;
    }
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->regions_lock, NULL);
    return e;
}

int discoverTopology(transfer_engine_t engine)
{
    /* kvpipe has no NIC topology to discover: a no-op, as on Mooncake's tcp. */
    return engine ? 0 : MC_ERR_INVALID_ARGUMENT;
}

int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len)
{
    mc_engine *e = engine;
    if (!e || !buf_out || !buf_len) return MC_ERR_INVALID_ARGUMENT;
    snprintf(buf_out, buf_len, "%s", kvp_engine_segment_name(e->kvp));
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
    if (strcmp(proto, "tcp") == 0) return &e->transport_token[0];
    if (strcmp(proto, e->protocol) == 0 || (is_ucx(proto) && is_ucx(e->protocol)))
        return &e->transport_token[1];
    char what[160];
    snprintf(what, sizeof what,
             "installTransport(\"%s\"): this engine runs \"%s\" (and tcp); set KVPIPE_PROTOCOL "
             "before createTransferEngine to choose rdma or shm",
             proto, e->protocol);
    not_supported(0, what);
    return NULL;
}

int uninstallTransport(transfer_engine_t engine, const char *proto)
{
    /* Mooncake's is a no-op too: transports stay until the engine goes. */
    return engine && proto ? 0 : MC_ERR_INVALID_ARGUMENT;
}

/* ------------------------------------------------------------ segments --- */

static const char *strip_slashes(const char *name)
{
    while (*name == '/')
        name++;
    return name;
}

/* Remember the name of kvpipe segment id; under e->lock. */
static int remember_segment(mc_engine *e, kvp_segment_id id, const char *name)
{
    if (id < e->n_seg_names && e->seg_names[id]) return 0;
    if (id >= e->n_seg_names) {
        size_t n = (size_t)id + 16;
        char **grown = realloc(e->seg_names, n * sizeof *grown);
        if (!grown) return -1;
        memset(grown + e->n_seg_names, 0, (n - e->n_seg_names) * sizeof *grown);
        e->seg_names = grown;
        e->n_seg_names = n;
    }
    return (e->seg_names[id] = strdup(name)) ? 0 : -1;
}

static segment_id_t open_by_name(mc_engine *e, const char *name)
{
    kvp_segment_id id;
    kvp_status st = kvp_engine_open_segment(e->kvp, name, &id);
    if (st) {
        mc_log(KVP_LOG_WARN, "openSegment(%s): %s: %s", name, kvp_strerror(st), kvp_last_error());
        return -1;
    }
    if (id >= INT32_MAX) return -1;
    pthread_mutex_lock(&e->lock);
    int rc = remember_segment(e, id, name);
    pthread_mutex_unlock(&e->lock);
    return rc ? -1 : (segment_id_t)(id + 1);
}

segment_id_t openSegment(transfer_engine_t engine, const char *segment_name)
{
    mc_engine *e = engine;
    if (!e || !segment_name) return -1;
    const char *name = strip_slashes(segment_name);
    return *name ? open_by_name(e, name) : -1;
}

segment_id_t openSegmentNoCache(transfer_engine_t engine, const char *segment_name)
{
    mc_engine *e = engine;
    if (!e || !segment_name) return -1;
    const char *name = strip_slashes(segment_name);
    if (!*name) return -1;
    kvp_status st = kvp_engine_probe(e->kvp, name);
    if (st) {
        mc_log(KVP_LOG_WARN, "openSegmentNoCache(%s): %s: %s", name, kvp_strerror(st),
               kvp_last_error());
        return mc_err(st);
    }
    return open_by_name(e, name);
}

int closeSegment(transfer_engine_t engine, segment_id_t segment_id)
{
    /* As Mooncake: the cached descriptor stays, a no-op. */
    (void)segment_id;
    return engine ? 0 : MC_ERR_INVALID_ARGUMENT;
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
    if (!engine || !segment_name || !*strip_slashes(segment_name)) return MC_ERR_INVALID_ARGUMENT;
    return not_supported(MC_ERR_NOT_IMPLEMENTED,
                         "removeLocalSegment: the segment stays published until "
                         "destroyTransferEngine");
}

/* kvpipe's segment for a Mooncake target id; -1 for one never opened. */
static int resolve_segment(mc_engine *e, int64_t target, kvp_segment_id *out)
{
    if (target < 0 || target > INT32_MAX) return -1;
    if (target == LOCAL_SEGMENT) {
        pthread_mutex_lock(&e->lock);
        int local = e->local_seg;
        pthread_mutex_unlock(&e->lock);
        if (!local) {
            segment_id_t id = open_by_name(e, kvp_engine_segment_name(e->kvp));
            if (id < 0) return -1;
            pthread_mutex_lock(&e->lock);
            e->local_seg = id;
            pthread_mutex_unlock(&e->lock);
            local = id;
        }
        *out = (kvp_segment_id)(local - 1);
        return 0;
    }
    kvp_segment_id id = (kvp_segment_id)(target - 1);
    pthread_mutex_lock(&e->lock);
    int known = id < e->n_seg_names && e->seg_names[id];
    pthread_mutex_unlock(&e->lock);
    if (!known) return -1;
    *out = id;
    return 0;
}

int syncSegmentCache(transfer_engine_t engine)
{
    mc_engine *e = engine;
    if (!e) return MC_ERR_INVALID_ARGUMENT;
    int first = 0;
    for (size_t id = 0;; id++) {
        char name[512];
        pthread_mutex_lock(&e->lock);
        size_t n = e->n_seg_names;
        int have = id < n && e->seg_names[id];
        if (have) snprintf(name, sizeof name, "%s", e->seg_names[id]);
        pthread_mutex_unlock(&e->lock);
        if (id >= n) break;
        if (!have) continue;
        kvp_status st = kvp_engine_probe(e->kvp, name);
        if (st && !first) {
            mc_log(KVP_LOG_WARN, "syncSegmentCache: %s: %s", name, kvp_last_error());
            first = mc_err(st);
        }
    }
    return first;
}

/* -------------------------------------------------------------- memory --- */

/* Index of the region starting at addr, or -1; under regions_lock. */
static long find_region(const mc_engine *e, uintptr_t addr)
{
    for (size_t i = 0; i < e->n_regions; i++)
        if (e->regions[i].addr == addr) return (long)i;
    return -1;
}

static int overlaps(const mc_engine *e, uintptr_t addr, size_t length)
{
    for (size_t i = 0; i < e->n_regions; i++) {
        const mc_region *r = &e->regions[i];
        if (addr < r->addr + r->length && r->addr < addr + length) return 1;
    }
    return 0;
}

/* Register one region; under regions_lock, overlaps already checked. */
static int register_one(mc_engine *e, void *addr, size_t length, int remote_accessible)
{
    if (e->n_regions == e->cap_regions) {
        size_t cap = e->cap_regions ? e->cap_regions * 2 : 16;
        mc_region *grown = realloc(e->regions, cap * sizeof *grown);
        if (!grown) return MC_ERR_MEMORY;
        e->regions = grown;
        e->cap_regions = cap;
    }
    if (remote_accessible) {
        kvp_status st = kvp_engine_register(e->kvp, addr, length);
        if (st) {
            mc_log(KVP_LOG_WARN, "registerLocalMemory(%p, %zu): %s: %s", addr, length,
                   kvp_strerror(st), kvp_last_error());
            return mc_err(st);
        }
    }
    e->regions[e->n_regions++] =
        (mc_region){.addr = (uintptr_t)addr, .length = length, .published = !!remote_accessible};
    return 0;
}

static int unregister_one(mc_engine *e, void *addr)
{
    long i = find_region(e, (uintptr_t)addr);
    if (i < 0) return MC_ERR_ADDRESS_NOT_REGISTERED;
    if (e->regions[i].published) {
        kvp_status st = kvp_engine_unregister(e->kvp, addr);
        if (st && st != KVP_ENOTFOUND) {
            mc_log(KVP_LOG_WARN, "unregisterLocalMemory(%p): %s: %s", addr, kvp_strerror(st),
                   kvp_last_error());
            return mc_err(st);
        }
    }
    e->regions[i] = e->regions[--e->n_regions];
    return 0;
}

int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length, const char *location,
                        int remote_accessible)
{
    /* location ("cpu:0", "cuda:0", "*") is not needed: kvpipe asks the
     * memory itself what it is (host, or CUDA device memory). */
    (void)location;
    mc_engine *e = engine;
    if (!e || !addr || !length) return MC_ERR_INVALID_ARGUMENT;
    pthread_mutex_lock(&e->regions_lock);
    int rc = overlaps(e, (uintptr_t)addr, length)
                 ? MC_ERR_ADDRESS_OVERLAPPED
                 : register_one(e, addr, length, remote_accessible);
    pthread_mutex_unlock(&e->regions_lock);
    return rc;
}

int unregisterLocalMemory(transfer_engine_t engine, void *addr)
{
    mc_engine *e = engine;
    if (!e) return MC_ERR_INVALID_ARGUMENT;
    pthread_mutex_lock(&e->regions_lock);
    int rc = unregister_one(e, addr);
    pthread_mutex_unlock(&e->regions_lock);
    return rc;
}

int registerLocalMemoryBatch(transfer_engine_t engine, buffer_entry_t *buffer_list,
                             size_t buffer_len, const char *location)
{
    (void)location;
    mc_engine *e = engine;
    if (!e || (buffer_len && !buffer_list)) return MC_ERR_INVALID_ARGUMENT;
    for (size_t i = 0; i < buffer_len; i++)
        if (!buffer_list[i].addr || !buffer_list[i].length) return MC_ERR_INVALID_ARGUMENT;
    pthread_mutex_lock(&e->regions_lock);
    int rc = 0;
    size_t done = 0;
    for (; done < buffer_len && !rc; done++) {
        /* Checking each against those before it (registered a moment ago)
         * finds overlaps inside the list too. */
        const buffer_entry_t *b = &buffer_list[done];
        rc = overlaps(e, (uintptr_t)b->addr, b->length) ? MC_ERR_ADDRESS_OVERLAPPED
                                                        : register_one(e, b->addr, b->length, 1);
    }
    if (rc) /* all or nothing: undo what this call registered */
        for (size_t i = 0; i + 1 < done; i++)
            unregister_one(e, buffer_list[i].addr);
    pthread_mutex_unlock(&e->regions_lock);
    return rc;
}

int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list, size_t addr_len)
{
    mc_engine *e = engine;
    if (!e || (addr_len && !addr_list)) return MC_ERR_INVALID_ARGUMENT;
    int first = 0;
    pthread_mutex_lock(&e->regions_lock);
    for (size_t i = 0; i < addr_len; i++) {
        int rc = unregister_one(e, addr_list[i]);
        if (rc && !first) first = rc;
    }
    pthread_mutex_unlock(&e->regions_lock);
    return first;
}

/* ------------------------------------------------------------- batches --- */

batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size)
{
    mc_engine *e = engine;
    if (!e) return INVALID_BATCH;
    mc_batch *b = calloc(1, sizeof *b);
    if (!b) return INVALID_BATCH;
    b->capacity = batch_size;
    pthread_mutex_init(&b->lock, NULL);
    pthread_mutex_lock(&e->lock);
    if (e->n_batches == e->cap_batches) {
        size_t cap = e->cap_batches ? e->cap_batches * 2 : 16;
        mc_batch **grown = realloc(e->batches, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&e->lock);
            pthread_mutex_destroy(&b->lock);
            free(b);
            return INVALID_BATCH;
        }
        e->batches = grown;
        e->cap_batches = cap;
    }
    b->id = ++e->next_batch_id;
    e->batches[e->n_batches++] = b;
    pthread_mutex_unlock(&e->lock);
    return b->id;
}

static mc_batch *find_batch(mc_engine *e, batch_id_t id, size_t *index)
{
    mc_batch *b = NULL;
    for (size_t i = e->n_batches; i-- > 0;)
        if (e->batches[i]->id == id) {
            b = e->batches[i];
            if (index) *index = i;
            break;
        }
    return b;
}

static mc_batch *get_batch(mc_engine *e, batch_id_t id)
{
    pthread_mutex_lock(&e->lock);
    mc_batch *b = find_batch(e, id, NULL);
    pthread_mutex_unlock(&e->lock);
    return b;
}

static int validate_requests(mc_engine *e, const struct transfer_request *r, size_t count,
                             kvp_segment_id *segs)
{
    for (size_t i = 0; i < count; i++) {
        if (r[i].opcode != OPCODE_READ && r[i].opcode != OPCODE_WRITE) {
            mc_log(KVP_LOG_WARN, "submitTransfer: request %zu: opcode %d is neither READ nor WRITE",
                   i, r[i].opcode);
            return 0;
        }
        if (r[i].length && !r[i].source) {
            mc_log(KVP_LOG_WARN, "submitTransfer: request %zu: no source memory", i);
            return 0;
        }
        if (resolve_segment(e, r[i].target_id, &segs[i])) {
            mc_log(KVP_LOG_WARN, "submitTransfer: request %zu: segment %" PRId32 " was not opened",
                   i, r[i].target_id);
            return 0;
        }
    }
    return 1;
}

static int grow(void **array, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need)
        n *= 2;
    void *grown = realloc(*array, n * elem);
    if (!grown) return -1;
    *array = grown;
    *cap = n;
    return 0;
}

/* Submit the requests as runs of one segment each; under b->lock. */
static int submit_runs(mc_engine *e, mc_batch *b, const struct transfer_request *r, size_t count,
                       const kvp_segment_id *segs)
{
    kvp_request *reqs = malloc((count ? count : 1) * sizeof *reqs);
    if (!reqs) return mc_code(MC_ERR_MEMORY);
    int rc = 0;
    for (size_t start = 0; start < count && !rc;) {
        size_t end = start + 1;
        while (end < count && segs[end] == segs[start])
            end++;
        for (size_t i = start; i < end; i++)
            reqs[i - start] =
                (kvp_request){.opcode = r[i].opcode == OPCODE_READ ? KVP_OP_READ : KVP_OP_WRITE,
                              .local = r[i].source,
                              .remote = r[i].target_offset,
                              .length = (size_t)r[i].length};
        kvp_batch *kb;
        kvp_status st = kvp_batch_submit(e->kvp, segs[start], reqs, end - start, &kb);
        if (st) {
            mc_log(KVP_LOG_WARN, "submitTransfer: %s: %s", kvp_strerror(st), kvp_last_error());
            rc = mc_code(mc_err(st));
            break;
        }
        b->chunks[b->n_chunks++] = (mc_chunk){.batch = kb, .first = b->count, .n = end - start};
        for (size_t i = start; i < end; i++)
            b->lengths[b->count++] = r[i].length;
        start = end;
    }
    free(reqs);
    return rc;
}

static int submit(mc_engine *e, batch_id_t batch_id, struct transfer_request *entries, size_t count,
                  const notify_msg_t *notify)
{
    if (!e || (count && !entries)) return mc_code(MC_ERR_INVALID_ARGUMENT);
    mc_batch *b = get_batch(e, batch_id);
    if (!b) {
        mc_log(KVP_LOG_WARN, "submitTransfer: no batch %" PRIu64, (uint64_t)batch_id);
        return mc_code(MC_ERR_INVALID_ARGUMENT);
    }
    if (notify && (!count || !notify->name || !notify->msg))
        return mc_code(MC_ERR_INVALID_ARGUMENT);
    kvp_segment_id *segs = malloc((count ? count : 1) * sizeof *segs);
    if (!segs) return mc_code(MC_ERR_MEMORY);
    if (!validate_requests(e, entries, count, segs)) {
        free(segs);
        return mc_code(MC_ERR_INVALID_ARGUMENT);
    }
    char *name = notify ? strdup(notify->name) : NULL;
    char *msg = notify ? strdup(notify->msg) : NULL;
    int rc = 0;
    pthread_mutex_lock(&b->lock);
    if (notify && (!name || !msg)) {
        rc = mc_code(MC_ERR_MEMORY);
    } else if (count > b->capacity - b->count) {
        mc_log(KVP_LOG_WARN,
               "submitTransfer: %zu requests exceed the batch's capacity (%zu of %zu "
               "used)",
               count, b->count, b->capacity);
        rc = mc_code(MC_ERR_TOO_MANY_REQUESTS);
    } else if (grow((void **)&b->lengths, &b->cap_lengths, b->count + count, sizeof *b->lengths) ||
               grow((void **)&b->chunks, &b->cap_chunks, b->n_chunks + count, sizeof *b->chunks)) {
        rc = mc_code(MC_ERR_MEMORY);
    } else {
        rc = submit_runs(e, b, entries, count, segs);
    }
    if (!rc && notify) {
        free(b->notify_name);
        free(b->notify_msg);
        b->notify_name = name;
        b->notify_msg = msg;
        b->notify_target = entries[0].target_id;
        name = msg = NULL;
    }
    pthread_mutex_unlock(&b->lock);
    free(name);
    free(msg);
    free(segs);
    return rc;
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

/* Whether every request of the batch completed successfully; under b->lock. */
static int batch_succeeded(const mc_batch *b)
{
    for (size_t c = 0; c < b->n_chunks; c++)
        if (kvp_batch_pending(b->chunks[c].batch)) return 0;
    for (size_t c = 0; c < b->n_chunks; c++)
        for (size_t i = 0; i < b->chunks[c].n; i++)
            if (kvp_batch_request_status(b->chunks[c].batch, i) != KVP_OK) return 0;
    return 1;
}

static void send_notify(mc_engine *e, int32_t target, const char *name, const char *msg)
{
    kvp_segment_id seg;
    if (resolve_segment(e, target, &seg)) {
        mc_log(KVP_LOG_ERROR, "notify: segment %" PRId32 " is not open", target);
        return;
    }
    kvp_status st = kvp_engine_notify(e->kvp, seg, name, msg);
    if (st)
        mc_log(KVP_LOG_ERROR, "failed to send the batch's notify message: %s: %s", kvp_strerror(st),
               kvp_last_error());
}

int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id, size_t task_id,
                      struct transfer_status *status)
{
    mc_engine *e = engine;
    if (!e || !status) return mc_code(MC_ERR_INVALID_ARGUMENT);
    mc_batch *b = get_batch(e, batch_id);
    if (!b) return mc_code(MC_ERR_INVALID_ARGUMENT);
    pthread_mutex_lock(&b->lock);
    if (task_id >= b->count) {
        pthread_mutex_unlock(&b->lock);
        return mc_code(MC_ERR_INVALID_ARGUMENT);
    }
    size_t lo = 0, hi = b->n_chunks; /* the chunk holding task_id */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (b->chunks[mid].first <= task_id)
            lo = mid;
        else
            hi = mid;
    }
    const mc_chunk *c = &b->chunks[lo];
    kvp_status st = kvp_batch_request_status(c->batch, task_id - c->first);
    status->transferred_bytes = 0;
    switch (st) {
    case KVP_EINPROGRESS:
        status->status = STATUS_WAITING;
        break;
    case KVP_OK:
        status->status = STATUS_COMPLETED;
        status->transferred_bytes = b->lengths[task_id];
        break;
    case KVP_ECANCELED:
        status->status = STATUS_CANCELED;
        break;
    default:
        status->status = STATUS_FAILED;
        break;
    }
    /* As Mooncake: the call that first sees the whole batch done sends its
     * notification, before it returns. */
    char *name = NULL, *msg = NULL;
    int32_t target = 0;
    if (st == KVP_OK && b->notify_name && batch_succeeded(b)) {
        name = b->notify_name;
        msg = b->notify_msg;
        target = b->notify_target;
        b->notify_name = b->notify_msg = NULL;
    }
    pthread_mutex_unlock(&b->lock);
    if (name) send_notify(e, target, name, msg);
    free(name);
    free(msg);
    return 0;
}

static void batch_destroy(mc_batch *b)
{
    for (size_t c = 0; c < b->n_chunks; c++)
        kvp_batch_free(b->chunks[c].batch);
    pthread_mutex_destroy(&b->lock);
    free(b->chunks);
    free(b->lengths);
    free(b->notify_name);
    free(b->notify_msg);
    free(b);
}

int freeBatchID(transfer_engine_t engine, batch_id_t batch_id)
{
    mc_engine *e = engine;
    if (!e) return mc_code(MC_ERR_INVALID_ARGUMENT);
    pthread_mutex_lock(&e->lock);
    size_t index;
    mc_batch *b = find_batch(e, batch_id, &index);
    if (!b) {
        pthread_mutex_unlock(&e->lock);
        return mc_code(MC_ERR_INVALID_ARGUMENT);
    }
    pthread_mutex_lock(&b->lock);
    int busy = 0;
    for (size_t c = 0; c < b->n_chunks && !busy; c++)
        busy = kvp_batch_pending(b->chunks[c].batch) > 0;
    if (!busy) e->batches[index] = e->batches[--e->n_batches];
    pthread_mutex_unlock(&b->lock);
    pthread_mutex_unlock(&e->lock);
    if (busy) return mc_code(MC_ERR_BATCH_BUSY);
    batch_destroy(b);
    return 0;
}

/* ------------------------------------------------------- notifications --- */

notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size)
{
    mc_engine *e = engine;
    if (size) *size = 0;
    if (!e || !size) return NULL;
    kvp_notify *got;
    size_t n;
    kvp_status st = kvp_engine_get_notifies(e->kvp, &got, &n);
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
    if (!e || !notify_msg.name || !notify_msg.msg) return MC_ERR_INVALID_ARGUMENT;
    kvp_segment_id seg;
    if (target_id > INT32_MAX || resolve_segment(e, (int64_t)target_id, &seg)) {
        mc_log(KVP_LOG_ERROR, "genNotifyInEngine: invalid segment ID %" PRIu64, target_id);
        return MC_ERR_METADATA;
    }
    kvp_status st = kvp_engine_notify(e->kvp, seg, notify_msg.name, notify_msg.msg);
    if (st) {
        mc_log(KVP_LOG_WARN, "genNotifyInEngine: %s: %s", kvp_strerror(st), kvp_last_error());
        return mc_err(st);
    }
    return 0;
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
    if (!e) return;
    pthread_mutex_lock(&e->lock);
    e->graceful = 1;
    pthread_mutex_unlock(&e->lock);
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

int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len, int json)
{
    mc_engine *e = engine;
    if (!e || !buf_out || !buf_len) return -1;
    size_t used = 0;
    buf_out[0] = '\0';
    if (json)
        append(buf_out, buf_len, &used, "{\"local\":\"%s\",\"segments\":[",
               kvp_engine_segment_name(e->kvp));
    int first = 1;
    pthread_mutex_lock(&e->lock);
    for (size_t id = 0; id < e->n_seg_names; id++) {
        if (!e->seg_names[id]) continue;
        const char *transport = kvp_engine_segment_transport(e->kvp, (kvp_segment_id)id);
        if (!transport) transport = "none";
        if (json)
            append(buf_out, buf_len, &used, "%s{\"id\":%zu,\"name\":\"%s\",\"transport\":\"%s\"}",
                   first ? "" : ",", id + 1, e->seg_names[id], transport);
        else
            append(buf_out, buf_len, &used, "%zu %s %s\n", id + 1, e->seg_names[id], transport);
        first = 0;
    }
    pthread_mutex_unlock(&e->lock);
    if (json) append(buf_out, buf_len, &used, "]}");
    return 0;
}

void destroyTransferEngine(transfer_engine_t engine)
{
    mc_engine *e = engine;
    if (!e) return;
    /* Graceful: what was submitted finishes (each request bounded by the
     * engine's deadlines) before the engine goes; otherwise it is canceled. */
    for (size_t i = 0; e->graceful && i < e->n_batches; i++)
        for (size_t c = 0; c < e->batches[i]->n_chunks; c++)
            kvp_batch_wait(e->batches[i]->chunks[c].batch, -1);
    for (size_t i = 0; i < e->n_batches; i++)
        batch_destroy(e->batches[i]);
    kvp_engine_destroy(e->kvp);
    for (size_t id = 0; id < e->n_seg_names; id++)
        free(e->seg_names[id]);
    free(e->seg_names);
    free(e->batches);
    free(e->regions);
    pthread_mutex_destroy(&e->lock);
    pthread_mutex_destroy(&e->regions_lock);
    free(e);
}
