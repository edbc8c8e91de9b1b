/* Options of the kvpipe CLI from one table per command (cli_opts.h). */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cli.h"
#include "cli_opts.h"

#define MAX_SPELLINGS 256
#define NAME_MAX_LEN 64
#define VAL_BASE 1000

const char *cli_cmd = "";

void cli_error(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "kvpipe%s%s: %s\n", *cli_cmd ? " " : "", cli_cmd, line);
}

const char *cli_opt_name(const cli_spec *spec, int id)
{
    for (size_t i = 0; i < spec->n_opts; i++)
        if (spec->opts[i].id == id) return spec->opts[i].name;
    return "?";
}

/* ---- the spellings getopt sees ---- */

typedef struct spellings {
    struct option opts[MAX_SPELLINGS + 2];
    char names[MAX_SPELLINGS][NAME_MAX_LEN];
    size_t n;
} spellings;

static void add_spelling(spellings *s, const char *name, size_t len, const cli_opt *o, int index)
{
    if (s->n == MAX_SPELLINGS || len == 0 || len >= NAME_MAX_LEN) return;
    for (size_t i = 0; i < s->n; i++)
        if (strlen(s->names[i]) == len && !memcmp(s->names[i], name, len)) return;
    memcpy(s->names[s->n], name, len);
    s->names[s->n][len] = '\0';
    s->opts[s->n] = (struct option){s->names[s->n],
                                    o->arg == CLI_ARG_FLAG ? optional_argument : required_argument,
                                    NULL, VAL_BASE + index};
    s->n++;
}

/* The canonical name, its underscore form, and the aliases. */
static void build_spellings(const cli_spec *spec, spellings *s)
{
    s->n = 0;
    for (size_t i = 0; i < spec->n_opts; i++) {
        const cli_opt *o = &spec->opts[i];
        add_spelling(s, o->name, strlen(o->name), o, (int)i);
        char under[NAME_MAX_LEN];
        snprintf(under, sizeof under, "%s", o->name);
        for (char *c = under; *c; c++)
            if (*c == '-') *c = '_';
        add_spelling(s, under, strlen(under), o, (int)i);
        for (const char *a = o->aliases; a && *a;) {
            size_t len = strcspn(a, " ");
            add_spelling(s, a, len, o, (int)i);
            a += len;
            a += strspn(a, " ");
        }
    }
    s->opts[s->n++] = (struct option){"help", no_argument, NULL, 'h'};
    s->opts[s->n] = (struct option){0, 0, 0, 0};
}

/* ---- values ---- */

static const char *parse_flag(const char *text, cli_value *v)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    if (!text) return v->i = 1, NULL;
    for (size_t i = 0; i < 4; i++) {
        if (!strcasecmp(text, yes[i])) return v->i = 1, NULL;
        if (!strcasecmp(text, no[i])) return v->i = 0, NULL;
    }
    return "no value, or true or false";
}

static void describe_range(char *buf, size_t cap, const char *what, long long lo, long long hi)
{
    if (hi == LLONG_MAX)
        snprintf(buf, cap, "%s of at least %lld", what, lo);
    else
        snprintf(buf, cap, "%s in %lld..%lld", what, lo, hi);
}

static const char *parse_value(const cli_opt *o, const char *text, cli_value *v, char *buf,
                               size_t cap);

/* A list: each item a value of the single kind. */
static const char *parse_list(const cli_opt *o, const char *text, cli_value *v, char *buf,
                              size_t cap)
{
    cli_opt one = *o;
    one.arg = o->arg == CLI_ARG_INTS ? CLI_ARG_INT : CLI_ARG_SIZE;
    v->n_list = 0;
    const char *c = text;
    do {
        char item[64];
        size_t len = strcspn(c, ",");
        cli_value iv;
        const char *what = NULL;
        if (len >= sizeof item || v->n_list == CLI_LIST_MAX) {
            what = "";
        } else {
            memcpy(item, c, len);
            item[len] = '\0';
            what = parse_value(&one, item, &iv, buf, cap);
        }
        if (what) {
            char single[160];
            snprintf(single, sizeof single, "%s", what[0] ? what : "a shorter list");
            snprintf(buf, cap, "%.100s, or a comma-separated list of at most %d of them", single,
                     CLI_LIST_MAX);
            return buf;
        }
        v->list[v->n_list++] = one.arg == CLI_ARG_INT ? (size_t)iv.i : iv.size;
        c += len;
    } while (*c++ == ',');
    v->i = (long long)v->list[0];
    v->size = v->list[0];
    return NULL;
}

/* NULL when text is a good value of o (then *v holds it), else what is
 * expected, written into buf. */
static const char *parse_value(const cli_opt *o, const char *text, cli_value *v, char *buf,
                               size_t cap)
{
    v->text = text;
    char *end;
    switch (o->arg) {
    case CLI_ARG_FLAG:
        return parse_flag(text, v);
    case CLI_ARG_STRING:
        return text && *text ? NULL : "a non-empty value";
    case CLI_ARG_INT:
        errno = 0;
        v->i = strtoll(text, &end, 10);
        if (*text && !*end && !errno && v->i >= o->lo && v->i <= o->hi) return NULL;
        describe_range(buf, cap, "an integer", o->lo, o->hi);
        return buf;
    case CLI_ARG_SIZE:
        if (cli_parse_size(text, &v->size) == 0 && v->size >= (size_t)o->lo &&
            (o->hi == LLONG_MAX || v->size <= (size_t)o->hi))
            return NULL;
        describe_range(buf, cap, "a byte count (K, M, G suffixes: powers of 1024)", o->lo, o->hi);
        return buf;
    case CLI_ARG_SECONDS:
        errno = 0;
        v->seconds = strtod(text, &end);
        if (*text && !*end && !errno && v->seconds > 0 && (!o->hi || v->seconds <= (double)o->hi))
            return NULL;
        if (o->hi)
            snprintf(buf, cap, "seconds, a number above 0 and at most %lld", o->hi);
        else
            snprintf(buf, cap, "seconds, a number above 0");
        return buf;
    case CLI_ARG_INTS:
    case CLI_ARG_SIZES:
        return parse_list(o, text, v, buf, cap);
    case CLI_ARG_CHOICE: {
        long long k = 0;
        for (const char *c = o->choices; *c; k++) {
            size_t len = strcspn(c, "|");
            if (strlen(text) == len && !memcmp(c, text, len)) return v->i = k, NULL;
            c += len;
            if (*c) c++;
        }
        size_t used = (size_t)snprintf(buf, cap, "one of ");
        for (const char *c = o->choices; *c && used + 3 < cap; c++) {
            if (*c == '|') buf[used++] = ',';
            buf[used++] = *c == '|' ? ' ' : *c;
        }
        buf[used] = '\0';
        return buf;
    }
    }
    return "a value";
}

/* Where CLI_TO says. */
static void store(void *o, const cli_opt *opt, const cli_value *v)
{
    char *at = (char *)o + opt->to;
    long long n = opt->arg == CLI_ARG_SIZE ? (long long)v->size : v->i;
    switch (opt->to_type) {
    case CLI_NOWHERE:
        break;
    case CLI_TEXT:
        *(const char **)at = v->text;
        break;
    case CLI_INT:
        *(int *)at = (int)n;
        break;
    case CLI_UNSIGNED:
        *(unsigned *)at = (unsigned)n;
        break;
    case CLI_LONG:
        *(long *)at = (long)n;
        break;
    case CLI_SIZE_T:
        *(size_t *)at = (size_t)n;
        break;
    case CLI_ULLONG:
        *(unsigned long long *)at = (unsigned long long)n;
        break;
    case CLI_DOUBLE:
        *(double *)at = v->seconds;
        break;
    }
}

/* The option as the user typed it, without =value. */
static void typed(const char *arg, char *out, size_t cap)
{
    size_t len = strcspn(arg, "=");
    snprintf(out, cap, "%.*s", (int)len, arg);
}

int cli_parse(const cli_spec *spec, int argc, char **argv, int operands, cli_set_fn set, void *o)
{
    static spellings s;
    cli_cmd = spec->cmd;
    build_spellings(spec, &s);
    optind = 1;
    opterr = 0;
    int c, longindex;
    while ((c = getopt_long_only(argc, argv, ":h", s.opts, &longindex)) != -1) {
        char name[NAME_MAX_LEN + 8];
        if (c == 'h') {
            cli_usage(spec, stdout);
            return 1;
        }
        if (c == '?') {
            typed(argv[optind - 1], name, sizeof name);
            cli_error("unknown option '%s' (kvpipe help %s lists them)", name, spec->cmd);
            return 3;
        }
        if (c == ':') {
            const cli_opt *opt = optopt >= VAL_BASE ? &spec->opts[optopt - VAL_BASE] : NULL;
            char buf[256];
            cli_value v;
            const char *what = opt ? parse_value(opt, "", &v, buf, sizeof buf) : "a value";
            cli_error("--%s needs a value: %s", opt ? opt->name : "?", what ? what : "a value");
            return 3;
        }
        const cli_opt *opt = &spec->opts[c - VAL_BASE];
        cli_value v = {0};
        char buf[256];
        const char *what = parse_value(opt, optarg, &v, buf, sizeof buf);
        if (!what && set) what = set(o, opt, &v);
        if (!what) store(o, opt, &v);
        if (what) {
            if (optarg)
                cli_error("--%s: invalid value '%s': expected %s", opt->name, optarg, what);
            else
                cli_error("--%s: %s", opt->name, what);
            return 3;
        }
    }
    if (!operands && optind < argc) {
        cli_error("unexpected argument '%s' (kvpipe help %s)", argv[optind], spec->cmd);
        return 3;
    }
    return 0;
}

/* ---- --help ---- */

static void put_help(FILE *out, const char *help, int col)
{
    const char *line = help;
    int first = 1;
    while (*line) {
        size_t len = strcspn(line, "\n");
        fprintf(out, "%*s%.*s\n", first ? 0 : col, "", (int)len, line);
        first = 0;
        line += len;
        if (*line) line++;
    }
}

void cli_usage(const cli_spec *spec, FILE *out)
{
    enum { COL = 28 };
    fputs(spec->synopsis, out);
    if (spec->about) fprintf(out, "\n%s", spec->about);
    fprintf(out, "\nOptions:\n");
    for (size_t i = 0; i < spec->n_opts; i++) {
        const cli_opt *o = &spec->opts[i];
        if (!o->help) continue;
        char head[96];
        int n = snprintf(head, sizeof head, "  --%s%s%s", o->name, o->meta ? " " : "",
                         o->meta ? o->meta : "");
        if (n < COL - 1)
            fprintf(out, "%-*s", COL, head);
        else
            fprintf(out, "%s\n%*s", head, COL, "");
        put_help(out, o->help, COL);
        if (o->aliases) {
            fprintf(out, "%*salso:", COL, "");
            for (const char *a = o->aliases; *a;) {
                size_t len = strcspn(a, " ");
                fprintf(out, " --%.*s", (int)len, a);
                a += len;
                a += strspn(a, " ");
            }
            fputc('\n', out);
        }
    }
    fprintf(out, "  %-*s%s\n", COL - 2, "--help", "show this text");
    if (spec->epilog) fprintf(out, "\n%s", spec->epilog);
    fprintf(out, "\nEvery option is also taken as --name=VALUE, with a single dash, and in\n"
                 "Mooncake's spelling with underscores (--block_size=65536). Flags take no\n"
                 "value or =true/=false.\n");
}
