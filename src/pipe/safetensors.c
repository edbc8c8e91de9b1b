#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"
#include "common/net.h"
#include "pipe/safetensors.h"

/* Largest integer a JSON number (a double in cJSON) carries exactly. */
#define JSON_INT_MAX 9007199254740992.0

#define HEADER_CAP KVPI_SAFETENSORS_HEADER_CAP

kvp_status kvpi_safetensors_header(const kvp_tensor *t, char *hdr, size_t *padded)
{
    size_t nbytes;
    kvp_status st = kvp_tensor_size(t->dtype, t->ndim, t->shape, NULL, &nbytes);
    if (st) return st;
    if (nbytes != t->nbytes)
        return kvpi_error(KVP_EINVAL, "tensor nbytes %zu does not match its shape (%zu)", t->nbytes,
                          nbytes);
    int n = snprintf(hdr, HEADER_CAP, "{\"tensor\":{\"dtype\":\"%s\",\"shape\":[",
                     kvp_dtype_name(t->dtype));
    for (int i = 0; i < t->ndim; i++)
        n += snprintf(hdr + n, HEADER_CAP - (size_t)n, "%s%lld", i ? "," : "",
                      (long long)t->shape[i]);
    n += snprintf(hdr + n, HEADER_CAP - (size_t)n, "],\"data_offsets\":[0,%zu]}}", nbytes);
    size_t len = (size_t)n;
    /* safetensors pads with spaces so that the data area starts 8-aligned. */
    while (len % 8)
        hdr[len++] = ' ';
    *padded = len;
    return KVP_OK;
}

kvp_status kvpi_safetensors_size(const kvp_tensor *t, size_t *out)
{
    if (!t || !out) return kvpi_error(KVP_EINVAL, "safetensors size: NULL argument");
    char hdr[HEADER_CAP];
    size_t hlen;
    kvp_status st = kvpi_safetensors_header(t, hdr, &hlen);
    if (st) return st;
    if (t->nbytes > SIZE_MAX - 8 - hlen)
        return kvpi_error(KVP_EINVAL, "tensor of %zu bytes too large to encode", t->nbytes);
    *out = 8 + hlen + t->nbytes;
    return KVP_OK;
}

kvp_status kvpi_safetensors_write_header(const kvp_tensor *t, void *buf, size_t cap,
                                         size_t *data_off)
{
    if (!t || !buf || !data_off) return kvpi_error(KVP_EINVAL, "safetensors write: NULL argument");
    if (t->nbytes && !t->data) return kvpi_error(KVP_EINVAL, "tensor data is NULL");
    char hdr[HEADER_CAP];
    size_t hlen;
    kvp_status st = kvpi_safetensors_header(t, hdr, &hlen);
    if (st) return st;
    if (cap < 8 + hlen || cap - 8 - hlen < t->nbytes)
        return kvpi_error(KVP_EINVAL, "buffer of %zu bytes too small for a %zu-byte tensor", cap,
                          t->nbytes);
    uint8_t *p = buf;
    kvpi_put_le64(p, hlen);
    memcpy(p + 8, hdr, hlen);
    *data_off = 8 + hlen;
    return KVP_OK;
}

kvp_status kvpi_safetensors_write(const kvp_tensor *t, void *buf, size_t cap, size_t *written)
{
    size_t off;
    kvp_status st = kvpi_safetensors_write_header(t, buf, cap, &off);
    if (st) return st;
    if (t->nbytes) memcpy((uint8_t *)buf + off, t->data, t->nbytes);
    *written = off + t->nbytes;
    return KVP_OK;
}

/* A JSON number that is an exact non-negative integer. */
static int json_uint(const cJSON *item, uint64_t *out)
{
    if (!cJSON_IsNumber(item)) return -1;
    double v = item->valuedouble;
    if (!isfinite(v) || v < 0 || v > JSON_INT_MAX || floor(v) != v) return -1;
    *out = (uint64_t)v;
    return 0;
}

static kvp_status parse_shape(const cJSON *shape, kvp_tensor *t)
{
    if (!cJSON_IsArray(shape))
        return kvpi_error(KVP_EPROTO, "safetensors: 'shape' is not an array");
    int n = cJSON_GetArraySize(shape);
    if (n > KVP_TENSOR_MAX_NDIM)
        return kvpi_error(KVP_EPROTO, "safetensors: %d dimensions, at most %d supported", n,
                          KVP_TENSOR_MAX_NDIM);
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape)
    {
        uint64_t v;
        if (json_uint(d, &v) != 0)
            return kvpi_error(KVP_EPROTO, "safetensors: shape[%d] is not a non-negative integer",
                              i);
        t->shape[i++] = (int64_t)v;
    }
    t->ndim = n;
    return KVP_OK;
}

static kvp_status parse_offsets(const cJSON *offs, uint64_t *begin, uint64_t *end)
{
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 ||
        json_uint(cJSON_GetArrayItem(offs, 0), begin) != 0 ||
        json_uint(cJSON_GetArrayItem(offs, 1), end) != 0)
        return kvpi_error(KVP_EPROTO,
                          "safetensors: 'data_offsets' must be [begin, end] of non-negative "
                          "integers");
    if (*begin > *end)
        return kvpi_error(KVP_EPROTO, "safetensors: data_offsets begin %llu > end %llu",
                          (unsigned long long)*begin, (unsigned long long)*end);
    return KVP_OK;
}

/* Check the fields of the tensor entry and fill t (without data). */
static kvp_status parse_entry(const cJSON *entry, size_t data_len, kvp_tensor *t,
                              uint64_t *begin_out)
{
    if (!cJSON_IsObject(entry))
        return kvpi_error(KVP_EPROTO, "safetensors: 'tensor' is not an object");
    const cJSON *dtype = NULL, *shape = NULL, *offs = NULL, *f;
    cJSON_ArrayForEach(f, entry)
    {
        const cJSON **slot = strcmp(f->string, "dtype") == 0          ? &dtype
                             : strcmp(f->string, "shape") == 0        ? &shape
                             : strcmp(f->string, "data_offsets") == 0 ? &offs
                                                                      : NULL;
        if (!slot) return kvpi_error(KVP_EPROTO, "safetensors: unknown field '%.40s'", f->string);
        if (*slot) return kvpi_error(KVP_EPROTO, "safetensors: duplicate field '%s'", f->string);
        *slot = f;
    }
    if (!dtype || !shape || !offs)
        return kvpi_error(KVP_EPROTO, "safetensors: tensor entry lacks '%s'",
                          !dtype   ? "dtype"
                          : !shape ? "shape"
                                   : "data_offsets");
    if (!cJSON_IsString(dtype))
        return kvpi_error(KVP_EPROTO, "safetensors: 'dtype' is not a string");
    if (kvp_dtype_from_name(dtype->valuestring, &t->dtype) != KVP_OK)
        return kvpi_error(KVP_EPROTO, "safetensors: unknown dtype '%.32s'", dtype->valuestring);
    kvp_status st = parse_shape(shape, t);
    if (st) return st;
    uint64_t begin, end;
    if ((st = parse_offsets(offs, &begin, &end))) return st;
    if (kvp_tensor_size(t->dtype, t->ndim, t->shape, NULL, &t->nbytes) != KVP_OK)
        return kvpi_error(KVP_EPROTO, "safetensors: shape overflows");
    /* safetensors requires the tensors to cover the data area with no gap. */
    if (begin != 0 || end != data_len)
        return kvpi_error(KVP_EPROTO,
                          "safetensors: data_offsets [%llu, %llu] do not cover the %zu-byte data "
                          "area",
                          (unsigned long long)begin, (unsigned long long)end, data_len);
    if (end - begin != t->nbytes)
        return kvpi_error(KVP_EPROTO,
                          "safetensors: %s shape needs %zu bytes but data_offsets span %llu",
                          dtype->valuestring, t->nbytes, (unsigned long long)(end - begin));
    *begin_out = begin;
    return KVP_OK;
}

static kvp_status check_metadata(const cJSON *meta)
{
    if (!cJSON_IsObject(meta))
        return kvpi_error(KVP_EPROTO, "safetensors: '__metadata__' is not an object");
    const cJSON *v;
    cJSON_ArrayForEach(v, meta)
    {
        if (!cJSON_IsString(v))
            return kvpi_error(KVP_EPROTO, "safetensors: __metadata__ value '%.40s' is not a string",
                              v->string);
    }
    return KVP_OK;
}

/* Find the one "tensor" entry among the root's keys. */
static kvp_status find_entry(const cJSON *root, const cJSON **out)
{
    if (!cJSON_IsObject(root))
        return kvpi_error(KVP_EPROTO, "safetensors: header is not an object");
    const cJSON *entry = NULL, *meta = NULL, *f;
    cJSON_ArrayForEach(f, root)
    {
        if (strcmp(f->string, "__metadata__") == 0) {
            if (meta) return kvpi_error(KVP_EPROTO, "safetensors: duplicate '__metadata__'");
            meta = f;
            kvp_status st = check_metadata(f);
            if (st) return st;
        } else if (strcmp(f->string, "tensor") == 0) {
            if (entry) return kvpi_error(KVP_EPROTO, "safetensors: duplicate tensor 'tensor'");
            entry = f;
        } else {
            return kvpi_error(KVP_EPROTO,
                              "safetensors: extra tensor '%.40s' (a pipe message holds exactly "
                              "one tensor named 'tensor')",
                              f->string);
        }
    }
    if (!entry) return kvpi_error(KVP_EPROTO, "safetensors: no tensor named 'tensor'");
    *out = entry;
    return KVP_OK;
}

static int only_whitespace(const char *p, const char *end)
{
    for (; p < end; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') return 0;
    return 1;
}

kvp_status kvpi_safetensors_parse(const void *buf, size_t len, kvp_tensor *out)
{
    if (!buf || !out) return kvpi_error(KVP_EINVAL, "safetensors parse: NULL argument");
    if (len < 8)
        return kvpi_error(KVP_EPROTO, "safetensors: message of %zu bytes is shorter than 8", len);
    const uint8_t *p = buf;
    uint64_t n = kvpi_get_le64(p);
    if (n > KVPI_SAFETENSORS_MAX_HEADER)
        return kvpi_error(KVP_EPROTO, "safetensors: header length %llu above the %u limit",
                          (unsigned long long)n, KVPI_SAFETENSORS_MAX_HEADER);
    if (n > len - 8)
        return kvpi_error(KVP_EPROTO,
                          "safetensors: header length %llu exceeds the %zu-byte message",
                          (unsigned long long)n, len);
    const char *hdr = (const char *)p + 8;
    if (n < 2 || hdr[0] != '{')
        return kvpi_error(KVP_EPROTO, "safetensors: header is not a JSON object");
    /* cJSON decodes \u0000 into a NUL that would cut a name short ("U8\u0000"
     * reading as "U8"); no valid header needs one. */
    if (memchr(hdr, 0, (size_t)n) || memmem(hdr, (size_t)n, "\\u0000", 6))
        return kvpi_error(KVP_EPROTO, "safetensors: header contains an escaped NUL character");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)n, &end, 0);
    if (!root) return kvpi_error(KVP_EPROTO, "safetensors: header is not valid JSON");
    kvp_status st = KVP_OK;
    if (!end || end > hdr + n || !only_whitespace(end, hdr + n)) {
        st = kvpi_error(KVP_EPROTO, "safetensors: bytes after the JSON header");
        goto out;
    }
    const cJSON *entry;
    if ((st = find_entry(root, &entry))) goto out;
    kvp_tensor t;
    memset(&t, 0, sizeof t);
    uint64_t begin;
    size_t data_len = len - 8 - (size_t)n;
    if ((st = parse_entry(entry, data_len, &t, &begin))) goto out;
    t.data = (void *)(p + 8 + n + begin);
    *out = t;
out:
    cJSON_Delete(root);
    return st;
}
