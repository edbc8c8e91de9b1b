/* Internal: setting the thread-local error detail. */
#ifndef KVPI_COMMON_ERROR_H
#define KVPI_COMMON_ERROR_H

#include "kvpipe/status.h"

/* Record a detail message for kvp_last_error() and return status, so that a
 * failure is described where it is first seen: return kvpi_error(KVP_EIO, ...). */
kvp_status kvpi_error(kvp_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void kvpi_error_clear(void);

#endif
