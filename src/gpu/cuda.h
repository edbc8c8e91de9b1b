/* Internal: the CUDA driver API, loaded at run time.
 *
 * kvpipe has no build-time CUDA dependency: the first call that needs the
 * driver dlopen()s libcuda.so.1 (env KVPIPE_LIBCUDA=path names another file:
 * the tests' double, tests/support/fake_cuda/) and resolves the few entry
 * points below, declared here from NVIDIA's documented signatures. Without a
 * driver every function fails with KVP_ENOTSUP saying what is missing
 * (libcuda.so.1 not found, an entry point missing, cuInit's error), and
 * nothing else of kvpipe changes.
 *
 * Contexts: copies run in the device's primary context (the one the CUDA
 * runtime, and so PyTorch, uses), made current on the calling thread by each
 * copy. Streams belong to whoever creates them (the staging pool: one per
 * bounce buffer). Thread-safe; loading happens once.
 */
#ifndef KVPI_GPU_CUDA_H
#define KVPI_GPU_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/status.h"

/* What a pointer is, as the driver sees it. */
typedef enum kvpi_ptr_kind {
    KVPI_PTR_HOST,            /* plain host memory the driver does not know */
    KVPI_PTR_HOST_REGISTERED, /* pinned host memory (cuMemHostAlloc/Register) */
    KVPI_PTR_DEVICE,          /* device memory: the CPU must not touch it */
    KVPI_PTR_MANAGED,         /* managed (unified) memory */
} kvpi_ptr_kind;

/* Load the driver and cuInit, once. KVP_ENOTSUP naming what is missing. */
kvp_status kvpi_cuda_load(void);

/* Non-zero once kvpi_cuda_load succeeded in this process: only then can a
 * pointer be device memory that kvpipe must classify. Costs an atomic load. */
int kvpi_cuda_active(void);

/* Classify p (one driver call, or two for device memory). *device is the
 * CUDA ordinal for device and managed memory, else 0. KVP_ENOTSUP without a
 * driver; KVP_EIO when the driver fails. */
kvp_status kvpi_cuda_classify(const void *p, kvpi_ptr_kind *kind, int *device);

/* The CUDA device whose memory holds [p, p+length): device or managed
 * memory, its first and last byte on that device (two driver calls).
 * KVP_EINVAL, saying what the driver says instead, when it is not; the
 * errors of kvpi_cuda_classify. */
kvp_status kvpi_cuda_range_device(const void *p, size_t length, int *device);

/* The driver's version (e.g. 12040) and its device count, for `kvpipe info`.
 * KVP_ENOTSUP without a driver. */
kvp_status kvpi_cuda_info(int *version, int *devices);

/* A stream of device's primary context; NULL-safe destroy. */
typedef struct kvpi_cuda_stream kvpi_cuda_stream;
kvp_status kvpi_cuda_stream_create(int device, kvpi_cuda_stream **out);
void kvpi_cuda_stream_destroy(kvpi_cuda_stream *s);
int kvpi_cuda_stream_device(const kvpi_cuda_stream *s);

/* Enqueue a copy of n bytes between device memory and (pinned) host memory
 * on stream s; kvpi_cuda_stream_sync waits for every copy enqueued on s.
 * KVP_EIO with the driver's error string on failure (then the destination's
 * bytes are unspecified; a failed sync fails every copy it waited for). */
kvp_status kvpi_cuda_copy_d2h_async(kvpi_cuda_stream *s, void *dst, const void *src, size_t n);
kvp_status kvpi_cuda_copy_h2d_async(kvpi_cuda_stream *s, void *dst, const void *src, size_t n);
kvp_status kvpi_cuda_stream_sync(kvpi_cuda_stream *s);

/* Copy n bytes between device memory of device and host memory (d2h: from
 * src on the device to dst), on the legacy default stream, and wait for it.
 * For the pipe's tensors: one call per tensor. KVP_EIO naming the device on
 * failure. */
kvp_status kvpi_cuda_copy_sync(void *dst, const void *src, size_t n, int device, int d2h);

/* Device memory of device (cuMemAlloc in its primary context), and its free
 * (NULL-safe). */
kvp_status kvpi_cuda_mem_alloc(int device, size_t n, void **out);
void kvpi_cuda_mem_free(int device, void *p);

/* Pinned, portable host memory (cuMemHostAlloc), and its free. */
kvp_status kvpi_cuda_host_alloc(size_t n, void **out);
void kvpi_cuda_host_free(void *p);

/* CUDA IPC: device memory of one process reached by another on the same
 * host. An IPC handle names a whole allocation (cuMemAlloc), so the
 * exporter gives out the allocation that holds p: its base and size
 * (cuMemGetAddressRange) and its handle (cuIpcGetMemHandle), in device's
 * primary context. KVP_ENOTSUP with the driver's reason when it cannot
 * (memory of cuMemCreate, as PyTorch's expandable segments are). */
#define KVPI_CUDA_IPC_HANDLE_LEN 64
kvp_status kvpi_cuda_ipc_export(int device, const void *p, uint64_t *base, uint64_t *size,
                                unsigned char handle[KVPI_CUDA_IPC_HANDLE_LEN]);

/* The importer maps a handle into device's primary context
 * (cuIpcOpenMemHandle, peer access enabled lazily): *mapped is the
 * allocation's base here, device memory. KVP_ENOTSUP with the driver's
 * reason when it refuses (another container, MIG, a handle of this very
 * process). kvpi_cuda_ipc_close unmaps it (cuIpcCloseMemHandle). */
kvp_status kvpi_cuda_ipc_open(int device, const unsigned char handle[KVPI_CUDA_IPC_HANDLE_LEN],
                              void **mapped);
void kvpi_cuda_ipc_close(int device, void *mapped);

/* Copy n bytes from src to dst, one of them memory mapped by
 * kvpi_cuda_ipc_open, the other device memory (of any device) or host
 * memory, in device's primary context on the legacy default stream
 * (cuMemcpyAsync: the driver infers the direction), and wait for it.
 * KVP_EIO with the driver's error string on failure (then dst's bytes are
 * unspecified). */
kvp_status kvpi_cuda_copy_ipc(int device, void *dst, const void *src, size_t n);

#endif
