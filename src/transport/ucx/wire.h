/* Internal: the ucx transport's control messages, their one encoder and
 * decoder (no UCX here: the fuzzer fuzz_ucx_wire drives the decoders).
 *
 * UCP active messages with no header part, their data a
 * sequence of little-endian u64 words, word 0 = KVPI_UCX_MAGIC | aux << 32:
 *   HELLO      initiator -> target, on the initiator's new endpoint, with
 *              UCP_AM_SEND_FLAG_REPLY; aux = version; word 1 = epoch of the
 *              descriptor the initiator read; then the initiator worker's
 *              address. The target creates its own endpoint to that address,
 *              which UCP pairs with the endpoint the initiator's requests
 *              arrive on, so that closing it cuts the initiator off.
 *   HELLO_ACK  target -> initiator; aux = status | n << 16; word 1 = the
 *              connection's id; then n ranges (addr, length) deregistered
 *              since that epoch.
 *   REVOKE     target -> initiator; words: serial, addr, length: the region
 *              is being deregistered.
 *   REVOKE_ACK initiator -> target; words: connection id, serial: no request
 *              of ours touches that range any more (refused from now on, and
 *              those issued before are flushed).
 *   BYE        initiator -> target; words: connection id: the initiator
 *              closes its endpoint (over shared memory UCX may not tell the
 *              target, whose deregistrations would then wait for it).
 *
 * Authenticated mode (docs/security.md; the engine has a key): the "ucx"
 * field also holds "auth": true and the buffers carry no "ucx_rkey": rkeys
 * are handed only to an initiator that proved the key, by a challenge-
 * response over the HELLO exchange (MACs: common/auth.h, channel "ucx",
 * the target in the "server" role):
 *   HELLO      as above with KVPI_UCX_HELLO_FLAG_AUTH in bits 48..63 of
 *              word 0, and before the worker address: kid[8] | Nc[32].
 *   CHALLENGE  target -> initiator, on the target's endpoint to it; aux =
 *              status (OK, or AUTH_KEY: no key of that kid); word 1 = the
 *              challenge's id; Ns[32] | MAC(server, ucx, kid, Nc, Ns).
 *   PROOF      initiator -> target, once it checked the target's MAC;
 *              word 1 = the challenge's id; MAC(client, ucx, kid, Nc, Ns).
 *   HELLO_ACK  sent only after a right PROOF (a wrong one gets a HELLO_ACK
 *              of status AUTH_PROOF, no rkeys, and the endpoint is closed);
 *              after the ranges: word m, then m entries addr | length |
 *              rkey length | the packed rkey, zero-padded to 8 bytes: every
 *              region registered at that moment.
 * A challenge unanswered within timeout_ms is dropped and its endpoint
 * closed; at most max_connections are pending at once. A plain HELLO
 * to an authenticated target gets a HELLO_ACK of status AUTH_REQUIRED.
 *
 * Each *_get checks a message taken off the wire: its magic, its exact
 * length (the HELLO's at least its head and one byte of address) and what
 * its header says of the rest; -1 when malformed (the caller ignores it).
 * Pointers it sets point into the message. Each *_put writes one message
 * into a buffer of the length the *_LEN macro or the *_size function gives.
 */
#ifndef KVPI_TRANSPORT_UCX_WIRE_H
#define KVPI_TRANSPORT_UCX_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "common/auth.h"

#define KVPI_UCX_VERSION 1
#define KVPI_UCX_MAGIC 0x5550564bu /* "KVPU" little-endian */

/* The descriptor's fields (Mooncake peers ignore them; "protocol" stays
 * "tcp"): a top-level object
 *   "ucx": {"version": 1, "worker": "<hex worker address>", "epoch": N,
 *           "host_id": "<as shm's>", "pid": P}
 * and, in each buffer entry, "ucx_rkey": "<hex packed rkey>". epoch counts
 * the server's deregistrations up to the moment the descriptor was
 * rendered. host_id and pid let a peer on the same host see that the
 * process died while UCX cannot (shared memory outlives it; a zombie keeps
 * its pid). */
#define KVPI_UCX_FIELD "ucx"
#define KVPI_UCX_RKEY_FIELD "ucx_rkey"
/* Deregistrations whose ranges a HELLO_ACK can still report. */
#define KVPI_UCX_REVOKE_LOG 256

enum kvpi_ucx_am {
    KVPI_UCX_AM_HELLO = 1,
    KVPI_UCX_AM_HELLO_ACK = 2,
    KVPI_UCX_AM_REVOKE = 3,
    KVPI_UCX_AM_REVOKE_ACK = 4,
    KVPI_UCX_AM_BYE = 5,
    KVPI_UCX_AM_CHALLENGE = 6,
    KVPI_UCX_AM_PROOF = 7,
};

enum kvpi_ucx_hello_status {
    KVPI_UCX_HELLO_OK = 0,
    KVPI_UCX_HELLO_STALE = 1,         /* the descriptor predates what the log keeps */
    KVPI_UCX_HELLO_UNPAIRED = 2,      /* the target could not pair its endpoint */
    KVPI_UCX_HELLO_AUTH_REQUIRED = 3, /* authenticated target, plain HELLO */
    KVPI_UCX_HELLO_AUTH_KEY = 4,      /* the target holds no key of the HELLO's kid */
    KVPI_UCX_HELLO_AUTH_PROOF = 5,    /* the initiator's proof was wrong */
    KVPI_UCX_HELLO_BUSY = 6,          /* max_connections challenges pending already */
};

#define KVPI_UCX_HELLO_FLAG_AUTH 1u
#define KVPI_UCX_AUTH_CHANNEL "ucx"
#define KVPI_UCX_AUTH_FIELD "auth"

#define KVPI_UCX_HELLO_LEN 16
/* The HELLO's head with its kid and nonce. */
#define KVPI_UCX_HELLO_AUTH_LEN (KVPI_UCX_HELLO_LEN + KVPI_AUTH_KID_LEN + KVPI_AUTH_NONCE_LEN)
#define KVPI_UCX_HELLO_ACK_LEN 16 /* without its ranges and rkeys */
#define KVPI_UCX_CHALLENGE_LEN (16 + KVPI_AUTH_NONCE_LEN + KVPI_AUTH_MAC_LEN)
#define KVPI_UCX_PROOF_LEN (16 + KVPI_AUTH_MAC_LEN)
#define KVPI_UCX_REVOKE_LEN 32
#define KVPI_UCX_REVOKE_ACK_LEN 24
#define KVPI_UCX_BYE_LEN 16

/* HELLO. kid and nonce: NULL, or (authenticated) KVPI_AUTH_KID_LEN and
 * KVPI_AUTH_NONCE_LEN bytes. */
typedef struct kvpi_ucx_hello {
    unsigned version;
    uint64_t epoch;
    const uint8_t *kid, *nonce;
    const void *addr; /* the initiator worker's address */
    size_t addr_len;  /* > 0 */
} kvpi_ucx_hello;
size_t kvpi_ucx_hello_size(const kvpi_ucx_hello *m);
void kvpi_ucx_hello_put(const kvpi_ucx_hello *m, uint8_t *buf);
/* Any version (the caller checks it); kid and nonce set when authenticated. */
int kvpi_ucx_hello_get(const uint8_t *d, size_t len, kvpi_ucx_hello *out);

/* HELLO_ACK: a head, n ranges, and (authenticated, status OK: with_rkeys)
 * the rkey list after them. */
typedef struct kvpi_ucx_hello_ack {
    unsigned status;
    uint64_t conn_id;
    size_t n_ranges;
    const uint8_t *ranges;            /* get: kvpi_ucx_range_get() of each */
    const uint8_t *rkeys, *rkeys_end; /* get, with_rkeys: the rkey list */
} kvpi_ucx_hello_ack;
/* Bytes of a HELLO_ACK with n ranges and an rkey list of rkeys_len bytes. */
size_t kvpi_ucx_hello_ack_size(size_t n_ranges, size_t rkeys_len);
/* The head; then kvpi_ucx_range_put() of each range at buf + 16 + 16 i,
 * then the rkey list at buf + 16 + 16 n. */
void kvpi_ucx_hello_ack_put(uint8_t *buf, unsigned status, size_t n_ranges, uint64_t conn_id);
void kvpi_ucx_range_put(uint8_t *at, uint64_t addr, uint64_t length);
void kvpi_ucx_range_get(const uint8_t *at, uint64_t *addr, uint64_t *length);
/* auth: the initiator holds a key, so an OK answer carries rkeys. */
int kvpi_ucx_hello_ack_get(const uint8_t *d, size_t len, int auth, kvpi_ucx_hello_ack *out);

/* The rkey list: word m, then m entries addr | length | key length | key,
 * zero-padded to 8 bytes. */
size_t kvpi_ucx_rkey_entry_size(size_t key_len);
/* Writes the count; entries follow at at + 8. */
void kvpi_ucx_rkeys_count_put(uint8_t *at, uint64_t m);
/* One entry at at; returns where the next goes. */
uint8_t *kvpi_ucx_rkey_entry_put(uint8_t *at, uint64_t addr, uint64_t length, const void *key,
                                 size_t key_len);
typedef struct kvpi_ucx_rkey_iter {
    const uint8_t *at, *end;
    uint64_t left;
} kvpi_ucx_rkey_iter;
int kvpi_ucx_rkeys_begin(const uint8_t *d, const uint8_t *end, kvpi_ucx_rkey_iter *it);
/* 1: an entry; 0: the end, the list exactly consumed; -1: malformed. */
int kvpi_ucx_rkeys_next(kvpi_ucx_rkey_iter *it, uint64_t *addr, uint64_t *length,
                        const uint8_t **key, size_t *key_len);

/* CHALLENGE (status in word 0's aux) and PROOF. */
void kvpi_ucx_challenge_put(uint8_t buf[KVPI_UCX_CHALLENGE_LEN], unsigned status, uint64_t id,
                            const uint8_t nonce[KVPI_AUTH_NONCE_LEN],
                            const uint8_t mac[KVPI_AUTH_MAC_LEN]);
int kvpi_ucx_challenge_get(const uint8_t *d, size_t len, uint64_t *id, const uint8_t **nonce,
                           const uint8_t **mac);
void kvpi_ucx_proof_put(uint8_t buf[KVPI_UCX_PROOF_LEN], uint64_t id,
                        const uint8_t mac[KVPI_AUTH_MAC_LEN]);
int kvpi_ucx_proof_get(const uint8_t *d, size_t len, uint64_t *id, const uint8_t **mac);

/* REVOKE, REVOKE_ACK, BYE: fixed words after the magic. */
void kvpi_ucx_revoke_put(uint8_t buf[KVPI_UCX_REVOKE_LEN], uint64_t serial, uint64_t addr,
                         uint64_t length);
int kvpi_ucx_revoke_get(const uint8_t *d, size_t len, uint64_t *serial, uint64_t *addr,
                        uint64_t *length);
void kvpi_ucx_revoke_ack_put(uint8_t buf[KVPI_UCX_REVOKE_ACK_LEN], uint64_t conn_id,
                             uint64_t serial);
int kvpi_ucx_revoke_ack_get(const uint8_t *d, size_t len, uint64_t *conn_id, uint64_t *serial);
void kvpi_ucx_bye_put(uint8_t buf[KVPI_UCX_BYE_LEN], uint64_t conn_id);
int kvpi_ucx_bye_get(const uint8_t *d, size_t len, uint64_t *conn_id);

#endif
