/* Internal logging to stderr. The level comes from env KVPIPE_LOG
 * (error|warn|info|debug; default warn). */
#ifndef KVPI_COMMON_LOG_H
#define KVPI_COMMON_LOG_H

enum kvpi_log_level { KVPI_LOG_ERROR, KVPI_LOG_WARN, KVPI_LOG_INFO, KVPI_LOG_DEBUG };

int kvpi_log_enabled(enum kvpi_log_level level);
void kvpi_log(enum kvpi_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define KVPI_ERROR(...) kvpi_log(KVPI_LOG_ERROR, __VA_ARGS__)
#define KVPI_WARN(...) kvpi_log(KVPI_LOG_WARN, __VA_ARGS__)
#define KVPI_INFO(...) kvpi_log(KVPI_LOG_INFO, __VA_ARGS__)
#define KVPI_DEBUG(...) kvpi_log(KVPI_LOG_DEBUG, __VA_ARGS__)

#endif
