/* Internal: the core of the segment descriptor, Mooncake's JSON form of a
 * segment.
 *
 *   {"name": "h:p", "protocol": "tcp", "timestamp": "2025-01-31 17:04:05.012345",
 *    "buffers": [{"name": "h:p", "addr": A, "length": L}, ...], ...}
 *
 * The core owns only these fields. Everything else belongs to someone else
 * and is written and read there: each transport's top-level fields
 * (server_describe, read in its peer_open: tcp's tcp_data_port and
 * tcp_proto_version, shm's kvpipe_shm) and per-buffer fields
 * (buffer_describe), the engine's kvpipe_instance (KVPI_INSTANCE_FIELD).
 * "protocol" is the value of the transport whose wire Mooncake speaks
 * (kvpi_transport_ops.mooncake_protocol), never chosen here.
 *
 * As Mooncake writes it: each buffer is named after the segment (Mooncake's
 * TCP transport), the timestamp is local time with microseconds. Memory that
 * is not host memory adds "kind" ("cuda") and "device" to its buffer entry;
 * on reading, a buffer without "kind" named "cuda:N" (Mooncake's RDMA
 * transport names buffers after their location) is CUDA memory of device N,
 * any other is host memory. Numbers are written exactly (as integer text);
 * on reading, addresses and lengths must be non-negative integers below
 * 2^53, the exactness limit of the JSON parser.
 *
 * Any protocol parses (a Mooncake "rdma" descriptor included): whether a
 * transport can reach the segment is its peer_open's call.
 */
#ifndef KVPI_ENGINE_DESCRIPTOR_H
#define KVPI_ENGINE_DESCRIPTOR_H

#include <cjson/cJSON.h>

#include "common/region.h"

typedef struct kvpi_descriptor {
    cJSON *json;           /* the whole document, for the others' fields */
    const char *name;      /* points into json */
    const char *protocol;  /* points into json */
    kvpi_region *regions;  /* sorted by addr, non-overlapping; handles NULL */
    const cJSON **buffers; /* the entry of each region in json, aligned with regions */
    size_t n_regions;
} kvpi_descriptor;

/* Build the core of a local segment's document: name, protocol (left out
 * when NULL), timestamp, and a buffer entry per region; NULL when out of
 * memory. The buffer entries are in the order of regions, for the
 * transports' buffer_describe. */
cJSON *kvpi_descriptor_build(const char *name, const char *protocol, const kvpi_region *regions,
                             size_t n_regions);

/* Parse and validate a peer's document: KVP_EPROTO naming the bad field. */
kvp_status kvpi_descriptor_parse(const char *text, kvpi_descriptor *out);

void kvpi_descriptor_free(kvpi_descriptor *desc);

#endif
