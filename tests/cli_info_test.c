/* kvpipe info, run as a separate process. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "target.h"
#include "test.h"
#include "transport/transport.h"

/* Run `kvpipe info ARGS`, capture stdout into out; returns the exit status. */
static int run_info(const char *args, char *out, size_t len)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s info %s 2>/dev/null", kvpt_cli(), args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, len - 1, f);
    out[n] = '\0';
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
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

static void store_down(void)
{
    char out[8192], args[128], url[96];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/metadata", kvpt_free_port());
    snprintf(args, sizeof args, "--metadata-server %s", url);
    CHECK(run_info(args, out, sizeof out) == 1);
    CHECK(strstr(out, url) != NULL);
    CHECK(run_info("--segment 127.0.0.1:1", out, sizeof out) == 2); /* needs a store */
    CHECK(run_info("--bogus", out, sizeof out) == 2);
}

static void shows_segment(void)
{
    char url[160], out[16384], args[256];
    REQUIRE(kvpt_http_store_start(url, sizeof url) > 0);
    kvpt_target t;
    kvpt_target_opts o = {.metadata = url, .len = 1u << 20, .seed = 1};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    snprintf(args, sizeof args, "--metadata-server %s --segment %s", url, t.name);
    CHECK(run_info(args, out, sizeof out) == 0);
    char addr[64];
    snprintf(addr, sizeof addr, "%llu", (unsigned long long)(uintptr_t)t.buf);
    CHECK(strstr(out, "\"tcp_data_port\"") != NULL);
    CHECK(strstr(out, addr) != NULL);
    /* An unknown segment fails with its name. */
    snprintf(args, sizeof args, "--metadata-server %s --segment 127.0.0.1:9", url);
    CHECK(run_info(args, out, sizeof out) == 1);
    CHECK(strstr(out, "127.0.0.1:9") != NULL);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

int main(void)
{
    RUN(lists_build);
    RUN(store_down);
    RUN(shows_segment);
    return kvpt_summary();
}
