#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/sized.h"
#include "common/log.h"
#include "engine/engine_ext.h"
#include "engine/engine_internal.h"
#include "engine/protocol.h"

#define DEFAULT_WORKERS 4
#define DEFAULT_CONNS 4
#define DEFAULT_SLICE (4u << 20)
#define KEEPER_INTERVAL_MS 2000

static kvp_engine_opts default_opts(void)
{
    return (kvp_engine_opts){.protocol = "tcp",
                             .timeout_ms = KVPI_DEFAULT_TIMEOUT_MS,
                             .workers = DEFAULT_WORKERS,
                             .conns_per_peer = DEFAULT_CONNS,
                             .slice_size = DEFAULT_SLICE,
                             .max_connections = KVPI_CONN_MAX_DEFAULT,
                             .idle_timeout_ms = KVPI_CONN_IDLE_MS_DEFAULT,
                             .min_transfer_rate = KVPI_MIN_RATE_DEFAULT,
                             .auth_max_age_ms = KVPI_AUTH_MAX_AGE_MS_DEFAULT,
                             .integrity = KVP_INTEGRITY_ENV};
}

void kvp_engine_opts_init_size(kvp_engine_opts *opts, size_t size)
{
    kvp_engine_opts d = default_opts();
    if (opts) kvpi_sized_out(opts, size, &d, sizeof d);
}

/* Add an upper layer's members (engine_ext.h), except those the descriptor
 * has already. -1 when out of memory. */
static int add_fields(cJSON *doc, const cJSON *fields)
{
    const cJSON *f;
    cJSON_ArrayForEach(f, fields)
    {
        if (cJSON_HasObjectItem(doc, f->string)) continue;
        cJSON *copy = cJSON_Duplicate(f, 1);
        if (!copy || !cJSON_AddItemToObject(doc, f->string, copy)) {
            cJSON_Delete(copy);
            return -1;
        }
    }
    return 0;
}

/* The descriptor's "protocol": the first running transport whose wire
 * Mooncake speaks says what it is. */
static const char *mooncake_protocol(const kvp_engine *e)
{
    for (size_t i = 0; e->transports[i]; i++)
        if (e->servers[i] && e->transports[i]->mooncake_protocol)
            return e->transports[i]->mooncake_protocol;
    return NULL;
}

/* Every running transport's fields: its own top-level ones, then its fields
 * of each buffer it registered (entries in the order of regions). */
static kvp_status describe_transports(kvp_engine *e, cJSON *doc, const kvpi_region *regions)
{
    cJSON *buffers = cJSON_GetObjectItemCaseSensitive(doc, "buffers");
    for (size_t i = 0; e->transports[i]; i++) {
        const kvpi_transport_ops *ops = e->transports[i];
        if (!e->servers[i]) continue;
        kvp_status st = ops->server_describe(e->servers[i], doc);
        if (st) return st;
        if (!ops->buffer_describe) continue;
        const kvpi_region *r = regions;
        cJSON *b;
        cJSON_ArrayForEach(b, buffers)
        {
            /* Only regions it registered: of a kind it moves. */
            if ((ops->mem_kinds & KVPI_MEM_BIT(r->kind)) &&
                (st = ops->buffer_describe(e->servers[i], r, r->handle[i], b)))
                return st;
            r++;
        }
    }
    return KVP_OK;
}

/* Build the descriptor from the region table and every transport's fields.
 * The regions stay pinned meanwhile, so that their handles stay valid. */
static kvp_status descriptor_render(kvp_engine *e, char **out)
{
    kvpi_pin *pins;
    size_t n;
    kvp_status st = kvpi_region_pin_all(&e->regions, &pins, &n);
    if (st) return st;
    kvpi_region *regions = malloc((n ? n : 1) * sizeof *regions);
    cJSON *doc = NULL;
    char *text = NULL;
    if (regions) {
        for (size_t i = 0; i < n; i++)
            regions[i] = *kvpi_pin_region(pins[i]);
        doc = kvpi_descriptor_build(e->name, mooncake_protocol(e), regions, n);
    }
    st =
        doc && cJSON_AddStringToObject(doc, KVPI_INSTANCE_FIELD, e->instance) &&
                (!e->integrity || cJSON_AddStringToObject(doc, KVPI_DIGEST_FIELD, KVPI_DIGEST_NAME))
            ? KVP_OK
            : kvpi_error(KVP_ENOMEM, "cannot render the segment descriptor: out of memory");
    if (!st) st = describe_transports(e, doc, regions);
    if (!st && add_fields(doc, e->fields))
        st = kvpi_error(KVP_ENOMEM, "cannot render the segment descriptor: out of memory");
    if (!st && !(text = cJSON_PrintUnformatted(doc)))
        st = kvpi_error(KVP_ENOMEM, "cannot render the segment descriptor: out of memory");
    cJSON_Delete(doc);
    free(regions);
    kvpi_region_unpin_all(&e->regions, pins, n);
    if (!st && e->auth) {
        char *signed_text = kvpi_auth_desc_sign(e->auth, text);
        free(text);
        text = signed_text;
        if (!text) st = kvpi_error(KVP_ENOMEM, "cannot sign the segment descriptor: out of memory");
    }
    if (!st) *out = text;
    return st;
}

/* Authenticated: the descriptor's signature is a quarter of its accepted age
 * old, so it is signed anew before peers would find it stale. */
static int sign_due(const kvp_engine *e)
{
    return e->auth &&
           kvpi_now_ns() - e->desc_signed_ns > (uint64_t)e->opts.auth_max_age_ms * 1000000u / 4;
}

static kvp_status render_locked(kvp_engine *e);

char *kvpi_engine_descriptor_text(kvp_engine *e)
{
    pthread_mutex_lock(&e->publish_lock);
    /* A handshake answer must not be stale either (P2P mode has no keeper). */
    if (e->desc_text && sign_due(e) && render_locked(e))
        KVPI_WARN("segment %s: cannot sign its descriptor anew: %s", e->name, kvp_last_error());
    char *copy = e->desc_text ? strdup(e->desc_text) : NULL;
    pthread_mutex_unlock(&e->publish_lock);
    return copy;
}

static char *rpc_describe(void *ctx)
{
    return kvpi_engine_descriptor_text(ctx);
}

/* Render the descriptor anew into e->desc_text; called with publish_lock. */
static kvp_status render_locked(kvp_engine *e)
{
    char *text;
    kvp_status st = descriptor_render(e, &text);
    if (st) return st;
    free(e->desc_text);
    e->desc_text = text;
    e->desc_signed_ns = kvpi_now_ns();
    return KVP_OK;
}

/* What the metadata layer needs to know of this engine, with descriptor desc
 * (e->desc_text only while publish_lock is held: it changes under it). */
static kvpi_meta_self self_of(const kvp_engine *e, const char *desc)
{
    return (kvpi_meta_self){.segment = e->name,
                            .desc_json = desc,
                            .rpc_host = e->self.host,
                            .rpc_port = e->self.port,
                            .instance = e->instance};
}

/* Render and publish the descriptor (only its ram key: rpc_meta was written
 * once, at creation); the lock keeps concurrent registrations from publishing
 * out of order. */
kvp_status kvpi_engine_publish(kvp_engine *e)
{
    pthread_mutex_lock(&e->publish_lock);
    kvp_status st = render_locked(e);
    if (!st) st = kvpi_meta_publish(e->meta, e->name, e->desc_text);
    /* The store missed this one (it may be down): the keeper renders and
     * publishes anew once it answers. */
    if (st) e->desc_stale = 1;
    pthread_mutex_unlock(&e->publish_lock);
    return st;
}

/* The rendered descriptor no longer matches the region table (a registration was
 * rolled back after its publish failed): the keeper renders it again. */
void kvpi_engine_mark_stale(kvp_engine *e)
{
    pthread_mutex_lock(&e->publish_lock);
    e->desc_stale = 1;
    pthread_mutex_unlock(&e->publish_lock);
}

/* Take the segment's name in the store. Not under publish_lock: taking over a
 * stale name asks the rpc_meta's address who answers there, and that may be
 * this engine's own handshake server, which reads the descriptor under it. */
static kvp_status claim(kvp_engine *e)
{
    pthread_mutex_lock(&e->publish_lock);
    kvp_status st = render_locked(e);
    char *text = st ? NULL : strdup(e->desc_text);
    pthread_mutex_unlock(&e->publish_lock);
    if (st) return st;
    if (!text) return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    kvpi_meta_self me = self_of(e, text);
    st = kvpi_meta_claim(e->meta, &me);
    free(text);
    if (st == KVP_OK) e->claimed = 1;
    return st;
}

/* One look of the keeper: read the store without the publish lock (a slow
 * store must not hold registrations up), write back under it. What is
 * written is the descriptor current then, which is what the store should
 * hold even if a registration published it meanwhile. */
static kvp_status keep_once(kvp_engine *e)
{
    pthread_mutex_lock(&e->publish_lock);
    kvp_status st = KVP_OK;
    if ((e->desc_stale || sign_due(e)) && (st = render_locked(e)) == KVP_OK) e->desc_stale = 0;
    char *text = st ? NULL : strdup(e->desc_text);
    pthread_mutex_unlock(&e->publish_lock);
    if (st) return st;
    if (!text) return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    kvpi_meta_self me = self_of(e, text);
    kvpi_meta_lost lost;
    st = kvpi_meta_check(e->meta, &me, &lost);
    free(text);
    if (st || (!lost.rpc_meta && !lost.descriptor)) return st;
    if (lost.forged || lost.rpc_foreign)
        KVPI_WARN_LIMITED("segment %s: its %s in the metadata store %s not written with the "
                          "key (forged, garbage or unsigned): putting the genuine one back",
                          e->name, lost.forged ? "descriptor" : "rpc_meta",
                          lost.forged ? "was" : "points elsewhere and was");
    pthread_mutex_lock(&e->publish_lock);
    me = self_of(e, e->desc_text);
    st = kvpi_meta_restore(e->meta, &me, &lost);
    pthread_mutex_unlock(&e->publish_lock);
    return st;
}

/* Put back what the store lost (a restarted store comes back empty), so that
 * peers find this engine again without a restart on its side. Keys another
 * engine took are left to it. */
static void *keeper_main(void *arg)
{
    kvp_engine *e = arg;
    kvp_status last = KVP_OK;
    pthread_mutex_lock(&e->keeper_lock);
    while (!e->keeper_stop) {
        struct timespec dl = kvpi_deadline_after_ms(KEEPER_INTERVAL_MS);
        pthread_cond_timedwait(&e->keeper_cond, &e->keeper_lock, &dl);
        if (e->keeper_stop) break;
        pthread_mutex_unlock(&e->keeper_lock);
        kvp_status st = keep_once(e);
        /* Once per change of state, not every interval. */
        if (st && st != last)
            KVPI_WARN("segment %s: metadata store: %s", e->name, kvp_last_error());
        if (!st && last) KVPI_INFO("segment %s: published again in the metadata store", e->name);
        last = st;
        pthread_mutex_lock(&e->keeper_lock);
    }
    pthread_mutex_unlock(&e->keeper_lock);
    return NULL;
}

static kvp_status copy_opts(kvp_engine *e, const kvp_engine_opts *o)
{
    if (!o->local_server_name || !o->metadata)
        return kvpi_error(KVP_EINVAL, "engine: local_server_name and metadata are required");
    e->opts = *o;
    if (e->opts.timeout_ms <= 0) e->opts.timeout_ms = KVPI_DEFAULT_TIMEOUT_MS;
    if (e->opts.workers <= 0) e->opts.workers = DEFAULT_WORKERS;
    if (e->opts.conns_per_peer <= 0) e->opts.conns_per_peer = DEFAULT_CONNS;
    if (e->opts.slice_size == 0) e->opts.slice_size = DEFAULT_SLICE;
    if (e->opts.max_connections <= 0) e->opts.max_connections = KVPI_CONN_MAX_DEFAULT;
    if (e->opts.idle_timeout_ms <= 0) e->opts.idle_timeout_ms = KVPI_CONN_IDLE_MS_DEFAULT;
    if (e->opts.min_transfer_rate == 0) e->opts.min_transfer_rate = KVPI_MIN_RATE_DEFAULT;
    if (e->opts.auth_max_age_ms <= 0) e->opts.auth_max_age_ms = KVPI_AUTH_MAX_AGE_MS_DEFAULT;
    e->opts.auth_key_file = NULL; /* read once, below */
    kvp_status st = kvpi_integrity_resolve(o->integrity, &e->integrity);
    if (st) return st;
    st = kvpi_auth_resolve(o->auth_key_file, &e->auth);
    if (st) return st;
    st = kvpi_protocol_resolve(o->protocol, &e->transport);
    if (st) return st;
    /* The list's transport of that name: a test's list may hold a variant of
     * a built-in table (another mem_kinds). */
    size_t n = 0;
    while (e->transports[n] && strcmp(e->transports[n]->name, e->transport->name) != 0)
        n++;
    if (!e->transports[n])
        return kvpi_error(KVP_ENOTSUP, "engine: the %s transport is not among this engine's",
                          e->transport->name);
    e->transport = e->transports[n];
    for (n = 0; e->transports[n]; n++)
        if (n == KVPI_MAX_TRANSPORTS)
            return kvpi_error(KVP_EINVAL, "engine: more than %d transports", KVPI_MAX_TRANSPORTS);
    e->n_transports = n;
    const char *proto = e->transport->name;
    st = kvpi_hostport_parse(o->local_server_name, -1, &e->self);
    if (st) return st;
    /* Where to listen and what to give peers (net.h, kvpi_advert_choose). */
    const char *forced = o->bind_address, *forced_by = "kvp_engine_opts.bind_address";
    if (!forced || !*forced) {
        forced = getenv("MC_TCP_BIND_ADDRESS");
        forced_by = "env MC_TCP_BIND_ADDRESS";
    }
    if ((st = kvpi_advert_choose(e->self.host, forced, forced_by, &e->advert))) return st;
    snprintf(e->self.host, sizeof e->self.host, "%s", e->advert.host);
    e->opts.bind_address = NULL; /* not kept: e->advert is */
    e->metadata_conn = strdup(o->metadata);
    e->protocol = strdup(proto);
    if (!e->metadata_conn || !e->protocol) return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    e->opts.metadata = e->metadata_conn;
    e->opts.protocol = e->protocol;
    e->opts.device_names = NULL;
    if (o->device_names && !(e->opts.device_names = e->device_names = strdup(o->device_names)))
        return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    return KVP_OK;
}

/* A random id that tells this engine's descriptor from one an earlier process
 * of the same name left in the store. */
static kvp_status draw_instance(kvp_engine *e)
{
    unsigned char raw[16];
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return kvpi_error(KVP_EIO, "engine: getrandom: %s", strerror(errno));
        got += (size_t)n;
    }
    for (size_t i = 0; i < sizeof raw; i++)
        snprintf(e->instance + 2 * i, 3, "%02x", raw[i]);
    return KVP_OK;
}

/* Serve handshakes on the port of the segment name. That port taken means
 * another process - most likely an engine of the same name - serves there. */
static kvp_status start_rpc(kvp_engine *e)
{
    kvpi_conn_limits limits = {.timeout_ms = e->opts.timeout_ms,
                               .max_conns = e->opts.max_connections,
                               .min_rate = e->opts.min_transfer_rate};
    kvp_status st = kvpi_rpc_server_start_notify(e->advert.bind, e->self.port, &limits, e->auth,
                                                 rpc_describe, kvpi_notify_receive, e, &e->rpc);
    if (st != KVP_EBUSY) return st;
    return kvpi_error(KVP_EBUSY,
                      "segment name '%s' is in use on this host: its handshake port is taken, "
                      "by another engine of this name or another program (%s); stop it or "
                      "choose another local_server_name",
                      e->opts.local_server_name, kvp_last_error());
}

/* The segment name is host:port of the handshake server, whose port may have
 * been chosen by the system (port 0). */
static kvp_status name_segment(kvp_engine *e)
{
    char name[KVPI_HOST_MAX + 8];
    e->self.port = kvpi_rpc_server_port(e->rpc);
    kvpi_hostport_format(e->self.host, e->self.port, name, sizeof name);
    if (!(e->name = strdup(name))) return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    e->opts.local_server_name = e->name;
    return KVP_OK;
}

/* Where the server of ops counts what it serves: the engine's slot for it
 * among the built transports the metrics name (none for another). */
static kvpi_served *served_slot(kvp_engine *e, const kvpi_transport_ops *ops)
{
    for (size_t i = 0; kvpi_transports[i] && i < KVPI_TRANSPORTS_MAX; i++)
        if (kvpi_transports[i] == ops) return &e->metrics.served[i];
    return NULL;
}

static kvp_status start_servers(kvp_engine *e)
{
    kvpi_server_ctx ctx = {.segment = e->name,
                           .host = e->advert.bind,
                           .regions = &e->regions,
                           .device_names = e->opts.device_names,
                           .timeout_ms = e->opts.timeout_ms,
                           .idle_timeout_ms = e->opts.idle_timeout_ms,
                           .max_conns = e->opts.max_connections,
                           .min_rate = e->opts.min_transfer_rate,
                           .auth = e->auth};
    for (size_t i = 0; e->transports[i]; i++) {
        const kvpi_transport_ops *ops = e->transports[i];
        ctx.served = served_slot(e, ops);
        kvp_status st = kvpi_transport_check(ops);
        if (!st && e->auth && !(ops->caps & KVPI_CAP_AUTH))
            st = kvpi_error(KVP_ENOTSUP,
                            "the %s transport does not authenticate its peers, so the "
                            "authenticated mode does not run it (docs/security.md)",
                            ops->name);
        if (!st) st = ops->server_start(&ctx, &e->servers[i]);
        if (st == KVP_OK) {
            if (ops->mooncake_protocol && !e->data_port && ops->server_port)
                e->data_port = ops->server_port(e->servers[i]);
            continue;
        }
        e->servers[i] = NULL;
        /* Mooncake's wire always serves, and the protocol asked for must;
         * any other transport is an addition whose absence is not fatal. */
        if (!ops->mooncake_protocol && ops != e->transport) {
            KVPI_INFO("engine %s: %s transport unavailable: %s", e->name, ops->name,
                      kvp_last_error());
            continue;
        }
        return st;
    }
    return KVP_OK;
}

kvp_status kvp_engine_create_size(const kvp_engine_opts *opts, size_t size, kvp_engine **out)
{
    if (!opts) return kvpi_error(KVP_EINVAL, "engine: NULL argument");
    kvp_engine_opts o = default_opts();
    kvp_status st = kvpi_sized_in(&o, sizeof o, opts, size, "kvp_engine_opts");
    return st ? st : kvpi_engine_create_with(&o, kvpi_transports, out);
}

static kvp_status engine_create(const kvp_engine_opts *opts,
                                const kvpi_transport_ops *const *transports, const cJSON *fields,
                                kvp_engine **out);

kvp_status kvpi_engine_create_with(const kvp_engine_opts *opts,
                                   const kvpi_transport_ops *const *transports, kvp_engine **out)
{
    return engine_create(opts, transports, NULL, out);
}

kvp_status kvpi_engine_create_with_fields(const kvp_engine_opts *opts, const cJSON *fields,
                                          kvp_engine **out)
{
    return engine_create(opts, kvpi_transports, fields, out);
}

/* Both of the above: an engine on these transports, whose descriptor also
 * carries an upper layer's fields (NULL: none). */
static kvp_status engine_create(const kvp_engine_opts *opts,
                                const kvpi_transport_ops *const *transports, const cJSON *fields,
                                kvp_engine **out)
{
    if (!opts || !out || !transports) return kvpi_error(KVP_EINVAL, "engine: NULL argument");
    if (fields && !cJSON_IsObject(fields))
        return kvpi_error(KVP_EINVAL, "engine: descriptor fields must be a JSON object");
    kvp_engine *e = calloc(1, sizeof *e);
    if (!e) return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    if (fields && !(e->fields = cJSON_Duplicate(fields, 1))) {
        free(e);
        return kvpi_error(KVP_ENOMEM, "engine: out of memory");
    }
    e->transports = transports;
    kvpi_region_table_init(&e->regions);
    pthread_mutex_init(&e->publish_lock, NULL);
    pthread_mutex_init(&e->segments_lock, NULL);
    pthread_mutex_init(&e->keeper_lock, NULL);
    kvpi_cond_init(&e->keeper_cond);
    pthread_mutex_init(&e->watch_lock, NULL);
    kvpi_notify_init(e);
    kvp_status st;
    if ((st = kvpi_cq_init(e))) goto fail;
    if ((st = copy_opts(e, opts))) goto fail;
    if ((st = kvpi_meta_open(e->metadata_conn, e->opts.timeout_ms, rpc_describe, e, &e->meta)))
        goto fail;
    if (e->auth) kvpi_meta_set_auth(e->meta, e->auth, e->opts.auth_max_age_ms);
    if ((st = draw_instance(e))) goto fail;
    if ((st = start_rpc(e))) goto fail;
    if ((st = name_segment(e))) goto fail;
    if ((st = start_servers(e))) goto fail;
    if ((st = kvpi_engine_pool_start(e))) goto fail;
    if ((st = kvpi_workers_start(e))) goto fail;
    /* The endpoint's scrapes read the pool: only once it is in place. */
    if ((st = kvpi_engine_metrics_start(e))) goto fail;
    if ((st = claim(e))) goto fail;
    if (!kvpi_meta_is_p2p(e->meta)) {
        if (pthread_create(&e->keeper, NULL, keeper_main, e) != 0) {
            st = kvpi_error(KVP_EIO, "engine: cannot start a thread: %s", strerror(errno));
            goto fail;
        }
        e->keeper_started = 1;
    }
    KVPI_INFO("engine %s: serving (data port %d, metadata %s%s%s)", e->name, e->data_port,
              e->metadata_conn, e->auth ? ", authenticated with key id " : "",
              e->auth ? kvpi_auth_kid(e->auth) : "");
    KVPI_INFO("engine %s: peers are given %s (%s); its listeners bind %s", e->name, e->self.host,
              e->advert.why, e->advert.bind);
    *out = e;
    return KVP_OK;
fail : {
    /* Keep the first failure's detail across the teardown's own calls. */
    kvpi_error_kept detail = kvpi_error_keep();
    kvp_engine_destroy(e);
    return kvpi_error(st, "%s", detail.text);
}
}

void kvp_engine_destroy(kvp_engine *e)
{
    if (!e) return;
    kvpi_engine_metrics_stop(e);
    if (e->keeper_started)
        kvpi_thread_stop(e->keeper, &e->keeper_lock, &e->keeper_cond, &e->keeper_stop);
    kvpi_segments_watch_stop(e);
    if (e->claimed) {
        kvpi_meta_self me = self_of(e, e->desc_text); /* every other thread has stopped */
        if (kvpi_meta_release(e->meta, &me))
            KVPI_INFO("segment %s: cannot remove its keys: %s", e->name, kvp_last_error());
    }
    kvpi_workers_stop(e);
    kvpi_segments_destroy(e);
    kvpi_rpc_server_stop(e->rpc);
    kvpi_notify_destroy(e);
    /* The pool unregisters its chunks through the engine: no publishing now.
     * Every region is unregistered from the transports before their servers
     * stop, since a server may own what its registrations use. */
    kvpi_meta_close(e->meta);
    e->meta = NULL;
    kvpi_pool_destroy(e->pool);
    kvpi_engine_unregister_all(e);
    for (size_t i = 0; e->transports[i]; i++)
        if (e->servers[i]) e->transports[i]->server_stop(e->servers[i]);
    kvpi_region_table_destroy(&e->regions);
    kvpi_cq_destroy(e);
    pthread_mutex_destroy(&e->publish_lock);
    pthread_mutex_destroy(&e->segments_lock);
    pthread_mutex_destroy(&e->keeper_lock);
    pthread_cond_destroy(&e->keeper_cond);
    pthread_mutex_destroy(&e->watch_lock);
    free(e->desc_text);
    cJSON_Delete(e->fields);
    free(e->name);
    free(e->metadata_conn);
    free(e->protocol);
    free(e->device_names);
    kvpi_auth_free(e->auth);
    free(e);
}

const char *kvp_engine_segment_name(const kvp_engine *e)
{
    return e->name;
}

int kvp_engine_rpc_port(const kvp_engine *e)
{
    return e->self.port;
}

int kvp_engine_data_port(const kvp_engine *e)
{
    return e->data_port;
}
