/* kvpipe's HTTP metadata store caps its memory as a whole, not only one value
 * (issue 11, item 5). The store runs as `kvpipe metadata-server` in a process
 * of its own, whose resident memory (VmRSS) the case reads from /proc.
 *
 * On efddc24 (before the budget): 30 values of 4 MiB were all stored and the
 * server's RSS grew by 120 MiB (many_values_stay_within_budget wants at most
 * the 64 MiB budget and some slack); 40 readers that did not read an 8 MiB
 * value grew it by 320 MiB (one copy each; slow_readers_share_one_copy wants
 * under 24 MiB); and 20 uploads declaring 4 MiB each were all admitted, none
 * refused (uploads_reserved_up_front wants the ones past a 32 MiB budget
 * refused at once). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "common/tsan.h"
#include "metadata/metadata.h"
#include "servers.h"
#include "test.h"

#define MIB ((size_t)1 << 20)

/* Resident bytes of a process, or 0. */
/* ThreadSanitizer keeps shadow memory beside the server's own (about four
 * bytes per byte touched, plus its metadata): its RSS grows about five times
 * as fast, and the bounds scale with it. Thirty values outside the budget
 * (120 MiB) would still break them. */
#ifdef KVPI_TSAN
#define RSS_SCALE 5
#else
#define RSS_SCALE 1
#endif

static size_t rss_of(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    size_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %zu kB", &kb) == 1) break;
    if (f) fclose(f);
    return kb << 10;
}

static char *value_of(size_t len, char c)
{
    char *v = malloc(len + 1);
    if (v) {
        memset(v, c, len);
        v[len] = '\0';
    }
    return v;
}

static void many_values_stay_within_budget(void)
{
    static const char *const args[] = {"--max-total-bytes", "64M", NULL};
    kvpt_server srv;
    REQUIRE(kvpt_http_cli_start(&srv, args) == KVPT_SERVER_OK);
    void *s = kvpt_http_store_open(srv.conn, 5000);
    REQUIRE(s);
    size_t before = rss_of(srv.pid);
    char *v = value_of(4 * MIB, 'v');
    REQUIRE(v);
    int stored = 0, refused = 0;
    for (int i = 0; i < 30; i++) {
        char key[32];
        snprintf(key, sizeof key, "mooncake/ram/big-%d", i);
        kvp_status st = kvpi_store_http.put(s, key, v);
        if (st == KVP_OK) stored++;
        if (st == KVP_ENOMEM) refused++;
        if (st && st != KVP_ENOMEM) fprintf(stderr, "  PUT %d: %s\n", i, kvp_last_error());
    }
    size_t grown = rss_of(srv.pid) - before;
    fprintf(stderr, "  30 PUTs of 4 MiB: %d stored, %d refused (507), RSS +%zu MiB\n", stored,
            refused, grown >> 20);
    CHECK(stored == 15); /* 64 MiB holds fifteen 4 MiB values and their keys */
    CHECK(refused == 15);
    CHECK(grown < RSS_SCALE * 80 * MIB);
    /* What is stored is served, and deleting makes room again. */
    char *got = NULL;
    CHECK_OK(kvpi_store_http.get(s, "mooncake/ram/big-0", &got));
    CHECK(got && strcmp(got, v) == 0);
    free(got);
    CHECK_OK(kvpi_store_http.del(s, "mooncake/ram/big-0"));
    CHECK_OK(kvpi_store_http.put(s, "mooncake/ram/big-29", v));
    free(v);
    kvpi_store_http.close(s);
    kvpt_server_stop(&srv);
}

/* Clients that ask for a large value and never read it share the stored
 * copy; they cost no memory per client. */
static void slow_readers_share_one_copy(void)
{
    kvpt_server srv;
    REQUIRE(kvpt_http_cli_start(&srv, NULL) == KVPT_SERVER_OK);
    void *s = kvpt_http_store_open(srv.conn, 5000);
    REQUIRE(s);
    char *v = value_of(8 * MIB, 'r');
    REQUIRE(v);
    REQUIRE_OK(kvpi_store_http.put(s, "big", v));
    size_t before = rss_of(srv.pid);
    enum { READERS = 40 };
    int fds[READERS];
    const char *get = "GET /metadata?key=big HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < READERS; i++) {
        fds[i] = -1;
        if (kvpi_tcp_connect("127.0.0.1", srv.port, 3000, &fds[i]) == KVP_OK) {
            int small = 4096; /* keep the kernel from taking much of it either */
            setsockopt(fds[i], SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
            kvpi_send_all(fds[i], get, strlen(get));
        }
    }
    usleep(1500 * 1000);
    size_t grown = rss_of(srv.pid) - before;
    fprintf(stderr, "  %d readers of an 8 MiB value that do not read: RSS +%zu MiB\n", READERS,
            grown >> 20);
    CHECK(grown < RSS_SCALE * 24 * MIB);
    /* Others are served meanwhile. */
    char *got = NULL;
    CHECK_OK(kvpi_store_http.get(s, "big", &got));
    CHECK(got && strcmp(got, v) == 0);
    free(got);
    for (int i = 0; i < READERS; i++)
        if (fds[i] >= 0) close(fds[i]);
    free(v);
    kvpi_store_http.close(s);
    kvpt_server_stop(&srv);
}

/* Uploads reserve their Content-Length before their body is read: those the
 * budget cannot hold are refused at once with 507, whatever their bodies
 * would do, and the reservations come back when they end. */
static void uploads_reserved_up_front(void)
{
    static const char *const args[] = {"--max-total-bytes", "32M", NULL};
    kvpt_server srv;
    REQUIRE(kvpt_http_cli_start(&srv, args) == KVPT_SERVER_OK);
    enum { UPLOADS = 20 };
    int fds[UPLOADS], refused = 0, waiting = 0;
    for (int i = 0; i < UPLOADS; i++) {
        char req[256];
        snprintf(req, sizeof req,
                 "PUT /metadata?key=u%d HTTP/1.1\r\nHost: x\r\nContent-Length: %zu\r\n\r\nab", i,
                 4 * MIB);
        fds[i] = -1;
        if (kvpi_tcp_connect("127.0.0.1", srv.port, 3000, &fds[i]) == KVP_OK)
            kvpi_send_all(fds[i], req, strlen(req));
    }
    usleep(500 * 1000);
    for (int i = 0; i < UPLOADS; i++) {
        char buf[64] = "";
        ssize_t n = fds[i] >= 0 ? recv(fds[i], buf, sizeof buf - 1, MSG_DONTWAIT) : -1;
        if (n > 0 && strncmp(buf, "HTTP/1.1 507", 12) == 0)
            refused++;
        else if (n < 0)
            waiting++; /* admitted: its body is awaited */
    }
    fprintf(stderr, "  %d uploads of 4 MiB into 32 MiB: %d refused at once, %d admitted\n", UPLOADS,
            refused, waiting);
    CHECK(waiting == 7); /* 32 MiB reserves seven 4 MiB bodies with the rest */
    CHECK(refused == UPLOADS - 7);
    for (int i = 0; i < UPLOADS; i++)
        if (fds[i] >= 0) close(fds[i]);
    /* The abandoned uploads gave their reservations back. */
    void *s = kvpt_http_store_open(srv.conn, 5000);
    REQUIRE(s);
    char *v = value_of(4 * MIB, 'u');
    REQUIRE(v);
    uint64_t t0 = kvpi_now_ms();
    int stored = 0;
    for (int i = 0; i < 7; i++) {
        char key[16];
        snprintf(key, sizeof key, "k%d", i);
        /* The server notices the closed uploads within moments. */
        kvp_status st;
        while ((st = kvpi_store_http.put(s, key, v)) == KVP_ENOMEM && kvpi_now_ms() - t0 < 5000)
            usleep(50 * 1000);
        if (st == KVP_OK) stored++;
    }
    CHECK(stored == 7);
    free(v);
    kvpi_store_http.close(s);
    kvpt_server_stop(&srv);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(many_values_stay_within_budget, 120);
    RUN_T(slow_readers_share_one_copy, 120);
    RUN_T(uploads_reserved_up_front, 120);
    return kvpt_summary();
}
