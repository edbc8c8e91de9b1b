/* kvpipe info: what this build offers, and what an operator needs to check a
 * deployment: can the transports start here, does the metadata store answer,
 * what does a segment's descriptor say. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "engine/registry.h"
#include "kvpipe/kvpipe.h"
#include "metadata/metadata.h"
#include "transport/transport.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpipe info [--metadata-server S [--segment NAME]] [--host H]\n\n"
                 "Lists the transports and metadata stores of this build and whether each\n"
                 "transport can serve on host H (default 127.0.0.1).\n"
                 "  --metadata-server S  also check that the metadata store S answers\n"
                 "  --segment NAME       and print the descriptor it holds for segment NAME\n"
                 "                       (with P2PHANDSHAKE: ask the engine at NAME)\n"
                 "Exit status: 0 if every check asked for passed, 1 otherwise.\n");
}

/* Start and stop each transport's server, as an engine would. */
static void list_transports(const char *host)
{
    printf("transports:\n");
    for (size_t i = 0; kvpi_transports[i]; i++) {
        const kvpi_transport_ops *ops = kvpi_transports[i];
        kvpi_registry reg;
        kvpi_registry_init(&reg);
        int port = 0;
        kvpi_server_ctx ctx = {.host = host, .registry = &reg, .timeout_ms = 2000,
                               .data_port_out = &port};
        void *srv = NULL;
        kvp_status st = ops->server_start(&ctx, &srv);
        if (st == KVP_OK) {
            ops->server_stop(srv);
            printf("  %-5s available%s\n", ops->name,
                   ops->caps & KVPI_TRANSPORT_SAME_HOST ? " (peers on this host)" : "");
        } else {
            printf("  %-5s unavailable: %s\n", ops->name, kvp_last_error());
        }
        kvpi_registry_destroy(&reg);
    }
    printf("  %-5s not supported in this build\n", "rdma");
}

static int check_store(const char *conn, const char *segment)
{
    kvpi_meta *meta;
    kvp_status st = kvpi_meta_open(conn, 5000, &meta);
    if (st) {
        printf("metadata store check failed: %s\n", kvp_last_error());
        return 1;
    }
    printf("metadata store %s: %s\n", conn,
           kvpi_meta_is_p2p(meta) ? "none (P2PHANDSHAKE)" : "answers");
    int rc = 0;
    if (segment) {
        char *desc = NULL, *host = NULL;
        if ((st = kvpi_meta_fetch(meta, segment, "{}", &desc, &host))) {
            printf("segment %s: %s\n", segment, kvp_last_error());
            rc = 1;
        } else {
            cJSON *doc = cJSON_Parse(desc);
            char *pretty = doc ? cJSON_Print(doc) : NULL;
            printf("segment %s (host %s):\n%s\n", segment, host, pretty ? pretty : desc);
            free(pretty);
            cJSON_Delete(doc);
        }
        free(desc);
        free(host);
    }
    kvpi_meta_close(meta);
    return rc;
}

int kvp_cmd_info(int argc, char **argv)
{
    static const struct option opts[] = {{"metadata-server", required_argument, 0, 'm'},
                                         {"segment", required_argument, 0, 's'},
                                         {"host", required_argument, 0, 'H'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *conn = NULL, *segment = NULL, *host = "127.0.0.1";
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': conn = optarg; break;
        case 's': segment = optarg; break;
        case 'H': host = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc || (segment && !conn)) {
        usage(stderr);
        return 2;
    }
    printf("kvpipe %s\n", KVP_VERSION_STRING);
    list_transports(host);
    printf("metadata stores: http://h:p/path, etcd://h:p[,h:p] (or h:p), "
           "redis://[user:pass@]h:p[/db], P2PHANDSHAKE\n");
    return conn ? check_store(conn, segment) : 0;
}
