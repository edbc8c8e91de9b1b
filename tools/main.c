/* kvpipe: the command-line face of the library. */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kvpipe/kvpipe.h"

static const kvp_cli_command commands[] = {
    {"bench", "measure transfer throughput (target and initiator)", kvp_cmd_bench},
    {"metadata-server", "run the HTTP metadata store", kvp_cmd_metadata_server},
    {"info", "list transports and stores; check a store and a segment", kvp_cmd_info},
    {"demo", "move a model's KV cache from prefill to decode on this host", kvp_cmd_demo},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpipe COMMAND [OPTIONS]\n\nCommands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(out, "  %-16s %s\n", commands[i].name, commands[i].summary);
    fprintf(out, "\n'kvpipe COMMAND --help' describes each command. Env KVPIPE_LOG=debug|info|"
                 "warn|error sets the log level.\n");
}

int kvp_cli_parse_size(const char *s, size_t *out)
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

int kvp_cli_getopt(int argc, char **argv, const struct option *opts, const char *cmd,
                   void (*print_usage)(FILE *out),
                   int (*parse_opt)(void *o, int c, const char *arg), void *o)
{
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'h') {
            print_usage(stdout);
            return 1;
        }
        if (c == '?' || parse_opt(o, c, optarg) != 0) {
            if (c != '?') fprintf(stderr, "%s: invalid value '%s'\n", cmd, optarg);
            print_usage(stderr);
            return 3;
        }
    }
    return 0;
}

int kvp_cli_wait_for_signal(void)
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
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(argv[1], commands[i].name) == 0) return commands[i].main(argc - 1, argv + 1);
    fprintf(stderr, "kvpipe: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
