/* The tests' child-process peer: one harness for every test that needs the
 * other side of a transfer in another process.
 *
 * The core is a child with a command channel: the test sends fixed-size
 * commands (kvpt_cmd) and waits a bounded time for each answer, so that a
 * child that is stuck (often the bug under test) fails a check instead of
 * hanging the case; a child that missed an answer is marked stuck and later
 * commands fail at once. The child's stderr may go to a file of its own, so
 * that a test can look for what it said (kvpt_peer_said) and show it when the
 * case fails (kvpt_peer_show). The child dies with the case.
 *
 * Three kinds are built on it:
 *  - the engine target (kvpt_target): an engine in a fresh exec of the test
 *    program, serving a buffer the test shares, with the limits the test sets,
 *    obeying commands (register, unregister, fill, check, unmap, count
 *    descriptors, ...);
 *  - a pipe side (kvpt_pipe_*): one side of a MooncakePipe running a test's
 *    function, on the rows every pipe suite runs on (tcp, shm, ucx);
 *  - a raw MooncakePipe-wire peer (kvpt_raw_*): bare libzmq sockets and a real
 *    engine on a side's ports, speaking the wire by hand. */
#ifndef KVPT_PEER_H
#define KVPT_PEER_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "kvpipe/kvpipe.h"
#include "kvpipe/pipe.h"
#include "pipe/announce.h"

/* ================================================================ core === */

typedef struct kvpt_peer {
    pid_t pid;
    int cmd, resp; /* our ends of the command and answer pipes */
    int stuck;     /* an answer did not come in time */
    char err[64];  /* the file that holds the child's stderr; "": ours */
} kvpt_peer;

/* A command: an operation and up to three arguments; the answer is one
 * int64_t (-1 for a failure, by convention). */
typedef struct kvpt_cmd {
    int64_t op;
    uint64_t a, b, c;
} kvpt_cmd;

/* A peer's body: serves commands read from cmd (kvpt_peer_next), answers on
 * resp (kvpt_peer_answer). The child exits 1 when a check failed in it,
 * else 0, once body returns. */
typedef void (*kvpt_peer_body)(void *arg, int cmd, int resp);

/* Fork a peer running body(arg, ...). capture: a word naming its stderr's
 * file (NULL: it writes to ours). 0, or -1 when it could not start. */
int kvpt_peer_fork(kvpt_peer *p, const char *capture, kvpt_peer_body body, void *arg);

/* The same in a fresh exec of this program (for children of a process that
 * may run threads: an engine in a bare fork of one may find a lock held
 * forever, and ThreadSanitizer refuses it): kind names a function registered
 * with KVPT_PEER_KIND, and env holds the NAME=VALUE strings it reads (NULL
 * ends them). keep: descriptors the child keeps (-1 ends them, at most 4). */
int kvpt_peer_exec(kvpt_peer *p, const char *capture, const char *kind, char *const env[],
                   const int keep[]);
typedef void (*kvpt_peer_main)(int cmd, int resp);
void kvpt_peer_register(const char *kind, kvpt_peer_main fn);
/* Registers fn as kind before main runs (and in the exec'd child, runs it). */
#define KVPT_PEER_KIND(kind, fn)                                                                   \
    __attribute__((constructor)) static void kvpt_peer_kind_##fn(void)                             \
    {                                                                                              \
        kvpt_peer_register(kind, fn);                                                              \
    }

/* Child side: the next command (0), or -1 once the test closed the channel. */
int kvpt_peer_next(int cmd, kvpt_cmd *c);
/* Child side: answer the command; 0 or -1. */
int kvpt_peer_answer(int resp, int64_t value);

/* Send a command and wait up to timeout_ms for its answer; -1 if none came
 * (the peer is then stuck) or the peer answered -1. */
int64_t kvpt_peer_call(kvpt_peer *p, int op, uint64_t a, uint64_t b, uint64_t c, int timeout_ms);
/* Raw bytes both ways, bounded on the reading side: 0 or -1. */
int kvpt_peer_send(kvpt_peer *p, const void *buf, size_t len);
int kvpt_peer_recv(kvpt_peer *p, void *buf, size_t len, int timeout_ms);
/* Read exactly len bytes from fd within timeout_ms (-1: no bound); 0 or -1. */
int kvpt_read_full(int fd, void *buf, size_t len, int timeout_ms);

/* Close the command channel and wait up to timeout_ms for the child (killed
 * past it); its exit status (kvpt_wait_child). */
int kvpt_peer_wait(kvpt_peer *p, int timeout_ms);
/* SIGKILL the child and reap it. */
void kvpt_peer_kill(kvpt_peer *p);

/* Lines of its captured stderr that hold text ("": every line), -1 with
 * none captured; kvpt_peer_show prints the first 40 lines marked who. */
int kvpt_peer_said(const kvpt_peer *p, const char *text);
void kvpt_peer_show(const kvpt_peer *p, const char *who);
/* Print its captured stderr and delete the file. */
void kvpt_peer_forget(kvpt_peer *p);

/* A one-way byte pipe between the processes of a case: a script's steps. */
typedef struct kvpt_chan {
    int fd[2];
} kvpt_chan;
int kvpt_chan_init(kvpt_chan *c);
void kvpt_step(kvpt_chan *c, char step);
/* The next step within timeout_ms, or 0. */
char kvpt_wait_step(kvpt_chan *c, int timeout_ms);

/* ======================================================= engine target === */

typedef struct kvpt_target_opts {
    const char *metadata; /* connection string; NULL: P2PHANDSHAKE */
    const char *protocol; /* NULL: tcp */
    int port;             /* the segment's (handshake) port; 0: a free one */
    int disable_shm;
    size_t len;    /* buffer bytes, registered at start */
    uint64_t seed; /* kvpt_fill pattern of the buffer */
    /* kvp_engine_opts fields; 0 keeps the default */
    int timeout_ms;
    int idle_timeout_ms;
    int max_connections;
    uint64_t min_transfer_rate;
    size_t pool_retain_bytes;
    int nofile; /* RLIMIT_NOFILE soft limit of the child; 0: unchanged */
    /* The child's stderr to a file of its own (kvpt_peer_said on t.peer). */
    int capture;
    /* kvp_engine_opts.auth_key_file: NULL, the environment's; "": off. */
    const char *auth_key_file;
} kvpt_target_opts;

typedef struct kvpt_target {
    kvpt_peer peer;
    pid_t pid;     /* the child's, as peer.pid */
    char name[64]; /* segment name, "127.0.0.1:port" (the handshake port) */
    int rpc_port;
    int data_port;
    void *buf; /* MAP_SHARED with the child at the same address; registered there */
    size_t len;
    char said[512]; /* a captured child that did not start: the start of what it said */
} kvpt_target;

/* Start the child and wait (bounded) until it serves. 0 on success. */
int kvpt_target_start(const kvpt_target_opts *opts, kvpt_target *out);

enum kvpt_target_op {
    KVPT_T_REGISTER = 'r',   /* register a fresh bytes of malloc'ed memory: ms taken */
    KVPT_T_NEW = 'n',        /* register a fresh bytes of mmap'ed memory filled with
                                kvpt_fill(seed b), at c bytes past a page: its address */
    KVPT_T_ALLOC = 'a',      /* kvp_engine_alloc of a bytes: ms taken */
    KVPT_T_POOL = 'p',       /* kvp_engine_alloc of a bytes filled with kvpt_fill(seed a):
                                their address */
    KVPT_T_POOL_FREE = 'F',  /* kvp_engine_free of the last KVPT_T_POOL buffer: ms taken */
    KVPT_T_UNREGISTER = 'u', /* unregister the buffer (a = 0) or the region at a: ms taken */
    KVPT_T_REREGISTER = 'R', /* unregister the buffer, fill it with kvpt_fill(seed a) and
                                register it again (the same range): 0 */
    KVPT_T_UNMAP = 'm',      /* munmap the buffer (still registered): 0 */
    KVPT_T_FDS = 'f',        /* open descriptors of the child */
    KVPT_T_CHECK = 'c',      /* kvpt_verify of [a, a + b) against seed c: index of the
                                first wrong byte, or -2 when all match (read through
                                the CUDA double in the KVPT_T_DEVICE memory) */
    KVPT_T_DEVICE = 'd',     /* device memory of the CUDA double at $KVPIPE_LIBCUDA:
                                a bytes filled with kvpt_fill(seed b), registered: its
                                address (one such region per child) */
};

/* Run a command with argument a; returns its value, or -1 if it failed or
 * no answer came within timeout_ms (the child is then stuck). */
int64_t kvpt_target_cmd(kvpt_target *t, int op, uint64_t a, int timeout_ms);

/* The shm socket the target's descriptor names, asked for by a handshake
 * (authenticated with a unless NULL), into name; 0 or -1. */
struct kvpi_auth;
int kvpt_target_shm_socket(const kvpt_target *t, const struct kvpi_auth *a, char *name, size_t len);

/* CPU time (user + system) the child used so far, in ms; -1 on error. */
int64_t kvpt_target_cpu_ms(const kvpt_target *t);

/* Stop the child cleanly (engine destroyed, segment unpublished; bounded,
 * killed past it) and unmap the buffer unless keep_buffer; returns its exit
 * status (-1: it had to be killed). */
int kvpt_target_stop(kvpt_target *t, int keep_buffer);

/* SIGKILL it (no cleanup: the metadata store keeps its stale descriptor);
 * the buffer stays mapped. */
void kvpt_target_kill(kvpt_target *t);

/* An initiator engine in this process with a free port: metadata (NULL:
 * P2PHANDSHAKE), protocol (NULL: tcp), disable_shm and timeout_ms (0: the
 * default). 0 on success. */
int kvpt_initiator_start(const char *metadata, const char *protocol, int disable_shm,
                         int timeout_ms, kvp_engine **out);

/* Options with a fresh local_server_name ("127.0.0.1:<free port>", in name)
 * and P2PHANDSHAKE metadata, for a test that sets more of them; and an
 * engine created from them, its failure printed. */
void kvpt_engine_opts(kvp_engine_opts *o, char name[64]);
kvp_engine *kvpt_engine_create(const kvp_engine_opts *o);

/* ---- the authenticated mode (docs/security.md) ---- */

/* Two key files of a case (kvpt_keys_make; kvpt_keys_drop removes them), and
 * a key file holding text with mode, under /tmp (its name in path). */
extern char kvpt_key1[64], kvpt_key2[64];
void kvpt_keys_make(void);
void kvpt_keys_drop(void);
void kvpt_key_file(char *path, size_t len, const char *text, unsigned mode);

/* The key file at path loaded (its failure printed), NULL on failure. */
struct kvpi_auth;
struct kvpi_auth *kvpt_auth_load(const char *path);

/* An initiator engine with key ("": none), metadata, disable_shm and
 * auth_max_age_ms (0: the default); its failure printed. */
kvp_engine *kvpt_auth_initiator(const char *metadata, const char *key, int disable_shm,
                                int max_age_ms);

/* A target with key (NULL: none, whatever the environment says) and its
 * stderr captured (t->peer.err, for its log lines): kvpt_target_start. */
int kvpt_auth_target(kvpt_target_opts *o, kvpt_target *t, const char *key);

/* 1 when e READs 4 KiB of t's buffer (pattern seed) through segment, over
 * transport want_tp unless NULL. */
int kvpt_read_ok(kvp_engine *e, const char *segment, const kvpt_target *t, uint64_t seed,
                 const char *want_tp);

/* A case's log file: named on stderr when the case failed, else removed. */
void kvpt_keep_log_if_failed(const char *log);

/* A `kvpipe metadata-server` process on a free port; fills url
 * ("http://127.0.0.1:P/metadata"). Returns its pid or -1. */
pid_t kvpt_http_store_start(char *url, size_t len);

/* Accept connections on lfd forever, a detached thread running
 * conn((void *)(intptr_t)fd) for each: a fake server's body. */
__attribute__((noreturn)) void kvpt_accept_forever(int lfd, void *(*conn)(void *));

/* Raw sockets for hostile peers: a connection to 127.0.0.1:port (-1 on
 * failure), and the largest number of descriptors this process may open
 * raised to at least n (0 on success). */
int kvpt_raw_connect(int port);
int kvpt_raise_nofile(int n);

/* ========================================================== pipe side === */

/* Two pipe sides in two processes on loopback, for the pipe suites
 * (tests/pipe_*_test.c): a config both read, the sides forked from the case,
 * and the rows every suite runs on.
 *
 * A row is the protocol of the config (a mooncake.json's "protocol") both
 * sides read and, for the ucx rows, UCX_TLS: tcp, shm, and ucx over UCX's tcp
 * and shared-memory transports. kvpt_pipe_main() runs a suite's cases on every
 * row, then again authenticated (a key file in KVPIPE_AUTH_KEY_FILE, which the
 * sides inherit: the pipe's links then use CURVE, its engines authenticate
 * every connection and sign their descriptors) on the tcp and ucx rows.
 *
 * A case's name carries its row's prefix ("shm/", "ucx_tcp/", "ucx_sm/",
 * nothing for tcp) and "_auth" when authenticated. The program's optional
 * argument runs only the cases whose name contains it, or, given as "=NAME",
 * the case of that exact name (KVPT_FILTER and KVPT_EXCLUDE work as in every
 * suite). */

/* The one way a side starts: fork a child that opens side rank of the pipe
 * config json with o, runs fn(pipe, arg) and closes it; it exits 1 when a
 * check failed, 2 when the pipe did not open. capture as kvpt_peer_fork's
 * (a path, starting with '/', names the file itself). Its pid. */
typedef void (*kvpt_side_fn)(kvp_pipe *pipe, void *arg);
pid_t kvpt_side_spawn(const char *json, int rank, const kvp_pipe_opts *o, kvpt_side_fn fn,
                      void *arg, const char *capture);

/* Wait up to timeout_ms for prefill a and decode b: both must exit 0. */
void kvpt_sides_wait(pid_t a, pid_t b, int timeout_ms);

#define KVPT_RECV_TIMEOUT 20000
#define KVPT_SIDE_TIMEOUT 200000 /* bounds a hang; preparing 1 GiB is slow on a loaded VM */

typedef struct kvpt_pipe_row {
    const char *prefix, *protocol, *ucx_tls;
} kvpt_pipe_row;

/* The row the current case runs on. */
extern const kvpt_pipe_row *kvpt_row;

/* The transport the row's protocol selects between two kvpipe engines. */
const char *kvpt_row_transport(void);

/* A config both sides read: "127.0.0.1:B" as both URLs (prefill uses B, B+9,
 * B+10; decode, at B+100, B+100, B+109, B+110), the row's protocol, and
 * metadata through a `kvpipe metadata-server` of the case's own (p2p = 0) or
 * by P2P handshake. 0, or -1 when no store or ports could be had. */
typedef struct kvpt_pipe_setup {
    char json[512];
    int base;
} kvpt_pipe_setup;
int kvpt_pipe_setup_make(kvpt_pipe_setup *s, int p2p);

/* Options over tcp (shm off: the TCP data path; a case lets shm in), a 20 s
 * send timeout. */
kvp_pipe_opts kvpt_pipe_tcp_opts(void);

/* Open side rank (0 prefill, 1 decode) of the config in json. */
kvp_status kvpt_pipe_open(const char *json, int rank, const kvp_pipe_opts *o, kvp_pipe **out);

/* A prefill side with no peer: P2P metadata, kvpt_pipe_tcp_opts() with a
 * 300 ms send timeout (kept in *s and *o, where not NULL, for a second
 * open). NULL, the reason printed, when it did not open. */
kvp_pipe *kvpt_pipe_alone(kvpt_pipe_setup *s, kvp_pipe_opts *o);

/* A side's body; returns non-zero to skip the final flush (its peer is gone). */
typedef int (*kvpt_row_side_fn)(kvp_pipe *pipe, int rank);

/* Fork side rank running fn; it flushes (unless fn returned non-zero),
 * closes and exits 0 when every check held, 2 when the pipe did not open. */
pid_t kvpt_pipe_spawn(const kvpt_pipe_setup *s, int rank, const kvp_pipe_opts *o,
                      kvpt_row_side_fn fn);

/* Run fn0 as prefill and fn1 as decode; both must exit 0. */
void kvpt_pipe_run_pair(const kvpt_pipe_setup *s, const kvp_pipe_opts *o0, const kvp_pipe_opts *o1,
                        kvpt_row_side_fn fn0, kvpt_row_side_fn fn1);

/* Run fn0 as prefill and fn1 as decode over tcp (kvpt_pipe_tcp_opts) with
 * a store of the case's own (p2p 0) or P2P handshakes. */
void kvpt_pipe_run(int p2p, kvpt_row_side_fn fn0, kvpt_row_side_fn fn1);

/* Run fn on both sides with the same-host transport allowed, then check
 * that the receiver READ over it (kvpt_pipe_expect_same_host); kv_buffer_size 0
 * keeps the default. */
void kvpt_pipe_run_same_host(kvpt_row_side_fn fn, size_t kv_buffer_size);

/* Receive one tensor (NULL: None) within timeout_ms; a failure is a failed
 * check. */
kvp_tensor *kvpt_pipe_recv(kvp_pipe *pipe, int timeout_ms);

/* Receive and require a tensor equal to want (NULL: None). */
void kvpt_pipe_expect(kvp_pipe *pipe, const kvp_tensor *want);

/* The transport this side's engine uses to its peer ("" if none yet). */
const char *kvpt_pipe_peer_transport(kvp_pipe *pipe);

/* On the receiver (rank 1): it READ over shm when this build has the
 * same-host transport, over tcp otherwise. Called on both sides after their
 * last tensor: the sender waits until the receiver looked (its answer is a
 * None), since the look needs the sender's segment, gone once it closed. */
void kvpt_pipe_expect_same_host(kvp_pipe *pipe, int rank);

/* A borrowed one-dimensional uint8 tensor of len bytes at data. */
kvp_tensor kvpt_u8_tensor(void *data, size_t len);

/* vLLM's test tensors: x = int64 [1], y = float32 [1, 4] = 2, 3, 4, 8. */
void kvpt_pipe_xy(kvp_tensor *x, kvp_tensor *y);

/* A case of a suite and the rows it runs on. */
enum {
    KVPT_ROWS_ALL = 0,
    KVPT_ROW_TCP_ONLY = 1,  /* cases that start the CLI */
    KVPT_ROWS_UCX_ONLY = 2, /* the demo over rdma */
    KVPT_AUTH = 4,          /* also authenticated, on the tcp and ucx rows */
    KVPT_AUTH_TCP = 8,      /* also authenticated, on the tcp row */
};
typedef struct kvpt_pipe_case {
    const char *name;
    void (*fn)(void);
    int secs;
    unsigned flags;
} kvpt_pipe_case;
/* clang-format off */
#define KVPT_PIPE_CASE(fn, secs, flags) {#fn, fn, secs, flags}
/* clang-format on */

/* Run the cases on every row, then authenticated; returns the exit code. */
int kvpt_pipe_main(int argc, char **argv, const kvpt_pipe_case *cases, size_t n);

/* ========================================================== raw peer === */

/* A raw MooncakePipe-wire peer, for the pipe fault tests: a real engine under
 * a side's segment name and bare libzmq sockets on that side's ports, so that
 * a test writes the wire by hand (announcements, ACKs, tags) and watches what
 * the pipe on the other side does. (void * are libzmq sockets.) */

#define KVPT_RAW_WAIT_MS 20000  /* bounds a wait that succeeds at once when the code is right */
#define KVPT_RAW_SIDE_MS 120000 /* bounds a pipe side's whole run */
#define KVPT_RAW_TENSOR 4096    /* bytes of each good tensor */

/* Both sides of a pipe whose config says 127.0.0.1:B for both URLs, in
 * P2PHANDSHAKE mode (no metadata store): prefill has B, B+9, B+10 and decode
 * (base B+100) B+100, B+109, B+110. */
typedef struct kvpt_raw_setup {
    char json[256];
    int base;
    kvp_pipe_endpoints side[2]; /* [kv_rank] */
} kvpt_raw_setup;
int kvpt_raw_setup_init(kvpt_raw_setup *s);

/* Run fn on side rank of the setup's pipe, opened with opts (the second:
 * kvpt_pipe_tcp_opts()), stderr to err_path: kvpt_side_spawn. */
pid_t kvpt_raw_spawn_side_with(const kvpt_raw_setup *s, int rank, const kvp_pipe_opts *opts,
                               kvpt_side_fn fn, void *arg, const char *err_path);
pid_t kvpt_raw_spawn_side(const kvpt_raw_setup *s, int rank, kvpt_side_fn fn, void *arg,
                          const char *err_path);

/* Both sides of the setup's pipe as children (kvpt_raw_spawn_side):
 * prefill (rank 0) runs prefill_fn, decode (rank 1) decode_fn, both with
 * arg, their stderr in kvpt_err_path files "<what>_prefill" and
 * "<what>_decode". kvpt_raw_sides_wait waits for both (KVPT_RAW_SIDE_MS),
 * shows both files if either failed and returns 0 if both exited 0;
 * kvpt_raw_sides_unlink removes the files. */
typedef struct kvpt_raw_sides {
    pid_t pid[2]; /* [kv_rank] */
    char err[2][128];
} kvpt_raw_sides;
void kvpt_raw_sides_spawn(kvpt_raw_sides *p, const kvpt_raw_setup *s, const char *what,
                          kvpt_side_fn prefill_fn, kvpt_side_fn decode_fn, void *arg);
int kvpt_raw_sides_wait(kvpt_raw_sides *p);
void kvpt_raw_sides_unlink(kvpt_raw_sides *p);

/* A temporary file name for a side's stderr; lines of such a file that hold
 * needle ("": every line), -1 without the file; its first 40 lines shown,
 * marked who. */
void kvpt_err_path(char *buf, size_t len, const char *what);
int kvpt_file_lines(const char *path, const char *needle);
void kvpt_file_show(const char *path, const char *who);

/* A real engine under side rank's segment name, to serve or make the READs
 * that the pipe on the other side expects. */
kvp_status kvpt_raw_engine(const kvpt_raw_setup *s, int rank, kvp_engine **out);

/* A socket of type with no linger and KVPT_RAW_WAIT_MS send and receive
 * timeouts; bound or connected to tcp://127.0.0.1:port (zmq_bind's result). */
void *kvpt_zmq_socket(void *ctx, int type);
int kvpt_zmq_bind(void *z, int port);
int kvpt_zmq_connect(void *z, int port);
/* A socket monitor on z; returns the PAIR socket its events arrive on. */
void *kvpt_zmq_monitor(void *ctx, void *z, const char *name);
/* Wait for one of the events in mask on a monitor, skipping others; 0 when
 * one came in time. */
int kvpt_zmq_wait_event(void *mon, int mask, int timeout_ms);
/* Send a message of n frames; 0 or -1. */
int kvpt_zmq_send_frames(void *z, const void *const *frames, const size_t *sizes, int n);

/* A raw side's sockets on rank's ports: prefill (0) binds a PUSH on its data
 * port (announcements) and connects a PULL to decode's ACK port; decode (1)
 * connects a PULL to prefill's data port and binds a PUSH on its ACK port.
 * watch: a socket with a monitor (mon), made before it binds or connects. e:
 * an engine of the caller's, destroyed by kvpt_raw_peer_stop when set. */
typedef struct kvpt_raw_peer {
    kvp_engine *e;
    void *ctx, *push, *pull, *mon;
} kvpt_raw_peer;
enum { KVPT_RAW_WATCH_NONE, KVPT_RAW_WATCH_PUSH, KVPT_RAW_WATCH_PULL };
/* 0, or -1 with ZeroMQ's reason printed. */
int kvpt_raw_peer_start(kvpt_raw_peer *r, const kvpt_raw_setup *s, int rank, int watch);
/* The sockets closed, the context ended, then the engine destroyed. */
void kvpt_raw_peer_stop(kvpt_raw_peer *r);

/* An announcement (address, length) as a sender's engine makes it. */
int kvpt_raw_send_announcement(void *z, uint64_t addr, uint64_t len);

/* Good tensor i: KVPT_RAW_TENSOR bytes of U8 with the pattern of seed i + 1;
 * its check; sent with a copy; encoded into engine memory for announcing;
 * announced from there. */
void kvpt_raw_tensor_fill(void *data, int i);
int kvpt_raw_tensor_check(const kvp_tensor *t, int i);
void kvpt_raw_send_good(kvp_pipe *pipe, int i);
kvp_status kvpt_raw_message(kvp_engine *e, int i, void **buf, size_t *len);
int kvpt_raw_announce_good(kvp_engine *e, void *push, int i);

/* Receive one message: its frame count (-1 on timeout), the sizes of its
 * first KVPT_RAW_MSG_FRAMES frames and their first KVPT_RAW_MSG_HEAD bytes
 * (a tag frame whole). */
#define KVPT_RAW_MSG_FRAMES 3
#define KVPT_RAW_MSG_HEAD KVPI_TAG_LEN
int kvpt_zmq_recv_message(void *z, uint8_t f[KVPT_RAW_MSG_FRAMES][KVPT_RAW_MSG_HEAD],
                          size_t sz[KVPT_RAW_MSG_FRAMES], int timeout_ms);

/* Count the ACKs that arrive within timeout_ms each, until one does not or
 * max arrived; a message that is not one frame "ACK" counts as -1000. */
int kvpt_raw_count_acks(void *pull, int max, int timeout_ms);

#endif
