/* The loopback ports a pipe pair on this host needs, for the CLI's launcher
 * (pipe_launch.c) and bench/pipe_ping.c. Header-only: the CLI sees only the
 * public API and the bench programs are single files, so neither can share
 * a helper through the library. */
#ifndef TOOLS_PIPE_PORTS_H
#define TOOLS_PIPE_PORTS_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* Whether a TCP socket can bind port on 127.0.0.1 now. */
static inline int port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int ok = fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

/* A base port for a pair whose prefill_url and decode_url are both
 * 127.0.0.1:base, so decode's base is base+100 (vLLM's same-node rule), with
 * every port the two sides bind (base, +9, +10, +100, +109, +110) free; -1
 * when none was found. The range stays below the usual ephemeral ports, which
 * the engines' data ports come from. */
static inline int pick_pipe_base(void)
{
    srand((unsigned)(getpid() ^ time(NULL)));
    for (int tries = 0; tries < 500; tries++) {
        int b = 20000 + rand() % 10000;
        int need[] = {b, b + 9, b + 10, b + 100, b + 109, b + 110};
        int ok = 1;
        for (size_t i = 0; i < 6 && ok; i++)
            ok = port_free(need[i]);
        if (ok) return b;
    }
    return -1;
}

#endif
