#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"

static int log_level = -1;
static pthread_once_t log_once = PTHREAD_ONCE_INIT;

static void log_init(void)
{
    const char *env = getenv("KVPIPE_LOG");
    log_level = KVPI_LOG_WARN;
    if (!env) return;
    static const char *const names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcmp(env, names[i]) == 0) log_level = i;
}

int kvpi_log_enabled(enum kvpi_log_level level)
{
    pthread_once(&log_once, log_init);
    return (int)level <= log_level;
}

void kvpi_log(enum kvpi_log_level level, const char *fmt, ...)
{
    static const char *const tags[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    if (!kvpi_log_enabled(level)) return;
    char line[1024];
    int n = snprintf(line, sizeof line, "kvpipe[%d] %s: ", (int)getpid(), tags[level]);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line) vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* One write per line so that lines of concurrent threads do not interleave. */
    fprintf(stderr, "%s\n", line);
}
