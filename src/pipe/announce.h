/* Internal: the pipe's announcement, vLLM MooncakePipe's data control message.
 *
 * One ZeroMQ message of two 8-byte frames: the big-endian address and the
 * big-endian length of the sender's managed buffer, which the receiver READs
 * and then acknowledges. The receiver takes the frames of a message one by
 * one into a kvpi_announce_rx, then decodes and checks it; all of this is pure
 * (no sockets), so that it can be fuzzed. Errors are KVP_EPROTO (KVP_ERANGE for
 * a range that wraps) with a message naming both pipe ends.
 */
#ifndef KVPI_PIPE_ANNOUNCE_H
#define KVPI_PIPE_ANNOUNCE_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/status.h"

#define KVPI_ANNOUNCE_FRAME_LEN 8

/* The frames of one message so far: how many, whether one of the first two
 * was not 8 bytes, and the first two. Start from {0}. */
typedef struct kvpi_announce_rx {
    int frames;
    int bad_size;
    uint8_t f[2][KVPI_ANNOUNCE_FRAME_LEN];
} kvpi_announce_rx;

/* The two frames announcing len bytes at addr. */
void kvpi_announce_encode(uint64_t addr, uint64_t len, uint8_t addr_frame[KVPI_ANNOUNCE_FRAME_LEN],
                          uint8_t len_frame[KVPI_ANNOUNCE_FRAME_LEN]);

/* Take the next frame of a message (size bytes at data). */
void kvpi_announce_add_frame(kvpi_announce_rx *rx, const void *data, size_t size);

/* The address and length of a whole message: KVP_EPROTO unless it was two
 * 8-byte frames. local and peer name the pipe's ends in the message. */
kvp_status kvpi_announce_decode(const kvpi_announce_rx *rx, const char *local, const char *peer,
                                uint64_t *addr, uint64_t *len);

/* Whether a receiver takes the announced range: not empty, at most max_bytes,
 * and not wrapping around. */
kvp_status kvpi_announce_check(uint64_t addr, uint64_t len, size_t max_bytes, const char *local,
                               const char *peer);

#endif
