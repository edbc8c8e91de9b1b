/* Mooncake Transfer Engine's C API, served by kvpipe (libkvpipe_mooncake).
 *
 * A program written against Mooncake's transfer_engine_c.h (NIXL's Mooncake
 * plugin, for one) builds unchanged against this header and runs on kvpipe:
 * the names, signatures, types and constants are Mooncake's (as of
 * kvcache-ai/Mooncake 3b5a594), the implementation is kvpipe's public engine
 * API (include/kvpipe/engine.h). docs/mooncake-c-api.md says, function by
 * function, what kvpipe does, and which calls it cannot honour.
 *
 * Return conventions, as Mooncake's:
 *  - functions returning int that are not listed below: 0 on success, a
 *    negative Mooncake error (ERR_INVALID_ARGUMENT -1,
 *    ERR_ADDRESS_NOT_REGISTERED -3, ERR_ADDRESS_OVERLAPPED -7, ERR_SOCKET
 *    -102, ERR_METADATA -200, ERR_MEMORY -302, ERR_NOT_IMPLEMENTED -303, ...;
 *    the values of Mooncake's error.h);
 *  - submitTransfer, submitTransferWithNotify, getTransferStatus and
 *    freeBatchID: 0, or a positive Mooncake Status code (1 invalid argument,
 *    2 too many requests, 4 batch busy, 999 not implemented, ...);
 *  - openSegment: a segment id >= 0, or -1;
 *  - createTransferEngine and installTransport: NULL on failure;
 *  - allocateBatchID: INVALID_BATCH on failure.
 * Strings passed in are copied; the caller may free them once a call returns.
 * Every function may be called from several threads at once, except
 * destroyTransferEngine, which must be the engine's last call.
 */
#ifndef TRANSFER_ENGINE_C
#define TRANSFER_ENGINE_C

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Mooncake spells these types as macros; callers may rely on that. */
#define segment_handle_t int32_t
#define segment_id_t int32_t
#define batch_id_t uint64_t

/* target_id of a request that addresses this engine's own segment. */
#define LOCAL_SEGMENT (0)
/* What allocateBatchID returns when it fails. */
#define INVALID_BATCH UINT64_MAX

#define OPCODE_READ (0)  /* target segment -> source */
#define OPCODE_WRITE (1) /* source -> target segment */

/* One request of a batch: length bytes between local memory at source and
 * the address target_offset inside a registered buffer of segment target_id
 * (an address, as the peer registered it, not an offset from its start). */
struct transfer_request {
    int opcode;
    void *source;
    segment_id_t target_id;
    uint64_t target_offset;
    uint64_t length;
};
typedef struct transfer_request transfer_request_t;

/* A notification: two NUL-terminated strings. */
struct notify_msg {
    char *name;
    char *msg;
};
typedef struct notify_msg notify_msg_t;

/* transfer_status.status */
#define STATUS_WAITING (0)
#define STATUS_PENDING (1)
#define STATUS_INVALID (2)
#define STATUS_CANCELED (3)
#define STATUS_COMPLETED (4)
#define STATUS_TIMEOUT (5)
#define STATUS_FAILED (6)

struct transfer_status {
    int status;
    uint64_t transferred_bytes;
};
typedef struct transfer_status transfer_status_t;

/* Mooncake's description of a segment (RDMA or NVMe-oF); part of its
 * header, used by no function here. */
struct segment_desc {
    int type;
    union {
        struct {
            void *addr;
            uint64_t size;
            const char *location;
        } rdma;
        struct {
            const char *file_path;
            const char *subsystem_name;
            const char *proto;
            const char *ip;
            uint64_t port;
        } nvmeof;
    } desc_;
};
typedef struct segment_desc segment_desc_t;

struct buffer_entry {
    void *addr;
    size_t length;
};
typedef struct buffer_entry buffer_entry_t;

typedef void *transfer_engine_t;
typedef void *transport_t;

/* Create an engine named local_server_name ("host" or "host:port") that
 * publishes its segment in metadata_conn_string ("P2PHANDSHAKE",
 * "http://h:p/metadata", "etcd://h:p", "redis://h:p"). A bare host gets a
 * free port; getLocalIpAndPort tells the name peers open. ip_or_host_name
 * and rpc_port are ignored, as Mooncake ignores them outside its legacy
 * binding. NULL on failure (the reason is logged). */
transfer_engine_t createTransferEngine(const char *metadata_conn_string,
                                       const char *local_server_name, const char *ip_or_host_name,
                                       uint64_t rpc_port, int auto_discover);

int discoverTopology(transfer_engine_t engine);

/* "host:port" of the engine's handshake port (its segment name), written
 * into buf_out (truncated to buf_len). */
int getLocalIpAndPort(transfer_engine_t engine, char *buf_out, size_t buf_len);

transport_t installTransport(transfer_engine_t engine, const char *proto, void **args);

int uninstallTransport(transfer_engine_t engine, const char *proto);

segment_id_t openSegment(transfer_engine_t engine, const char *segment_name);

segment_id_t openSegmentNoCache(transfer_engine_t engine, const char *segment_name);

int closeSegment(transfer_engine_t engine, segment_id_t segment_id);

int warmupEfaSegment(transfer_engine_t engine, const char *segment_name);

int removeLocalSegment(transfer_engine_t engine, const char *segment_name);

void destroyTransferEngine(transfer_engine_t engine);

int registerLocalMemory(transfer_engine_t engine, void *addr, size_t length, const char *location,
                        int remote_accessible);

int unregisterLocalMemory(transfer_engine_t engine, void *addr);

int registerLocalMemoryBatch(transfer_engine_t engine, buffer_entry_t *buffer_list,
                             size_t buffer_len, const char *location);

int unregisterLocalMemoryBatch(transfer_engine_t engine, void **addr_list, size_t addr_len);

batch_id_t allocateBatchID(transfer_engine_t engine, size_t batch_size);

int submitTransfer(transfer_engine_t engine, batch_id_t batch_id, struct transfer_request *entries,
                   size_t count);

int submitTransferWithNotify(transfer_engine_t engine, batch_id_t batch_id,
                             struct transfer_request *entries, size_t count,
                             notify_msg_t notify_msg);

/* The notifications received and not yet taken: a malloc'ed array of *size
 * entries (NULL and 0 when there are none) that freeNotifsMsgBuf frees. */
notify_msg_t *getNotifsFromEngine(transfer_engine_t engine, int *size);

int freeNotifsMsgBuf(notify_msg_t *msg, int size);

int genNotifyInEngine(transfer_engine_t engine, uint64_t target_id, notify_msg_t notify_msg);

int getTransferStatus(transfer_engine_t engine, batch_id_t batch_id, size_t task_id,
                      struct transfer_status *status);

int freeBatchID(transfer_engine_t engine, batch_id_t batch_id);

int syncSegmentCache(transfer_engine_t engine);

struct nic_load_stat {
    char device_name[64];
    uint64_t inflight_bytes;
    double ewma_bandwidth_bps;
};
typedef struct nic_load_stat nic_load_stat_t;

int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats, size_t *count);

void enableGracefulShutdown(transfer_engine_t engine);

int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len, int json);

#ifdef __cplusplus
}
#endif

#endif
