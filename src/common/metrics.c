/* Metric snapshots: assembly, lookup, and the Prometheus text format. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/metrics.h"

#define LABELS_MAX 4
#define BASE_MAX 2
#define ARENA_BLOCK 8192

const uint64_t kvpi_latency_bounds_ns[KVPI_LATENCY_BUCKETS] = {
    10000ull,      20000ull,      50000ull,      100000ull,     200000ull,
    500000ull,     1000000ull,    2000000ull,    5000000ull,    10000000ull,
    20000000ull,   50000000ull,   100000000ull,  200000000ull,  500000000ull,
    1000000000ull, 2000000000ull, 5000000000ull, 10000000000ull};

static const double latency_bounds_s[KVPI_LATENCY_BUCKETS] = {
    1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2,
    2e-2, 5e-2, 1e-1, 2e-1, 5e-1, 1,    2,    5,    10};

uint64_t kvpi_histogram_merge(kvpi_histogram *into, const kvpi_histogram *h)
{
    uint64_t counts[KVPI_LATENCY_BUCKETS + 1];
    uint64_t n = kvpi_histogram_read(h, counts);
    for (size_t i = 0; i <= KVPI_LATENCY_BUCKETS; i++)
        atomic_fetch_add_explicit(&into->buckets[i], counts[i], memory_order_relaxed);
    atomic_fetch_add_explicit(
        &into->sum_ns, atomic_load_explicit(&((kvpi_histogram *)h)->sum_ns, memory_order_relaxed),
        memory_order_relaxed);
    return n;
}

uint64_t kvpi_histogram_read(const kvpi_histogram *h, uint64_t counts[KVPI_LATENCY_BUCKETS + 1])
{
    uint64_t total = 0;
    for (size_t i = 0; i <= KVPI_LATENCY_BUCKETS; i++) {
        counts[i] = atomic_load_explicit(&((kvpi_histogram *)h)->buckets[i], memory_order_relaxed);
        total += counts[i];
    }
    return total;
}

/* Everything a snapshot points to lives in its arena, freed at once. */
typedef struct block {
    struct block *next;
    size_t used, cap;
    max_align_t data[];
} block;

typedef struct entry {
    kvp_metric pub;
    kvp_metric_label labels[LABELS_MAX];
} entry;

struct kvp_metrics {
    block *arena;
    entry **items;
    size_t n, cap;
    kvp_metric_label base[BASE_MAX];
    size_t n_base;
    int failed;
};

static void *arena_alloc(kvp_metrics *m, size_t len)
{
    len = (len + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    block *b = m->arena;
    if (!b || b->cap - b->used < len) {
        size_t cap = len > ARENA_BLOCK ? len : ARENA_BLOCK;
        if (!(b = malloc(sizeof *b + cap))) {
            m->failed = 1;
            return NULL;
        }
        b->used = 0;
        b->cap = cap;
        b->next = m->arena;
        m->arena = b;
    }
    void *p = (char *)b->data + b->used;
    b->used += len;
    return p;
}

static const char *arena_strdup(kvp_metrics *m, const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = arena_alloc(m, n);
    if (p) memcpy(p, s, n);
    return p;
}

kvp_metrics *kvpi_metrics_new(void)
{
    return calloc(1, sizeof(kvp_metrics));
}

void kvp_metrics_free(kvp_metrics *m)
{
    if (!m) return;
    for (block *b = m->arena, *next; b; b = next) {
        next = b->next;
        free(b);
    }
    free(m->items);
    free(m);
}

kvp_status kvpi_metrics_status(const kvp_metrics *m)
{
    return m->failed ? kvpi_error(KVP_ENOMEM, "metrics: out of memory") : KVP_OK;
}

void kvpi_metrics_base_labels(kvp_metrics *m, ...)
{
    va_list ap;
    va_start(ap, m);
    m->n_base = 0;
    const char *name;
    while ((name = va_arg(ap, const char *))) {
        const char *value = va_arg(ap, const char *);
        if (m->n_base == BASE_MAX) {
            m->failed = 1;
            break;
        }
        m->base[m->n_base].name = arena_strdup(m, name);
        m->base[m->n_base].value = arena_strdup(m, value);
        m->n_base++;
    }
    va_end(ap);
}

/* A new entry of family f with the base labels and those of ap. */
static entry *add_entry(kvp_metrics *m, const kvpi_metric_family *f, va_list ap)
{
    if (m->n == m->cap) {
        size_t cap = m->cap ? 2 * m->cap : 64;
        entry **grown = realloc(m->items, cap * sizeof *grown);
        if (!grown) {
            m->failed = 1;
            return NULL;
        }
        m->items = grown;
        m->cap = cap;
    }
    entry *e = arena_alloc(m, sizeof *e);
    if (!e) return NULL;
    memset(e, 0, sizeof *e);
    e->pub.name = f->name;
    e->pub.help = f->help;
    e->pub.type = f->type;
    e->pub.labels = e->labels;
    size_t n = 0;
    for (; n < m->n_base; n++)
        e->labels[n] = m->base[n];
    const char *name;
    while ((name = va_arg(ap, const char *))) {
        const char *value = va_arg(ap, const char *);
        if (n == LABELS_MAX) {
            m->failed = 1;
            return NULL;
        }
        e->labels[n].name = arena_strdup(m, name);
        e->labels[n].value = arena_strdup(m, value);
        n++;
    }
    e->pub.n_labels = n;
    m->items[m->n++] = e;
    return e;
}

void kvpi_metrics_add(kvp_metrics *m, const kvpi_metric_family *f, double value, ...)
{
    va_list ap;
    va_start(ap, value);
    entry *e = add_entry(m, f, ap);
    va_end(ap);
    if (e) e->pub.value = value;
}

void kvpi_metrics_add_histogram(kvp_metrics *m, const kvpi_metric_family *f,
                                const kvpi_histogram *h, ...)
{
    va_list ap;
    va_start(ap, h);
    entry *e = add_entry(m, f, ap);
    va_end(ap);
    if (!e) return;
    uint64_t raw[KVPI_LATENCY_BUCKETS + 1];
    kvpi_histogram_read(h, raw);
    uint64_t *cum = arena_alloc(m, sizeof(uint64_t) * KVPI_LATENCY_BUCKETS);
    if (!cum) return;
    uint64_t run = 0;
    for (size_t i = 0; i < KVPI_LATENCY_BUCKETS; i++)
        cum[i] = run += raw[i];
    run += raw[KVPI_LATENCY_BUCKETS];
    e->pub.n_buckets = KVPI_LATENCY_BUCKETS;
    e->pub.bucket_bounds = latency_bounds_s;
    e->pub.bucket_counts = cum;
    e->pub.count = run;
    e->pub.value = (double)run;
    e->pub.sum =
        (double)atomic_load_explicit(&((kvpi_histogram *)h)->sum_ns, memory_order_relaxed) / 1e9;
}

const char *kvpi_metrics_status_name(kvp_status st)
{
    /* The status's name without "KVP_": "EAUTH". */
#define KVPI_STATUS_NAME_(name, value, text) [value] = #name + 4,
    static const char *const names[] = {KVP_STATUS_LIST(KVPI_STATUS_NAME_)};
#undef KVPI_STATUS_NAME_
    if ((unsigned)st < sizeof names / sizeof names[0] && names[st]) return names[st];
    return "EUNKNOWN";
}

/* ---- reading ---- */

size_t kvp_metrics_count(const kvp_metrics *m)
{
    return m ? m->n : 0;
}

const kvp_metric *kvp_metrics_at(const kvp_metrics *m, size_t i)
{
    return m && i < m->n ? &m->items[i]->pub : NULL;
}

/* Whether sample x carries the pair name=value given as [p, p+len). */
static int has_pair(const kvp_metric *x, const char *p, size_t len)
{
    const char *eq = memchr(p, '=', len);
    if (!eq) return 0;
    size_t nlen = (size_t)(eq - p), vlen = len - nlen - 1;
    for (size_t i = 0; i < x->n_labels; i++) {
        const kvp_metric_label *l = &x->labels[i];
        if (strlen(l->name) == nlen && memcmp(l->name, p, nlen) == 0 && strlen(l->value) == vlen &&
            memcmp(l->value, eq + 1, vlen) == 0)
            return 1;
    }
    return 0;
}

static int labels_match(const kvp_metric *x, const char *sel)
{
    while (sel && *sel) {
        const char *comma = strchr(sel, ',');
        size_t len = comma ? (size_t)(comma - sel) : strlen(sel);
        if (len && !has_pair(x, sel, len)) return 0;
        sel = comma ? comma + 1 : NULL;
    }
    return 1;
}

const kvp_metric *kvp_metrics_find(const kvp_metrics *m, const char *name, const char *labels)
{
    if (!m || !name) return NULL;
    for (size_t i = 0; i < m->n; i++) {
        const kvp_metric *x = &m->items[i]->pub;
        if (strcmp(x->name, name) == 0 && labels_match(x, labels)) return x;
    }
    return NULL;
}

/* ---- Prometheus text, exposition format 0.0.4 ---- */

static void put_escaped(FILE *f, const char *s, int quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            fputs("\\\\", f);
        else if (*s == '\n')
            fputs("\\n", f);
        else if (*s == '"' && quote)
            fputs("\\\"", f);
        else
            fputc(*s, f);
    }
}

/* A float as Prometheus reads it: integers without a fraction, others with
 * the fewest digits that read back as the same double. */
static void put_value(FILE *f, double v)
{
    if (isnan(v)) {
        fputs("NaN", f);
    } else if (isinf(v)) {
        fputs(v > 0 ? "+Inf" : "-Inf", f);
    } else if (v == floor(v) && fabs(v) < 9007199254740992.0) {
        fprintf(f, "%.0f", v);
    } else {
        char buf[32];
        for (int prec = 6; prec <= 17; prec++) {
            snprintf(buf, sizeof buf, "%.*g", prec, v);
            if (strtod(buf, NULL) == v) break;
        }
        fputs(buf, f);
    }
}

/* name{labels[,le="bound"]} */
static void put_series(FILE *f, const kvp_metric *x, const char *suffix, const char *le)
{
    fputs(x->name, f);
    fputs(suffix, f);
    if (!x->n_labels && !le) return;
    fputc('{', f);
    for (size_t i = 0; i < x->n_labels; i++) {
        fprintf(f, "%s%s=\"", i ? "," : "", x->labels[i].name);
        put_escaped(f, x->labels[i].value, 1);
        fputc('"', f);
    }
    if (le) fprintf(f, "%sle=\"%s\"", x->n_labels ? "," : "", le);
    fputc('}', f);
}

static void put_sample(FILE *f, const kvp_metric *x)
{
    if (x->type != KVP_METRIC_HISTOGRAM) {
        put_series(f, x, "", NULL);
        fputc(' ', f);
        put_value(f, x->value);
        fputc('\n', f);
        return;
    }
    char le[32];
    for (size_t b = 0; b < x->n_buckets; b++) {
        snprintf(le, sizeof le, "%g", x->bucket_bounds[b]);
        put_series(f, x, "_bucket", le);
        fprintf(f, " %llu\n", (unsigned long long)x->bucket_counts[b]);
    }
    put_series(f, x, "_bucket", "+Inf");
    fprintf(f, " %llu\n", (unsigned long long)x->count);
    put_series(f, x, "_sum", NULL);
    fputc(' ', f);
    put_value(f, x->sum);
    fputc('\n', f);
    put_series(f, x, "_count", NULL);
    fprintf(f, " %llu\n", (unsigned long long)x->count);
}

static const char *type_name(kvp_metric_type t)
{
    return t == KVP_METRIC_COUNTER ? "counter" : t == KVP_METRIC_GAUGE ? "gauge" : "histogram";
}

kvp_status kvp_metrics_format_prometheus(const kvp_metrics *m, char **text, size_t *len)
{
    if (!m || !text || !len) return kvpi_error(KVP_EINVAL, "metrics: NULL argument");
    char *buf = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&buf, &size);
    if (!f) return kvpi_error(KVP_ENOMEM, "metrics: out of memory");
    /* Every family once, in the order of its first sample, with all of its
     * samples (those of several engines come apart in a shared snapshot). */
    for (size_t i = 0; i < m->n; i++) {
        const kvp_metric *x = &m->items[i]->pub;
        int seen = 0;
        for (size_t j = 0; j < i && !seen; j++)
            seen = strcmp(m->items[j]->pub.name, x->name) == 0;
        if (seen) continue;
        fprintf(f, "# HELP %s ", x->name);
        put_escaped(f, x->help, 0);
        fprintf(f, "\n# TYPE %s %s\n", x->name, type_name(x->type));
        for (size_t j = i; j < m->n; j++)
            if (strcmp(m->items[j]->pub.name, x->name) == 0) put_sample(f, &m->items[j]->pub);
    }
    if (ferror(f) | fclose(f)) {
        free(buf);
        return kvpi_error(KVP_ENOMEM, "metrics: out of memory");
    }
    *text = buf;
    *len = size;
    return KVP_OK;
}
