/* poll_initiator: the initiator's job (see initiator.c) with every transfer
 * in flight at once and one poll(2) loop waiting for them, as an event loop
 * (libuv, asyncio, a NIXL progress thread) waits on kvpipe.
 *
 *   poll_initiator TARGET_HOST:PORT [METADATA]
 *
 * Submits the READs of the first half of the target's first buffer and the
 * WRITEs of pattern 2 into its second half as 16 batches, each queued on the
 * engine's completion queue when done (kvp_batch_opts.reap), then polls the
 * engine's completion fd (an event loop's poll would watch its other fds
 * too) and reaps what completed until every batch did. Then it sets the
 * target's done flag, the last byte, with one more batch. Works with the
 * target example. */
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define BATCHES 16

/* Wait on the completion fd until `want` batches were reaped; -1 on a failed
 * batch or after 30 s without progress. */
static int reap_all(kvp_engine *engine, size_t want)
{
    size_t done = 0;
    while (done < want) {
        /* An event loop polls its other fds in the same call. */
        struct pollfd fds[1] = {{.fd = kvp_engine_completion_fd(engine), .events = POLLIN}};
        int r = poll(fds, 1, 30000);
        if (r == 0) {
            fprintf(stderr, "no batch completed within 30 s\n");
            return -1;
        }
        if (r < 0) continue; /* EINTR */
        if (!(fds[0].revents & POLLIN)) continue;
        /* Readable while a completed batch waits: take what there is. */
        kvp_completion c[BATCHES];
        size_t n = kvp_engine_reap(engine, c, BATCHES);
        for (size_t i = 0; i < n; i++) {
            if (c[i].status != KVP_OK) {
                kvp_batch_wait(c[i].batch, 0); /* sets kvp_last_error() */
                return example_fail("batch", c[i].status);
            }
            kvp_batch_free(c[i].batch); /* completed: returns at once */
        }
        done += n;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: poll_initiator TARGET_HOST:PORT [METADATA]\n");
        return 2;
    }
    kvp_engine_opts opts;
    kvp_engine_opts_init(&opts);
    opts.local_server_name = "127.0.0.1:0";
    opts.metadata = argc > 2 ? argv[2] : "P2PHANDSHAKE";
    kvp_engine *engine;
    kvp_status st = kvp_engine_create(&opts, &engine);
    if (st) return example_fail("kvp_engine_create", st);

    kvp_segment_id seg;
    kvp_remote_buffer rb;
    size_t n = 0;
    if ((st = kvp_engine_open_segment(engine, argv[1], &seg)) ||
        (st = kvp_engine_segment_buffers(engine, seg, &rb, 1, &n)))
        return example_fail(argv[1], st);
    if (n == 0 || rb.length < 2 * BATCHES) {
        fprintf(stderr, "%s registered no buffer large enough\n", argv[1]);
        return 1;
    }
    size_t half = (size_t)rb.length / 2, chunk = half / BATCHES;
    uint8_t *mem = malloc(rb.length);
    if (!mem) return 1;
    for (size_t i = half; i < rb.length - 1; i++)
        mem[i] = example_byte(2, i);

    /* Every batch in flight at once: a READ of chunk i of the first half and
     * a WRITE of chunk i of the second (the flag byte excluded). */
    kvp_batch_opts bo;
    kvp_batch_opts_init(&bo);
    bo.reap = 1;
    for (size_t i = 0; i < BATCHES; i++) {
        size_t off = i * chunk, woff = half + off;
        size_t wlen = i == BATCHES - 1 ? rb.length - 1 - woff : chunk;
        kvp_request r[2] = {
            {KVP_OP_READ, mem + off, rb.addr + off, i == BATCHES - 1 ? half - off : chunk},
            {KVP_OP_WRITE, mem + woff, rb.addr + woff, wlen},
        };
        kvp_batch *b;
        if ((st = kvp_batch_submit_with(engine, seg, r, 2, &bo, &b)))
            return example_fail("kvp_batch_submit_with", st);
        /* b is reaped below; kvp_batch_free releases it there. */
    }
    if (reap_all(engine, BATCHES)) return 1;
    for (size_t i = 0; i < half; i++)
        if (mem[i] != example_byte(1, i)) {
            fprintf(stderr, "byte %zu reads %u, not %u\n", i, mem[i], example_byte(1, i));
            return 1;
        }
    printf("%d batches completed through poll(2): pattern 1 read, pattern 2 written\n", BATCHES);

    /* The flag last: every WRITE above completed, so its bytes are in place. */
    uint8_t flag = 1;
    kvp_request fr = {KVP_OP_WRITE, &flag, rb.addr + rb.length - 1, 1};
    kvp_batch *b;
    if ((st = kvp_batch_submit_with(engine, seg, &fr, 1, &bo, &b))) return example_fail("flag", st);
    if (reap_all(engine, 1)) return 1;
    printf("wrote the done flag\n");
    free(mem);
    kvp_engine_destroy(engine);
    return 0;
}
