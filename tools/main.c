/* kvpipe: the command-line face of the library. */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_opts.h"
#include "kvpipe/kvpipe.h"

static int cmd_help(int argc, char **argv);

static const cli_command commands[] = {
    {"bench", "measure transfers: throughput and latency, one point or a sweep", cmd_bench},
    {"metadata-server", "run the HTTP metadata store", cmd_metadata_server},
    {"info", "list transports and stores; check a store and a segment", cmd_info},
    {"demo", "move a model's KV cache from prefill to decode on this host", cmd_demo},
    {"help", "describe a command: kvpipe help [COMMAND [--pipe]]", cmd_help},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpipe COMMAND [OPTIONS]\n\nCommands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(out, "  %-16s %s\n", commands[i].name, commands[i].summary);
    fprintf(out, "\n'kvpipe help COMMAND' (or 'kvpipe COMMAND --help') describes each command.\n"
                 "Environment: KVPIPE_LOG=error|warn|info|debug sets the log level;\n"
                 "KVPIPE_METRICS_PORT=P serves each engine's metrics at "
                 "http://127.0.0.1:P/metrics;\n"
                 "MC_TE_METRIC=1 logs Mooncake's throughput line every 5 s.\n");
}

static const cli_command *find_command(const char *name)
{
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(name, commands[i].name) == 0) return &commands[i];
    return NULL;
}

/* kvpipe help [COMMAND [ARGS]]: COMMAND's --help (bench --pipe's with --pipe). */
static int cmd_help(int argc, char **argv)
{
    if (argc < 2) {
        usage(stdout);
        return 0;
    }
    const cli_command *c = find_command(argv[1]);
    if (!c || c->main == cmd_help) {
        cli_cmd = "help";
        cli_error("unknown command '%s' (kvpipe help lists them)", argv[1]);
        return 2;
    }
    char *args[8] = {argv[1]};
    int n = 1;
    for (int i = 2; i < argc && n < 6; i++)
        args[n++] = argv[i];
    args[n++] = "--help";
    args[n] = NULL;
    return c->main(n, args);
}

int cli_parse_size(const char *s, size_t *out)
{
    if (*s < '0' || *s > '9') return -1; /* no sign, no space: strtoull takes both */
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno == ERANGE) return -1;
    int shift = 0;
    if (*end == 'K' || *end == 'k') shift = 10;
    if (*end == 'M' || *end == 'm') shift = 20;
    if (*end == 'G' || *end == 'g') shift = 30;
    if (shift) end++;
    if (*end == 'i' && end[1] == 'B') end += 2;
    if (*end || v > (SIZE_MAX >> shift)) return -1;
    *out = (size_t)(v << shift);
    return 0;
}

int cli_wait_for_signal(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    int sig = 0;
    sigwait(&set, &sig);
    return sig;
}

int main(int argc, char **argv)
{
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("kvpipe %s\n", KVP_VERSION_STRING);
        return 0;
    }
    /* Subcommands that serve until a signal wait for it with sigwait; block the
     * signals before any library thread starts so that threads inherit the mask. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    const cli_command *c = find_command(argv[1]);
    if (c) return c->main(argc - 1, argv + 1);
    cli_error("unknown command '%s' (kvpipe help lists them)", argv[1]);
    return 2;
}
