/* The transports of this build and the protocol names that select them: the
 * one place where a name maps to an ops table. */
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
                       : !o->peer_open || !o->peer_xfer || !o->peer_close ? "peer_open/xfer/close"
                                                                          : NULL;
    if (!lack) return KVP_OK;
    return kvpi_error(KVP_EINVAL, "transport %s: its ops table lacks %s",
                      o->name ? o->name : "(unnamed)", lack);
}
