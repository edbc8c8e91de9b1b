/* The mooncake config JSON of a pipe (src/pipe/config.c): MOONCAKE_CONFIG_PATH
 * is operator input, but it names peers, and vLLM writes it from user
 * settings. Invariants of an accepted config: every field checks again, the
 * metadata connection string follows Mooncake's rule, and the endpoints of the
 * two sides mirror each other (what prefill connects to is where decode
 * listens), with every port in 1..65535; writing the config out and parsing it
 * again gives the same fields. */
#include <cjson/cJSON.h>

#include "common/net.h"
#include "fuzz.h"
#include "kvpipe/pipe.h"
#include "metadata/metadata.h"

KVPF_QUIET_INITIALIZE

static int same(const char *a, const char *b)
{
    return (!a && !b) || (a && b && strcmp(a, b) == 0);
}

static void check_conn(const kvp_pipe_config *cfg)
{
    char *conn = NULL;
    FUZZ_CHECK(kvp_pipe_config_metadata_conn(cfg, &conn) == KVP_OK && conn);
    const char *s = cfg->metadata_server;
    if (strcmp(s, KVPI_P2P_CONN) == 0 || strstr(s, "://")) {
        FUZZ_CHECK(strcmp(conn, s) == 0);
    } else {
        const char *scheme = cfg->metadata_backend ? cfg->metadata_backend : "etcd";
        size_t n = strlen(scheme);
        FUZZ_CHECK(strncmp(conn, scheme, n) == 0 && strncmp(conn + n, "://", 3) == 0 &&
                   strcmp(conn + n + 3, s) == 0);
    }
    free(conn);
}

static void check_ports(const kvp_pipe_endpoints *e)
{
    const int ports[] = {e->engine_port,      e->data_port,      e->ack_port,
                         e->peer_engine_port, e->peer_data_port, e->peer_ack_port};
    for (size_t i = 0; i < sizeof ports / sizeof ports[0]; i++)
        FUZZ_CHECK(ports[i] >= 1 && ports[i] <= 65535);
    FUZZ_CHECK(e->data_port != e->engine_port && e->ack_port != e->data_port);
    kvpi_hostport hp;
    FUZZ_CHECK(kvpi_hostport_parse(e->local_segment, -1, &hp) == KVP_OK);
    FUZZ_CHECK(hp.port == e->engine_port && strcmp(hp.host, e->local_host) == 0);
}

static void check_endpoints(const kvp_pipe_config *cfg, int local_rank)
{
    kvp_pipe_endpoints p, d;
    kvp_status sp = kvp_pipe_config_endpoints(cfg, local_rank, 0, &p);
    kvp_status sd = kvp_pipe_config_endpoints(cfg, local_rank, 1, &d);
    FUZZ_CHECK(sp == KVP_OK || sp == KVP_ECONFIG);
    FUZZ_CHECK(sd == KVP_OK || sd == KVP_ECONFIG);
    /* Both sides need the ports of both, so they succeed or fail together. */
    FUZZ_CHECK(sp == sd);
    if (sp) return;
    check_ports(&p);
    check_ports(&d);
    FUZZ_CHECK(p.peer_engine_port == d.engine_port && d.peer_engine_port == p.engine_port);
    FUZZ_CHECK(p.peer_data_port == d.data_port && d.peer_data_port == p.data_port);
    FUZZ_CHECK(p.peer_ack_port == d.ack_port && d.peer_ack_port == p.ack_port);
    FUZZ_CHECK(strcmp(p.peer_segment, d.local_segment) == 0);
    FUZZ_CHECK(strcmp(d.peer_segment, p.local_segment) == 0);
    FUZZ_CHECK(strcmp(p.local_segment, d.local_segment) != 0);
    kvpi_hostport hp;
    FUZZ_CHECK(kvpi_hostport_parse(cfg->prefill_url, -1, &hp) == KVP_OK);
    FUZZ_CHECK(p.engine_port == hp.port + local_rank && strcmp(p.local_host, hp.host) == 0);
}

static void check_reparse(const kvp_pipe_config *cfg)
{
    cJSON *o = cJSON_CreateObject();
    FUZZ_CHECK(o);
    cJSON_AddStringToObject(o, "prefill_url", cfg->prefill_url);
    cJSON_AddStringToObject(o, "decode_url", cfg->decode_url);
    cJSON_AddStringToObject(o, "metadata_server", cfg->metadata_server);
    if (cfg->metadata_backend)
        cJSON_AddStringToObject(o, "metadata_backend", cfg->metadata_backend);
    cJSON_AddStringToObject(o, "protocol", cfg->protocol);
    cJSON_AddStringToObject(o, "device_name", cfg->device_name);
    char *text = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    FUZZ_CHECK(text);
    kvp_pipe_config *back = NULL;
    FUZZ_CHECK(kvp_pipe_config_parse(text, strlen(text), &back) == KVP_OK);
    free(text);
    FUZZ_CHECK(same(back->prefill_url, cfg->prefill_url) &&
               same(back->decode_url, cfg->decode_url) &&
               same(back->metadata_server, cfg->metadata_server) &&
               same(back->metadata_backend, cfg->metadata_backend) &&
               same(back->protocol, cfg->protocol) && same(back->device_name, cfg->device_name));
    kvp_pipe_config_free(back);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvp_pipe_config *cfg = NULL;
    kvp_status st = kvp_pipe_config_parse((const char *)data, size, &cfg);
    FUZZ_CHECK(st == KVP_OK || st == KVP_ECONFIG || st == KVP_ENOMEM);
    if (st) {
        FUZZ_CHECK(cfg == NULL);
        return 0;
    }
    FUZZ_CHECK(kvp_pipe_config_check(cfg) == KVP_OK);
    FUZZ_CHECK(cfg->protocol && cfg->device_name && cfg->metadata_server[0]);
    FUZZ_CHECK(!cfg->metadata_backend || strcmp(cfg->metadata_backend, "etcd") == 0 ||
               strcmp(cfg->metadata_backend, "redis") == 0);
    check_conn(cfg);
    /* The last byte picks one more local rank, so the fuzzer reaches the
     * port ceiling as well. */
    check_endpoints(cfg, 0);
    check_endpoints(cfg, 7);
    check_endpoints(cfg, size ? data[size - 1] * 16 : 1);
    check_reparse(cfg);
    kvp_pipe_config_free(cfg);
    return 0;
}
