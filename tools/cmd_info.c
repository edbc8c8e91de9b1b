/* kvpipe info: what this build offers, and what an operator needs to check a
 * deployment: can the transports start here, does the metadata store answer,
 * what does a segment's descriptor say. All of it through include/kvpipe/info.h. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "kvpipe/kvpipe.h"

#define STORE_TIMEOUT_MS 5000

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpipe info [--metadata-server S [--segment NAME]] [--host H]\n\n"
                 "Lists the transports, metadata stores and libraries of this build and\n"
                 "whether each transport can serve on host H (default 127.0.0.1).\n"
                 "  --metadata-server S  also check that the metadata store S answers\n"
                 "  --segment NAME       and print the descriptor it holds for segment NAME\n"
                 "                       (with P2PHANDSHAKE: ask the engine at NAME)\n"
                 "Exit status: 0 if every check asked for passed, 1 otherwise.\n");
}

static void list_transports(const kvp_info *info)
{
    printf("transports:\n");
    const kvp_transport_info *t;
    for (size_t i = 0; (t = kvp_info_transport(info, i)); i++) {
        if (t->status == KVP_OK)
            printf("  %-5s available%s\n", t->name,
                   t->caps & KVP_TRANSPORT_SAME_HOST ? " (peers on this host)" : "");
        else if (t->status == KVP_ENOTSUP)
            printf("  %-5s %s\n", t->name, t->detail);
        else
            printf("  %-5s unavailable: %s\n", t->name, t->detail);
    }
}

static void list_stores(const kvp_info *info)
{
    printf("metadata stores:\n");
    const kvp_store_info *s;
    for (size_t i = 0; (s = kvp_info_store(info, i)); i++) {
        if (s->status == KVP_OK)
            printf("  %-5s %s\n", s->name, s->syntax);
        else
            printf("  %-5s not built in (%s)\n", s->name, s->detail);
    }
}

static void list_components(const kvp_info *info)
{
    printf("libraries:\n");
    const kvp_component_info *c;
    for (size_t i = 0; (c = kvp_info_component(info, i)); i++) {
        if (c->status == KVP_OK)
            printf("  %-13s %-8s %s\n", c->name, c->version, c->purpose);
        else
            printf("  %-13s %-8s %s: not built in\n", c->name, "-", c->purpose);
    }
}

static void print_descriptor(const char *segment, const char *desc, const char *host)
{
    cJSON *doc = cJSON_Parse(desc);
    char *pretty = doc ? cJSON_Print(doc) : NULL;
    printf("segment %s (host %s):\n%s\n", segment, host, pretty ? pretty : desc);
    free(pretty);
    cJSON_Delete(doc);
}

static int check_store(const kvp_info *info, const char *conn, const char *segment)
{
    kvp_status st = kvp_info_store_check(conn, STORE_TIMEOUT_MS);
    if (st) {
        printf("metadata store check failed: %s: %s\n", kvp_strerror(st), kvp_last_error());
        return 1;
    }
    const kvp_store_info *store = kvp_info_store_for(info, conn);
    printf("metadata store %s (%s): %s\n", conn, store ? store->name : "?",
           store && store->flags & KVP_STORE_PEER_TO_PEER ? "none: descriptors come by handshake"
                                                          : "answers");
    if (!segment) return 0;
    char *desc = NULL, *host = NULL;
    if ((st = kvp_info_segment(conn, segment, STORE_TIMEOUT_MS, &desc, &host))) {
        printf("segment %s: %s\n", segment, kvp_last_error());
        return 1;
    }
    print_descriptor(segment, desc, host);
    free(desc);
    free(host);
    return 0;
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
    kvp_info *info;
    kvp_status st = kvp_info_get(host, 0, &info);
    if (st) {
        fprintf(stderr, "kvpipe info: %s: %s\n", kvp_strerror(st), kvp_last_error());
        return 1;
    }
    printf("kvpipe %s (library %s)\n", KVP_VERSION_STRING, kvp_version());
    list_transports(info);
    list_stores(info);
    list_components(info);
    int rc = conn ? check_store(info, conn, segment) : 0;
    kvp_info_free(info);
    return rc;
}
