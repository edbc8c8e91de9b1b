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
#ifndef KVPT_PIPE_PAIR_H
#define KVPT_PIPE_PAIR_H

#include <stddef.h>
#include <sys/types.h>

#include "kvpipe/pipe.h"

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
 * 300 ms send timeout (kept in *s and *o for a second open). NULL, the
 * reason printed, when it did not open. */
kvp_pipe *kvpt_pipe_alone(kvpt_pipe_setup *s, kvp_pipe_opts *o);

/* A side's body; returns non-zero to skip the final flush (its peer is gone). */
typedef int (*kvpt_side_fn)(kvp_pipe *pipe, int rank);

/* Fork side rank running fn; it flushes, closes and exits 0 when every check
 * held, 2 when the pipe did not open. */
pid_t kvpt_pipe_spawn(const kvpt_pipe_setup *s, int rank, const kvp_pipe_opts *o, kvpt_side_fn fn);

/* Run fn0 as prefill and fn1 as decode; both must exit 0. */
void kvpt_pipe_run_pair(const kvpt_pipe_setup *s, const kvp_pipe_opts *o0, const kvp_pipe_opts *o1,
                        kvpt_side_fn fn0, kvpt_side_fn fn1);

/* Run fn on both sides with the same-host transport allowed; kv_buffer_size 0
 * keeps the default. */
void kvpt_pipe_run_same_host(kvpt_side_fn fn, size_t kv_buffer_size);

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

#endif
