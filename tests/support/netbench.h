/* `kvpipe bench` runs across a kvpt_netns pair, for the network fault tests.
 *
 * Engine bench: a `kvpipe metadata-server` and a `bench --mode target` on side
 * 0, the `bench --mode initiator` on side 1, every byte checked (--verify) and
 * shm off, so every byte crosses the veth pair. The target fills its buffer
 * with a pattern; a READ checks every byte it gets; a WRITE run reads back
 * every block it wrote, and the target checks, when stopped, that each word
 * of its buffer is its own pattern or the written one.
 *
 * Pipe bench: `bench --pipe` rank 0 (sender) on side 0 and rank 1 (receiver)
 * on side 1 with a mooncake config naming both sides' addresses and
 * P2PHANDSHAKE metadata; the receiver compares every byte and counts tensors
 * lost, duplicated, reordered and corrupt.
 *
 * The processes are children of the caller, in its process group, and die with
 * it (kvpt_spawn); their stdout goes to files in a private directory. Parsed
 * results are -1 where the output had none (the process failed early).
 */
#ifndef KVPT_NETBENCH_H
#define KVPT_NETBENCH_H

#include <stdint.h>
#include <sys/types.h>

#include "netns.h"

typedef struct kvpt_engine_bench {
    /* Set before start. */
    const char *operation; /* "read" or "write" */
    double duration_s;     /* the initiator's --duration */
    int timeout_ms;        /* both engines' --timeout-ms */
    /* Internal. */
    kvpt_netns *net;
    char dir[64];
    pid_t store, target, initiator;
    uint64_t initiator_start_ns;
    /* Results of kvpt_engine_bench_wait(). */
    int initiator_rc;   /* exit status; -1 when it was killed at the bound */
    double initiator_s; /* from its start to its exit */
    long ops, errors, mismatches, read_back;
    double gbps;
    char transport[16];
    /* Results of kvpt_engine_bench_stop(). */
    int target_rc;
    long written; /* bytes the target found written; -1 if it did not say */
} kvpt_engine_bench;

/* Start the store and the target and wait until the target serves. 0, or -1
 * with the reason on stderr. */
int kvpt_engine_bench_start(kvpt_engine_bench *b, kvpt_netns *net);

/* Start an initiator (again after a wait, against the same target). */
int kvpt_engine_bench_run(kvpt_engine_bench *b);

/* Wait for the initiator at most timeout_ms (then kill it) and parse its
 * report. Returns initiator_rc. */
int kvpt_engine_bench_wait(kvpt_engine_bench *b, int timeout_ms);

/* Stop the target (SIGTERM: it unpublishes, then checks its buffer) and the
 * store; remove the files. Returns target_rc. Safe after a failed start. */
int kvpt_engine_bench_stop(kvpt_engine_bench *b);

/* CHECK that the initiator's run was clean: exit 0, transfers over TCP, no
 * error, no wrong byte, and for a WRITE every block it wrote read back. */
void kvpt_engine_bench_check_clean(const kvpt_engine_bench *b);

typedef struct kvpt_pipe_bench {
    /* Set before start. */
    const char *tensor_size; /* e.g. "256K" */
    long count;
    int timeout_ms; /* both engines' --timeout-ms */
    /* Internal. */
    kvpt_netns *net;
    char dir[64];
    pid_t sender, receiver;
    uint64_t start_ns;
    /* Results of kvpt_pipe_bench_wait(). */
    int sender_rc, receiver_rc; /* -1 when killed at the bound */
    double seconds;             /* from the start to the receiver's exit */
    long ops, errors, lost, duplicated, reordered, corrupt, failed;
    double gbps; /* the receiver's, from the first tensor to the last */
    char transport[16];
} kvpt_pipe_bench;

/* Start both ranks. 0, or -1 with the reason on stderr. */
int kvpt_pipe_bench_start(kvpt_pipe_bench *b, kvpt_netns *net);

/* Wait for both at most timeout_ms in all (then kill them), parse the
 * receiver's report and remove the files. Returns receiver_rc. */
int kvpt_pipe_bench_wait(kvpt_pipe_bench *b, int timeout_ms);

/* CHECK that the run was clean: both ranks exit 0, over TCP, every tensor
 * received once, in order, every byte right. */
void kvpt_pipe_bench_check_clean(const kvpt_pipe_bench *b);

/* ---- the network fault tests' fixture ---- */

/* A pair of namespaces (kvpt_netns_create) with fault(n, amount) in place
 * (NULL: none); skips the case where namespaces, or the fault's tool
 * (unavailable(n)), are missing. 0, or -1 with the reason on stderr. */
typedef const char *(*kvpt_net_unavailable_fn)(kvpt_netns *n);
typedef int (*kvpt_net_fault_fn)(kvpt_netns *n, int amount);
int kvpt_netns_pair(kvpt_netns *n, kvpt_net_unavailable_fn unavailable, kvpt_net_fault_fn fault,
                    int amount);

/* The engine bench b across n: started and run, during(n, arg) while it
 * runs (NULL: nothing), waited for up to bound_ms and CHECKed clean, then
 * stopped (the target checks its buffer). Returns whether it started; b
 * keeps the results. */
int kvpt_engine_bench_case(kvpt_engine_bench *b, kvpt_netns *n, kvpt_net_fault_fn during, int arg,
                           int bound_ms);

/* The pipe bench b across n: started, during(n, arg) (NULL: nothing),
 * waited for up to bound_ms. */
void kvpt_pipe_bench_case(kvpt_pipe_bench *b, kvpt_netns *n, kvpt_net_fault_fn during, int arg,
                          int bound_ms);

#endif
