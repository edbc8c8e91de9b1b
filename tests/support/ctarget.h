/* A commanded target engine in a child process, for the reliability suite.
 *
 * Like kvpt_target (target.h), but the engine's limits are set by the test
 * (timeouts, connection caps, the floor rate, a descriptor limit set with
 * setrlimit in the child), and the child obeys commands over a pipe while it
 * serves: register or allocate more memory and say how long that took,
 * unregister its buffer, unmap part of it behind the engine's back, count its
 * open descriptors. Every command has a timeout on the test's side, so a
 * child that is stuck (the bug under test) fails the check instead of hanging
 * the test. The buffer is MAP_SHARED, made before the fork, so the test sees
 * what WRITEs put there. */
#ifndef KVPT_CTARGET_H
#define KVPT_CTARGET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct kvpt_ctarget_opts {
    const char *metadata; /* NULL: P2PHANDSHAKE */
    const char *protocol; /* NULL: tcp */
    int disable_shm;
    size_t len; /* buffer bytes, registered at start */
    uint64_t seed;
    /* kvp_engine_opts fields; 0 keeps the default */
    int timeout_ms;
    int idle_timeout_ms;
    int max_connections;
    uint64_t min_transfer_rate;
    int nofile; /* RLIMIT_NOFILE soft limit of the child; 0: unchanged */
    size_t pool_retain_bytes;
    /* The child's stderr goes to this file (NULL: the test's own), so that a
     * test can read what it said before it died (kvpt_ctarget_said). */
    const char *stderr_path;
} kvpt_ctarget_opts;

typedef struct kvpt_ctarget {
    pid_t pid;
    char name[64]; /* segment name, "127.0.0.1:port" (the handshake port) */
    int rpc_port;
    int data_port;
    void *buf;
    size_t len;
    int cmd, resp; /* our ends of the command and reply pipes */
    int stuck;     /* a command went unanswered: later ones fail at once */
} kvpt_ctarget;

/* Start the child and wait (bounded) until it serves. 0 on success. */
int kvpt_ctarget_start(const kvpt_ctarget_opts *opts, kvpt_ctarget *out);

enum kvpt_ctarget_op {
    KVPT_CT_REGISTER = 'r',   /* register arg fresh bytes of malloc'ed memory: ms taken */
    KVPT_CT_ALLOC = 'a',      /* kvp_engine_alloc of arg bytes: ms taken */
    KVPT_CT_POOL = 'p',       /* kvp_engine_alloc of arg bytes filled with
                                 kvpt_fill(seed arg): their address */
    KVPT_CT_POOL_FREE = 'F',  /* kvp_engine_free of the last KVPT_CT_POOL buffer: ms taken */
    KVPT_CT_UNREGISTER = 'u', /* unregister the buffer: ms taken */
    KVPT_CT_REREGISTER = 'R', /* unregister the buffer, fill it with kvpt_fill(seed
                                 arg) and register it again (the same range): 0 */
    KVPT_CT_UNMAP = 'm',      /* munmap the buffer (still registered): 0 */
    KVPT_CT_FDS = 'f',        /* open descriptors of the child */
};

/* Run a command; returns its value, or -1 if it failed or no answer came
 * within timeout_ms (the child is then stuck). */
int64_t kvpt_ctarget_cmd(kvpt_ctarget *t, int op, uint64_t arg, int timeout_ms);

/* Copy the file opts.stderr_path named to our stderr and delete it; 1 if
 * it held text, else 0. Call it once the child was reaped. */
int kvpt_ctarget_said(const char *stderr_path, const char *text);

/* CPU time (user + system) the child used so far, in ms; -1 on error. */
int64_t kvpt_ctarget_cpu_ms(const kvpt_ctarget *t);

/* Stop the child cleanly (bounded) and unmap the buffer; returns its exit
 * status (-1: it had to be killed). */
int kvpt_ctarget_stop(kvpt_ctarget *t);

/* An initiator engine in this process (P2PHANDSHAKE, a free port) with
 * protocol (NULL: tcp), disable_shm and timeout_ms (0: default). 0 on success. */
struct kvp_engine;
int kvpt_initiator_start(const char *protocol, int disable_shm, int timeout_ms,
                         struct kvp_engine **out);

/* Raw sockets for hostile peers: a connection to 127.0.0.1:port (-1 on
 * failure), and the largest number of descriptors this process may open
 * raised to at least n (0 on success). */
int kvpt_raw_connect(int port);
int kvpt_raise_nofile(int n);

#endif
