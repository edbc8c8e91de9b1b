/* Internal: Mooncake's TCP data-plane framing.
 *
 * Request header, 24 bytes little-endian: u64 size, u64 addr, u8 opcode, 7 pad.
 * Opcode 0 READ (server streams size bytes from addr), 1 WRITE (client streams
 * size bytes to addr). Protocol v2 sets bit 0x80: the server then sends an
 * 8-byte status frame (magic in the high 32 bits, code in the low 32) before
 * READ data and after a WRITE is applied; code 1 means the range was rejected.
 *
 * kvpipe's integrity (common/digest.h), with v2 between two kvpipe engines
 * that both have it on (their descriptors say "kvpipe_integrity"), sets bit
 * 0x40 too: the side that sends the payload follows it with its 8-byte
 * digest (little-endian), taken once it sent it; a READ's client and
 * a WRITE's server compare it with the digest of what arrived. A WRITE
 * whose digests differ is answered with status code 2 (the bytes landed, the
 * request failed); a READ's client fails the request itself. Mooncake never
 * sets the bit, and an older kvpipe is never sent it (it closes the
 * connection on an unknown opcode).
 */
#ifndef KVPI_TRANSPORT_TCP_WIRE_H
#define KVPI_TRANSPORT_TCP_WIRE_H

#include <stdint.h>
#include <string.h>

#include "common/net.h"

/* The descriptor fields (top level): "tcp_data_port" (the data port) and
 * "tcp_proto_version" (absent: 1, Mooncake before the status frames). */
#define KVPI_TCP_PROTO_VERSION 2

#define KVPI_TCP_HDR_LEN 24
#define KVPI_TCP_OP_READ 0
#define KVPI_TCP_OP_WRITE 1
#define KVPI_TCP_OP_V2 0x80
#define KVPI_TCP_OP_DIGEST 0x40
#define KVPI_TCP_STATUS_MAGIC 0x4D435456u
#define KVPI_TCP_STATUS_OK 0
#define KVPI_TCP_STATUS_REJECTED 1
#define KVPI_TCP_STATUS_CORRUPT 2

typedef struct kvpi_tcp_hdr {
    uint64_t size;
    uint64_t addr;
    uint8_t opcode; /* without the v2 and digest bits */
    int v2;
    int digest; /* a digest follows the payload (v2 only) */
} kvpi_tcp_hdr;

static inline void kvpi_tcp_hdr_encode(const kvpi_tcp_hdr *h, uint8_t out[KVPI_TCP_HDR_LEN])
{
    memset(out, 0, KVPI_TCP_HDR_LEN);
    kvpi_put_le64(out, h->size);
    kvpi_put_le64(out + 8, h->addr);
    out[16] = (uint8_t)(h->opcode | (h->v2 ? KVPI_TCP_OP_V2 : 0) |
                        (h->v2 && h->digest ? KVPI_TCP_OP_DIGEST : 0));
}

/* Returns 0, or -1 for an unknown opcode (the digest bit without v2 among
 * them). Padding bytes are ignored. */
static inline int kvpi_tcp_hdr_decode(const uint8_t in[KVPI_TCP_HDR_LEN], kvpi_tcp_hdr *h)
{
    h->size = kvpi_get_le64(in);
    h->addr = kvpi_get_le64(in + 8);
    h->v2 = (in[16] & KVPI_TCP_OP_V2) != 0;
    h->digest = (in[16] & KVPI_TCP_OP_DIGEST) != 0;
    h->opcode = in[16] & (uint8_t) ~(KVPI_TCP_OP_V2 | KVPI_TCP_OP_DIGEST);
    if (h->digest && !h->v2) return -1;
    return h->opcode == KVPI_TCP_OP_READ || h->opcode == KVPI_TCP_OP_WRITE ? 0 : -1;
}

static inline void kvpi_tcp_status_encode(uint32_t code, uint8_t out[8])
{
    kvpi_put_le64(out, ((uint64_t)KVPI_TCP_STATUS_MAGIC << 32) | code);
}

/* Returns the code, or -1 when the magic is wrong. */
static inline int64_t kvpi_tcp_status_decode(const uint8_t in[8])
{
    uint64_t v = kvpi_get_le64(in);
    if ((v >> 32) != KVPI_TCP_STATUS_MAGIC) return -1;
    return (int64_t)(v & 0xffffffffu);
}

#endif
