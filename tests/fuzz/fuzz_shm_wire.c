/* The shm transport's frames (src/transport/shm_internal.h): the hello and the
 * requests a local initiator sends the target's socket, and the status frames
 * the target sends back. Input: the registered regions (regions.h), a 24-byte
 * hello, an 8-byte status frame, then 32-byte requests to the end.
 * Invariants: a hello decodes iff its magic and version are ours; a request
 * iff its opcode is READ, WRITE or CUDA IPC, and encodes back to the same bytes with the
 * padding zeroed; a non-empty request passes the target's range check iff it
 * lies in one region of a kind the server moves (regions.h); a status decodes
 * iff its magic is right and its code is a final one (at most 64, not
 * KVP_EINPROGRESS), and encodes back to the same bytes. */
#include "common/net.h"
#include "fuzz.h"
#include "regions.h"
#include "transport/shm_internal.h"

static void check_hello(const uint8_t raw[KVPI_SHM_HELLO_LEN])
{
    kvpi_shm_hello h;
    int ok = kvpi_shm_hello_decode(raw, &h) == 0;
    FUZZ_CHECK(ok == (kvpi_get_le64(raw) == ((uint64_t)KVPI_SHM_MAGIC << 32 | KVPI_SHM_VERSION)));
    if (!ok) return;
    uint8_t again[KVPI_SHM_HELLO_LEN];
    kvpi_shm_hello_encode(&h, again);
    FUZZ_CHECK(memcmp(again, raw, sizeof again) == 0);
}

static void check_status(const uint8_t raw[KVPI_SHM_STATUS_LEN])
{
    uint64_t v = kvpi_get_le64(raw);
    kvp_status st = KVP_OK;
    int err = 0;
    kvp_status rc = kvpi_shm_get_status(raw, &st, &err);
    int want = v >> 32 == KVPI_SHM_MAGIC && (v & 0xffff) <= 64 && (v & 0xffff) != KVP_EINPROGRESS;
    FUZZ_CHECK((rc == KVP_OK) == want);
    if (rc) {
        FUZZ_CHECK(rc == KVP_EPROTO);
        return;
    }
    FUZZ_CHECK(kvp_strerror(st) != NULL && err >= 0 && err <= 0xffff);
    uint8_t again[KVPI_SHM_STATUS_LEN];
    kvpi_shm_put_status(again, st, err);
    FUZZ_CHECK(memcmp(again, raw, sizeof again) == 0);
}

static void check_request(kvpf_regions *regions, const uint8_t raw[KVPI_SHM_REQ_LEN])
{
    kvpi_shm_req r;
    int ok = kvpi_shm_req_decode(raw, &r) == 0;
    /* The opcode byte: integrity's digest flag, then the op; a CUDA IPC
     * request carries no digest. */
    int digest = (raw[24] & KVPI_SHM_OP_DIGEST) != 0;
    uint8_t op = raw[24] & (uint8_t)~KVPI_SHM_OP_DIGEST;
    int rw = op == KVP_OP_READ || op == KVP_OP_WRITE;
    FUZZ_CHECK(ok == (rw || (!digest && op == KVPI_SHM_OP_CUDA_IPC)));
    FUZZ_CHECK(r.opcode == op && r.digest == digest);
    if (!ok) return;
    uint8_t again[KVPI_SHM_REQ_LEN];
    kvpi_shm_req_encode(&r, again);
    kvpf_check_again(again, raw, 25, KVPI_SHM_REQ_LEN);
    if (r.length) kvpf_regions_check_pin(regions, r.remote, r.length);
}

KVPF_QUIET_INITIALIZE

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvpf_reader in = {data, size};
    kvpf_regions regions;
    kvpf_regions_build(&regions, &in);
    uint8_t hello[KVPI_SHM_HELLO_LEN], status[KVPI_SHM_STATUS_LEN];
    kvpf_take_bytes(&in, hello, sizeof hello);
    kvpf_take_bytes(&in, status, sizeof status);
    check_hello(hello);
    check_status(status);
    while (in.left >= KVPI_SHM_REQ_LEN) {
        check_request(&regions, in.p);
        in.p += KVPI_SHM_REQ_LEN;
        in.left -= KVPI_SHM_REQ_LEN;
    }
    kvpf_regions_free(&regions);
    return 0;
}
