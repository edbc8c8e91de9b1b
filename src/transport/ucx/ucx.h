/* Internal: the ucx transport as its tests and tools see it (the parts:
 * runtime.h). */
#ifndef KVPI_TRANSPORT_UCX_UCX_H
#define KVPI_TRANSPORT_UCX_UCX_H

#include <stddef.h>

#include "transport/ucx/runtime.h"
#include "transport/ucx/wire.h"

/* The lanes UCX chose for a peer's endpoint (ucp_ep_print_info), one
 * "transport/device (roles)" each, comma-separated, into buf; returns the
 * length written. For logs and for tests that check what UCX used. */
size_t kvpi_ucx_peer_lanes(void *peer, char *buf, size_t len);

#endif
