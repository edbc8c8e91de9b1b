/* Shared by the data-plane harnesses: a region table built from the input next
 * to a plain model of it, for the servers' rule that a request is served only
 * inside one registered region of a kind the server moves (tcp and shm: host
 * memory, and CUDA memory, which they stage; a server of host memory only
 * pins host regions only). */
#ifndef KVPF_REGIONS_H
#define KVPF_REGIONS_H

#include "common/region.h"
#include "fuzz.h"

#define KVPF_MAX_REGIONS 8

typedef unsigned __int128 kvpf_u128;

typedef struct kvpf_regions {
    kvpi_region_table table;
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

/* Non-zero if [addr, addr+len) lies inside one modelled region of a kind in
 * the mask kinds (KVPI_MEM_BIT). */
static inline int kvpf_model_inside(const kvpf_regions *r, uint64_t addr, uint64_t len,
                                    unsigned kinds)
{
    for (size_t i = 0; i < r->n; i++)
        if ((kinds & KVPI_MEM_BIT(r->model[i].kind)) && addr >= r->model[i].addr &&
            (kvpf_u128)addr + len <= (kvpf_u128)r->model[i].addr + r->model[i].length)
            return 1;
    return 0;
}

/* Input: u8 count (mod KVPF_MAX_REGIONS + 1), then that many u64 addr + u64
 * length, registered in order; a region whose length has its top bit set is
 * device memory (the bit cleared), the rest host memory. Checks that the table
 * refuses exactly the empty, wrapping and overlapping ones and lists its
 * regions sorted. */
static inline void kvpf_regions_build(kvpf_regions *r, kvpf_reader *in)
{
    kvpi_region_table_init(&r->table);
    r->n = 0;
    size_t want = kvpf_take(in, 1) % (KVPF_MAX_REGIONS + 1);
    for (size_t i = 0; i < want; i++) {
        uint64_t addr = kvpf_take(in, 8), len = kvpf_take(in, 8);
        kvp_mem_kind kind = len >> 63 ? KVP_MEM_CUDA : KVP_MEM_HOST;
        len &= ~(1ull << 63);
        kvpi_region_entry *e;
        int ok =
            kvpi_region_add(&r->table, &(kvpi_region){.addr = addr, .length = len, .kind = kind},
                            &e) == KVP_OK;
        if (ok) kvpi_region_activate(&r->table, e);
        /* An end at exactly 2^64 counts as wrapping. */
        int model_ok =
            len != 0 && (kvpf_u128)addr + len <= UINT64_MAX && !kvpf_model_overlaps(r, addr, len);
        FUZZ_CHECK(ok == model_ok);
        if (ok) r->model[r->n++] = (kvpi_region){.addr = addr, .length = len, .kind = kind};
    }
    kvpi_pin *pins = NULL;
    size_t count = 0;
    FUZZ_CHECK(kvpi_region_pin_all(&r->table, &pins, &count) == KVP_OK);
    FUZZ_CHECK(count == r->n);
    for (size_t i = 1; i < count; i++) {
        const kvpi_region *a = kvpi_pin_region(pins[i - 1]), *b = kvpi_pin_region(pins[i]);
        FUZZ_CHECK(a->addr + a->length <= b->addr);
    }
    kvpi_region_unpin_all(&r->table, pins, count);
}

/* The server's decision for a non-empty request, checked against the model:
 * for a server of host memory only, and for one of host and CUDA memory. */
static inline void kvpf_regions_check_pin(kvpf_regions *r, uint64_t addr, uint64_t len)
{
    static const unsigned masks[] = {KVPI_MEM_HOST_BIT,
                                     KVPI_MEM_HOST_BIT | KVPI_MEM_BIT(KVP_MEM_CUDA)};
    for (size_t m = 0; m < sizeof masks / sizeof masks[0]; m++) {
        kvpi_pin pin;
        int pinned = kvpi_region_pin(&r->table, addr, len, masks[m], &pin) == KVP_OK;
        if (pinned) {
            const kvpi_region *g = kvpi_pin_region(pin);
            FUZZ_CHECK((masks[m] & KVPI_MEM_BIT(g->kind)) && addr >= g->addr &&
                       (kvpf_u128)addr + len <= (kvpf_u128)g->addr + g->length);
            kvpi_region_unpin(&r->table, pin);
        }
        FUZZ_CHECK(pinned == kvpf_model_inside(r, addr, len, masks[m]));
    }
}

static inline void kvpf_regions_free(kvpf_regions *r)
{
    kvpi_region_table_destroy(&r->table);
}

#endif
