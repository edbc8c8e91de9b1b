/* kvpipe bench: a target serves a registered buffer; an initiator READs or
 * WRITEs it in batches from several threads and reports throughput. In the
 * spirit of Mooncake's transfer_engine_bench, with the same flag names. */
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvpipe/kvpipe.h"
#include "pattern.h"

typedef struct bench_opts {
    const char *mode, *metadata, *local_name, *segment, *protocol, *operation;
    size_t block_size, batch_size, buffer_size;
    int threads, workers, conns, timeout_ms;
    size_t slice_size;
    double duration;
    int verify, json, no_shm;
} bench_opts;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvpipe bench --mode target|initiator [options]\n"
            "       kvpipe bench --pipe ... (see kvpipe bench --pipe --help)\n\n"
            "  --metadata-server S    metadata connection string (default P2PHANDSHAKE);\n"
            "                         http://h:p/metadata, etcd://h:p, redis://h:p\n"
            "  --local-server-name H:P  this engine's segment name (required)\n"
            "  --segment-id NAME      the target's segment name (initiator; required)\n"
            "  --protocol P           tcp (default), shm, or rdma/ucx (where built)\n"
            "  --no-shm               never use shm automatically for a same-host peer\n"
            "  --operation read|write initiator operation (default read)\n"
            "  --block-size BYTES     bytes per request (default 65536)\n"
            "  --batch-size N         requests per batch (default 128)\n"
            "  --threads N            initiator threads (default 2)\n"
            "  --duration SECONDS     initiator run time (default 5)\n"
            "  --buffer-size BYTES    target buffer and span used (default 268435456)\n"
            "  --verify               target fills a pattern; initiator checks every byte\n"
            "                         read, or writes a pattern the target checks on exit\n"
            "                         and reads back every block it wrote, checking it\n"
            "  --json                 initiator: last stdout line is a JSON object\n"
            "  --workers N            engine worker threads (default 4)\n"
            "  --conns N              connections per peer (default 4)\n"
            "  --slice-size BYTES     requests above this are split (default 4M)\n"
            "  --timeout-ms MS        the engine's I/O timeout (default 5000)\n"
            "Sizes accept K, M and G suffixes (powers of 1024).\n"
            "The target prints its segment name when it serves and runs until SIGINT or\n"
            "SIGTERM; with --verify it exits 1 if any byte written to it is wrong.\n");
}

/* Sizes here must not be 0. */
static int parse_size(const char *s, size_t *out)
{
    size_t v;
    if (kvp_cli_parse_size(s, &v) || v == 0) return -1;
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, bench_opts *o)
{
    static const struct option longopts[] = {
        {"mode", required_argument, 0, 'm'},          {"metadata-server", required_argument, 0, 'M'},
        {"local-server-name", required_argument, 0, 'l'}, {"segment-id", required_argument, 0, 's'},
        {"protocol", required_argument, 0, 'p'},      {"operation", required_argument, 0, 'o'},
        {"block-size", required_argument, 0, 'b'},    {"batch-size", required_argument, 0, 'B'},
        {"threads", required_argument, 0, 't'},       {"duration", required_argument, 0, 'd'},
        {"buffer-size", required_argument, 0, 'S'},   {"verify", no_argument, 0, 'v'},
        {"json", no_argument, 0, 'j'},                {"no-shm", no_argument, 0, 'n'},
        {"workers", required_argument, 0, 'W'},       {"conns", required_argument, 0, 'C'},
        {"slice-size", required_argument, 0, 'L'},    {"timeout-ms", required_argument, 0, 'T'},
        {"help", no_argument, 0, 'h'},                {0, 0, 0, 0}};
    *o = (bench_opts){.metadata = "P2PHANDSHAKE", .protocol = "tcp", .operation = "read",
                      .block_size = 65536, .batch_size = 128, .buffer_size = 256u << 20,
                      .threads = 2, .duration = 5};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case 'm': o->mode = optarg; break;
        case 'M': o->metadata = optarg; break;
        case 'l': o->local_name = optarg; break;
        case 's': o->segment = optarg; break;
        case 'p': o->protocol = optarg; break;
        case 'o': o->operation = optarg; break;
        case 'b': bad = parse_size(optarg, &o->block_size); break;
        case 'B': bad = parse_size(optarg, &o->batch_size); break;
        case 'S': bad = parse_size(optarg, &o->buffer_size); break;
        case 't': o->threads = atoi(optarg); bad = o->threads <= 0 || o->threads > 256; break;
        case 'd': o->duration = atof(optarg); bad = !(o->duration > 0); break;
        case 'v': o->verify = 1; break;
        case 'j': o->json = 1; break;
        case 'n': o->no_shm = 1; break;
        case 'W': o->workers = atoi(optarg); bad = o->workers <= 0 || o->workers > 256; break;
        case 'C': o->conns = atoi(optarg); bad = o->conns <= 0 || o->conns > 256; break;
        case 'L': bad = parse_size(optarg, &o->slice_size); break;
        case 'T': o->timeout_ms = atoi(optarg); bad = o->timeout_ms <= 0; break;
        case 'h': usage(stdout); exit(0);
        default: return -1;
        }
        if (bad) {
            const struct option *lo = longopts;
            while (lo->name && lo->val != c) lo++;
            fprintf(stderr, "kvpipe bench: invalid value '%s' for --%s\n", optarg, lo->name);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "kvpipe bench: unexpected argument '%s'\n", argv[optind]);
        return -1;
    }
    if (!o->mode || (strcmp(o->mode, "target") && strcmp(o->mode, "initiator"))) {
        fprintf(stderr, "kvpipe bench: --mode must be target or initiator\n");
        return -1;
    }
    if (!o->local_name) {
        fprintf(stderr, "kvpipe bench: --local-server-name is required\n");
        return -1;
    }
    if (strcmp(o->operation, "read") && strcmp(o->operation, "write")) {
        fprintf(stderr, "kvpipe bench: --operation must be read or write\n");
        return -1;
    }
    if (!strcmp(o->mode, "initiator") && !o->segment) {
        fprintf(stderr, "kvpipe bench: the initiator needs --segment-id\n");
        return -1;
    }
    if (o->verify && (o->block_size % 8 || o->buffer_size % 8)) {
        fprintf(stderr, "kvpipe bench: --verify needs sizes that are multiples of 8\n");
        return -1;
    }
    return 0;
}

static kvp_status make_engine(const bench_opts *o, kvp_engine **out)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = o->local_name;
    eo.metadata = o->metadata;
    eo.protocol = o->protocol;
    eo.disable_shm = o->no_shm;
    if (o->workers) eo.workers = o->workers;
    if (o->conns) eo.conns_per_peer = o->conns;
    if (o->slice_size) eo.slice_size = o->slice_size;
    if (o->timeout_ms) eo.timeout_ms = o->timeout_ms;
    kvp_status st = kvp_engine_create(&eo, out);
    if (st) fprintf(stderr, "kvpipe bench: cannot start the engine: %s\n", kvp_last_error());
    return st;
}

static int run_target(const bench_opts *o)
{
    kvp_engine *e;
    if (make_engine(o, &e)) return 1;
    void *buf = mmap(NULL, o->buffer_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (buf == MAP_FAILED) {
        fprintf(stderr, "kvpipe bench: cannot map %zu bytes\n", o->buffer_size);
        kvp_engine_destroy(e);
        return 1;
    }
    if (o->verify) kvp_pattern_fill(buf, o->buffer_size, KVP_PATTERN_TARGET, 0);
    else memset(buf, 0, o->buffer_size);
    if (kvp_engine_register(e, buf, o->buffer_size)) {
        fprintf(stderr, "kvpipe bench: cannot register the buffer: %s\n", kvp_last_error());
        kvp_engine_destroy(e);
        return 1;
    }
    printf("kvpipe bench target: serving segment %s (data port %d, %zu bytes at 0x%" PRIxPTR ")\n",
           kvp_engine_segment_name(e), kvp_engine_data_port(e), o->buffer_size, (uintptr_t)buf);
    fflush(stdout);
    kvp_cli_wait_for_signal();
    int rc = 0;
    /* Unpublish before checking, so no initiator writes while we look. */
    kvp_engine_destroy(e);
    if (o->verify) {
        size_t written = 0;
        for (size_t off = 0; off + 8 <= o->buffer_size; off += 8) {
            uint64_t w;
            memcpy(&w, (char *)buf + off, 8);
            if (w == kvp_pattern_word(KVP_PATTERN_WRITE, off)) {
                written += 8;
            } else if (w != kvp_pattern_word(KVP_PATTERN_TARGET, off)) {
                fprintf(stderr, "kvpipe bench target: verify FAILED at byte %zu\n", off);
                rc = 1;
                break;
            }
        }
        if (!rc) printf("kvpipe bench target: verify OK (%zu bytes written by peers)\n", written);
    }
    munmap(buf, o->buffer_size);
    return rc;
}

typedef struct worker {
    pthread_t thread;
    int id;
    const bench_opts *o;
    kvp_engine *e;
    kvp_segment_id seg;
    uint64_t remote_base, remote_len;
    uint64_t deadline_ns;
    uint64_t bytes, ops, errors, mismatches;
    uint8_t *written; /* write --verify: per block, 1 once a write of it succeeded */
    char error[256];  /* the first failure's detail */
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    const bench_opts *o = w->o;
    int is_read = strcmp(o->operation, "read") == 0;
    size_t nblocks = w->remote_len / o->block_size;
    size_t local_len = o->batch_size * o->block_size;
    char *local = malloc(local_len);
    kvp_request *reqs = calloc(o->batch_size, sizeof *reqs);
    uint64_t *offs = calloc(o->batch_size, sizeof *offs);
    if (!local || !reqs || !offs) {
        w->errors++;
        goto out;
    }
    uint64_t next = (uint64_t)w->id * o->batch_size;
    while (kvp_cli_now_ns() < w->deadline_ns) {
        for (size_t i = 0; i < o->batch_size; i++) {
            offs[i] = (next++ % nblocks) * o->block_size;
            char *l = local + i * o->block_size;
            if (!is_read && o->verify) kvp_pattern_fill(l, o->block_size, KVP_PATTERN_WRITE, offs[i]);
            reqs[i] = (kvp_request){is_read ? KVP_OP_READ : KVP_OP_WRITE, l,
                                    w->remote_base + offs[i], o->block_size};
        }
        kvp_batch *b;
        kvp_status st = kvp_batch_submit(w->e, w->seg, reqs, o->batch_size, &b);
        if (st == KVP_OK) {
            if (kvp_batch_wait(b, -1) != KVP_OK && !w->error[0])
                snprintf(w->error, sizeof w->error, "%s", kvp_last_error());
            for (size_t i = 0; i < o->batch_size; i++) {
                if (kvp_batch_request_status(b, i) != KVP_OK) {
                    w->errors++;
                    continue;
                }
                w->ops++;
                w->bytes += o->block_size;
                if (w->written) w->written[offs[i] / o->block_size] = 1;
                if (is_read && o->verify &&
                    kvp_pattern_check(local + i * o->block_size, o->block_size,
                                      KVP_PATTERN_TARGET, offs[i]))
                    w->mismatches++;
            }
            kvp_batch_free(b);
        } else {
            snprintf(w->error, sizeof w->error, "%s", kvp_last_error());
            w->errors += o->batch_size;
        }
        if (w->errors) break;
    }
out:
    free(local);
    free(reqs);
    free(offs);
    return NULL;
}

/* After a write --verify run: read back every block some worker wrote
 * successfully and check that it holds what was written, so that a write
 * reported done whose bytes never landed is caught (the target's own check on
 * exit accepts its initial pattern). Returns the number of blocks that do not
 * hold the written pattern, or -1 (with the reason in kvp_last_error()) when
 * the read-back itself failed; *checked counts the blocks read back. */
static int64_t read_back(const bench_opts *o, kvp_engine *e, kvp_segment_id seg, uint64_t base,
                         const worker *ws, size_t nblocks, uint64_t *checked)
{
    char *local = malloc(o->block_size);
    if (!local) {
        fprintf(stderr, "kvpipe bench: out of memory for the read-back\n");
        return -1;
    }
    int64_t lost = 0;
    *checked = 0;
    for (size_t k = 0; k < nblocks; k++) {
        int wrote = 0;
        for (int i = 0; i < o->threads && !wrote; i++)
            wrote = ws[i].written[k];
        if (!wrote) continue;
        uint64_t off = (uint64_t)k * o->block_size;
        if (kvp_engine_read(e, seg, local, base + off, o->block_size) != KVP_OK) {
            lost = -1;
            break;
        }
        (*checked)++;
        if (kvp_pattern_check(local, o->block_size, KVP_PATTERN_WRITE, off)) {
            if (!lost) fprintf(stderr, "kvpipe bench: block at %" PRIu64 " lost its write\n", off);
            lost++;
        }
    }
    free(local);
    return lost;
}

static int run_initiator(const bench_opts *o)
{
    kvp_engine *e;
    if (make_engine(o, &e)) return 1;
    int rc = 1;
    kvp_segment_id seg;
    kvp_remote_buffer rb;
    size_t nb = 0;
    worker *ws = NULL;
    if (kvp_engine_open_segment(e, o->segment, &seg) ||
        kvp_engine_segment_buffers(e, seg, &rb, 1, &nb)) {
        fprintf(stderr, "kvpipe bench: cannot open segment %s: %s\n", o->segment,
                kvp_last_error());
        goto out;
    }
    if (nb == 0 || rb.length < o->block_size) {
        fprintf(stderr, "kvpipe bench: segment %s has no buffer of at least %zu bytes\n",
                o->segment, o->block_size);
        goto out;
    }
    uint64_t span = rb.length < o->buffer_size ? rb.length : o->buffer_size;
    size_t nblocks = span / o->block_size;
    int check_writes = o->verify && strcmp(o->operation, "write") == 0;
    ws = calloc((size_t)o->threads, sizeof *ws);
    if (!ws) goto out;
    for (int i = 0; i < o->threads && check_writes; i++)
        if (!(ws[i].written = calloc(nblocks, 1))) goto out;
    uint64_t start = kvp_cli_now_ns();
    for (int i = 0; i < o->threads; i++) {
        uint8_t *written = ws[i].written;
        ws[i] = (worker){.id = i, .o = o, .e = e, .seg = seg, .remote_base = rb.addr,
                         .remote_len = span,
                         .deadline_ns = start + (uint64_t)(o->duration * 1e9)};
        ws[i].written = written;
        pthread_create(&ws[i].thread, NULL, worker_main, &ws[i]);
    }
    uint64_t bytes = 0, ops = 0, errors = 0, mismatches = 0;
    for (int i = 0; i < o->threads; i++) {
        pthread_join(ws[i].thread, NULL);
        bytes += ws[i].bytes;
        ops += ws[i].ops;
        errors += ws[i].errors;
        mismatches += ws[i].mismatches;
    }
    double secs = (double)(kvp_cli_now_ns() - start) / 1e9;
    double gbps = (double)bytes / secs / 1e9;
    uint64_t checked = 0;
    if (check_writes && !errors) {
        int64_t lost = read_back(o, e, seg, rb.addr, ws, nblocks, &checked);
        if (lost < 0) {
            fprintf(stderr, "kvpipe bench: reading back the written blocks failed: %s\n",
                    kvp_last_error());
            errors++;
        } else {
            mismatches += (uint64_t)lost;
        }
    }
    printf("kvpipe bench: %s %zu B x %zu x %d threads via %s: %.3f GB/s, %" PRIu64 " ops, "
           "%" PRIu64 " errors%s\n",
           o->operation, o->block_size, o->batch_size, o->threads,
           kvp_engine_segment_transport(e, seg), gbps, ops, errors,
           o->verify ? (mismatches ? ", VERIFY FAILED" : ", verified") : "");
    if (o->json)
        printf("{\"gbps\": %.4f, \"bytes\": %" PRIu64 ", \"ops\": %" PRIu64 ", \"errors\": %" PRIu64
               ", \"mismatches\": %" PRIu64 ", \"seconds\": %.3f, \"operation\": \"%s\", "
               "\"block_size\": %zu, \"transport\": \"%s\", \"read_back\": %" PRIu64 "}\n",
               gbps, bytes, ops, errors + mismatches, mismatches, secs, o->operation, o->block_size,
               kvp_engine_segment_transport(e, seg), checked);
    for (int i = 0; i < o->threads; i++)
        if (ws[i].error[0]) {
            fprintf(stderr, "kvpipe bench: transfers failed: %s\n", ws[i].error);
            break;
        }
    rc = errors || mismatches || ops == 0 ? 1 : 0;
out:
    for (int i = 0; ws && i < o->threads; i++)
        free(ws[i].written);
    free(ws);
    kvp_engine_destroy(e);
    return rc;
}

int kvp_cmd_bench(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--pipe") == 0) return kvp_cmd_bench_pipe(argc, argv);
    bench_opts o;
    if (parse_args(argc, argv, &o) != 0) {
        usage(stderr);
        return 2;
    }
    return strcmp(o.mode, "target") == 0 ? run_target(&o) : run_initiator(&o);
}
