/* Internal to the shm transport: wire format and helpers shared by its target
 * side (shm_server.c) and initiator side (shm.c).
 *
 * The same-host transport moves bytes with cross-memory attach: the process
 * that owns the registered memory (the target) copies directly between its
 * memory and the initiator's with process_vm_readv/process_vm_writev, after
 * checking the request against its live region table. Requests travel over an
 * abstract Unix stream socket; no payload byte crosses a socket. See
 * docs/transport-shm.md for why.
 *
 * Wire (all integers little-endian):
 *   hello   (initiator -> target, once per connection, 24 bytes):
 *           u64 KVPI_SHM_MAGIC << 32 | KVPI_SHM_VERSION, u64 probe address,
 *           u64 probe value (the 8 bytes at the probe address)
 *   request (initiator -> target, 32 bytes):
 *           u64 remote (target) address, u64 length, u64 local (initiator)
 *           address, u8 opcode (0 READ, 1 WRITE, 2 CUDA IPC), 7 bytes zero
 *   status  (target -> initiator, 8 bytes, after the hello and each request):
 *           u64 KVPI_SHM_MAGIC << 32 | errno << 16 | kvp_status
 *   ipc     (target -> initiator, 80 bytes, after the OK status of a CUDA
 *           IPC request): u64 base, u64 size of the device allocation that
 *           holds [remote, +length), its 64-byte CUDA IPC handle
 * Integrity (common/digest.h): between two kvpipe engines that both have it
 * on, a READ's or WRITE's opcode carries KVPI_SHM_OP_DIGEST and its status
 * is followed by 8 bytes, the target's digest (little-endian; 0 after a
 * failure) of its memory, read once the copy (out for a READ, in for a
 * WRITE) has ended. The initiator digests its own side (a READ's
 * destination, a WRITE's source) once the status is in, and fails the
 * request with KVP_ECORRUPT when the two differ.
 * A CUDA IPC request (local 0) asks for the handle of registered device
 * memory, so that the initiator copies with the driver itself (shm.c); only a
 * target whose descriptor says "cuda_ipc": true is sent one. A connection
 * serves requests in order, so an initiator may send several requests before
 * reading their statuses.
 */
#ifndef KVPI_TRANSPORT_SHM_INTERNAL_H
#define KVPI_TRANSPORT_SHM_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "common/net.h"
#include "gpu/cuda.h"
#include "transport/runner.h"
#include "transport/transport.h"

#define KVPI_SHM_MAGIC 0x4B565348u /* "KVSH" */
#define KVPI_SHM_VERSION 1u
#define KVPI_SHM_HELLO_LEN 24
#define KVPI_SHM_REQ_LEN 32
#define KVPI_SHM_STATUS_LEN 8
#define KVPI_SHM_IPC_LEN (16 + KVPI_CUDA_IPC_HANDLE_LEN)
#define KVPI_SHM_OP_CUDA_IPC 2
#define KVPI_SHM_OP_DIGEST 0x40
/* The server copies a request this much at a time, and stops between two
 * copies when the initiator has closed or shut down the connection (it gave
 * the request up at its deadline); the initiator then waits up to one copy's
 * time for the server to close its end before it completes the request. */
#define KVPI_SHM_COPY_CHUNK ((size_t)4 << 20)

/* The descriptor field: {"kvpipe_shm": {"version", "host_id", "pid", "socket",
 * "cuda_ipc"}}. */
#define KVPI_SHM_FIELD "kvpipe_shm"
#define KVPI_SHM_HOST_ID_MAX 160
#define KVPI_SHM_SOCKET_MAX 100 /* fits sockaddr_un.sun_path after the NUL */

/* Identity of "this host" as far as cross-memory attach goes: the boot id
 * plus the pid and network namespaces (pids must mean the same process, and
 * the abstract socket must be reachable). */
kvp_status kvpi_shm_host_id(char *buf, size_t len);

/* Fill a sockaddr_un for the abstract name; returns the address length. */
socklen_t kvpi_shm_sockaddr(const char *name, struct sockaddr_un *sa);

/* The hello and request frames, decoded. The codecs below are pure, so that
 * they can be fuzzed (tests/fuzz/fuzz_shm_wire.c). */
typedef struct kvpi_shm_hello {
    uint64_t probe_addr;  /* in the initiator's memory */
    uint64_t probe_value; /* the 8 bytes there */
} kvpi_shm_hello;

typedef struct kvpi_shm_req {
    uint64_t remote; /* target address */
    uint64_t length;
    uint64_t local; /* initiator address */
    uint8_t opcode; /* KVP_OP_READ, KVP_OP_WRITE or KVPI_SHM_OP_CUDA_IPC */
    int digest;     /* KVPI_SHM_OP_DIGEST: a digest follows the status (READ and WRITE) */
} kvpi_shm_req;

/* The answer to a CUDA IPC request. */
typedef struct kvpi_shm_ipc {
    uint64_t base, size;
    unsigned char handle[KVPI_CUDA_IPC_HANDLE_LEN];
} kvpi_shm_ipc;

static inline void kvpi_shm_hello_encode(const kvpi_shm_hello *h, uint8_t out[KVPI_SHM_HELLO_LEN])
{
    kvpi_put_le64(out, (uint64_t)KVPI_SHM_MAGIC << 32 | KVPI_SHM_VERSION);
    kvpi_put_le64(out + 8, h->probe_addr);
    kvpi_put_le64(out + 16, h->probe_value);
}

/* Returns 0, or -1 when the magic or the version is not ours. */
static inline int kvpi_shm_hello_decode(const uint8_t in[KVPI_SHM_HELLO_LEN], kvpi_shm_hello *h)
{
    if (kvpi_get_le64(in) != ((uint64_t)KVPI_SHM_MAGIC << 32 | KVPI_SHM_VERSION)) return -1;
    h->probe_addr = kvpi_get_le64(in + 8);
    h->probe_value = kvpi_get_le64(in + 16);
    return 0;
}

static inline void kvpi_shm_req_encode(const kvpi_shm_req *r, uint8_t out[KVPI_SHM_REQ_LEN])
{
    memset(out, 0, KVPI_SHM_REQ_LEN);
    kvpi_put_le64(out, r->remote);
    kvpi_put_le64(out + 8, r->length);
    kvpi_put_le64(out + 16, r->local);
    out[24] = (uint8_t)(r->opcode | (r->digest ? KVPI_SHM_OP_DIGEST : 0));
}

/* Fills *r; returns 0, or -1 for an unknown opcode. The padding is ignored. */
static inline int kvpi_shm_req_decode(const uint8_t in[KVPI_SHM_REQ_LEN], kvpi_shm_req *r)
{
    r->remote = kvpi_get_le64(in);
    r->length = kvpi_get_le64(in + 8);
    r->local = kvpi_get_le64(in + 16);
    r->digest = (in[24] & KVPI_SHM_OP_DIGEST) != 0;
    r->opcode = in[24] & (uint8_t)~KVPI_SHM_OP_DIGEST;
    if (r->digest) return r->opcode <= KVP_OP_WRITE ? 0 : -1;
    return r->opcode <= KVP_OP_WRITE || r->opcode == KVPI_SHM_OP_CUDA_IPC ? 0 : -1;
}

static inline void kvpi_shm_ipc_encode(const kvpi_shm_ipc *m, uint8_t out[KVPI_SHM_IPC_LEN])
{
    kvpi_put_le64(out, m->base);
    kvpi_put_le64(out + 8, m->size);
    memcpy(out + 16, m->handle, KVPI_CUDA_IPC_HANDLE_LEN);
}

static inline void kvpi_shm_ipc_decode(const uint8_t in[KVPI_SHM_IPC_LEN], kvpi_shm_ipc *m)
{
    m->base = kvpi_get_le64(in);
    m->size = kvpi_get_le64(in + 8);
    memcpy(m->handle, in + 16, KVPI_CUDA_IPC_HANDLE_LEN);
}

/* Encode / decode a status frame. Decoding fails (KVP_EPROTO) on a bad magic. */
void kvpi_shm_put_status(uint8_t *p, kvp_status st, int err);
kvp_status kvpi_shm_get_status(const uint8_t *p, kvp_status *st, int *err);

/* Target side (shm_server.c), called through the ops table in shm.c. */
kvp_status kvpi_shm_server_start(const kvpi_server_ctx *ctx, void **server);
kvp_status kvpi_shm_server_describe(void *server, cJSON *desc);
void kvpi_shm_server_stop(void *server);
/* The server's runner, for its peers' transfers (NULL server: NULL). */
kvpi_runner *kvpi_shm_server_runner(void *server);

#endif
