/* The region table and the host-memory checks; see region.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/region.h"
#include "common/util.h"

typedef enum entry_state {
    RESERVED, /* being added: blocks overlaps, not pinnable, not listed */
    ACTIVE,
    REMOVING, /* no new pins; the remover waits for pins to reach 0 */
} entry_state;

struct kvpi_region_entry {
    kvpi_region region;
    size_t pins;
    entry_state state;
};

static const char *const kind_names[KVPI_N_MEM_KINDS] = {
    [KVP_MEM_HOST] = "host",
    [KVP_MEM_CUDA] = "cuda",
};

const char *kvpi_mem_kind_name(kvp_mem_kind kind)
{
    return (unsigned)kind < KVPI_N_MEM_KINDS ? kind_names[kind] : "unknown";
}

kvp_mem_kind kvpi_mem_kind_parse(const char *name)
{
    for (unsigned k = 0; k < KVPI_N_MEM_KINDS; k++)
        if (strcmp(name, kind_names[k]) == 0) return (kvp_mem_kind)k;
    return KVPI_MEM_KIND_UNKNOWN;
}

const char *kvpi_mem_kinds_names(unsigned kinds, char *buf, size_t size)
{
    size_t used = 0;
    buf[0] = '\0';
    for (unsigned k = 0; k < 32; k++) {
        if (!(kinds & KVPI_MEM_BIT(k)) || used >= size) continue;
        unsigned later = kinds & ~(KVPI_MEM_BIT(k) | (KVPI_MEM_BIT(k) - 1));
        const char *sep = !later ? "" : later & (later - 1) ? ", " : " and ";
        used += (size_t)snprintf(buf + used, size - used, "%s%s",
                                 kvpi_mem_kind_name((kvp_mem_kind)k), sep);
    }
    return buf;
}

void kvpi_region_table_init(kvpi_region_table *t)
{
    memset(t, 0, sizeof *t);
    pthread_mutex_init(&t->lock, NULL);
    kvpi_cond_init(&t->unpinned);
    atomic_init(&t->non_host, 0);
}

void kvpi_region_table_destroy(kvpi_region_table *t)
{
    for (size_t i = 0; i < t->count; i++)
        free(t->entries[i]);
    free(t->entries);
    pthread_cond_destroy(&t->unpinned);
    pthread_mutex_destroy(&t->lock);
    t->entries = NULL;
    t->count = t->cap = 0;
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

/* The same over the table's entries. */
static size_t entry_upper_bound(const kvpi_region_table *t, uint64_t addr)
{
    size_t lo = 0, hi = t->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->entries[mid]->region.addr <= addr)
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

long kvpi_regions_find(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length)
{
    if (length > UINT64_MAX - addr) return -1;
    size_t i = upper_bound(regions, n, addr);
    return i > 0 && region_contains(&regions[i - 1], addr, length) ? (long)(i - 1) : -1;
}

int kvpi_regions_contain(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length)
{
    return kvpi_regions_find(regions, n, addr, length) >= 0;
}

/* The entry holding [addr, addr+length) whole, in any state; NULL if none.
 * Called with the lock held. */
static kvpi_region_entry *entry_holding(const kvpi_region_table *t, uint64_t addr, uint64_t length)
{
    if (length > UINT64_MAX - addr) return NULL;
    size_t i = entry_upper_bound(t, addr);
    kvpi_region_entry *e = i > 0 ? t->entries[i - 1] : NULL;
    return e && region_contains(&e->region, addr, length) ? e : NULL;
}

kvp_status kvpi_region_add(kvpi_region_table *t, const kvpi_region *r, kvpi_region_entry **out)
{
    uint64_t addr = r->addr, length = r->length;
    if (length == 0 || length > UINT64_MAX - addr)
        return kvpi_error(KVP_EINVAL, "cannot register [0x%llx, +%llu): empty or wraps around",
                          (unsigned long long)addr, (unsigned long long)length);
    kvpi_region_entry *e = calloc(1, sizeof *e);
    if (!e) return kvpi_error(KVP_ENOMEM, "region table: out of memory");
    e->region = *r;
    e->state = RESERVED;
    kvp_status st = KVP_OK;
    pthread_mutex_lock(&t->lock);
    size_t i = entry_upper_bound(t, addr);
    const kvpi_region *prev = i > 0 ? &t->entries[i - 1]->region : NULL;
    const kvpi_region *next = i < t->count ? &t->entries[i]->region : NULL;
    if ((prev && prev->addr + prev->length > addr) || (next && next->addr < addr + length)) {
        st = kvpi_error(KVP_EINVAL, "region [0x%llx, +%llu) overlaps a registered region",
                        (unsigned long long)addr, (unsigned long long)length);
        goto out;
    }
    if (kvpi_grow((void **)&t->entries, &t->cap, t->count + 1, sizeof *t->entries)) {
        st = kvpi_error(KVP_ENOMEM, "region table: out of memory");
        goto out;
    }
    memmove(&t->entries[i + 1], &t->entries[i], (t->count - i) * sizeof *t->entries);
    t->entries[i] = e;
    t->count++;
    *out = e;
    e = NULL;
out:
    pthread_mutex_unlock(&t->lock);
    free(e);
    return st;
}

kvpi_region *kvpi_region_of(kvpi_region_entry *e)
{
    return &e->region;
}

void kvpi_region_activate(kvpi_region_table *t, kvpi_region_entry *e)
{
    pthread_mutex_lock(&t->lock);
    e->state = ACTIVE;
    if (e->region.kind != KVP_MEM_HOST) atomic_fetch_add(&t->non_host, 1);
    pthread_mutex_unlock(&t->lock);
}

/* Take e out of the table and free it; called with the lock held. Entries
 * move when others come and go, so its index is looked up again. */
static void entry_drop(kvpi_region_table *t, kvpi_region_entry *e)
{
    size_t i = entry_upper_bound(t, e->region.addr) - 1;
    memmove(&t->entries[i], &t->entries[i + 1], (t->count - i - 1) * sizeof *t->entries);
    t->count--;
    free(e);
}

void kvpi_region_discard(kvpi_region_table *t, kvpi_region_entry *e)
{
    pthread_mutex_lock(&t->lock);
    entry_drop(t, e);
    pthread_mutex_unlock(&t->lock);
}

kvp_status kvpi_region_remove_begin(kvpi_region_table *t, uint64_t addr, kvpi_region_entry **out)
{
    pthread_mutex_lock(&t->lock);
    size_t i = entry_upper_bound(t, addr);
    kvpi_region_entry *e = i > 0 ? t->entries[i - 1] : NULL;
    if (!e || e->region.addr != addr || e->state != ACTIVE) {
        pthread_mutex_unlock(&t->lock);
        return kvpi_error(KVP_ENOTFOUND, "no registered region starts at 0x%llx",
                          (unsigned long long)addr);
    }
    e->state = REMOVING;
    if (e->region.kind != KVP_MEM_HOST) atomic_fetch_sub(&t->non_host, 1);
    /* The wait releases the lock: other regions are pinned, added and
     * removed meanwhile. */
    while (e->pins > 0)
        pthread_cond_wait(&t->unpinned, &t->lock);
    pthread_mutex_unlock(&t->lock);
    *out = e;
    return KVP_OK;
}

void kvpi_region_remove_end(kvpi_region_table *t, kvpi_region_entry *e)
{
    kvpi_region_discard(t, e);
}

kvp_status kvpi_region_pin(kvpi_region_table *t, uint64_t addr, uint64_t length, unsigned kinds,
                           kvpi_pin *pin)
{
    kvp_status st = KVP_ERANGE;
    pthread_mutex_lock(&t->lock);
    kvpi_region_entry *e = entry_holding(t, addr, length);
    if (e && e->state == ACTIVE && (kinds & KVPI_MEM_BIT(e->region.kind))) {
        e->pins++;
        *pin = e;
        st = KVP_OK;
    }
    pthread_mutex_unlock(&t->lock);
    return st;
}

const kvpi_region *kvpi_pin_region(kvpi_pin pin)
{
    return &pin->region;
}

/* Called with the lock held. */
static void unpin_locked(kvpi_region_table *t, kvpi_pin pin)
{
    if (--pin->pins == 0 && pin->state == REMOVING) pthread_cond_broadcast(&t->unpinned);
}

void kvpi_region_unpin(kvpi_region_table *t, kvpi_pin pin)
{
    pthread_mutex_lock(&t->lock);
    unpin_locked(t, pin);
    pthread_mutex_unlock(&t->lock);
}

void kvpi_region_totals(kvpi_region_table *t, size_t *count, uint64_t *bytes)
{
    size_t n = 0;
    uint64_t sum = 0;
    pthread_mutex_lock(&t->lock);
    for (size_t i = 0; i < t->count; i++)
        if (t->entries[i]->state == ACTIVE) {
            n++;
            sum += t->entries[i]->region.length;
        }
    pthread_mutex_unlock(&t->lock);
    *count = n;
    *bytes = sum;
}

kvp_status kvpi_region_pin_all(kvpi_region_table *t, kvpi_pin **pins, size_t *count)
{
    pthread_mutex_lock(&t->lock);
    kvpi_pin *all = malloc((t->count ? t->count : 1) * sizeof *all);
    size_t n = 0;
    for (size_t i = 0; all && i < t->count; i++) {
        kvpi_region_entry *e = t->entries[i];
        if (e->state != ACTIVE) continue;
        e->pins++;
        all[n++] = e;
    }
    pthread_mutex_unlock(&t->lock);
    if (!all) return kvpi_error(KVP_ENOMEM, "region table: out of memory");
    *pins = all;
    *count = n;
    return KVP_OK;
}

void kvpi_region_unpin_all(kvpi_region_table *t, kvpi_pin *pins, size_t count)
{
    pthread_mutex_lock(&t->lock);
    for (size_t i = 0; i < count; i++)
        unpin_locked(t, pins[i]);
    pthread_mutex_unlock(&t->lock);
    free(pins);
}

int kvpi_region_kind_find(kvpi_region_table *t, uint64_t addr, uint64_t length, kvp_mem_kind *kind,
                          int *device)
{
    int found = 0;
    *kind = KVP_MEM_HOST;
    *device = 0;
    pthread_mutex_lock(&t->lock);
    const kvpi_region_entry *e = entry_holding(t, addr, length);
    if (e && e->state == ACTIVE) {
        *kind = e->region.kind;
        *device = e->region.device;
        found = 1;
    }
    pthread_mutex_unlock(&t->lock);
    return found;
}

kvp_mem_kind kvpi_region_kind_at(kvpi_region_table *t, uint64_t addr, uint64_t length, int *device)
{
    kvp_mem_kind kind = KVP_MEM_HOST;
    *device = 0;
    if (atomic_load(&t->non_host) == 0) return kind;
    kvpi_region_kind_find(t, addr, length, &kind, device);
    return kind;
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

int kvpi_memory_readable(const void *addr, size_t length)
{
    if (!length) return 1;
    char tmp[2];
    int n = length > 1 ? 2 : 1;
    struct iovec local = {.iov_base = tmp, .iov_len = (size_t)n};
    struct iovec remote[2] = {{.iov_base = (void *)addr, .iov_len = 1},
                              {.iov_base = (char *)addr + length - 1, .iov_len = 1}};
    ssize_t got = process_vm_readv(getpid(), &local, 1, remote, (unsigned long)n, 0);
    if (got == n) return 1;
    return got >= 0 || errno == EFAULT ? 0 : -1;
}

kvp_status kvpi_memory_check_host(const void *addr, size_t length)
{
    static const char *const what =
        "kvp_engine_register() takes host (CPU) memory: malloc'ed or mmap'ed memory, or "
        "kvp_engine_alloc() buffers, not GPU device pointers (register those with "
        "kvp_engine_register_mem() and KVP_MEM_CUDA where a transport moves them, or copy a "
        "GPU cache to host memory)";
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
