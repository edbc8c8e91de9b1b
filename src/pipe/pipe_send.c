/* The tensor pipe's send side: the FIFO of messages awaiting ACK, flow
 * control, and each message's way out - an announcement of a managed buffer
 * (MooncakePipe's wire) or, to a peer that offers it, an inline message
 * (pipe_internal.h).
 *
 * The FIFO is shared by senders and the control thread under `lock`; `room`
 * is signalled whenever an ACK frees an entry. Its entries are queued before
 * their message leaves, since the ACK may come at once.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/digest.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"
#include "common/region.h"
#include "gpu/cuda.h"
#include "pipe/pipe_internal.h"
#include "pipe/safetensors.h"

_Static_assert(KVPI_SEND_PREFIX >= 8 + KVPI_SAFETENSORS_HEADER_CAP && KVPI_SEND_PREFIX % 256 == 0,
               "KVPI_SEND_PREFIX must hold a header and keep 256-byte alignment");

/* ------------------------------------------------------------ the FIFO --- */

static int q_push(kvp_pipe *p, void *buf, size_t len, uint64_t *seq)
{
    if (p->q_count == p->q_cap) {
        size_t cap = p->q_cap ? p->q_cap * 2 : 64;
        kvpi_inflight *q = malloc(cap * sizeof *q);
        if (!q) return -1;
        for (size_t i = 0; i < p->q_count; i++)
            q[i] = p->q[(p->q_head + i) % p->q_cap];
        free(p->q);
        p->q = q;
        p->q_cap = cap;
        p->q_head = 0;
    }
    *seq = ++p->seq;
    p->q[(p->q_head + p->q_count++) % p->q_cap] = (kvpi_inflight){buf, len, *seq};
    p->inflight_bytes += len;
    return 0;
}

static kvpi_inflight q_pop_head(kvp_pipe *p)
{
    kvpi_inflight e = p->q[p->q_head];
    p->q_head = (p->q_head + 1) % p->q_cap;
    p->q_count--;
    p->inflight_bytes -= e.len;
    return e;
}

/* Take the newest entry back. Only for the entry being posted, which is the
 * newest as long as no ACK popped it (sends are serialised; ACKs pop the head). */
static void q_drop_tail(kvp_pipe *p)
{
    kvpi_inflight *e = &p->q[(p->q_head + p->q_count - 1) % p->q_cap];
    p->inflight_bytes -= e->len;
    p->q_count--;
}

/* Pop the head for an ACK; an ACK that pops the message still being posted
 * leaves its buffer to its sender (post()), which may yet have to take it
 * back. Returns the buffer to free (NULL: none). Under lock. */
static void *ack_head(kvp_pipe *p)
{
    kvpi_inflight e = q_pop_head(p);
    if (e.seq == p->posting) {
        p->posting_acked = 1;
        e.buf = NULL;
    }
    p->stats.acks++;
    return e.buf;
}

/* A plain ACK frees the oldest message; a tagged one (pipe_internal.h,
 * "Tags") every message up to its number, and nothing when it is another
 * instance's or names a message never sent. */
void kvpi_pipe_take_ack(kvp_pipe *p, const kvpi_msg_tag *tag)
{
    const char *bad = NULL;
    pthread_mutex_lock(&p->lock);
    if (tag && strcmp(tag->instance, kvp_engine_instance(p->engine)) != 0)
        bad = "for another instance of this pipe's segment (one that ran before this process)";
    else if (tag && tag->seq > p->seq)
        bad = "for a message never sent";
    else if (!tag && !p->q_count)
        bad = "with nothing in flight";
    if (bad) {
        p->stats.bad_acks++;
        pthread_mutex_unlock(&p->lock);
        KVPI_WARN_LIMITED("pipe %s: dropped an ACK from %s %s", p->ep.local_segment,
                          p->ep.peer_segment, bad);
        return;
    }
    /* A plain ACK covers the oldest message; a tagged one (repeated, say)
     * may cover none still in flight. */
    uint64_t upto = tag ? tag->seq : p->q[p->q_head].seq;
    int freed = 0;
    while (p->q_count && p->q[p->q_head].seq <= upto) {
        void *buf = ack_head(p);
        freed = 1;
        if (!buf) continue;
        pthread_mutex_unlock(&p->lock);
        kvp_engine_free(p->engine, buf);
        pthread_mutex_lock(&p->lock);
    }
    if (freed) kvpi_pipe_room_freed(p);
    pthread_mutex_unlock(&p->lock);
    if (freed) atomic_store(&p->ack_in.good, 1);
}

void kvpi_pipe_drop_queue(kvp_pipe *p)
{
    while (p->q_count > 0) {
        void *buf = q_pop_head(p).buf;
        if (buf) kvp_engine_free(p->engine, buf);
    }
}

/* ------------------------------------------------------- flow control --- */

/* Wait until size more bytes fit under kv_buffer_size, or nothing is in flight
 * (so a message larger than the budget still goes, alone). A deadline of 0
 * (kvp_pipe_send_timeout with 0) only looks: a caller's poll, not a timeout,
 * so it is not counted as one. */
static kvp_status wait_for_room(kvp_pipe *p, size_t size, uint64_t deadline)
{
    kvp_status st = KVP_OK;
    struct timespec ts = kvpi_pipe_mono_deadline(deadline);
    pthread_mutex_lock(&p->lock);
    while (!atomic_load(&p->closing) && p->inflight_bytes > 0 &&
           p->inflight_bytes + size > p->opts.kv_buffer_size) {
        int rc = pthread_cond_timedwait(&p->room, &p->lock, &ts);
        if (rc == ETIMEDOUT && p->inflight_bytes > 0 &&
            p->inflight_bytes + size > p->opts.kv_buffer_size) {
            if (deadline) kvpi_counter_add(&p->counters.send_timeouts, 1);
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

static kvp_status begin_send(kvp_pipe *p, size_t size, uint64_t deadline)
{
    if (!kvp_pipe_usable(p))
        return kvpi_error(KVP_ECLOSED, "pipe %s can no longer be used", p->ep.local_segment);
    return wait_for_room(p, size, deadline);
}

/* ----------------------------------------------------- a message out --- */

/* A message on its way: the tensor to encode (copying send) or the encoded
 * message in place (send_take), and the forms made of it so far. */
typedef struct outgoing {
    const kvp_tensor *t; /* copying send: encode this */
    kvpi_held *h;        /* send_take: the buffer holding msg */
    const uint8_t *msg;  /* send_take: the message, inside h->buf */
    size_t size;
    void *buf;      /* the announced form: a managed buffer holding the message */
    zmq_msg_t zmsg; /* the inline form */
    int have_zmsg;
    int cuda_device; /* copying send: the CUDA device holding t's bytes, or -1 */
    int digested;    /* integrity: digest is the message's (either form) */
    uint64_t digest;
} outgoing;

/* Copy len bytes of the message to dst, digesting them on the way when
 * integrity is on (the digest of the whole message, header first: into
 * m->digest once the last byte is in). */
static kvp_status copy_in(kvp_pipe *p, kvpi_digester **d, void *dst, const void *src, size_t len)
{
    if (!p->integrity) {
        memcpy(dst, src, len);
        return KVP_OK;
    }
    if (!*d && !(*d = kvpi_digester_new())) return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    kvpi_digester_copy(*d, dst, src, len);
    return KVP_OK;
}

/* Encode m's tensor into out (m->size bytes): its bytes copied once, by the
 * CPU (digested as they are copied, with integrity on) or, from GPU memory,
 * by the driver (then digested in a pass over the host copy). */
static kvp_status encode(kvp_pipe *p, outgoing *m, void *out)
{
    size_t off;
    kvp_status st = kvpi_safetensors_write_header(m->t, out, m->size, &off);
    if (st) return st;
    if (m->cuda_device >= 0) {
        if (m->t->nbytes)
            st = kvpi_cuda_copy_sync((uint8_t *)out + off, m->t->data, m->t->nbytes, m->cuda_device,
                                     1);
        if (!st && p->integrity) m->digest = kvpi_digest(out, m->size), m->digested = 1;
        return st;
    }
    kvpi_digester *d = NULL;
    if (p->integrity && !(d = kvpi_digester_new()))
        return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    if (d) kvpi_digester_add(d, out, off);
    if (m->t->nbytes) st = copy_in(p, &d, (uint8_t *)out + off, m->t->data, m->t->nbytes);
    if (!st && d) m->digest = kvpi_digester_value(d), m->digested = 1;
    kvpi_digester_free(d);
    return st;
}

/* Where t's bytes live: -1 for memory the CPU reads, else the CUDA device of
 * the GPU memory that holds them (vLLM's tensors on "cuda:N"). One system
 * call for host memory (its first and last byte read); the driver only for
 * memory the CPU cannot read. */
static kvp_status tensor_device(const kvp_tensor *t, int *device)
{
    *device = -1;
    int readable = kvpi_memory_readable(t->data, t->nbytes);
    if (readable < 0) readable = kvpi_memory_check_host(t->data, t->nbytes) == KVP_OK;
    if (readable) return KVP_OK;
    /* A tensor is one allocation of one device: its first and last byte. */
    kvp_status st = kvpi_cuda_range_device(t->data, t->nbytes, device);
    if (st)
        return kvpi_error(KVP_EINVAL,
                          "pipe send: the tensor's %zu bytes cannot be read by the CPU, and %s",
                          t->nbytes, kvp_last_error());
    return KVP_OK;
}

static kvp_status make_announced(kvp_pipe *p, outgoing *m)
{
    if (m->h || m->buf) return KVP_OK; /* send_take's message is in a managed buffer already */
    kvp_status st = kvp_engine_alloc(p->engine, m->size, &m->buf);
    if (st) return st;
    if ((st = encode(p, m, m->buf))) {
        kvp_engine_free(p->engine, m->buf);
        m->buf = NULL;
    }
    return st;
}

static kvp_status make_inline(kvp_pipe *p, outgoing *m)
{
    if (m->have_zmsg) return KVP_OK;
    if (zmq_msg_init_size(&m->zmsg, kvpi_inline_size(m->size)) != 0)
        return kvpi_error(KVP_ENOMEM, "pipe %s: out of memory for an inline message of %zu bytes",
                          p->ep.local_segment, m->size);
    m->have_zmsg = 1;
    uint8_t *out = kvpi_inline_put_tag(zmq_msg_data(&m->zmsg));
    kvp_status st;
    if (m->msg) {
        kvpi_digester *d = NULL;
        st = copy_in(p, &d, out, m->msg, m->size);
        if (!st && d) m->digest = kvpi_digester_value(d), m->digested = 1;
        kvpi_digester_free(d);
    } else {
        st = encode(p, m, out);
    }
    if (st) {
        zmq_msg_close(&m->zmsg);
        m->have_zmsg = 0;
    }
    return st;
}

/* Free what is left of m: the forms that did not leave. A caller clears
 * m->buf when the queue took it. */
static void outgoing_done(kvp_pipe *p, outgoing *m)
{
    if (m->have_zmsg) zmq_msg_close(&m->zmsg);
    if (m->buf) kvp_engine_free(p->engine, m->buf);
}

/* What the peer of data_push's current connections takes, as the
 * negotiator read it: whether a message of size bytes may go inline,
 * whether it is tagged, and whether the tag carries its digest
 * (pipe_internal.h). Under push_lock. */
static void peer_terms(kvp_pipe *p, size_t size, int *as_inline, int *tagged, int *digested)
{
    pthread_mutex_lock(&p->lock);
    int known = p->push_gen && p->neg_done == p->push_gen;
    *as_inline = known && size <= p->opts.inline_max_bytes && size <= p->neg_peer_inline;
    *tagged = known && p->neg_peer_tags;
    *digested = *tagged && p->neg_peer_digest;
    pthread_mutex_unlock(&p->lock);
}

/* The message's digest, for its tag: taken as it was copied in, or now, in
 * a pass over a message built in place (send_take's). */
static uint64_t message_digest(outgoing *m)
{
    if (!m->digested) {
        const void *msg = m->msg ? (const void *)m->msg : m->buf;
        if (!msg && m->have_zmsg) msg = (uint8_t *)zmq_msg_data(&m->zmsg) + KVPI_INLINE_TAG_LEN;
        m->digest = kvpi_digest(msg, m->size);
        m->digested = 1;
    }
    return m->digest;
}

/* Queue the message for its ACK (its buffer, for an announced one) and note
 * it as the one being posted; *seq: its sequence number. */
static kvp_status queue_posting(kvp_pipe *p, void *buf, size_t size, uint64_t *seq_out)
{
    pthread_mutex_lock(&p->lock);
    uint64_t seq = 0;
    int full = q_push(p, buf, size, &seq);
    if (!full) {
        p->posting = seq;
        p->posting_acked = 0;
    }
    pthread_mutex_unlock(&p->lock);
    *seq_out = seq;
    return full ? kvpi_error(KVP_ENOMEM, "pipe: out of memory") : KVP_OK;
}

/* The posted message did not leave: take its entry back, unless an ACK (a
 * stray one: the message never left) took it. */
static void unqueue_posting(kvp_pipe *p)
{
    pthread_mutex_lock(&p->lock);
    if (!p->posting_acked) {
        q_drop_tail(p);
        /* For flush; not the send descriptor: the sender that took its
         * message back is the one that would be told. */
        pthread_cond_broadcast(&p->room);
    }
    p->posting = 0;
    pthread_mutex_unlock(&p->lock);
}

/* The posted message left; returns whether an ACK took its entry meanwhile. */
static int posted(kvp_pipe *p, size_t size, int as_inline)
{
    pthread_mutex_lock(&p->lock);
    int acked = p->posting_acked;
    p->posting = 0;
    p->stats.sent++;
    p->stats.bytes_sent += size;
    if (as_inline) p->stats.inline_sent++;
    pthread_mutex_unlock(&p->lock);
    return acked;
}

/* The last frames of a message once its first left: with the first in,
 * ZeroMQ takes the rest (it delivers a multipart message whole); if one
 * still fails, the stream is torn. 1, or -1 with *st. */
static int push_rest(kvp_pipe *p, const void *const *frames, const size_t *sizes, int n,
                     kvp_status *st)
{
    for (int i = 0; i < n; i++)
        if (kvpi_pipe_zsend(p->data_push, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0,
                            p->opts.io_timeout_ms) < 0) {
            atomic_store(&p->broken, 1);
            *st = kvpi_pipe_zmq_fail(p, "send of a message's last frames");
            return -1;
        }
    return 1;
}

/* Hand one form of the message to data_push without waiting, tagged with
 * seq unless seq is 0. Returns 1 when it left, 0 when data_push cannot take
 * it now (no peer, queue full), or a negative status on a ZeroMQ failure.
 * Under push_lock. */
static int try_push(kvp_pipe *p, outgoing *m, int as_inline, uint64_t seq, int digested,
                    kvp_status *st)
{
    uint8_t tag[KVPI_TAG_DIGEST_LEN];
    size_t tag_len = 0;
    if (seq) {
        kvpi_msg_tag t = {.seq = seq, .has_digest = digested};
        if (digested) t.digest = message_digest(m);
        memcpy(t.instance, kvp_engine_instance(p->engine), KVPI_TAG_INSTANCE_LEN);
        tag_len = kvpi_tag_encode(&t, tag);
    }
    int more = seq ? ZMQ_SNDMORE : 0;
    if (as_inline) {
        if (zmq_msg_send(&m->zmsg, p->data_push, more | ZMQ_DONTWAIT) >= 0) {
            m->have_zmsg = 0; /* ZeroMQ owns it now */
            const void *f[] = {tag};
            size_t sz[] = {tag_len};
            return seq ? push_rest(p, f, sz, 1, st) : 1;
        }
    } else {
        uint8_t addr[KVPI_ANNOUNCE_FRAME_LEN], length[KVPI_ANNOUNCE_FRAME_LEN];
        const void *msg = m->msg ? (const void *)m->msg : m->buf;
        kvpi_announce_encode((uint64_t)(uintptr_t)msg, m->size, addr, length);
        if (zmq_send(p->data_push, addr, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT) >= 0) {
            const void *f[] = {length, tag};
            size_t sz[] = {sizeof length, tag_len};
            return push_rest(p, f, sz, seq ? 2 : 1, st);
        }
    }
    int err = zmq_errno();
    if (err == EAGAIN || err == EINTR) return 0;
    *st = kvpi_pipe_zmq_fail(p, "send");
    return -1;
}

static kvp_status wait_writable(kvp_pipe *p, uint64_t deadline)
{
    for (;;) {
        int left = kvpi_pipe_remaining_ms(deadline);
        zmq_pollitem_t it = {.socket = p->data_push, .events = ZMQ_POLLOUT};
        int r = zmq_poll(&it, 1, left);
        if (r > 0) return KVP_OK;
        if (r < 0 && zmq_errno() != EINTR) return kvpi_pipe_zmq_fail(p, "poll");
        if (r == 0 && left == 0) {
            if (deadline) kvpi_counter_add(&p->counters.send_timeouts, 1);
            return kvpi_error(KVP_ETIMEDOUT,
                              "pipe %s: peer %s took no announcement within %d ms (is its pipe "
                              "open and connected to port %d?%s)",
                              p->ep.local_segment, p->ep.peer_segment, p->opts.send_timeout_ms,
                              p->ep.data_port,
                              p->auth ? " The pipe is authenticated: a peer without its key "
                                        "cannot connect; the log says if one tried"
                                      : "");
        }
    }
}

/* Send m: announced, or inline when the peer of data_push's current
 * connections takes it. Caller holds send_lock. On success the queue owns
 * the announced buffer (freed on its ACK); on error nothing was sent and
 * nothing of the caller's was freed, even when a stray ACK popped the queue
 * entry meanwhile. *as_inline tells which form left. */
static kvp_status post(kvp_pipe *p, outgoing *m, uint64_t deadline, int *as_inline)
{
    kvp_status st;
    /* The first try does not poll: a zmq_poll costs several system calls,
     * and data_push can take a message nearly always. */
    for (int must_wait = 0;;) {
        if (must_wait && (st = wait_writable(p, deadline))) return st;
        pthread_mutex_lock(&p->push_lock);
        int inl, tagged, digested;
        peer_terms(p, m->size, &inl, &tagged, &digested);
        if (inl ? !m->have_zmsg : !(m->h || m->buf)) {
            /* Made outside push_lock: a copy of up to the message's size. */
            pthread_mutex_unlock(&p->push_lock);
            if ((st = inl ? make_inline(p, m) : make_announced(p, m))) return st;
            continue;
        }
        void *announced = inl ? NULL : (m->h ? m->h->buf : m->buf);
        uint64_t seq;
        if ((st = queue_posting(p, announced, m->size, &seq))) {
            pthread_mutex_unlock(&p->push_lock);
            return st;
        }
        int r = try_push(p, m, inl, tagged ? seq : 0, digested, &st);
        pthread_mutex_unlock(&p->push_lock);
        if (r <= 0) {
            /* A stray ACK may have taken the entry: nothing of ours was freed
             * either way. */
            unqueue_posting(p);
            if (r < 0) return st;
            must_wait = 1; /* no peer, or its queue is full */
            continue;
        }
        /* Acknowledged before it was posted: the ACK left the buffer to us. */
        if (posted(p, m->size, inl) && announced) kvp_engine_free(p->engine, announced);
        *as_inline = inl;
        return KVP_OK;
    }
}

kvp_status kvp_pipe_send(kvp_pipe *p, const kvp_tensor *t)
{
    if (!p) return kvpi_error(KVP_EINVAL, "pipe send: NULL pipe");
    return kvp_pipe_send_timeout(p, t, p->opts.send_timeout_ms);
}

kvp_status kvp_pipe_send_timeout(kvp_pipe *p, const kvp_tensor *t, int timeout_ms)
{
    if (!p) return kvpi_error(KVP_EINVAL, "pipe send: NULL pipe");
    int64_t none_value = KVP_PIPE_NONE_VALUE, one = 1;
    kvp_tensor none;
    if (!t) {
        kvp_tensor_init(&none, KVP_DTYPE_I64, 1, &one, &none_value);
        t = &none;
    }
    outgoing m = {.t = t};
    kvp_status st = kvpi_safetensors_size(t, &m.size);
    if (!st) st = tensor_device(t, &m.cuda_device);
    if (st) return st;
    /* A wait "without limit" of a century; 0: only a look (wait_for_room). */
    uint64_t deadline =
        timeout_ms ? kvpi_now_ms() + (uint64_t)(timeout_ms < 0 ? 3153600000000ll : timeout_ms) : 0;
    pthread_mutex_lock(&p->send_lock);
    kvpi_pipe_drain_fd(p->room_fd); /* what was freed before now is seen below */
    int as_inline = 0;
    if ((st = begin_send(p, m.size, deadline)) == KVP_OK) st = post(p, &m, deadline, &as_inline);
    /* An announced buffer that left belongs to the queue now. */
    if (st == KVP_OK && !as_inline) m.buf = NULL;
    outgoing_done(p, &m);
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
    if (nbytes > SIZE_MAX - KVPI_SEND_PREFIX)
        return kvpi_error(KVP_EINVAL, "pipe tensor_alloc: %zu bytes is too large", nbytes);
    if (!kvp_pipe_usable(p))
        return kvpi_error(KVP_ECLOSED, "pipe %s can no longer be used", p->ep.local_segment);
    kvpi_held *h = calloc(1, sizeof *h);
    if (!h) return kvpi_error(KVP_ENOMEM, "pipe: out of memory");
    void *buf;
    if ((st = kvp_engine_alloc(p->engine, KVPI_SEND_PREFIX + nbytes, &buf))) {
        free(h);
        return st;
    }
    kvp_tensor_init(&h->t, dtype, ndim, shape, (char *)buf + KVPI_SEND_PREFIX);
    h->sendable = 1;
    h->room = nbytes;
    *out = kvpi_pipe_hold(p, h, buf);
    return KVP_OK;
}

kvp_status kvp_pipe_send_take(kvp_pipe *p, kvp_tensor *t)
{
    if (!p || !t) return kvpi_error(KVP_EINVAL, "pipe send_take: NULL argument");
    kvpi_held *h = kvpi_pipe_sendable(p, t);
    if (!h)
        return kvpi_error(KVP_EINVAL,
                          "pipe %s: send_take needs a tensor from kvp_pipe_tensor_alloc() of this "
                          "pipe (use kvp_pipe_send() for others)",
                          p->ep.local_segment);
    if (t->data != (char *)h->buf + KVPI_SEND_PREFIX || t->nbytes > h->room)
        return kvpi_error(KVP_EINVAL,
                          "pipe %s: send_take: the tensor's data pointer or size (%zu bytes, %zu "
                          "allocated) changed since kvp_pipe_tensor_alloc()",
                          p->ep.local_segment, t->nbytes, h->room);
    char hdr[KVPI_SAFETENSORS_HEADER_CAP];
    size_t hlen;
    kvp_status st = kvpi_safetensors_header(t, hdr, &hlen);
    if (st) return st;
    uint8_t *msg = (uint8_t *)t->data - 8 - hlen;
    outgoing m = {.h = h, .msg = msg, .size = 8 + hlen + t->nbytes, .cuda_device = -1};
    uint64_t deadline = kvpi_now_ms() + (uint64_t)p->opts.send_timeout_ms;
    pthread_mutex_lock(&p->send_lock);
    int as_inline = 0;
    if ((st = begin_send(p, m.size, deadline)) == KVP_OK) {
        /* The header goes right in front of the data: the bytes stay in place. */
        kvpi_put_le64(msg, hlen);
        memcpy(msg + 8, hdr, hlen);
        st = post(p, &m, deadline, &as_inline);
    }
    outgoing_done(p, &m);
    pthread_mutex_unlock(&p->send_lock);
    if (st != KVP_OK) return st;
    if (as_inline) {
        kvp_tensor_free(t); /* the bytes left in a copy */
    } else {
        /* The queue owns the buffer now (or it was acknowledged already and
         * freed): the struct and its reference go. */
        free(h);
        kvpi_pipe_unref(p);
    }
    return KVP_OK;
}

kvp_status kvp_pipe_flush(kvp_pipe *p, int timeout_ms)
{
    if (!p) return kvpi_error(KVP_EINVAL, "pipe flush: NULL pipe");
    uint64_t deadline = kvpi_now_ms() + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms);
    struct timespec ts = kvpi_pipe_mono_deadline(deadline);
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&p->lock);
    while (p->q_count > 0 && !atomic_load(&p->closing) && !atomic_load(&p->broken)) {
        int rc = 0;
        if (timeout_ms < 0)
            pthread_cond_wait(&p->room, &p->lock);
        else
            rc = pthread_cond_timedwait(&p->room, &p->lock, &ts);
        if (rc == ETIMEDOUT && p->q_count > 0) {
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
