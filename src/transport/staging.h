/* Internal: device memory moved through pinned host bounce buffers, for the
 * transports whose bytes the CPU moves (tcp, shm). One helper for both, on
 * either side of a transfer; the wire never changes, so a peer cannot tell
 * device memory from host memory.
 *
 * Bounce buffers come from two bounded process-wide pools, one for the
 * initiator side and one for the target side (so that an initiator waiting
 * on a target of the same process never holds what the target needs):
 * KVPIPE_CUDA_BOUNCE_BUFFERS buffers each (default 8) of
 * KVPIPE_CUDA_BOUNCE_BYTES (default 4 MiB), pinned (cuMemHostAlloc),
 * allocated on first use and kept until the process exits. Each buffer has
 * its own stream; a thread holds a buffer only while it moves one group of
 * slices or one served request, and waits for one when all are taken. A
 * buffer is used as two halves, so that the driver's copy of one half
 * overlaps the I/O of the other (the copy of piece n+1 runs on the stream
 * while piece n is on the wire).
 *
 * Device memory is touched only by the driver's copies (gpu/cuda.h); the
 * CPU touches the bounce buffers only.
 */
#ifndef KVPI_TRANSPORT_STAGING_H
#define KVPI_TRANSPORT_STAGING_H

#include <stdint.h>

#include "transport/runner.h"

/* Initiator side: run n slices through run (a transport's blocking run
 * function), with every slice whose local memory is device memory
 * (kvpi_slice.local_kind) replaced by pieces of a bounce buffer: copied
 * device to host before a WRITE is sent, host to device after a READ's
 * bytes arrived. A group with more device bytes than half a buffer holds
 * runs as several calls of run, a slice longer than that as several pieces
 * (more requests on the wire, each inside the slice's remote range). With
 * no device slice it is run itself, at the cost of one pass over the
 * slices. Sets every slice's status; returns what run's contract says, or
 * KVP_EIO when a copy failed (the slices it failed say so; a WRITE whose
 * copy failed sent nothing of that piece). */
kvp_status kvpi_stage_run(kvpi_run_fn run, void *peer, kvpi_slice *const *slices, size_t n,
                          uint64_t start_ns, uint64_t deadline);

/* Target side: the transport's I/O for one bounce buffer of a served
 * request: send len bytes from buf (a READ) or receive len bytes into it
 * (a WRITE), the request's bytes at offset off from its start. */
typedef kvp_status (*kvpi_stage_io)(void *ctx, void *buf, size_t len, uint64_t off);

/* Serve a request on the registered device memory [addr, addr+len) of
 * device: a READ copies each half buffer's worth device to host and then
 * hands it to io (copying the next meanwhile); a WRITE has io fill a half and
 * then copies it host to device (while io fills the other). After a failed
 * copy a WRITE still has io take the rest, so that the caller's stream stays
 * in step.
 * *moved counts the bytes io moved. On failure: *copy_failed is 1 when a
 * driver copy failed (KVP_EIO, kvp_last_error() saying which; for a READ,
 * io was not called for that buffer), 0 when io failed (its status). */
kvp_status kvpi_stage_serve(kvp_opcode op, int device, uint64_t addr, uint64_t len,
                            kvpi_stage_io io, void *ctx, uint64_t *moved, int *copy_failed);

#endif
