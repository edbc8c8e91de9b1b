/* The ucx transport's transfers (transfer.h): a peer's xfers issued to UCX
 * under the runtime's lock, completed from UCP's callbacks on whichever
 * thread progresses, failed at their deadline, given up when UCX keeps them
 * past it; and the copies of memory the rkeys map here.
 */
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVPI_LOG_SUBSYS "ucx"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "transport/ucx/transfer.h"
#include "transport/ucx/wire.h"

/* How often a busy peer on this host is checked for being alive. */
#define ALIVE_CHECK_NS (100 * 1000 * 1000)

void kvpi_ucx_revoke_range(ucx_peer *p, uint64_t addr, uint64_t length)
{
    pthread_rwlock_wrlock(&p->map_lock); /* waits for the copies running */
    for (size_t i = 0; i < p->n_regions; i++)
        if (p->regions[i].addr < addr + length && addr < p->regions[i].addr + p->regions[i].length)
            p->revoked[i] = KVPI_UCX_REVOKED_DEREG;
    pthread_rwlock_unlock(&p->map_lock);
}

void kvpi_ucx_find_mapping(ucx_peer *p, size_t i)
{
    void *here;
    if (ucp_rkey_ptr(p->rkeys[i], p->regions[i].addr, &here) != UCS_OK) return;
    p->mapped[i] = here;
    p->n_mapped++;
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

void kvpi_ucx_watch_process(ucx_peer *p, const cJSON *o)
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

typedef struct ucx_item {
    ucx_xfer *ux;
    ucs_status_t status;
    int refused; /* never issued: REFUSED_* */
} ucx_item;

enum { REFUSED_OUTSIDE = 1, REFUSED_REVOKED = 2, REFUSED_NO_RKEY = 3, REFUSED_CANCELED = 4 };

/* Why sl may not be issued (REFUSED_*), or 0. The caller holds the runtime's
 * lock or map_lock (both are held to change revoked). The engine checked
 * the range before; one-sided, this is the last place a bad one can be
 * stopped. */
static int refusal(const ucx_peer *p, const kvpi_slice *sl)
{
    size_t r = sl->remote_region;
    if (r >= p->n_regions || !kvpi_regions_contain(&p->regions[r], 1, sl->remote, sl->length))
        return REFUSED_OUTSIDE;
    if (p->revoked[r])
        return p->revoked[r] == KVPI_UCX_REVOKED_NO_RKEY ? REFUSED_NO_RKEY : REFUSED_REVOKED;
    return 0;
}

/* One posted xfer. Everything here changes under the runtime's lock: it is
 * issued by the lock's holder, and UCP calls its requests back from the
 * holder's progress. */
struct ucx_xfer {
    kvpi_ucx_later later; /* first: its completion, deferred */
    ucx_peer *p;
    kvpi_xfer *x;
    uint64_t deadline;
    uint64_t bytes;
    int pending; /* requests in flight */
    int writes;
    int abandoned;         /* completed without its requests (see abandon) */
    atomic_int *ran;       /* kvpi_ucx_run's: set once done ran; NULL for peer_post */
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

/* Set the slices' statuses and complete x; ux stays (for its caller, or,
 * abandoned, for UCX's callbacks). */
static void report(ucx_xfer *ux)
{
    atomic_fetch_sub(&ux->p->posted_bytes, ux->bytes);
    ucx_peer *p = ux->p;
    kvpi_xfer *x = ux->x;
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
    /* Nothing of ux after done: once the peer's last xfer is done the
     * engine may close the peer, and the close of a frozen worker purges
     * an abandoned ux's requests, whose last callback frees it. */
    atomic_int *ran = ux->ran;
    x->done(x, result);
    if (ran) atomic_store(ran, 1);
}

/* Every request of ux completed (or none was issued): complete; a poster
 * before anything was issued, or once the lock was let go. */
static void finish(ucx_xfer *ux)
{
    report(ux);
    free(ux);
}

static void finish_later(kvpi_ucx_later *l)
{
    finish((ucx_xfer *)l);
}

static void report_later(kvpi_ucx_later *l)
{
    report((ucx_xfer *)l); /* abandoned: ux stays for UCX's callbacks */
}

/* Under the lock: complete ux once it is let go. */
static void complete_later(ucx_xfer *ux, void (*run)(kvpi_ucx_later *))
{
    ux->later.run = run;
    kvpi_ucx_defer(ux->p->rt, &ux->later);
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
    if (!ux->ran) atomic_fetch_sub(&p->rt->inflight, 1);
    if (--ux->pending > 0) return;
    unlink_issued(p, ux);
    complete_later(ux, finish_later);
}

/* Issue one request; r is what ucp_*_nbx returned. */
static void issued(ucx_xfer *ux, ucx_item *it, ucs_status_ptr_t r)
{
    if (UCS_PTR_IS_PTR(r)) {
        ux->p->inflight++;
        if (!ux->ran) kvpi_ucx_inflight_add(ux->p->rt); /* nobody waits here: the thread drives */
        ux->pending++;
    } else {
        it->status = UCS_PTR_STATUS(r);
    }
}

/* Issue ux's requests; the caller holds the runtime's lock. */
static void xfer_run(ucx_xfer *ux)
{
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
        complete_later(ux, finish_later);
        return;
    }
    ux->prev = NULL;
    ux->next = p->issued;
    if (p->issued) p->issued->prev = ux;
    p->issued = ux;
}

/* Out of time: close the endpoint, which completes what is in flight with
 * UCS_ERR_CANCELED, at the next progress or at once (UCX may purge them in
 * ucp_ep_close_nbx itself: request_done runs, and unlinks the xfers from
 * p->issued; their completions wait for the unlock); the engine then looks
 * the peer up again. The caller holds the runtime's lock. */
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
 * their bytes once it resumes, into memory their callers had back
 * (tests/probes/ucx_close_pending.c: 60 of 64 GETs of 4 MiB, up to 6 MB
 * written after they were given up; cancel_test crashed so). After this
 * long the xfer completes without them, so that no caller waits for ever,
 * and the worker is frozen: never progressed again, destroyed without
 * draining when the peer closes (the engine closes it after the failure),
 * so that nothing lands in memory its caller owns again. ux stays (leaked
 * if UCX never calls its requests back). */
#define ABANDON_NS (1000u * 1000000u)

static void abandon(ucx_peer *p, ucx_xfer *ux)
{
    unlink_issued(p, ux);
    p->inflight -= ux->pending;
    if (!ux->ran) atomic_fetch_sub(&p->rt->inflight, ux->pending);
    ux->abandoned = 1;
    if (!p->frozen) kvpi_ucx_poller_remove(p->rt, &p->poll);
    p->frozen = 1;
    complete_later(ux, report_later);
}

/* After each round of progress: an xfer past its deadline cuts the
 * endpoint; what is still issued ABANDON_NS after the
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
            cut(p); /* may unlink ux (and the others): read none of them after */
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

unsigned kvpi_ucx_transfers_service(ucx_peer *p)
{
    check_alive(p);
    unsigned had = p->issued != NULL;
    check_deadlines(p);
    return had && !p->issued; /* given up */
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

/* Issue x; ran: kvpi_ucx_run's flag, or NULL. */
static void post(ucx_peer *p, kvpi_xfer *x, atomic_int *ran)
{
    if (copy_mapped(p, x)) {
        if (ran) atomic_store(ran, 1);
        return;
    }
    uint64_t bytes = 0;
    for (size_t i = 0; i < x->n; i++)
        bytes += x->slices[i]->length;
    ucx_xfer *ux = calloc(1, sizeof *ux + x->n * sizeof ux->items[0]);
    if (!ux) {
        for (size_t i = 0; i < x->n; i++)
            x->slices[i]->status = KVP_ENOMEM;
        x->done(x, kvpi_error(KVP_ENOMEM, "ucx: out of memory"));
        if (ran) atomic_store(ran, 1);
        return;
    }
    ux->p = p;
    ux->x = x;
    ux->ran = ran;
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
    pthread_mutex_lock(&p->rt->lock);
    xfer_run(ux);
    kvpi_ucx_unlock(p->rt); /* may complete (and free) ux */
}

void kvpi_ucx_post(void *peer, kvpi_xfer *x)
{
    post(peer, x, NULL);
}

/* Progress calls per round of kvpi_ucx_run, and the empty rounds between
 * two yields of the CPU (a yield costs about a microsecond: a request that
 * completes within some tens of them is not slowed by one). */
#define RUN_BUDGET 16
#define RUN_YIELD 64

void kvpi_ucx_run(void *peer, kvpi_xfer *x)
{
    ucx_peer *p = peer;
    atomic_int ran = 0;
    post(p, x, &ran);
    /* As ucx_perftest's loop, on the peer's worker: no thread wake-up on
     * the way of a request that completes meanwhile. A slow peer is waited
     * for yielding the CPU between empty rounds; the deadlines are checked
     * in each (the peer's service). */
    for (unsigned idle = 0; !atomic_load(&ran);)
        if (kvpi_ucx_progress_one(p->rt, &p->poll, RUN_BUDGET))
            idle = 0;
        else if (++idle % RUN_YIELD == 0)
            sched_yield();
}
