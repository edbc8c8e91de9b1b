/* Which transport serves a protocol; see protocol.h. */
#include "engine/protocol.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/error.h"
#include "common/log.h"

int kvpi_force_tcp(void)
{
    /* Mooncake's engine forces TCP when the variable is set at all, its
     * configuration parser reads it as a boolean; the spellings of false are
     * taken as false, so MC_FORCE_TCP=0 does not force. */
    static const char *const no[] = {"", "0", "false", "no", "off"};
    const char *v = getenv("MC_FORCE_TCP");
    if (!v) return 0;
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        if (strcasecmp(v, no[i]) == 0) return 0;
    return 1;
}

void kvpi_protocol_names(char *out, size_t len)
{
    size_t used = 0;
    out[0] = '\0';
    for (size_t i = 0; kvpi_transports[i] && used < len; i++)
        used += (size_t)snprintf(out + used, len - used, "%s%s", i ? ", " : "",
                                 kvpi_transports[i]->name);
}

kvp_status kvpi_protocol_resolve(const char *asked, const kvpi_transport_ops **out)
{
    const char *name = asked && *asked ? asked : "tcp";
    if (kvpi_force_tcp()) {
        if (strcmp(name, "tcp") != 0)
            KVPI_INFO("MC_FORCE_TCP is set: protocol '%s' runs over tcp", name);
        name = "tcp";
    }
    const kvpi_transport_ops *ops = kvpi_transport_lookup(name);
    if (ops) {
        *out = ops;
        return KVP_OK;
    }
    char names[128];
    kvpi_protocol_names(names, sizeof names);
    const char *missing = kvpi_transport_missing(name);
    return kvpi_error(KVP_ENOTSUP,
                      "protocol '%s' is not supported by this build (%s%sit serves %s); to run "
                      "over TCP, ask for protocol 'tcp' (in a mooncake config file: "
                      "\"protocol\": \"tcp\") or set MC_FORCE_TCP=1",
                      name, missing ? missing : "", missing ? "; " : "", names);
}
