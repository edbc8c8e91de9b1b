#include "netns.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "servers.h"
#include "test.h"

#define TOOL_TIMEOUT_MS 20000

/* The reason, formatted into why; -1. fail and cfail keep it in a
 * kvpt_netns's or a kvpt_cluster's why. */
static int failf(char *why, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int failf(char *why, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
    return -1;
}
#define fail(n, ...) failf((n)->why, sizeof(n)->why, __VA_ARGS__)
#define cfail(c, ...) failf((c)->why, sizeof(c)->why, __VA_ARGS__)

const char *kvpt_netns_unavailable(void)
{
    if (geteuid() != 0) return "network namespaces need root";
    if (!kvpt_find_binary("ip")) return "ip (iproute2) not found";
    return NULL;
}

/* Run fn(arg) with the calling thread in side's namespace, then return home.
 * A failure to return home is fatal: the rest of the case would run in the
 * wrong namespace. */
static int ns_call(int fd, int home, int (*fn)(void *), void *arg)
{
    if (setns(fd, CLONE_NEWNET) != 0) return -2;
    int r = fn(arg);
    if (setns(home, CLONE_NEWNET) != 0) {
        perror("kvpt_netns: setns back home");
        abort();
    }
    return r;
}

static int in_ns(kvpt_netns *n, int side, int (*fn)(void *), void *arg)
{
    int r = ns_call(n->fd[side], n->home, fn, arg);
    if (r == -2) return fail(n, "setns into side %d: %s", side, strerror(errno));
    return r;
}

typedef struct spawn_args {
    char *const *argv;
    const char *out_path;
    pid_t pid;
} spawn_args;

static int do_spawn(void *arg)
{
    spawn_args *a = arg;
    a->pid = kvpt_spawn(a->argv, a->out_path);
    return a->pid < 0 ? -1 : 0;
}

static pid_t spawn_in(int fd, int home, char *const argv[], const char *out_path)
{
    spawn_args a = {argv, out_path, -1};
    if (ns_call(fd, home, do_spawn, &a) != 0) return -1;
    return a.pid;
}

pid_t kvpt_netns_spawn(kvpt_netns *n, int side, char *const argv[], const char *out_path)
{
    return spawn_in(n->fd[side], n->home, argv, out_path);
}

/* Run tool in the namespace fd and wait for it; its status, or -1 with why. */
static int run_in(int fd, int home, const char *where, const char *tool, const char *const args[],
                  const char *out_path, char *why, size_t why_len)
{
    const char *found = kvpt_find_binary(tool);
    if (!found) {
        snprintf(why, why_len, "%s not found", tool);
        return -1;
    }
    char path[4096], *argv[32] = {path};
    snprintf(path, sizeof path, "%s", found);
    size_t k = 1;
    for (size_t i = 0; args[i] && k < 31; i++)
        argv[k++] = (char *)args[i];
    argv[k] = NULL;
    pid_t pid = spawn_in(fd, home, argv, out_path);
    if (pid < 0) {
        snprintf(why, why_len, "%s: cannot start %s: %s", where, tool, strerror(errno));
        return -1;
    }
    int rc = kvpt_wait_child(pid, TOOL_TIMEOUT_MS);
    if (rc != 0) {
        char cmd[400] = "";
        for (size_t i = 0; args[i]; i++) {
            strncat(cmd, " ", sizeof cmd - strlen(cmd) - 1);
            strncat(cmd, args[i], sizeof cmd - strlen(cmd) - 1);
        }
        snprintf(why, why_len, "%s: %s%s: %s %d", where, tool, cmd,
                 rc < 0 ? "timed out" : "exit status", rc);
    }
    return rc;
}

int kvpt_netns_run(kvpt_netns *n, int side, const char *tool, const char *const args[],
                   const char *out_path)
{
    char where[16];
    snprintf(where, sizeof where, "side %d", side);
    return run_in(n->fd[side], n->home, where, tool, args, out_path, n->why, sizeof n->why);
}

/* Run a tool and fail (-1) unless it exits 0. */
static int run_ok(kvpt_netns *n, int side, const char *tool, const char *const args[])
{
    return kvpt_netns_run(n, side, tool, args, NULL) == 0 ? 0 : -1;
}

typedef struct port_args {
    const char *host;
    int port, timeout_ms;
} port_args;

static int do_wait_port(void *arg)
{
    port_args *a = arg;
    return kvpt_wait_port(a->host, a->port, a->timeout_ms);
}

int kvpt_netns_wait_port(kvpt_netns *n, int side, const char *host, int port, int timeout_ms)
{
    port_args a = {host, port, timeout_ms};
    return in_ns(n, side, do_wait_port, &a);
}

/* A new namespace, held by a descriptor; the thread stays home. */
static int make_ns(int home, char *why, size_t why_len)
{
    if (unshare(CLONE_NEWNET) != 0) {
        snprintf(why, why_len, "unshare(CLONE_NEWNET): %s", strerror(errno));
        return -1;
    }
    int fd = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    int err = errno;
    if (setns(home, CLONE_NEWNET) != 0) {
        perror("kvpt_netns: setns back home");
        abort();
    }
    if (fd < 0) snprintf(why, why_len, "open the new namespace: %s", strerror(err));
    return fd;
}

static int new_ns(kvpt_netns *n)
{
    return make_ns(n->home, n->why, sizeof n->why);
}

int kvpt_netns_create(kvpt_netns *n)
{
    *n = (kvpt_netns){.fd = {-1, -1}, .home = -1};
    n->home = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    if (n->home < 0) return fail(n, "open this namespace: %s", strerror(errno));
    for (int i = 0; i < 2; i++) {
        if ((n->fd[i] = new_ns(n)) < 0) return -1;
        snprintf(n->ifname[i], sizeof n->ifname[i], "kvpf%d%c", (int)getpid() % 100000, 'a' + i);
        snprintf(n->addr[i], sizeof n->addr[i], "10.77.0.%d", i + 1);
    }
    /* ip names the peer's namespace by a path it can open: our descriptor. */
    char peer_ns[64];
    snprintf(peer_ns, sizeof peer_ns, "/proc/%d/fd/%d", (int)getpid(), n->fd[1]);
    const char *add[] = {"link", "add",        n->ifname[0], "type",  "veth", "peer",
                         "name", n->ifname[1], "netns",      peer_ns, NULL};
    if (run_ok(n, 0, "ip", add)) return -1;
    for (int i = 0; i < 2; i++) {
        char cidr[32];
        snprintf(cidr, sizeof cidr, "%s/24", n->addr[i]);
        const char *lo[] = {"link", "set", "lo", "up", NULL};
        const char *addr[] = {"addr", "add", cidr, "dev", n->ifname[i], NULL};
        const char *up[] = {"link", "set", n->ifname[i], "up", NULL};
        if (run_ok(n, i, "ip", lo) || run_ok(n, i, "ip", addr) || run_ok(n, i, "ip", up)) return -1;
    }
    return 0;
}

void kvpt_netns_destroy(kvpt_netns *n)
{
    for (int i = 0; i < 2; i++)
        if (n->fd[i] >= 0) {
            close(n->fd[i]);
            n->fd[i] = -1;
        }
    if (n->home >= 0) {
        close(n->home);
        n->home = -1;
    }
}

/* ---------------------------------------------------------------- faults --- */

#define NFT_TABLE "kvpt_fault"

/* Why tool cannot be used in n (missing: it is not installed; what: its
 * name in the message), or NULL: probe runs on side 0 and drop undoes it. */
static const char *tool_unavailable(kvpt_netns *n, const char *tool, const char *missing,
                                    const char *what, const char *const probe[],
                                    const char *const drop[])
{
    static char why[600];
    if (!kvpt_find_binary(tool)) return missing;
    if (run_ok(n, 0, tool, probe) != 0) {
        snprintf(why, sizeof why, "%s not usable here: %s", what, n->why);
        return why;
    }
    return run_ok(n, 0, tool, drop) ? n->why : NULL;
}

const char *kvpt_net_loss_unavailable(kvpt_netns *n)
{
    const char *probe[] = {"add", "table", "inet", NFT_TABLE "_probe", NULL};
    const char *drop[] = {"delete", "table", "inet", NFT_TABLE "_probe", NULL};
    return tool_unavailable(n, "nft", "nft (nftables) not found", "nftables", probe, drop);
}

int kvpt_net_loss(kvpt_netns *n, int percent)
{
    char pct[16];
    snprintf(pct, sizeof pct, "%d", percent);
    for (int i = 0; i < 2; i++) {
        const char *table[] = {"add", "table", "inet", NFT_TABLE, NULL};
        const char *chain[] = {"add",     "chain", "inet",
                               NFT_TABLE, "input", "{ type filter hook input priority 0 ; }",
                               NULL};
        const char *rule[] = {"add", "rule", "inet", NFT_TABLE, "input",   "numgen", "random",
                              "mod", "100",  "<",    pct,       "counter", "drop",   NULL};
        if (run_ok(n, i, "nft", table) || run_ok(n, i, "nft", chain) || run_ok(n, i, "nft", rule))
            return -1;
    }
    return 0;
}

long kvpt_net_loss_dropped(kvpt_netns *n)
{
    char dir[] = "/tmp/kvpt-nft-XXXXXX";
    if (!mkdtemp(dir)) return fail(n, "mkdtemp: %s", strerror(errno));
    char path[64];
    snprintf(path, sizeof path, "%s/out", dir);
    long total = 0;
    for (int i = 0; i < 2 && total >= 0; i++) {
        const char *list[] = {"list", "table", "inet", NFT_TABLE, NULL};
        if (kvpt_netns_run(n, i, "nft", list, path) != 0) {
            total = -1;
            break;
        }
        FILE *f = fopen(path, "r");
        char line[512];
        long got = -1;
        while (f && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, "counter packets ");
            if (p) got = strtol(p + strlen("counter packets "), NULL, 10);
        }
        if (f) fclose(f);
        total = got < 0 ? fail(n, "side %d: no counter in the nft table", i) : total + got;
    }
    unlink(path);
    rmdir(dir);
    return total;
}

const char *kvpt_net_rate_unavailable(kvpt_netns *n)
{
    const char *probe[] = {"qdisc", "add",   "dev",  "lo",      "root",  "tbf", "rate",
                           "1mbit", "burst", "32kb", "latency", "400ms", NULL};
    const char *drop[] = {"qdisc", "del", "dev", "lo", "root", NULL};
    return tool_unavailable(n, "tc", "tc (iproute2) not found", "tc tbf", probe, drop);
}

int kvpt_net_rate(kvpt_netns *n, int rate_kbit)
{
    char rate[32];
    snprintf(rate, sizeof rate, "%dkbit", rate_kbit);
    for (int i = 0; i < 2; i++) {
        const char *tbf[] = {"qdisc", "add",   "dev",  n->ifname[i], "root",  "tbf", "rate",
                             rate,    "burst", "32kb", "latency",    "400ms", NULL};
        if (run_ok(n, i, "tc", tbf)) return -1;
    }
    return 0;
}

static int link_set(kvpt_netns *n, const char *state)
{
    const char *set[] = {"link", "set", "dev", n->ifname[0], state, NULL};
    return run_ok(n, 0, "ip", set);
}

int kvpt_net_link_down(kvpt_netns *n)
{
    return link_set(n, "down");
}

int kvpt_net_link_up(kvpt_netns *n)
{
    return link_set(n, "up");
}

/* --------------------------------------------------------------- cluster --- */

int kvpt_cluster_run(kvpt_cluster *c, int host, const char *tool, const char *const args[],
                     const char *out_path)
{
    char where[24];
    if (host < 0)
        snprintf(where, sizeof where, "bridge");
    else
        snprintf(where, sizeof where, "host %d", host);
    int fd = host < 0 ? c->bridge : c->fd[host];
    return run_in(fd, c->home, where, tool, args, out_path, c->why, sizeof c->why);
}

static int crun(kvpt_cluster *c, int host, const char *const args[])
{
    return kvpt_cluster_run(c, host, "ip", args, NULL) == 0 ? 0 : -1;
}

int kvpt_cluster_create(kvpt_cluster *c, int hosts, int net)
{
    *c = (kvpt_cluster){.home = -1, .bridge = -1};
    for (int i = 0; i < KVPT_CLUSTER_MAX; i++)
        c->fd[i] = -1;
    if (hosts < 1 || hosts > KVPT_CLUSTER_MAX)
        return cfail(c, "%d hosts: 1..%d", hosts, KVPT_CLUSTER_MAX);
    if (net < 1 || net > 254) return cfail(c, "network 10.%d: 1..254", net);
    c->home = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    if (c->home < 0) return cfail(c, "open this namespace: %s", strerror(errno));
    if ((c->bridge = make_ns(c->home, c->why, sizeof c->why)) < 0) goto fail;
    const char *br[] = {"link", "add", "br0", "type", "bridge", NULL};
    const char *brup[] = {"link", "set", "br0", "up", NULL};
    if (crun(c, -1, br) || crun(c, -1, brup)) goto fail;
    for (int i = 0; i < hosts; i++) {
        if ((c->fd[i] = make_ns(c->home, c->why, sizeof c->why)) < 0) goto fail;
        c->hosts = i + 1;
        snprintf(c->addr[i], sizeof c->addr[i], "10.%d.%d.%d", net, (i + 1) / 250, (i + 1) % 250);
        char port[16], peer_ns[64], cidr[32];
        snprintf(port, sizeof port, "h%d", i);
        snprintf(peer_ns, sizeof peer_ns, "/proc/%d/fd/%d", (int)getpid(), c->fd[i]);
        snprintf(cidr, sizeof cidr, "%s/16", c->addr[i]);
        const char *add[] = {"link", "add",  port,    "type",  "veth", "peer",
                             "name", "eth0", "netns", peer_ns, NULL};
        const char *master[] = {"link", "set", port, "master", "br0", "up", NULL};
        const char *lo[] = {"link", "set", "lo", "up", NULL};
        const char *addr[] = {"addr", "add", cidr, "dev", "eth0", NULL};
        const char *up[] = {"link", "set", "eth0", "up", NULL};
        if (crun(c, -1, add) || crun(c, -1, master) || crun(c, i, lo) || crun(c, i, addr) ||
            crun(c, i, up))
            goto fail;
    }
    return 0;
fail:;
    char why[sizeof c->why];
    memcpy(why, c->why, sizeof why);
    kvpt_cluster_destroy(c);
    memcpy(c->why, why, sizeof why);
    return -1;
}

void kvpt_cluster_destroy(kvpt_cluster *c)
{
    for (int i = 0; i < KVPT_CLUSTER_MAX; i++)
        if (c->fd[i] >= 0) {
            close(c->fd[i]);
            c->fd[i] = -1;
        }
    if (c->bridge >= 0) close(c->bridge);
    if (c->home >= 0) close(c->home);
    c->bridge = c->home = -1;
    c->hosts = 0;
}

pid_t kvpt_cluster_spawn(kvpt_cluster *c, int host, char *const argv[], const char *out_path)
{
    if (host < 0 || host >= c->hosts) return cfail(c, "no host %d", host);
    pid_t pid = spawn_in(c->fd[host], c->home, argv, out_path);
    if (pid < 0) cfail(c, "host %d: cannot start %s: %s", host, argv[0], strerror(errno));
    return pid;
}

int kvpt_cluster_wait_port(kvpt_cluster *c, int host, const char *addr, int port, int timeout_ms)
{
    port_args a = {addr, port, timeout_ms};
    int r = ns_call(c->fd[host], c->home, do_wait_port, &a);
    if (r == -2) return cfail(c, "setns into host %d: %s", host, strerror(errno));
    if (r != 0) cfail(c, "nothing answers on %s:%d within %d ms", addr, port, timeout_ms);
    return r;
}

int kvpt_cluster_link(kvpt_cluster *c, int host, int up)
{
    char port[16];
    snprintf(port, sizeof port, "h%d", host);
    const char *state = up ? "up" : "down";
    const char *in_host[] = {"link", "set", "dev", "eth0", state, NULL};
    const char *on_bridge[] = {"link", "set", "dev", port, state, NULL};
    if (up) return crun(c, -1, on_bridge) || crun(c, host, in_host) ? -1 : 0;
    return crun(c, host, in_host) || crun(c, -1, on_bridge) ? -1 : 0;
}

int kvpt_cluster_rate(kvpt_cluster *c, int host, int rate_kbit)
{
    char port[16], rate[32];
    snprintf(port, sizeof port, "h%d", host);
    snprintf(rate, sizeof rate, "%dkbit", rate_kbit);
    for (int side = 0; side < 2; side++) {
        const char *dev = side ? port : "eth0";
        int where = side ? -1 : host;
        const char *del[] = {"qdisc", "del", "dev", dev, "root", NULL};
        const char *tbf[] = {"qdisc", "replace", "dev",  dev,       "root",  "tbf", "rate",
                             rate,    "burst",   "32kb", "latency", "400ms", NULL};
        int rc = kvpt_cluster_run(c, where, "tc", rate_kbit > 0 ? tbf : del, NULL);
        if (rc != 0) return -1;
    }
    return 0;
}

pid_t kvpt_cluster_etcd(kvpt_cluster *c, int host, const char *dir, int port, int peer_port)
{
    const char *bin = kvpt_find_binary("etcd");
    if (!bin) {
        snprintf(c->why, sizeof c->why, "etcd not found (Debian: etcd-server)");
        return -1;
    }
    char data[128], log[128], err[128];
    snprintf(data, sizeof data, "%s/etcd", dir);
    snprintf(log, sizeof log, "%s/etcd.log", dir);
    snprintf(err, sizeof err, "%s/etcd.err", dir);
    static const char *const zap[] = {"--logger", "zap", "--log-outputs", "stdout", NULL};
    kvpt_etcd_args a;
    kvpt_etcd_args_make(&a, bin, c->addr[host], port, peer_port, data, zap);
    /* etcd's own stderr (gRPC's warnings) to a log of its own too */
    int efd = open(err, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644), saved = dup(2);
    if (efd >= 0) dup2(efd, 2);
    pid_t pid = kvpt_cluster_spawn(c, host, a.argv, log);
    if (saved >= 0) dup2(saved, 2), close(saved);
    if (efd >= 0) close(efd);
    if (pid < 0) return -1;
    if (kvpt_cluster_wait_port(c, host, c->addr[host], port, 30000) == 0) return pid;
    kill(pid, SIGKILL);
    kvpt_wait_child(pid, 5000);
    return -1;
}
