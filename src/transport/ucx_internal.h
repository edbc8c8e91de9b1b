/* Internal: the ucx transport's parts and the messages between them.
 *
 * ucx_server.c is the target side: the engine's UCP context, the worker whose
 * address peers connect to, the progress thread, memory registration
 * (ucp_mem_map, packed rkeys) and the connections initiators open to it.
 * ucx.c is the initiator side (one UCP worker and endpoint per peer, one-sided
 * ucp_get_nbx/ucp_put_nbx) and the ops table. docs/transport-ucx.md has the
 * reasons and the trust model.
 *
 * Descriptor fields (kvpipe's own; Mooncake peers ignore them, "protocol"
 * stays "tcp"): a top-level object
 *   "ucx": {"version": 1, "worker": "<hex worker address>", "epoch": N}
 * and, in each buffer entry, "ucx_rkey": "<hex packed rkey>". epoch counts the
 * server's deregistrations up to the moment the descriptor was rendered.
 *
 * Control messages: UCP active messages with no header part, their data a
 * sequence of little-endian u64 words, word 0 = KVPI_UCX_MAGIC | aux << 32:
 *   HELLO      initiator -> target, on the initiator's new endpoint, with
 *              UCP_AM_SEND_FLAG_REPLY; aux = version; word 1 = epoch of the
 *              descriptor the initiator read; then the initiator worker's
 *              address. The target creates its own endpoint to that address,
 *              which UCP pairs with the endpoint the initiator's requests
 *              arrive on, so that closing it cuts the initiator off.
 *   HELLO_ACK  target -> initiator; aux = status | n << 16; word 1 = the
 *              connection's id; then n ranges (addr, length) deregistered
 *              since that epoch.
 *   REVOKE     target -> initiator; words: serial, addr, length: the region
 *              is being deregistered.
 *   REVOKE_ACK initiator -> target; words: connection id, serial: no request
 *              of ours touches that range any more (refused from now on, and
 *              those issued before are flushed).
 */
#ifndef KVPI_TRANSPORT_UCX_INTERNAL_H
#define KVPI_TRANSPORT_UCX_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <ucp/api/ucp.h>

#include "transport/transport.h"

#define KVPI_UCX_FIELD "ucx"
#define KVPI_UCX_RKEY_FIELD "ucx_rkey"
#define KVPI_UCX_VERSION 1
#define KVPI_UCX_MAGIC 0x5550564bu /* "KVPU" little-endian */

enum kvpi_ucx_am {
    KVPI_UCX_AM_HELLO = 1,
    KVPI_UCX_AM_HELLO_ACK = 2,
    KVPI_UCX_AM_REVOKE = 3,
    KVPI_UCX_AM_REVOKE_ACK = 4,
};

enum kvpi_ucx_hello_status {
    KVPI_UCX_HELLO_OK = 0,
    KVPI_UCX_HELLO_STALE = 1,    /* the descriptor predates what the log keeps */
    KVPI_UCX_HELLO_UNPAIRED = 2, /* the target could not pair its endpoint */
};

#define KVPI_UCX_HELLO_LEN 16
#define KVPI_UCX_HELLO_ACK_LEN 16
#define KVPI_UCX_REVOKE_LEN 32
#define KVPI_UCX_REVOKE_ACK_LEN 24
/* Deregistrations whose ranges a HELLO_ACK can still report. */
#define KVPI_UCX_REVOKE_LOG 256

typedef struct kvpi_ucx_server kvpi_ucx_server;

/* A worker the server's progress thread progresses besides its own: a
 * peer's. service runs on the progress thread after each progress round and
 * returns non-zero if it did something. */
typedef struct kvpi_ucx_pollee {
    ucp_worker_h worker;
    int efd;
    unsigned (*service)(struct kvpi_ucx_pollee *self);
    struct kvpi_ucx_pollee *next;
} kvpi_ucx_pollee;

/* ucx_server.c */
kvp_status kvpi_ucx_server_start(const kvpi_server_ctx *ctx, void **server);
void kvpi_ucx_server_stop(void *server);
kvp_status kvpi_ucx_server_describe(void *server, cJSON *doc);
kvp_status kvpi_ucx_buffer_describe(void *server, const kvpi_region *region, void *handle,
                                    cJSON *buffer);
kvp_status kvpi_ucx_mem_reg(void *server, const kvpi_region *region, void **handle);
void kvpi_ucx_mem_dereg(void *server, void *handle);

ucp_context_h kvpi_ucx_context(const kvpi_ucx_server *s);
/* A new worker on the server's context (for a peer), thread mode MULTI. */
kvp_status kvpi_ucx_worker_create(kvpi_ucx_server *s, ucp_worker_h *out);
/* Let the progress thread progress p->worker (and run p->service), or stop
 * doing so: when poll_remove returns, the thread no longer touches p. */
kvp_status kvpi_ucx_poll_add(kvpi_ucx_server *s, kvpi_ucx_pollee *p);
void kvpi_ucx_poll_remove(kvpi_ucx_server *s, kvpi_ucx_pollee *p);
/* Requests in flight on the peers' workers: the progress thread spins while
 * there are any. kvpi_ucx_busy_add wakes it if it sleeps. */
void kvpi_ucx_busy_add(kvpi_ucx_server *s, long n);

/* Set the active-message handler id of worker w (whole messages only). */
kvp_status kvpi_ucx_set_handler(ucp_worker_h w, unsigned id, ucp_am_recv_callback_t cb,
                                void *arg);
/* Send a control message of len bytes (copied) on ep; UCP completes it in the
 * background. flags: UCP_AM_SEND_FLAG_*. */
kvp_status kvpi_ucx_am_send(ucp_ep_h ep, unsigned id, const void *bytes, size_t len,
                            uint32_t flags);
/* Close ep at once: its requests complete with UCS_ERR_CANCELED. */
void kvpi_ucx_ep_close_force(ucp_ep_h ep);

/* The kvp_status of a UCX failure. */
kvp_status kvpi_ucx_status(ucs_status_t st);

/* Hex text of n bytes (malloc'ed), and back: KVP_OK and *out (malloc'ed),
 * *n, or KVP_EPROTO for text that is not even-length hex. */
char *kvpi_ucx_hex(const void *bytes, size_t n);
kvp_status kvpi_ucx_unhex(const char *text, void **out, size_t *n);

#endif
