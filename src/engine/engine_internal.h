/* Internal: the engine's parts and how they meet.
 *   engine.c   - create/destroy, publishing, the keeper thread
 *   registration.c - memory registration with the transports, the pool's hooks
 *   segment.c  - the table of opened peer segments and their transports
 *   batch.c    - the batch API: requests cut into slices, grouped and
 *                posted to the transports; the workers (lookups, retries,
 *                closing peers)
 *   metrics.c  - the engine's metrics, their endpoint and MC_TE_METRIC
 */
#ifndef KVPI_ENGINE_INTERNAL_H
#define KVPI_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "common/auth.h"
#include "common/digest.h"
#include "common/net.h"
#include "common/region.h"
#include "engine/buffer_pool.h"
#include "engine/descriptor.h"
#include "engine/metrics.h"
#include "kvpipe/engine.h"
#include "metadata/metadata.h"
#include "transport/transport.h"

/* One transport's state for a peer, opened when first needed. */
typedef struct kvpi_link {
    const kvpi_transport_ops *ops;
    size_t slot;  /* its index in the engine's transports: server, region handles */
    void *handle; /* peer_open's; NULL until opened */
    int refused;  /* peer_open failed: not tried again for this peer */
} kvpi_link;

/* What the engine knows of a peer: its descriptor and the transports it may
 * use for it. Shared by workers, reference counted: a failed peer is detached
 * from its segment and closed when the last worker using it lets go. */
typedef struct kvpi_peer {
    kvpi_descriptor desc;
    char *host;
    atomic_int refs;
    pthread_mutex_t lock;                 /* opening links */
    kvpi_link links[KVPI_MAX_TRANSPORTS]; /* the allowed transports, preferred first */
    size_t n_links;
    kvpi_link *primary;             /* the first that opened at lookup (links before it refused) */
    int integrity;                  /* both sides digest (common/digest.h) */
    struct kvpi_peer *next_closing; /* on the workers' queue, once unreferenced */
} kvpi_peer;

typedef struct kvpi_segment {
    char *name;
    /* Held across a lookup (the transports' peer_open and peer_close, which
     * may wait on a transport's own threads), so that workers racing to a
     * segment that failed look it up once. */
    pthread_mutex_t lookup_lock;
    /* The fields below; held briefly, never across a call into a transport:
     * transfers complete on the transports' threads and take it there. */
    pthread_mutex_t lock;
    kvpi_peer *peer;       /* NULL until looked up, and after a connection error */
    const char *transport; /* name of the last transport used, for callers */
    int failing;           /* the last transfer failed: log the next failure quietly */
    int looked_up;         /* a descriptor was fetched once: later lookups refresh it */
    /* Slices whose digests differed (KVP_ECORRUPT), by transport, as
     * kvpi_transports[] orders them (metrics.c). */
    kvpi_counter corrupt[KVPI_TRANSPORTS_MAX];
} kvpi_segment;

typedef struct kvpi_job kvpi_job;

/* The workers' queue: works that need a lookup (or a link opened) before
 * they can be posted, and peers to close. */
typedef struct kvpi_queue {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    kvpi_job *head, **tail;
    kvpi_peer *closing;
    int stopping;
    /* Set at destroy: work from now on fails with KVP_ECLOSED instead of
     * being posted, and the destroying thread waits for inflight (xfers
     * posted and not completed) to reach 0. */
    atomic_int draining;
    atomic_long inflight;
} kvpi_queue;

/* The completion queue (batch.c): batches submitted with
 * kvp_batch_opts.reap that completed and were not reaped or freed yet,
 * oldest first. fd (an eventfd) holds 1 exactly while the queue is not
 * empty: written when the first batch is queued, read when the last leaves,
 * both under lock. */
typedef struct kvpi_cq {
    pthread_mutex_t lock;
    int fd;
    kvp_batch *head, *tail;
} kvpi_cq;

/* Notifications received (notify.c): a FIFO bounded by
 * KVP_NOTIFY_QUEUE_MAX entries and KVP_NOTIFY_QUEUE_MAX_BYTES. */
typedef struct kvpi_notify_entry {
    struct kvpi_notify_entry *next;
    char *name, *msg;
    size_t bytes;
} kvpi_notify_entry;

typedef struct kvpi_notify_queue {
    pthread_mutex_t lock;
    kvpi_notify_entry *head, **tail;
    size_t count, bytes;
} kvpi_notify_queue;

struct kvp_engine {
    kvp_engine_opts opts; /* strings below are owned copies */
    char *name, *metadata_conn, *protocol, *device_names;
    kvpi_hostport self; /* self.host: the advertised host (advert.host) */
    kvpi_advert advert; /* where listeners bind, and why self.host */
    /* This engine's transports (kvpi_transports, unless a test gives others),
     * NULL-terminated; servers[i] is transports[i]'s, i its region handle
     * slot. */
    const kvpi_transport_ops *const *transports;
    size_t n_transports;
    const kvpi_transport_ops *transport; /* the protocol's transport */
    kvpi_meta *meta;
    kvpi_rpc_server *rpc;
    kvpi_region_table regions;
    void *servers[KVPI_MAX_TRANSPORTS]; /* NULL where one did not start */
    int data_port;
    kvpi_pool *pool;

    char instance[KVP_INSTANCE_LEN + 1]; /* KVPI_INSTANCE_FIELD: random hex, drawn at creation */
    cJSON *fields; /* an upper layer's descriptor members (engine_ext.h), or NULL */
    int claimed;   /* the name is taken in the store: release it at destroy */
    pthread_mutex_t publish_lock;
    char *desc_text;         /* last rendered descriptor, for handshakes */
    int desc_stale;          /* desc_text may list regions no longer registered */
    kvpi_auth *auth;         /* NULL: unauthenticated */
    int integrity;           /* opts.integrity resolved: digests with peers that have it too */
    uint64_t desc_signed_ns; /* authenticated: when desc_text was signed */

    pthread_mutex_t segments_lock;
    kvpi_segment **segments;
    size_t n_segments, cap_segments;

    kvpi_queue queue;
    kvpi_cq cq;
    pthread_t *workers;
    int n_workers;

    pthread_t keeper;
    int keeper_started;
    pthread_mutex_t keeper_lock;
    pthread_cond_t keeper_cond;
    int keeper_stop;

    /* Following peers' descriptors in the store (segment.c): started with
     * the first peer descriptor cached, stopped at destroy. */
    pthread_mutex_t watch_lock;
    kvpi_meta_watch *watch;
    int watch_tried; /* started, failed to, or env says not to */

    kvpi_notify_queue notifies;

    kvpi_engine_metrics metrics;
    struct kvpi_metrics_server *metrics_srv; /* the endpoint, when asked for */
    pthread_t reporter;                      /* MC_TE_METRIC's line */
    int reporter_started, report_interval_s, report_stop;
    pthread_mutex_t report_lock;
    pthread_cond_t report_cond;
};

/* segment.c */
kvpi_segment *kvpi_segment_get(kvp_engine *e, kvp_segment_id id);
/* The opened segment of that name, or NULL. */
kvpi_segment *kvpi_segment_find(kvp_engine *e, const char *name);
/* Drop the cached peer, so that the next use looks the segment up again;
 * transfers holding it finish on it. */
void kvpi_segment_forget(kvpi_segment *seg);
/* A referenced peer for the segment, looking it up (again) if needed. */
kvp_status kvpi_segment_acquire(kvp_engine *e, kvpi_segment *seg, kvpi_peer **out);
/* The same without blocking: KVP_EBUSY where a lookup is needed (or one
 * runs). */
kvp_status kvpi_segment_try_acquire(kvpi_segment *seg, kvpi_peer **out);
/* Drop a reference; if failed is non-zero and the segment still uses this
 * peer, detach it so that the next transfer looks the segment up again. */
void kvpi_segment_release(kvpi_segment *seg, kvpi_peer *peer, int failed);
/* The same from a completion, which must not close a peer: the last
 * reference goes to e's workers (kvpi_workers_close). */
void kvpi_segment_release_later(kvp_engine *e, kvpi_segment *seg, kvpi_peer *peer, int failed);
/* Close and free a peer nothing references any more. */
void kvpi_peer_free(kvpi_peer *peer);
void kvpi_segments_destroy(kvp_engine *e);
/* Stop following the store (destroy, before kvpi_segments_destroy). */
void kvpi_segments_watch_stop(kvp_engine *e);
/* enum kvpi_watch_state of the engine's watch; -1 when it has none (not
 * started yet, P2P mode, or KVPIPE_METADATA_WATCH=off). For tests. */
int kvpi_engine_watch_state(kvp_engine *e);
/* The link to move memory of the kinds in mask kinds (KVPI_MEM_BIT of the
 * local and the remote memory) with: the first allowed transport, in
 * preference order, that moves all of them and opens for this peer.
 * KVP_ENOTSUP naming the kinds when none does. Without blocking (0), a
 * link that would have to be opened first is KVP_EBUSY. */
kvp_status kvpi_peer_select(kvp_engine *e, kvpi_peer *peer, unsigned kinds, int blocking,
                            kvpi_link **out);
/* Record a transfer's outcome; a failure is logged once until one succeeds. */
void kvpi_segment_note(kvpi_segment *seg, kvp_status st);

/* batch.c */
/* The completion queue and its eventfd (create); closed by kvpi_cq_destroy. */
kvp_status kvpi_cq_init(kvp_engine *e);
void kvpi_cq_destroy(kvp_engine *e);
kvp_status kvpi_workers_start(kvp_engine *e);
/* Wait for every xfer in flight, then stop the workers (destroy). */
void kvpi_workers_stop(kvp_engine *e);
/* Hand an unreferenced peer to the workers to close. */
void kvpi_workers_close(kvp_engine *e, kvpi_peer *peer);

/* engine.c */
char *kvpi_engine_descriptor_text(kvp_engine *e);
/* Render and publish the descriptor (its ram key). */
kvp_status kvpi_engine_publish(kvp_engine *e);
/* The rendered descriptor no longer matches the regions: render it again. */
void kvpi_engine_mark_stale(kvp_engine *e);
/* kvp_engine_create with another list of transports (NULL-terminated, at most
 * KVPI_MAX_TRANSPORTS, one of the protocol's name among them): how tests run
 * the engine over transports of their own, or variants of the built-in ones. */
kvp_status kvpi_engine_create_with(const kvp_engine_opts *opts,
                                   const kvpi_transport_ops *const *transports, kvp_engine **out);

/* notify.c */
void kvpi_notify_init(kvp_engine *e);
/* The handshake server's NOTIFY handler (kvpi_rpc_notify_fn; ctx: e). */
kvp_status kvpi_notify_receive(void *ctx, const char *name, const char *msg);
/* After the handshake server stopped: free what was not collected. */
void kvpi_notify_destroy(kvp_engine *e);
/* The queue's length, for the metrics. */
size_t kvpi_notify_queued(kvp_engine *e);

/* registration.c */
/* Create the buffer pool: host memory, its chunks mapped by the first
 * running transport that has chunk_map (else anonymous mappings) and
 * registered like any region. */
kvp_status kvpi_engine_pool_start(kvp_engine *e);
/* Unregister, from every transport, what is still registered (teardown). */
void kvpi_engine_unregister_all(kvp_engine *e);

/* Register and publish region r (addr, length, kind, device) as
 * kvp_engine_register_mem() does after its checks of the memory itself (host
 * memory readable, CUDA memory the driver's): for tests of the engine's
 * selection by kind, whose transports move "CUDA" memory that is host
 * memory. */
kvp_status kvpi_engine_register_region(kvp_engine *e, const kvpi_region *r);

#endif
