/* The HTTP metadata server's table and request rules; see kv_table.h. */
#include "metadata/kv_table.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

#define MIN_BUCKETS 64
#define PATH_METADATA "/metadata"
#define PATH_HEALTH "/health"
#define RPC_META_MARK "rpc_meta" /* Mooncake's servers refuse to overwrite such keys */

struct kvpi_kvt_blob {
    kvpi_kvt *t;
    atomic_int refs;
    size_t len, cap;
    char data[];
};

typedef struct entry {
    char *key;
    kvpi_kvt_blob *value;
    struct entry *next;
} entry;

struct kvpi_kvt {
    kvpi_kvt_limits limits;
    pthread_mutex_t lock; /* guards everything below */
    entry **buckets;
    size_t n_buckets, count;
    size_t used; /* bytes charged to the budget */
};

/* ---- the budget ---- */

static int charge(kvpi_kvt *t, size_t n)
{
    pthread_mutex_lock(&t->lock);
    int ok = n <= t->limits.max_total_bytes - t->used;
    if (ok) t->used += n;
    pthread_mutex_unlock(&t->lock);
    return ok ? 0 : -1;
}

static void refund(kvpi_kvt *t, size_t n)
{
    pthread_mutex_lock(&t->lock);
    t->used -= n;
    pthread_mutex_unlock(&t->lock);
}

static size_t entry_charge(const char *key)
{
    return sizeof(entry) + strlen(key) + 1;
}

/* ---- blobs ---- */

static size_t blob_charge(size_t cap)
{
    return sizeof(kvpi_kvt_blob) + cap;
}

/* A blob of capacity cap, charged; NULL over the budget or out of memory. */
static kvpi_kvt_blob *blob_new(kvpi_kvt *t, size_t cap)
{
    if (cap > t->limits.max_total_bytes || charge(t, blob_charge(cap)) != 0) return NULL;
    kvpi_kvt_blob *b = malloc(blob_charge(cap));
    if (!b) {
        refund(t, blob_charge(cap));
        return NULL;
    }
    b->t = t;
    atomic_init(&b->refs, 1);
    b->len = 0;
    b->cap = cap;
    return b;
}

const char *kvpi_kvt_blob_data(const kvpi_kvt_blob *b)
{
    return b->data;
}

size_t kvpi_kvt_blob_len(const kvpi_kvt_blob *b)
{
    return b->len;
}

void kvpi_kvt_blob_release(kvpi_kvt_blob *b)
{
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1) return;
    refund(b->t, blob_charge(b->cap));
    free(b);
}

/* ---- the hash table (called with the lock held) ---- */

static size_t hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (size_t)h;
}

static entry **find_slot(kvpi_kvt *t, const char *key)
{
    entry **e = &t->buckets[hash(key) & (t->n_buckets - 1)];
    while (*e && strcmp((*e)->key, key) != 0)
        e = &(*e)->next;
    return e;
}

/* Twice the buckets, if the budget allows; a full table is slower, not wrong. */
static void grow_locked(kvpi_kvt *t)
{
    size_t n = t->n_buckets * 2, extra = t->n_buckets * sizeof(entry *);
    if (extra > t->limits.max_total_bytes - t->used) return;
    entry **b = calloc(n, sizeof *b);
    if (!b) return;
    t->used += extra;
    for (size_t i = 0; i < t->n_buckets; i++) {
        for (entry *e = t->buckets[i], *next; e; e = next) {
            next = e->next;
            entry **slot = &b[hash(e->key) & (n - 1)];
            e->next = *slot;
            *slot = e;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->n_buckets = n;
}

kvp_status kvpi_kvt_create(const kvpi_kvt_limits *limits, kvpi_kvt **out)
{
    kvpi_kvt *t = calloc(1, sizeof *t);
    if (!t) return kvpi_error(KVP_ENOMEM, "metadata server: out of memory");
    t->limits = *limits;
    t->n_buckets = MIN_BUCKETS;
    t->buckets = calloc(t->n_buckets, sizeof *t->buckets);
    if (!t->buckets) {
        free(t);
        return kvpi_error(KVP_ENOMEM, "metadata server: out of memory");
    }
    t->used = t->n_buckets * sizeof(entry *);
    pthread_mutex_init(&t->lock, NULL);
    *out = t;
    return KVP_OK;
}

void kvpi_kvt_destroy(kvpi_kvt *t)
{
    if (!t) return;
    for (size_t i = 0; i < t->n_buckets; i++) {
        for (entry *e = t->buckets[i], *next; e; e = next) {
            next = e->next;
            free(e->key);
            free(e->value); /* no references are left: see the header */
            free(e);
        }
    }
    free(t->buckets);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

size_t kvpi_kvt_bytes_used(kvpi_kvt *t)
{
    pthread_mutex_lock(&t->lock);
    size_t n = t->used;
    pthread_mutex_unlock(&t->lock);
    return n;
}

/* ---- replies ---- */

static int reply_text(kvpi_kvt_reply *r, unsigned status, const char *text)
{
    *r = (kvpi_kvt_reply){.status = status, .text = text, .content_type = "text/plain"};
    r->allow = status == 405;
    return 1;
}

static int reply_blob(kvpi_kvt_reply *r, kvpi_kvt_blob *b)
{
    *r = (kvpi_kvt_reply){.status = 200, .blob = b, .content_type = "application/json"};
    return 1;
}

static int full(kvpi_kvt_reply *r)
{
    return reply_text(r, 507, "metadata server memory limit reached\n");
}

/* ---- GET, DELETE, list ---- */

static int do_get(kvpi_kvt *t, const char *key, kvpi_kvt_reply *r)
{
    pthread_mutex_lock(&t->lock);
    entry *e = *find_slot(t, key);
    if (e) atomic_fetch_add(&e->value->refs, 1);
    pthread_mutex_unlock(&t->lock);
    if (!e) return reply_text(r, 404, "metadata not found\n");
    return reply_blob(r, e->value);
}

static int do_delete(kvpi_kvt *t, const char *key, kvpi_kvt_reply *r)
{
    pthread_mutex_lock(&t->lock);
    entry **slot = find_slot(t, key), *e = *slot;
    if (e) {
        *slot = e->next;
        t->count--;
        t->used -= entry_charge(e->key);
    }
    pthread_mutex_unlock(&t->lock);
    if (!e) return reply_text(r, 404, "metadata not found\n");
    kvpi_kvt_blob_release(e->value);
    free(e->key);
    free(e);
    return reply_text(r, 200, "metadata deleted\n");
}

/* Length of a valid UTF-8 sequence at s (of n bytes), or 0. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    size_t len = s[0] < 0x80             ? 1
                 : (s[0] & 0xE0) == 0xC0 ? 2
                 : (s[0] & 0xF0) == 0xE0 ? 3
                 : (s[0] & 0xF8) == 0xF0 ? 4
                                         : 0;
    if (len == 0 || len > n || (len == 2 && s[0] < 0xC2) || (len == 4 && s[0] > 0xF4)) return 0;
    for (size_t i = 1; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    if (len == 3 && ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] >= 0xA0))) return 0;
    if (len == 4 && ((s[0] == 0xF0 && s[1] < 0x90) || (s[0] == 0xF4 && s[1] >= 0x90))) return 0;
    return len;
}

/* Write key as a JSON string at out (when non-NULL); returns its length.
 * Bytes that are not UTF-8 become U+FFFD, so the listing is always JSON. */
static size_t json_string(const char *key, char *out)
{
    static const char hex[] = "0123456789abcdef";
    const unsigned char *s = (const unsigned char *)key;
    size_t n = strlen(key), o = 0;
    char esc[8];
    if (out) out[o] = '"';
    o++;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_len(s + i, n - i), e = 0;
        if (k == 0) {
            memcpy(esc, "\\ufffd", e = 6);
            k = 1;
        } else if (s[i] == '"' || s[i] == '\\') {
            esc[e++] = '\\';
            esc[e++] = (char)s[i];
        } else if (s[i] < 0x20) {
            memcpy(esc, "\\u00", 4);
            esc[4] = hex[s[i] >> 4];
            esc[5] = hex[s[i] & 15];
            e = 6;
        }
        if (out && e) memcpy(out + o, esc, e);
        if (out && !e) memcpy(out + o, s + i, k);
        o += e ? e : k;
        i += k;
    }
    if (out) out[o] = '"';
    return o + 1;
}

static int key_cmp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The keys that start with prefix, sorted, as a JSON array. */
static int do_list(kvpi_kvt *t, const char *prefix, kvpi_kvt_reply *r)
{
    size_t plen = strlen(prefix), n = 0, len = 2;
    pthread_mutex_lock(&t->lock);
    const char **keys = malloc((t->count ? t->count : 1) * sizeof *keys);
    if (!keys) {
        pthread_mutex_unlock(&t->lock);
        return full(r);
    }
    for (size_t i = 0; i < t->n_buckets; i++)
        for (entry *e = t->buckets[i]; e; e = e->next)
            if (strncmp(e->key, prefix, plen) == 0) keys[n++] = e->key;
    qsort(keys, n, sizeof *keys, key_cmp);
    for (size_t i = 0; i < n; i++)
        len += json_string(keys[i], NULL) + (i ? 1 : 0);
    /* Charged like a value: the answer may be large and slow to send. */
    size_t cost = blob_charge(len);
    kvpi_kvt_blob *b = NULL;
    if (cost <= t->limits.max_total_bytes - t->used && (b = malloc(cost))) {
        t->used += cost;
        b->t = t;
        atomic_init(&b->refs, 1);
        b->cap = b->len = len;
        size_t o = 0;
        b->data[o++] = '[';
        for (size_t i = 0; i < n; i++) {
            if (i) b->data[o++] = ',';
            o += json_string(keys[i], b->data + o);
        }
        b->data[o] = ']';
    }
    pthread_mutex_unlock(&t->lock);
    free(keys);
    return b ? reply_blob(r, b) : full(r);
}

/* ---- PUT ---- */

static int is_rpc_meta(const char *key)
{
    return strstr(key, RPC_META_MARK) != NULL;
}

static int exists(kvpi_kvt *t, const char *key)
{
    pthread_mutex_lock(&t->lock);
    int found = *find_slot(t, key) != NULL;
    pthread_mutex_unlock(&t->lock);
    return found;
}

static int duplicate(kvpi_kvt_reply *r)
{
    return reply_text(r, 400, "Duplicate rpc_meta key not allowed\n");
}

static int begin_put(kvpi_kvt *t, const kvpi_kvt_request *req, kvpi_kvt_blob **upload,
                     kvpi_kvt_reply *r)
{
    long long cl = req->content_length;
    if (cl > 0 && (unsigned long long)cl > t->limits.max_value_bytes)
        return reply_text(r, 413, "value too large\n");
    /* Refused before its body is read, as it would be after. */
    if (is_rpc_meta(req->key) && exists(t, req->key)) return duplicate(r);
    *upload = blob_new(t, cl > 0 ? (size_t)cl : 0);
    if (!*upload) return full(r);
    return 0;
}

int kvpi_kvt_upload_append(kvpi_kvt *t, kvpi_kvt_blob **upload, const char *data, size_t n)
{
    kvpi_kvt_blob *b = *upload;
    if (n > t->limits.max_value_bytes - b->len) return -1;
    if (n > b->cap - b->len) {
        /* No Content-Length (chunked): grow, doubling, within the value limit. */
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n)
            cap *= 2;
        if (cap > t->limits.max_value_bytes) cap = t->limits.max_value_bytes;
        if (charge(t, cap - b->cap) != 0) return -1;
        kvpi_kvt_blob *nb = realloc(b, blob_charge(cap));
        if (!nb) {
            refund(t, cap - b->cap);
            return -1;
        }
        nb->cap = cap;
        *upload = b = nb;
    }
    memcpy(b->data + b->len, data, n);
    b->len += n;
    return 0;
}

static void finish_put(kvpi_kvt *t, const char *key, kvpi_kvt_blob *value, kvpi_kvt_reply *r)
{
    kvpi_kvt_blob *old = NULL;
    entry *fresh = NULL;
    char *fresh_key = NULL;
    pthread_mutex_lock(&t->lock);
    entry **slot = find_slot(t, key);
    if (*slot && is_rpc_meta(key)) {
        duplicate(r);
    } else if (*slot) {
        old = (*slot)->value;
        (*slot)->value = value;
        value = NULL;
        reply_text(r, 200, "metadata updated\n");
    } else if (entry_charge(key) > t->limits.max_total_bytes - t->used) {
        full(r);
    } else if ((fresh = malloc(sizeof *fresh)) && (fresh_key = strdup(key))) {
        t->used += entry_charge(key);
        *fresh = (entry){.key = fresh_key, .value = value, .next = NULL};
        *slot = fresh;
        fresh = NULL;
        value = NULL;
        if (++t->count > 2 * t->n_buckets) grow_locked(t);
        reply_text(r, 200, "metadata updated\n");
    } else {
        full(r);
    }
    pthread_mutex_unlock(&t->lock);
    free(fresh);
    kvpi_kvt_blob_release(value); /* not stored */
    kvpi_kvt_blob_release(old);   /* answers still sending it keep their reference */
}

/* ---- routing ---- */

int kvpi_kvt_begin(kvpi_kvt *t, const kvpi_kvt_request *req, kvpi_kvt_blob **upload,
                   kvpi_kvt_reply *reply)
{
    *upload = NULL;
    int get = strcmp(req->method, "GET") == 0;
    if (strcmp(req->path, PATH_HEALTH) == 0)
        return get ? reply_text(reply, 200, "OK\n")
                   : reply_text(reply, 405, "method not allowed\n");
    if (strcmp(req->path, PATH_METADATA) != 0) return reply_text(reply, 404, "not found\n");
    if (req->list && req->key) return reply_text(reply, 400, "give either key or list, not both\n");
    if (req->list)
        return get ? do_list(t, req->list, reply) : reply_text(reply, 405, "method not allowed\n");
    if (!req->key || !*req->key) return reply_text(reply, 400, "metadata key is required\n");
    if (get) return do_get(t, req->key, reply);
    if (strcmp(req->method, "DELETE") == 0) return do_delete(t, req->key, reply);
    if (strcmp(req->method, "PUT") == 0) return begin_put(t, req, upload, reply);
    return reply_text(reply, 405, "method not allowed\n");
}

void kvpi_kvt_finish(kvpi_kvt *t, const kvpi_kvt_request *req, kvpi_kvt_blob *upload,
                     kvpi_kvt_reply *reply)
{
    finish_put(t, req->key, upload, reply);
}

void kvpi_kvt_handle(kvpi_kvt *t, const kvpi_kvt_request *req, const char *body, size_t len,
                     kvpi_kvt_reply *reply)
{
    kvpi_kvt_blob *upload = NULL;
    if (kvpi_kvt_begin(t, req, &upload, reply)) return;
    if (len && kvpi_kvt_upload_append(t, &upload, body, len) != 0) {
        kvpi_kvt_blob_release(upload);
        if (len > t->limits.max_value_bytes)
            reply_text(reply, 413, "value too large\n");
        else
            full(reply);
        return;
    }
    kvpi_kvt_finish(t, req, upload, reply);
}
