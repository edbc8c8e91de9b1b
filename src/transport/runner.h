/* Internal: the threads of a transport whose I/O blocks (tcp, shm).
 *
 * Such a transport moves a group of slices with one blocking function (a
 * kvpi_run_fn, its old peer_xfer) and implements peer_post by handing the
 * xfer to its server's runner: one of the runner's threads runs the function
 * and calls the xfer's completion (transport.h). With KVPI_POST_INLINE, or
 * without a runner (a peer opened without its server, as unit tests do), the
 * function runs on the posting thread and the completion comes before
 * kvpi_runner_post returns.
 *
 * An xfer cancelled (kvpi_xfer.canceled) before a thread takes it completes
 * with KVP_ECANCELED without running, at once with kvpi_runner_cancel (even
 * while every thread is busy with a stalled peer), or when a thread takes it;
 * one already running finishes (or fails at its deadline) first. The threads start at the first post that needs one,
 * so that a transport no peer uses costs nothing; kvpi_runner_stop completes
 * what is still queued with KVP_ECLOSED and joins them.
 */
#ifndef KVPI_TRANSPORT_RUNNER_H
#define KVPI_TRANSPORT_RUNNER_H

#include "transport/transport.h"

/* Move n slices against peer, setting each one's status; returns what
 * peer_post's completion reports (transport.h). */
typedef kvp_status (*kvpi_run_fn)(void *peer, kvpi_slice *const *slices, size_t n);

typedef struct kvpi_runner kvpi_runner;

/* threads <= 0: KVPI_RUNNER_THREADS_DEFAULT. KVP_ENOMEM only. */
#define KVPI_RUNNER_THREADS_DEFAULT 4
kvp_status kvpi_runner_create(int threads, kvpi_runner **out);
void kvpi_runner_stop(kvpi_runner *r);

/* The body of a blocking transport's server_cancel: complete now, with
 * KVP_ECANCELED, every queued xfer whose cancel flag is set. */
void kvpi_runner_cancel(kvpi_runner *r);

/* The body of a blocking transport's peer_post. r may be NULL (see above). */
void kvpi_runner_post(kvpi_runner *r, kvpi_run_fn run, void *peer, kvpi_xfer *x, unsigned flags);

#endif
