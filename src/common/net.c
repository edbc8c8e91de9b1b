#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/error.h"
#include "common/net.h"
#include "common/util.h"

static int parse_port(const char *s, int *port)
{
    long v;
    if (kvpi_parse_long(s, 0, 65535, &v)) return -1;
    *port = (int)v;
    return 0;
}

kvp_status kvpi_hostport_parse(const char *text, int default_port, kvpi_hostport *out)
{
    if (!text || !*text) return kvpi_error(KVP_EINVAL, "empty host:port");
    size_t len = strlen(text);
    const char *host = text, *port_str = NULL;
    size_t host_len;
    if (text[0] == '[') {
        const char *close = strchr(text, ']');
        if (!close) return kvpi_error(KVP_EINVAL, "'%s': missing ']' after IPv6 address", text);
        host = text + 1;
        host_len = (size_t)(close - host);
        if (close[1] == ':')
            port_str = close + 2;
        else if (close[1] != '\0')
            return kvpi_error(KVP_EINVAL, "'%s': expected ':port' after ']'", text);
    } else {
        const char *colon = strrchr(text, ':');
        if (colon && strchr(text, ':') != colon) {
            /* Several colons and no brackets: a bare IPv6 address. */
            host_len = len;
        } else if (colon) {
            host_len = (size_t)(colon - text);
            port_str = colon + 1;
        } else {
            host_len = len;
        }
    }
    if (host_len == 0) return kvpi_error(KVP_EINVAL, "'%s': empty host", text);
    if (host_len >= KVPI_HOST_MAX) return kvpi_error(KVP_EINVAL, "'%.40s...': host too long", text);
    /* Brackets only enclose an IPv6 address: a host holding one would not
     * format back to text that parses ("[[h]:1" is host "[h", written "[h:1"). */
    if (memchr(host, '[', host_len) || memchr(host, ']', host_len))
        return kvpi_error(KVP_EINVAL, "'%s': '[' or ']' inside the host", text);
    int port = default_port;
    if (port_str) {
        if (parse_port(port_str, &port) != 0)
            return kvpi_error(KVP_EINVAL, "'%s': port must be a number in 0..65535", text);
    } else if (default_port < 0) {
        return kvpi_error(KVP_EINVAL, "'%s': expected host:port", text);
    }
    memcpy(out->host, host, host_len);
    out->host[host_len] = '\0';
    out->port = port;
    return KVP_OK;
}

void kvpi_hostport_format(const char *host, int port, char *buf, size_t len)
{
    if (strchr(host, ':'))
        snprintf(buf, len, "[%s]:%d", host, port);
    else
        snprintf(buf, len, "%s:%d", host, port);
}

static kvp_status resolve(const char *host, int port, int passive, struct addrinfo **res)
{
    struct addrinfo hints = {0};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    char port_str[16];
    snprintf(port_str, sizeof port_str, "%d", port);
    int rc = getaddrinfo(host, port_str, &hints, res);
    if (rc != 0)
        return kvpi_error(KVP_ECONNREFUSED, "cannot resolve '%s': %s", host, gai_strerror(rc));
    return KVP_OK;
}

void kvpi_tcp_abort(int fd)
{
    struct linger l = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    close(fd);
}

void kvpi_socket_set_timeout(int fd, int timeout_ms)
{
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

kvp_status kvpi_tcp_listen(const char *host, int port, int *fd_out, int *port_out)
{
    struct addrinfo *res;
    kvp_status st = resolve(host, port, 1, &res);
    if (st) return st;
    int err = 0, fd = -1;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, KVPI_LISTEN_BACKLOG) == 0)
            break;
        err = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return kvpi_error(err == EADDRINUSE ? KVP_EBUSY : KVP_EIO, "cannot listen on %s:%d: %s",
                          host, port, strerror(err));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *port_out = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                               : ((struct sockaddr_in *)&ss)->sin_port);
    *fd_out = fd;
    return KVP_OK;
}

static void tune(int fd, int timeout_ms)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    kvpi_socket_set_timeout(fd, timeout_ms);
}

static int connect_one(const struct addrinfo *ai, int timeout_ms, int *err)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) {
            *err = errno;
            close(fd);
            return -1;
        }
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int rc;
        do
            rc = poll(&p, 1, timeout_ms);
        while (rc < 0 && errno == EINTR);
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (rc == 0)
            soerr = ETIMEDOUT;
        else if (rc < 0)
            soerr = errno;
        else
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        if (soerr) {
            *err = soerr;
            close(fd);
            return -1;
        }
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

kvp_status kvpi_tcp_connect(const char *host, int port, int timeout_ms, int *fd_out)
{
    struct addrinfo *res;
    kvp_status st = resolve(host, port, 0, &res);
    if (st) return st;
    int err = ECONNREFUSED, fd = -1;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next)
        fd = connect_one(ai, timeout_ms, &err);
    freeaddrinfo(res);
    if (fd < 0) {
        char hp[KVPI_HOST_MAX + 8];
        kvpi_hostport_format(host, port, hp, sizeof hp);
        return kvpi_error(err == ETIMEDOUT ? KVP_ETIMEDOUT : KVP_ECONNREFUSED,
                          "cannot connect to %s: %s", hp, strerror(err));
    }
    tune(fd, timeout_ms);
    *fd_out = fd;
    return KVP_OK;
}

kvp_status kvpi_tcp_accept(int listen_fd, int timeout_ms, int *fd_out)
{
    int fd;
    do
        fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) return kvpi_error(KVP_EIO, "accept: %s", strerror(errno));
    tune(fd, timeout_ms);
    *fd_out = fd;
    return KVP_OK;
}

static kvp_status io_error(int err, const char *what, size_t left, size_t total,
                           uint64_t deadline_ns)
{
    if ((err == EAGAIN || err == EWOULDBLOCK) && deadline_ns)
        return kvpi_error(KVP_ETIMEDOUT, "%s: deadline passed with %zu of %zu bytes still to move",
                          what, left, total);
    if (err == EAGAIN || err == EWOULDBLOCK)
        return kvpi_error(KVP_ETIMEDOUT, "%s: peer made no progress within the timeout", what);
    if (err == 0) return kvpi_error(KVP_ECONNRESET, "%s: peer closed the connection", what);
    if (err == EFAULT)
        return kvpi_error(KVP_EINVAL, "%s: %s (local memory not mapped)", what, strerror(err));
    return kvpi_error(KVP_ECONNRESET, "%s: %s", what, strerror(err));
}

/* Before a blocking call under a deadline: give the socket the time left as
 * its timeout, which Linux counts over the whole call (a recv with
 * MSG_WAITALL or a large send that waits several times still ends by it).
 * Returns -1 (errno EAGAIN) once the deadline has passed. */
static int arm(int fd, int opt, uint64_t deadline_ns)
{
    if (!deadline_ns) return 0;
    int ms = kvpi_remaining_ms(deadline_ns);
    if (ms == 0) {
        errno = EAGAIN;
        return -1;
    }
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv);
    return 0;
}

int kvpi_eventfd_signal(int fd)
{
    uint64_t one = 1;
    ssize_t n;
    do
        n = write(fd, &one, sizeof one);
    while (n < 0 && errno == EINTR);
    return n == sizeof one || (n < 0 && errno == EAGAIN) ? 0 : -1;
}

/* Skip the first done bytes of an iovec list; returns the new start. */
static struct iovec *iov_advance(struct iovec *iov, int *n, size_t done)
{
    while (*n > 0 && done >= iov->iov_len) {
        done -= iov->iov_len;
        iov->iov_len = 0; /* callers can tell which buffers were filled */
        iov++;
        (*n)--;
    }
    if (*n > 0) {
        iov->iov_base = (char *)iov->iov_base + done;
        iov->iov_len -= done;
    }
    return iov;
}

static size_t iov_total(const struct iovec *iov, int n)
{
    size_t t = 0;
    for (int i = 0; i < n; i++)
        t += iov[i].iov_len;
    return t;
}

/* Send (recving 0) or receive all of iov by deadline_ns (0: none). */
static kvp_status move_all_by(int fd, int recving, struct iovec *iov, int n, uint64_t deadline_ns)
{
    const char *what = recving ? "recv" : "send";
    iov = iov_advance(iov, &n, 0);
    size_t total = iov_total(iov, n);
    while (n > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t moved = arm(fd, recving ? SO_RCVTIMEO : SO_SNDTIMEO, deadline_ns) ? -1
                        : recving ? recvmsg(fd, &m, MSG_WAITALL)
                                  : sendmsg(fd, &m, MSG_NOSIGNAL);
        if (moved < 0) {
            if (errno == EINTR) continue;
            if ((errno == EAGAIN || errno == EWOULDBLOCK) && deadline_ns &&
                kvpi_remaining_ms(deadline_ns) > 0)
                continue; /* the socket timeout rounded down: the deadline is not here yet */
            return io_error(errno, what, iov_total(iov, n), total, deadline_ns);
        }
        /* n > 0: bytes were still to come (iov_advance drops empty buffers). */
        if (moved == 0 && recving) return io_error(0, what, iov_total(iov, n), total, deadline_ns);
        iov = iov_advance(iov, &n, (size_t)moved);
    }
    return KVP_OK;
}

kvp_status kvpi_send_all_by(int fd, const void *buf, size_t len, uint64_t deadline_ns)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    return move_all_by(fd, 0, &iov, 1, deadline_ns);
}

kvp_status kvpi_recv_all_by(int fd, void *buf, size_t len, uint64_t deadline_ns)
{
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    return move_all_by(fd, 1, &iov, 1, deadline_ns);
}

kvp_status kvpi_send_all(int fd, const void *buf, size_t len)
{
    return kvpi_send_all_by(fd, buf, len, 0);
}

kvp_status kvpi_recv_all(int fd, void *buf, size_t len)
{
    return kvpi_recv_all_by(fd, buf, len, 0);
}

kvp_status kvpi_sendv_all_by(int fd, struct iovec *iov, int n, uint64_t deadline_ns)
{
    return move_all_by(fd, 0, iov, n, deadline_ns);
}

kvp_status kvpi_recvv_all_by(int fd, struct iovec *iov, int n, uint64_t deadline_ns)
{
    return move_all_by(fd, 1, iov, n, deadline_ns);
}

kvp_status kvpi_sendv_all(int fd, struct iovec *iov, int n)
{
    return kvpi_sendv_all_by(fd, iov, n, 0);
}

kvp_status kvpi_recvv_all(int fd, struct iovec *iov, int n)
{
    return kvpi_recvv_all_by(fd, iov, n, 0);
}

/* ------------------------------------------------ the advertised address */

int kvpi_host_is_wildcard(const char *host)
{
    return strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0;
}

int kvpi_iface_virtual(const char *name)
{
    static const char *const prefixes[] = {
        "docker", "br-",   "veth",  "virbr", "cni",    "flannel", "cali", "weave",
        "vxlan",  "kube-", "lxcbr", "lxdbr", "podman", "cilium",  "tunl", "nerdctl"};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++)
        if (strncmp(name, prefixes[i], strlen(prefixes[i])) == 0) return 1;
    return 0;
}

/* The interface of the IPv4 default route with the lowest metric
 * (/proc/net/route), or "" when there is none. */
static void default_route_iface(char *out, size_t len)
{
    out[0] = '\0';
    FILE *f = fopen("/proc/net/route", "r");
    if (!f) return;
    char line[512];
    unsigned long best = (unsigned long)-1;
    if (fgets(line, sizeof line, f)) /* the header */
        while (fgets(line, sizeof line, f)) {
            char ifname[64];
            unsigned long dest, gw, metric, mask;
            unsigned flags;
            if (sscanf(line, "%63s %lx %lx %x %*d %*d %lu %lx", ifname, &dest, &gw, &flags, &metric,
                       &mask) != 6)
                continue;
            if (dest == 0 && mask == 0 && (flags & 0x1) && metric < best) { /* RTF_UP */
                best = metric;
                snprintf(out, len, "%s", ifname);
            }
        }
    fclose(f);
}

/* How good an address is for peers elsewhere: lower is better, -1 never. */
enum { RANK_DEFAULT_ROUTE, RANK_UP, RANK_VIRTUAL, RANK_LOOPBACK, RANK_COUNT };

static int rank_of(const struct ifaddrs *ifa, const char *route_if)
{
    const struct sockaddr *sa = ifa->ifa_addr;
    if (!sa || (sa->sa_family != AF_INET && sa->sa_family != AF_INET6)) return -1;
    if (!(ifa->ifa_flags & IFF_UP)) return -1;
    if (sa->sa_family == AF_INET) {
        uint32_t a = ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr);
        if ((a >> 16) == 0xa9fe) return -1; /* 169.254/16: link-local */
        if ((a >> 24) == 127 || (ifa->ifa_flags & IFF_LOOPBACK)) return RANK_LOOPBACK;
    } else {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LINKLOCAL(a) || IN6_IS_ADDR_V4MAPPED(a)) return -1;
        if (IN6_IS_ADDR_LOOPBACK(a) || (ifa->ifa_flags & IFF_LOOPBACK)) return RANK_LOOPBACK;
    }
    if (kvpi_iface_virtual(ifa->ifa_name)) return RANK_VIRTUAL;
    if (!(ifa->ifa_flags & IFF_RUNNING)) return -1; /* no carrier */
    return strcmp(ifa->ifa_name, route_if) == 0 ? RANK_DEFAULT_ROUTE : RANK_UP;
}

kvp_status kvpi_host_address(char *out, size_t len, char *why, size_t why_len)
{
    struct ifaddrs *list;
    if (getifaddrs(&list) != 0)
        return kvpi_error(KVP_EIO, "cannot list network interfaces: %s", strerror(errno));
    char route_if[64];
    default_route_iface(route_if, sizeof route_if);
    /* The best address of each rank (IPv4 first), and what was passed over. */
    const struct ifaddrs *best[RANK_COUNT] = {0};
    for (const struct ifaddrs *ifa = list; ifa; ifa = ifa->ifa_next) {
        int r = rank_of(ifa, route_if);
        if (r < 0) continue;
        if (!best[r] ||
            (best[r]->ifa_addr->sa_family == AF_INET6 && ifa->ifa_addr->sa_family == AF_INET))
            best[r] = ifa;
    }
    int r = 0;
    while (r < RANK_COUNT && !best[r])
        r++;
    if (r == RANK_COUNT) {
        freeifaddrs(list);
        return kvpi_error(KVP_ENOTFOUND, "this host has no network address (not even loopback)");
    }
    const struct ifaddrs *pick = best[r];
    socklen_t sl = pick->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in)
                                                        : sizeof(struct sockaddr_in6);
    char text[INET6_ADDRSTRLEN + 1];
    if (getnameinfo(pick->ifa_addr, sl, text, sizeof text, NULL, 0, NI_NUMERICHOST) != 0) {
        freeifaddrs(list);
        return kvpi_error(KVP_EIO, "cannot format the address of %s", pick->ifa_name);
    }
    snprintf(out, len, "%s", text);
    static const char *const how[RANK_COUNT] = {
        "the default route's interface", "an interface that is up (none carries the default route)",
        "a container or virtual bridge: no other interface has an address, so peers on other "
        "hosts may not reach it",
        "loopback: no other interface has an address, so only peers on this host reach it"};
    int n = snprintf(why, why_len, "%s on %s, %s", text, pick->ifa_name, how[r]);
    /* Name what was passed over: the bridges and loopback behind a better pick. */
    for (int k = r + 1; k < RANK_COUNT && n > 0 && (size_t)n < why_len; k++) {
        if (!best[k] || k == RANK_UP) continue;
        char other[INET6_ADDRSTRLEN + 1];
        socklen_t ol = best[k]->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in)
                                                               : sizeof(struct sockaddr_in6);
        if (getnameinfo(best[k]->ifa_addr, ol, other, sizeof other, NULL, 0, NI_NUMERICHOST))
            continue;
        n += snprintf(why + n, why_len - (size_t)n, "; passed over %s on %s (%s)", other,
                      best[k]->ifa_name,
                      k == RANK_VIRTUAL ? "container/virtual bridge" : "loopback");
    }
    freeifaddrs(list);
    return KVP_OK;
}

kvp_status kvpi_advert_choose(const char *given_host, const char *forced, const char *forced_by,
                              kvpi_advert *out)
{
    if (forced && *forced) {
        kvpi_hostport hp;
        /* A bare address, or one in brackets; a port is not for here. */
        kvp_status st = kvpi_hostport_parse(forced, 0, &hp);
        if (st || hp.port != 0 || kvpi_host_is_wildcard(hp.host))
            return kvpi_error(KVP_EINVAL,
                              "%s '%s' is not an address of this host to bind and advertise (an "
                              "IP address or host name, without a port, not a wildcard)",
                              forced_by, forced);
        snprintf(out->host, sizeof out->host, "%s", hp.host);
        snprintf(out->bind, sizeof out->bind, "%s", hp.host);
        snprintf(out->why, sizeof out->why, "%s, set by %s", hp.host, forced_by);
        return KVP_OK;
    }
    if (!kvpi_host_is_wildcard(given_host)) {
        snprintf(out->host, sizeof out->host, "%s", given_host);
        snprintf(out->bind, sizeof out->bind, "%s", given_host);
        snprintf(out->why, sizeof out->why, "%s, the host of local_server_name", given_host);
        return KVP_OK;
    }
    char why[sizeof out->why - 64];
    kvp_status st = kvpi_host_address(out->host, sizeof out->host, why, sizeof why);
    if (st) return st;
    snprintf(out->bind, sizeof out->bind, "%s", given_host);
    snprintf(out->why, sizeof out->why, "chosen for local_server_name's %s: %s", given_host, why);
    return KVP_OK;
}
