/* kvpipe metadata-server: run the HTTP metadata store until SIGINT/SIGTERM. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_opts.h"
#include "kvpipe/kvpipe.h"
#include "kvpipe/metadata_server.h"

typedef struct server_opts {
    char host[256];
    kvp_metadata_server_opts o;
} server_opts;

enum { O_HOST = 1 };

static const cli_opt opts[] = {
    {"host", CLI_ARG_STRING, "H", "address to bind (default 127.0.0.1; IPv6 allowed)",
     .id = O_HOST},
    {"port", CLI_ARG_INT, "P", "port to listen on (default 8080; 0 picks a free one)", 0, 65535,
     CLI_TO(server_opts, o.port)},
    {"max-value-bytes", CLI_ARG_SIZE, "N", "largest value (default 16M)", 1, LLONG_MAX,
     CLI_TO(server_opts, o.max_value_bytes)},
    {"max-total-bytes", CLI_ARG_SIZE, "N", "memory for keys, values and requests (default 256M)", 1,
     LLONG_MAX, CLI_TO(server_opts, o.max_total_bytes)},
    {"max-connections", CLI_ARG_INT, "N", "connections served at once (default 1024)", 1, 1000000,
     CLI_TO(server_opts, o.max_connections)},
    {"max-connections-per-ip", CLI_ARG_INT, "N", "from one client address (default 256)", 1,
     1000000, CLI_TO(server_opts, o.max_connections_per_ip)},
    {"idle-timeout", CLI_ARG_INT, "S",
     "close a connection silent for S s, or that takes\nover S s for its request header (default "
     "15)",
     1, 86400, CLI_TO(server_opts, o.idle_timeout_s)},
    {"request-timeout", CLI_ARG_INT, "S",
     "close one that takes over S s for a request\n(default 30)", 1, 86400,
     CLI_TO(server_opts, o.request_timeout_s)},
};

static const cli_spec spec = {
    .cmd = "metadata-server",
    .synopsis = "usage: kvpipe metadata-server [--host H] [--port P] [LIMITS]\n",
    .about = "Serve Mooncake's HTTP metadata protocol (GET|PUT|DELETE /metadata?key=K) from\n"
             "memory until SIGINT or SIGTERM, with the rules of Mooncake's own server (a\n"
             "second PUT of an rpc_meta key is refused). Point engines at\n"
             "http://H:P/metadata. Also: GET /health, GET /metadata?list=PREFIX.\n",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .epilog = "Byte counts take a K, M or G suffix (powers of 1024).\n",
};

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

static const char *set_opt(void *p, const cli_opt *opt, const cli_value *v)
{
    server_opts *so = p;
    if (opt->id == O_HOST && strip_brackets(v->text, so->host, sizeof so->host))
        return "a host name or address";
    return NULL;
}

int cmd_metadata_server(int argc, char **argv)
{
    server_opts so = {.host = "127.0.0.1"};
    kvp_metadata_server_opts_init(&so.o);
    so.o.port = 8080;
    int r = cli_parse(&spec, argc, argv, 0, set_opt, &so);
    if (r) return r - 1;
    if (so.o.max_value_bytes > so.o.max_total_bytes) {
        cli_error("--max-value-bytes exceeds --max-total-bytes");
        return 2;
    }
    so.o.host = so.host;
    kvp_metadata_server *srv;
    kvp_status st = kvp_metadata_server_start_opts(&so.o, &srv);
    if (st) {
        cli_error("%s: %s", kvp_strerror(st), kvp_last_error());
        return 1;
    }
    /* An IPv6 literal goes in brackets in a URL. */
    int v6 = strchr(so.host, ':') != NULL;
    printf("kvpipe metadata-server listening on http://%s%s%s:%d/metadata\n", v6 ? "[" : "",
           so.host, v6 ? "]" : "", kvp_metadata_server_port(srv));
    fflush(stdout);
    int sig = cli_wait_for_signal();
    cli_error("signal %d, stopping", sig);
    kvp_metadata_server_stop(srv);
    return 0;
}
