/* The tensor pipe's control messages (src/pipe/announce.c): one ZeroMQ
 * message from a peer's PUSH socket, taken as an announcement on the data link
 * (two frames of u64 big-endian address and length) or as an ACK on the ACK
 * link (the one 3-byte frame "ACK"). Input: u64 max_message_bytes, then the
 * message's frames, each a u8 size and that many bytes, to the end.
 * Invariants: a message is an announcement iff it is exactly two 8-byte
 * frames, and an ACK iff it is the one frame "ACK"; the range is taken iff it
 * is non-empty, within max_message_bytes and does not wrap (KVP_ERANGE for a
 * wrap, else KVP_EPROTO); encoding what was decoded and decoding it again
 * gives the same address and length; a message is inline iff it is one frame
 * of the tag and at least KVPI_INLINE_MIN bytes more, never both an inline
 * message and an announcement, and a tag put before a body decodes back to
 * that body's length. */
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
    kvpi_control_msg m = {0};
    int frames = 0, all_eight = 1, is_ack = 0, tagged = 0;
    size_t size0 = 0;
    const uint8_t *first[2] = {NULL, NULL};
    while (in.left) {
        size_t n = (size_t)kvpf_take(&in, 1);
        if (n > in.left) n = in.left;
        /* A copy of exactly n bytes, so a read past the frame is caught. */
        uint8_t *frame = malloc(n ? n : 1);
        FUZZ_CHECK(frame);
        memcpy(frame, in.p, n);
        kvpi_control_add_frame(&m, frame, n);
        free(frame);
        if (frames < 2) {
            first[frames] = in.p;
            all_eight &= n == KVPI_ANNOUNCE_FRAME_LEN;
        }
        if (frames == 0) {
            is_ack = n == 3 && memcmp(in.p, "ACK", 3) == 0;
            tagged = n >= KVPI_INLINE_TAG_LEN && memcmp(in.p, KVPI_INLINE_TAG, 8) == 0;
            size0 = n;
        }
        frames++;
        in.p += n;
        in.left -= n;
    }
    FUZZ_CHECK(m.frames == frames);
    FUZZ_CHECK(kvpi_ack_is_valid(&m) == (frames == 1 && is_ack));

    size_t body = 5;
    int in_line = kvpi_inline_decode(&m, &body);
    FUZZ_CHECK(in_line == (frames == 1 && tagged && size0 >= KVPI_INLINE_TAG_LEN + KVPI_INLINE_MIN));
    FUZZ_CHECK(in_line ? body == size0 - KVPI_INLINE_TAG_LEN : body == 5);
    if (in_line) {
        uint8_t frame[KVPI_INLINE_TAG_LEN + KVPI_INLINE_MIN] = {0};
        FUZZ_CHECK(kvpi_inline_put_tag(frame) == frame + KVPI_INLINE_TAG_LEN);
        FUZZ_CHECK(kvpi_inline_size(body) == size0);
        kvpi_control_msg again = {0};
        kvpi_control_add_frame(&again, frame, sizeof frame);
        size_t b2 = 0;
        FUZZ_CHECK(kvpi_inline_decode(&again, &b2) && b2 == KVPI_INLINE_MIN);
    }

    uint64_t addr = 7, len = 9;
    int ok = kvpi_announce_decode(&m, &addr, &len);
    FUZZ_CHECK(!(ok && in_line));
    FUZZ_CHECK(ok == (frames == 2 && all_eight));
    if (!ok) {
        FUZZ_CHECK(addr == 7 && len == 9);
        return 0;
    }
    FUZZ_CHECK(addr == kvpi_get_be64(first[0]) && len == kvpi_get_be64(first[1]));

    kvp_status st = kvpi_announce_check(addr, len, max, "local", "peer");
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
    kvpi_control_msg again = {0};
    kvpi_control_add_frame(&again, a, sizeof a);
    kvpi_control_add_frame(&again, l, sizeof l);
    uint64_t addr2, len2;
    FUZZ_CHECK(kvpi_announce_decode(&again, &addr2, &len2));
    FUZZ_CHECK(addr2 == addr && len2 == len);
    return 0;
}
