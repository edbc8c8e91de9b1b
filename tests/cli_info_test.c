/* kvpipe info, run as a separate process. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cjson/cJSON.h>

#include "peer.h"
#include "test.h"
#include "transport/transport.h"

/* Run `kvpipe info ARGS`, capture stdout into out; returns the exit status. */
static int run_info(const char *args, char *out, size_t len)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "info %s", args);
    return kvpt_cli_run(cmd, out, len);
}

static void lists_build(void)
{
    char out[8192];
    CHECK(run_info("", out, sizeof out) == 0);
    CHECK(strstr(out, "tcp   available") != NULL);
    CHECK(strstr(out, "shm ") != NULL);
    /* rdma: the ucx transport where built, else a line saying it is not. */
    CHECK(strstr(out, kvpi_transport_lookup("rdma") ? "ucx   available" : "rdma  not supported"));
    CHECK(strstr(out, "P2PHANDSHAKE") != NULL);
}

/* info --json alone: transports, stores and libraries as one object. */
static void lists_build_json(void)
{
    char out[16384];
    CHECK(run_info("--json", out, sizeof out) == 0);
    cJSON *doc = cJSON_Parse(out);
    REQUIRE(doc);
    const cJSON *t, *tcp = NULL, *rdma = NULL, *ucx = NULL;
    cJSON_ArrayForEach(t, cJSON_GetObjectItemCaseSensitive(doc, "transports"))
    {
        const char *name = cJSON_GetObjectItemCaseSensitive(t, "name")->valuestring;
        if (!strcmp(name, "tcp")) tcp = t;
        if (!strcmp(name, "rdma")) rdma = t;
        if (!strcmp(name, "ucx")) ucx = t;
    }
    CHECK(tcp && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(tcp, "available")));
    /* rdma: the ucx transport where built, else an entry saying it is not. */
    if (kvpi_transport_lookup("rdma"))
        CHECK(ucx && !rdma && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(ucx, "built_in")));
    else
        CHECK(rdma && cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(rdma, "built_in")));
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(doc, "stores")) == 4);
    CHECK(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(doc, "version")));
    CHECK(cJSON_GetObjectItemCaseSensitive(doc, "store_check") == NULL);
    cJSON_Delete(doc);
}

/* The memory kinds: host always; cuda with the driver's version and devices
 * (the test double's: 12.4, 3 devices), or why not without a driver. */
static void lists_memory_kinds(void)
{
    char out[8192];
    setenv("KVPIPE_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
    CHECK(run_info("", out, sizeof out) == 0);
    CHECK(strstr(out, "memory kinds:\n  host  available (") != NULL);
    CHECK(strstr(out, "cuda  unavailable: CUDA: /nonexistent/libcuda.so.1 not found") != NULL);
    setenv("KVPIPE_LIBCUDA", KVPT_FAKECUDA_PATH, 1);
    setenv("FAKECUDA_DEVICES", "3", 1);
    CHECK(run_info("", out, sizeof out) == 0);
    CHECK(strstr(out, "cuda  available (shm, tcp): CUDA driver 12.4, 3 devices") != NULL);
    CHECK(run_info("--json", out, sizeof out) == 0);
    cJSON *doc = cJSON_Parse(out);
    REQUIRE(doc);
    const cJSON *mem = cJSON_GetObjectItemCaseSensitive(doc, "memory");
    CHECK(cJSON_GetArraySize(mem) == 2);
    const cJSON *cuda = cJSON_GetArrayItem(mem, 1);
    CHECK(cuda && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cuda, "available")));
    cJSON_Delete(doc);
}

static void store_down(void)
{
    char out[8192], args[128], url[96];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metadata", kvpt_free_port());
    snprintf(args, sizeof args, "--metadata-server %s", url);
    CHECK(run_info(args, out, sizeof out) == 1);
    CHECK(strstr(out, url) != NULL);
    CHECK(run_info("--segment-id 127.0.0.1:1", out, sizeof out) == 2); /* needs a store */
    CHECK(run_info("--bogus", out, sizeof out) == 2);
}

static void shows_segment(void)
{
    char url[160], out[16384], args[320];
    REQUIRE(kvpt_http_store_start(url, sizeof url) > 0);
    kvpt_target t;
    kvpt_target_opts o = {.metadata = url, .len = 1u << 20, .seed = 1};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    snprintf(args, sizeof args, "--metadata-server %s --segment-id %s", url, t.name);
    CHECK(run_info(args, out, sizeof out) == 0);
    /* Addresses in hex, the buffer's length beside it. */
    char addr[64], dec[64];
    snprintf(addr, sizeof addr, "0x%012llx", (unsigned long long)(uintptr_t)t.buf);
    snprintf(dec, sizeof dec, "%llu", (unsigned long long)(uintptr_t)t.buf);
    CHECK(strstr(out, "tcp_data_port ") != NULL);
    CHECK(strstr(out, addr) != NULL);
    CHECK(strstr(out, dec) == NULL);
    CHECK(strstr(out, "1048576 bytes (1.0 MiB)") != NULL);
    /* --segment is the old spelling of --segment-id. */
    snprintf(args, sizeof args, "--metadata-server %s --segment %s", url, t.name);
    CHECK(run_info(args, out, sizeof out) == 0 && strstr(out, addr) != NULL);
    /* --json: one object with the same facts, the address in hex. */
    snprintf(args, sizeof args, "--json --metadata-server %s --segment-id %s", url, t.name);
    CHECK(run_info(args, out, sizeof out) == 0);
    cJSON *doc = cJSON_Parse(out);
    REQUIRE(doc);
    const cJSON *seg = cJSON_GetObjectItemCaseSensitive(doc, "segment");
    const cJSON *buf0 = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(seg, "buffers"), 0);
    const cJSON *hex = cJSON_GetObjectItemCaseSensitive(buf0, "addr");
    snprintf(addr, sizeof addr, "0x%llx", (unsigned long long)(uintptr_t)t.buf);
    CHECK(cJSON_IsString(hex) && strcmp(hex->valuestring, addr) == 0);
    CHECK(cJSON_GetObjectItemCaseSensitive(buf0, "length")->valuedouble == 1 << 20);
    const cJSON *desc = cJSON_GetObjectItemCaseSensitive(seg, "descriptor");
    CHECK(cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(desc, "tcp_data_port")));
    const cJSON *check = cJSON_GetObjectItemCaseSensitive(doc, "store_check");
    CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(check, "ok")));
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(doc, "transports")) >= 2);
    cJSON_Delete(doc);
    /* An unknown segment fails with its name. */
    snprintf(args, sizeof args, "--metadata-server %s --segment 127.0.0.1:9", url);
    CHECK(run_info(args, out, sizeof out) == 1);
    CHECK(strstr(out, "127.0.0.1:9") != NULL);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

int main(void)
{
    RUN(lists_build);
    RUN(lists_build_json);
    RUN(lists_memory_kinds);
    RUN(store_down);
    RUN(shows_segment);
    return kvpt_summary();
}
