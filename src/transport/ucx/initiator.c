/* The ucx transport: one-sided RMA through UCX's UCP API (protocols rdma and
 * ucx).
 *
 * This file is the initiator side and the ops table; ucx_server.c and
 * ucx_target.c are the engine-wide part. A peer gets its own UCP worker (so that UCP pairs the
 * endpoint its target makes back to it, see ucx_internal.h) with one
 * endpoint to the target's published worker and the target's packed rkeys
 * unpacked on it. A transfer issues ucp_get_nbx/ucp_put_nbx (and one flush
 * after writes, so that they completed at the target) on the calling thread
 * when it can take the peer's worker, and progresses the worker there while
 * it makes progress; what is left (or a transfer that found the worker
 * taken) the progress thread serves, the calling thread waiting within the
 * transfer's deadline (ucx_internal.h, "Threads"). A transfer out of time
 * closes the endpoint, which cancels what is in flight, and the engine looks
 * the peer up again. An xfer all in target memory the rkeys map here (UCX's
 * shared memory) is copied on the posting thread instead (copy_mapped). A
 * REVOKE from the target refuses its range from then on and is acknowledged
 * once what was issued before is flushed. In the authenticated mode the
 * descriptor has no rkeys: the HELLO runs a challenge-response (we check the
 * target's MAC over our fresh nonce before we send ours) and the rkeys come
 * with its answer.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/conn_server.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "transport/shm_internal.h"
#include "transport/ucx/ucx.h"

/* How often a busy peer on this host is checked for being alive. */
#define ALIVE_CHECK_NS (100 * 1000 * 1000)
/* A calling thread that leads its transfer (progresses the worker itself)
 * hands it to the progress thread once the worker made no progress for this
 * long: a slow peer is waited for asleep, not by spinning. */
#define LEAD_IDLE_NS (1000 * 1000)

/* A REVOKE being answered. */
typedef struct ucx_revoke {
    struct ucx_revoke *next;
    uint64_t serial;
    void *flush; /* the flush request, until it completed; NULL before it is issued */
    int issued;
} ucx_revoke;

typedef struct ucx_peer {
    kvpi_ucx_pollee poll; /* first: the progress thread hands it back; its lock is the worker's */
    kvpi_ucx_server *server;
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

    /* Whoever holds poll.lock's (the progress thread, or a caller). */
    ucp_worker_h worker;
    ucp_ep_h ep; /* NULL once closed */
    ucp_rkey_h *rkeys;
    unsigned char *revoked; /* REVOKED_*: refused from now on; written under map_lock too */
    /* Regions whose rkey maps the target's memory here (UCX's shared
     * memory, ucp_rkey_ptr): where region i's first byte is in this
     * process, or NULL. A transfer of such memory is a copy on the posting
     * thread (copy_mapped), without the worker, under map_lock for reading;
     * whoever refuses a region or sets its rkey holds it for writing, so
     * that once revoke_range returned no copy of the range runs. */
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
    uint64_t down_ns;        /* when the holder first saw the endpoint closed or failed */
    struct ucx_xfer *issued; /* xfers with requests in flight */
    pid_t target_pid;        /* on this host; 0 where not, or unknown */
    unsigned long long target_start;
    uint64_t next_check;

    atomic_int ep_status; /* the ucs_status_t the endpoint failed with; 0 while fine */
    atomic_int timed_out; /* closed by us after a deadline passed */

    pthread_mutex_t lock; /* the HELLO's answer */
    pthread_cond_t answered;
    int hello_done;
    unsigned hello_status;
    kvp_status open_status;
    char open_error[256];
} ucx_peer;

/* ---- the peer's endpoint and control messages (the worker's holder) ---- */

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

/* Why a region of the peer is refused. */
enum { REVOKED_DEREG = 1, REVOKED_NO_RKEY = 2 };

/* Statuses of the HELLO exchange this side decides (the target's are
 * KVPI_UCX_HELLO_*). */
enum { HELLO_IMPOSTOR = 0x100, HELLO_BAD_RKEY = 0x101 };

/* Refuse every region of ours that overlaps [addr, addr+length). */
static void revoke_range(ucx_peer *p, uint64_t addr, uint64_t length)
{
    pthread_rwlock_wrlock(&p->map_lock); /* waits for the copies running */
    for (size_t i = 0; i < p->n_regions; i++)
        if (p->regions[i].addr < addr + length && addr < p->regions[i].addr + p->regions[i].length)
            p->revoked[i] = REVOKED_DEREG;
    pthread_rwlock_unlock(&p->map_lock);
}

/* Region i's rkey was unpacked: is its memory mapped here? The caller holds
 * map_lock for writing, or no transfer can use p yet. */
static void find_mapping(ucx_peer *p, size_t i)
{
    void *here;
    if (ucp_rkey_ptr(p->rkeys[i], p->regions[i].addr, &here) != UCS_OK) return;
    p->mapped[i] = here;
    p->n_mapped++;
}

/* The HELLO exchange ended with status. */
static void hello_finish(ucx_peer *p, unsigned status)
{
    p->awaiting_hello = 0;
    kvpi_ucx_busy_add(p->server, -1);
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
        p->revoked[i] = p->revoked[i] ? p->revoked[i] : REVOKED_NO_RKEY;
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
            find_mapping(p, i);
            if (p->revoked[i] == REVOKED_NO_RKEY) p->revoked[i] = 0;
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
 * an rkey. The progress thread: no transfer has p yet. */
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
        find_mapping(p, i);
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
            revoke_range(p, addr, len);
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

/* Transfers run on this thread too, so once the range is marked no request
 * reaches it; the flush service() issues next covers those issued before. */
static ucs_status_t on_revoke(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    (void)header;
    (void)header_length;
    (void)param;
    ucx_peer *p = arg;
    uint64_t serial, addr, len;
    if (kvpi_ucx_revoke_get(data, length, &serial, &addr, &len)) return UCS_OK;
    revoke_range(p, addr, len);
    KVPI_DEBUG("ucx peer %s: revoked 0x%" PRIx64 "+%" PRIu64, p->segment, addr, len);
    ucx_revoke *rv = calloc(1, sizeof *rv);
    if (!rv) return UCS_OK; /* unanswered, the target cuts us off: safe, if abrupt */
    rv->serial = serial;
    *p->revokes_tail = rv;
    p->revokes_tail = &rv->next;
    return UCS_OK;
}

static ucs_status_t on_nothing(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    (void)arg, (void)header, (void)header_length, (void)data, (void)length, (void)param;
    return UCS_OK;
}

/* The state letter and start time of process pid, from /proc; -1 if it
 * has none. */
static int proc_stat(pid_t pid, char *state, unsigned long long *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    /* "pid (comm) S ppid ...": the state is field 3, the start time 22. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ' || !p[2]) return -1;
    *state = p[2];
    p += 3; /* the space before field 4 */
    for (int i = 4; i < 22 && p; i++)
        p = strchr(p + 1, ' ');
    return p && sscanf(p, " %llu", start) == 1 ? 0 : -1;
}

/* A same-host target that died is a zombie until reaped, and its shared
 * memory stays: UCX's keepalive (which compares start times) sees it alive. */
static int target_gone(const ucx_peer *p)
{
    char state;
    unsigned long long start;
    if (proc_stat(p->target_pid, &state, &start)) return 1;
    return state == 'Z' || state == 'X' || start != p->target_start;
}

static void check_alive(ucx_peer *p)
{
    uint64_t now = kvpi_now_ns();
    if (!p->target_pid || !p->ep || !p->inflight || now < p->next_check) return;
    p->next_check = now + ALIVE_CHECK_NS;
    if (!target_gone(p)) return;
    int fine = 0;
    atomic_compare_exchange_strong(&p->ep_status, &fine, (int)UCS_ERR_CONNECTION_RESET);
    KVPI_DEBUG("ucx peer %s: process %d is gone", p->segment, (int)p->target_pid);
    kvpi_ucx_ep_close_force(p->ep); /* its requests complete, canceled */
    p->ep = NULL;
}

static void check_deadlines(ucx_peer *p);

/* After each round of progress: flush behind each new REVOKE, and answer
 * them in order once flushed, so that the target may read an answer as
 * covering every earlier serial. */
static unsigned peer_service(kvpi_ucx_server *s, kvpi_ucx_pollee *poll)
{
    (void)s;
    ucx_peer *p = (ucx_peer *)poll;
    unsigned did = 0;
    check_alive(p);
    check_deadlines(p);
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
    poll->busy = p->inflight > 0;
    return did;
}

/* ---- opening (progress thread) ---- */

static kvp_status send_hello(ucx_peer *p, uint64_t epoch)
{
    ucp_address_t *addr;
    size_t len;
    ucs_status_t ust = ucp_worker_get_address(p->worker, &addr, &len);
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
    ucp_worker_release_address(p->worker, addr);
    if (!msg) return kvpi_error(KVP_ENOMEM, "ucx: out of memory");
    kvp_status st = kvpi_ucx_am_send(p->ep, KVPI_UCX_AM_HELLO, msg, size, UCP_AM_SEND_FLAG_REPLY);
    free(msg);
    if (st) return st;
    p->awaiting_hello = 1;
    kvpi_ucx_busy_add(p->server, 1);
    return KVP_OK;
}

typedef struct open_args {
    ucx_peer *p;
    const void *addr; /* the target worker's */
    uint64_t epoch;
} open_args;

static kvp_status open_steps(kvpi_ucx_server *s, open_args *a)
{
    ucx_peer *p = a->p;
    kvp_status st = kvpi_ucx_worker_create(s, &p->worker);
    if (st) {
        p->worker = NULL;
        return st;
    }
    if ((st = kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_HELLO_ACK, on_hello_ack, p)) ||
        (st = kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_CHALLENGE, on_challenge, p)) ||
        (st = kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_REVOKE, on_revoke, p)))
        return st;
    p->poll.worker = p->worker;
    p->poll.service = peer_service;
    if ((st = kvpi_ucx_poll_add(s, &p->poll))) {
        p->poll.worker = NULL;
        return st;
    }
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = a->addr,
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
    /* The rkeys are unpacked once the HELLO is answered (unpack_rkeys;
     * authenticated, they come with the answer). */
    return send_hello(p, a->epoch);
}

static void open_run(kvpi_ucx_server *s, void *arg)
{
    open_args *a = arg;
    ucx_peer *p = a->p;
    pthread_mutex_lock(&p->poll.lock); /* no caller has p yet: for the rule's sake */
    p->open_status = open_steps(s, a);
    pthread_mutex_unlock(&p->poll.lock);
    if (p->open_status) snprintf(p->open_error, sizeof p->open_error, "%s", kvp_last_error());
}

/* ---- closing ---- */

static void close_run(kvpi_ucx_server *s, void *arg)
{
    ucx_peer *p = arg;
    if (!p->worker) return;
    /* No transfer runs any more: the lock is free, and what is still posted
     * was abandoned. */
    pthread_mutex_lock(&p->poll.lock);
    kvpi_ucx_run_posted(s, &p->poll);
    if (p->poll.worker) kvpi_ucx_poll_remove(s, &p->poll);
    if (p->awaiting_hello) kvpi_ucx_busy_add(s, -1);
    for (size_t i = 0; p->rkeys && i < p->n_regions; i++)
        if (p->rkeys[i]) ucp_rkey_destroy(p->rkeys[i]);
    for (ucx_revoke *rv = p->revokes, *next; rv; rv = next) {
        next = rv->next;
        if (rv->flush) ucp_request_free(rv->flush);
        free(rv);
    }
    p->revokes = NULL;
    /* The worker outlives p while its endpoint closes: nothing of p may be
     * called back. A closed endpoint calls no error callback. */
    kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_HELLO_ACK, on_nothing, NULL);
    kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_CHALLENGE, on_nothing, NULL);
    kvpi_ucx_set_handler(p->worker, KVPI_UCX_AM_REVOKE, on_nothing, NULL);
    void *req = NULL;
    if (p->ep && atomic_load(&p->ep_status)) {
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
    if (atomic_load(&p->poll.frozen)) {
        /* Draining it could deliver what abandon gave up. */
        if (req) ucp_request_free(req);
        ucp_worker_destroy(p->worker);
    } else {
        kvpi_ucx_retire(s, p->worker, req, NULL, NULL);
    }
    p->worker = NULL;
    pthread_mutex_unlock(&p->poll.lock);
}

static void peer_close(void *peer)
{
    ucx_peer *p = peer;
    if (!p) return;
    if (p->worker) kvpi_ucx_call(p->server, close_run, p);
    for (size_t i = 0; p->rkey_bufs && i < p->n_regions; i++)
        free(p->rkey_bufs[i]);
    pthread_cond_destroy(&p->answered);
    pthread_mutex_destroy(&p->lock);
    pthread_rwlock_destroy(&p->map_lock);
    kvpi_ucx_pollee_destroy(&p->poll);
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
    pthread_mutex_lock(&p->poll.lock);
    if (p->ep) ucp_ep_print_info(p->ep, f);
    pthread_mutex_unlock(&p->poll.lock);
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

/* The target's worker address and epoch, from its "ucx" field. */
/* The target's process, if it runs on this host. */
static void parse_process(ucx_peer *p, const cJSON *o)
{
    const cJSON *host = cJSON_GetObjectItemCaseSensitive(o, "host_id");
    const cJSON *pid = cJSON_GetObjectItemCaseSensitive(o, "pid");
    char ours[KVPI_SHM_HOST_ID_MAX], state;
    if (!cJSON_IsString(host) || !cJSON_IsNumber(pid) || pid->valuedouble < 1 ||
        pid->valuedouble > 0x7fffffff || kvpi_shm_host_id(ours, sizeof ours) ||
        strcmp(ours, host->valuestring) != 0)
        return;
    p->target_pid = (pid_t)pid->valuedouble;
    if (proc_stat(p->target_pid, &state, &p->target_start)) p->target_pid = 0;
}

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
    p->server = ctx->server;
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
    kvpi_ucx_pollee_init(&p->poll);
    /* A REVOKE waits for the copies running, not for every later one. */
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&p->map_lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    if (!(st = peer_init(p, ctx))) {
        parse_process(p, cJSON_GetObjectItemCaseSensitive(ctx->desc, KVPI_UCX_FIELD));
        open_args a = {.p = p, .addr = addr, .epoch = epoch};
        kvpi_ucx_call(p->server, open_run, &a);
        if ((st = p->open_status)) kvpi_error(st, "%s", p->open_error);
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

/* ---- transfers ---- */

typedef struct ucx_xfer ucx_xfer;

typedef struct ucx_item {
    ucx_xfer *ux;
    ucs_status_t status;
    int refused; /* never issued: REFUSED_* */
} ucx_item;

enum { REFUSED_OUTSIDE = 1, REFUSED_REVOKED = 2, REFUSED_NO_RKEY = 3, REFUSED_CANCELED = 4 };

/* Why sl may not be issued (REFUSED_*), or 0. The caller holds the worker's
 * lock or map_lock (both are held to change revoked). The engine checked
 * the range before; one-sided, this is the last place a bad one can be
 * stopped. */
static int refusal(const ucx_peer *p, const kvpi_slice *sl)
{
    size_t r = sl->remote_region;
    if (r >= p->n_regions || !kvpi_regions_contain(&p->regions[r], 1, sl->remote, sl->length))
        return REFUSED_OUTSIDE;
    if (p->revoked[r]) return p->revoked[r] == REVOKED_NO_RKEY ? REFUSED_NO_RKEY : REFUSED_REVOKED;
    return 0;
}

/* One posted xfer. Everything here changes under the worker's lock: it is
 * issued by the lock's holder, and UCP calls its requests back from the
 * holder's progress. */
struct ucx_xfer {
    kvpi_ucx_cmd cmd; /* first: posted to the worker's holder */
    ucx_peer *p;
    kvpi_xfer *x;
    uint64_t deadline;
    uint64_t bytes;
    int pending; /* requests in flight */
    int writes;
    int abandoned;         /* completed without its requests (see abandon) */
    int *led;              /* a leading caller's flag, set when done; NULL if none */
    ucx_xfer *prev, *next; /* the peer's issued xfers (p->issued) */
    ucx_item flush;
    ucx_item items[];
};

static kvp_status slice_status(const ucx_peer *p, const ucx_item *it, ucs_status_t st,
                               const kvpi_slice *s)
{
    if (it->refused == REFUSED_CANCELED)
        return kvpi_error(KVP_ECANCELED, "ucx: segment %s: cancelled before it was issued",
                          p->segment);
    if (it->refused == REFUSED_REVOKED)
        return kvpi_error(KVP_ERANGE, "ucx: segment %s deregistered the buffer of 0x%" PRIx64,
                          p->segment, s->remote);
    if (it->refused == REFUSED_NO_RKEY)
        return kvpi_error(KVP_ERANGE,
                          "ucx: segment %s handed us no rkey for its buffer of 0x%" PRIx64
                          " (not registered there as the descriptor says any more)",
                          p->segment, s->remote);
    if (it->refused == REFUSED_OUTSIDE)
        return kvpi_error(KVP_ERANGE, "ucx: 0x%" PRIx64 "+%zu lies outside segment %s's buffer",
                          s->remote, s->length, p->segment);
    if (st == UCS_OK) return KVP_OK;
    if (st == UCS_ERR_CANCELED || st == UCS_INPROGRESS)
        return atomic_load(&p->timed_out) ? KVP_ETIMEDOUT : KVP_ECONNRESET;
    kvp_status k = kvpi_ucx_status(st);
    return k == KVP_EIO || k == KVP_ECONNREFUSED ? KVP_ECONNRESET : k;
}

/* Set the slices' statuses and complete x; ux stays. */
static void report(ucx_xfer *ux)
{
    atomic_fetch_sub(&ux->p->posted_bytes, ux->bytes);
    ucx_peer *p = ux->p;
    kvpi_xfer *x = ux->x;
    if (ux->led) *ux->led = 1;
    kvp_status conn = KVP_OK, result = KVP_OK;
    for (size_t i = 0; i < x->n; i++) {
        ucs_status_t st = ux->items[i].status;
        if (st == UCS_OK && ux->writes && x->slices[i]->opcode == KVP_OP_WRITE)
            st = ux->flush.status;
        kvp_status k = slice_status(p, &ux->items[i], st, x->slices[i]);
        x->slices[i]->status = k;
        if (k == KVP_ECONNRESET || k == KVP_ETIMEDOUT) conn = k;
        if (k && !result) result = k;
    }
    if (conn == KVP_ETIMEDOUT) {
        result = kvpi_error(conn,
                            "ucx: segment %s: %" PRIu64
                            " bytes not done within %d ms + the bytes at %" PRIu64 " bytes/s",
                            p->segment, ux->bytes, p->timeout_ms, p->min_rate);
    } else if (conn) {
        int st = atomic_load(&p->ep_status);
        result = kvpi_error(conn, "ucx: segment %s: %s", p->segment,
                            st ? ucs_status_string((ucs_status_t)st) : "endpoint closed");
    }
    x->done(x, result);
}

/* Every request of ux completed (or none was issued): complete. The
 * worker's holder, or a poster before anything was issued. */
static void finish(ucx_xfer *ux)
{
    report(ux);
    free(ux);
}

static void unlink_issued(ucx_peer *p, ucx_xfer *ux)
{
    if (ux->prev)
        ux->prev->next = ux->next;
    else
        p->issued = ux->next;
    if (ux->next) ux->next->prev = ux->prev;
}

static void request_done(void *request, ucs_status_t st, void *user_data)
{
    ucx_item *it = user_data;
    ucx_xfer *ux = it->ux;
    it->status = st;
    ucp_request_free(request);
    if (ux->abandoned) { /* its peer may be gone: ux is all that is left */
        if (--ux->pending == 0) free(ux);
        return;
    }
    ucx_peer *p = ux->p;
    p->inflight--;
    if (--ux->pending > 0) return;
    unlink_issued(p, ux);
    finish(ux);
}

/* Issue one request; r is what ucp_*_nbx returned. */
static void issued(ucx_xfer *ux, ucx_item *it, ucs_status_ptr_t r)
{
    if (UCS_PTR_IS_PTR(r)) {
        ux->p->inflight++;
        ux->pending++;
    } else {
        it->status = UCS_PTR_STATUS(r);
    }
}

/* Issue ux's requests; the caller holds the worker's lock. */
static void xfer_run(kvpi_ucx_server *s, kvpi_ucx_cmd *cmd)
{
    (void)s;
    ucx_xfer *ux = (ucx_xfer *)cmd;
    ucx_peer *p = ux->p;
    kvpi_xfer *x = ux->x;
    int canceled = atomic_load(&x->canceled);
    if (!canceled && kvpi_now_ns() >= ux->deadline) atomic_store(&p->timed_out, 1);
    ucp_request_param_t prm = {.op_attr_mask =
                                   UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = request_done};
    for (size_t i = 0; i < x->n; i++) {
        ucx_item *it = &ux->items[i];
        const kvpi_slice *sl = x->slices[i];
        it->ux = ux;
        it->status = UCS_INPROGRESS;
        if (canceled) {
            it->refused = REFUSED_CANCELED;
            continue;
        }
        if (!p->ep || atomic_load(&p->timed_out)) {
            it->status = UCS_ERR_CANCELED;
            continue;
        }
        if ((it->refused = refusal(p, sl))) continue;
        prm.user_data = it;
        ucp_rkey_h rkey = p->rkeys[sl->remote_region];
        issued(ux, it,
               sl->opcode == KVP_OP_READ
                   ? ucp_get_nbx(p->ep, sl->local, sl->length, sl->remote, rkey, &prm)
                   : ucp_put_nbx(p->ep, sl->local, sl->length, sl->remote, rkey, &prm));
        ux->writes |= sl->opcode == KVP_OP_WRITE;
    }
    if (ux->writes && p->ep) {
        /* A put completes when its buffer may be reused; the flush, when the
         * target has the bytes. */
        ux->flush.ux = ux;
        ux->flush.status = UCS_INPROGRESS;
        prm.user_data = &ux->flush;
        issued(ux, &ux->flush, ucp_ep_flush_nbx(p->ep, &prm));
    }
    if (ux->pending == 0) {
        finish(ux);
        return;
    }
    ux->prev = NULL;
    ux->next = p->issued;
    if (p->issued) p->issued->prev = ux;
    p->issued = ux;
}

/* Out of time: close the endpoint, which completes what is in flight with
 * UCS_ERR_CANCELED, at the next progress or at once (UCX may purge them in
 * ucp_ep_close_nbx itself: request_done runs, and frees the xfers); the
 * engine then looks the peer up again. The caller holds the worker's lock. */
static void cut(ucx_peer *p)
{
    if (!p->ep) return;
    atomic_store(&p->timed_out, 1);
    kvpi_ucx_ep_close_force(p->ep);
    p->ep = NULL;
}

/* Requests of a force-closed endpoint normally complete (cancelled) at the
 * next progress; UCX 1.13 on shared memory keeps READs of memory the target
 * registered pending while the target is stopped or killed, and delivers
 * their bytes once it resumes (cancel_test crashed writing into a freed
 * buffer). After
 * this long the xfer completes without them, so that no caller waits for
 * ever, and the worker is frozen: never progressed again, destroyed without
 * draining when the peer closes (the engine closes it after the failure),
 * so that nothing lands in memory its caller owns again. ux stays (leaked
 * if UCX never calls its requests back). */
#define ABANDON_NS (1000u * 1000000u)

static void abandon(ucx_peer *p, ucx_xfer *ux)
{
    unlink_issued(p, ux);
    p->inflight -= ux->pending;
    ux->abandoned = 1;
    atomic_store(&p->poll.frozen, 1);
    report(ux);
}

/* The worker's holder, after each round of progress: an xfer past its
 * deadline cuts the endpoint; what is still issued ABANDON_NS after the
 * endpoint went down (cut, failed, or its same-host target gone) is given
 * up. */
static void check_deadlines(ucx_peer *p)
{
    if (!p->issued) return;
    uint64_t now = kvpi_now_ns();
    for (ucx_xfer *ux = p->issued; ux && p->ep; ux = ux->next)
        if (now >= ux->deadline) {
            KVPI_DEBUG("ucx peer %s: a transfer passed its deadline: closing the endpoint",
                       p->segment);
            cut(p); /* may complete and free ux (and the others): read none of them after */
            break;
        }
    if (p->ep && !atomic_load(&p->ep_status)) return;
    if (!p->down_ns) p->down_ns = now;
    if (now - p->down_ns < ABANDON_NS) return;
    long requests = p->inflight;
    int xfers = 0;
    for (; p->issued; xfers++)
        abandon(p, p->issued);
    KVPI_WARN("ucx peer %s: %ld requests of %d transfers still pending %u ms after the endpoint "
              "went down: the transfers fail without them, and this peer's worker is never "
              "progressed again",
              p->segment, requests, xfers, ABANDON_NS / 1000000u);
}

/* With the worker's lock: issue ux (and what others posted); when led is
 * not NULL, progress the worker on this thread until ux is done, the worker
 * made no progress for LEAD_IDLE_NS, or its deadline passed - no thread
 * wake-up on the way of a request that completes meanwhile, the same loop
 * as ucx_perftest's. Then let go of the worker (the progress thread serves
 * what is left). */
static void lead(ucx_peer *p, ucx_xfer *ux, int *led)
{
    kvpi_ucx_server *s = p->server;
    uint64_t deadline = ux->deadline;
    ux->led = led;
    kvpi_ucx_run_posted(s, &p->poll);
    xfer_run(s, &ux->cmd); /* may finish (and free) ux */
    uint64_t last = kvpi_now_ns();
    int moved = 0;
    for (unsigned i = 1; led && !*led && p->ep; i++) {
        moved |= ucp_worker_progress(p->worker) != 0;
        if (i % 16) continue;
        kvpi_ucx_run_posted(s, &p->poll);
        check_alive(p); /* a same-host target's death, which UCX may not see */
        uint64_t now = kvpi_now_ns();
        if (now >= deadline) break;
        if (moved)
            last = now, moved = 0;
        else if (now - last > LEAD_IDLE_NS)
            break;
    }
    if (led && !*led) ux->led = NULL; /* still in flight: nobody leads it now */
    peer_service(s, &p->poll);
    int more = p->inflight > 0;
    pthread_mutex_unlock(&p->poll.lock);
    kvpi_ucx_let_go(s, &p->poll, more);
}

/* Every slice of x in memory the target's rkeys map here: copy them on this
 * thread and complete x - what UCP's shared memory transports would do with
 * the worker, without it, so that callers copy side by side. 0 (nothing
 * done) when a slice is not, or is refused, or the peer is down or x
 * cancelled: the worker's path then runs it, or fails it with its reason.
 * A copy cannot stall, so it needs no deadline; a target that died leaves
 * its memory mapped until we close, as UCP's own copy would read it, and
 * its endpoint's failure stops the copies as it stops UCP's. */
static int copy_mapped(ucx_peer *p, kvpi_xfer *x)
{
    if (!p->n_mapped) return 0;
    pthread_rwlock_rdlock(&p->map_lock);
    int ok =
        !atomic_load(&p->ep_status) && !atomic_load(&p->timed_out) && !atomic_load(&x->canceled);
    for (size_t i = 0; ok && i < x->n; i++)
        ok = !refusal(p, x->slices[i]) && p->mapped[x->slices[i]->remote_region];
    for (size_t i = 0; ok && i < x->n; i++) {
        kvpi_slice *sl = x->slices[i];
        size_t r = sl->remote_region;
        char *there = p->mapped[r] + (sl->remote - p->regions[r].addr);
        if (sl->opcode == KVP_OP_READ)
            memcpy(sl->local, there, sl->length);
        else
            memcpy(there, sl->local, sl->length);
        sl->status = KVP_OK;
    }
    /* A release: the bytes of a WRITE come before anything that tells the
     * target of them (a message after the completion). */
    pthread_rwlock_unlock(&p->map_lock);
    if (!ok) return 0;
    x->done(x, KVP_OK);
    return 1;
}

static void peer_post(void *peer, kvpi_xfer *x)
{
    ucx_peer *p = peer;
    if (copy_mapped(p, x)) return;
    uint64_t bytes = 0;
    for (size_t i = 0; i < x->n; i++)
        bytes += x->slices[i]->length;
    ucx_xfer *ux = calloc(1, sizeof *ux + x->n * sizeof ux->items[0]);
    if (!ux) {
        for (size_t i = 0; i < x->n; i++)
            x->slices[i]->status = KVP_ENOMEM;
        x->done(x, kvpi_error(KVP_ENOMEM, "ucx: out of memory"));
        return;
    }
    ux->cmd.run = xfer_run;
    ux->p = p;
    ux->x = x;
    ux->bytes = bytes;
    /* Everything posted goes to UCX at once, so an xfer waits behind the
     * bytes posted before it: its budget at the floor rate counts them. */
    uint64_t ahead = atomic_fetch_add(&p->posted_bytes, bytes);
    ux->deadline = kvpi_transfer_deadline(p->timeout_ms, p->min_rate, ahead + bytes);
    if (atomic_load(&p->ep_status) || atomic_load(&p->timed_out)) {
        /* Down: fails at once, without the worker. */
        for (size_t i = 0; i < x->n; i++)
            ux->items[i].status = UCS_ERR_CANCELED;
        finish(ux);
        return;
    }
    /* The progress thread holds the worker for one round at most: wait for
     * it. Another caller leads it until its own transfer is done: post ours
     * to it. */
    if (pthread_mutex_trylock(&p->poll.lock) == 0 ||
        (atomic_load_explicit(&p->poll.by_progress, memory_order_relaxed) &&
         pthread_mutex_lock(&p->poll.lock) == 0)) {
        lead(p, ux, NULL);
    } else {
        kvpi_ucx_post(p->server, &p->poll, &ux->cmd);
    }
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
    .peer_post = peer_post,
    .peer_close = peer_close,
};
