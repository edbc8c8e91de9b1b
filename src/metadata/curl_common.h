/* Internal: what the libcurl clients of the metadata stores (http.c, etcd.c)
 * share — one global initialisation, the collection of a response body and
 * a pool of idle handles. */
#ifndef KVPI_METADATA_CURL_COMMON_H
#define KVPI_METADATA_CURL_COMMON_H

#include <curl/curl.h>
#include <pthread.h>
#include <stddef.h>

#include "kvpipe/status.h"

/* A response body, NUL-terminated once anything arrived; a body longer than
 * max makes the transfer fail with too_big set. The caller frees data. */
typedef struct kvpi_curl_body {
    char *data;
    size_t len, cap, max;
    int too_big;
} kvpi_curl_body;

/* CURLOPT_WRITEFUNCTION collecting into the kvpi_curl_body given as
 * CURLOPT_WRITEDATA. Returns 0 (curl then fails with CURLE_WRITE_ERROR) when
 * the body passes max or memory runs out. */
size_t kvpi_curl_on_data(char *ptr, size_t size, size_t nmemb, void *userdata);

/* The options every metadata request sets on h: url, no signals, timeout_ms
 * for connecting and for the whole request, the body into resp (at most
 * max_body bytes), curl's error text into errbuf (CURL_ERROR_SIZE bytes). */
void kvpi_curl_setup(CURL *h, const char *url, int timeout_ms, kvpi_curl_body *resp,
                     size_t max_body, char *errbuf);

/* Idle CURL handles, so that requests reuse their keep-alive connections; a
 * request owns its handle while it runs, so concurrent requests never share
 * one. */
#define KVPI_CURL_IDLE_HANDLES 4
typedef struct kvpi_curl_pool {
    pthread_mutex_t lock;
    CURL *idle[KVPI_CURL_IDLE_HANDLES];
    int n_idle;
} kvpi_curl_pool;

void kvpi_curl_pool_init(kvpi_curl_pool *pool);
void kvpi_curl_pool_destroy(kvpi_curl_pool *pool);
/* An idle handle, reset (its connection kept), or a new one; NULL when out
 * of memory. */
CURL *kvpi_curl_take(kvpi_curl_pool *pool);
/* Give a handle back after a request: kept when it worked (ok) and there is
 * room, else cleaned up (a failed connection is not worth keeping). */
void kvpi_curl_give(kvpi_curl_pool *pool, CURL *h, int ok);

/* curl_global_init(), once per process. KVP_EMETADATA naming who (a store's
 * connection string) when it failed. */
kvp_status kvpi_curl_init(const char *who);

#endif
