/* xpyd: many prefill and many decode engines, each a process on a "host" of
 * its own (a network namespace with its own address on one Linux bridge),
 * finding each other through a real etcd on a host of its own, with real TCP
 * between them (docs/scale-out.md).
 *
 *   build/xpyd --prefill 4 --decode 4 --seconds 60 --mode write|read|pipe
 *              [--skew K] [--baseline] [--fault F] [--json FILE]
 *
 * This process is the router: it runs in the namespace it was started in and
 * talks to its workers over socket pairs only (nothing is added to that
 * namespace). Each worker is this program again (--worker, bench/xpyd_worker.c),
 * one engine process (pipe mode: one process holding one pipe per peer) using
 * the public kvpipe API. A request is a KV block of the demo's Llama-3-8B shape: 128 KiB
 * per token (32 layers x 8 KV heads x 128 dims x K and V x 2 bytes), its
 * token count drawn log-uniformly from [--min-tokens, --max-tokens] (16..256
 * by default, seeded), i.e. about 11 MiB on average. The router assigns each
 * to a (prefill, decode) pair, round-robin over the pairs that have room
 * (--window requests in flight per pair; --skew K gives the pairs of decode 0
 * K times that, one hot decode), and it moves:
 *
 *   write  the prefill fills it and WRITEs it into the decode's registered
 *          slot; then the decode verifies every byte;
 *   read   the prefill fills its own registered slot; the decode READs it
 *          and verifies every byte;
 *   pipe   one kvpipe pipe per (prefill, decode) pair, P x D pipes: the
 *          prefill sends a [tokens, 65536] BF16 tensor, the decode receives it
 *          and checks that it is the request the router expects next on that
 *          pair (nothing lost or reordered) and every byte of it.
 *
 * The bytes are a pattern of the request id and the offset. A request's
 * latency runs from its assignment to the decode's verdict.
 *
 * Faults (--fault, injected at 30 % of the run, on one host): kill-prefill,
 * restart-prefill, restart-etcd, link-down, rate-limit. The router then checks
 * each fault's bounded effect from the per-pair outcomes and exits 1 when a
 * check fails (docs/scale-out.md lists the checks).
 *
 * Exit status: 0 every check held; 1 a check failed; 2 bad usage or the
 * cluster could not be set up; 77 network namespaces are not available here
 * (not root, no `ip`). Ctrl-C or SIGTERM stops the run and tears everything
 * down; the hosts' processes die with this one in any case
 * (PR_SET_PDEATHSIG), and the namespaces with them. */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "common/clock.h"
#include "kvpipe/kvpipe.h"
#include "netns.h"
#include "servers.h"
#include "test.h"
#include "xpyd.h"

/* --------------------------------------------------------------- router --- */

typedef struct opts {
    int prefill, decode, seconds, window, skew, baseline, timeout_ms;
    int min_tokens, max_tokens, fault_seconds, keep_logs, warmup_ms, sample_s;
    double keep, min_ratio;
    unsigned seed;
    const char *mode, *fault, *json;
} opts;

typedef struct proc {
    pid_t pid;
    int fd, host, ready, dead, prefill, index, restarted;
    char name[64];
    msg stats;
    int have_stats;
} proc;

typedef struct rq {
    int used, p, d, stage, failed, tokens, slot_p, slot_d;
    uint64_t id, t0;
    char err[ERR_LEN];
} rq;

typedef struct done_rec {
    uint32_t pair;
    int ok;
    uint64_t t_ms, lat_us, bytes;
} done_rec;

typedef struct pair_st {
    int inflight, cap;
    uint64_t busy; /* decode slots in use (bit k: slot base + k) */
    uint64_t ok, errors, mismatches, reordered, bytes;
    char first_err[ERR_LEN];
} pair_st;

typedef struct run {
    opts opts; /* this run's: its fault */
    const opts *o;
    int P, D, mode; /* mode: 0 write, 1 read, 2 pipe */
    kvpt_cluster c;
    char dir[64];
    proc etcd;
    proc pre[MAX_SIDE], dec[MAX_SIDE];
    pair_st pair[MAX_PAIRS];
    rq *rqs;
    int nrq;
    done_rec *done;
    size_t ndone, capdone;
    uint64_t next_id, start_ms, rr;
    size_t slot_bytes;
    /* fault timeline, ms since start */
    uint64_t t_fault, t_fault_end, t_restarted;
    int fault_host_prefill, fault_index, fault_done;
    char lookup_during[ERR_LEN + 64], lookup_after[ERR_LEN + 64];
    int lookup_during_st, lookup_after_st, lookups_pending;
    int checks_failed;
    char check_log[4096];
    double gbps, p50, p99, p999;
    uint64_t requests, errors, bytes, warm_errors;
    /* --sample-s: the largest of each figure over the engines, in the first
     * sample and the latest; samples taken. */
    int64_t first[3], last[3];
    int samples;
} run;

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

static void check(run *r, int ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void check(run *r, int ok, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    printf("  check %-4s %s\n", ok ? "ok" : "FAIL", line);
    size_t used = strlen(r->check_log);
    snprintf(r->check_log + used, sizeof r->check_log - used, "%s%s: %s", used ? "; " : "",
             ok ? "ok" : "FAIL", line);
    if (!ok) r->checks_failed++;
}

static uint64_t now_rel(run *r)
{
    return kvpi_now_ms() - r->start_ms;
}

static const char *self_exe(void)
{
    static char path[4096];
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
    path[n > 0 ? n : 0] = '\0';
    return path;
}

/* Spawn process pr on its host, a socket pair as its control link. */
static int spawn_worker(run *r, proc *pr)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return -1;
    fcntl(sv[1], F_SETFD, 0); /* the child's end survives exec */
    char a_index[16], a_ctl[16], a_peers[16], a_slot[32], a_slots[16], a_to[16], a_etcd[64];
    char peers[MAX_SIDE * 32] = "";
    int npeers = pr->prefill ? r->D : r->P;
    for (int i = 0; i < npeers; i++) {
        int host = pr->prefill ? 1 + r->P + i : 1 + i;
        strcat(peers, r->c.addr[host]);
        if (i + 1 < npeers) strcat(peers, ",");
    }
    /* slots: a decode holds the slots of every pair it is in; a prefill (read
     * mode) one per pair as well, at the same index as its decode uses */
    size_t slots = 0;
    for (int i = 0; i < (pr->prefill ? r->D : 1); i++)
        slots += (size_t)r->pair[pr->prefill ? i * r->P + pr->index : pr->index * r->P].cap;
    if (!pr->prefill) slots *= (size_t)r->P;
    snprintf(a_index, sizeof a_index, "%d", pr->index);
    snprintf(a_ctl, sizeof a_ctl, "%d", sv[1]);
    snprintf(a_peers, sizeof a_peers, "%d", npeers);
    snprintf(a_slot, sizeof a_slot, "%zu", r->slot_bytes);
    snprintf(a_slots, sizeof a_slots, "%zu", slots);
    snprintf(a_to, sizeof a_to, "%d", r->o->timeout_ms);
    snprintf(a_etcd, sizeof a_etcd, "%s:%d", r->c.addr[0], ETCD_PORT);
    char *argv[] = {(char *)self_exe(),
                    "--worker",
                    pr->prefill ? "prefill" : "decode",
                    "--index",
                    a_index,
                    "--ctl",
                    a_ctl,
                    "--addr",
                    r->c.addr[pr->host],
                    "--etcd",
                    a_etcd,
                    "--mode",
                    (char *)r->o->mode,
                    "--peers",
                    a_peers,
                    "--peer-addrs",
                    peers,
                    "--slot-bytes",
                    a_slot,
                    "--slots",
                    a_slots,
                    "--timeout-ms",
                    a_to,
                    NULL};
    char log[128];
    snprintf(log, sizeof log, "%s/%s%d.log", r->dir, pr->prefill ? "prefill" : "decode", pr->index);
    pr->pid = kvpt_cluster_spawn(&r->c, pr->host, argv, log);
    close(sv[1]);
    if (pr->pid < 0) {
        close(sv[0]);
        return -1;
    }
    pr->fd = sv[0];
    pr->ready = pr->dead = 0;
    return 0;
}

static int spawn_etcd(run *r)
{
    r->etcd.pid = kvpt_cluster_etcd(&r->c, 0, r->dir, ETCD_PORT, ETCD_PEER_PORT);
    return r->etcd.pid > 0 ? 0 : -1;
}

static void stop_etcd(run *r)
{
    if (r->etcd.pid > 0) {
        kill(r->etcd.pid, SIGTERM);
        if (kvpt_wait_child(r->etcd.pid, 10000) < 0) kill(r->etcd.pid, SIGKILL);
        r->etcd.pid = 0;
    }
}

static int pair_index(const run *r, int p, int d)
{
    return d * r->P + p;
}

/* Draw a token count, log-uniform on [min, max]. */
static int draw_tokens(run *r)
{
    double u = (double)rand() / ((double)RAND_MAX + 1.0);
    double lo = log((double)r->o->min_tokens), hi = log((double)r->o->max_tokens + 1);
    int t = (int)exp(lo + u * (hi - lo));
    if (t < r->o->min_tokens) t = r->o->min_tokens;
    if (t > r->o->max_tokens) t = r->o->max_tokens;
    return t;
}

static void to_worker(proc *pr, msg *m)
{
    xpyd_send_msg(pr->fd, NULL, m);
}

/* The first slot of pair (p, d) in decode d's buffer, and in prefill p's. */
static int dslot_base(run *r, int p, int d)
{
    return p * r->pair[pair_index(r, p, d)].cap;
}

static int pslot_base(run *r, int p, int d)
{
    int base = 0;
    for (int i = 0; i < d; i++)
        base += r->pair[pair_index(r, p, i)].cap;
    return base;
}

static void record(run *r, rq *q, int ok)
{
    if (r->ndone == r->capdone) {
        r->capdone = r->capdone ? 2 * r->capdone : 4096;
        r->done = realloc(r->done, r->capdone * sizeof *r->done);
        if (!r->done) abort();
    }
    pair_st *ps = &r->pair[pair_index(r, q->p, q->d)];
    uint64_t bytes = (uint64_t)q->tokens * TOKEN_BYTES;
    uint64_t now_ns = kvpi_now_ns();
    r->done[r->ndone++] = (done_rec){.pair = (uint32_t)pair_index(r, q->p, q->d),
                                     .ok = ok,
                                     .t_ms = now_rel(r),
                                     .lat_us = (now_ns - q->t0) / 1000,
                                     .bytes = bytes};
    if (ok) {
        ps->ok++;
        ps->bytes += bytes;
    } else {
        ps->errors++;
        if (!ps->first_err[0]) snprintf(ps->first_err, sizeof ps->first_err, "%s", q->err);
    }
    ps->inflight--;
    if (r->mode != 2) ps->busy &= ~(1ull << (q->slot_d - dslot_base(r, q->p, q->d)));
    q->used = 0;
}

static rq *find_rq(run *r, uint64_t id)
{
    for (int i = 0; i < r->nrq; i++)
        if (r->rqs[i].used && r->rqs[i].id == id) return &r->rqs[i];
    return NULL;
}

static void fail_rq(rq *q, const char *err)
{
    q->failed = 1;
    if (!q->err[0]) snprintf(q->err, sizeof q->err, "%s", err);
}

/* Start one request on the next pair with room, round-robin. */
static int dispatch_one(run *r)
{
    int pairs = r->P * r->D;
    for (int k = 0; k < pairs; k++) {
        int idx = (int)((r->rr + (uint64_t)k) % (uint64_t)pairs);
        int p = idx % r->P, d = idx / r->P;
        pair_st *ps = &r->pair[idx];
        if (ps->inflight >= ps->cap || !r->pre[p].ready || !r->dec[d].ready) continue;
        rq *q = NULL;
        for (int i = 0; i < r->nrq && !q; i++)
            if (!r->rqs[i].used) q = &r->rqs[i];
        if (!q) return 0;
        r->rr = (uint64_t)idx + 1;
        *q = (rq){.used = 1,
                  .p = p,
                  .d = d,
                  .id = r->next_id++,
                  .t0 = kvpi_now_ns(),
                  .tokens = draw_tokens(r)};
        ps->inflight++;
        if (r->mode != 2) {
            int k2 = 0;
            while (ps->busy & (1ull << k2))
                k2++;
            ps->busy |= 1ull << k2;
            q->slot_d = dslot_base(r, p, d) + k2;
            q->slot_p = pslot_base(r, p, d) + k2;
        }
        msg m = {.req = q->id, .tokens = (uint32_t)q->tokens};
        if (r->mode == 0) {
            m.type = CMD_WRITE;
            m.peer = (uint32_t)d;
            m.slot = (uint32_t)q->slot_d;
            snprintf(m.name, sizeof m.name, "%s", r->dec[d].name);
            to_worker(&r->pre[p], &m);
        } else if (r->mode == 1) {
            m.type = CMD_FILL;
            m.peer = (uint32_t)d;
            m.slot = (uint32_t)q->slot_p;
            to_worker(&r->pre[p], &m);
        } else {
            /* The decode is told to receive once the send succeeded: a
             * tensor whose send failed was never sent, and the decode would
             * otherwise wait for it and take the next one in its place. */
            m.type = CMD_PSEND;
            m.peer = (uint32_t)d;
            to_worker(&r->pre[p], &m);
        }
        q->stage = 1;
        return 1;
    }
    return 0;
}

static void on_done(run *r, proc *from, msg *m)
{
    rq *q = find_rq(r, m->req);
    if (!q) return; /* failed already (its prefill died) */
    pair_st *ps = &r->pair[pair_index(r, q->p, q->d)];
    if (m->status == -1) ps->mismatches++;
    if (m->status == -2) ps->reordered++;
    if (m->status == -1 || m->status == -2)
        printf("  t=%.1fs: pair p%d-d%d: %s\n", now_rel(r) / 1000.0, q->p, q->d, m->err);
    if (m->status != 0) fail_rq(q, m->err);
    if (q->stage == 1 && from->prefill && !q->failed) {
        /* on to the decode */
        msg n = {.req = q->id, .tokens = (uint32_t)q->tokens, .peer = (uint32_t)q->p};
        if (r->mode == 0) {
            n.type = CMD_VERIFY;
            n.slot = (uint32_t)q->slot_d;
        } else if (r->mode == 2) {
            n.type = CMD_PRECV;
        } else {
            n.type = CMD_READ;
            n.slot = (uint32_t)q->slot_p;
            n.slot2 = (uint32_t)q->slot_d;
            snprintf(n.name, sizeof n.name, "%s", r->pre[q->p].name);
        }
        q->stage = 2;
        to_worker(&r->dec[q->d], &n);
        return;
    }
    record(r, q, !q->failed);
}

/* A worker's control link closed: it died. What waited on it fails, naming it. */
static void on_dead(run *r, proc *pr)
{
    int status = 0;
    waitpid(pr->pid, &status, 0);
    char why[ERR_LEN];
    snprintf(why, sizeof why, "%s %d (%s) exited: %s %d", pr->prefill ? "prefill" : "decode",
             pr->index, pr->name, WIFSIGNALED(status) ? "signal" : "status",
             WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    printf("  %s\n", why);
    close(pr->fd);
    pr->fd = -1;
    pr->dead = 1;
    pr->ready = 0;
    pr->pid = 0;
    for (int i = 0; i < r->nrq; i++) {
        rq *q = &r->rqs[i];
        if (!q->used) continue;
        int waits =
            pr->prefill ? q->p == pr->index && (q->stage == 1 || r->mode == 2) : q->d == pr->index;
        if (!waits) continue;
        /* A prefill that dies between its send and its reply may have sent
         * the tensor: the decode drops it if it comes. */
        if (pr->prefill && r->mode == 2 && q->stage == 1 && !r->dec[q->d].dead) {
            msg g = {.type = CMD_GIVEUP, .peer = (uint32_t)pr->index, .req = q->id};
            to_worker(&r->dec[q->d], &g);
        }
        fail_rq(q, why);
        record(r, q, 0);
    }
    if (pr->prefill && r->mode == 2)
        for (int d = 0; d < r->D; d++)
            if (!r->dec[d].dead) {
                msg m = {.type = CMD_ABANDON, .peer = (uint32_t)pr->index};
                to_worker(&r->dec[d], &m);
            }
}

static void on_msg(run *r, proc *pr, msg *m)
{
    switch (m->type) {
    case REP_READY:
        if (m->status != 0) {
            printf("  %s %d did not start: %s\n", pr->prefill ? "prefill" : "decode", pr->index,
                   m->err);
            break;
        }
        snprintf(pr->name, sizeof pr->name, "%s", m->name);
        pr->ready = 1;
        if (pr->restarted && r->mode == 2) /* its pipes' peers wait for it again */
            for (int d = 0; d < r->D; d++)
                if (!r->dec[d].dead) {
                    msg n = {.type = CMD_ABANDON, .peer = (uint32_t)pr->index, .slot = 1};
                    to_worker(&r->dec[d], &n);
                }
        pr->restarted = 0;
        break;
    case REP_DONE:
        on_done(r, pr, m);
        break;
    case REP_STATS:
        pr->stats = *m;
        pr->have_stats = 1;
        break;
    case REP_LOOKUP:
        r->lookups_pending--;
        if (m->slot == 0) {
            r->lookup_during_st = m->status;
            snprintf(r->lookup_during, sizeof r->lookup_during, "%s after %llu ms",
                     m->status ? m->err : "ok", (unsigned long long)(m->elapsed_ms % 100000000));
        } else {
            r->lookup_after_st = m->status;
            snprintf(r->lookup_after, sizeof r->lookup_after, "%s after %llu ms",
                     m->status ? m->err : "ok", (unsigned long long)(m->elapsed_ms % 100000000));
        }
        break;
    }
}

/* Read what the workers say for up to wait_ms. */
static void pump(run *r, int wait_ms)
{
    struct pollfd pfd[2 * MAX_SIDE];
    proc *who[2 * MAX_SIDE];
    int n = 0;
    for (int i = 0; i < r->P; i++)
        if (r->pre[i].fd >= 0 && !r->pre[i].dead)
            who[n] = &r->pre[i], pfd[n++] = (struct pollfd){r->pre[i].fd, POLLIN, 0};
    for (int i = 0; i < r->D; i++)
        if (r->dec[i].fd >= 0 && !r->dec[i].dead)
            who[n] = &r->dec[i], pfd[n++] = (struct pollfd){r->dec[i].fd, POLLIN, 0};
    if (poll(pfd, (nfds_t)n, wait_ms) <= 0) return;
    for (int i = 0; i < n; i++) {
        if (!pfd[i].revents) continue;
        for (int k = 0; k < 64; k++) {
            msg m;
            ssize_t got = recv(who[i]->fd, &m, sizeof m, MSG_DONTWAIT);
            if (got == (ssize_t)sizeof m) {
                on_msg(r, who[i], &m);
                continue;
            }
            if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) on_dead(r, who[i]);
            break;
        }
    }
}

static void inject(run *r, int start)
{
    const char *f = r->o->fault;
    proc *pre0 = &r->pre[0];
    int dec_host = 1 + r->P + r->fault_index;
    if (strcmp(f, "kill-prefill") == 0 || strcmp(f, "restart-prefill") == 0) {
        if (start) {
            printf("  t=%.1fs: kill -9 prefill 0 (%s)\n", now_rel(r) / 1000.0, pre0->name);
            kill(pre0->pid, SIGKILL);
        } else if (strcmp(f, "restart-prefill") == 0) {
            printf("  t=%.1fs: restart prefill 0 under the same name\n", now_rel(r) / 1000.0);
            for (int i = 0; i < 100 && !pre0->dead; i++)
                pump(r, 50);
            if (spawn_worker(r, pre0) != 0)
                printf("  cannot restart prefill 0: %s\n", r->c.why);
            else
                pre0->restarted = 1;
        }
    } else if (strcmp(f, "restart-etcd") == 0) {
        msg m = {.type = CMD_LOOKUP, .slot = start ? 0 : 1};
        snprintf(m.name, sizeof m.name, "%s", r->pre[r->P - 1].name);
        if (start) {
            printf("  t=%.1fs: etcd stopped\n", now_rel(r) / 1000.0);
            stop_etcd(r);
        } else {
            printf("  t=%.1fs: etcd started again (same data)\n", now_rel(r) / 1000.0);
            if (spawn_etcd(r) != 0) printf("  etcd did not come back: %s\n", r->c.why);
        }
        /* a fresh lookup by decode 0, while the store is down, then after */
        r->lookups_pending++;
        to_worker(&r->dec[0], &m);
    } else if (strcmp(f, "link-down") == 0) {
        printf("  t=%.1fs: link of decode %d (%s) %s\n", now_rel(r) / 1000.0, r->fault_index,
               r->c.addr[dec_host], start ? "down" : "up");
        if (kvpt_cluster_link(&r->c, dec_host, !start) != 0) printf("  %s\n", r->c.why);
    } else if (strcmp(f, "rate-limit") == 0) {
        printf("  t=%.1fs: prefill 0's host %s\n", now_rel(r) / 1000.0,
               start ? "limited to 1 Mbit/s" : "unlimited again");
        if (kvpt_cluster_rate(&r->c, 1, start ? 1000 : 0) != 0) printf("  %s\n", r->c.why);
    }
}

/* Whether pair idx involves the faulted host. */
static int affected(run *r, int idx)
{
    if (!r->o->fault || strcmp(r->o->fault, "restart-etcd") == 0) return 0;
    int p = idx % r->P, d = idx / r->P;
    if (strcmp(r->o->fault, "link-down") == 0) return d == r->fault_index;
    return p == 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Bytes per second of the pairs (affected or not) completed in [t0, t1). */
static double rate_in(run *r, uint64_t t0, uint64_t t1, int want_affected)
{
    uint64_t bytes = 0;
    for (size_t i = 0; i < r->ndone; i++) {
        done_rec *d = &r->done[i];
        if (d->ok && d->t_ms >= t0 && d->t_ms < t1 && affected(r, (int)d->pair) == want_affected)
            bytes += d->bytes;
    }
    return t1 > t0 ? (double)bytes / ((double)(t1 - t0) / 1000.0) : 0;
}

static int pair_ok_in(run *r, int idx, uint64_t t0, uint64_t t1)
{
    int n = 0;
    for (size_t i = 0; i < r->ndone; i++)
        if (r->done[i].pair == (uint32_t)idx && r->done[i].ok && r->done[i].t_ms >= t0 &&
            r->done[i].t_ms < t1)
            n++;
    return n;
}

static void fault_checks(run *r)
{
    const opts *o = r->o;
    const char *f = o->fault;
    int pairs = r->P * r->D;
    uint64_t errs_unaffected = 0;
    for (int i = 0; i < pairs; i++)
        if (!affected(r, i)) errs_unaffected += r->pair[i].errors;
    check(r, errs_unaffected == 0, "no errors on the pairs away from the fault (%llu)",
          (unsigned long long)errs_unaffected);
    /* from a moment into the fault: what was past the network then (a
     * decode verifying) may still finish */
    uint64_t settle = r->t_fault + (r->t_fault_end - r->t_fault) / 3;
    int keeps = 1;
    for (int i = 0; i < pairs; i++)
        if (!affected(r, i) && pair_ok_in(r, i, settle, r->t_fault_end) == 0) keeps = 0;
    check(r, keeps, "every pair away from the fault completes requests during it (%.1f..%.1f s)",
          settle / 1000.0, r->t_fault_end / 1000.0);
    double before = rate_in(r, 0, r->t_fault, 0),
           during = rate_in(r, r->t_fault, r->t_fault_end, 0);
    if (strcmp(f, "restart-etcd") != 0)
        check(r, during >= o->keep * before,
              "the others keep their throughput: %.3f GB/s during against %.3f before (>= %.2fx)",
              during / 1e9, before / 1e9, o->keep);
    if (strcmp(f, "kill-prefill") == 0 || strcmp(f, "restart-prefill") == 0) {
        int named = 1, fast = 1;
        uint64_t bound = (uint64_t)o->timeout_ms * 2 + 2000;
        for (size_t i = 0; i < r->ndone; i++) {
            done_rec *d = &r->done[i];
            if (d->ok || !affected(r, (int)d->pair)) continue;
            if (d->t_ms > r->t_fault + bound) fast = 0;
        }
        for (int i = 0; i < pairs; i++)
            if (affected(r, i) && r->pair[i].errors && !strstr(r->pair[i].first_err, r->c.addr[1]))
                named = 0;
        check(r, fast, "the killed prefill's requests fail within %llu ms of the kill",
              (unsigned long long)bound);
        check(r, named, "their errors name the peer (%s)", r->c.addr[1]);
    }
    if (strcmp(f, "restart-prefill") == 0) {
        int back = r->t_restarted > 0;
        for (int i = 0; i < pairs && back; i++)
            if (affected(r, i) && pair_ok_in(r, i, r->t_restarted, UINT64_MAX) == 0) back = 0;
        check(r, back, "every pair of the restarted prefill completes requests after it is back");
    }
    if (strcmp(f, "link-down") == 0) {
        int back = 1;
        for (int i = 0; i < pairs; i++)
            if (affected(r, i) && pair_ok_in(r, i, r->t_fault_end, UINT64_MAX) == 0) back = 0;
        check(r, back, "the cut-off host's pairs complete requests after the link is back");
    }
    if (strcmp(f, "restart-etcd") == 0) {
        check(r, r->errors == 0, "running transfers continue: %llu errors",
              (unsigned long long)r->errors);
        printf("  lookup while etcd is down: %s\n", r->lookup_during);
        check(r, r->lookup_during[0] != '\0', "a lookup while etcd is down returns (%s)",
              r->lookup_during[0] ? (r->lookup_during_st ? "fails" : "served") : "no answer");
        check(r, r->lookup_after[0] && r->lookup_after_st == 0, "a lookup after it is back: %s",
              r->lookup_after[0] ? r->lookup_after : "no answer");
    }
}

static void teardown(run *r)
{
    proc *all[2 * MAX_SIDE];
    int n = 0;
    for (int i = 0; i < r->P; i++)
        all[n++] = &r->pre[i];
    for (int i = 0; i < r->D; i++)
        all[n++] = &r->dec[i];
    for (int i = 0; i < n; i++)
        if (all[i]->pid > 0) {
            msg m = {.type = CMD_QUIT};
            if (!stop_flag) to_worker(all[i], &m);
        }
    for (int i = 0; i < n; i++)
        if (all[i]->pid > 0) {
            if (stop_flag || kvpt_wait_child(all[i]->pid, 15000) < 0) {
                kill(all[i]->pid, SIGKILL);
                waitpid(all[i]->pid, NULL, 0);
            }
            all[i]->pid = 0;
        }
    for (int i = 0; i < n; i++)
        if (all[i]->fd >= 0) close(all[i]->fd), all[i]->fd = -1;
    stop_etcd(r);
    kvpt_cluster_destroy(&r->c);
    if (r->dir[0] && !r->o->keep_logs && !r->checks_failed) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", r->dir);
        if (system(cmd) != 0) fprintf(stderr, "xpyd: could not remove %s\n", r->dir);
    } else if (r->dir[0]) {
        printf("  logs kept in %s\n", r->dir);
    }
    free(r->rqs);
    free(r->done);
}

/* Engine k of the run: the prefills, then the decodes. */
static proc *engine(run *r, int k)
{
    return k < r->P ? &r->pre[k] : &r->dec[k - r->P];
}

/* Ask every live engine for its figures; the answers land in its stats. */
static void ask_stats(run *r)
{
    for (int k = 0; k < r->P + r->D; k++) {
        proc *pr = engine(r, k);
        pr->have_stats = 0;
        if (pr->ready) to_worker(pr, &(msg){.type = CMD_STATS});
    }
}

static int stats_missing(run *r)
{
    int missing = 0;
    for (int k = 0; k < r->P + r->D; k++)
        missing += engine(r, k)->ready && !engine(r, k)->have_stats;
    return missing;
}

/* One line of the engines' answers (--sample-s): each figure's range over
 * the engines that answered. */
static void print_sample(run *r, uint64_t t_ms)
{
    int64_t lo[4], hi[4];
    int n = 0;
    for (int e = 0; e < r->P + r->D; e++) {
        const proc *pr = engine(r, e);
        if (!pr->have_stats) continue;
        int64_t v[4] = {pr->stats.fds, pr->stats.conns, pr->stats.time_wait,
                        pr->stats.rss_kib / 1024};
        for (int k = 0; k < 4; k++) {
            lo[k] = n && lo[k] < v[k] ? lo[k] : v[k];
            hi[k] = n && hi[k] > v[k] ? hi[k] : v[k];
        }
        n++;
    }
    if (!n) return;
    printf("sample %6.0f s  engines %2d  fds %lld-%lld  established %lld-%lld  time_wait "
           "%lld-%lld  peak RSS %lld-%lld M\n",
           t_ms / 1000.0, n, (long long)lo[0], (long long)hi[0], (long long)lo[1], (long long)hi[1],
           (long long)lo[2], (long long)hi[2], (long long)lo[3], (long long)hi[3]);
    fflush(stdout);
    memcpy(r->last, hi, sizeof r->last);
    if (!r->samples++) memcpy(r->first, hi, sizeof r->first);
}

/* One whole run: cluster up, traffic, fault, stats, teardown. 0 when it ran
 * (checks may have failed), -1 when it could not be set up. */
static int run_cluster(run *r, const opts *o, int P, int D, const char *fault)
{
    memset(r, 0, sizeof *r);
    r->opts = *o;
    r->opts.fault = fault;
    r->o = o = &r->opts;
    r->P = P;
    r->D = D;
    r->mode = strcmp(o->mode, "write") == 0 ? 0 : strcmp(o->mode, "read") == 0 ? 1 : 2;
    r->slot_bytes = (size_t)o->max_tokens * TOKEN_BYTES;
    r->etcd.fd = -1;
    for (int i = 0; i < MAX_SIDE; i++)
        r->pre[i].fd = r->dec[i].fd = -1;
    int pairs = P * D, total_cap = 0;
    for (int i = 0; i < pairs; i++) {
        int d = i / P;
        r->pair[i].cap = o->window * (d == 0 ? o->skew : 1);
        total_cap += r->pair[i].cap;
    }
    r->nrq = total_cap;
    r->rqs = calloc((size_t)total_cap, sizeof *r->rqs);
    srand(o->seed);
    snprintf(r->dir, sizeof r->dir, "/tmp/kvp-xpyd-XXXXXX");
    if (!r->rqs || !mkdtemp(r->dir)) {
        fprintf(stderr, "xpyd: %s\n", strerror(errno));
        r->dir[0] = '\0';
        return -1;
    }
    printf("\n== %dP x %dD, %s mode, %d s%s%s ==\n", P, D, o->mode, o->seconds,
           fault ? ", fault " : "", fault ? fault : "");
    if (kvpt_cluster_create(&r->c, 1 + P + D, NET) != 0 || spawn_etcd(r) != 0) {
        fprintf(stderr, "xpyd: cluster: %s\n", r->c.why);
        r->checks_failed++;
        teardown(r);
        return -1;
    }
    for (int i = 0; i < P; i++) {
        r->pre[i] = (proc){.fd = -1, .host = 1 + i, .prefill = 1, .index = i};
        if (spawn_worker(r, &r->pre[i]) != 0) goto setup_failed;
    }
    for (int i = 0; i < D; i++) {
        r->dec[i] = (proc){.fd = -1, .host = 1 + P + i, .prefill = 0, .index = i};
        if (spawn_worker(r, &r->dec[i]) != 0) goto setup_failed;
    }
    uint64_t ready_by = kvpi_now_ms() + 60000;
    for (;;) {
        int ready = 0, dead = 0;
        for (int i = 0; i < P; i++)
            ready += r->pre[i].ready, dead += r->pre[i].dead;
        for (int i = 0; i < D; i++)
            ready += r->dec[i].ready, dead += r->dec[i].dead;
        if (ready == P + D) break;
        if (dead || stop_flag || kvpi_now_ms() > ready_by) {
            snprintf(r->c.why, sizeof r->c.why, "%s",
                     dead ? "a worker died at start" : "workers not ready within 60 s");
            goto setup_failed;
        }
        pump(r, 100);
    }
    /* the fault */
    r->fault_index = D - 1;
    uint64_t dur = (uint64_t)o->fault_seconds * 1000;
    r->t_fault = (uint64_t)o->seconds * 300;
    r->t_fault_end = r->t_fault + dur;
    int phase = 0;
    /* Warm-up: first connections, first touches of the buffers. Its
     * successes are not counted; its failures are. */
    r->start_ms = kvpi_now_ms();
    while (!stop_flag && now_rel(r) < (uint64_t)o->warmup_ms) {
        while (dispatch_one(r)) {
        }
        pump(r, 5);
    }
    for (size_t i = 0; i < r->ndone; i++)
        r->warm_errors += !r->done[i].ok;
    r->ndone = 0;
    for (int i = 0; i < pairs; i++)
        r->pair[i].ok = r->pair[i].bytes = 0;
    r->start_ms = kvpi_now_ms();
    uint64_t end = (uint64_t)o->seconds * 1000;
    uint64_t sample_every = (uint64_t)o->sample_s * 1000, next_sample = sample_every;
    uint64_t sample_asked = 0; /* when the answers awaited were asked for, + 1 */
    while (!stop_flag && now_rel(r) < end) {
        while (dispatch_one(r)) {
        }
        pump(r, 5);
        uint64_t t = now_rel(r);
        if (sample_asked && (!stats_missing(r) || t > sample_asked + 10000)) {
            print_sample(r, sample_asked - 1);
            sample_asked = 0;
        }
        if (sample_every && t >= next_sample && !sample_asked) {
            ask_stats(r);
            sample_asked = t + 1;
            next_sample += sample_every;
        }
        if (fault && phase == 0 && t >= r->t_fault) {
            inject(r, 1);
            phase = 1;
        }
        if (fault && phase == 1 && t >= r->t_fault_end) {
            inject(r, 0);
            phase = 2;
        }
        if (phase == 2 && !r->t_restarted && r->pre[0].ready && fault &&
            strcmp(fault, "restart-prefill") == 0)
            r->t_restarted = now_rel(r);
    }
    uint64_t end_ms = now_rel(r);
    /* drain */
    uint64_t drain_by = kvpi_now_ms() + (uint64_t)o->timeout_ms * 4 + 5000;
    for (;;) {
        int busy = r->lookups_pending > 0;
        for (int i = 0; i < r->nrq; i++)
            busy |= r->rqs[i].used;
        if (!busy || stop_flag || kvpi_now_ms() > drain_by) break;
        pump(r, 50);
    }
    for (int i = 0; i < r->nrq; i++)
        if (r->rqs[i].used) {
            fail_rq(&r->rqs[i], "not finished at the end of the run");
            record(r, &r->rqs[i], 0);
        }
    /* stats */
    ask_stats(r);
    uint64_t stats_by = kvpi_now_ms() + 10000;
    while (stats_missing(r) && !stop_flag && kvpi_now_ms() <= stats_by)
        pump(r, 50);
    if (sample_every) print_sample(r, end_ms);
    /* figures */
    uint64_t *lat = malloc((r->ndone + 1) * sizeof *lat);
    size_t nl = 0;
    for (size_t i = 0; i < r->ndone; i++) {
        if (r->done[i].ok) {
            r->requests++;
            r->bytes += r->done[i].bytes;
            if (lat) lat[nl++] = r->done[i].lat_us;
        } else {
            r->errors++;
        }
    }
    if (lat && nl) {
        qsort(lat, nl, sizeof *lat, cmp_u64);
        r->p50 = lat[nl / 2] / 1000.0;
        r->p99 = lat[(size_t)((double)nl * 0.99)] / 1000.0;
        r->p999 = lat[(size_t)((double)nl * 0.999)] / 1000.0;
    }
    free(lat);
    r->errors += r->warm_errors;
    r->gbps = end_ms ? (double)r->bytes / ((double)end_ms / 1000.0) / 1e9 : 0;
    uint64_t mism = 0, reord = 0;
    for (int i = 0; i < pairs; i++)
        mism += r->pair[i].mismatches, reord += r->pair[i].reordered;
    printf("%-10s %8s %8s %10s %8s %9s %9s %9s\n", "run", "requests", "errors", "GiB", "GB/s",
           "p50 ms", "p99 ms", "p999 ms");
    char label[32];
    snprintf(label, sizeof label, "%dx%d", P, D);
    printf("%-10s %8llu %8llu %10.2f %8.3f %9.1f %9.1f %9.1f\n", label,
           (unsigned long long)r->requests, (unsigned long long)r->errors,
           (double)r->bytes / (1u << 30), r->gbps, r->p50, r->p99, r->p999);
    printf("%-10s %-22s %6s %8s %9s\n", "engine", "segment", "conns", "lookups", "peak RSS");
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < (s ? D : P); i++) {
            proc *pr = s ? &r->dec[i] : &r->pre[i];
            char who[32];
            snprintf(who, sizeof who, "%s%d", s ? "decode" : "prefill", i);
            if (pr->have_stats)
                printf("%-10s %-22s %6lld %8lld %7.0f M\n", who, pr->name,
                       (long long)pr->stats.conns, (long long)pr->stats.lookups,
                       pr->stats.rss_kib / 1024.0);
            else
                printf("%-10s %-22s %6s %8s %9s\n", who, pr->name, "-", "-", "-");
        }
    printf("%-10s %8s %8s %8s %s\n", "pair", "ok", "errors", "GB/s", "first error");
    for (int i = 0; i < pairs; i++) {
        char pl[32];
        snprintf(pl, sizeof pl, "p%d-d%d", i % P, i / P);
        printf("%-10s %8llu %8llu %8.3f %s\n", pl, (unsigned long long)r->pair[i].ok,
               (unsigned long long)r->pair[i].errors,
               end_ms ? (double)r->pair[i].bytes / ((double)end_ms / 1000.0) / 1e9 : 0,
               r->pair[i].first_err);
    }
    check(r, mism == 0, "every byte verified: %llu requests with a wrong byte",
          (unsigned long long)mism);
    check(r, reord == 0, "nothing lost or reordered: %llu requests out of order",
          (unsigned long long)reord);
    if (!fault) {
        check(r, r->errors == 0, "no errors (%llu)", (unsigned long long)r->errors);
        int all = 1;
        for (int i = 0; i < pairs; i++)
            all &= r->pair[i].ok > 0;
        check(r, all, "every pair completed requests");
        if (r->samples >= 2) {
            /* Bounded: the last sample within a quarter (at least 8) of the
             * first, for each engine's largest figure. */
            static const char *const what[3] = {"descriptors", "established connections",
                                                "TIME_WAIT sockets"};
            for (int k = 0; k < 3; k++) {
                int64_t slack = r->first[k] / 4 > 8 ? r->first[k] / 4 : 8;
                check(r, r->last[k] <= r->first[k] + slack,
                      "%s stay bounded: at most %lld per engine in the first sample, %lld in "
                      "the last",
                      what[k], (long long)r->first[k], (long long)r->last[k]);
            }
        }
    } else {
        fault_checks(r);
    }
    if (stop_flag) r->checks_failed++;
    teardown(r);
    return 0;
setup_failed:
    fprintf(stderr, "xpyd: setup: %s\n", r->c.why);
    r->checks_failed++;
    teardown(r);
    return -1;
}

static void json_run(FILE *f, run *r, const char *label)
{
    fprintf(f, "  \"%s\": {\"prefill\": %d, \"decode\": %d, \"mode\": \"%s\", \"fault\": %s%s%s, ",
            label, r->P, r->D, r->o->mode, r->o->fault ? "\"" : "",
            r->o->fault ? r->o->fault : "null", r->o->fault ? "\"" : "");
    fprintf(f,
            "\"seconds\": %d, \"requests\": %llu, \"errors\": %llu, \"bytes\": %llu, "
            "\"gb_per_s\": %.4f, \"latency_ms\": {\"p50\": %.2f, \"p99\": %.2f, \"p999\": %.2f},\n",
            r->o->seconds, (unsigned long long)r->requests, (unsigned long long)r->errors,
            (unsigned long long)r->bytes, r->gbps, r->p50, r->p99, r->p999);
    fprintf(f, "    \"engines\": [");
    int first = 1;
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < (s ? r->D : r->P); i++) {
            proc *pr = s ? &r->dec[i] : &r->pre[i];
            fprintf(f, "%s\n      {\"role\": \"%s\", \"index\": %d, \"segment\": \"%s\", ",
                    first ? "" : ",", s ? "decode" : "prefill", i, pr->name);
            if (pr->have_stats)
                fprintf(
                    f, "\"connections\": %lld, \"metadata_lookups\": %lld, \"peak_rss_kib\": %lld}",
                    (long long)pr->stats.conns, (long long)pr->stats.lookups,
                    (long long)pr->stats.rss_kib);
            else
                fprintf(
                    f,
                    "\"connections\": null, \"metadata_lookups\": null, \"peak_rss_kib\": null}");
            first = 0;
        }
    fprintf(f, "],\n    \"pairs\": [");
    for (int i = 0; i < r->P * r->D; i++) {
        pair_st *ps = &r->pair[i];
        fprintf(f,
                "%s\n      {\"prefill\": %d, \"decode\": %d, \"ok\": %llu, \"errors\": %llu, "
                "\"wrong_bytes\": %llu, \"reordered\": %llu, \"bytes\": %llu}",
                i ? "," : "", i % r->P, i / r->P, (unsigned long long)ps->ok,
                (unsigned long long)ps->errors, (unsigned long long)ps->mismatches,
                (unsigned long long)ps->reordered, (unsigned long long)ps->bytes);
    }
    fprintf(f, "],\n    \"checks_failed\": %d}", r->checks_failed);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: xpyd [--prefill P] [--decode D] [--seconds S] [--mode write|read|pipe]\n"
            "            [--window W] [--skew K] [--min-tokens N] [--max-tokens N] [--seed N]\n"
            "            [--timeout-ms MS] [--baseline] [--min-ratio R]\n"
            "            [--fault kill-prefill|restart-prefill|restart-etcd|link-down|rate-limit]\n"
            "            [--fault-seconds S] [--keep R] [--warmup-ms MS] [--sample-s S]\n"
            "            [--json FILE] [--keep-logs]\n"
            "Many prefill and many decode engines, each in a network namespace of its own,\n"
            "through a real etcd (docs/scale-out.md). Needs root and iproute2.\n");
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--worker") == 0) return xpyd_worker(argc, argv);
    opts o = {.prefill = 2,
              .decode = 2,
              .seconds = 10,
              .window = 2,
              .skew = 1,
              .timeout_ms = 3000,
              .min_tokens = 16,
              .max_tokens = 256,
              .fault_seconds = -1,
              .keep = 0.9,
              .seed = 1,
              .mode = "write",
              .warmup_ms = 2000};
    int help = 0;
    const bench_opt lo[] = {{"prefill", BENCH_INT, &o.prefill, 'p'},
                            {"decode", BENCH_INT, &o.decode, 'd'},
                            {"seconds", BENCH_INT, &o.seconds, 's'},
                            {"mode", BENCH_STR, &o.mode, 'm'},
                            {"window", BENCH_INT, &o.window, 'w'},
                            {"skew", BENCH_INT, &o.skew, 'k'},
                            {"min-tokens", BENCH_INT, &o.min_tokens},
                            {"max-tokens", BENCH_INT, &o.max_tokens},
                            {"seed", BENCH_UINT, &o.seed},
                            {"timeout-ms", BENCH_INT, &o.timeout_ms},
                            {"baseline", BENCH_FLAG, &o.baseline},
                            {"min-ratio", BENCH_DOUBLE, &o.min_ratio},
                            {"fault", BENCH_STR, &o.fault},
                            {"fault-seconds", BENCH_INT, &o.fault_seconds},
                            {"keep", BENCH_DOUBLE, &o.keep},
                            {"json", BENCH_STR, &o.json},
                            {"keep-logs", BENCH_FLAG, &o.keep_logs},
                            {"help", BENCH_FLAG, &help, 'h'},
                            {"warmup-ms", BENCH_INT, &o.warmup_ms},
                            {"sample-s", BENCH_INT, &o.sample_s}};
    if (bench_parse(argc, argv, lo, sizeof lo / sizeof lo[0])) {
        usage(stderr);
        return 2;
    }
    if (help) {
        usage(stdout);
        return 0;
    }
    const char *why = NULL;
    if (optind < argc)
        why = "unexpected argument";
    else if (strcmp(o.mode, "write") && strcmp(o.mode, "read") && strcmp(o.mode, "pipe"))
        why = "--mode: write, read or pipe";
    else if (o.prefill < 1 || o.prefill > MAX_SIDE || o.decode < 1 || o.decode > MAX_SIDE)
        why = "--prefill and --decode: 1..16";
    else if (o.window < 1 || o.skew < 1 || o.window * o.skew > 64)
        why = "--window and --skew: at least 1, window x skew at most 64";
    else if (o.min_tokens < 1 || o.max_tokens < o.min_tokens || o.max_tokens > 8192)
        why = "--min-tokens 1.. <= --max-tokens ..8192";
    else if (o.seconds < 1)
        why = "--seconds: at least 1";
    else if (o.timeout_ms < 100)
        why = "--timeout-ms: at least 100";
    else if (o.warmup_ms < 0)
        why = "--warmup-ms: 0 or more";
    else if (o.sample_s < 0)
        why = "--sample-s: 0 (no samples) or more";
    if (o.fault) {
        int pf = !strcmp(o.fault, "kill-prefill") || !strcmp(o.fault, "restart-prefill") ||
                 !strcmp(o.fault, "rate-limit");
        if (!pf && strcmp(o.fault, "restart-etcd") && strcmp(o.fault, "link-down"))
            why = "--fault: kill-prefill, restart-prefill, restart-etcd, link-down or rate-limit";
        else if (pf && o.prefill < 2)
            why = "this fault needs --prefill 2 or more (pairs away from the fault)";
        else if (!strcmp(o.fault, "link-down") && o.decode < 2)
            why = "link-down needs --decode 2 or more (pairs away from the fault)";
        if (o.fault_seconds < 0) o.fault_seconds = !strcmp(o.fault, "link-down") ? 8 : 4;
        if (!why && o.seconds * 3 / 10 + o.fault_seconds + 2 > o.seconds)
            why = "--seconds too short for the fault: it starts at 30 % of the run and needs "
                  "--fault-seconds + 2 s after";
    }
    if (why) {
        fprintf(stderr, "xpyd: %s\n", why);
        usage(stderr);
        return 2;
    }
    const char *no = kvpt_netns_unavailable();
    if (no) {
        fprintf(stderr, "xpyd: SKIP: %s\n", no);
        return 77;
    }
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    static run base, main_run;
    int rc = 0;
    double ratio = 0;
    if (o.baseline) {
        if (run_cluster(&base, &o, 1, 1, NULL) != 0) return 2;
        if (base.checks_failed) rc = 1;
    }
    if (!stop_flag) {
        if (run_cluster(&main_run, &o, o.prefill, o.decode, o.fault) != 0) return 2;
        if (main_run.checks_failed) rc = 1;
    }
    if (o.baseline && !stop_flag) {
        ratio = base.gbps > 0 ? main_run.gbps / base.gbps : 0;
        printf("\naggregate %dx%d %.3f GB/s against 1x1 %.3f GB/s: %.2fx\n", o.prefill, o.decode,
               main_run.gbps, base.gbps, ratio);
        if (o.min_ratio > 0) {
            int ok = ratio >= o.min_ratio;
            printf("  check %-4s aggregate >= %.2fx one pair\n", ok ? "ok" : "FAIL", o.min_ratio);
            if (!ok) rc = 1;
        }
    }
    if (o.json && !stop_flag) {
        FILE *f = fopen(o.json, "w");
        if (!f) {
            fprintf(stderr, "xpyd: %s: %s\n", o.json, strerror(errno));
            return 2;
        }
        fprintf(f,
                "{\n  \"token_bytes\": %u, \"tokens\": {\"distribution\": \"log-uniform\", "
                "\"min\": %d, \"max\": %d, \"seed\": %u}, \"window\": %d, \"skew\": %d,\n",
                TOKEN_BYTES, o.min_tokens, o.max_tokens, o.seed, o.window, o.skew);
        if (o.baseline) {
            json_run(f, &base, "baseline_1x1");
            fprintf(f, ",\n  \"ratio_to_1x1\": %.4f,\n", ratio);
        }
        json_run(f, &main_run, "run");
        fprintf(f, ",\n  \"ok\": %s\n}\n", rc == 0 ? "true" : "false");
        fclose(f);
    }
    if (stop_flag) {
        fprintf(stderr, "xpyd: interrupted; everything torn down\n");
        return 130;
    }
    return rc;
}
