/* Internal: the tensor pipe's parts and how they meet.
 *   pipe.c       open and close, the options, the ZeroMQ sockets, stats
 *   pipe_control.c  the control thread (ACKs in, the links' monitors and
 *                redials, the ZAP handler, the deferred ACKs' timer) and the
 *                negotiator thread (the inline path's descriptor reads)
 *   pipe_send.c  send: the FIFO of messages awaiting ACK, flow control, the
 *                choice between an announcement and an inline message
 *   pipe_recv.c  recv: the window of messages taken and READ ahead
 *
 * Sockets and threads. ZeroMQ sockets are not thread-safe, so each has one
 * user at a time:
 *   data_push   (announce)  senders, under send_lock (and push_lock, below)
 *   ack_push    (ACKs out)  receivers, under recv_lock
 *   data_in     (announce)  receivers, under recv_lock
 *   ack_in      (ACKs in)   the control thread
 *   zap         (ZAP)       the control thread
 *   the monitors of data_in and ack_in: the control thread
 *
 * The inline path. Between two kvpipe pipes a message of at most the
 * receiver's inline_max_bytes travels inside the announcement (one frame:
 * KVPI_INLINE_TAG and the safetensors file) instead of being READ. A receiver offers it
 * in its engine's descriptor (KVPI_PIPE_FIELD); Mooncake and MooncakePipe
 * peers neither publish nor read that field, so they only ever see
 * MooncakePipe's wire. A sender may use it only towards the peer whose
 * descriptor it read: data_push's connections are counted (push_gen) by the
 * ZAP handler, which every new connection's handshake waits for before the
 * connection can take a message, and a sender reads push_gen and sends under
 * push_lock, which the handler takes too. So no message is ever sent inline
 * on a connection accepted after the descriptor that allowed it was read;
 * after each new connection the negotiator thread reads the peer's
 * descriptor again, and until it has, messages are announced.
 *
 * Tags. ACKs on MooncakePipe's wire are all alike, so an ACK a receiver owed
 * a sender that died could free a buffer of the process that took its place
 * on the same port, and an announcement the dead sender left queued would be
 * READ from the new process's memory. Between kvpipe pipes each message
 * therefore carries a tag (announce.h): the sender engine's instance id and
 * the message's sequence number. A sender tags only towards a peer whose
 * descriptor field says it reads tags (version >= 2), under the same
 * push_gen rule as the inline path; a receiver answers a tagged message with
 * a tagged ACK, and MooncakePipe's plain ACK otherwise. A tagged ACK is
 * cumulative: it frees every message of that instance up to its number, so a
 * receiver owes one (the newest) however many it has handed out, keeps it
 * until the ACK link takes it (never gives it up), and a lost one is made
 * good by the next. A sender drops a tagged ACK of another instance. A
 * receiver READs a tagged announcement only from the instance that made it:
 * the engine refuses the READ (KVP_ECONNRESET) when the descriptor it would
 * READ through names another (kvp_batch_opts.instance).
 *
 * Integrity. With it on (kvp_pipe_opts.integrity; off by default), a side
 * says so in its field ("digest": "xxh3-64"). Its engine does not digest:
 * the message's digest covers the READ end to end. A sender whose
 * peer's field says so (negotiated as tags are) puts each message's digest
 * in its tag (announce.h, KVPI_TAG_DIGEST_LEN), taken as the message's
 * bytes are copied into their buffer or inline frame (over a message built
 * in place, send_take's, in a pass of its own); the receiver digests what
 * arrived - an inline message as it copies it out, an announced one once
 * its READ completes - and hands out a message whose digest differs as
 * KVP_ECORRUPT, acknowledged like any failed message. So the check covers
 * what the engine's cannot: a sender's buffer rewritten or reused between
 * the copy in and the READ.
 */
#ifndef KVPI_PIPE_INTERNAL_H
#define KVPI_PIPE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "kvpipe/pipe.h"
#include "common/auth.h"
#include "pipe/announce.h"
#include "pipe/pipe_metrics.h"

/* The ZAP domains of the pipe's sockets (pipe.c, make_socket): data_push
 * has one of its own, so that the ZAP handler (pipe_control.c) tells its
 * connections from the others'. */
#define KVPI_PIPE_ZAP_DOMAIN "kvpipe"
#define KVPI_PIPE_ZAP_ANNOUNCE "kvpipe-announce"
/* The monitor events of a failed ZeroMQ handshake. */
#define KVPI_PIPE_HANDSHAKE_FAILED                                                                 \
    (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |                  \
     ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

/* The descriptor field a pipe's engine publishes:
 * {"kvpipe_pipe": {"version": 1, "inline_max_bytes": N}}. */
#define KVPI_PIPE_FIELD "kvpipe_pipe"
/* Version 2: the side reads tags (see "Tags"). Version 3 may add "digest":
 * "xxh3-64": the side checks messages' digests (see "Integrity"). */
#define KVPI_PIPE_FIELD_VERSION 3

/* One message sent and not yet acknowledged; buf is the managed buffer to
 * free on its ACK (NULL for an inline message, which ZeroMQ owns). */
typedef struct kvpi_inflight {
    void *buf;
    size_t len;
    uint64_t seq;
} kvpi_inflight;

/* A PULL socket connected to one of the peer's PUSH ports, with the monitor
 * that shows its connection being closed. The socket belongs to its reader;
 * the rest to the control thread, but for good. */
typedef struct kvpi_pull_link {
    const char *what; /* "announce" or "ACK", for the log */
    void *sock, *mon;
    char endpoint[KVP_PIPE_NAME_MAX + 16];
    uint64_t redial_at; /* kvpi_now_ms() when to connect again; 0: not due */
    int backoff_ms;
    atomic_int good; /* the reader saw a well-formed message: back-off resets */
    int handshaken;  /* authenticated: the CURVE handshake of this connection passed */
    int refused;     /* authenticated: it failed (and was logged) */
} kvpi_pull_link;

/* One message recv took off the data link, in arrival order. */
typedef struct kvpi_rx_entry {
    uint64_t addr, len; /* as announced; an inline message: 0 and its size */
    void *buf;          /* the local managed buffer that holds (or will) the message */
    void *batch;        /* kvp_batch of its READ while one is outstanding */
    kvp_status status;  /* KVP_EINPROGRESS while READ, then the outcome */
    char *why;          /* the error's message (malloc'ed), or NULL */
    int state;          /* pipe_recv.c: waiting for its READ to start, reading, done */
    int is_inline;
    int tagged; /* it came with tag (see "Tags") */
    kvpi_msg_tag tag;
} kvpi_rx_entry;

struct kvp_pipe {
    atomic_int refs;
    atomic_int broken;
    kvp_engine *engine;
    kvp_pipe_endpoints ep;
    kvp_pipe_opts opts;

    void *zctx;
    void *data_push, *ack_push, *zap;
    /* Authenticated mode: the CURVE keys, and monitors of the two PUSH
     * sockets that show refused handshakes (the control thread's). */
    kvpi_auth *auth;
    kvpi_auth_curve curve;
    void *data_push_mon, *ack_push_mon;
    kvpi_pull_link data_in, ack_in;
    int data_in_fd;         /* data_in's ZMQ_FD, for recv's poll(2) */
    int recv_wake_fd;       /* eventfd: wakes a receiver waiting on data_in */
    atomic_int data_redial; /* data_in must be connected again, by whoever has it */
    uint64_t handoff_at;    /* control thread: when to look at data_redial again */
    pthread_t ctl_thread;
    int ctl_started;

    pthread_mutex_t send_lock, recv_lock;
    /* Held across reading push_gen and handing a message to data_push, and by
     * the ZAP handler across counting a new connection (see the top). */
    pthread_mutex_t push_lock;
    uint64_t push_gen; /* data_push connections seen; under push_lock */

    pthread_mutex_t lock; /* guards everything below */
    pthread_cond_t room;
    int room_fd; /* eventfd: room came free (kvpi_pipe_room_freed): kvp_pipe_send_fd */
    int poll_fd; /* epoll of data_in_fd, rx_done_fd, recv_wake_fd: kvp_pipe_recv_fd */
    kvpi_inflight *q;
    size_t q_head, q_count, q_cap;
    size_t inflight_bytes;
    uint64_t seq;       /* of the last message queued */
    atomic_int closing; /* written under lock, read anywhere */
    kvp_pipe_stats stats;

    /* The message a sender is announcing (under send_lock), and whether an ACK
     * took its queue entry meanwhile. */
    uint64_t posting;
    int posting_acked;

    /* Negotiation of the inline path (the negotiator thread). */
    pthread_t neg_thread;
    int neg_started, neg_stop;
    pthread_cond_t neg_cond;
    uint64_t neg_want;      /* the push_gen to negotiate for */
    uint64_t neg_done;      /* the push_gen peer_inline is valid for; 0: none */
    size_t neg_peer_inline; /* the peer's inline_max_bytes (0: it takes none) */
    int neg_peer_tags;      /* the peer reads tags */
    int neg_peer_digest;    /* the peer checks digests (so both sides do) */

    /* recv's window (under recv_lock). */
    kvpi_rx_entry *rx;
    size_t rx_head, rx_count;
    size_t rx_bytes;
    size_t rx_bytes_peak; /* the most rx_bytes held since open (tests read it) */
    int rx_done_fd;       /* eventfd: a READ of the window completed */
    int ack_stalled;      /* the last ACKs were given up: give up the next at once */
    int ack_link_up;      /* the ACK link took an ACK since open */
    int integrity;        /* opts.integrity resolved */
    int ack_tagged;       /* ack_tag is owed (it covers every ACK owed before it) */
    kvpi_msg_tag ack_tag;
    /* Deferred ACKs (pipe_recv.c): inline messages handed out and not yet
     * acknowledged, written under recv_lock; when the oldest must leave. */
    atomic_size_t acks_owed;
    uint64_t acks_due_ns;
    int ack_timer_fd; /* timerfd: owed ACKs are due, for the control thread */
    int peer_open;
    kvp_segment_id peer_seg;

    kvpi_pipe_counters counters; /* what kvp_pipe_stats does not count */
};

/* pipe.c */
kvp_status kvpi_pipe_zmq_fail(kvp_pipe *p, const char *what);
int kvpi_pipe_remaining_ms(uint64_t deadline);
struct timespec kvpi_pipe_mono_deadline(uint64_t deadline_ms);
int kvpi_pipe_zsend(void *s, const void *buf, size_t len, int flags, int timeout_ms);
void kvpi_pipe_unref(kvp_pipe *p);

/* pipe_control.c */
void kvpi_pipe_link_reconnect(kvp_pipe *p, kvpi_pull_link *l);
/* A message from a stranger or a broken peer on the data link: counted and
 * logged (rate-limited). frames and the sizes of the first two. */
void kvpi_pipe_drop_message(kvp_pipe *p, int frames, size_t size0, size_t size1);
/* Ask the negotiator to read the peer's descriptor for data_push connection
 * generation gen. */
void kvpi_pipe_negotiate(kvp_pipe *p, uint64_t gen);

/* pipe_send.c: the FIFO of messages awaiting ACK (all under lock). */
/* One ACK arrived: a plain one (tag NULL) frees the oldest message's
 * buffer, a tagged one those it covers ("Tags"). The control thread. */
void kvpi_pipe_take_ack(kvp_pipe *p, const kvpi_msg_tag *tag);
/* Free every message still queued (close, after the control thread stopped). */
void kvpi_pipe_drop_queue(kvp_pipe *p);

/* pipe_recv.c */
/* Drop the window (close): waits for READs still running. */
void kvpi_pipe_drop_window(kvp_pipe *p);
/* Close: send the ACKs owed, waiting up to ack_timeout_ms for the link to
 * take them (not when it is stalled); caller holds recv_lock. */
void kvpi_pipe_close_acks(kvp_pipe *p);
/* The control thread, when ack_timer_fd fires: send what ACKs are owed
 * without waiting (pipe_recv.c says which are given up and when), unless a
 * receiver holds recv_lock. Returns 0 when none is owed any more, else the
 * microseconds after which to try again. */
long kvpi_pipe_acks_due(kvp_pipe *p);

/* pipe_control.c: the two threads kvp_pipe_open starts (arg: the pipe). */
void *kvpi_pipe_control_main(void *arg);
void *kvpi_pipe_negotiator_main(void *arg);

/* The heap tensor behind a received or kvp_pipe_tensor_alloc() tensor. */
typedef struct kvpi_held {
    kvp_tensor t; /* must stay the first member: kvp_tensor_free() frees the struct */
    kvp_pipe *pipe;
    void *buf;
    int sendable; /* from kvp_pipe_tensor_alloc(): data at buf + KVPI_SEND_PREFIX */
    size_t room;  /* sendable: data bytes the buffer holds */
} kvpi_held;

/* Room in front of the data of a kvp_pipe_tensor_alloc() tensor for the
 * message header (8 + the longest header), rounded up to 256 so that the data
 * keeps the buffer pool's 256-byte alignment. */
#define KVPI_SEND_PREFIX 1280

/* Make h->t a heap tensor that owns buf (a managed buffer) and holds a
 * reference to p. */
kvp_tensor *kvpi_pipe_hold(kvp_pipe *p, kvpi_held *h, void *buf);
/* h when t is a sendable tensor of pipe p, else NULL. */
kvpi_held *kvpi_pipe_sendable(kvp_pipe *p, kvp_tensor *t);

/* Under p->lock: room came free for senders (an ACK, a message taken back,
 * the pipe closing or broken): wake the waiting ones and poll_fd. */
void kvpi_pipe_room_freed(kvp_pipe *p);

/* Read an eventfd down to zero (it is non-blocking). */
void kvpi_pipe_drain_fd(int fd);

#endif
