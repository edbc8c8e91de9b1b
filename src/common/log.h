/* Internal logging: KVPI_WARN(...) and friends write one line through the
 * public machinery of include/kvpipe/log.h (stderr or the embedder's
 * handler), tagged with the subsystem.
 *
 * The subsystem is the base name of the source file without its extension
 * (src/transport/tcp.c logs as "tcp"); a file may name its own by defining
 * KVPI_LOG_SUBSYS "name" before including this header.
 *
 * Warnings a peer can trigger at will (a malformed frame, a stray ACK, a
 * refused request) use KVPI_WARN_LIMITED(...): each call site keeps its own
 * state, logs its first line in full, counts the ones that follow within the
 * repeat window (env KVPIPE_LOG_REPEAT_S, default 10 s) and reports the count
 * on the next line it logs: "... (repeated 9999 times in the last 10 s)". So
 * a flood of garbage costs a line per window per kind, not a line per frame.
 */
#ifndef KVPI_COMMON_LOG_H
#define KVPI_COMMON_LOG_H

#include <stdatomic.h>
#include <stdint.h>

#include "kvpipe/log.h"

#ifndef KVPI_LOG_SUBSYS
#define KVPI_LOG_SUBSYS __FILE__
#endif

/* Whether a line of this level would be written now. */
int kvpi_log_enabled(kvp_log_level level);

/* Log one line. subsys: a name or a path (its base name minus the extension
 * is used). */
void kvpi_log(kvp_log_level level, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Log one line, as it is, whatever the threshold: a line the user asked
 * for by name (MC_TE_METRIC's throughput report), tagged with level as
 * usual. */
void kvpi_log_always(kvp_log_level level, const char *subsys, const char *message);

/* The state of one rate-limited call site. Zero-initialised (static) means
 * "never logged". */
typedef struct kvpi_log_limit {
    _Atomic uint64_t last_ms;    /* 1 + time of the last line logged, 0: none yet */
    _Atomic uint64_t suppressed; /* calls counted, not logged, since then */
} kvpi_log_limit;

/* The decision for one event at now_ms (a monotonic clock) with a window of
 * window_ms: returns 1 when it is to be logged, with *repeated the events
 * suppressed since the last line logged and *since_ms the time since that
 * line (0 for the first); 0 when it was counted instead. window_ms 0 logs
 * every event. Thread-safe (lock-free). */
int kvpi_log_limit_take(kvpi_log_limit *lim, uint64_t now_ms, uint64_t window_ms,
                        uint64_t *repeated, uint64_t *since_ms);

/* The window from KVPIPE_LOG_REPEAT_S, in milliseconds. */
uint64_t kvpi_log_repeat_window_ms(void);

/* Log through lim: see KVPI_WARN_LIMITED. */
void kvpi_log_limited(kvpi_log_limit *lim, kvp_log_level level, const char *subsys, const char *fmt,
                      ...) __attribute__((format(printf, 4, 5)));

#define KVPI_ERROR(...) kvpi_log(KVP_LOG_ERROR, KVPI_LOG_SUBSYS, __VA_ARGS__)
#define KVPI_WARN(...) kvpi_log(KVP_LOG_WARN, KVPI_LOG_SUBSYS, __VA_ARGS__)
#define KVPI_INFO(...) kvpi_log(KVP_LOG_INFO, KVPI_LOG_SUBSYS, __VA_ARGS__)
#define KVPI_DEBUG(...) kvpi_log(KVP_LOG_DEBUG, KVPI_LOG_SUBSYS, __VA_ARGS__)

/* A rate-limited line; the static state belongs to this call site. */
#define KVPI_LOG_LIMITED(level, ...)                                                               \
    do {                                                                                           \
        static kvpi_log_limit kvpi_limit_;                                                         \
        kvpi_log_limited(&kvpi_limit_, (level), KVPI_LOG_SUBSYS, __VA_ARGS__);                     \
    } while (0)
#define KVPI_WARN_LIMITED(...) KVPI_LOG_LIMITED(KVP_LOG_WARN, __VA_ARGS__)

#endif
