/* The tensor pipe's receive side: a window of messages taken off the data
 * link and READ ahead.
 *
 * recv takes every message waiting on the link (up to recv_window of them)
 * and starts the READs of the announced ones at once, so that several run
 * concurrently (the engine pipelines small ones on one connection and
 * spreads large ones); inline messages are copied out of ZeroMQ as they are
 * taken. The window hands them out strictly in arrival order, and each one
 * is acknowledged when it is handed out (as a tensor or as its error), so the
 * sender's FIFO of buffers is released in order whatever order the READs
 * finish in: an ACK frees the sender's oldest buffer, which is this window's
 * head. READs start in order too, while the bytes held stay under
 * recv_window_bytes (the head always starts).
 *
 * A message taken is answered with exactly one ACK, unless the pipe closes
 * first: then what the window holds is dropped unacknowledged, as what is
 * still queued in ZeroMQ is.
 *
 * Deferred ACKs. The ACK of an announced message is due when the message is
 * handed out, and leaves before recv returns if the link takes it at once,
 * as MooncakePipe's does: the sender waits for it to free its buffer (a link
 * that does not take it: see acks_try). Only a kvpipe pipe sends inline messages, and
 * no buffer waits for their ACKs (the sender lets them wait in ZeroMQ too):
 * those are owed, and leave together, when 16 are owed, when an announced
 * message's ACK leaves (behind them: the count stays in FIFO order), or
 * ack_delay_us after the first of them: sent by a receiver waiting in recv,
 * or by the control thread (ack_timer_fd) while no receiver runs. So a
 * message echoed at once (a ping) costs no ACK and none of the wake-ups an
 * ACK costs both sides on its round trip.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/timerfd.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/digest.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "pipe/pipe_internal.h"
#include "pipe/safetensors.h"

/* Deferred ACKs owed that make the receiver send them at once. */
#define ACKS_OWED_MAX 16

enum { RX_WAITING = 1, RX_READING, RX_DONE };

static kvpi_rx_entry *rx_at(kvp_pipe *p, size_t i)
{
    return &p->rx[(p->rx_head + i) % (size_t)p->opts.recv_window];
}

/* Record why e failed (the current kvp_last_error()). */
static void rx_fail(kvpi_rx_entry *e, kvp_status st)
{
    e->status = st;
    e->why = strdup(*kvp_last_error() ? kvp_last_error() : kvp_strerror(st));
}

static kvp_status check_announcement(kvp_pipe *p, uint64_t addr, uint64_t len)
{
    return kvpi_announce_check(addr, len, p->opts.max_message_bytes, p->ep.local_segment,
                               p->ep.peer_segment);
}

/* Integrity: a message whose digest is not the one its tag carries fails
 * (pipe_internal.h, "Integrity"). */
static void rx_check(kvp_pipe *p, kvpi_rx_entry *e, uint64_t digest)
{
    if (digest == e->tag.digest) return;
    kvpi_counter_add(&p->counters.corrupt, 1);
    rx_fail(e, kvpi_error(KVP_ECORRUPT,
                          "pipe %s: message %llu from %s (%llu bytes, %s) arrived corrupted: "
                          "its digest differs from the one the sender took as it copied the "
                          "message in (its buffer changed before it was read, or the bytes "
                          "changed on the way)",
                          p->ep.local_segment, (unsigned long long)e->tag.seq, p->ep.peer_segment,
                          (unsigned long long)e->len, e->is_inline ? "inline" : "READ"));
}

/* Whether e's message is checked against its tag's digest. */
static int rx_digested(const kvp_pipe *p, const kvpi_rx_entry *e)
{
    return p->integrity && e->tagged && e->tag.has_digest;
}

/* The window holds len more bytes (a READ started, an inline copy taken). */
static void rx_hold(kvp_pipe *p, size_t len)
{
    p->rx_bytes += len;
    if (p->rx_bytes > p->rx_bytes_peak) p->rx_bytes_peak = p->rx_bytes;
}

/* A READ of the window completed (kvp_batch_opts.on_complete, on an engine
 * thread): wake rx_wait. */
static void rx_read_done(kvp_batch *b, void *arg)
{
    (void)b;
    kvp_pipe *p = arg;
    uint64_t one = 1;
    if (write(p->rx_done_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVPI_WARN("pipe %s: cannot write its READ eventfd: %s", p->ep.local_segment,
                  strerror(errno));
}

/* Start e's READ into a new local managed buffer. */
static void rx_start(kvp_pipe *p, kvpi_rx_entry *e)
{
    kvp_status st = KVP_OK;
    if (!p->peer_open) {
        if ((st = kvp_engine_open_segment(p->engine, p->ep.peer_segment, &p->peer_seg))) {
            rx_fail(e, st);
            e->state = RX_DONE;
            return;
        }
        p->peer_open = 1;
    }
    if ((st = kvp_engine_alloc(p->engine, (size_t)e->len, &e->buf))) {
        e->buf = NULL;
        rx_fail(e, st);
        e->state = RX_DONE;
        return;
    }
    kvp_request req = {KVP_OP_READ, e->buf, e->addr, (size_t)e->len};
    kvp_batch *b;
    kvp_batch_opts bo;
    kvp_batch_opts_init(&bo);
    bo.on_complete = rx_read_done;
    bo.user_data = p;
    /* A tagged announcement is READ only from the instance that made it
     * (pipe_internal.h, "Tags"). */
    bo.instance = e->tagged ? e->tag.instance : NULL;
    if ((st = kvp_batch_submit_with(p->engine, p->peer_seg, &req, 1, &bo, &b))) {
        kvp_engine_free(p->engine, e->buf);
        e->buf = NULL;
        rx_fail(e, st);
        e->state = RX_DONE;
        return;
    }
    rx_hold(p, (size_t)e->len);
    e->batch = b;
    e->state = RX_READING;
}

/* Start the READs of waiting entries, in order. The head always starts,
 * whatever the entries behind it hold (inline copies taken meanwhile count
 * in rx_bytes too), so recv always makes progress; an entry behind it
 * starts only while the bytes held stay within recv_window_bytes. So the
 * window holds at most recv_window_bytes + one message (the head) + the
 * inline copies (at most recv_window of inline_max_bytes). */
static void rx_start_waiting(kvp_pipe *p)
{
    for (size_t i = 0; i < p->rx_count; i++) {
        kvpi_rx_entry *e = rx_at(p, i);
        if (e->state != RX_WAITING) continue;
        if (i > 0 && p->rx_bytes + e->len > p->opts.recv_window_bytes) return;
        rx_start(p, e);
    }
}

static kvpi_rx_entry *rx_push(kvp_pipe *p, uint64_t addr, uint64_t len, int is_inline,
                              const kvpi_msg_tag *tag)
{
    kvpi_rx_entry *e = rx_at(p, p->rx_count++);
    *e = (kvpi_rx_entry){.addr = addr, .len = len, .status = KVP_OK, .is_inline = is_inline};
    if (tag) {
        e->tagged = 1;
        e->tag = *tag;
    }
    return e;
}

static void take_announcement(kvp_pipe *p, uint64_t addr, uint64_t len, const kvpi_msg_tag *tag)
{
    kvpi_rx_entry *e = rx_push(p, addr, len, 0, tag);
    kvp_status st = check_announcement(p, addr, len);
    if (st) {
        rx_fail(e, st);
        e->state = RX_DONE;
        return;
    }
    e->state = RX_WAITING;
}

/* An inline message of a len-byte file in frame f0: copied into a managed
 * buffer, like the one a READ fills. */
static void take_inline(kvp_pipe *p, zmq_msg_t *f0, size_t len, const kvpi_msg_tag *tag)
{
    kvpi_rx_entry *e = rx_push(p, 0, len, 1, tag);
    e->state = RX_DONE;
    kvp_status st = check_announcement(p, 0, len);
    if (!st) st = kvp_engine_alloc(p->engine, len, &e->buf);
    if (st) {
        e->buf = NULL;
        rx_fail(e, st);
        return;
    }
    const uint8_t *body = (const uint8_t *)zmq_msg_data(f0) + KVPI_INLINE_TAG_LEN;
    kvpi_digester *d = rx_digested(p, e) ? kvpi_digester_new() : NULL;
    if (d) {
        kvpi_digester_copy(d, e->buf, body, len);
        rx_check(p, e, kvpi_digester_value(d));
        kvpi_digester_free(d);
    } else {
        memcpy(e->buf, body, len);
    }
    rx_hold(p, len);
}

/* Take one message off the data link into the window. Returns 1 when one was
 * taken (or dropped as malformed), 0 when none was waiting, -1 on ETERM. */
static int take_one(kvp_pipe *p)
{
    zmq_msg_t f[2];
    zmq_msg_init(&f[0]);
    zmq_msg_init(&f[1]);
    int frames = 0, more = 1, rc = 1;
    kvpi_control_msg m = {0};
    while (more) {
        zmq_msg_t *part = &f[frames < 2 ? frames : 1];
        if (frames >= 2) {
            zmq_msg_close(part);
            zmq_msg_init(part);
        }
        if (zmq_msg_recv(part, p->data_in.sock, ZMQ_DONTWAIT) < 0) {
            int err = zmq_errno();
            /* Parts of a message arrive together: only the first can be missing. */
            rc = frames > 0 || err == EAGAIN || err == EINTR ? (frames > 0) : -1;
            break;
        }
        kvpi_control_add_frame(&m, zmq_msg_data(part), zmq_msg_size(part));
        frames++;
        more = zmq_msg_more(part);
    }
    uint64_t addr, len;
    size_t body;
    kvpi_msg_tag tag;
    const kvpi_msg_tag *tagged = kvpi_control_take_tag(&m, &tag) ? &tag : NULL;
    if (kvpi_announce_decode(&m, &addr, &len)) {
        atomic_store(&p->data_in.good, 1);
        take_announcement(p, addr, len, tagged);
    } else if (p->opts.inline_max_bytes && kvpi_inline_decode(&m, &body)) {
        atomic_store(&p->data_in.good, 1);
        take_inline(p, &f[0], body, tagged);
    } else if (frames > 0) {
        /* No MooncakePipe sends it and no buffer of the peer waits for its
         * ACK: dropped unanswered. */
        kvpi_pipe_drop_message(p, frames, m.size[0], m.size[1]);
    }
    zmq_msg_close(&f[0]);
    zmq_msg_close(&f[1]);
    return rc;
}

/* Take what the link holds, as far as the window has room, and start READs.
 * At most a window's worth of messages is looked at, so that a flood of
 * malformed ones does not hold recv past its timeout. *drained: the link
 * said it has nothing more (so its ZMQ_FD signals the next message). */
static kvp_status rx_fill(kvp_pipe *p, int *drained)
{
    *drained = 0;
    for (int n = 0; n < p->opts.recv_window && p->rx_count < (size_t)p->opts.recv_window; n++) {
        int r = take_one(p);
        if (r < 0) return kvpi_pipe_zmq_fail(p, "receive");
        if (r == 0) {
            *drained = 1;
            break;
        }
    }
    rx_start_waiting(p);
    return KVP_OK;
}

/* The head's READ ended: keep its outcome. */
static void rx_finish(kvp_pipe *p, kvpi_rx_entry *e)
{
    kvp_status st = kvp_batch_wait(e->batch, 0);
    if (st) rx_fail(e, st);
    if (!st && rx_digested(p, e)) rx_check(p, e, kvpi_digest(e->buf, (size_t)e->len));
    kvp_batch_free(e->batch);
    e->batch = NULL;
    e->state = RX_DONE;
}

/* ----------------------------------------------------------- waiting --- */

static void drain_eventfd(int fd)
{
    uint64_t v;
    while (read(fd, &v, sizeof v) > 0) {
    }
}

/* Wait for something to do: a message on the link (while the window has
 * room), a READ of the window completing, or the control thread's wake-up;
 * at most timeout_ms (negative: no limit). The link is watched through its
 * ZMQ_FD, which signals new activity only: the caller has just found it
 * drained. A plain poll(2) here, as zmq_poll() costs several system calls
 * more per wait. */
static kvp_status rx_wait(kvp_pipe *p, int timeout_ms)
{
    struct pollfd fds[3] = {
        {.fd = p->rx_done_fd, .events = POLLIN},
        {.fd = p->recv_wake_fd, .events = POLLIN},
        {.fd = p->data_in_fd, .events = POLLIN},
    };
    nfds_t n = p->rx_count < (size_t)p->opts.recv_window ? 3 : 2;
    int r = poll(fds, n, timeout_ms);
    if (r < 0 && errno != EINTR)
        return kvpi_error(KVP_EIO, "pipe %s: poll: %s", p->ep.local_segment, strerror(errno));
    if (r > 0 && fds[0].revents) drain_eventfd(p->rx_done_fd);
    if (r > 0 && fds[1].revents) drain_eventfd(p->recv_wake_fd);
    return KVP_OK;
}

/* Whether the head is ready to hand out, finishing its READ if it ended. */
static int head_ready(kvp_pipe *p)
{
    if (!p->rx_count) return 0;
    kvpi_rx_entry *e = rx_at(p, 0);
    if (e->state == RX_READING && kvp_batch_pending(e->batch) == 0) rx_finish(p, e);
    return e->state == RX_DONE;
}

/* Poll the link and the head for up to busy_poll_us before sleeping. */
static kvp_status busy_poll(kvp_pipe *p)
{
    uint64_t until = kvpi_now_ns() + (uint64_t)p->opts.busy_poll_us * 1000u;
    kvp_status st;
    int drained;
    do {
        if ((st = rx_fill(p, &drained))) return st;
        if (head_ready(p)) return KVP_OK;
    } while (kvpi_now_ns() < until);
    return KVP_OK;
}

/* --------------------------------------------------------- handing out --- */

static int is_none(const kvp_tensor *t)
{
    if (t->dtype != KVP_DTYPE_I64 || t->nbytes != 8) return 0;
    int64_t v;
    memcpy(&v, t->data, 8);
    return v == KVP_PIPE_NONE_VALUE;
}

/* Parse the message in place and hand out a tensor that owns the buffer. */
static kvp_status deliver(kvp_pipe *p, void *buf, size_t len, kvp_tensor **out)
{
    kvp_tensor t;
    kvp_status st = kvpi_safetensors_parse(buf, len, &t);
    if (st) {
        kvpi_error_kept why = kvpi_error_keep();
        kvp_engine_free(p->engine, buf);
        return kvpi_error(st, "pipe %s: message from %s: %s", p->ep.local_segment,
                          p->ep.peer_segment, why.text);
    }
    if (is_none(&t)) {
        kvp_engine_free(p->engine, buf);
        *out = NULL;
        return KVP_OK;
    }
    kvpi_held *h = calloc(1, sizeof *h);
    if (!h) {
        kvp_engine_free(p->engine, buf);
        return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    }
    h->t = t;
    *out = kvpi_pipe_hold(p, h, buf);
    return KVP_OK;
}

/* Sending ACKs never makes recv wait: every ACK is owed first, and the
 * owed ones that are due leave while the link takes them at once. What it
 * does not take (a sender stopped or gone, its PULL not reading, or its ACK
 * link not connected yet) is tried again - by a receiver waiting in recv,
 * else by the control thread (ack_timer_fd) - every millisecond, and every
 * ACK_RETRY_SLOW_US once ack_timeout_ms passed since it was due.
 *
 * A tagged ACK (pipe_internal.h, "Tags") is never given up: it stands for
 * every message its sender sent before, and a restarted sender drops it. Plain
 * ACKs, all alike, are given up ack_timeout_ms after they were due, or at
 * once while the link is stalled (the last ones were given up), so that a
 * dead sender costs one wait, not one per message - but only once the link
 * took an ACK since open: a sender whose ACK link is slow to connect (a lost
 * SYN) gets them when it does. The sender frees its buffers in order, so an
 * ACK that leaves late still frees the right one. */

/* How often a kept ACK is tried again once ack_timeout_ms passed. */
#define ACK_RETRY_SLOW_US 100000

/* Arm the control thread's timer to fire in us microseconds. */
static int ack_timer_in(kvp_pipe *p, long us)
{
    struct itimerspec due = {.it_value = {.tv_sec = us / 1000000, .tv_nsec = us % 1000000 * 1000}};
    return timerfd_settime(p->ack_timer_fd, 0, &due, NULL);
}

/* Microseconds until owed ACKs the link did not take are tried again. */
static long acks_retry_us(const kvp_pipe *p)
{
    uint64_t slow = p->acks_due_ns + (uint64_t)p->opts.ack_timeout_ms * 1000000u;
    return kvpi_now_ns() < slow ? 1000 : ACK_RETRY_SLOW_US;
}

/* Send the owed tagged ACK: 1 when the link took it. wait_ms: how long it
 * may wait for the link (0: not at all). */
static int send_tagged_ack(kvp_pipe *p, int wait_ms)
{
    uint8_t tag[KVPI_TAG_DIGEST_LEN];
    size_t tag_len = kvpi_tag_encode(&p->ack_tag, tag);
    if (kvpi_pipe_zsend(p->ack_push, KVPI_ACK_TEXT, KVPI_ACK_LEN, ZMQ_SNDMORE | ZMQ_DONTWAIT, 0) !=
            KVPI_ACK_LEN &&
        (wait_ms == 0 || kvpi_pipe_zsend(p->ack_push, KVPI_ACK_TEXT, KVPI_ACK_LEN, ZMQ_SNDMORE,
                                         wait_ms) != KVPI_ACK_LEN))
        return 0;
    /* The first frame is in: ZeroMQ takes the rest of the message. */
    kvpi_pipe_zsend(p->ack_push, tag, tag_len, 0, p->opts.io_timeout_ms);
    return 1;
}

/* The link took what was owed. */
static void acks_sent(kvp_pipe *p)
{
    atomic_store(&p->acks_owed, 0);
    p->ack_tagged = 0;
    p->ack_stalled = 0;
    p->ack_link_up = 1;
}

/* Under recv_lock, with the owed ACKs due: send them while the link takes
 * them, give up plain ones as above. Returns how many are left, to try
 * again. */
static size_t acks_try(kvp_pipe *p)
{
    if (p->ack_tagged) {
        if (atomic_load(&p->acks_owed) && send_tagged_ack(p, 0)) acks_sent(p);
        return atomic_load(&p->acks_owed);
    }
    while (atomic_load(&p->acks_owed) > 0 &&
           kvpi_pipe_zsend(p->ack_push, KVPI_ACK_TEXT, KVPI_ACK_LEN, ZMQ_DONTWAIT, 0) ==
               KVPI_ACK_LEN) {
        atomic_fetch_sub(&p->acks_owed, 1);
        p->ack_stalled = 0;
        p->ack_link_up = 1;
    }
    size_t left = atomic_load(&p->acks_owed);
    uint64_t limit = p->acks_due_ns + (uint64_t)p->opts.ack_timeout_ms * 1000000u;
    if (left && p->ack_link_up && (p->ack_stalled || kvpi_now_ns() >= limit)) {
        p->ack_stalled = 1;
        atomic_store(&p->acks_owed, 0);
        /* The data is here already; only the sender's buffer release
         * depends on the ACK, and a sender that does not take it is gone
         * or not listening. */
        KVPI_WARN_LIMITED("pipe %s: could not send %zu ACKs to %s within %d ms: %s",
                          p->ep.local_segment, left, p->ep.peer_segment, p->opts.ack_timeout_ms,
                          zmq_strerror(zmq_errno()));
        left = 0;
    }
    return left;
}

void kvpi_pipe_close_acks(kvp_pipe *p)
{
    /* Closing: the owed ACKs may wait for the link, up to ack_timeout_ms
     * (not when it is stalled); ack_linger_ms then lets them go out. */
    int wait_ms = p->ack_stalled ? 0 : p->opts.ack_timeout_ms;
    size_t left = atomic_load(&p->acks_owed);
    if (left && p->ack_tagged) {
        if (send_tagged_ack(p, p->opts.ack_timeout_ms)) left = 0;
        wait_ms = p->opts.ack_timeout_ms;
    } else {
        for (; left > 0; left--)
            if (kvpi_pipe_zsend(p->ack_push, KVPI_ACK_TEXT, KVPI_ACK_LEN, 0, wait_ms) !=
                KVPI_ACK_LEN)
                break;
    }
    atomic_store(&p->acks_owed, 0);
    if (left)
        KVPI_WARN_LIMITED("pipe %s: could not send %zu ACKs to %s within %d ms: %s",
                          p->ep.local_segment, left, p->ep.peer_segment, wait_ms,
                          zmq_strerror(zmq_errno()));
}

long kvpi_pipe_acks_due(kvp_pipe *p)
{
    if (atomic_load(&p->acks_owed) == 0) return 0;
    if (pthread_mutex_trylock(&p->recv_lock) != 0) return 1000;
    /* Never waits: this thread answers the ZAP requests that a connection
     * of the ACK link itself may need first. */
    long again = acks_try(p) ? acks_retry_us(p) : 0;
    pthread_mutex_unlock(&p->recv_lock);
    return again;
}

/* Milliseconds until the deferred ACKs owed are due (rounded up; 0: due
 * now), or -1 when none is owed. Under recv_lock. */
static int acks_due_in_ms(const kvp_pipe *p)
{
    if (atomic_load(&p->acks_owed) == 0) return -1;
    uint64_t now = kvpi_now_ns();
    if (now >= p->acks_due_ns) return 0;
    return (int)((p->acks_due_ns - now + 999999) / 1000000);
}

/* The ACK of a message handed out (see the top): due at once for an
 * announced message (with the deferred ones owed before it); deferred for
 * an inline one, up to ACKS_OWED_MAX of them. A tagged one replaces the
 * tagged one owed (it covers it); a plain one after a tagged one is another
 * sender's (the tagged one's sender was replaced), which gives that up. */
static void ack_taken(kvp_pipe *p, int is_inline, const kvpi_msg_tag *tag)
{
    uint64_t now = kvpi_now_ns();
    long us = is_inline ? p->opts.ack_delay_us : 0;
    if (tag) {
        p->ack_tagged = 1;
        p->ack_tag = *tag;
        p->ack_tag.has_digest = 0; /* an ACK's tag is KVPI_TAG_LEN */
    } else if (p->ack_tagged) {
        p->ack_tagged = 0;
        atomic_store(&p->acks_owed, 0);
    }
    size_t owed = atomic_fetch_add(&p->acks_owed, 1) + 1;
    if (owed == 1) p->acks_due_ns = now + (uint64_t)us * 1000u;
    if (us > 0 && owed < ACKS_OWED_MAX) {
        if (owed == 1 && ack_timer_in(p, us) != 0) p->acks_due_ns = now;
        if (p->acks_due_ns > now) return;
    }
    if (p->acks_due_ns > now) p->acks_due_ns = now;
    if (acks_try(p)) ack_timer_in(p, acks_retry_us(p)); /* the control thread tries again */
}

/* Hand out the head (done): acknowledge it, then its tensor or its error. */
static kvp_status rx_pop(kvp_pipe *p, kvp_tensor **out)
{
    kvpi_rx_entry e = *rx_at(p, 0);
    p->rx_head = (p->rx_head + 1) % (size_t)p->opts.recv_window;
    p->rx_count--;
    if (e.buf) p->rx_bytes -= (size_t)e.len;
    /* One ACK per message taken, good or bad, once we are done with the
     * sender's buffer: the sender holds one for each. */
    ack_taken(p, e.is_inline, e.tagged ? &e.tag : NULL);
    kvp_status st = e.status;
    if (st == KVP_OK) {
        st = deliver(p, e.buf, (size_t)e.len, out);
    } else {
        kvp_engine_free(p->engine, e.buf);
        st = kvpi_error(st, "%s", e.why ? e.why : kvp_strerror(st));
    }
    free(e.why);
    pthread_mutex_lock(&p->lock);
    if (st == KVP_OK) {
        p->stats.received++;
        p->stats.bytes_received += e.len;
        if (e.is_inline) p->stats.inline_received++;
    } else {
        p->stats.bad_messages++;
    }
    pthread_mutex_unlock(&p->lock);
    /* The head's bytes are free: the next READs may start. */
    rx_start_waiting(p);
    return st;
}

kvp_status kvp_pipe_recv(kvp_pipe *p, int timeout_ms, kvp_tensor **out)
{
    if (!p || !out) return kvpi_error(KVP_EINVAL, "pipe recv: NULL argument");
    pthread_mutex_lock(&p->recv_lock);
    uint64_t deadline = kvpi_now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    kvp_status st = KVP_OK;
    /* What woke poll_fd is looked at below (kvp_pipe_recv_fd). */
    kvpi_pipe_drain_fd(p->rx_done_fd);
    kvpi_pipe_drain_fd(p->recv_wake_fd);
    int polled = 0, drained, looks = 0;
    for (;;) {
        if (!kvp_pipe_usable(p)) {
            st = kvpi_error(KVP_ECLOSED, "pipe %s can no longer be used", p->ep.local_segment);
            break;
        }
        if (atomic_exchange(&p->data_redial, 0)) kvpi_pipe_link_reconnect(p, &p->data_in);
        if ((st = rx_fill(p, &drained))) break;
        if (head_ready(p)) {
            st = rx_pop(p, out);
            break;
        }
        if (p->opts.busy_poll_us && timeout_ms != 0 && !polled) {
            polled = 1;
            if ((st = busy_poll(p))) break;
            continue;
        }
        int left = timeout_ms < 0 ? -1 : kvpi_pipe_remaining_ms(deadline);
        if (left == 0) {
            /* The window stays as it is: a READ running goes on (the engine's
             * deadlines end it), and the next recv hands out its message.
             * The link's ZMQ_FD, which signals activity, not state, is
             * cleared (ZMQ_EVENTS): with the window full it may say messages
             * wait, and recv_fd must not stay readable for them until the
             * head's READ ends. */
            int events = 0;
            size_t events_len = sizeof events;
            zmq_getsockopt(p->data_in.sock, ZMQ_EVENTS, &events, &events_len);
            /* Reading ZMQ_EVENTS takes in the socket's pending commands and
             * resets ZMQ_FD: a message that arrived since rx_fill found none
             * is readable now and will not signal again. Take it (while the
             * window has room), or a caller waiting on recv_fd next would
             * sleep past it until something else arrived. */
            if ((events & ZMQ_POLLIN) && p->rx_count < (size_t)p->opts.recv_window && looks++ < 4)
                continue;
            if (timeout_ms) kvpi_counter_add(&p->counters.recv_timeouts, 1);
            if (!p->rx_count)
                st = kvpi_error(KVP_ETIMEDOUT, "pipe %s: nothing announced by %s within %d ms",
                                p->ep.local_segment, p->ep.peer_segment, timeout_ms);
            else
                st = kvpi_error(KVP_ETIMEDOUT,
                                "pipe %s: the next message from %s (%llu bytes) is still being "
                                "read after %d ms; %zu in the window, nothing consumed",
                                p->ep.local_segment, p->ep.peer_segment,
                                (unsigned long long)rx_at(p, 0)->len, timeout_ms, p->rx_count);
            break;
        }
        if (!drained && p->rx_count < (size_t)p->opts.recv_window) continue; /* more to take */
        /* A READ of the window ending wakes rx_wait (rx_done_fd); deferred
         * ACKs leave when due. */
        int wait = left, acks = acks_due_in_ms(p);
        if (acks == 0) acks = acks_try(p) ? (int)(acks_retry_us(p) / 1000) : -1;
        if (acks > 0 && (wait < 0 || acks < wait)) wait = acks;
        if ((st = rx_wait(p, wait))) break;
    }
    pthread_mutex_unlock(&p->recv_lock);
    return st;
}

void kvpi_pipe_drop_window(kvp_pipe *p)
{
    while (p->rx_count) {
        kvpi_rx_entry *e = rx_at(p, 0);
        if (e->batch) kvp_batch_free(e->batch); /* waits for its READ */
        if (e->buf) kvp_engine_free(p->engine, e->buf);
        free(e->why);
        p->rx_head = (p->rx_head + 1) % (size_t)p->opts.recv_window;
        p->rx_count--;
    }
    p->rx_bytes = 0;
}
