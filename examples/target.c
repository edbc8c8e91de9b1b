/* target: serve a block of memory to peers.
 *
 *   target HOST:PORT [METADATA]
 *
 * Creates an engine whose segment is named HOST:PORT, registers 1 MiB filled
 * with pattern 1, and waits (at most 60 s) until a peer has written pattern 2
 * into the second half and set the last byte to 1 (the initiator does). With
 * METADATA "P2PHANDSHAKE" (the default) no metadata store is needed: peers ask
 * this engine for its descriptor on PORT. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"

#define SIZE (1u << 20)

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: target HOST:PORT [METADATA]\n");
        return 2;
    }
    kvp_engine_opts opts;
    kvp_engine_opts_init(&opts);
    opts.local_server_name = argv[1];
    opts.metadata = argc > 2 ? argv[2] : "P2PHANDSHAKE";

    kvp_engine *engine;
    kvp_status st = kvp_engine_create(&opts, &engine);
    if (st) return example_fail("kvp_engine_create", st);

    /* The memory stays ours; the engine only lets peers READ and WRITE it. */
    uint8_t *buf = malloc(SIZE);
    if (!buf) return 1;
    for (size_t i = 0; i < SIZE; i++)
        buf[i] = example_byte(1, i);
    buf[SIZE - 1] = 0; /* the "done" flag the initiator sets last */
    if ((st = kvp_engine_register(engine, buf, SIZE)))
        return example_fail("kvp_engine_register", st);

    printf("serving %u bytes at segment %s\n", SIZE, kvp_engine_segment_name(engine));
    fflush(stdout);

    /* The engine's threads write into buf; the flag is read atomically and
     * set by the peer only after its data write completed. */
    int done = 0;
    for (int ms = 0; ms < 60000 && !done; ms += 10) {
        done = __atomic_load_n(&buf[SIZE - 1], __ATOMIC_ACQUIRE) == 1;
        if (!done) nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
    }
    int ok = done;
    for (size_t i = SIZE / 2; ok && i < SIZE - 1; i++)
        ok = buf[i] == example_byte(2, i);
    printf("target: %s\n", !done ? "no peer wrote in time"
                           : ok  ? "peer's write arrived intact"
                                 : "peer's write is corrupt");

    kvp_engine_unregister(engine, buf);
    kvp_engine_destroy(engine);
    free(buf);
    return ok ? 0 : 1;
}
