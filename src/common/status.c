/* Status texts and the thread-local detail of the last failure. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/error.h"

#define TEXT(name, value, text) [name] = text,
static const char *const status_text[] = {KVP_STATUS_LIST(TEXT)};
#undef TEXT

const char *kvp_strerror(kvp_status status)
{
    if ((unsigned)status < sizeof status_text / sizeof status_text[0] && status_text[status])
        return status_text[status];
    return "unknown status";
}

static _Thread_local char last_error[512];

const char *kvp_last_error(void)
{
    return last_error;
}

kvp_status kvpi_error(kvp_status status, const char *fmt, ...)
{
    /* Format aside first: callers may pass kvp_last_error() as an argument to
     * add context to the failure below them. */
    char text[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    memcpy(last_error, text, sizeof last_error);
    return status;
}

kvpi_error_kept kvpi_error_keep(void)
{
    kvpi_error_kept k;
    _Static_assert(sizeof k.text == sizeof last_error, "the kept text holds the whole detail");
    memcpy(k.text, last_error, sizeof k.text);
    return k;
}

void kvpi_error_clear(void)
{
    last_error[0] = '\0';
}
