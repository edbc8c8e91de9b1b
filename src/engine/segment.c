#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "engine/engine_internal.h"

kvp_status kvp_engine_open_segment(kvp_engine *e, const char *name, kvp_segment_id *out)
{
    if (!e || !name || !*name || !out)
        return kvpi_error(KVP_EINVAL, "open_segment: empty segment name");
    kvp_status st = KVP_OK;
    kvpi_segment *seg = NULL;
    size_t id;
    pthread_mutex_lock(&e->segments_lock);
    for (id = 0; id < e->n_segments; id++)
        if (strcmp(e->segments[id]->name, name) == 0) break;
    if (id == e->n_segments) {
        if (e->n_segments == e->cap_segments) {
            size_t cap = e->cap_segments ? e->cap_segments * 2 : 16;
            kvpi_segment **grown = realloc(e->segments, cap * sizeof *grown);
            if (!grown) {
                st = kvpi_error(KVP_ENOMEM, "open_segment: out of memory");
                goto out;
            }
            e->segments = grown;
            e->cap_segments = cap;
        }
        seg = calloc(1, sizeof *seg);
        if (!seg || !(seg->name = strdup(name))) {
            free(seg);
            st = kvpi_error(KVP_ENOMEM, "open_segment: out of memory");
            goto out;
        }
        pthread_mutex_init(&seg->lock, NULL);
        atomic_init(&seg->group_bytes, KVPI_GROUP_BYTES_DEFAULT);
        e->segments[e->n_segments++] = seg;
    }
    seg = e->segments[id];
out:
    pthread_mutex_unlock(&e->segments_lock);
    if (st) return st;
    /* Look the peer up now, so that a missing segment is reported here. */
    kvpi_peer *peer;
    if ((st = kvpi_segment_acquire(e, seg, &peer))) return st;
    kvpi_segment_release(seg, peer, 0);
    *out = (kvp_segment_id)id;
    return KVP_OK;
}

kvpi_segment *kvpi_segment_get(kvp_engine *e, kvp_segment_id id)
{
    pthread_mutex_lock(&e->segments_lock);
    kvpi_segment *seg = id < e->n_segments ? e->segments[id] : NULL;
    pthread_mutex_unlock(&e->segments_lock);
    return seg;
}

const char *kvp_engine_segment_transport(kvp_engine *e, kvp_segment_id id)
{
    kvpi_segment *seg = kvpi_segment_get(e, id);
    if (!seg) return NULL;
    pthread_mutex_lock(&seg->lock);
    const char *name = seg->transport;
    pthread_mutex_unlock(&seg->lock);
    return name;
}

static void peer_put(kvpi_peer *peer);

kvp_status kvp_engine_segment_buffers(kvp_engine *e, kvp_segment_id id, kvp_remote_buffer *out,
                                      size_t cap, size_t *count)
{
    kvpi_segment *seg = e && count ? kvpi_segment_get(e, id) : NULL;
    if (!seg) return kvpi_error(KVP_EINVAL, "segment_buffers: segment id %u is not open", id);
    kvpi_peer *peer;
    kvp_status st = kvpi_segment_acquire(e, seg, &peer);
    if (st) return st;
    for (size_t i = 0; i < peer->desc.n_regions && i < cap; i++)
        out[i] = (kvp_remote_buffer){peer->desc.regions[i].addr, peer->desc.regions[i].length};
    *count = peer->desc.n_regions;
    kvpi_segment_release(seg, peer, 0);
    return KVP_OK;
}

static void peer_put(kvpi_peer *peer)
{
    if (atomic_fetch_sub(&peer->refs, 1) != 1) return;
    peer->ops->peer_close(peer->handle);
    kvpi_descriptor_free(&peer->desc);
    free(peer->host);
    free(peer);
}

/* May the engine use this transport for a peer? The protocol's own transport,
 * and same-host transports as an automatic upgrade of a network protocol. */
static int transport_allowed(const kvp_engine *e, const kvpi_transport_ops *ops)
{
    if (ops == e->transport) return 1;
    if (e->transport->caps & KVPI_TRANSPORT_SAME_HOST) return 0;
    return (ops->caps & KVPI_TRANSPORT_SAME_HOST) && !e->opts.disable_shm;
}

static kvp_status peer_connect(kvp_engine *e, kvpi_peer *peer, const char *segname)
{
    kvpi_peer_ctx ctx = {.host = peer->host,
                         .desc = peer->desc.json,
                         .regions = peer->desc.regions,
                         .n_regions = peer->desc.n_regions,
                         .timeout_ms = e->opts.timeout_ms,
                         .min_rate = e->opts.min_transfer_rate,
                         .conns = e->opts.conns_per_peer,
                         .retries = &e->metrics.retries,
                         .auth = e->auth};
    for (size_t i = 0; kvpi_transports[i]; i++) {
        const kvpi_transport_ops *ops = kvpi_transports[i];
        if (!transport_allowed(e, ops)) continue;
        kvp_status st = ops->peer_open(&ctx, &peer->handle);
        if (st == KVP_OK) {
            peer->ops = ops;
            return KVP_OK;
        }
        if (st != KVP_ENOTSUP || ops == e->transport) return st;
        KVPI_INFO("segment %s: not using %s: %s", segname, ops->name, kvp_last_error());
    }
    return kvpi_error(KVP_ENOTSUP, "segment %s: no transport can reach it", segname);
}

/* Authenticated: only a descriptor signed with an accepted key, fresh and of
 * this name, is used. Without a key, a signed one belongs to an engine that
 * will refuse us: say so now rather than fail at its listener. */
static kvp_status check_signature(const kvp_engine *e, const char *name, const char *text)
{
    if (e->auth) return kvpi_auth_desc_verify(e->auth, text, name, e->opts.auth_max_age_ms);
    if (!kvpi_auth_desc_signed(text)) return KVP_OK;
    return kvpi_error(KVP_EAUTH,
                      "segment %s is authenticated (its descriptor is signed) and this engine "
                      "has no key: give it the same key file (env " KVPI_AUTH_ENV
                      " or auth_key_file; docs/security.md)",
                      name);
}

static kvp_status peer_lookup(kvp_engine *e, const char *name, kvpi_peer **out)
{
    kvpi_peer *peer = calloc(1, sizeof *peer);
    if (!peer) return kvpi_error(KVP_ENOMEM, "segment lookup: out of memory");
    char *own = kvpi_engine_descriptor_text(e);
    char *text = NULL;
    kvp_status st = kvpi_meta_fetch(e->meta, name, own, &text, &peer->host);
    free(own);
    if (st) goto fail;
    st = check_signature(e, name, text);
    if (!st) st = kvpi_descriptor_parse(text, &peer->desc);
    free(text);
    if (st) goto fail;
    if ((st = peer_connect(e, peer, name))) goto fail;
    atomic_init(&peer->refs, 1);
    *out = peer;
    return KVP_OK;
fail:
    kvpi_descriptor_free(&peer->desc);
    free(peer->host);
    free(peer);
    return st;
}

kvp_status kvpi_segment_acquire(kvp_engine *e, kvpi_segment *seg, kvpi_peer **out)
{
    kvp_status st = KVP_OK;
    /* The lock is held across a lookup, so that workers racing to a segment
     * that failed look it up once. */
    pthread_mutex_lock(&seg->lock);
    if (!seg->peer) {
        kvpi_counter_add(&e->metrics.lookups, 1);
        if (seg->looked_up) kvpi_counter_add(&e->metrics.refreshes, 1);
        st = peer_lookup(e, seg->name, &seg->peer);
        if (st == KVP_OK) {
            seg->looked_up = 1;
            const kvpi_transport_ops *ops = seg->peer->ops;
            seg->transport = ops->name;
            atomic_store(&seg->group_bytes,
                         ops->group_bytes ? ops->group_bytes : KVPI_GROUP_BYTES_DEFAULT);
        }
    }
    if (st == KVP_OK) {
        atomic_fetch_add(&seg->peer->refs, 1);
        *out = seg->peer;
    }
    pthread_mutex_unlock(&seg->lock);
    return st;
}

void kvpi_segment_release(kvpi_segment *seg, kvpi_peer *peer, int failed)
{
    if (failed) {
        pthread_mutex_lock(&seg->lock);
        if (seg->peer == peer) {
            seg->peer = NULL;
            peer_put(peer);
        }
        pthread_mutex_unlock(&seg->lock);
    }
    peer_put(peer);
}

void kvpi_segment_note(kvpi_segment *seg, kvp_status st)
{
    pthread_mutex_lock(&seg->lock);
    int was_failing = seg->failing;
    seg->failing = st != KVP_OK;
    pthread_mutex_unlock(&seg->lock);
    if (st && !was_failing)
        KVPI_WARN("segment %s: %s (the next transfer looks it up again)", seg->name,
                  kvp_last_error());
    else if (st)
        KVPI_DEBUG("segment %s: %s", seg->name, kvp_last_error());
}

void kvpi_segments_destroy(kvp_engine *e)
{
    for (size_t i = 0; i < e->n_segments; i++) {
        kvpi_segment *seg = e->segments[i];
        if (seg->peer) peer_put(seg->peer);
        pthread_mutex_destroy(&seg->lock);
        free(seg->name);
        free(seg);
    }
    free(e->segments);
    e->segments = NULL;
    e->n_segments = 0;
}
