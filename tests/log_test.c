/* Logging: the line format on stderr, levels from KVPIPE_LOG and Mooncake's
 * MC_LOG_LEVEL, the public handler (serialised, not re-entered, replaced
 * safely) and the per-call-site rate limiter. Each case runs in a fresh
 * child, so the environment it sets is read at its first log line. */
#include <fcntl.h>
#include <pthread.h>
#include <regex.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "test.h"

/* ------------------------------------------------- stderr capture --- */

typedef struct capture {
    char path[64];
    int saved;
} capture;

static void capture_start(capture *c)
{
    snprintf(c->path, sizeof c->path, "/tmp/kvpt_log_%d_XXXXXX", (int)getpid());
    int fd = mkstemp(c->path);
    c->saved = dup(STDERR_FILENO);
    dup2(fd, STDERR_FILENO);
    close(fd);
}

/* Stop capturing; returns what was written (malloc'ed). */
static char *capture_end(capture *c)
{
    dup2(c->saved, STDERR_FILENO);
    close(c->saved);
    FILE *f = fopen(c->path, "r");
    static char empty[] = "";
    char *buf = calloc(1, 1 << 16);
    if (!f || !buf) return buf ? buf : empty;
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = '\0';
    fclose(f);
    unlink(c->path);
    return buf;
}

static int count_of(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

static int matches(const char *text, const char *pattern)
{
    regex_t re;
    if (regcomp(&re, pattern, REG_EXTENDED | REG_NEWLINE | REG_NOSUB) != 0) return 0;
    int ok = regexec(&re, text, 0, NULL, 0) == 0;
    regfree(&re);
    return ok;
}

/* ---------------------------------------------------------- format --- */

static void test_line_format(void)
{
    capture c;
    capture_start(&c);
    KVPI_WARN("hello %d", 42);
    kvpi_log(KVP_LOG_ERROR, "/somewhere/src/transport/tcp.c", "from %s", "tcp");
    char *out = capture_end(&c);
    char pattern[256];
    snprintf(
        pattern, sizeof pattern,
        "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6}[+-][0-9]{2}:[0-9]{2} "
        "WARN kvpipe\\[%d:%d\\] log_test: hello 42$",
        (int)getpid(), (int)gettid());
    if (!matches(out, pattern)) fprintf(stderr, "  got: %s", out);
    CHECK(matches(out, pattern));
    CHECK(matches(out, "^[^ ]+ ERROR kvpipe\\[[0-9]+:[0-9]+\\] tcp: from tcp$"));
    CHECK(count_of(out, "\n") == 2);
    free(out);
}

static void test_long_message_is_cut(void)
{
    char big[3000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    capture c;
    capture_start(&c);
    KVPI_WARN("%s", big);
    char *out = capture_end(&c);
    CHECK(count_of(out, "\n") == 1);
    CHECK(strstr(out, "xxx...\n") != NULL);
    CHECK(strlen(out) < 1300);
    free(out);
}

/* ---------------------------------------------------------- levels --- */

/* The level a fresh process gets from this environment; note gets what it
 * wrote to stderr (its report of a bad value). */
static int level_with(const char *kvpipe_log, const char *mc_log_level, char *note, size_t cap)
{
    int fds[2];
    if (pipe(fds) != 0) return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], STDERR_FILENO);
        if (kvpipe_log)
            setenv("KVPIPE_LOG", kvpipe_log, 1);
        else
            unsetenv("KVPIPE_LOG");
        if (mc_log_level)
            setenv("MC_LOG_LEVEL", mc_log_level, 1);
        else
            unsetenv("MC_LOG_LEVEL");
        /* The first log call reads the environment and reports bad values. */
        kvpi_log_enabled(KVP_LOG_ERROR);
        _exit((int)kvp_log_get_level());
    }
    close(fds[1]);
    ssize_t n = read(fds[0], note, cap - 1);
    note[n > 0 ? n : 0] = '\0';
    close(fds[0]);
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_levels_from_env(void)
{
    static const struct {
        const char *own, *mc;
        int want, note;
    } cases[] = {
        {NULL, NULL, KVP_LOG_WARN, 0},
        {"DEBUG", NULL, KVP_LOG_DEBUG, 0}, /* upper case works */
        {"Info", NULL, KVP_LOG_INFO, 0},
        {"warning", NULL, KVP_LOG_WARN, 0},
        {"error", NULL, KVP_LOG_ERROR, 0},
        {"trace", NULL, KVP_LOG_DEBUG, 0},
        {NULL, "TRACE", KVP_LOG_DEBUG, 0}, /* Mooncake's values */
        {NULL, "INFO", KVP_LOG_INFO, 0},
        {NULL, "WARNING", KVP_LOG_WARN, 0},
        {NULL, "ERROR", KVP_LOG_ERROR, 0},
        {"error", "TRACE", KVP_LOG_ERROR, 0}, /* KVPIPE_LOG wins */
        {"", "INFO", KVP_LOG_INFO, 0},        /* empty counts as unset */
        {"loud", "INFO", KVP_LOG_INFO, 1},    /* a bad KVPIPE_LOG is reported and skipped */
        {NULL, "verbose", KVP_LOG_WARN, 1},
        {"loud", NULL, KVP_LOG_WARN, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[1024];
        int got = level_with(cases[i].own, cases[i].mc, text, sizeof text);
        int note = strstr(text, "is not a log level") != NULL;
        if (got != cases[i].want || note != cases[i].note)
            fprintf(stderr, "  KVPIPE_LOG=%s MC_LOG_LEVEL=%s: level %d note %d, want %d %d\n",
                    cases[i].own ? cases[i].own : "(unset)", cases[i].mc ? cases[i].mc : "(unset)",
                    got, note, cases[i].want, cases[i].note);
        CHECK(got == cases[i].want && note == cases[i].note);
    }
}

static void test_set_level_overrides_env(void)
{
    setenv("KVPIPE_LOG", "debug", 1);
    CHECK_OK(kvp_log_set_level(KVP_LOG_ERROR));
    CHECK(kvp_log_get_level() == KVP_LOG_ERROR);
    CHECK(!kvpi_log_enabled(KVP_LOG_WARN)); /* the environment does not come back */
    CHECK(kvpi_log_enabled(KVP_LOG_ERROR));
    CHECK_ST(kvp_log_set_level((kvp_log_level)4), KVP_EINVAL);
    CHECK_ST(kvp_log_set_level((kvp_log_level)-1), KVP_EINVAL);
    CHECK(kvp_log_get_level() == KVP_LOG_ERROR);
}

static void test_level_names(void)
{
    kvp_log_level l = KVP_LOG_ERROR;
    CHECK_OK(kvp_log_level_parse("DEBUG", &l));
    CHECK(l == KVP_LOG_DEBUG);
    CHECK_OK(kvp_log_level_parse("Warning", &l));
    CHECK(l == KVP_LOG_WARN);
    CHECK_ST(kvp_log_level_parse("loud", &l), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "loud") && strstr(kvp_last_error(), "debug"));
    CHECK(l == KVP_LOG_WARN); /* unchanged on error */
    CHECK_ST(kvp_log_level_parse(NULL, &l), KVP_EINVAL);
    CHECK(strcmp(kvp_log_level_name(KVP_LOG_INFO), "INFO") == 0);
    CHECK(strcmp(kvp_log_level_name((kvp_log_level)9), "?") == 0);
}

/* --------------------------------------------------------- handler --- */

typedef struct sink {
    atomic_int calls, inside, overlap;
    kvp_log_record last;
    char last_line[2048], last_message[1100], last_subsystem[32];
    long tids[8];
    atomic_int ntids;
    kvp_status nested_set; /* what kvp_log_set_handler() said from inside */
    int log_inside;        /* log a line from inside the handler */
} sink;

static void remember_tid(sink *s, long tid)
{
    int n = atomic_load(&s->ntids);
    for (int i = 0; i < n; i++)
        if (s->tids[i] == tid) return;
    if (n < 8) s->tids[atomic_fetch_add(&s->ntids, 1)] = tid;
}

static void sink_fn(void *user, const kvp_log_record *r)
{
    sink *s = user;
    if (atomic_fetch_add(&s->inside, 1) != 0) atomic_fetch_add(&s->overlap, 1);
    atomic_fetch_add(&s->calls, 1);
    s->last = *r;
    snprintf(s->last_line, sizeof s->last_line, "%s", r->line);
    snprintf(s->last_message, sizeof s->last_message, "%s", r->message);
    snprintf(s->last_subsystem, sizeof s->last_subsystem, "%s", r->subsystem);
    remember_tid(s, r->thread_id);
    if (s->log_inside) {
        s->nested_set = kvp_log_set_handler(NULL, NULL);
        KVPI_WARN("logged from inside the handler");
    }
    usleep(50); /* widen the window in which two calls could overlap */
    atomic_fetch_sub(&s->inside, 1);
}

static void *log_lines(void *arg)
{
    (void)arg;
    for (int i = 0; i < 200; i++)
        KVPI_WARN("line %d", i);
    return NULL;
}

static void test_handler_gets_every_line_one_at_a_time(void)
{
    static sink s;
    CHECK_OK(kvp_log_set_handler(sink_fn, &s));
    capture c;
    capture_start(&c);
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        REQUIRE(pthread_create(&th[i], NULL, log_lines, NULL) == 0);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    KVPI_INFO("below the threshold"); /* default warn */
    char *out = capture_end(&c);
    CHECK(atomic_load(&s.calls) == 800);
    CHECK(atomic_load(&s.overlap) == 0);
    CHECK(atomic_load(&s.ntids) == 4);
    CHECK(out[0] == '\0'); /* nothing went to stderr */
    free(out);
    CHECK(s.last.level == KVP_LOG_WARN);
    CHECK(strcmp(s.last_subsystem, "log_test") == 0);
    CHECK(strncmp(s.last_message, "line ", 5) == 0);
    /* The line is the stderr line: it ends with the message. */
    size_t ll = strlen(s.last_line), ml = strlen(s.last_message);
    CHECK(ll > ml && strcmp(s.last_line + ll - ml, s.last_message) == 0);
    CHECK(strstr(s.last_line, " WARN kvpipe[") != NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t now_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    CHECK(s.last.time_us <= now_us && now_us - s.last.time_us < 60 * 1000000LL);

    /* NULL: back to stderr. */
    CHECK_OK(kvp_log_set_handler(NULL, NULL));
    capture_start(&c);
    KVPI_WARN("to stderr again");
    out = capture_end(&c);
    CHECK(strstr(out, "log_test: to stderr again\n") != NULL);
    CHECK(atomic_load(&s.calls) == 800);
    free(out);
}

static void test_handler_not_reentered(void)
{
    static sink s;
    s.log_inside = 1;
    CHECK_OK(kvp_log_set_handler(sink_fn, &s));
    capture c;
    capture_start(&c);
    KVPI_WARN("outer");
    char *out = capture_end(&c);
    /* The inner line went to stderr, not back into the handler, and setting a
     * handler from inside one is refused. */
    CHECK(atomic_load(&s.calls) == 1);
    CHECK(strcmp(s.last_message, "outer") == 0);
    CHECK(strstr(out, "logged from inside the handler") != NULL);
    CHECK(s.nested_set == KVP_EBUSY);
    free(out);
    CHECK_OK(kvp_log_set_handler(NULL, NULL));
}

static atomic_int keep_logging;

static void *log_until_told(void *arg)
{
    (void)arg;
    while (atomic_load(&keep_logging))
        KVPI_WARN("busy");
    return NULL;
}

/* Once kvp_log_set_handler() returns, the old handler never runs again. */
static void test_replaced_handler_never_called_again(void)
{
    static sink a, b;
    CHECK_OK(kvp_log_set_handler(sink_fn, &a));
    atomic_store(&keep_logging, 1);
    pthread_t th[3];
    for (int i = 0; i < 3; i++)
        REQUIRE(pthread_create(&th[i], NULL, log_until_told, NULL) == 0);
    while (atomic_load(&a.calls) < 100)
        usleep(1000);
    CHECK_OK(kvp_log_set_handler(sink_fn, &b));
    int after = atomic_load(&a.calls);
    CHECK(atomic_load(&a.inside) == 0);
    while (atomic_load(&b.calls) < 100)
        usleep(1000);
    atomic_store(&keep_logging, 0);
    for (int i = 0; i < 3; i++)
        pthread_join(th[i], NULL);
    CHECK(atomic_load(&a.calls) == after);
    CHECK_OK(kvp_log_set_handler(NULL, NULL));
}

/* ----------------------------------------------------- rate limits --- */

static void test_rate_limit_decisions(void)
{
    kvpi_log_limit lim = {0};
    uint64_t rep = 99, since = 99;
    CHECK(kvpi_log_limit_take(&lim, 0, 10000, &rep, &since) == 1);
    CHECK(rep == 0 && since == 0);
    for (uint64_t t = 1; t <= 1000; t++)
        CHECK(kvpi_log_limit_take(&lim, t, 10000, &rep, &since) == 0);
    CHECK(kvpi_log_limit_take(&lim, 9999, 10000, &rep, &since) == 0);
    CHECK(kvpi_log_limit_take(&lim, 10000, 10000, &rep, &since) == 1);
    CHECK(rep == 1001 && since == 10000);
    CHECK(kvpi_log_limit_take(&lim, 10001, 10000, &rep, &since) == 0);
    /* A quiet spell: the count comes with the next line, whenever that is. */
    CHECK(kvpi_log_limit_take(&lim, 3600000, 10000, &rep, &since) == 1);
    CHECK(rep == 1 && since == 3590000);
    /* A time a little before the last line (another thread's clock read). */
    CHECK(kvpi_log_limit_take(&lim, 3599990, 10000, &rep, &since) == 0);
    /* Window 0: every event is logged. */
    kvpi_log_limit all = {0};
    for (uint64_t t = 0; t < 5; t++) {
        CHECK(kvpi_log_limit_take(&all, 7, 0, &rep, &since) == 1);
        CHECK(rep == 0);
    }
}

typedef struct racer {
    kvpi_log_limit *lim;
    atomic_int logged;
} racer;

static void *race(void *arg)
{
    racer *r = arg;
    uint64_t rep, since;
    for (int i = 0; i < 100000; i++)
        if (kvpi_log_limit_take(r->lim, 500, 10000, &rep, &since)) atomic_fetch_add(&r->logged, 1);
    return NULL;
}

static void test_rate_limit_threads(void)
{
    kvpi_log_limit lim = {0};
    racer r = {.lim = &lim};
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        REQUIRE(pthread_create(&th[i], NULL, race, &r) == 0);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    CHECK(atomic_load(&r.logged) == 1);
    uint64_t rep, since;
    CHECK(kvpi_log_limit_take(&lim, 20000, 10000, &rep, &since) == 1);
    CHECK(rep == 4 * 100000 - 1);
}

static void flood_site(int n)
{
    for (int i = 0; i < n; i++)
        KVPI_WARN_LIMITED("flood %d", i);
}

static void other_site(void)
{
    KVPI_WARN_LIMITED("another kind");
}

/* Through the macro and the real clock, with a 2 s window. */
static void test_rate_limited_lines(void)
{
    setenv("KVPIPE_LOG_REPEAT_S", "2", 1);
    capture c;
    capture_start(&c);
    flood_site(1000);
    other_site(); /* its own state: logged at once */
    usleep(2500 * 1000);
    flood_site(1);
    char *out = capture_end(&c);
    if (count_of(out, "\n") != 3) fprintf(stderr, "  got:\n%s", out);
    CHECK(count_of(out, "\n") == 3);
    CHECK(matches(out, "log_test: flood 0$"));
    CHECK(matches(out, "log_test: another kind$"));
    CHECK(matches(out, "log_test: flood 0 \\(repeated 999 times in the last [23] s\\)$"));
    free(out);
}

static void test_repeat_window_zero(void)
{
    setenv("KVPIPE_LOG_REPEAT_S", "0", 1);
    capture c;
    capture_start(&c);
    flood_site(5);
    char *out = capture_end(&c);
    CHECK(count_of(out, "log_test: flood") == 5);
    CHECK(kvpi_log_repeat_window_ms() == 0);
    free(out);
}

static void test_bad_repeat_window(void)
{
    char note[1024];
    setenv("KVPIPE_LOG_REPEAT_S", "ten", 1);
    CHECK(level_with(NULL, NULL, note, sizeof note) == KVP_LOG_WARN);
    CHECK(strstr(note, "KVPIPE_LOG_REPEAT_S='ten'") != NULL);
}

int main(void)
{
    RUN(test_line_format);
    RUN(test_long_message_is_cut);
    RUN(test_levels_from_env);
    RUN(test_set_level_overrides_env);
    RUN(test_level_names);
    RUN(test_handler_gets_every_line_one_at_a_time);
    RUN(test_handler_not_reentered);
    RUN(test_replaced_handler_never_called_again);
    RUN(test_rate_limit_decisions);
    RUN(test_rate_limit_threads);
    RUN(test_rate_limited_lines);
    RUN(test_repeat_window_zero);
    RUN(test_bad_repeat_window);
    return kvpt_summary();
}
