/* Internal: the ucx transport's server, what a target serves (target.c):
 * start and stop, registrations, the pool's chunks, the descriptor's
 * fields. The server is a runtime (runtime.h) first, so the engine's server
 * pointer is also the kvpi_ucx_rt * the initiator's side uses. */
#ifndef KVPI_TRANSPORT_UCX_TARGET_H
#define KVPI_TRANSPORT_UCX_TARGET_H

#include "transport/ucx/runtime.h"

kvp_status kvpi_ucx_server_start(const kvpi_server_ctx *ctx, void **server);
void kvpi_ucx_server_stop(void *server);
kvp_status kvpi_ucx_server_describe(void *server, cJSON *doc);
kvp_status kvpi_ucx_buffer_describe(void *server, const kvpi_region *region, void *handle,
                                    cJSON *buffer);
kvp_status kvpi_ucx_mem_reg(void *server, const kvpi_region *region, void **handle);
void kvpi_ucx_mem_dereg(void *server, void *handle);
kvp_status kvpi_ucx_chunk_map(void *server, size_t length, void **addr);
void kvpi_ucx_chunk_unmap(void *server, void *addr, size_t length);

#endif
