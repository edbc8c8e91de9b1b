/* The rpc_meta value a peer publishes in the metadata store
 * (mooncake/rpc_meta/<segment> = {"ip_or_host_name": str, "rpc_port": int}),
 * read by kvpi_rpc_meta_parse in src/metadata/metadata.c. Invariants of an
 * accepted value: the host is the document's ip_or_host_name, non-empty and
 * shorter than KVPI_HOST_MAX, the port an integer in 0..65535; the value
 * kvpipe would publish for that host parses back to it. */
#include <cjson/cJSON.h>
#include <math.h>

#include "common/net.h"
#include "fuzz.h"
#include "metadata/metadata.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvpf_quiet();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    FUZZ_CHECK(text);
    memcpy(text, data, size);
    text[size] = '\0';
    char *host = NULL;
    kvp_status st = kvpi_rpc_meta_parse(text, "seg", "fuzz", &host);
    FUZZ_CHECK(st == KVP_OK || st == KVP_EPROTO || st == KVP_ENOMEM);
    if (st) {
        FUZZ_CHECK(host == NULL);
        free(text);
        return 0;
    }
    FUZZ_CHECK(host && host[0] && strlen(host) < KVPI_HOST_MAX);
    cJSON *o = cJSON_Parse(text);
    free(text);
    FUZZ_CHECK(cJSON_IsObject(o));
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(o, "ip_or_host_name");
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "rpc_port");
    FUZZ_CHECK(cJSON_IsString(h) && strcmp(h->valuestring, host) == 0);
    FUZZ_CHECK(cJSON_IsNumber(p) && p->valuedouble >= 0 && p->valuedouble <= 65535 &&
               floor(p->valuedouble) == p->valuedouble);
    int port = (int)p->valuedouble;
    cJSON_Delete(o);

    /* What kvpi_meta_publish writes for this host and port. */
    cJSON *out = cJSON_CreateObject();
    FUZZ_CHECK(out && cJSON_AddStringToObject(out, "ip_or_host_name", host) &&
               cJSON_AddNumberToObject(out, "rpc_port", port));
    char *again = cJSON_PrintUnformatted(out);
    cJSON_Delete(out);
    FUZZ_CHECK(again);
    char *back = NULL;
    FUZZ_CHECK(kvpi_rpc_meta_parse(again, "seg", "fuzz", &back) == KVP_OK);
    FUZZ_CHECK(strcmp(back, host) == 0);
    free(back);
    free(again);
    free(host);
    return 0;
}
