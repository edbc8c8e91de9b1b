/* initiator: read and write a target's memory.
 *
 *   initiator TARGET_HOST:PORT [METADATA]
 *
 * Opens the target's segment, reads the first half of its first buffer and
 * checks pattern 1, writes pattern 2 into the second half, then sets the last
 * byte to 1 to tell the target it is done. METADATA must be the one the target
 * uses (default "P2PHANDSHAKE"). */
#include <stdlib.h>
#include <string.h>

#include "common.h"

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: initiator TARGET_HOST:PORT [METADATA]\n");
        return 2;
    }
    kvp_engine_opts opts;
    kvp_engine_opts_init(&opts);
    opts.local_server_name = "127.0.0.1:0"; /* any free port */
    opts.metadata = argc > 2 ? argv[2] : "P2PHANDSHAKE";

    kvp_engine *engine;
    kvp_status st = kvp_engine_create(&opts, &engine);
    if (st) return example_fail("kvp_engine_create", st);

    /* Find the target's registered memory through its descriptor. */
    kvp_segment_id seg;
    kvp_remote_buffer rb;
    size_t n = 0;
    if ((st = kvp_engine_open_segment(engine, argv[1], &seg)) ||
        (st = kvp_engine_segment_buffers(engine, seg, &rb, 1, &n)))
        return example_fail(argv[1], st);
    if (n == 0 || rb.length < 2) {
        fprintf(stderr, "%s registered no memory\n", argv[1]);
        return 1;
    }
    size_t half = (size_t)rb.length / 2;
    printf("segment %s: %zu buffer(s), the first %llu bytes at 0x%llx, via %s\n", argv[1], n,
           (unsigned long long)rb.length, (unsigned long long)rb.addr,
           kvp_engine_segment_transport(engine, seg));

    /* Local memory need not be registered for these one-sided transfers. */
    uint8_t *mem = malloc(rb.length);
    if (!mem) return 1;
    if ((st = kvp_engine_read(engine, seg, mem, rb.addr, half))) return example_fail("read", st);
    for (size_t i = 0; i < half; i++)
        if (mem[i] != example_byte(1, i)) {
            fprintf(stderr, "byte %zu reads %u, not %u\n", i, mem[i], example_byte(1, i));
            return 1;
        }
    printf("read %zu bytes: pattern 1 intact\n", half);

    for (size_t i = half; i < rb.length - 1; i++)
        mem[i] = example_byte(2, i);
    if ((st = kvp_engine_write(engine, seg, mem + half, rb.addr + half, rb.length - 1 - half)))
        return example_fail("write", st);
    /* A synchronous write returns once the data is in the target's memory,
     * so the flag set next is seen after it. */
    uint8_t flag = 1;
    if ((st = kvp_engine_write(engine, seg, &flag, rb.addr + rb.length - 1, 1)))
        return example_fail("write flag", st);
    printf("wrote %zu bytes of pattern 2 and the done flag\n", (size_t)rb.length - half);

    free(mem);
    kvp_engine_destroy(engine);
    return 0;
}
