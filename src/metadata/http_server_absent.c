/* kvp_metadata_server in a build without libmicrohttpd (CMake
 * KVP_WITH_HTTP_SERVER OFF or the library not found): starting one fails with
 * KVP_ENOTSUP naming the option. Engines still use any HTTP store as clients
 * (KVP_WITH_HTTP). */
#include <string.h>

#include "common/error.h"
#include "kvpipe/metadata_server.h"

kvp_status kvp_metadata_server_start(const char *host, int port, kvp_metadata_server **out)
{
    (void)host, (void)port, (void)out;
    return kvpi_error(KVP_ENOTSUP, "metadata server: not built in; reconfigure kvpipe with "
                                   "-DKVP_WITH_HTTP_SERVER=ON (needs libmicrohttpd)");
}

int kvp_metadata_server_port(const kvp_metadata_server *server)
{
    (void)server;
    return -1;
}

void kvp_metadata_server_stop(kvp_metadata_server *server)
{
    (void)server;
}

void kvp_metadata_server_opts_init_size(kvp_metadata_server_opts *opts, size_t size)
{
    /* Zero fields mean the defaults; there is no server to apply them. */
    if (opts) memset(opts, 0, size);
}

kvp_status kvp_metadata_server_start_opts_size(const kvp_metadata_server_opts *opts, size_t size,
                                               kvp_metadata_server **out)
{
    (void)size;
    return kvp_metadata_server_start(opts ? opts->host : NULL, opts ? opts->port : 0, out);
}

size_t kvp_metadata_server_bytes_used(const kvp_metadata_server *server)
{
    (void)server;
    return 0;
}
