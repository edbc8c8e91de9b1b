/* The address an engine gives its peers on a multi-homed host (issue 23
 * item 5; Mooncake #1938, vLLM #42023): never a container bridge's or
 * loopback while a routable address exists; MC_TCP_BIND_ADDRESS and
 * kvp_engine_opts.bind_address force it; the choice is logged and `kvpipe
 * info` shows it.
 *
 * In a kvpt_netns pair, side 0 (the target's host) gets a "docker0" (a veth
 * end, up, with carrier) with 172.17.0.1/16 and an interface index below
 * the routable veth's, so it comes first in the host's interface list (Mooncake's pick, the first
 * interface other than lo, takes it); its routable address is the veth's 10.77.0.1. A `kvpipe bench
 * --mode target` named 0.0.0.0:PORT must name its segment 10.77.0.1:PORT and publish that host in
 * the metadata store, and an initiator on side 1 must move verified bytes through it. With a
 * default route through the veth and a decoy interface (eth9, up) listed before it, the default
 * route's interface wins. MC_TCP_BIND_ADDRESS=10.77.0.1 with local_server_name 172.17.0.1:PORT (a
 * caller that picked the bridge) gives and binds 10.77.0.1.
 *
 * Cases without namespaces check the option itself in this process: it
 * beats the env var, replaces the host of the name, is logged with its
 * reason, and a port or wildcard in it is refused. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/net.h"
#include "kvpipe/info.h"
#include "kvpipe/log.h"
#include "netns.h"
#include "test.h"

#define STORE_PORT 18411
#define TARGET_PORT 18412
#define INITIATOR_PORT 18413
#define START_MS 15000

static void rm_dir(const char *dir)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "  cannot remove %s\n", dir);
}

/* A veth pair inside side 0, one end named name with index idx and addr
 * (cidr), the other (peer, no address) up too, so that name has carrier.
 * Namespaces here may lack the dummy and bridge link types; veth they
 * have. */
static int add_iface(kvpt_netns *n, const char *name, int idx, const char *peer, const char *cidr)
{
    char index[8], pindex[8];
    snprintf(index, sizeof index, "%d", idx);
    snprintf(pindex, sizeof pindex, "%d", idx + 100);
    const char *add[] = {"link", "add",  name, "index", index,  "type", "veth",
                         "peer", "name", peer, "index", pindex, NULL};
    const char *addr[] = {"addr", "add", cidr, "dev", name, NULL};
    const char *up[] = {"link", "set", name, "up", NULL};
    const char *pup[] = {"link", "set", peer, "up", NULL};
    if (kvpt_netns_run(n, 0, "ip", add, NULL) || kvpt_netns_run(n, 0, "ip", addr, NULL) ||
        kvpt_netns_run(n, 0, "ip", up, NULL) || kvpt_netns_run(n, 0, "ip", pup, NULL))
        return -1;
    return 0;
}

/* Side 0 as a multi-homed host: docker0 (index 2), then with decoy eth9
 * (index 3), both up, listed before the routable veth end; with route, a
 * default route through the veth. The veth end was made in side 0 with its
 * lowest free index: it goes to side 1 while the others take the low
 * indexes, and comes back behind them (a moved link keeps its index unless
 * it is taken where it goes), its address put back. */
static int make_host(kvpt_netns *n, int decoy, int route)
{
    char ns[2][64], cidr[32];
    for (int i = 0; i < 2; i++)
        snprintf(ns[i], sizeof ns[i], "/proc/%d/fd/%d", (int)getpid(), n->fd[i]);
    snprintf(cidr, sizeof cidr, "%s/24", n->addr[0]);
    const char *away[] = {"link", "set", n->ifname[0], "netns", ns[1], NULL};
    const char *back[] = {"link", "set", n->ifname[0], "netns", ns[0], NULL};
    const char *addr[] = {"addr", "add", cidr, "dev", n->ifname[0], NULL};
    const char *up[] = {"link", "set", n->ifname[0], "up", NULL};
    if (kvpt_netns_run(n, 0, "ip", away, NULL) ||
        add_iface(n, "docker0", 2, "kvpd0", "172.17.0.1/16") ||
        (decoy && add_iface(n, "eth9", 3, "kvpd9", "192.168.250.1/24")) ||
        kvpt_netns_run(n, 1, "ip", back, NULL) || kvpt_netns_run(n, 0, "ip", addr, NULL) ||
        kvpt_netns_run(n, 0, "ip", up, NULL))
        return -1;
    if (route) {
        const char *r[] = {"route", "add", "default", "via", n->addr[1], NULL};
        if (kvpt_netns_run(n, 0, "ip", r, NULL)) return -1;
    }
    return 0;
}

/* The first line of path starting with prefix, copied to out; 0 if found. */
static int line_after(const char *path, const char *prefix, char *out, size_t len)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[2048];
    int found = -1;
    while (found && fgets(line, sizeof line, f)) {
        char *at = strstr(line, prefix);
        if (!at) continue;
        snprintf(out, len, "%s", at + strlen(prefix));
        out[strcspn(out, "\n")] = '\0';
        found = 0;
    }
    fclose(f);
    return found;
}

/* A metadata server and a bench target on side 0, named local_name (with
 * env MC_TCP_BIND_ADDRESS = forced when set), an initiator on side 1 that
 * READs and WRITEs through whatever the target published; the target's
 * segment name must be want_host:TARGET_PORT and `kvpipe info` on side 0
 * must name want_host. */
static void run_case(int decoy, int route, const char *local_host, const char *forced,
                     const char *want_host)
{
    const char *why = kvpt_netns_unavailable();
    if (why) SKIP("%s", why);
    kvpt_netns n;
    if (kvpt_netns_create(&n) != 0) {
        fprintf(stderr, "  %s\n", n.why);
        kvpt_netns_destroy(&n);
        REQUIRE(0);
    }
    if (make_host(&n, decoy, route) != 0) {
        fprintf(stderr, "  %s\n", n.why);
        kvpt_netns_destroy(&n);
        REQUIRE(0);
    }
    char dir[] = "/tmp/kvpt_advXXXXXX";
    REQUIRE(mkdtemp(dir));
    /* The host's addresses in interface order (getifaddrs's): docker0's
     * must come before the routable one, or the case proves nothing. */
    char path[256], line[2048];
    snprintf(path, sizeof path, "%s/addrs.out", dir);
    const char *lsa[] = {"-o", "-4", "addr", "show", NULL};
    CHECK(kvpt_netns_run(&n, 0, "ip", lsa, path) == 0);
    FILE *f = fopen(path, "r");
    int docker_at = -1, veth_at = -1, k = 0;
    while (f && fgets(line, sizeof line, f)) {
        fprintf(stderr, "    %s", line);
        if (strstr(line, " docker0 ")) docker_at = k;
        if (strstr(line, n.addr[0])) veth_at = k;
        k++;
    }
    if (f) fclose(f);
    CHECK(docker_at >= 0 && veth_at > docker_at);

    char cli[512], store_port[16], url[128], name[64], seg[128] = "", out[2048];
    snprintf(cli, sizeof cli, "%s", kvpt_cli());
    snprintf(store_port, sizeof store_port, "%d", STORE_PORT);
    snprintf(url, sizeof url, "http://%s:%d/metadata", n.addr[0], STORE_PORT);
    char *store[] = {cli, "metadata-server", "--host", n.addr[0], "--port", store_port, NULL};
    snprintf(path, sizeof path, "%s/store.out", dir);
    pid_t st = kvpt_netns_spawn(&n, 0, store, path);
    CHECK(st > 0 && kvpt_netns_wait_port(&n, 0, n.addr[0], STORE_PORT, START_MS) == 0);

    snprintf(name, sizeof name, "%s:%d", local_host, TARGET_PORT);
    char *target[] = {cli,
                      "bench",
                      "--mode",
                      "target",
                      "--metadata-server",
                      url,
                      "--local-server-name",
                      name,
                      "--buffer-size",
                      "1M",
                      "--verify",
                      "--no-shm",
                      NULL};
    snprintf(path, sizeof path, "%s/target.out", dir);
    if (forced) setenv("MC_TCP_BIND_ADDRESS", forced, 1);
    setenv("KVPIPE_LOG", "info", 1);
    pid_t tg = kvpt_netns_spawn(&n, 0, target, path);
    unsetenv("KVPIPE_LOG");
    uint64_t until = kvpi_now_ms() + START_MS;
    while (tg > 0 && line_after(path, "serving segment ", out, sizeof out) && kvpi_now_ms() < until)
        usleep(50000);
    sscanf(out, "%127s", seg);
    char want[128];
    snprintf(want, sizeof want, "%s:%d", want_host, TARGET_PORT);
    fprintf(stderr, "  local_server_name %s%s%s: segment %s (want %s)\n", name,
            forced ? ", MC_TCP_BIND_ADDRESS=" : "", forced ? forced : "", seg, want);
    CHECK(strcmp(seg, want) == 0);

    /* `kvpipe info` on that host says the same, and why. */
    char *info[] = {cli, "info", NULL};
    snprintf(path, sizeof path, "%s/info.out", dir);
    pid_t ip = kvpt_netns_spawn(&n, 0, info, path);
    if (forced) unsetenv("MC_TCP_BIND_ADDRESS");
    CHECK(ip > 0 && kvpt_wait_child(ip, 20000) == 0);
    f = fopen(path, "r");
    char shown[2048] = "";
    int next = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (next) {
            snprintf(shown, sizeof shown, "%s", line);
            break;
        }
        next = strncmp(line, "address given to peers", 22) == 0;
    }
    if (f) fclose(f);
    shown[strcspn(shown, "\n")] = '\0';
    fprintf(stderr, "  kvpipe info:%s\n", shown);
    char head[160];
    snprintf(head, sizeof head, "  %s: ", want_host);
    CHECK(strncmp(shown, head, strlen(head)) == 0);
    if (!forced) CHECK(strstr(shown, "passed over 172.17.0.1 on docker0") != NULL);

    /* A peer on the other host reaches it through what was published. */
    char iname[64];
    snprintf(iname, sizeof iname, "%s:%d", n.addr[1], INITIATOR_PORT);
    const char *ops[] = {"read", "write"}; /* the READ checks the target's own pattern */
    for (k = 0; k < 2 && seg[0]; k++) {
        char *ini[] = {cli,
                       "bench",
                       "--mode",
                       "initiator",
                       "--metadata-server",
                       url,
                       "--local-server-name",
                       iname,
                       "--segment-id",
                       seg,
                       "--operation",
                       (char *)ops[k],
                       "--block-size",
                       "64K",
                       "--batch-size",
                       "4",
                       "--threads",
                       "1",
                       "--buffer-size",
                       "1M",
                       "--duration",
                       "0.5",
                       "--verify",
                       "--no-shm",
                       NULL};
        snprintf(path, sizeof path, "%s/initiator_%s.out", dir, ops[k]);
        pid_t in = kvpt_netns_spawn(&n, 1, ini, path);
        int rc = in > 0 ? kvpt_wait_child(in, 30000) : -1;
        out[0] = '\0';
        line_after(path, "kvpipe bench", out, sizeof out);
        fprintf(stderr, "  initiator %s from side 1: exit %d: %.200s\n", ops[k], rc, out);
        CHECK(rc == 0);
    }
    if (tg > 0) {
        kill(tg, SIGTERM);
        CHECK(kvpt_wait_child(tg, 20000) == 0); /* --verify: what was written is intact */
    }
    if (st > 0) {
        kill(st, SIGTERM);
        kvpt_wait_child(st, 10000);
    }
    kvpt_netns_destroy(&n);
    rm_dir(dir);
}

/* A wildcard name on a host whose first interface is docker0 and that has
 * no default route: the veth's address, not the bridge's. */
static void wildcard_skips_bridge(void)
{
    run_case(0, 0, "0.0.0.0", NULL, "10.77.0.1");
}

/* A default route through the veth, and an up interface (eth9) listed
 * before it: the default route's interface. */
static void wildcard_takes_default_route(void)
{
    run_case(1, 1, "0.0.0.0", NULL, "10.77.0.1");
}

/* A caller that named the bridge's address (as an auto-detection may):
 * MC_TCP_BIND_ADDRESS puts the routable one in its place. */
static void env_forces_address(void)
{
    run_case(0, 0, "172.17.0.1", "10.77.0.1", "10.77.0.1");
}

/* ------------------------------------------------ in this process --- */

static char logged[1024];

static void keep_line(void *user, const kvp_log_record *r)
{
    (void)user;
    if (strstr(r->message, "peers are given")) snprintf(logged, sizeof logged, "%s", r->message);
}

static kvp_status make(const char *name, const char *bind, kvp_engine **e)
{
    kvp_engine_opts o;
    kvp_engine_opts_init(&o);
    o.local_server_name = name;
    o.metadata = "P2PHANDSHAKE";
    o.disable_shm = 1;
    o.bind_address = bind;
    return kvp_engine_create(&o, e);
}

/* The option beats the env var and replaces the name's host, bound and
 * given; the log line says so. */
static void option_forces_address(void)
{
    setenv("MC_TCP_BIND_ADDRESS", "192.0.2.254", 1); /* not this host's: would fail */
    kvp_log_set_level(KVP_LOG_INFO);
    kvp_log_set_handler(keep_line, NULL);
    kvp_engine *e = NULL;
    REQUIRE_OK(make("0.0.0.0:0", "127.0.0.1", &e));
    char want[64];
    snprintf(want, sizeof want, "127.0.0.1:%d", kvp_engine_rpc_port(e));
    CHECK(strcmp(kvp_engine_segment_name(e), want) == 0);
    fprintf(stderr, "  segment %s; logged: %s\n", kvp_engine_segment_name(e), logged);
    CHECK(strstr(logged, "set by kvp_engine_opts.bind_address") != NULL);
    /* Bound there: the data port answers on 127.0.0.1. */
    CHECK(kvpt_wait_port("127.0.0.1", kvp_engine_data_port(e), 2000) == 0);
    kvp_engine_destroy(e);
    /* Without the option, the env var's (foreign) address is taken: and
     * cannot be bound. */
    CHECK(make("127.0.0.1:0", NULL, &e) != KVP_OK);
    fprintf(stderr, "  MC_TCP_BIND_ADDRESS=192.0.2.254: %s\n", kvp_last_error());
    CHECK(strstr(kvp_last_error(), "192.0.2.254") != NULL);
    unsetenv("MC_TCP_BIND_ADDRESS");
    kvp_log_set_handler(NULL, NULL);
}

/* A port or a wildcard in the option is refused, saying which. */
static void option_refuses_bad_values(void)
{
    kvp_engine *e = NULL;
    const char *bad[] = {"127.0.0.1:5000", "0.0.0.0", "::", "[::1]:1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_ST(make("127.0.0.1:0", bad[i], &e), KVP_EINVAL);
        CHECK(strstr(kvp_last_error(), "bind_address") != NULL);
    }
    /* An explicit host in the name stays as given. */
    REQUIRE_OK(make("127.0.0.1:0", NULL, &e));
    CHECK(strncmp(kvp_engine_segment_name(e), "127.0.0.1:", 10) == 0);
    kvp_engine_destroy(e);
}

/* The choice itself, on this host: never loopback or a bridge while
 * another address is up (the test machine has one, or says why not). */
static void host_address_here(void)
{
    char addr[64], why[512];
    REQUIRE_OK(kvpi_host_address(addr, sizeof addr, why, sizeof why));
    fprintf(stderr, "  %s: %s\n", addr, why);
    CHECK(strncmp(addr, "127.", 4) != 0 || strstr(why, "loopback: no other") != NULL);
    CHECK(kvpi_iface_virtual("docker0") && kvpi_iface_virtual("br-1a2b") &&
          kvpi_iface_virtual("veth12") && kvpi_iface_virtual("virbr0") &&
          kvpi_iface_virtual("cni0") && kvpi_iface_virtual("flannel.1"));
    CHECK(!kvpi_iface_virtual("eth0") && !kvpi_iface_virtual("ens108np0") &&
          !kvpi_iface_virtual("bond0") && !kvpi_iface_virtual("br0"));
}

int main(void)
{
    RUN_T(host_address_here, 30);
    RUN_T(option_forces_address, 60);
    RUN_T(option_refuses_bad_values, 60);
    RUN_T(wildcard_skips_bridge, 120);
    RUN_T(wildcard_takes_default_route, 120);
    RUN_T(env_forces_address, 120);
    return kvpt_summary();
}
