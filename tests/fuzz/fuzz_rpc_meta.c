/* The rpc_meta value a peer publishes in the metadata store
 * (mooncake/rpc_meta/<segment> = {"ip_or_host_name": str, "rpc_port": int}),
 * read by kvpi_rpc_meta_parse in src/metadata/metadata.c. Invariants of an
 * accepted value: the host is the document's ip_or_host_name, non-empty and
 * shorter than KVPI_HOST_MAX, the port an integer in 0..65535; the value
 * kvpipe would publish for that host and port parses back to them. Outputs
 * are set only on success. */
#include <cjson/cJSON.h>
#include <math.h>

#include "common/net.h"
#include "fuzz.h"
#include "metadata/metadata.h"

KVPF_QUIET_INITIALIZE

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    FUZZ_CHECK(text);
    memcpy(text, data, size);
    text[size] = '\0';
    char host[KVPI_HOST_MAX];
    int port = -1;
    memset(host, 0x5a, sizeof host);
    kvp_status st = kvpi_rpc_meta_parse(text, host, &port);
    FUZZ_CHECK(st == KVP_OK || st == KVP_EPROTO);
    if (st) {
        /* Outputs are set only on success. */
        FUZZ_CHECK(port == -1 && (unsigned char)host[0] == 0x5a);
        free(text);
        return 0;
    }
    FUZZ_CHECK(host[0] && memchr(host, '\0', KVPI_HOST_MAX));
    cJSON *o = cJSON_Parse(text);
    free(text);
    FUZZ_CHECK(cJSON_IsObject(o));
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(o, "ip_or_host_name");
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "rpc_port");
    FUZZ_CHECK(cJSON_IsString(h) && strcmp(h->valuestring, host) == 0);
    FUZZ_CHECK(cJSON_IsNumber(p) && p->valuedouble >= 0 && p->valuedouble <= 65535 &&
               floor(p->valuedouble) == p->valuedouble && port == (int)p->valuedouble);
    cJSON_Delete(o);

    /* What kvpipe publishes for this host and port (rpc_meta_json). */
    cJSON *out = cJSON_CreateObject();
    FUZZ_CHECK(out && cJSON_AddStringToObject(out, "ip_or_host_name", host) &&
               cJSON_AddNumberToObject(out, "rpc_port", port));
    char *again = cJSON_PrintUnformatted(out);
    cJSON_Delete(out);
    FUZZ_CHECK(again);
    char back[KVPI_HOST_MAX];
    int back_port = -1;
    FUZZ_CHECK(kvpi_rpc_meta_parse(again, back, &back_port) == KVP_OK);
    FUZZ_CHECK(strcmp(back, host) == 0 && back_port == port);
    free(again);
    return 0;
}
