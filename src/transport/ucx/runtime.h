/* Internal: the state of the ucx transport's engine-wide part, shared by
 * its two files: ucx_server.c, the runtime (the UCP context, the progress
 * thread that owns every worker, the hand-offs to it, start and stop), and
 * ucx_target.c, what the target serves (the initiators' connections and
 * their HELLO exchange, registrations and their revocation, the pool's
 * chunks, the descriptor fields). ucx_internal.h has the threads' rules. */
#ifndef KVPI_TRANSPORT_UCX_SERVER_H
#define KVPI_TRANSPORT_UCX_SERVER_H

#include <pthread.h>
#include <stdint.h>

#include <ucp/api/ucp.h>

#include "transport/shm_internal.h"
#include "transport/ucx/ucx.h"

typedef struct ucx_reg {
    struct ucx_reg *next; /* the server's list of live registrations */
    ucp_mem_h memh;
    char *rkey_hex;
    void *rkey; /* packed */
    size_t rkey_len;
    uint64_t addr, length;
    int in_chunk; /* memh is a pool chunk's (ucx_chunk): chunk_unmap frees it */
} ucx_reg;

/* A buffer-pool chunk UCX allocated (chunk_map): memory a same-host peer's
 * UCX maps into its own address space from the rkey, and then copies
 * directly, without this process's progress (docs/transport-ucx.md). */
typedef struct ucx_chunk {
    struct ucx_chunk *next;
    ucp_mem_h memh;
    uint64_t addr, length;
} ucx_chunk;

/* An initiator that said HELLO: the endpoint to it is the one its requests
 * arrive on (UCP paired them). The progress thread owns it; id, acked and
 * dead are also read by a deregistration waiting for acknowledgements, so
 * they change under conns_lock, as does the list. */
typedef struct ucx_conn {
    struct ucx_conn *next;
    kvpi_ucx_server *server;
    ucp_ep_h ep; /* NULL once closed */
    uint64_t id;
    uint64_t acked; /* the highest REVOKE serial it acknowledged */
    int dead;       /* failed or cut off: nothing more is sent to it */
} ucx_conn;

/* Authenticated mode: an initiator's HELLO answered with a CHALLENGE, its
 * PROOF awaited. Only the progress thread touches these. */
typedef struct ucx_chal {
    struct ucx_chal *next;
    ucx_conn *conn; /* its endpoint; joins the connections once proven */
    uint64_t id, epoch, deadline;
    uint8_t kid[KVPI_AUTH_KID_LEN];
    uint8_t nc[KVPI_AUTH_NONCE_LEN], ns[KVPI_AUTH_NONCE_LEN];
} ucx_chal;

/* A worker whose endpoint is closing. */
typedef struct ucx_retiree {
    struct ucx_retiree *next;
    ucp_worker_h worker;
    void *req;
    uint64_t deadline;
    void (*done)(void *arg);
    void *arg;
} ucx_retiree;

struct kvpi_ucx_server {
    ucp_context_h ctx;
    ucp_worker_h worker;
    char *worker_hex;
    char *segment;
    char host_id[KVPI_SHM_HOST_ID_MAX]; /* "" where unknown */
    int timeout_ms;
    const kvpi_auth *auth; /* the engine's, outlives the server; NULL: plain */

    pthread_t thread;
    int thread_started;
    int epfd, evfd;

    pthread_mutex_t queue_lock; /* the queue, sleeping and stop */
    kvpi_ucx_cmd *queue, **queue_tail;
    int sleeping, stop;

    /* The progress thread's own. */
    kvpi_ucx_pollee *pollees;
    ucx_retiree *retirees;
    long busy;
    ucx_chal *chals; /* authenticated mode: challenges pending */
    int n_chals, max_chals;
    uint64_t next_chal;

    pthread_mutex_t conns_lock; /* never held across a UCX call */
    pthread_cond_t conns_cond;  /* an acknowledgement came, or a connection failed */
    ucx_conn *conns;
    ucx_reg *regs; /* live registrations, for the rkeys of a HELLO_ACK */
    uint64_t next_id;
    uint64_t epoch; /* deregistrations so far */
    struct {
        uint64_t addr, length;
    } log[KVPI_UCX_REVOKE_LOG]; /* the range of deregistration e at [e % LOG] */
    pthread_mutex_t dereg_lock; /* one deregistration at a time */
    pthread_mutex_t chunks_lock;
    ucx_chunk *chunks; /* the pool's chunks UCX allocated */
};

/* ucx_target.c, for the runtime: set the server worker's handlers of the
 * initiators' messages; on the progress thread, close the connections that
 * failed or were cut off, and drop challenges unanswered in time (each
 * returns how many it did); at stop, with the thread gone, close what is
 * left of both. */
kvp_status kvpi_ucx_target_handlers(kvpi_ucx_server *s);
unsigned kvpi_ucx_reap(kvpi_ucx_server *s);
unsigned kvpi_ucx_expire_challenges(kvpi_ucx_server *s);
void kvpi_ucx_target_close(kvpi_ucx_server *s);

#endif
