#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "engine/registry.h"

struct kvpi_reg_entry {
    kvpi_region region;
    size_t pins;
    int removing; /* no new pins; the remover waits for pins to reach 0 */
};

void kvpi_registry_init(kvpi_registry *r)
{
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->lock, NULL);
    kvpi_cond_init(&r->unpinned);
}

void kvpi_registry_destroy(kvpi_registry *r)
{
    for (size_t i = 0; i < r->count; i++)
        free(r->entries[i]);
    free(r->entries);
    pthread_cond_destroy(&r->unpinned);
    pthread_mutex_destroy(&r->lock);
    r->entries = NULL;
    r->count = r->cap = 0;
}

/* Index of the first region whose addr is > addr. */
static size_t upper_bound(const kvpi_region *regions, size_t n, uint64_t addr)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (regions[mid].addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The same over the registry's entries. */
static size_t entry_upper_bound(const kvpi_registry *r, uint64_t addr)
{
    size_t lo = 0, hi = r->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r->entries[mid]->region.addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int region_contains(const kvpi_region *reg, uint64_t addr, uint64_t length)
{
    return addr - reg->addr <= reg->length && length <= reg->length - (addr - reg->addr);
}

int kvpi_regions_contain(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length)
{
    if (length > UINT64_MAX - addr) return 0;
    size_t i = upper_bound(regions, n, addr);
    return i > 0 && region_contains(&regions[i - 1], addr, length);
}

kvp_status kvpi_registry_add(kvpi_registry *r, uint64_t addr, uint64_t length)
{
    if (length == 0 || length > UINT64_MAX - addr)
        return kvpi_error(KVP_EINVAL, "cannot register [0x%llx, +%llu): empty or wraps around",
                          (unsigned long long)addr, (unsigned long long)length);
    kvpi_reg_entry *e = calloc(1, sizeof *e);
    if (!e) return kvpi_error(KVP_ENOMEM, "registry: out of memory");
    e->region = (kvpi_region){addr, length};
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&r->lock);
    size_t i = entry_upper_bound(r, addr);
    const kvpi_region *prev = i > 0 ? &r->entries[i - 1]->region : NULL;
    const kvpi_region *next = i < r->count ? &r->entries[i]->region : NULL;
    if ((prev && prev->addr + prev->length > addr) || (next && next->addr < addr + length)) {
        st = kvpi_error(KVP_EINVAL, "region [0x%llx, +%llu) overlaps a registered region",
                        (unsigned long long)addr, (unsigned long long)length);
        goto out;
    }
    if (r->count == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 16;
        kvpi_reg_entry **grown = realloc(r->entries, cap * sizeof *grown);
        if (!grown) {
            st = kvpi_error(KVP_ENOMEM, "registry: out of memory");
            goto out;
        }
        r->entries = grown;
        r->cap = cap;
    }
    memmove(&r->entries[i + 1], &r->entries[i], (r->count - i) * sizeof *r->entries);
    r->entries[i] = e;
    r->count++;
    e = NULL;
out:
    pthread_mutex_unlock(&r->lock);
    free(e);
    return st;
}

kvp_status kvpi_registry_remove(kvpi_registry *r, uint64_t addr)
{
    pthread_mutex_lock(&r->lock);
    size_t i = entry_upper_bound(r, addr);
    kvpi_reg_entry *e = i > 0 ? r->entries[i - 1] : NULL;
    if (!e || e->region.addr != addr || e->removing) {
        pthread_mutex_unlock(&r->lock);
        return kvpi_error(KVP_ENOTFOUND, "no registered region starts at 0x%llx",
                          (unsigned long long)addr);
    }
    e->removing = 1;
    /* The wait releases the lock: other regions are pinned, added and
     * removed meanwhile. Entries move when others come and go, so the index
     * is looked up again after. */
    while (e->pins > 0)
        pthread_cond_wait(&r->unpinned, &r->lock);
    i = entry_upper_bound(r, addr) - 1;
    memmove(&r->entries[i], &r->entries[i + 1], (r->count - i - 1) * sizeof *r->entries);
    r->count--;
    pthread_mutex_unlock(&r->lock);
    free(e);
    return KVP_OK;
}

kvp_status kvpi_registry_pin(kvpi_registry *r, uint64_t addr, uint64_t length, kvpi_pin *pin)
{
    if (length > UINT64_MAX - addr) return KVP_ERANGE;
    kvp_status st = KVP_ERANGE;
    pthread_mutex_lock(&r->lock);
    size_t i = entry_upper_bound(r, addr);
    kvpi_reg_entry *e = i > 0 ? r->entries[i - 1] : NULL;
    if (e && !e->removing && region_contains(&e->region, addr, length)) {
        e->pins++;
        *pin = e;
        st = KVP_OK;
    }
    pthread_mutex_unlock(&r->lock);
    return st;
}

void kvpi_registry_unpin(kvpi_registry *r, kvpi_pin pin)
{
    pthread_mutex_lock(&r->lock);
    if (--pin->pins == 0 && pin->removing) pthread_cond_broadcast(&r->unpinned);
    pthread_mutex_unlock(&r->lock);
}

kvp_status kvpi_registry_snapshot(kvpi_registry *r, kvpi_region **out, size_t *count)
{
    pthread_mutex_lock(&r->lock);
    kvpi_region *copy = malloc((r->count ? r->count : 1) * sizeof *copy);
    size_t n = 0;
    for (size_t i = 0; copy && i < r->count; i++)
        if (!r->entries[i]->removing) copy[n++] = r->entries[i]->region;
    pthread_mutex_unlock(&r->lock);
    if (!copy) return kvpi_error(KVP_ENOMEM, "registry snapshot: out of memory");
    *out = copy;
    *count = n;
    return KVP_OK;
}

/* The page-aligned span around [addr, addr+length). */
static void page_span(const void *addr, size_t length, void **start, size_t *span)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)addr & ~(page - 1);
    *start = (void *)a;
    *span = (size_t)((uintptr_t)addr - a) + length;
}

int kvpi_memory_mapped(const void *addr, size_t length)
{
    void *start;
    size_t span;
    page_span(addr, length, &start, &span);
    /* MS_ASYNC writes nothing back (a no-op since Linux 2.6.19); the kernel
     * still checks the range and fails with ENOMEM where a page is unmapped. */
    return msync(start, span, MS_ASYNC) == 0 || errno != ENOMEM;
}

/* Can this process read the byte at p? A write(2) from it into a pipe faults
 * in the kernel (EFAULT) rather than in us. -1 when the probe itself cannot
 * run (out of descriptors). */
static int readable(int fd, const void *p)
{
    if (write(fd, p, 1) == 1) return 1;
    return errno == EFAULT ? 0 : -1;
}

kvp_status kvpi_memory_check_host(const void *addr, size_t length)
{
    static const char *const what = "kvpipe serves host (CPU) memory only: malloc'ed or "
                                    "mmap'ed memory, or kvp_engine_alloc() buffers, not GPU "
                                    "device pointers (copy a GPU cache to host memory first)";
    if (!kvpi_memory_mapped(addr, length))
        return kvpi_error(KVP_EINVAL, "register: [%p, +%zu) is not mapped in this process; %s",
                          addr, length, what);
    int fds[2];
    if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
        KVPI_DEBUG("register: cannot probe [%p, +%zu): pipe: %s", addr, length, strerror(errno));
        return KVP_OK; /* the mapping check passed; the servers check again */
    }
    const char *last = (const char *)addr + length - 1;
    int first_ok = readable(fds[1], addr);
    int last_ok = first_ok == 0 ? 1 : readable(fds[1], last);
    close(fds[0]);
    close(fds[1]);
    if (first_ok == 0 || last_ok == 0)
        return kvpi_error(KVP_EINVAL,
                          "register: [%p, +%zu) is mapped but cannot be read (its %s byte "
                          "faults: %s); %s",
                          addr, length, first_ok == 0 ? "first" : "last", strerror(EFAULT), what);
    return KVP_OK;
}
