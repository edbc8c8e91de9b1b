/* Internal: which transport serves the protocol an engine is asked for.
 *
 * Mooncake's MC_FORCE_TCP is honoured here: set (to anything but "", "0",
 * "false", "no" or "off"), every engine uses "tcp" whatever its protocol says,
 * so stacks that hard-code "rdma" run on a build or host without it. */
#ifndef KVPI_ENGINE_PROTOCOL_H
#define KVPI_ENGINE_PROTOCOL_H

#include <stddef.h>

#include "kvpipe/status.h"
#include "transport/transport.h"

/* Non-zero when MC_FORCE_TCP asks for TCP. */
int kvpi_force_tcp(void);

/* The transport for protocol asked (NULL or "": "tcp"), after MC_FORCE_TCP.
 * KVP_ENOTSUP for a name this build has no transport for, with a message that
 * lists what it serves and says how to run over TCP. */
kvp_status kvpi_protocol_resolve(const char *asked, const kvpi_transport_ops **out);

/* The names of this build's transports, "tcp, shm", into out. */
void kvpi_protocol_names(char *out, size_t len);

#endif
