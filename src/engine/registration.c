/* Memory registration: the region table, every running transport's
 * mem_reg/mem_dereg, and the buffer pool's hooks, which register chunks the
 * same way.
 *
 * A region is reserved in the table first (invisible: no peer request can
 * pin it, no descriptor lists it), then registered with each running
 * transport that can move its kind, in transport order; a failure undoes the
 * ones done, in reverse, and drops the reservation. Only then is it made
 * visible and published. Unregistering stops new pins, waits for the
 * region's pins, deregisters in reverse order and drops the entry. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/log.h"
#include "engine/engine_internal.h"
#include "gpu/cuda.h"

/* Does transport i register regions of this kind? Fixed for the engine's
 * life: servers start and stop only with it. */
static int registers(const kvp_engine *e, size_t i, kvp_mem_kind kind)
{
    const kvpi_transport_ops *ops = e->transports[i];
    return e->servers[i] && ops->mem_reg && (ops->mem_kinds & KVPI_MEM_BIT(kind));
}

/* Undo the registrations of r with transports [0, n), last first. */
static void deregister(kvp_engine *e, kvpi_region *r, size_t n)
{
    for (size_t i = n; i-- > 0;)
        if (registers(e, i, r->kind)) {
            e->transports[i]->mem_dereg(e->servers[i], r->handle[i]);
            r->handle[i] = NULL;
        }
}

/* The kinds this engine's running transports move, and their names. */
static unsigned movable_kinds(const kvp_engine *e, char *names, size_t len)
{
    unsigned kinds = 0;
    size_t used = 0;
    names[0] = '\0';
    for (size_t i = 0; e->transports[i]; i++) {
        if (!e->servers[i]) continue;
        kinds |= e->transports[i]->mem_kinds;
        if (used < len)
            used += (size_t)snprintf(names + used, len - used, "%s%s", used ? ", " : "",
                                     e->transports[i]->name);
    }
    return kinds;
}

static kvp_status check_kind(const kvp_engine *e, kvp_mem_kind kind, int device)
{
    if (kind != KVP_MEM_HOST && kind != KVP_MEM_CUDA)
        return kvpi_error(KVP_EINVAL, "register: %d is not a memory kind (kvp_mem_kind)",
                          (int)kind);
    if (device < 0 || (kind == KVP_MEM_HOST && device != 0))
        return kvpi_error(KVP_EINVAL, "register: device %d is not a %s device", device,
                          kvpi_mem_kind_name(kind));
    char names[128];
    unsigned kinds = movable_kinds(e, names, sizeof names);
    if (kinds & KVPI_MEM_BIT(kind)) return KVP_OK;
    char moved[64];
    return kvpi_error(KVP_ENOTSUP,
                      "register: %s memory (device %d): no transport of this engine can move it "
                      "(its transports %s move %s memory)",
                      kvpi_mem_kind_name(kind), device, names,
                      kvpi_mem_kinds_names(kinds, moved, sizeof moved));
}

/* Register r with every transport that takes its kind and add it to the
 * table, visible to peers once all succeeded; nothing stays on failure. */
static kvp_status region_register(kvp_engine *e, const kvpi_region *r)
{
    kvpi_region_entry *entry;
    kvp_status st = kvpi_region_add(&e->regions, r, &entry);
    if (st) return st;
    kvpi_region *reg = kvpi_region_of(entry);
    for (size_t i = 0; e->transports[i]; i++) {
        if (!registers(e, i, r->kind)) continue;
        void *handle = NULL;
        if ((st = e->transports[i]->mem_reg(e->servers[i], reg, &handle))) {
            /* Keep this failure's detail across the undoing. */
            kvpi_error_kept detail = kvpi_error_keep();
            deregister(e, reg, i);
            kvpi_region_discard(&e->regions, entry);
            return kvpi_error(st, "register [0x%llx, +%llu): the %s transport refused it: %s",
                              (unsigned long long)r->addr, (unsigned long long)r->length,
                              e->transports[i]->name, detail.text);
        }
        reg->handle[i] = handle;
    }
    kvpi_region_activate(&e->regions, entry);
    return KVP_OK;
}

/* Take the region starting at addr out of the table, once its pins dropped,
 * and deregister it from every transport. */
static kvp_status region_unregister(kvp_engine *e, uint64_t addr)
{
    kvpi_region_entry *entry;
    kvp_status st = kvpi_region_remove_begin(&e->regions, addr, &entry);
    if (st) return st;
    deregister(e, kvpi_region_of(entry), e->n_transports);
    kvpi_region_remove_end(&e->regions, entry);
    return KVP_OK;
}

static kvp_status register_and_publish(kvp_engine *e, const kvpi_region *r)
{
    kvp_status st = region_register(e, r);
    if (st || !e->meta) return st;
    if ((st = kvpi_engine_publish(e))) {
        kvpi_error_kept detail = kvpi_error_keep();
        region_unregister(e, r->addr);
        kvpi_engine_mark_stale(e); /* the rendered descriptor still lists it */
        kvpi_error(st, "%s", detail.text);
    }
    return st;
}

/* CUDA memory must be what the driver says: device (or managed) memory of
 * that device, the whole range in one allocation's device. */
static kvp_status check_cuda(void *addr, size_t length, int device)
{
    int dev_first;
    kvp_status st = kvpi_cuda_range_device(addr, length, &dev_first);
    if (st == KVP_EINVAL)
        return kvpi_error(st, "register: %s; register host memory with kvp_engine_register()",
                          kvp_last_error());
    if (st)
        return kvpi_error(st, "register: [%p, +%zu) as cuda memory of device %d: %s", addr, length,
                          device, kvp_last_error());
    if (dev_first != device)
        return kvpi_error(KVP_EINVAL,
                          "register: [%p, +%zu) is memory of cuda device %d, not of device %d",
                          addr, length, dev_first, device);
    return KVP_OK;
}

kvp_status kvpi_engine_register_region(kvp_engine *e, const kvpi_region *r)
{
    kvp_status st = check_kind(e, r->kind, r->device);
    return st ? st : register_and_publish(e, r);
}

kvp_status kvp_engine_register_mem(kvp_engine *e, void *addr, size_t length, kvp_mem_kind kind,
                                   int device)
{
    if (!e || !addr) return kvpi_error(KVP_EINVAL, "register: NULL argument");
    kvp_status st = check_kind(e, kind, device);
    if (!st && kind == KVP_MEM_HOST && length) st = kvpi_memory_check_host(addr, length);
    if (!st && kind == KVP_MEM_CUDA) st = check_cuda(addr, length, device);
    if (st) return st;
    kvpi_region r = {
        .addr = (uint64_t)(uintptr_t)addr, .length = length, .kind = kind, .device = device};
    return register_and_publish(e, &r);
}

kvp_status kvp_engine_register(kvp_engine *e, void *addr, size_t length)
{
    if (!e || !addr) return kvpi_error(KVP_EINVAL, "register: NULL argument");
    kvp_status st = length ? kvpi_memory_check_host(addr, length) : KVP_OK;
    if (st == KVP_OK) return kvp_engine_register_mem(e, addr, length, KVP_MEM_HOST, 0);
    /* Not host memory the CPU can read: a GPU pointer (vLLM and SGLang pass
     * tensor.data_ptr()) is classified by the driver, where there is one. */
    kvpi_error_kept host_why = kvpi_error_keep();
    kvpi_ptr_kind kind;
    int device;
    kvp_status cst = kvpi_cuda_classify(addr, &kind, &device);
    if (cst == KVP_OK && (kind == KVPI_PTR_DEVICE || kind == KVPI_PTR_MANAGED))
        return kvp_engine_register_mem(e, addr, length, KVP_MEM_CUDA, device);
    if (cst == KVP_OK)
        return kvpi_error(st, "%s (the CUDA driver does not know it either)", host_why.text);
    return kvpi_error(st, "%s; and it cannot be classified as GPU memory: %s", host_why.text,
                      kvp_last_error());
}

kvp_status kvp_engine_unregister(kvp_engine *e, void *addr)
{
    if (!e) return kvpi_error(KVP_EINVAL, "unregister: NULL engine");
    kvp_status st = region_unregister(e, (uint64_t)(uintptr_t)addr);
    if (st || !e->meta) return st;
    return kvpi_engine_publish(e);
}

void kvpi_engine_unregister_all(kvp_engine *e)
{
    kvpi_pin *pins;
    size_t n;
    if (kvpi_region_pin_all(&e->regions, &pins, &n)) return;
    uint64_t *addrs = malloc((n ? n : 1) * sizeof *addrs);
    for (size_t i = 0; addrs && i < n; i++)
        addrs[i] = kvpi_pin_region(pins[i])->addr;
    kvpi_region_unpin_all(&e->regions, pins, n);
    for (size_t i = 0; addrs && i < n; i++)
        region_unregister(e, addrs[i]);
    free(addrs);
}

/* ---------------------------------------------------------------- pool --- */

/* Chunks are registered like the application's memory: through every
 * transport, published. The pool knows their kind. */
static kvp_status pool_register(void *ctx, void *addr, size_t length)
{
    kvp_engine *e = ctx;
    int device;
    kvp_mem_kind kind = kvpi_pool_kind(e->pool, &device);
    kvpi_region r = {
        .addr = (uint64_t)(uintptr_t)addr, .length = length, .kind = kind, .device = device};
    return register_and_publish(e, &r);
}

static void pool_unregister(void *ctx, void *addr)
{
    kvp_engine_unregister(ctx, addr);
}

/* The slot of the transport that maps the pool's chunks: the protocol's,
 * where it has chunk_map and its server runs (ucx: memory a same-host peer
 * maps); else the slot of the list's end, and the pool maps its own. Not in
 * the authenticated mode: such memory can be reachable without the key (UCX's
 * shared memory segments: by any process of the user or group that names
 * the segment), where the pool's own is reachable only through the
 * transports' authenticated connections. */
static size_t pool_mapper(const kvp_engine *e)
{
    size_t i = 0;
    for (; e->transports[i]; i++)
        if (e->transports[i] == e->transport) break;
    if (e->transports[i] && (e->auth || !e->servers[i] || !e->transports[i]->chunk_map))
        while (e->transports[i])
            i++;
    return i;
}

static kvp_status pool_map(void *ctx, size_t length, void **addr)
{
    kvp_engine *e = ctx;
    size_t i = pool_mapper(e);
    return e->transports[i]->chunk_map(e->servers[i], length, addr);
}

static void pool_unmap(void *ctx, void *addr, size_t length)
{
    kvp_engine *e = ctx;
    size_t i = pool_mapper(e);
    e->transports[i]->chunk_unmap(e->servers[i], addr, length);
}

kvp_status kvpi_engine_pool_start(kvp_engine *e)
{
    kvpi_pool_opts popts = {.retain_bytes = e->opts.pool_retain_bytes, .kind = KVP_MEM_HOST};
    kvpi_pool_hooks hooks = {
        .ctx = e, .register_chunk = pool_register, .unregister_chunk = pool_unregister};
    if (e->transports[pool_mapper(e)]) {
        hooks.map_chunk = pool_map;
        hooks.unmap_chunk = pool_unmap;
    }
    return kvpi_pool_create(&popts, &hooks, &e->pool);
}

kvp_status kvp_engine_alloc(kvp_engine *e, size_t length, void **out)
{
    if (!e || !out) return kvpi_error(KVP_EINVAL, "alloc: NULL argument");
    return kvpi_pool_alloc(e->pool, length, out);
}

kvp_status kvp_engine_free(kvp_engine *e, void *addr)
{
    if (!e) return kvpi_error(KVP_EINVAL, "free: NULL engine");
    if (!addr) return KVP_OK;
    return kvpi_pool_free(e->pool, addr);
}
