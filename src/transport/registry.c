#include <string.h>

#include "transport/transport.h"

/* Preference order: same-host transports first; the engine tries them only
 * where its protocol allows (see segment.c). */
const kvpi_transport_ops *const kvpi_transports[] = {
    &kvpi_transport_shm,
    &kvpi_transport_tcp,
    NULL,
};

const kvpi_transport_ops *kvpi_transport_lookup(const char *name)
{
    for (size_t i = 0; kvpi_transports[i]; i++)
        if (strcmp(kvpi_transports[i]->name, name) == 0) return kvpi_transports[i];
    return NULL;
}
