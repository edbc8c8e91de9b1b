/* Internal: host:port parsing and blocking sockets with timeouts.
 *
 * All sockets here are blocking with SO_RCVTIMEO/SO_SNDTIMEO set, so a peer that
 * stops making progress surfaces as KVP_ETIMEDOUT after the timeout, and a peer
 * that dies surfaces as KVP_ECONNRESET at once. The *_by functions bound a
 * whole exchange by a deadline instead. Functions set kvp_last_error().
 */
#ifndef KVPI_COMMON_NET_H
#define KVPI_COMMON_NET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "kvpipe/status.h"

#define KVPI_HOST_MAX 256

typedef struct kvpi_hostport {
    char host[KVPI_HOST_MAX]; /* without IPv6 brackets */
    int port;                 /* 0..65535 */
} kvpi_hostport;

/* Parse "host:port", "[v6addr]:port", or, when default_port >= 0, a bare host
 * or bare IPv6 address ("::1") with that port. KVP_EINVAL with a message
 * otherwise. */
kvp_status kvpi_hostport_parse(const char *text, int default_port, kvpi_hostport *out);

/* Format host and port as "host:port", bracketing IPv6 literals. */
void kvpi_hostport_format(const char *host, int port, char *buf, size_t len);

/* The listen queue of every listener kvpipe binds: as long as the kernel
 * allows (net.core.somaxconn caps it), so that a burst of strangers
 * connecting at once does not fill it and drop a legitimate client's SYN,
 * which the client would send again only after a second. */
#define KVPI_LISTEN_BACKLOG SOMAXCONN

/* Listen on host:port (port 0: any free port); returns the fd and bound port.
 * SO_REUSEADDR is set so a restarted process can bind again at once.
 * KVP_EBUSY when the address is in use, KVP_EIO for other failures. */
kvp_status kvpi_tcp_listen(const char *host, int port, int *fd_out, int *port_out);

/* Connect with a timeout; the socket gets TCP_NODELAY and I/O timeouts of
 * timeout_ms. */
kvp_status kvpi_tcp_connect(const char *host, int port, int timeout_ms, int *fd_out);

/* Accept one connection and give it I/O timeouts of timeout_ms (0: none). */
kvp_status kvpi_tcp_accept(int listen_fd, int timeout_ms, int *fd_out);

/* Close a connection given up on mid-request with a reset (SO_LINGER 0): the
 * kernel drops what is still queued to send instead of delivering it later.
 * A plain close() of a request that timed out while the link was down sends
 * its bytes once the link is back, and the peer then applies a WRITE its
 * initiator reported failed, over whatever was written since. */
void kvpi_tcp_abort(int fd);

/* Set SO_RCVTIMEO and SO_SNDTIMEO (0: block without limit). */
void kvpi_socket_set_timeout(int fd, int timeout_ms);

/* Send or receive exactly len bytes. KVP_ECONNRESET when the peer closed,
 * KVP_ETIMEDOUT when no byte moved for the socket's timeout, KVP_EINVAL when
 * the kernel could not read or write buf (EFAULT: the memory is not mapped). */
kvp_status kvpi_send_all(int fd, const void *buf, size_t len);
kvp_status kvpi_recv_all(int fd, void *buf, size_t len);

/* The same for a list of buffers, in one system call where the kernel takes
 * it all (a header and its payload, say). iov is modified: each entry left
 * with iov_len 0 was moved completely, also when the call fails. */
struct iovec;
kvp_status kvpi_sendv_all(int fd, struct iovec *iov, int n);
kvp_status kvpi_recvv_all(int fd, struct iovec *iov, int n);

/* The same under a deadline on the whole call: deadline_ns is a point on
 * kvpi_now_ns()'s clock (common/clock.h) by which every byte must have moved,
 * however the peer paces them, else KVP_ETIMEDOUT saying how many bytes were
 * left. A trickling peer cannot stretch it: it bounds total progress, not the
 * gap between bytes. deadline_ns 0: only the socket's own timeouts apply
 * (the functions above). These set the socket's SO_SNDTIMEO / SO_RCVTIMEO to
 * the time left before each system call, so a socket used with them keeps
 * the last such value. */
kvp_status kvpi_send_all_by(int fd, const void *buf, size_t len, uint64_t deadline_ns);
kvp_status kvpi_recv_all_by(int fd, void *buf, size_t len, uint64_t deadline_ns);
kvp_status kvpi_sendv_all_by(int fd, struct iovec *iov, int n, uint64_t deadline_ns);
kvp_status kvpi_recvv_all_by(int fd, struct iovec *iov, int n, uint64_t deadline_ns);

/* ---- The address an engine advertises (docs/transport-tcp.md, "Which
 * address peers are given") ----
 *
 * An engine binds its listeners on one host and gives peers one address
 * (its segment name's host, its rpc_meta): kvpi_advert_choose() decides
 * both, and says why, from
 *  1. forced (kvp_engine_opts.bind_address, else env MC_TCP_BIND_ADDRESS;
 *     forced_by names which): bound and advertised as it is;
 *  2. else the host of local_server_name, when it names one: the same;
 *  3. else (a wildcard, "0.0.0.0" or "::"): bound there, and advertised is
 *     kvpi_host_address()'s pick. */
typedef struct kvpi_advert {
    char host[KVPI_HOST_MAX]; /* advertised */
    char bind[KVPI_HOST_MAX]; /* where the listeners bind */
    char why[512];            /* one line: where host came from */
} kvpi_advert;

kvp_status kvpi_advert_choose(const char *given_host, const char *forced, const char *forced_by,
                              kvpi_advert *out);

/* Whether host is a wildcard address ("0.0.0.0", "::"). */
int kvpi_host_is_wildcard(const char *host);

/* This host's address that peers on other hosts are likeliest to reach, as
 * text, and why (one line naming the interface and what was passed over):
 * an address of the default route's interface, else of another interface
 * that is up, else of a container or virtual bridge (docker*, br-*, veth*,
 * virbr*, cni*, flannel*, cali*, weave*, vxlan*, kube-*, lxcbr*, lxdbr*,
 * podman*, cilium*, tunl*: kvpi_iface_virtual), else loopback. IPv4 before
 * IPv6; never a link-local address. KVP_ENOTFOUND when the host has no
 * address at all (not even loopback), KVP_EIO when interfaces cannot be
 * listed. */
kvp_status kvpi_host_address(char *out, size_t len, char *why, size_t why_len);

/* Whether an interface name is a container or virtual bridge's (above). */
int kvpi_iface_virtual(const char *name);

/* Wake the thread waiting on eventfd fd: add 1 to its counter. A counter
 * at its maximum is woken already. 0, or -1 with errno set. */
int kvpi_eventfd_signal(int fd);

/* Little-endian and big-endian integer codecs for wire headers. */
static inline void kvpi_put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint64_t kvpi_get_le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static inline void kvpi_put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (56 - 8 * i));
}
static inline uint64_t kvpi_get_be64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

#endif
