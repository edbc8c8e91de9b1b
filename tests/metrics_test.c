/* Metrics: snapshots count what engines did, exactly; the Prometheus text
 * passes a strict parser of exposition format 0.0.4 written here; the
 * endpoint serves it from live engines in other processes during transfers;
 * MC_TE_METRIC prints Mooncake's line. */
#include <ctype.h>
#include <curl/curl.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include "kvpipe/metrics.h"
#include "peer.h"
#include "test.h"

/* ------------------------------------------------ a strict 0.0.4 parser --- */

#define MAX_SAMPLES 4096
#define MAX_FAMILIES 256

typedef struct sample {
    char name[128];
    char labels[512];      /* canonical: name="value",... in the order given, le included */
    char le[256];          /* the le label of a _bucket sample, else "" */
    char base_labels[512]; /* labels without le */
    double value;
} sample;

typedef struct family {
    char name[128];
    char type[16];
    int help, typed;
    int closed; /* another family's lines came after its samples */
} family;

typedef struct parsed {
    sample s[MAX_SAMPLES];
    size_t n;
    family f[MAX_FAMILIES];
    size_t nf;
    char error[256];
} parsed;

static int fail_at(parsed *p, int line, const char *what)
{
    snprintf(p->error, sizeof p->error, "line %d: %s", line, what);
    return -1;
}

static int metric_name_ok(const char *s, size_t n)
{
    if (n == 0 || !(isalpha((unsigned char)s[0]) || s[0] == '_' || s[0] == ':')) return 0;
    for (size_t i = 1; i < n; i++)
        if (!(isalnum((unsigned char)s[i]) || s[i] == '_' || s[i] == ':')) return 0;
    return 1;
}

static int label_name_ok(const char *s, size_t n)
{
    if (n == 0 || !(isalpha((unsigned char)s[0]) || s[0] == '_')) return 0;
    if (n >= 2 && s[0] == '_' && s[1] == '_') return 0; /* reserved */
    for (size_t i = 1; i < n; i++)
        if (!(isalnum((unsigned char)s[i]) || s[i] == '_')) return 0;
    return 1;
}

/* A Go ParseFloat value as Prometheus writes it. */
static int value_ok(const char *s, double *out)
{
    if (!strcmp(s, "NaN")) return *out = NAN, 1;
    if (!strcmp(s, "+Inf")) return *out = INFINITY, 1;
    if (!strcmp(s, "-Inf")) return *out = -INFINITY, 1;
    const char *q = s;
    if (*q == '-' || *q == '+') q++;
    if (!isdigit((unsigned char)*q) && *q != '.') return 0;
    for (const char *c = q; *c; c++)
        if (!isdigit((unsigned char)*c) && !strchr(".eE+-", *c)) return 0;
    char *end;
    *out = strtod(s, &end);
    return *end == '\0';
}

static family *family_of(parsed *p, const char *name)
{
    for (size_t i = 0; i < p->nf; i++)
        if (!strcmp(p->f[i].name, name)) return &p->f[i];
    return NULL;
}

static int comment(parsed *p, int ln, char *line, family **current)
{
    char kind[8], name[128];
    int off = 0;
    if (sscanf(line, "# %7s %127s %n", kind, name, &off) < 2)
        return fail_at(p, ln, "a comment that is neither HELP nor TYPE");
    if (strcmp(kind, "HELP") && strcmp(kind, "TYPE"))
        return fail_at(p, ln, "a comment that is neither HELP nor TYPE");
    if (strncmp(line, "# ", 2) || line[2 + strlen(kind)] != ' ')
        return fail_at(p, ln, "HELP/TYPE not separated by single spaces");
    if (!metric_name_ok(name, strlen(name))) return fail_at(p, ln, "bad metric name");
    family *f = family_of(p, name);
    if (!f) {
        if (p->nf == MAX_FAMILIES) return fail_at(p, ln, "too many families");
        f = &p->f[p->nf++];
        memset(f, 0, sizeof *f);
        snprintf(f->name, sizeof f->name, "%s", name);
    }
    if (f->closed) return fail_at(p, ln, "HELP/TYPE for a family whose samples are done");
    if (*current && *current != f) (*current)->closed = 1;
    *current = f;
    const char *rest = line + off;
    if (!strcmp(kind, "HELP")) {
        if (f->help++) return fail_at(p, ln, "a second HELP");
        for (const char *c = rest; *c; c++)
            if (*c == '\\' && c[1] != '\\' && c[1] != 'n')
                return fail_at(p, ln, "bad HELP escape");
            else if (*c == '\\')
                c++;
        return 0;
    }
    if (f->typed++) return fail_at(p, ln, "a second TYPE");
    static const char *const types[] = {"counter", "gauge", "histogram", "summary", "untyped"};
    for (size_t i = 0; i < 5; i++)
        if (!strcmp(rest, types[i])) {
            snprintf(f->type, sizeof f->type, "%s", rest);
            return 0;
        }
    return fail_at(p, ln, "unknown TYPE");
}

/* Labels "{a="x",b="y"}" starting at *c; fills canonical text and le. */
static int labels(parsed *p, int ln, const char **c, sample *s)
{
    const char *q = *c + 1;
    char names[8][64];
    int n = 0;
    size_t used = 0, base = 0;
    while (*q != '}') {
        const char *start = q;
        while (*q && *q != '=')
            q++;
        size_t nlen = (size_t)(q - start);
        if (*q != '=' || !label_name_ok(start, nlen) || nlen >= 64)
            return fail_at(p, ln, "bad label name");
        for (int i = 0; i < n; i++)
            if (strlen(names[i]) == nlen && !memcmp(names[i], start, nlen))
                return fail_at(p, ln, "a label given twice");
        if (n == 8) return fail_at(p, ln, "too many labels");
        memcpy(names[n], start, nlen);
        names[n++][nlen] = '\0';
        if (*++q != '"') return fail_at(p, ln, "label value not quoted");
        q++;
        char value[256];
        size_t vlen = 0;
        while (*q && *q != '"') {
            if (*q == '\\') {
                q++;
                if (*q != '\\' && *q != '"' && *q != 'n') return fail_at(p, ln, "bad label escape");
            } else if (*q == '\n') {
                return fail_at(p, ln, "newline in a label value");
            }
            if (vlen + 1 < sizeof value) value[vlen++] = *q;
            q++;
        }
        value[vlen] = '\0';
        if (*q != '"') return fail_at(p, ln, "unterminated label value");
        q++;
        int is_le = !strcmp(names[n - 1], "le");
        if (is_le) snprintf(s->le, sizeof s->le, "%s", value);
        used += (size_t)snprintf(s->labels + used, sizeof s->labels - used, "%s%s=\"%s\"",
                                 used ? "," : "", names[n - 1], value);
        if (!is_le)
            base += (size_t)snprintf(s->base_labels + base, sizeof s->base_labels - base,
                                     "%s%s=\"%s\"", base ? "," : "", names[n - 1], value);
        if (*q == ',') {
            q++;
            if (*q == '}') return fail_at(p, ln, "a trailing comma in the labels");
        } else if (*q != '}') {
            return fail_at(p, ln, "labels not separated by a comma");
        }
    }
    *c = q + 1;
    return 0;
}

/* The family a sample name belongs to, given the family's type. */
static family *owner(parsed *p, const char *name, int *suffix)
{
    family *f = family_of(p, name);
    *suffix = 0;
    if (f && strcmp(f->type, "histogram")) return f;
    static const char *const sfx[] = {"_bucket", "_sum", "_count"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(name), k = strlen(sfx[i]);
        if (n <= k || strcmp(name + n - k, sfx[i])) continue;
        char base[128];
        snprintf(base, sizeof base, "%.*s", (int)(n - k), name);
        family *h = family_of(p, base);
        if (h && !strcmp(h->type, "histogram")) {
            *suffix = i + 1;
            return h;
        }
    }
    return NULL;
}

static int sample_line(parsed *p, int ln, const char *line, family **current)
{
    if (p->n == MAX_SAMPLES) return fail_at(p, ln, "too many samples");
    sample *s = &p->s[p->n];
    memset(s, 0, sizeof *s);
    const char *c = line;
    while (*c && *c != '{' && *c != ' ')
        c++;
    if (!metric_name_ok(line, (size_t)(c - line)) || (size_t)(c - line) >= sizeof s->name)
        return fail_at(p, ln, "bad metric name");
    memcpy(s->name, line, (size_t)(c - line));
    if (*c == '{' && labels(p, ln, &c, s)) return -1;
    if (*c != ' ' || c[1] == ' ') return fail_at(p, ln, "no single space before the value");
    c++;
    char value[64], stamp[32] = "";
    int n = sscanf(c, "%63s %31s", value, stamp);
    if (n < 1 || !value_ok(value, &s->value)) return fail_at(p, ln, "bad value");
    if (strstr(c, "  ")) return fail_at(p, ln, "two spaces");
    if (n == 2)
        for (const char *d = stamp[0] == '-' ? stamp + 1 : stamp; *d; d++)
            if (!isdigit((unsigned char)*d)) return fail_at(p, ln, "bad timestamp");
    int suffix;
    family *f = owner(p, s->name, &suffix);
    if (!f || !f->typed) return fail_at(p, ln, "a sample whose family has no TYPE");
    if (f != *current || f->closed) return fail_at(p, ln, "a family's samples are not together");
    if ((suffix == 1) != (s->le[0] != '\0')) return fail_at(p, ln, "le on a non-bucket sample");
    if (!strcmp(f->type, "counter") && (s->value < 0 || isnan(s->value)))
        return fail_at(p, ln, "a negative counter");
    for (size_t i = 0; i < p->n; i++)
        if (!strcmp(p->s[i].name, s->name) && !strcmp(p->s[i].labels, s->labels))
            return fail_at(p, ln, "a series given twice");
    p->n++;
    return 0;
}

/* Per histogram series: buckets ascending in le and cumulative, the last
 * +Inf and equal to _count, and a _sum. */
static int histograms_ok(parsed *p)
{
    for (size_t i = 0; i < p->n; i++) {
        const sample *c = &p->s[i];
        size_t nlen = strlen(c->name);
        if (nlen < 6 || strcmp(c->name + nlen - 6, "_count")) continue;
        char base[128];
        snprintf(base, sizeof base, "%.*s", (int)(nlen - 6), c->name);
        family *f = family_of(p, base);
        if (!f || strcmp(f->type, "histogram")) continue;
        char bname[160], sname[160];
        snprintf(bname, sizeof bname, "%s_bucket", base);
        snprintf(sname, sizeof sname, "%s_sum", base);
        double last_le = -INFINITY, last_count = 0;
        int buckets = 0, inf = 0, sum = 0;
        for (size_t j = 0; j < p->n; j++) {
            const sample *b = &p->s[j];
            if (strcmp(b->base_labels, c->base_labels)) continue;
            if (!strcmp(b->name, sname)) sum = 1;
            if (strcmp(b->name, bname)) continue;
            double le;
            if (inf)
                return snprintf(p->error, sizeof p->error, "%s: a bucket after +Inf", base), -1;
            if (!value_ok(b->le, &le) || !(le > last_le))
                return snprintf(p->error, sizeof p->error, "%s: le not ascending", base), -1;
            if (b->value < last_count)
                return snprintf(p->error, sizeof p->error, "%s: buckets not cumulative", base), -1;
            last_le = le;
            last_count = b->value;
            buckets++;
            if (isinf(le)) inf = 1;
        }
        if (!buckets || !inf)
            return snprintf(p->error, sizeof p->error, "%s: no +Inf bucket", base), -1;
        if (last_count != c->value)
            return snprintf(p->error, sizeof p->error, "%s: +Inf bucket is not _count", base), -1;
        if (!sum) return snprintf(p->error, sizeof p->error, "%s: no _sum", base), -1;
    }
    /* ... and no bucket or sum without a _count. */
    for (size_t i = 0; i < p->n; i++) {
        int suffix;
        family *f = owner(p, p->s[i].name, &suffix);
        if (!suffix) continue;
        char cname[160];
        snprintf(cname, sizeof cname, "%s_count", f->name);
        int found = 0;
        for (size_t j = 0; j < p->n && !found; j++)
            found =
                !strcmp(p->s[j].name, cname) && !strcmp(p->s[j].base_labels, p->s[i].base_labels);
        if (!found) return snprintf(p->error, sizeof p->error, "%s: no _count", f->name), -1;
    }
    return 0;
}

/* Parse text strictly; 0, or -1 with p->error saying where and why. */
static int prom_parse(const char *text, parsed *p)
{
    memset(p, 0, sizeof *p);
    size_t len = strlen(text);
    if (len == 0 || text[len - 1] != '\n') return fail_at(p, 0, "text does not end in a newline");
    family *current = NULL;
    int ln = 0;
    for (const char *c = text; *c;) {
        const char *nl = strchr(c, '\n');
        char line[2048];
        size_t n = (size_t)(nl - c);
        ln++;
        if (n >= sizeof line) return fail_at(p, ln, "line too long");
        memcpy(line, c, n);
        line[n] = '\0';
        c = nl + 1;
        if (n == 0) return fail_at(p, ln, "an empty line");
        if (line[n - 1] == ' ' || line[n - 1] == '\r') return fail_at(p, ln, "trailing space");
        if (line[0] == '#' ? comment(p, ln, line, &current) : sample_line(p, ln, line, &current))
            return -1;
    }
    for (size_t i = 0; i < p->nf; i++)
        if (!p->f[i].typed) return fail_at(p, 0, "a family with HELP and no TYPE");
    return histograms_ok(p);
}

/* The value of the sample name{labels} (labels canonical), or NAN. */
static double value_of(const parsed *p, const char *name, const char *labels)
{
    for (size_t i = 0; i < p->n; i++)
        if (!strcmp(p->s[i].name, name) && !strcmp(p->s[i].labels, labels)) return p->s[i].value;
    return NAN;
}

/* The sum of name's samples whose labels contain every comma-free part of
 * want (e.g. "op=\"read\""). */
static double sum_of(const parsed *p, const char *name, const char *want)
{
    double sum = 0;
    for (size_t i = 0; i < p->n; i++)
        if (!strcmp(p->s[i].name, name) && strstr(p->s[i].labels, want)) sum += p->s[i].value;
    return sum;
}

/* -------------------------------------------------------------- helpers --- */

static parsed P, Q; /* big: not on the stack */

static kvp_engine *engine_with(int metrics_port)
{
    char name[64];
    kvp_engine_opts o;
    kvpt_engine_opts(&o, name);
    o.metrics_port = metrics_port;
    kvp_engine *e = NULL;
    if (kvp_engine_create(&o, &e) != KVP_OK) fprintf(stderr, "  engine: %s\n", kvp_last_error());
    return e;
}

static char *snapshot_text(kvp_engine *e)
{
    kvp_metrics *m;
    if (kvp_engine_metrics(e, &m) != KVP_OK) return NULL;
    char *text = NULL;
    size_t len;
    if (kvp_metrics_format_prometheus(m, &text, &len) != KVP_OK) text = NULL;
    kvp_metrics_free(m);
    return text;
}

typedef struct http_reply {
    long status;
    char *body;
    size_t len;
    char type[128];
} http_reply;

static size_t on_body(char *data, size_t size, size_t n, void *user)
{
    http_reply *r = user;
    char *grown = realloc(r->body, r->len + size * n + 1);
    if (!grown) return 0;
    memcpy(grown + r->len, data, size * n);
    r->len += size * n;
    grown[r->len] = '\0';
    r->body = grown;
    return size * n;
}

/* method NULL: GET. Returns 0 when an HTTP answer came. */
static int http(const char *host, int port, const char *path, const char *method, http_reply *r)
{
    memset(r, 0, sizeof *r);
    char url[256];
    snprintf(url, sizeof url, "http://%s:%d%s", host, port, path);
    CURL *c = curl_easy_init();
    if (!c) return -1;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 10000L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    if (method) curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    CURLcode rc = curl_easy_perform(c);
    char *type = NULL;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    curl_easy_getinfo(c, CURLINFO_CONTENT_TYPE, &type);
    if (type) snprintf(r->type, sizeof r->type, "%s", type);
    curl_easy_cleanup(c);
    if (!r->body) r->body = calloc(1, 1);
    return rc == CURLE_OK ? 0 : -1;
}

/* Scrape and parse into p; 0 on success. */
static int scrape(int port, parsed *p)
{
    http_reply r;
    if (http("127.0.0.1", port, "/metrics", NULL, &r) || r.status != 200) {
        free(r.body);
        return -1;
    }
    int rc = prom_parse(r.body, p);
    if (rc) fprintf(stderr, "  scrape of port %d: %s\n", port, p->error);
    free(r.body);
    return rc;
}

/* ---------------------------------------------------------------- cases --- */

/* The parser itself refuses each kind of malformed text. */
static void parser_refuses(void)
{
    static const char *const bad[] = {
        "x_total 1\n",                                          /* no TYPE */
        "# TYPE x_total counter\nx_total 1",                    /* no final newline */
        "# TYPE x_total counter\nx_total  1\n",                 /* two spaces */
        "# TYPE x_total counter\nx_total{a=\"b\",} 1\n",        /* trailing comma */
        "# TYPE x_total counter\nx_total{a=\"\\q\"} 1\n",       /* bad escape */
        "# TYPE x_total counter\nx_total{a=b} 1\n",             /* unquoted */
        "# TYPE x_total counter\nx_total{1a=\"b\"} 1\n",        /* bad label name */
        "# TYPE x_total counter\nx_total{a=\"b\",a=\"c\"} 1\n", /* label twice */
        "# TYPE x_total counter\nx_total one\n",                /* bad value */
        "# TYPE x_total counter\nx_total -1\n",                 /* negative counter */
        "# TYPE x_total counter\nx_total 1\nx_total 2\n",       /* series twice */
        "# TYPE x_total counter\n# TYPE x_total counter\n",     /* TYPE twice */
        "# TYPE x_total counter\n\nx_total 1\n",                /* empty line */
        "# TYPE x_total count\nx_total 1\n",                    /* unknown type */
        "# random comment\n",                                   /* not HELP/TYPE */
        "# TYPE a counter\n# TYPE b gauge\na 1\n",              /* family not together */
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"2\"} 1\n"
        "h_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n",                     /* not cumulative */
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_sum 1\nh_count 2\n",    /* no +Inf */
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 3\nh_sum 1\nh_count 2\n", /* +Inf != count */
        "# TYPE h histogram\nh_bucket{le=\"2\"} 1\nh_bucket{le=\"1\"} 1\n"
        "h_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",            /* le order */
        "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n", /* no sum */
        "# TYPE h histogram\nh{le=\"+Inf\"} 1\n",                   /* bare name */
        "# TYPE g gauge\ng{le=\"1\"} 1\nx 1\n",                     /* undeclared */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = prom_parse(bad[i], &P);
        if (rc == 0) fprintf(stderr, "  accepted: %s", bad[i]);
        CHECK(rc != 0);
    }
    /* ... and takes what is well formed: escapes, labels, a histogram. */
    const char *good = "# HELP h a \\\\ b\\n c\n# TYPE h histogram\n"
                       "h_bucket{a=\"x\\\"y\",le=\"0.5\"} 1\nh_bucket{a=\"x\\\"y\",le=\"+Inf\"} 2\n"
                       "h_sum{a=\"x\\\"y\"} 1.5e-3\nh_count{a=\"x\\\"y\"} 2\n"
                       "# TYPE g gauge\ng -0.25\ng{b=\"\"} NaN 1700000000000\n";
    int rc = prom_parse(good, &P);
    if (rc) fprintf(stderr, "  refused: %s\n", P.error);
    CHECK(rc == 0 && P.n == 6);
    CHECK(value_of(&P, "h_count", "a=\"x\"y\"") == 2);
}

/* An idle engine's snapshot: every family, zero counts, strict text. */
static void idle_snapshot(void)
{
    kvp_engine *e = engine_with(0);
    REQUIRE(e);
    char *text = snapshot_text(e);
    REQUIRE(text);
    int rc = prom_parse(text, &P);
    if (rc) fprintf(stderr, "  %s\n%s", P.error, text);
    CHECK(rc == 0);
    CHECK(value_of(&P, "kvpipe_engine_requests_total", "op=\"read\",transport=\"tcp\"") == 0);
    CHECK(value_of(&P, "kvpipe_engine_bytes_total", "op=\"write\",transport=\"shm\"") == 0);
    CHECK(value_of(&P, "kvpipe_engine_request_duration_seconds_count", "op=\"read\"") == 0);
    CHECK(value_of(&P, "kvpipe_engine_request_duration_seconds_bucket",
                   "op=\"read\",le=\"+Inf\"") == 0);
    CHECK(value_of(&P, "kvpipe_engine_inflight_bytes", "") == 0);
    CHECK(value_of(&P, "kvpipe_engine_pool_bytes", "") == 0);
    CHECK(value_of(&P, "kvpipe_engine_errors_total", "op=\"read\",status=\"ETIMEDOUT\"") == 0);
    CHECK(kvp_engine_metrics_port(e) == 0);
    free(text);
    /* The managed pool shows in the pool gauges. */
    void *buf;
    REQUIRE_OK(kvp_engine_alloc(e, 1u << 20, &buf));
    text = snapshot_text(e);
    REQUIRE(text && prom_parse(text, &P) == 0);
    double pool = value_of(&P, "kvpipe_engine_pool_bytes", "");
    double free_b = value_of(&P, "kvpipe_engine_pool_free_bytes", "");
    CHECK(pool >= (1u << 20));
    CHECK(free_b == pool - (1u << 20));
    CHECK(value_of(&P, "kvpipe_engine_pool_allocations", "") == 1);
    CHECK(value_of(&P, "kvpipe_engine_registered_bytes", "") == pool);
    free(text);
    CHECK_OK(kvp_engine_free(e, buf));
    kvp_engine_destroy(e);
}

/* Exact counts of a known workload against a target in another process, over
 * tcp and over shm. */
static void counts_transfers_on(const char *protocol, int disable_shm)
{
    kvpt_target t;
    kvpt_target_opts to = {.metadata = "P2PHANDSHAKE",
                           .protocol = protocol,
                           .len = 4u << 20,
                           .seed = 3,
                           .disable_shm = disable_shm};
    REQUIRE(kvpt_target_start(&to, &t) == 0);
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start("P2PHANDSHAKE", protocol, disable_shm, 0, &e) == 0);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    kvp_remote_buffer rb;
    size_t nb;
    REQUIRE_OK(kvp_engine_segment_buffers(e, seg, &rb, 1, &nb));
    const char *tr = kvp_engine_segment_transport(e, seg);
    REQUIRE(tr);
    static char local[1 << 20];
    for (int i = 0; i < 5; i++)
        CHECK_OK(kvp_engine_read(e, seg, local, rb.addr, 65536));
    for (int i = 0; i < 3; i++)
        CHECK_OK(kvp_engine_write(e, seg, local, rb.addr + 4096, 1000));
    /* A batch of 4, one of them outside the target's buffer: 3 done, 1 ERANGE. */
    kvp_request reqs[4];
    for (int i = 0; i < 4; i++)
        reqs[i] = (kvp_request){KVP_OP_READ, local + i * 4096, rb.addr + (uint64_t)i * 4096, 4096};
    reqs[3].remote = rb.addr + rb.length; /* just past the end */
    kvp_batch *b;
    REQUIRE_OK(kvp_batch_submit(e, seg, reqs, 4, &b));
    CHECK_ST(kvp_batch_wait(b, 30000), KVP_ERANGE);
    kvp_batch_free(b);

    kvp_metrics *m;
    REQUIRE_OK(kvp_engine_metrics(e, &m));
    char sel[64];
    snprintf(sel, sizeof sel, "op=read,transport=%s", tr);
    const kvp_metric *x = kvp_metrics_find(m, "kvpipe_engine_requests_total", sel);
    CHECK(x && x->value == 8);
    x = kvp_metrics_find(m, "kvpipe_engine_bytes_total", sel);
    CHECK(x && x->value == 5 * 65536 + 3 * 4096);
    snprintf(sel, sizeof sel, "op=write,transport=%s", tr);
    x = kvp_metrics_find(m, "kvpipe_engine_bytes_total", sel);
    CHECK(x && x->value == 3000);
    x = kvp_metrics_find(m, "kvpipe_engine_errors_total", "op=read,status=ERANGE");
    CHECK(x && x->value == 1);
    x = kvp_metrics_find(m, "kvpipe_engine_request_duration_seconds", "op=read");
    CHECK(x && x->type == KVP_METRIC_HISTOGRAM && x->count == 8 && x->sum > 0);
    CHECK(x && x->n_buckets > 0 && x->bucket_counts[x->n_buckets - 1] <= x->count);
    x = kvp_metrics_find(m, "kvpipe_engine_inflight_requests", NULL);
    CHECK(x && x->value == 0);
    x = kvp_metrics_find(m, "kvpipe_engine_inflight_bytes", NULL);
    CHECK(x && x->value == 0);
    x = kvp_metrics_find(m, "kvpipe_engine_descriptor_lookups_total", NULL);
    CHECK(x && x->value >= 1);
    /* The other transport moved nothing. */
    const char *other = strcmp(tr, "tcp") ? "tcp" : "shm";
    snprintf(sel, sizeof sel, "op=read,transport=%s", other);
    x = kvp_metrics_find(m, "kvpipe_engine_requests_total", sel);
    CHECK(x && x->value == 0);
    CHECK(kvp_metrics_find(m, "kvpipe_engine_requests_total", "op=bogus") == NULL);
    CHECK(kvp_metrics_find(m, "no_such_metric", NULL) == NULL);
    kvp_metrics_free(m);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

static void counts_tcp(void)
{
    counts_transfers_on("tcp", 1);
}

static void counts_shm(void)
{
    counts_transfers_on("tcp", 0); /* a same-host peer: shm */
}

/* Bench target and initiator as separate processes, each with an endpoint;
 * this test scrapes both while the initiator runs and parses every scrape. */
static void endpoint_live_transfer(void)
{
    /* Four ports picked together, so that no two of them are the same. */
    static const int offsets[] = {0, 1, 2, 3};
    int base = kvpt_free_port_block(offsets, 4);
    int tport = base, iport = base + 1, tm = base + 2, im = base + 3;
    char tname[64], iname[64], tm_s[16], im_s[16];
    snprintf(tname, sizeof tname, "127.0.0.1:%d", tport);
    snprintf(iname, sizeof iname, "127.0.0.1:%d", iport);
    snprintf(tm_s, sizeof tm_s, "%d", tm);
    snprintf(im_s, sizeof im_s, "%d", im);
    setenv("KVPIPE_METRICS_PORT", tm_s, 1);
    char *targv[] = {
        (char *)kvpt_cli(), "bench", "--mode",   "target", "--local-server-name", tname,
        "--buffer-size",    "16M",   "--no-shm", NULL};
    /* The target serves once it says so: its ports open before its buffer
     * is registered. */
    pid_t target = kvpt_spawn_until(targv, "serving segment", 10000);
    REQUIRE(target > 0);
    REQUIRE(kvpt_wait_port("127.0.0.1", tm, 10000) == 0);
    setenv("KVPIPE_METRICS_PORT", im_s, 1);
    char *iargv[] = {(char *)kvpt_cli(),
                     "bench",
                     "--mode",
                     "initiator",
                     "--local-server-name",
                     iname,
                     "--segment-id",
                     tname,
                     "--buffer-size",
                     "16M",
                     "--no-shm",
                     "--block-size",
                     "64K",
                     "--batch-size",
                     "16",
                     "--threads",
                     "1",
                     "--duration",
                     "6",
                     NULL};
    pid_t init = kvpt_spawn(iargv, "/dev/null");
    unsetenv("KVPIPE_METRICS_PORT");
    REQUIRE(kvpt_wait_port("127.0.0.1", im, 10000) == 0);
    /* Scrape until two scrapes show the read counters growing mid-run. */
    double first = -1, later = -1;
    int scrapes = 0, bad = 0;
    for (int i = 0; i < 50 && later <= first; i++) {
        usleep(100000);
        if (scrape(im, &P) != 0) {
            bad++;
            continue;
        }
        scrapes++;
        double v = sum_of(&P, "kvpipe_engine_bytes_total", "op=\"read\",transport=\"tcp\"");
        CHECK(!isnan(v));
        if (v > 0 && first < 0)
            first = v;
        else if (first > 0 && v > first)
            later = v;
    }
    CHECK(bad == 0);
    CHECK(first > 0 && later > first);
    /* Every sample carries the engine label. */
    char want[160];
    snprintf(want, sizeof want, "engine=\"%s\"", iname);
    for (size_t i = 0; i < P.n; i++)
        CHECK(strncmp(P.s[i].labels, want, strlen(want)) == 0);
    /* The latency histogram counts the same requests. */
    double reqs = sum_of(&P, "kvpipe_engine_requests_total", "op=\"read\"");
    double hist = sum_of(&P, "kvpipe_engine_request_duration_seconds_count", "op=\"read\"");
    CHECK(reqs > 0 && hist == reqs);
    /* The target served what it was asked. */
    REQUIRE(scrape(tm, &Q) == 0);
    snprintf(want, sizeof want, "engine=\"%s\",op=\"read\",transport=\"tcp\"", tname);
    CHECK(value_of(&Q, "kvpipe_engine_served_bytes_total", want) > 0);
    snprintf(want, sizeof want, "engine=\"%s\"", tname);
    CHECK(value_of(&Q, "kvpipe_engine_registered_bytes", want) == 16 << 20);
    /* Content type, other paths and methods. */
    http_reply r;
    CHECK(http("127.0.0.1", tm, "/metrics", NULL, &r) == 0 && r.status == 200);
    CHECK(strstr(r.type, "text/plain") && strstr(r.type, "version=0.0.4"));
    free(r.body);
    CHECK(http("127.0.0.1", tm, "/other", NULL, &r) == 0 && r.status == 404);
    free(r.body);
    CHECK(http("127.0.0.1", tm, "/metrics", "POST", &r) == 0 && r.status == 405);
    free(r.body);
    CHECK(kvpt_wait_child(init, 60000) == 0);
    kill(target, SIGTERM);
    CHECK(kvpt_wait_child(target, 20000) == 0);
    fprintf(stderr, "  %d scrapes during the run\n", scrapes);
}

/* Two engines of one process asking for one port share the endpoint. */
static void endpoint_shared(void)
{
    int port = kvpt_free_port();
    kvp_engine *a = engine_with(port), *b = engine_with(port);
    REQUIRE(a && b);
    CHECK(kvp_engine_metrics_port(a) == port && kvp_engine_metrics_port(b) == port);
    REQUIRE(scrape(port, &P) == 0);
    char want[160];
    snprintf(want, sizeof want, "engine=\"%s\",op=\"read\",transport=\"tcp\"",
             kvp_engine_segment_name(a));
    CHECK(value_of(&P, "kvpipe_engine_requests_total", want) == 0);
    snprintf(want, sizeof want, "engine=\"%s\",op=\"read\",transport=\"tcp\"",
             kvp_engine_segment_name(b));
    CHECK(value_of(&P, "kvpipe_engine_requests_total", want) == 0);
    kvp_engine_destroy(b);
    REQUIRE(scrape(port, &P) == 0);
    CHECK(isnan(value_of(&P, "kvpipe_engine_requests_total", want)));
    kvp_engine_destroy(a);
    http_reply r;
    CHECK(http("127.0.0.1", port, "/metrics", NULL, &r) != 0); /* gone with the last engine */
    free(r.body);
    /* Port ANY: a port of its own. */
    kvp_engine *c = engine_with(KVP_METRICS_PORT_ANY);
    REQUIRE(c);
    CHECK(kvp_engine_metrics_port(c) > 0);
    CHECK(scrape(kvp_engine_metrics_port(c), &P) == 0);
    kvp_engine_destroy(c);
}

/* The endpoint listens on loopback unless told otherwise (/proc/net/tcp). */
static void endpoint_loopback(void)
{
    kvp_engine *e = engine_with(KVP_METRICS_PORT_ANY);
    REQUIRE(e);
    int port = kvp_engine_metrics_port(e);
    FILE *f = fopen("/proc/net/tcp", "r");
    REQUIRE(f);
    char line[512], want[32];
    snprintf(want, sizeof want, ":%04X ", port);
    int found = 0, loopback = 0;
    while (fgets(line, sizeof line, f)) {
        char local[64];
        unsigned st;
        if (sscanf(line, " %*d: %63s %*s %x", local, &st) != 2 || st != 0x0A) continue;
        strcat(local, " ");
        if (!strstr(local, want)) continue;
        found = 1;
        loopback = strncmp(local, "0100007F:", 9) == 0;
    }
    fclose(f);
    CHECK(found && loopback);
    kvp_engine_destroy(e);
}

static void endpoint_errors(void)
{
    /* A port another program holds. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    REQUIRE(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(fd, 1) == 0);
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    char name[64];
    kvp_engine_opts o;
    kvpt_engine_opts(&o, name);
    o.metrics_port = ntohs(sa.sin_port);
    kvp_engine *e = NULL;
    CHECK_ST(kvp_engine_create(&o, &e), KVP_EBUSY);
    CHECK(strstr(kvp_last_error(), "metrics endpoint") != NULL);
    CHECK(e == NULL);
    close(fd);
    o.metrics_port = 70000;
    CHECK_ST(kvp_engine_create(&o, &e), KVP_EINVAL);
    /* A bad KVPIPE_METRICS_PORT names itself. */
    o.metrics_port = 0;
    setenv("KVPIPE_METRICS_PORT", "eighty", 1);
    CHECK_ST(kvp_engine_create(&o, &e), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "KVPIPE_METRICS_PORT") != NULL);
    setenv("KVPIPE_METRICS_PORT", "", 1);
    CHECK_OK(kvp_engine_create(&o, &e));
    CHECK(kvp_engine_metrics_port(e) == 0);
    kvp_engine_destroy(e);
    setenv("MC_TE_METRIC", "1", 1);
    setenv("MC_TE_METRIC_INTERVAL_SECONDS", "0", 1);
    e = NULL;
    CHECK_ST(kvp_engine_create(&o, &e), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "MC_TE_METRIC_INTERVAL_SECONDS") != NULL);
}

/* MC_TE_METRIC=1: Mooncake's line, once per interval while bytes move. */
static void mc_te_metric_line(void)
{
    int tport = kvpt_free_port(), iport = kvpt_free_port();
    char tname[64], iname[64], log_path[64];
    snprintf(tname, sizeof tname, "127.0.0.1:%d", tport);
    snprintf(iname, sizeof iname, "127.0.0.1:%d", iport);
    snprintf(log_path, sizeof log_path, "/tmp/kvpt-mcmetric-%d.log", (int)getpid());
    char *targv[] = {
        (char *)kvpt_cli(), "bench", "--mode",   "target", "--local-server-name", tname,
        "--buffer-size",    "16M",   "--no-shm", NULL};
    pid_t target = kvpt_spawn_until(targv, "serving segment", 10000);
    REQUIRE(target > 0);
    setenv("MC_TE_METRIC", "1", 1);
    setenv("MC_TE_METRIC_INTERVAL_SECONDS", "1", 1);
    setenv("KVPIPE_LOG", "error", 1); /* the line shows at any level */
    fflush(NULL);
    pid_t init = fork();
    if (init == 0) {
        int fd = open(log_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(fd, 2);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        execl(kvpt_cli(), kvpt_cli(), "bench", "--mode", "initiator", "--local-server-name", iname,
              "--segment-id", tname, "--buffer-size", "16M", "--no-shm", "--threads", "1",
              "--duration", "3.5", (char *)NULL);
        _exit(127);
    }
    int init_rc = kvpt_wait_child(init, 60000);
    CHECK(init_rc == 0);
    kill(target, SIGTERM);
    kvpt_wait_child(target, 20000);
    FILE *f = fopen(log_path, "r");
    REQUIRE(f);
    char line[2048];
    int lines = 0;
    while (fgets(line, sizeof line, f)) {
        if (init_rc != 0) fprintf(stderr, "  initiator: %s", line);
        const char *m =
            strstr(line, "[Metrics] Transfer Engine Stats (over last 1s): Throughput: ");
        if (!m) continue;
        double mbs;
        unsigned long long count;
        const char *lat = strstr(m, " MB/s | Latency Distribution (count=");
        CHECK(sscanf(m, "[Metrics] Transfer Engine Stats (over last 1s): Throughput: %lf", &mbs) ==
              1);
        CHECK(mbs > 0);
        CHECK(lat && sscanf(lat, " MB/s | Latency Distribution (count=%llu)", &count) == 1 &&
              count > 0);
        CHECK(lat && strstr(lat, "μs:") != NULL && strstr(lat, "%") != NULL);
        lines++;
    }
    fclose(f);
    unlink(log_path);
    CHECK(lines >= 2 && lines <= 5);
}

/* A pipe's metrics: the sender here (endpoint on a free port), the receiver
 * in another process; counts of messages, bytes, ACKs and timeouts, through
 * kvp_pipe_metrics() and the endpoint. */
static void pipe_metrics(void)
{
    kvpt_raw_setup rs; /* a P2P tcp config at 127.0.0.1:B for both sides */
    REQUIRE(kvpt_raw_setup_init(&rs) == 0);
    const char *json = rs.json;
    enum { N = 5, SIZE = 100000 };
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        kvp_pipe_config *cfg;
        kvp_pipe *pipe;
        kvp_pipe_opts co;
        kvp_pipe_opts_init(&co);
        co.disable_shm = 1;
        co.inline_max_bytes = 0; /* every message announced and READ: the engine counts it */
        if (kvp_pipe_config_parse(json, strlen(json), &cfg) || kvp_pipe_open(cfg, 0, 1, &co, &pipe))
            _exit(2);
        kvp_pipe_config_free(cfg);
        int bad = 0;
        for (int i = 0; i < N; i++) {
            kvp_tensor *t = NULL;
            if (kvp_pipe_recv(pipe, 30000, &t) != KVP_OK || !t || t->nbytes != SIZE) bad = 1;
            kvp_tensor_free(t);
        }
        kvp_pipe_close(pipe);
        _exit(bad);
    }
    kvp_pipe_config *cfg;
    REQUIRE_OK(kvp_pipe_config_parse(json, strlen(json), &cfg));
    kvp_pipe_opts po;
    kvp_pipe_opts_init(&po);
    po.metrics_port = KVP_METRICS_PORT_ANY;
    po.disable_shm = 1;
    po.inline_max_bytes = 0;
    kvp_pipe *pipe;
    REQUIRE_OK(kvp_pipe_open(cfg, 0, 0, &po, &pipe));
    kvp_pipe_config_free(cfg);
    static uint8_t data[SIZE];
    int64_t shape = SIZE;
    for (int i = 0; i < N; i++) {
        kvp_tensor t;
        kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &shape, data);
        CHECK_OK(kvp_pipe_send(pipe, &t));
    }
    CHECK_OK(kvp_pipe_flush(pipe, 30000));
    kvp_tensor *none = NULL;
    CHECK_ST(kvp_pipe_recv(pipe, 10, &none), KVP_ETIMEDOUT); /* nothing comes this way */
    CHECK(kvpt_wait_child(child, 60000) == 0);
    kvp_metrics *m;
    REQUIRE_OK(kvp_pipe_metrics(pipe, &m));
    const kvp_metric *x = kvp_metrics_find(m, "kvpipe_pipe_messages_total", "direction=sent");
    CHECK(x && x->value == N);
    x = kvp_metrics_find(m, "kvpipe_pipe_bytes_total", "direction=sent");
    CHECK(x && x->value > (double)N * SIZE && x->value < (double)N * (SIZE + 1024));
    x = kvp_metrics_find(m, "kvpipe_pipe_acks_total", NULL);
    CHECK(x && x->value == N);
    x = kvp_metrics_find(m, "kvpipe_pipe_timeouts_total", "op=recv");
    CHECK(x && x->value == 1);
    x = kvp_metrics_find(m, "kvpipe_pipe_timeouts_total", "op=send");
    CHECK(x && x->value == 0);
    x = kvp_metrics_find(m, "kvpipe_pipe_inflight_messages", NULL);
    CHECK(x && x->value == 0);
    /* Its engine's follow: the receiver READ the messages from it. */
    x = kvp_metrics_find(m, "kvpipe_engine_served_requests_total", "op=read,transport=tcp");
    CHECK(x && x->value >= N);
    kvp_metrics_free(m);
    /* The endpoint serves both, under the engine's label. */
    int port = kvp_engine_metrics_port(kvp_pipe_engine(pipe));
    REQUIRE(port > 0 && scrape(port, &P) == 0);
    char want[160];
    snprintf(want, sizeof want, "engine=\"%s\",direction=\"sent\"",
             kvp_engine_segment_name(kvp_pipe_engine(pipe)));
    CHECK(value_of(&P, "kvpipe_pipe_messages_total", want) == N);
    CHECK(sum_of(&P, "kvpipe_engine_served_requests_total", "op=\"read\"") >= N);
    kvp_pipe_close(pipe);
}

int main(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    RUN(parser_refuses);
    RUN(idle_snapshot);
    RUN(counts_tcp);
    RUN(counts_shm);
    RUN(endpoint_live_transfer);
    RUN(endpoint_shared);
    RUN(endpoint_loopback);
    RUN(endpoint_errors);
    RUN(mc_te_metric_line);
    RUN(pipe_metrics);
    return kvpt_summary();
}
