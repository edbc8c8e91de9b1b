#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/error.h"
#include "common/region.h"
#include "engine/descriptor.h"

#define EXACT_LIMIT 9007199254740992.0 /* 2^53 */

static int add_u64(cJSON *obj, const char *key, uint64_t v)
{
    char text[24];
    snprintf(text, sizeof text, "%" PRIu64, v);
    return cJSON_AddRawToObject(obj, key, text) != NULL;
}

/* Local time with microseconds, as Mooncake's getCurrentDateTime() writes it:
 * "2025-01-31 17:04:05.012345". */
static void timestamp(char *out, size_t len)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct tm tm;
    char secs[24];
    strftime(secs, sizeof secs, "%Y-%m-%d %H:%M:%S", localtime_r(&now.tv_sec, &tm));
    snprintf(out, len, "%s.%06d", secs, (int)(now.tv_nsec / 1000) % 1000000);
}

/* A buffer entry: name, addr, length, and where the memory is not host
 * memory, its kind and device. */
static int add_buffer(cJSON *buffers, const char *name, const kvpi_region *r)
{
    cJSON *b = cJSON_CreateObject();
    if (!b) return 0;
    cJSON_AddItemToArray(buffers, b);
    /* Mooncake's TCP transport names each buffer after its segment. */
    if (!cJSON_AddStringToObject(b, "name", name) || !add_u64(b, "addr", r->addr) ||
        !add_u64(b, "length", r->length))
        return 0;
    if (r->kind == KVP_MEM_HOST) return 1;
    return cJSON_AddStringToObject(b, "kind", kvpi_mem_kind_name(r->kind)) &&
           cJSON_AddNumberToObject(b, "device", r->device);
}

cJSON *kvpi_descriptor_build(const char *name, const char *protocol, const kvpi_region *regions,
                             size_t n_regions)
{
    cJSON *doc = cJSON_CreateObject();
    cJSON *buffers = NULL;
    char stamp[64];
    timestamp(stamp, sizeof stamp);
    if (!doc || !cJSON_AddStringToObject(doc, "name", name) ||
        (protocol && !cJSON_AddStringToObject(doc, "protocol", protocol)) ||
        !cJSON_AddStringToObject(doc, "timestamp", stamp) ||
        !(buffers = cJSON_AddArrayToObject(doc, "buffers")))
        goto fail;
    for (size_t i = 0; i < n_regions; i++)
        if (!add_buffer(buffers, name, &regions[i])) goto fail;
    return doc;
fail:
    cJSON_Delete(doc);
    return NULL;
}

static kvp_status get_u64(const cJSON *obj, const char *key, const char *where, uint64_t *out)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(item))
        return kvpi_error(KVP_EPROTO, "segment descriptor: %s.%s missing or not a number", where,
                          key);
    double d = item->valuedouble;
    if (!(d >= 0) || d >= EXACT_LIMIT || floor(d) != d)
        return kvpi_error(KVP_EPROTO, "segment descriptor: %s.%s is not an integer in [0, 2^53)",
                          where, key);
    *out = (uint64_t)d;
    return KVP_OK;
}

/* The memory kind of buffer entry b: its "kind" and "device" (kvpipe's), else
 * what a Mooncake location name ("cuda:0") says, else host. A kind this build
 * does not know is KVPI_MEM_KIND_UNKNOWN, which no transport can touch. */
static kvp_status parse_kind(const cJSON *b, size_t i, kvpi_region *r)
{
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(b, "kind");
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(b, "name");
    r->kind = KVP_MEM_HOST;
    r->device = 0;
    if (kind) {
        if (!cJSON_IsString(kind))
            return kvpi_error(KVP_EPROTO, "segment descriptor: buffers[%zu].kind is not a string",
                              i);
        r->kind = kvpi_mem_kind_parse(kind->valuestring);
        uint64_t dev = 0;
        kvp_status st = cJSON_GetObjectItemCaseSensitive(b, "device")
                            ? get_u64(b, "device", "buffers[]", &dev)
                            : KVP_OK;
        if (st) return st;
        r->device = dev > INT32_MAX ? INT32_MAX : (int)dev;
        return KVP_OK;
    }
    int dev, used = 0;
    if (cJSON_IsString(name) && sscanf(name->valuestring, "cuda:%d%n", &dev, &used) == 1 &&
        name->valuestring[used] == '\0' && dev >= 0) {
        r->kind = KVP_MEM_CUDA;
        r->device = dev;
    }
    return KVP_OK;
}

/* A buffer and its entry, sorted together. */
typedef struct parsed_buffer {
    kvpi_region region;
    const cJSON *json;
} parsed_buffer;

static int buffer_cmp(const void *a, const void *b)
{
    const parsed_buffer *x = a, *y = b;
    return x->region.addr < y->region.addr ? -1 : x->region.addr > y->region.addr;
}

static kvp_status parse_buffers(const cJSON *buffers, kvpi_descriptor *d)
{
    if (!cJSON_IsArray(buffers))
        return kvpi_error(KVP_EPROTO, "segment descriptor: 'buffers' missing or not an array");
    size_t n = (size_t)cJSON_GetArraySize(buffers);
    parsed_buffer *p = calloc(n ? n : 1, sizeof *p);
    d->regions = calloc(n ? n : 1, sizeof *d->regions);
    d->buffers = calloc(n ? n : 1, sizeof *d->buffers);
    kvp_status st = KVP_OK;
    if (!p || !d->regions || !d->buffers) {
        st = kvpi_error(KVP_ENOMEM, "segment descriptor: out of memory");
        goto out;
    }
    size_t i = 0;
    const cJSON *b;
    cJSON_ArrayForEach(b, buffers)
    {
        if (!cJSON_IsObject(b)) {
            st = kvpi_error(KVP_EPROTO, "segment descriptor: buffers[%zu] is not an object", i);
            goto out;
        }
        if ((st = get_u64(b, "addr", "buffers[]", &p[i].region.addr)) ||
            (st = get_u64(b, "length", "buffers[]", &p[i].region.length)) ||
            (st = parse_kind(b, i, &p[i].region)))
            goto out;
        if (p[i].region.length > UINT64_MAX - p[i].region.addr) {
            st = kvpi_error(KVP_EPROTO, "segment descriptor: buffers[%zu] wraps around", i);
            goto out;
        }
        p[i].json = b;
        i++;
    }
    qsort(p, n, sizeof *p, buffer_cmp);
    for (i = 0; i < n; i++) {
        d->regions[i] = p[i].region;
        d->buffers[i] = p[i].json;
    }
    d->n_regions = n;
    for (i = 1; i < n; i++)
        if (d->regions[i - 1].addr + d->regions[i - 1].length > d->regions[i].addr) {
            st = kvpi_error(KVP_EPROTO, "segment descriptor: buffers overlap");
            goto out;
        }
out:
    free(p);
    return st;
}

kvp_status kvpi_descriptor_parse(const char *text, kvpi_descriptor *out)
{
    kvpi_descriptor d = {0};
    kvp_status st = KVP_OK;
    d.json = cJSON_Parse(text);
    if (!cJSON_IsObject(d.json)) {
        st = kvpi_error(KVP_EPROTO, "segment descriptor is not a JSON object");
        goto fail;
    }
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(d.json, "name");
    const cJSON *proto = cJSON_GetObjectItemCaseSensitive(d.json, "protocol");
    if (!cJSON_IsString(name)) {
        st = kvpi_error(KVP_EPROTO, "segment descriptor: 'name' missing or not a string");
        goto fail;
    }
    d.name = name->valuestring;
    if (!cJSON_IsString(proto)) {
        st = kvpi_error(KVP_EPROTO, "segment descriptor of '%s': 'protocol' missing", d.name);
        goto fail;
    }
    d.protocol = proto->valuestring;
    if ((st = parse_buffers(cJSON_GetObjectItemCaseSensitive(d.json, "buffers"), &d))) goto fail;
    *out = d;
    return KVP_OK;
fail:
    kvpi_descriptor_free(&d);
    return st;
}

void kvpi_descriptor_free(kvpi_descriptor *desc)
{
    cJSON_Delete(desc->json);
    free(desc->regions);
    free(desc->buffers);
    memset(desc, 0, sizeof *desc);
}
