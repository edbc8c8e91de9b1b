/* The tensor pipe: MooncakePipe's control plane on ZeroMQ over the transfer
 * engine. See include/kvpipe/pipe.h for the protocol and docs/pipe.md.
 *
 * Sockets and threads. ZeroMQ sockets are not thread-safe, so each has one
 * user at a time:
 *   data_push (announce)  senders, under send_lock
 *   ack_pull  (ACKs in)   the ACK thread only
 *   data_pull (announce)  receivers, under recv_lock
 *   ack_push  (ACKs out)  receivers, under recv_lock
 * The FIFO of buffers awaiting ACK is shared by senders and the ACK thread
 * under `lock`; `room` is signalled whenever an ACK frees one.
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
#include <zmq.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "kvpipe/pipe.h"
#include "pipe/announce.h"
#include "pipe/safetensors.h"

#define ACK_TEXT "ACK"
#define ACK_LEN 3
/* Control frames are 8 bytes; a peer sending far larger ones is dropped by
 * ZeroMQ before they are buffered. */
#define CONTROL_MAX_FRAME 4096
#define DEFAULT_KV_BUFFER_SIZE 1000000000u
#define DEFAULT_SEND_TIMEOUT_MS 30000
#define DEFAULT_IO_TIMEOUT_MS 5000
#define DEFAULT_MAX_MESSAGE ((size_t)32 << 30)
/* Longest a receiver waits for the ack socket to take an ACK. */
#define ACK_SEND_TIMEOUT_MS 2000
/* Longest close waits for queued ACKs to leave. */
#define ACK_LINGER_MS 500

typedef struct inflight {
    void *buf;
    size_t len;
} inflight;

struct kvp_pipe {
    atomic_int refs;
    atomic_int broken;
    kvp_engine *engine;
    kvp_pipe_endpoints ep;
    kvp_pipe_opts opts;

    void *zctx;
    void *data_push, *ack_push, *data_pull, *ack_pull;
    pthread_t ack_thread;
    int ack_thread_started;

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

/* linger_ms bounds how long closing waits to hand queued messages over. */
static kvp_status make_socket(kvp_pipe *p, int type, int linger_ms, void **out)
{
    void *s = zmq_socket(p->zctx, type);
    if (!s) return zmq_fail(p, "socket");
    int one = 1;
    int64_t maxmsg = CONTROL_MAX_FRAME;
    if (zmq_setsockopt(s, ZMQ_LINGER, &linger_ms, sizeof linger_ms) != 0 ||
        zmq_setsockopt(s, ZMQ_IPV6, &one, sizeof one) != 0 ||
        zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) != 0) {
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

static kvp_status connect_socket(kvp_pipe *p, void *s, int port)
{
    char hp[KVP_PIPE_NAME_MAX + 8], ep[KVP_PIPE_NAME_MAX + 16];
    kvpi_hostport_format(p->ep.peer_host, port, hp, sizeof hp);
    snprintf(ep, sizeof ep, "tcp://%s", hp);
    if (zmq_connect(s, ep) == 0) return KVP_OK;
    return kvpi_error(KVP_EIO, "pipe %s: cannot connect ZeroMQ endpoint %s: %s",
                      p->ep.local_segment, ep, zmq_strerror(zmq_errno()));
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
    if ((st = make_socket(p, ZMQ_PULL, 0, &p->data_pull))) return st;
    if ((st = make_socket(p, ZMQ_PULL, 0, &p->ack_pull))) return st;
    if ((st = bind_socket(p, p->data_push, p->ep.data_port))) return st;
    if ((st = bind_socket(p, p->ack_push, p->ep.ack_port))) return st;
    if ((st = connect_socket(p, p->data_pull, p->ep.peer_data_port))) return st;
    return connect_socket(p, p->ack_pull, p->ep.peer_ack_port);
}

/* Stop the ACK thread and close every socket and the context. Safe on a
 * half-opened pipe. */
static void close_sockets(kvp_pipe *p)
{
    if (!p->zctx) return;
    /* Shutdown makes the ACK thread's blocking receive return ETERM. */
    zmq_ctx_shutdown(p->zctx);
    if (p->ack_thread_started) pthread_join(p->ack_thread, NULL);
    p->ack_thread_started = 0;
    void **socks[] = {&p->data_push, &p->ack_push, &p->data_pull, &p->ack_pull};
    for (size_t i = 0; i < 4; i++) {
        if (*socks[i]) zmq_close(*socks[i]);
        *socks[i] = NULL;
    }
    zmq_ctx_term(p->zctx);
    p->zctx = NULL;
}

/* ---------------------------------------------------------- ACK thread --- */

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

/* One ACK message: the oldest buffer in flight is free. Like vLLM, any single
 * message on the ACK socket counts; one that is not "ACK" is logged. An ACK
 * that pops the buffer still being announced leaves it to its sender (post()),
 * which may yet have to take it back. */
static void handle_ack(kvp_pipe *p, int frames, int ok)
{
    pthread_mutex_lock(&p->lock);
    int have = p->q_count > 0;
    inflight e = have ? q_pop_head(p) : (inflight){NULL, 0};
    if (have && e.buf == p->posting) {
        p->posting_acked = 1;
        e.buf = NULL;
    }
    if (!ok || frames != 1 || !have) p->stats.bad_acks++;
    if (have) p->stats.acks++;
    pthread_cond_broadcast(&p->room);
    pthread_mutex_unlock(&p->lock);
    if (!have)
        KVPI_WARN("pipe %s: ACK from %s with nothing in flight, ignored", p->ep.local_segment,
                  p->ep.peer_segment);
    else if (!ok || frames != 1)
        KVPI_WARN("pipe %s: malformed ACK from %s (%d frames), taken as an ACK",
                  p->ep.local_segment, p->ep.peer_segment, frames);
    if (e.buf) kvp_engine_free(p->engine, e.buf);
}

static void *ack_main(void *arg)
{
    kvp_pipe *p = arg;
    for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        int frames = 0, ok = 1, more;
        do {
            if (zmq_msg_recv(&msg, p->ack_pull, 0) < 0) {
                int err = zmq_errno();
                zmq_msg_close(&msg);
                if (err == EINTR) goto next;
                return NULL; /* ETERM: the pipe is closing */
            }
            frames++;
            if (frames == 1)
                ok = zmq_msg_size(&msg) == ACK_LEN && memcmp(zmq_msg_data(&msg), ACK_TEXT, 3) == 0;
            more = zmq_msg_more(&msg);
        } while (more);
        zmq_msg_close(&msg);
        handle_ack(p, frames, ok);
    next:;
    }
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
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int err = pthread_cond_init(&p->room, &ca);
    pthread_condattr_destroy(&ca);
    if (err) return kvpi_error(KVP_EIO, "pipe: pthread_cond_init: %s", strerror(err));
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
    if ((st = create_engine(p, cfg))) goto fail;
    if ((st = open_sockets(p))) goto fail;
    int err = pthread_create(&p->ack_thread, NULL, ack_main, p);
    if (err) {
        st = kvpi_error(KVP_EIO, "pipe: cannot start the ACK thread: %s", strerror(err));
        goto fail;
    }
    p->ack_thread_started = 1;
    KVPI_INFO("pipe %s open (kv_rank %d, peer %s): ZeroMQ data %d ack %d", ep.local_segment,
              kv_rank, ep.peer_segment, ep.data_port, ep.ack_port);
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
    uint8_t addr[KVPI_ANNOUNCE_FRAME_LEN], length[KVPI_ANNOUNCE_FRAME_LEN];
    kvpi_announce_encode((uint64_t)(uintptr_t)buf, len, addr, length);
    if (zsend(p->data_push, addr, 8, ZMQ_SNDMORE, remaining_ms(deadline)) < 0) {
        if (zmq_errno() != EAGAIN) return zmq_fail(p, "send");
        return kvpi_error(KVP_ETIMEDOUT,
                          "pipe %s: peer %s took no announcement within %d ms (is its pipe open "
                          "and connected to port %d?)",
                          p->ep.local_segment, p->ep.peer_segment, p->opts.send_timeout_ms,
                          p->ep.data_port);
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

/* Wait until an announcement can be read. */
static kvp_status wait_readable(kvp_pipe *p, int timeout_ms)
{
    uint64_t deadline = kvpi_now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    for (;;) {
        zmq_pollitem_t item = {.socket = p->data_pull, .events = ZMQ_POLLIN};
        int wait = timeout_ms < 0 ? -1 : remaining_ms(deadline);
        int r = zmq_poll(&item, 1, wait);
        if (r > 0) return KVP_OK;
        if (r < 0 && zmq_errno() != EINTR) return zmq_fail(p, "poll");
        if (r == 0 && timeout_ms >= 0 && remaining_ms(deadline) == 0)
            return kvpi_error(KVP_ETIMEDOUT, "pipe %s: nothing announced by %s within %d ms",
                              p->ep.local_segment, p->ep.peer_segment, timeout_ms);
    }
}

/* Take one whole message off the data socket. *consumed says whether a message
 * was taken (it then needs an ACK, good or bad). */
static kvp_status take_announcement(kvp_pipe *p, uint64_t *addr, uint64_t *len, int *consumed)
{
    kvpi_announce_rx rx = {0};
    int more;
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    do {
        /* The parts of a message arrive together, so none of these waits. */
        if (zmq_msg_recv(&msg, p->data_pull, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&msg);
            if (rx.frames == 0 && zmq_errno() == EAGAIN)
                return kvpi_error(KVP_ETIMEDOUT, "pipe %s: no announcement", p->ep.local_segment);
            return zmq_fail(p, "receive");
        }
        *consumed = 1;
        kvpi_announce_add_frame(&rx, zmq_msg_data(&msg), zmq_msg_size(&msg));
        more = zmq_msg_more(&msg);
    } while (more);
    zmq_msg_close(&msg);
    return kvpi_announce_decode(&rx, p->ep.local_segment, p->ep.peer_segment, addr, len);
}

/* READ the announced range into a new local managed buffer. */
static kvp_status fetch(kvp_pipe *p, uint64_t addr, uint64_t len, void **out)
{
    kvp_status st = kvpi_announce_check(addr, len, p->opts.max_message_bytes, p->ep.local_segment,
                                        p->ep.peer_segment);
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
    KVPI_WARN("pipe %s: could not send ACK to %s: %s", p->ep.local_segment, p->ep.peer_segment,
              zmq_strerror(zmq_errno()));
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
    kvp_status st;
    int consumed = 0;
    uint64_t addr = 0, len = 0;
    void *buf = NULL;
    if (!kvp_pipe_usable(p)) {
        st = kvpi_error(KVP_ECLOSED, "pipe %s can no longer be used", p->ep.local_segment);
        goto out;
    }
    if ((st = wait_readable(p, timeout_ms))) goto out;
    if ((st = take_announcement(p, &addr, &len, &consumed)) == KVP_OK)
        st = fetch(p, addr, len, &buf);
    /* One ACK per message taken, once we are done with the sender's buffer. */
    if (consumed) send_ack(p);
    if (st == KVP_OK) st = deliver(p, buf, (size_t)len, out);
    pthread_mutex_lock(&p->lock);
    if (st == KVP_OK) {
        p->stats.received++;
        p->stats.bytes_received += len;
    } else if (consumed) {
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
    close_sockets(p);
    /* The ACK thread is gone: what is still queued will never be acknowledged. */
    while (p->q_count > 0)
        kvp_engine_free(p->engine, q_pop_head(p).buf);
    KVPI_INFO("pipe %s closed", p->ep.local_segment);
    pipe_unref(p);
}
