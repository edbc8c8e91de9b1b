/* The pipe's control message codecs (see announce.h). */
#include <string.h>

#include "common/error.h"
#include "common/net.h"
#include "pipe/announce.h"

void kvpi_control_add_frame(kvpi_control_msg *m, const void *data, size_t size)
{
    if (m->frames < 2) {
        m->size[m->frames] = size;
        memcpy(m->head[m->frames], data,
               size < KVPI_ANNOUNCE_FRAME_LEN ? size : KVPI_ANNOUNCE_FRAME_LEN);
    }
    m->last_size = size;
    if (size == KVPI_TAG_LEN || size == KVPI_TAG_DIGEST_LEN) memcpy(m->last, data, size);
    m->frames++;
}

size_t kvpi_tag_encode(const kvpi_msg_tag *t, uint8_t frame[KVPI_TAG_DIGEST_LEN])
{
    memcpy(frame, t->instance, KVPI_TAG_INSTANCE_LEN);
    kvpi_put_be64(frame + KVPI_TAG_INSTANCE_LEN, t->seq);
    if (!t->has_digest) return KVPI_TAG_LEN;
    kvpi_put_be64(frame + KVPI_TAG_LEN, t->digest);
    return KVPI_TAG_DIGEST_LEN;
}

int kvpi_control_take_tag(kvpi_control_msg *m, kvpi_msg_tag *t)
{
    if (m->frames < 2 || (m->last_size != KVPI_TAG_LEN && m->last_size != KVPI_TAG_DIGEST_LEN))
        return 0;
    for (int i = 0; i < KVPI_TAG_INSTANCE_LEN; i++) {
        uint8_t c = m->last[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return 0;
    }
    memcpy(t->instance, m->last, KVPI_TAG_INSTANCE_LEN);
    t->instance[KVPI_TAG_INSTANCE_LEN] = '\0';
    t->seq = kvpi_get_be64(m->last + KVPI_TAG_INSTANCE_LEN);
    t->has_digest = m->last_size == KVPI_TAG_DIGEST_LEN;
    t->digest = t->has_digest ? kvpi_get_be64(m->last + KVPI_TAG_LEN) : 0;
    m->frames--;
    m->last_size = 0; /* a message has one tag */
    return 1;
}

void kvpi_announce_encode(uint64_t addr, uint64_t len, uint8_t addr_frame[KVPI_ANNOUNCE_FRAME_LEN],
                          uint8_t len_frame[KVPI_ANNOUNCE_FRAME_LEN])
{
    kvpi_put_be64(addr_frame, addr);
    kvpi_put_be64(len_frame, len);
}

int kvpi_announce_decode(const kvpi_control_msg *m, uint64_t *addr, uint64_t *len)
{
    if (m->frames != 2 || m->size[0] != KVPI_ANNOUNCE_FRAME_LEN ||
        m->size[1] != KVPI_ANNOUNCE_FRAME_LEN)
        return 0;
    *addr = kvpi_get_be64(m->head[0]);
    *len = kvpi_get_be64(m->head[1]);
    return 1;
}

kvp_status kvpi_announce_check(uint64_t addr, uint64_t len, size_t max_bytes, const char *local,
                               const char *peer)
{
    if (len == 0)
        return kvpi_error(KVP_EPROTO, "pipe %s: announcement from %s has length 0", local, peer);
    if (len > max_bytes)
        return kvpi_error(KVP_EPROTO,
                          "pipe %s: announcement from %s of %llu bytes is above max_message_bytes "
                          "(%zu)",
                          local, peer, (unsigned long long)len, max_bytes);
    if (addr + len < addr)
        return kvpi_error(KVP_ERANGE, "pipe %s: announced range 0x%llx+%llu wraps around", local,
                          (unsigned long long)addr, (unsigned long long)len);
    return KVP_OK;
}

int kvpi_ack_is_valid(const kvpi_control_msg *m)
{
    return m->frames == 1 && m->size[0] == KVPI_ACK_LEN &&
           memcmp(m->head[0], KVPI_ACK_TEXT, KVPI_ACK_LEN) == 0;
}

size_t kvpi_inline_size(size_t body_len)
{
    return KVPI_INLINE_TAG_LEN + body_len;
}

uint8_t *kvpi_inline_put_tag(uint8_t *frame)
{
    memcpy(frame, KVPI_INLINE_TAG, KVPI_INLINE_TAG_LEN);
    return frame + KVPI_INLINE_TAG_LEN;
}

int kvpi_inline_decode(const kvpi_control_msg *m, size_t *body_len)
{
    if (m->frames != 1 || m->size[0] < KVPI_INLINE_TAG_LEN + KVPI_INLINE_MIN ||
        memcmp(m->head[0], KVPI_INLINE_TAG, KVPI_INLINE_TAG_LEN) != 0)
        return 0;
    *body_len = m->size[0] - KVPI_INLINE_TAG_LEN;
    return 1;
}
