/* Descriptor fields of an upper layer, read from a peer (engine_ext.h). */
#include <stdlib.h>

#include "common/error.h"
#include "engine/engine_ext.h"
#include "engine/engine_internal.h"

kvp_status kvpi_engine_lookup_field(kvp_engine *e, const char *segment, const char *key,
                                    cJSON **out)
{
    if (!e || !segment || !key || !out)
        return kvpi_error(KVP_EINVAL, "lookup_field: NULL argument");
    char *text = NULL, *host = NULL;
    kvp_status st = kvpi_meta_fetch(e->meta, segment, &text, &host);
    free(host);
    if (st) return st;
    cJSON *doc = cJSON_Parse(text);
    free(text);
    if (!cJSON_IsObject(doc)) {
        cJSON_Delete(doc);
        return kvpi_error(KVP_EPROTO, "segment %s: its descriptor is not a JSON object", segment);
    }
    *out = cJSON_DetachItemFromObjectCaseSensitive(doc, key);
    cJSON_Delete(doc);
    return KVP_OK;
}

const char *kvp_engine_instance(const kvp_engine *e)
{
    return e ? e->instance : NULL;
}
