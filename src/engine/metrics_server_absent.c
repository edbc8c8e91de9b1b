/* The metrics endpoint in a build without libmicrohttpd (CMake
 * KVP_WITH_HTTP_SERVER OFF or the library not found): asking for one fails
 * with KVP_ENOTSUP naming the option. kvp_engine_metrics() and the
 * Prometheus text of kvp_metrics_format_prometheus() still work. */
#include "common/error.h"
#include "engine/metrics_server.h"

kvp_status kvpi_metrics_server_acquire(const char *host, int port, kvpi_metrics_server **out)
{
    (void)host, (void)port, (void)out;
    return kvpi_error(KVP_ENOTSUP, "metrics endpoint: not built in; reconfigure kvpipe with "
                                   "-DKVP_WITH_HTTP_SERVER=ON (needs libmicrohttpd)");
}

void kvpi_metrics_server_release(kvpi_metrics_server *srv)
{
    (void)srv;
}

int kvpi_metrics_server_port(const kvpi_metrics_server *srv)
{
    (void)srv;
    return 0;
}

kvp_status kvpi_metrics_server_add(kvpi_metrics_server *srv, kvpi_metrics_collect_fn fn, void *ctx)
{
    (void)srv, (void)fn, (void)ctx;
    return kvpi_error(KVP_ENOTSUP, "metrics endpoint: not built in");
}

void kvpi_metrics_server_remove(kvpi_metrics_server *srv, void *ctx)
{
    (void)srv, (void)ctx;
}
