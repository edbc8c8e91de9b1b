/* The ucx transport's control messages (src/transport/ucx/wire.h), as a
 * peer sends them. Input: one byte choosing the message (its low 3 bits:
 * the kind, bit 3: the receiver holds a key), then the message to the end.
 * Invariants: a fixed-size message decodes iff its length is its own and
 * its magic ours, and encodes back to the same bytes (but its unused aux);
 * a HELLO iff its magic is ours and an address follows its head (with kid
 * and nonce when it says so), and encodes back to the same bytes; a
 * HELLO_ACK iff its ranges fit and its length is exact (without a key, or
 * when it refuses) or leaves room for an rkey list, whose walk stays inside
 * the message and re-encodes each entry to its bytes (padding aside). */
#include "common/net.h"
#include "fuzz.h"
#include "transport/ucx/wire.h"

static int magic_ok(const uint8_t *d, size_t len)
{
    return len >= 8 && (uint32_t)kvpi_get_le64(d) == KVPI_UCX_MAGIC;
}

/* Encoded again, the same bytes but word 0's aux. */
static void same_but_aux(const uint8_t *again, const uint8_t *d, size_t len)
{
    FUZZ_CHECK(memcmp(again, d, 4) == 0);
    FUZZ_CHECK(memcmp(again + 8, d + 8, len - 8) == 0);
}

static void check_hello(const uint8_t *d, size_t len)
{
    kvpi_ucx_hello m;
    int ok = kvpi_ucx_hello_get(d, len, &m) == 0;
    int authed = len >= 8 && (kvpi_get_le64(d) >> 48 & KVPI_UCX_HELLO_FLAG_AUTH);
    size_t head = authed ? KVPI_UCX_HELLO_AUTH_LEN : KVPI_UCX_HELLO_LEN;
    FUZZ_CHECK(ok == (magic_ok(d, len) && len > head));
    if (!ok) return;
    FUZZ_CHECK((m.kid != NULL) == authed && m.addr_len == len - head);
    FUZZ_CHECK(kvpi_ucx_hello_size(&m) == len);
    uint8_t *again = malloc(len);
    FUZZ_CHECK(again);
    kvpi_ucx_hello_put(&m, again);
    /* Bits 49..63 of word 0 are not the HELLO's: the rest comes back. */
    uint64_t w0 = kvpi_get_le64(d) & ~(~(uint64_t)0 << 49);
    FUZZ_CHECK(kvpi_get_le64(again) == w0);
    FUZZ_CHECK(memcmp(again + 8, d + 8, len - 8) == 0);
    free(again);
}

static void check_hello_ack(const uint8_t *d, size_t len, int auth)
{
    kvpi_ucx_hello_ack m;
    int ok = kvpi_ucx_hello_ack_get(d, len, auth, &m) == 0;
    if (!magic_ok(d, len) || len < KVPI_UCX_HELLO_ACK_LEN) {
        FUZZ_CHECK(!ok);
        return;
    }
    uint64_t w0 = kvpi_get_le64(d);
    uint64_t n = w0 >> 48;
    int keys = auth && (w0 >> 32 & 0xffff) == KVPI_UCX_HELLO_OK;
    uint64_t ranges = KVPI_UCX_HELLO_ACK_LEN + 16 * n;
    FUZZ_CHECK(ok == (keys ? len >= ranges : len == ranges));
    if (!ok) return;
    FUZZ_CHECK(m.n_ranges == n && (m.rkeys != NULL) == keys);
    uint8_t head[KVPI_UCX_HELLO_ACK_LEN];
    kvpi_ucx_hello_ack_put(head, m.status, m.n_ranges, m.conn_id);
    FUZZ_CHECK(memcmp(head, d, sizeof head) == 0);
    for (size_t i = 0; i < m.n_ranges; i++) {
        uint64_t addr, length;
        uint8_t r[16];
        kvpi_ucx_range_get(m.ranges + 16 * i, &addr, &length);
        kvpi_ucx_range_put(r, addr, length);
        FUZZ_CHECK(memcmp(r, m.ranges + 16 * i, 16) == 0);
    }
    if (!keys) return;
    kvpi_ucx_rkey_iter it;
    if (kvpi_ucx_rkeys_begin(m.rkeys, m.rkeys_end, &it)) {
        FUZZ_CHECK(m.rkeys_end - m.rkeys < 8);
        return;
    }
    uint64_t addr, length;
    const uint8_t *key, *at = m.rkeys + 8;
    size_t klen;
    int r;
    while ((r = kvpi_ucx_rkeys_next(&it, &addr, &length, &key, &klen)) == 1) {
        size_t size = kvpi_ucx_rkey_entry_size(klen);
        FUZZ_CHECK(klen > 0 && key == at + 24 && at + size <= m.rkeys_end);
        uint8_t *again = malloc(size);
        FUZZ_CHECK(again);
        FUZZ_CHECK(kvpi_ucx_rkey_entry_put(again, addr, length, key, klen) == again + size);
        FUZZ_CHECK(memcmp(again, at, 24 + klen) == 0);
        free(again);
        at += size;
    }
    FUZZ_CHECK(r == -1 || at == m.rkeys_end);
}

static void check_fixed(int kind, const uint8_t *d, size_t len)
{
    static const size_t lens[] = {[KVPI_UCX_AM_REVOKE] = KVPI_UCX_REVOKE_LEN,
                                  [KVPI_UCX_AM_REVOKE_ACK] = KVPI_UCX_REVOKE_ACK_LEN,
                                  [KVPI_UCX_AM_BYE] = KVPI_UCX_BYE_LEN,
                                  [KVPI_UCX_AM_CHALLENGE] = KVPI_UCX_CHALLENGE_LEN,
                                  [KVPI_UCX_AM_PROOF] = KVPI_UCX_PROOF_LEN};
    uint8_t again[KVPI_UCX_CHALLENGE_LEN];
    uint64_t a, b, c;
    const uint8_t *p, *q;
    int ok = -1;
    switch (kind) {
    case KVPI_UCX_AM_REVOKE:
        if ((ok = kvpi_ucx_revoke_get(d, len, &a, &b, &c) == 0))
            kvpi_ucx_revoke_put(again, a, b, c);
        break;
    case KVPI_UCX_AM_REVOKE_ACK:
        if ((ok = kvpi_ucx_revoke_ack_get(d, len, &a, &b) == 0))
            kvpi_ucx_revoke_ack_put(again, a, b);
        break;
    case KVPI_UCX_AM_BYE:
        if ((ok = kvpi_ucx_bye_get(d, len, &a) == 0)) kvpi_ucx_bye_put(again, a);
        break;
    case KVPI_UCX_AM_CHALLENGE:
        if ((ok = kvpi_ucx_challenge_get(d, len, &a, &p, &q) == 0)) {
            FUZZ_CHECK(p == d + 16 && q == d + 16 + KVPI_AUTH_NONCE_LEN);
            kvpi_ucx_challenge_put(again, 0, a, p, q);
        }
        break;
    case KVPI_UCX_AM_PROOF:
        if ((ok = kvpi_ucx_proof_get(d, len, &a, &q) == 0)) kvpi_ucx_proof_put(again, a, q);
        break;
    }
    FUZZ_CHECK(ok == (len == lens[kind] && magic_ok(d, len)));
    if (ok) same_but_aux(again, d, len);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int kind = data[0] % 7 + 1, auth = data[0] >> 3 & 1;
    /* A copy of its own size, so that a read past its end is ASan's. */
    uint8_t *d = malloc(size - 1 ? size - 1 : 1);
    FUZZ_CHECK(d);
    memcpy(d, data + 1, size - 1);
    if (kind == KVPI_UCX_AM_HELLO)
        check_hello(d, size - 1);
    else if (kind == KVPI_UCX_AM_HELLO_ACK)
        check_hello_ack(d, size - 1, auth);
    else
        check_fixed(kind, d, size - 1);
    free(d);
    return 0;
}
