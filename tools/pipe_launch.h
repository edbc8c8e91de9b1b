/* Running both sides of a pipe on this host, for `kvpipe demo` and
 * `kvpipe bench --pipe`: a metadata store (embedded HTTP store, P2P handshake,
 * or a given connection string), a mooncake config file, and the two sides as
 * child processes of this one, each a fresh exec of the kvpipe binary that
 * finds the config through MOONCAKE_CONFIG_PATH, as vLLM does. */
#ifndef TOOLS_PIPE_LAUNCH_H
#define TOOLS_PIPE_LAUNCH_H

#include <sys/types.h>

#include "kvpipe/metadata_server.h"
#include "kvpipe/pipe.h"

typedef struct launch_pair {
    char dir[64];          /* private temporary directory */
    char config_path[128]; /* dir/mooncake.json */
    char metadata[512];    /* metadata_server as written in the config */
    int base_port;         /* prefill_url = decode_url = 127.0.0.1:base_port */
    kvp_metadata_server *store;
} launch_pair;

/* Prepare a run: metadata is "http" (start the embedded store), "p2p"
 * (P2PHANDSHAKE) or a connection string used as given. base_port 0 picks one
 * whose pipe ports (base, +9, +10, +100, +109, +110) are free. Prints the
 * reason to stderr and returns -1 on failure. */
int launch_prepare(launch_pair *l, const char *metadata, const char *protocol, int base_port);

/* Run the two sides as children of this process, which die with it: each
 * this binary as `kvpipe CMD`, with the caller's options (argv[1..argc))
 * and then its own side_args[i], and env MOONCAKE_CONFIG_PATH set to the
 * config; then wait for both, up to timeout_ms in all. When one fails or
 * the time is up, the other is killed. Returns 0 when both exited 0;
 * otherwise prints which failed (names label the sides) and returns 1. */
#define LAUNCH_SIDE_ARGS 4
int launch_run(const launch_pair *l, const char *cmd, int argc, char **argv,
               const char *const names[2], const char *const side_args[2][LAUNCH_SIDE_ARGS],
               int timeout_ms);

/* Stop the store and remove the temporary files. */
void launch_cleanup(launch_pair *l);

/* For a receiving side, with the pipe's stats the caller read: the transport
 * its engine READ messages with ("tcp", "shm", "ucx"), or "inline" when every
 * message came inline on the pipe's ZeroMQ link (those up to inline_max_bytes
 * never touch the engine); "?" when unknown. Once a message was READ the pipe
 * holds the peer's segment open, so this asks nothing of a peer that may have
 * exited meanwhile. */
const char *launch_recv_transport(kvp_pipe *pipe, const kvp_pipe_stats *ps);

/* For a side: let SIGINT/SIGTERM act again (the CLI blocks them) and, when
 * started by launch_run(), die with the parent. */
void launch_child_init(void);

#endif
