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
 * that body's length. Each is checked on the message as it came and, when
 * its last frame (of more than one) is a tag - KVPI_TAG_LEN bytes, 32
 * lower-case hex digits first - on the message without it; the tag's fields
 * are its bytes, and encoding them gives those bytes back. */
#include "common/net.h"
#include "fuzz.h"
#include "pipe/announce.h"

KVPF_QUIET_INITIALIZE

/* The frames of one message, as the fuzzer cut them. */
typedef struct frames {
    int n;
    const uint8_t *p[64];
    size_t size[64];
} frames;

static int is_tag(const uint8_t *p, size_t n)
{
    if (n != KVPI_TAG_LEN && n != KVPI_TAG_DIGEST_LEN) return 0;
    for (int i = 0; i < KVPI_TAG_INSTANCE_LEN; i++)
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) return 0;
    return 1;
}

/* The decoders' invariants on m, made of the first `count` frames of f. */
static void check_message(const kvpi_control_msg *m, const frames *f, int count, size_t max)
{
    size_t size0 = count ? f->size[0] : 0;
    int is_ack = count && size0 == 3 && memcmp(f->p[0], "ACK", 3) == 0;
    int tagged = count && size0 >= KVPI_INLINE_TAG_LEN && memcmp(f->p[0], KVPI_INLINE_TAG, 8) == 0;
    int all_eight = count == 2 && f->size[0] == 8 && f->size[1] == 8;
    FUZZ_CHECK(m->frames == count);
    FUZZ_CHECK(kvpi_ack_is_valid(m) == (count == 1 && is_ack));

    size_t body = 5;
    int in_line = kvpi_inline_decode(m, &body);
    FUZZ_CHECK(in_line == (count == 1 && tagged && size0 >= KVPI_INLINE_TAG_LEN + KVPI_INLINE_MIN));
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
    int ok = kvpi_announce_decode(m, &addr, &len);
    FUZZ_CHECK(!(ok && in_line));
    FUZZ_CHECK(ok == all_eight);
    if (!ok) {
        FUZZ_CHECK(addr == 7 && len == 9);
        return;
    }
    FUZZ_CHECK(addr == kvpi_get_be64(f->p[0]) && len == kvpi_get_be64(f->p[1]));

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
    FUZZ_CHECK(memcmp(a, f->p[0], 8) == 0 && memcmp(l, f->p[1], 8) == 0);
    kvpi_control_msg again = {0};
    kvpi_control_add_frame(&again, a, sizeof a);
    kvpi_control_add_frame(&again, l, sizeof l);
    uint64_t addr2, len2;
    FUZZ_CHECK(kvpi_announce_decode(&again, &addr2, &len2));
    FUZZ_CHECK(addr2 == addr && len2 == len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvpf_reader in = {data, size};
    size_t max = (size_t)kvpf_take(&in, 8);
    kvpi_control_msg m = {0};
    frames f = {0};
    while (in.left) {
        size_t n = (size_t)kvpf_take(&in, 1);
        if (n > in.left) n = in.left;
        /* A copy of exactly n bytes, so a read past the frame is caught. */
        uint8_t *frame = malloc(n ? n : 1);
        FUZZ_CHECK(frame);
        memcpy(frame, in.p, n);
        kvpi_control_add_frame(&m, frame, n);
        free(frame);
        if (f.n == 64) return 0; /* longer than any message the checks describe */
        f.p[f.n] = in.p;
        f.size[f.n++] = n;
        in.p += n;
        in.left -= n;
    }
    check_message(&m, &f, f.n, max);

    kvpi_msg_tag tag = {.seq = 3};
    kvpi_control_msg untagged = m;
    int has_tag = kvpi_control_take_tag(&untagged, &tag);
    FUZZ_CHECK(has_tag == (f.n > 1 && is_tag(f.p[f.n - 1], f.size[f.n - 1])));
    if (!has_tag) {
        FUZZ_CHECK(tag.seq == 3 && untagged.frames == m.frames);
        return 0;
    }
    const uint8_t *last = f.p[f.n - 1];
    FUZZ_CHECK(strlen(tag.instance) == KVPI_TAG_INSTANCE_LEN &&
               memcmp(tag.instance, last, KVPI_TAG_INSTANCE_LEN) == 0);
    FUZZ_CHECK(tag.seq == kvpi_get_be64(last + KVPI_TAG_INSTANCE_LEN));
    size_t len = f.size[f.n - 1];
    FUZZ_CHECK(tag.has_digest == (len == KVPI_TAG_DIGEST_LEN));
    FUZZ_CHECK(!tag.has_digest || tag.digest == kvpi_get_be64(last + KVPI_TAG_LEN));
    uint8_t again[KVPI_TAG_DIGEST_LEN];
    FUZZ_CHECK(kvpi_tag_encode(&tag, again) == len);
    FUZZ_CHECK(memcmp(again, last, len) == 0);
    check_message(&untagged, &f, f.n - 1, max);
    /* One tag a message. */
    kvpi_msg_tag twice;
    FUZZ_CHECK(!kvpi_control_take_tag(&untagged, &twice));
    return 0;
}
