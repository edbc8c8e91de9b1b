/* The ucx transport, what the target serves: the initiators' connections
 * (HELLO, CHALLENGE and PROOF, REVOKE_ACK, BYE; wire.h), registrations
 * and the REVOKE exchange that takes a deregistered range from every peer,
 * the buffer pool's chunks UCX allocates, the descriptor's fields, and the
 * server's start and stop (on the runtime, runtime.h).
 *
 * With one-sided RMA the target's code sees no request. On RDMA hardware the
 * NIC checks each against the rkey it names; over UCX's own transports (tcp,
 * shared memory) UCX emulates RMA with active messages that this process's
 * progress serves (the runtime's thread, or a waiter), at any address a
 * peer names. So the target cannot
 * refuse a request: what keeps peers inside its registered memory is their
 * own range check against the descriptor, and what keeps them out of memory
 * it deregisters is the REVOKE exchange below, backed by cutting off a peer
 * that does not answer it in time (docs/transport-ucx.md). In the
 * authenticated mode the rkeys are not published: a HELLO gets them only
 * after its initiator answered a challenge with the key (docs/security.md).
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#define KVPI_LOG_SUBSYS "ucx"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "transport/ucx/target.h"
#include "transport/ucx/wire.h"

/* Challenges an authenticated target keeps pending at once (strangers' HELLOs
 * beyond it are refused): the listener's max_connections, as for every other
 * listener's incomplete connections, or this without one. */
#define CHALLENGES_DEFAULT 256

typedef struct ucx_server ucx_server;

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
 * arrive on (UCP paired them). Its endpoint is the runtime's lock's; id,
 * acked and dead are also read by a deregistration waiting for
 * acknowledgements, so they change under conns_lock, as does the list. */
typedef struct ucx_conn {
    struct ucx_conn *next;
    ucx_server *server;
    ucp_ep_h ep; /* NULL once closed */
    uint64_t id;
    uint64_t acked; /* the highest REVOKE serial it acknowledged */
    int dead;       /* failed or cut off: nothing more is sent to it */
} ucx_conn;

/* Authenticated mode: an initiator's HELLO answered with a CHALLENGE, its
 * PROOF awaited. Under the runtime's lock. */
typedef struct ucx_chal {
    struct ucx_chal *next;
    ucx_conn *conn; /* its endpoint; joins the connections once proven */
    uint64_t id, epoch, deadline;
    uint8_t kid[KVPI_AUTH_KID_LEN];
    uint8_t nc[KVPI_AUTH_NONCE_LEN], ns[KVPI_AUTH_NONCE_LEN];
} ucx_chal;

struct ucx_server {
    kvpi_ucx_rt rt; /* first: the engine's server pointer is one to it */

    /* Under the runtime's lock. */
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

/* ---- connections from initiators ---- */

static void conn_failed(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)ep;
    ucx_conn *c = arg;
    ucx_server *s = c->server;
    KVPI_DEBUG("ucx %s: connection %" PRIu64 " from an initiator failed: %s", s->rt.segment, c->id,
               ucs_status_string(st));
    pthread_mutex_lock(&s->conns_lock);
    c->dead = 1;
    pthread_cond_broadcast(&s->conns_cond);
    pthread_mutex_unlock(&s->conns_lock);
}

/* The bytes of the rkeys of every live registration in a HELLO_ACK
 * (authenticated mode). Called with conns_lock. */
static size_t rkeys_len(const ucx_server *s)
{
    size_t n = 8;
    for (const ucx_reg *r = s->regs; r; r = r->next)
        n += kvpi_ucx_rkey_entry_size(r->rkey_len);
    return n;
}

static void rkeys_put(const ucx_server *s, uint8_t *at)
{
    uint64_t m = 0;
    uint8_t *p = at + 8;
    for (const ucx_reg *r = s->regs; r; r = r->next, m++)
        p = kvpi_ucx_rkey_entry_put(p, r->addr, r->length, r->rkey, r->rkey_len);
    kvpi_ucx_rkeys_count_put(at, m);
}

/* The answer to a HELLO of epoch, with the ranges deregistered since (and,
 * authenticated, the rkeys); adds c to the connections when it is OK.
 * Called with conns_lock. */
static uint8_t *hello_answer(ucx_server *s, ucx_conn *c, int paired, uint64_t epoch,
                             unsigned *status, size_t *len)
{
    uint64_t n = 0;
    if (!paired)
        *status = KVPI_UCX_HELLO_UNPAIRED;
    else if (epoch > s->epoch || s->epoch - epoch > KVPI_UCX_REVOKE_LOG)
        *status = KVPI_UCX_HELLO_STALE;
    else
        *status = KVPI_UCX_HELLO_OK, n = s->epoch - epoch;
    int keys = s->rt.auth && *status == KVPI_UCX_HELLO_OK;
    *len = kvpi_ucx_hello_ack_size(n, keys ? rkeys_len(s) : 0);
    uint8_t *ack = malloc(*len);
    if (!ack) return NULL;
    if (*status == KVPI_UCX_HELLO_OK) {
        c->id = ++s->next_id;
        c->next = s->conns;
        s->conns = c;
    }
    kvpi_ucx_hello_ack_put(ack, *status, n, c->id);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t e = (epoch + 1 + i) % KVPI_UCX_REVOKE_LOG;
        kvpi_ucx_range_put(ack + KVPI_UCX_HELLO_ACK_LEN + 16 * i, s->log[e].addr, s->log[e].length);
    }
    if (keys) rkeys_put(s, ack + KVPI_UCX_HELLO_ACK_LEN + 16 * n);
    return ack;
}

/* Refusals of initiators that do not prove the key, logged as the other
 * listeners' are: once, then counted (common/log.h). */
static kvpi_log_limit refusals;

/* Close c's endpoint once its last message went out; a closed endpoint
 * calls no error callback, so c can go. */
static void conn_drop(ucx_conn *c)
{
    ucp_request_param_t prm = {0};
    ucs_status_ptr_t r = ucp_ep_close_nbx(c->ep, &prm);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    free(c);
}

/* Answer a HELLO with a refusal (no connection id, no rkeys) and drop c. */
static void conn_refuse(ucx_conn *c, unsigned status)
{
    uint8_t ack[KVPI_UCX_HELLO_ACK_LEN];
    kvpi_ucx_hello_ack_put(ack, status, 0, 0);
    kvpi_ucx_am_send(c->ep, KVPI_UCX_AM_HELLO_ACK, ack, sizeof ack, 0);
    conn_drop(c);
}

/* Answer a HELLO (or, authenticated, a right PROOF) of epoch on c. */
static void conn_answer(ucx_server *s, ucx_conn *c, int paired, uint64_t epoch)
{
    unsigned status;
    size_t len;
    pthread_mutex_lock(&s->conns_lock);
    uint8_t *ack = hello_answer(s, c, paired, epoch, &status, &len);
    pthread_mutex_unlock(&s->conns_lock);
    /* Authenticated, eager however many rkeys it carries: the initiator
     * takes whole messages only (a rendezvous would be dropped). */
    uint32_t flags = s->rt.auth ? UCP_AM_SEND_FLAG_EAGER : 0;
    if (ack) kvpi_ucx_am_send(c->ep, KVPI_UCX_AM_HELLO_ACK, ack, len, flags);
    free(ack);
    if (ack && status == KVPI_UCX_HELLO_OK) return;
    if (ack)
        KVPI_INFO("ucx %s: refused an initiator (%s)", s->rt.segment,
                  status == KVPI_UCX_HELLO_STALE ? "its descriptor is too old"
                                                 : "its endpoint could not be paired");
    conn_drop(c);
}

/* Authenticated: answer an initiator's HELLO (key id kid, nonce nc) with
 * our nonce and our proof; it joins the connections once its own proof is
 * right (on_proof). */
static void challenge(ucx_server *s, ucx_conn *c, const uint8_t *kid, const uint8_t *nc,
                      uint64_t epoch)
{
    char hex[2 * KVPI_AUTH_KID_LEN + 1];
    sodium_bin2hex(hex, sizeof hex, kid, KVPI_AUTH_KID_LEN);
    if (s->n_chals >= s->max_chals) {
        kvpi_log_limited(&refusals, KVP_LOG_WARN, KVPI_LOG_SUBSYS,
                         "ucx %s: refused a connection: %d authentications are pending already "
                         "(max_connections)",
                         s->rt.segment, s->max_chals);
        conn_refuse(c, KVPI_UCX_HELLO_BUSY);
        return;
    }
    ucx_chal *ch = calloc(1, sizeof *ch);
    if (!ch) {
        conn_drop(c); /* the initiator's HELLO times out */
        return;
    }
    memcpy(ch->kid, kid, KVPI_AUTH_KID_LEN);
    memcpy(ch->nc, nc, KVPI_AUTH_NONCE_LEN);
    kvpi_auth_nonce(ch->ns);
    uint8_t mac[KVPI_AUTH_MAC_LEN], msg[KVPI_UCX_CHALLENGE_LEN];
    if (kvpi_auth_mac(s->rt.auth, kid, "server", KVPI_UCX_AUTH_CHANNEL, ch->nc, ch->ns, mac) != 0) {
        kvpi_log_limited(&refusals, KVP_LOG_WARN, KVPI_LOG_SUBSYS,
                         "ucx %s: refused a connection: the peer proves with key id %s, which "
                         "is not ours (%s): a different key",
                         s->rt.segment, hex, kvpi_auth_kid(s->rt.auth));
        free(ch);
        conn_refuse(c, KVPI_UCX_HELLO_AUTH_KEY);
        return;
    }
    ch->conn = c;
    ch->id = ++s->next_chal;
    ch->epoch = epoch;
    ch->deadline = kvpi_deadline_ns(s->rt.timeout_ms);
    kvpi_ucx_challenge_put(msg, KVPI_UCX_HELLO_OK, ch->id, ch->ns, mac);
    if (kvpi_ucx_am_send(c->ep, KVPI_UCX_AM_CHALLENGE, msg, sizeof msg, 0)) {
        free(ch);
        conn_drop(c);
        return;
    }
    ch->next = s->chals;
    s->chals = ch;
    s->n_chals++;
}

static ucs_status_t on_hello(void *arg, const void *header, size_t header_length, void *data,
                             size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    ucx_server *s = arg;
    kvpi_ucx_hello m;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        kvpi_ucx_hello_get(data, length, &m) || m.version != KVPI_UCX_VERSION) {
        KVPI_DEBUG("ucx %s: ignored a malformed HELLO (%zu bytes)", s->rt.segment, length);
        return UCS_OK;
    }
    int authed = m.kid != NULL;
    ucx_conn *c = calloc(1, sizeof *c);
    if (!c) return UCS_OK; /* the initiator's HELLO times out */
    c->server = s;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = (const ucp_address_t *)m.addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = conn_failed, .arg = c}};
    ucs_status_t ust = ucp_ep_create(s->rt.target.worker, &ep, &c->ep);
    if (ust != UCS_OK) {
        KVPI_WARN_LIMITED("ucx %s: cannot connect back to an initiator: %s", s->rt.segment,
                          ucs_status_string(ust));
        free(c);
        return UCS_OK;
    }
    int paired = c->ep == param->reply_ep;
    uint64_t epoch = m.epoch;
    if (s->rt.auth && !authed) {
        kvpi_log_limited(&refusals, KVP_LOG_WARN, KVPI_LOG_SUBSYS,
                         "ucx %s: refused a connection: the peer sent a HELLO without "
                         "authenticating (a kvpipe peer without the key)",
                         s->rt.segment);
        conn_refuse(c, KVPI_UCX_HELLO_AUTH_REQUIRED);
    } else if (authed && !s->rt.auth) {
        conn_refuse(c, KVPI_UCX_HELLO_AUTH_KEY); /* we hold no key at all */
    } else if (authed && !paired) {
        conn_refuse(c, KVPI_UCX_HELLO_UNPAIRED);
    } else if (authed) {
        challenge(s, c, m.kid, m.nonce, epoch);
    } else {
        conn_answer(s, c, paired, epoch);
    }
    return UCS_OK;
}

/* Authenticated: the initiator's answer to our CHALLENGE. It must come on
 * the endpoint the challenge went to and carry the client's MAC over both
 * nonces; only then does the initiator get its connection and the rkeys. */
static ucs_status_t on_proof(void *arg, const void *header, size_t header_length, void *data,
                             size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    ucx_server *s = arg;
    uint64_t id;
    const uint8_t *mac;
    if (!s->rt.auth || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        kvpi_ucx_proof_get(data, length, &id, &mac))
        return UCS_OK;
    ucx_chal **pc = &s->chals;
    while (*pc && ((*pc)->id != id || (*pc)->conn->ep != param->reply_ep))
        pc = &(*pc)->next;
    ucx_chal *ch = *pc;
    if (!ch) {
        KVPI_DEBUG("ucx %s: ignored a PROOF of no pending challenge", s->rt.segment);
        return UCS_OK;
    }
    *pc = ch->next;
    s->n_chals--;
    ucx_conn *c = ch->conn;
    int ok = kvpi_auth_mac_check(s->rt.auth, ch->kid, "client", KVPI_UCX_AUTH_CHANNEL, ch->nc,
                                 ch->ns, mac) == 0;
    if (!ok) {
        char hex[2 * KVPI_AUTH_KID_LEN + 1];
        sodium_bin2hex(hex, sizeof hex, ch->kid, KVPI_AUTH_KID_LEN);
        kvpi_log_limited(&refusals, KVP_LOG_WARN, KVPI_LOG_SUBSYS,
                         "ucx %s: refused a connection: the peer's proof does not match (key "
                         "id %s): a wrong or replayed handshake",
                         s->rt.segment, hex);
        conn_refuse(c, KVPI_UCX_HELLO_AUTH_PROOF);
    } else {
        conn_answer(s, c, 1, ch->epoch);
    }
    free(ch);
    return UCS_OK;
}

/* Drop challenges unanswered in time, and those whose endpoint failed. */
static unsigned expire_challenges(ucx_server *s)
{
    unsigned n = 0;
    uint64_t now = kvpi_now_ns();
    for (ucx_chal **pc = &s->chals; *pc;) {
        ucx_chal *ch = *pc;
        pthread_mutex_lock(&s->conns_lock);
        int dead = ch->conn->dead;
        pthread_mutex_unlock(&s->conns_lock);
        if (!dead && now < ch->deadline) {
            pc = &ch->next;
            continue;
        }
        *pc = ch->next;
        s->n_chals--;
        KVPI_DEBUG("ucx %s: an initiator did not answer its challenge%s", s->rt.segment,
                   dead ? " (its endpoint failed)" : " in time");
        kvpi_ucx_ep_close_force(ch->conn->ep);
        free(ch->conn);
        free(ch);
        n++;
    }
    return n;
}

static ucs_status_t on_revoke_ack(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    (void)param;
    ucx_server *s = arg;
    uint64_t id, serial;
    if (kvpi_ucx_revoke_ack_get(data, length, &id, &serial)) return UCS_OK;
    pthread_mutex_lock(&s->conns_lock);
    for (ucx_conn *c = s->conns; c; c = c->next)
        if (c->id == id && serial > c->acked) c->acked = serial;
    pthread_cond_broadcast(&s->conns_cond);
    pthread_mutex_unlock(&s->conns_lock);
    return UCS_OK;
}

static ucs_status_t on_bye(void *arg, const void *header, size_t header_length, void *data,
                           size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    (void)param;
    ucx_server *s = arg;
    uint64_t id;
    if (kvpi_ucx_bye_get(data, length, &id)) return UCS_OK;
    pthread_mutex_lock(&s->conns_lock);
    for (ucx_conn *c = s->conns; c; c = c->next)
        if (c->id == id) c->dead = 1; /* reap() closes it */
    pthread_cond_broadcast(&s->conns_cond);
    pthread_mutex_unlock(&s->conns_lock);
    return UCS_OK;
}

/* ---- the buffer pool's chunks ---- */

kvp_status kvpi_ucx_chunk_map(void *server, size_t length, void **addr)
{
    ucx_server *s = server;
    ucx_chunk *c = calloc(1, sizeof *c);
    if (!c) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    /* UCX picks the memory by UCX_ALLOC_PRIO: its shared memory (sysv,
     * posix) first where UCX_TLS lets it use it, else plain pages. */
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                             UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                               .address = NULL,
                               .length = length,
                               .flags = UCP_MEM_MAP_ALLOCATE};
    ucs_status_t st = ucp_mem_map(s->rt.ctx, &mp, &c->memh);
    ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
    if (st == UCS_OK && (st = ucp_mem_query(c->memh, &attr)) != UCS_OK)
        ucp_mem_unmap(s->rt.ctx, c->memh);
    if (st != UCS_OK) {
        free(c);
        return kvpi_error(st == UCS_ERR_NO_MEMORY ? KVP_ENOMEM : kvpi_ucx_status(st),
                          "ucx: allocating a pool chunk of %zu bytes (ucp_mem_map): %s", length,
                          ucs_status_string(st));
    }
    c->addr = (uint64_t)(uintptr_t)attr.address;
    c->length = length;
    pthread_mutex_lock(&s->chunks_lock);
    c->next = s->chunks;
    s->chunks = c;
    pthread_mutex_unlock(&s->chunks_lock);
    *addr = attr.address;
    return KVP_OK;
}

/* The link to the chunk at [addr, +length) exactly (*link NULL where there
 * is none). chunks_lock held. */
static ucx_chunk **chunk_link(ucx_server *s, uint64_t addr, uint64_t length)
{
    ucx_chunk **pc = &s->chunks;
    while (*pc && !((*pc)->addr == addr && (*pc)->length == length))
        pc = &(*pc)->next;
    return pc;
}

void kvpi_ucx_chunk_unmap(void *server, void *addr, size_t length)
{
    ucx_server *s = server;
    pthread_mutex_lock(&s->chunks_lock);
    ucx_chunk **pc = chunk_link(s, (uint64_t)(uintptr_t)addr, length);
    ucx_chunk *c = *pc;
    if (c) *pc = c->next;
    pthread_mutex_unlock(&s->chunks_lock);
    if (!c) {
        KVPI_ERROR("ucx: unmapping %zu bytes at %p that no chunk_map gave", length, addr);
        return;
    }
    ucp_mem_unmap(s->rt.ctx, c->memh);
    free(c);
}

/* ---- registrations ---- */

kvp_status kvpi_ucx_mem_reg(void *server, const kvpi_region *region, void **handle)
{
    ucx_server *s = server;
    ucx_reg *r = calloc(1, sizeof *r);
    if (!r) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    r->addr = region->addr;
    r->length = region->length;
    ucs_status_t st = UCS_OK;
    /* A pool chunk UCX allocated is registered already, and only its own
     * memory handle packs the rkey a same-host peer maps it with. */
    pthread_mutex_lock(&s->chunks_lock);
    ucx_chunk *chunk = *chunk_link(s, region->addr, region->length);
    pthread_mutex_unlock(&s->chunks_lock);
    if (chunk) {
        r->memh = chunk->memh;
        r->in_chunk = 1;
    } else {
        ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                                 UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                                   .address = (void *)(uintptr_t)region->addr,
                                   .length = region->length};
        st = ucp_mem_map(s->rt.ctx, &mp, &r->memh);
    }
    if (st != UCS_OK) {
        free(r);
        return kvpi_error(kvpi_ucx_status(st),
                          "ucx: ucp_mem_map of %" PRIu64 " bytes at 0x%" PRIx64 ": %s",
                          region->length, region->addr, ucs_status_string(st));
    }
    void *rkey;
    size_t rkey_len;
    if ((st = ucp_rkey_pack(s->rt.ctx, r->memh, &rkey, &rkey_len)) != UCS_OK) {
        if (!r->in_chunk) ucp_mem_unmap(s->rt.ctx, r->memh);
        free(r);
        return kvpi_error(kvpi_ucx_status(st), "ucx: ucp_rkey_pack: %s", ucs_status_string(st));
    }
    r->rkey_hex = kvpi_ucx_hex(rkey, rkey_len);
    r->rkey = malloc(rkey_len);
    if (r->rkey) memcpy(r->rkey, rkey, rkey_len);
    r->rkey_len = rkey_len;
    ucp_rkey_buffer_release(rkey);
    if (!r->rkey_hex || !r->rkey) {
        if (!r->in_chunk) ucp_mem_unmap(s->rt.ctx, r->memh);
        free(r->rkey_hex);
        free(r->rkey);
        free(r);
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    }
    /* From now on a HELLO_ACK hands its rkey out (authenticated mode): before
     * the region is in any descriptor. */
    pthread_mutex_lock(&s->conns_lock);
    r->next = s->regs;
    s->regs = r;
    pthread_mutex_unlock(&s->conns_lock);
    *handle = r;
    return KVP_OK;
}

/* A deregistration in progress. */
typedef struct ucx_dereg {
    ucx_reg *reg;
    uint64_t serial;  /* its REVOKE serial (= the epoch it ends) */
    uint64_t last_id; /* connections up to this id were told */
} ucx_dereg;

/* From now on a HELLO learns of the range from its answer; every connection
 * made before is sent a REVOKE. With the runtime's lock. */
static void dereg_begin(ucx_server *s, ucx_dereg *d)
{
    pthread_mutex_lock(&s->conns_lock);
    d->serial = ++s->epoch;
    s->log[d->serial % KVPI_UCX_REVOKE_LOG].addr = d->reg->addr;
    s->log[d->serial % KVPI_UCX_REVOKE_LOG].length = d->reg->length;
    d->last_id = s->next_id;
    for (ucx_reg **pr = &s->regs; *pr; pr = &(*pr)->next)
        if (*pr == d->reg) {
            *pr = d->reg->next; /* no HELLO_ACK hands its rkey out any more */
            break;
        }
    pthread_mutex_unlock(&s->conns_lock);
    uint8_t msg[KVPI_UCX_REVOKE_LEN];
    kvpi_ucx_revoke_put(msg, d->serial, d->reg->addr, d->reg->length);
    /* Only the lock's holder changes the list or a connection's endpoint. */
    for (ucx_conn *c = s->conns; c; c = c->next)
        if (!c->dead && c->ep) kvpi_ucx_am_send(c->ep, KVPI_UCX_AM_REVOKE, msg, sizeof msg, 0);
}

/* Is a connection told of d still to answer? conns_lock held. */
static int unanswered(const ucx_conn *c, const ucx_dereg *d)
{
    return c->id <= d->last_id && !c->dead && c->acked < d->serial;
}

static unsigned reap(ucx_server *s);

/* Cut off every connection that did not answer. With the runtime's lock. */
static void dereg_end(ucx_server *s, ucx_dereg *d)
{
    pthread_mutex_lock(&s->conns_lock);
    for (ucx_conn *c = s->conns; c; c = c->next)
        if (unanswered(c, d)) {
            KVPI_WARN_LIMITED("ucx %s: a peer did not confirm the deregistration of 0x%" PRIx64
                              " within %d ms: cut off",
                              s->rt.segment, d->reg->addr, s->rt.timeout_ms);
            c->dead = 1; /* reap() closes its endpoint */
        }
    pthread_mutex_unlock(&s->conns_lock);
    reap(s);
}

void kvpi_ucx_mem_dereg(void *server, void *handle)
{
    ucx_server *s = server;
    ucx_dereg d = {.reg = handle};
    pthread_mutex_lock(&s->dereg_lock);
    pthread_mutex_lock(&s->rt.lock);
    dereg_begin(s, &d);
    pthread_mutex_unlock(&s->rt.lock);
    struct timespec dl = kvpi_deadline_after_ms(s->rt.timeout_ms);
    pthread_mutex_lock(&s->conns_lock);
    for (;;) {
        int waiting = 0;
        for (ucx_conn *c = s->conns; c && !waiting; c = c->next)
            waiting = unanswered(c, &d);
        if (!waiting || pthread_cond_timedwait(&s->conns_cond, &s->conns_lock, &dl) == ETIMEDOUT)
            break;
    }
    pthread_mutex_unlock(&s->conns_lock);
    pthread_mutex_lock(&s->rt.lock);
    dereg_end(s, &d);
    pthread_mutex_unlock(&s->rt.lock);
    /* No peer can reach the memory now: those told refuse it and flushed,
     * the others are cut off. A pool chunk's memory handle stays until its
     * chunk_unmap. */
    if (!d.reg->in_chunk) ucp_mem_unmap(s->rt.ctx, d.reg->memh);
    free(d.reg->rkey_hex);
    free(d.reg->rkey);
    free(d.reg);
    pthread_mutex_unlock(&s->dereg_lock);
}

/* ---- descriptor ---- */

kvp_status kvpi_ucx_server_describe(void *server, cJSON *doc)
{
    ucx_server *s = server;
    pthread_mutex_lock(&s->conns_lock);
    double epoch = (double)s->epoch;
    pthread_mutex_unlock(&s->conns_lock);
    cJSON *o = cJSON_AddObjectToObject(doc, KVPI_UCX_FIELD);
    if (!o || !cJSON_AddNumberToObject(o, "version", KVPI_UCX_VERSION) ||
        !cJSON_AddStringToObject(o, "worker", s->rt.worker_hex) ||
        !cJSON_AddNumberToObject(o, "epoch", epoch) ||
        (s->rt.auth && !cJSON_AddTrueToObject(o, KVPI_UCX_AUTH_FIELD)) ||
        (s->rt.host_id[0] && (!cJSON_AddStringToObject(o, "host_id", s->rt.host_id) ||
                              !cJSON_AddNumberToObject(o, "pid", (double)getpid()))))
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    return KVP_OK;
}

kvp_status kvpi_ucx_buffer_describe(void *server, const kvpi_region *region, void *handle,
                                    cJSON *buffer)
{
    (void)region;
    ucx_server *s = server;
    ucx_reg *r = handle;
    if (s->rt.auth) return KVP_OK; /* rkeys go to authenticated initiators only */
    if (!cJSON_AddStringToObject(buffer, KVPI_UCX_RKEY_FIELD, r->rkey_hex))
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    return KVP_OK;
}

/* ---- start and stop ---- */

/* Close the endpoints of failed connections and forget them. */
static unsigned reap(ucx_server *s)
{
    ucx_conn *gone = NULL;
    pthread_mutex_lock(&s->conns_lock);
    for (ucx_conn **pc = &s->conns; *pc;) {
        ucx_conn *c = *pc;
        if (c->dead) {
            *pc = c->next;
            c->next = gone;
            gone = c;
        } else {
            pc = &c->next;
        }
    }
    pthread_mutex_unlock(&s->conns_lock);
    unsigned n = 0;
    for (ucx_conn *c = gone, *next; c; c = next, n++) {
        next = c->next;
        if (c->ep) kvpi_ucx_ep_close_force(c->ep);
        free(c);
    }
    return n;
}

/* The target worker's service, after each round of progress. */
static unsigned service(kvpi_ucx_poller *self)
{
    ucx_server *s = (ucx_server *)((char *)self - offsetof(kvpi_ucx_rt, target));
    return reap(s) + (s->chals ? expire_challenges(s) : 0);
}

static kvp_status set_handlers(ucx_server *s)
{
    kvp_status st;
    ucp_worker_h w = s->rt.target.worker;
    if ((st = kvpi_ucx_set_handler(w, KVPI_UCX_AM_HELLO, on_hello, s)) ||
        (st = kvpi_ucx_set_handler(w, KVPI_UCX_AM_BYE, on_bye, s)) ||
        (st = kvpi_ucx_set_handler(w, KVPI_UCX_AM_PROOF, on_proof, s)))
        return st;
    return kvpi_ucx_set_handler(w, KVPI_UCX_AM_REVOKE_ACK, on_revoke_ack, s);
}

kvp_status kvpi_ucx_server_start(const kvpi_server_ctx *ctx, void **server)
{
    ucx_server *s = calloc(1, sizeof *s);
    if (!s) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    pthread_mutex_init(&s->conns_lock, NULL);
    pthread_mutex_init(&s->dereg_lock, NULL);
    pthread_mutex_init(&s->chunks_lock, NULL);
    kvpi_cond_init(&s->conns_cond);
    s->max_chals = ctx->max_conns > 0 ? ctx->max_conns : CHALLENGES_DEFAULT;
    kvp_status st = kvpi_ucx_rt_start(&s->rt, ctx, service);
    if (!st) st = set_handlers(s);
    if (!st) st = kvpi_ucx_rt_run(&s->rt);
    if (st) {
        kvpi_ucx_server_stop(s);
        return st;
    }
    *server = s;
    return KVP_OK;
}

void kvpi_ucx_server_stop(void *server)
{
    ucx_server *s = server;
    if (!s) return;
    kvpi_ucx_rt_halt(&s->rt);
    /* The thread is gone; every peer was closed and every region
     * deregistered before: what is left are the connections from
     * initiators. */
    for (ucx_conn *c = s->conns, *next; c; c = next) {
        next = c->next;
        if (c->ep) kvpi_ucx_ep_close_force(c->ep);
        free(c);
    }
    s->conns = NULL; /* the handlers still run while the worker drains */
    for (ucx_chal *ch = s->chals, *next; ch; ch = next) {
        next = ch->next;
        kvpi_ucx_ep_close_force(ch->conn->ep);
        free(ch->conn);
        free(ch);
    }
    s->chals = NULL;
    kvpi_ucx_rt_free(&s->rt);
    pthread_cond_destroy(&s->conns_cond);
    pthread_mutex_destroy(&s->chunks_lock);
    pthread_mutex_destroy(&s->dereg_lock);
    pthread_mutex_destroy(&s->conns_lock);
    free(s);
}
