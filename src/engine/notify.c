/* Notifications and probes: the handshake port's NOTIFY and PROBE frames
 * (Mooncake's types 2 and 3), from both ends.
 *
 * Received notifications wait in a FIFO until kvp_engine_get_notifies() takes
 * them all. The FIFO is bounded (KVP_NOTIFY_QUEUE_MAX entries,
 * KVP_NOTIFY_QUEUE_MAX_BYTES of strings); one that would pass a bound is
 * refused, so its sender learns that it was not delivered, and nothing queued
 * is dropped. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "engine/engine_internal.h"

void kvpi_notify_init(kvp_engine *e)
{
    pthread_mutex_init(&e->notifies.lock, NULL);
    e->notifies.head = NULL;
    e->notifies.tail = &e->notifies.head;
}

static void entry_free(kvpi_notify_entry *n)
{
    free(n->name);
    free(n->msg);
    free(n);
}

void kvpi_notify_destroy(kvp_engine *e)
{
    kvpi_notify_entry *n = e->notifies.head;
    while (n) {
        kvpi_notify_entry *next = n->next;
        entry_free(n);
        n = next;
    }
    e->notifies.head = NULL;
    e->notifies.tail = &e->notifies.head;
    pthread_mutex_destroy(&e->notifies.lock);
}

size_t kvpi_notify_queued(kvp_engine *e)
{
    pthread_mutex_lock(&e->notifies.lock);
    size_t n = e->notifies.count;
    pthread_mutex_unlock(&e->notifies.lock);
    return n;
}

kvp_status kvpi_notify_receive(void *ctx, const char *name, const char *msg)
{
    kvp_engine *e = ctx;
    kvpi_notify_entry *n = calloc(1, sizeof *n);
    if (n) {
        n->name = strdup(name);
        n->msg = strdup(msg);
        n->bytes = strlen(name) + strlen(msg);
    }
    if (!n || !n->name || !n->msg) {
        if (n) entry_free(n);
        kvpi_counter_add(&e->metrics.notifies_refused, 1);
        return kvpi_error(KVP_ENOMEM, "engine %s: out of memory for a notification", e->name);
    }
    kvpi_notify_queue *q = &e->notifies;
    pthread_mutex_lock(&q->lock);
    int full = q->count >= KVP_NOTIFY_QUEUE_MAX || q->bytes + n->bytes > KVP_NOTIFY_QUEUE_MAX_BYTES;
    size_t count = q->count, bytes = q->bytes;
    if (!full) {
        *q->tail = n;
        q->tail = &n->next;
        q->count++;
        q->bytes += n->bytes;
    }
    pthread_mutex_unlock(&q->lock);
    if (full) {
        entry_free(n);
        kvpi_counter_add(&e->metrics.notifies_refused, 1);
        KVPI_WARN_LIMITED("engine %s: refused a notification: %zu notifications (%zu bytes) wait "
                          "to be collected (get_notifies), the most it keeps is %u (%u bytes)",
                          e->name, count, bytes, (unsigned)KVP_NOTIFY_QUEUE_MAX,
                          (unsigned)KVP_NOTIFY_QUEUE_MAX_BYTES);
        return kvpi_error(KVP_EBUSY,
                          "engine %s keeps %zu notifications (%zu bytes) nobody collected; it "
                          "takes at most %u (%u bytes)",
                          e->name, count, bytes, (unsigned)KVP_NOTIFY_QUEUE_MAX,
                          (unsigned)KVP_NOTIFY_QUEUE_MAX_BYTES);
    }
    kvpi_counter_add(&e->metrics.notifies_received, 1);
    return KVP_OK;
}

kvp_status kvp_engine_get_notifies(kvp_engine *e, kvp_notify **out, size_t *count)
{
    if (!e || !out || !count)
        return kvpi_error(KVP_EINVAL, "get_notifies: engine, out and count are required");
    kvpi_notify_queue *q = &e->notifies;
    pthread_mutex_lock(&q->lock);
    size_t n = q->count;
    kvp_notify *list = n ? malloc(n * sizeof *list) : NULL;
    if (n && !list) {
        pthread_mutex_unlock(&q->lock);
        return kvpi_error(KVP_ENOMEM, "get_notifies: out of memory for %zu notifications", n);
    }
    kvpi_notify_entry *head = q->head;
    q->head = NULL;
    q->tail = &q->head;
    q->count = q->bytes = 0;
    pthread_mutex_unlock(&q->lock);
    /* The strings move to the array; the entries go. */
    size_t i = 0;
    while (head) {
        kvpi_notify_entry *next = head->next;
        list[i++] = (kvp_notify){head->name, head->msg};
        free(head);
        head = next;
    }
    *out = list;
    *count = n;
    return KVP_OK;
}

void kvp_engine_notifies_free(kvp_notify *notifies, size_t count)
{
    if (!notifies) return;
    for (size_t i = 0; i < count; i++) {
        free(notifies[i].name);
        free(notifies[i].msg);
    }
    free(notifies);
}

kvp_status kvp_engine_notify(kvp_engine *e, kvp_segment_id id, const char *name, const char *msg)
{
    if (!e || !name || !msg)
        return kvpi_error(KVP_EINVAL, "notify: engine, name and msg are required");
    kvpi_segment *seg = kvpi_segment_get(e, id);
    if (!seg) return kvpi_error(KVP_EINVAL, "notify: segment id %u is not open", id);
    /* The frame's JSON escapes the strings: bound that, not their sum. */
    char *json = kvpi_rpc_notify_json(name, msg);
    if (!json) return kvpi_error(KVP_ENOMEM, "notify: out of memory");
    if (strlen(json) + 1 > KVPI_RPC_MAX_FRAME) {
        size_t len = strlen(json);
        free(json);
        return kvpi_error(KVP_EINVAL,
                          "notify %s: the notification takes %zu bytes of JSON; a handshake "
                          "frame holds at most %u",
                          seg->name, len, KVPI_RPC_MAX_FRAME - 1);
    }
    char *reply = NULL;
    kvp_status st = kvpi_meta_call(e->meta, seg->name, KVPI_RPC_NOTIFY, json, &reply);
    free(json);
    if (st == KVP_OK) {
        st = kvpi_rpc_notify_reply_check(reply);
        if (st) st = kvpi_error(st, "notify %s: %s", seg->name, kvp_last_error());
    } else {
        st = kvpi_error(st, "notify: %s", kvp_last_error());
    }
    free(reply);
    if (st == KVP_OK) kvpi_counter_add(&e->metrics.notifies_sent, 1);
    return st;
}

kvp_status kvp_engine_probe(kvp_engine *e, const char *name)
{
    if (!e || !name || !*name) return kvpi_error(KVP_EINVAL, "probe: an empty segment name");
    char *reply = NULL;
    kvp_status st = kvpi_meta_call(e->meta, name, KVPI_RPC_PROBE, "{}", &reply);
    /* Mooncake's sender asks only for a PROBE frame of JSON back. */
    free(reply);
    if (st) return kvpi_error(st, "probe: %s", kvp_last_error());
    /* The peer answers: use what it publishes now, not what was cached. */
    kvpi_segment *seg = kvpi_segment_find(e, name);
    if (seg) kvpi_segment_forget(seg);
    kvp_segment_id id;
    st = kvp_engine_open_segment(e, name, &id);
    if (st) return kvpi_error(st, "probe %s: the peer answers, but %s", name, kvp_last_error());
    return KVP_OK;
}
