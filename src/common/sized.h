/* Internal: the caller's side of an extensible public struct (docs/abi.md).
 *
 * A struct that a program fills or receives (kvp_engine_opts, kvp_pipe_opts,
 * kvp_metadata_server_opts, kvp_pipe_stats, kvp_pipe_endpoints) only ever
 * grows at its end, and a field added later takes 0 to mean its default. The
 * header's inline wrappers pass sizeof the struct as the program was built,
 * so the library knows how much of it the program has: */
#ifndef KVPI_COMMON_SIZED_H
#define KVPI_COMMON_SIZED_H

#include <stddef.h>

#include "kvpipe/status.h"

/* A struct passed in: copy the program's size bytes of src over dst (this
 * library's struct of known bytes, filled with the defaults first), so the
 * fields an older program lacks keep their defaults. Bytes past known, from
 * a program built against a newer kvpipe, must be 0 (fields left at their
 * defaults); else KVP_ENOTSUP saying so. KVP_EINVAL for a size no kvpipe
 * struct has. what names the struct in the message. */
kvp_status kvpi_sized_in(void *dst, size_t known, const void *src, size_t size, const char *what);

/* A struct handed out: the program's size bytes of dst get src's first
 * ones (src has known bytes), 0 past known. */
void kvpi_sized_out(void *dst, size_t size, const void *src, size_t known);

#endif
