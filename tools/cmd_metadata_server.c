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
    fprintf(out,
            "usage: kvpipe metadata-server [--host H] [--port P] [LIMITS]\n"
            "\n"
            "Serve Mooncake's HTTP metadata protocol (GET|PUT|DELETE /metadata?key=K) from\n"
            "memory until SIGINT or SIGTERM, with the rules of Mooncake's own server (a\n"
            "second PUT of an rpc_meta key is refused). Point engines at\n"
            "http://H:P/metadata. Also: GET /health, GET /metadata?list=PREFIX.\n"
            "\n"
            "  --host H                   address to bind (default 127.0.0.1; IPv6 allowed)\n"
            "  --port P                   port to listen on (default 8080; 0 picks a free one)\n"
            "  --max-value-bytes N        largest value (default 16M)\n"
            "  --max-total-bytes N        memory for keys, values and requests (default 256M)\n"
            "  --max-connections N        connections served at once (default 1024)\n"
            "  --max-connections-per-ip N from one client address (default 256)\n"
            "  --idle-timeout S           close a connection silent for S s (default 15)\n"
            "  --request-timeout S        close one that takes over S s for a request\n"
            "                             (default 30)\n"
            "  --help                     show this text\n"
            "Byte counts take a K, M or G suffix (powers of 1024).\n");
}

enum {
    OPT_HOST = 'H',
    OPT_PORT = 'p',
    OPT_HELP = 'h',
    OPT_MAX_VALUE = 256,
    OPT_MAX_TOTAL,
    OPT_MAX_CONNS,
    OPT_MAX_CONNS_PER_IP,
    OPT_IDLE_TIMEOUT,
    OPT_REQUEST_TIMEOUT,
};

static const struct option opts[] = {
    {"host", required_argument, NULL, OPT_HOST},
    {"port", required_argument, NULL, OPT_PORT},
    {"max-value-bytes", required_argument, NULL, OPT_MAX_VALUE},
    {"max-total-bytes", required_argument, NULL, OPT_MAX_TOTAL},
    {"max-connections", required_argument, NULL, OPT_MAX_CONNS},
    {"max-connections-per-ip", required_argument, NULL, OPT_MAX_CONNS_PER_IP},
    {"idle-timeout", required_argument, NULL, OPT_IDLE_TIMEOUT},
    {"request-timeout", required_argument, NULL, OPT_REQUEST_TIMEOUT},
    {"help", no_argument, NULL, OPT_HELP},
    {NULL, 0, NULL, 0},
};

/* A decimal integer in [lo, hi]. */
static int parse_uint(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi) return -1;
    *out = v;
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

/* One option into o; on a bad value, *what says what was expected. */
static int parse_one(int c, const char *arg, char *host, size_t host_len,
                     kvp_metadata_server_opts *o, const char **what)
{
    long v = 0;
    size_t bytes = 0;
    switch (c) {
    case OPT_HOST:
        *what = "a host name or address";
        return strip_brackets(arg, host, host_len);
    case OPT_PORT:
        *what = "a port in 0..65535";
        if (parse_uint(arg, 0, 65535, &v)) return -1;
        o->port = (int)v;
        return 0;
    case OPT_MAX_VALUE:
    case OPT_MAX_TOTAL:
        *what = "a byte count above 0, such as 16M";
        if (kvp_cli_parse_size(arg, &bytes) || bytes == 0) return -1;
        *(c == OPT_MAX_VALUE ? &o->max_value_bytes : &o->max_total_bytes) = bytes;
        return 0;
    case OPT_MAX_CONNS:
    case OPT_MAX_CONNS_PER_IP:
        *what = "a count in 1..1000000";
        if (parse_uint(arg, 1, 1000000, &v)) return -1;
        *(c == OPT_MAX_CONNS ? &o->max_connections : &o->max_connections_per_ip) = (unsigned)v;
        return 0;
    default: /* the two timeouts */
        *what = "seconds in 1..86400";
        if (parse_uint(arg, 1, 86400, &v)) return -1;
        *(c == OPT_IDLE_TIMEOUT ? &o->idle_timeout_s : &o->request_timeout_s) = (unsigned)v;
        return 0;
    }
}

static const char *opt_name(int c)
{
    for (const struct option *p = opts; p->name; p++)
        if (p->val == c) return p->name;
    return "?";
}

/* Returns -1 to continue, else the exit code. */
static int parse_args(int argc, char **argv, char *host, size_t host_len,
                      kvp_metadata_server_opts *o)
{
    int c;
    while ((c = getopt_long(argc, argv, "H:p:h", opts, NULL)) != -1) {
        if (c == OPT_HELP) {
            usage(stdout);
            return 0;
        }
        const char *what = NULL;
        if (c != '?' && parse_one(c, optarg, host, host_len, o, &what) == 0) continue;
        if (c != '?')
            fprintf(stderr, "kvpipe metadata-server: invalid --%s '%s': expected %s\n", opt_name(c),
                    optarg, what);
        usage(stderr);
        return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "kvpipe metadata-server: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (o->max_value_bytes > o->max_total_bytes) {
        fprintf(stderr, "kvpipe metadata-server: --max-value-bytes exceeds --max-total-bytes\n");
        return 2;
    }
    return -1;
}

int kvp_cmd_metadata_server(int argc, char **argv)
{
    char host[256] = "127.0.0.1";
    kvp_metadata_server_opts o;
    kvp_metadata_server_opts_init(&o);
    o.port = 8080;
    int rc = parse_args(argc, argv, host, sizeof host, &o);
    if (rc >= 0) return rc;
    o.host = host;
    kvp_metadata_server *srv;
    kvp_status st = kvp_metadata_server_start_opts(&o, &srv);
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
