/* Internal: a peer of the ucx transport and its transfers (transfer.c).
 *
 * A peer has its own UCP worker, with one endpoint to the target's
 * published worker and the target's rkeys unpacked on it. Its own worker,
 * because the target pairs an endpoint of its own with it (wire.h, HELLO),
 * and because UCX 1.13 may keep the RMA requests of a force-closed endpoint
 * pending and deliver them once the target resumes
 * (tests/probes/ucx_close_pending.c): a peer whose requests were given up
 * has its worker frozen, never progressed again, which only a worker of its
 * own allows.
 *
 * A transfer issues ucp_get_nbx/ucp_put_nbx (and one flush after writes,
 * so that they completed at the target) under the runtime's lock and
 * returns; the completions come from whoever progresses (runtime.h). A
 * transfer out of time closes the endpoint, which cancels what is in
 * flight, and the engine looks the peer up again. An xfer all in target
 * memory the rkeys map here (UCX's shared memory) is copied on the posting
 * thread instead, without the worker.
 */
#ifndef KVPI_TRANSPORT_UCX_TRANSFER_H
#define KVPI_TRANSPORT_UCX_TRANSFER_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include <cjson/cJSON.h>

#include "transport/ucx/runtime.h"

/* A REVOKE being answered. */
typedef struct ucx_revoke {
    struct ucx_revoke *next;
    uint64_t serial;
    void *flush; /* the flush request, until it completed; NULL before it is issued */
    int issued;
} ucx_revoke;

/* Why a region of the peer is refused. */
enum { KVPI_UCX_REVOKED_DEREG = 1, KVPI_UCX_REVOKED_NO_RKEY = 2 };

typedef struct ucx_xfer ucx_xfer;

typedef struct ucx_peer {
    kvpi_ucx_poller poll; /* first; its worker is the peer's */
    kvpi_ucx_rt *rt;
    char *segment;
    int timeout_ms;
    uint64_t min_rate;
    size_t n_regions;
    kvpi_region *regions;
    void **rkey_bufs; /* packed, until unpacked on the endpoint */
    size_t *rkey_lens;
    /* Authenticated mode: the key, and our half of the HELLO's challenge. */
    const kvpi_auth *auth;
    uint8_t kid[KVPI_AUTH_KID_LEN], nc[KVPI_AUTH_NONCE_LEN];
    int proved; /* our PROOF went out: a HELLO_ACK may hand us rkeys now */

    /* The runtime's lock's. */
    ucp_ep_h ep; /* NULL once closed */
    ucp_rkey_h *rkeys;
    unsigned char
        *revoked; /* KVPI_UCX_REVOKED_*: refused from now on; written under map_lock too */
    /* Regions whose rkey maps the target's memory here (UCX's shared
     * memory, ucp_rkey_ptr): where region i's first byte is in this
     * process, or NULL. A transfer of such memory is a copy on the posting
     * thread, without the worker, under map_lock for reading; whoever
     * refuses a region or sets its rkey holds it for writing, so that once
     * kvpi_ucx_revoke_range returned no copy of the range runs. */
    char **mapped;
    size_t n_mapped;
    pthread_rwlock_t map_lock;
    ucx_revoke *revokes, **revokes_tail;
    uint64_t conn_id;
    int awaiting_hello;
    long inflight; /* requests issued and not completed */
    /* Bytes of xfers posted and not completed: a new xfer's deadline counts
     * them, since UCX moves them first (see peer_post). */
    atomic_uint_fast64_t posted_bytes;
    uint64_t down_ns; /* when the endpoint was first seen closed or failed */
    ucx_xfer *issued; /* xfers with requests in flight */
    int frozen;       /* requests given up: the worker is never progressed again */
    pid_t target_pid; /* on this host; 0 where not, or unknown */
    unsigned long long target_start;
    uint64_t next_check;

    atomic_int ep_status; /* the ucs_status_t the endpoint failed with; 0 while fine */
    atomic_int timed_out; /* closed by us after a deadline passed */

    pthread_mutex_t lock; /* the HELLO's answer */
    pthread_cond_t answered;
    int hello_done;
    unsigned hello_status;
} ucx_peer;

/* peer_post and peer_run (any thread). An xfer run is driven by its
 * caller; one posted, by the runtime's thread, which it wakes (runtime.h,
 * inflight). */
void kvpi_ucx_post(void *peer, kvpi_xfer *x);
void kvpi_ucx_run(void *peer, kvpi_xfer *x);

/* The rest: with the runtime's lock held, or before any transfer has p. */
/* Refuse every region of p that overlaps [addr, addr+length). */
void kvpi_ucx_revoke_range(ucx_peer *p, uint64_t addr, uint64_t length);
/* Region i's rkey was unpacked: is its memory mapped here? The caller holds
 * map_lock for writing, or no transfer can use p yet. */
void kvpi_ucx_find_mapping(ucx_peer *p, size_t i);
/* Watch the target's process, where the descriptor's ucx field o says it
 * runs on this host. */
void kvpi_ucx_watch_process(ucx_peer *p, const cJSON *o);
/* After each round of progress: a same-host target's death, the deadlines
 * of the xfers in flight, and their abandon. Returns what it did. */
unsigned kvpi_ucx_transfers_service(ucx_peer *p);

#endif
