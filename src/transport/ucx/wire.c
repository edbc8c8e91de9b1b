#include "transport/ucx/wire.h"

#include <string.h>

#include "common/net.h"

/* Word 0: the magic, aux in bits 32..63. */
static void head_put(uint8_t *d, uint64_t aux)
{
    kvpi_put_le64(d, KVPI_UCX_MAGIC | aux << 32);
}

/* A message of exactly want bytes (at least want when at_least) with our
 * magic; its aux in *aux. */
static int head_get(const uint8_t *d, size_t len, size_t want, int at_least, uint64_t *aux)
{
    if (len < want || (!at_least && len != want) || len < 8) return -1;
    uint64_t w0 = kvpi_get_le64(d);
    if ((uint32_t)w0 != KVPI_UCX_MAGIC) return -1;
    if (aux) *aux = w0 >> 32;
    return 0;
}

size_t kvpi_ucx_hello_size(const kvpi_ucx_hello *m)
{
    return (m->kid ? KVPI_UCX_HELLO_AUTH_LEN : KVPI_UCX_HELLO_LEN) + m->addr_len;
}

void kvpi_ucx_hello_put(const kvpi_ucx_hello *m, uint8_t *buf)
{
    uint64_t flags = m->kid ? KVPI_UCX_HELLO_FLAG_AUTH : 0;
    head_put(buf, (uint64_t)(m->version & 0xffff) | flags << 16);
    kvpi_put_le64(buf + 8, m->epoch);
    size_t head = KVPI_UCX_HELLO_LEN;
    if (m->kid) {
        memcpy(buf + head, m->kid, KVPI_AUTH_KID_LEN);
        memcpy(buf + head + KVPI_AUTH_KID_LEN, m->nonce, KVPI_AUTH_NONCE_LEN);
        head = KVPI_UCX_HELLO_AUTH_LEN;
    }
    memcpy(buf + head, m->addr, m->addr_len);
}

int kvpi_ucx_hello_get(const uint8_t *d, size_t len, kvpi_ucx_hello *out)
{
    uint64_t aux;
    if (head_get(d, len, KVPI_UCX_HELLO_LEN, 1, &aux)) return -1;
    int authed = (aux >> 16 & KVPI_UCX_HELLO_FLAG_AUTH) != 0;
    size_t head = authed ? KVPI_UCX_HELLO_AUTH_LEN : KVPI_UCX_HELLO_LEN;
    if (len <= head) return -1; /* no address */
    *out = (kvpi_ucx_hello){.version = (unsigned)(aux & 0xffff),
                            .epoch = kvpi_get_le64(d + 8),
                            .kid = authed ? d + KVPI_UCX_HELLO_LEN : NULL,
                            .nonce = authed ? d + KVPI_UCX_HELLO_LEN + KVPI_AUTH_KID_LEN : NULL,
                            .addr = d + head,
                            .addr_len = len - head};
    return 0;
}

size_t kvpi_ucx_hello_ack_size(size_t n_ranges, size_t rkeys_len)
{
    return KVPI_UCX_HELLO_ACK_LEN + 16 * n_ranges + rkeys_len;
}

void kvpi_ucx_hello_ack_put(uint8_t *buf, unsigned status, size_t n_ranges, uint64_t conn_id)
{
    head_put(buf, (uint64_t)(status & 0xffff) | (uint64_t)n_ranges << 16);
    kvpi_put_le64(buf + 8, conn_id);
}

void kvpi_ucx_range_put(uint8_t *at, uint64_t addr, uint64_t length)
{
    kvpi_put_le64(at, addr);
    kvpi_put_le64(at + 8, length);
}

void kvpi_ucx_range_get(const uint8_t *at, uint64_t *addr, uint64_t *length)
{
    *addr = kvpi_get_le64(at);
    *length = kvpi_get_le64(at + 8);
}

int kvpi_ucx_hello_ack_get(const uint8_t *d, size_t len, int auth, kvpi_ucx_hello_ack *out)
{
    uint64_t aux;
    if (head_get(d, len, KVPI_UCX_HELLO_ACK_LEN, 1, &aux)) return -1;
    unsigned status = (unsigned)(aux & 0xffff);
    uint64_t n = aux >> 16;
    int keys = auth && status == KVPI_UCX_HELLO_OK;
    if (n > (len - KVPI_UCX_HELLO_ACK_LEN) / 16) return -1;
    size_t ranges = KVPI_UCX_HELLO_ACK_LEN + 16 * (size_t)n;
    if (keys ? len < ranges : len != ranges) return -1;
    *out = (kvpi_ucx_hello_ack){.status = status,
                                .conn_id = kvpi_get_le64(d + 8),
                                .n_ranges = (size_t)n,
                                .ranges = d + KVPI_UCX_HELLO_ACK_LEN,
                                .rkeys = keys ? d + ranges : NULL,
                                .rkeys_end = keys ? d + len : NULL};
    return 0;
}

size_t kvpi_ucx_rkey_entry_size(size_t key_len)
{
    return 24 + (key_len + 7) / 8 * 8;
}

void kvpi_ucx_rkeys_count_put(uint8_t *at, uint64_t m)
{
    kvpi_put_le64(at, m);
}

uint8_t *kvpi_ucx_rkey_entry_put(uint8_t *at, uint64_t addr, uint64_t length, const void *key,
                                 size_t key_len)
{
    kvpi_put_le64(at, addr);
    kvpi_put_le64(at + 8, length);
    kvpi_put_le64(at + 16, key_len);
    size_t padded = (key_len + 7) / 8 * 8;
    memset(at + 24, 0, padded);
    memcpy(at + 24, key, key_len);
    return at + 24 + padded;
}

int kvpi_ucx_rkeys_begin(const uint8_t *d, const uint8_t *end, kvpi_ucx_rkey_iter *it)
{
    if (!d || end - d < 8) return -1;
    *it = (kvpi_ucx_rkey_iter){.at = d + 8, .end = end, .left = kvpi_get_le64(d)};
    return 0;
}

int kvpi_ucx_rkeys_next(kvpi_ucx_rkey_iter *it, uint64_t *addr, uint64_t *length,
                        const uint8_t **key, size_t *key_len)
{
    if (it->left == 0) return it->at == it->end ? 0 : -1;
    if (it->end - it->at < 24) return -1;
    uint64_t klen = kvpi_get_le64(it->at + 16), padded = (klen + 7) / 8 * 8;
    if (klen == 0 || padded < klen || (uint64_t)(it->end - it->at - 24) < padded) return -1;
    *addr = kvpi_get_le64(it->at);
    *length = kvpi_get_le64(it->at + 8);
    *key = it->at + 24;
    *key_len = (size_t)klen;
    it->at += 24 + padded;
    it->left--;
    return 1;
}

void kvpi_ucx_challenge_put(uint8_t buf[KVPI_UCX_CHALLENGE_LEN], unsigned status, uint64_t id,
                            const uint8_t nonce[KVPI_AUTH_NONCE_LEN],
                            const uint8_t mac[KVPI_AUTH_MAC_LEN])
{
    head_put(buf, status & 0xffff);
    kvpi_put_le64(buf + 8, id);
    memcpy(buf + 16, nonce, KVPI_AUTH_NONCE_LEN);
    memcpy(buf + 16 + KVPI_AUTH_NONCE_LEN, mac, KVPI_AUTH_MAC_LEN);
}

int kvpi_ucx_challenge_get(const uint8_t *d, size_t len, uint64_t *id, const uint8_t **nonce,
                           const uint8_t **mac)
{
    if (head_get(d, len, KVPI_UCX_CHALLENGE_LEN, 0, NULL)) return -1;
    *id = kvpi_get_le64(d + 8);
    *nonce = d + 16;
    *mac = d + 16 + KVPI_AUTH_NONCE_LEN;
    return 0;
}

void kvpi_ucx_proof_put(uint8_t buf[KVPI_UCX_PROOF_LEN], uint64_t id,
                        const uint8_t mac[KVPI_AUTH_MAC_LEN])
{
    head_put(buf, 0);
    kvpi_put_le64(buf + 8, id);
    memcpy(buf + 16, mac, KVPI_AUTH_MAC_LEN);
}

int kvpi_ucx_proof_get(const uint8_t *d, size_t len, uint64_t *id, const uint8_t **mac)
{
    if (head_get(d, len, KVPI_UCX_PROOF_LEN, 0, NULL)) return -1;
    *id = kvpi_get_le64(d + 8);
    *mac = d + 16;
    return 0;
}

void kvpi_ucx_revoke_put(uint8_t buf[KVPI_UCX_REVOKE_LEN], uint64_t serial, uint64_t addr,
                         uint64_t length)
{
    head_put(buf, 0);
    kvpi_put_le64(buf + 8, serial);
    kvpi_put_le64(buf + 16, addr);
    kvpi_put_le64(buf + 24, length);
}

int kvpi_ucx_revoke_get(const uint8_t *d, size_t len, uint64_t *serial, uint64_t *addr,
                        uint64_t *length)
{
    if (head_get(d, len, KVPI_UCX_REVOKE_LEN, 0, NULL)) return -1;
    *serial = kvpi_get_le64(d + 8);
    *addr = kvpi_get_le64(d + 16);
    *length = kvpi_get_le64(d + 24);
    return 0;
}

void kvpi_ucx_revoke_ack_put(uint8_t buf[KVPI_UCX_REVOKE_ACK_LEN], uint64_t conn_id,
                             uint64_t serial)
{
    head_put(buf, 0);
    kvpi_put_le64(buf + 8, conn_id);
    kvpi_put_le64(buf + 16, serial);
}

int kvpi_ucx_revoke_ack_get(const uint8_t *d, size_t len, uint64_t *conn_id, uint64_t *serial)
{
    if (head_get(d, len, KVPI_UCX_REVOKE_ACK_LEN, 0, NULL)) return -1;
    *conn_id = kvpi_get_le64(d + 8);
    *serial = kvpi_get_le64(d + 16);
    return 0;
}

void kvpi_ucx_bye_put(uint8_t buf[KVPI_UCX_BYE_LEN], uint64_t conn_id)
{
    head_put(buf, 0);
    kvpi_put_le64(buf + 8, conn_id);
}

int kvpi_ucx_bye_get(const uint8_t *d, size_t len, uint64_t *conn_id)
{
    if (head_get(d, len, KVPI_UCX_BYE_LEN, 0, NULL)) return -1;
    *conn_id = kvpi_get_le64(d + 8);
    return 0;
}
