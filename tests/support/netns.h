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

/* --------------------------------------------------------------- cluster --- */

/* A cluster: hosts network namespaces on one Linux bridge, every one with its
 * own address, for the many-to-many harness (bench/xpyd.c,
 * docs/scale-out.md). The bridge lives in a namespace of its own too, and all
 * of them are anonymous as above: nothing is added to the namespace this
 * process runs in, and everything goes when this process and the processes
 * started in the hosts are gone (each is killed when this process dies:
 * PR_SET_PDEATHSIG).
 *
 * Host i is 10.<net>.0.<i+1>/16 on "eth0" inside its namespace; the other end
 * of its veth pair, "h<i>", is a port of bridge "br0". Not thread-safe, as
 * above. */
#define KVPT_CLUSTER_MAX 64

typedef struct kvpt_cluster {
    int home;                        /* the namespace this process runs in */
    int bridge;                      /* the namespace holding br0 */
    int hosts;                       /* number of hosts */
    int fd[KVPT_CLUSTER_MAX];        /* each host's namespace */
    char addr[KVPT_CLUSTER_MAX][16]; /* each host's IPv4 address */
    char why[512];                   /* reason of the last failure */
} kvpt_cluster;

/* Make the bridge and hosts hosts (1..KVPT_CLUSTER_MAX) on 10.net.0.0/16
 * (net 1..254), all up. 0, or -1 with the reason in c->why (what was made is
 * released). */
int kvpt_cluster_create(kvpt_cluster *c, int hosts, int net);

/* Release the namespaces (they go once their processes have exited). Safe on
 * a failed create and twice. */
void kvpt_cluster_destroy(kvpt_cluster *c);

/* kvpt_spawn() of argv inside host's namespace; its pid or -1 (why). */
pid_t kvpt_cluster_spawn(kvpt_cluster *c, int host, char *const argv[], const char *out_path);

/* kvpt_wait_port() from inside host's namespace. */
int kvpt_cluster_wait_port(kvpt_cluster *c, int host, const char *addr, int port, int timeout_ms);

/* A real etcd on host (a member of its own, clients at the host's address
 * and port, peers at peer_port), its data and logs in dir; waits until it
 * listens. Its pid, or -1 (why). */
pid_t kvpt_cluster_etcd(kvpt_cluster *c, int host, const char *dir, int port, int peer_port);

/* Run tool with args inside host's namespace (host -1: the bridge's), as
 * kvpt_netns_run(). */
int kvpt_cluster_run(kvpt_cluster *c, int host, const char *tool, const char *const args[],
                     const char *out_path);

/* Take host's link down (its veth end in the host and its bridge port: the
 * host is cut off both ways) or bring it up again. 0 or -1 (why). */
int kvpt_cluster_link(kvpt_cluster *c, int host, int up);

/* Limit host's traffic both ways to rate_kbit kbit/s with a token bucket
 * filter on both ends of its veth pair (bursts of 32 KiB, 400 ms of queue);
 * rate_kbit 0 removes the limit. 0 or -1 (why). */
int kvpt_cluster_rate(kvpt_cluster *c, int host, int rate_kbit);

#endif
