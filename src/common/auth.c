/* The authenticated mode: keys, the connection handshake, signed descriptors
 * and CURVE keys. See auth.h for the formats and docs/security.md for what it
 * protects. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <sys/socket.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <sodium.h>

#include "common/auth.h"
#include "common/clock.h"
#include "common/conn_server.h"
#include "common/error.h"
#include "common/log.h"
#include "common/net.h"

#define KEY_FILE_MAX 65536
#define MAGIC "KVPAUTH1"
#define MAGIC_LEN 8
#define KID_LEN 8
#define NONCE_LEN 32
#define MAC_LEN crypto_auth_hmacsha512256_BYTES
#define HELLO_LEN (MAGIC_LEN + KID_LEN + 8 + NONCE_LEN)
#define CHAL_LEN (MAGIC_LEN + 8 + NONCE_LEN + MAC_LEN)
#define DONE_LEN (MAGIC_LEN + 8)
#define HELLO_MARK 0xFF
#define KDF_CONTEXT "kvpipeau"

_Static_assert(KVPI_AUTH_KID_LEN == KID_LEN && KVPI_AUTH_NONCE_LEN == NONCE_LEN &&
                   KVPI_AUTH_MAC_LEN == MAC_LEN,
               "auth.h's lengths are the handshake's");

/* Subkey ids of crypto_kdf_derive_from_key. */
enum { SUB_HANDSHAKE = 1, SUB_DESC = 2, SUB_CURVE_SERVER = 3, SUB_CURVE_CLIENT = 4, SUB_KID = 5 };

typedef struct auth_key {
    uint8_t master[crypto_kdf_KEYBYTES];
    uint8_t handshake[crypto_auth_hmacsha512256_KEYBYTES];
    uint8_t desc[crypto_auth_hmacsha512256_KEYBYTES];
    uint8_t kid[KID_LEN];
    char kid_hex[2 * KID_LEN + 1];
} auth_key;

struct kvpi_auth {
    size_t n_keys;
    auth_key keys[KVPI_AUTH_MAX_KEYS]; /* keys[0]: the one we prove and sign with */
};

/* ------------------------------------------------------------------ keys --- */

static void derive_key(auth_key *k, const char *text, size_t len)
{
    crypto_generichash(k->master, sizeof k->master, (const unsigned char *)text, len, NULL, 0);
    crypto_kdf_derive_from_key(k->handshake, sizeof k->handshake, SUB_HANDSHAKE, KDF_CONTEXT,
                               k->master);
    crypto_kdf_derive_from_key(k->desc, sizeof k->desc, SUB_DESC, KDF_CONTEXT, k->master);
    uint8_t kid[crypto_kdf_BYTES_MIN];
    crypto_kdf_derive_from_key(kid, sizeof kid, SUB_KID, KDF_CONTEXT, k->master);
    memcpy(k->kid, kid, KID_LEN);
    sodium_bin2hex(k->kid_hex, sizeof k->kid_hex, k->kid, KID_LEN);
}

static kvp_status read_key_file(const char *path, char *buf, size_t cap, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvpi_error(KVP_ECONFIG, "auth key file %s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    kvp_status st = KVP_OK;
    if (fstat(fd, &sb) != 0)
        st = kvpi_error(KVP_ECONFIG, "auth key file %s: stat: %s", path, strerror(errno));
    else if (!S_ISREG(sb.st_mode))
        st = kvpi_error(KVP_ECONFIG, "auth key file %s is not a regular file", path);
    else if (sb.st_mode & (S_IRWXG | S_IRWXO))
        st = kvpi_error(KVP_ECONFIG,
                        "auth key file %s is accessible to group or others (mode %03o); "
                        "chmod 600 it",
                        path, (unsigned)(sb.st_mode & 0777));
    size_t got = 0;
    while (!st && got < cap) {
        ssize_t n = read(fd, buf + got, cap - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) st = kvpi_error(KVP_ECONFIG, "auth key file %s: %s", path, strerror(errno));
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    if (!st && got == cap)
        st = kvpi_error(KVP_ECONFIG, "auth key file %s is larger than %d bytes", path,
                        KEY_FILE_MAX - 1);
    *len = got;
    return st;
}

/* Split the file into keys, one per line. */
static kvp_status parse_keys(kvpi_auth *a, const char *path, char *text, size_t len)
{
    text[len] = '\0';
    int lineno = 0;
    for (char *line = text, *next; line && *line; line = next) {
        lineno++;
        next = strchr(line, '\n');
        if (next) *next++ = '\0';
        size_t n = strlen(line);
        while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t'))
            line[--n] = '\0';
        while (*line == ' ' || *line == '\t') {
            line++;
            n--;
        }
        if (n == 0 || line[0] == '#') continue;
        if (n < KVPI_AUTH_MIN_KEY_CHARS)
            return kvpi_error(KVP_ECONFIG,
                              "auth key file %s, line %d: a key of %zu characters; at least %d "
                              "are needed (e.g. the output of `openssl rand -hex 32`)",
                              path, lineno, n, KVPI_AUTH_MIN_KEY_CHARS);
        if (a->n_keys == KVPI_AUTH_MAX_KEYS)
            return kvpi_error(KVP_ECONFIG, "auth key file %s holds more than %d keys", path,
                              KVPI_AUTH_MAX_KEYS);
        derive_key(&a->keys[a->n_keys++], line, n);
    }
    if (a->n_keys == 0) return kvpi_error(KVP_ECONFIG, "auth key file %s holds no key", path);
    return KVP_OK;
}

kvp_status kvpi_auth_load(const char *path, kvpi_auth **out)
{
    if (!path || !*path || !out) return kvpi_error(KVP_EINVAL, "auth: no key file named");
    if (sodium_init() < 0) return kvpi_error(KVP_EIO, "auth: libsodium cannot initialise");
    char *text = malloc(KEY_FILE_MAX);
    kvpi_auth *a = calloc(1, sizeof *a);
    if (!text || !a) {
        free(text);
        free(a);
        return kvpi_error(KVP_ENOMEM, "auth: out of memory");
    }
    size_t len = 0;
    kvp_status st = read_key_file(path, text, KEY_FILE_MAX, &len);
    if (!st) st = parse_keys(a, path, text, len);
    sodium_memzero(text, KEY_FILE_MAX);
    free(text);
    if (st) {
        kvpi_auth_free(a);
        return st;
    }
    *out = a;
    return KVP_OK;
}

kvp_status kvpi_auth_resolve(const char *option, kvpi_auth **out)
{
    const char *path = option ? option : getenv(KVPI_AUTH_ENV);
    if (!path || !*path) {
        *out = NULL;
        return KVP_OK;
    }
    return kvpi_auth_load(path, out);
}

void kvpi_auth_free(kvpi_auth *a)
{
    if (!a) return;
    sodium_memzero(a, sizeof *a);
    free(a);
}

const char *kvpi_auth_kid(const kvpi_auth *a)
{
    return a->keys[0].kid_hex;
}

static const auth_key *key_of(const kvpi_auth *a, const uint8_t kid[KID_LEN])
{
    for (size_t i = 0; i < a->n_keys; i++)
        if (sodium_memcmp(a->keys[i].kid, kid, KID_LEN) == 0) return &a->keys[i];
    return NULL;
}

/* ------------------------------------------------------------ handshake --- */

static void handshake_mac(const auth_key *k, const char *role, const char *channel,
                          const uint8_t nc[NONCE_LEN], const uint8_t ns[NONCE_LEN],
                          uint8_t out[MAC_LEN])
{
    crypto_auth_hmacsha512256_state s;
    crypto_auth_hmacsha512256_init(&s, k->handshake, sizeof k->handshake);
    char label[64];
    int n = snprintf(label, sizeof label, "kvpipe auth v1 %s", role);
    crypto_auth_hmacsha512256_update(&s, (const uint8_t *)label, (size_t)n + 1);
    crypto_auth_hmacsha512256_update(&s, (const uint8_t *)channel, strlen(channel) + 1);
    crypto_auth_hmacsha512256_update(&s, k->kid, KID_LEN);
    crypto_auth_hmacsha512256_update(&s, nc, NONCE_LEN);
    crypto_auth_hmacsha512256_update(&s, ns, NONCE_LEN);
    crypto_auth_hmacsha512256_final(&s, out);
}

void kvpi_auth_nonce(uint8_t out[KVPI_AUTH_NONCE_LEN])
{
    randombytes_buf(out, KVPI_AUTH_NONCE_LEN);
}

void kvpi_auth_kid_bytes(const kvpi_auth *a, uint8_t out[KVPI_AUTH_KID_LEN])
{
    memcpy(out, a->keys[0].kid, KID_LEN);
}

int kvpi_auth_mac(const kvpi_auth *a, const uint8_t kid[KVPI_AUTH_KID_LEN], const char *role,
                  const char *channel, const uint8_t nc[KVPI_AUTH_NONCE_LEN],
                  const uint8_t ns[KVPI_AUTH_NONCE_LEN], uint8_t out[KVPI_AUTH_MAC_LEN])
{
    const auth_key *k = key_of(a, kid);
    if (!k) return -1;
    handshake_mac(k, role, channel, nc, ns, out);
    return 0;
}

int kvpi_auth_mac_check(const kvpi_auth *a, const uint8_t kid[KVPI_AUTH_KID_LEN], const char *role,
                        const char *channel, const uint8_t nc[KVPI_AUTH_NONCE_LEN],
                        const uint8_t ns[KVPI_AUTH_NONCE_LEN], const uint8_t mac[KVPI_AUTH_MAC_LEN])
{
    uint8_t want[MAC_LEN];
    if (kvpi_auth_mac(a, kid, role, channel, nc, ns, want) != 0) return -1;
    int ok = sodium_memcmp(want, mac, MAC_LEN) == 0;
    sodium_memzero(want, sizeof want);
    return ok ? 0 : -1;
}

static void put_verdict(uint8_t *frame, int verdict)
{
    memset(frame, 0, DONE_LEN);
    memcpy(frame, MAGIC, MAGIC_LEN);
    frame[MAGIC_LEN] = (uint8_t)verdict;
}

static const char *verdict_text(int v)
{
    return v == KVPI_AUTH_REFUSED_KEY     ? "it holds no key of our key id: a different key"
           : v == KVPI_AUTH_REFUSED_PROOF ? "our proof did not match its key"
                                          : "an unknown verdict";
}

/* A read of the peer's first answer failed or was not ours: say what that
 * means for authentication. */
static kvp_status not_authenticated(kvp_status st, const char *channel, const char *what)
{
    char detail[256];
    snprintf(detail, sizeof detail, "%s", st ? kvp_last_error() : "");
    return kvpi_error(KVP_EAUTH,
                      "%s peer %s: it is not an authenticated kvpipe peer (a Mooncake peer, or "
                      "kvpipe without the key)%s%s",
                      channel, what, st ? ": " : "", detail);
}

kvp_status kvpi_auth_client(const kvpi_auth *a, int fd, const char *channel, uint64_t deadline)
{
    const auth_key *k = &a->keys[0];
    uint8_t hello[HELLO_LEN] = {0}, chal[CHAL_LEN], proof[MAC_LEN], done[DONE_LEN];
    memcpy(hello, MAGIC, MAGIC_LEN);
    memcpy(hello + MAGIC_LEN, k->kid, KID_LEN);
    hello[MAGIC_LEN + KID_LEN] = HELLO_MARK;
    uint8_t *nc = hello + MAGIC_LEN + KID_LEN + 8;
    randombytes_buf(nc, NONCE_LEN);
    kvp_status st = kvpi_send_all_by(fd, hello, sizeof hello, deadline);
    if (st) return st;
    st = kvpi_recv_all_by(fd, chal, MAGIC_LEN, deadline);
    if (st == KVP_ECONNRESET)
        return not_authenticated(st, channel, "closed the connection at our authentication hello");
    if (st) return st;
    if (memcmp(chal, MAGIC, MAGIC_LEN) != 0)
        return not_authenticated(KVP_OK, channel,
                                 "answered our authentication hello with "
                                 "something else");
    if ((st = kvpi_recv_all_by(fd, chal + MAGIC_LEN, 8, deadline))) return st;
    int verdict = chal[MAGIC_LEN];
    if (verdict != KVPI_AUTH_ACCEPTED)
        return kvpi_error(KVP_EAUTH, "%s peer refused our key (key id %s): %s", channel, k->kid_hex,
                          verdict_text(verdict));
    if ((st = kvpi_recv_all_by(fd, chal + MAGIC_LEN + 8, NONCE_LEN + MAC_LEN, deadline))) return st;
    const uint8_t *ns = chal + MAGIC_LEN + 8;
    uint8_t want[MAC_LEN];
    handshake_mac(k, "server", channel, nc, ns, want);
    if (sodium_memcmp(want, ns + NONCE_LEN, MAC_LEN) != 0)
        return kvpi_error(KVP_EAUTH,
                          "%s peer failed to prove the key (its MAC does not match): an "
                          "impostor, or a replayed answer",
                          channel);
    handshake_mac(k, "client", channel, nc, ns, proof);
    if ((st = kvpi_send_all_by(fd, proof, sizeof proof, deadline))) return st;
    if ((st = kvpi_recv_all_by(fd, done, sizeof done, deadline))) return st;
    if (memcmp(done, MAGIC, MAGIC_LEN) != 0)
        return kvpi_error(KVP_EAUTH, "%s peer sent a malformed authentication verdict", channel);
    if (done[MAGIC_LEN] != KVPI_AUTH_ACCEPTED)
        return kvpi_error(KVP_EAUTH, "%s peer refused us: %s", channel,
                          verdict_text(done[MAGIC_LEN]));
    return KVP_OK;
}

kvp_status kvpi_auth_server(const kvpi_auth *a, int fd, const char *channel, uint64_t deadline)
{
    uint8_t hello[HELLO_LEN], chal[CHAL_LEN] = {0}, proof[MAC_LEN], done[DONE_LEN];
    kvp_status st = kvpi_recv_all_by(fd, hello, MAGIC_LEN, deadline);
    if (st) return st;
    if (memcmp(hello, MAGIC, MAGIC_LEN) != 0)
        return kvpi_error(KVP_EAUTH,
                          "the peer sent no authentication hello (first bytes %02x%02x%02x%02x): "
                          "a Mooncake peer or a kvpipe peer without the key",
                          hello[0], hello[1], hello[2], hello[3]);
    if ((st = kvpi_recv_all_by(fd, hello + MAGIC_LEN, HELLO_LEN - MAGIC_LEN, deadline))) return st;
    const uint8_t *kid = hello + MAGIC_LEN;
    const uint8_t *nc = kid + KID_LEN + 8;
    const auth_key *k = key_of(a, kid);
    if (!k) {
        put_verdict(chal, KVPI_AUTH_REFUSED_KEY);
        kvpi_send_all_by(fd, chal, DONE_LEN, deadline);
        char hex[2 * KID_LEN + 1];
        sodium_bin2hex(hex, sizeof hex, kid, KID_LEN);
        return kvpi_error(KVP_EAUTH,
                          "the peer proves with key id %s, which is not ours (%s): "
                          "a different key",
                          hex, a->keys[0].kid_hex);
    }
    put_verdict(chal, KVPI_AUTH_ACCEPTED);
    uint8_t *ns = chal + MAGIC_LEN + 8;
    randombytes_buf(ns, NONCE_LEN);
    handshake_mac(k, "server", channel, nc, ns, ns + NONCE_LEN);
    if ((st = kvpi_send_all_by(fd, chal, sizeof chal, deadline))) return st;
    if ((st = kvpi_recv_all_by(fd, proof, sizeof proof, deadline))) return st;
    uint8_t want[MAC_LEN];
    handshake_mac(k, "client", channel, nc, ns, want);
    int ok = sodium_memcmp(want, proof, MAC_LEN) == 0;
    put_verdict(done, ok ? KVPI_AUTH_ACCEPTED : KVPI_AUTH_REFUSED_PROOF);
    kvp_status sent = kvpi_send_all_by(fd, done, sizeof done, deadline);
    if (!ok)
        return kvpi_error(KVP_EAUTH,
                          "the peer's proof does not match (key id %s): a wrong or "
                          "replayed handshake",
                          k->kid_hex);
    return sent;
}

kvp_status kvpi_auth_conn_setup(kvpi_conn *conn, const kvpi_auth *a, const char *channel,
                                kvpi_log_limit *lim)
{
    kvp_status st = kvpi_auth_server(a, kvpi_conn_fd(conn), channel, kvpi_conn_deadline(conn));
    if (st == KVP_EAUTH)
        kvpi_log_limited(lim, KVP_LOG_WARN, KVPI_LOG_SUBSYS, "%s: refused a connection: %s",
                         kvpi_conn_name(conn), kvp_last_error());
    else if (st)
        KVPI_DEBUG("%s: authentication did not finish: %s", kvpi_conn_name(conn), kvp_last_error());
    return st;
}

int kvpi_auth_peek(int fd, uint64_t deadline)
{
    char head[MAGIC_LEN];
    for (;;) {
        ssize_t n = recv(fd, head, sizeof head, MSG_PEEK | MSG_DONTWAIT);
        if (n == (ssize_t)sizeof head) return memcmp(head, MAGIC, MAGIC_LEN) == 0;
        if (n > 0 && memcmp(head, MAGIC, (size_t)n) != 0) return 0;
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            return -1;
        int left = kvpi_remaining_ms(deadline);
        if (left == 0) return -1;
        /* A partial HELLO: the socket stays readable, so sleep a little
         * before looking again instead of polling it. */
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(n > 0 ? NULL : &p, n > 0 ? 0 : 1, n > 0 && left > 5 ? 5 : left) < 0 &&
            errno != EINTR)
            return -1;
    }
}

/* ---------------------------------------------------------- descriptors --- */

#define FIELD_HEAD ",\"" KVPI_AUTH_FIELD "\":{\"ts\":"

static uint64_t wall_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (uint64_t)now.tv_sec * 1000u + (uint64_t)now.tv_nsec / 1000000u;
}

/* MAC over the label, ts and the unsigned text (len bytes of it, then "}"). */
static void desc_mac(const auth_key *k, uint64_t ts, const char *text, size_t len,
                     uint8_t out[MAC_LEN])
{
    static const char label[] = "kvpipe desc v1";
    uint8_t t[8];
    kvpi_put_le64(t, ts);
    crypto_auth_hmacsha512256_state s;
    crypto_auth_hmacsha512256_init(&s, k->desc, sizeof k->desc);
    crypto_auth_hmacsha512256_update(&s, (const uint8_t *)label, sizeof label);
    crypto_auth_hmacsha512256_update(&s, t, sizeof t);
    crypto_auth_hmacsha512256_update(&s, (const uint8_t *)text, len);
    crypto_auth_hmacsha512256_update(&s, (const uint8_t *)"}", 1);
    crypto_auth_hmacsha512256_final(&s, out);
}

char *kvpi_auth_desc_sign(const kvpi_auth *a, const char *desc)
{
    size_t n = strlen(desc);
    if (n < 2 || desc[n - 1] != '}') return NULL;
    const auth_key *k = &a->keys[0];
    uint64_t ts = wall_ms();
    uint8_t mac[MAC_LEN];
    desc_mac(k, ts, desc, n - 1, mac);
    char mac_hex[2 * MAC_LEN + 1];
    sodium_bin2hex(mac_hex, sizeof mac_hex, mac, MAC_LEN);
    size_t cap = n + 256;
    char *out = malloc(cap);
    if (out)
        snprintf(out, cap, "%.*s" FIELD_HEAD "%" PRIu64 ",\"kid\":\"%s\",\"mac\":\"%s\"}}",
                 (int)(n - 1), desc, ts, k->kid_hex, mac_hex);
    return out;
}

/* The start of the last signature field in text, or NULL. */
static const char *find_field(const char *text)
{
    const char *last = NULL;
    for (const char *p = strstr(text, FIELD_HEAD); p; p = strstr(p + 1, FIELD_HEAD))
        last = p;
    return last;
}

int kvpi_auth_desc_signed(const char *desc)
{
    cJSON *d = desc ? cJSON_Parse(desc) : NULL;
    int has = cJSON_IsObject(d) && cJSON_GetObjectItemCaseSensitive(d, KVPI_AUTH_FIELD);
    cJSON_Delete(d);
    return has;
}

/* Parse `"ts":N,"kid":"HEX","mac":"HEX"}}` after FIELD_HEAD, up to end. */
static int parse_field(const char *p, const char *end, uint64_t *ts, uint8_t kid[KID_LEN],
                       uint8_t mac[MAC_LEN])
{
    p += strlen(FIELD_HEAD);
    char *after;
    errno = 0;
    unsigned long long v = strtoull(p, &after, 10);
    if (after == p || errno || *p == '-' || after - p > 16) return -1;
    *ts = v;
    p = after;
    static const char kid_head[] = ",\"kid\":\"", mac_head[] = "\",\"mac\":\"", tail[] = "\"}}";
    size_t kh = sizeof kid_head - 1, mh = sizeof mac_head - 1, th = sizeof tail - 1;
    if ((size_t)(end - p) != kh + 2 * KID_LEN + mh + 2 * MAC_LEN + th) return -1;
    if (memcmp(p, kid_head, kh) != 0) return -1;
    p += kh;
    size_t got = 0;
    if (sodium_hex2bin(kid, KID_LEN, p, 2 * KID_LEN, NULL, &got, NULL) != 0 || got != KID_LEN)
        return -1;
    p += 2 * KID_LEN;
    if (memcmp(p, mac_head, mh) != 0) return -1;
    p += mh;
    if (sodium_hex2bin(mac, MAC_LEN, p, 2 * MAC_LEN, NULL, &got, NULL) != 0 || got != MAC_LEN)
        return -1;
    p += 2 * MAC_LEN;
    return memcmp(p, tail, th) == 0 ? 0 : -1;
}

/* The unsigned document's "name" equals segment. */
static int names_segment(const char *text, size_t len, const char *segment)
{
    char *copy = malloc(len + 2);
    if (!copy) return 0;
    memcpy(copy, text, len);
    copy[len] = '}';
    copy[len + 1] = '\0';
    cJSON *d = cJSON_Parse(copy);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(d, "name");
    int same = cJSON_IsString(name) && strcmp(name->valuestring, segment) == 0;
    cJSON_Delete(d);
    free(copy);
    return same;
}

kvp_status kvpi_auth_desc_verify(const kvpi_auth *a, const char *desc, const char *segment,
                                 int max_age_ms)
{
    if (max_age_ms <= 0) max_age_ms = KVPI_AUTH_MAX_AGE_MS_DEFAULT;
    const char *field = desc ? find_field(desc) : NULL;
    if (!field)
        return kvpi_error(KVP_EAUTH,
                          "segment %s: descriptor refused: it is unsigned (written by an engine "
                          "without the key, a Mooncake engine, or someone else)",
                          segment);
    const char *end = desc + strlen(desc);
    while (end > field && (end[-1] == '\n' || end[-1] == '\r' || end[-1] == ' '))
        end--;
    uint64_t ts;
    uint8_t kid[KID_LEN], mac[MAC_LEN], want[MAC_LEN];
    if (parse_field(field, end, &ts, kid, mac) != 0)
        return kvpi_error(KVP_EAUTH, "segment %s: descriptor refused: its '%s' field is garbage",
                          segment, KVPI_AUTH_FIELD);
    const auth_key *k = key_of(a, kid);
    char hex[2 * KID_LEN + 1];
    sodium_bin2hex(hex, sizeof hex, kid, KID_LEN);
    if (!k)
        return kvpi_error(KVP_EAUTH,
                          "segment %s: descriptor refused: signed with key id %s, which this "
                          "process does not hold (ours: %s)",
                          segment, hex, a->keys[0].kid_hex);
    desc_mac(k, ts, desc, (size_t)(field - desc), want);
    if (sodium_memcmp(want, mac, MAC_LEN) != 0)
        return kvpi_error(KVP_EAUTH,
                          "segment %s: descriptor refused: forged (its MAC does not match its "
                          "contents under key id %s)",
                          segment, hex);
    uint64_t now = wall_ms();
    if (now > ts + (uint64_t)max_age_ms || ts > now + (uint64_t)max_age_ms)
        return kvpi_error(KVP_EAUTH,
                          "segment %s: descriptor refused: stale (signed %+.1f s from now; at "
                          "most %d ms old is accepted: is its engine gone, or a clock off?)",
                          segment, ((double)ts - (double)now) / 1000.0, max_age_ms);
    if (!names_segment(desc, (size_t)(field - desc), segment))
        return kvpi_error(KVP_EAUTH,
                          "segment %s: descriptor refused: it is genuine but names another "
                          "segment (moved under this key by someone)",
                          segment);
    return KVP_OK;
}

/* --------------------------------------------------------------- CURVE --- */

kvp_status kvpi_auth_curve_keys(const kvpi_auth *a, kvpi_auth_curve *out)
{
    uint8_t seed[crypto_box_SEEDBYTES];
    const auth_key *k = &a->keys[0];
    crypto_kdf_derive_from_key(seed, sizeof seed, SUB_CURVE_SERVER, KDF_CONTEXT, k->master);
    int bad = crypto_box_seed_keypair(out->server_public, out->server_secret, seed);
    crypto_kdf_derive_from_key(seed, sizeof seed, SUB_CURVE_CLIENT, KDF_CONTEXT, k->master);
    bad |= crypto_box_seed_keypair(out->client_public, out->client_secret, seed);
    sodium_memzero(seed, sizeof seed);
    return bad ? kvpi_error(KVP_EIO, "auth: cannot derive the CURVE keys") : KVP_OK;
}
