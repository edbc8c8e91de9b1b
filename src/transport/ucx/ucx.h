/* Internal: the ucx transport's parts and the messages between them.
 *
 * The engine-wide part is two files sharing ucx_server.h: ucx_server.c, the
 * runtime (the UCP context, the progress thread, the worker peers reach, the
 * hand-offs to that thread, start and stop), and ucx_target.c, what the
 * target serves (memory registration with ucp_mem_map and packed rkeys, the
 * pool's chunks, the connections initiators open to it and the REVOKE
 * exchange, the descriptor fields). ucx.c is the initiator side (a worker
 * and an endpoint per peer, one-sided ucp_get_nbx/ucp_put_nbx) and the ops
 * table; ucx_wire.{h,c} the control messages between the two sides.
 * docs/transport-ucx.md has the reasons and the trust model.
 *
 * Threads: a worker is called by one thread at a time, so workers run in
 * UCS_THREAD_MODE_SERIALIZED and nothing spins on UCX's locks (measured: a
 * MULTI-mode worker shared by the engine's threads and a progress thread ran
 * 1 MiB reads 30 times slower on a loaded 2-core host, its spinlock held by
 * preempted threads). The progress thread owns the server's worker, and
 * serves each peer's worker (a pollee) whenever no caller holds that
 * pollee's lock. A transfer's calling thread that takes the lock issues its
 * requests and progresses the worker itself while the worker keeps making
 * progress ("leads"), then hands what is left back to the progress thread:
 * a short request is served without a thread wake-up. A caller that finds
 * the lock taken posts its transfer for whoever holds it (kvpi_ucx_post).
 * A transfer all in target memory mapped here needs no worker: its caller
 * copies it (ucx.c, copy_mapped). Other threads hand work to the progress
 * thread (kvpi_ucx_call, kvpi_ucx_submit) and wait on their own condition
 * variables. Only the
 * context's memory calls (ucp_mem_map, ucp_rkey_pack, ucp_mem_unmap) run on
 * any thread, the context being shared by workers.
 *
 * Descriptor fields (kvpipe's own; Mooncake peers ignore them, "protocol"
 * stays "tcp"): a top-level object
 *   "ucx": {"version": 1, "worker": "<hex worker address>", "epoch": N,
 *           "host_id": "<as shm's>", "pid": P}
 * and, in each buffer entry, "ucx_rkey": "<hex packed rkey>". epoch counts the
 * server's deregistrations up to the moment the descriptor was rendered.
 * host_id and pid let a peer on the same host see that the process died while
 * UCX cannot (shared memory outlives it; a zombie keeps its pid).
 *
 * Control messages (HELLO, HELLO_ACK, REVOKE, ...): ucx_wire.h, their one
 * encoder and decoder.
 */
#ifndef KVPI_TRANSPORT_UCX_INTERNAL_H
#define KVPI_TRANSPORT_UCX_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <ucp/api/ucp.h>

#include "transport/transport.h"
#include "transport/ucx/wire.h"

#define KVPI_UCX_FIELD "ucx"
#define KVPI_UCX_RKEY_FIELD "ucx_rkey"
/* Challenges an authenticated target keeps pending at once (strangers' HELLOs
 * beyond it are refused): the listener's max_connections, as for every other
 * listener's incomplete connections, or this without one. */
#define KVPI_UCX_CHALLENGES_DEFAULT 256
/* Deregistrations whose ranges a HELLO_ACK can still report. */
#define KVPI_UCX_REVOKE_LOG 256

typedef struct kvpi_ucx_server kvpi_ucx_server;

/* Work for the progress thread: run is called there once, with cmd; what
 * cmd points to must stay valid until then. */
typedef struct kvpi_ucx_cmd {
    struct kvpi_ucx_cmd *next;
    void (*run)(kvpi_ucx_server *s, struct kvpi_ucx_cmd *cmd);
} kvpi_ucx_cmd;

/* A worker the progress thread serves besides its own (a peer's). Whoever
 * holds lock may call UCP on the worker (and what lives on it) and runs the
 * commands posted to it; the progress thread only ever try-locks it, and
 * after each round of progress on it calls service, which returns non-zero
 * if it did something and sets busy while requests are in flight. The
 * progress thread alone touches next and watched; pending, npending and driven_ns change
 * under the server's queue lock (npending and driven_ns are read without). */
typedef struct kvpi_ucx_pollee {
    ucp_worker_h worker;
    int efd;
    pthread_mutex_t lock;
    int busy;
    unsigned (*service)(kvpi_ucx_server *s, struct kvpi_ucx_pollee *self);
    kvpi_ucx_cmd *pending, **pending_tail;
    atomic_int npending;
    _Atomic uint64_t driven_ns; /* when a caller last let go of it */
    atomic_int by_progress;     /* the progress thread holds lock (briefly) */
    /* Never progressed again: requests on it were given up, and progress
     * could still deliver their bytes into memory their callers own again
     * (ucx.c, abandon). Its owner destroys the worker without draining it. */
    atomic_int frozen;
    int watched; /* the progress thread's sleep wakes on efd */
    struct kvpi_ucx_pollee *next;
} kvpi_ucx_pollee;

/* ---- ucx.c ---- */
/* The lanes UCX chose for a peer's endpoint (ucp_ep_print_info), one
 * "transport/device (roles)" each, comma-separated, into buf; returns the
 * length written. For logs and for tests that check what UCX used. */
size_t kvpi_ucx_peer_lanes(void *peer, char *buf, size_t len);

/* ---- ucx_server.c and ucx_target.c: the ops of the server side ---- */
kvp_status kvpi_ucx_server_start(const kvpi_server_ctx *ctx, void **server);
void kvpi_ucx_server_stop(void *server);
kvp_status kvpi_ucx_server_describe(void *server, cJSON *doc);
kvp_status kvpi_ucx_buffer_describe(void *server, const kvpi_region *region, void *handle,
                                    cJSON *buffer);
kvp_status kvpi_ucx_mem_reg(void *server, const kvpi_region *region, void **handle);
void kvpi_ucx_mem_dereg(void *server, void *handle);
kvp_status kvpi_ucx_chunk_map(void *server, size_t length, void **addr);
void kvpi_ucx_chunk_unmap(void *server, void *addr, size_t length);

/* ---- ucx_server.c: for ucx.c ---- */
/* Queue cmd for the progress thread and wake it. Any thread. */
void kvpi_ucx_submit(kvpi_ucx_server *s, kvpi_ucx_cmd *cmd);
/* Run fn(s, arg) on the progress thread and wait until it ran. Any thread
 * but the progress thread. */
void kvpi_ucx_call(kvpi_ucx_server *s, void (*fn)(kvpi_ucx_server *s, void *arg), void *arg);
/* Queue cmd for whoever holds p's lock (the progress thread, unless a
 * caller leads), and wake the progress thread if it sleeps. Any thread. */
void kvpi_ucx_post(kvpi_ucx_server *s, kvpi_ucx_pollee *p, kvpi_ucx_cmd *cmd);
/* Run the commands posted to p; the caller holds p's lock. Returns how many. */
unsigned kvpi_ucx_run_posted(kvpi_ucx_server *s, kvpi_ucx_pollee *p);
/* A caller that held p's lock let go of it (after unlocking): the progress
 * thread is woken if it sleeps and more is non-zero (requests still in
 * flight) or commands are posted. */
void kvpi_ucx_let_go(kvpi_ucx_server *s, kvpi_ucx_pollee *p, int more);
/* A pollee's lock and queue, before it is added, and after it is removed. */
void kvpi_ucx_pollee_init(kvpi_ucx_pollee *p);
void kvpi_ucx_pollee_destroy(kvpi_ucx_pollee *p);

/* The rest runs on the progress thread only. */
/* A new worker on the server's context (for a peer), SERIALIZED. */
kvp_status kvpi_ucx_worker_create(kvpi_ucx_server *s, ucp_worker_h *out);
/* Serve p->worker (and p->service) from now on, or no longer. p's lock and
 * queue are initialised by kvpi_ucx_pollee_init (any thread, before). */
kvp_status kvpi_ucx_poll_add(kvpi_ucx_server *s, kvpi_ucx_pollee *p);
void kvpi_ucx_poll_remove(kvpi_ucx_server *s, kvpi_ucx_pollee *p);
/* Hand over a worker whose endpoint is closing (req: the close request, or
 * NULL): the thread progresses it until the close completes or CLOSE_MS
 * passed, then destroys it and calls done(arg) (frees what its callbacks
 * used). */
void kvpi_ucx_retire(kvpi_ucx_server *s, ucp_worker_h w, void *req, void (*done)(void *arg),
                     void *arg);
/* Requests in flight that only the progress thread serves (not a pollee's):
 * it does not sleep while there are any. */
void kvpi_ucx_busy_add(kvpi_ucx_server *s, long n);
/* Set the active-message handler id of worker w (whole messages only). */
kvp_status kvpi_ucx_set_handler(ucp_worker_h w, unsigned id, ucp_am_recv_callback_t cb, void *arg);
/* Send a control message of len bytes (copied) on ep; UCP completes it in the
 * background. flags: UCP_AM_SEND_FLAG_*. */
kvp_status kvpi_ucx_am_send(ucp_ep_h ep, unsigned id, const void *bytes, size_t len,
                            uint32_t flags);
/* Close ep at once: its requests complete with UCS_ERR_CANCELED. */
void kvpi_ucx_ep_close_force(ucp_ep_h ep);

/* ---- ucx_server.c: any thread ---- */
/* The kvp_status of a UCX failure. */
kvp_status kvpi_ucx_status(ucs_status_t st);
/* Hex text of n bytes (malloc'ed), and back: KVP_OK and *out (malloc'ed),
 * *n, or KVP_EPROTO for text that is not even-length hex. */
char *kvpi_ucx_hex(const void *bytes, size_t n);
kvp_status kvpi_ucx_unhex(const char *text, void **out, size_t *n);

#endif
