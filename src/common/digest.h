/* Internal: the digest of end-to-end integrity (docs/reliability.md,
 * "Integrity"): XXH3-64 from libxxhash, over the bytes a transfer moves.
 *
 * Where it is taken: the side that sends a slice's bytes digests them in a
 * pass of its own once the copy that sends them has ended (the copy has
 * brought them into cache, so the pass reads them there), and the side that
 * receives digests what landed as it lands, a chunk at a time
 * (kvpi_digest_recv). A slice whose two digests differ failed: the bytes
 * changed on the way, or the source changed while the transfer read it.
 * Since the sending side's pass begins after its copy ended, matching
 * digests prove that every byte held, when the pass read it, the value the
 * copy had read: the bytes moved are those the source held at one instant,
 * between the copy's end and the pass's start.
 *
 * Thread-safe: the state of kvpi_digest_recv is the calling thread's. */
#ifndef KVPI_COMMON_DIGEST_H
#define KVPI_COMMON_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#include "kvpipe/status.h"

/* The name peers agree on, in the descriptor field KVPI_DIGEST_FIELD. */
#define KVPI_DIGEST_NAME "xxh3-64"
#define KVPI_DIGEST_FIELD "kvpipe_integrity"
#define KVPI_DIGEST_LEN 8
/* Receiving digests this many bytes at a time, each while it is in cache. */
#define KVPI_DIGEST_CHUNK ((size_t)256 << 10)

uint64_t kvpi_digest(const void *buf, size_t len);

/* A digest taken piece by piece: the same value as kvpi_digest over the
 * pieces in order. */
typedef struct kvpi_digester kvpi_digester;
kvpi_digester *kvpi_digester_new(void); /* NULL: out of memory */
void kvpi_digester_free(kvpi_digester *d);
void kvpi_digester_reset(kvpi_digester *d);
void kvpi_digester_add(kvpi_digester *d, const void *buf, size_t len);
uint64_t kvpi_digester_value(const kvpi_digester *d);
/* Copy len bytes from src to dst, adding them to d as they are copied: a
 * chunk at a time, each digested from dst while it is in cache. */
void kvpi_digester_copy(kvpi_digester *d, void *dst, const void *src, size_t len);

/* Receive len bytes into buf from fd by deadline (kvpi_recv_all_by), a
 * chunk at a time, and the digest of what arrived in *digest. */
kvp_status kvpi_digest_recv(int fd, void *buf, size_t len, uint64_t deadline, uint64_t *digest);

/* Whether integrity is asked for: option (kvp_engine_opts.integrity: -1 env
 * KVPIPE_INTEGRITY, 0 off, 1 on) resolved into *on; KVP_ECONFIG naming the
 * variable when it is neither unset, "", "0" nor "1". */
kvp_status kvpi_integrity_resolve(int option, int *on);

#endif
