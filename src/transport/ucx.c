/* The ucx transport: one-sided RMA through UCX's UCP API (rdma and ucx
 * protocols).
 *
 * This file is the initiator side and the ops table; ucx_server.c is the
 * target side. A peer gets its own UCP worker (so that UCP pairs the endpoint
 * its target makes back to it, see ucx_internal.h) with one endpoint to the
 * target's published worker, and the target's packed rkeys unpacked on it.
 * A transfer issues ucp_get_nbx/ucp_put_nbx for its slices (and one flush for
 * writes, so that they completed at the target) and waits, within its
 * deadline, for the server's progress thread to complete them; a transfer
 * out of time closes the endpoint, which cancels what is in flight, and the
 * engine looks the peer up again. A REVOKE from the target refuses its range
 * from then on and is acknowledged once what was issued before is flushed.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "transport/ucx_internal.h"

/* How long closing a healthy endpoint may take before it is forced. */
#define CLOSE_MS 1000

/* A REVOKE being answered; only the progress thread touches it. */
typedef struct ucx_revoke {
    struct ucx_revoke *next;
    uint64_t serial, addr, length;
    int marked;          /* the range is refused from now on */
    atomic_int flushed;  /* what was issued before has completed */
} ucx_revoke;

typedef struct ucx_peer {
    kvpi_ucx_pollee poll; /* first: the progress thread hands it back */
    kvpi_ucx_server *server;
    char *segment;
    ucp_worker_h worker;
    int timeout_ms;
    uint64_t min_rate;

    /* Issuing a request reads these; a revocation or closing the endpoint
     * writes them. */
    pthread_rwlock_t rw;
    ucp_ep_h ep; /* NULL once closed after a timeout */
    size_t n_regions;
    kvpi_region *regions;
    ucp_rkey_h *rkeys;
    unsigned char *revoked;

    atomic_int ep_status; /* ucs_status_t the endpoint failed with; 0 while fine */
    atomic_int timed_out; /* we closed the endpoint after a deadline passed */

    pthread_mutex_t lock; /* the HELLO's answer */
    pthread_cond_t answered;
    int hello_done;
    unsigned hello_status;
    uint64_t conn_id;
    uint64_t *ranges; /* deregistered since our descriptor: addr, length pairs */
    size_t n_ranges;

    ucx_revoke *revokes, **revokes_tail;
} ucx_peer;

/* One peer_xfer call's requests, shared with their callbacks: it outlives the
 * call if a request completes after the call gave up on it. */
typedef struct ucx_xfer ucx_xfer;
typedef struct ucx_item {
    ucx_xfer *x;
    ucs_status_t status;
    int refused; /* never issued: REFUSED_* */
} ucx_item;

enum { REFUSED_OUTSIDE = 1, REFUSED_REVOKED = 2 };

struct ucx_xfer {
    pthread_mutex_t lock;
    pthread_cond_t done;
    kvpi_ucx_server *server;
    int pending; /* requests not completed */
    int refs;    /* the call, and each pending request */
    ucx_item flush;
    ucx_item items[];
};

static void xfer_put(ucx_xfer *x)
{
    pthread_mutex_lock(&x->lock);
    int last = --x->refs == 0;
    pthread_mutex_unlock(&x->lock);
    if (!last) return;
    pthread_cond_destroy(&x->done);
    pthread_mutex_destroy(&x->lock);
    free(x);
}

static void request_done(void *request, ucs_status_t st, void *user_data)
{
    ucx_item *it = user_data;
    ucx_xfer *x = it->x;
    pthread_mutex_lock(&x->lock);
    it->status = st;
    if (--x->pending == 0) pthread_cond_broadcast(&x->done);
    pthread_mutex_unlock(&x->lock);
    kvpi_ucx_busy_add(x->server, -1);
    ucp_request_free(request);
    xfer_put(x);
}

/* Account for a request just issued: r is what ucp_*_nbx returned. The
 * request was counted as pending before it was issued, so that its callback
 * can run at once. */
static void issued(ucx_xfer *x, ucx_item *it, ucs_status_ptr_t r)
{
    if (UCS_PTR_IS_PTR(r)) return;
    pthread_mutex_lock(&x->lock);
    it->status = UCS_PTR_STATUS(r);
    x->pending--;
    x->refs--;
    pthread_mutex_unlock(&x->lock);
    kvpi_ucx_busy_add(x->server, -1);
}

static void expect(ucx_xfer *x, ucx_item *it)
{
    it->x = x;
    it->status = UCS_INPROGRESS;
    pthread_mutex_lock(&x->lock);
    x->pending++;
    x->refs++;
    pthread_mutex_unlock(&x->lock);
    kvpi_ucx_busy_add(x->server, 1);
}

/* ---- the peer's endpoint and control messages ---- */

static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)ep;
    ucx_peer *p = arg;
    int fine = 0;
    if (atomic_compare_exchange_strong(&p->ep_status, &fine, (int)st))
        KVPI_DEBUG("ucx peer %s: endpoint failed: %s", p->segment, ucs_status_string(st));
    pthread_mutex_lock(&p->lock);
    pthread_cond_broadcast(&p->answered);
    pthread_mutex_unlock(&p->lock);
}

static ucs_status_t on_hello_ack(void *arg, const void *header, size_t header_length,
                                 void *data, size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    (void)param;
    ucx_peer *p = arg;
    const uint8_t *d = data;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length < KVPI_UCX_HELLO_ACK_LEN ||
        (uint32_t)kvpi_get_le64(d) != KVPI_UCX_MAGIC)
        return UCS_OK;
    uint64_t w0 = kvpi_get_le64(d);
    size_t n = (size_t)(w0 >> 48);
    if (length != KVPI_UCX_HELLO_ACK_LEN + 16 * n) return UCS_OK;
    pthread_mutex_lock(&p->lock);
    if (!p->hello_done) {
        p->hello_status = (unsigned)(w0 >> 32 & 0xffff);
        p->conn_id = kvpi_get_le64(d + 8);
        p->ranges = n ? malloc(16 * n) : NULL;
        for (size_t i = 0; p->ranges && i < 2 * n; i++)
            p->ranges[i] = kvpi_get_le64(d + 16 + 8 * i);
        p->n_ranges = p->ranges ? n : 0;
        /* Without room for the ranges, refuse them all: stale. */
        if (n && !p->ranges) p->hello_status = KVPI_UCX_HELLO_STALE;
        p->hello_done = 1;
        pthread_cond_broadcast(&p->answered);
    }
    pthread_mutex_unlock(&p->lock);
    return UCS_OK;
}

static ucs_status_t on_revoke(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    (void)param;
    ucx_peer *p = arg;
    const uint8_t *d = data;
    if (length != KVPI_UCX_REVOKE_LEN || (uint32_t)kvpi_get_le64(d) != KVPI_UCX_MAGIC)
        return UCS_OK;
    ucx_revoke *rv = calloc(1, sizeof *rv);
    if (!rv) {
        /* Unanswered, the target cuts us off: safe, if abrupt. */
        KVPI_ERROR("ucx peer %s: out of memory for a revocation", p->segment);
        return UCS_OK;
    }
    rv->serial = kvpi_get_le64(d + 8);
    rv->addr = kvpi_get_le64(d + 16);
    rv->length = kvpi_get_le64(d + 24);
    *p->revokes_tail = rv;
    p->revokes_tail = &rv->next;
    return UCS_OK;
}

/* Refuse every region of ours that overlaps [addr, addr+length); rw held. */
static void revoke_range(ucx_peer *p, uint64_t addr, uint64_t length)
{
    for (size_t i = 0; i < p->n_regions; i++)
        if (p->regions[i].addr < addr + length && addr < p->regions[i].addr + p->regions[i].length)
            p->revoked[i] = 1;
}

static void revoke_flushed(void *request, ucs_status_t st, void *user_data)
{
    (void)st;
    ucx_revoke *rv = user_data;
    atomic_store(&rv->flushed, 1);
    ucp_request_free(request);
}

/* On the progress thread, outside progress: answer the REVOKEs that came. */
static unsigned peer_service(kvpi_ucx_pollee *poll)
{
    ucx_peer *p = (ucx_peer *)poll;
    unsigned did = 0;
    for (ucx_revoke *rv = p->revokes; rv; rv = rv->next) {
        if (rv->marked) continue;
        /* Once the write lock is ours, every request that passed the check
         * has been issued, so the flush that follows covers it. */
        pthread_rwlock_wrlock(&p->rw);
        revoke_range(p, rv->addr, rv->length);
        pthread_rwlock_unlock(&p->rw);
        rv->marked = 1;
        pthread_rwlock_rdlock(&p->rw);
        ucs_status_ptr_t r = NULL;
        if (p->ep && !atomic_load(&p->ep_status)) {
            ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                       UCP_OP_ATTR_FIELD_USER_DATA,
                                       .cb.send = revoke_flushed,
                                       .user_data = rv};
            r = ucp_ep_flush_nbx(p->ep, &prm);
        }
        pthread_rwlock_unlock(&p->rw);
        if (!UCS_PTR_IS_PTR(r)) atomic_store(&rv->flushed, 1);
        did++;
    }
    /* In order, so that the target may read an acknowledgement as covering
     * every earlier serial. */
    while (p->revokes && atomic_load(&p->revokes->flushed)) {
        ucx_revoke *rv = p->revokes;
        uint8_t msg[KVPI_UCX_REVOKE_ACK_LEN];
        kvpi_put_le64(msg, KVPI_UCX_MAGIC);
        kvpi_put_le64(msg + 8, p->conn_id);
        kvpi_put_le64(msg + 16, rv->serial);
        pthread_rwlock_rdlock(&p->rw);
        if (p->ep && !atomic_load(&p->ep_status))
            kvpi_ucx_am_send(p->ep, KVPI_UCX_AM_REVOKE_ACK, msg, sizeof msg, 0);
        pthread_rwlock_unlock(&p->rw);
        KVPI_DEBUG("ucx peer %s: revoked 0x%" PRIx64 "+%" PRIu64, p->segment, rv->addr,
                   rv->length);
        if (!(p->revokes = rv->next)) p->revokes_tail = &p->revokes;
        free(rv);
        did++;
    }
    return did;
}

/* ---- opening and closing ---- */

/* Close the endpoint: politely (flushing) within CLOSE_MS, else by force
 * when the worker is destroyed. The progress thread no longer serves the
 * worker, so this thread progresses it. */
static void ep_close(ucx_peer *p)
{
    if (!p->ep) return;
    if (atomic_load(&p->ep_status)) {
        kvpi_ucx_ep_close_force(p->ep);
        p->ep = NULL;
        return;
    }
    ucp_request_param_t prm = {0};
    ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep, &prm);
    p->ep = NULL;
    if (!UCS_PTR_IS_PTR(r)) return;
    uint64_t dl = kvpi_deadline_ns(CLOSE_MS);
    while (ucp_request_check_status(r) == UCS_INPROGRESS && kvpi_now_ns() < dl)
        ucp_worker_progress(p->worker);
    ucp_request_free(r);
}

static void peer_close(void *peer)
{
    ucx_peer *p = peer;
    if (!p) return;
    if (p->poll.worker) kvpi_ucx_poll_remove(p->server, &p->poll);
    for (size_t i = 0; p->rkeys && i < p->n_regions; i++)
        if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
    ep_close(p);
    if (p->worker) {
        while (ucp_worker_progress(p->worker)) {
        }
        ucp_worker_destroy(p->worker);
    }
    for (ucx_revoke *rv = p->revokes, *next; rv; rv = next) {
        next = rv->next;
        free(rv);
    }
    pthread_cond_destroy(&p->answered);
    pthread_mutex_destroy(&p->lock);
    pthread_rwlock_destroy(&p->rw);
    free(p->ranges);
    free(p->revoked);
    free(p->rkeys);
    free(p->regions);
    free(p->segment);
    free(p);
}

/* The target's worker address and epoch, from its "ucx" field. */
static kvp_status parse_endpoint(const kvpi_peer_ctx *ctx, void **addr, size_t *len,
                                 uint64_t *epoch)
{
    const cJSON *o = ctx->desc ? cJSON_GetObjectItemCaseSensitive(ctx->desc, KVPI_UCX_FIELD) : NULL;
    if (!cJSON_IsObject(o))
        return kvpi_error(KVP_ENOTSUP, "ucx: segment %s publishes no '%s' endpoint (a Mooncake "
                          "peer, or a kvpipe engine built without UCX)", ctx->segment,
                          KVPI_UCX_FIELD);
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(o, "version");
    const cJSON *worker = cJSON_GetObjectItemCaseSensitive(o, "worker");
    const cJSON *ep = cJSON_GetObjectItemCaseSensitive(o, "epoch");
    if (!cJSON_IsNumber(ver) || !cJSON_IsString(worker) || !cJSON_IsNumber(ep) ||
        ep->valuedouble < 0 || ep->valuedouble > 9007199254740992.0)
        return kvpi_error(KVP_EPROTO, "ucx: segment %s: malformed '%s' field", ctx->segment,
                          KVPI_UCX_FIELD);
    if (ver->valuedouble != KVPI_UCX_VERSION)
        return kvpi_error(KVP_ENOTSUP, "ucx: segment %s speaks ucx version %g, we speak %d",
                          ctx->segment, ver->valuedouble, KVPI_UCX_VERSION);
    kvp_status st = kvpi_ucx_unhex(worker->valuestring, addr, len);
    if (st)
        return kvpi_error(st, "ucx: segment %s: its worker address is not hex", ctx->segment);
    *epoch = (uint64_t)ep->valuedouble;
    return KVP_OK;
}

/* Unpack every buffer's rkey on the endpoint. */
static kvp_status unpack_rkeys(ucx_peer *p, const kvpi_peer_ctx *ctx)
{
    for (size_t i = 0; i < p->n_regions; i++) {
        const cJSON *k = ctx->buffers && ctx->buffers[i]
                             ? cJSON_GetObjectItemCaseSensitive(ctx->buffers[i], KVPI_UCX_RKEY_FIELD)
                             : NULL;
        if (!cJSON_IsString(k))
            return kvpi_error(KVP_ENOTSUP, "ucx: segment %s: buffer 0x%" PRIx64 " has no '%s'",
                              ctx->segment, p->regions[i].addr, KVPI_UCX_RKEY_FIELD);
        void *buf;
        size_t len;
        kvp_status st = kvpi_ucx_unhex(k->valuestring, &buf, &len);
        if (st)
            return kvpi_error(st, "ucx: segment %s: buffer 0x%" PRIx64 ": rkey is not hex",
                              ctx->segment, p->regions[i].addr);
        ucs_status_t ust = ucp_ep_rkey_unpack(p->ep, buf, &p->rkeys[i]);
        free(buf);
        if (ust != UCS_OK)
            return kvpi_error(KVP_EPROTO, "ucx: segment %s: buffer 0x%" PRIx64
                              ": ucp_ep_rkey_unpack: %s", ctx->segment, p->regions[i].addr,
                              ucs_status_string(ust));
    }
    return KVP_OK;
}

/* Say HELLO and wait for the answer, within the peer's timeout. */
static kvp_status hello(ucx_peer *p, uint64_t epoch)
{
    ucp_address_t *addr;
    size_t len;
    ucs_status_t ust = ucp_worker_get_address(p->worker, &addr, &len);
    if (ust != UCS_OK)
        return kvpi_error(kvpi_ucx_status(ust), "ucx: ucp_worker_get_address: %s",
                          ucs_status_string(ust));
    uint8_t *msg = malloc(KVPI_UCX_HELLO_LEN + len);
    if (!msg) {
        ucp_worker_release_address(p->worker, addr);
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    }
    kvpi_put_le64(msg, KVPI_UCX_MAGIC | (uint64_t)KVPI_UCX_VERSION << 32);
    kvpi_put_le64(msg + 8, epoch);
    memcpy(msg + KVPI_UCX_HELLO_LEN, addr, len);
    ucp_worker_release_address(p->worker, addr);
    kvpi_ucx_busy_add(p->server, 1);
    kvp_status st = kvpi_ucx_am_send(p->ep, KVPI_UCX_AM_HELLO, msg, KVPI_UCX_HELLO_LEN + len,
                                     UCP_AM_SEND_FLAG_REPLY);
    free(msg);
    struct timespec dl = kvpi_deadline_after_ms(p->timeout_ms);
    pthread_mutex_lock(&p->lock);
    while (!st && !p->hello_done && !atomic_load(&p->ep_status))
        if (pthread_cond_timedwait(&p->answered, &p->lock, &dl) == ETIMEDOUT) break;
    int done = p->hello_done;
    pthread_mutex_unlock(&p->lock);
    kvpi_ucx_busy_add(p->server, -1);
    if (st) return st;
    int failed = atomic_load(&p->ep_status);
    if (!done && failed)
        return kvpi_error(KVP_ECONNREFUSED, "ucx: segment %s cannot be reached: %s", p->segment,
                          ucs_status_string((ucs_status_t)failed));
    if (!done)
        return kvpi_error(KVP_ETIMEDOUT, "ucx: segment %s did not answer within %d ms",
                          p->segment, p->timeout_ms);
    if (p->hello_status == KVPI_UCX_HELLO_STALE)
        return kvpi_error(KVP_ECONNRESET, "ucx: segment %s: the descriptor read is older than "
                          "its last %d deregistrations (the next transfer looks it up again)",
                          p->segment, KVPI_UCX_REVOKE_LOG);
    if (p->hello_status != KVPI_UCX_HELLO_OK)
        return kvpi_error(KVP_ENOTSUP, "ucx: segment %s could not pair our endpoint with its own",
                          p->segment);
    for (size_t i = 0; i < p->n_ranges; i++)
        revoke_range(p, p->ranges[2 * i], p->ranges[2 * i + 1]);
    return KVP_OK;
}

static kvp_status peer_init(ucx_peer *p, const kvpi_peer_ctx *ctx)
{
    p->server = ctx->server;
    p->timeout_ms = ctx->timeout_ms > 0 ? ctx->timeout_ms : KVPI_CONN_TIMEOUT_MS_DEFAULT;
    p->min_rate = ctx->min_rate ? ctx->min_rate : KVPI_MIN_RATE_DEFAULT;
    p->n_regions = ctx->n_regions;
    p->revokes_tail = &p->revokes;
    size_t n = ctx->n_regions ? ctx->n_regions : 1;
    if (!(p->segment = strdup(ctx->segment ? ctx->segment : "?")) ||
        !(p->regions = calloc(n, sizeof *p->regions)) || !(p->rkeys = calloc(n, sizeof *p->rkeys)) ||
        !(p->revoked = calloc(n, 1)))
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    for (size_t i = 0; i < ctx->n_regions; i++) {
        p->regions[i].addr = ctx->regions[i].addr;
        p->regions[i].length = ctx->regions[i].length;
    }
    return KVP_OK;
}

static kvp_status peer_connect(ucx_peer *p, const void *addr)
{
    kvp_status st = kvpi_ucx_worker_create(p->server, &p->worker);
    if (st) return st;
    if ((st = kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_HELLO_ACK, on_hello_ack, p)) ||
        (st = kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_REVOKE, on_revoke, p)))
        return st;
    p->poll.worker = p->worker;
    p->poll.service = peer_service;
    if ((st = kvpi_ucx_poll_add(p->server, &p->poll))) {
        p->poll.worker = NULL;
        return st;
    }
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_failed, .arg = p}};
    ucs_status_t ust = ucp_ep_create(p->worker, &ep, &p->ep);
    if (ust != UCS_OK) {
        p->ep = NULL;
        /* No transport of ours reaches any of the target's (UCX_TLS). */
        return kvpi_error(ust == UCS_ERR_UNREACHABLE ? KVP_ENOTSUP : kvpi_ucx_status(ust),
                          "ucx: no endpoint to segment %s: %s (UCX_TLS=%s)", p->segment,
                          ucs_status_string(ust), getenv("UCX_TLS") ? getenv("UCX_TLS") : "all");
    }
    return KVP_OK;
}

static kvp_status peer_open(const kvpi_peer_ctx *ctx, void **out)
{
    if (!ctx->server)
        return kvpi_error(KVP_ENOTSUP, "ucx: this engine's ucx transport did not start");
    void *addr = NULL;
    size_t len = 0;
    uint64_t epoch = 0;
    kvp_status st = parse_endpoint(ctx, &addr, &len, &epoch);
    if (st) return st;
    ucx_peer *p = calloc(1, sizeof *p);
    if (!p) {
        free(addr);
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    }
    pthread_rwlock_init(&p->rw, NULL);
    pthread_mutex_init(&p->lock, NULL);
    kvpi_cond_init(&p->answered);
    if (!(st = peer_init(p, ctx)) && !(st = peer_connect(p, addr)) && !(st = unpack_rkeys(p, ctx)))
        st = hello(p, epoch);
    free(addr);
    if (st) {
        char why[512]; /* the teardown below may log */
        snprintf(why, sizeof why, "%s", kvp_last_error());
        peer_close(p);
        return kvpi_error(st, "%s", why);
    }
    *out = p;
    return KVP_OK;
}

/* ---- transfers ---- */

static kvp_status slice_status(const ucx_peer *p, ucs_status_t st)
{
    if (st == UCS_OK) return KVP_OK;
    if (st == UCS_ERR_CANCELED || st == UCS_INPROGRESS)
        return atomic_load(&p->timed_out) ? KVP_ETIMEDOUT : KVP_ECONNRESET;
    kvp_status k = kvpi_ucx_status(st);
    return k == KVP_EIO || k == KVP_ECONNREFUSED ? KVP_ECONNRESET : k;
}

/* Issue every slice that may go; rw is held. Returns whether writes went. */
static int issue(ucx_peer *p, ucx_xfer *x, kvpi_slice *const *slices, size_t n)
{
    int writes = 0;
    for (size_t i = 0; i < n; i++) {
        kvpi_slice *s = slices[i];
        ucx_item *it = &x->items[i];
        size_t r = s->remote_region;
        if (r >= p->n_regions ||
            !kvpi_regions_contain(&p->regions[r], 1, s->remote, (uint64_t)s->length)) {
            it->refused = REFUSED_OUTSIDE; /* the engine checked before: defence in depth */
            continue;
        }
        if (p->revoked[r]) {
            it->refused = REFUSED_REVOKED;
            continue;
        }
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                   UCP_OP_ATTR_FIELD_USER_DATA,
                                   .cb.send = request_done,
                                   .user_data = it};
        expect(x, it);
        ucs_status_ptr_t q =
            s->opcode == KVP_OP_READ
                ? ucp_get_nbx(p->ep, s->local, s->length, s->remote, p->rkeys[r], &prm)
                : ucp_put_nbx(p->ep, s->local, s->length, s->remote, p->rkeys[r], &prm);
        issued(x, it, q);
        writes |= s->opcode == KVP_OP_WRITE;
    }
    if (writes) {
        /* A put completes when its buffer may be reused; the flush, when the
         * target has the bytes. */
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                                   UCP_OP_ATTR_FIELD_USER_DATA,
                                   .cb.send = request_done,
                                   .user_data = &x->flush};
        expect(x, &x->flush);
        issued(x, &x->flush, ucp_ep_flush_nbx(p->ep, &prm));
    }
    return writes;
}

/* Out of time: close the endpoint, which completes what is in flight with
 * UCS_ERR_CANCELED; the engine then looks the segment up again. */
static void cut(ucx_peer *p)
{
    pthread_rwlock_wrlock(&p->rw);
    if (p->ep) {
        atomic_store(&p->timed_out, 1);
        kvpi_ucx_ep_close_force(p->ep);
        p->ep = NULL;
    }
    pthread_rwlock_unlock(&p->rw);
}

static kvp_status peer_xfer(void *peer, kvpi_slice *const *slices, size_t n)
{
    ucx_peer *p = peer;
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; i++)
        bytes += slices[i]->length;
    uint64_t budget_ms = (uint64_t)p->timeout_ms + bytes * 1000u / p->min_rate;
    uint64_t deadline = kvpi_now_ns() + budget_ms * 1000000u;
    ucx_xfer *x = calloc(1, sizeof *x + n * sizeof x->items[0]);
    if (!x) {
        for (size_t i = 0; i < n; i++)
            slices[i]->status = KVP_ENOMEM;
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    }
    pthread_mutex_init(&x->lock, NULL);
    kvpi_cond_init(&x->done);
    x->server = p->server;
    x->refs = 1;
    x->flush.status = UCS_OK;
    int writes = 0, closed;
    pthread_rwlock_rdlock(&p->rw);
    closed = !p->ep || atomic_load(&p->ep_status);
    if (!closed) writes = issue(p, x, slices, n);
    pthread_rwlock_unlock(&p->rw);
    if (closed) {
        for (size_t i = 0; i < n; i++)
            x->items[i].status = UCS_ERR_CANCELED;
    }
    pthread_mutex_lock(&x->lock);
    struct timespec dl = kvpi_timespec_at_ns(deadline);
    while (x->pending > 0 && kvpi_now_ns() < deadline)
        pthread_cond_timedwait(&x->done, &x->lock, &dl);
    int late = x->pending > 0;
    pthread_mutex_unlock(&x->lock);
    if (late) cut(p);
    kvp_status conn = KVP_OK;
    pthread_mutex_lock(&x->lock);
    for (size_t i = 0; i < n; i++) {
        ucs_status_t st = x->items[i].status;
        if (st == UCS_OK && writes && slices[i]->opcode == KVP_OP_WRITE) st = x->flush.status;
        kvp_status k;
        if (x->items[i].refused == REFUSED_REVOKED)
            k = kvpi_error(KVP_ERANGE, "ucx: segment %s deregistered the buffer of 0x%" PRIx64,
                           p->segment, slices[i]->remote);
        else if (x->items[i].refused == REFUSED_OUTSIDE)
            k = kvpi_error(KVP_ERANGE, "ucx: 0x%" PRIx64 "+%zu lies outside segment %s's buffer",
                           slices[i]->remote, slices[i]->length, p->segment);
        else
            k = slice_status(p, st);
        slices[i]->status = k;
        if (k == KVP_ECONNRESET || k == KVP_ETIMEDOUT) conn = k;
    }
    pthread_mutex_unlock(&x->lock);
    xfer_put(x);
    if (conn == KVP_ETIMEDOUT)
        return kvpi_error(conn, "ucx: segment %s: %" PRIu64 " bytes not done within %" PRIu64
                          " ms", p->segment, bytes, budget_ms);
    if (conn) {
        int st = atomic_load(&p->ep_status);
        return kvpi_error(conn, "ucx: segment %s: %s", p->segment,
                          st ? ucs_status_string((ucs_status_t)st) : "endpoint closed");
    }
    return KVP_OK;
}

const kvpi_transport_ops kvpi_transport_ucx = {
    .name = "ucx",
    .caps = KVPI_CAP_RDMA,
    .mem_kinds = KVPI_MEM_HOST_BIT,
    .group_bytes = (size_t)16 << 20,
    .server_start = kvpi_ucx_server_start,
    .server_stop = kvpi_ucx_server_stop,
    .server_describe = kvpi_ucx_server_describe,
    .buffer_describe = kvpi_ucx_buffer_describe,
    .mem_reg = kvpi_ucx_mem_reg,
    .mem_dereg = kvpi_ucx_mem_dereg,
    .peer_open = peer_open,
    .peer_xfer = peer_xfer,
    .peer_close = peer_close,
};
