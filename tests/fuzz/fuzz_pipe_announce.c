/* The tensor pipe's announcement (src/pipe/announce.c): one ZeroMQ message
 * from the peer's PUSH socket, two frames of u64 big-endian address and
 * length. Input: u64 max_message_bytes, then the message's frames, each a
 * u8 size and that many bytes, to the end. Invariants: a message is decoded
 * iff it is exactly two 8-byte frames; the range is taken iff it is non-empty,
 * within max_message_bytes and does not wrap (KVP_ERANGE for a wrap, else
 * KVP_EPROTO); encoding what was decoded and decoding it again gives the same
 * address and length. */
#include "common/net.h"
#include "fuzz.h"
#include "pipe/announce.h"

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    kvpf_quiet();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvpf_reader in = {data, size};
    size_t max = (size_t)kvpf_take(&in, 8);
    kvpi_announce_rx rx = {0};
    int frames = 0, all_eight = 1;
    const uint8_t *first[2] = {NULL, NULL};
    while (in.left) {
        size_t n = (size_t)kvpf_take(&in, 1);
        if (n > in.left) n = in.left;
        /* A copy of exactly n bytes, so a read past the frame is caught. */
        uint8_t *frame = malloc(n ? n : 1);
        FUZZ_CHECK(frame);
        memcpy(frame, in.p, n);
        kvpi_announce_add_frame(&rx, frame, n);
        free(frame);
        if (frames < 2) {
            first[frames] = in.p;
            all_eight &= n == KVPI_ANNOUNCE_FRAME_LEN;
        }
        frames++;
        in.p += n;
        in.left -= n;
    }
    FUZZ_CHECK(rx.frames == frames);
    uint64_t addr = 0, len = 0;
    kvp_status st = kvpi_announce_decode(&rx, "local", "peer", &addr, &len);
    FUZZ_CHECK((st == KVP_OK) == (frames == 2 && all_eight));
    if (st) {
        FUZZ_CHECK(st == KVP_EPROTO);
        return 0;
    }
    FUZZ_CHECK(addr == kvpi_get_be64(first[0]) && len == kvpi_get_be64(first[1]));

    st = kvpi_announce_check(addr, len, max, "local", "peer");
    int wraps = len > UINT64_MAX - addr;
    if (len == 0 || len > max)
        FUZZ_CHECK(st == KVP_EPROTO);
    else if (wraps)
        FUZZ_CHECK(st == KVP_ERANGE);
    else
        FUZZ_CHECK(st == KVP_OK);

    uint8_t a[KVPI_ANNOUNCE_FRAME_LEN], l[KVPI_ANNOUNCE_FRAME_LEN];
    kvpi_announce_encode(addr, len, a, l);
    FUZZ_CHECK(memcmp(a, first[0], 8) == 0 && memcmp(l, first[1], 8) == 0);
    kvpi_announce_rx again = {0};
    kvpi_announce_add_frame(&again, a, sizeof a);
    kvpi_announce_add_frame(&again, l, sizeof l);
    uint64_t addr2, len2;
    FUZZ_CHECK(kvpi_announce_decode(&again, "local", "peer", &addr2, &len2) == KVP_OK);
    FUZZ_CHECK(addr2 == addr && len2 == len);
    return 0;
}
