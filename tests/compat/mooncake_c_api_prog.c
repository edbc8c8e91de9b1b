/* A program written against Mooncake Transfer Engine's C API alone
 * (transfer_engine_c.h, and the error values of Mooncake's error.h), the way
 * NIXL's Mooncake plugin drives it. It builds unchanged against Mooncake's
 * header and libtransfer_engine, or kvpipe's (libkvpipe_mooncake); the two
 * roles run in separate processes and may be built against either:
 *
 *   mooncake_c_api_prog target    METADATA HOST INFO_FILE
 *   mooncake_c_api_prog initiator METADATA HOST INFO_FILE
 *
 * HOST is the engine's local_server_name: an address over P2PHANDSHAKE;
 * with a metadata store a name of its own, host:port, each role another.
 *
 * The target registers a buffer (first half a known pattern, second half
 * zero), writes "<segment name> <buffer address>" to INFO_FILE, and waits for
 * the notification "written": at that moment the second half must hold the
 * initiator's pattern. It answers with genNotifyInEngine ("target", "ack").
 * The initiator READs the first half and checks it, WRITEs the second half
 * with submitTransferWithNotify, waits for the ack, and checks Mooncake's
 * error codes on the way. Each prints "ok" and exits 0, or "FAIL: ..." and 1.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <transfer_engine_c.h>

/* Mooncake's error.h (not part of transfer_engine_c.h). */
#define MC_ERR_INVALID_ARGUMENT (-1)
#define MC_ERR_ADDRESS_NOT_REGISTERED (-3)
#define MC_ERR_ADDRESS_OVERLAPPED (-7)
/* Mooncake's Status codes, as submitTransfer and getTransferStatus return. */
#define MC_STATUS_INVALID_ARGUMENT 1
#define MC_STATUS_TOO_MANY_REQUESTS 2

#define HALF (8u << 20)
#define PIECES 4

static int failed;

#define EXPECT(cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL: %s:%d: %s: ", role, __LINE__, #cond);                                    \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
            fflush(stdout);                                                                        \
            failed = 1;                                                                            \
        }                                                                                          \
    } while (0)

static const char *role = "?";

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)((i * 31u + seed * 7u + (i >> 9)) & 0xff);
}

/* Index of the first byte that differs from the pattern, or n. */
static size_t check(const unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)((i * 31u + seed * 7u + (i >> 9)) & 0xff)) return i;
    return n;
}

/* Poll every task of a batch until none is WAITING or PENDING (20 s at most);
 * the number of tasks that ended other than want. */
static size_t wait_batch(transfer_engine_t e, batch_id_t b, size_t n, int want, uint64_t each)
{
    size_t bad = 0;
    for (size_t t = 0; t < n; t++) {
        struct transfer_status st = {0};
        int rc = 0;
        for (int waited = 0; waited < 20000; waited++) {
            rc = getTransferStatus(e, b, t, &st);
            if (rc || (st.status != STATUS_WAITING && st.status != STATUS_PENDING)) break;
            sleep_ms(1);
        }
        EXPECT(rc == 0, "getTransferStatus(task %zu) = %d", t, rc);
        EXPECT(st.status == want, "task %zu ended with status %d, want %d", t, st.status, want);
        if (rc || st.status != want) bad++;
        if (want == STATUS_COMPLETED)
            EXPECT(st.transferred_bytes == each, "task %zu: transferred_bytes %llu, want %llu", t,
                   (unsigned long long)st.transferred_bytes, (unsigned long long)each);
    }
    return bad;
}

/* Wait (20 s at most) for a notification whose msg is want; 1 if it came,
 * with its name copied to name_out. */
static int wait_notify(transfer_engine_t e, const char *want, char *name_out, size_t cap)
{
    for (int waited = 0; waited < 20000; waited += 2) {
        int n = 0;
        notify_msg_t *list = getNotifsFromEngine(e, &n);
        int found = 0;
        for (int i = 0; i < n; i++)
            if (strcmp(list[i].msg, want) == 0) {
                snprintf(name_out, cap, "%s", list[i].name);
                found = 1;
            }
        freeNotifsMsgBuf(list, n);
        if (found) return 1;
        sleep_ms(2);
    }
    return 0;
}

static transfer_engine_t start_engine(const char *metadata, const char *host)
{
    transfer_engine_t e = createTransferEngine(metadata, host, host, 0, 1);
    EXPECT(e != NULL, "createTransferEngine(%s, %s)", metadata, host);
    if (e) EXPECT(installTransport(e, "tcp", NULL) != NULL, "installTransport(tcp)");
    return e;
}

/* The name peers open this engine's segment by. Over P2PHANDSHAKE it is the
 * handshake's host:port, which getLocalIpAndPort gives; with a metadata
 * store it is the local_server_name the engine was created with (HOST, then
 * host:port), while Mooncake's getLocalIpAndPort gives its RPC address. */
static void own_name(transfer_engine_t e, const char *metadata, const char *host, char *out,
                     size_t cap)
{
    EXPECT(getLocalIpAndPort(e, out, cap) == 0, "getLocalIpAndPort");
    if (strcmp(metadata, "P2PHANDSHAKE") != 0) snprintf(out, cap, "%s", host);
}

static int run_target(const char *metadata, const char *host, const char *info)
{
    transfer_engine_t e = start_engine(metadata, host);
    if (!e) return 1;
    unsigned char *buf = calloc(1, 2 * HALF);
    fill(buf, HALF, 1);
    EXPECT(registerLocalMemory(e, buf, 2 * HALF, "cpu:0", 1) == 0, "registerLocalMemory");
    EXPECT(registerLocalMemory(e, buf + 64, 128, "cpu:0", 1) == MC_ERR_ADDRESS_OVERLAPPED,
           "an overlapping region");

    char name[256];
    own_name(e, metadata, host, name, sizeof name);
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s.tmp", info);
    FILE *f = fopen(tmp, "w");
    if (!f) return 1;
    fprintf(f, "%s %llu\n", name, (unsigned long long)(uintptr_t)buf);
    fclose(f);
    rename(tmp, info);

    char peer[256];
    int got = wait_notify(e, "written", peer, sizeof peer);
    EXPECT(got, "no notification \"written\" within 20 s");
    if (got) {
        /* The data the notification follows is in place when it arrives. */
        size_t at = check(buf + HALF, HALF, 2);
        EXPECT(at == HALF, "notification before the data: byte %zu of the WRITE is wrong", at);
        EXPECT(check(buf, HALF, 1) == HALF, "the first half changed");
        segment_id_t seg = openSegment(e, peer);
        EXPECT(seg >= 0, "openSegment(%s) of the notifier = %d", peer, (int)seg);
        notify_msg_t ack = {.name = "target", .msg = "ack"};
        if (seg >= 0) EXPECT(genNotifyInEngine(e, (uint64_t)seg, ack) == 0, "genNotifyInEngine");
    }
    /* Let the initiator take the ack before this segment goes. */
    sleep_ms(500);
    EXPECT(unregisterLocalMemory(e, buf) == 0, "unregisterLocalMemory");
    destroyTransferEngine(e);
    free(buf);
    return failed;
}

static void check_errors(transfer_engine_t e, segment_id_t seg, uint64_t remote,
                         unsigned char *local)
{
    /* Mooncake's codes for what a caller gets wrong. */
    EXPECT(openSegment(e, "127.0.0.1:1") == MC_ERR_INVALID_ARGUMENT, "an unknown segment");
    EXPECT(openSegment(e, "") == MC_ERR_INVALID_ARGUMENT, "an empty segment name");
    EXPECT(unregisterLocalMemory(e, local + 4096) == MC_ERR_ADDRESS_NOT_REGISTERED,
           "unregistering memory never registered");
    EXPECT(registerLocalMemory(e, local, 0, "cpu:0", 1) == MC_ERR_INVALID_ARGUMENT,
           "a zero-length region");
    EXPECT(registerLocalMemory(e, local + 100, 10, "cpu:0", 1) == MC_ERR_ADDRESS_OVERLAPPED,
           "an overlapping region");

    batch_id_t b = allocateBatchID(e, 2);
    EXPECT(b != INVALID_BATCH, "allocateBatchID");
    struct transfer_request r[3];
    for (int i = 0; i < 3; i++)
        r[i] = (struct transfer_request){.opcode = OPCODE_READ,
                                         .source = local + i * 4096,
                                         .target_id = seg,
                                         .target_offset = remote + i * 4096,
                                         .length = 4096};
    EXPECT(submitTransfer(e, b, r, 3) == MC_STATUS_TOO_MANY_REQUESTS, "3 requests in a batch of 2");
    notify_msg_t none = {.name = "x", .msg = "y"};
    EXPECT(submitTransferWithNotify(e, b, r, 0, none) == MC_STATUS_INVALID_ARGUMENT,
           "a notify with no request");
    /* A range past the peer's buffer fails the task, not the submit. */
    r[0].target_offset = remote + 2 * HALF;
    EXPECT(submitTransfer(e, b, r, 1) == 0, "submitTransfer out of range");
    wait_batch(e, b, 1, STATUS_FAILED, 0);
    struct transfer_status st;
    EXPECT(getTransferStatus(e, b, 1, &st) == MC_STATUS_INVALID_ARGUMENT, "a task never submitted");
    EXPECT(freeBatchID(e, b) == 0, "freeBatchID");
}

static int run_initiator(const char *metadata, const char *host, const char *info)
{
    char target[256] = "";
    unsigned long long remote = 0;
    for (int waited = 0; waited < 20000 && !remote; waited += 10) {
        FILE *f = fopen(info, "r");
        if (f) {
            if (fscanf(f, "%255s %llu", target, &remote) != 2) remote = 0;
            fclose(f);
        }
        if (!remote) sleep_ms(10);
    }
    EXPECT(remote != 0, "no target info in %s", info);
    if (!remote) return 1;
    transfer_engine_t e = start_engine(metadata, host);
    if (!e) return 1;
    unsigned char *local = calloc(1, 2 * HALF);
    EXPECT(registerLocalMemory(e, local, 2 * HALF, "cpu:0", 1) == 0, "registerLocalMemory");
    segment_id_t seg = openSegment(e, target);
    EXPECT(seg >= 0, "openSegment(%s) = %d", target, (int)seg);
    if (seg < 0) return 1;

    /* READ the first half in PIECES requests. */
    batch_id_t b = allocateBatchID(e, 16);
    struct transfer_request r[PIECES];
    const uint64_t piece = HALF / PIECES;
    for (int i = 0; i < PIECES; i++)
        r[i] = (struct transfer_request){.opcode = OPCODE_READ,
                                         .source = local + i * piece,
                                         .target_id = seg,
                                         .target_offset = remote + i * piece,
                                         .length = piece};
    EXPECT(submitTransfer(e, b, r, PIECES) == 0, "submitTransfer(READ)");
    wait_batch(e, b, PIECES, STATUS_COMPLETED, piece);
    size_t at = check(local, HALF, 1);
    EXPECT(at == HALF, "READ: byte %zu differs from the target's", at);
    EXPECT(freeBatchID(e, b) == 0, "freeBatchID");

    check_errors(e, seg, remote, local);

    /* WRITE the second half, then the notification (sent by the status poll
     * that sees the whole batch completed). */
    char me[256];
    own_name(e, metadata, host, me, sizeof me);
    fill(local + HALF, HALF, 2);
    b = allocateBatchID(e, 16);
    for (int i = 0; i < PIECES; i++)
        r[i] = (struct transfer_request){.opcode = OPCODE_WRITE,
                                         .source = local + HALF + i * piece,
                                         .target_id = seg,
                                         .target_offset = remote + HALF + i * piece,
                                         .length = piece};
    notify_msg_t note = {.name = me, .msg = "written"};
    EXPECT(submitTransferWithNotify(e, b, r, PIECES, note) == 0, "submitTransferWithNotify");
    wait_batch(e, b, PIECES, STATUS_COMPLETED, piece);
    EXPECT(freeBatchID(e, b) == 0, "freeBatchID");

    /* LOCAL_SEGMENT: this engine's own registered memory as the target. */
    unsigned char *scratch = malloc(piece);
    fill(scratch, piece, 3);
    b = allocateBatchID(e, 1);
    r[0] = (struct transfer_request){.opcode = OPCODE_WRITE,
                                     .source = scratch,
                                     .target_id = LOCAL_SEGMENT,
                                     .target_offset = (uint64_t)(uintptr_t)local,
                                     .length = piece};
    EXPECT(submitTransfer(e, b, r, 1) == 0, "submitTransfer(LOCAL_SEGMENT)");
    wait_batch(e, b, 1, STATUS_COMPLETED, piece);
    EXPECT(check(local, piece, 3) == piece, "LOCAL_SEGMENT: the WRITE did not land");
    EXPECT(freeBatchID(e, b) == 0, "freeBatchID");
    free(scratch);

    char from[256];
    EXPECT(wait_notify(e, "ack", from, sizeof from), "no \"ack\" from the target within 20 s");
    EXPECT(strcmp(from, "target") == 0, "the ack's name is %s", from);

    EXPECT(unregisterLocalMemory(e, local) == 0, "unregisterLocalMemory");
    EXPECT(unregisterLocalMemory(e, local) == MC_ERR_ADDRESS_NOT_REGISTERED, "a second unregister");
    destroyTransferEngine(e);
    free(local);
    return failed;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s target|initiator METADATA HOST INFO_FILE\n", argv[0]);
        return 2;
    }
    role = argv[1];
    int rc;
    if (strcmp(role, "target") == 0)
        rc = run_target(argv[2], argv[3], argv[4]);
    else if (strcmp(role, "initiator") == 0)
        rc = run_initiator(argv[2], argv[3], argv[4]);
    else
        return 2;
    if (!rc && !failed) printf("ok: %s\n", role);
    return rc || failed;
}
