#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/auth.h"
#include "common/error.h"
#include "common/log.h"
#include "common/util.h"
#include "engine/engine_internal.h"

static void peer_put(kvp_engine *later, kvpi_peer *peer);
static void release(kvp_engine *later, kvpi_segment *seg, kvpi_peer *peer, int failed);

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
        if (kvpi_grow((void **)&e->segments, &e->cap_segments, e->n_segments + 1,
                      sizeof *e->segments) ||
            !(seg = calloc(1, sizeof *seg)) || !(seg->name = strdup(name))) {
            free(seg);
            st = kvpi_error(KVP_ENOMEM, "open_segment: out of memory");
            goto out;
        }
        pthread_mutex_init(&seg->lookup_lock, NULL);
        pthread_mutex_init(&seg->lock, NULL);
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

kvpi_segment *kvpi_segment_find(kvp_engine *e, const char *name)
{
    kvpi_segment *seg = NULL;
    pthread_mutex_lock(&e->segments_lock);
    for (size_t id = 0; id < e->n_segments && !seg; id++)
        if (strcmp(e->segments[id]->name, name) == 0) seg = e->segments[id];
    pthread_mutex_unlock(&e->segments_lock);
    return seg;
}

void kvpi_segment_forget(kvpi_segment *seg)
{
    pthread_mutex_lock(&seg->lookup_lock); /* after a lookup under way, not before */
    pthread_mutex_lock(&seg->lock);
    kvpi_peer *peer = seg->peer;
    seg->peer = NULL;
    pthread_mutex_unlock(&seg->lock);
    pthread_mutex_unlock(&seg->lookup_lock);
    if (peer) peer_put(NULL, peer);
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

kvp_status kvp_engine_segment_instance(kvp_engine *e, kvp_segment_id id, char *out, size_t cap)
{
    kvpi_segment *seg = e && out ? kvpi_segment_get(e, id) : NULL;
    if (!seg) return kvpi_error(KVP_EINVAL, "segment_instance: segment id %u is not open", id);
    if (cap < KVP_INSTANCE_LEN + 1)
        return kvpi_error(KVP_EINVAL, "segment_instance: %zu bytes hold no instance id", cap);
    kvpi_peer *peer;
    kvp_status st = kvpi_segment_acquire(e, seg, &peer);
    if (st) return st;
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(peer->desc.json, KVPI_INSTANCE_FIELD);
    if (cJSON_IsString(f) && strlen(f->valuestring) < cap)
        snprintf(out, cap, "%s", f->valuestring);
    else
        st = kvpi_error(KVP_ENOTFOUND, "segment %s: its descriptor carries no instance id%s",
                        seg->name, cJSON_IsString(f) ? " kvpipe knows" : " (a Mooncake peer?)");
    kvpi_segment_release(seg, peer, 0);
    return st;
}

void kvpi_peer_free(kvpi_peer *peer)
{
    for (size_t i = 0; i < peer->n_links; i++)
        if (peer->links[i].handle) peer->links[i].ops->peer_close(peer->links[i].handle);
    pthread_mutex_destroy(&peer->lock);
    kvpi_descriptor_free(&peer->desc);
    free(peer->host);
    free(peer);
}

/* Drop a reference; the last one closes the peer here, or on later's
 * workers. */
static void peer_put(kvp_engine *later, kvpi_peer *peer)
{
    if (atomic_fetch_sub(&peer->refs, 1) != 1) return;
    if (later)
        kvpi_workers_close(later, peer);
    else
        kvpi_peer_free(peer);
}

/* May the engine use this transport for a peer? Decided by capability, never
 * by name: the protocol's own transport; same-host transports, as an
 * automatic upgrade of a network protocol (unless disable_shm); and the
 * transport of Mooncake's wire, which reaches any peer a network protocol's
 * transport cannot (a Mooncake TCP peer, say). A same-host protocol uses
 * only its own transport. */
static int transport_allowed(const kvp_engine *e, const kvpi_transport_ops *ops)
{
    if (e->auth && !(ops->caps & KVPI_CAP_AUTH)) return 0; /* see KVPI_CAP_AUTH */
    if (ops == e->transport) return 1;
    if (e->transport->caps & KVPI_CAP_SAME_HOST) return 0;
    if (ops->caps & KVPI_CAP_SAME_HOST) return !e->opts.disable_shm;
    return ops->mooncake_protocol != NULL;
}

/* Open link l for the peer, once; on failure it is marked refused and
 * kvp_last_error() says why. Called with the peer's lock held, or before the
 * peer is shared. */
static kvp_status link_open(kvp_engine *e, kvpi_peer *peer, const char *segname, kvpi_link *l)
{
    if (l->handle) return KVP_OK;
    if (l->refused) return kvpi_error(KVP_ENOTSUP, "%s: refused this peer before", l->ops->name);
    kvpi_peer_ctx ctx = {.segment = segname,
                         .host = peer->host,
                         .desc = peer->desc.json,
                         .regions = peer->desc.regions,
                         .buffers = peer->desc.buffers,
                         .n_regions = peer->desc.n_regions,
                         .server = e->servers[l->slot],
                         .timeout_ms = e->opts.timeout_ms,
                         .min_rate = e->opts.min_transfer_rate,
                         .conns = e->opts.conns_per_peer,
                         .retries = &e->metrics.retries,
                         .auth = e->auth,
                         .integrity = peer->integrity};
    kvp_status st = l->ops->peer_open(&ctx, &l->handle);
    if (st) {
        l->handle = NULL;
        l->refused = 1;
    }
    return st;
}

/* Append "name: why" of a refusal to the list in buf (why alone where it
 * starts with the name already). */
static void note_refusal(char *buf, size_t len, const kvpi_link *l, const char *why)
{
    size_t used = strlen(buf), n = strlen(l->ops->name);
    int named = strncmp(why, l->ops->name, n) == 0 && why[n] == ':';
    if (used < len)
        snprintf(buf + used, len - used, "%s%s%s%s", used ? "; " : "", named ? "" : l->ops->name,
                 named ? "" : ": ", why);
}

/* The allowed transports, in preference order; then open the first that
 * moves host memory and will serve the peer: that is the peer's primary
 * link. Transports that move other kinds only open when a request needs
 * them (kvpi_peer_select). */
static kvp_status peer_connect(kvp_engine *e, kvpi_peer *peer, const char *segname)
{
    /* Integrity takes both sides: a peer that does not digest keeps its wire
     * (Mooncake's, an older kvpipe's), unchecked. */
    if (e->integrity) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(peer->desc.json, KVPI_DIGEST_FIELD);
        peer->integrity = cJSON_IsString(f) && strcmp(f->valuestring, KVPI_DIGEST_NAME) == 0;
        if (!peer->integrity)
            KVPI_WARN("segment %s does not check integrity (a Mooncake peer, or kvpipe with it "
                      "off or older): transfers with it are not digested",
                      segname);
    }
    for (size_t i = 0; e->transports[i]; i++)
        if (transport_allowed(e, e->transports[i]))
            peer->links[peer->n_links++] = (kvpi_link){.ops = e->transports[i], .slot = i};
    char refusals[400] = "";
    kvp_status first = KVP_OK; /* the first failure that is not "cannot serve" */
    for (size_t i = 0; i < peer->n_links; i++) {
        kvpi_link *l = &peer->links[i];
        if (!(l->ops->mem_kinds & KVPI_MEM_HOST_BIT)) continue;
        kvp_status st = link_open(e, peer, segname, l);
        if (st == KVP_OK) {
            if (refusals[0]) KVPI_INFO("segment %s: not using %s", segname, refusals);
            peer->primary = l;
            return KVP_OK;
        }
        if (st != KVP_ENOTSUP && !first) first = st;
        note_refusal(refusals, sizeof refusals, l, kvp_last_error());
    }
    return kvpi_error(first ? first : KVP_ENOTSUP, "segment %s: no transport can reach it: %s",
                      segname, refusals);
}

kvp_status kvpi_peer_select(kvp_engine *e, kvpi_peer *peer, unsigned kinds, int blocking,
                            kvpi_link **out)
{
    /* Links before the primary refused the peer or move no host memory: for
     * host memory and what else it moves, it is the first choice. */
    if ((kinds & KVPI_MEM_HOST_BIT) && (peer->primary->ops->mem_kinds & kinds) == kinds) {
        *out = peer->primary;
        return KVP_OK;
    }
    char refusals[300] = "";
    kvp_status st = KVP_ENOTSUP;
    if (!blocking) {
        if (pthread_mutex_trylock(&peer->lock) != 0) return KVP_EBUSY; /* one opens */
    } else {
        pthread_mutex_lock(&peer->lock);
    }
    for (size_t i = 0; i < peer->n_links; i++) {
        kvpi_link *l = &peer->links[i];
        if ((l->ops->mem_kinds & kinds) != kinds || l->refused) continue;
        if (!blocking && !l->handle) {
            st = KVP_EBUSY;
            break;
        }
        if ((st = link_open(e, peer, peer->desc.name, l)) == KVP_OK) {
            *out = l;
            break;
        }
        note_refusal(refusals, sizeof refusals, l, kvp_last_error());
    }
    pthread_mutex_unlock(&peer->lock);
    if (st == KVP_OK || st == KVP_EBUSY) return st;
    char names[64];
    return kvpi_error(KVP_ENOTSUP,
                      "segment %s: no transport this engine may use moves %s memory%s%s",
                      peer->desc.name, kvpi_mem_kinds_names(kinds, names, sizeof names),
                      refusals[0] ? "; refused: " : "", refusals);
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
    pthread_mutex_init(&peer->lock, NULL);
    atomic_init(&peer->refs, 1);
    char *text = NULL;
    kvp_status st = kvpi_meta_fetch(e->meta, name, &text, &peer->host);
    if (!st) {
        st = check_signature(e, name, text);
        if (!st) st = kvpi_descriptor_parse(text, &peer->desc);
        free(text);
    }
    if (!st) st = peer_connect(e, peer, name);
    if (st) {
        peer_put(NULL, peer);
        return st;
    }
    *out = peer;
    return KVP_OK;
}

/* ---- following peers' descriptors (docs/metadata-segments.md) ---- */

#define WATCH_POLL_MS_DEFAULT 2000

/* The cached descriptor and the store's text are the same descriptor: equal
 * but for the signature (re-signed on its own every auth_max_age_ms / 4). */
static int same_descriptor(const kvpi_peer *peer, const char *text, const char *host)
{
    if (strcmp(peer->host, host) != 0) return 0;
    cJSON *now = cJSON_Parse(text), *was = cJSON_Duplicate(peer->desc.json, 1);
    cJSON_DeleteItemFromObjectCaseSensitive(now, KVPI_AUTH_FIELD);
    cJSON_DeleteItemFromObjectCaseSensitive(was, KVPI_AUTH_FIELD);
    int same = now && was && cJSON_Compare(now, was, 1);
    cJSON_Delete(now);
    cJSON_Delete(was);
    return same;
}

/* Look at the store's descriptor of a cached peer: a different one (a
 * restarted peer, new regions) drops the cached peer, so that the next
 * transfer looks it up afresh. A missing one does not: the peer's
 * connections say whether it is gone, and a store that restarted empty gets
 * the keys back from the peer's keeper. Returns the fetch's status. */
static kvp_status revalidate(kvp_engine *e, kvpi_segment *seg)
{
    pthread_mutex_lock(&seg->lock);
    kvpi_peer *peer = seg->peer;
    if (peer) atomic_fetch_add(&peer->refs, 1);
    pthread_mutex_unlock(&seg->lock);
    if (!peer) return KVP_OK;
    char *text = NULL, *host = NULL;
    kvp_status st = kvpi_meta_fetch(e->meta, seg->name, &text, &host);
    if (st == KVP_OK && !same_descriptor(peer, text, host)) {
        KVPI_INFO("segment %s: its descriptor changed in the metadata store; the next transfer "
                  "uses the new one",
                  seg->name);
        kvpi_counter_add(&e->metrics.changes, 1);
        release(NULL, seg, peer, 1); /* detaches it, and drops our reference */
        peer = NULL;
    }
    if (peer) peer_put(NULL, peer);
    free(text);
    free(host);
    return st == KVP_ENOTFOUND ? KVP_OK : st;
}

/* kvpi_meta_change_fn: segment changed, or (NULL) anything may have. */
static void watch_changed(void *ctx, const char *segment)
{
    kvp_engine *e = ctx;
    if (segment) {
        kvpi_segment *seg = kvpi_segment_find(e, segment);
        if (seg) revalidate(e, seg);
        return;
    }
    /* Every cached peer; stop at the first store error (the store is down:
     * each look would wait for its timeout). */
    pthread_mutex_lock(&e->segments_lock);
    size_t n = e->n_segments;
    kvpi_segment **segs = n ? malloc(n * sizeof *segs) : NULL;
    if (segs) memcpy(segs, e->segments, n * sizeof *segs);
    pthread_mutex_unlock(&e->segments_lock);
    for (size_t i = 0; segs && i < n; i++) {
        if (revalidate(e, segs[i]) == KVP_OK) continue;
        KVPI_DEBUG("revalidating cached descriptors: %s", kvp_last_error());
        break;
    }
    free(segs);
}

/* Start following the store, once, when the first peer descriptor is cached.
 * KVPIPE_METADATA_WATCH: "watch" (the default), "poll" (revalidate every
 * KVPIPE_METADATA_POLL_MS, default 2000), "off" (neither: a cached
 * descriptor is looked up again only after a transfer with it failed). */
static void watch_start(kvp_engine *e)
{
    pthread_mutex_lock(&e->watch_lock);
    if (e->watch_tried || kvpi_meta_is_p2p(e->meta)) {
        pthread_mutex_unlock(&e->watch_lock);
        return;
    }
    e->watch_tried = 1;
    const char *mode = getenv("KVPIPE_METADATA_WATCH");
    const char *poll_env = getenv("KVPIPE_METADATA_POLL_MS");
    long poll_ms = WATCH_POLL_MS_DEFAULT;
    if (poll_env && kvpi_parse_long(poll_env, 10, 3600000, &poll_ms)) {
        KVPI_WARN("KVPIPE_METADATA_POLL_MS='%s' is not a number of milliseconds in "
                  "10..3600000: polling every %d ms",
                  poll_env, WATCH_POLL_MS_DEFAULT);
    }
    if (mode && strcmp(mode, "watch") != 0 && strcmp(mode, "poll") != 0 &&
        strcmp(mode, "off") != 0) {
        KVPI_WARN("KVPIPE_METADATA_WATCH='%s' is none of watch, poll, off: watching", mode);
        mode = NULL;
    }
    if (mode && strcmp(mode, "off") == 0) {
        KVPI_INFO("engine %s: KVPIPE_METADATA_WATCH=off: cached descriptors are looked up "
                  "again only after a failed transfer",
                  e->name);
    } else if (kvpi_meta_watch_start(e->meta,
                                     (int)(mode && strcmp(mode, "poll") == 0 ? -poll_ms : poll_ms),
                                     watch_changed, e, &e->watch)) {
        KVPI_WARN("engine %s: cannot follow the metadata store (%s): cached descriptors are "
                  "looked up again only after a failed transfer",
                  e->name, kvp_last_error());
    }
    pthread_mutex_unlock(&e->watch_lock);
}

void kvpi_segments_watch_stop(kvp_engine *e)
{
    pthread_mutex_lock(&e->watch_lock);
    kvpi_meta_watch *w = e->watch;
    e->watch = NULL;
    e->watch_tried = 1; /* no start after this */
    pthread_mutex_unlock(&e->watch_lock);
    kvpi_meta_watch_stop(w);
}

int kvpi_engine_watch_state(kvp_engine *e)
{
    pthread_mutex_lock(&e->watch_lock);
    int state = e->watch ? kvpi_meta_watch_state(e->watch) : -1;
    pthread_mutex_unlock(&e->watch_lock);
    return state;
}

kvp_status kvpi_segment_acquire(kvp_engine *e, kvpi_segment *seg, kvpi_peer **out)
{
    kvp_status st = KVP_OK;
    /* lookup_lock is held across a lookup, so that workers racing to a
     * segment that failed look it up once; seg->lock is not: a transfer of
     * the failed peer completing on a transport's thread takes it
     * (kvpi_segment_note, release), and ucx's peer_open and peer_close wait
     * for that very thread. */
    pthread_mutex_lock(&seg->lookup_lock);
    pthread_mutex_lock(&seg->lock);
    kvpi_peer *peer = seg->peer;
    if (peer) atomic_fetch_add(&peer->refs, 1); /* the caller's */
    int looked_up = seg->looked_up;
    pthread_mutex_unlock(&seg->lock);
    if (!peer) {
        kvpi_counter_add(&e->metrics.lookups, 1);
        if (looked_up) kvpi_counter_add(&e->metrics.refreshes, 1);
        st = peer_lookup(e, seg->name, &peer); /* its reference is the segment's */
        if (st == KVP_OK) {
            if (!looked_up) watch_start(e);
            pthread_mutex_lock(&seg->lock);
            seg->peer = peer; /* still NULL: only a lookup sets it, under lookup_lock */
            seg->looked_up = 1;
            seg->transport = peer->primary->ops->name;
            atomic_fetch_add(&peer->refs, 1); /* the caller's */
            pthread_mutex_unlock(&seg->lock);
        }
    }
    pthread_mutex_unlock(&seg->lookup_lock);
    if (st == KVP_OK) *out = peer;
    return st;
}

kvp_status kvpi_segment_try_acquire(kvpi_segment *seg, kvpi_peer **out)
{
    if (pthread_mutex_trylock(&seg->lock) != 0) return KVP_EBUSY;
    kvpi_peer *peer = seg->peer;
    if (peer) atomic_fetch_add(&peer->refs, 1);
    pthread_mutex_unlock(&seg->lock);
    if (!peer) return KVP_EBUSY;
    *out = peer;
    return KVP_OK;
}

static void release(kvp_engine *later, kvpi_segment *seg, kvpi_peer *peer, int failed)
{
    if (failed) {
        pthread_mutex_lock(&seg->lock);
        if (seg->peer == peer) {
            seg->peer = NULL;
            peer_put(later, peer);
        }
        pthread_mutex_unlock(&seg->lock);
    }
    peer_put(later, peer);
}

void kvpi_segment_release(kvpi_segment *seg, kvpi_peer *peer, int failed)
{
    release(NULL, seg, peer, failed);
}

void kvpi_segment_release_later(kvp_engine *e, kvpi_segment *seg, kvpi_peer *peer, int failed)
{
    release(e, seg, peer, failed);
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
        if (seg->peer) peer_put(NULL, seg->peer);
        pthread_mutex_destroy(&seg->lock);
        pthread_mutex_destroy(&seg->lookup_lock);
        free(seg->name);
        free(seg);
    }
    free(e->segments);
    e->segments = NULL;
    e->n_segments = 0;
}
