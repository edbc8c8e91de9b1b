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

/* Every status code, once: X(name, value, text), where text is what
 * kvp_strerror() returns. The enum below, the texts and the Python module's
 * constants are generated from this table. Append only: a code, once
 * released, keeps its name and value. */
#define KVP_STATUS_LIST(X)                                                                         \
    X(KVP_OK, 0, "success")                                                                        \
    /* an argument is invalid */                                                                   \
    X(KVP_EINVAL, 1, "invalid argument")                                                           \
    /* out of memory, or a configured memory bound reached */                                      \
    X(KVP_ENOMEM, 2, "out of memory")                                                              \
    /* a wait ran past its timeout */                                                              \
    X(KVP_ETIMEDOUT, 3, "timed out")                                                               \
    /* a peer or server could not be reached */                                                    \
    X(KVP_ECONNREFUSED, 4, "connection refused or peer unreachable")                               \
    /* a peer closed the connection or died mid-operation */                                       \
    X(KVP_ECONNRESET, 5, "connection reset by peer")                                               \
    /* an address range lies outside registered memory */                                          \
    X(KVP_ERANGE, 6, "address range outside registered memory")                                    \
    /* no such segment, key or buffer */                                                           \
    X(KVP_ENOTFOUND, 7, "not found")                                                               \
    /* a malformed frame, header or JSON document */                                               \
    X(KVP_EPROTO, 8, "protocol error (malformed message)")                                         \
    /* the operation is not supported (by this build or peer) */                                   \
    X(KVP_ENOTSUP, 9, "not supported")                                                             \
    /* the metadata store failed or is unreachable */                                              \
    X(KVP_EMETADATA, 10, "metadata store error")                                                   \
    /* an operating-system call failed */                                                          \
    X(KVP_EIO, 11, "I/O error")                                                                    \
    /* the object is in use */                                                                     \
    X(KVP_EBUSY, 12, "resource busy")                                                              \
    /* a configuration file or field is invalid */                                                 \
    X(KVP_ECONFIG, 13, "invalid configuration")                                                    \
    /* the operation was canceled */                                                               \
    X(KVP_ECANCELED, 14, "canceled")                                                               \
    /* the operation has not completed yet */                                                      \
    X(KVP_EINPROGRESS, 15, "in progress")                                                          \
    /* the object was closed */                                                                    \
    X(KVP_ECLOSED, 16, "closed")                                                                   \
    /* a blocking call was interrupted (a signal) */                                               \
    X(KVP_EINTR, 17, "interrupted")                                                                \
    /* a peer or descriptor failed authentication */                                               \
    X(KVP_EAUTH, 18, "authentication failed")                                                      \
    /* the bytes that arrived differ from those the source held (integrity) */                     \
    X(KVP_ECORRUPT, 19, "data corrupted in transfer (integrity check failed)")

#define KVP_STATUS_ENUM_ENTRY_(name, value, text) name = value,
typedef enum kvp_status { KVP_STATUS_LIST(KVP_STATUS_ENUM_ENTRY_) } kvp_status;
#undef KVP_STATUS_ENUM_ENTRY_

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
