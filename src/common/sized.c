#include "common/sized.h"

#include <string.h>

#include "common/error.h"
#include "kvpipe/version.h"

/* No struct of kvpipe's is smaller or anywhere near as large. */
#define SIZED_MIN 4
#define SIZED_MAX (64u * 1024u)

kvp_status kvpi_sized_in(void *dst, size_t known, const void *src, size_t size, const char *what)
{
    if (size < SIZED_MIN || size > SIZED_MAX)
        return kvpi_error(KVP_EINVAL,
                          "%s: size %zu is no kvpipe struct's (this library's is %zu bytes)", what,
                          size, known);
    memcpy(dst, src, size < known ? size : known);
    for (size_t i = known; i < size; i++)
        if (((const unsigned char *)src)[i])
            return kvpi_error(KVP_ENOTSUP,
                              "%s: the program sets a field this library does not have (byte %zu "
                              "of %zu; kvpipe %s knows %zu): it was built against a newer kvpipe",
                              what, i, size, KVP_VERSION_STRING, known);
    return KVP_OK;
}

void kvpi_sized_out(void *dst, size_t size, const void *src, size_t known)
{
    memcpy(dst, src, size < known ? size : known);
    if (size > known) memset((char *)dst + known, 0, size - known);
}
