/* A test double of the CUDA driver API: the entry points kvpipe's
 * src/gpu/cuda.c resolves, with "device memory" that the CPU cannot touch.
 *
 * Device memory is a memfd mapped twice: the addresses handed out are in a
 * PROT_NONE view, so any CPU access to them by kvpipe crashes the test
 * (SIGSEGV); only this double's copy functions reach the bytes, through a
 * private read-write view. Built only for tests (libfakecuda.so), loaded by
 * kvpipe through KVPIPE_LIBCUDA. A forked child gets a fresh device (its own
 * memfd) at its first call.
 *
 * CUDA IPC: a handle (cuIpcGetMemHandle of an allocation's base) holds the
 * exporter's pid, its memfd's descriptor number, the allocation's offset,
 * length and device; cuIpcOpenMemHandle in another process of the same user
 * opens /proc/<pid>/fd/<fd> and maps that range twice, as the device memory
 * above (a PROT_NONE view it hands out, a read-write one for its copies). As
 * the real driver, it refuses a handle of its own process.
 *
 * Knobs: FAKECUDA_DEVICES (default 2), FAKECUDA_INIT_FAIL=1 (cuInit fails
 * with CUDA_ERROR_NO_DEVICE), FAKECUDA_FAIL_COPY=N (the Nth copy of this
 * process fails with CUDA_ERROR_ILLEGAL_ADDRESS; fakecuda_fail_copy() sets it
 * at run time), FAKECUDA_IPC_REFUSE=1 (cuIpcOpenMemHandle fails with
 * CUDA_ERROR_NOT_SUPPORTED, as across containers or on MIG). Test helpers
 * (not driver API): fakecuda_peek/poke read and write device memory without
 * counting as copies; fakecuda_copies() counts every copy,
 * fakecuda_ipc_copies() those to or from memory opened by IPC. Beside
 * kvpipe's entry points, the double has those the GPU suite uses
 * (tests/gpu/): the synchronous copies, cuMemcpyDtoD_v2, cuCtxSynchronize,
 * and cuMemFree_v2 that frees (a freed range is no longer device memory). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpu/cuda_driver.h"

/* What this double puts in a handle. */
typedef struct ipc_handle {
    uint32_t magic;
    int32_t pid, fd, device;
    uint64_t off, len;
} ipc_handle;
#define IPC_MAGIC 0x46434950u

#define API __attribute__((visibility("default")))
#define OK 0
#define E_INVALID_VALUE 1
#define E_NOT_INITIALIZED 3
#define E_NO_DEVICE 100
#define E_INVALID_DEVICE 101
#define E_INVALID_CONTEXT 201
#define E_INVALID_HANDLE 400
#define E_ILLEGAL_ADDRESS 700
#define E_NOT_SUPPORTED 801

#define ARENA ((size_t)1 << 30)
#define MAX_ALLOCS 1024
#define MAX_DEV 8

struct CUctx_st {
    int device;
};
struct CUstream_st {
    uint32_t magic;
    CUcontext ctx;
};
#define STREAM_MAGIC 0x5354524du

static struct {
    pid_t pid;
    int inited;
    int devices;
    char *none; /* the PROT_NONE view: device addresses */
    char *rw;   /* the double's own view */
    size_t top;
    struct {
        size_t off, len;
        int device;
        int freed; /* by cuMemFree_v2: no longer an allocation */
    } allocs[MAX_ALLOCS];
    int n_allocs;
    struct {
        void *p;
        size_t len;
    } hosts[MAX_ALLOCS];
    int n_hosts;
    int fd; /* the memfd, for importers */
    struct {
        char *none, *rw; /* the views of another process's allocation */
        size_t len;
        size_t skip; /* from the page the views start at to the allocation */
    } imports[MAX_ALLOCS];
    int n_imports;
} S;
static struct CUctx_st ctxs[MAX_DEV];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread CUcontext current;
static atomic_long copies, ipc_copies, fail_at;

static void fresh(void)
{
    if (S.pid == getpid()) return;
    memset(&S, 0, sizeof S);
    S.pid = getpid();
    atomic_store(&copies, 0);
    atomic_store(&ipc_copies, 0);
    const char *f = getenv("FAKECUDA_FAIL_COPY");
    atomic_store(&fail_at, f ? atol(f) : 0);
}

API CUresult cuInit(unsigned flags)
{
    (void)flags;
    pthread_mutex_lock(&lock);
    fresh();
    CUresult r = OK;
    const char *fail = getenv("FAKECUDA_INIT_FAIL");
    if (fail && strcmp(fail, "1") == 0) {
        r = E_NO_DEVICE;
    } else if (!S.inited) {
        const char *d = getenv("FAKECUDA_DEVICES");
        S.devices = d ? atoi(d) : 2;
        if (S.devices > MAX_DEV) S.devices = MAX_DEV;
        int fd = memfd_create("fakecuda", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)ARENA) != 0) {
            r = E_NO_DEVICE;
        } else {
            S.none = mmap(NULL, ARENA, PROT_NONE, MAP_SHARED, fd, 0);
            S.rw = mmap(NULL, ARENA, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            r = S.none == MAP_FAILED || S.rw == MAP_FAILED ? E_NO_DEVICE : OK;
            S.inited = r == OK;
        }
        if (r == OK)
            S.fd = fd;
        else if (fd >= 0)
            close(fd);
        for (int i = 0; i < MAX_DEV; i++)
            ctxs[i].device = i;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

API CUresult cuGetErrorString(CUresult r, const char **s)
{
    switch (r) {
    case OK:
        *s = "no error";
        break;
    case E_INVALID_VALUE:
        *s = "invalid argument";
        break;
    case E_NOT_INITIALIZED:
        *s = "initialization error";
        break;
    case E_NO_DEVICE:
        *s = "no CUDA-capable device is detected";
        break;
    case E_INVALID_DEVICE:
        *s = "invalid device ordinal";
        break;
    case E_INVALID_CONTEXT:
        *s = "invalid device context";
        break;
    case E_INVALID_HANDLE:
        *s = "invalid resource handle";
        break;
    case E_ILLEGAL_ADDRESS:
        *s = "an illegal memory access was encountered";
        break;
    case E_NOT_SUPPORTED:
        *s = "operation not supported";
        break;
    default:
        *s = NULL;
        return E_INVALID_VALUE;
    }
    return OK;
}

API CUresult cuDriverGetVersion(int *v)
{
    *v = 12040;
    return OK;
}

static int ready(void)
{
    return S.inited && S.pid == getpid();
}

API CUresult cuDeviceGetCount(int *n)
{
    if (!ready()) return E_NOT_INITIALIZED;
    *n = S.devices;
    return OK;
}

API CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= S.devices) return E_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (d < 0 || d >= S.devices) return E_INVALID_DEVICE;
    *c = &ctxs[d];
    return OK;
}

API CUresult cuCtxGetCurrent(CUcontext *c)
{
    *c = current;
    return OK;
}

API CUresult cuCtxSetCurrent(CUcontext c)
{
    current = c;
    return OK;
}

/* The allocation holding [p, p+n) in the device view, or -1. */
static int alloc_of(CUdeviceptr p, size_t n)
{
    uintptr_t base = (uintptr_t)S.none;
    if (!ready() || p < base || p >= base + ARENA) return -1;
    size_t off = (size_t)(p - base);
    for (int i = 0; i < S.n_allocs; i++)
        if (!S.allocs[i].freed && off >= S.allocs[i].off &&
            off - S.allocs[i].off + n <= S.allocs[i].len)
            return i;
    return -1;
}

static int host_of(CUdeviceptr p)
{
    for (int i = 0; i < S.n_hosts; i++)
        if (p >= (uintptr_t)S.hosts[i].p && p < (uintptr_t)S.hosts[i].p + S.hosts[i].len) return i;
    return -1;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    size_t len = (n + 255) & ~(size_t)255;
    CUresult r = OK;
    if (S.n_allocs == MAX_ALLOCS || S.top + len > ARENA) {
        r = 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    } else {
        S.allocs[S.n_allocs].off = S.top;
        S.allocs[S.n_allocs].len = len;
        S.allocs[S.n_allocs++].device = current->device;
        *p = (CUdeviceptr)(uintptr_t)(S.none + S.top);
        S.top += len;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

/* The base of a live allocation only, with a context current, as the
 * driver; a bump allocator: the addresses are never handed out again. */
API CUresult cuMemFree_v2(CUdeviceptr p)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    int a = alloc_of(p, 1);
    int base = a >= 0 && (size_t)(p - (uintptr_t)S.none) == S.allocs[a].off;
    if (base) S.allocs[a].freed = 1;
    pthread_mutex_unlock(&lock);
    return base ? OK : E_INVALID_VALUE;
}

API CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p)
{
    if (!ready()) return E_NOT_INITIALIZED;
    pthread_mutex_lock(&lock);
    int a = alloc_of(p, 1), h = a < 0 ? host_of(p) : -1;
    pthread_mutex_unlock(&lock);
    if (a < 0 && h < 0) return E_INVALID_VALUE;
    switch (attr) {
    case 2:
        *(unsigned *)data = a >= 0 ? 2u : 1u;
        return OK; /* MEMORY_TYPE */
    case 8:
        *(unsigned *)data = 0;
        return OK; /* IS_MANAGED */
    case 9:
        *(int *)data = a >= 0 ? S.allocs[a].device : 0;
        return OK;
    default:
        return E_INVALID_VALUE;
    }
}

API CUresult cuStreamCreate(CUstream *s, unsigned flags)
{
    (void)flags;
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    struct CUstream_st *st = malloc(sizeof *st);
    if (!st) return 2;
    st->magic = STREAM_MAGIC;
    st->ctx = current;
    *s = st;
    return OK;
}

API CUresult cuStreamDestroy_v2(CUstream s)
{
    if (!s || s->magic != STREAM_MAGIC) return E_INVALID_HANDLE;
    s->magic = 0;
    free(s);
    return OK;
}

API CUresult cuStreamSynchronize(CUstream s)
{
    if (!s) return ready() && current ? OK : E_INVALID_CONTEXT; /* the legacy default stream */
    return s->magic == STREAM_MAGIC ? OK : E_INVALID_HANDLE;
}

/* A copy as the driver checks it: a context current, the stream of that
 * context, the device range inside one allocation of the context's device. */
static CUresult copy(CUdeviceptr dev, size_t n, CUstream s, char **rw)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    if (s && (s->magic != STREAM_MAGIC || s->ctx != current)) return E_INVALID_HANDLE;
    long k = atomic_fetch_add(&copies, 1) + 1;
    if (atomic_load(&fail_at) == k) return E_ILLEGAL_ADDRESS;
    pthread_mutex_lock(&lock);
    int a = alloc_of(dev, n);
    int dev_ok = a >= 0 && S.allocs[a].device == current->device;
    pthread_mutex_unlock(&lock);
    if (!dev_ok) return E_INVALID_VALUE;
    *rw = S.rw + (dev - (uintptr_t)S.none);
    return OK;
}

/* The copy engine of the double's "GPU". A real GPU's copies are its DMA
 * engines', which ThreadSanitizer never sees; the order between a copy and
 * the CPU's use of the memory is the stream's, or the test's messages
 * between its processes, which TSan cannot see either. So these copies are
 * not instrumented (plain volatile loads and stores, never a memcpy call
 * that TSan intercepts); they move overlapping ranges as memmove does. */
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DMA_NO_TSAN __attribute__((no_sanitize("thread")))
#endif
#elif defined(__SANITIZE_THREAD__)
#define DMA_NO_TSAN __attribute__((no_sanitize_thread))
#endif
#ifndef DMA_NO_TSAN
#define DMA_NO_TSAN
#endif
DMA_NO_TSAN static void dma_copy(void *dst, const void *src, size_t n)
{
    volatile unsigned char *d = dst;
    const volatile unsigned char *s = src;
    if (d > s && d < s + n) {
        while (n--)
            d[n] = s[n];
        return;
    }
    size_t i = 0;
    if ((uintptr_t)d % 8 == (uintptr_t)s % 8) {
        for (; i < n && (uintptr_t)(d + i) % 8; i++)
            d[i] = s[i];
        for (; i + 8 <= n; i += 8)
            *(volatile uint64_t *)(d + i) = *(const volatile uint64_t *)(s + i);
    }
    for (; i < n; i++)
        d[i] = s[i];
}

API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s)
{
    char *rw;
    CUresult r = copy(src, n, s, &rw);
    if (r == OK) dma_copy(dst, rw, n);
    return r;
}

API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    char *rw;
    CUresult r = copy(dst, n, s, &rw);
    if (r == OK) dma_copy(rw, src, n);
    return r;
}

/* The synchronous copies (the suite's, tests/gpu/gpu_check.c and
 * python/tests/cuda_mem.py; kvpipe uses the Async ones), checked as those:
 * a context current, each device range inside one allocation of its device. */
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    return cuMemcpyDtoHAsync_v2(dst, src, n, NULL);
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    return cuMemcpyHtoDAsync_v2(dst, src, n, NULL);
}

/* Device to device: both ranges in allocations of this process (of any
 * device: with unified addressing the driver copies between devices). */
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    long k = atomic_fetch_add(&copies, 1) + 1;
    if (atomic_load(&fail_at) == k) return E_ILLEGAL_ADDRESS;
    pthread_mutex_lock(&lock);
    int ok = alloc_of(dst, n) >= 0 && alloc_of(src, n) >= 0;
    pthread_mutex_unlock(&lock);
    if (!ok) return E_INVALID_VALUE;
    dma_copy(S.rw + (dst - (uintptr_t)S.none), S.rw + (src - (uintptr_t)S.none), n);
    return OK;
}

/* Every copy here is done when it returns: only the context is checked. */
API CUresult cuCtxSynchronize(void)
{
    if (!ready()) return E_NOT_INITIALIZED;
    return current ? OK : E_INVALID_CONTEXT;
}

API CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags)
{
    (void)flags;
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    CUresult r = OK;
    if (S.n_hosts == MAX_ALLOCS || !(*p = aligned_alloc(4096, (n + 4095) & ~(size_t)4095))) {
        r = 2;
    } else {
        S.hosts[S.n_hosts].p = *p;
        S.hosts[S.n_hosts++].len = n;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

API CUresult cuMemFreeHost(void *p)
{
    pthread_mutex_lock(&lock);
    int h = host_of((CUdeviceptr)(uintptr_t)p);
    if (h >= 0) S.hosts[h] = S.hosts[--S.n_hosts];
    pthread_mutex_unlock(&lock);
    if (h < 0) return E_INVALID_VALUE;
    free(p);
    return OK;
}

API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    int a = alloc_of(p, 1);
    if (a >= 0) {
        *base = (CUdeviceptr)(uintptr_t)(S.none + S.allocs[a].off);
        *size = S.allocs[a].len;
    }
    pthread_mutex_unlock(&lock);
    return a >= 0 ? OK : E_INVALID_VALUE;
}

API CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    int a = alloc_of(p, 1);
    int base = a >= 0 && (size_t)(p - (uintptr_t)S.none) == S.allocs[a].off;
    ipc_handle ih = {IPC_MAGIC,
                     (int32_t)getpid(),
                     S.fd,
                     a >= 0 ? S.allocs[a].device : 0,
                     a >= 0 ? S.allocs[a].off : 0,
                     a >= 0 ? S.allocs[a].len : 0};
    pthread_mutex_unlock(&lock);
    if (!base) return E_INVALID_VALUE; /* the base of an allocation only */
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &ih, sizeof ih);
    return OK;
}

API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags)
{
    (void)flags;
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    const char *refuse = getenv("FAKECUDA_IPC_REFUSE");
    if (refuse && strcmp(refuse, "1") == 0) return E_NOT_SUPPORTED;
    ipc_handle ih;
    memcpy(&ih, h.reserved, sizeof ih);
    if (ih.magic != IPC_MAGIC || ih.len == 0) return E_INVALID_VALUE;
    if (ih.pid == (int32_t)getpid()) return E_INVALID_CONTEXT; /* its own memory */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)ih.pid, (int)ih.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return E_INVALID_HANDLE;
    size_t skip = ih.off % 4096, len = skip + ih.len; /* offsets of mmap are whole pages */
    off_t at = (off_t)(ih.off - skip);
    char *none = mmap(NULL, len, PROT_NONE, MAP_SHARED, fd, at);
    char *rw = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, at);
    close(fd);
    pthread_mutex_lock(&lock);
    CUresult r = OK;
    if (none == MAP_FAILED || rw == MAP_FAILED || S.n_imports == MAX_ALLOCS) {
        r = E_INVALID_HANDLE;
    } else {
        S.imports[S.n_imports].none = none + skip;
        S.imports[S.n_imports].rw = rw + skip;
        S.imports[S.n_imports].len = ih.len;
        S.imports[S.n_imports++].skip = skip;
        *p = (CUdeviceptr)(uintptr_t)(none + skip);
    }
    pthread_mutex_unlock(&lock);
    if (r != OK) {
        if (none != MAP_FAILED) munmap(none, len);
        if (rw != MAP_FAILED) munmap(rw, len);
    }
    return r;
}

API CUresult cuIpcCloseMemHandle(CUdeviceptr p)
{
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < S.n_imports && (uintptr_t)S.imports[i].none != p)
        i++;
    int found = i < S.n_imports;
    if (found) {
        size_t skip = S.imports[i].skip;
        munmap(S.imports[i].none - skip, skip + S.imports[i].len);
        munmap(S.imports[i].rw - skip, skip + S.imports[i].len);
        S.imports[i] = S.imports[--S.n_imports];
    }
    pthread_mutex_unlock(&lock);
    return found ? OK : E_INVALID_VALUE;
}

/* The read-write view of [p, p+n) when it is device memory (of this process,
 * or opened by IPC: *imported), else NULL (host memory). *bad when the range
 * starts in device memory and leaves its allocation. Under the lock. */
static char *device_view(CUdeviceptr p, size_t n, int *imported, int *bad)
{
    int a = alloc_of(p, n);
    if (a >= 0) return S.rw + (p - (uintptr_t)S.none);
    if (alloc_of(p, 1) >= 0) *bad = 1;
    for (int i = 0; i < S.n_imports; i++) {
        uintptr_t base = (uintptr_t)S.imports[i].none;
        if (p < base || p >= base + S.imports[i].len) continue;
        if (p - base + n > S.imports[i].len) *bad = 1;
        *imported = 1;
        return S.imports[i].rw + (p - base);
    }
    return NULL;
}

/* The unified copy: the direction from the pointers, as with unified
 * addressing; host to host is not a copy kvpipe makes, so refused. */
API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
{
    if (!ready()) return E_NOT_INITIALIZED;
    if (!current) return E_INVALID_CONTEXT;
    if (s && (s->magic != STREAM_MAGIC || s->ctx != current)) return E_INVALID_HANDLE;
    long k = atomic_fetch_add(&copies, 1) + 1;
    if (atomic_load(&fail_at) == k) return E_ILLEGAL_ADDRESS;
    int imported = 0, bad = 0;
    pthread_mutex_lock(&lock);
    char *d = device_view(dst, n, &imported, &bad), *sr = device_view(src, n, &imported, &bad);
    pthread_mutex_unlock(&lock);
    if (bad || (!d && !sr)) return E_INVALID_VALUE;
    if (imported) atomic_fetch_add(&ipc_copies, 1);
    dma_copy(d ? d : (char *)(uintptr_t)dst, sr ? sr : (const char *)(uintptr_t)src, n);
    return OK;
}

/* ---- test helpers, not driver API ---- */

/* Allocate n bytes of device memory on device (a context made current). */
API void *fakecuda_alloc(int device, size_t n)
{
    if (cuInit(0) != OK) return NULL;
    CUcontext saved = current;
    current = &ctxs[device];
    CUdeviceptr p = 0;
    CUresult r = cuMemAlloc_v2(&p, n);
    current = saved;
    return r == OK ? (void *)(uintptr_t)p : NULL;
}

/* Read or write device memory without counting as a copy; 0 on success. */
API int fakecuda_peek(void *dst, const void *dev, size_t n)
{
    pthread_mutex_lock(&lock);
    int a = alloc_of((uintptr_t)dev, n);
    pthread_mutex_unlock(&lock);
    if (a < 0) return -1;
    dma_copy(dst, S.rw + ((const char *)dev - S.none), n);
    return 0;
}

API int fakecuda_poke(void *dev, const void *src, size_t n)
{
    pthread_mutex_lock(&lock);
    int a = alloc_of((uintptr_t)dev, n);
    pthread_mutex_unlock(&lock);
    if (a < 0) return -1;
    dma_copy(S.rw + ((char *)dev - S.none), src, n);
    return 0;
}

/* Fail the nth copy from now (1: the next); 0: none. */
API void fakecuda_fail_copy(long n)
{
    atomic_store(&fail_at, n ? atomic_load(&copies) + n : 0);
}

API long fakecuda_copies(void)
{
    return atomic_load(&copies);
}

API long fakecuda_ipc_copies(void)
{
    return atomic_load(&ipc_copies);
}
