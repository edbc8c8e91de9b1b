/* The P2P handshake frame (src/metadata/p2p.c): u64 LE length | u8 type | JSON,
 * read by the handshake server from any client and by an initiator from the
 * peer it asks. The input is the byte stream as it arrives; it is checked the
 * way serve_recv and call_on do (the length word first, then the type byte), and the
 * JSON of a complete METADATA frame goes on to the descriptor parser, as a
 * reply does in kvpi_meta_fetch. Invariants: the length word is accepted iff
 * it is in 1..1 MiB, the type iff it is 0..3, and encoding the decoded header
 * gives the same 9 bytes. */
#include "common/net.h"
#include "engine/descriptor.h"
#include "fuzz.h"
#include "metadata/metadata.h"

KVPF_QUIET_INITIALIZE

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 8) return 0;
    uint64_t len = kvpi_get_le64(data);
    int type = -2;
    size_t n = 0;
    kvp_status st = kvpi_rpc_frame_decode(data, 8, &type, &n);
    FUZZ_CHECK((st == KVP_OK) == (len >= 1 && len <= KVPI_RPC_MAX_FRAME));
    if (st) return 0;
    FUZZ_CHECK(type == -1 && n == len - 1);
    if (size < KVPI_RPC_HDR_LEN) return 0;
    st = kvpi_rpc_frame_decode(data, size, &type, &n);
    FUZZ_CHECK((st == KVP_OK) == (data[8] <= KVPI_RPC_PROBE));
    if (st) return 0;
    FUZZ_CHECK(type == data[8] && n == len - 1);
    uint8_t hdr[KVPI_RPC_HDR_LEN];
    kvpi_rpc_frame_header(type, n, hdr);
    FUZZ_CHECK(memcmp(hdr, data, sizeof hdr) == 0);
    if (size - KVPI_RPC_HDR_LEN < n || type != KVPI_RPC_METADATA) return 0;

    /* As serve_recv and call_on hand it on: NUL-terminated text. */
    char *json = malloc(n + 1);
    FUZZ_CHECK(json);
    memcpy(json, data + KVPI_RPC_HDR_LEN, n);
    json[n] = '\0';
    kvpi_descriptor d;
    if (kvpi_descriptor_parse(json, &d) == KVP_OK) {
        for (size_t i = 1; i < d.n_regions; i++)
            FUZZ_CHECK(d.regions[i - 1].addr + d.regions[i - 1].length <= d.regions[i].addr);
        kvpi_descriptor_free(&d);
    }
    free(json);
    return 0;
}
