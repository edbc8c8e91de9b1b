/* The core of a peer's segment descriptor (src/engine/descriptor.c), as read
 * from the metadata store or a P2P handshake (the transports' own fields are
 * read in their peer_open). Invariants of an accepted one: a name and a
 * protocol, regions sorted by address that neither overlap nor pass 2^53 (so
 * cannot wrap), each reachable by the range check, with no handles and a
 * buffer entry each; and building a descriptor from what was parsed and
 * parsing that again gives the same name, protocol and regions (kind and
 * device included). */
#include <cjson/cJSON.h>

#include "engine/descriptor.h"
#include "fuzz.h"

KVPF_QUIET_INITIALIZE

static void check(const kvpi_descriptor *d)
{
    FUZZ_CHECK(d->json && d->name && d->protocol);
    FUZZ_CHECK(d->n_regions == 0 || (d->regions && d->buffers));
    for (size_t i = 0; i < d->n_regions; i++) {
        const kvpi_region *r = &d->regions[i];
        /* Numbers past 2^53 are not exact in JSON, so they are refused. */
        FUZZ_CHECK(r->addr < (1ull << 53) && r->length < (1ull << 53));
        FUZZ_CHECK(d->buffers[i] != NULL);
        for (size_t k = 0; k < KVPI_MAX_TRANSPORTS; k++)
            FUZZ_CHECK(r->handle[k] == NULL);
        if (i) FUZZ_CHECK(d->regions[i - 1].addr + d->regions[i - 1].length <= r->addr);
        /* The client's range check lets the whole region through. */
        FUZZ_CHECK(kvpi_regions_contain(d->regions, d->n_regions, r->addr, r->length));
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    FUZZ_CHECK(text);
    memcpy(text, data, size);
    text[size] = '\0';
    kvpi_descriptor d;
    kvp_status st = kvpi_descriptor_parse(text, &d);
    free(text);
    FUZZ_CHECK(st == KVP_OK || st == KVP_EPROTO || st == KVP_ENOTSUP || st == KVP_ENOMEM);
    if (st) return 0;
    check(&d);

    cJSON *built = kvpi_descriptor_build(d.name, d.protocol, d.regions, d.n_regions);
    FUZZ_CHECK(built);
    char *again = cJSON_PrintUnformatted(built);
    cJSON_Delete(built);
    FUZZ_CHECK(again);
    kvpi_descriptor back;
    FUZZ_CHECK(kvpi_descriptor_parse(again, &back) == KVP_OK);
    free(again);
    check(&back);
    FUZZ_CHECK(strcmp(back.name, d.name) == 0 && strcmp(back.protocol, d.protocol) == 0);
    FUZZ_CHECK(back.n_regions == d.n_regions);
    for (size_t i = 0; i < d.n_regions; i++) {
        const kvpi_region *a = &d.regions[i], *b = &back.regions[i];
        FUZZ_CHECK(a->addr == b->addr && a->length == b->length && a->kind == b->kind &&
                   a->device == b->device);
    }
    kvpi_descriptor_free(&back);
    kvpi_descriptor_free(&d);
    return 0;
}
