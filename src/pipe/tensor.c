#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/region.h"
#include "gpu/cuda.h"
#include "kvpipe/tensor.h"

static const struct {
    const char *name;
    size_t size;
} dtypes[KVP_DTYPE_COUNT] = {
    [KVP_DTYPE_BOOL] = {"BOOL", 1},       [KVP_DTYPE_U8] = {"U8", 1},
    [KVP_DTYPE_I8] = {"I8", 1},           [KVP_DTYPE_I16] = {"I16", 2},
    [KVP_DTYPE_U16] = {"U16", 2},         [KVP_DTYPE_I32] = {"I32", 4},
    [KVP_DTYPE_U32] = {"U32", 4},         [KVP_DTYPE_I64] = {"I64", 8},
    [KVP_DTYPE_U64] = {"U64", 8},         [KVP_DTYPE_F16] = {"F16", 2},
    [KVP_DTYPE_BF16] = {"BF16", 2},       [KVP_DTYPE_F32] = {"F32", 4},
    [KVP_DTYPE_F64] = {"F64", 8},         [KVP_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [KVP_DTYPE_F8_E5M2] = {"F8_E5M2", 1},
};

static int dtype_known(kvp_dtype dtype)
{
    return (unsigned)dtype < KVP_DTYPE_COUNT;
}

size_t kvp_dtype_size(kvp_dtype dtype)
{
    return dtype_known(dtype) ? dtypes[dtype].size : 0;
}

const char *kvp_dtype_name(kvp_dtype dtype)
{
    return dtype_known(dtype) ? dtypes[dtype].name : NULL;
}

kvp_status kvp_dtype_from_name(const char *name, kvp_dtype *out)
{
    if (!name || !out) return kvpi_error(KVP_EINVAL, "dtype name: NULL argument");
    for (int i = 0; i < KVP_DTYPE_COUNT; i++) {
        if (strcmp(name, dtypes[i].name) == 0) {
            *out = (kvp_dtype)i;
            return KVP_OK;
        }
    }
    return kvpi_error(KVP_EINVAL, "unknown dtype '%.32s'", name);
}

kvp_status kvp_tensor_size(kvp_dtype dtype, int ndim, const int64_t *shape, size_t *numel,
                           size_t *nbytes)
{
    if (!dtype_known(dtype)) return kvpi_error(KVP_EINVAL, "unknown dtype %d", (int)dtype);
    if (ndim < 0 || ndim > KVP_TENSOR_MAX_NDIM)
        return kvpi_error(KVP_EINVAL, "ndim %d outside 0..%d", ndim, KVP_TENSOR_MAX_NDIM);
    if (ndim > 0 && !shape) return kvpi_error(KVP_EINVAL, "shape is NULL with ndim %d", ndim);
    if (!nbytes) return kvpi_error(KVP_EINVAL, "tensor size: NULL output");
    /* Every prefix product must fit, even if a later dimension is 0: a shape
     * whose non-zero part cannot be represented is refused outright rather than
     * accepted because of a zero somewhere. */
    size_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return kvpi_error(KVP_EINVAL, "dimension %d is negative (%lld)", i,
                              (long long)shape[i]);
        if ((uint64_t)shape[i] > SIZE_MAX)
            return kvpi_error(KVP_EINVAL, "dimension %d (%lld) too large", i, (long long)shape[i]);
        size_t d = (size_t)shape[i];
        if (d != 0 && n > SIZE_MAX / d)
            return kvpi_error(KVP_EINVAL, "shape overflows: product of dimensions too large");
        n = d == 0 ? 0 : n * d;
    }
    size_t es = dtypes[dtype].size;
    if (n > SIZE_MAX / es) return kvpi_error(KVP_EINVAL, "shape overflows: byte size too large");
    if (numel) *numel = n;
    *nbytes = n * es;
    return KVP_OK;
}

kvp_status kvp_tensor_init(kvp_tensor *t, kvp_dtype dtype, int ndim, const int64_t *shape,
                           void *data)
{
    if (!t) return kvpi_error(KVP_EINVAL, "tensor init: NULL tensor");
    size_t nbytes;
    kvp_status st = kvp_tensor_size(dtype, ndim, shape, NULL, &nbytes);
    if (st) return st;
    if (!data && nbytes)
        return kvpi_error(KVP_EINVAL, "tensor data is NULL but size is %zu", nbytes);
    memset(t, 0, sizeof *t);
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    t->data = data;
    t->nbytes = nbytes;
    return KVP_OK;
}

static void release_free(void *owner, void *data)
{
    (void)owner;
    free(data);
}

kvp_status kvp_tensor_alloc(kvp_dtype dtype, int ndim, const int64_t *shape, kvp_tensor **out)
{
    size_t nbytes;
    kvp_status st = kvp_tensor_size(dtype, ndim, shape, NULL, &nbytes);
    if (st) return st;
    if (!out) return kvpi_error(KVP_EINVAL, "tensor alloc: NULL output");
    /* calloc(1, 0) may return NULL; ask for one byte so that NULL means ENOMEM. */
    void *data = calloc(1, nbytes ? nbytes : 1);
    if (!data) return kvpi_error(KVP_ENOMEM, "tensor of %zu bytes: out of memory", nbytes);
    st = kvp_tensor_wrap(dtype, ndim, shape, data, release_free, NULL, out);
    if (st) free(data);
    return st;
}

kvp_status kvp_tensor_wrap(kvp_dtype dtype, int ndim, const int64_t *shape, void *data,
                           kvp_tensor_release_fn release, void *owner, kvp_tensor **out)
{
    if (!out) return kvpi_error(KVP_EINVAL, "tensor wrap: NULL output");
    kvp_tensor tmp;
    kvp_status st = kvp_tensor_init(&tmp, dtype, ndim, shape, data);
    if (st) return st;
    kvp_tensor *t = malloc(sizeof *t);
    if (!t) return kvpi_error(KVP_ENOMEM, "tensor: out of memory");
    *t = tmp;
    t->release = release;
    t->owner = owner;
    *out = t;
    return KVP_OK;
}

void kvp_tensor_free(kvp_tensor *t)
{
    if (!t) return;
    if (t->release) t->release(t->owner, t->data);
    free(t);
}

static void release_cuda(void *owner, void *data)
{
    kvpi_cuda_mem_free((int)(intptr_t)owner, data);
}

kvp_status kvp_tensor_to_cuda(const kvp_tensor *src, int device, kvp_tensor **out)
{
    if (!src || !out) return kvpi_error(KVP_EINVAL, "tensor to cuda: NULL argument");
    if (device < 0) return kvpi_error(KVP_EINVAL, "tensor to cuda: device %d", device);
    if (kvpi_memory_readable(src->data, src->nbytes) == 0)
        return kvpi_error(KVP_EINVAL,
                          "tensor to cuda: the source's %zu bytes at %p cannot be read by the CPU "
                          "(it must be in host memory)",
                          src->nbytes, src->data);
    kvp_status st;
    void *dev = NULL;
    if ((st = kvpi_cuda_mem_alloc(device, src->nbytes, &dev))) return st;
    if (src->nbytes && (st = kvpi_cuda_copy_sync(dev, src->data, src->nbytes, device, 0))) {
        kvpi_cuda_mem_free(device, dev);
        return st;
    }
    st = kvp_tensor_wrap(src->dtype, src->ndim, src->shape, dev, release_cuda,
                         (void *)(intptr_t)device, out);
    if (st) kvpi_cuda_mem_free(device, dev);
    return st;
}

size_t kvp_tensor_numel(const kvp_tensor *t)
{
    size_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= (size_t)t->shape[i];
    return n;
}

int kvp_tensor_equal(const kvp_tensor *a, const kvp_tensor *b)
{
    if (a->dtype != b->dtype || a->ndim != b->ndim || a->nbytes != b->nbytes) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0;
}
