/* Shared by the data-plane harnesses: a registry built from the input next to
 * a plain model of it, for the servers' rule that a request is served only
 * inside one registered region. */
#ifndef KVPF_REGIONS_H
#define KVPF_REGIONS_H

#include "engine/registry.h"
#include "fuzz.h"

#define KVPF_MAX_REGIONS 8

typedef unsigned __int128 kvpf_u128;

typedef struct kvpf_regions {
    kvpi_registry reg;
    kvpi_region model[KVPF_MAX_REGIONS];
    size_t n;
} kvpf_regions;

static inline int kvpf_model_overlaps(const kvpf_regions *r, uint64_t addr, uint64_t len)
{
    for (size_t i = 0; i < r->n; i++)
        if ((kvpf_u128)addr < (kvpf_u128)r->model[i].addr + r->model[i].length &&
            (kvpf_u128)r->model[i].addr < (kvpf_u128)addr + len)
            return 1;
    return 0;
}

/* Non-zero if [addr, addr+len) lies inside one modelled region. */
static inline int kvpf_model_inside(const kvpf_regions *r, uint64_t addr, uint64_t len)
{
    for (size_t i = 0; i < r->n; i++)
        if (addr >= r->model[i].addr &&
            (kvpf_u128)addr + len <= (kvpf_u128)r->model[i].addr + r->model[i].length)
            return 1;
    return 0;
}

/* Input: u8 count (mod KVPF_MAX_REGIONS + 1), then that many u64 addr + u64
 * length, registered in order. Checks that the registry refuses exactly the
 * empty, wrapping and overlapping ones and keeps its regions sorted. */
static inline void kvpf_regions_build(kvpf_regions *r, kvpf_reader *in)
{
    kvpi_registry_init(&r->reg);
    r->n = 0;
    size_t want = kvpf_take(in, 1) % (KVPF_MAX_REGIONS + 1);
    for (size_t i = 0; i < want; i++) {
        uint64_t addr = kvpf_take(in, 8), len = kvpf_take(in, 8);
        int ok = kvpi_registry_add(&r->reg, addr, len) == KVP_OK;
        /* An end at exactly 2^64 counts as wrapping. */
        int model_ok =
            len != 0 && (kvpf_u128)addr + len <= UINT64_MAX && !kvpf_model_overlaps(r, addr, len);
        FUZZ_CHECK(ok == model_ok);
        if (ok) r->model[r->n++] = (kvpi_region){addr, len};
    }
    kvpi_region *snap = NULL;
    size_t count = 0;
    FUZZ_CHECK(kvpi_registry_snapshot(&r->reg, &snap, &count) == KVP_OK);
    FUZZ_CHECK(count == r->n);
    for (size_t i = 1; i < count; i++)
        FUZZ_CHECK(snap[i - 1].addr + snap[i - 1].length <= snap[i].addr);
    free(snap);
}

/* The server's decision for a non-empty request, checked against the model. */
static inline void kvpf_regions_check_pin(kvpf_regions *r, uint64_t addr, uint64_t len)
{
    kvpi_pin pin;
    int pinned = kvpi_registry_pin(&r->reg, addr, len, &pin) == KVP_OK;
    if (pinned) kvpi_registry_unpin(&r->reg, pin);
    FUZZ_CHECK(pinned == kvpf_model_inside(r, addr, len));
}

static inline void kvpf_regions_free(kvpf_regions *r)
{
    kvpi_registry_destroy(&r->reg);
}

#endif
