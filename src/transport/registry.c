/* The transports of this build and the protocol names that select them: the
 * one place where a name maps to an ops table. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "transport/transport.h"

/* Preference order: same-host transports first; the engine tries them only
 * where its protocol allows (see engine/segment.c). */
const kvpi_transport_ops *const kvpi_transports[] = {
    &kvpi_transport_shm,
#if KVP_HAVE_UCX
    &kvpi_transport_ucx,
#endif
    &kvpi_transport_tcp,
    NULL,
};

#define NO_UCX "built without UCX: KVP_WITH_UCX was off or libucx-dev was not found"

/* Protocol names, as kvp_engine_opts.protocol and a Mooncake config's
 * "protocol" give them. A name with no ops says why it is missing here. */
static const struct {
    const char *name;
    const kvpi_transport_ops *ops;
    const char *missing;
} protocols[] = {
    {"tcp", &kvpi_transport_tcp, NULL},
    {"shm", &kvpi_transport_shm, NULL},
#if KVP_HAVE_UCX
    {"rdma", &kvpi_transport_ucx, NULL},
    {"ucx", &kvpi_transport_ucx, NULL},
#else
    {"rdma", NULL, NO_UCX},
    {"ucx", NULL, NO_UCX},
#endif
};

const kvpi_transport_ops *kvpi_transport_lookup(const char *name)
{
    for (size_t i = 0; i < sizeof protocols / sizeof protocols[0]; i++)
        if (strcmp(protocols[i].name, name) == 0) return protocols[i].ops;
    return NULL;
}

const char *kvpi_transport_missing(const char *name)
{
    for (size_t i = 0; i < sizeof protocols / sizeof protocols[0]; i++)
        if (strcmp(protocols[i].name, name) == 0) return protocols[i].missing;
    return NULL;
}

kvp_status kvpi_transport_check(const kvpi_transport_ops *o)
{
    const char *lack = !o->name                              ? "name"
                       : !o->mem_kinds                       ? "mem_kinds"
                       : !o->server_start || !o->server_stop ? "server_start/stop"
                       : !o->server_describe                 ? "server_describe"
                       : !o->mem_reg != !o->mem_dereg        ? "mem_reg with mem_dereg"
                       : !o->chunk_map != !o->chunk_unmap    ? "chunk_map with chunk_unmap"
                       : !o->server_progress != !o->server_wait_fd
                           ? "server_progress with server_wait_fd"
                       : !o->peer_open || !o->peer_post || !o->peer_close ? "peer_open/post/close"
                                                                          : NULL;
    if (!lack) return KVP_OK;
    return kvpi_error(KVP_EINVAL, "transport %s: its ops table lacks %s",
                      o->name ? o->name : "(unnamed)", lack);
}

typedef struct sync_xfer {
    kvpi_xfer x; /* first */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int done;
    kvp_status st;
    char detail[256];
} sync_xfer;

static void sync_done(kvpi_xfer *x, kvp_status st)
{
    sync_xfer *s = (sync_xfer *)x;
    pthread_mutex_lock(&s->lock);
    s->st = st;
    if (st) snprintf(s->detail, sizeof s->detail, "%s", kvp_last_error());
    s->done = 1;
    pthread_cond_signal(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

kvp_status kvpi_transport_xfer_sync(const kvpi_transport_ops *ops, void *peer,
                                    kvpi_slice *const *slices, size_t n)
{
    sync_xfer s = {.x = {.slices = slices, .n = n, .done = sync_done}};
    pthread_mutex_init(&s.lock, NULL);
    pthread_cond_init(&s.cond, NULL);
    if (ops->peer_run)
        ops->peer_run(peer, &s.x);
    else
        ops->peer_post(peer, &s.x);
    pthread_mutex_lock(&s.lock);
    while (!s.done)
        pthread_cond_wait(&s.cond, &s.lock);
    pthread_mutex_unlock(&s.lock);
    pthread_mutex_destroy(&s.lock);
    pthread_cond_destroy(&s.cond);
    return s.st ? kvpi_error(s.st, "%s", s.detail) : KVP_OK;
}
