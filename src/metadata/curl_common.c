#include "metadata/curl_common.h"

#include <curl/curl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"

size_t kvpi_curl_on_data(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    kvpi_curl_body *b = userdata;
    size_t n = size * nmemb;
    if (n > b->max - b->len) {
        b->too_big = 1;
        return 0;
    }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->data, cap);
        if (!p) return 0;
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->len, ptr, n);
    b->len += n;
    b->data[b->len] = '\0';
    return n;
}

void kvpi_curl_setup(CURL *h, const char *url, int timeout_ms, kvpi_curl_body *resp,
                     size_t max_body, char *errbuf)
{
    resp->max = max_body;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L); /* no SIGALRM from the resolver */
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, kvpi_curl_on_data);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, resp);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
}

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static CURLcode init_rc;

static void init(void)
{
    init_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

kvp_status kvpi_curl_init(const char *who)
{
    pthread_once(&init_once, init);
    if (init_rc == CURLE_OK) return KVP_OK;
    return kvpi_error(KVP_EMETADATA, "metadata store %s: curl_global_init failed: %s", who,
                      curl_easy_strerror(init_rc));
}

void kvpi_curl_pool_init(kvpi_curl_pool *pool)
{
    memset(pool, 0, sizeof *pool);
    pthread_mutex_init(&pool->lock, NULL);
}

void kvpi_curl_pool_destroy(kvpi_curl_pool *pool)
{
    for (int i = 0; i < pool->n_idle; i++)
        curl_easy_cleanup(pool->idle[i]);
    pool->n_idle = 0;
    pthread_mutex_destroy(&pool->lock);
}

CURL *kvpi_curl_take(kvpi_curl_pool *pool)
{
    CURL *h = NULL;
    pthread_mutex_lock(&pool->lock);
    if (pool->n_idle > 0) h = pool->idle[--pool->n_idle];
    pthread_mutex_unlock(&pool->lock);
    if (h) {
        curl_easy_reset(h); /* keeps the connection cache, clears the last request's options */
        return h;
    }
    return curl_easy_init();
}

void kvpi_curl_give(kvpi_curl_pool *pool, CURL *h, int ok)
{
    if (!h) return;
    pthread_mutex_lock(&pool->lock);
    if (ok && pool->n_idle < KVPI_CURL_IDLE_HANDLES) {
        pool->idle[pool->n_idle++] = h;
        h = NULL;
    }
    pthread_mutex_unlock(&pool->lock);
    if (h) curl_easy_cleanup(h);
}
