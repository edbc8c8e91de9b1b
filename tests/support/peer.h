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
} kvpt_target_opts;

typedef struct kvpt_target {
    kvpt_peer peer;
    pid_t pid;     /* the child's, as peer.pid */
    char name[64]; /* segment name, "127.0.0.1:port" (the handshake port) */
    int rpc_port;
    int data_port;
    void *buf; /* MAP_SHARED with the child at the same address; registered there */
    size_t len;
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
                                first wrong byte, or -2 when all match */
};

/* Run a command with argument a; returns its value, or -1 if it failed or
 * no answer came within timeout_ms (the child is then stuck). */
int64_t kvpt_target_cmd(kvpt_target *t, int op, uint64_t a, int timeout_ms);

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

/* A `kvpipe metadata-server` process on a free port; fills url
 * ("http://127.0.0.1:P/metadata"). Returns its pid or -1. */
pid_t kvpt_http_store_start(char *url, size_t len);

/* Raw sockets for hostile peers: a connection to 127.0.0.1:port (-1 on
 * failure), and the largest number of descriptors this process may open
 * raised to at least n (0 on success). */
int kvpt_raw_connect(int port);
int kvpt_raise_nofile(int n);

#endif
