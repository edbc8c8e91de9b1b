/* kvpipe logging: levels, and a handler that takes kvpipe's log lines.
 *
 * By default kvpipe writes each line to stderr, one write(2) per line:
 *
 *   2025-06-01T10:00:00.123456+02:00 WARN kvpipe[4242:4250] pipe: message
 *
 * that is the local time with microseconds and UTC offset, the level, the
 * process and kernel thread ids, the subsystem (the part of kvpipe that
 * speaks: pipe, engine, tcp, shm, p2p, http_server, ...) and the message.
 * A program that embeds kvpipe (vLLM's logger, say) can take the lines itself
 * with kvp_log_set_handler().
 *
 * The level comes from env KVPIPE_LOG, else from Mooncake's MC_LOG_LEVEL,
 * else it is warn; both are read once, at the first log line, in any case:
 *   KVPIPE_LOG    error | warn (or warning) | info | debug (or trace)
 *   MC_LOG_LEVEL  Mooncake's ERROR | WARNING | INFO | TRACE (trace is debug)
 * KVPIPE_LOG wins when both are set; a value that is not a level is reported
 * on one line and ignored. kvp_log_set_level() overrides both at any time.
 *
 * Warnings that a peer can trigger at will (malformed frames, stray ACKs) are
 * rate-limited per kind: the first is logged in full, later ones within the
 * next KVPIPE_LOG_REPEAT_S seconds (default 10; 0: no limit) are counted, and
 * the next one logged after that carries "(repeated N times in the last T s)".
 * See docs/logging.md.
 */
#ifndef KVPIPE_LOG_H
#define KVPIPE_LOG_H

#include <stdint.h>

#include "kvpipe/export.h"
#include "kvpipe/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Lower is more severe; a threshold lets through its level and those below. */
typedef enum kvp_log_level {
    KVP_LOG_ERROR = 0,
    KVP_LOG_WARN = 1,
    KVP_LOG_INFO = 2,
    KVP_LOG_DEBUG = 3,
} kvp_log_level;

/* One log line, as a handler receives it. Every pointer is valid only during
 * the handler call: copy what you keep. */
typedef struct kvp_log_record {
    kvp_log_level level;
    const char *subsystem; /* "pipe", "engine", "tcp", ... */
    const char *message;   /* the text alone, no newline */
    const char *line;      /* the whole line as written to stderr, no newline */
    int64_t time_us;       /* wall clock, microseconds since the Unix epoch */
    long thread_id;        /* kernel thread id (gettid) of the logging thread */
} kvp_log_record;

/* A log handler: user is the pointer given to kvp_log_set_handler(). */
typedef void (*kvp_log_fn)(void *user, const kvp_log_record *record);

/* Send every log line at or above the threshold to fn instead of stderr; fn
 * NULL goes back to stderr.
 *
 * How fn is called:
 *  - from whichever kvpipe thread logs (the caller's thread, the pipe's ACK
 *    thread, the engine's server threads ...), one call at a time: calls are
 *    serialised by a lock, so fn needs no locking of its own;
 *  - possibly while that thread holds kvpipe's internal locks: fn must not
 *    call kvpipe functions other than those of this header, and must not wait
 *    for another thread that may be calling kvpipe (hand the line to a queue
 *    instead, as the Python module does); it should return quickly, since the
 *    logging thread waits for it;
 *  - not re-entered: a line that kvpipe logs while fn runs on the same thread
 *    goes to stderr.
 * When kvp_log_set_handler() returns, the previous handler is not running and
 * is never called again, so its user data may be freed. KVP_EBUSY when called
 * from inside a handler (it would wait for itself). Thread-safe. */
KVP_API kvp_status kvp_log_set_handler(kvp_log_fn fn, void *user);

/* Set the threshold (overrides KVPIPE_LOG and MC_LOG_LEVEL). KVP_EINVAL for a
 * value outside the enum. Thread-safe; takes effect for lines started after
 * it returns. */
KVP_API kvp_status kvp_log_set_level(kvp_log_level level);

/* The current threshold (from the environment until kvp_log_set_level()).
 * Thread-safe. */
KVP_API kvp_log_level kvp_log_get_level(void);

/* The level of a name, in any case: error, warn, warning, info, debug, trace
 * (= debug). KVP_EINVAL, with the allowed names in kvp_last_error(), for
 * anything else. */
KVP_API kvp_status kvp_log_level_parse(const char *name, kvp_log_level *out);

/* "ERROR", "WARN", "INFO" or "DEBUG"; "?" outside the enum. */
KVP_API const char *kvp_log_level_name(kvp_log_level level);

#ifdef __cplusplus
}
#endif
#endif
