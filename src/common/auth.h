/* Internal: the opt-in authenticated mode (docs/security.md).
 *
 * A shared secret, read from a key file, lets kvpipe peers prove to each
 * other that they hold it. Everything here is libsodium: crypto_auth
 * (HMAC-SHA512-256) for every MAC, crypto_kdf to derive one subkey per use
 * from each key, randombytes_buf for nonces, sodium_memcmp to compare MACs,
 * crypto_box_seed_keypair for the pipe's ZeroMQ CURVE keys.
 *
 * Key file: one key per line (blank lines and lines starting with '#' are
 * skipped), each at least 32 characters of high-entropy text (for example
 * `openssl rand -hex 32`); at most KVPI_AUTH_MAX_KEYS. The first key is the
 * one this process proves with and signs with; every key in the file is
 * accepted from peers, which is how a key is rotated without a flag day. The
 * file must not be readable or writable by group or others.
 *
 * Connection handshake, run by both ends right after the connection is made,
 * before any byte of the transport's own protocol (all integers
 * little-endian, MACs are crypto_auth with the key's handshake subkey):
 *
 *   client -> server  HELLO  "KVPAUTH1" | kid[8] | 0xFF | 7 zero bytes | Nc[32]
 *   server -> client  CHAL   "KVPAUTH1" | verdict u8 | 7 zero | Ns[32] | MACs[32]
 *   client -> server  PROOF  MACc[32]
 *   server -> client  DONE   "KVPAUTH1" | verdict u8 | 7 zero
 *
 *   MACs = MAC("kvpipe auth v1 server" | channel | kid | Nc | Ns)
 *   MACc = MAC("kvpipe auth v1 client" | channel | kid | Nc | Ns)
 *
 * kid names the key the client proves with (8 bytes derived from it), so a
 * server that accepts several keys picks the right one. Both nonces are fresh
 * per connection, so a recorded handshake replayed to either side fails; the
 * direction and the channel ("tcp", "shm", "rpc", ...) are bound into each
 * MAC, so neither a reflected MAC nor one from another listener passes. The
 * byte 0xFF at offset 16 makes a HELLO an invalid request to Mooncake's TCP
 * data plane (opcode 0x7F) and an oversized frame to its handshake port, so
 * an unauthenticated server closes at once instead of waiting. A verdict is
 * 0 (accepted) or a KVPI_AUTH_REFUSED_* code; a server that refuses sends it
 * and closes.
 *
 * Descriptors: an authenticated engine appends
 *   ,"kvpipe_auth":{"ts":MS,"kid":"HEX16","mac":"HEX64"}
 * as the last field of its segment descriptor, MS being the Unix time in
 * milliseconds when it was signed and mac = MAC("kvpipe desc v1" | ts |
 * the descriptor text without the field) with the key's descriptor subkey.
 * Mooncake readers ignore the field (unknown fields are ignored).
 *
 * Thread safety: a kvpi_auth is immutable once loaded and may be used by any
 * number of threads at once.
 */
#ifndef KVPI_COMMON_AUTH_H
#define KVPI_COMMON_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/status.h"

/* The env variable naming the key file when no option names one. */
#define KVPI_AUTH_ENV "KVPIPE_AUTH_KEY_FILE"
#define KVPI_AUTH_MAX_KEYS 4
#define KVPI_AUTH_MIN_KEY_CHARS 32
/* The descriptor field of the signature. */
#define KVPI_AUTH_FIELD "kvpipe_auth"
/* Default age past which a signed descriptor is refused as stale. */
#define KVPI_AUTH_MAX_AGE_MS_DEFAULT 120000

/* Verdicts of the handshake. */
#define KVPI_AUTH_ACCEPTED 0
#define KVPI_AUTH_REFUSED_KEY 1   /* the server holds no key of that kid */
#define KVPI_AUTH_REFUSED_PROOF 2 /* the client's MAC was wrong */

typedef struct kvpi_auth kvpi_auth;

/* Load the key file at path. KVP_ECONFIG naming the path and the problem
 * (unreadable, readable by others, no key, a key too short, too many). */
kvp_status kvpi_auth_load(const char *path, kvpi_auth **out);

/* The authentication an engine or pipe uses: option (a key file path) when
 * non-NULL, else env KVPIPE_AUTH_KEY_FILE; "" (or an unset env) means off:
 * *out = NULL and KVP_OK. */
kvp_status kvpi_auth_resolve(const char *option, kvpi_auth **out);

void kvpi_auth_free(kvpi_auth *auth);

/* The key id (hex, 16 characters) this process proves with, for messages. */
const char *kvpi_auth_kid(const kvpi_auth *auth);

/* ---- the connection handshake ----
 * Both bound by deadline_ns (kvpi_now_ns clock). KVP_EAUTH when the other end
 * does not prove the key (the message says how: refused, wrong MAC, not an
 * authenticated kvpipe peer at all); I/O errors as kvpi_recv_all_by.
 * channel names the listener kind and must be the same on both ends. */
kvp_status kvpi_auth_client(const kvpi_auth *auth, int fd, const char *channel,
                            uint64_t deadline_ns);
kvp_status kvpi_auth_server(const kvpi_auth *auth, int fd, const char *channel,
                            uint64_t deadline_ns);

/* The server side as a connection server's setup step (common/conn_server.h):
 * under the connection's setup deadline; a refusal is logged at WARN naming
 * the listener, rate-limited through lim (a static of the listener kind, so a
 * flood on one listener does not hide refusals on another), and the
 * connection closes. This is the one call a listener needs; its clients call
 * kvpi_auth_client on each new connection. */
struct kvpi_conn;
struct kvpi_log_limit;
kvp_status kvpi_auth_conn_setup(struct kvpi_conn *conn, const kvpi_auth *auth, const char *channel,
                                struct kvpi_log_limit *lim);

/* Wait (by deadline_ns) until the first 8 bytes of fd's stream are in, and
 * say whether they begin a HELLO (1) or not (0: the peer speaks the
 * listener's own protocol, unauthenticated); -1 when the stream ends or the
 * deadline passes first. Consumes nothing, so a listener can answer an
 * unauthenticated peer in its own protocol with a clear refusal. */
int kvpi_auth_peek(int fd, uint64_t deadline_ns);

/* ---- the same challenge-response over a transport's own messages ----
 * For a transport that exchanges its connection parameters over a channel of
 * its own (ucx: UCP active messages) instead of a stream: it carries the
 * client's key id and nonce, the server's nonce and the two MACs in its own
 * messages, and computes and checks them here, so that the MACs are the
 * stream handshake's (same subkey, labels, binding of role, channel, key
 * id and both nonces). role is "server" (the side that proves first: the
 * target) or "client" (the initiator). */
#define KVPI_AUTH_KID_LEN 8
#define KVPI_AUTH_NONCE_LEN 32
#define KVPI_AUTH_MAC_LEN 32

/* A fresh nonce (randombytes_buf). */
void kvpi_auth_nonce(uint8_t out[KVPI_AUTH_NONCE_LEN]);
/* The key id this process proves with. */
void kvpi_auth_kid_bytes(const kvpi_auth *auth, uint8_t out[KVPI_AUTH_KID_LEN]);
/* role's MAC under the key of kid: 0, or -1 when no key of that kid is held. */
int kvpi_auth_mac(const kvpi_auth *auth, const uint8_t kid[KVPI_AUTH_KID_LEN], const char *role,
                  const char *channel, const uint8_t nc[KVPI_AUTH_NONCE_LEN],
                  const uint8_t ns[KVPI_AUTH_NONCE_LEN], uint8_t out[KVPI_AUTH_MAC_LEN]);
/* 0 when mac is role's MAC under the key of kid (compared with
 * sodium_memcmp); -1 when it is not or no key of that kid is held. */
int kvpi_auth_mac_check(const kvpi_auth *auth, const uint8_t kid[KVPI_AUTH_KID_LEN],
                        const char *role, const char *channel,
                        const uint8_t nc[KVPI_AUTH_NONCE_LEN],
                        const uint8_t ns[KVPI_AUTH_NONCE_LEN],
                        const uint8_t mac[KVPI_AUTH_MAC_LEN]);

/* ---- descriptors ---- */

/* desc_json (a JSON object's text, ending in '}') with the signature field
 * appended, signed now; malloc'ed, NULL when out of memory. */
char *kvpi_auth_desc_sign(const kvpi_auth *auth, const char *desc_json);

/* Check a descriptor's signature: present, made with a key this process
 * accepts, and no older than max_age_ms (nor further in the future). KVP_OK,
 * or KVP_EAUTH with a message naming segment and saying what is wrong
 * (unsigned, forged or garbage, stale). */
kvp_status kvpi_auth_desc_verify(const kvpi_auth *auth, const char *desc_json, const char *segment,
                                 int max_age_ms);

/* Whether descriptor text (a JSON object) has a KVPI_AUTH_FIELD member at all:
 * a signature, or the refusal an authenticated handshake port answers an
 * unauthenticated request with. A reader without the key uses this to say
 * why it cannot reach such a segment. */
int kvpi_auth_desc_signed(const char *desc_json);

/* ---- ZeroMQ CURVE keys, derived from the current key ----
 * Binary, 32 bytes each. The server's public key is derived from the secret
 * and never sent, so a client that completes a CURVE handshake with it holds
 * the secret. */
typedef struct kvpi_auth_curve {
    uint8_t server_public[32], server_secret[32];
    uint8_t client_public[32], client_secret[32];
} kvpi_auth_curve;

kvp_status kvpi_auth_curve_keys(const kvpi_auth *auth, kvpi_auth_curve *out);

#endif
