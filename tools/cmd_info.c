/* kvpipe info: what this build offers, and what an operator needs to check a
 * deployment: can the transports start here, does the metadata store answer,
 * what does a segment's descriptor say. All of it through include/kvpipe/info.h;
 * as text, or as one JSON object with --json. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cli_opts.h"
#include "kvpipe/kvpipe.h"

typedef struct info_opts {
    const char *conn, *segment, *host;
    int json;
} info_opts;

static const cli_opt opts[] = {
    {"metadata-server", CLI_ARG_STRING, "S", "also check that the metadata store S answers",
     .aliases = "metadata", CLI_TO(info_opts, conn)},
    {"segment-id", CLI_ARG_STRING, "NAME",
     "and show the descriptor it holds for segment NAME\n(with P2PHANDSHAKE: ask the engine at "
     "NAME)",
     .aliases = "segment", CLI_TO(info_opts, segment)},
    {"host", CLI_ARG_STRING, "H", "where the transports are tried (default 127.0.0.1)",
     CLI_TO(info_opts, host)},
    {"json", CLI_ARG_FLAG, NULL, "print one JSON object instead of text", CLI_TO(info_opts, json)},
};

static const cli_spec spec = {
    .cmd = "info",
    .synopsis = "usage: kvpipe info [--metadata-server S [--segment-id NAME]] [--host H] "
                "[--json]\n",
    .about = "Lists the transports, metadata stores and libraries of this build and\n"
             "whether each transport can serve on host H. Addresses are shown in hex.\n",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .epilog = "Exit status: 0 if every check asked for passed, 1 otherwise.\n",
};

/* ------------------------------------------------------------- text --- */

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

static void list_memory(const kvp_info *info)
{
    printf("memory kinds:\n");
    const kvp_memory_info *m;
    for (size_t i = 0; (m = kvp_info_memory(info, i)); i++) {
        if (m->status == KVP_OK)
            printf("  %-5s available (%s): %s\n", m->name, m->transports, m->detail);
        else
            printf("  %-5s unavailable: %s\n", m->name, m->detail);
    }
}

static void show_address(const kvp_info *info)
{
    const kvp_address_info *a = kvp_info_address(info);
    printf("address given to peers (local_server_name 0.0.0.0:PORT, or MC_TCP_BIND_ADDRESS):\n");
    if (a->status == KVP_OK)
        printf("  %s: %s\n", a->address, a->reason);
    else
        printf("  none: %s\n", a->reason);
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

static void print_bytes(uint64_t n)
{
    if (n >= (1ull << 30))
        printf("%.1f GiB", (double)n / (1ull << 30));
    else if (n >= (1ull << 20))
        printf("%.1f MiB", (double)n / (1ull << 20));
    else
        printf("%.1f KiB", (double)n / 1024);
}

/* The descriptor's buffers with hex addresses, its scalar fields on one
 * line, and any other field as compact JSON. */
static void print_descriptor(const char *segment, const char *text, const char *host)
{
    printf("segment %s (host %s):\n", segment, host);
    cJSON *doc = cJSON_Parse(text);
    if (!cJSON_IsObject(doc)) {
        printf("  %s\n", text);
        cJSON_Delete(doc);
        return;
    }
    const cJSON *f;
    int first = 1;
    cJSON_ArrayForEach(f, doc)
    {
        if (!strcmp(f->string, "buffers") || !strcmp(f->string, "name")) continue;
        if (cJSON_IsString(f))
            printf("%s%s %s", first ? "  " : ", ", f->string, f->valuestring);
        else if (cJSON_IsNumber(f))
            printf("%s%s %.0f", first ? "  " : ", ", f->string, f->valuedouble);
        else
            continue;
        first = 0;
    }
    if (!first) printf("\n");
    const cJSON *bufs = cJSON_GetObjectItemCaseSensitive(doc, "buffers");
    printf("  buffers (%d):\n", cJSON_GetArraySize(bufs));
    cJSON_ArrayForEach(f, bufs)
    {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "name");
        const cJSON *addr = cJSON_GetObjectItemCaseSensitive(f, "addr");
        const cJSON *len = cJSON_GetObjectItemCaseSensitive(f, "length");
        uint64_t a = cJSON_IsNumber(addr) ? (uint64_t)addr->valuedouble : 0;
        uint64_t n = cJSON_IsNumber(len) ? (uint64_t)len->valuedouble : 0;
        printf("    %-12s 0x%012" PRIx64 "  %" PRIu64 " bytes (",
               cJSON_IsString(name) ? name->valuestring : "?", a, n);
        print_bytes(n);
        printf(")\n");
    }
    cJSON_ArrayForEach(f, doc)
    {
        if (cJSON_IsObject(f) || (cJSON_IsArray(f) && strcmp(f->string, "buffers"))) {
            char *compact = cJSON_PrintUnformatted(f);
            printf("  %s: %s\n", f->string, compact ? compact : "?");
            free(compact);
        }
    }
    cJSON_Delete(doc);
}

/* ------------------------------------------------------------- JSON --- */

static cJSON *json_build(const kvp_info *info)
{
    cJSON *doc = cJSON_CreateObject();
    cJSON_AddStringToObject(doc, "version", KVP_VERSION_STRING);
    cJSON_AddStringToObject(doc, "library", kvp_version());
    cJSON *arr = cJSON_AddArrayToObject(doc, "transports");
    const kvp_transport_info *t;
    for (size_t i = 0; (t = kvp_info_transport(info, i)); i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", t->name);
        cJSON_AddBoolToObject(o, "available", t->status == KVP_OK);
        cJSON_AddBoolToObject(o, "built_in", t->status != KVP_ENOTSUP);
        cJSON_AddStringToObject(o, "detail", t->detail);
        cJSON_AddBoolToObject(o, "same_host_only", (t->caps & KVP_TRANSPORT_SAME_HOST) != 0);
        cJSON_AddItemToArray(arr, o);
    }
    arr = cJSON_AddArrayToObject(doc, "stores");
    const kvp_store_info *s;
    for (size_t i = 0; (s = kvp_info_store(info, i)); i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", s->name);
        cJSON_AddStringToObject(o, "syntax", s->syntax);
        cJSON_AddBoolToObject(o, "built_in", s->status == KVP_OK);
        cJSON_AddStringToObject(o, "detail", s->detail);
        cJSON_AddBoolToObject(o, "peer_to_peer", (s->flags & KVP_STORE_PEER_TO_PEER) != 0);
        cJSON_AddItemToArray(arr, o);
    }
    arr = cJSON_AddArrayToObject(doc, "memory");
    const kvp_memory_info *m;
    for (size_t i = 0; (m = kvp_info_memory(info, i)); i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", m->name);
        cJSON_AddBoolToObject(o, "available", m->status == KVP_OK);
        cJSON_AddStringToObject(o, "detail", m->detail);
        cJSON_AddStringToObject(o, "transports", m->transports);
        cJSON_AddItemToArray(arr, o);
    }
    const kvp_address_info *a = kvp_info_address(info);
    cJSON *addr = cJSON_AddObjectToObject(doc, "address");
    cJSON_AddStringToObject(addr, "address", a->address);
    cJSON_AddStringToObject(addr, "reason", a->reason);
    cJSON_AddBoolToObject(addr, "chosen", a->status == KVP_OK);
    arr = cJSON_AddArrayToObject(doc, "libraries");
    const kvp_component_info *c;
    for (size_t i = 0; (c = kvp_info_component(info, i)); i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", c->name);
        cJSON_AddStringToObject(o, "version", c->version);
        cJSON_AddStringToObject(o, "purpose", c->purpose);
        cJSON_AddBoolToObject(o, "built_in", c->status == KVP_OK);
        cJSON_AddItemToArray(arr, o);
    }
    return doc;
}

/* The descriptor as stored, plus its buffers with hex addresses. */
static cJSON *json_segment(const char *segment, const char *text, const char *host)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", segment);
    cJSON_AddStringToObject(o, "host", host);
    cJSON *desc = cJSON_Parse(text);
    cJSON *bufs = cJSON_AddArrayToObject(o, "buffers");
    const cJSON *b;
    cJSON_ArrayForEach(b, cJSON_GetObjectItemCaseSensitive(desc, "buffers"))
    {
        const cJSON *addr = cJSON_GetObjectItemCaseSensitive(b, "addr");
        const cJSON *len = cJSON_GetObjectItemCaseSensitive(b, "length");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(b, "name");
        char hex[32];
        snprintf(hex, sizeof hex, "0x%" PRIx64,
                 cJSON_IsNumber(addr) ? (uint64_t)addr->valuedouble : 0);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "name", cJSON_IsString(name) ? name->valuestring : "");
        cJSON_AddStringToObject(e, "addr", hex);
        cJSON_AddNumberToObject(e, "length", cJSON_IsNumber(len) ? len->valuedouble : 0);
        cJSON_AddItemToArray(bufs, e);
    }
    if (desc)
        cJSON_AddItemToObject(o, "descriptor", desc);
    else
        cJSON_AddStringToObject(o, "descriptor", text);
    return o;
}

/* ------------------------------------------------------------ checks --- */

/* Check the store (and segment); text lines, or fields of doc. */
static int check_store(const kvp_info *info, const info_opts *o, cJSON *doc)
{
    kvp_status st = kvp_info_store_check(o->conn, 0 /* the default, 5000 */);
    const kvp_store_info *store = kvp_info_store_for(info, o->conn);
    cJSON *check = doc ? cJSON_AddObjectToObject(doc, "store_check") : NULL;
    if (check) {
        cJSON_AddStringToObject(check, "metadata_server", o->conn);
        cJSON_AddStringToObject(check, "store", store ? store->name : "");
        cJSON_AddBoolToObject(check, "ok", st == KVP_OK);
        cJSON_AddStringToObject(check, "error", st ? kvp_last_error() : "");
    }
    if (st) {
        if (!doc)
            printf("metadata store check failed: %s: %s\n", kvp_strerror(st), kvp_last_error());
        return 1;
    }
    if (!doc)
        printf("metadata store %s (%s): %s\n", o->conn, store ? store->name : "?",
               store && store->flags & KVP_STORE_PEER_TO_PEER
                   ? "none: descriptors come by handshake"
                   : "answers");
    if (!o->segment) return 0;
    char *desc = NULL, *host = NULL;
    if ((st = kvp_info_segment(o->conn, o->segment, 0, &desc, &host))) {
        if (doc) {
            cJSON *seg = cJSON_AddObjectToObject(doc, "segment");
            cJSON_AddStringToObject(seg, "name", o->segment);
            cJSON_AddStringToObject(seg, "error", kvp_last_error());
        } else {
            printf("segment %s: %s\n", o->segment, kvp_last_error());
        }
        return 1;
    }
    if (doc)
        cJSON_AddItemToObject(doc, "segment", json_segment(o->segment, desc, host));
    else
        print_descriptor(o->segment, desc, host);
    free(desc);
    free(host);
    return 0;
}

int cmd_info(int argc, char **argv)
{
    info_opts o = {.host = "127.0.0.1"};
    int r = cli_parse(&spec, argc, argv, 0, NULL, &o);
    if (r) return r - 1;
    if (o.segment && !o.conn) {
        cli_error("--segment-id needs --metadata-server");
        return 2;
    }
    kvp_info *info;
    kvp_status st = kvp_info_get(o.host, 0, &info);
    if (st) {
        cli_error("%s: %s", kvp_strerror(st), kvp_last_error());
        return 1;
    }
    cJSON *doc = o.json ? json_build(info) : NULL;
    if (!o.json) {
        printf("kvpipe %s (library %s)\n", KVP_VERSION_STRING, kvp_version());
        list_transports(info);
        show_address(info);
        list_memory(info);
        list_stores(info);
        list_components(info);
    }
    int rc = o.conn ? check_store(info, &o, doc) : 0;
    if (doc) {
        char *text = cJSON_Print(doc);
        printf("%s\n", text ? text : "{}");
        free(text);
        cJSON_Delete(doc);
    }
    kvp_info_free(info);
    return rc;
}
