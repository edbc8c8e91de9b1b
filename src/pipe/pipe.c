/* The tensor pipe: MooncakePipe's control plane on ZeroMQ over the transfer
 * engine. See include/kvpipe/pipe.h for the protocol, docs/pipe.md, and
 * pipe_internal.h for the parts, their threads and the inline path.
 *
 * This file: opening and closing, the options, the sockets, the stats;
 * pipe_control.c: the links, the control thread, the ZAP handler and the
 * negotiator thread.
 *
 * The two PULL sockets ("links", connected to the peer) check every message:
 * an announcement that is not two 8-byte frames (or, when this side offers
 * the inline path, one frame of an inline message) and an ACK that is not
 * the 3-byte frame "ACK" are dropped, counted and logged (rate-limited).
 *
 * ZeroMQ closes a connection whose peer broke the protocol (a frame above
 * max_control_frame, a bad handshake) and never reconnects it by itself. The
 * control thread reads both links' monitors (a monitor must be read all the
 * time: a full one blocks ZeroMQ's I/O thread), tells such a close from one
 * that ZeroMQ reconnects, and has the link connected again after a back-off.
 * It does that itself for ack_in; for data_in, the socket of the receivers,
 * it does it only when it can take recv_lock without waiting, and otherwise
 * raises data_redial and wakes a receiver waiting in its poll (recv_wake_fd),
 * which then does it; a receiver busy with a READ does it on its next wait.
 *
 * Lifetime. The pipe struct and its engine are reference counted: one
 * reference for the open pipe, one per received tensor still alive, so a
 * tensor may outlive kvp_pipe_close().
 */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>
#include <sodium.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/digest.h"
#include "common/error.h"
#include "common/sized.h"
#include "common/log.h"
#include "common/net.h"
#include "engine/engine_ext.h"
#include "pipe/pipe_internal.h"
#include "pipe/pipe_metrics.h"

/* Inbound messages a PUSH socket buffers per connection. A PUSH never reads,
 * so this only bounds what a peer that sends to it can park there. */
#define PUSH_RCVHWM 1
#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define DEFAULT_KV_BUFFER_SIZE 1000000000u
#define DEFAULT_SEND_TIMEOUT_MS 30000
#define DEFAULT_MAX_MESSAGE ((size_t)32 << 30)
#define DEFAULT_INLINE_MAX ((size_t)128 << 10)
#define DEFAULT_RECV_WINDOW 32
#define DEFAULT_RECV_WINDOW_BYTES ((size_t)64 << 20)
#define DEFAULT_MAX_CONTROL_FRAME 4096
#define DEFAULT_REDIAL_MIN_MS 200
#define DEFAULT_REDIAL_MAX_MS 5000
#define DEFAULT_ACK_TIMEOUT_MS 2000
#define DEFAULT_ACK_DELAY_US 1000
#define DEFAULT_ACK_LINGER_MS 500
#define DEFAULT_ZMQ_HWM 1000
/* Bounds of the options, so that nothing overflows. */
#define MAX_MS 86400000
#define MAX_RECV_WINDOW 65536

static kvp_pipe_opts default_opts(void)
{
    return (kvp_pipe_opts){.kv_buffer_size = DEFAULT_KV_BUFFER_SIZE,
                           .send_timeout_ms = DEFAULT_SEND_TIMEOUT_MS,
                           .io_timeout_ms = KVPI_DEFAULT_TIMEOUT_MS,
                           .max_message_bytes = DEFAULT_MAX_MESSAGE,
                           .inline_max_bytes = DEFAULT_INLINE_MAX,
                           .recv_window = DEFAULT_RECV_WINDOW,
                           .recv_window_bytes = DEFAULT_RECV_WINDOW_BYTES,
                           .max_control_frame = DEFAULT_MAX_CONTROL_FRAME,
                           .redial_min_ms = DEFAULT_REDIAL_MIN_MS,
                           .redial_max_ms = DEFAULT_REDIAL_MAX_MS,
                           .ack_timeout_ms = DEFAULT_ACK_TIMEOUT_MS,
                           .ack_delay_us = DEFAULT_ACK_DELAY_US,
                           .ack_linger_ms = DEFAULT_ACK_LINGER_MS,
                           .zmq_hwm = DEFAULT_ZMQ_HWM,
                           .integrity = KVP_INTEGRITY_ENV};
}

void kvp_pipe_opts_init_size(kvp_pipe_opts *opts, size_t size)
{
    kvp_pipe_opts d = default_opts();
    if (opts) kvpi_sized_out(opts, size, &d, sizeof d);
}

/* ------------------------------------------------------------ helpers --- */

int kvpi_pipe_remaining_ms(uint64_t deadline)
{
    uint64_t now = kvpi_now_ms();
    return now >= deadline ? 0 : (int)(deadline - now > INT32_MAX ? INT32_MAX : deadline - now);
}

struct timespec kvpi_pipe_mono_deadline(uint64_t deadline_ms)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline_ms / 1000),
                          .tv_nsec = (long)(deadline_ms % 1000) * 1000000L};
    return ts;
}

int kvpi_pipe_zsend(void *s, const void *buf, size_t len, int flags, int timeout_ms)
{
    zmq_setsockopt(s, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
    int r;
    while ((r = zmq_send(s, buf, len, flags)) < 0 && zmq_errno() == EINTR) {
    }
    return r;
}

kvp_status kvpi_pipe_zmq_fail(kvp_pipe *p, const char *what)
{
    int err = zmq_errno();
    if (err == ETERM || err == ENOTSOCK) atomic_store(&p->broken, 1);
    return kvpi_error(err == ETERM ? KVP_ECLOSED : KVP_EIO, "pipe %s: ZeroMQ %s: %s",
                      p->ep.local_segment, what, zmq_strerror(err));
}

/* ------------------------------------------------------------ lifetime --- */

static void close_eventfds(kvp_pipe *p);

void kvpi_pipe_unref(kvp_pipe *p)
{
    if (atomic_fetch_sub(&p->refs, 1) != 1) return;
    kvp_engine_destroy(p->engine);
    free(p->q);
    free(p->rx);
    pthread_mutex_destroy(&p->send_lock);
    pthread_mutex_destroy(&p->recv_lock);
    pthread_mutex_destroy(&p->push_lock);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->room);
    pthread_cond_destroy(&p->neg_cond);
    close_eventfds(p);
    kvpi_auth_free(p->auth);
    sodium_memzero(&p->curve, sizeof p->curve);
    free(p);
}

static void release_held(void *owner, void *data)
{
    (void)data;
    kvpi_held *h = owner;
    kvp_engine_free(h->pipe->engine, h->buf);
    kvpi_pipe_unref(h->pipe); /* kvp_tensor_free() frees h itself: t is its first member */
}

kvp_tensor *kvpi_pipe_hold(kvp_pipe *p, kvpi_held *h, void *buf)
{
    h->t.release = release_held;
    h->t.owner = h;
    h->pipe = p;
    h->buf = buf;
    atomic_fetch_add(&p->refs, 1);
    return &h->t;
}

kvpi_held *kvpi_pipe_sendable(kvp_pipe *p, kvp_tensor *t)
{
    kvpi_held *h = t->release == release_held ? t->owner : NULL;
    return h && &h->t == t && h->sendable && h->pipe == p ? h : NULL;
}

/* ------------------------------------------------------------- sockets --- */

/* Every socket of the pipe is made here, so that options that apply to all of
 * them (security mechanisms among them) have one place. linger_ms bounds how
 * long closing waits to hand queued messages over; max_frame is the largest
 * frame it takes in.
 *
 * A ZAP domain changes two things. ZeroMQ refuses peers that speak the ZMTP
 * 1.0 and 2.0 handshakes, which carry no socket type: without it, any TCP
 * client whose first byte is not 0xFF (a port scanner, an HTTP probe) passes
 * for a ZMTP 1.0 peer, joins a PUSH socket's round-robin and takes
 * announcements or ACKs that are then lost; every ZeroMQ 4 peer (pyzmq's
 * MooncakePipe included) speaks ZMTP 3. And every handshake waits for the
 * ZAP handler of the pipe's context (zap_answer()), which accepts everyone
 * but counts data_push's connections.
 *
 * Strangers: ZeroMQ accepts on the PUSH sockets' ports itself, with no cap
 * on connections, so the pipe bounds what a stranger holds by time: a
 * connection that has not finished its ZMTP handshake (a half-open or
 * trickling one, a CURVE client without the key) is closed after
 * io_timeout_ms (ZMQ_HANDSHAKE_IVL; ZeroMQ's default is 30 s), and one that
 * fails it is closed at once; the listen queue is as long as the kernel
 * allows (ZMQ_BACKLOG), so a burst of them drops no real peer's SYN. A
 * stranger never joins a PUSH socket's round-robin before its handshake is
 * done (ZeroMQ attaches a connection's pipe then), so it takes no message.
 *
 * In the authenticated mode the PUSH sockets are CURVE servers and the PULL
 * sockets CURVE clients, with keys derived from the key. The ZAP handler
 * still accepts every client that completes the CURVE handshake, which takes
 * the server's public key - derived from the secret, never sent - so only a
 * holder of the key gets in. */
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

static kvp_status make_socket(kvp_pipe *p, int type, int linger_ms, size_t max_frame,
                              const char *domain, void **out)
{
    void *s = zmq_socket(p->zctx, type);
    if (!s) return kvpi_pipe_zmq_fail(p, "socket");
    int one = 1, rcvhwm = type == ZMQ_PUSH ? PUSH_RCVHWM : p->opts.zmq_hwm;
    int sndhwm = p->opts.zmq_hwm, backlog = KVPI_LISTEN_BACKLOG;
    int handshake_ms = p->opts.io_timeout_ms;
    int64_t maxmsg = (int64_t)max_frame;
    if (zmq_setsockopt(s, ZMQ_LINGER, &linger_ms, sizeof linger_ms) != 0 ||
        zmq_setsockopt(s, ZMQ_IPV6, &one, sizeof one) != 0 ||
        zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) != 0 ||
        zmq_setsockopt(s, ZMQ_ZAP_DOMAIN, domain, strlen(domain)) != 0 ||
        zmq_setsockopt(s, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm) != 0 ||
        zmq_setsockopt(s, ZMQ_RCVHWM, &rcvhwm, sizeof rcvhwm) != 0 ||
        zmq_setsockopt(s, ZMQ_BACKLOG, &backlog, sizeof backlog) != 0 ||
        zmq_setsockopt(s, ZMQ_HANDSHAKE_IVL, &handshake_ms, sizeof handshake_ms) != 0 ||
        (p->auth && (type == ZMQ_PUSH || type == ZMQ_PULL) && set_curve(p, s, type) != 0)) {
        zmq_close(s);
        return kvpi_pipe_zmq_fail(p, "setsockopt");
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
#define AUTH_EVENTS (KVPI_PIPE_HANDSHAKE_FAILED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED)

/* A PULL socket connected to the peer's port, with its monitor. */
static kvp_status open_link(kvp_pipe *p, kvpi_pull_link *l, const char *what, int port,
                            size_t max_frame)
{
    kvp_status st;
    l->what = what;
    l->backoff_ms = p->opts.redial_min_ms;
    char hp[KVP_PIPE_NAME_MAX + 8], mon_ep[64];
    kvpi_hostport_format(p->ep.peer_host, port, hp, sizeof hp);
    snprintf(l->endpoint, sizeof l->endpoint, "tcp://%s", hp);
    /* The context is the pipe's own, so the name needs to be unique only in it. */
    snprintf(mon_ep, sizeof mon_ep, "inproc://kvpipe-monitor-%s", what);
    if ((st = make_socket(p, ZMQ_PULL, 0, max_frame, KVPI_PIPE_ZAP_DOMAIN, &l->sock))) return st;
    if (zmq_socket_monitor(l->sock, mon_ep, p->auth ? LINK_EVENTS : LINK_EVENTS & ~AUTH_EVENTS) !=
        0)
        return kvpi_pipe_zmq_fail(p, "monitor");
    if ((st =
             make_socket(p, ZMQ_PAIR, 0, p->opts.max_control_frame, KVPI_PIPE_ZAP_DOMAIN, &l->mon)))
        return st;
    if (zmq_connect(l->mon, mon_ep) != 0) return kvpi_pipe_zmq_fail(p, "monitor connect");
    if (zmq_connect(l->sock, l->endpoint) == 0) return KVP_OK;
    return kvpi_error(KVP_EIO, "pipe %s: cannot connect ZeroMQ endpoint %s: %s",
                      p->ep.local_segment, l->endpoint, zmq_strerror(zmq_errno()));
}

/* Authenticated: a monitor of a PUSH socket, for its refused handshakes. */
static kvp_status monitor_push(kvp_pipe *p, void *sock, const char *what, void **mon)
{
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://kvpipe-monitor-push-%s", what);
    if (zmq_socket_monitor(sock, ep, KVPI_PIPE_HANDSHAKE_FAILED) != 0)
        return kvpi_pipe_zmq_fail(p, "monitor");
    kvp_status st =
        make_socket(p, ZMQ_PAIR, 0, p->opts.max_control_frame, KVPI_PIPE_ZAP_DOMAIN, mon);
    if (!st && zmq_connect(*mon, ep) != 0) st = kvpi_pipe_zmq_fail(p, "monitor connect");
    return st;
}

/* The ZAP handler's socket, before any socket that asks it exists. */
static kvp_status open_zap(kvp_pipe *p)
{
    if (!(p->zap = zmq_socket(p->zctx, ZMQ_REP))) return kvpi_pipe_zmq_fail(p, "ZAP socket");
    int zero = 0;
    zmq_setsockopt(p->zap, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(p->zap, ZAP_ENDPOINT) != 0) return kvpi_pipe_zmq_fail(p, "ZAP bind");
    return KVP_OK;
}

static kvp_status open_sockets(kvp_pipe *p)
{
    kvp_status st;
    const kvp_pipe_opts *o = &p->opts;
    if (!(p->zctx = zmq_ctx_new())) return kvpi_pipe_zmq_fail(p, "context");
    if ((st = open_zap(p))) return st;
    /* Announcements die with the pipe (their buffers are freed at close), so
     * linger 0; the last ACKs get a short grace so that a receiver closing right
     * after its last recv still releases the sender's buffers. */
    if ((st = make_socket(p, ZMQ_PUSH, 0, o->max_control_frame, KVPI_PIPE_ZAP_ANNOUNCE,
                          &p->data_push)))
        return st;
    if ((st = make_socket(p, ZMQ_PUSH, o->ack_linger_ms, o->max_control_frame, KVPI_PIPE_ZAP_DOMAIN,
                          &p->ack_push)))
        return st;
    if ((st = bind_socket(p, p->data_push, p->ep.data_port))) return st;
    if ((st = bind_socket(p, p->ack_push, p->ep.ack_port))) return st;
    if (p->auth && ((st = monitor_push(p, p->data_push, "announce", &p->data_push_mon)) ||
                    (st = monitor_push(p, p->ack_push, "ACK", &p->ack_push_mon))))
        return st;
    size_t inline_frame = o->inline_max_bytes ? kvpi_inline_size(o->inline_max_bytes) : 0;
    size_t data_max = inline_frame > o->max_control_frame ? inline_frame : o->max_control_frame;
    if ((st = open_link(p, &p->data_in, "announce", p->ep.peer_data_port, data_max))) return st;
    size_t fd_len = sizeof p->data_in_fd;
    if (zmq_getsockopt(p->data_in.sock, ZMQ_FD, &p->data_in_fd, &fd_len) != 0)
        return kvpi_pipe_zmq_fail(p, "getsockopt ZMQ_FD");
    return open_link(p, &p->ack_in, "ACK", p->ep.peer_ack_port, o->max_control_frame);
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
    void **socks[] = {&p->data_push,   &p->ack_push,      &p->data_in.sock,
                      &p->ack_in.sock, &p->data_in.mon,   &p->ack_in.mon,
                      &p->zap,         &p->data_push_mon, &p->ack_push_mon};
    for (size_t i = 0; i < sizeof socks / sizeof socks[0]; i++) {
        if (*socks[i]) zmq_close(*socks[i]);
        *socks[i] = NULL;
    }
    zmq_ctx_term(p->zctx);
    p->zctx = NULL;
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

/* What this side offers in its descriptor (pipe_internal.h): the inline
 * path up to inline_max_bytes (0: off), and tags; NULL when out of memory
 * (then neither is offered). */
static cJSON *pipe_fields(const kvp_pipe_opts *o, int integrity)
{
    cJSON *doc = cJSON_CreateObject(), *f = cJSON_CreateObject();
    if (!doc || !f || !cJSON_AddNumberToObject(f, "version", KVPI_PIPE_FIELD_VERSION) ||
        !cJSON_AddNumberToObject(f, "inline_max_bytes", (double)o->inline_max_bytes) ||
        (integrity && !cJSON_AddStringToObject(f, "digest", KVPI_DIGEST_NAME)) ||
        !cJSON_AddItemToObject(doc, KVPI_PIPE_FIELD, f)) {
        cJSON_Delete(doc);
        cJSON_Delete(f);
        return NULL;
    }
    return doc;
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
    /* The message's digest covers its READ end to end (pipe_internal.h,
     * "Integrity"): the engine's own would only repeat it, at twice the
     * passes over memory. */
    eo.integrity = 0;
    eo.metrics_host = p->opts.metrics_host;
    cJSON *fields = pipe_fields(&p->opts, p->integrity);
    if (p->opts.inline_max_bytes && !fields) p->opts.inline_max_bytes = 0;
    st = kvpi_engine_create_with_fields(&eo, fields, &p->engine);
    cJSON_Delete(fields);
    free(conn);
    return st;
}

static kvp_status check_opts(const kvp_pipe_opts *o)
{
    const char *bad =
        o->kv_buffer_size == 0 ? "kv_buffer_size is 0"
        : o->send_timeout_ms < 0 || o->send_timeout_ms > MAX_MS
            ? "send_timeout_ms outside 0..86400000"
        : o->io_timeout_ms <= 0 || o->io_timeout_ms > MAX_MS ? "io_timeout_ms outside 1..86400000"
        : o->max_message_bytes == 0                          ? "max_message_bytes is 0"
        : o->inline_max_bytes > ((size_t)1 << 30)            ? "inline_max_bytes above 1 GiB"
        : o->recv_window < 1 || o->recv_window > MAX_RECV_WINDOW ? "recv_window outside 1..65536"
        : o->recv_window_bytes == 0                              ? "recv_window_bytes is 0"
        : o->max_control_frame < 16 || o->max_control_frame > ((size_t)1 << 30)
            ? "max_control_frame outside 16..1 GiB (announcements are 8-byte frames)"
        : o->redial_min_ms < 1 || o->redial_min_ms > MAX_MS ? "redial_min_ms outside 1..86400000"
        : o->redial_max_ms < o->redial_min_ms || o->redial_max_ms > MAX_MS
            ? "redial_max_ms outside redial_min_ms..86400000"
        : o->ack_timeout_ms < 0 || o->ack_timeout_ms > MAX_MS ? "ack_timeout_ms outside 0..86400000"
        : o->ack_linger_ms < 0 || o->ack_linger_ms > MAX_MS   ? "ack_linger_ms outside 0..86400000"
        : o->ack_delay_us < 0 || o->ack_delay_us > 60000000   ? "ack_delay_us outside 0..60000000"
        : o->zmq_hwm < 0                                      ? "zmq_hwm < 0"
        : o->busy_poll_us < 0 || o->busy_poll_us > 1000000    ? "busy_poll_us outside 0..1000000"
                                                              : NULL;
    return bad ? kvpi_error(KVP_EINVAL, "pipe option %s", bad) : KVP_OK;
}

void kvpi_pipe_room_freed(kvp_pipe *p)
{
    pthread_cond_broadcast(&p->room);
    uint64_t one = 1;
    if (write(p->room_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        KVPI_WARN("pipe %s: cannot write its room eventfd: %s", p->ep.local_segment,
                  strerror(errno));
}

void kvpi_pipe_drain_fd(int fd)
{
    uint64_t v;
    while (read(fd, &v, sizeof v) > 0) {
    }
}

int kvp_pipe_recv_fd(kvp_pipe *p)
{
    return p ? p->poll_fd : -1;
}

int kvp_pipe_send_fd(kvp_pipe *p)
{
    return p ? p->room_fd : -1;
}

/* The receiver's descriptor for an event loop (kvp_pipe_recv_fd): its
 * wake-ups together. The senders' is room_fd itself; data_push's ZMQ_FD is
 * in neither: it signals whenever that socket has commands, which nothing
 * reads while no send runs, so a loop would spin on it. */
static kvp_status open_poll_fd(kvp_pipe *p)
{
    if ((p->poll_fd = epoll_create1(EPOLL_CLOEXEC)) < 0)
        return kvpi_error(KVP_EIO, "pipe: epoll_create1: %s", strerror(errno));
    int fds[] = {p->data_in_fd, p->rx_done_fd, p->recv_wake_fd};
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = fds[i]};
        if (epoll_ctl(p->poll_fd, EPOLL_CTL_ADD, fds[i], &ev) != 0)
            return kvpi_error(KVP_EIO, "pipe: epoll_ctl: %s", strerror(errno));
    }
    return KVP_OK;
}

static void close_eventfds(kvp_pipe *p)
{
    int *fds[] = {&p->recv_wake_fd, &p->rx_done_fd, &p->ack_timer_fd, &p->room_fd, &p->poll_fd};
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++)
        if (*fds[i] >= 0) close(*fds[i]);
}

static kvp_status pipe_init_sync(kvp_pipe *p)
{
    p->recv_wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    p->rx_done_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    p->ack_timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    p->room_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    p->poll_fd = -1;
    if (p->recv_wake_fd < 0 || p->rx_done_fd < 0 || p->ack_timer_fd < 0 || p->room_fd < 0) {
        int err = errno;
        close_eventfds(p);
        return kvpi_error(KVP_EIO, "pipe: eventfd: %s", strerror(err));
    }
    if (kvpi_cond_init(&p->room) || kvpi_cond_init(&p->neg_cond)) {
        close_eventfds(p);
        return kvpi_error(KVP_EIO, "pipe: cannot make a condition variable");
    }
    pthread_mutex_init(&p->lock, NULL);
    pthread_mutex_init(&p->send_lock, NULL);
    pthread_mutex_init(&p->recv_lock, NULL);
    pthread_mutex_init(&p->push_lock, NULL);
    return KVP_OK;
}

static kvp_status start_threads(kvp_pipe *p)
{
    int err = pthread_create(&p->neg_thread, NULL, kvpi_pipe_negotiator_main, p);
    if (err) return kvpi_error(KVP_EIO, "pipe: cannot start a thread: %s", strerror(err));
    p->neg_started = 1;
    if ((err = pthread_create(&p->ctl_thread, NULL, kvpi_pipe_control_main, p)))
        return kvpi_error(KVP_EIO, "pipe: cannot start a thread: %s", strerror(err));
    p->ctl_started = 1;
    return KVP_OK;
}

static void stop_negotiator(kvp_pipe *p)
{
    if (!p->neg_started) return;
    kvpi_thread_stop(p->neg_thread, &p->lock, &p->neg_cond, &p->neg_stop);
    p->neg_started = 0;
}

kvp_status kvp_pipe_open_size(const kvp_pipe_config *cfg, int local_rank, int kv_rank,
                              const kvp_pipe_opts *opts, size_t size, kvp_pipe **out)
{
    if (!out) return kvpi_error(KVP_EINVAL, "pipe open: NULL output");
    kvp_pipe_endpoints ep;
    kvp_status st = kvp_pipe_config_endpoints(cfg, local_rank, kv_rank, &ep);
    if (st) return st;
    kvp_pipe_opts o = default_opts();
    if (opts && (st = kvpi_sized_in(&o, sizeof o, opts, size, "kvp_pipe_opts"))) return st;
    if ((st = check_opts(&o))) return st;
    kvp_pipe *p = calloc(1, sizeof *p);
    if (p) p->rx = calloc((size_t)o.recv_window, sizeof *p->rx);
    if (!p || !p->rx) {
        free(p);
        return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    }
    if ((st = pipe_init_sync(p))) {
        free(p->rx);
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
    if ((st = kvpi_integrity_resolve(o.integrity, &p->integrity))) goto fail;
    if ((st = create_engine(p, cfg))) goto fail;
    if ((st = open_sockets(p))) goto fail;
    if ((st = open_poll_fd(p))) goto fail;
    if ((st = start_threads(p))) goto fail;
    if ((st = kvpi_engine_metrics_attach(p->engine, kvpi_pipe_metrics_serve, p))) goto fail;
    KVPI_INFO("pipe %s open (kv_rank %d, peer %s): ZeroMQ data %d ack %d, inline path %s%s%s",
              ep.local_segment, kv_rank, ep.peer_segment, ep.data_port, ep.ack_port,
              p->opts.inline_max_bytes ? "offered" : "off",
              p->auth ? ", authenticated (CURVE)" : "", p->integrity ? ", integrity checked" : "");
    *out = p;
    return KVP_OK;
fail:
    stop_negotiator(p);
    close_sockets(p);
    kvpi_pipe_unref(p);
    return st;
}

/* --------------------------------------------------------------- other --- */

int kvp_pipe_usable(const kvp_pipe *p)
{
    return p && !atomic_load(&((kvp_pipe *)p)->broken) && !atomic_load(&((kvp_pipe *)p)->closing);
}

void kvp_pipe_get_stats_size(kvp_pipe *p, kvp_pipe_stats *out, size_t size)
{
    pthread_mutex_lock(&p->push_lock);
    uint64_t gen = p->push_gen;
    pthread_mutex_unlock(&p->push_lock);
    pthread_mutex_lock(&p->lock);
    kvp_pipe_stats s = p->stats;
    s.inflight_bytes = p->inflight_bytes;
    s.inflight_count = p->q_count;
    s.peer_inline_max = p->neg_done == gen && gen ? p->neg_peer_inline : 0;
    pthread_mutex_unlock(&p->lock);
    kvpi_sized_out(out, size, &s, sizeof s);
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
    kvpi_pipe_room_freed(p);
    pthread_mutex_unlock(&p->lock);
    kvpi_engine_metrics_detach(p->engine, p);
    stop_negotiator(p);
    /* The deferred ACKs of what was handed out leave as recv would have sent
     * them; ack_linger_ms lets them go out. */
    pthread_mutex_lock(&p->recv_lock);
    kvpi_pipe_close_acks(p);
    pthread_mutex_unlock(&p->recv_lock);
    close_sockets(p);
    /* The control thread is gone: what is still queued will never be acknowledged. */
    kvpi_pipe_drop_queue(p);
    kvpi_pipe_drop_window(p);
    KVPI_INFO("pipe %s closed", p->ep.local_segment);
    kvpi_pipe_unref(p);
}
