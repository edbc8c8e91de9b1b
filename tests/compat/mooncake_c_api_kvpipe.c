/* kvpipe's answers where Mooncake's C API leaves the outcome to the
 * implementation (docs/mooncake-c-api.md, "Function by function"): written
 * against transfer_engine_c.h alone, linked with libkvpipe_mooncake only.
 * Two engines in this process, A (target) and B (initiator), over
 * P2PHANDSHAKE. Prints "ok" and exits 0, or "FAIL: ..." lines and 1. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <transfer_engine_c.h>

#define MB (1u << 20)

static int failed;

#define EXPECT(cond, what)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL: line %d: %s: %s\n", __LINE__, #cond, what);                              \
            failed = 1;                                                                            \
        }                                                                                          \
    } while (0)

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The final status of task 0 of a one-request batch (20 s at most). */
static int run_one(transfer_engine_t e, int opcode, void *local, segment_id_t seg, uint64_t remote,
                   uint64_t len, const notify_msg_t *notify)
{
    batch_id_t b = allocateBatchID(e, 1);
    struct transfer_request r = {.opcode = opcode,
                                 .source = local,
                                 .target_id = seg,
                                 .target_offset = remote,
                                 .length = len};
    int rc = notify ? submitTransferWithNotify(e, b, &r, 1, *notify) : submitTransfer(e, b, &r, 1);
    EXPECT(rc == 0, "submit");
    struct transfer_status st = {.status = STATUS_WAITING};
    for (int i = 0; i < 20000 && (st.status == STATUS_WAITING || st.status == STATUS_PENDING);
         i++) {
        if (getTransferStatus(e, b, 0, &st)) break;
        if (st.status == STATUS_WAITING) sleep_ms(1);
    }
    EXPECT(freeBatchID(e, b) == 0, "freeBatchID after completion");
    return st.status;
}

/* Threads sharing one engine, each with its own batches, as NIXL's
 * backend is called from several threads. */
#define THREADS 8
#define ROUNDS 20
#define PIECE (64u << 10)
typedef struct worker {
    transfer_engine_t e;
    segment_id_t seg;
    uint64_t remote;
    unsigned char local[8 * PIECE];
    int bad;
    char why[160]; /* what went wrong first */
} worker;

static void worker_bad(worker *w, int bad, int round, size_t t, const struct transfer_status *st)
{
    if (w->bad) return;
    w->bad = bad;
    snprintf(w->why, sizeof w->why, "round %d, request %zu: status %d, %zu bytes", round, t,
             st ? (int)st->status : -1, st ? (size_t)st->transferred_bytes : 0);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    for (int round = 0; round < ROUNDS && !w->bad; round++) {
        memset(w->local, 0, sizeof w->local);
        batch_id_t b = allocateBatchID(w->e, 8);
        struct transfer_request r[8];
        for (int i = 0; i < 8; i++)
            r[i] = (struct transfer_request){.opcode = OPCODE_READ,
                                             .source = w->local + i * PIECE,
                                             .target_id = w->seg,
                                             .target_offset = w->remote + i * PIECE,
                                             .length = PIECE};
        /* Two submits into one batch, as NIXL's postXfer may. */
        if (submitTransfer(w->e, b, r, 3) || submitTransfer(w->e, b, r + 3, 5))
            worker_bad(w, 1, round, 0, NULL);
        for (size_t t = 0; t < 8 && !w->bad; t++) {
            struct transfer_status st = {.status = STATUS_WAITING};
            for (int i = 0; i < 20000 && st.status == STATUS_WAITING; i++)
                if (getTransferStatus(w->e, b, t, &st))
                    worker_bad(w, 2, round, t, NULL);
                else if (st.status == STATUS_WAITING)
                    sleep_ms(1);
            if (st.status != STATUS_COMPLETED || st.transferred_bytes != PIECE)
                worker_bad(w, 3, round, t, &st);
        }
        if (freeBatchID(w->e, b)) worker_bad(w, 4, round, 0, NULL);
        for (size_t i = 0; i < sizeof w->local && !w->bad; i++)
            if (w->local[i] != 0x5a) worker_bad(w, 5, round, i / PIECE, NULL);
    }
    return NULL;
}

int main(void)
{
    transfer_engine_t a = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "", 0, 1);
    transfer_engine_t b = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "", 0, 1);
    if (!a || !b) {
        printf("FAIL: createTransferEngine\n");
        return 1;
    }
    char name_a[128];
    getLocalIpAndPort(a, name_a, sizeof name_a);

    /* Transports: tcp always, others named as not supported. */
    EXPECT(installTransport(a, "tcp", NULL) != NULL, "installTransport(tcp)");
    EXPECT(installTransport(a, "nvmeof", NULL) == NULL, "installTransport(nvmeof)");
    EXPECT(uninstallTransport(a, "tcp") == 0, "uninstallTransport");
    EXPECT(removeLocalSegment(a, name_a) == -303, "removeLocalSegment: ERR_NOT_IMPLEMENTED");

    /* remote_accessible = 0 is not published: a peer cannot READ it. */
    unsigned char *priv = calloc(1, MB), *pub = malloc(MB), *mine = calloc(1, MB);
    memset(pub, 0x5a, MB);
    EXPECT(registerLocalMemory(a, priv, MB, "cpu:0", 0) == 0, "register private");
    EXPECT(registerLocalMemory(a, pub, MB, "cpu:0", 1) == 0, "register public");
    segment_id_t seg = openSegment(b, name_a);
    EXPECT(seg > 0, "openSegment");
    EXPECT(openSegment(b, name_a) == seg, "the same name, the same id");
    EXPECT(run_one(b, OPCODE_READ, mine, seg, (uintptr_t)priv, 4096, NULL) == STATUS_FAILED,
           "READ of memory registered with remote_accessible = 0");
    EXPECT(run_one(b, OPCODE_READ, mine, seg, (uintptr_t)pub, MB, NULL) == STATUS_COMPLETED,
           "READ of published memory");
    EXPECT(mine[0] == 0x5a && mine[MB - 1] == 0x5a, "READ's bytes");

    /* A failed batch sends no notification. */
    notify_msg_t note = {.name = "b", .msg = "should-not-arrive"};
    EXPECT(run_one(b, OPCODE_READ, mine, seg, (uintptr_t)priv, 4096, &note) == STATUS_FAILED,
           "READ with notify of private memory");
    sleep_ms(300);
    int n = -1;
    notify_msg_t *got = getNotifsFromEngine(a, &n);
    EXPECT(got == NULL && n == 0, "no notification after a failed batch");
    freeNotifsMsgBuf(got, n);
    EXPECT(freeNotifsMsgBuf(NULL, 0) == 0, "freeNotifsMsgBuf(NULL)");

    /* Requests refused before anything is sent. */
    batch_id_t bid = allocateBatchID(b, 4);
    struct transfer_request bad = {.opcode = OPCODE_READ,
                                   .source = mine,
                                   .target_id = 999,
                                   .target_offset = (uintptr_t)pub,
                                   .length = 16};
    EXPECT(submitTransfer(b, bid, &bad, 1) == 1, "a segment never opened");
    bad.target_id = seg;
    bad.opcode = 7;
    EXPECT(submitTransfer(b, bid, &bad, 1) == 1, "an opcode that is neither");
    struct transfer_status st;
    EXPECT(getTransferStatus(b, bid, 0, &st) == 1, "nothing was submitted");
    EXPECT(freeBatchID(b, bid) == 0, "freeBatchID of an empty batch");
    EXPECT(freeBatchID(b, bid) == 1, "freeBatchID twice");
    EXPECT(getTransferStatus(b, 424242, 0, &st) == 1, "an unknown batch");
    notify_msg_t hello = {.name = "b", .msg = "hello"};
    EXPECT(genNotifyInEngine(b, 999, hello) == -200, "genNotifyInEngine to a segment never opened");

    /* Batch registration is all or nothing. */
    unsigned char *x = malloc(2 * MB);
    buffer_entry_t list[2] = {{x, MB}, {x + 100, 10}};
    EXPECT(registerLocalMemoryBatch(a, list, 2, "cpu:0") == -7, "overlap inside the list");
    EXPECT(registerLocalMemory(a, x, MB, "cpu:0", 1) == 0, "nothing left of the failed batch");
    void *addrs[2] = {x, x + MB};
    EXPECT(unregisterLocalMemoryBatch(a, addrs, 2) == -3, "one address never registered");
    EXPECT(registerLocalMemory(a, x, MB, "cpu:0", 1) == 0, "the other was unregistered");
    EXPECT(unregisterLocalMemory(a, x) == 0, "unregister");

    /* Introspection. */
    nic_load_stat_t nics[2];
    size_t count = 2;
    EXPECT(getNicLoadStats(a, nics, &count) == 0 && count == 0, "no NICs");
    char links[512];
    EXPECT(showLinks(b, links, sizeof links, 1) == 0, "showLinks");
    EXPECT(strstr(links, name_a) && strstr(links, "\"transport\":\"tcp\""), links);
    EXPECT(syncSegmentCache(b) == 0, "syncSegmentCache");
    EXPECT(openSegmentNoCache(b, name_a) == seg, "openSegmentNoCache");

    /* Threads at once on one engine, while another registers and
     * unregisters memory of the same engine. */
    static worker workers[THREADS];
    pthread_t tids[THREADS];
    for (int i = 0; i < THREADS; i++) {
        workers[i] = (worker){.e = b, .seg = seg, .remote = (uintptr_t)pub};
        pthread_create(&tids[i], NULL, worker_main, &workers[i]);
    }
    for (int i = 0; i < 50; i++) {
        int rc = registerLocalMemory(b, x, MB, "cpu:0", 1);
        if (rc == 0) rc = unregisterLocalMemory(b, x);
        EXPECT(rc == 0, "register/unregister while transfers run");
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(tids[i], NULL);
        if (workers[i].bad)
            fprintf(stderr,
                    "thread %d: %s (bad %d: 1 submit, 2 status, 3 not completed, 4 free, "
                    "5 bytes)\n",
                    i, workers[i].why, workers[i].bad);
        EXPECT(workers[i].bad == 0, "a thread's READs");
    }

    /* Graceful shutdown: destroy waits for a WRITE still running. */
    const size_t big = 64u * MB;
    unsigned char *dst = calloc(1, big), *src = malloc(big);
    memset(src, 0x33, big);
    EXPECT(registerLocalMemory(a, dst, big, "cpu:0", 1) == 0, "register 64 MiB");
    bid = allocateBatchID(b, 1);
    struct transfer_request w = {.opcode = OPCODE_WRITE,
                                 .source = src,
                                 .target_id = seg,
                                 .target_offset = (uintptr_t)dst,
                                 .length = big};
    EXPECT(submitTransfer(b, bid, &w, 1) == 0, "submit the 64 MiB WRITE");
    enableGracefulShutdown(b);
    destroyTransferEngine(b);
    size_t at = 0;
    while (at < big && dst[at] == 0x33)
        at++;
    EXPECT(at == big, "graceful shutdown returned before the WRITE was done");

    destroyTransferEngine(a);
    free(priv);
    free(pub);
    free(mine);
    free(x);
    free(dst);
    free(src);
    if (!failed) printf("ok: kvpipe's answers\n");
    return failed;
}
