/* kvpipe metadata-server: run the HTTP metadata store until SIGINT/SIGTERM. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kvpipe/kvpipe.h"
#include "kvpipe/metadata_server.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: kvpipe metadata-server [--host H] [--port P]\n"
                 "\n"
                 "Serve Mooncake's HTTP metadata protocol (GET|PUT|DELETE <path>?key=K) from\n"
                 "memory until SIGINT or SIGTERM. Point engines at http://H:P/metadata.\n"
                 "\n"
                 "  --host H   address to bind (default 127.0.0.1; an IPv6 literal is allowed)\n"
                 "  --port P   port to listen on (default 8080; 0 picks a free port)\n"
                 "  --help     show this text\n");
}

static int parse_port(const char *s, int *port)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < 0 || v > 65535) return -1;
    *port = (int)v;
    return 0;
}

/* "[::1]" names the same host as "::1"; the library takes it bare. */
static int strip_brackets(const char *in, char *out, size_t len)
{
    size_t n = strlen(in);
    if (n >= 2 && in[0] == '[' && in[n - 1] == ']') {
        in++;
        n -= 2;
    }
    if (n == 0 || n >= len) return -1;
    memcpy(out, in, n);
    out[n] = '\0';
    return 0;
}

/* Returns -1 to continue, else the exit code. */
static int parse_args(int argc, char **argv, char *host, size_t host_len, int *port)
{
    static const struct option opts[] = {
        {"host", required_argument, NULL, 'H'},
        {"port", required_argument, NULL, 'p'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "H:p:h", opts, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            return 0;
        }
        if (c == 'H' && strip_brackets(optarg, host, host_len) == 0) continue;
        if (c == 'p' && parse_port(optarg, port) == 0) continue;
        if (c == 'H' || c == 'p')
            fprintf(stderr, "kvpipe metadata-server: invalid --%s '%s'\n",
                    c == 'H' ? "host" : "port", optarg);
        usage(stderr);
        return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "kvpipe metadata-server: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    return -1;
}

int kvp_cmd_metadata_server(int argc, char **argv)
{
    char host[256] = "127.0.0.1";
    int port = 8080;
    int rc = parse_args(argc, argv, host, sizeof host, &port);
    if (rc >= 0) return rc;
    kvp_metadata_server *srv;
    kvp_status st = kvp_metadata_server_start(host, port, &srv);
    if (st) {
        fprintf(stderr, "kvpipe metadata-server: %s: %s\n", kvp_strerror(st), kvp_last_error());
        return 1;
    }
    /* An IPv6 literal goes in brackets in a URL. */
    int v6 = strchr(host, ':') != NULL;
    printf("kvpipe metadata-server listening on http://%s%s%s:%d/metadata\n", v6 ? "[" : "", host,
           v6 ? "]" : "", kvp_metadata_server_port(srv));
    fflush(stdout);
    int sig = kvp_cli_wait_for_signal();
    fprintf(stderr, "kvpipe metadata-server: signal %d, stopping\n", sig);
    kvp_metadata_server_stop(srv);
    return 0;
}
