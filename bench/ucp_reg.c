/* ucp_reg: the UCP baseline on the application's memory, for bench/run.sh's
 * ucx section.
 *
 * ucx_perftest moves buffers that UCX allocated itself (ucp_mem_map with
 * UCP_MEM_MAP_ALLOCATE); over UCX's shared memory a peer then maps them and
 * copies directly, the responder idle. kvpipe registers memory it was given
 * (ucp_mem_map of an existing range), which UCX 1.13 serves over shared
 * memory by emulation instead. This program is ucx_perftest's loop on such
 * memory: a responder process maps one block (mmap), registers it and
 * progresses its worker; the initiator (this process) connects with peer
 * error handling (as kvpipe's endpoints), and for --duration seconds either
 * reads the block with ucp_get_nbx, one request in flight, progressing until
 * it completes (--op get, the default), or writes it with ucp_put_nbx, 32 in
 * flight, then a flush (--op put). UCX_TLS and the other UCX settings come
 * from the environment. Prints one JSON line {"gbps": ..., "bytes": ...};
 * gbps is decimal GB/s. */
#include <errno.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#define PUT_DEPTH 32

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what, ucs_status_t st)
{
    fprintf(stderr, "ucp_reg: %s: %s\n", what, ucs_status_string(st));
    exit(1);
}

static int write_all(int fd, const void *p, size_t n)
{
    for (const char *c = p; n > 0;) {
        ssize_t k = write(fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        c += k, n -= (size_t)k;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    for (char *c = p; n > 0;) {
        ssize_t k = read(fd, c, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        c += k, n -= (size_t)k;
    }
    return 0;
}

/* A length-prefixed blob over fd. */
static int send_blob(int fd, const void *p, uint64_t n)
{
    return write_all(fd, &n, sizeof n) || write_all(fd, p, n) ? -1 : 0;
}

static void *recv_blob(int fd, uint64_t *n)
{
    if (read_all(fd, n, sizeof *n) || *n > (1u << 20)) return NULL;
    void *p = malloc(*n ? *n : 1);
    if (p && read_all(fd, p, *n)) {
        free(p);
        return NULL;
    }
    return p;
}

static void start(ucp_context_h *ctx, ucp_worker_h *w)
{
    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
    ucs_status_t st = ucp_init(&cp, NULL, ctx);
    if (st != UCS_OK) die("ucp_init", st);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((st = ucp_worker_create(*ctx, &wp, w)) != UCS_OK) die("ucp_worker_create", st);
}

static void *map_block(size_t block)
{
    void *p = mmap(NULL, block, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
    if (p == MAP_FAILED) {
        perror("ucp_reg: mmap");
        exit(1);
    }
    memset(p, 0x5a, block);
    return p;
}

/* The responder: register one block, publish it, progress until told. */
static void responder(int fd, size_t block)
{
    ucp_context_h ctx;
    ucp_worker_h w;
    start(&ctx, &w);
    void *buf = map_block(block);
    ucp_mem_map_params_t mp = {.field_mask =
                                   UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = buf,
                               .length = block};
    ucp_mem_h memh;
    ucs_status_t st = ucp_mem_map(ctx, &mp, &memh);
    if (st != UCS_OK) die("ucp_mem_map", st);
    void *rkey, *addr;
    size_t rkey_len, addr_len;
    if ((st = ucp_rkey_pack(ctx, memh, &rkey, &rkey_len)) != UCS_OK) die("ucp_rkey_pack", st);
    ucp_address_t *wa;
    if ((st = ucp_worker_get_address(w, &wa, &addr_len)) != UCS_OK) die("worker address", st);
    addr = wa;
    uint64_t where = (uint64_t)(uintptr_t)buf;
    if (send_blob(fd, addr, addr_len) || send_blob(fd, rkey, rkey_len) ||
        write_all(fd, &where, sizeof where))
        exit(1);
    ucp_rkey_buffer_release(rkey);
    ucp_worker_release_address(w, wa);
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    for (;;) {
        for (int i = 0; i < 1024; i++)
            ucp_worker_progress(w);
        if (poll(&pfd, 1, 0) != 0) break; /* a byte or EOF: done */
    }
    ucp_mem_unmap(ctx, memh);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    munmap(buf, block);
    exit(0);
}

static void ep_failed(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)arg, (void)ep;
    die("the endpoint failed", st);
}

static ucs_status_t wait_for(ucp_worker_h w, ucs_status_ptr_t r)
{
    if (!UCS_PTR_IS_PTR(r)) return UCS_PTR_STATUS(r);
    ucs_status_t st;
    while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS)
        ucp_worker_progress(w);
    ucp_request_free(r);
    return st;
}

int main(int argc, char **argv)
{
    size_t block = 65536;
    double duration = 5;
    int put = 0;
    static const struct option longs[] = {{"block-size", required_argument, NULL, 'b'},
                                          {"duration", required_argument, NULL, 'd'},
                                          {"op", required_argument, NULL, 'o'},
                                          {NULL, 0, NULL, 0}};
    for (int c; (c = getopt_long(argc, argv, "", longs, NULL)) != -1;) {
        if (c == 'b')
            block = strtoull(optarg, NULL, 0);
        else if (c == 'd')
            duration = atof(optarg);
        else if (c == 'o' && (!strcmp(optarg, "get") || !strcmp(optarg, "put")))
            put = optarg[1] == 'u';
        else {
            fprintf(stderr, "usage: ucp_reg [--block-size BYTES] [--duration S] [--op get|put]\n");
            return 2;
        }
    }
    if (block == 0 || duration <= 0) {
        fprintf(stderr, "ucp_reg: --block-size and --duration must be positive\n");
        return 2;
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
        perror("ucp_reg: socketpair");
        return 1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("ucp_reg: fork");
        return 1;
    }
    if (pid == 0) {
        close(sv[0]);
        responder(sv[1], block);
    }
    close(sv[1]);
    uint64_t addr_len, rkey_len, remote;
    void *addr = recv_blob(sv[0], &addr_len);
    void *rkey_buf = addr ? recv_blob(sv[0], &rkey_len) : NULL;
    if (!rkey_buf || read_all(sv[0], &remote, sizeof remote)) {
        fprintf(stderr, "ucp_reg: the responder did not start\n");
        return 1;
    }
    ucp_context_h ctx;
    ucp_worker_h w;
    start(&ctx, &w);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_failed}};
    ucp_ep_h e;
    ucs_status_t st = ucp_ep_create(w, &ep, &e);
    if (st != UCS_OK) die("ucp_ep_create", st);
    ucp_rkey_h rkey;
    if ((st = ucp_ep_rkey_unpack(e, rkey_buf, &rkey)) != UCS_OK) die("ucp_ep_rkey_unpack", st);
    char *local = map_block(block);
    ucp_request_param_t prm = {0};
    uint64_t bytes = 0;
    /* A warm-up of a tenth of the time, as ucx_perftest's -w. */
    for (int round = 0; round < 2; round++) {
        double t0 = now(), end = t0 + (round ? duration : duration / 10);
        bytes = 0;
        while (now() < end) {
            if (!put) {
                st = wait_for(w, ucp_get_nbx(e, local, block, remote, rkey, &prm));
                bytes += block;
            } else {
                ucs_status_ptr_t rs[PUT_DEPTH];
                for (int i = 0; i < PUT_DEPTH; i++)
                    rs[i] = ucp_put_nbx(e, local, block, remote, rkey, &prm);
                for (int i = 0; i < PUT_DEPTH; i++) {
                    ucs_status_t s = wait_for(w, rs[i]);
                    if (s != UCS_OK) st = s;
                }
                bytes += (uint64_t)PUT_DEPTH * block;
            }
            if (st != UCS_OK) die(put ? "ucp_put_nbx" : "ucp_get_nbx", st);
        }
        if (put && (st = wait_for(w, ucp_ep_flush_nbx(e, &prm))) != UCS_OK) die("flush", st);
        if (round)
            printf("{\"gbps\": %.4f, \"bytes\": %llu}\n", bytes / (now() - t0) / 1e9,
                   (unsigned long long)bytes);
    }
    ucp_rkey_destroy(rkey);
    ucp_request_param_t cl = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    wait_for(w, ucp_ep_close_nbx(e, &cl));
    if (write_all(sv[0], "x", 1)) fprintf(stderr, "ucp_reg: the responder is gone\n");
    int status = 0;
    waitpid(pid, &status, 0);
    ucp_worker_destroy(w);
    ucp_cleanup(ctx);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
