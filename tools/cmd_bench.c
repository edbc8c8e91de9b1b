/* kvpipe bench: a target serves a registered buffer; an initiator READs or
 * WRITEs it in batches from several threads and reports throughput and batch
 * latency, at one point or over a sweep of block sizes, batch sizes and
 * thread counts. In the spirit of Mooncake's transfer_engine_bench, whose
 * flags it takes. Without --mode both sides run here, the target as a child
 * process. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "cli_opts.h"
#include "kvpipe/kvpipe.h"
#include "pattern.h"

#define TARGET_START_MS 30000

const bench_unit bench_units[] = {
    {"GB", 1e9},     {"GiB", 1073741824.0}, {"Gb", 1e9 / 8}, {"MB", 1e6},     {"MiB", 1048576.0},
    {"Mb", 1e6 / 8}, {"KB", 1e3},           {"KiB", 1024.0}, {"Kb", 1e3 / 8},
};

enum {
    O_MODE = 1,
    O_BLOCK,
    O_BATCH,
    O_THREADS,
    O_DURATION,
    O_AUTO_DISCOVERY,
    O_BACKEND,
    O_NIC_MATRIX,
};

static const cli_opt opts[] = {
    {"mode", CLI_ARG_CHOICE, "target|initiator",
     "run one side (as Mooncake's bench); without --mode both\nsides run here, the target as a "
     "child process",
     .choices = "target|initiator", .id = O_MODE},
    {"metadata-server", CLI_ARG_STRING, "S",
     "metadata connection string (default P2PHANDSHAKE):\nhttp://h:p/metadata, etcd://h:p, "
     "redis://h:p, h:p (etcd)",
     .aliases = "metadata", CLI_TO(bench_opts, metadata)},
    {"local-server-name", CLI_ARG_STRING, "H:P",
     "this engine's segment name (required with --mode)", CLI_TO(bench_opts, local_name)},
    {"segment-id", CLI_ARG_STRING, "NAME", "the target's segment name (--mode initiator)",
     CLI_TO(bench_opts, segment)},
    {"protocol", CLI_ARG_STRING, "P", "tcp (default), shm, or rdma/ucx (where built)",
     CLI_TO(bench_opts, protocol)},
    {"device-name", CLI_ARG_STRING, "NAMES",
     "RDMA devices, for rdma/ucx: UCX_NET_DEVICES (ignored by tcp\nand shm)",
     CLI_TO(bench_opts, device_names)},
    {"no-shm", CLI_ARG_FLAG, NULL, "never use shm automatically for a same-host peer",
     CLI_TO(bench_opts, no_shm)},
    {"operation", CLI_ARG_CHOICE, "read|write", "initiator operation (default read)",
     .choices = "read|write", CLI_TO(bench_opts, write)},
    {"block-size", CLI_ARG_SIZES, "BYTES", "bytes per request (default 65536)", 1, 1ll << 40,
     .id = O_BLOCK},
    {"batch-size", CLI_ARG_INTS, "N", "requests per batch (default 128)", 1, 65536, .id = O_BATCH},
    {"threads", CLI_ARG_INTS, "N", "initiator threads (default 2)", 1, 256, .id = O_THREADS},
    {"duration", CLI_ARG_SECONDS, "SECONDS",
     "initiator run time (default 5; with --sweep 1 per point)", .hi = 86400, .id = O_DURATION},
    {"buffer-size", CLI_ARG_SIZE, "BYTES", "target buffer and span used (default 256M)", 8,
     1ll << 44, CLI_TO(bench_opts, buffer_size)},
    {"local-span", CLI_ARG_SIZE, "BYTES",
     "initiator: local bytes per thread the requests rotate\nover (default a block per request of "
     "a batch, at\nmost 64M; a block: every request from one block,\nas ucx_perftest's)",
     1, 1ll << 40, CLI_TO(bench_opts, local_span)},
    {"verify", CLI_ARG_FLAG, NULL,
     "target fills a pattern; initiator checks every byte\nread, or writes a pattern the target "
     "checks on exit\nand reads back every block it wrote, checking it",
     CLI_TO(bench_opts, verify)},
    {"sync", CLI_ARG_FLAG, NULL,
     "initiator: each request by itself through the blocking\nkvp_engine_read/write (on the "
     "calling thread, no\nbatch): a batch's requests run one after the other",
     CLI_TO(bench_opts, sync)},
    {"no-warmup", CLI_ARG_FLAG, NULL,
     "initiator: start the clock at once; by default one\nuntimed pass over the span comes "
     "first (as ucx_perftest's\nwarm-up), so a fresh mapping's page faults are not timed",
     CLI_TO(bench_opts, no_warmup)},
    {"pool", CLI_ARG_FLAG, NULL,
     "target: serve a buffer from the engine's pool\n(kvp_engine_alloc, as the pipe's tensors; "
     "over "
     "rdma/ucx\nmemory UCX allocates) instead of memory it registers",
     CLI_TO(bench_opts, pool)},
    {"sweep", CLI_ARG_FLAG, NULL,
     "measure every combination of --block-size, --batch-size\nand --threads, each a "
     "comma-separated list (default\n4K,64K,1M,16M x 1,32 x 1,2), and print a table",
     CLI_TO(bench_opts, sweep)},
    {"json", CLI_ARG_FLAG, NULL,
     "initiator: the last stdout line is a JSON object (with\n--sweep: every point in "
     "\"points\")",
     CLI_TO(bench_opts, json)},
    {"report-unit", CLI_ARG_CHOICE, "UNIT",
     "throughput unit: GB (default), GiB, Gb, MB, MiB, Mb, KB,\nKiB, Kb (Mooncake's "
     "--report_unit)",
     .choices = "GB|GiB|Gb|MB|MiB|Mb|KB|KiB|Kb", CLI_TO(bench_opts, unit)},
    {"report-precision", CLI_ARG_INT, "N", "digits after the point of the throughput (default 3)",
     0, 9, CLI_TO(bench_opts, precision)},
    {"workers", CLI_ARG_INT, "N", "engine worker threads (default 4)", 1, 256,
     CLI_TO(bench_opts, workers)},
    {"conns", CLI_ARG_INT, "N", "connections per peer (default 4)", 1, 256,
     CLI_TO(bench_opts, conns)},
    {"slice-size", CLI_ARG_SIZE, "BYTES", "requests above this are split (default 4M)", 1,
     1ll << 40, CLI_TO(bench_opts, slice_size)},
    {"timeout-ms", CLI_ARG_INT, "MS", "the engine's I/O timeout (default 5000)", 1, 86400000,
     CLI_TO(bench_opts, timeout_ms)},
    {"wait", CLI_ARG_SECONDS, "SECONDS",
     "with --mode: wait this long for the metadata store to answer\nand (initiator) for "
     "--segment-id to serve a buffer, so the\nsides may start in any order (default 10)",
     .hi = 3600, CLI_TO(bench_opts, wait)},
    {"metrics-port", CLI_ARG_INT, "P",
     "serve the engine's metrics at http://127.0.0.1:P/metrics\n(default: env "
     "KVPIPE_METRICS_PORT, else none); without\n--mode the target's engine serves them",
     1, 65535, CLI_TO(bench_opts, metrics_port)},
    {"auto-discovery", CLI_ARG_FLAG, NULL, "Mooncake's RDMA device discovery: only =false",
     .id = O_AUTO_DISCOVERY},
    {"backend", CLI_ARG_STRING, "classic", "Mooncake's engine backend: only classic",
     .id = O_BACKEND},
    {"nic-priority-matrix", CLI_ARG_STRING, "FILE", NULL, .id = O_NIC_MATRIX},
};

static const cli_spec spec = {
    .cmd = "bench",
    .synopsis = "usage: kvpipe bench [--sweep] [options]                    (both sides here)\n"
                "       kvpipe bench --mode target --local-server-name H:P [options]\n"
                "       kvpipe bench --mode initiator --local-server-name H:P --segment-id "
                "NAME [options]\n"
                "       kvpipe bench --pipe ...          (the tensor pipe: kvpipe help bench "
                "--pipe)\n",
    .about = "Measure the transfer engine. The initiator READs (or WRITEs) --batch-size\n"
             "blocks of --block-size bytes per batch from --threads threads for --duration\n"
             "seconds, and reports GB/s and the latency of a batch (submit to the last\n"
             "completion) at p50, p99 and p999. The target serves --buffer-size bytes and\n"
             "runs until SIGINT or SIGTERM; with --verify it exits 1 if any byte written\n"
             "to it is wrong.\n",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .epilog = "Mooncake's transfer_engine_bench flags work as they are (--metadata_server=...\n"
              "--local_server_name=... --segment_id=... --device_name=... --report_unit=...).\n",
};

static void copy_list(size_t *dst, size_t *n, const cli_value *v)
{
    memcpy(dst, v->list, v->n_list * sizeof *dst);
    *n = v->n_list;
}

static const char *set_opt(void *p, const cli_opt *opt, const cli_value *v)
{
    bench_opts *o = p;
    switch (opt->id) {
    case O_MODE:
        o->mode = v->i ? BENCH_INITIATOR : BENCH_TARGET;
        break;
    case O_BLOCK:
        copy_list(o->blocks, &o->n_blocks, v);
        break;
    case O_BATCH:
        copy_list(o->batches, &o->n_batches, v);
        break;
    case O_THREADS:
        copy_list(o->threads, &o->n_threads, v);
        break;
    case O_DURATION:
        o->duration = v->seconds, o->duration_set = 1;
        break;
    case O_AUTO_DISCOVERY:
        if (v->i) return "false: RDMA device discovery is not in this build";
        break;
    case O_BACKEND:
        if (strcmp(v->text, "classic"))
            return "classic: Mooncake's other backends (tent) are not in kvpipe";
        break;
    case O_NIC_MATRIX:
        return "nothing: NIC priority matrices are for RDMA, not in this build";
    }
    return NULL;
}

/* What the options say together; NULL when they agree. */
static const char *check(bench_opts *o)
{
    if (o->mode != BENCH_BOTH && !o->local_name) return "--mode needs --local-server-name";
    if (o->mode == BENCH_INITIATOR && !o->segment) return "--mode initiator needs --segment-id";
    if (o->mode == BENCH_TARGET && o->sweep) return "--sweep is the initiator's (or no --mode)";
    if (o->mode == BENCH_BOTH && o->segment) return "--segment-id needs --mode initiator";
    /* Both sides here meet over P2PHANDSHAKE on loopback: a store or a name
     * given for them would be ignored, so it is refused. */
    if (o->mode == BENCH_BOTH && o->metadata)
        return "--metadata-server needs --mode target or initiator (without --mode both sides "
               "run here over P2PHANDSHAKE)";
    if (o->mode == BENCH_BOTH && o->local_name)
        return "--local-server-name needs --mode target or initiator (without --mode both sides "
               "run here on loopback)";
    if (!o->sweep && (o->n_blocks > 1 || o->n_batches > 1 || o->n_threads > 1))
        return "lists of --block-size, --batch-size or --threads need --sweep";
    for (size_t i = 0; i < o->n_blocks; i++)
        if (o->verify && o->blocks[i] % 8) return "--verify needs --block-size a multiple of 8";
    if (o->verify && o->buffer_size % 8) return "--verify needs --buffer-size a multiple of 8";
    if (o->verify && o->local_span)
        return "--local-span needs no --verify (each request checks its own block)";
    return NULL;
}

static int parse_args(int argc, char **argv, bench_opts *o)
{
    *o = (bench_opts){
        .protocol = "tcp", .buffer_size = 256u << 20, .duration = 5, .wait = 10, .precision = 3};
    int r = cli_parse(&spec, argc, argv, 0, set_opt, o);
    if (r) return r;
    if (!o->n_blocks) {
        static const size_t sweep_blocks[] = {4096, 65536, 1u << 20, 16u << 20};
        o->n_blocks = o->sweep ? 4 : 1;
        memcpy(o->blocks, o->sweep ? sweep_blocks : (size_t[]){65536},
               o->n_blocks * sizeof(size_t));
    }
    if (!o->n_batches) {
        o->n_batches = o->sweep ? 2 : 1;
        memcpy(o->batches, o->sweep ? (size_t[]){1, 32} : (size_t[]){128},
               o->n_batches * sizeof(size_t));
    }
    if (!o->n_threads) {
        o->n_threads = o->sweep ? 2 : 1;
        memcpy(o->threads, o->sweep ? (size_t[]){1, 2} : (size_t[]){2},
               o->n_threads * sizeof(size_t));
    }
    if (o->sweep && !o->duration_set) o->duration = 1;
    const char *bad = check(o);
    if (bad) {
        cli_error("%s", bad);
        return 3;
    }
    if (!o->metadata) o->metadata = "P2PHANDSHAKE";
    return 0;
}

/* Whether st may pass by waiting: the store, the peer or its segment is not
 * up yet. */
static int transient(kvp_status st)
{
    return st == KVP_EMETADATA || st == KVP_ENOTFOUND || st == KVP_ECONNREFUSED ||
           st == KVP_ECONNRESET || st == KVP_ETIMEDOUT;
}

kvp_status bench_wait_for(const bench_opts *o, const char *what,
                          kvp_status (*probe)(const bench_opts *o, char *why, size_t cap))
{
    uint64_t end = cli_now_ms() + (uint64_t)(o->wait * 1000);
    char why[512] = "";
    kvp_status st;
    int said = 0;
    while ((st = probe(o, why, sizeof why)) != KVP_OK && transient(st) && cli_now_ms() < end) {
        if (!said++)
            fprintf(stderr, "kvpipe bench: waiting up to %g s for %s (now: %s)\n", o->wait, what,
                    why);
        usleep(100 * 1000);
    }
    if (st) fprintf(stderr, "kvpipe bench: %s\n", why);
    return st;
}

static kvp_status store_answers(const bench_opts *o, char *why, size_t cap)
{
    kvp_status st = kvp_info_store_check(o->metadata, 1000);
    if (st) snprintf(why, cap, "%s", kvp_last_error());
    return st;
}

kvp_status bench_engine(const bench_opts *o, const char *name, kvp_engine **out)
{
    /* One side of a pair started by hand: the store may still be starting. */
    if (o->mode != BENCH_BOTH && bench_wait_for(o, "the metadata store", store_answers)) {
        cli_error("cannot start the engine: the metadata store does not answer");
        return KVP_EMETADATA;
    }
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = name;
    eo.metadata = o->metadata;
    eo.protocol = o->protocol;
    eo.device_names = o->device_names;
    eo.disable_shm = o->no_shm;
    if (o->workers) eo.workers = o->workers;
    if (o->conns) eo.conns_per_peer = o->conns;
    if (o->slice_size) eo.slice_size = o->slice_size;
    if (o->timeout_ms) eo.timeout_ms = o->timeout_ms;
    if (o->metrics_port) eo.metrics_port = o->metrics_port;
    kvp_status st = kvp_engine_create(&eo, out);
    if (st) cli_error("cannot start the engine: %s", kvp_last_error());
    return st;
}

/* ------------------------------------------------------------- target --- */

/* After the run: every word is the target's pattern or the initiators'. */
static int verify_target(const void *buf, size_t len)
{
    size_t written = 0;
    for (size_t off = 0; off + 8 <= len; off += 8) {
        uint64_t w;
        memcpy(&w, (const char *)buf + off, 8);
        if (w == pattern_word(PATTERN_WRITE, off)) {
            written += 8;
        } else if (w != pattern_word(PATTERN_TARGET, off)) {
            cli_error("target: verify FAILED at byte %zu", off);
            return 1;
        }
    }
    printf("kvpipe bench target: verify OK (%zu bytes written by peers)\n", written);
    return 0;
}

/* The target's buffer: from the pool, or mapped here and registered. */
static int target_buffer(const bench_opts *o, kvp_engine *e, void **out)
{
    void *buf;
    if (o->pool) {
        if (kvp_engine_alloc(e, o->buffer_size, &buf)) {
            cli_error("target: cannot allocate %zu bytes from the pool: %s", o->buffer_size,
                      kvp_last_error());
            return 1;
        }
        /* Populated now, so that no initiator's first pass pays our faults. */
        if (o->verify)
            pattern_fill(buf, o->buffer_size, PATTERN_TARGET, 0);
        else
            memset(buf, 0, o->buffer_size);
        *out = buf;
        return 0;
    }
    buf = mmap(NULL, o->buffer_size, PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (buf == MAP_FAILED) {
        cli_error("target: cannot map %zu bytes: %s", o->buffer_size, strerror(errno));
        return 1;
    }
    if (o->verify) pattern_fill(buf, o->buffer_size, PATTERN_TARGET, 0);
    if (kvp_engine_register(e, buf, o->buffer_size)) {
        cli_error("target: cannot register the buffer: %s", kvp_last_error());
        munmap(buf, o->buffer_size);
        return 1;
    }
    *out = buf;
    return 0;
}

static int run_target(const bench_opts *o)
{
    kvp_engine *e;
    if (bench_engine(o, o->local_name, &e)) return 1;
    void *buf;
    if (target_buffer(o, e, &buf)) {
        kvp_engine_destroy(e);
        return 1;
    }
    printf("kvpipe bench target: serving segment %s (data port %d, %zu bytes at 0x%" PRIxPTR
           "%s)\n",
           kvp_engine_segment_name(e), kvp_engine_data_port(e), o->buffer_size, (uintptr_t)buf,
           o->pool ? ", from the pool" : "");
    if (kvp_engine_metrics_port(e))
        printf("kvpipe bench target: metrics at http://127.0.0.1:%d/metrics\n",
               kvp_engine_metrics_port(e));
    fflush(stdout);
    cli_wait_for_signal();
    if (o->pool) {
        /* The pool's memory goes with the engine: checked first (the
         * initiators are done when the signal comes). */
        int rc = o->verify ? verify_target(buf, o->buffer_size) : 0;
        kvp_engine_destroy(e);
        return rc;
    }
    /* Unpublish before checking, so no initiator writes while we look. */
    kvp_engine_destroy(e);
    int rc = o->verify ? verify_target(buf, o->buffer_size) : 0;
    munmap(buf, o->buffer_size);
    return rc;
}

/* ---------------------------------------------------- both sides here --- */

/* The target as a child process on a free port; fills its segment name and
 * *out, the read end of its stdout (kept open: it writes more at exit). */
static pid_t spawn_target(const bench_opts *o, char segment[256], FILE **out)
{
    char buffer[32];
    snprintf(buffer, sizeof buffer, "%zu", o->buffer_size);
    char *args[32];
    int n = 0;
    args[n++] = "kvpipe";
    args[n++] = "bench";
    args[n++] = "--mode=target";
    args[n++] = "--local-server-name=127.0.0.1:0";
    args[n++] = "--metadata-server=P2PHANDSHAKE";
    args[n++] = "--buffer-size";
    args[n++] = buffer;
    args[n++] = "--protocol";
    args[n++] = (char *)o->protocol;
    if (o->no_shm) args[n++] = "--no-shm";
    if (o->verify) args[n++] = "--verify";
    if (o->pool) args[n++] = "--pool";
    char metrics[16];
    if (o->metrics_port) {
        snprintf(metrics, sizeof metrics, "%d", o->metrics_port);
        args[n++] = "--metrics-port";
        args[n++] = metrics;
    }
    args[n] = NULL;
    int fds[2];
    if (pipe(fds) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGINT);
        sigaddset(&set, SIGTERM);
        pthread_sigmask(SIG_BLOCK, &set, NULL); /* it waits for them with sigwait */
        close(fds[0]);
        dup2(fds[1], STDOUT_FILENO);
        close(fds[1]);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    close(fds[1]);
    FILE *f = fdopen(fds[0], "r");
    char line[512];
    int found = 0;
    while (f && !found && fgets(line, sizeof line, f))
        found = sscanf(line, "kvpipe bench target: serving segment %255s", segment) == 1;
    if (!found) {
        cli_error("the target did not start (run kvpipe bench --mode target to see why)");
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        if (f) fclose(f);
        return -1;
    }
    *out = f;
    return pid;
}

static int run_both(bench_opts *o)
{
    char segment[256], line[512];
    FILE *out = NULL;
    pid_t target = spawn_target(o, segment, &out);
    if (target < 0) return 1;
    /* The metrics endpoint (--metrics-port or the environment's) is the
     * target's, which serves the bytes; two engines of two processes cannot
     * share one port. */
    o->metrics_port = 0;
    unsetenv("KVPIPE_METRICS_PORT");
    o->segment = segment;
    o->metadata = "P2PHANDSHAKE";
    o->local_name = "127.0.0.1:0";
    int rc = bench_initiator(o);
    kill(target, SIGTERM);
    /* The rest of its lines (its --verify verdict) go to stderr: stdout's last
     * line is the initiator's. */
    while (fgets(line, sizeof line, out))
        fputs(line, stderr);
    fclose(out);
    int status = 0;
    waitpid(target, &status, 0);
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        cli_error("the target failed%s", o->verify ? " its --verify check" : "");
        rc = 1;
    }
    return rc;
}

int cmd_bench(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--pipe") == 0 || strcmp(argv[i], "-pipe") == 0)
            return cmd_bench_pipe(argc, argv);
    bench_opts o;
    int r = parse_args(argc, argv, &o);
    if (r) return r - 1;
    switch (o.mode) {
    case BENCH_TARGET:
        return run_target(&o);
    case BENCH_INITIATOR:
        return bench_initiator(&o);
    default:
        return run_both(&o);
    }
}
