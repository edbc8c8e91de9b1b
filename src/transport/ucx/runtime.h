/* Internal: the ucx transport's runtime, what its other parts stand on: the
 * UCP context, the workers and the one lock that serializes them, the
 * transport's manual progress (transport.h: server_progress,
 * server_wait_fd) and the thread that drives it when no waiter does, and
 * small UCP helpers. It knows nothing of targets or initiators: each worker
 * comes with a service, called after each round of progress.
 *
 * The parts, each including only those before it: wire.{h,c} (control
 * messages, no UCX), runtime.{h,c}, target.{h,c} (what the target serves:
 * registrations, REVOKE, the initiators' connections, the pool's chunks,
 * the descriptor's fields; server_start and server_stop), transfer.{h,c}
 * (a peer's transfers: issuing, completion, deadlines, copies of mapped
 * memory), initiator.c (opening and closing peers, their control messages,
 * the ops table). docs/transport-ucx.md has the reasons.
 *
 * Threads. Workers are UCS_THREAD_MODE_SERIALIZED: whoever holds the
 * runtime's lock may call UCP on any of its workers, and no one else does
 * (measured: a MULTI-mode worker shared by the engine's threads and a
 * progress thread ran 1 MiB reads 30 times slower on a loaded 2-core host,
 * its spinlock held by preempted threads). The lock is held for bounded
 * work only: issuing requests, one round of progress, opening or closing an
 * endpoint; never while waiting for a peer. The context's memory calls
 * (ucp_mem_map, ucp_rkey_pack, ucp_mem_unmap) run on any thread without it.
 * Who progresses: the caller of peer_run until its xfer completed
 * (transfer.c), waiters through server_progress (the engine's
 * kvp_batch_wait), and the runtime's thread, which keeps progressing while
 * posted requests are in flight and shortly after any work, then sleeps in
 * poll() on the wait descriptor, waking at least every KVPI_UCX_TICK_MS for
 * what needs no event (deadlines, a same-host target's death, unanswered
 * challenges). A progress call that finds another in progress returns at
 * once: the one running handles the events, and completions wake their
 * waiters.
 */
#ifndef KVPI_TRANSPORT_UCX_RUNTIME_H
#define KVPI_TRANSPORT_UCX_RUNTIME_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include <ucp/api/ucp.h>

#include "transport/shm_internal.h"
#include "transport/transport.h"

/* The longest sleep of the runtime's thread: the period of the checks that
 * no event triggers. */
#define KVPI_UCX_TICK_MS 100

/* Work deferred until the lock is let go: a completion, so that the engine's
 * code never runs under the lock (it takes its own locks, which threads
 * holding them may take the runtime's lock after: peer_open). */
typedef struct kvpi_ucx_later {
    struct kvpi_ucx_later *next;
    void (*run)(struct kvpi_ucx_later *self);
} kvpi_ucx_later;

/* A worker the runtime progresses. service runs after each round of
 * progress, under the lock; it returns how many things it did. */
typedef struct kvpi_ucx_poller {
    ucp_worker_h worker;
    int efd;
    unsigned (*service)(struct kvpi_ucx_poller *self);
    struct kvpi_ucx_poller *next;
    int listed; /* progressed: between kvpi_ucx_poller_add and _remove */
} kvpi_ucx_poller;

/* The runtime; first in the server (target.c), so that the engine's server
 * pointer is one to it too. */
typedef struct kvpi_ucx_rt {
    ucp_context_h ctx;
    kvpi_ucx_poller target;             /* the worker peers connect to (its service: target.c's) */
    char *worker_hex;                   /* its address, published */
    char *segment;                      /* ours, for messages */
    char host_id[KVPI_SHM_HOST_ID_MAX]; /* "" where unknown */
    int timeout_ms;
    const kvpi_auth *auth; /* the engine's, outlives the server; NULL: plain */

    pthread_mutex_t lock; /* every UCP call on a worker; the lists below */
    kvpi_ucx_poller *pollers;
    kvpi_ucx_later *later, **later_tail;

    int epfd; /* every poller's efd: the wait descriptor */
    int evfd; /* wakes the thread: a worker to arm, or stop */
    pthread_t thread;
    int thread_started;
    atomic_int stop;
    /* Requests of its peers issued by peer_post and not completed
     * (transfer.c; peer_run's are driven by their caller): UCX may need
     * polling to move them (a send waiting for room in a shared-memory FIFO
     * raises no event), so the thread does not sleep while any are, and the
     * first one issued wakes it (sleeping: it is in poll()). */
    atomic_long inflight;
    atomic_int sleeping;
} kvpi_ucx_rt;

/* server_start's first half: the context (its configuration from ctx) and
 * the target's worker, whose service is target_service (which holds no
 * lock of the runtime's). */
kvp_status kvpi_ucx_rt_start(kvpi_ucx_rt *rt, const kvpi_server_ctx *ctx,
                             unsigned (*target_service)(kvpi_ucx_poller *));
/* Its second half: the thread. */
kvp_status kvpi_ucx_rt_run(kvpi_ucx_rt *rt);
/* Stop the thread (if it ran). Then, with the lock, the caller closes what
 * uses the target worker; then kvpi_ucx_rt_free. */
void kvpi_ucx_rt_halt(kvpi_ucx_rt *rt);
void kvpi_ucx_rt_free(kvpi_ucx_rt *rt);

/* The ops (server = the runtime). */
unsigned kvpi_ucx_progress(void *server, unsigned budget);
int kvpi_ucx_wait_fd(void *server);

/* As kvpi_ucx_progress, for p's worker alone: up to budget calls until one
 * found something; when none did, p's service. Nothing once p was removed
 * (a frozen worker is never progressed again, whoever still holds p). */
unsigned kvpi_ucx_progress_one(kvpi_ucx_rt *rt, kvpi_ucx_poller *p, unsigned budget);
/* Let go of the lock, then run what was deferred meanwhile, in order. */
void kvpi_ucx_unlock(kvpi_ucx_rt *rt);

/* The rest: with the lock held. */
/* Run l once the lock is let go (kvpi_ucx_unlock). */
void kvpi_ucx_defer(kvpi_ucx_rt *rt, kvpi_ucx_later *l);
/* One more request in flight (see inflight). */
void kvpi_ucx_inflight_add(kvpi_ucx_rt *rt);
/* A new worker on the context, SERIALIZED. */
kvp_status kvpi_ucx_worker_create(kvpi_ucx_rt *rt, ucp_worker_h *out);
/* Progress p from now on (p->worker, p->service set), or no longer (from
 * inside p's own service too); then the caller owns p's worker alone. */
kvp_status kvpi_ucx_poller_add(kvpi_ucx_rt *rt, kvpi_ucx_poller *p);
void kvpi_ucx_poller_remove(kvpi_ucx_rt *rt, kvpi_ucx_poller *p);
/* Set the active-message handler id of worker w (whole messages only). */
kvp_status kvpi_ucx_set_handler(ucp_worker_h w, unsigned id, ucp_am_recv_callback_t cb, void *arg);
/* Send a control message of len bytes (copied) on ep; UCP completes it in the
 * background. flags: UCP_AM_SEND_FLAG_*. */
kvp_status kvpi_ucx_am_send(ucp_ep_h ep, unsigned id, const void *bytes, size_t len,
                            uint32_t flags);
/* Close ep at once: its requests complete with UCS_ERR_CANCELED. */
void kvpi_ucx_ep_close_force(ucp_ep_h ep);

/* Any thread. */
/* The kvp_status of a UCX failure. */
kvp_status kvpi_ucx_status(ucs_status_t st);
/* Hex text of n bytes (malloc'ed), and back: KVP_OK and *out (malloc'ed),
 * *n, or KVP_EPROTO for text that is not even-length hex. */
char *kvpi_ucx_hex(const void *bytes, size_t n);
kvp_status kvpi_ucx_unhex(const char *text, void **out, size_t *n);

#endif
