/* Internal: the safetensors codec for pipe messages.
 *
 * A message is a safetensors file holding one tensor named "tensor":
 *   u64 little-endian N | N bytes of JSON header, space-padded to a multiple of 8 |
 *   data area (the tensor's bytes, row-major)
 * The header is {"tensor":{"dtype":D,"shape":[...],"data_offsets":[0,nbytes]}},
 * optionally with a "__metadata__" object of string values (ignored).
 *
 * The parser trusts nothing: the header length is bounded by the buffer and by
 * KVPI_SAFETENSORS_MAX_HEADER, the JSON is checked field by field, the dtype
 * must be known, dimensions are non-negative integers, the offsets cover the
 * data area exactly (as safetensors requires) and equal dtype size x product
 * of the shape without overflow. Errors are KVP_EPROTO with a message.
 */
#ifndef KVPI_PIPE_SAFETENSORS_H
#define KVPI_PIPE_SAFETENSORS_H

#include <stddef.h>

#include "kvpipe/tensor.h"

/* safetensors' own bound on the header (100 MB). */
#define KVPI_SAFETENSORS_MAX_HEADER 100000000u

/* Room for the longest header the writer produces: 32 dimensions of 20 digits
 * plus the fixed text, padded. */
#define KVPI_SAFETENSORS_HEADER_CAP 1024

/* Format the JSON header of t into hdr (KVPI_SAFETENSORS_HEADER_CAP bytes),
 * space-padded to a multiple of 8; *padded gets its length. KVP_EINVAL when
 * t->nbytes does not match its dtype and shape. The message is then
 * u64 LE *padded | hdr | the tensor's bytes. */
kvp_status kvpi_safetensors_header(const kvp_tensor *t, char *hdr, size_t *padded);

/* The exact encoded size of t (8 + padded header + t->nbytes). */
kvp_status kvpi_safetensors_size(const kvp_tensor *t, size_t *out);

/* Encode t into buf, which must hold at least kvpi_safetensors_size() bytes
 * (KVP_EINVAL otherwise). The tensor's bytes are copied once, straight into
 * buf. *written gets the encoded size. */
kvp_status kvpi_safetensors_write(const kvp_tensor *t, void *buf, size_t cap, size_t *written);

/* The same without the tensor's bytes: the length prefix and the header, with
 * the same checks; *data_off gets where the bytes go (for a caller that
 * copies them from elsewhere: a tensor in GPU memory). */
kvp_status kvpi_safetensors_write_header(const kvp_tensor *t, void *buf, size_t cap,
                                         size_t *data_off);

/* Parse a message of len bytes. On success *out describes the tensor with data
 * pointing into buf (borrowed: release is NULL); buf must outlive that use.
 * The data starts 8 + N bytes into buf: 8-byte aligned relative to buf when
 * the header is padded as safetensors writers do (not required here). */
kvp_status kvpi_safetensors_parse(const void *buf, size_t len, kvp_tensor *out);

#endif
