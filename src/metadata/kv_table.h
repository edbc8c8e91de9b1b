/* Internal: the table of kvpipe's HTTP metadata server and the rules of its
 * requests, apart from any socket (http_server.c carries them over
 * libmicrohttpd), so that they can be unit-tested and fuzzed as plain calls.
 *
 * Rules (Mooncake's mooncake-wheel/mooncake/http_metadata_server.py, plus
 * kvpipe's read-only extensions):
 *   GET    /health                 200 "OK"                     (extension)
 *   GET    /metadata?list=PREFIX   200 JSON array of the keys   (extension)
 *   GET    /metadata?key=K         200 value | 404
 *   PUT    /metadata?key=K + body  200 | 400 "Duplicate rpc_meta key not
 *                                  allowed" when K contains "rpc_meta" and
 *                                  exists | 413 over the value limit | 507
 *                                  over the memory budget
 *   DELETE /metadata?key=K         200 | 404 when K is missing
 *   no or empty key 400, another method 405, another path 404.
 *
 * Memory: every byte the table holds is charged to one budget
 * (max_total_bytes): stored keys and values, bodies being uploaded (reserved
 * from their Content-Length before they are read), and answers being sent
 * (values are shared with the answers that send them, never copied).
 *
 * Thread-safe: one mutex guards the table and the budget.
 */
#ifndef KVPI_METADATA_KV_TABLE_H
#define KVPI_METADATA_KV_TABLE_H

#include <stddef.h>

#include "kvpipe/status.h"

typedef struct kvpi_kvt_limits {
    size_t max_value_bytes; /* one PUT body */
    size_t max_total_bytes; /* everything the table holds, see above */
} kvpi_kvt_limits;

typedef struct kvpi_kvt kvpi_kvt;

/* Immutable bytes with a reference count, charged to the table's budget
 * until the last reference is released. */
typedef struct kvpi_kvt_blob kvpi_kvt_blob;

typedef struct kvpi_kvt_request {
    const char *method;       /* as sent: "GET", "PUT", ... */
    const char *path;         /* without the query */
    const char *key;          /* the decoded ?key= argument; NULL when absent */
    const char *list;         /* the decoded ?list= argument; NULL when absent */
    long long content_length; /* -1 when the request has none (chunked or no body) */
} kvpi_kvt_request;

typedef struct kvpi_kvt_reply {
    unsigned status;          /* HTTP status code */
    const char *text;         /* static body when blob is NULL */
    kvpi_kvt_blob *blob;      /* or a reference the caller must release */
    const char *content_type; /* "application/json" or "text/plain" */
    int allow;                /* non-zero: send "Allow: GET, PUT, DELETE" (405) */
} kvpi_kvt_reply;

kvp_status kvpi_kvt_create(const kvpi_kvt_limits *limits, kvpi_kvt **out);

/* Free the table and every stored value. Every blob handed out must have been
 * released before. NULL is a no-op. */
void kvpi_kvt_destroy(kvpi_kvt *t);

/* Look at a request before its body is read. Returns 1 with *reply filled when
 * it is answered now (refused, or a request without a body: GET, DELETE);
 * returns 0 when its body is to be read: *upload is then an empty blob with
 * the request's Content-Length reserved, to be filled with
 * kvpi_kvt_upload_append() and handed to kvpi_kvt_finish(). */
int kvpi_kvt_begin(kvpi_kvt *t, const kvpi_kvt_request *req, kvpi_kvt_blob **upload,
                   kvpi_kvt_reply *reply);

/* Append body bytes to an upload. -1 when the body would pass the value limit
 * or the memory budget (or memory runs out): the caller drops the request
 * (its upload is then only released). */
int kvpi_kvt_upload_append(kvpi_kvt *t, kvpi_kvt_blob **upload, const char *data, size_t n);

/* The whole body has arrived: store it (the upload is consumed) and fill
 * *reply. */
void kvpi_kvt_finish(kvpi_kvt *t, const kvpi_kvt_request *req, kvpi_kvt_blob *upload,
                     kvpi_kvt_reply *reply);

/* One whole request at once (begin, append, finish), for tests and fuzzers.
 * body may be NULL when len is 0. The caller releases reply->blob. */
void kvpi_kvt_handle(kvpi_kvt *t, const kvpi_kvt_request *req, const char *body, size_t len,
                     kvpi_kvt_reply *reply);

const char *kvpi_kvt_blob_data(const kvpi_kvt_blob *b);
size_t kvpi_kvt_blob_len(const kvpi_kvt_blob *b);
/* Drop a reference; the last one frees the bytes and returns them to the
 * budget. NULL is a no-op. Any thread. */
void kvpi_kvt_blob_release(kvpi_kvt_blob *b);

/* Bytes charged to the budget now. */
size_t kvpi_kvt_bytes_used(kvpi_kvt *t);

#endif
