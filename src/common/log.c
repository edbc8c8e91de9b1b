/* Logging: the line format, levels from the environment, the embedder's
 * handler and the per-call-site rate limiter. See include/kvpipe/log.h. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/log.h"
#include "common/util.h"

/* A message longer than this is cut (and ends in "..."). */
#define MESSAGE_MAX 1024
/* Timestamp, level, ids and subsystem in front of the message. */
#define PREFIX_MAX 160
#define SUBSYS_MAX 32
#define DEFAULT_LEVEL KVP_LOG_WARN
#define DEFAULT_REPEAT_S 10
#define MAX_REPEAT_S 86400

static atomic_int threshold = DEFAULT_LEVEL;
static _Atomic uint64_t repeat_window_ms = DEFAULT_REPEAT_S * 1000u;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* What the environment got wrong, reported by the first line after init
 * (init itself cannot log: logging waits for init). */
static char env_note[256];
static atomic_int env_note_pending;

/* The handler; calls are serialised by handler_lock. */
static pthread_mutex_t handler_lock = PTHREAD_MUTEX_INITIALIZER;
static kvp_log_fn handler;
static void *handler_user;
/* Set while this thread runs the handler: its own lines go to stderr. */
static _Thread_local int in_handler;

static const char *const level_names[] = {"ERROR", "WARN", "INFO", "DEBUG"};

const char *kvp_log_level_name(kvp_log_level level)
{
    return (unsigned)level <= KVP_LOG_DEBUG ? level_names[level] : "?";
}

static int level_of(const char *name, kvp_log_level *out)
{
    static const struct {
        const char *name;
        kvp_log_level level;
    } names[] = {
        {"error", KVP_LOG_ERROR}, {"warn", KVP_LOG_WARN},   {"warning", KVP_LOG_WARN},
        {"info", KVP_LOG_INFO},   {"debug", KVP_LOG_DEBUG}, {"trace", KVP_LOG_DEBUG},
    };
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (strcasecmp(name, names[i].name) == 0) {
            *out = names[i].level;
            return 0;
        }
    return -1;
}

kvp_status kvp_log_level_parse(const char *name, kvp_log_level *out)
{
    kvp_log_level l;
    if (!out || level_of(name, &l) != 0)
        return kvpi_error(KVP_EINVAL,
                          "'%s' is not a log level (error, warn, warning, info, debug, trace; any "
                          "case)",
                          name ? name : "(null)");
    *out = l;
    return KVP_OK;
}

/* ------------------------------------------------------------- init --- */

static void note_env(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note_env(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(env_note, sizeof env_note, fmt, ap);
    va_end(ap);
    atomic_store(&env_note_pending, 1);
}

/* KVPIPE_LOG first, then Mooncake's MC_LOG_LEVEL, then the default. */
static kvp_log_level level_from_env(void)
{
    const char *own = getenv("KVPIPE_LOG"), *mc = getenv("MC_LOG_LEVEL");
    kvp_log_level l;
    if (own && *own) {
        if (level_of(own, &l) == 0) return l;
        note_env("KVPIPE_LOG='%.64s' is not a log level (error, warn, info, debug); ignored", own);
    }
    if (mc && *mc) {
        if (level_of(mc, &l) == 0) return l;
        note_env("MC_LOG_LEVEL='%.64s' is not a log level (ERROR, WARNING, INFO, TRACE); ignored",
                 mc);
    }
    return DEFAULT_LEVEL;
}

static void repeat_from_env(void)
{
    const char *s = getenv("KVPIPE_LOG_REPEAT_S");
    long v;
    if (!s || !*s) return;
    if (kvpi_parse_long(s, 0, MAX_REPEAT_S, &v)) {
        note_env("KVPIPE_LOG_REPEAT_S='%.32s' is not a number of seconds in 0..%d; using %d", s,
                 MAX_REPEAT_S, DEFAULT_REPEAT_S);
        return;
    }
    atomic_store(&repeat_window_ms, (uint64_t)v * 1000u);
}

/* A child forked while another thread ran the handler would inherit the lock
 * held for ever; fork waits for the handler call to end instead. */
static void fork_prepare(void)
{
    pthread_mutex_lock(&handler_lock);
}

static void fork_done(void)
{
    pthread_mutex_unlock(&handler_lock);
}

static void log_init(void)
{
    atomic_store(&threshold, level_from_env());
    repeat_from_env();
    pthread_atfork(fork_prepare, fork_done, fork_done);
}

static void ensure_init(void);

kvp_status kvp_log_set_level(kvp_log_level level)
{
    if ((unsigned)level > KVP_LOG_DEBUG)
        return kvpi_error(KVP_EINVAL, "log level %d is outside ERROR (0) .. DEBUG (3)", (int)level);
    pthread_once(&init_once, log_init); /* so that the environment cannot undo it later */
    atomic_store(&threshold, level);
    return KVP_OK;
}

kvp_log_level kvp_log_get_level(void)
{
    ensure_init();
    return (kvp_log_level)atomic_load(&threshold);
}

uint64_t kvpi_log_repeat_window_ms(void)
{
    ensure_init();
    return atomic_load(&repeat_window_ms);
}

kvp_status kvp_log_set_handler(kvp_log_fn fn, void *user)
{
    if (in_handler)
        return kvpi_error(KVP_EBUSY, "kvp_log_set_handler() called from inside a log handler");
    pthread_once(&init_once, log_init);
    pthread_mutex_lock(&handler_lock);
    handler = fn;
    handler_user = fn ? user : NULL;
    pthread_mutex_unlock(&handler_lock);
    return KVP_OK;
}

/* ----------------------------------------------------------- output --- */

/* "pipe" from "/src/pipe/pipe.c" or from "pipe". */
static void subsystem_of(const char *path, char *out, size_t cap)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t n = strcspn(base, ".");
    if (n >= cap) n = cap - 1;
    memcpy(out, base, n);
    out[n] = '\0';
}

/* "2025-06-01T10:00:00.123456+02:00" */
static void format_time(const struct timespec *ts, char *out, size_t cap)
{
    struct tm tm;
    localtime_r(&ts->tv_sec, &tm);
    size_t n = strftime(out, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    int off = (int)(tm.tm_gmtoff / 60);
    char sign = off < 0 ? '-' : '+';
    if (off < 0) off = -off;
    snprintf(out + n, cap - n, ".%06d%c%02d:%02d", (int)(ts->tv_nsec / 1000) % 1000000, sign,
             off / 60 % 100, off % 60);
}

static void write_all(const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(STDERR_FILENO, buf, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        buf += n;
        len -= (size_t)n;
    }
}

static void emit(kvp_log_level level, const char *subsys_path, const char *message)
{
    char subsys[SUBSYS_MAX], stamp[48];
    subsystem_of(subsys_path, subsys, sizeof subsys);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    format_time(&ts, stamp, sizeof stamp);
    long tid = (long)gettid();
    /* Room for the newline that stderr gets. */
    char line[PREFIX_MAX + MESSAGE_MAX + 2];
    int n = snprintf(line, sizeof line - 1, "%s %s kvpipe[%d:%ld] %s: %s", stamp,
                     kvp_log_level_name(level), (int)getpid(), tid, subsys, message);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof line - 1 ? (size_t)n : sizeof line - 2;
    kvp_log_record rec = {
        .level = level,
        .subsystem = subsys,
        .message = message,
        .line = line,
        .time_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000,
        .thread_id = tid,
    };
    if (!in_handler) {
        pthread_mutex_lock(&handler_lock);
        if (handler) {
            in_handler = 1;
            handler(handler_user, &rec);
            in_handler = 0;
            pthread_mutex_unlock(&handler_lock);
            return;
        }
        pthread_mutex_unlock(&handler_lock);
    }
    /* One write per line, so that lines of threads and processes sharing
     * stderr do not interleave. */
    line[len] = '\n';
    write_all(line, len + 1);
}

static void ensure_init(void)
{
    pthread_once(&init_once, log_init);
    if (atomic_exchange(&env_note_pending, 0) && atomic_load(&threshold) >= KVP_LOG_WARN)
        emit(KVP_LOG_WARN, "log", env_note);
}

int kvpi_log_enabled(kvp_log_level level)
{
    ensure_init();
    return (int)level <= atomic_load(&threshold);
}

/* Format into buf (MESSAGE_MAX bytes); a cut message ends in "...". */
static void format_message(char *buf, const char *fmt, va_list ap)
{
    int n = vsnprintf(buf, MESSAGE_MAX, fmt, ap);
    if (n >= MESSAGE_MAX) memcpy(buf + MESSAGE_MAX - 4, "...", 4);
}

void kvpi_log(kvp_log_level level, const char *subsys, const char *fmt, ...)
{
    if (!kvpi_log_enabled(level)) return;
    char msg[MESSAGE_MAX];
    va_list ap;
    va_start(ap, fmt);
    format_message(msg, fmt, ap);
    va_end(ap);
    emit(level, subsys, msg);
}

void kvpi_log_always(kvp_log_level level, const char *subsys, const char *message)
{
    ensure_init();
    emit(level, subsys, message);
}

/* ------------------------------------------------------ rate limits --- */

int kvpi_log_limit_take(kvpi_log_limit *lim, uint64_t now_ms, uint64_t window_ms,
                        uint64_t *repeated, uint64_t *since_ms)
{
    uint64_t last = atomic_load(&lim->last_ms);
    /* last is 1 + the time of the line logged; "now + 1 < last + window"
     * cannot underflow when another thread stored a slightly later time. */
    if (window_ms > 0 && last != 0 && now_ms + 1 < last + window_ms) {
        atomic_fetch_add(&lim->suppressed, 1);
        return 0;
    }
    /* Of the threads that found the window over, one logs. */
    if (!atomic_compare_exchange_strong(&lim->last_ms, &last, now_ms + 1)) {
        atomic_fetch_add(&lim->suppressed, 1);
        return 0;
    }
    *repeated = atomic_exchange(&lim->suppressed, 0);
    *since_ms = last != 0 && now_ms + 1 > last ? now_ms + 1 - last : 0;
    return 1;
}

void kvpi_log_limited(kvpi_log_limit *lim, kvp_log_level level, const char *subsys, const char *fmt,
                      ...)
{
    if (!kvpi_log_enabled(level)) return;
    uint64_t repeated, since_ms;
    if (!kvpi_log_limit_take(lim, kvpi_now_ms(), kvpi_log_repeat_window_ms(), &repeated, &since_ms))
        return;
    char msg[MESSAGE_MAX];
    va_list ap;
    va_start(ap, fmt);
    format_message(msg, fmt, ap);
    va_end(ap);
    if (repeated > 0) {
        /* Appended after the message, cutting it if need be: the count is the
         * news. */
        char tail[96];
        int t =
            snprintf(tail, sizeof tail, " (repeated %llu times in the last %llu s)",
                     (unsigned long long)repeated, (unsigned long long)((since_ms + 500) / 1000));
        size_t len = strlen(msg);
        if (len + (size_t)t >= MESSAGE_MAX) len = MESSAGE_MAX - 1 - (size_t)t;
        memcpy(msg + len, tail, (size_t)t + 1);
    }
    emit(level, subsys, msg);
}
