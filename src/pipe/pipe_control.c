/* The tensor pipe's control thread and its negotiator (pipe.c starts and
 * stops both; pipe_internal.h says which thread owns which socket): taking
 * ACKs off the ACK link, the links' monitors and their redials, the ZAP
 * handler of the authenticated mode and of the inline path's connection
 * count, the deferred ACKs' timer, and the negotiator, which reads the
 * peer's descriptor for its inline offer after each new connection. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/timerfd.h>
#include <unistd.h>
#include <zmq.h>

#include <cjson/cJSON.h>

#include "common/clock.h"
#include "common/digest.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "engine/engine_ext.h"
#include "pipe/pipe_internal.h"
#include "pipe/pipe_metrics.h"

/* Messages the control thread takes off the ACK link before it looks at its
 * other sockets again. */
#define ACK_BATCH 256
/* How soon the control thread looks again at a data_in redial it handed to
 * a receiver that is busy (with a READ, say). */
#define HANDOFF_RETRY_MS 100

/* --------------------------------------- the links and the control thread --- */

/* One whole message off a link (its parts arrive together, so this does not
 * wait), as a kvpi_control_msg (announce.h). Returns the frame count, 0 when
 * none was waiting, -1 on ETERM. */
static int take_message(void *sock, kvpi_control_msg *m)
{
    zmq_msg_t part;
    zmq_msg_init(&part);
    *m = (kvpi_control_msg){0};
    int more;
    do {
        if (zmq_msg_recv(&part, sock, ZMQ_DONTWAIT) < 0) {
            int err = zmq_errno();
            zmq_msg_close(&part);
            if (m->frames > 0 || err == EAGAIN || err == EINTR) return m->frames;
            return -1;
        }
        kvpi_control_add_frame(m, zmq_msg_data(&part), zmq_msg_size(&part));
        more = zmq_msg_more(&part);
    } while (more);
    zmq_msg_close(&part);
    return m->frames;
}

/* Only the 3-byte frame "ACK" frees a buffer (every MooncakePipe sends just
 * that), or that frame tagged (pipe_internal.h, "Tags"): anything else could
 * free one the peer is still reading. */
static void handle_ack(kvp_pipe *p, kvpi_control_msg *m)
{
    kvpi_msg_tag tag;
    int tagged = kvpi_control_take_tag(m, &tag);
    if (kvpi_ack_is_valid(m)) {
        kvpi_pipe_take_ack(p, tagged ? &tag : NULL);
        return;
    }
    pthread_mutex_lock(&p->lock);
    p->stats.bad_acks++;
    pthread_mutex_unlock(&p->lock);
    KVPI_WARN_LIMITED("pipe %s: dropped a malformed ACK from %s (%d frame(s), the first of %zu "
                      "bytes; an ACK is the one 3-byte frame \"ACK\")",
                      p->ep.local_segment, p->ep.peer_segment, m->frames, m->size[0]);
}

static int take_acks(kvp_pipe *p)
{
    for (int i = 0; i < ACK_BATCH; i++) {
        kvpi_control_msg m;
        int n = take_message(p->ack_in.sock, &m);
        if (n <= 0) return n;
        handle_ack(p, &m);
    }
    return 0;
}

void kvpi_pipe_drop_message(kvp_pipe *p, int frames, size_t size0, size_t size1)
{
    pthread_mutex_lock(&p->lock);
    p->stats.bad_messages++;
    pthread_mutex_unlock(&p->lock);
    char shape[64];
    if (frames == 1)
        snprintf(shape, sizeof shape, "1 frame of %zu bytes", size0);
    else
        snprintf(shape, sizeof shape, "%d frames, the first of %zu and %zu bytes", frames, size0,
                 size1);
    KVPI_WARN_LIMITED("pipe %s: dropped a malformed announcement from %s (%s); an announcement is "
                      "two 8-byte frames (address, length)%s",
                      p->ep.local_segment, p->ep.peer_segment, shape,
                      p->opts.inline_max_bytes ? ", or one frame of an inline message" : "");
}

/* Read the link's monitor: a DISCONNECTED that no CONNECT_RETRIED follows is
 * a connection ZeroMQ closed for a protocol error and will not reconnect. */
static int link_events(kvp_pipe *p, kvpi_pull_link *l)
{
    for (;;) {
        uint8_t ev[6];
        char addr[256];
        int n = zmq_recv(l->mon, ev, sizeof ev, ZMQ_DONTWAIT);
        if (n < 0) return zmq_errno() == EAGAIN || zmq_errno() == EINTR ? 0 : -1;
        if (zmq_recv(l->mon, addr, sizeof addr, 0) < 0) return -1;
        uint16_t event;
        memcpy(&event, ev, sizeof event);
        if (n != 6) continue;
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            l->handshaken = 1;
            continue;
        }
        if (event & KVPI_PIPE_HANDSHAKE_FAILED) {
            l->refused = 1;
            KVPI_WARN_LIMITED("pipe %s: the CURVE handshake of the %s link to %s (%s) failed: "
                              "the peer holds another key, or none (a MooncakePipe peer, or "
                              "kvpipe without the key, cannot join an authenticated pipe)",
                              p->ep.local_segment, l->what, p->ep.peer_segment, l->endpoint);
            continue;
        }
        if (event == ZMQ_EVENT_DISCONNECTED && p->auth && !l->handshaken && !l->refused)
            KVPI_WARN_LIMITED("pipe %s: the %s link to %s (%s) was closed during its CURVE "
                              "handshake: the peer holds another key, or none (a MooncakePipe "
                              "peer, or kvpipe without the key, cannot join an authenticated "
                              "pipe)",
                              p->ep.local_segment, l->what, p->ep.peer_segment, l->endpoint);
        if (event == ZMQ_EVENT_DISCONNECTED) l->handshaken = l->refused = 0;
        if (event == ZMQ_EVENT_DISCONNECTED) {
            if (atomic_exchange(&l->good, 0)) l->backoff_ms = p->opts.redial_min_ms;
            l->redial_at = kvpi_now_ms() + (uint64_t)l->backoff_ms;
        } else {
            l->redial_at = 0; /* ZeroMQ is (re)connecting by itself */
        }
    }
}

/* Authenticated: read a PUSH socket's monitor, which shows only refused
 * handshakes: a connection to our port by someone without the key. */
static int push_events(kvp_pipe *p, void *mon, const char *what)
{
    for (;;) {
        uint8_t ev[6];
        char addr[256];
        int n = zmq_recv(mon, ev, sizeof ev, ZMQ_DONTWAIT);
        if (n < 0) return zmq_errno() == EAGAIN || zmq_errno() == EINTR ? 0 : -1;
        int m = zmq_recv(mon, addr, sizeof addr - 1, 0);
        if (m < 0) return -1;
        addr[m < (int)sizeof addr - 1 ? m : (int)sizeof addr - 1] = '\0';
        KVPI_WARN_LIMITED("pipe %s: refused a connection to its %s port %d (%s): its CURVE "
                          "handshake failed: a peer without the pipe's key (a MooncakePipe "
                          "peer, kvpipe without the key or with another, or a stranger)",
                          p->ep.local_segment, what,
                          strcmp(what, "ACK") == 0 ? p->ep.ack_port : p->ep.data_port, addr);
    }
}

/* Connect the link's socket again. Its owner only. The endpoint's dead
 * session goes first: two live ones would share the peer's messages
 * round-robin and could reorder them. */
void kvpi_pipe_link_reconnect(kvp_pipe *p, kvpi_pull_link *l)
{
    zmq_disconnect(l->sock, l->endpoint);
    if (zmq_connect(l->sock, l->endpoint) != 0)
        KVPI_WARN_LIMITED("pipe %s: cannot connect the %s link to %s again: %s",
                          p->ep.local_segment, l->what, l->endpoint, zmq_strerror(zmq_errno()));
}

/* Whether the link's back-off has passed; then it is logged and the next
 * back-off doubles. */
static int link_due(kvp_pipe *p, kvpi_pull_link *l, uint64_t now)
{
    if (!l->redial_at || now < l->redial_at) return 0;
    l->redial_at = 0;
    KVPI_WARN_LIMITED("pipe %s: ZeroMQ closed the %s link to %s (%s) after a protocol error (a "
                      "frame above %zu bytes, a malformed ZeroMQ stream, or a refused handshake: "
                      "an authenticated peer refuses a pipe without its key); connecting again "
                      "after %d ms",
                      p->ep.local_segment, l->what, p->ep.peer_segment, l->endpoint,
                      l == &p->data_in && p->opts.inline_max_bytes > p->opts.max_control_frame
                          ? p->opts.inline_max_bytes
                          : p->opts.max_control_frame,
                      l->backoff_ms);
    l->backoff_ms =
        l->backoff_ms > p->opts.redial_max_ms / 2 ? p->opts.redial_max_ms : l->backoff_ms * 2;
    return 1;
}

/* data_in is the receivers' socket: reconnect it here only when no receiver
 * holds it; else a receiver waiting on it is woken to do it, and one busy
 * with a READ does it when it next waits (looked at again after a while). */
static void data_handoff(kvp_pipe *p, uint64_t now)
{
    if (!atomic_load(&p->data_redial) || now < p->handoff_at) return;
    if (pthread_mutex_trylock(&p->recv_lock) == 0) {
        if (atomic_exchange(&p->data_redial, 0)) kvpi_pipe_link_reconnect(p, &p->data_in);
        pthread_mutex_unlock(&p->recv_lock);
        p->handoff_at = 0;
        return;
    }
    if (kvpi_eventfd_signal(p->recv_wake_fd))
        KVPI_WARN("pipe %s: cannot wake a receiver: %s", p->ep.local_segment, strerror(errno));
    p->handoff_at = now + HANDOFF_RETRY_MS;
}

/* How long the control thread may sleep: until the next thing due, or for
 * ever. */
static long control_timeout(const kvp_pipe *p, uint64_t now)
{
    uint64_t due[] = {p->data_in.redial_at, p->ack_in.redial_at,
                      atomic_load(&p->data_redial) ? p->handoff_at : 0};
    uint64_t next = 0;
    for (size_t i = 0; i < sizeof due / sizeof due[0]; i++)
        if (due[i] && (!next || due[i] < next)) next = due[i];
    if (!next) return atomic_load(&p->data_redial) ? 0 : -1;
    return next > now ? (long)(next - now) : 0;
}

/* ------------------------------------------------------- the ZAP handler --- */

/* ZAP (ZeroMQ RFC 27) request frames: version, request id, domain, address,
 * routing id, mechanism, credentials... */
#define ZAP_FRAMES_MAX 8

/* Answer one ZAP request: everyone is accepted (the ZAP domain is there for
 * what it makes ZeroMQ refuse, see make_socket()), but a connection to
 * data_push is counted first, under push_lock, before the reply lets its
 * handshake finish: from then on no sender uses the inline path until the
 * negotiator has read the peer's descriptor again. Returns -1 on ETERM. */
static int zap_answer(kvp_pipe *p)
{
    zmq_msg_t f[ZAP_FRAMES_MAX];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, p->zap, n ? 0 : ZMQ_DONTWAIT) < 0) {
            int err = zmq_errno();
            zmq_msg_close(&part);
            for (int i = 0; i < n; i++)
                zmq_msg_close(&f[i]);
            return n == 0 && (err == EAGAIN || err == EINTR) ? 0 : -1;
        }
        more = zmq_msg_more(&part);
        if (n < ZAP_FRAMES_MAX)
            f[n++] = part;
        else
            zmq_msg_close(&part);
    }
    int announce =
        n >= 3 && zmq_msg_size(&f[2]) == strlen(KVPI_PIPE_ZAP_ANNOUNCE) &&
        memcmp(zmq_msg_data(&f[2]), KVPI_PIPE_ZAP_ANNOUNCE, strlen(KVPI_PIPE_ZAP_ANNOUNCE)) == 0;
    if (announce) {
        pthread_mutex_lock(&p->push_lock);
        uint64_t gen = ++p->push_gen;
        pthread_mutex_unlock(&p->push_lock);
        kvpi_pipe_negotiate(p, gen);
    }
    /* Reply: version, request id, status code, status text, user id, metadata. */
    int rc = 0;
    if (n >= 2) {
        rc |= zmq_send(p->zap, "1.0", 3, ZMQ_SNDMORE) < 0;
        rc |= zmq_send(p->zap, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE) < 0;
        rc |= zmq_send(p->zap, "200", 3, ZMQ_SNDMORE) < 0;
        rc |= zmq_send(p->zap, "OK", 2, ZMQ_SNDMORE) < 0;
        rc |= zmq_send(p->zap, "", 0, ZMQ_SNDMORE) < 0;
        rc |= zmq_send(p->zap, "", 0, 0) < 0;
    }
    for (int i = 0; i < n; i++)
        zmq_msg_close(&f[i]);
    return rc && zmq_errno() == ETERM ? -1 : 0;
}

/* ------------------------------------------------------ deferred ACKs --- */

/* ACKs a receiver owes are due (pipe_recv.c): send them. When a receiver
 * holds recv_lock (a receiver in recv sends them itself when they are due)
 * or the link cannot take them yet, look again when kvpi_pipe_acks_due
 * says. */
static void ack_due(kvp_pipe *p)
{
    long us = kvpi_pipe_acks_due(p);
    if (!us) return;
    struct itimerspec again = {
        .it_value = {.tv_sec = us / 1000000, .tv_nsec = us % 1000000 * 1000}};
    timerfd_settime(p->ack_timer_fd, 0, &again, NULL);
}

void *kvpi_pipe_control_main(void *arg)
{
    kvp_pipe *p = arg;
    enum { ACKS, ACK_DUE, ACK_MON, DATA_MON, ZAP, DATA_PUSH_MON, ACK_PUSH_MON };
    for (;;) {
        /* ACKs are taken as they arrive, so that a sender's inflight_count
         * and room follow the receiver's ACKs at once; the receiver batches
         * those of inline messages (pipe_recv.c), so a stream of them costs
         * this thread one wake-up per batch, not per message. */
        zmq_pollitem_t it[] = {
            [ACKS] = {.socket = p->ack_in.sock, .events = ZMQ_POLLIN},
            [ACK_DUE] = {.fd = p->ack_timer_fd, .events = ZMQ_POLLIN},
            [ACK_MON] = {.socket = p->ack_in.mon, .events = ZMQ_POLLIN},
            [DATA_MON] = {.socket = p->data_in.mon, .events = ZMQ_POLLIN},
            [ZAP] = {.socket = p->zap, .events = ZMQ_POLLIN},
            /* Not authenticated: no monitors, and nothing ever readable
             * (a pollitem of no socket and fd -1 is skipped by poll). */
            [DATA_PUSH_MON] = {.socket = p->data_push_mon, .fd = -1, .events = ZMQ_POLLIN},
            [ACK_PUSH_MON] = {.socket = p->ack_push_mon, .fd = -1, .events = ZMQ_POLLIN},
        };
        int r = zmq_poll(it, sizeof it / sizeof it[0], control_timeout(p, kvpi_now_ms()));
        if (r < 0 && zmq_errno() == EINTR) continue;
        if (r < 0) break; /* ETERM: the pipe is closing */
        uint64_t v;
        if (it[ACK_DUE].revents && read(p->ack_timer_fd, &v, sizeof v) >= 0) ack_due(p);
        if ((it[ZAP].revents && zap_answer(p) < 0) ||
            (it[ACK_MON].revents && link_events(p, &p->ack_in) < 0) ||
            (it[DATA_MON].revents && link_events(p, &p->data_in) < 0) ||
            (it[DATA_PUSH_MON].revents && push_events(p, p->data_push_mon, "announce") < 0) ||
            (it[ACK_PUSH_MON].revents && push_events(p, p->ack_push_mon, "ACK") < 0) ||
            (it[ACKS].revents && take_acks(p) < 0))
            break;
        uint64_t now = kvpi_now_ms();
        if (link_due(p, &p->ack_in, now)) kvpi_pipe_link_reconnect(p, &p->ack_in);
        if (link_due(p, &p->data_in, now)) {
            atomic_store(&p->data_redial, 1);
            p->handoff_at = now;
        }
        data_handoff(p, now);
    }
    /* Nothing takes ACKs any more: senders must not wait for room. */
    pthread_mutex_lock(&p->lock);
    if (!atomic_load(&p->closing)) atomic_store(&p->broken, 1);
    kvpi_pipe_room_freed(p);
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* ------------------------------------------------------ the negotiator --- */

void kvpi_pipe_negotiate(kvp_pipe *p, uint64_t gen)
{
    pthread_mutex_lock(&p->lock);
    p->neg_want = gen;
    pthread_cond_signal(&p->neg_cond);
    pthread_mutex_unlock(&p->lock);
}

/* The peer's inline_max_bytes from its descriptor's field (0 without one),
 * whether it reads tags (version 2 on), and whether it checks digests. */
static kvp_status read_peer_terms(kvp_pipe *p, size_t *inline_max, int *tags, int *digest)
{
    cJSON *f = NULL;
    kvp_status st = kvpi_engine_lookup_field(p->engine, p->ep.peer_segment, KVPI_PIPE_FIELD, &f);
    if (st) return st;
    const cJSON *max = cJSON_GetObjectItemCaseSensitive(f, "inline_max_bytes");
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(f, "version");
    *inline_max = 0;
    *tags = 0;
    /* A later version keeps the meaning earlier ones gave the fields it has. */
    if (cJSON_IsNumber(ver) && ver->valuedouble >= 1 && cJSON_IsNumber(max) &&
        max->valuedouble >= 0 && max->valuedouble < 9.0e15)
        *inline_max = p->opts.inline_max_bytes ? (size_t)max->valuedouble : 0;
    if (cJSON_IsNumber(ver) && ver->valuedouble >= 2) *tags = 1;
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(f, "digest");
    *digest = *tags && cJSON_IsString(d) && strcmp(d->valuestring, KVPI_DIGEST_NAME) == 0;
    cJSON_Delete(f);
    return KVP_OK;
}

/* Read the peer's descriptor after each new data_push connection (neg_want),
 * so that senders know whether the peer takes inline messages; a failed
 * lookup is retried with the link back-off. */
void *kvpi_pipe_negotiator_main(void *arg)
{
    kvp_pipe *p = arg;
    int backoff = p->opts.redial_min_ms;
    uint64_t retry_at = 0;
    pthread_mutex_lock(&p->lock);
    while (!p->neg_stop) {
        uint64_t now = kvpi_now_ms();
        if (p->neg_want == p->neg_done || now < retry_at) {
            if (p->neg_want != p->neg_done) {
                struct timespec ts = kvpi_pipe_mono_deadline(retry_at);
                pthread_cond_timedwait(&p->neg_cond, &p->lock, &ts);
            } else {
                pthread_cond_wait(&p->neg_cond, &p->lock);
            }
            continue;
        }
        uint64_t gen = p->neg_want;
        pthread_mutex_unlock(&p->lock);
        size_t peer = 0;
        int tags = 0, digest = 0;
        kvp_status st = read_peer_terms(p, &peer, &tags, &digest);
        if (st) {
            KVPI_INFO("pipe %s: cannot read the descriptor of %s (%s); announcing every message "
                      "until it can, again in %d ms",
                      p->ep.local_segment, p->ep.peer_segment, kvp_last_error(), backoff);
            retry_at = kvpi_now_ms() + (uint64_t)backoff;
            backoff = backoff > p->opts.redial_max_ms / 2 ? p->opts.redial_max_ms : backoff * 2;
        } else {
            retry_at = 0;
            backoff = p->opts.redial_min_ms;
        }
        pthread_mutex_lock(&p->lock);
        if (st) continue;
        size_t was = p->neg_peer_inline;
        p->neg_done = gen;
        p->neg_peer_inline = peer;
        p->neg_peer_tags = tags;
        if (p->integrity && !digest && gen == 1)
            KVPI_WARN("pipe %s: peer %s does not check integrity (a MooncakePipe peer, or a "
                      "kvpipe pipe with it off): its messages go unchecked",
                      p->ep.local_segment, p->ep.peer_segment);
        p->neg_peer_digest = p->integrity && digest;
        p->stats.peer_lookups++;
        if (peer != was || gen == 1)
            KVPI_INFO("pipe %s: peer %s %s", p->ep.local_segment, p->ep.peer_segment,
                      peer && p->opts.inline_max_bytes
                          ? "takes inline messages: those up to the smaller of both sides' "
                            "inline_max_bytes travel inline (kvpipe's path)"
                          : "takes no inline messages: every message is announced and READ "
                            "(MooncakePipe's path)");
    }
    pthread_mutex_unlock(&p->lock);
    return NULL;
}
