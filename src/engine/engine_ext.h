/* Internal: what the tensor pipe asks of its engine beyond the public API:
 * descriptor fields of an upper layer. A pipe advertises what its side
 * accepts (kvpipe's own fast path) in a field of its engine's segment
 * descriptor, so only a peer that reads that field - a kvpipe pipe - uses
 * it; Mooncake and MooncakePipe peers ignore unknown fields. The fields are
 * fixed for the engine's life: they are in the first descriptor the engine
 * publishes. (Submitting, completion and instance ids are public:
 * kvp_batch_submit_with(), kvp_engine_instance() in engine.h.)
 */
#ifndef KVPI_ENGINE_EXT_H
#define KVPI_ENGINE_EXT_H

#include <cjson/cJSON.h>

#include "kvpipe/engine.h"

/* kvp_engine_create() with fields, a JSON object whose members are added to
 * every descriptor the engine publishes (copied; NULL: none). A member may not
 * replace one of the engine's or a transport's (KVP_EINVAL). */
kvp_status kvpi_engine_create_with_fields(const kvp_engine_opts *opts, const cJSON *fields,
                                          kvp_engine **out);

/* Look the segment's descriptor up now (the metadata store, or a handshake in
 * P2P mode; the engine's cached copy is not used nor changed) and return a
 * copy of its member key, or NULL in *out when the descriptor has none. The
 * caller frees it with cJSON_Delete(). Blocks up to the engine's timeout_ms;
 * the lookup's errors (KVP_ENOTFOUND, KVP_ECONNREFUSED, KVP_EPROTO for text
 * that is not a JSON object, ...). Thread-safe. */
kvp_status kvpi_engine_lookup_field(kvp_engine *e, const char *segment, const char *key,
                                    cJSON **out);

#endif
