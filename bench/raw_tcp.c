/* raw_tcp: the loopback TCP baseline for `kvpipe bench`.
 *
 * A sender process streams blocks of --block-size bytes over one plain TCP
 * connection to a receiver that recv()s them into one buffer, for --duration
 * seconds: what the kernel can move with no protocol at all. Prints one JSON
 * line {"gbps": ..., "bytes": ...}; gbps is decimal GB/s. */
#include <arpa/inet.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int sender(int port, size_t block)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) return 1;
    char *buf = malloc(block);
    if (!buf) return 1;
    memset(buf, 0x5a, block);
    for (;;) {
        size_t off = 0;
        while (off < block) {
            ssize_t n = send(fd, buf + off, block - off, MSG_NOSIGNAL);
            if (n <= 0) return 0; /* the receiver is done */
            off += (size_t)n;
        }
    }
}

int main(int argc, char **argv)
{
    size_t block = 1u << 20;
    double duration = 3;
    static const struct option opts[] = {{"block-size", required_argument, 0, 'b'},
                                         {"duration", required_argument, 0, 'd'},
                                         {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'b') block = strtoull(optarg, NULL, 10);
        else if (c == 'd') duration = atof(optarg);
        else return 2;
    }
    if (block == 0 || !(duration > 0)) return 2;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 1) ||
        getsockname(lfd, (struct sockaddr *)&sa, &sl)) {
        perror("raw_tcp");
        return 1;
    }
    pid_t pid = fork();
    if (pid == 0) _exit(sender(ntohs(sa.sin_port), block));
    int fd = accept(lfd, NULL, NULL);
    char *buf = malloc(block);
    if (fd < 0 || !buf) return 1;
    uint64_t bytes = 0;
    double start = now(), end = start + duration;
    while (now() < end) {
        size_t off = 0;
        while (off < block) {
            ssize_t n = recv(fd, buf + off, block - off, 0);
            if (n <= 0) {
                perror("raw_tcp: recv");
                return 1;
            }
            off += (size_t)n;
        }
        bytes += block;
    }
    double secs = now() - start;
    close(fd);
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
    printf("{\"gbps\": %.4f, \"bytes\": %llu, \"seconds\": %.3f, \"block_size\": %zu}\n",
           (double)bytes / secs / 1e9, (unsigned long long)bytes, secs, block);
    return 0;
}
