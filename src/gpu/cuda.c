/* The CUDA driver API through dlopen (see cuda.h; its types in
 * cuda_driver.h). The copy, stream-destroy, address-range and IPC-open entry
 * points are resolved under their _v2 names, the ones the toolkit's header
 * maps the plain names to. */
#include "gpu/cuda.h"

#include <dlfcn.h> /* in libc since glibc 2.34: no -ldl */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "gpu/cuda_driver.h"

_Static_assert(KVPI_CUDA_IPC_HANDLE_LEN == CU_IPC_HANDLE_SIZE, "an IPC handle is the driver's");

/* The primary contexts kvpipe retains (never released: they live as long as
 * the process, as the CUDA runtime's do). */
#define MAX_DEVICES 64

static struct {
    CUresult (*init)(unsigned);
    CUresult (*driver_version)(int *);
    CUresult (*device_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_get)(CUcontext *);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*pointer_attr)(void *, int, CUdeviceptr);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_sync)(CUstream);
    CUresult (*d2h_async)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*h2d_async)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*host_free)(void *);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*copy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*ipc_get)(CUipcMemHandle *, CUdeviceptr);
    CUresult (*ipc_open)(CUdeviceptr *, CUipcMemHandle, unsigned);
    CUresult (*ipc_close)(CUdeviceptr);
    CUresult (*error_string)(CUresult, const char **);
} cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static kvp_status load_status;
static char load_error[400];
static atomic_int active;

static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext primary[MAX_DEVICES];

struct kvpi_cuda_stream {
    CUstream stream;
    CUcontext ctx;
    int device;
};

static const char *err_name(CUresult r)
{
    const char *s = NULL;
    if (cu.error_string && cu.error_string(r, &s) == CUDA_SUCCESS && s) return s;
    return "unknown CUDA error";
}

#define RESOLVE(lib, field, name)                                                                  \
    do {                                                                                           \
        *(void **)&cu.field = dlsym(lib, name);                                                    \
        if (!cu.field) {                                                                           \
            snprintf(load_error, sizeof load_error,                                                \
                     "CUDA: the driver %s lacks %s (a driver older than CUDA 11?)", path, name);   \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static void load(void)
{
    load_status = KVP_ENOTSUP;
    const char *env = getenv("KVPIPE_LIBCUDA");
    const char *path = env && env[0] ? env : "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(load_error, sizeof load_error,
                 "CUDA: %s not found (no NVIDIA driver on this host, or KVPIPE_LIBCUDA names "
                 "no library): %s",
                 path, dlerror());
        return;
    }
    RESOLVE(lib, error_string, "cuGetErrorString");
    RESOLVE(lib, init, "cuInit");
    RESOLVE(lib, driver_version, "cuDriverGetVersion");
    RESOLVE(lib, device_count, "cuDeviceGetCount");
    RESOLVE(lib, device_get, "cuDeviceGet");
    RESOLVE(lib, primary_retain, "cuDevicePrimaryCtxRetain");
    RESOLVE(lib, ctx_get, "cuCtxGetCurrent");
    RESOLVE(lib, ctx_set, "cuCtxSetCurrent");
    RESOLVE(lib, pointer_attr, "cuPointerGetAttribute");
    RESOLVE(lib, stream_create, "cuStreamCreate");
    RESOLVE(lib, stream_destroy, "cuStreamDestroy_v2");
    RESOLVE(lib, stream_sync, "cuStreamSynchronize");
    RESOLVE(lib, d2h_async, "cuMemcpyDtoHAsync_v2");
    RESOLVE(lib, h2d_async, "cuMemcpyHtoDAsync_v2");
    RESOLVE(lib, host_alloc, "cuMemHostAlloc");
    RESOLVE(lib, host_free, "cuMemFreeHost");
    RESOLVE(lib, mem_alloc, "cuMemAlloc_v2");
    RESOLVE(lib, mem_free, "cuMemFree_v2");
    RESOLVE(lib, copy_async, "cuMemcpyAsync");
    RESOLVE(lib, address_range, "cuMemGetAddressRange_v2");
    RESOLVE(lib, ipc_get, "cuIpcGetMemHandle");
    RESOLVE(lib, ipc_open, "cuIpcOpenMemHandle_v2");
    RESOLVE(lib, ipc_close, "cuIpcCloseMemHandle");
    CUresult r = cu.init(0);
    if (r != CUDA_SUCCESS) {
        snprintf(load_error, sizeof load_error, "CUDA: cuInit failed (%s): %s", path, err_name(r));
        return;
    }
    load_status = KVP_OK;
    atomic_store(&active, 1);
    KVPI_DEBUG("CUDA driver loaded from %s", path);
}

kvp_status kvpi_cuda_load(void)
{
    pthread_once(&load_once, load);
    if (load_status) return kvpi_error(load_status, "%s", load_error);
    return KVP_OK;
}

int kvpi_cuda_active(void)
{
    return atomic_load_explicit(&active, memory_order_acquire);
}

kvp_status kvpi_cuda_info(int *version, int *devices)
{
    kvp_status st = kvpi_cuda_load();
    if (st) return st;
    CUresult r = cu.driver_version(version);
    if (r == CUDA_SUCCESS) r = cu.device_count(devices);
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_EIO, "CUDA: cannot query the driver: %s", err_name(r));
    return KVP_OK;
}

kvp_status kvpi_cuda_classify(const void *p, kvpi_ptr_kind *kind, int *device)
{
    kvp_status st = kvpi_cuda_load();
    if (st) return st;
    CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)p;
    unsigned type = 0, managed = 0;
    int ordinal = 0;
    CUresult r = cu.pointer_attr(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr);
    if (r == CUDA_ERROR_INVALID_VALUE) { /* memory the driver does not know */
        *kind = KVPI_PTR_HOST;
        *device = 0;
        return KVP_OK;
    }
    if (r == CUDA_SUCCESS) r = cu.pointer_attr(&managed, CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr);
    if (r == CUDA_SUCCESS && type != CU_MEMORYTYPE_HOST)
        r = cu.pointer_attr(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_EIO, "CUDA: cuPointerGetAttribute(%p): %s", p, err_name(r));
    if (managed) {
        *kind = KVPI_PTR_MANAGED;
    } else if (type == CU_MEMORYTYPE_HOST) {
        *kind = KVPI_PTR_HOST_REGISTERED;
        ordinal = 0;
    } else if (type == CU_MEMORYTYPE_DEVICE || type == CU_MEMORYTYPE_UNIFIED) {
        *kind = KVPI_PTR_DEVICE;
    } else {
        return kvpi_error(KVP_ENOTSUP,
                          "CUDA: %p is a CUDA array (memory type %u), not linear "
                          "memory",
                          p, type);
    }
    *device = ordinal;
    return KVP_OK;
}

kvp_status kvpi_cuda_range_device(const void *p, size_t length, int *device)
{
    kvpi_ptr_kind first, last;
    int dev_first, dev_last;
    kvp_status st = kvpi_cuda_classify(p, &first, &dev_first);
    if (!st && length) st = kvpi_cuda_classify((const char *)p + length - 1, &last, &dev_last);
    if (st) return st;
    int device_mem = first == KVPI_PTR_DEVICE || first == KVPI_PTR_MANAGED;
    if (!device_mem || (length && (last != first || dev_last != dev_first)))
        return kvpi_error(KVP_EINVAL, "[%p, +%zu) is not CUDA device memory (%s)", p, length,
                          device_mem ? "its last byte is not in the same device's memory"
                          : first == KVPI_PTR_HOST ? "the CUDA driver does not know it"
                                                   : "the driver says pinned host memory");
    *device = dev_first;
    return KVP_OK;
}

/* The primary context of device ordinal, retained once. */
static kvp_status primary_ctx(int ordinal, CUcontext *out)
{
    if (ordinal < 0 || ordinal >= MAX_DEVICES)
        return kvpi_error(KVP_EINVAL, "CUDA: device %d is out of range", ordinal);
    pthread_mutex_lock(&ctx_lock);
    CUresult r = CUDA_SUCCESS;
    if (!primary[ordinal]) {
        CUdevice dev;
        r = cu.device_get(&dev, ordinal);
        if (r == CUDA_SUCCESS) r = cu.primary_retain(&primary[ordinal], dev);
    }
    *out = primary[ordinal];
    pthread_mutex_unlock(&ctx_lock);
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_EIO, "CUDA: device %d: no primary context: %s", ordinal, err_name(r));
    return KVP_OK;
}

/* Make ctx current on this thread for a call, and put the caller's back
 * after it: an application thread that posts inline keeps its own. */
static CUresult ctx_push(CUcontext ctx, CUcontext *saved)
{
    CUresult r = cu.ctx_get(saved);
    if (r == CUDA_SUCCESS && *saved != ctx) r = cu.ctx_set(ctx);
    return r;
}

static void ctx_pop(CUcontext ctx, CUcontext saved)
{
    if (saved != ctx) cu.ctx_set(saved);
}

kvp_status kvpi_cuda_stream_create(int device, kvpi_cuda_stream **out)
{
    kvp_status st = kvpi_cuda_load();
    CUcontext ctx = NULL, saved = NULL;
    if (st || (st = primary_ctx(device, &ctx))) return st;
    kvpi_cuda_stream *s = calloc(1, sizeof *s);
    if (!s) return kvpi_error(KVP_ENOMEM, "CUDA: out of memory");
    CUresult r = ctx_push(ctx, &saved);
    if (r == CUDA_SUCCESS) {
        r = cu.stream_create(&s->stream, CU_STREAM_NON_BLOCKING);
        ctx_pop(ctx, saved);
    }
    if (r != CUDA_SUCCESS) {
        free(s);
        return kvpi_error(KVP_EIO, "CUDA: device %d: cuStreamCreate: %s", device, err_name(r));
    }
    s->ctx = ctx;
    s->device = device;
    *out = s;
    return KVP_OK;
}

void kvpi_cuda_stream_destroy(kvpi_cuda_stream *s)
{
    if (!s) return;
    cu.stream_destroy(s->stream);
    free(s);
}

int kvpi_cuda_stream_device(const kvpi_cuda_stream *s)
{
    return s->device;
}

/* A copy in ctx on stream (NULL: the legacy default stream), waited for when
 * wait is set. */
static kvp_status copy_on(CUcontext ctx, CUstream stream, int device, void *dst, const void *src,
                          size_t n, int d2h, int wait)
{
    CUcontext saved = NULL;
    CUresult r = ctx_push(ctx, &saved);
    if (r == CUDA_SUCCESS) {
        r = d2h ? cu.d2h_async(dst, (CUdeviceptr)(uintptr_t)src, n, stream)
                : cu.h2d_async((CUdeviceptr)(uintptr_t)dst, src, n, stream);
        if (r == CUDA_SUCCESS && wait) r = cu.stream_sync(stream);
        ctx_pop(ctx, saved);
    }
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_EIO, "CUDA: device %d: copy of %zu bytes %s failed: %s", device, n,
                          d2h ? "device to host" : "host to device", err_name(r));
    return KVP_OK;
}

static kvp_status enqueue(kvpi_cuda_stream *s, void *dst, const void *src, size_t n, int d2h)
{
    return copy_on(s->ctx, s->stream, s->device, dst, src, n, d2h, 0);
}

kvp_status kvpi_cuda_copy_d2h_async(kvpi_cuda_stream *s, void *dst, const void *src, size_t n)
{
    return enqueue(s, dst, src, n, 1);
}

kvp_status kvpi_cuda_copy_h2d_async(kvpi_cuda_stream *s, void *dst, const void *src, size_t n)
{
    return enqueue(s, dst, src, n, 0);
}

kvp_status kvpi_cuda_stream_sync(kvpi_cuda_stream *s)
{
    CUcontext saved = NULL;
    CUresult r = ctx_push(s->ctx, &saved);
    if (r == CUDA_SUCCESS) {
        r = cu.stream_sync(s->stream);
        ctx_pop(s->ctx, saved);
    }
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_EIO, "CUDA: device %d: a copy between device and host failed: %s",
                          s->device, err_name(r));
    return KVP_OK;
}

kvp_status kvpi_cuda_host_alloc(size_t n, void **out)
{
    kvp_status st = kvpi_cuda_load();
    CUcontext ctx = NULL, saved = NULL;
    /* cuMemHostAlloc needs a current context; PORTABLE makes the memory
     * pinned for every context, so device 0's serves all devices. */
    if (st || (st = primary_ctx(0, &ctx))) return st;
    CUresult r = ctx_push(ctx, &saved);
    if (r == CUDA_SUCCESS) {
        r = cu.host_alloc(out, n, CU_MEMHOSTALLOC_PORTABLE);
        ctx_pop(ctx, saved);
    }
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_ENOMEM, "CUDA: cuMemHostAlloc of %zu bytes: %s", n, err_name(r));
    return KVP_OK;
}

void kvpi_cuda_host_free(void *p)
{
    if (p && kvpi_cuda_active()) cu.host_free(p);
}

kvp_status kvpi_cuda_copy_sync(void *dst, const void *src, size_t n, int device, int d2h)
{
    kvp_status st = kvpi_cuda_load();
    CUcontext ctx = NULL;
    if (st || (st = primary_ctx(device, &ctx))) return st;
    /* On the legacy default stream (NULL): ordered after the work that a
     * DLPack producer synchronised to it when it exported the tensor. */
    return copy_on(ctx, NULL, device, dst, src, n, d2h, 1);
}

kvp_status kvpi_cuda_mem_alloc(int device, size_t n, void **out)
{
    kvp_status st = kvpi_cuda_load();
    CUcontext ctx = NULL, saved = NULL;
    if (st || (st = primary_ctx(device, &ctx))) return st;
    CUdeviceptr p = 0;
    CUresult r = ctx_push(ctx, &saved);
    if (r == CUDA_SUCCESS) {
        r = cu.mem_alloc(&p, n ? n : 1);
        ctx_pop(ctx, saved);
    }
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_ENOMEM, "CUDA: device %d: cuMemAlloc of %zu bytes: %s", device, n,
                          err_name(r));
    *out = (void *)(uintptr_t)p;
    return KVP_OK;
}

typedef CUresult (*release_fn)(CUdeviceptr);

/* Give p back with *release (cuMemFree, cuIpcCloseMemHandle: read once the
 * driver is known to be loaded) in device's context; nothing when there is
 * nothing to give back. */
static void release_in(int device, void *p, const release_fn *release)
{
    CUcontext ctx = NULL, saved = NULL;
    if (!p || !kvpi_cuda_active() || primary_ctx(device, &ctx)) return;
    if (ctx_push(ctx, &saved) != CUDA_SUCCESS) return;
    (*release)((CUdeviceptr)(uintptr_t)p);
    ctx_pop(ctx, saved);
}

void kvpi_cuda_mem_free(int device, void *p)
{
    release_in(device, p, &cu.mem_free);
}

kvp_status kvpi_cuda_ipc_export(int device, const void *p, uint64_t *base, uint64_t *size,
                                unsigned char handle[KVPI_CUDA_IPC_HANDLE_LEN])
{
    kvp_status st = kvpi_cuda_load();
    CUcontext ctx = NULL, saved = NULL;
    if (st || (st = primary_ctx(device, &ctx))) return st;
    CUdeviceptr b = 0;
    size_t n = 0;
    CUipcMemHandle h;
    CUresult r = ctx_push(ctx, &saved);
    if (r == CUDA_SUCCESS) {
        r = cu.address_range(&b, &n, (CUdeviceptr)(uintptr_t)p);
        if (r == CUDA_SUCCESS) r = cu.ipc_get(&h, b);
        ctx_pop(ctx, saved);
    }
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_ENOTSUP,
                          "CUDA: device %d: no IPC handle for the allocation of %p: %s", device, p,
                          err_name(r));
    *base = b;
    *size = n;
    memcpy(handle, h.reserved, sizeof h.reserved);
    return KVP_OK;
}

kvp_status kvpi_cuda_ipc_open(int device, const unsigned char handle[KVPI_CUDA_IPC_HANDLE_LEN],
                              void **mapped)
{
    kvp_status st = kvpi_cuda_load();
    CUcontext ctx = NULL, saved = NULL;
    if (st || (st = primary_ctx(device, &ctx))) return st;
    CUipcMemHandle h;
    memcpy(h.reserved, handle, sizeof h.reserved);
    CUdeviceptr p = 0;
    CUresult r = ctx_push(ctx, &saved);
    if (r == CUDA_SUCCESS) {
        r = cu.ipc_open(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
        ctx_pop(ctx, saved);
    }
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_ENOTSUP, "CUDA: device %d: cuIpcOpenMemHandle refused: %s", device,
                          err_name(r));
    *mapped = (void *)(uintptr_t)p;
    return KVP_OK;
}

void kvpi_cuda_ipc_close(int device, void *mapped)
{
    release_in(device, mapped, &cu.ipc_close);
}

kvp_status kvpi_cuda_copy_ipc(int device, void *dst, const void *src, size_t n)
{
    kvp_status st = kvpi_cuda_load();
    CUcontext ctx = NULL, saved = NULL;
    if (st || (st = primary_ctx(device, &ctx))) return st;
    CUresult r = ctx_push(ctx, &saved);
    if (r == CUDA_SUCCESS) {
        /* A device-to-device cuMemcpy may return before it is done: wait. */
        r = cu.copy_async((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n, NULL);
        if (r == CUDA_SUCCESS) r = cu.stream_sync(NULL);
        ctx_pop(ctx, saved);
    }
    if (r != CUDA_SUCCESS)
        return kvpi_error(KVP_EIO, "CUDA: device %d: copy of %zu bytes through CUDA IPC failed: %s",
                          device, n, err_name(r));
    return KVP_OK;
}
