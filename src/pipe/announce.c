/* The pipe's announcement codec (see announce.h). */
#include <string.h>

#include "common/error.h"
#include "common/net.h"
#include "pipe/announce.h"

void kvpi_announce_encode(uint64_t addr, uint64_t len, uint8_t addr_frame[KVPI_ANNOUNCE_FRAME_LEN],
                          uint8_t len_frame[KVPI_ANNOUNCE_FRAME_LEN])
{
    kvpi_put_be64(addr_frame, addr);
    kvpi_put_be64(len_frame, len);
}

void kvpi_announce_add_frame(kvpi_announce_rx *rx, const void *data, size_t size)
{
    if (rx->frames < 2 && size == KVPI_ANNOUNCE_FRAME_LEN)
        memcpy(rx->f[rx->frames], data, KVPI_ANNOUNCE_FRAME_LEN);
    else if (rx->frames < 2)
        rx->bad_size = 1;
    rx->frames++;
}

kvp_status kvpi_announce_decode(const kvpi_announce_rx *rx, const char *local, const char *peer,
                                uint64_t *addr, uint64_t *len)
{
    if (rx->frames != 2 || rx->bad_size)
        return kvpi_error(KVP_EPROTO,
                          "pipe %s: malformed announcement from %s: %d frame(s)%s, want two "
                          "8-byte frames (address, length)",
                          local, peer, rx->frames, rx->bad_size ? " of the wrong size" : "");
    *addr = kvpi_get_be64(rx->f[0]);
    *len = kvpi_get_be64(rx->f[1]);
    return KVP_OK;
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
