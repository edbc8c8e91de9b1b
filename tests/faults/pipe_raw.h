/* What the pipe fault tests share: a pipe side in a child process whose
 * stderr goes to a file, a raw peer made of a real engine and bare libzmq
 * sockets on the other side's ports, ZeroMQ socket monitors, and a byte pipe
 * to step the two processes through a script. Functions are static inline so
 * that each test uses what it needs. */
#ifndef KVPT_FAULTS_PIPE_RAW_H
#define KVPT_FAULTS_PIPE_RAW_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <signal.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/net.h"
#include "kvpipe/pipe.h"
#include "pipe/announce.h"
#include "pipe/safetensors.h"
#include "test.h"

#define RAW_WAIT_MS 20000  /* bounds a wait that succeeds at once when the code is right */
#define RAW_SIDE_MS 120000 /* bounds a pipe side's whole run */
#define RAW_TENSOR 4096    /* bytes of each good tensor */

/* Both sides of a pipe whose config says 127.0.0.1:B for both URLs, in
 * P2PHANDSHAKE mode (no metadata store): prefill has B, B+9, B+10 and decode
 * (base B+100) B+100, B+109, B+110. */
typedef struct raw_setup {
    char json[256];
    kvp_pipe_endpoints side[2]; /* [kv_rank] */
} raw_setup;

static inline int raw_setup_init(raw_setup *s)
{
    static const int offsets[] = {0, 9, 10, 100, 109, 110};
    int base = kvpt_free_port_block(offsets, sizeof offsets / sizeof offsets[0]);
    if (base < 0) return -1;
    snprintf(s->json, sizeof s->json,
             "{\"prefill_url\":\"127.0.0.1:%d\",\"decode_url\":\"127.0.0.1:%d\","
             "\"metadata_server\":\"P2PHANDSHAKE\",\"protocol\":\"tcp\"}",
             base, base);
    kvp_pipe_config *cfg;
    if (kvp_pipe_config_parse(s->json, strlen(s->json), &cfg)) return -1;
    int bad = kvp_pipe_config_endpoints(cfg, 0, 0, &s->side[0]) ||
              kvp_pipe_config_endpoints(cfg, 0, 1, &s->side[1]);
    kvp_pipe_config_free(cfg);
    return bad ? -1 : 0;
}

static inline kvp_pipe_opts raw_pipe_opts(void)
{
    kvp_pipe_opts o;
    kvp_pipe_opts_init(&o);
    o.disable_shm = 1;
    o.send_timeout_ms = RAW_WAIT_MS;
    return o;
}

/* Open side rank of the setup's pipe with opts. */
static inline kvp_status raw_open_pipe(const raw_setup *s, int rank, const kvp_pipe_opts *opts,
                                       kvp_pipe **out)
{
    kvp_pipe_config *cfg;
    kvp_status st = kvp_pipe_config_parse(s->json, strlen(s->json), &cfg);
    if (st) return st;
    st = kvp_pipe_open(cfg, 0, rank, opts, out);
    kvp_pipe_config_free(cfg);
    return st;
}

/* ------------------------------------------------------ pipe side --- */

typedef void (*raw_side_fn)(kvp_pipe *pipe, void *arg);

/* Fork a child that dies with this process and whose stderr goes to
 * err_path; returns 0 in the child, its pid in the parent. */
static inline pid_t raw_fork(const char *err_path)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0) return pid;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
        dup2(fd, STDERR_FILENO);
        close(fd);
    }
    kvpt_failures = 0;
    return 0;
}

/* Run fn on a pipe of side rank, opened with opts, in a raw_fork() child.
 * The child exits 1 when a check failed, 2 when the pipe did not open. */
static inline pid_t raw_spawn_side_with(const raw_setup *s, int rank, const kvp_pipe_opts *opts,
                                        raw_side_fn fn, void *arg, const char *err_path)
{
    pid_t pid = raw_fork(err_path);
    if (pid != 0) return pid;
    kvp_pipe *pipe;
    kvp_status st = raw_open_pipe(s, rank, opts, &pipe);
    if (st) {
        fprintf(stderr, "  rank %d: open: %s\n", rank, kvp_last_error());
        _exit(2);
    }
    fn(pipe, arg);
    kvp_pipe_close(pipe);
    _exit(kvpt_failures ? 1 : 0);
}

/* The same with raw_pipe_opts(). */
static inline pid_t raw_spawn_side(const raw_setup *s, int rank, raw_side_fn fn, void *arg,
                                   const char *err_path)
{
    kvp_pipe_opts o = raw_pipe_opts();
    return raw_spawn_side_with(s, rank, &o, fn, arg, err_path);
}

/* A temporary file name for a side's stderr. */
static inline void raw_err_path(char *buf, size_t len, const char *what)
{
    snprintf(buf, len, "/tmp/kvpt_%s_%d.err", what, (int)getpid());
}

/* Lines of the file containing needle (every line when needle is ""). */
static inline int raw_count_lines(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, needle)) n++;
    fclose(f);
    return n;
}

/* Show a side's stderr (the first lines) when its case failed. */
static inline void raw_show(const char *path, const char *who)
{
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[4096];
    for (int i = 0; i < 40 && fgets(line, sizeof line, f); i++)
        fprintf(stderr, "  [%s] %s", who, line);
    fclose(f);
}

/* ----------------------------------------------------------- steps --- */

/* A one-way byte pipe from one process to the other: the script's steps. */
typedef struct raw_chan {
    int fd[2];
} raw_chan;

static inline int raw_chan_init(raw_chan *c)
{
    return pipe(c->fd);
}

static inline void raw_step(raw_chan *c, char step)
{
    if (write(c->fd[1], &step, 1) != 1) kvpt_failures++;
}

/* Wait for the next step (up to timeout_ms); returns it, or 0 on timeout. */
static inline char raw_wait_step(raw_chan *c, int timeout_ms)
{
    struct pollfd p = {.fd = c->fd[0], .events = POLLIN};
    char step = 0;
    if (poll(&p, 1, timeout_ms) == 1 && read(c->fd[0], &step, 1) == 1) return step;
    return 0;
}

/* ------------------------------------------------------- raw peer --- */

/* A real engine under a side's segment name, to serve or make the READs that
 * the pipe on the other side expects. */
static inline kvp_status raw_engine(const raw_setup *s, int rank, kvp_engine **out)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = s->side[rank].local_segment;
    eo.metadata = "P2PHANDSHAKE";
    eo.disable_shm = 1;
    return kvp_engine_create(&eo, out);
}

static inline void *raw_socket(void *ctx, int type)
{
    void *z = zmq_socket(ctx, type);
    int zero = 0, tmo = RAW_WAIT_MS;
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_SNDTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(z, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    return z;
}

static inline int raw_bind(void *z, int port)
{
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    return zmq_bind(z, ep);
}

static inline int raw_connect(void *z, int port)
{
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port);
    return zmq_connect(z, ep);
}

/* A socket monitor on z; returns the PAIR socket its events arrive on. */
static inline void *raw_monitor(void *ctx, void *z, const char *name)
{
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://kvpt-monitor-%s", name);
    if (zmq_socket_monitor(z, ep, ZMQ_EVENT_ALL) != 0) return NULL;
    void *m = raw_socket(ctx, ZMQ_PAIR);
    if (zmq_connect(m, ep) != 0) return NULL;
    return m;
}

/* Wait for event on a monitor, skipping others; 0 when it came in time. */
static inline int raw_wait_event(void *mon, int event, int timeout_ms)
{
    uint64_t deadline = kvpi_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        uint64_t now = kvpi_now_ms();
        if (now >= deadline) return -1;
        zmq_pollitem_t it = {.socket = mon, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, (long)(deadline - now)) <= 0) continue;
        uint8_t head[6];
        char addr[256];
        if (zmq_recv(mon, head, sizeof head, 0) != 6) return -1;
        zmq_recv(mon, addr, sizeof addr, 0);
        uint16_t ev;
        memcpy(&ev, head, 2);
        if (ev == event) return 0;
    }
}

/* Send a message of n frames. */
static inline int raw_send_frames(void *z, const void *const *frames, const size_t *sizes, int n)
{
    for (int i = 0; i < n; i++)
        if (zmq_send(z, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0) < 0) return -1;
    return 0;
}

static inline int raw_send_announcement(void *z, uint64_t addr, uint64_t len)
{
    uint8_t a[8], l[8];
    kvpi_put_be64(a, addr);
    kvpi_put_be64(l, len);
    const void *f[2] = {a, l};
    size_t s[2] = {8, 8};
    return raw_send_frames(z, f, s, 2);
}

/* Good tensor i: RAW_TENSOR bytes of U8 with the pattern of seed i + 1. */
static inline void raw_tensor_fill(void *data, int i)
{
    kvpt_fill(data, RAW_TENSOR, (uint64_t)i + 1);
}

static inline int raw_tensor_check(const kvp_tensor *t, int i)
{
    return t && t->dtype == KVP_DTYPE_U8 && t->ndim == 1 && t->shape[0] == RAW_TENSOR &&
           kvpt_verify(t->data, RAW_TENSOR, (uint64_t)i + 1) == (size_t)-1;
}

/* Send good tensor i (RAW_TENSOR bytes) with a copy. */
static inline void raw_send_good(kvp_pipe *pipe, int i)
{
    static uint8_t data[RAW_TENSOR];
    raw_tensor_fill(data, i);
    int64_t n = RAW_TENSOR;
    kvp_tensor t;
    kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, data);
    CHECK_OK(kvp_pipe_send(pipe, &t));
}

/* Encode good tensor i into engine memory for announcing. */
static inline kvp_status raw_message(kvp_engine *e, int i, void **buf, size_t *len)
{
    static uint8_t data[RAW_TENSOR];
    raw_tensor_fill(data, i);
    int64_t n = RAW_TENSOR;
    kvp_tensor t;
    kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, data);
    size_t size, written;
    kvp_status st = kvpi_safetensors_size(&t, &size);
    if (st || (st = kvp_engine_alloc(e, size, buf))) return st;
    if ((st = kvpi_safetensors_write(&t, *buf, size, &written))) return st;
    *len = written;
    return KVP_OK;
}

/* Announce good tensor i from engine memory. */
static inline int raw_announce_good(kvp_engine *e, void *push, int i)
{
    void *buf;
    size_t len;
    if (raw_message(e, i, &buf, &len)) return -1;
    return raw_send_announcement(push, (uint64_t)(uintptr_t)buf, len);
}

/* Receive one message: its frame count (-1 on timeout), the sizes of its
 * first RAW_MSG_FRAMES frames and their first RAW_MSG_HEAD bytes (a tag
 * frame whole). */
#define RAW_MSG_FRAMES 3
#define RAW_MSG_HEAD KVPI_TAG_LEN
static inline int raw_recv_message(void *z, uint8_t f[RAW_MSG_FRAMES][RAW_MSG_HEAD],
                                   size_t sz[RAW_MSG_FRAMES], int timeout_ms)
{
    zmq_setsockopt(z, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    int frames = 0, more;
    do {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z, 0) < 0) {
            zmq_msg_close(&m);
            return frames ? frames : -1;
        }
        if (frames < RAW_MSG_FRAMES) {
            sz[frames] = zmq_msg_size(&m);
            memcpy(f[frames], zmq_msg_data(&m),
                   sz[frames] < RAW_MSG_HEAD ? sz[frames] : RAW_MSG_HEAD);
        }
        frames++;
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    } while (more);
    return frames;
}

/* Count the ACKs that arrive within timeout_ms each, until one does not or
 * max arrived; a message that is not one frame "ACK" counts as -1000. */
static inline int raw_count_acks(void *pull, int max, int timeout_ms)
{
    int n = 0;
    for (int i = 0; i < max; i++) {
        uint8_t f[RAW_MSG_FRAMES][RAW_MSG_HEAD];
        size_t sz[RAW_MSG_FRAMES];
        int frames = raw_recv_message(pull, f, sz, timeout_ms);
        if (frames < 0) break;
        n += frames == 1 && sz[0] == 3 && memcmp(f[0], "ACK", 3) == 0 ? 1 : -1000;
    }
    return n;
}

#endif
