/* The mooncake JSON config: loading, validation and the ports derived from it. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvpipe/pipe.h"
#include "test.h"

static kvp_status parse(const char *json, kvp_pipe_config **out)
{
    return kvp_pipe_config_parse(json, strlen(json), out);
}

/* Parsing must fail with KVP_ECONFIG and a message that contains want. */
static void expect_error(const char *json, const char *want)
{
    kvp_pipe_config *cfg = NULL;
    kvp_status st = parse(json, &cfg);
    if (st != KVP_ECONFIG || !strstr(kvp_last_error(), want))
        fprintf(stderr, "  config %s\n  -> %d '%s', want ECONFIG with '%s'\n", json, st,
                kvp_last_error(), want);
    CHECK(st == KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), want) != NULL);
    CHECK(cfg == NULL);
}

static const char *full =
    "{\"prefill_url\": \"127.0.0.1:13003\", \"decode_url\": \"127.0.0.1:14003\","
    " \"metadata_server\": \"127.0.0.1:2379\", \"metadata_backend\": \"etcd\","
    " \"protocol\": \"tcp\", \"device_name\": \"mlx5_0\", \"extra\": [1, 2]}";

static void test_valid_full(void)
{
    kvp_pipe_config *cfg;
    REQUIRE_OK(parse(full, &cfg));
    CHECK(strcmp(cfg->prefill_url, "127.0.0.1:13003") == 0);
    CHECK(strcmp(cfg->decode_url, "127.0.0.1:14003") == 0);
    CHECK(strcmp(cfg->metadata_server, "127.0.0.1:2379") == 0);
    CHECK(strcmp(cfg->metadata_backend, "etcd") == 0);
    CHECK(strcmp(cfg->protocol, "tcp") == 0);
    CHECK(strcmp(cfg->device_name, "mlx5_0") == 0);
    kvp_pipe_config_free(cfg);
}

static void test_defaults(void)
{
    kvp_pipe_config *cfg;
    REQUIRE_OK(parse("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\","
                     "\"metadata_server\":\"http://h:8080/metadata\",\"metadata_backend\":null}",
                     &cfg));
    CHECK(cfg->metadata_backend == NULL);
    CHECK(strcmp(cfg->protocol, "tcp") == 0);
    CHECK(strcmp(cfg->device_name, "") == 0);
    kvp_pipe_config_free(cfg);
    /* vLLM lower-cases the backend */
    REQUIRE_OK(parse("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\","
                     "\"metadata_server\":\"h:6379\",\"metadata_backend\":\"Redis\"}",
                     &cfg));
    CHECK(strcmp(cfg->metadata_backend, "redis") == 0);
    kvp_pipe_config_free(cfg);
}

static void test_missing_fields(void)
{
    expect_error("{\"decode_url\":\"b:2\",\"metadata_server\":\"m\"}", "'prefill_url' is missing");
    expect_error("{\"prefill_url\":\"a:1\",\"metadata_server\":\"m\"}", "'decode_url' is missing");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\"}",
                 "'metadata_server' is missing");
    expect_error("{\"prefill_url\":null,\"decode_url\":\"b:2\",\"metadata_server\":\"m\"}",
                 "'prefill_url' is missing");
}

static void test_wrong_types(void)
{
    expect_error("{\"prefill_url\":1,\"decode_url\":\"b:2\",\"metadata_server\":\"m\"}",
                 "'prefill_url' must be a string, got a number");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":[\"b:2\"],\"metadata_server\":\"m\"}",
                 "'decode_url' must be a string, got an array");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":{}}",
                 "'metadata_server' must be a string, got an object");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\","
                 "\"protocol\":true}",
                 "'protocol' must be a string, got a boolean");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\","
                 "\"device_name\":0}",
                 "'device_name' must be a string");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\","
                 "\"metadata_backend\":5}",
                 "'metadata_backend' must be a string");
    expect_error("[1,2]", "not a JSON object");
    expect_error("{\"prefill_url\":", "not valid JSON");
    expect_error("", "not valid JSON");
}

static void test_bad_values(void)
{
    expect_error("{\"prefill_url\":\"a\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\"}",
                 "'prefill_url': 'a' is not host:port");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:70000\",\"metadata_server\":\"m\"}",
                 "'decode_url': 'b:70000' is not host:port");
    expect_error("{\"prefill_url\":\"a:x\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\"}",
                 "'prefill_url': 'a:x' is not host:port");
    expect_error("{\"prefill_url\":\":5\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\"}",
                 "'prefill_url'");
    /* Found by fuzz_config: the segment name "[e02:14000" would not parse. */
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"[[e02]:14000\","
                 "\"metadata_server\":\"m\"}",
                 "'decode_url': '[[e02]:14000' is not host:port");
    expect_error("{\"prefill_url\":\"a:0\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\"}",
                 "'prefill_url': 'a:0' needs a port in 1..65535");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"\"}",
                 "'metadata_server' is empty");
    expect_error(
        "{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"p2phandshake\"}",
        "'metadata_server': 'p2phandshake' would name an etcd host (a value without "
        "'://' is an etcd address, as in Mooncake); did you mean 'P2PHANDSHAKE'?");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\","
                 "\"metadata_backend\":\"zookeeper\"}",
                 "'metadata_backend': 'zookeeper' is not one of etcd, redis");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\","
                 "\"protocol\":\"\"}",
                 "'protocol' is empty");
    expect_error("{\"prefill_url\":\"a:1\",\"decode_url\":\"b:2\",\"metadata_server\":\"m\","
                 "\"protocol\":\"TCP over IP\"}",
                 "'protocol': 'TCP over IP' is not a protocol name");
}

static char *write_temp(const char *text)
{
    static char path[64];
    snprintf(path, sizeof path, "/tmp/kvp_cfg_XXXXXX");
    int fd = mkstemp(path);
    if (fd < 0) return NULL;
    if (write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
        close(fd);
        return NULL;
    }
    close(fd);
    return path;
}

static void test_load_file_and_env(void)
{
    char *path = write_temp(full);
    REQUIRE(path != NULL);
    kvp_pipe_config *cfg = NULL;
    REQUIRE_OK(kvp_pipe_config_load(path, &cfg));
    CHECK(strcmp(cfg->decode_url, "127.0.0.1:14003") == 0);
    kvp_pipe_config_free(cfg);

    setenv("MOONCAKE_CONFIG_PATH", path, 1);
    cfg = NULL;
    REQUIRE_OK(kvp_pipe_config_load_env(&cfg));
    CHECK(strcmp(cfg->device_name, "mlx5_0") == 0);
    kvp_pipe_config_free(cfg);
    unlink(path);

    cfg = NULL;
    CHECK_ST(kvp_pipe_config_load_env(&cfg), KVP_ECONFIG); /* the file is gone */
    CHECK(strstr(kvp_last_error(), path) != NULL);
    unsetenv("MOONCAKE_CONFIG_PATH");
    CHECK_ST(kvp_pipe_config_load_env(&cfg), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "MOONCAKE_CONFIG_PATH") != NULL);
    CHECK(cfg == NULL);

    /* An error inside the file names the file and the field. */
    path = write_temp("{\"prefill_url\":\"a:1\",\"decode_url\":2,\"metadata_server\":\"m\"}");
    REQUIRE(path != NULL);
    CHECK_ST(kvp_pipe_config_load(path, &cfg), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), path) != NULL);
    CHECK(strstr(kvp_last_error(), "decode_url") != NULL);
    unlink(path);
}

static char *conn_of(const char *server, const char *backend)
{
    kvp_pipe_config cfg = {
        .prefill_url = "a:1", .decode_url = "b:2", .protocol = "tcp", .device_name = ""};
    cfg.metadata_server = (char *)server;
    cfg.metadata_backend = (char *)backend;
    char *conn = NULL;
    if (kvp_pipe_config_metadata_conn(&cfg, &conn) != KVP_OK) return NULL;
    return conn;
}

static void check_conn(const char *server, const char *backend, const char *want)
{
    char *got = conn_of(server, backend);
    CHECK(got != NULL && strcmp(got, want) == 0);
    if (got && strcmp(got, want) != 0) fprintf(stderr, "  got '%s', want '%s'\n", got, want);
    free(got);
}

static void test_metadata_backend(void)
{
    check_conn("127.0.0.1:2379", "etcd", "etcd://127.0.0.1:2379");
    check_conn("127.0.0.1:6379", "redis", "redis://127.0.0.1:6379");
    check_conn("redis://h:6379", "redis", "redis://h:6379");
    check_conn("http://h:8080/metadata", NULL, "http://h:8080/metadata");
    check_conn("P2PHANDSHAKE", NULL, "P2PHANDSHAKE");
    check_conn("P2PHANDSHAKE", "etcd", "P2PHANDSHAKE");
    check_conn("h:2379", NULL, "etcd://h:2379");
    CHECK(conn_of("h:2379", "consul") == NULL);
}

static kvp_pipe_config *cfg_of(const char *p, const char *d)
{
    char json[512];
    snprintf(json, sizeof json,
             "{\"prefill_url\":\"%s\",\"decode_url\":\"%s\",\"metadata_server\":\"P2PHANDSHAKE\"}",
             p, d);
    kvp_pipe_config *cfg = NULL;
    parse(json, &cfg);
    return cfg;
}

/* kvp_pipe_config_endpoints of the config with these URLs; KVP_EINVAL if it
 * does not parse. */
static kvp_status endpoints_of(const char *p, const char *d, int local_rank, int kv_rank,
                               kvp_pipe_endpoints *e)
{
    kvp_pipe_config *cfg = cfg_of(p, d);
    if (!cfg) return KVP_EINVAL;
    kvp_status st = kvp_pipe_config_endpoints(cfg, local_rank, kv_rank, e);
    kvp_pipe_config_free(cfg);
    return st;
}

static void test_endpoints(void)
{
    kvp_pipe_config *cfg = cfg_of("10.0.0.1:13003", "10.0.0.2:14003");
    REQUIRE(cfg != NULL);
    kvp_pipe_endpoints e;
    REQUIRE_OK(kvp_pipe_config_endpoints(cfg, 0, 0, &e));
    CHECK(strcmp(e.local_segment, "10.0.0.1:13003") == 0);
    CHECK(strcmp(e.peer_segment, "10.0.0.2:14003") == 0);
    CHECK(e.data_port == 13012 && e.ack_port == 13013);
    CHECK(e.peer_data_port == 14012 && e.peer_ack_port == 14013);
    REQUIRE_OK(kvp_pipe_config_endpoints(cfg, 2, 1, &e));
    CHECK(strcmp(e.local_segment, "10.0.0.2:14005") == 0);
    CHECK(strcmp(e.peer_segment, "10.0.0.1:13005") == 0);
    CHECK(strcmp(e.local_host, "10.0.0.2") == 0 && strcmp(e.peer_host, "10.0.0.1") == 0);
    CHECK(e.data_port == 14016 && e.ack_port == 14017);
    CHECK(e.peer_data_port == 13016 && e.peer_ack_port == 13017);
    CHECK_ST(kvp_pipe_config_endpoints(cfg, 0, 2, &e), KVP_EINVAL);
    CHECK_ST(kvp_pipe_config_endpoints(cfg, -1, 0, &e), KVP_EINVAL);
    kvp_pipe_config_free(cfg);

    /* Same URL: decode's base port moves up by 100, before local_rank. */
    REQUIRE_OK(endpoints_of("127.0.0.1:20000", "127.0.0.1:20000", 1, 1, &e));
    CHECK(strcmp(e.local_segment, "127.0.0.1:20101") == 0);
    CHECK(strcmp(e.peer_segment, "127.0.0.1:20001") == 0);
    CHECK(e.data_port == 20111 && e.ack_port == 20112);
    CHECK(e.peer_data_port == 20011 && e.peer_ack_port == 20012);

    /* IPv6 segment names are bracketed. */
    REQUIRE_OK(endpoints_of("[::1]:30000", "[::1]:31000", 0, 1, &e));
    CHECK(strcmp(e.local_segment, "[::1]:31000") == 0);
    CHECK(strcmp(e.local_host, "::1") == 0);

    /* Derived ports past 65535 name the field. */
    CHECK_ST(endpoints_of("127.0.0.1:65530", "127.0.0.1:1000", 0, 1, &e), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "prefill_url") != NULL);
    CHECK_ST(endpoints_of("127.0.0.1:65430", "127.0.0.1:65430", 0, 0, &e), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "decode_url") != NULL);
    CHECK(strstr(kvp_last_error(), "+100") != NULL);
}

static void test_open_rejects_bad_config(void)
{
    kvp_pipe_config cfg = {.prefill_url = "a:1",
                           .decode_url = "nope",
                           .metadata_server = "m",
                           .protocol = "tcp",
                           .device_name = ""};
    kvp_pipe *pipe = NULL;
    CHECK_ST(kvp_pipe_open(&cfg, 0, 0, NULL, &pipe), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "decode_url") != NULL);
    CHECK(pipe == NULL);
}

int main(void)
{
    RUN(test_valid_full);
    RUN(test_defaults);
    RUN(test_missing_fields);
    RUN(test_wrong_types);
    RUN(test_bad_values);
    RUN(test_load_file_and_env);
    RUN(test_metadata_backend);
    RUN(test_endpoints);
    RUN(test_open_rejects_bad_config);
    return kvpt_summary();
}
