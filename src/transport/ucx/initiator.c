/* The ucx transport: one-sided RMA through UCX's UCP API (protocols rdma and
 * ucx). This file is the initiator's side - opening and closing peers (a
 * worker and an endpoint each, transfer.h), their control messages (the
 * HELLO exchange, REVOKEs) - and the ops table; transfer.c moves the bytes,
 * target.c serves, runtime.c progresses.
 *
 * A REVOKE from the target refuses its range from then on and is
 * acknowledged once what was issued before is flushed. In the authenticated
 * mode the descriptor has no rkeys: the HELLO runs a challenge-response (we
 * check the target's MAC over our fresh nonce before we send ours) and the
 * rkeys come with its answer.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVPI_LOG_SUBSYS "ucx"
#include "common/clock.h"
#include "common/conn_server.h"
#include "common/error.h"
#include "common/log.h"
#include "transport/ucx/target.h"
#include "transport/ucx/transfer.h"
#include "transport/ucx/ucx.h"
#include "transport/ucx/wire.h"

/* ---- the peer's endpoint and control messages (the runtime's lock) ---- */

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

/* Statuses of the HELLO exchange this side decides (the target's are
 * KVPI_UCX_HELLO_*). */
enum { HELLO_IMPOSTOR = 0x100, HELLO_BAD_RKEY = 0x101 };

/* The HELLO exchange ended with status. */
static void hello_finish(ucx_peer *p, unsigned status)
{
    p->awaiting_hello = 0;
    pthread_mutex_lock(&p->lock);
    p->hello_status = status;
    p->hello_done = 1;
    pthread_cond_broadcast(&p->answered);
    pthread_mutex_unlock(&p->lock);
}

/* Authenticated: unpack the rkeys of a HELLO_ACK (m entries from d, end
 * at end) for the regions of our descriptor; a region without one is
 * refused (it is not registered there any more, or again with another
 * length; the engine looks the segment up again). 0, or -1 when the list is
 * malformed or UCX refuses an rkey. */
static int take_rkeys(ucx_peer *p, const uint8_t *d, const uint8_t *end)
{
    kvpi_ucx_rkey_iter it;
    if (kvpi_ucx_rkeys_begin(d, end, &it)) return -1;
    pthread_rwlock_wrlock(&p->map_lock);
    for (size_t i = 0; i < p->n_regions; i++)
        p->revoked[i] = p->revoked[i] ? p->revoked[i] : KVPI_UCX_REVOKED_NO_RKEY;
    uint64_t addr, len;
    const uint8_t *key;
    size_t klen;
    int r;
    while ((r = kvpi_ucx_rkeys_next(&it, &addr, &len, &key, &klen)) == 1) {
        for (size_t i = 0; i < p->n_regions; i++) {
            if (p->regions[i].addr != addr || p->regions[i].length != len || p->rkeys[i]) continue;
            ucs_status_t ust = ucp_ep_rkey_unpack(p->ep, key, &p->rkeys[i]);
            if (ust != UCS_OK) {
                p->rkeys[i] = NULL;
                KVPI_DEBUG("ucx peer %s: buffer 0x%" PRIx64 ": ucp_ep_rkey_unpack: %s", p->segment,
                           addr, ucs_status_string(ust));
                r = -1;
                goto out;
            }
            kvpi_ucx_find_mapping(p, i);
            if (p->revoked[i] == KVPI_UCX_REVOKED_NO_RKEY) p->revoked[i] = 0;
        }
    }
out:
    pthread_rwlock_unlock(&p->map_lock);
    return r;
}

/* Not authenticated: unpack the descriptor's rkeys, once the HELLO's answer
 * refused the ranges deregistered since the descriptor was made. Those are
 * left packed: over UCX's shared memory the rkey of a pool chunk names its
 * segment, which the target removes once the chunk is given back, and UCX
 * 1.13 takes SIGSEGV on the failed unpack (it releases the parts it never
 * unpacked, ucp_ep_rkey_unpack -> ucp_rkey_destroy). A range deregistered
 * later is REVOKEd on this connection, after this answer, and the target
 * unmaps it only once we answered, or cut us off. 0, or -1 when UCX refuses
 * an rkey. Under the runtime's lock, and no transfer has p yet (its open
 * waits for this answer). */
static int unpack_rkeys(ucx_peer *p)
{
    for (size_t i = 0; i < p->n_regions; i++) {
        if (p->revoked[i]) continue;
        ucs_status_t ust = ucp_ep_rkey_unpack(p->ep, p->rkey_bufs[i], &p->rkeys[i]);
        if (ust != UCS_OK) {
            p->rkeys[i] = NULL;
            KVPI_DEBUG("ucx peer %s: buffer 0x%" PRIx64 ": ucp_ep_rkey_unpack: %s", p->segment,
                       p->regions[i].addr, ucs_status_string(ust));
            return -1;
        }
        kvpi_ucx_find_mapping(p, i);
    }
    return 0;
}

static ucs_status_t on_hello_ack(void *arg, const void *header, size_t header_length, void *data,
                                 size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    ucx_peer *p = arg;
    kvpi_ucx_hello_ack m;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || !p->awaiting_hello ||
        kvpi_ucx_hello_ack_get(data, length, p->auth != NULL, &m))
        return UCS_OK;
    unsigned status = m.status;
    /* Authenticated, an accepting answer counts only once we proved the
     * key, and it carries the rkeys after the ranges. */
    int keys = m.rkeys != NULL;
    if (keys && !p->proved) return UCS_OK;
    if (status == KVPI_UCX_HELLO_OK) {
        p->conn_id = m.conn_id;
        for (size_t i = 0; i < m.n_ranges; i++) {
            uint64_t addr, len;
            kvpi_ucx_range_get(m.ranges + 16 * i, &addr, &len);
            kvpi_ucx_revoke_range(p, addr, len);
        }
    }
    if (keys && take_rkeys(p, m.rkeys, m.rkeys_end) != 0) status = HELLO_BAD_RKEY;
    if (!p->auth && status == KVPI_UCX_HELLO_OK && unpack_rkeys(p) != 0) status = HELLO_BAD_RKEY;
    hello_finish(p, status);
    return UCS_OK;
}

/* Authenticated: the target's answer to our HELLO. Only a target that holds
 * the key can make its MAC over our fresh nonce; then we prove ours. */
static ucs_status_t on_challenge(void *arg, const void *header, size_t header_length, void *data,
                                 size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    ucx_peer *p = arg;
    uint64_t id;
    const uint8_t *ns, *mac;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || !p->auth || !p->awaiting_hello ||
        p->proved || kvpi_ucx_challenge_get(data, length, &id, &ns, &mac))
        return UCS_OK;
    if (kvpi_auth_mac_check(p->auth, p->kid, "server", KVPI_UCX_AUTH_CHANNEL, p->nc, ns, mac) !=
        0) {
        hello_finish(p, HELLO_IMPOSTOR); /* no proof of ours goes to it */
        return UCS_OK;
    }
    uint8_t ours[KVPI_AUTH_MAC_LEN], proof[KVPI_UCX_PROOF_LEN];
    kvpi_auth_mac(p->auth, p->kid, "client", KVPI_UCX_AUTH_CHANNEL, p->nc, ns, ours);
    kvpi_ucx_proof_put(proof, id, ours);
    if (kvpi_ucx_am_send(p->ep, KVPI_UCX_AM_PROOF, proof, sizeof proof, UCP_AM_SEND_FLAG_REPLY))
        return UCS_OK; /* the HELLO times out */
    p->proved = 1;
    return UCS_OK;
}

/* Transfers are issued under the same lock, so once the range is marked no
 * request reaches it; the flush peer_service() issues next covers those
 * issued before. */
static ucs_status_t on_revoke(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    (void)param;
    ucx_peer *p = arg;
    uint64_t serial, addr, len;
    if (kvpi_ucx_revoke_get(data, length, &serial, &addr, &len)) return UCS_OK;
    kvpi_ucx_revoke_range(p, addr, len);
    KVPI_DEBUG("ucx peer %s: revoked 0x%" PRIx64 "+%" PRIu64, p->segment, addr, len);
    ucx_revoke *rv = calloc(1, sizeof *rv);
    if (!rv) return UCS_OK; /* unanswered, the target cuts us off: safe, if abrupt */
    rv->serial = serial;
    *p->revokes_tail = rv;
    p->revokes_tail = &rv->next;
    return UCS_OK;
}

/* After each round of progress: flush behind each new REVOKE, and answer
 * them in order once flushed, so that the target may read an answer as
 * covering every earlier serial. */
static unsigned peer_service(kvpi_ucx_poller *poll)
{
    ucx_peer *p = (ucx_peer *)poll;
    unsigned did = kvpi_ucx_transfers_service(p);
    for (ucx_revoke *rv = p->revokes; rv; rv = rv->next) {
        if (rv->issued) continue;
        rv->issued = 1;
        did++;
        if (!p->ep || atomic_load(&p->ep_status)) continue;
        ucp_request_param_t prm = {0};
        ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &prm);
        if (UCS_PTR_IS_PTR(r)) rv->flush = r;
    }
    while (p->revokes && p->revokes->issued &&
           (!p->revokes->flush || ucp_request_check_status(p->revokes->flush) != UCS_INPROGRESS)) {
        ucx_revoke *rv = p->revokes;
        if (rv->flush) ucp_request_free(rv->flush);
        uint8_t msg[KVPI_UCX_REVOKE_ACK_LEN];
        kvpi_ucx_revoke_ack_put(msg, p->conn_id, rv->serial);
        if (p->ep && !atomic_load(&p->ep_status))
            kvpi_ucx_am_send(p->ep, KVPI_UCX_AM_REVOKE_ACK, msg, sizeof msg, 0);
        if (!(p->revokes = rv->next)) p->revokes_tail = &p->revokes;
        free(rv);
        did++;
    }
    return did;
}

/* ---- opening (the runtime's lock) ---- */

static kvp_status send_hello(ucx_peer *p, uint64_t epoch)
{
    ucp_address_t *addr;
    size_t len;
    ucs_status_t ust = ucp_worker_get_address(p->poll.worker, &addr, &len);
    if (ust != UCS_OK)
        return kvpi_error(kvpi_ucx_status(ust), "ucx: ucp_worker_get_address: %s",
                          ucs_status_string(ust));
    kvpi_ucx_hello m = {.version = KVPI_UCX_VERSION, .epoch = epoch, .addr = addr, .addr_len = len};
    if (p->auth) { /* a fresh nonce per connection: a recorded answer fails */
        kvpi_auth_kid_bytes(p->auth, p->kid);
        kvpi_auth_nonce(p->nc);
        m.kid = p->kid;
        m.nonce = p->nc;
    }
    size_t size = kvpi_ucx_hello_size(&m);
    uint8_t *msg = malloc(size);
    if (msg) kvpi_ucx_hello_put(&m, msg);
    ucp_worker_release_address(p->poll.worker, addr);
    if (!msg) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    kvp_status st = kvpi_ucx_am_send(p->ep, KVPI_UCX_AM_HELLO, msg, size, UCP_AM_SEND_FLAG_REPLY);
    free(msg);
    if (st) return st;
    p->awaiting_hello = 1;
    return KVP_OK;
}

/* A worker for p, and an endpoint to the target's (addr, from a descriptor
 * of epoch): the HELLO goes out. */
static kvp_status open_steps(ucx_peer *p, const void *addr, uint64_t epoch)
{
    kvp_status st = kvpi_ucx_worker_create(p->rt, &p->poll.worker);
    if (st) {
        p->poll.worker = NULL;
        return st;
    }
    if ((st = kvpi_ucx_set_handler(p->poll.worker, KVPI_UCX_AM_HELLO_ACK, on_hello_ack, p)) ||
        (st = kvpi_ucx_set_handler(p->poll.worker, KVPI_UCX_AM_CHALLENGE, on_challenge, p)) ||
        (st = kvpi_ucx_set_handler(p->poll.worker, KVPI_UCX_AM_REVOKE, on_revoke, p)))
        return st;
    p->poll.service = peer_service;
    if ((st = kvpi_ucx_poller_add(p->rt, &p->poll))) {
        ucp_worker_destroy(p->poll.worker);
        p->poll.worker = NULL;
        return st;
    }
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_failed, .arg = p}};
    ucs_status_t ust = ucp_ep_create(p->poll.worker, &ep, &p->ep);
    if (ust != UCS_OK) {
        p->ep = NULL;
        /* No transport of ours reaches any of the target's (UCX_TLS). */
        return kvpi_error(ust == UCS_ERR_UNREACHABLE ? KVP_ENOTSUP : kvpi_ucx_status(ust),
                          "ucx: no endpoint to segment %s: %s (UCX_TLS=%s)", p->segment,
                          ucs_status_string(ust), getenv("UCX_TLS") ? getenv("UCX_TLS") : "all");
    }
    /* The rkeys are unpacked once the HELLO is answered (unpack_rkeys;
     * authenticated, they come with the answer). */
    return send_hello(p, epoch);
}

/* ---- closing ---- */

/* How long a closing endpoint may take to flush. */
#define CLOSE_MS 1000

/* Say BYE and close the endpoint, progressing the worker until the close
 * completed (CLOSE_MS at most), then destroy it; a frozen worker at once,
 * undrained (transfer.c, abandon). No transfer runs any more, and the
 * runtime no longer progresses the worker: this thread owns it. */
static void close_worker(ucx_peer *p)
{
    for (size_t i = 0; p->rkeys && i < p->n_regions; i++)
        if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
    void *req = NULL;
    if (p->ep && (atomic_load(&p->ep_status) || p->frozen)) {
        kvpi_ucx_ep_close_force(p->ep);
    } else if (p->ep) {
        if (p->conn_id) {
            uint8_t bye[KVPI_UCX_BYE_LEN];
            kvpi_ucx_bye_put(bye, p->conn_id);
            kvpi_ucx_am_send(p->ep, KVPI_UCX_AM_BYE, bye, sizeof bye, 0);
        }
        ucp_request_param_t prm = {0}; /* flushes the BYE out first */
        ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep, &prm);
        if (UCS_PTR_IS_PTR(r)) req = r;
    }
    p->ep = NULL;
    /* Then what UCX still completes at once (a control message's send). */
    uint64_t end = kvpi_deadline_ns(CLOSE_MS);
    for (int idle = 0; !p->frozen && idle < 64 && kvpi_now_ns() < end;)
        idle = ucp_worker_progress(p->poll.worker) ||
                       (req && ucp_request_check_status(req) == UCS_INPROGRESS)
                   ? 0
                   : idle + 1;
    if (req) ucp_request_free(req);
    /* The REVOKEs last: that progress can still deliver one (on_revoke). */
    for (ucx_revoke *rv = p->revokes, *next; rv; rv = next) {
        next = rv->next;
        if (rv->flush) ucp_request_free(rv->flush);
        free(rv);
    }
    p->revokes = NULL;
    p->revokes_tail = &p->revokes;
    ucp_worker_destroy(p->poll.worker);
    p->poll.worker = NULL;
}

static void peer_close(void *peer)
{
    ucx_peer *p = peer;
    if (!p) return;
    if (p->poll.worker) {
        pthread_mutex_lock(&p->rt->lock);
        if (!p->frozen) kvpi_ucx_poller_remove(p->rt, &p->poll);
        pthread_mutex_unlock(&p->rt->lock);
        close_worker(p);
    }
    for (size_t i = 0; p->rkey_bufs && i < p->n_regions; i++)
        free(p->rkey_bufs[i]);
    pthread_cond_destroy(&p->answered);
    pthread_mutex_destroy(&p->lock);
    pthread_rwlock_destroy(&p->map_lock);
    free(p->rkey_bufs);
    free(p->rkey_lens);
    free(p->revoked);
    free(p->mapped);
    free(p->rkeys);
    free(p->regions);
    free(p->segment);
    free(p);
}

/* ---- what UCX chose ---- */

size_t kvpi_ucx_peer_lanes(void *peer, char *buf, size_t len)
{
    ucx_peer *p = peer;
    char *text = NULL;
    size_t text_len = 0, used = 0;
    if (len) buf[0] = '\0';
    FILE *f = open_memstream(&text, &text_len);
    if (!f) return 0;
    pthread_mutex_lock(&p->rt->lock);
    if (p->ep) ucp_ep_print_info(p->ep, f);
    pthread_mutex_unlock(&p->rt->lock);
    fclose(f);
    /* "#  lane[0]:  1:tcp/lo.0 md[0]  -> md[0]/tcp/sysdev[255] am am_bw#0 keepalive"
     * becomes "tcp/lo.0 (am am_bw#0 keepalive)". */
    for (char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        char *lane = strstr(line, "lane[");
        char *colon = lane ? strchr(lane, ':') : NULL;
        char *tl = colon ? strchr(colon + 1, ':') : NULL;
        char *arrow = tl ? strstr(tl, "->") : NULL;
        if (!arrow) continue;
        size_t tl_len = strcspn(tl + 1, " ");
        char *roles = strchr(arrow + 3, ' ');
        while (roles && *roles == ' ')
            roles++;
        if (used + 1 < len)
            used += (size_t)snprintf(buf + used, len - used, "%s%.*s (%s)", used ? ", " : "",
                                     (int)tl_len, tl + 1, roles && *roles ? roles : "rma");
    }
    free(text);
    return used < len ? used : len ? len - 1 : 0;
}

/* ---- opening ---- */

static kvp_status parse_endpoint(const kvpi_peer_ctx *ctx, void **addr, uint64_t *epoch)
{
    const cJSON *o = ctx->desc ? cJSON_GetObjectItemCaseSensitive(ctx->desc, KVPI_UCX_FIELD) : NULL;
    if (!cJSON_IsObject(o))
        return kvpi_error(KVP_ENOTSUP,
                          "ucx: segment %s publishes no '%s' endpoint (a Mooncake "
                          "peer, or a kvpipe engine without UCX)",
                          ctx->segment, KVPI_UCX_FIELD);
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
    /* Authenticated on both sides or on neither: a target with the key hands
     * rkeys only to peers that prove it, one without publishes them. */
    int authed = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, KVPI_UCX_AUTH_FIELD));
    if (authed && !ctx->auth)
        return kvpi_error(KVP_EAUTH,
                          "ucx: segment %s is authenticated (it hands its rkeys only to peers "
                          "that prove its key) and this engine has no key: give it the same key "
                          "file (env " KVPI_AUTH_ENV " or auth_key_file; docs/security.md)",
                          ctx->segment);
    if (!authed && ctx->auth)
        return kvpi_error(KVP_ENOTSUP,
                          "ucx: segment %s's ucx endpoint does not authenticate its peers, so "
                          "this authenticated engine does not use it",
                          ctx->segment);
    size_t len;
    if (kvpi_ucx_unhex(worker->valuestring, addr, &len))
        return kvpi_error(KVP_EPROTO, "ucx: segment %s: its worker address is not hex",
                          ctx->segment);
    *epoch = (uint64_t)ep->valuedouble;
    return KVP_OK;
}

/* Copy the buffers and their packed rkeys. */
static kvp_status peer_init(ucx_peer *p, const kvpi_peer_ctx *ctx)
{
    p->rt = ctx->server;
    p->timeout_ms = ctx->timeout_ms > 0 ? ctx->timeout_ms : KVPI_CONN_TIMEOUT_MS_DEFAULT;
    p->min_rate = ctx->min_rate ? ctx->min_rate : KVPI_MIN_RATE_DEFAULT;
    p->n_regions = ctx->n_regions;
    p->auth = ctx->auth;
    p->revokes_tail = &p->revokes;
    size_t n = ctx->n_regions ? ctx->n_regions : 1;
    if (!(p->segment = strdup(ctx->segment ? ctx->segment : "?")) ||
        !(p->regions = calloc(n, sizeof *p->regions)) ||
        !(p->rkeys = calloc(n, sizeof *p->rkeys)) || !(p->revoked = calloc(n, 1)) ||
        !(p->mapped = calloc(n, sizeof *p->mapped)) ||
        !(p->rkey_bufs = calloc(n, sizeof *p->rkey_bufs)) ||
        !(p->rkey_lens = calloc(n, sizeof *p->rkey_lens)))
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    for (size_t i = 0; i < ctx->n_regions; i++) {
        p->regions[i].addr = ctx->regions[i].addr;
        p->regions[i].length = ctx->regions[i].length;
        if (p->auth) continue; /* its rkeys come with the HELLO's answer */
        const cJSON *k =
            ctx->buffers && ctx->buffers[i]
                ? cJSON_GetObjectItemCaseSensitive(ctx->buffers[i], KVPI_UCX_RKEY_FIELD)
                : NULL;
        if (!cJSON_IsString(k))
            return kvpi_error(KVP_ENOTSUP, "ucx: segment %s: buffer 0x%" PRIx64 " has no '%s'",
                              p->segment, p->regions[i].addr, KVPI_UCX_RKEY_FIELD);
        if (kvpi_ucx_unhex(k->valuestring, &p->rkey_bufs[i], &p->rkey_lens[i]))
            return kvpi_error(KVP_EPROTO,
                              "ucx: segment %s: buffer 0x%" PRIx64 ": its rkey is not hex",
                              p->segment, p->regions[i].addr);
    }
    return KVP_OK;
}

/* The error of a HELLO exchange that ended with status. */
static kvp_status hello_error(const ucx_peer *p, unsigned status)
{
    const char *kid = p->auth ? kvpi_auth_kid(p->auth) : "";
    switch (status) {
    case KVPI_UCX_HELLO_OK:
        return KVP_OK;
    case KVPI_UCX_HELLO_STALE:
        return kvpi_error(KVP_ECONNRESET,
                          "ucx: segment %s: the descriptor read is older than "
                          "its last %d deregistrations (the next transfer looks it up again)",
                          p->segment, KVPI_UCX_REVOKE_LOG);
    case KVPI_UCX_HELLO_AUTH_REQUIRED:
        return kvpi_error(KVP_EAUTH,
                          "ucx: segment %s refused us: it authenticates its peers and "
                          "this engine has no key (docs/security.md)",
                          p->segment);
    case KVPI_UCX_HELLO_AUTH_KEY:
        return kvpi_error(KVP_EAUTH,
                          "ucx: segment %s refused our key (key id %s): it holds no "
                          "key of our key id: a different key",
                          p->segment, kid);
    case KVPI_UCX_HELLO_AUTH_PROOF:
        return kvpi_error(KVP_EAUTH, "ucx: segment %s refused our proof (key id %s)", p->segment,
                          kid);
    case KVPI_UCX_HELLO_BUSY:
        return kvpi_error(KVP_ECONNREFUSED,
                          "ucx: segment %s has too many authentications "
                          "pending (the next transfer tries again)",
                          p->segment);
    case HELLO_IMPOSTOR:
        return kvpi_error(KVP_EAUTH,
                          "ucx: segment %s failed to prove the key (its MAC does not "
                          "match): an impostor, or a replayed answer",
                          p->segment);
    case HELLO_BAD_RKEY:
        return kvpi_error(KVP_EPROTO, "ucx: segment %s: UCX cannot unpack the rkeys %s", p->segment,
                          p->auth ? "of its HELLO's answer" : "its descriptor publishes");
    default:
        return kvpi_error(KVP_ENOTSUP, "ucx: segment %s could not pair our endpoint with its own",
                          p->segment);
    }
}

/* Wait for the HELLO's answer within the peer's timeout. */
static kvp_status await_hello(ucx_peer *p)
{
    struct timespec dl = kvpi_deadline_after_ms(p->timeout_ms);
    pthread_mutex_lock(&p->lock);
    while (!p->hello_done && !atomic_load(&p->ep_status))
        if (pthread_cond_timedwait(&p->answered, &p->lock, &dl) == ETIMEDOUT) break;
    int done = p->hello_done;
    unsigned status = p->hello_status;
    pthread_mutex_unlock(&p->lock);
    int failed = atomic_load(&p->ep_status);
    if (!done && failed)
        return kvpi_error(KVP_ECONNREFUSED, "ucx: segment %s cannot be reached: %s", p->segment,
                          ucs_status_string((ucs_status_t)failed));
    if (!done)
        return kvpi_error(KVP_ETIMEDOUT, "ucx: segment %s did not answer within %d ms", p->segment,
                          p->timeout_ms);
    return hello_error(p, status);
}

static kvp_status peer_open(const kvpi_peer_ctx *ctx, void **out)
{
    if (!ctx->server)
        return kvpi_error(KVP_ENOTSUP, "ucx: this engine's ucx transport did not start");
    void *addr = NULL;
    uint64_t epoch = 0;
    kvp_status st = parse_endpoint(ctx, &addr, &epoch);
    if (st) return st;
    ucx_peer *p = calloc(1, sizeof *p);
    if (!p) {
        free(addr);
        return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    }
    pthread_mutex_init(&p->lock, NULL);
    kvpi_cond_init(&p->answered);
    /* A REVOKE waits for the copies running, not for every later one. */
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&p->map_lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    if (!(st = peer_init(p, ctx))) {
        kvpi_ucx_watch_process(p, cJSON_GetObjectItemCaseSensitive(ctx->desc, KVPI_UCX_FIELD));
        pthread_mutex_lock(&p->rt->lock);
        st = open_steps(p, addr, epoch);
        pthread_mutex_unlock(&p->rt->lock);
    }
    free(addr);
    if (!st) st = await_hello(p);
    if (st) {
        kvpi_error_kept why = kvpi_error_keep(); /* closing may log */
        peer_close(p);
        return kvpi_error(st, "%s", why.text);
    }
    if (kvpi_log_enabled(KVP_LOG_INFO)) {
        char lanes[512];
        kvpi_ucx_peer_lanes(p, lanes, sizeof lanes);
        KVPI_INFO("ucx peer %s: lanes %s", p->segment, lanes);
    }
    *out = p;
    return KVP_OK;
}

const kvpi_transport_ops kvpi_transport_ucx = {
    .name = "ucx",
    .caps = KVPI_CAP_RDMA | KVPI_CAP_AUTH,
    .mem_kinds = KVPI_MEM_HOST_BIT,
    .group_bytes = (size_t)1 << 20,
    .server_start = kvpi_ucx_server_start,
    .server_stop = kvpi_ucx_server_stop,
    .server_describe = kvpi_ucx_server_describe,
    .buffer_describe = kvpi_ucx_buffer_describe,
    .mem_reg = kvpi_ucx_mem_reg,
    .mem_dereg = kvpi_ucx_mem_dereg,
    .chunk_map = kvpi_ucx_chunk_map,
    .chunk_unmap = kvpi_ucx_chunk_unmap,
    .peer_open = peer_open,
    .peer_post = kvpi_ucx_post,
    .peer_run = kvpi_ucx_run,
    .peer_close = peer_close,
    .server_progress = kvpi_ucx_progress,
    .server_wait_fd = kvpi_ucx_wait_fd,
};
