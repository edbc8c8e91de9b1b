/* The TCP data plane's request header and status frame (src/transport/tcp_wire.h)
 * and the range check the server applies to every request (kvpi_region_pin:
 * "inside one registered buffer of a kind it moves", regions.h).
 *
 * Input: the registered regions (regions.h), an 8-byte status frame, then
 * 24-byte request headers to the end. Invariants: a header decodes iff its
 * opcode (less the v2 bit) is READ or WRITE, and encodes back to the same
 * bytes with the padding zeroed; a non-empty request is served iff it lies in
 * one region of a kind the server moves; a status frame decodes iff its magic is right,
 * and encodes back to the same bytes. */
#include "common/net.h"
#include "fuzz.h"
#include "regions.h"
#include "transport/tcp_wire.h"

static void check_status(const uint8_t frame[8])
{
    int64_t code = kvpi_tcp_status_decode(frame);
    uint64_t v = kvpi_get_le64(frame);
    FUZZ_CHECK((code < 0) == ((v >> 32) != KVPI_TCP_STATUS_MAGIC));
    if (code < 0) return;
    FUZZ_CHECK(code <= UINT32_MAX);
    uint8_t again[8];
    kvpi_tcp_status_encode((uint32_t)code, again);
    FUZZ_CHECK(memcmp(again, frame, 8) == 0);
}

static void check_header(kvpf_regions *regions, const uint8_t raw[KVPI_TCP_HDR_LEN])
{
    kvpi_tcp_hdr h;
    int rc = kvpi_tcp_hdr_decode(raw, &h);
    /* The opcode byte: v2 (0x80), integrity's digest (0x40, v2 only), the op. */
    uint8_t op = raw[16] & (uint8_t) ~(KVPI_TCP_OP_V2 | KVPI_TCP_OP_DIGEST);
    int v2 = (raw[16] & KVPI_TCP_OP_V2) != 0, digest = (raw[16] & KVPI_TCP_OP_DIGEST) != 0;
    FUZZ_CHECK((rc == 0) ==
               ((op == KVPI_TCP_OP_READ || op == KVPI_TCP_OP_WRITE) && (v2 || !digest)));
    if (rc != 0) return;
    FUZZ_CHECK(h.size == kvpi_get_le64(raw) && h.addr == kvpi_get_le64(raw + 8));
    FUZZ_CHECK(h.v2 == v2 && h.digest == digest && h.opcode == op);
    uint8_t again[KVPI_TCP_HDR_LEN];
    kvpi_tcp_hdr_encode(&h, again);
    kvpf_check_again(again, raw, 17, KVPI_TCP_HDR_LEN);
    /* serve_request answers an empty request without looking at the registry. */
    if (h.size) kvpf_regions_check_pin(regions, h.addr, h.size);
}

KVPF_QUIET_INITIALIZE

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvpf_reader in = {data, size};
    kvpf_regions regions;
    kvpf_regions_build(&regions, &in);
    uint8_t frame[8];
    kvpf_take_bytes(&in, frame, sizeof frame);
    check_status(frame);
    while (in.left >= KVPI_TCP_HDR_LEN) {
        check_header(&regions, in.p);
        in.p += KVPI_TCP_HDR_LEN;
        in.left -= KVPI_TCP_HDR_LEN;
    }
    kvpf_regions_free(&regions);
    return 0;
}
