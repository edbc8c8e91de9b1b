/* Internal: the pipe's control messages, as vLLM's MooncakePipe sends them.
 *
 *   announcement (data link): one ZeroMQ message of two 8-byte frames, the
 *       big-endian address and the big-endian length of the sender's managed
 *       buffer, which the receiver READs and then acknowledges;
 *   ACK (ACK link): one message of the one 3-byte frame "ACK";
 * and kvpipe's own, between two kvpipe pipes (pipe_internal.h, "The inline
 * path"):
 *   inline message (data link): one frame, KVPI_INLINE_TAG then the
 *       safetensors file itself (at least KVPI_INLINE_MIN bytes), copied out
 *       of ZeroMQ instead of READ; acknowledged like an announcement;
 *   tag: one more, last, frame of KVPI_TAG_LEN bytes after an announcement, an
 *       inline message or an ACK: the sender's instance and the message's
 *       sequence number (kvpi_msg_tag). A tagged ACK acknowledges every
 *       message of that instance up to that number (pipe_internal.h, "Tags").
 *       Between pipes that both check integrity, a message's tag is
 *       KVPI_TAG_DIGEST_LEN bytes: the message's digest follows
 *       (pipe_internal.h, "Integrity").
 *
 * A reader takes the frames of one message into a kvpi_control_msg, then asks
 * whether it is an announcement or an ACK; anything else is dropped by the
 * caller. All of this is pure (no sockets, no logging), so that it can be
 * fuzzed; thread-safe.
 */
#ifndef KVPI_PIPE_ANNOUNCE_H
#define KVPI_PIPE_ANNOUNCE_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/engine.h"
#include "kvpipe/status.h"

#define KVPI_ANNOUNCE_FRAME_LEN 8
#define KVPI_ACK_TEXT "ACK"
#define KVPI_ACK_LEN 3
/* As the first frame of an announcement these 8 bytes would be a
 * non-canonical address, so no announcement, and no malformed message but a
 * forged one, starts like that. */
#define KVPI_INLINE_TAG "KVPINL01"
#define KVPI_INLINE_TAG_LEN 8
/* The smallest safetensors file: its 8-byte header length and a header of 8. */
#define KVPI_INLINE_MIN 16

/* A tag frame: the sending pipe's engine instance (KVPI_INSTANCE_FIELD of its
 * descriptor, 32 lower-case hex digits), then the message's sequence number
 * (u64 big-endian, from 1). */
#define KVPI_TAG_INSTANCE_LEN KVP_INSTANCE_LEN
#define KVPI_TAG_LEN (KVPI_TAG_INSTANCE_LEN + 8)
/* A tag with the message's digest after the sequence number (u64
 * big-endian; common/digest.h). */
#define KVPI_TAG_DIGEST_LEN (KVPI_TAG_LEN + 8)
typedef struct kvpi_msg_tag {
    char instance[KVPI_TAG_INSTANCE_LEN + 1];
    uint64_t seq;
    int has_digest;
    uint64_t digest;
} kvpi_msg_tag;

/* One message as it arrived: its frame count, the sizes of its first two
 * frames and the first 8 bytes of each (fewer when shorter; the rest is
 * unspecified), and its last frame when that is KVPI_TAG_LEN or
 * KVPI_TAG_DIGEST_LEN bytes long.
 * Start from {0}. */
typedef struct kvpi_control_msg {
    int frames;
    size_t size[2];
    uint8_t head[2][KVPI_ANNOUNCE_FRAME_LEN];
    size_t last_size;
    uint8_t last[KVPI_TAG_DIGEST_LEN];
} kvpi_control_msg;

/* Take the next frame of a message (size bytes at data). */
void kvpi_control_add_frame(kvpi_control_msg *m, const void *data, size_t size);

/* The frame of tag t; returns its length (KVPI_TAG_DIGEST_LEN with a digest). */
size_t kvpi_tag_encode(const kvpi_msg_tag *t, uint8_t frame[KVPI_TAG_DIGEST_LEN]);

/* If m has more than one frame and its last is a tag: *t set, m without that
 * frame (the decoders below then see the message it tags), 1. Else 0, m and
 * *t untouched. */
int kvpi_control_take_tag(kvpi_control_msg *m, kvpi_msg_tag *t);

/* The two frames announcing len bytes at addr. */
void kvpi_announce_encode(uint64_t addr, uint64_t len, uint8_t addr_frame[KVPI_ANNOUNCE_FRAME_LEN],
                          uint8_t len_frame[KVPI_ANNOUNCE_FRAME_LEN]);

/* 1 if m is an announcement (exactly two 8-byte frames), with *addr and *len
 * set; 0 otherwise, outputs untouched. */
int kvpi_announce_decode(const kvpi_control_msg *m, uint64_t *addr, uint64_t *len);

/* Whether a receiver takes the announced range: not empty, at most max_bytes,
 * and not wrapping around. KVP_EPROTO (KVP_ERANGE for a wrap) with a message
 * naming both pipe ends (local, peer) otherwise. */
kvp_status kvpi_announce_check(uint64_t addr, uint64_t len, size_t max_bytes, const char *local,
                               const char *peer);

/* 1 if m is an ACK (the one 3-byte frame "ACK"), else 0. */
int kvpi_ack_is_valid(const kvpi_control_msg *m);

/* The frame of an inline message of a body_len-byte file: its size, and its
 * tag written at frame; the file goes at frame + KVPI_INLINE_TAG_LEN. */
size_t kvpi_inline_size(size_t body_len);
uint8_t *kvpi_inline_put_tag(uint8_t *frame);

/* 1 if m is an inline message (one frame: the tag, then at least
 * KVPI_INLINE_MIN bytes), with *body_len set: the file is the frame's bytes
 * from KVPI_INLINE_TAG_LEN on; 0 otherwise, *body_len untouched. */
int kvpi_inline_decode(const kvpi_control_msg *m, size_t *body_len);

#endif
