/* kvpipe status codes.
 *
 * Every fallible public function returns a kvp_status: 0 (KVP_OK) on success, a
 * positive code otherwise. Codes are append-only and never renumbered.
 * kvp_strerror() gives the fixed text of a code; kvp_last_error() gives the
 * detailed message of the last failure on the calling thread (which peer, which
 * field, which errno), so callers can log one useful line.
 */
#ifndef KVPIPE_STATUS_H
#define KVPIPE_STATUS_H

#include "kvpipe/export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvp_status {
    KVP_OK = 0,
    KVP_EINVAL = 1,       /* an argument is invalid */
    KVP_ENOMEM = 2,       /* out of memory, or a configured memory bound reached */
    KVP_ETIMEDOUT = 3,    /* a wait ran past its timeout */
    KVP_ECONNREFUSED = 4, /* a peer or server could not be reached */
    KVP_ECONNRESET = 5,   /* a peer closed the connection or died mid-operation */
    KVP_ERANGE = 6,       /* an address range lies outside registered memory */
    KVP_ENOTFOUND = 7,    /* no such segment, key or buffer */
    KVP_EPROTO = 8,       /* a malformed frame, header or JSON document */
    KVP_ENOTSUP = 9,      /* the operation is not supported (by this build or peer) */
    KVP_EMETADATA = 10,   /* the metadata store failed or is unreachable */
    KVP_EIO = 11,         /* an operating-system call failed */
    KVP_EBUSY = 12,       /* the object is in use */
    KVP_ECONFIG = 13,     /* a configuration file or field is invalid */
    KVP_ECANCELED = 14,   /* the operation was canceled */
    KVP_EINPROGRESS = 15, /* the operation has not completed yet */
    KVP_ECLOSED = 16,     /* the object was closed */
    KVP_EINTR = 17,       /* a blocking call was interrupted (a signal) */
    KVP_EAUTH = 18,       /* a peer or descriptor failed authentication */
} kvp_status;

/* Fixed English text for a status code; never NULL. Thread-safe. */
KVP_API const char *kvp_strerror(kvp_status status);

/* The detailed message of the most recent failure on the calling thread, or ""
 * if none. The string is thread-local and valid until the next kvpipe call on
 * the same thread. */
KVP_API const char *kvp_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
