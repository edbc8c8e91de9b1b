#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "engine/registry.h"

void kvpi_registry_init(kvpi_registry *r)
{
    memset(r, 0, sizeof *r);
    /* Prefer writers so that an unregister is not starved by a stream of
     * server requests pinning regions; no thread pins recursively. */
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&r->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
}

void kvpi_registry_destroy(kvpi_registry *r)
{
    pthread_rwlock_destroy(&r->lock);
    free(r->regions);
    r->regions = NULL;
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

int kvpi_regions_contain(const kvpi_region *regions, size_t n, uint64_t addr, uint64_t length)
{
    if (length > UINT64_MAX - addr) return 0;
    size_t i = upper_bound(regions, n, addr);
    if (i == 0) return 0;
    const kvpi_region *reg = &regions[i - 1];
    return addr - reg->addr <= reg->length && length <= reg->length - (addr - reg->addr);
}

kvp_status kvpi_registry_add(kvpi_registry *r, uint64_t addr, uint64_t length)
{
    if (length == 0 || length > UINT64_MAX - addr)
        return kvpi_error(KVP_EINVAL, "cannot register [0x%llx, +%llu): empty or wraps around",
                          (unsigned long long)addr, (unsigned long long)length);
    kvp_status st = KVP_OK;
    pthread_rwlock_wrlock(&r->lock);
    size_t i = upper_bound(r->regions, r->count, addr);
    int overlaps_prev = i > 0 && r->regions[i - 1].addr + r->regions[i - 1].length > addr;
    int overlaps_next = i < r->count && r->regions[i].addr < addr + length;
    if (overlaps_prev || overlaps_next) {
        st = kvpi_error(KVP_EINVAL, "region [0x%llx, +%llu) overlaps a registered region",
                        (unsigned long long)addr, (unsigned long long)length);
        goto out;
    }
    if (r->count == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 16;
        kvpi_region *grown = realloc(r->regions, cap * sizeof *grown);
        if (!grown) {
            st = kvpi_error(KVP_ENOMEM, "registry: out of memory");
            goto out;
        }
        r->regions = grown;
        r->cap = cap;
    }
    memmove(&r->regions[i + 1], &r->regions[i], (r->count - i) * sizeof *r->regions);
    r->regions[i] = (kvpi_region){addr, length};
    r->count++;
out:
    pthread_rwlock_unlock(&r->lock);
    return st;
}

kvp_status kvpi_registry_remove(kvpi_registry *r, uint64_t addr)
{
    kvp_status st = KVP_OK;
    /* The write lock waits for every pinned (read-locked) request. */
    pthread_rwlock_wrlock(&r->lock);
    size_t i = upper_bound(r->regions, r->count, addr);
    if (i == 0 || r->regions[i - 1].addr != addr) {
        st = kvpi_error(KVP_ENOTFOUND, "no registered region starts at 0x%llx",
                        (unsigned long long)addr);
    } else {
        memmove(&r->regions[i - 1], &r->regions[i], (r->count - i) * sizeof *r->regions);
        r->count--;
    }
    pthread_rwlock_unlock(&r->lock);
    return st;
}

kvp_status kvpi_registry_pin(kvpi_registry *r, uint64_t addr, uint64_t length)
{
    pthread_rwlock_rdlock(&r->lock);
    if (kvpi_regions_contain(r->regions, r->count, addr, length)) return KVP_OK;
    pthread_rwlock_unlock(&r->lock);
    return KVP_ERANGE;
}

void kvpi_registry_unpin(kvpi_registry *r)
{
    pthread_rwlock_unlock(&r->lock);
}

kvp_status kvpi_registry_snapshot(kvpi_registry *r, kvpi_region **out, size_t *count)
{
    pthread_rwlock_rdlock(&r->lock);
    size_t n = r->count;
    kvpi_region *copy = malloc((n ? n : 1) * sizeof *copy);
    if (copy && n) memcpy(copy, r->regions, n * sizeof *copy);
    pthread_rwlock_unlock(&r->lock);
    if (!copy) return kvpi_error(KVP_ENOMEM, "registry snapshot: out of memory");
    *out = copy;
    *count = n;
    return KVP_OK;
}
