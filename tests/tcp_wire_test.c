/* Mooncake TCP data-plane conformance: a raw socket client, speaking the
 * bytes ARCHITECTURE.md specifies, against a kvpipe target in another
 * process. Also the exact byte layout of the codecs. */
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "metadata/metadata.h"
#include "peer.h"
#include "test.h"
#include "transport/tcp_wire.h"

#define SEED 77
#define LEN (1u << 20)

static void codec_bytes(void)
{
    kvpi_tcp_hdr h = {.size = 0x0102030405060708ull,
                      .addr = 0x1112131415161718ull,
                      .opcode = KVPI_TCP_OP_WRITE,
                      .v2 = 1};
    uint8_t raw[KVPI_TCP_HDR_LEN];
    kvpi_tcp_hdr_encode(&h, raw);
    static const uint8_t want[KVPI_TCP_HDR_LEN] = {0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,
                                                   0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,
                                                   0x81, 0,    0,    0,    0,    0,    0,    0};
    CHECK(memcmp(raw, want, sizeof want) == 0);
    kvpi_tcp_hdr back;
    CHECK(kvpi_tcp_hdr_decode(raw, &back) == 0);
    CHECK(back.size == h.size && back.addr == h.addr && back.opcode == 1 && back.v2 == 1);
    raw[16] = 0x00;
    CHECK(kvpi_tcp_hdr_decode(raw, &back) == 0 && back.opcode == 0 && back.v2 == 0);
    raw[16] = 0x02;
    CHECK(kvpi_tcp_hdr_decode(raw, &back) == -1);
    raw[16] = 0x85;
    CHECK(kvpi_tcp_hdr_decode(raw, &back) == -1);
    uint8_t st[8];
    kvpi_tcp_status_encode(1, st);
    static const uint8_t want_st[8] = {1, 0, 0, 0, 0x56, 0x54, 0x43, 0x4D};
    CHECK(memcmp(st, want_st, 8) == 0);
    CHECK(kvpi_tcp_status_decode(st) == 1);
    st[7] = 0;
    CHECK(kvpi_tcp_status_decode(st) == -1);
}

static kvpt_target T;
static int data_port;

/* Start a target and learn its data port by a P2P handshake, as a Mooncake
 * peer would. */
static int start(void)
{
    kvpt_target_opts o = {.metadata = "P2PHANDSHAKE", .len = LEN, .seed = SEED, .disable_shm = 1};
    if (kvpt_target_start(&o, &T)) return -1;
    int port = atoi(strchr(T.name, ':') + 1);
    char *reply = NULL;
    if (kvpi_rpc_call("127.0.0.1", port, KVPI_RPC_METADATA, "{\"name\":\"raw\"}", 5000, &reply))
        return -1;
    cJSON *d = cJSON_Parse(reply);
    free(reply);
    cJSON *p = cJSON_GetObjectItem(d, "tcp_data_port");
    cJSON *v = cJSON_GetObjectItem(d, "tcp_proto_version");
    data_port = cJSON_IsNumber(p) ? p->valueint : 0;
    int ok = data_port > 0 && cJSON_IsNumber(v) && v->valueint == 2 &&
             cJSON_IsString(cJSON_GetObjectItem(d, "protocol")) &&
             strcmp(cJSON_GetObjectItem(d, "protocol")->valuestring, "tcp") == 0;
    cJSON_Delete(d);
    return ok ? 0 : -1;
}

static int conn(void)
{
    int fd = -1;
    if (kvpi_tcp_connect("127.0.0.1", data_port, 5000, &fd)) return -1;
    return fd;
}

static int send_hdr(int fd, uint64_t size, uint64_t addr, uint8_t op)
{
    uint8_t raw[KVPI_TCP_HDR_LEN] = {0};
    kvpi_put_le64(raw, size);
    kvpi_put_le64(raw + 8, addr);
    raw[16] = op;
    return kvpi_send_all(fd, raw, sizeof raw) == KVP_OK ? 0 : -1;
}

static int64_t read_status(int fd)
{
    uint8_t st[8];
    if (kvpi_recv_all(fd, st, 8)) return -2;
    return kvpi_tcp_status_decode(st);
}

/* Non-zero if the peer has closed the connection (EOF or reset). */
static int closed_by_peer(int fd)
{
    char c;
    ssize_t n = recv(fd, &c, 1, 0);
    return n <= 0;
}

static uint64_t base(void)
{
    return (uint64_t)(uintptr_t)T.buf;
}

static void v2_read_write(void)
{
    REQUIRE(start() == 0);
    int fd = conn();
    REQUIRE(fd >= 0);
    char buf[8192];
    REQUIRE(send_hdr(fd, sizeof buf, base() + 4096, 0x80) == 0);
    CHECK(read_status(fd) == 0);
    REQUIRE_OK(kvpi_recv_all(fd, buf, sizeof buf));
    CHECK(kvpt_verify(buf, sizeof buf, SEED + 4096) == (size_t)-1);
    kvpt_fill(buf, sizeof buf, 5);
    REQUIRE(send_hdr(fd, sizeof buf, base() + 65536, 0x81) == 0);
    REQUIRE_OK(kvpi_send_all(fd, buf, sizeof buf));
    CHECK(read_status(fd) == 0);
    /* The status comes after the WRITE is applied. */
    CHECK(kvpt_verify((char *)T.buf + 65536, sizeof buf, 5) == (size_t)-1);
    /* Zero length: a status, no data. */
    REQUIRE(send_hdr(fd, 0, 0, 0x80) == 0);
    CHECK(read_status(fd) == 0);
    /* Pipelined: three READ headers in one go, answers in order. */
    uint8_t three[3 * KVPI_TCP_HDR_LEN] = {0};
    for (int i = 0; i < 3; i++) {
        kvpi_tcp_hdr h = {100, base() + 8 * (uint64_t)i * 1000, 0, 1};
        kvpi_tcp_hdr_encode(&h, three + i * KVPI_TCP_HDR_LEN);
    }
    REQUIRE_OK(kvpi_send_all(fd, three, sizeof three));
    for (int i = 0; i < 3; i++) {
        CHECK(read_status(fd) == 0);
        REQUIRE_OK(kvpi_recv_all(fd, buf, 100));
        CHECK(kvpt_verify(buf, 100, SEED + 8 * (uint64_t)i * 1000) == (size_t)-1);
    }
    close(fd);
    CHECK(kvpt_target_stop(&T, 0) == 0);
}

static void v1_read_write(void)
{
    REQUIRE(start() == 0);
    int fd = conn();
    REQUIRE(fd >= 0);
    char buf[4096];
    REQUIRE(send_hdr(fd, sizeof buf, base(), 0) == 0);
    REQUIRE_OK(kvpi_recv_all(fd, buf, sizeof buf));
    CHECK(kvpt_verify(buf, sizeof buf, SEED) == (size_t)-1);
    kvpt_fill(buf, sizeof buf, 6);
    REQUIRE(send_hdr(fd, sizeof buf, base() + 8192, 1) == 0);
    REQUIRE_OK(kvpi_send_all(fd, buf, sizeof buf));
    /* v1 has no acknowledgement: a READ behind the WRITE orders it. */
    REQUIRE(send_hdr(fd, sizeof buf, base() + 8192, 0) == 0);
    REQUIRE_OK(kvpi_recv_all(fd, buf, sizeof buf));
    CHECK(kvpt_verify(buf, sizeof buf, 6) == (size_t)-1);
    close(fd);
    CHECK(kvpt_target_stop(&T, 0) == 0);
}

/* Every bad request is refused and the target goes on serving others. */
static void rejected(void)
{
    REQUIRE(start() == 0);
    struct {
        uint64_t size, addr;
        uint8_t op;
        int payload;
    } bad[] = {
        {100, base() + LEN - 50, 0x80, 0}, /* READ past the end */
        {100, base() - 100, 0x80, 0},      /* READ before the start */
        {UINT64_MAX, base(), 0x80, 0},     /* wraps around */
        {4096, base() + LEN, 0x81, 1},     /* WRITE past the end, with its payload */
        {16, 0x1000, 0x81, 1},             /* WRITE to an unregistered address */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int fd = conn();
        REQUIRE(fd >= 0);
        REQUIRE(send_hdr(fd, bad[i].size, bad[i].addr, bad[i].op) == 0);
        if (bad[i].payload) {
            char junk[4096] = {0};
            kvpi_send_all(fd, junk, bad[i].size);
        }
        CHECK(read_status(fd) == 1);
        CHECK(closed_by_peer(fd));
        close(fd);
    }
    /* v1 (no status frames): the connection is closed without data. */
    int fd = conn();
    REQUIRE(fd >= 0);
    REQUIRE(send_hdr(fd, 100, base() + LEN, 0) == 0);
    CHECK(closed_by_peer(fd));
    close(fd);
    /* Unknown opcode. */
    fd = conn();
    REQUIRE(fd >= 0);
    REQUIRE(send_hdr(fd, 100, base(), 0x07) == 0);
    CHECK(closed_by_peer(fd));
    close(fd);
    /* A truncated header, then a close. */
    fd = conn();
    REQUIRE(fd >= 0);
    REQUIRE_OK(kvpi_send_all(fd, "\x01\x02\x03", 3));
    close(fd);
    /* Nothing was written by the rejected WRITEs, and the target serves. */
    CHECK(kvpt_verify(T.buf, LEN, SEED) == (size_t)-1);
    fd = conn();
    REQUIRE(fd >= 0);
    char buf[256];
    REQUIRE(send_hdr(fd, sizeof buf, base() + LEN - sizeof buf, 0x80) == 0);
    CHECK(read_status(fd) == 0);
    REQUIRE_OK(kvpi_recv_all(fd, buf, sizeof buf));
    CHECK(kvpt_verify(buf, sizeof buf, SEED + LEN - sizeof buf) == (size_t)-1);
    close(fd);
    CHECK(kvpt_target_stop(&T, 0) == 0);
}

/* The engine refuses a range outside the peer's descriptor without sending
 * it (the raw cases above cover the server's own check). */
static void client_side_check(void)
{
    REQUIRE(start() == 0);
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start("P2PHANDSHAKE", "tcp", 1, 0, &e) == 0);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, T.name, &seg));
    char buf[4096];
    CHECK_OK(kvp_engine_read(e, seg, buf, base(), sizeof buf));
    CHECK_ST(kvp_engine_write(e, seg, buf, base() + LEN, sizeof buf), KVP_ERANGE);
    CHECK(kvpt_verify(T.buf, LEN, SEED) == (size_t)-1);
    kvp_engine_destroy(e);
    CHECK(kvpt_target_stop(&T, 0) == 0);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN(codec_bytes);
    RUN(v2_read_write);
    RUN(v1_read_write);
    RUN(rejected);
    RUN(client_side_check);
    return kvpt_summary();
}
