/* The kvpipe CLI: one file per subcommand, each exporting one entry point. */
#ifndef TOOLS_CLI_H
#define TOOLS_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

typedef struct cli_command {
    const char *name;
    const char *summary;
    int (*main)(int argc, char **argv); /* argv[0] is the command name */
} cli_command;

int cmd_bench(int argc, char **argv);
int cmd_metadata_server(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_bench_pipe(int argc, char **argv); /* cmd_bench hands --pipe runs here */

/* Parse a byte count: decimal digits with an optional K, M or G suffix
 * (powers of 1024, either case, optionally followed by "iB"). -1 for anything
 * else or a value past SIZE_MAX; *out is written only on success. */
int cli_parse_size(const char *s, size_t *out);

/* Block SIGINT and SIGTERM in the calling thread (call before starting threads)
 * and wait for one of them; returns the signal number. */
int cli_wait_for_signal(void);

/* The monotonic clock, for timing runs and bounding waits. */
static inline uint64_t cli_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t cli_now_ms(void)
{
    return cli_now_ns() / 1000000u;
}

#endif
