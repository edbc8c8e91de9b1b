/* The tensor pipe: MooncakePipe's control plane on ZeroMQ over the transfer
 * engine. See include/kvpipe/pipe.h for the protocol and docs/pipe.md.
 *
 * Sockets and threads. ZeroMQ sockets are not thread-safe, so each has one
 * user at a time:
 *   data_push   (announce)  senders, under send_lock
 *   ack_push    (ACKs out)  receivers, under recv_lock
 *   data_in     (announce)  receivers, under recv_lock
 *   ack_in      (ACKs in)   the control thread
 *   the monitors of data_in and ack_in: the control thread
 * The two PULL sockets ("links", connected to the peer) check every message:
 * an announcement that is not two 8-byte frames and an ACK that is not the
 * 3-byte frame "ACK" are dropped, counted and logged (rate-limited).
 *
 * ZeroMQ closes a connection whose peer broke the protocol (a frame above
 * CONTROL_MAX_FRAME, a bad handshake) and never reconnects it by itself. The
 * control thread reads both links' monitors (a monitor must be read all the
 * time: a full one blocks ZeroMQ's I/O thread), tells such a close from one
 * that ZeroMQ reconnects, and has the link connected again after a back-off.
 * It does that itself for ack_in; for data_in, the socket of the receivers,
 * it does it only when it can take recv_lock without waiting, and otherwise
 * raises data_redial and wakes a receiver waiting in its poll (recv_wake_fd),
 * which then does it; a receiver busy with a READ does it on its next wait.
 *
 * The FIFO of buffers awaiting ACK is shared by senders and the control
 * thread under `lock`; `room` is signalled whenever an ACK frees one.
 *
 * Lifetime. The pipe struct and its engine are reference counted: one
 * reference for the open pipe, one per received tensor still alive, so a
 * tensor may outlive kvp_pipe_close().
 */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <sodium.h>
#include <zmq.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "kvpipe/pipe.h"
#include "pipe/pipe_metrics.h"
#include "pipe/safetensors.h"

#define ACK_TEXT "ACK"
#define ACK_LEN 3
/* Control frames are 8 bytes (3 for an ACK); ZeroMQ drops the connection of a
 * peer that sends a larger frame than this before buffering it. */
#define CONTROL_MAX_FRAME 4096
/* Inbound messages a PUSH socket buffers per connection. A PUSH never reads,
 * so this only bounds what a peer that sends to it can park there. */
#define PUSH_RCVHWM 1
/* See make_socket(). */
#define ZAP_DOMAIN "kvpipe"
#define DEFAULT_KV_BUFFER_SIZE 1000000000u
#define DEFAULT_SEND_TIMEOUT_MS 30000
#define DEFAULT_IO_TIMEOUT_MS 5000
#define DEFAULT_MAX_MESSAGE ((size_t)32 << 30)
/* Longest a receiver waits for the ack socket to take an ACK. */
#define ACK_SEND_TIMEOUT_MS 2000
/* Longest close waits for queued ACKs to leave. */
#define ACK_LINGER_MS 500
/* Reconnecting a link that ZeroMQ closed for a protocol error: the first wait
 * (also long enough for ZeroMQ to show that it reconnects by itself, after a
 * plain connection error), doubled after each such close up to the last,
 * back to the first after a good frame. */
#define REDIAL_FIRST_MS 200
#define REDIAL_MAX_MS 5000
/* Messages the control thread takes off the ACK link before it looks at its
 * other sockets again. */
#define ACK_BATCH 256
/* How soon the control thread looks again at a data_in redial it handed to
 * a receiver that is busy (with a READ, say). */
#define HANDOFF_RETRY_MS 100

typedef struct inflight {
    void *buf;
    size_t len;
} inflight;

/* A PULL socket connected to one of the peer's PUSH ports, with the monitor
 * that shows its connection being closed. The socket belongs to its reader
 * (see the top of the file); the rest to the control thread, but for good. */
typedef struct pull_link {
    const char *what; /* "announce" or "ACK", for the log */
    void *sock, *mon;
    char endpoint[KVP_PIPE_NAME_MAX + 16];
    uint64_t redial_at; /* kvpi_now_ms() when to connect again; 0: not due */
    int backoff_ms;
    atomic_int good; /* the reader saw a well-formed message: back-off resets */
    int handshaken;  /* authenticated: the CURVE handshake of this connection passed */
    int refused;     /* authenticated: it failed (and was logged) */
} pull_link;

struct kvp_pipe {
    atomic_int refs;
    atomic_int broken;
    kvp_engine *engine;
    kvp_pipe_endpoints ep;
    kvp_pipe_opts opts;

    void *zctx;
    void *data_push, *ack_push;
    /* Authenticated mode: the CURVE keys, and monitors of the two PUSH
     * sockets that show refused handshakes (the control thread's). */
    kvpi_auth *auth;
    kvpi_auth_curve curve;
    void *data_push_mon, *ack_push_mon;
    pull_link data_in, ack_in;
    int recv_wake_fd;       /* eventfd: wakes a receiver waiting on data_in */
    atomic_int data_redial; /* data_in must be connected again, by whoever has it */
    uint64_t handoff_at;    /* control thread: when to look at data_redial again */
    pthread_t ctl_thread;
    int ctl_started;

    pthread_mutex_t send_lock, recv_lock;

    pthread_mutex_t lock; /* guards everything below */
    pthread_cond_t room;
    inflight *q;
    size_t q_head, q_count, q_cap;
    size_t inflight_bytes;
    atomic_int closing; /* written under lock, read anywhere */
    kvp_pipe_stats stats;

    /* The buffer a sender is announcing (under send_lock), and whether an ACK
     * took its queue entry meanwhile; both under lock. */
    void *posting;
    int posting_acked;

    int peer_open; /* under recv_lock */
    kvp_segment_id peer_seg;

    kvpi_pipe_counters counters; /* what kvp_pipe_stats does not count */
};

/* Room in front of the data of a kvp_pipe_tensor_alloc() tensor for the
 * message header (8 + the longest header), rounded up to 256 so that the data
 * keeps the buffer pool's 256-byte alignment. */
#define SEND_PREFIX 1280
_Static_assert(SEND_PREFIX >= 8 + KVPI_SAFETENSORS_HEADER_CAP && SEND_PREFIX % 256 == 0,
               "SEND_PREFIX must hold a header and keep 256-byte alignment");

/* A heap tensor whose data lives in a managed buffer of the pipe's engine:
 * one from kvp_pipe_recv() or kvp_pipe_tensor_alloc(). kvp_tensor_free() frees
 * the struct, its release returns the buffer. t must stay the first member. */
typedef struct held {
    kvp_tensor t;
    kvp_pipe *pipe;
    void *buf;
    int sendable; /* from kvp_pipe_tensor_alloc(): data at buf + SEND_PREFIX */
    size_t room;  /* sendable: data bytes the buffer holds */
} held;

void kvp_pipe_opts_init(kvp_pipe_opts *opts)
{
    memset(opts, 0, sizeof *opts);
    opts->kv_buffer_size = DEFAULT_KV_BUFFER_SIZE;
    opts->send_timeout_ms = DEFAULT_SEND_TIMEOUT_MS;
    opts->io_timeout_ms = DEFAULT_IO_TIMEOUT_MS;
    opts->max_message_bytes = DEFAULT_MAX_MESSAGE;
}

/* ------------------------------------------------------------ lifetime --- */

static void pipe_unref(kvp_pipe *p)
{
    if (atomic_fetch_sub(&p->refs, 1) != 1) return;
    kvp_engine_destroy(p->engine);
    free(p->q);
    pthread_mutex_destroy(&p->send_lock);
    pthread_mutex_destroy(&p->recv_lock);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->room);
    close(p->recv_wake_fd);
    kvpi_auth_free(p->auth);
    sodium_memzero(&p->curve, sizeof p->curve);
    free(p);
}

static void release_held(void *owner, void *data)
{
    (void)data;
    held *h = owner;
    kvp_engine_free(h->pipe->engine, h->buf);
    pipe_unref(h->pipe); /* kvp_tensor_free() frees h itself: t is its first member */
}

/* Make h->t a heap tensor that owns buf and holds a reference to p. */
static kvp_tensor *hold(kvp_pipe *p, held *h, void *buf)
{
    h->t.release = release_held;
    h->t.owner = h;
    h->pipe = p;
    h->buf = buf;
    atomic_fetch_add(&p->refs, 1);
    return &h->t;
}

/* ------------------------------------------------------------- sockets --- */

static kvp_status zmq_fail(kvp_pipe *p, const char *what)
{
    int err = zmq_errno();
    if (err == ETERM || err == ENOTSOCK) atomic_store(&p->broken, 1);
    return kvpi_error(err == ETERM ? KVP_ECLOSED : KVP_EIO, "pipe %s: ZeroMQ %s: %s",
                      p->ep.local_segment, what, zmq_strerror(err));
}

/* Every socket of the pipe is made here, so that options that apply to all of
 * them (security mechanisms among them) have one place. linger_ms bounds how
 * long closing waits to hand queued messages over.
 *
 * A ZAP domain, with no ZAP handler in the context, changes one thing:
 * ZeroMQ refuses peers that speak the ZMTP 1.0 and 2.0 handshakes, which
 * carry no socket type. Without it, any TCP client whose first byte is not
 * 0xFF (a port scanner, an HTTP probe) passes for a ZMTP 1.0 peer, joins a
 * PUSH socket's round-robin and takes announcements or ACKs that are then
 * lost. Every ZeroMQ 4 peer (pyzmq's MooncakePipe included) speaks ZMTP 3.
 *
 * In the authenticated mode the PUSH sockets are CURVE servers and the PULL
 * sockets CURVE clients, with keys derived from the key. The domain stays
 * and still no ZAP handler runs: with ZMQ_ZAP_ENFORCE_DOMAIN off (the
 * default) ZeroMQ then admits any client that completes the CURVE handshake,
 * which takes the server's public key - derived from the secret, never sent -
 * so only a holder of the key gets in. */
static int set_curve(kvp_pipe *p, void *s, int type)
{
    const kvpi_auth_curve *c = &p->curve;
    int one = 1;
    if (type == ZMQ_PUSH)
        return zmq_setsockopt(s, ZMQ_CURVE_SERVER, &one, sizeof one) ||
               zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, c->server_secret, 32);
    return zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, c->server_public, 32) ||
           zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, c->client_public, 32) ||
           zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, c->client_secret, 32);
}

static kvp_status make_socket(kvp_pipe *p, int type, int linger_ms, void **out)
{
    void *s = zmq_socket(p->zctx, type);
    if (!s) return zmq_fail(p, "socket");
    int one = 1, rcvhwm = PUSH_RCVHWM;
    int64_t maxmsg = CONTROL_MAX_FRAME;
    if (zmq_setsockopt(s, ZMQ_LINGER, &linger_ms, sizeof linger_ms) != 0 ||
        zmq_setsockopt(s, ZMQ_IPV6, &one, sizeof one) != 0 ||
        zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) != 0 ||
        zmq_setsockopt(s, ZMQ_ZAP_DOMAIN, ZAP_DOMAIN, strlen(ZAP_DOMAIN)) != 0 ||
        (type == ZMQ_PUSH && zmq_setsockopt(s, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm) != 0) ||
        (p->auth && (type == ZMQ_PUSH || type == ZMQ_PULL) && set_curve(p, s, type) != 0)) {
        zmq_close(s);
        return zmq_fail(p, "setsockopt");
    }
    *out = s;
    return KVP_OK;
}

/* Bind on the configured host when it is an IP literal; a host name is bound
 * on all interfaces, as vLLM does (ZeroMQ binds interfaces, not names). */
static void bind_endpoint(const char *host, int port, char *buf, size_t len)
{
    unsigned char addr[16];
    if (inet_pton(AF_INET, host, addr) == 1)
        snprintf(buf, len, "tcp://%s:%d", host, port);
    else if (inet_pton(AF_INET6, host, addr) == 1)
        snprintf(buf, len, "tcp://[%s]:%d", host, port);
    else
        snprintf(buf, len, "tcp://*:%d", port);
}

static kvp_status bind_socket(kvp_pipe *p, void *s, int port)
{
    char ep[KVP_PIPE_NAME_MAX + 16];
    bind_endpoint(p->ep.local_host, port, ep, sizeof ep);
    if (zmq_bind(s, ep) == 0) return KVP_OK;
    return kvpi_error(KVP_EIO, "pipe %s: cannot bind ZeroMQ endpoint %s: %s", p->ep.local_segment,
                      ep, zmq_strerror(zmq_errno()));
}

/* The events that tell a connection ZeroMQ gave up on (DISCONNECTED with no
 * reconnect after it) from one it reconnects by itself (CONNECT_RETRIED). */
#define LINK_EVENTS                                                                                \
    (ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_CONNECT_DELAYED |              \
     ZMQ_EVENT_CONNECTED | AUTH_EVENTS)
/* The authenticated mode's handshakes, on both kinds of socket. */
#define HANDSHAKE_FAILED                                                                           \
    (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |                  \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
#define AUTH_EVENTS (HANDSHAKE_FAILED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED)

/* A PULL socket connected to the peer's port, with its monitor. */
static kvp_status open_link(kvp_pipe *p, pull_link *l, const char *what, int port)
{
    kvp_status st;
    l->what = what;
    l->backoff_ms = REDIAL_FIRST_MS;
    char hp[KVP_PIPE_NAME_MAX + 8], mon_ep[64];
    kvpi_hostport_format(p->ep.peer_host, port, hp, sizeof hp);
    snprintf(l->endpoint, sizeof l->endpoint, "tcp://%s", hp);
    /* The context is the pipe's own, so the name needs to be unique only in it. */
    snprintf(mon_ep, sizeof mon_ep, "inproc://kvpipe-monitor-%s", what);
    if ((st = make_socket(p, ZMQ_PULL, 0, &l->sock))) return st;
    if (zmq_socket_monitor(l->sock, mon_ep, p->auth ? LINK_EVENTS : LINK_EVENTS & ~AUTH_EVENTS) !=
        0)
        return zmq_fail(p, "monitor");
    if ((st = make_socket(p, ZMQ_PAIR, 0, &l->mon))) return st;
    if (zmq_connect(l->mon, mon_ep) != 0) return zmq_fail(p, "monitor connect");
    if (zmq_connect(l->sock, l->endpoint) == 0) return KVP_OK;
    return kvpi_error(KVP_EIO, "pipe %s: cannot connect ZeroMQ endpoint %s: %s",
                      p->ep.local_segment, l->endpoint, zmq_strerror(zmq_errno()));
}

/* Authenticated: a monitor of a PUSH socket, for its refused handshakes. */
static kvp_status monitor_push(kvp_pipe *p, void *sock, const char *what, void **mon)
{
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://kvpipe-monitor-push-%s", what);
    if (zmq_socket_monitor(sock, ep, HANDSHAKE_FAILED) != 0) return zmq_fail(p, "monitor");
    kvp_status st = make_socket(p, ZMQ_PAIR, 0, mon);
    if (!st && zmq_connect(*mon, ep) != 0) st = zmq_fail(p, "monitor connect");
    return st;
}

static kvp_status open_sockets(kvp_pipe *p)
{
    kvp_status st;
    if (!(p->zctx = zmq_ctx_new())) return zmq_fail(p, "context");
    /* Announcements die with the pipe (their buffers are freed at close), so
     * linger 0; the last ACKs get a short grace so that a receiver closing right
     * after its last recv still releases the sender's buffers. */
    if ((st = make_socket(p, ZMQ_PUSH, 0, &p->data_push))) return st;
    if ((st = make_socket(p, ZMQ_PUSH, ACK_LINGER_MS, &p->ack_push))) return st;
    if ((st = bind_socket(p, p->data_push, p->ep.data_port))) return st;
    if ((st = bind_socket(p, p->ack_push, p->ep.ack_port))) return st;
    if (p->auth && ((st = monitor_push(p, p->data_push, "announce", &p->data_push_mon)) ||
                    (st = monitor_push(p, p->ack_push, "ACK", &p->ack_push_mon))))
        return st;
    if ((st = open_link(p, &p->data_in, "announce", p->ep.peer_data_port))) return st;
    return open_link(p, &p->ack_in, "ACK", p->ep.peer_ack_port);
}

/* Stop the control thread and close every socket and the context. Safe on a
 * half-opened pipe. */
static void close_sockets(kvp_pipe *p)
{
    if (!p->zctx) return;
    /* Shutdown makes the control thread's poll return ETERM. */
    zmq_ctx_shutdown(p->zctx);
    if (p->ctl_started) pthread_join(p->ctl_thread, NULL);
    p->ctl_started = 0;
    /* The monitored sockets first: closing one ends its monitor. */
    void **socks[] = {&p->data_push,   &p->ack_push,   &p->data_in.sock,  &p->ack_in.sock,
                      &p->data_in.mon, &p->ack_in.mon, &p->data_push_mon, &p->ack_push_mon};
    for (size_t i = 0; i < sizeof socks / sizeof socks[0]; i++) {
        if (*socks[i]) zmq_close(*socks[i]);
        *socks[i] = NULL;
    }
    zmq_ctx_term(p->zctx);
    p->zctx = NULL;
}

/* ------------------------------------------------------- the FIFO ----- */

static int q_push(kvp_pipe *p, void *buf, size_t len)
{
    if (p->q_count == p->q_cap) {
        size_t cap = p->q_cap ? p->q_cap * 2 : 64;
        inflight *q = malloc(cap * sizeof *q);
        if (!q) return -1;
        for (size_t i = 0; i < p->q_count; i++)
            q[i] = p->q[(p->q_head + i) % p->q_cap];
        free(p->q);
        p->q = q;
        p->q_cap = cap;
        p->q_head = 0;
    }
    p->q[(p->q_head + p->q_count++) % p->q_cap] = (inflight){buf, len};
    p->inflight_bytes += len;
    return 0;
}

static inflight q_pop_head(kvp_pipe *p)
{
    inflight e = p->q[p->q_head];
    p->q_head = (p->q_head + 1) % p->q_cap;
    p->q_count--;
    p->inflight_bytes -= e.len;
    return e;
}

/* Take the newest entry back. Only for the entry being posted, which is the
 * newest as long as no ACK popped it (sends are serialised; ACKs pop the head). */
static void q_drop_tail(kvp_pipe *p)
{
    inflight *e = &p->q[(p->q_head + p->q_count - 1) % p->q_cap];
    p->inflight_bytes -= e->len;
    p->q_count--;
}

/* --------------------------------------- the links and the control thread --- */

/* One whole message off a link (its parts arrive together, so this does not
 * wait). Keeps the sizes of the first two frames and the first 8 bytes of
 * each. Returns the frame count, 0 when none was waiting, -1 on ETERM. */
typedef struct control_msg {
    int frames;
    size_t size[2];
    uint8_t head[2][8];
} control_msg;

static int take_message(void *sock, control_msg *m)
{
    zmq_msg_t part;
    zmq_msg_init(&part);
    m->frames = 0;
    int more;
    do {
        if (zmq_msg_recv(&part, sock, ZMQ_DONTWAIT) < 0) {
            int err = zmq_errno();
            zmq_msg_close(&part);
            if (m->frames > 0 || err == EAGAIN || err == EINTR) return m->frames;
            return -1;
        }
        if (m->frames < 2) {
            size_t n = zmq_msg_size(&part);
            m->size[m->frames] = n;
            memcpy(m->head[m->frames], zmq_msg_data(&part), n < 8 ? n : 8);
        }
        m->frames++;
        more = zmq_msg_more(&part);
    } while (more);
    zmq_msg_close(&part);
    return m->frames;
}

/* One well-formed ACK: the oldest buffer in flight is free. An ACK that pops
 * the buffer still being announced leaves it to its sender (post()), which
 * may yet have to take it back. */
static void take_ack(kvp_pipe *p)
{
    pthread_mutex_lock(&p->lock);
    int have = p->q_count > 0;
    inflight e = have ? q_pop_head(p) : (inflight){NULL, 0};
    if (have && e.buf == p->posting) {
        p->posting_acked = 1;
        e.buf = NULL;
    }
    if (have)
        p->stats.acks++;
    else
        p->stats.bad_acks++;
    pthread_cond_broadcast(&p->room);
    pthread_mutex_unlock(&p->lock);
    if (!have) {
        KVPI_WARN_LIMITED("pipe %s: dropped an ACK from %s with nothing in flight",
                          p->ep.local_segment, p->ep.peer_segment);
        return;
    }
    atomic_store(&p->ack_in.good, 1);
    if (e.buf) kvp_engine_free(p->engine, e.buf);
}

/* Only the 3-byte frame "ACK" frees a buffer (every MooncakePipe sends just
 * that): anything else could free one the peer is still reading. */
static void handle_ack(kvp_pipe *p, const control_msg *m)
{
    if (m->frames == 1 && m->size[0] == ACK_LEN && memcmp(m->head[0], ACK_TEXT, ACK_LEN) == 0) {
        take_ack(p);
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
        control_msg m;
        int n = take_message(p->ack_in.sock, &m);
        if (n <= 0) return n;
        handle_ack(p, &m);
    }
    return 0;
}

/* An announcement is two 8-byte frames: u64 BE address, u64 BE length. */
static int is_announcement(const control_msg *m)
{
    return m->frames == 2 && m->size[0] == 8 && m->size[1] == 8;
}

/* Anything else on the data link is dropped unanswered, since no MooncakePipe
 * sends it and no buffer of the peer waits for its ACK. */
static void drop_announcement(kvp_pipe *p, const control_msg *m)
{
    pthread_mutex_lock(&p->lock);
    p->stats.bad_messages++;
    pthread_mutex_unlock(&p->lock);
    char shape[64];
    if (m->frames == 1)
        snprintf(shape, sizeof shape, "1 frame of %zu bytes", m->size[0]);
    else
        snprintf(shape, sizeof shape, "%d frames, the first of %zu and %zu bytes", m->frames,
                 m->size[0], m->size[1]);
    KVPI_WARN_LIMITED("pipe %s: dropped a malformed announcement from %s (%s); an announcement is "
                      "two 8-byte frames (address, length)",
                      p->ep.local_segment, p->ep.peer_segment, shape);
}

/* Read the link's monitor: a DISCONNECTED that no CONNECT_RETRIED follows is
 * a connection ZeroMQ closed for a protocol error and will not reconnect. */
static int link_events(kvp_pipe *p, pull_link *l)
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
        if (event & HANDSHAKE_FAILED) {
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
            if (atomic_exchange(&l->good, 0)) l->backoff_ms = REDIAL_FIRST_MS;
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
static void link_reconnect(kvp_pipe *p, pull_link *l)
{
    zmq_disconnect(l->sock, l->endpoint);
    if (zmq_connect(l->sock, l->endpoint) != 0)
        KVPI_WARN_LIMITED("pipe %s: cannot connect the %s link to %s again: %s",
                          p->ep.local_segment, l->what, l->endpoint, zmq_strerror(zmq_errno()));
}

/* Whether the link's back-off has passed; then it is logged and the next
 * back-off doubles. */
static int link_due(kvp_pipe *p, pull_link *l, uint64_t now)
{
    if (!l->redial_at || now < l->redial_at) return 0;
    l->redial_at = 0;
    KVPI_WARN_LIMITED("pipe %s: ZeroMQ closed the %s link to %s (%s) after a protocol error (a "
                      "frame above %d bytes, a malformed ZeroMQ stream, or a refused handshake: "
                      "an authenticated peer refuses a pipe without its key); connecting again "
                      "after %d ms",
                      p->ep.local_segment, l->what, p->ep.peer_segment, l->endpoint,
                      CONTROL_MAX_FRAME, l->backoff_ms);
    l->backoff_ms = l->backoff_ms * 2 > REDIAL_MAX_MS ? REDIAL_MAX_MS : l->backoff_ms * 2;
    return 1;
}

/* data_in is the receivers' socket: reconnect it here only when no receiver
 * holds it; else a receiver waiting on it is woken to do it, and one busy
 * with a READ does it when it next waits (looked at again after a while). */
static void data_handoff(kvp_pipe *p, uint64_t now)
{
    if (!atomic_load(&p->data_redial) || now < p->handoff_at) return;
    if (pthread_mutex_trylock(&p->recv_lock) == 0) {
        if (atomic_exchange(&p->data_redial, 0)) link_reconnect(p, &p->data_in);
        pthread_mutex_unlock(&p->recv_lock);
        p->handoff_at = 0;
        return;
    }
    uint64_t one = 1;
    if (write(p->recv_wake_fd, &one, sizeof one) < 0 && errno != EAGAIN)
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

static void *control_main(void *arg)
{
    kvp_pipe *p = arg;
    enum { ACKS, ACK_MON, DATA_MON, DATA_PUSH_MON, ACK_PUSH_MON };
    for (;;) {
        zmq_pollitem_t it[] = {
            [ACKS] = {.socket = p->ack_in.sock, .events = ZMQ_POLLIN},
            [ACK_MON] = {.socket = p->ack_in.mon, .events = ZMQ_POLLIN},
            [DATA_MON] = {.socket = p->data_in.mon, .events = ZMQ_POLLIN},
            [DATA_PUSH_MON] = {.socket = p->data_push_mon, .events = ZMQ_POLLIN},
            [ACK_PUSH_MON] = {.socket = p->ack_push_mon, .events = ZMQ_POLLIN},
        };
        int r = zmq_poll(it, p->auth ? 5 : 3, control_timeout(p, kvpi_now_ms()));
        if (r < 0 && zmq_errno() == EINTR) continue;
        if (r < 0) break; /* ETERM: the pipe is closing */
        if ((it[ACK_MON].revents && link_events(p, &p->ack_in) < 0) ||
            (it[DATA_MON].revents && link_events(p, &p->data_in) < 0) ||
            (it[DATA_PUSH_MON].revents && push_events(p, p->data_push_mon, "announce") < 0) ||
            (it[ACK_PUSH_MON].revents && push_events(p, p->ack_push_mon, "ACK") < 0) ||
            (it[ACKS].revents && take_acks(p) < 0))
            break;
        uint64_t now = kvpi_now_ms();
        if (link_due(p, &p->ack_in, now)) link_reconnect(p, &p->ack_in);
        if (link_due(p, &p->data_in, now)) {
            atomic_store(&p->data_redial, 1);
            p->handoff_at = now;
        }
        data_handoff(p, now);
    }
    /* Nothing takes ACKs any more: senders must not wait for room. */
    pthread_mutex_lock(&p->lock);
    if (!atomic_load(&p->closing)) atomic_store(&p->broken, 1);
    pthread_cond_broadcast(&p->room);
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* ---------------------------------------------------------------- open --- */

/* The engine's pool keeps twice kv_buffer_size (at least 1 GiB) of free
 * chunks: a full budget in flight plus as much again being prepared or held
 * by the receiver. With less, a pipe running at its budget keeps unmapping
 * chunks and faulting fresh ones in (64 MiB tensors under the default 1e9
 * budget need 16 chunks of 66 MiB on the sender alone). */
static size_t pool_retention(const kvp_pipe_opts *o)
{
    size_t floor = (size_t)1 << 30;
    size_t want = o->kv_buffer_size > SIZE_MAX / 2 ? SIZE_MAX : o->kv_buffer_size * 2;
    return want > floor ? want : floor;
}

static kvp_status create_engine(kvp_pipe *p, const kvp_pipe_config *cfg)
{
    char *conn = NULL;
    kvp_status st = kvp_pipe_config_metadata_conn(cfg, &conn);
    if (st) return st;
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = p->ep.local_segment;
    eo.metadata = conn;
    eo.protocol = cfg->protocol;
    eo.device_names = cfg->device_name[0] ? cfg->device_name : NULL;
    eo.timeout_ms = p->opts.io_timeout_ms;
    eo.disable_shm = p->opts.disable_shm;
    eo.pool_retain_bytes = pool_retention(&p->opts);
    eo.auth_key_file = cfg->auth_key_file;
    eo.metrics_port = p->opts.metrics_port;
    eo.metrics_host = p->opts.metrics_host;
    st = kvp_engine_create(&eo, &p->engine);
    free(conn);
    return st;
}

static kvp_status check_opts(const kvp_pipe_opts *o)
{
    if (o->kv_buffer_size == 0) return kvpi_error(KVP_EINVAL, "pipe option kv_buffer_size is 0");
    if (o->send_timeout_ms < 0) return kvpi_error(KVP_EINVAL, "pipe option send_timeout_ms < 0");
    if (o->io_timeout_ms <= 0) return kvpi_error(KVP_EINVAL, "pipe option io_timeout_ms <= 0");
    if (o->max_message_bytes == 0)
        return kvpi_error(KVP_EINVAL, "pipe option max_message_bytes is 0");
    return KVP_OK;
}

static kvp_status pipe_init_sync(kvp_pipe *p)
{
    p->recv_wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->recv_wake_fd < 0) return kvpi_error(KVP_EIO, "pipe: eventfd: %s", strerror(errno));
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int err = pthread_cond_init(&p->room, &ca);
    pthread_condattr_destroy(&ca);
    if (err) {
        close(p->recv_wake_fd);
        return kvpi_error(KVP_EIO, "pipe: pthread_cond_init: %s", strerror(err));
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_mutex_init(&p->send_lock, NULL);
    pthread_mutex_init(&p->recv_lock, NULL);
    return KVP_OK;
}

kvp_status kvp_pipe_open(const kvp_pipe_config *cfg, int local_rank, int kv_rank,
                         const kvp_pipe_opts *opts, kvp_pipe **out)
{
    if (!out) return kvpi_error(KVP_EINVAL, "pipe open: NULL output");
    kvp_pipe_endpoints ep;
    kvp_status st = kvp_pipe_config_endpoints(cfg, local_rank, kv_rank, &ep);
    if (st) return st;
    kvp_pipe_opts o;
    kvp_pipe_opts_init(&o);
    if (opts) o = *opts;
    if ((st = check_opts(&o))) return st;
    kvp_pipe *p = calloc(1, sizeof *p);
    if (!p) return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    if ((st = pipe_init_sync(p))) {
        free(p);
        return st;
    }
    atomic_init(&p->refs, 1);
    atomic_init(&p->broken, 0);
    atomic_init(&p->closing, 0);
    p->ep = ep;
    p->opts = o;
    if ((st = kvpi_auth_resolve(cfg->auth_key_file, &p->auth))) goto fail;
    if (p->auth && !zmq_has("curve")) {
        st = kvpi_error(KVP_ENOTSUP,
                        "pipe %s: authenticated mode needs ZeroMQ's CURVE, and "
                        "this libzmq is built without it",
                        ep.local_segment);
        goto fail;
    }
    if (p->auth && (st = kvpi_auth_curve_keys(p->auth, &p->curve))) goto fail;
    if ((st = create_engine(p, cfg))) goto fail;
    if ((st = open_sockets(p))) goto fail;
    int err = pthread_create(&p->ctl_thread, NULL, control_main, p);
    if (err) {
        st = kvpi_error(KVP_EIO, "pipe: cannot start the control thread: %s", strerror(err));
        goto fail;
    }
    p->ctl_started = 1;
    if ((st = kvpi_engine_metrics_attach(p->engine, kvpi_pipe_metrics_serve, p))) goto fail;
    KVPI_INFO("pipe %s open (kv_rank %d, peer %s): ZeroMQ data %d ack %d%s", ep.local_segment,
              kv_rank, ep.peer_segment, ep.data_port, ep.ack_port,
              p->auth ? ", authenticated (CURVE)" : "");
    *out = p;
    return KVP_OK;
fail:
    close_sockets(p);
    pipe_unref(p);
    return st;
}

/* ---------------------------------------------------------------- send --- */

static int remaining_ms(uint64_t deadline)
{
    uint64_t now = kvpi_now_ms();
    return now >= deadline ? 0 : (int)(deadline - now > INT32_MAX ? INT32_MAX : deadline - now);
}

static struct timespec mono_deadline(uint64_t deadline_ms)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline_ms / 1000),
                          .tv_nsec = (long)(deadline_ms % 1000) * 1000000L};
    return ts;
}

/* Wait until size more bytes fit under kv_buffer_size, or nothing is in flight
 * (so a message larger than the budget still goes, alone). */
static kvp_status wait_for_room(kvp_pipe *p, size_t size, uint64_t deadline)
{
    kvp_status st = KVP_OK;
    struct timespec ts = mono_deadline(deadline);
    pthread_mutex_lock(&p->lock);
    while (!atomic_load(&p->closing) && p->inflight_bytes > 0 &&
           p->inflight_bytes + size > p->opts.kv_buffer_size) {
        if (pthread_cond_timedwait(&p->room, &p->lock, &ts) == ETIMEDOUT && p->inflight_bytes > 0 &&
            p->inflight_bytes + size > p->opts.kv_buffer_size) {
            kvpi_counter_add(&p->counters.send_timeouts, 1);
            st = kvpi_error(KVP_ETIMEDOUT,
                            "pipe %s: peer %s acknowledged nothing for %d ms (%zu messages, %zu "
                            "bytes in flight, kv_buffer_size %zu); is it alive and receiving?",
                            p->ep.local_segment, p->ep.peer_segment, p->opts.send_timeout_ms,
                            p->q_count, p->inflight_bytes, p->opts.kv_buffer_size);
            break;
        }
    }
    if (!st && atomic_load(&p->closing))
        st = kvpi_error(KVP_ECLOSED, "pipe %s is closing", p->ep.local_segment);
    pthread_mutex_unlock(&p->lock);
    return st;
}

static int zsend(void *s, const void *buf, size_t len, int flags, int timeout_ms)
{
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
    int r;
    while ((r = zmq_send(s, buf, len, flags)) < 0 && zmq_errno() == EINTR) {
    }
    return r;
}

/* The two-frame announcement: u64 big-endian address, u64 big-endian length. */
static kvp_status announce(kvp_pipe *p, const void *buf, size_t len, uint64_t deadline)
{
    uint8_t addr[8], length[8];
    kvpi_put_be64(addr, (uint64_t)(uintptr_t)buf);
    kvpi_put_be64(length, len);
    if (zsend(p->data_push, addr, 8, ZMQ_SNDMORE, remaining_ms(deadline)) < 0) {
        if (zmq_errno() != EAGAIN) return zmq_fail(p, "send");
        kvpi_counter_add(&p->counters.send_timeouts, 1);
        return kvpi_error(KVP_ETIMEDOUT,
                          "pipe %s: peer %s took no announcement within %d ms (is its pipe open "
                          "and connected to port %d?%s)",
                          p->ep.local_segment, p->ep.peer_segment, p->opts.send_timeout_ms,
                          p->ep.data_port,
                          p->auth ? " The pipe is authenticated: a peer without its key cannot "
                                    "connect; the log says if one tried"
                                  : "");
    }
    /* ZeroMQ delivers a multipart message whole; once the first frame is in, the
     * second joins it. If it still fails the stream is torn: stop the pipe. */
    if (zsend(p->data_push, length, 8, 0, p->opts.io_timeout_ms) < 0) {
        atomic_store(&p->broken, 1);
        return zmq_fail(p, "send of the second announcement frame");
    }
    return KVP_OK;
}

/* Queue the managed buffer buf for its ACK and announce the message msg of
 * size bytes inside it. Caller holds send_lock. On success buf belongs to the
 * queue (freed on its ACK); on error nothing was announced and buf is the
 * caller's again, even when a stray ACK popped its queue entry meanwhile. */
static kvp_status post(kvp_pipe *p, void *buf, const void *msg, size_t size, uint64_t deadline)
{
    pthread_mutex_lock(&p->lock);
    /* Queued before the announcement goes out, since its ACK may come at once. */
    int full = q_push(p, buf, size);
    if (!full) {
        p->posting = buf;
        p->posting_acked = 0;
    }
    pthread_mutex_unlock(&p->lock);
    if (full) return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    kvp_status st = announce(p, msg, size, deadline);
    pthread_mutex_lock(&p->lock);
    int acked = p->posting_acked;
    p->posting = NULL;
    if (st == KVP_OK) {
        p->stats.sent++;
        p->stats.bytes_sent += size;
    } else if (!acked) {
        q_drop_tail(p);
        pthread_cond_broadcast(&p->room);
    }
    pthread_mutex_unlock(&p->lock);
    /* Acknowledged before announce() returned: the ACK left the buffer to us. */
    if (st == KVP_OK && acked) kvp_engine_free(p->engine, buf);
    return st;
}

static kvp_status begin_send(kvp_pipe *p, size_t size, uint64_t deadline)
{
    if (!kvp_pipe_usable(p))
        return kvpi_error(KVP_ECLOSED, "pipe %s can no longer be used", p->ep.local_segment);
    return wait_for_room(p, size, deadline);
}

kvp_status kvp_pipe_send(kvp_pipe *p, const kvp_tensor *t)
{
    if (!p) return kvpi_error(KVP_EINVAL, "pipe send: NULL pipe");
    int64_t none_value = KVP_PIPE_NONE_VALUE, one = 1;
    kvp_tensor none;
    if (!t) {
        kvp_tensor_init(&none, KVP_DTYPE_I64, 1, &one, &none_value);
        t = &none;
    }
    size_t size;
    kvp_status st = kvpi_safetensors_size(t, &size);
    if (st) return st;
    uint64_t deadline = kvpi_now_ms() + (uint64_t)p->opts.send_timeout_ms;
    pthread_mutex_lock(&p->send_lock);
    void *buf = NULL;
    size_t written;
    if ((st = begin_send(p, size, deadline)) == KVP_OK &&
        (st = kvp_engine_alloc(p->engine, size, &buf)) == KVP_OK &&
        ((st = kvpi_safetensors_write(t, buf, size, &written)) ||
         (st = post(p, buf, buf, size, deadline))))
        kvp_engine_free(p->engine, buf);
    pthread_mutex_unlock(&p->send_lock);
    return st;
}

kvp_status kvp_pipe_tensor_alloc(kvp_pipe *p, kvp_dtype dtype, int ndim, const int64_t *shape,
                                 kvp_tensor **out)
{
    if (!p || !out || (ndim > 0 && !shape))
        return kvpi_error(KVP_EINVAL, "pipe tensor_alloc: NULL argument");
    size_t nbytes;
    kvp_status st = kvp_tensor_size(dtype, ndim, shape, NULL, &nbytes);
    if (st) return st;
    if (nbytes > SIZE_MAX - SEND_PREFIX)
        return kvpi_error(KVP_EINVAL, "pipe tensor_alloc: %zu bytes is too large", nbytes);
    if (!kvp_pipe_usable(p))
        return kvpi_error(KVP_ECLOSED, "pipe %s can no longer be used", p->ep.local_segment);
    held *h = calloc(1, sizeof *h);
    if (!h) return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    void *buf;
    if ((st = kvp_engine_alloc(p->engine, SEND_PREFIX + nbytes, &buf))) {
        free(h);
        return st;
    }
    kvp_tensor_init(&h->t, dtype, ndim, shape, (char *)buf + SEND_PREFIX);
    h->sendable = 1;
    h->room = nbytes;
    *out = hold(p, h, buf);
    return KVP_OK;
}

/* The held struct behind t when t is a sendable tensor of pipe p. */
static held *sendable_of(kvp_pipe *p, kvp_tensor *t)
{
    held *h = t->release == release_held ? t->owner : NULL;
    return h && &h->t == t && h->sendable && h->pipe == p ? h : NULL;
}

kvp_status kvp_pipe_send_take(kvp_pipe *p, kvp_tensor *t)
{
    if (!p || !t) return kvpi_error(KVP_EINVAL, "pipe send_take: NULL argument");
    held *h = sendable_of(p, t);
    if (!h)
        return kvpi_error(KVP_EINVAL,
                          "pipe %s: send_take needs a tensor from kvp_pipe_tensor_alloc() of this "
                          "pipe (use kvp_pipe_send() for others)",
                          p->ep.local_segment);
    if (t->data != (char *)h->buf + SEND_PREFIX || t->nbytes > h->room)
        return kvpi_error(KVP_EINVAL,
                          "pipe %s: send_take: the tensor's data pointer or size (%zu bytes, %zu "
                          "allocated) changed since kvp_pipe_tensor_alloc()",
                          p->ep.local_segment, t->nbytes, h->room);
    char hdr[KVPI_SAFETENSORS_HEADER_CAP];
    size_t hlen;
    kvp_status st = kvpi_safetensors_header(t, hdr, &hlen);
    if (st) return st;
    size_t size = 8 + hlen + t->nbytes;
    uint8_t *msg = (uint8_t *)t->data - 8 - hlen;
    uint64_t deadline = kvpi_now_ms() + (uint64_t)p->opts.send_timeout_ms;
    pthread_mutex_lock(&p->send_lock);
    if ((st = begin_send(p, size, deadline)) == KVP_OK) {
        /* The header goes right in front of the data: the bytes stay in place. */
        kvpi_put_le64(msg, hlen);
        memcpy(msg + 8, hdr, hlen);
        st = post(p, h->buf, msg, size, deadline);
    }
    pthread_mutex_unlock(&p->send_lock);
    if (st == KVP_OK) {
        /* The queue owns the buffer now; the struct and its reference go. */
        free(h);
        pipe_unref(p);
    }
    return st;
}

kvp_status kvp_pipe_flush(kvp_pipe *p, int timeout_ms)
{
    if (!p) return kvpi_error(KVP_EINVAL, "pipe flush: NULL pipe");
    uint64_t deadline = kvpi_now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    struct timespec ts = mono_deadline(deadline);
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&p->lock);
    while (p->q_count > 0 && !atomic_load(&p->closing) && !atomic_load(&p->broken)) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&p->room, &p->lock);
        } else if (pthread_cond_timedwait(&p->room, &p->lock, &ts) == ETIMEDOUT && p->q_count > 0) {
            st = kvpi_error(KVP_ETIMEDOUT,
                            "pipe %s: %zu messages (%zu bytes) still unacknowledged by %s after "
                            "%d ms",
                            p->ep.local_segment, p->q_count, p->inflight_bytes, p->ep.peer_segment,
                            timeout_ms);
            break;
        }
    }
    if (!st && p->q_count > 0)
        st = kvpi_error(KVP_ECLOSED, "pipe %s closed with messages in flight", p->ep.local_segment);
    pthread_mutex_unlock(&p->lock);
    return st;
}

/* ---------------------------------------------------------------- recv --- */

/* The next announcement off the data link, waiting up to timeout_ms
 * (negative: no limit, 0: only what is there); malformed messages are
 * dropped on the way. Caller holds recv_lock. */
static kvp_status next_announcement(kvp_pipe *p, int timeout_ms, uint64_t *addr, uint64_t *len)
{
    uint64_t deadline = kvpi_now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    for (;;) {
        if (atomic_exchange(&p->data_redial, 0)) link_reconnect(p, &p->data_in);
        control_msg m;
        int n = take_message(p->data_in.sock, &m);
        if (n < 0) return zmq_fail(p, "receive");
        if (n > 0 && is_announcement(&m)) {
            *addr = kvpi_get_be64(m.head[0]);
            *len = kvpi_get_be64(m.head[1]);
            atomic_store(&p->data_in.good, 1);
            return KVP_OK;
        }
        if (n > 0) drop_announcement(p, &m);
        /* A flood of garbage does not hold recv past its timeout. */
        if (timeout_ms >= 0 && (n == 0 ? remaining_ms(deadline) == 0 : kvpi_now_ms() > deadline)) {
            kvpi_counter_add(&p->counters.recv_timeouts, 1);
            return kvpi_error(KVP_ETIMEDOUT, "pipe %s: nothing announced by %s within %d ms",
                              p->ep.local_segment, p->ep.peer_segment, timeout_ms);
        }
        if (n > 0) continue;
        zmq_pollitem_t it[2] = {
            {.socket = p->data_in.sock, .events = ZMQ_POLLIN},
            {.fd = p->recv_wake_fd, .events = ZMQ_POLLIN},
        };
        int r = zmq_poll(it, 2, timeout_ms < 0 ? -1 : remaining_ms(deadline));
        if (r < 0 && zmq_errno() != EINTR) return zmq_fail(p, "poll");
        uint64_t v;
        if (r > 0 && it[1].revents && read(p->recv_wake_fd, &v, sizeof v) < 0 && errno != EAGAIN)
            return kvpi_error(KVP_EIO, "pipe %s: eventfd: %s", p->ep.local_segment,
                              strerror(errno));
    }
}

static kvp_status check_announcement(kvp_pipe *p, uint64_t addr, uint64_t len)
{
    if (len == 0)
        return kvpi_error(KVP_EPROTO, "pipe %s: announcement from %s has length 0",
                          p->ep.local_segment, p->ep.peer_segment);
    if (len > p->opts.max_message_bytes)
        return kvpi_error(KVP_EPROTO,
                          "pipe %s: announcement from %s of %llu bytes is above max_message_bytes "
                          "(%zu)",
                          p->ep.local_segment, p->ep.peer_segment, (unsigned long long)len,
                          p->opts.max_message_bytes);
    if (addr + len < addr)
        return kvpi_error(KVP_ERANGE, "pipe %s: announced range 0x%llx+%llu wraps around",
                          p->ep.local_segment, (unsigned long long)addr, (unsigned long long)len);
    return KVP_OK;
}

/* READ the announced range into a new local managed buffer. */
static kvp_status fetch(kvp_pipe *p, uint64_t addr, uint64_t len, void **out)
{
    kvp_status st = check_announcement(p, addr, len);
    if (st) return st;
    if (!p->peer_open) {
        if ((st = kvp_engine_open_segment(p->engine, p->ep.peer_segment, &p->peer_seg))) return st;
        p->peer_open = 1;
    }
    void *buf;
    if ((st = kvp_engine_alloc(p->engine, (size_t)len, &buf))) return st;
    if ((st = kvp_engine_read(p->engine, p->peer_seg, buf, addr, (size_t)len))) {
        kvp_engine_free(p->engine, buf);
        return st;
    }
    *out = buf;
    return KVP_OK;
}

static void send_ack(kvp_pipe *p)
{
    if (zsend(p->ack_push, ACK_TEXT, ACK_LEN, 0, ACK_SEND_TIMEOUT_MS) == ACK_LEN) return;
    /* The data is here already; only the sender's buffer release depends on the
     * ACK, and a sender that does not take it is gone or not listening. */
    KVPI_WARN_LIMITED("pipe %s: could not send ACK to %s within %d ms: %s", p->ep.local_segment,
                      p->ep.peer_segment, ACK_SEND_TIMEOUT_MS, zmq_strerror(zmq_errno()));
}

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
        char why[512];
        snprintf(why, sizeof why, "%s", kvp_last_error());
        kvp_engine_free(p->engine, buf);
        return kvpi_error(st, "pipe %s: message from %s: %s", p->ep.local_segment,
                          p->ep.peer_segment, why);
    }
    if (is_none(&t)) {
        kvp_engine_free(p->engine, buf);
        *out = NULL;
        return KVP_OK;
    }
    held *h = calloc(1, sizeof *h);
    if (!h) {
        kvp_engine_free(p->engine, buf);
        return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    }
    h->t = t;
    *out = hold(p, h, buf);
    return KVP_OK;
}

kvp_status kvp_pipe_recv(kvp_pipe *p, int timeout_ms, kvp_tensor **out)
{
    if (!p || !out) return kvpi_error(KVP_EINVAL, "pipe recv: NULL argument");
    pthread_mutex_lock(&p->recv_lock);
    uint64_t addr = 0, len = 0;
    void *buf = NULL;
    kvp_status st = KVP_OK;
    if (!kvp_pipe_usable(p)) {
        st = kvpi_error(KVP_ECLOSED, "pipe %s can no longer be used", p->ep.local_segment);
        goto out;
    }
    st = next_announcement(p, timeout_ms, &addr, &len);
    if (st) goto out;
    st = fetch(p, addr, len, &buf);
    /* One ACK per announcement taken, good or bad, once we are done with the
     * sender's buffer: the sender holds one for each. */
    send_ack(p);
    if (st == KVP_OK) st = deliver(p, buf, (size_t)len, out);
    pthread_mutex_lock(&p->lock);
    if (st == KVP_OK) {
        p->stats.received++;
        p->stats.bytes_received += len;
    } else {
        p->stats.bad_messages++;
    }
    pthread_mutex_unlock(&p->lock);
out:
    pthread_mutex_unlock(&p->recv_lock);
    return st;
}

/* --------------------------------------------------------------- other --- */

int kvp_pipe_usable(const kvp_pipe *p)
{
    return p && !atomic_load(&((kvp_pipe *)p)->broken) && !atomic_load(&((kvp_pipe *)p)->closing);
}

void kvp_pipe_get_stats(kvp_pipe *p, kvp_pipe_stats *out)
{
    pthread_mutex_lock(&p->lock);
    *out = p->stats;
    out->inflight_bytes = p->inflight_bytes;
    out->inflight_count = p->q_count;
    pthread_mutex_unlock(&p->lock);
}

const kvpi_pipe_counters *kvpi_pipe_counters_of(const kvp_pipe *p)
{
    return &p->counters;
}

const kvp_pipe_endpoints *kvp_pipe_get_endpoints(const kvp_pipe *p)
{
    return &p->ep;
}

kvp_engine *kvp_pipe_engine(kvp_pipe *p)
{
    return p->engine;
}

void kvp_pipe_close(kvp_pipe *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->closing, 1);
    pthread_cond_broadcast(&p->room);
    pthread_mutex_unlock(&p->lock);
    kvpi_engine_metrics_detach(p->engine, p);
    close_sockets(p);
    /* The control thread is gone: what is still queued will never be acknowledged. */
    while (p->q_count > 0)
        kvp_engine_free(p->engine, q_pop_head(p).buf);
    KVPI_INFO("pipe %s closed", p->ep.local_segment);
    pipe_unref(p);
}
