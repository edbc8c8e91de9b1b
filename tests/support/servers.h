/* Test fixtures: real metadata stores on free loopback ports.
 *
 * kvpt_redis_start() and kvpt_etcd_start() run the real redis-server and etcd
 * binaries (found in PATH, then /usr/bin and /usr/sbin) in a fresh mkdtemp
 * directory, with their output in <dir>/log, and wait (bounded) until they
 * answer. kvpt_http_start() runs kvpipe's own HTTP metadata server in this
 * process, kvpt_http_cli_start() as `kvpipe metadata-server` in another. Each fills a connection
 * string, so a suite can treat all stores alike.
 *
 * Not thread-safe; call from the test's main thread. A fixture left running by
 * a failed case dies with the case's process group (see kvpt_run).
 */
#ifndef KVPT_SERVERS_H
#define KVPT_SERVERS_H

#include <sys/types.h>

/* Return codes of the start functions. */
#define KVPT_SERVER_OK 0
#define KVPT_SERVER_FAILED (-1) /* binary present but did not come up */
#define KVPT_SERVER_ABSENT (-2) /* binary not installed: skip the case */

typedef struct kvpt_server {
    const char *kind;        /* "redis", "etcd", "http" */
    char conn[256];          /* connection string: "redis://127.0.0.1:P", ... */
    char addr[64];           /* "127.0.0.1:P" */
    int port;                /* client port */
    int peer_port;           /* etcd's peer port; 0 otherwise */
    pid_t pid;               /* server process; 0 when stopped or in-process */
    char dir[256];           /* data and log directory; "" for http */
    void *http;              /* kvp_metadata_server * for an in-process http */
    int cli;                 /* http: a `kvpipe metadata-server` process instead */
    const char *const *args; /* its extra flags, NULL-terminated (caller's) */
    char password[64];       /* redis: started with --requirepass this */
    char why[512];           /* reason of the last failure, for SKIP or a message */
} kvpt_server;

int kvpt_redis_start(kvpt_server *out);
/* A redis-server that wants a password (--requirepass); conn holds none. */
int kvpt_redis_start_auth(kvpt_server *out, const char *password);
int kvpt_etcd_start(kvpt_server *out);
/* kvpipe's HTTP metadata server in this process. */
int kvpt_http_start(kvpt_server *out);
/* kvpipe's HTTP metadata server as a process of its own (`kvpipe
 * metadata-server --port P ARGS...`; args NULL-terminated, may be NULL, and
 * must outlive the server); pid is its process. */
int kvpt_http_cli_start(kvpt_server *out, const char *const *args);

/* Stop the server (SIGTERM, then SIGKILL after a bound) but keep its port,
 * directory and connection string, so it can be started again. */
void kvpt_server_down(kvpt_server *s);

/* Start a server that kvpt_server_down() stopped, on the same port (etcd: with
 * the same data directory, so its keys survive; redis and http start empty). */
int kvpt_server_up(kvpt_server *s);

/* As kvpt_server_down(), but with SIGKILL: the server gets no chance to
 * flush or say goodbye (an in-process http server is just stopped). */
void kvpt_server_kill(kvpt_server *s);

/* kvpt_server_down() then kvpt_server_up(). */
int kvpt_server_restart(kvpt_server *s);

/* Stop the server and remove its directory. Safe on a zeroed struct. */
void kvpt_server_stop(kvpt_server *s);

/* A process that answers handshakes (Mooncake's P2P framing, as an engine's
 * RPC port does) on 127.0.0.1:port, every metadata request with reply (a
 * descriptor, or "null" as a Mooncake engine outside P2P mode answers).
 * Returns its pid once it listens, or -1. Start it before the case has
 * threads of its own (it forks). Stop it with kill + waitpid. */
pid_t kvpt_handshake_responder(int port, const char *reply);

/* Path of a program in PATH, /usr/bin or /usr/sbin (static buffer), or NULL. */
const char *kvpt_find_binary(const char *name);

/* A store handle of the HTTP store at conn (kvpi_store_http.open with
 * timeout_ms), its failure printed; NULL on failure. */
void *kvpt_http_store_open(const char *conn, int timeout_ms);

/* etcd's command line (argv, NULL-terminated): bin as a one-member cluster
 * named "default", clients at http://host:port, peers at host:peer_port, its
 * data in data_dir, warnings only; then extra's arguments (at most 8). */
typedef struct kvpt_etcd_args {
    char data[300], client[64], peer[64], cluster[96];
    char *argv[32];
} kvpt_etcd_args;
void kvpt_etcd_args_make(kvpt_etcd_args *a, const char *bin, const char *host, int port,
                         int peer_port, const char *data_dir, const char *const extra[]);

#endif
