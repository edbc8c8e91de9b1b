/* Internal: the segment descriptor, Mooncake's JSON form of a segment.
 *
 *   {"name": "h:p", "protocol": "tcp", "tcp_data_port": N, "tcp_proto_version": 2,
 *    "timestamp": "2025-01-31 17:04:05.012345",
 *    "buffers": [{"name": "h:p", "addr": A, "length": L}, ...]}
 *
 * As Mooncake writes it: each buffer is named after the segment (Mooncake's
 * TCP transport), the timestamp is local time with microseconds.
 * Readers ignore unknown fields, so transports add their own (shm does), and
 * the engine its instance id (KVPI_INSTANCE_FIELD). Numbers
 * are written exactly (as integer text); on reading, addresses and lengths must
 * be non-negative integers below 2^53, the exactness limit of the JSON parser.
 */
#ifndef KVPI_ENGINE_DESCRIPTOR_H
#define KVPI_ENGINE_DESCRIPTOR_H

#include <cjson/cJSON.h>

#include "common/region.h"

#define KVPI_TCP_PROTO_VERSION 2

typedef struct kvpi_descriptor {
    cJSON *json;           /* the whole document, for transports' own fields */
    const char *name;      /* points into json */
    int tcp_data_port;     /* 0 when absent */
    int tcp_proto_version; /* 1 when absent (Mooncake before v2) */
    kvpi_region *regions;  /* sorted by addr, non-overlapping */
    const cJSON **buffers; /* the entry of each region in json, aligned with regions */
    size_t n_regions;
} kvpi_descriptor;

/* Build the document of a local segment; NULL when out of memory. */
cJSON *kvpi_descriptor_build(const char *name, int tcp_data_port, const kvpi_region *regions,
                             size_t n_regions);

/* Parse and validate a peer's document. KVP_EPROTO naming the bad field, or
 * KVP_ENOTSUP for a protocol other than tcp. */
kvp_status kvpi_descriptor_parse(const char *text, kvpi_descriptor *out);

void kvpi_descriptor_free(kvpi_descriptor *desc);

#endif
