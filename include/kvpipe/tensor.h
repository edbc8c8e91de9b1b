/* kvpipe tensors: a dtype, a shape and a block of memory with a known owner.
 *
 * A kvp_tensor describes contiguous, row-major (C order) data. It is a plain
 * struct: fill one on the stack with kvp_tensor_init() to describe memory you
 * own (it borrows it), or get a heap tensor from kvp_tensor_alloc(),
 * kvp_tensor_wrap() or kvp_pipe_recv() and release it with kvp_tensor_free().
 *
 * 0-d tensors (ndim 0, one element) and zero-size tensors (a 0 in the shape,
 * nbytes 0, data may be NULL) are valid.
 *
 * Threads: the functions here touch only their arguments; a tensor may be freed
 * from any thread.
 */
#ifndef KVPIPE_TENSOR_H
#define KVPIPE_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/export.h"
#include "kvpipe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types; the names are safetensors' dtype strings. Append-only. */
typedef enum kvp_dtype {
    KVP_DTYPE_BOOL = 0, /* "BOOL", 1 byte */
    KVP_DTYPE_U8,       /* "U8" */
    KVP_DTYPE_I8,       /* "I8" */
    KVP_DTYPE_I16,      /* "I16" */
    KVP_DTYPE_U16,      /* "U16" */
    KVP_DTYPE_I32,      /* "I32" */
    KVP_DTYPE_U32,      /* "U32" */
    KVP_DTYPE_I64,      /* "I64" */
    KVP_DTYPE_U64,      /* "U64" */
    KVP_DTYPE_F16,      /* "F16" */
    KVP_DTYPE_BF16,     /* "BF16" */
    KVP_DTYPE_F32,      /* "F32" */
    KVP_DTYPE_F64,      /* "F64" */
    KVP_DTYPE_F8_E4M3,  /* "F8_E4M3" */
    KVP_DTYPE_F8_E5M2,  /* "F8_E5M2" */
    KVP_DTYPE_COUNT     /* number of dtypes; not a dtype */
} kvp_dtype;

/* Most dimensions a tensor may have. */
#define KVP_TENSOR_MAX_NDIM 32

/* Called by kvp_tensor_free() to give the data back to its owner. */
typedef void (*kvp_tensor_release_fn)(void *owner, void *data);

typedef struct kvp_tensor {
    kvp_dtype dtype;
    int ndim;                           /* 0..KVP_TENSOR_MAX_NDIM */
    int64_t shape[KVP_TENSOR_MAX_NDIM]; /* each >= 0; entries past ndim unused */
    void *data;                         /* nbytes bytes, row-major */
    size_t nbytes;                      /* element size x product(shape) */
    kvp_tensor_release_fn release;      /* NULL: data is borrowed, nothing to do */
    void *owner;                        /* passed to release */
} kvp_tensor;

/* Bytes per element (1, 2, 4 or 8); 0 for an unknown dtype. */
KVP_API size_t kvp_dtype_size(kvp_dtype dtype);

/* The safetensors name ("F32"); NULL for an unknown dtype. */
KVP_API const char *kvp_dtype_name(kvp_dtype dtype);

/* Look a safetensors name up (exact, case-sensitive). KVP_EINVAL if unknown. */
KVP_API kvp_status kvp_dtype_from_name(const char *name, kvp_dtype *out);

/* Number of elements and bytes of a shape, with overflow checks: KVP_EINVAL
 * for an unknown dtype, ndim outside 0..KVP_TENSOR_MAX_NDIM, a negative
 * dimension, or a product that does not fit in size_t (even when a later
 * dimension is 0). numel may be NULL. */
KVP_API kvp_status kvp_tensor_size(kvp_dtype dtype, int ndim, const int64_t *shape, size_t *numel,
                                   size_t *nbytes);

/* Fill *t to describe data (borrowed: release NULL). data may be NULL only when
 * the size is 0. *t is written only on success. */
KVP_API kvp_status kvp_tensor_init(kvp_tensor *t, kvp_dtype dtype, int ndim, const int64_t *shape,
                                   void *data);

/* A heap tensor whose data is malloc'ed (zero-filled) and freed with it. */
KVP_API kvp_status kvp_tensor_alloc(kvp_dtype dtype, int ndim, const int64_t *shape,
                                    kvp_tensor **out);

/* A heap tensor over caller memory; kvp_tensor_free() calls release(owner,
 * data) when release is not NULL. On failure release is not called. */
KVP_API kvp_status kvp_tensor_wrap(kvp_dtype dtype, int ndim, const int64_t *shape, void *data,
                                   kvp_tensor_release_fn release, void *owner, kvp_tensor **out);

/* Release the data through its release callback, then free the struct. Only for
 * heap tensors from this header or from kvp_pipe_recv(). NULL is a no-op. */
KVP_API void kvp_tensor_free(kvp_tensor *t);

/* A copy of src in the GPU memory of CUDA device `device`, for a receiver
 * whose tensors live on a GPU (vLLM's pipe does tensor.to("cuda:N")): one
 * host-to-device copy by the CUDA driver, loaded at run time (docs/gpu.md).
 * (*out)->data is then device memory, which only the GPU and the driver may
 * touch; kvp_tensor_free() gives it back to the driver. src must be in host
 * memory. Blocks until the copy is done; thread-safe. KVP_ENOTSUP without a
 * driver (the message names what is missing), KVP_EINVAL for a bad device or
 * a src the CPU cannot read, KVP_ENOMEM, KVP_EIO when the copy fails. The
 * pipe's send takes such tensors back (kvp_pipe_send copies GPU memory
 * device-to-host into its message). */
KVP_API kvp_status kvp_tensor_to_cuda(const kvp_tensor *src, int device, kvp_tensor **out);

/* Number of elements (1 for 0-d). The tensor must be valid. */
KVP_API size_t kvp_tensor_numel(const kvp_tensor *t);

/* Non-zero when a and b have the same dtype, shape and bytes. */
KVP_API int kvp_tensor_equal(const kvp_tensor *a, const kvp_tensor *b);

#ifdef __cplusplus
}
#endif
#endif
