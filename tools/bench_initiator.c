/* kvpipe bench, the initiator: one point (block size x batch size x
 * threads), or each point of a sweep, against one target segment. Each
 * thread submits a batch, waits for it, and records how long the batch took;
 * throughput counts the bytes of requests that succeeded. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <cjson/cJSON.h>

#include "bench.h"
#include "cli.h"
#include "pattern.h"

/* Local memory per thread without --verify: requests beyond it reuse it (a
 * READ's bytes land on others'), so a sweep to 16 MiB x 32 stays affordable. */
#define LOCAL_CAP ((size_t)64 << 20)
#define SAMPLES_MAX ((size_t)16 << 20)

typedef struct point {
    size_t block, batch;
    int threads;
} point;

typedef struct result {
    point at;
    uint64_t bytes, ops, errors, mismatches, batches, read_back;
    double secs, gbps, p50_ms, p99_ms, p999_ms;
} result;

typedef struct worker {
    pthread_t thread;
    int id;
    const bench_opts *o;
    point at;
    kvp_engine *e;
    kvp_segment_id seg;
    uint64_t remote_base, remote_len;
    uint64_t deadline_ns;
    uint64_t bytes, ops, errors, mismatches;
    uint64_t *lat_ns; /* per batch */
    size_t n_lat, cap_lat;
    uint8_t *written; /* write --verify: per block, 1 once a write of it succeeded */
    char error[256];  /* the first failure's detail */
} worker;

static void record(worker *w, uint64_t ns)
{
    if (w->n_lat == w->cap_lat) {
        size_t cap = w->cap_lat ? 2 * w->cap_lat : 4096;
        uint64_t *grown = cap <= SAMPLES_MAX ? realloc(w->lat_ns, cap * sizeof *grown) : NULL;
        if (!grown) return; /* the percentiles then cover what fit */
        w->lat_ns = grown;
        w->cap_lat = cap;
    }
    w->lat_ns[w->n_lat++] = ns;
}

/* Request i of a batch succeeded: into the worker's counts. */
static void count_ok(worker *w, size_t i, const char *local, size_t slots, const uint64_t *offs)
{
    size_t block = w->at.block;
    w->ops++;
    w->bytes += block;
    if (w->written) w->written[offs[i] / block] = 1;
    if (!w->o->write && w->o->verify &&
        pattern_check(local + (i % slots) * block, block, PATTERN_TARGET, offs[i]))
        w->mismatches++;
}

/* One batch's results into the worker's counts. */
static void account(worker *w, kvp_batch *b, char *local, size_t slots, const uint64_t *offs)
{
    for (size_t i = 0; i < w->at.batch; i++) {
        if (kvp_batch_request_status(b, i) != KVP_OK)
            w->errors++;
        else
            count_ok(w, i, local, slots, offs);
    }
}

/* --sync: the batch's requests one after the other, each through the
 * blocking calls, accounted as account() does. */
static void sync_batch(worker *w, const kvp_request *reqs, char *local, size_t slots,
                       const uint64_t *offs)
{
    for (size_t i = 0; i < w->at.batch; i++) {
        const kvp_request *r = &reqs[i];
        kvp_status st = r->opcode == KVP_OP_WRITE
                            ? kvp_engine_write(w->e, w->seg, r->local, r->remote, r->length)
                            : kvp_engine_read(w->e, w->seg, r->local, r->remote, r->length);
        if (st == KVP_OK) {
            count_ok(w, i, local, slots, offs);
            continue;
        }
        if (!w->error[0]) snprintf(w->error, sizeof w->error, "%s", kvp_last_error());
        w->errors++;
    }
}

/* bytes rounded down to whole blocks, one at least. */
static size_t whole_blocks(size_t bytes, size_t block)
{
    return bytes > block ? bytes / block * block : block;
}

/* A worker's local memory at point at: a block per request of a batch (at
 * most LOCAL_CAP without --verify), or --local-span in whole blocks. */
static size_t local_bytes(const bench_opts *o, point at)
{
    size_t len = at.batch * at.block;
    if (o->local_span) return whole_blocks(o->local_span, at.block);
    if (!o->verify && len > LOCAL_CAP) return whole_blocks(LOCAL_CAP, at.block);
    return len;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    const bench_opts *o = w->o;
    size_t block = w->at.block, batch = w->at.batch;
    size_t nblocks = w->remote_len / block;
    size_t local_len = local_bytes(o, w->at);
    size_t slots = local_len / block;
    /* Populated before the clock starts: page faults are not the engine's. */
    char *local = mmap(NULL, local_len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    kvp_request *reqs = calloc(batch, sizeof *reqs);
    uint64_t *offs = calloc(batch, sizeof *offs);
    if (local == MAP_FAILED || !reqs || !offs) {
        snprintf(w->error, sizeof w->error, "out of memory for %zu local bytes", local_len);
        w->errors++;
        goto out;
    }
    uint64_t next = (uint64_t)w->id * batch;
    while (cli_now_ns() < w->deadline_ns) {
        for (size_t i = 0; i < batch; i++) {
            offs[i] = (next++ % nblocks) * block;
            char *l = local + (i % slots) * block;
            if (o->write && o->verify) pattern_fill(l, block, PATTERN_WRITE, offs[i]);
            reqs[i] = (kvp_request){o->write ? KVP_OP_WRITE : KVP_OP_READ, l,
                                    w->remote_base + offs[i], block};
        }
        uint64_t t0 = cli_now_ns();
        if (o->sync) {
            sync_batch(w, reqs, local, slots, offs);
            record(w, cli_now_ns() - t0);
            if (w->errors) break;
            continue;
        }
        kvp_batch *b;
        kvp_status st = kvp_batch_submit(w->e, w->seg, reqs, batch, &b);
        if (st == KVP_OK) {
            st = kvp_batch_wait(b, -1);
            record(w, cli_now_ns() - t0);
            if (st != KVP_OK && !w->error[0])
                snprintf(w->error, sizeof w->error, "%s", kvp_last_error());
            account(w, b, local, slots, offs);
            kvp_batch_free(b);
        } else {
            snprintf(w->error, sizeof w->error, "%s", kvp_last_error());
            w->errors += batch;
        }
        if (w->errors) break;
    }
out:
    if (local != MAP_FAILED) munmap(local, local_len);
    free(reqs);
    free(offs);
    return NULL;
}

/* After a write --verify run: read back every block some worker wrote
 * successfully and check that it holds what was written, so that a write
 * reported done whose bytes never landed is caught (the target's own check on
 * exit accepts its initial pattern). Returns the blocks that do not hold the
 * written pattern, or -1 when the read-back itself failed. */
static int64_t read_back(const worker *ws, int threads, size_t nblocks, uint64_t *checked)
{
    size_t block = ws[0].at.block;
    char *local = malloc(block);
    if (!local) return -1;
    int64_t lost = 0;
    *checked = 0;
    for (size_t k = 0; k < nblocks; k++) {
        int wrote = 0;
        for (int i = 0; i < threads && !wrote; i++)
            wrote = ws[i].written[k];
        if (!wrote) continue;
        uint64_t off = (uint64_t)k * block;
        if (kvp_engine_read(ws[0].e, ws[0].seg, local, ws[0].remote_base + off, block) != KVP_OK) {
            lost = -1;
            break;
        }
        (*checked)++;
        if (pattern_check(local, block, PATTERN_WRITE, off)) {
            if (!lost) cli_error("block at %" PRIu64 " lost its write", off);
            lost++;
        }
    }
    free(local);
    return lost;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentiles of every worker's batch latencies, in ms. */
static void percentiles(const worker *ws, int threads, result *r)
{
    size_t n = 0;
    for (int i = 0; i < threads; i++)
        n += ws[i].n_lat;
    r->batches = n;
    uint64_t *all = n ? malloc(n * sizeof *all) : NULL;
    if (!all) return;
    size_t k = 0;
    for (int i = 0; i < threads; i++) {
        memcpy(all + k, ws[i].lat_ns, ws[i].n_lat * sizeof *all);
        k += ws[i].n_lat;
    }
    qsort(all, n, sizeof *all, cmp_u64);
    const double q[3] = {0.5, 0.99, 0.999};
    double *out[3] = {&r->p50_ms, &r->p99_ms, &r->p999_ms};
    for (int j = 0; j < 3; j++) {
        size_t rank = (size_t)(q[j] * (double)n + 0.999999);
        *out[j] = (double)all[rank ? rank - 1 : 0] / 1e6;
    }
    free(all);
}

typedef struct target {
    kvp_engine *e;
    kvp_segment_id seg;
    kvp_remote_buffer rb;
    uint64_t span;
    uint64_t warmup_bytes; /* moved by the untimed pass, in warmup_secs */
    double warmup_secs;
} target;

#define WARMUP_CHUNK ((size_t)4 << 20)

/* The untimed pass before the clock starts (unless --no-warmup): every byte
 * of the span READ once, and for a write run written back as it was read
 * (so a --verify target still holds its pattern). A transport that maps the
 * target's memory here (ucx over shared memory) takes its page faults now,
 * as ucx_perftest's warm-up does and a long-running caller does once: the
 * timed run measures the transfers, not the first touch. 0, or -1 with
 * error set. */
static int warm_up(const bench_opts *o, target *t, char *error, size_t cap)
{
    size_t chunk = t->span < WARMUP_CHUNK ? (size_t)t->span : WARMUP_CHUNK;
    char *local = mmap(NULL, chunk, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (local == MAP_FAILED) {
        snprintf(error, cap, "warm-up: out of memory for %zu local bytes", chunk);
        return -1;
    }
    uint64_t start = cli_now_ns();
    int rc = 0;
    for (uint64_t off = 0; off < t->span && !rc; off += chunk) {
        size_t len = t->span - off < chunk ? (size_t)(t->span - off) : chunk;
        uint64_t at = t->rb.addr + off;
        if (kvp_engine_read(t->e, t->seg, local, at, len) ||
            (o->write && kvp_engine_write(t->e, t->seg, local, at, len))) {
            snprintf(error, cap, "warm-up pass at offset %" PRIu64 ": %s", off, kvp_last_error());
            rc = -1;
        } else {
            t->warmup_bytes += len;
        }
    }
    t->warmup_secs = (double)(cli_now_ns() - start) / 1e9;
    munmap(local, chunk);
    return rc;
}

/* Run one point; 0 when it ran (errors are in r), -1 when it could not. */
static int run_point(const bench_opts *o, const target *t, point at, result *r, char *error,
                     size_t cap)
{
    memset(r, 0, sizeof *r);
    r->at = at;
    size_t nblocks = t->span / at.block;
    if (nblocks == 0) {
        snprintf(error, cap, "the target's buffer (%" PRIu64 " bytes) is smaller than a block",
                 t->span);
        return -1;
    }
    int check_writes = o->verify && o->write;
    worker *ws = calloc((size_t)at.threads, sizeof *ws);
    if (!ws) return -1;
    int rc = 0;
    for (int i = 0; i < at.threads && check_writes; i++)
        if (!(ws[i].written = calloc(nblocks, 1))) rc = -1;
    uint64_t start = cli_now_ns();
    for (int i = 0; i < at.threads && !rc; i++) {
        uint8_t *written = ws[i].written;
        ws[i] = (worker){.id = i,
                         .o = o,
                         .at = at,
                         .e = t->e,
                         .seg = t->seg,
                         .remote_base = t->rb.addr,
                         .remote_len = t->span,
                         .deadline_ns = start + (uint64_t)(o->duration * 1e9)};
        ws[i].written = written;
        pthread_create(&ws[i].thread, NULL, worker_main, &ws[i]);
    }
    for (int i = 0; i < at.threads && !rc; i++) {
        pthread_join(ws[i].thread, NULL);
        r->bytes += ws[i].bytes;
        r->ops += ws[i].ops;
        r->errors += ws[i].errors;
        r->mismatches += ws[i].mismatches;
        if (ws[i].error[0] && !error[0]) snprintf(error, cap, "%s", ws[i].error);
    }
    r->secs = (double)(cli_now_ns() - start) / 1e9;
    r->gbps = (double)r->bytes / r->secs / 1e9;
    if (!rc) percentiles(ws, at.threads, r);
    if (!rc && check_writes && !r->errors) {
        int64_t lost = read_back(ws, at.threads, nblocks, &r->read_back);
        if (lost < 0) {
            snprintf(error, cap, "reading back the written blocks failed: %s", kvp_last_error());
            r->errors++;
        } else {
            r->mismatches += (uint64_t)lost;
        }
    }
    for (int i = 0; i < at.threads; i++) {
        free(ws[i].written);
        free(ws[i].lat_ns);
    }
    free(ws);
    return rc;
}

/* ------------------------------------------------------------ output --- */

static void human(size_t b, char *out, size_t cap)
{
    if (b >= (1u << 20) && b % (1u << 20) == 0)
        snprintf(out, cap, "%zu MiB", b >> 20);
    else if (b >= 1024 && b % 1024 == 0)
        snprintf(out, cap, "%zu KiB", b >> 10);
    else
        snprintf(out, cap, "%zu B", b);
}

static double in_unit(const bench_opts *o, const result *r)
{
    return (double)r->bytes / r->secs / bench_units[o->unit].bytes;
}

static void print_point(const bench_opts *o, const result *r, const char *tr)
{
    const char *unit = bench_units[o->unit].name;
    printf("kvpipe bench: %s %zu B x %zu x %d threads via %s: %.*f %s/s, %" PRIu64 " ops, %" PRIu64
           " errors%s; batch latency p50 %.3f ms, p99 %.3f ms, p999 %.3f ms\n",
           o->write ? "write" : "read", r->at.block, r->at.batch, r->at.threads, tr, o->precision,
           in_unit(o, r), unit, r->ops, r->errors,
           o->verify ? (r->mismatches ? ", VERIFY FAILED" : ", verified") : "", r->p50_ms,
           r->p99_ms, r->p999_ms);
    /* Mooncake's transfer_engine_bench line, for scripts that read it. */
    printf("Test completed: duration %.2f, batch count %" PRIu64 ", throughput %.*f %s/s\n",
           r->secs, r->batches, o->precision, in_unit(o, r), unit);
}

/* A point's JSON fields, without the braces. */
static void json_fields(const bench_opts *o, const result *r)
{
    printf("\"block_size\": %zu, \"batch_size\": %zu, \"threads\": %d, \"local_bytes\": %zu, "
           "\"gbps\": %.4f, "
           "\"bytes\": %" PRIu64 ", \"ops\": %" PRIu64 ", \"batches\": %" PRIu64
           ", \"errors\": %" PRIu64 ", \"mismatches\": %" PRIu64 ", \"seconds\": %.3f, "
           "\"p50_ms\": %.4f, \"p99_ms\": %.4f, \"p999_ms\": %.4f, \"read_back\": %" PRIu64,
           r->at.block, r->at.batch, r->at.threads, local_bytes(o, r->at), r->gbps, r->bytes,
           r->ops, r->batches, r->errors + r->mismatches, r->mismatches, r->secs, r->p50_ms,
           r->p99_ms, r->p999_ms, r->read_back);
}

static void table_head(const bench_opts *o, const char *tr, size_t n)
{
    printf("kvpipe bench: sweep of %zu points, %s via %s, %.1f s each; latency of one batch, "
           "submit to completion\n",
           n, o->write ? "write" : "read", tr, o->duration);
    char unit[16];
    snprintf(unit, sizeof unit, "%s/s", bench_units[o->unit].name);
    printf("%10s %6s %7s %10s %10s %9s %9s %9s %7s\n", "block", "batch", "threads", unit, "ops",
           "p50 ms", "p99 ms", "p999 ms", "errors");
}

static void table_row(const bench_opts *o, const result *r)
{
    char b[32];
    human(r->at.block, b, sizeof b);
    printf("%10s %6zu %7d %10.*f %10" PRIu64 " %9.3f %9.3f %9.3f %7" PRIu64 "\n", b, r->at.batch,
           r->at.threads, o->precision, in_unit(o, r), r->ops, r->p50_ms, r->p99_ms, r->p999_ms,
           r->errors + r->mismatches);
    fflush(stdout);
}

/* -------------------------------------------------------------- run --- */

/* Whether the store (or, P2P, the target) has o->segment with a buffer. */
static kvp_status segment_serves(const bench_opts *o, char *why, size_t cap)
{
    char *desc, *host;
    kvp_status st = kvp_info_segment(o->metadata, o->segment, 1000, &desc, &host);
    if (st) {
        snprintf(why, cap, "%s", kvp_last_error());
        return st;
    }
    cJSON *doc = cJSON_Parse(desc);
    int n = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(doc, "buffers"));
    cJSON_Delete(doc);
    free(desc);
    free(host);
    if (n > 0) return KVP_OK;
    /* Published before its buffer is registered: a target starting up. */
    snprintf(why, cap, "segment %s has no registered buffer yet", o->segment);
    return KVP_ENOTFOUND;
}

static int open_target(const bench_opts *o, target *t)
{
    if (bench_engine(o, o->local_name, &t->e)) return -1;
    /* Started by hand beside its target, which may still be starting. */
    if (o->mode == BENCH_INITIATOR) bench_wait_for(o, "the target's segment", segment_serves);
    size_t nb = 0;
    if (kvp_engine_open_segment(t->e, o->segment, &t->seg) ||
        kvp_engine_segment_buffers(t->e, t->seg, &t->rb, 1, &nb)) {
        cli_error("cannot open segment %s: %s", o->segment, kvp_last_error());
        return -1;
    }
    if (nb == 0) {
        cli_error("segment %s has no registered buffer", o->segment);
        return -1;
    }
    t->span = t->rb.length < o->buffer_size ? t->rb.length : o->buffer_size;
    return 0;
}

int bench_initiator(const bench_opts *o)
{
    target t = {0};
    int rc = 1;
    size_t n = o->n_blocks * o->n_batches * o->n_threads, k = 0;
    result *rs = calloc(n, sizeof *rs);
    if (!rs || open_target(o, &t)) goto out;
    const char *tr = kvp_engine_segment_transport(t.e, t.seg);
    char error[256] = "";
    rc = 0;
    if (!o->no_warmup && warm_up(o, &t, error, sizeof error)) rc = 1;
    if (t.warmup_bytes && !rc) {
        char span[32];
        human(t.warmup_bytes, span, sizeof span);
        printf("kvpipe bench: warm-up, not timed: %s %s in %.3f s\n",
               o->write ? "read and written back" : "read", span, t.warmup_secs);
    }
    if (o->sweep && !rc) table_head(o, tr, n);
    for (size_t a = 0; a < o->n_blocks; a++)
        for (size_t b = 0; b < o->n_batches; b++)
            for (size_t c = 0; c < o->n_threads && !error[0]; c++, k++) {
                point at = {o->blocks[a], o->batches[b], (int)o->threads[c]};
                if (run_point(o, &t, at, &rs[k], error, sizeof error)) {
                    rc = 1;
                    break;
                }
                if (o->sweep)
                    table_row(o, &rs[k]);
                else
                    print_point(o, &rs[k], tr);
                if (rs[k].errors || rs[k].mismatches || rs[k].ops == 0) rc = 1;
            }
    if (o->json && o->sweep) {
        printf("{\"operation\": \"%s\", \"transport\": \"%s\", \"seconds_per_point\": %.3f, "
               "\"warmup_bytes\": %" PRIu64 ", \"warmup_seconds\": %.3f, \"points\": [",
               o->write ? "write" : "read", tr, o->duration, t.warmup_bytes, t.warmup_secs);
        for (size_t i = 0; i < k; i++) {
            printf("%s{", i ? ", " : "");
            json_fields(o, &rs[i]);
            printf("}");
        }
        printf("]}\n");
    } else if (o->json && k) {
        /* One point: its fields at the top level. */
        printf("{\"operation\": \"%s\", \"transport\": \"%s\", \"warmup_bytes\": %" PRIu64
               ", \"warmup_seconds\": %.3f, ",
               o->write ? "write" : "read", tr, t.warmup_bytes, t.warmup_secs);
        json_fields(o, &rs[0]);
        printf("}\n");
    }
    if (error[0]) cli_error("transfers failed: %s", error);
out:
    free(rs);
    kvp_engine_destroy(t.e);
    return rc;
}
