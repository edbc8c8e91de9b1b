/* A program of another kvpipe release, for tests/packaging/abi.sh: built
 * against one release's headers and run against another's library. Every
 * sized struct (docs/abi.md) ends flush against a PROT_NONE page, so a
 * library that reads or writes past the program's struct crashes it.
 *
 *   abi_prog          create an engine, a metadata server and a pipe with
 *                     options, submit a batch with options, read the
 *                     pipe's stats and endpoints: "ok"
 *   abi_prog --set    (built with -DABI_PROG_NEWER, against headers with a
 *                     field abi_test_added at the end of each struct) set
 *                     that field: each call must fail with KVP_ENOTSUP */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvpipe/kvpipe.h"

static void *guarded(size_t size)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE), span = (size + page - 1) / page * page;
    char *m = mmap(NULL, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED || mprotect(m + span, page, PROT_NONE)) exit(3);
    return m + span - size;
}

static int failures;

static void expect(kvp_status got, kvp_status want, const char *what)
{
    if (got == want) return;
    printf("FAIL %s: %s (%s), want %s\n", what, kvp_strerror(got), kvp_last_error(),
           kvp_strerror(want));
    failures++;
}

int main(int argc, char **argv)
{
    int set = argc > 1 && !strcmp(argv[1], "--set");
    kvp_status want = set ? KVP_ENOTSUP : KVP_OK;
    int port = argc > 2 ? atoi(argv[2]) : 0;

    kvp_metadata_server_opts *mo = guarded(sizeof *mo);
    kvp_metadata_server_opts_init(mo);
    kvp_engine_opts *eo = guarded(sizeof *eo);
    kvp_engine_opts_init(eo);
    eo->local_server_name = "127.0.0.1:0";
    eo->metadata = "P2PHANDSHAKE";
    kvp_pipe_opts *po = guarded(sizeof *po);
    kvp_pipe_opts_init(po);
#ifdef ABI_PROG_NEWER
    if (set) mo->abi_test_added = eo->abi_test_added = po->abi_test_added = 1;
#endif
    kvp_metadata_server *srv = NULL;
    expect(kvp_metadata_server_start_opts(mo, &srv), want, "kvp_metadata_server_start_opts");
    kvp_metadata_server_stop(srv);
    kvp_engine *e = NULL;
    expect(kvp_engine_create(eo, &e), want, "kvp_engine_create");
    kvp_engine_destroy(e);

    /* A batch submitted with options, on an engine made without the field. */
#ifdef ABI_PROG_NEWER
    eo->abi_test_added = 0;
#endif
    kvp_engine *be = NULL;
    kvp_segment_id seg = 0;
    expect(kvp_engine_create(eo, &be), KVP_OK, "kvp_engine_create (batches)");
    if (be)
        expect(kvp_engine_open_segment(be, kvp_engine_segment_name(be), &seg), KVP_OK,
               "kvp_engine_open_segment (its own)");
    kvp_batch_opts *bo = guarded(sizeof *bo);
    kvp_batch_opts_init(bo);
    bo->reap = 1;
#ifdef ABI_PROG_NEWER
    if (set) bo->abi_test_added = 1;
#endif
    kvp_batch *b = NULL;
    if (be) expect(kvp_batch_submit_with(be, seg, NULL, 0, bo, &b), want, "kvp_batch_submit_with");
    kvp_completion c = {0};
    if (b && (kvp_engine_reap(be, &c, 1) != 1 || c.batch != b || c.status != KVP_OK))
        printf("FAIL kvp_engine_reap\n"), failures++;
    kvp_batch_free(b);
    kvp_engine_destroy(be);

    char json[256];
    snprintf(json, sizeof json,
             "{\"prefill_url\":\"127.0.0.1:%d\",\"decode_url\":\"127.0.0.1:%d\","
             "\"metadata_server\":\"P2PHANDSHAKE\",\"protocol\":\"tcp\"}",
             port, port);
    kvp_pipe_config *cfg;
    expect(kvp_pipe_config_parse(json, strlen(json), &cfg), KVP_OK, "kvp_pipe_config_parse");
    kvp_pipe_endpoints *ep = guarded(sizeof *ep);
    expect(kvp_pipe_config_endpoints(cfg, 0, 1, ep), KVP_OK, "kvp_pipe_config_endpoints");
    if (ep->peer_engine_port != port)
        printf("FAIL endpoints: peer port %d\n", ep->peer_engine_port);
    kvp_pipe *p = NULL;
    expect(kvp_pipe_open(cfg, 0, 0, po, &p), want, "kvp_pipe_open");
    if (p) {
        kvp_pipe_stats *st = guarded(sizeof *st);
        kvp_pipe_get_stats(p, st);
        if (st->sent || st->inflight_count)
            printf("FAIL stats: sent %llu\n", (unsigned long long)st->sent);
        kvp_pipe_close(p);
    }
    kvp_pipe_config_free(cfg);
    if (!failures) printf("ok (%s)\n", kvp_version());
    return failures ? 1 : 0;
}
