/* Internal: setting the thread-local error detail. */
#ifndef KVPI_COMMON_ERROR_H
#define KVPI_COMMON_ERROR_H

#include "kvpipe/status.h"

/* Record a detail message for kvp_last_error() and return status, so that a
 * failure is described where it is first seen: return kvpi_error(KVP_EIO, ...).
 * It formats aside first, so the failure below may be passed as an argument
 * to add context: kvpi_error(st, "peer %s: %s", name, kvp_last_error()). */
kvp_status kvpi_error(kvp_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void kvpi_error_clear(void);

/* The current detail, kept across calls that may overwrite it (undoing a
 * failed step): kvpi_error_kept why = kvpi_error_keep(); undo(); return
 * kvpi_error(st, "...: %s", why.text). */
typedef struct kvpi_error_kept {
    char text[512];
} kvpi_error_kept;
kvpi_error_kept kvpi_error_keep(void);

#endif
