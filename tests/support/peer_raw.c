/* The raw MooncakePipe-wire peer (peer.h): a real engine and bare libzmq
 * sockets on a side's ports, and the files a side's stderr goes to. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "common/clock.h"
#include "common/net.h"
#include "peer.h"
#include "pipe/safetensors.h"
#include "test.h"

int kvpt_raw_setup_init(kvpt_raw_setup *s)
{
    int base = kvpt_pipe_ports();
    if (base < 0) return -1;
    s->base = base;
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

pid_t kvpt_raw_spawn_side_with(const kvpt_raw_setup *s, int rank, const kvp_pipe_opts *opts,
                               kvpt_side_fn fn, void *arg, const char *err_path)
{
    return kvpt_side_spawn(s->json, rank, opts, fn, arg, err_path);
}

pid_t kvpt_raw_spawn_side(const kvpt_raw_setup *s, int rank, kvpt_side_fn fn, void *arg,
                          const char *err_path)
{
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    return kvpt_side_spawn(s->json, rank, &o, fn, arg, err_path);
}

void kvpt_err_path(char *buf, size_t len, const char *what)
{
    snprintf(buf, len, "/tmp/kvpt_%s_%d.err", what, (int)getpid());
}

void kvpt_raw_sides_spawn(kvpt_raw_sides *p, const kvpt_raw_setup *s, const char *what,
                          kvpt_side_fn prefill_fn, kvpt_side_fn decode_fn, void *arg)
{
    static const char *const side[2] = {"prefill", "decode"};
    kvpt_side_fn fn[2] = {prefill_fn, decode_fn};
    for (int r = 0; r < 2; r++) {
        char name[96];
        snprintf(name, sizeof name, "%s_%s", what, side[r]);
        kvpt_err_path(p->err[r], sizeof p->err[r], name);
        p->pid[r] = kvpt_raw_spawn_side(s, r, fn[r], arg, p->err[r]);
    }
}

int kvpt_raw_sides_wait(kvpt_raw_sides *p)
{
    int rp = kvpt_wait_child(p->pid[0], KVPT_RAW_SIDE_MS);
    int rd = kvpt_wait_child(p->pid[1], KVPT_RAW_SIDE_MS);
    if (rp || rd) {
        fprintf(stderr, "  prefill exit %d, decode exit %d\n", rp, rd);
        kvpt_file_show(p->err[0], "prefill");
        kvpt_file_show(p->err[1], "decode");
    }
    return rp || rd ? -1 : 0;
}

void kvpt_raw_sides_unlink(kvpt_raw_sides *p)
{
    unlink(p->err[0]);
    unlink(p->err[1]);
}

int kvpt_file_lines(const char *path, const char *needle)
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

void kvpt_file_show(const char *path, const char *who)
{
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[4096];
    for (int i = 0; i < 40 && fgets(line, sizeof line, f); i++)
        fprintf(stderr, "  [%s] %s", who, line);
    fclose(f);
}

kvp_status kvpt_raw_engine(const kvpt_raw_setup *s, int rank, kvp_engine **out)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = s->side[rank].local_segment;
    eo.metadata = "P2PHANDSHAKE";
    eo.disable_shm = 1;
    return kvp_engine_create(&eo, out);
}

void *kvpt_zmq_socket(void *ctx, int type)
{
    void *z = zmq_socket(ctx, type);
    int zero = 0, tmo = KVPT_RAW_WAIT_MS;
    zmq_setsockopt(z, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(z, ZMQ_SNDTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(z, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    return z;
}

static void endpoint(char *ep, size_t len, int port)
{
    snprintf(ep, len, "tcp://127.0.0.1:%d", port);
}

int kvpt_zmq_bind(void *z, int port)
{
    char ep[64];
    endpoint(ep, sizeof ep, port);
    return zmq_bind(z, ep);
}

int kvpt_zmq_connect(void *z, int port)
{
    char ep[64];
    endpoint(ep, sizeof ep, port);
    return zmq_connect(z, ep);
}

void *kvpt_zmq_monitor(void *ctx, void *z, const char *name)
{
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://kvpt-monitor-%s", name);
    if (zmq_socket_monitor(z, ep, ZMQ_EVENT_ALL) != 0) return NULL;
    void *m = kvpt_zmq_socket(ctx, ZMQ_PAIR);
    if (zmq_connect(m, ep) != 0) return NULL;
    return m;
}

int kvpt_zmq_wait_event(void *mon, int event, int timeout_ms)
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
        if (ev & event) return 0;
    }
}

int kvpt_zmq_send_frames(void *z, const void *const *frames, const size_t *sizes, int n)
{
    for (int i = 0; i < n; i++)
        if (zmq_send(z, frames[i], sizes[i], i + 1 < n ? ZMQ_SNDMORE : 0) < 0) return -1;
    return 0;
}

int kvpt_raw_peer_start(kvpt_raw_peer *r, const kvpt_raw_setup *s, int rank, int watch)
{
    memset(r, 0, sizeof *r);
    r->ctx = zmq_ctx_new();
    r->push = kvpt_zmq_socket(r->ctx, ZMQ_PUSH);
    r->pull = kvpt_zmq_socket(r->ctx, ZMQ_PULL);
    if (watch)
        r->mon = kvpt_zmq_monitor(r->ctx, watch == KVPT_RAW_WATCH_PUSH ? r->push : r->pull,
                                  rank ? "raw_decode" : "raw_prefill");
    int bad = watch && !r->mon;
    if (rank == 0)
        bad = bad || kvpt_zmq_bind(r->push, s->side[0].data_port) ||
              kvpt_zmq_connect(r->pull, s->side[1].ack_port);
    else
        bad = bad || kvpt_zmq_connect(r->pull, s->side[0].data_port) ||
              kvpt_zmq_bind(r->push, s->side[1].ack_port);
    if (bad) fprintf(stderr, "  raw side %d: sockets: %s\n", rank, zmq_strerror(zmq_errno()));
    return bad ? -1 : 0;
}

void kvpt_raw_peer_stop(kvpt_raw_peer *r)
{
    if (r->mon) zmq_close(r->mon);
    zmq_close(r->pull);
    zmq_close(r->push);
    zmq_ctx_term(r->ctx);
    if (r->e) kvp_engine_destroy(r->e);
    r->e = NULL;
}

int kvpt_raw_send_announcement(void *z, uint64_t addr, uint64_t len)
{
    uint8_t a[8], l[8];
    kvpi_put_be64(a, addr);
    kvpi_put_be64(l, len);
    const void *f[2] = {a, l};
    size_t s[2] = {8, 8};
    return kvpt_zmq_send_frames(z, f, s, 2);
}

void kvpt_raw_tensor_fill(void *data, int i)
{
    kvpt_fill(data, KVPT_RAW_TENSOR, (uint64_t)i + 1);
}

int kvpt_raw_tensor_check(const kvp_tensor *t, int i)
{
    return t && t->dtype == KVP_DTYPE_U8 && t->ndim == 1 && t->shape[0] == KVPT_RAW_TENSOR &&
           kvpt_verify(t->data, KVPT_RAW_TENSOR, (uint64_t)i + 1) == (size_t)-1;
}

/* Good tensor i in data (KVPT_RAW_TENSOR bytes), described by t. */
static void good_tensor(kvp_tensor *t, uint8_t *data, int i)
{
    static int64_t n = KVPT_RAW_TENSOR;
    kvpt_raw_tensor_fill(data, i);
    kvp_tensor_init(t, KVP_DTYPE_U8, 1, &n, data);
}

void kvpt_raw_send_good(kvp_pipe *pipe, int i)
{
    static uint8_t data[KVPT_RAW_TENSOR];
    kvp_tensor t;
    good_tensor(&t, data, i);
    CHECK_OK(kvp_pipe_send(pipe, &t));
}

kvp_status kvpt_raw_message(kvp_engine *e, int i, void **buf, size_t *len)
{
    static uint8_t data[KVPT_RAW_TENSOR];
    kvp_tensor t;
    good_tensor(&t, data, i);
    size_t size, written;
    kvp_status st = kvpi_safetensors_size(&t, &size);
    if (st || (st = kvp_engine_alloc(e, size, buf))) return st;
    if ((st = kvpi_safetensors_write(&t, *buf, size, &written))) return st;
    *len = written;
    return KVP_OK;
}

int kvpt_raw_announce_good(kvp_engine *e, void *push, int i)
{
    void *buf;
    size_t len;
    if (kvpt_raw_message(e, i, &buf, &len)) return -1;
    return kvpt_raw_send_announcement(push, (uint64_t)(uintptr_t)buf, len);
}

int kvpt_zmq_recv_message(void *z, uint8_t f[KVPT_RAW_MSG_FRAMES][KVPT_RAW_MSG_HEAD],
                          size_t sz[KVPT_RAW_MSG_FRAMES], int timeout_ms)
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
        if (frames < KVPT_RAW_MSG_FRAMES) {
            sz[frames] = zmq_msg_size(&m);
            memcpy(f[frames], zmq_msg_data(&m),
                   sz[frames] < KVPT_RAW_MSG_HEAD ? sz[frames] : KVPT_RAW_MSG_HEAD);
        }
        frames++;
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    } while (more);
    return frames;
}

int kvpt_raw_count_acks(void *pull, int max, int timeout_ms)
{
    int n = 0;
    for (int i = 0; i < max; i++) {
        uint8_t f[KVPT_RAW_MSG_FRAMES][KVPT_RAW_MSG_HEAD];
        size_t sz[KVPT_RAW_MSG_FRAMES];
        int frames = kvpt_zmq_recv_message(pull, f, sz, timeout_ms);
        if (frames < 0) break;
        n += frames == 1 && sz[0] == 3 && memcmp(f[0], "ACK", 3) == 0 ? 1 : -1000;
    }
    return n;
}
