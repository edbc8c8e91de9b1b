/* Device (CUDA) memory through the tcp and shm transports, on the driver's
 * test double (tests/support/fake_cuda: device memory the CPU cannot touch,
 * so any CPU access by kvpipe to it crashes the case): staged through bounce
 * buffers, and over shm by CUDA IPC (the ipc_ cases; the shm_ cases have the
 * double refuse IPC, as across containers, so they run the staged
 * fallback). Multi-process: the target engine runs in a forked child with its
 * own "device"; it checks what the initiator WROTE into its memory itself,
 * through the double's copies, and how many copies it made, and exits with
 * the verdict. */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvpipe/kvpipe.h"
#include "peer.h"
#include "test.h"
#include "transport/transport.h"

#define TLEN ((size_t)2 << 20)   /* the target's buffer */
#define XLEN ((size_t)600 << 10) /* bytes moved: not a multiple of a bounce buffer */
#define READ_OFF 4096
#define WRITE_OFF ((size_t)1 << 20)
#define SEED_TARGET 11
#define SEED_WRITE 22

static kvpt_fakecuda fc;

static void load_double(void)
{
    kvpt_fakecuda_load(&fc, KVPT_FAKECUDA_PATH);
}

/* An engine on protocol, named name or (NULL) 127.0.0.1 and a free port. */
static kvp_engine *engine(const char *name, const char *protocol)
{
    char here[64];
    if (!name) {
        snprintf(here, sizeof here, "127.0.0.1:%d", kvpt_free_port());
        name = here;
    }
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = name;
    o.metadata = "P2PHANDSHAKE";
    o.protocol = protocol;
    o.disable_shm = strcmp(protocol, "shm") != 0; /* tcp: never shm for this same-host peer */
    kvp_engine *e = NULL;
    if (kvp_engine_create(&o, &e) != KVP_OK)
        fprintf(stderr, "  engine %s: %s\n", name, kvp_last_error());
    return e;
}

/* st is want and the last error says text; else what it was, printed. */
static int fails_with(kvp_status st, kvp_status want, const char *text)
{
    int ok = st == want && strstr(kvp_last_error(), text) != NULL;
    if (!ok)
        fprintf(stderr, "  got %d (%s: %s), want %d saying \"%s\"\n", (int)st, kvp_strerror(st),
                kvp_last_error(), (int)want, text);
    return ok;
}

/* Memory of len bytes, device (on device 1) or host, holding pattern seed. */
static void *memory(int device, size_t len, uint64_t seed)
{
    char *ref = malloc(len);
    kvpt_fill(ref, len, seed);
    void *p = ref;
    if (device) {
        p = fc.alloc(1, len);
        if (!p || fc.poke(p, ref, len) != 0) p = NULL;
        free(ref);
    }
    return p;
}

/* Copy len bytes of memory (device or host) out to host memory. */
static void read_back(int device, void *dst, const void *src, size_t len)
{
    if (device)
        fc.peek(dst, src, len);
    else
        memcpy(dst, src, len);
}

/* Non-zero if [off, +len) of mem holds the bytes of pattern seed at
 * [pat_off, +len) of it. */
static int holds(int device, const void *mem, size_t off, size_t len, uint64_t seed, size_t pat_off)
{
    char *ref = malloc(pat_off + len + 1), *got = malloc(len + 1);
    kvpt_fill(ref, pat_off + len, seed);
    read_back(device, got, (const char *)mem + off, len);
    int ok = memcmp(got, ref + pat_off, len) == 0;
    free(ref);
    free(got);
    return ok;
}

/* ------------------------------------------------------------ the target --- */

/* A kvpt_peer: the parent writes the verdict to check on its channel, then
 * closes it; device 3: a byte asks the child to unregister the second buffer,
 * and the child answers it. */
typedef struct target {
    kvpt_peer peer;
    char name[64];
    uint64_t addr;
    uint64_t second; /* device 2: its host buffer; device 3: its second device buffer */
    const char *proto;
    int device;
    long fail_copy;
} target;
#define ANSWER_MS 20000

typedef struct verdict {
    uint64_t off, len, seed; /* [off, +len) must hold seed's pattern (its first len bytes) */
    int copies;              /* the target's own copies: 0 none, 1 some, -1 either */
} verdict;

/* The child: its engine, its memory (pattern SEED_TARGET), registered with
 * kvp_engine_register as vLLM passes tensor.data_ptr(); device 2: device
 * memory and a host buffer of the same pattern, both registered; device 3:
 * two device buffers, the second unregistered when the parent writes a byte
 * (acknowledged on ready). Then waits for the verdict and checks its whole
 * memory (the first buffer's): the verdict's range WRITTEN, the rest
 * untouched. Exit 0: as expected; 10: wrong bytes. */
static void target_main(void *arg, int ctl, int ready)
{
    const target *t = arg;
    if (t->fail_copy) {
        char v[32];
        snprintf(v, sizeof v, "%ld", t->fail_copy);
        setenv("FAKECUDA_FAIL_COPY", v, 1);
    }
    int device = t->device;
    kvp_engine *e = engine(t->name, t->proto);
    if (!e) _exit(3);
    int kind2 = device;
    device = device != 0;
    void *mem = memory(device, TLEN, SEED_TARGET);
    void *second = kind2 >= 2 ? memory(kind2 == 3, TLEN, SEED_TARGET) : NULL;
    if (!mem) _exit(4);
    if (kvp_engine_register(e, mem, TLEN) != KVP_OK ||
        (second && kvp_engine_register(e, second, TLEN) != KVP_OK)) {
        fprintf(stderr, "  target register: %s\n", kvp_last_error());
        _exit(5);
    }
    uint64_t addr[2] = {(uint64_t)(uintptr_t)mem, (uint64_t)(uintptr_t)second};
    if (write(ready, addr, sizeof addr) != sizeof addr) _exit(6);
    char c;
    if (kind2 == 3 && (read(ctl, &c, 1) != 1 || kvp_engine_unregister(e, second) != KVP_OK ||
                       write(ready, &c, 1) != 1))
        _exit(7);
    verdict v = {0, 0, 0, -1};
    ssize_t n = read(ctl, &v, sizeof v);
    kvp_engine_destroy(e);
    if (n != sizeof v) _exit(0); /* nothing to check */
    long copies = fc.copies();
    if (v.copies >= 0 && (copies > 0) != v.copies) {
        fprintf(stderr, "  the target made %ld copies\n", copies);
        _exit(11);
    }
    int ok = holds(device, mem, v.off, v.len, v.seed, 0) &&
             holds(device, mem, 0, v.off, SEED_TARGET, 0) &&
             holds(device, mem, v.off + v.len, TLEN - v.off - v.len, SEED_TARGET, v.off + v.len);
    _exit(ok ? 0 : 10);
}

/* Fork the target before this process touches the driver (a CUDA process
 * cannot fork one that uses it). fail_copy: the child's Nth copy fails. */
static int target_start(const char *proto, int device, long fail_copy, target *t)
{
    snprintf(t->name, sizeof t->name, "127.0.0.1:%d", kvpt_free_port());
    t->proto = proto;
    t->device = device;
    t->fail_copy = fail_copy;
    uint64_t addr[2];
    if (kvpt_peer_fork(&t->peer, NULL, target_main, t) ||
        kvpt_peer_recv(&t->peer, addr, sizeof addr, ANSWER_MS))
        return -1;
    t->addr = addr[0];
    t->second = addr[1];
    return 0;
}

/* The child's exit status (0: its memory is as expected; 11: not the copies
 * expected; 128+11: it crashed, as a CPU access to device memory does). */
static int target_stop(target *t, const verdict *v)
{
    int sent = !v || kvpt_peer_send(&t->peer, v, sizeof *v) == 0;
    int rc = kvpt_peer_wait(&t->peer, 20000);
    if (rc) fprintf(stderr, "  the target exited with status %d\n", rc);
    return sent ? rc : -1;
}

/* The target forked, then an engine here on the same protocol (NULL if
 * either fails). */
static kvp_engine *start(const char *proto, int device, long fail_copy, target *t)
{
    if (target_start(proto, device, fail_copy, t) != 0) {
        fprintf(stderr, "  the target did not start\n");
        return NULL;
    }
    return engine(NULL, proto);
}

/* Destroy the engine, then check the target's verdict: [WRITE_OFF, +len)
 * holds SEED_WRITE, its own copies as copies says (verdict). */
static void finish(kvp_engine *e, target *t, size_t len, int copies)
{
    kvp_engine_destroy(e);
    verdict v = {WRITE_OFF, len, SEED_WRITE, copies};
    CHECK(target_stop(t, &v) == 0);
}

/* XLEN bytes to READ into (in, pattern 99) and to WRITE from (out,
 * SEED_WRITE), on device 1 or the host, both registered with e; 0, or -1
 * with the reason printed. */
static int in_and_out(kvp_engine *e, int device, void **in, void **out)
{
    *in = memory(device, XLEN, 99);
    *out = memory(device, XLEN, SEED_WRITE);
    if (!*in || !*out) return -1;
    for (int i = 0; i < 2; i++)
        if (kvp_engine_register(e, i ? *out : *in, XLEN) != KVP_OK) {
            fprintf(stderr, "  register: %s\n", kvp_last_error());
            return -1;
        }
    return 0;
}

/* ------------------------------------------------------------- transfers --- */

/* How device memory must move over shm: staged through bounce buffers, the
 * double refusing CUDA IPC (as across containers or on MIG); or by CUDA IPC,
 * the initiator's copies only. (tcp always stages.) */
enum path { STAGED, IPC };

/* READ [READ_OFF, +XLEN) of the target into local memory and WRITE pattern
 * SEED_WRITE to [WRITE_OFF, +XLEN); every byte checked on both sides, and
 * the copies of each side counted. */
static void round_trip(const char *proto, int local_dev, int target_dev, enum path path)
{
    if (path == STAGED) setenv("FAKECUDA_IPC_REFUSE", "1", 1);
    target t;
    kvp_engine *e = start(proto, target_dev, 0, &t);
    REQUIRE(e);
    /* The KV cache is registered, as vLLM and SGLang do: classified once. */
    void *in, *out;
    REQUIRE(in_and_out(e, local_dev, &in, &out) == 0);
    /* Host memory goes through IPC in a process that uses the driver anyway
     * (one with device memory of its own). */
    if (path == IPC && !local_dev) CHECK_OK(kvp_engine_register(e, fc.alloc(0, 4096), 4096));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    long before = fc.copies(), ipc_before = fc.ipc_copies();
    CHECK_OK(kvp_engine_read(e, seg, in, t.addr + READ_OFF, XLEN));
    CHECK(holds(local_dev, in, 0, XLEN, SEED_TARGET, READ_OFF));
    CHECK_OK(kvp_engine_write(e, seg, out, t.addr + WRITE_OFF, XLEN));
    long copies = fc.copies() - before, ipc = fc.ipc_copies() - ipc_before;
    if (path == IPC) {
        /* Every copy of ours one through IPC (none into a bounce buffer), at
         * least one each way; the target made none. */
        CHECK(ipc >= 2 && copies == ipc);
    } else {
        CHECK(ipc == 0);
        /* Device memory moved through the driver's copies: a bounce buffer
         * (KVPIPE_CUDA_BOUNCE_BYTES, 64 KiB here) at a time, each way. */
        if (local_dev) CHECK(copies >= (long)(2 * XLEN / 65536));
    }
    kvp_engine_destroy(e);
    if (!local_dev) { /* device memory is the double's bump allocator's */
        free(in);
        free(out);
    }
    verdict v = {WRITE_OFF, XLEN, SEED_WRITE, path == IPC ? 0 : target_dev ? 1 : -1};
    CHECK(target_stop(&t, &v) == 0);
}

/* One case a line: the protocol, which sides hold device memory, the path. */
#define ROUND_TRIP(name, proto, init_dev, target_dev, path)                                        \
    static void name(void)                                                                         \
    {                                                                                              \
        round_trip(proto, init_dev, target_dev, path);                                             \
    }
ROUND_TRIP(tcp_initiator_device, "tcp", 1, 0, STAGED)
ROUND_TRIP(tcp_target_device, "tcp", 0, 1, STAGED)
ROUND_TRIP(tcp_both_device, "tcp", 1, 1, STAGED)
ROUND_TRIP(shm_initiator_device, "shm", 1, 0, STAGED)
ROUND_TRIP(shm_target_device, "shm", 0, 1, STAGED)
ROUND_TRIP(shm_both_device, "shm", 1, 1, STAGED)
ROUND_TRIP(ipc_both_device, "shm", 1, 1, IPC)
ROUND_TRIP(ipc_target_device, "shm", 0, 1, IPC)

/* ucx moves host memory only: an engine on rdma moves device memory over tcp
 * to the same peer (staged), chosen by memory kind. */
static void rdma_device_over_tcp(void)
{
    if (!kvpi_transport_lookup("rdma")) SKIP("no ucx transport in this build");
    round_trip("rdma", 1, 1, STAGED);
}

/* A batch of many small requests on device memory: grouped into xfers of
 * several slices, some pieces of one bounce buffer. */
static void tcp_batch_device(void)
{
    target t;
    kvp_engine *e = start("tcp", 1, 0, &t);
    REQUIRE(e);
    void *out = memory(1, XLEN, SEED_WRITE);
    REQUIRE(out);
    CHECK_OK(kvp_engine_register(e, out, XLEN));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    enum { N = 60 };
    kvp_request reqs[N];
    size_t each = XLEN / N;
    for (size_t i = 0; i < N; i++)
        reqs[i] = (kvp_request){.opcode = KVP_OP_WRITE,
                                .local = (char *)out + i * each,
                                .remote = t.addr + WRITE_OFF + i * each,
                                .length = each};
    kvp_batch *b;
    REQUIRE_OK(kvp_batch_submit(e, seg, reqs, N, &b));
    CHECK_OK(kvp_batch_wait(b, 30000));
    kvp_batch_free(b);
    finish(e, &t, each * N, -1);
}

/* ------------------------------------------------------------ registration --- */

static void register_kinds(void)
{
    kvp_engine *e = engine(NULL, "tcp");
    REQUIRE(e);
    char *dev = fc.alloc(1, 1 << 20);
    REQUIRE(dev);
    /* As vLLM passes it: a plain register of a device pointer. */
    CHECK_OK(kvp_engine_register(e, dev, 1 << 19));
    /* Another device than the memory's: refused, saying which. */
    CHECK(fails_with(kvp_engine_register_mem(e, dev + (1 << 19), 4096, KVP_MEM_CUDA, 0), KVP_EINVAL,
                     "device 1"));
    CHECK_OK(kvp_engine_register_mem(e, dev + (1 << 19), 4096, KVP_MEM_CUDA, 1));
    /* Host memory is not CUDA memory. */
    char *host = malloc(8192);
    CHECK(fails_with(kvp_engine_register_mem(e, host, 8192, KVP_MEM_CUDA, 0), KVP_EINVAL,
                     "not CUDA device memory"));
    CHECK_OK(kvp_engine_register(e, host, 8192));
    CHECK_OK(kvp_engine_unregister(e, dev));
    CHECK_OK(kvp_engine_unregister(e, host));
    kvp_engine_destroy(e);
    free(host);
}

/* A tcp engine made with the environment variable name set to value. */
static kvp_engine *engine_under(const char *name, const char *value)
{
    setenv(name, value, 1);
    return engine(NULL, "tcp");
}

/* 1 MiB the CPU cannot read (PROT_NONE), as a GPU pointer is to it; NULL if
 * it cannot be mapped. */
static void *unreadable(void)
{
    void *p = mmap(NULL, 1 << 20, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* Memory the CPU cannot read stands for a GPU pointer on a host without the
 * driver: a clear error naming what is missing, host memory still fine. */
static void register_no_driver(void)
{
    kvp_engine *e = engine_under("KVPIPE_LIBCUDA", "/nonexistent/libcuda.so.1");
    REQUIRE(e);
    void *gpu_like = unreadable();
    REQUIRE(gpu_like);
    CHECK(fails_with(kvp_engine_register(e, gpu_like, 1 << 20), KVP_EINVAL,
                     "libcuda.so.1 not found"));
    CHECK(fails_with(kvp_engine_register_mem(e, gpu_like, 1 << 20, KVP_MEM_CUDA, 0), KVP_ENOTSUP,
                     "not found"));
    char *host = malloc(4096);
    CHECK_OK(kvp_engine_register(e, host, 4096));
    kvp_engine_destroy(e);
    free(host);
}

static void register_init_fails(void)
{
    kvp_engine *e = engine_under("FAKECUDA_INIT_FAIL", "1");
    REQUIRE(e);
    void *gpu_like = unreadable();
    REQUIRE(gpu_like);
    CHECK(fails_with(kvp_engine_register_mem(e, gpu_like, 1 << 20, KVP_MEM_CUDA, 0), KVP_ENOTSUP,
                     "cuInit failed"));
    CHECK(strstr(kvp_last_error(), "no CUDA-capable device") != NULL);
    kvp_engine_destroy(e);
}

/* ------------------------------------------------------------- failed copies --- */

/* The initiator's nth copy fails under a WRITE, then under a READ: each
 * KVP_EIO saying write_says / read_says (the WRITE's also the driver's
 * "illegal memory access"). The same transfers again, without a failure:
 * all the bytes (in: device memory). */
static void fails_then_heals(kvp_engine *e, kvp_segment_id seg, const target *t, void *in,
                             void *out, long nth, const char *write_says, const char *read_says)
{
    fc.fail_copy(nth);
    CHECK(
        fails_with(kvp_engine_write(e, seg, out, t->addr + WRITE_OFF, XLEN), KVP_EIO, write_says));
    CHECK(strstr(kvp_last_error(), "illegal memory access") != NULL);
    fc.fail_copy(nth);
    CHECK(fails_with(kvp_engine_read(e, seg, in, t->addr + READ_OFF, XLEN), KVP_EIO, read_says));
    CHECK_OK(kvp_engine_read(e, seg, in, t->addr + READ_OFF, XLEN));
    CHECK(holds(1, in, 0, XLEN, SEED_TARGET, READ_OFF));
    CHECK_OK(kvp_engine_write(e, seg, out, t->addr + WRITE_OFF, XLEN));
}

/* The initiator's 3rd copy fails: the transfer fails with a clear error,
 * nothing outside its range is touched, and the next one succeeds. */
static void copy_fails_initiator(const char *proto)
{
    target t;
    kvp_engine *e = start(proto, 0, 0, &t);
    REQUIRE(e);
    void *in, *out;
    REQUIRE(in_and_out(e, 1, &in, &out) == 0);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    fails_then_heals(e, seg, &t, in, out, 3, "copy", "host to device");
    finish(e, &t, XLEN, -1);
}

/* The target's 2nd copy fails (serving the READ): the initiator's READ fails
 * with an error, its next READ and a WRITE succeed, every byte right. */
static void copy_fails_target(const char *proto)
{
    target t;
    kvp_engine *e = start(proto, 1, 2, &t);
    REQUIRE(e);
    char *in = malloc(XLEN), *out = memory(0, XLEN, SEED_WRITE);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    kvp_status st = kvp_engine_read(e, seg, in, t.addr + READ_OFF, XLEN);
    CHECK(st != KVP_OK);
    fprintf(stderr, "  (the failed READ: %s: %s)\n", kvp_strerror(st), kvp_last_error());
    CHECK_OK(kvp_engine_read(e, seg, in, t.addr + READ_OFF, XLEN));
    CHECK(holds(0, in, 0, XLEN, SEED_TARGET, READ_OFF));
    CHECK_OK(kvp_engine_write(e, seg, out, t.addr + WRITE_OFF, XLEN));
    finish(e, &t, XLEN, -1);
    free(in);
    free(out);
}

/* The target's 3rd copy fails while it serves a WRITE: the WRITE fails with
 * an error or (tcp: the refusal makes the engine look the segment up and run
 * it once more) succeeds; either way the next WRITE succeeds and the target
 * holds every byte, nothing outside the range touched. */
static void copy_fails_target_write(const char *proto)
{
    target t;
    kvp_engine *e = start(proto, 1, 3, &t);
    REQUIRE(e);
    char *out = memory(0, XLEN, SEED_WRITE);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    kvp_status st = kvp_engine_write(e, seg, out, t.addr + WRITE_OFF, XLEN);
    fprintf(stderr, "  (the WRITE whose target copy failed: %s%s%s)\n", kvp_strerror(st),
            st ? ": " : "", st ? kvp_last_error() : "");
    CHECK_OK(kvp_engine_write(e, seg, out, t.addr + WRITE_OFF, XLEN));
    finish(e, &t, XLEN, -1);
    free(out);
}

/* One batch, its requests alternately on the target's device memory (CUDA
 * IPC) and on its host buffer (the target copies, our device memory staged;
 * the engine groups them apart, by memory kinds): WRITE, then READ it all
 * back, every byte checked. */
static void ipc_mixed_batch(void)
{
    target t;
    kvp_engine *e = start("shm", 2, 0, &t);
    REQUIRE(e);
    enum { N = 6 };
    const size_t each = 65536;
    void *in = memory(1, N * each, 99), *out = memory(1, N * each, SEED_WRITE);
    REQUIRE(in && out);
    CHECK_OK(kvp_engine_register(e, in, N * each));
    CHECK_OK(kvp_engine_register(e, out, N * each));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    long before = fc.copies(), ipc_before = fc.ipc_copies();
    for (int op = KVP_OP_WRITE; op >= KVP_OP_READ; op--) {
        kvp_request reqs[N];
        for (size_t i = 0; i < N; i++)
            reqs[i] = (kvp_request){.opcode = (kvp_opcode)op,
                                    .local = (char *)(op == KVP_OP_READ ? in : out) + i * each,
                                    .remote = (i % 2 ? t.second : t.addr) + i * each,
                                    .length = each};
        kvp_batch *b;
        REQUIRE_OK(kvp_batch_submit(e, seg, reqs, N, &b));
        CHECK_OK(kvp_batch_wait(b, 30000));
        kvp_batch_free(b);
    }
    CHECK(holds(1, in, 0, N * each, SEED_WRITE, 0));
    long ipc = fc.ipc_copies() - ipc_before;
    CHECK(ipc == N);                   /* the device half, each way */
    CHECK(fc.copies() - before > ipc); /* and the host half through bounce buffers */
    kvp_engine_destroy(e);
    CHECK(target_stop(&t, NULL) == 0);
}

/* One group of slices, half on a device buffer of the target (CUDA IPC),
 * half on one it unregistered after we read its descriptor: the target has
 * no handle for those (KVP_ERANGE), so they go its way and it refuses them,
 * while the others complete through IPC; every byte checked. */
static void ipc_stale_region(void)
{
    target t;
    kvp_engine *e = start("shm", 3, 0, &t);
    REQUIRE(e);
    enum { N = 4 };
    const size_t each = 65536;
    void *out = memory(1, N * each, SEED_WRITE);
    REQUIRE(out);
    CHECK_OK(kvp_engine_register(e, out, N * each));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    char c = 'u';
    REQUIRE(kvpt_peer_send(&t.peer, &c, 1) == 0 && kvpt_peer_recv(&t.peer, &c, 1, ANSWER_MS) == 0);
    long ipc_before = fc.ipc_copies();
    kvp_request reqs[N];
    for (size_t i = 0; i < N; i++) /* A B A B; A's bytes are out's first half */
        reqs[i] = (kvp_request){.opcode = KVP_OP_WRITE,
                                .local = (char *)out + (i % 2 ? N / 2 + i / 2 : i / 2) * each,
                                .remote = i % 2 ? t.second + i / 2 * each
                                                : t.addr + WRITE_OFF + i / 2 * each,
                                .length = each};
    kvp_batch *b;
    REQUIRE_OK(kvp_batch_submit(e, seg, reqs, N, &b));
    CHECK_ST(kvp_batch_wait(b, 30000), KVP_ERANGE);
    for (size_t i = 0; i < N; i++)
        CHECK_ST(kvp_batch_request_status(b, i), i % 2 ? KVP_ERANGE : KVP_OK);
    kvp_batch_free(b);
    CHECK(fc.ipc_copies() - ipc_before == N / 2);
    finish(e, &t, N / 2 * each, 0);
}

/* Target and initiator engines in one process: the driver opens no IPC
 * handle of its own process, so device memory is staged, with no warning;
 * every byte right. */
static void ipc_same_process(void)
{
    char tname[64];
    snprintf(tname, sizeof tname, "127.0.0.1:%d", kvpt_free_port());
    kvp_engine *te = engine(tname, "shm"), *e = engine(NULL, "shm");
    REQUIRE(te && e);
    void *tmem = memory(1, TLEN, SEED_TARGET), *in = memory(1, XLEN, 99);
    REQUIRE(tmem && in);
    CHECK_OK(kvp_engine_register(te, tmem, TLEN));
    CHECK_OK(kvp_engine_register(e, in, XLEN));
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, tname, &seg));
    long ipc_before = fc.ipc_copies();
    uint64_t addr = (uint64_t)(uintptr_t)tmem;
    CHECK_OK(kvp_engine_read(e, seg, in, addr + READ_OFF, XLEN));
    CHECK(holds(1, in, 0, XLEN, SEED_TARGET, READ_OFF));
    CHECK_OK(kvp_engine_write(e, seg, in, addr + WRITE_OFF, XLEN));
    CHECK(holds(1, tmem, WRITE_OFF, XLEN, SEED_TARGET, READ_OFF));
    CHECK(fc.ipc_copies() == ipc_before);
    kvp_engine_destroy(e);
    kvp_engine_destroy(te);
}

/* A copy through CUDA IPC fails (the initiator's next copy, of a WRITE and
 * then of a READ): KVP_EIO with the driver's message; then the same
 * transfers succeed, every byte right, the target having copied nothing. */
static void ipc_copy_fails(void)
{
    target t;
    kvp_engine *e = start("shm", 1, 0, &t);
    REQUIRE(e);
    void *in, *out;
    REQUIRE(in_and_out(e, 1, &in, &out) == 0);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    long ipc_before = fc.ipc_copies();
    fails_then_heals(e, seg, &t, in, out, 1, "through CUDA IPC failed", "through CUDA IPC failed");
    CHECK(fc.ipc_copies() - ipc_before >= 2);
    finish(e, &t, XLEN, 0);
}

/* Each of these cases on tcp and on shm. */
#define ON_TCP_AND_SHM(fn)                                                                         \
    static void tcp_##fn(void)                                                                     \
    {                                                                                              \
        fn("tcp");                                                                                 \
    }                                                                                              \
    static void shm_##fn(void)                                                                     \
    {                                                                                              \
        fn("shm");                                                                                 \
    }
ON_TCP_AND_SHM(copy_fails_initiator)
ON_TCP_AND_SHM(copy_fails_target)
ON_TCP_AND_SHM(copy_fails_target_write)

int main(void)
{
    signal(SIGPIPE, SIG_IGN); /* a crashed target's pipe fails a CHECK, not the case */
    setenv("KVPIPE_LIBCUDA", KVPT_FAKECUDA_PATH, 1);
    /* Small bounce buffers, few of them: many pieces, and waits for them. */
    setenv("KVPIPE_CUDA_BOUNCE_BYTES", "65536", 1);
    setenv("KVPIPE_CUDA_BOUNCE_BUFFERS", "2", 1);
    load_double();
    RUN(register_kinds);
    RUN(register_no_driver);
    RUN(register_init_fails);
    RUN(tcp_initiator_device);
    RUN(tcp_target_device);
    RUN(tcp_both_device);
    RUN(tcp_batch_device);
    RUN(rdma_device_over_tcp);
    RUN(shm_initiator_device);
    RUN(shm_target_device);
    RUN(shm_both_device);
    RUN(tcp_copy_fails_initiator);
    RUN(shm_copy_fails_initiator);
    RUN(tcp_copy_fails_target);
    RUN(shm_copy_fails_target);
    RUN(tcp_copy_fails_target_write);
    RUN(shm_copy_fails_target_write);
    RUN(ipc_both_device);
    RUN(ipc_target_device);
    RUN(ipc_copy_fails);
    RUN(ipc_same_process);
    RUN(ipc_mixed_batch);
    RUN(ipc_stale_region);
    return kvpt_summary();
}
