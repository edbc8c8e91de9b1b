/* The ops tables of the metadata stores a build leaves out (CMake
 * KVP_WITH_HTTP, KVP_WITH_ETCD, KVP_WITH_REDIS set OFF or their library not
 * found). Each still claims its connection strings, so that the engine answers
 * them with KVP_ENOTSUP naming the option that builds the store in, not with
 * "unknown connection string" or by sending them to another store (a bare
 * h:p is etcd's). Only open() is ever called: it always fails. */
#include <string.h>
#include <strings.h>

#include "common/error.h"
#include "metadata/metadata.h"

static kvp_status absent_get(void *store, const char *key, char **value)
{
    (void)store, (void)key, (void)value;
    return kvpi_error(KVP_ENOTSUP, "metadata store not built in");
}

static kvp_status absent_put(void *store, const char *key, const char *value)
{
    (void)store, (void)key, (void)value;
    return kvpi_error(KVP_ENOTSUP, "metadata store not built in");
}

static kvp_status absent_del(void *store, const char *key)
{
    (void)store, (void)key;
    return kvpi_error(KVP_ENOTSUP, "metadata store not built in");
}

static void absent_close(void *store)
{
    (void)store;
}

/* The connection string is not repeated: it may hold a password. */
static kvp_status not_built_in(const char *name, const char *option, const char *lib)
{
    return kvpi_error(KVP_ENOTSUP,
                      "the %s metadata store is not built in: reconfigure kvpipe with -D%s=ON "
                      "(needs %s)",
                      name, option, lib);
}

#define ABSENT_STORE(NAME, OPTION, LIB)                                                            \
    static kvp_status NAME##_open(const char *conn, int timeout_ms, void **store)                  \
    {                                                                                              \
        (void)conn, (void)timeout_ms, (void)store;                                                 \
        return not_built_in(#NAME, OPTION, LIB);                                                   \
    }                                                                                              \
    const kvpi_store_ops kvpi_store_##NAME = {                                                     \
        .name = #NAME,                                                                             \
        .accepts = NAME##_accepts,                                                                 \
        .open = NAME##_open,                                                                       \
        .get = absent_get,                                                                         \
        .put = absent_put,                                                                         \
        .del = absent_del,                                                                         \
        .close = absent_close,                                                                     \
    }

/* The same strings the real stores accept (http.c, etcd.c, redis.c). */
#if !KVP_HAVE_HTTP
static int http_accepts(const char *conn)
{
    return strncasecmp(conn, "http://", 7) == 0 || strncasecmp(conn, "https://", 8) == 0;
}
ABSENT_STORE(http, "KVP_WITH_HTTP", "libcurl");
#endif

#if !KVP_HAVE_ETCD
static int etcd_accepts(const char *conn)
{
    if (strncasecmp(conn, "etcd://", 7) == 0) return 1;
    return *conn && !strstr(conn, "://") && strcmp(conn, KVPI_P2P_CONN) != 0;
}
ABSENT_STORE(etcd, "KVP_WITH_ETCD", "libcurl");
#endif

#if !KVP_HAVE_REDIS
static int redis_accepts(const char *conn)
{
    return strncasecmp(conn, "redis://", 8) == 0;
}
ABSENT_STORE(redis, "KVP_WITH_REDIS", "hiredis");
#endif
