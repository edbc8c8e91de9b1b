/* Mooncake's semantics on kvpipe's public engine API, for both facades
 * (mooncake_core.h says what and why). */
#include "mooncake_core.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvpipe/log.h"
#include "kvpipe/status.h"

enum { REGION_PUBLISHED = 1, REGION_MANAGED = 2, REGION_DEVICE = 4 };

typedef struct region {
    uintptr_t addr;
    size_t length;
    unsigned flags;
} region;

typedef struct chunk {
    kvp_batch *batch;
    size_t first; /* task id of its first request */
    size_t n;
} chunk;

typedef struct mc_batch {
    uint64_t id;
    kvmc_engine *e;
    size_t capacity;
    pthread_mutex_t lock;
    size_t count;      /* requests submitted (under lock) */
    uint64_t *lengths; /* per task */
    size_t cap_lengths;
    chunk *chunks;
    size_t n_chunks, cap_chunks;
    /* Chunks completed (their callbacks) and the waiter's eventfd, under
     * watch_lock, which the callbacks take alone: one may run inside
     * kvmc_batch_submit, under lock (taken before watch_lock). */
    pthread_mutex_t watch_lock;
    size_t done;
    int watch_fd;
    /* the notification to send once every request completed */
    char *notify_name, *notify_msg;
    int64_t notify_target;
} mc_batch;

struct kvmc_engine {
    kvp_engine *kvp;
    char protocol[16];
    pthread_mutex_t lock; /* the three tables */
    region *regions;
    size_t n_regions, cap_regions;
    char **seg_names; /* by kvpipe segment id */
    size_t n_seg_names;
    int local_seg; /* kvpipe id of this engine's own segment + 1; 0: not opened */
    mc_batch **batches;
    size_t n_batches, cap_batches;
    uint64_t next_batch_id;
};

/* ---------------------------------------------------------- codes --- */

int kvmc_err(kvp_status st)
{
    switch (st) {
    case KVP_OK:
        return 0;
    case KVP_ENOMEM:
        return KVMC_ERR_MEMORY;
    case KVP_ETIMEDOUT:
    case KVP_ECONNREFUSED:
    case KVP_ECONNRESET:
    case KVP_EIO:
    case KVP_ECLOSED:
    case KVP_EINTR:
    case KVP_ECORRUPT: /* a transfer's bytes arrived corrupted (integrity) */
        return KVMC_ERR_SOCKET;
    case KVP_EPROTO:
        return KVMC_ERR_MALFORMED_JSON;
    case KVP_EMETADATA:
        return KVMC_ERR_METADATA;
    case KVP_EBUSY:
    case KVP_EAUTH:
        return KVMC_ERR_REJECT_HANDSHAKE;
    case KVP_ENOTSUP:
        return KVMC_ERR_NOT_IMPLEMENTED;
    default:
        return KVMC_ERR_INVALID_ARGUMENT;
    }
}

int kvmc_code(int err)
{
    return err == KVMC_ERR_NOT_IMPLEMENTED ? KVMC_STATUS_NOT_IMPLEMENTED : -err;
}

/* The detail of this thread's last failure the core found itself (own),
 * rather than kvpipe's. */
static _Thread_local char detail[256];
static _Thread_local int own;

__attribute__((format(printf, 2, 3))) static kvp_status own_error(kvp_status st, const char *fmt,
                                                                  ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    own = 1;
    return st;
}

const char *kvmc_last_error(void)
{
    return own ? detail : kvp_last_error();
}

/* A status from kvpipe's API: its kvp_last_error() is the detail. */
static kvp_status kvp_rc(kvp_status st)
{
    own = 0;
    return st;
}

static kvmc_rc rc_of(kvp_status st)
{
    return (kvmc_rc){kvmc_err(st), kvp_rc(st)};
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

/* --------------------------------------------------------- engine --- */

/* Whether "host:port" / "[v6]:port" carries a port (a bare IPv6 address has
 * several colons and no brackets). */
static int has_port(const char *name)
{
    if (name[0] == '[') return strstr(name, "]:") != NULL;
    const char *colon = strchr(name, ':');
    return colon && !strchr(colon + 1, ':');
}

/* name, with ":0" (any free port) when it has no port. */
static int server_name(char *buf, size_t cap, const char *name)
{
    int n;
    size_t len = strlen(name);
    if (has_port(name))
        n = snprintf(buf, cap, "%s", name);
    else if (name[0] == '[' && len > 2 && name[len - 1] == ']')
        n = snprintf(buf, cap, "%s:0", name);
    else if (strchr(name, ':')) /* a bare IPv6 address */
        n = snprintf(buf, cap, "[%s]:0", name);
    else
        n = snprintf(buf, cap, "%s:0", name);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

static int env_on(const char *name)
{
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

kvp_status kvmc_create(const char *local_server_name, const char *metadata, const char *protocol,
                       const char *devices, kvmc_engine **out)
{
    if (!local_server_name || !*local_server_name || !metadata || !out)
        return own_error(KVP_EINVAL, "metadata and local_server_name are required");
    char name[512];
    if (server_name(name, sizeof name, local_server_name))
        return own_error(KVP_EINVAL, "local_server_name too long");
    kvmc_engine *e = calloc(1, sizeof *e);
    if (!e) return own_error(KVP_ENOMEM, "out of memory");
    const char *forced = getenv("KVPIPE_PROTOCOL");
    if (forced && *forced) protocol = forced;
    snprintf(e->protocol, sizeof e->protocol, "%s", protocol && *protocol ? protocol : "tcp");
    kvp_engine_opts opts;
    kvp_engine_opts_init(&opts);
    opts.local_server_name = name;
    opts.metadata = metadata;
    opts.protocol = e->protocol;
    opts.device_names = devices && *devices ? devices : NULL;
    /* Same-host peers go through shm unless asked not to (Mooncake's API
     * has no parameter for it). */
    opts.disable_shm = env_on("KVPIPE_DISABLE_SHM");
    kvp_status st = kvp_rc(kvp_engine_create(&opts, &e->kvp));
    if (st) {
        free(e);
        return st;
    }
    pthread_mutex_init(&e->lock, NULL);
    *out = e;
    return KVP_OK;
}

kvp_engine *kvmc_kvp(const kvmc_engine *e)
{
    return e->kvp;
}

const char *kvmc_protocol(const kvmc_engine *e)
{
    return e->protocol;
}

static void batch_destroy(mc_batch *b, int graceful)
{
    for (size_t c = 0; graceful && c < b->n_chunks; c++)
        kvp_batch_wait(b->chunks[c].batch, -1);
    for (size_t c = 0; c < b->n_chunks; c++)
        kvp_batch_free(b->chunks[c].batch);
    pthread_mutex_destroy(&b->lock);
    pthread_mutex_destroy(&b->watch_lock);
    free(b->chunks);
    free(b->lengths);
    free(b->notify_name);
    free(b->notify_msg);
    free(b);
}

void kvmc_destroy(kvmc_engine *e, int graceful)
{
    if (!e) return;
    /* Graceful: what was submitted finishes (each request bounded by the
     * engine's deadlines) before the engine goes; otherwise it is
     * cancelled. */
    for (size_t i = 0; i < e->n_batches; i++)
        batch_destroy(e->batches[i], graceful);
    kvp_engine_destroy(e->kvp);
    for (size_t id = 0; id < e->n_seg_names; id++)
        free(e->seg_names[id]);
    free(e->seg_names);
    free(e->batches);
    free(e->regions);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

/* --------------------------------------------------------- regions --- */

/* The table's index of the region of these flags (mask) starting at addr,
 * or -1; under lock. */
static long find_region(const kvmc_engine *e, uintptr_t addr, unsigned mask, unsigned flags)
{
    for (size_t i = 0; i < e->n_regions; i++)
        if (e->regions[i].addr == addr && (e->regions[i].flags & mask) == flags) return (long)i;
    return -1;
}

static int overlaps(const kvmc_engine *e, uintptr_t addr, size_t length)
{
    for (size_t i = 0; i < e->n_regions; i++) {
        const region *r = &e->regions[i];
        if (addr < r->addr + r->length && r->addr < addr + length) return 1;
    }
    return 0;
}

static int add_region(kvmc_engine *e, uintptr_t addr, size_t length, unsigned flags)
{
    if (grow((void **)&e->regions, &e->cap_regions, e->n_regions + 1, sizeof *e->regions))
        return -1;
    e->regions[e->n_regions++] = (region){addr, length, flags};
    return 0;
}

/* Can the CPU read the byte at addr? A write(2) from it into a pipe fails
 * with EFAULT, rather than crashing, where it cannot (GPU memory). */
static int cpu_readable(uintptr_t addr)
{
    int fds[2];
    if (pipe(fds) != 0) return 1;
    int ok = write(fds[1], (const void *)addr, 1) == 1;
    close(fds[0]);
    close(fds[1]);
    return ok;
}

/* Under lock: the region table does not change meanwhile, so the overlap
 * checked is the overlap registered. */
static kvmc_rc register_locked(kvmc_engine *e, void *addr, size_t length, int publish)
{
    if (overlaps(e, (uintptr_t)addr, length))
        return (kvmc_rc){
            KVMC_ERR_ADDRESS_OVERLAPPED,
            own_error(KVP_EINVAL, "region [%p, +%zu) overlaps a registered region", addr, length)};
    if (publish) {
        kvp_status st = kvp_engine_register(e->kvp, addr, length);
        if (st) return rc_of(st);
    }
    unsigned flags = publish ? REGION_PUBLISHED : 0;
    /* The engine took memory the CPU cannot read: GPU memory (docs/gpu.md). */
    if (publish && length && !cpu_readable((uintptr_t)addr)) flags |= REGION_DEVICE;
    if (add_region(e, (uintptr_t)addr, length, flags)) {
        if (publish) kvp_engine_unregister(e->kvp, addr);
        return (kvmc_rc){KVMC_ERR_MEMORY, own_error(KVP_ENOMEM, "out of memory")};
    }
    return rc_of(KVP_OK);
}

static kvmc_rc unregister_locked(kvmc_engine *e, void *addr)
{
    long i = find_region(e, (uintptr_t)addr, REGION_MANAGED, 0);
    if (i < 0)
        return (kvmc_rc){KVMC_ERR_ADDRESS_NOT_REGISTERED,
                         own_error(KVP_ENOTFOUND, "no region registered here starts at %p", addr)};
    if (e->regions[i].flags & REGION_PUBLISHED) {
        kvp_status st = kvp_engine_unregister(e->kvp, addr);
        if (st && st != KVP_ENOTFOUND) return rc_of(st);
    }
    e->regions[i] = e->regions[--e->n_regions];
    return rc_of(KVP_OK);
}

kvmc_rc kvmc_register(kvmc_engine *e, void *addr, size_t length, int publish)
{
    pthread_mutex_lock(&e->lock);
    kvmc_rc rc = register_locked(e, addr, length, publish);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

kvmc_rc kvmc_register_all(kvmc_engine *e, void *const *addrs, const size_t *lengths, size_t n)
{
    pthread_mutex_lock(&e->lock);
    kvmc_rc rc = rc_of(KVP_OK);
    size_t done = 0;
    /* Checking each against those before it (registered a moment ago)
     * finds overlaps inside the list too. */
    for (; done < n && !rc.mc; done++)
        rc = register_locked(e, addrs[done], lengths[done], 1);
    if (rc.mc) /* all or nothing: undo what this call registered */
        for (size_t i = done - 1; i-- > 0;)
            unregister_locked(e, addrs[i]);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

kvmc_rc kvmc_unregister(kvmc_engine *e, void *addr)
{
    pthread_mutex_lock(&e->lock);
    kvmc_rc rc = unregister_locked(e, addr);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

kvp_status kvmc_alloc(kvmc_engine *e, size_t length, void **out)
{
    kvp_status st = kvp_rc(kvp_engine_alloc(e->kvp, length, out));
    if (st) return st;
    pthread_mutex_lock(&e->lock);
    int bad = add_region(e, (uintptr_t)*out, length, REGION_MANAGED);
    pthread_mutex_unlock(&e->lock);
    if (bad) {
        kvp_engine_free(e->kvp, *out);
        return own_error(KVP_ENOMEM, "out of memory");
    }
    return KVP_OK;
}

kvp_status kvmc_free(kvmc_engine *e, void *addr)
{
    kvp_status st = kvp_rc(kvp_engine_free(e->kvp, addr));
    if (st) return st;
    pthread_mutex_lock(&e->lock);
    long i = find_region(e, (uintptr_t)addr, REGION_MANAGED, REGION_MANAGED);
    if (i >= 0) e->regions[i] = e->regions[--e->n_regions];
    pthread_mutex_unlock(&e->lock);
    return KVP_OK;
}

const char *kvmc_copy_refusal(kvmc_engine *e, uint64_t addr, size_t length, kvp_status *st)
{
    const char *why = "is not inside a managed or registered buffer of this engine";
    *st = KVP_ERANGE;
    pthread_mutex_lock(&e->lock);
    for (size_t i = 0; i < e->n_regions; i++) {
        const region *r = &e->regions[i];
        if (addr >= r->addr && addr - r->addr <= r->length &&
            length <= r->length - (addr - r->addr)) {
            why = NULL;
            if (r->flags & REGION_DEVICE) {
                *st = KVP_ENOTSUP;
                why = "is GPU memory, which the CPU cannot copy (read it with torch; kvpipe's "
                      "transfers stage it, docs/gpu.md)";
            }
            break;
        }
    }
    pthread_mutex_unlock(&e->lock);
    if (!why) *st = KVP_OK;
    return why;
}

/* -------------------------------------------------------- segments --- */

/* Remember the name of kvpipe segment id; under lock. */
static int remember_segment(kvmc_engine *e, kvp_segment_id id, const char *name)
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

static const char *strip_slashes(const char *name)
{
    while (*name == '/')
        name++;
    return name;
}

int kvmc_lookup(kvmc_engine *e, const char *name, kvp_segment_id *out)
{
    name = strip_slashes(name);
    int found = 0;
    pthread_mutex_lock(&e->lock);
    for (size_t id = 0; id < e->n_seg_names && !found; id++)
        if (e->seg_names[id] && strcmp(e->seg_names[id], name) == 0) {
            *out = (kvp_segment_id)id;
            found = 1;
        }
    pthread_mutex_unlock(&e->lock);
    return found;
}

kvp_status kvmc_open(kvmc_engine *e, const char *name, int32_t *mc_id, kvp_segment_id *out)
{
    if (!name || !*strip_slashes(name)) return own_error(KVP_EINVAL, "empty segment name");
    name = strip_slashes(name);
    kvp_segment_id id;
    if (!kvmc_lookup(e, name, &id)) {
        kvp_status st = kvp_rc(kvp_engine_open_segment(e->kvp, name, &id));
        if (st) return st;
        if (id >= INT32_MAX) return own_error(KVP_ENOMEM, "too many segments");
        pthread_mutex_lock(&e->lock);
        int bad = remember_segment(e, id, name);
        pthread_mutex_unlock(&e->lock);
        if (bad) return own_error(KVP_ENOMEM, "out of memory");
    }
    if (mc_id) *mc_id = (int32_t)(id + 1);
    if (out) *out = id;
    return KVP_OK;
}

kvp_status kvmc_resolve(kvmc_engine *e, int64_t mc_id, kvp_segment_id *out)
{
    if (mc_id < 0 || mc_id > INT32_MAX)
        return own_error(KVP_EINVAL, "segment %lld was not opened", (long long)mc_id);
    if (mc_id == 0) {
        pthread_mutex_lock(&e->lock);
        int local = e->local_seg;
        pthread_mutex_unlock(&e->lock);
        if (!local) {
            int32_t id;
            kvp_status st = kvmc_open(e, kvp_engine_segment_name(e->kvp), &id, NULL);
            if (st) return st;
            pthread_mutex_lock(&e->lock);
            e->local_seg = local = id;
            pthread_mutex_unlock(&e->lock);
        }
        *out = (kvp_segment_id)(local - 1);
        return KVP_OK;
    }
    kvp_segment_id id = (kvp_segment_id)(mc_id - 1);
    pthread_mutex_lock(&e->lock);
    int known = id < e->n_seg_names && e->seg_names[id];
    pthread_mutex_unlock(&e->lock);
    if (!known) return own_error(KVP_EINVAL, "segment %lld was not opened", (long long)mc_id);
    *out = id;
    return KVP_OK;
}

kvp_status kvmc_probe(kvmc_engine *e, const char *name, int32_t *mc_id, kvp_segment_id *out)
{
    if (!name || !*strip_slashes(name)) return own_error(KVP_EINVAL, "empty segment name");
    kvp_status st = kvp_rc(kvp_engine_probe(e->kvp, strip_slashes(name)));
    return st ? st : kvmc_open(e, name, mc_id, out);
}

kvp_status kvmc_probe_all(kvmc_engine *e)
{
    kvp_status first = KVP_OK;
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
        if (st && !first) first = kvp_rc(st);
    }
    return first;
}

void kvmc_each_segment(kvmc_engine *e, void (*fn)(void *arg, int32_t mc_id, const char *name),
                       void *arg)
{
    pthread_mutex_lock(&e->lock);
    for (size_t id = 0; id < e->n_seg_names; id++)
        if (e->seg_names[id]) fn(arg, (int32_t)(id + 1), e->seg_names[id]);
    pthread_mutex_unlock(&e->lock);
}

/* --------------------------------------------------------- batches --- */

uint64_t kvmc_batch_new(kvmc_engine *e, size_t capacity)
{
    mc_batch *b = calloc(1, sizeof *b);
    if (!b) return 0;
    b->e = e;
    b->capacity = capacity;
    b->watch_fd = -1;
    pthread_mutex_init(&b->lock, NULL);
    pthread_mutex_init(&b->watch_lock, NULL);
    pthread_mutex_lock(&e->lock);
    if (grow((void **)&e->batches, &e->cap_batches, e->n_batches + 1, sizeof *e->batches)) {
        pthread_mutex_unlock(&e->lock);
        pthread_mutex_destroy(&b->lock);
        pthread_mutex_destroy(&b->watch_lock);
        free(b);
        return 0;
    }
    b->id = ++e->next_batch_id;
    e->batches[e->n_batches++] = b;
    pthread_mutex_unlock(&e->lock);
    return b->id;
}

/* The batch of id, and its index in the map; under e->lock. */
static mc_batch *find_batch(kvmc_engine *e, uint64_t id, size_t *index)
{
    for (size_t i = e->n_batches; i-- > 0;)
        if (e->batches[i]->id == id) {
            if (index) *index = i;
            return e->batches[i];
        }
    return NULL;
}

static mc_batch *get_batch(kvmc_engine *e, uint64_t id)
{
    pthread_mutex_lock(&e->lock);
    mc_batch *b = find_batch(e, id, NULL);
    pthread_mutex_unlock(&e->lock);
    return b;
}

/* The error of an id that names no batch of the engine's. */
static kvp_status no_batch(uint64_t id)
{
    return own_error(KVP_EINVAL, "unknown or already collected batch id %llu",
                     (unsigned long long)id);
}

/* A chunk's kvpipe batch completed (kvp_batch_opts.on_complete, on an engine
 * thread): count its requests done and wake the batch's watcher. Touches
 * watch_lock alone: it may run on the submitting thread, inside
 * kvmc_batch_submit, which holds the batch's lock. */
static void chunk_done(kvp_batch *kb, void *arg)
{
    mc_batch *b = arg;
    (void)kb;
    pthread_mutex_lock(&b->watch_lock);
    b->done++;
    uint64_t one = 1;
    /* An eventfd takes the write unless full: nothing to do otherwise. */
    if (b->watch_fd >= 0 && write(b->watch_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        b->watch_fd = -1;
    pthread_mutex_unlock(&b->watch_lock);
}

/* Submit the requests as runs of one segment each; under b->lock. */
static kvmc_rc submit_runs(kvmc_engine *e, mc_batch *b, const kvmc_request *r, size_t count,
                           const kvp_segment_id *segs)
{
    kvp_request *reqs = malloc((count ? count : 1) * sizeof *reqs);
    if (!reqs) return (kvmc_rc){kvmc_code(KVMC_ERR_MEMORY), own_error(KVP_ENOMEM, "out of memory")};
    kvmc_rc rc = {0, KVP_OK};
    kvp_batch_opts o;
    kvp_batch_opts_init(&o);
    o.on_complete = chunk_done;
    o.user_data = b;
    for (size_t start = 0; start < count;) {
        size_t end = start + 1;
        while (end < count && segs[end] == segs[start])
            end++;
        for (size_t i = start; i < end; i++)
            reqs[i - start] = (kvp_request){.opcode = r[i].opcode,
                                            .local = r[i].local,
                                            .remote = r[i].remote,
                                            .length = (size_t)r[i].length};
        /* Counted first: its callback may run before submit returns. */
        size_t first = b->count;
        for (size_t i = start; i < end; i++)
            b->lengths[b->count++] = r[i].length;
        kvp_batch *kb;
        kvp_status st = kvp_batch_submit_with(e->kvp, segs[start], reqs, end - start, &o, &kb);
        if (st) {
            b->count = first;
            rc = (kvmc_rc){kvmc_code(kvmc_err(st)), kvp_rc(st)};
            break;
        }
        b->chunks[b->n_chunks++] = (chunk){.batch = kb, .first = first, .n = end - start};
        start = end;
    }
    free(reqs);
    return rc;
}

kvmc_rc kvmc_batch_submit(kvmc_engine *e, uint64_t id, const kvmc_request *reqs, size_t n,
                          const char *notify_name, const char *notify_msg)
{
    kvmc_rc invalid = {kvmc_code(KVMC_ERR_INVALID_ARGUMENT), KVP_EINVAL};
    if (n && !reqs) return (own_error(KVP_EINVAL, "no requests"), invalid);
    mc_batch *b = get_batch(e, id);
    int notify = notify_name || notify_msg;
    if (!b) return (own_error(KVP_EINVAL, "no batch %llu", (unsigned long long)id), invalid);
    if (notify && (!n || !notify_name || !notify_msg))
        return (own_error(KVP_EINVAL, "a notification needs a name, a message and a request"),
                invalid);
    kvp_segment_id *segs = malloc((n ? n : 1) * sizeof *segs);
    if (!segs) return (kvmc_rc){kvmc_code(KVMC_ERR_MEMORY), own_error(KVP_ENOMEM, "out of memory")};
    for (size_t i = 0; i < n; i++) {
        const char *bad = NULL;
        if (reqs[i].opcode != KVP_OP_READ && reqs[i].opcode != KVP_OP_WRITE)
            bad = "its opcode is neither READ nor WRITE";
        else if (reqs[i].length && !reqs[i].local)
            bad = "no source memory";
        else if (kvmc_resolve(e, reqs[i].target, &segs[i]))
            bad = "its segment was not opened";
        if (bad) {
            own_error(KVP_EINVAL, "request %zu: %s", i, bad);
            free(segs);
            return invalid;
        }
    }
    char *name = notify ? strdup(notify_name) : NULL;
    char *msg = notify ? strdup(notify_msg) : NULL;
    kvmc_rc rc = {0, KVP_OK};
    pthread_mutex_lock(&b->lock);
    if (notify && (!name || !msg)) {
        rc = (kvmc_rc){kvmc_code(KVMC_ERR_MEMORY), own_error(KVP_ENOMEM, "out of memory")};
    } else if (n > b->capacity - b->count) {
        rc = (kvmc_rc){kvmc_code(KVMC_ERR_TOO_MANY_REQUESTS),
                       own_error(KVP_EINVAL,
                                 "%zu requests exceed the batch's capacity (%zu of %zu used)", n,
                                 b->count, b->capacity)};
    } else if (grow((void **)&b->lengths, &b->cap_lengths, b->count + n, sizeof *b->lengths) ||
               grow((void **)&b->chunks, &b->cap_chunks, b->n_chunks + n, sizeof *b->chunks)) {
        rc = (kvmc_rc){kvmc_code(KVMC_ERR_MEMORY), own_error(KVP_ENOMEM, "out of memory")};
    } else {
        rc = submit_runs(e, b, reqs, n, segs);
    }
    if (!rc.mc && notify) {
        free(b->notify_name);
        free(b->notify_msg);
        b->notify_name = name;
        b->notify_msg = msg;
        b->notify_target = reqs[0].target;
        name = msg = NULL;
    }
    pthread_mutex_unlock(&b->lock);
    free(name);
    free(msg);
    free(segs);
    return rc;
}

/* Whether every request submitted completed, and the first failed one's
 * status; under b->lock. Judged by the requests' statuses, as
 * getTransferStatus reports them: a chunk's on_complete runs a moment after
 * its last request's status is out, and a caller who saw every task done may
 * free the batch at once (batch_destroy's kvp_batch_free waits for it). */
static int batch_done(mc_batch *b, kvp_status *first_error)
{
    *first_error = KVP_OK;
    for (size_t c = 0; c < b->n_chunks; c++)
        for (size_t i = 0; i < b->chunks[c].n; i++) {
            kvp_status st = kvp_batch_request_status(b->chunks[c].batch, i);
            if (st == KVP_EINPROGRESS) return 0;
            if (!*first_error) *first_error = st;
        }
    return 1;
}

kvp_status kvmc_task_status(kvmc_engine *e, uint64_t id, size_t task, kvp_status *status,
                            uint64_t *bytes)
{
    mc_batch *b = get_batch(e, id);
    if (!b || !status) return no_batch(id);
    pthread_mutex_lock(&b->lock);
    if (task >= b->count) {
        pthread_mutex_unlock(&b->lock);
        return own_error(KVP_EINVAL, "batch %llu has no task %zu", (unsigned long long)id, task);
    }
    size_t lo = 0, hi = b->n_chunks; /* the chunk holding task */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (b->chunks[mid].first <= task)
            lo = mid;
        else
            hi = mid;
    }
    const chunk *c = &b->chunks[lo];
    *status = kvp_batch_request_status(c->batch, task - c->first);
    if (bytes) *bytes = b->lengths[task];
    /* As Mooncake: the call that first sees the whole batch done sends its
     * notification, before it returns. */
    char *name = NULL, *msg = NULL;
    int64_t target = 0;
    kvp_status failed;
    if (*status == KVP_OK && b->notify_name && batch_done(b, &failed) && !failed) {
        name = b->notify_name;
        msg = b->notify_msg;
        target = b->notify_target;
        b->notify_name = b->notify_msg = NULL;
    }
    pthread_mutex_unlock(&b->lock);
    if (name) {
        kvp_segment_id seg;
        kvp_status st = kvmc_resolve(e, target, &seg);
        if (!st) st = kvp_rc(kvp_engine_notify(e->kvp, seg, name, msg));
        if (st && kvp_log_get_level() >= KVP_LOG_ERROR)
            fprintf(stderr,
                    "ERROR kvpipe mooncake: failed to send the batch's notify message: "
                    "%s: %s\n",
                    kvp_strerror(st), kvmc_last_error());
    }
    free(name);
    free(msg);
    return KVP_OK;
}

kvp_status kvmc_batch_progress(kvmc_engine *e, uint64_t id, int *complete, kvp_status *first_error)
{
    mc_batch *b = get_batch(e, id);
    if (!b) return no_batch(id);
    pthread_mutex_lock(&b->lock);
    *complete = batch_done(b, first_error);
    pthread_mutex_unlock(&b->lock);
    return KVP_OK;
}

kvp_status kvmc_batch_watch(kvmc_engine *e, uint64_t id, int fd)
{
    mc_batch *b = get_batch(e, id);
    if (!b) return no_batch(id);
    pthread_mutex_lock(&b->lock);
    pthread_mutex_lock(&b->watch_lock);
    kvp_status st = KVP_OK;
    uint64_t one = 1;
    if (fd < 0)
        b->watch_fd = -1; /* from now on no callback writes the old fd */
    else if (b->watch_fd >= 0)
        st = own_error(KVP_EBUSY, "another thread waits for batch %llu", (unsigned long long)id);
    else if (b->done >= b->n_chunks && write(fd, &one, sizeof one) < 0)
        st = own_error(KVP_EIO, "cannot write the waiter's eventfd");
    else
        b->watch_fd = fd;
    pthread_mutex_unlock(&b->watch_lock);
    pthread_mutex_unlock(&b->lock);
    return st;
}

kvmc_rc kvmc_batch_free(kvmc_engine *e, uint64_t id, int force)
{
    pthread_mutex_lock(&e->lock);
    size_t index;
    mc_batch *b = find_batch(e, id, &index);
    if (!b) {
        pthread_mutex_unlock(&e->lock);
        return (kvmc_rc){kvmc_code(KVMC_ERR_INVALID_ARGUMENT),
                         own_error(KVP_EINVAL, "unknown or already collected batch id %llu",
                                   (unsigned long long)id)};
    }
    pthread_mutex_lock(&b->lock);
    kvp_status failed;
    int busy = !force && !batch_done(b, &failed);
    if (!busy) e->batches[index] = e->batches[--e->n_batches];
    pthread_mutex_unlock(&b->lock);
    pthread_mutex_unlock(&e->lock);
    if (busy)
        return (kvmc_rc){kvmc_code(KVMC_ERR_BATCH_BUSY),
                         own_error(KVP_EBUSY, "batch %llu still runs", (unsigned long long)id)};
    batch_destroy(b, 0);
    return (kvmc_rc){0, KVP_OK};
}
