/* The digest of end-to-end integrity: see digest.h. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
/* On x86-64, libxxhash's dispatcher: the same XXH3 with the widest vectors
 * this CPU has (AVX2, AVX-512) instead of the SSE2 the library was built
 * for; 2.2 times as fast in cache here (bench/digest_speed). Its header
 * turns the calls below into the _dispatch ones. */
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxh_x86dispatch.h>)
#include <xxh_x86dispatch.h>
#endif
#endif

#include "common/digest.h"
#include "common/error.h"
#include "common/net.h"

uint64_t kvpi_digest(const void *buf, size_t len)
{
    return XXH3_64bits(buf, len);
}

struct kvpi_digester {
    XXH3_state_t *state;
};

kvpi_digester *kvpi_digester_new(void)
{
    kvpi_digester *d = malloc(sizeof *d);
    if (d && !(d->state = XXH3_createState())) {
        free(d);
        return NULL;
    }
    if (d) XXH3_64bits_reset(d->state);
    return d;
}

void kvpi_digester_free(kvpi_digester *d)
{
    if (!d) return;
    XXH3_freeState(d->state);
    free(d);
}

void kvpi_digester_reset(kvpi_digester *d)
{
    XXH3_64bits_reset(d->state);
}

void kvpi_digester_add(kvpi_digester *d, const void *buf, size_t len)
{
    XXH3_64bits_update(d->state, buf, len);
}

uint64_t kvpi_digester_value(const kvpi_digester *d)
{
    return XXH3_64bits_digest(d->state);
}

void kvpi_digester_copy(kvpi_digester *d, void *dst, const void *src, size_t len)
{
    for (size_t off = 0; off < len;) {
        size_t n = len - off < KVPI_DIGEST_CHUNK ? len - off : KVPI_DIGEST_CHUNK;
        memcpy((char *)dst + off, (const char *)src + off, n);
        XXH3_64bits_update(d->state, (char *)dst + off, n);
        off += n;
    }
}

/* The calling thread's digester, made on first use and freed when the
 * thread ends. */
static pthread_key_t mine_key;
static pthread_once_t mine_once = PTHREAD_ONCE_INIT;
static int mine_key_ok;

static void mine_free(void *d)
{
    kvpi_digester_free(d);
}

static void mine_init(void)
{
    mine_key_ok = pthread_key_create(&mine_key, mine_free) == 0;
}

static kvpi_digester *mine(void)
{
    pthread_once(&mine_once, mine_init);
    if (!mine_key_ok) return NULL;
    kvpi_digester *d = pthread_getspecific(mine_key);
    if (!d && (d = kvpi_digester_new()) && pthread_setspecific(mine_key, d) != 0) {
        kvpi_digester_free(d);
        d = NULL;
    }
    return d;
}

kvp_status kvpi_digest_recv(int fd, void *buf, size_t len, uint64_t deadline, uint64_t *digest)
{
    if (len <= KVPI_DIGEST_CHUNK) {
        kvp_status st = kvpi_recv_all_by(fd, buf, len, deadline);
        if (!st) *digest = kvpi_digest(buf, len);
        return st;
    }
    kvpi_digester *d = mine();
    if (!d) return kvpi_error(KVP_ENOMEM, "integrity: out of memory");
    kvpi_digester_reset(d);
    for (size_t off = 0; off < len;) {
        size_t n = len - off < KVPI_DIGEST_CHUNK ? len - off : KVPI_DIGEST_CHUNK;
        kvp_status st = kvpi_recv_all_by(fd, (char *)buf + off, n, deadline);
        if (st) return st;
        kvpi_digester_add(d, (char *)buf + off, n);
        off += n;
    }
    *digest = kvpi_digester_value(d);
    return KVP_OK;
}

kvp_status kvpi_integrity_resolve(int option, int *on)
{
    if (option >= 0) {
        *on = option != 0;
        return KVP_OK;
    }
    const char *v = getenv("KVPIPE_INTEGRITY");
    if (!v || !*v || strcmp(v, "0") == 0) {
        *on = 0;
        return KVP_OK;
    }
    if (strcmp(v, "1") == 0) {
        *on = 1;
        return KVP_OK;
    }
    return kvpi_error(KVP_ECONFIG, "KVPIPE_INTEGRITY=%s: want 1 (on) or 0 (off)", v);
}
