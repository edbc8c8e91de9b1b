/* Options of the kvpipe CLI: one table per command says each option's name,
 * its other spellings, what value it takes and what it does; parsing, value
 * checks, error messages and --help all come from that table, so that every
 * command spells a concept the same way and every error names its option.
 *
 *   - Every option is --name VALUE or --name=VALUE; a single dash works too
 *     (-name=VALUE, as gflags takes it), and so does Mooncake's spelling with
 *     underscores (--block_size=65536) of every name with a dash.
 *   - A bad value is one line: "kvpipe CMD: --name: invalid value 'V':
 *     expected WHAT", then exit status 2; so is an unknown option, a missing
 *     value and an unexpected operand. No usage text follows: `kvpipe help
 *     CMD` prints it.
 *   - A flag takes no value, or gflags' =true/=false (1/0, yes/no, on/off).
 */
#ifndef TOOLS_CLI_OPTS_H
#define TOOLS_CLI_OPTS_H

#include <stddef.h>
#include <stdio.h>

/* The type of the field an option's value goes to (CLI_TO). */
typedef enum cli_field {
    CLI_NOWHERE, /* set() alone takes the value */
    CLI_TEXT,    /* const char *: the text as given (a STRING) */
    CLI_INT,
    CLI_UNSIGNED,
    CLI_LONG,
    CLI_SIZE_T,
    CLI_ULLONG,
    CLI_DOUBLE, /* a SECONDS */
} cli_field;

/* In an option's entry: cli_parse stores the value in this field of the
 * command's options (its o, a TYPE). A number goes to an int, unsigned,
 * long, size_t or unsigned long long, converted (a FLAG's 0/1, an INT, a
 * CHOICE's index, a SIZE); SECONDS to a double; a STRING's text to a
 * const char *. Anything else does not compile. */
#define CLI_TO(TYPE, FIELD)                                                                        \
    .to = offsetof(TYPE, FIELD),                                                                   \
    .to_type = _Generic(((TYPE *)0)->FIELD,                                                        \
                        const char *: CLI_TEXT,                                                    \
                        int: CLI_INT,                                                              \
                        unsigned: CLI_UNSIGNED,                                                    \
                        long: CLI_LONG,                                                            \
                        size_t: CLI_SIZE_T,                                                        \
                        unsigned long long: CLI_ULLONG,                                            \
                        double: CLI_DOUBLE)

typedef enum cli_arg {
    CLI_ARG_FLAG,    /* no value (or =true/=false) */
    CLI_ARG_STRING,  /* any non-empty text */
    CLI_ARG_INT,     /* a decimal integer in [lo, hi] */
    CLI_ARG_SIZE,    /* a byte count, K/M/G suffixes, in [lo, hi] */
    CLI_ARG_SECONDS, /* a decimal number of seconds, > 0 and <= hi */
    CLI_ARG_CHOICE,  /* one of choices, "a|b|c" (case-sensitive) */
    CLI_ARG_INTS,    /* INT, or a comma-separated list of them */
    CLI_ARG_SIZES,   /* SIZE, or a comma-separated list of them */
} cli_arg;

#define CLI_LIST_MAX 32

typedef struct cli_value {
    const char *text;          /* as given */
    long long i;               /* FLAG (0/1), INT, CHOICE (index) */
    size_t size;               /* SIZE */
    double seconds;            /* SECONDS */
    size_t list[CLI_LIST_MAX]; /* INTS, SIZES (i and size hold the first) */
    size_t n_list;
} cli_value;

typedef struct cli_opt {
    const char *name; /* canonical long name, "block-size" */
    cli_arg arg;
    const char *meta;    /* the value in --help: "BYTES"; NULL for a flag */
    const char *help;    /* --help text; '\n' continues on the next line; NULL: hidden */
    long long lo, hi;    /* INT and SIZE bounds; SECONDS: hi (0: none) */
    const char *choices; /* CHOICE: "read|write" */
    const char *aliases; /* other spellings, space-separated, without dashes */
    int id;              /* handed to the command's set() */
    size_t to;           /* CLI_TO: where the value goes */
    cli_field to_type;
} cli_opt;

/* A command's value check beyond the kind, and what an option without
 * CLI_TO does: NULL to accept, else what is expected ("a multiple of 8"),
 * for the error line. Called before the value is stored (CLI_TO). */
typedef const char *(*cli_set_fn)(void *o, const cli_opt *opt, const cli_value *v);

typedef struct cli_spec {
    const char *cmd;      /* "bench": messages start "kvpipe bench: " */
    const char *synopsis; /* "usage: ..." lines, each ending in \n */
    const char *about;    /* paragraph(s) before the options; may be NULL */
    const cli_opt *opts;
    size_t n_opts;
    const char *epilog; /* after the options; may be NULL */
} cli_spec;

/* Parse argv (argv[0] the command) against spec, calling set (if not NULL)
 * for each option in order and storing its value (CLI_TO). Returns 0 to go on, with optind at the
 * first operand when operands is non-zero (else an operand is an error); otherwise 1 + the exit
 * code: --help printed the usage to stdout (1), or an error line went to
 * stderr (3). */
int cli_parse(const cli_spec *spec, int argc, char **argv, int operands, cli_set_fn set, void *o);

/* The usage text, from the table. */
void cli_usage(const cli_spec *spec, FILE *out);

/* The command whose messages these are ("bench"); set by cli_parse(). */
extern const char *cli_cmd;

/* One line on stderr: "kvpipe CMD: " + the message + newline. */
void cli_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The option of spec with this id (for messages that name it). */
const char *cli_opt_name(const cli_spec *spec, int id);

#endif
