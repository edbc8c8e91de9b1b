/* Two network namespaces joined by a veth pair, and network faults between
 * them, for the reliability suite (tests/faults/net_*_test.c).
 *
 * The namespaces are anonymous: this process holds each by a file descriptor
 * and gives it no name under /run/netns. A namespace, and the veth end in it,
 * goes away when its last holder is gone: this process and every process
 * started in it. So nothing is left behind when a case fails, crashes or is
 * killed by its alarm (kvpt_run kills the case's whole process group), and
 * nothing is ever added to the namespace the test runs in, so concurrent
 * tests cannot collide: each pair has its own addresses and ports.
 *
 * Side 0 is 10.77.0.1/24 on veth "kvpf<pid>a", side 1 is 10.77.0.2/24 on
 * "kvpf<pid>b"; loopback is up in both. Tools (ip, nft, tc) are found in PATH,
 * /usr/bin and /usr/sbin and run inside the namespace.
 *
 * Not thread-safe: spawning switches the calling thread's namespace for the
 * moment of the fork. Call from the case's main thread.
 */
#ifndef KVPT_NETNS_H
#define KVPT_NETNS_H

#include <sys/types.h>

typedef struct kvpt_netns {
    int fd[2];          /* the two namespaces */
    int home;           /* the namespace this process runs in */
    char ifname[2][16]; /* the veth end in each */
    char addr[2][16];   /* its IPv4 address */
    char why[512];      /* reason of the last failure */
} kvpt_netns;

/* NULL when namespaces and veth pairs can be made here (root, `ip` found);
 * otherwise the reason, for SKIP. */
const char *kvpt_netns_unavailable(void);

/* Make the pair and bring it up. 0, or -1 with the reason in n->why. */
int kvpt_netns_create(kvpt_netns *n);

/* Close the namespaces (they go once their processes have exited). Safe on a
 * pair whose create failed, and twice. */
void kvpt_netns_destroy(kvpt_netns *n);

/* kvpt_spawn() of argv (argv[0] a path) inside side's namespace. */
pid_t kvpt_netns_spawn(kvpt_netns *n, int side, char *const argv[], const char *out_path);

/* Run tool (a name looked up as above) with args (NULL-terminated, without
 * argv[0]) inside side's namespace, stdout to out_path (NULL: inherit), and
 * wait at most 20 s. Returns its exit status, or -1 with n->why set. */
int kvpt_netns_run(kvpt_netns *n, int side, const char *tool, const char *const args[],
                   const char *out_path);

/* kvpt_wait_port() from inside side's namespace. */
int kvpt_netns_wait_port(kvpt_netns *n, int side, const char *host, int port, int timeout_ms);

/* ---------------------------------------------------------------- faults --- */

/* NULL when nftables works in these namespaces (nft found, the kernel has
 * nf_tables); otherwise the reason, for SKIP. */
const char *kvpt_net_loss_unavailable(kvpt_netns *n);

/* Drop percent % of the IP packets each side receives, at random (an
 * nftables rule `numgen random mod 100 < percent` with a counter, in the
 * input hook of both namespaces): loss in both directions. 0 or -1 (why). */
int kvpt_net_loss(kvpt_netns *n, int percent);

/* Packets the loss rules have dropped so far, both sides; -1 (why). */
long kvpt_net_loss_dropped(kvpt_netns *n);

/* NULL when tc's token bucket filter (sch_tbf) works here; else the reason. */
const char *kvpt_net_rate_unavailable(kvpt_netns *n);

/* Limit both veth ends to rate_kbit kbit/s with a token bucket filter
 * (bursts of 32 KiB, packets queued up to 400 ms). 0 or -1 (why). */
int kvpt_net_rate(kvpt_netns *n, int rate_kbit);

/* Take side 0's veth end down (both directions stop: the peer loses carrier)
 * or bring it up again. 0 or -1 (why). */
int kvpt_net_link_down(kvpt_netns *n);
int kvpt_net_link_up(kvpt_netns *n);

#endif
