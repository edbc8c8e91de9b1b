/* Internal: the threads of a transport whose I/O blocks (tcp, shm).
 *
 * Such a transport moves a group of slices with one blocking function (a
 * kvpi_run_fn) and implements peer_post by handing the xfer to its server's
 * runner: one of the runner's threads runs the function, with slices of
 * device memory staged through bounce buffers (staging.h: the function sees
 * host memory only) unless the lane says the function stages itself, and
 * calls the xfer's completion (transport.h). kvpi_runner_run (the body of
 * the transport's peer_run), or kvpi_runner_post without a runner (a peer
 * opened without its server, as unit tests do), runs the function on the
 * calling thread: the completion comes before it returns.
 *
 * One peer never holds up another: each peer has a lane, and at most its
 * lane's limit of its xfers run at once (a transport sets it to the
 * connections it keeps to the peer: more would only wait for one); a thread
 * starts when an xfer that may run now is queued and none is idle, up to
 * KVPI_RUNNER_THREADS_MAX, so a peer that stalls its xfers until their
 * deadline (stopped, black-holed) ties up only its lane's threads while
 * others start for the other peers. Threads stay until the runner stops.
 *
 * An xfer cancelled (kvpi_xfer.canceled) before a thread takes it completes
 * with KVP_ECANCELED without running, at once with kvpi_runner_cancel, or
 * when a thread takes it; one already running finishes (or fails at its
 * deadline) first. kvpi_runner_stop completes what is still queued with
 * KVP_ECLOSED and joins the threads.
 */
#ifndef KVPI_TRANSPORT_RUNNER_H
#define KVPI_TRANSPORT_RUNNER_H

#include "transport/transport.h"

/* Move n slices against peer by deadline (waiting for a connection
 * included), setting each one's status; returns what peer_post's completion
 * reports (transport.h). start_ns: when it started, for messages. */
typedef kvp_status (*kvpi_run_fn)(void *peer, kvpi_slice *const *slices, size_t n,
                                  uint64_t start_ns, uint64_t deadline);

typedef struct kvpi_runner kvpi_runner;

/* A peer's share of the runner, inside the transport's peer: the transport
 * sets limit (>= 1), timeout_ms, min_rate (> 0) and own_staging at peer_open; running
 * and queued are the runner's, under its lock. The runner touches it no more once the
 * peer's last xfer completed.
 *
 * An xfer's deadline starts when it runs: timeout_ms + its bytes /
 * min_rate. When one fails at the connection level (the peer timed out,
 * reset or refused), what waits in the same lane fails at once with it, as
 * a batch's other requests do: a peer that stalls fails everything posted
 * to it within about one deadline, not a deadline after another. */
typedef struct kvpi_runner_lane {
    int limit;
    int timeout_ms;
    uint64_t min_rate;
    /* Set: the function gets the slices as posted, device memory included,
     * and stages what it does not move otherwise (shm: CUDA IPC first). */
    int own_staging;
    int running, queued;
} kvpi_runner_lane;

#define KVPI_RUNNER_THREADS_MAX 64

/* KVP_ENOMEM only. No thread starts before the first queued xfer. */
kvp_status kvpi_runner_create(kvpi_runner **out);
void kvpi_runner_stop(kvpi_runner *r);

/* The body of a blocking transport's server_cancel: complete now, with
 * KVP_ECANCELED, every queued xfer whose cancel flag is set. */
void kvpi_runner_cancel(kvpi_runner *r);

/* The body of a blocking transport's peer_post. r may be NULL (see above). */
void kvpi_runner_post(kvpi_runner *r, kvpi_run_fn run, void *peer, kvpi_runner_lane *lane,
                      kvpi_xfer *x);
/* The body of its peer_run: x on the calling thread, as a runner thread
 * would run it (staging included). */
void kvpi_runner_run(kvpi_run_fn run, void *peer, kvpi_runner_lane *lane, kvpi_xfer *x);

#endif
