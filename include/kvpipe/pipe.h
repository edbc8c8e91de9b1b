/* kvpipe tensor pipe: vLLM's MooncakePipe, in C, with one copy.
 *
 * A pipe connects a prefill instance (kv_rank 0) and a decode instance
 * (kv_rank 1). Both sides can send and receive; each direction is FIFO. The
 * wire is MooncakePipe's, so a kvpipe pipe talks to a Python process running
 * vLLM's MooncakePipe over a Mooncake-compatible engine:
 *
 *   send: serialise the tensor as a safetensors file holding one tensor named
 *         "tensor" straight into a managed (registered) buffer of the transfer
 *         engine — the one copy — and announce it on ZeroMQ as two frames,
 *         u64 big-endian address and u64 big-endian length. A tensor built
 *         in such a buffer (kvp_pipe_tensor_alloc) is sent with no copy.
 *   recv: READ the announced range from the peer's segment into a local
 *         managed buffer, reply with the 3-byte frame "ACK" (the sender then
 *         frees its buffer), and hand out a tensor whose data lives in that
 *         buffer — no copy out.
 *   None: sent as the int64 tensor [KVP_PIPE_NONE_VALUE].
 *
 * Ports (from the mooncake config; "base" is the port in prefill_url or
 * decode_url, with decode's base +100 when both URLs are equal):
 *   engine (handshake) port and segment name:  own_host:(base + local_rank)
 *   ZeroMQ PUSH, bound on own host:           base + 8 + 2*local_rank + 1 (data)
 *                                             base + 8 + 2*local_rank + 2 (ACK)
 *   ZeroMQ PULL, connected to the peer's same two ports.
 *
 * Threads: every function is thread-safe except kvp_pipe_close(), which must be
 * the last call. Sends are serialised with each other and receives with each
 * other, so a send and a recv run in parallel: the usual shape is one thread
 * that sends and one that receives. A process that alternates sends and
 * receives on one thread must not let its sends wait for ACKs that its peer
 * only sends after this process receives (keep within kv_buffer_size, or use
 * two threads). An internal thread takes announcements and ACKs off the two
 * ZeroMQ links, drops malformed ones (logged, rate-limited), frees send buffers
 * on ACKs and reconnects a link that ZeroMQ closed for a protocol error.
 */
#ifndef KVPIPE_PIPE_H
#define KVPIPE_PIPE_H

#include <stddef.h>

#include "kvpipe/export.h"
#include "kvpipe/engine.h"
#include "kvpipe/status.h"
#include "kvpipe/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* vLLM's MooncakePipe sends None as the int64 tensor [KVP_PIPE_NONE_VALUE];
 * kvp_pipe_recv() returns NULL for it. */
#define KVP_PIPE_NONE_VALUE (-150886311LL)

/* ---------------------------------------------------------------- config --- */

/* The mooncake JSON config (vLLM's MOONCAKE_CONFIG_PATH file):
 *   {"prefill_url": "host:port", "decode_url": "host:port",
 *    "metadata_server": "...", "metadata_backend": "etcd"|"redis" (optional),
 *    "protocol": "tcp" (default), "device_name": "" (default),
 *    "auth_key_file": "/path" (kvpipe's own, optional: docs/security.md)}
 * Unknown fields are ignored, as vLLM does. All strings are malloc'ed and owned
 * by the config; free it with kvp_pipe_config_free(). A program may also fill
 * the struct itself (with its own strings, not freed by kvp_pipe_config_free
 * then); kvp_pipe_open() checks it again. */
typedef struct kvp_pipe_config {
    char *prefill_url;      /* "host:port", port 1..65535 */
    char *decode_url;       /* "host:port" */
    char *metadata_server;  /* non-empty */
    char *metadata_backend; /* NULL, "etcd" or "redis" (lower-cased on load) */
    char *protocol;         /* "tcp", "shm", or "rdma"/"ucx" where built with UCX */
    char *device_name;      /* network devices for rdma, comma-separated; may be "" */
    /* The authenticated mode's key file (kvp_engine_opts.auth_key_file), for
     * the engine and the ZeroMQ links alike; NULL: env KVPIPE_AUTH_KEY_FILE
     * (unset: off); "": off. */
    char *auth_key_file;
} kvp_pipe_config;

/* Parse config JSON text of len bytes. KVP_ECONFIG with a message naming the
 * field and the problem (missing, wrong type, bad host:port, bad backend). */
KVP_API kvp_status kvp_pipe_config_parse(const char *json, size_t len, kvp_pipe_config **out);

/* Read and parse the file at path (at most 1 MiB). KVP_ECONFIG names the path. */
KVP_API kvp_status kvp_pipe_config_load(const char *path, kvp_pipe_config **out);

/* Load the file named by env MOONCAKE_CONFIG_PATH; KVP_ECONFIG when unset. */
KVP_API kvp_status kvp_pipe_config_load_env(kvp_pipe_config **out);

/* Check every field as parsing does. */
KVP_API kvp_status kvp_pipe_config_check(const kvp_pipe_config *cfg);

/* Free a config from parse/load. NULL is a no-op. */
KVP_API void kvp_pipe_config_free(kvp_pipe_config *cfg);

/* The engine's metadata connection string, as Mooncake builds it (malloc'ed,
 * the caller frees):
 *   metadata_server "P2PHANDSHAKE"              -> "P2PHANDSHAKE"
 *   metadata_server with "://" (any backend)    -> as given
 *   metadata_backend "etcd"|"redis", bare h:p    -> "<backend>://h:p"
 *   no backend, bare h:p                         -> "etcd://h:p" */
KVP_API kvp_status kvp_pipe_config_metadata_conn(const kvp_pipe_config *cfg, char **out);

#define KVP_PIPE_NAME_MAX 272

/* Where one side of a pipe listens and what it connects to. */
typedef struct kvp_pipe_endpoints {
    char local_segment[KVP_PIPE_NAME_MAX]; /* "host:port" of the own engine */
    char peer_segment[KVP_PIPE_NAME_MAX];  /* the peer engine's segment name */
    char local_host[KVP_PIPE_NAME_MAX];    /* own host, without brackets */
    char peer_host[KVP_PIPE_NAME_MAX];
    int engine_port; /* base + local_rank */
    int peer_engine_port;
    int data_port;      /* own PUSH for announcements */
    int ack_port;       /* own PUSH for ACKs */
    int peer_data_port; /* the peer's, our PULLs connect there */
    int peer_ack_port;
} kvp_pipe_endpoints;

/* Compute the ports of side kv_rank (0 prefill, 1 decode) for local_rank >= 0.
 * KVP_EINVAL for a bad rank; KVP_ECONFIG, naming the field, when a derived port
 * passes 65535. */
KVP_API kvp_status kvp_pipe_config_endpoints_size(const kvp_pipe_config *cfg, int local_rank,
                                                  int kv_rank, kvp_pipe_endpoints *out,
                                                  size_t size);
static inline kvp_status kvp_pipe_config_endpoints(const kvp_pipe_config *cfg, int local_rank,
                                                   int kv_rank, kvp_pipe_endpoints *out)
{
    return kvp_pipe_config_endpoints_size(cfg, local_rank, kv_rank, out, sizeof *out);
}

/* ------------------------------------------------------------------ pipe --- */

typedef struct kvp_pipe kvp_pipe;

typedef struct kvp_pipe_opts {
    /* Bytes of sent messages not yet acknowledged before send waits (default
     * 1e9, as vLLM). A message larger than this is sent once nothing else is in
     * flight. */
    size_t kv_buffer_size;
    /* Longest a send waits for room under kv_buffer_size and for the peer to
     * take the announcement (default 30000 ms). */
    int send_timeout_ms;
    /* The engine's per-round-trip I/O timeout, which bounds each READ
     * (default 5000 ms); also how long a connection to the pipe's ZeroMQ
     * ports may take to finish its handshake before it is closed. */
    int io_timeout_ms;
    /* Largest announced message recv accepts (default 32 GiB); longer ones are
     * refused before any memory is allocated. */
    size_t max_message_bytes;
    /* Non-zero: the engine never uses the same-host transport (see engine.h). */
    int disable_shm;

    /* The inline path, kvpipe's fast path between two kvpipe pipes: a message
     * (the encoded safetensors file: 8 + header + data bytes) of at most this
     * many bytes travels inside its announcement on ZeroMQ instead of being
     * READ, when the peer offers it too. This side offers it in its engine's
     * descriptor (field "kvpipe_pipe"), which Mooncake and MooncakePipe peers
     * ignore; they get MooncakePipe's wire whatever this says. Also the
     * largest inline message this side accepts. Default 131072; 0: never,
     * and not offered. kvp_pipe_stats says which path a pair uses. */
    size_t inline_max_bytes;
    /* Announcements recv takes off the link and READs ahead, concurrently,
     * while handing them out in order (default 32; 1: one at a time), and
     * the bytes they may hold at once (default 64 MiB; a larger message is
     * still taken alone). Held in the receiver's engine memory. */
    int recv_window;
    size_t recv_window_bytes;
    /* Largest ZeroMQ frame a link accepts (ZMQ_MAXMSGSIZE; default 4096): a
     * peer that sends a larger one has its connection dropped before it is
     * read. The announce link accepts inline messages up to inline_max_bytes
     * besides. */
    size_t max_control_frame;
    /* A link ZeroMQ closed after a protocol error is connected again after
     * redial_min_ms (default 200), doubling for each further such close up
     * to redial_max_ms (default 5000). The same back-off spaces retries of
     * a failed descriptor lookup of the inline path's negotiation. */
    int redial_min_ms;
    int redial_max_ms;
    /* How long an ACK the ACK socket does not take (a sender stopped or
     * gone) is tried again before it is dropped with a warning (default
     * 2000 ms); the data has arrived. recv never waits for it: a receiver in
     * recv or the pipe's control thread retries it every millisecond. */
    int ack_timeout_ms;
    /* Inline messages only (between two kvpipe pipes; an announced
     * message's ACK always leaves before recv returns): the ACK of one
     * handed out by recv leaves with up to 15 others, or at the latest about
     * this many microseconds after the first of them (default 1000,
     * 0..60000000; 0: each at once), so that a peer answering each message
     * does not pay an ACK on every round trip. A sender whose kv_buffer_size
     * holds only a few inline messages gets room back up to that much later. */
    int ack_delay_us;
    /* Longest kvp_pipe_close() waits for queued ACKs to leave (default 500). */
    int ack_linger_ms;
    /* Messages ZeroMQ queues per connection and direction (ZMQ_SNDHWM and
     * ZMQ_RCVHWM of the announcement and ACK sockets; default 1000, ZeroMQ's). */
    int zmq_hwm;
    /* recv polls for the next message this long (microseconds) before it
     * sleeps in the kernel (default 0: no polling). Saves a wake-up per
     * message when the peer answers within it; costs a core meanwhile. */
    int busy_poll_us;
    /* The metrics endpoint of the pipe's engine, serving the pipe's metrics
     * too (kvp_pipe_metrics() lists them): as kvp_engine_opts.metrics_port
     * and metrics_host (0 and NULL, the defaults: env KVPIPE_METRICS_PORT and
     * KVPIPE_METRICS_HOST; unset: no endpoint). */
    int metrics_port;
    const char *metrics_host;
    /* End-to-end integrity (docs/pipe.md, "Integrity"): with it on at both
     * sides (kvpipe pipes only), each message's digest (XXH3-64, taken as
     * its bytes are copied in) travels in its tag and recv checks what
     * arrived against it; a message whose bytes differ is handed out as an
     * error, KVP_ECORRUPT. A MooncakePipe peer, or a pipe with it off, goes
     * unchecked. KVP_INTEGRITY_ENV (the default): as env KVPIPE_INTEGRITY
     * says ("1": on; unset, "" or "0": off); 0: off; 1: on. */
    int integrity;
} kvp_pipe_opts;

/* Fill opts with the defaults above. The struct grows at its end
 * (docs/abi.md): the inline wrappers pass its size. */
KVP_API void kvp_pipe_opts_init_size(kvp_pipe_opts *opts, size_t size);
static inline void kvp_pipe_opts_init(kvp_pipe_opts *opts)
{
    kvp_pipe_opts_init_size(opts, sizeof *opts);
}

/* Open side kv_rank of the pipe: create the engine (segment "host:port" from
 * the config), bind the two PUSH sockets and connect the two PULL sockets. Does
 * not wait for the peer: the first send waits (up to send_timeout_ms) until
 * the peer is connected. In the authenticated mode (cfg->auth_key_file or env
 * KVPIPE_AUTH_KEY_FILE) the four ZeroMQ sockets use CURVE with keys derived
 * from the key, so only a peer with the same key connects (a MooncakePipe peer
 * cannot: refused handshakes are logged, rate-limited, on both sides). opts NULL: defaults. Errors:
 * KVP_ECONFIG for the config, the engine's errors (metadata store unreachable, port in use),
 * KVP_EIO naming the ZeroMQ endpoint that failed to bind. */
KVP_API kvp_status kvp_pipe_open_size(const kvp_pipe_config *cfg, int local_rank, int kv_rank,
                                      const kvp_pipe_opts *opts, size_t size, kvp_pipe **out);
static inline kvp_status kvp_pipe_open(const kvp_pipe_config *cfg, int local_rank, int kv_rank,
                                       const kvp_pipe_opts *opts, kvp_pipe **out)
{
    return kvp_pipe_open_size(cfg, local_rank, kv_rank, opts, sizeof *opts, out);
}

/* Send tensor t, or None when t is NULL. The tensor's bytes are copied (once)
 * before send returns, so the caller may reuse t at once. t->data may be GPU
 * memory (CUDA device or managed memory, e.g. from kvp_tensor_to_cuda() or a
 * framework's tensor on "cuda:N"): the CUDA driver then copies it
 * device-to-host into the message, on the legacy default stream (work a
 * DLPack producer synchronised to it is done first; docs/gpu.md). Blocks while in-flight
 * bytes would pass kv_buffer_size (waiting for ACKs) and while the peer is not
 * connected, at most send_timeout_ms in all; then KVP_ETIMEDOUT naming the
 * peer. KVP_ENOMEM when the engine cannot allocate the buffer; KVP_EINVAL for
 * data that is neither memory the CPU reads nor GPU memory; KVP_EIO when the
 * device-to-host copy fails. On any error nothing was sent and the pipe can
 * go on. */
KVP_API kvp_status kvp_pipe_send(kvp_pipe *pipe, const kvp_tensor *t);

/* ------------------------------------------------ sending without a copy --- */

/* kvp_pipe_send() copies the tensor once into registered memory. A producer
 * that can write its tensor straight into registered memory saves that copy:
 *
 *   kvp_tensor *t;
 *   kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_BF16, 3, shape, &t);
 *   fill(t->data);                   // e.g. the device-to-host copy of the KV
 *   kvp_pipe_send_take(pipe, t);     // announced in place; t is the pipe's now
 *
 * The wire is unchanged (the message is a safetensors file; its header is
 * written into room kept in front of the data), so the peer may be any
 * MooncakePipe. */

/* A heap tensor of the given dtype and shape whose data lies in a managed
 * buffer of the pipe's engine, with room in front for the message header.
 * The data is 256-byte aligned and its contents are unspecified (recycled
 * memory is not cleared). Hand it to kvp_pipe_send_take(), or release it with
 * kvp_tensor_free(), also after kvp_pipe_close(). Errors: KVP_EINVAL for a bad
 * dtype or shape, KVP_ENOMEM, KVP_ECLOSED for an unusable pipe. */
KVP_API kvp_status kvp_pipe_tensor_alloc(kvp_pipe *pipe, kvp_dtype dtype, int ndim,
                                         const int64_t *shape, kvp_tensor **out);

/* Send t, a tensor from kvp_pipe_tensor_alloc() of this pipe, without copying
 * its bytes. Its dtype and shape may have been changed since the allocation as
 * long as the bytes still fit (and data was not moved). On KVP_OK the pipe owns
 * t: do not touch t or its data again; the buffer is freed when the peer
 * acknowledges. On an error nothing was sent and t is still the caller's, data
 * intact, to retry or free. Waits and errors as kvp_pipe_send(), plus KVP_EINVAL
 * for a tensor that did not come from kvp_pipe_tensor_alloc() of this pipe. */
KVP_API kvp_status kvp_pipe_send_take(kvp_pipe *pipe, kvp_tensor *t);

/* Receive the next tensor. *out is a heap tensor to release with
 * kvp_tensor_free(), or NULL for None. Its data lives in a managed buffer of the
 * pipe's engine (no copy): the buffer is returned to the engine when the tensor
 * is freed, which may happen from any thread and also after kvp_pipe_close()
 * (the engine then lives on until the last received tensor is freed).
 *
 * timeout_ms bounds the wait for an announcement (negative: no limit, 0: poll);
 * the READ that follows is bounded by the engine's I/O timeout.
 *
 * Every announcement (two 8-byte frames) taken from the peer is answered with
 * one "ACK" — a refused one too, once recv is done with it — so the sender's
 * FIFO of buffers stays in step. A message that is not an announcement is
 * dropped unanswered, counted in bad_messages and logged (rate-limited), and
 * recv goes on waiting. Errors:
 *   KVP_ETIMEDOUT   nothing was announced in time, or the next message's READ
 *                   still runs at the deadline; nothing consumed (the next
 *                   recv hands that message out). A message whose own READ
 *                   timed out in the engine is consumed and reported with the
 *                   engine's KVP_ETIMEDOUT ("not done within ...").
 *   KVP_EPROTO      an announced length of 0 or above max_message_bytes, or
 *                   malformed safetensors.
 *   KVP_ERANGE      the announced range lies outside the peer's registered
 *                   memory (the peer's server refused it).
 *   others          the engine's errors from opening the peer segment or the
 *                   READ (KVP_ECONNREFUSED, KVP_ECONNRESET, KVP_ENOMEM ...).
 * After any of these the bad message has been consumed and dropped, and the
 * pipe can go on: call recv again. Only when kvp_pipe_usable() says 0 is the
 * pipe finished. */
KVP_API kvp_status kvp_pipe_recv(kvp_pipe *pipe, int timeout_ms, kvp_tensor **out);

/* kvp_pipe_send() with its own bound on the wait for room under
 * kv_buffer_size and for the peer to take the announcement (timeout_ms; 0:
 * no wait at all, negative: no limit) in place of send_timeout_ms. With 0,
 * KVP_ETIMEDOUT means nothing was sent and the send would have had to wait:
 * try again once kvp_pipe_send_fd() is readable (or a little later, when the
 * peer is not connected yet). */
KVP_API kvp_status kvp_pipe_send_timeout(kvp_pipe *pipe, const kvp_tensor *t, int timeout_ms);

/* Descriptors for an event loop (poll, epoll, asyncio's add_reader), one per
 * direction, so that a side that only sends (or only receives) waits on
 * nothing of the other's. The pipe owns them (do not read or close them);
 * valid until kvp_pipe_close(); -1 for NULL. Thread-safe.
 *
 * kvp_pipe_recv_fd: readable when a message arrived or a READ of one ended,
 * so that kvp_pipe_recv(pipe, 0, ...) may hand one out. Edge-like: once it
 * is readable, call kvp_pipe_recv(pipe, 0, ...) until it answers
 * KVP_ETIMEDOUT, then wait on it again.
 *
 * kvp_pipe_send_fd: readable when room came free for a send (an ACK freed a
 * buffer under kv_buffer_size): retry kvp_pipe_send_timeout(pipe, t, 0). A
 * send that waits for the peer to connect or to take an announcement is not
 * told by it: retry such a send on a timer. */
KVP_API int kvp_pipe_recv_fd(kvp_pipe *pipe);
KVP_API int kvp_pipe_send_fd(kvp_pipe *pipe);

/* Wait until every sent message has been acknowledged, at most timeout_ms
 * (negative: no limit). A sender should flush before closing, because closing
 * frees the buffers the peer may still be reading. KVP_ETIMEDOUT otherwise. */
KVP_API kvp_status kvp_pipe_flush(kvp_pipe *pipe, int timeout_ms);

/* Non-zero while the pipe works. 0 after an internal ZeroMQ failure, after
 * which every call fails with KVP_ECLOSED. */
KVP_API int kvp_pipe_usable(const kvp_pipe *pipe);

/* Counters, for tools and tests. */
typedef struct kvp_pipe_stats {
    uint64_t sent, received;             /* messages (None included) */
    uint64_t bytes_sent, bytes_received; /* encoded message bytes */
    uint64_t acks;                       /* messages acknowledged (by plain or tagged ACKs) */
    uint64_t bad_messages;               /* announcements dropped (malformed) or refused */
    uint64_t bad_acks; /* ACKs dropped: not the frame "ACK", unexpected, or another instance's */
    size_t inflight_bytes; /* sent, not yet acknowledged */
    size_t inflight_count;
    /* Of sent and received, the messages that travelled inline. */
    uint64_t inline_sent, inline_received;
    /* The peer's inline_max_bytes as its descriptor says, for the current
     * connection: sends of up to min(this, own inline_max_bytes) go inline.
     * 0: the peer takes none (a Mooncake or MooncakePipe peer, a kvpipe peer
     * with the inline path off) or it was not read yet. */
    size_t peer_inline_max;
    /* Times the peer's descriptor was read for what it takes (the inline
     * path, tags: docs/pipe.md), once per new connection of the peer to this
     * side's announce socket. */
    uint64_t peer_lookups;
} kvp_pipe_stats;
/* The struct grows at its end (docs/abi.md): the wrapper passes its size. */
KVP_API void kvp_pipe_get_stats_size(kvp_pipe *pipe, kvp_pipe_stats *out, size_t size);
static inline void kvp_pipe_get_stats(kvp_pipe *pipe, kvp_pipe_stats *out)
{
    kvp_pipe_get_stats_size(pipe, out, sizeof *out);
}

/* The ports this side uses. Valid until the pipe is closed. */
KVP_API const kvp_pipe_endpoints *kvp_pipe_get_endpoints(const kvp_pipe *pipe);

/* The pipe's engine, for inspection (segment name, transport to the peer).
 * Owned by the pipe; do not destroy it. */
KVP_API kvp_engine *kvp_pipe_engine(kvp_pipe *pipe);

/* Close the sockets at once (linger 0), stop the ACK thread, free the buffers
 * still awaiting ACKs, and release the engine once no received tensor uses it.
 * Never waits for the peer. NULL is a no-op. */
KVP_API void kvp_pipe_close(kvp_pipe *pipe);

#ifdef __cplusplus
}
#endif
#endif
