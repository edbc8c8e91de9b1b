/* gpu_check: kvpipe moving GPU device memory between two processes, on the
 * CUDA driver kvpipe loads (libcuda.so.1, or the file KVPIPE_LIBCUDA names),
 * through kvpipe's public engine API; the device memory itself is allocated,
 * filled and read back with the driver API (dlopen), so every byte is checked
 * by copying it back to the host.
 *
 *     gpu_check [--quick] [--device N]
 *
 * A target process (forked before this one touches the driver: a process
 * that used CUDA cannot fork one that does) registers device memory with two
 * engines, one on tcp (staged through pinned bounce buffers) and one on shm
 * (CUDA IPC where the driver allows it, else staged). This process moves its
 * own device memory to and from them:
 *
 *   checks      a WRITE and a READ of one range, and a batch of many requests
 *               each way, per transport; the target checks its whole buffer
 *               (the range written, the rest untouched), this process its
 *               destination and the guard bytes around it;
 *   throughput  the same transfers timed, each against a copy the driver
 *               makes in this run: staged WRITE / READ against the pinned
 *               device-to-host / host-to-device copy rate (cuMemcpyDtoH/HtoD
 *               with cuMemHostAlloc memory), shm against a device-to-device
 *               copy (cuMemcpyDtoD) of the same size (what CUDA IPC does).
 *
 * Output: JSON lines on stdout, each with "driver": "real", or "double" on
 * the test double (tests/support/fake_cuda), whose figures mean nothing.
 * Exit 0: every check passed; 1: one failed; 77: no driver or no device. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu/cuda_driver.h"
#include "kvpipe/kvpipe.h"

#define SKIP 77

/* The driver entry points this program calls (NVIDIA's documented names). */
static struct {
    const char *path;
    int is_double; /* the test double exports its test helpers too */
    CUresult (*init)(unsigned);
    CUresult (*error_string)(CUresult, const char **);
    CUresult (*driver_version)(int *);
    CUresult (*device_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*ctx_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*ctx_sync)(void);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free)(CUdeviceptr);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*host_free)(void *);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*dtod)(CUdeviceptr, CUdeviceptr, size_t);
} cu;

static const char *driver_kind(void)
{
    return cu.is_double ? "double" : "real";
}

/* s with the characters a JSON string cannot hold as they are (quotes,
 * backslashes, control characters) made apostrophes and spaces; the last
 * four results stay valid. */
static const char *js(const char *s)
{
    static char ring[4][512];
    static int next;
    char *out = ring[next++ % 4];
    size_t i = 0;
    for (; s && s[i] && i + 1 < sizeof ring[0]; i++)
        out[i] = s[i] == '"' || s[i] == '\\' ? '\'' : (unsigned char)s[i] < 0x20 ? ' ' : s[i];
    out[i] = 0;
    return out;
}

static const char *cu_error(CUresult r)
{
    const char *s = NULL;
    return cu.error_string(r, &s) == 0 && s ? s : "unknown CUDA error";
}

/* Load the driver's entry points; NULL, or why not. */
static const char *load_driver(void)
{
    static char why[512];
    const char *env = getenv("KVPIPE_LIBCUDA");
    cu.path = env && *env ? env : "libcuda.so.1";
    void *lib = dlopen(cu.path, RTLD_NOW);
    if (!lib) {
        snprintf(why, sizeof why, "cannot load the CUDA driver %s: %s", cu.path, dlerror());
        return why;
    }
    cu.is_double = dlsym(lib, "fakecuda_copies") != NULL;
    struct {
        void **fn;
        const char *name;
    } syms[] = {
        {(void **)&cu.init, "cuInit"},
        {(void **)&cu.error_string, "cuGetErrorString"},
        {(void **)&cu.driver_version, "cuDriverGetVersion"},
        {(void **)&cu.device_count, "cuDeviceGetCount"},
        {(void **)&cu.device_get, "cuDeviceGet"},
        {(void **)&cu.ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.ctx_set, "cuCtxSetCurrent"},
        {(void **)&cu.ctx_sync, "cuCtxSynchronize"},
        {(void **)&cu.alloc, "cuMemAlloc_v2"},
        {(void **)&cu.free, "cuMemFree_v2"},
        {(void **)&cu.host_alloc, "cuMemHostAlloc"},
        {(void **)&cu.host_free, "cuMemFreeHost"},
        {(void **)&cu.htod, "cuMemcpyHtoD_v2"},
        {(void **)&cu.dtoh, "cuMemcpyDtoH_v2"},
        {(void **)&cu.dtod, "cuMemcpyDtoD_v2"},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        if (!(*syms[i].fn = dlsym(lib, syms[i].name))) {
            snprintf(why, sizeof why, "the CUDA driver %s has no %s", cu.path, syms[i].name);
            return why;
        }
    }
    return NULL;
}

/* cuInit, the device's primary context current on this thread; 0, SKIP (no
 * device) or 1, with the reason in why. */
static int open_device(int device, char *why, size_t cap)
{
    CUresult r = cu.init(0);
    int count = 0;
    if (r == 0) r = cu.device_count(&count);
    if (r != 0 || count == 0) {
        snprintf(why, cap, "%s: no CUDA device: %s", cu.path, r ? cu_error(r) : "none found");
        return SKIP;
    }
    CUdevice d;
    CUcontext ctx;
    if ((r = cu.device_get(&d, device)) != 0 || (r = cu.ctx_retain(&ctx, d)) != 0 ||
        (r = cu.ctx_set(ctx)) != 0) {
        snprintf(why, cap, "%s: device %d of %d: %s", cu.path, device, count, cu_error(r));
        return 1;
    }
    return 0;
}

static void *device_alloc(size_t n)
{
    CUdeviceptr p = 0;
    CUresult r = cu.alloc(&p, n);
    if (r != 0) {
        fprintf(stderr, "gpu_check: cuMemAlloc_v2 of %zu bytes: %s\n", n, cu_error(r));
        exit(1);
    }
    return (void *)(uintptr_t)p;
}

/* ---------------------------------------------------------------- bytes --- */

/* Byte i of pattern seed: a hash of (seed, i / 8), so that a shifted or
 * misplaced range never matches. */
static void fill(unsigned char *buf, size_t len, uint64_t seed, size_t start)
{
    for (size_t i = 0; i < len; i++) {
        uint64_t h = ((start + i) >> 3) * 0x9E3779B97F4A7C15ull ^ seed * 0xC2B2AE3D27D4EB4Full;
        h ^= h >> 29;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 32;
        buf[i] = (unsigned char)(h >> (((start + i) & 7) * 8));
    }
}

/* Fill [off, +len) of device memory with pattern seed from pattern position
 * start, through the driver. */
static int device_fill(void *dev, size_t off, size_t len, uint64_t seed, size_t start)
{
    unsigned char *h = malloc(len ? len : 1);
    if (!h) return -1;
    fill(h, len, seed, start);
    CUresult r = cu.htod((CUdeviceptr)(uintptr_t)dev + off, h, len);
    free(h);
    if (r) fprintf(stderr, "gpu_check: cuMemcpyHtoD_v2: %s\n", cu_error(r));
    return r ? -1 : 0;
}

/* The first byte of [off, +len) of device memory (copied back by the
 * driver) that differs from pattern seed at position start; -1 none, -2
 * the copy failed. */
static long long device_diff(const void *dev, size_t off, size_t len, uint64_t seed, size_t start)
{
    if (len == 0) return -1;
    unsigned char *got = malloc(len), *want = malloc(len);
    long long at = -2;
    CUresult r = got && want ? cu.dtoh(got, (CUdeviceptr)(uintptr_t)dev + off, len) : 2;
    if (r) {
        fprintf(stderr, "gpu_check: cuMemcpyDtoH_v2: %s\n", cu_error(r));
    } else {
        fill(want, len, seed, start);
        at = -1;
        for (size_t i = 0; i < len && at < 0; i++)
            if (got[i] != want[i]) at = (long long)(off + i);
    }
    free(got);
    free(want);
    return at;
}

/* ---------------------------------------------------------- the target --- */

#define SEED_TARGET 7 /* the target's buffers between checks */

enum { TCP, SHM, N_PROTO };
static const char *const proto_name[N_PROTO] = {"tcp", "shm"};

/* A command to the target: fill buffer which with pattern seed (whole), or
 * check that [off, +len) holds pattern seed from position start and the rest
 * pattern SEED_TARGET, then refill it with SEED_TARGET. */
typedef struct command {
    enum { FILL, CHECK, EXIT } op;
    int which;
    uint64_t off, len, seed, start;
} command;

typedef struct ready_msg {
    int status; /* 0, SKIP or 1 */
    char why[256];
    char name[N_PROTO][64];
    uint64_t addr[N_PROTO];
} ready_msg;

/* An engine on 127.0.0.1, on a port it picks; its segment name in name. */
static kvp_engine *engine(int proto, char *name, size_t cap)
{
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = "127.0.0.1:0";
    o.metadata = "P2PHANDSHAKE";
    o.protocol = proto_name[proto];
    o.disable_shm = proto != SHM; /* tcp: never shm for this same-host peer */
    kvp_engine *e = NULL;
    if (kvp_engine_create(&o, &e) != KVP_OK) {
        fprintf(stderr, "gpu_check: %s engine: %s\n", proto_name[proto], kvp_last_error());
        return NULL;
    }
    snprintf(name, cap, "%s", kvp_engine_segment_name(e));
    return e;
}

/* The target: a device buffer of len bytes per engine, registered with
 * kvp_engine_register as vLLM passes tensor.data_ptr(); then commands until
 * EXIT. Replies one int per command: 0 as expected, else 1. */
static void target_main(int device, size_t len, int in, int out)
{
    ready_msg m = {0};
    kvp_engine *e[N_PROTO] = {NULL};
    void *buf[N_PROTO] = {NULL};
    m.status = open_device(device, m.why, sizeof m.why);
    for (int p = 0; p < N_PROTO && m.status == 0; p++) {
        buf[p] = device_alloc(len);
        e[p] = engine(p, m.name[p], sizeof m.name[p]);
        if (!e[p] || device_fill(buf[p], 0, len, SEED_TARGET, 0) ||
            kvp_engine_register(e[p], buf[p], len) != KVP_OK) {
            snprintf(m.why, sizeof m.why, "target %s: %s", proto_name[p], kvp_last_error());
            m.status = 1;
        }
        m.addr[p] = (uint64_t)(uintptr_t)buf[p];
    }
    if (write(out, &m, sizeof m) != sizeof m || m.status) _exit(m.status);
    command c;
    while (read(in, &c, sizeof c) == sizeof c && c.op != EXIT) {
        int bad = 0;
        void *b = buf[c.which];
        if (c.op == FILL) {
            bad = device_fill(b, 0, len, c.seed, 0) != 0;
        } else {
            long long at[3] = {
                device_diff(b, 0, c.off, SEED_TARGET, 0),
                device_diff(b, c.off, c.len, c.seed, c.start),
                device_diff(b, c.off + c.len, len - c.off - c.len, SEED_TARGET, c.off + c.len)};
            for (int i = 0; i < 3 && !bad; i++) {
                if (at[i] == -1) continue;
                bad = 1;
                if (at[i] == -2) continue; /* device_diff said why */
                fprintf(stderr, "gpu_check: target %s: byte %lld %s\n", proto_name[c.which], at[i],
                        i == 1 ? "is not what was written" : "outside the range changed");
            }
            bad |= device_fill(b, 0, len, SEED_TARGET, 0) != 0;
        }
        if (write(out, &bad, sizeof bad) != sizeof bad) break;
    }
    for (int p = 0; p < N_PROTO; p++)
        kvp_engine_destroy(e[p]);
    _exit(0);
}

static struct {
    pid_t pid;
    int in, out; /* to it, from it */
    ready_msg m;
} target;

/* Fork the target; 0, SKIP or 1. */
static int target_start(int device, size_t len)
{
    int to[2], from[2];
    if (pipe(to) || pipe(from)) return 1;
    fflush(NULL);
    target.pid = fork();
    if (target.pid < 0) return 1;
    if (target.pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(to[1]);
        close(from[0]);
        target_main(device, len, to[0], from[1]);
    }
    close(to[0]);
    close(from[1]);
    target.in = to[1];
    target.out = from[0];
    if (read(target.out, &target.m, sizeof target.m) != sizeof target.m) {
        snprintf(target.m.why, sizeof target.m.why, "the target exited before it was ready");
        return 1;
    }
    return target.m.status;
}

/* 0 when the target did c and found its buffer as expected. */
static int target_do(command c)
{
    int bad = 1;
    if (write(target.in, &c, sizeof c) != sizeof c ||
        read(target.out, &bad, sizeof bad) != sizeof bad)
        fprintf(stderr, "gpu_check: the target is gone\n");
    return bad;
}

/* ------------------------------------------------------------ the runs --- */

static int failures;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void result(const char *name, int ok, const char *fmt, ...)
{
    char detail[512] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    printf("{\"check\": \"%s\", \"driver\": \"%s\", \"ok\": %s%s%s}\n", name, driver_kind(),
           ok ? "true" : "false", *detail ? ", " : "", detail);
    fflush(stdout);
    failures += !ok;
}

/* Move [0, len) of local to and from remote + off as n requests of (about)
 * equal size, all in one batch; KVP_OK or the batch's status. */
static kvp_status transfer(kvp_engine *e, kvp_segment_id seg, kvp_opcode op, void *local,
                           uint64_t remote, size_t len, size_t n)
{
    kvp_request *reqs = calloc(n, sizeof *reqs);
    if (!reqs) return KVP_ENOMEM;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        size_t part = len / n + (i < len % n);
        reqs[i] = (kvp_request){op, (char *)local + at, remote + at, part};
        at += part;
    }
    kvp_batch *b = NULL;
    kvp_status s = kvp_batch_submit(e, seg, reqs, n, &b);
    if (s == KVP_OK) s = kvp_batch_wait(b, -1);
    if (s != KVP_OK) fprintf(stderr, "gpu_check: %s: %s\n", kvp_strerror(s), kvp_last_error());
    kvp_batch_free(b);
    free(reqs);
    return s;
}

#define GUARD 4096
#define SEED_GUARD 3

typedef struct peer {
    int proto;
    kvp_engine *e;
    kvp_segment_id seg;
    uint64_t remote;
} peer;

/* WRITE len bytes from device memory to the target at off, as n requests;
 * READ them back at another offset into device memory between guards. */
static void check_round_trip(peer *p, size_t len, size_t n, uint64_t seed)
{
    const char *pn = proto_name[p->proto];
    char name[64];
    size_t woff = 12345, roff = 777; /* odd offsets on purpose */
    char *src = device_alloc(len), *dst = device_alloc(len + 2 * GUARD);
    int ok = device_fill(src, 0, len, seed, 0) == 0;
    ok &= device_fill(dst, 0, len + 2 * GUARD, SEED_GUARD, 0) == 0;
    /* Registered, as vLLM registers its KV cache: classified once. */
    ok &= kvp_engine_register(p->e, src, len) == KVP_OK &&
          kvp_engine_register(p->e, dst, len + 2 * GUARD) == KVP_OK;
    snprintf(name, sizeof name, "%s_write_%zu_requests", pn, n);
    kvp_status s = transfer(p->e, p->seg, KVP_OP_WRITE, src, p->remote + woff, len, n);
    int target_ok = target_do(s == KVP_OK ? (command){CHECK, p->proto, woff, len, seed, 0}
                                          : (command){FILL, p->proto, 0, 0, SEED_TARGET, 0}) == 0 &&
                    s == KVP_OK;
    result(name, ok && target_ok, "\"bytes\": %zu, \"status\": \"%s\"", len, kvp_strerror(s));

    snprintf(name, sizeof name, "%s_read_%zu_requests", pn, n);
    s = transfer(p->e, p->seg, KVP_OP_READ, dst + GUARD, p->remote + roff, len, n);
    long long at[3] = {device_diff(dst, 0, GUARD, SEED_GUARD, 0),
                       device_diff(dst, GUARD, len, SEED_TARGET, roff),
                       device_diff(dst, GUARD + len, GUARD, SEED_GUARD, GUARD + len)};
    int read_ok = s == KVP_OK && at[0] == -1 && at[1] == -1 && at[2] == -1;
    result(name, read_ok, "\"bytes\": %zu, \"status\": \"%s\", \"first_wrong_byte\": %lld", len,
           kvp_strerror(s),
           at[1] != -1   ? at[1]
           : at[0] != -1 ? at[0]
                         : at[2]);
    kvp_engine_unregister(p->e, src);
    kvp_engine_unregister(p->e, dst);
    cu.free((CUdeviceptr)(uintptr_t)src);
    cu.free((CUdeviceptr)(uintptr_t)dst);
}

typedef struct rate {
    const char *name;
    double gbps;
} rate;

/* Seconds per copy of len bytes by the driver, best of iters. */
static double time_copy(int kind, void *dev_a, void *dev_b, void *host, size_t len, int iters)
{
    double best = 1e30;
    for (int i = 0; i < iters; i++) {
        double t0 = now();
        CUresult r = kind == 0   ? cu.dtoh(host, (CUdeviceptr)(uintptr_t)dev_a, len)
                     : kind == 1 ? cu.htod((CUdeviceptr)(uintptr_t)dev_a, host, len)
                                 : cu.dtod((CUdeviceptr)(uintptr_t)dev_b,
                                           (CUdeviceptr)(uintptr_t)dev_a, len);
        if (r == 0) r = cu.ctx_sync(); /* a device-to-device copy may return early */
        if (r) {
            fprintf(stderr, "gpu_check: baseline copy: %s\n", cu_error(r));
            failures++;
            return 0;
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    return best;
}

static void print_rate(const char *name, size_t len, double secs, const char *base_name,
                       double base_secs)
{
    double gbps = secs > 0 ? (double)len / secs / 1e9 : 0;
    printf("{\"rate\": \"%s\", \"driver\": \"%s\", \"bytes\": %zu, \"GBps\": %.3f", name,
           driver_kind(), len, gbps);
    if (base_name && base_secs > 0 && secs > 0)
        printf(", \"baseline\": \"%s\", \"ratio\": %.3f", base_name, base_secs / secs);
    printf("}\n");
    fflush(stdout);
}

/* The timed transfers of one transport, len bytes in chunk-sized requests,
 * best of iters after one untimed; the last WRITE's bytes checked by the
 * target, the last READ's here. */
static void throughput(peer *p, void *src, void *dst, size_t len, size_t chunk, int iters,
                       double d2h, double h2d, double d2d)
{
    const char *pn = proto_name[p->proto];
    size_t n = (len + chunk - 1) / chunk;
    for (int op = 0; op < 2; op++) {
        double best = 1e30;
        kvp_status s = KVP_OK;
        void *local = op == 0 ? src : dst;
        /* What a READ fails to write must show: not bytes of an earlier one. */
        if (op == 1 && device_fill(dst, 0, len, SEED_GUARD, 0)) s = KVP_EIO;
        for (int i = 0; i <= iters && s == KVP_OK; i++) {
            double t0 = now();
            s = transfer(p->e, p->seg, op == 0 ? KVP_OP_WRITE : KVP_OP_READ, local, p->remote, len,
                         n);
            double dt = now() - t0;
            if (i > 0 && dt < best) best = dt;
        }
        char name[64];
        snprintf(name, sizeof name, "%s_%s", pn, op == 0 ? "write" : "read");
        int ok = s == KVP_OK && (op == 0 ? target_do((command){CHECK, p->proto, 0, len, 41, 0}) == 0
                                         : device_diff(dst, 0, len, SEED_TARGET, 0) == -1);
        if (s != KVP_OK) target_do((command){FILL, p->proto, 0, 0, SEED_TARGET, 0});
        if (!ok) {
            result(name, 0, "\"bytes\": %zu, \"status\": \"%s\", \"timed\": true", len,
                   kvp_strerror(s));
            continue;
        }
        if (p->proto == SHM) {
            print_rate(name, len, best, "device_to_device", d2d);
        } else {
            print_rate(name, len, best, op == 0 ? "pinned_device_to_host" : "pinned_host_to_device",
                       op == 0 ? d2h : h2d);
        }
    }
}

static void usage(void)
{
    fprintf(stderr, "usage: gpu_check [--quick] [--device N]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    int quick = 0, device = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = 1;
        else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            device = atoi(argv[++i]);
        else
            usage();
    }
    alarm(quick ? 240 : 480); /* a hang fails the run (SIGALRM) */
    const char *why = load_driver();
    if (why) {
        printf("{\"skip\": \"%s\"}\n", js(why));
        return SKIP;
    }
    /* The double's device memory is 1 GiB a process; its figures mean nothing. */
    size_t len = quick || cu.is_double ? (size_t)16 << 20 : (size_t)256 << 20;
    size_t check_len = ((size_t)9 << 20) + 4099; /* several bounce buffers, not a multiple */
    size_t chunk = (size_t)4 << 20;
    int iters = quick || cu.is_double ? 2 : 5;
    size_t target_len = (len > check_len + 16384 ? len : check_len + 16384);

    int st = target_start(device, target_len); /* before this process uses the driver */
    char local_why[256];
    if (st == 0)
        st = open_device(device, local_why, sizeof local_why);
    else
        snprintf(local_why, sizeof local_why, "%s", target.m.why);
    if (st) {
        printf("{\"%s\": \"%s\"}\n", st == SKIP ? "skip" : "error", js(local_why));
        return st;
    }
    int version = 0;
    cu.driver_version(&version);
    printf(
        "{\"gpu_check\": \"start\", \"driver\": \"%s\", \"library\": \"%s\", \"driver_version\": "
        "%d, \"device\": %d, \"quick\": %s}\n",
        driver_kind(), js(cu.path), version, device, quick ? "true" : "false");
    fflush(stdout);

    peer peers[N_PROTO];
    for (int p = 0; p < N_PROTO; p++) {
        char name[64];
        peers[p] = (peer){p, engine(p, name, sizeof name), 0, target.m.addr[p]};
        if (!peers[p].e || kvp_engine_open_segment(peers[p].e, target.m.name[p], &peers[p].seg)) {
            result(proto_name[p], 0, "\"error\": \"open %s: %s\"", target.m.name[p],
                   js(kvp_last_error()));
            return 1;
        }
    }
    for (int p = 0; p < N_PROTO; p++) {
        check_round_trip(&peers[p], check_len, 1, 21 + p);
        check_round_trip(&peers[p], check_len, 64, 31 + p);
    }

    void *src = device_alloc(len), *dst = device_alloc(len), *host = NULL;
    CUresult r = cu.host_alloc(&host, len, CU_MEMHOSTALLOC_PORTABLE);
    if (r || device_fill(src, 0, len, 41, 0)) {
        result("throughput", 0, "\"error\": \"cuMemHostAlloc: %s\"", js(cu_error(r)));
        return 1;
    }
    double d2h = time_copy(0, src, NULL, host, len, iters);
    double h2d = time_copy(1, dst, NULL, host, len, iters);
    double d2d = time_copy(2, src, dst, NULL, len, iters);
    print_rate("pinned_device_to_host", len, d2h, NULL, 0);
    print_rate("pinned_host_to_device", len, h2d, NULL, 0);
    print_rate("device_to_device", len, d2d, NULL, 0);
    for (int p = 0; p < N_PROTO; p++) {
        if (kvp_engine_register(peers[p].e, src, len) ||
            kvp_engine_register(peers[p].e, dst, len)) {
            result(proto_name[p], 0, "\"error\": \"register: %s\"", js(kvp_last_error()));
            continue;
        }
        throughput(&peers[p], src, dst, len, chunk, iters, d2h, h2d, d2d);
    }

    cu.host_free(host);
    cu.free((CUdeviceptr)(uintptr_t)src);
    cu.free((CUdeviceptr)(uintptr_t)dst);
    for (int p = 0; p < N_PROTO; p++)
        kvp_engine_destroy(peers[p].e);
    command bye = {EXIT, 0, 0, 0, 0, 0};
    if (write(target.in, &bye, sizeof bye) != sizeof bye) failures++;
    int status = 0;
    waitpid(target.pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status)) {
        fprintf(stderr, "gpu_check: the target ended with status %d\n", status);
        failures++;
    }
    printf("{\"gpu_check\": \"done\", \"driver\": \"%s\", \"failures\": %d}\n", driver_kind(),
           failures);
    return failures ? 1 : 0;
}
