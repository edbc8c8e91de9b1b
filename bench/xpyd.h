/* xpyd's router (bench/xpyd.c) and its workers (bench/xpyd_worker.c): the
 * messages between them over a socket pair, and the blocks' pattern. */
#ifndef KVPB_XPYD_H
#define KVPB_XPYD_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define TOKEN_BYTES (128u << 10) /* Llama-3-8B: 32 x 8 x 128 x 2 x 2 */
#define TOKEN_ELEMS (TOKEN_BYTES / 2)
#define NET 78 /* hosts are 10.78.0.x */
#define ENGINE_PORT 15000
#define PIPE_PORT 20000 /* + 200 x peer index */
#define ETCD_PORT 2379
#define ETCD_PEER_PORT 2380
#define MAX_SIDE 16
#define MAX_PAIRS (MAX_SIDE * MAX_SIDE)
#define QCAP 256
#define ERR_LEN 240

/* ------------------------------------------------------------- messages --- */

enum {
    CMD_WRITE = 1, /* prefill: fill and WRITE to decode peer's slot */
    CMD_FILL,      /* prefill: fill own slot (read mode) */
    CMD_VERIFY,    /* decode: verify own slot (write mode) */
    CMD_READ,      /* decode: READ peer's slot into own, verify (read mode) */
    CMD_PSEND,     /* prefill: send the tensor on the pipe to peer */
    CMD_PRECV,     /* decode: receive the next tensor from peer, verify */
    CMD_ABANDON,   /* decode: fail what waits on peer (it died) */
    CMD_GIVEUP,    /* decode: drop req's tensor if it comes (peer died mid-send) */
    CMD_LOOKUP,    /* probe peer by name now (a fresh metadata lookup) */
    CMD_STATS,
    CMD_QUIT,
    REP_READY,
    REP_DONE,
    REP_STATS,
    REP_LOOKUP,
};

typedef struct msg {
    uint32_t type;
    int32_t status; /* kvp_status; -1: a byte was wrong; -2: reordered */
    uint64_t req;   /* request id */
    uint32_t peer;  /* the other side's index */
    uint32_t slot;  /* slot in the verb's target buffer */
    uint32_t slot2; /* read: own slot */
    uint32_t tokens;
    uint64_t elapsed_ms;
    char name[64]; /* a segment name */
    char err[ERR_LEN];
    /* REP_STATS */
    int64_t conns, lookups, rss_kib, fds, time_wait;
} msg;

/* Send m on fd (under mu unless NULL). */
void xpyd_send_msg(int fd, pthread_mutex_t *mu, const msg *m);

/* A worker: this program run with --worker ROLE and the workers' options
 * (spawn_worker in xpyd.c); its exit status. */
int xpyd_worker(int argc, char **argv);

#endif
