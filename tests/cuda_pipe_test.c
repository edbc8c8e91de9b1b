/* The pipe with tensors in GPU memory, on the CUDA driver's test double
 * (tests/support/fake_cuda: device memory the CPU cannot touch, so any CPU
 * access by kvpipe to it crashes the side): kvp_pipe_send copies a device
 * tensor device-to-host into its message, kvp_tensor_to_cuda puts a received
 * tensor on a device, across two processes over tcp, both ways, every byte
 * checked through the double; a pointer that is neither host nor device
 * memory, a failing copy and a missing driver give clear errors and send
 * nothing. */
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "peer.h"
#include "test.h"

#define BIG ((int64_t)3 << 20) /* bytes: announced (above the inline threshold) */
#define SMALL ((int64_t)1000)  /* bytes: inline between two kvpipe pipes */
#define DEV 1                  /* the device each side uses */

static kvpt_fakecuda fc;

static void load_double(void)
{
    kvpt_fakecuda_load(&fc, KVPT_FAKECUDA_PATH);
}

/* A u8 tensor of n bytes with pattern seed, in device memory of DEV. */
static void device_tensor(kvp_tensor *t, int64_t n, uint64_t seed)
{
    void *host = malloc((size_t)n);
    void *dev = fc.alloc(DEV, (size_t)n);
    REQUIRE(host && dev);
    kvpt_fill(host, (size_t)n, seed);
    REQUIRE(fc.poke(dev, host, (size_t)n) == 0);
    free(host);
    REQUIRE_OK(kvp_tensor_init(t, KVP_DTYPE_U8, 1, &n, dev));
}

/* Received tensor t (host memory) holds pattern seed; put on DEV, it still
 * does (read back through the double). */
static void check_and_move(kvp_tensor *t, int64_t n, uint64_t seed)
{
    REQUIRE(t && t->nbytes == (size_t)n);
    CHECK(kvpt_verify(t->data, t->nbytes, seed) == (size_t)-1);
    kvp_tensor *d = NULL;
    CHECK_OK(kvp_tensor_to_cuda(t, DEV, &d));
    if (d) {
        void *back = malloc(t->nbytes);
        REQUIRE(back);
        CHECK(fc.peek(back, d->data, t->nbytes) == 0);
        CHECK(kvpt_verify(back, t->nbytes, seed) == (size_t)-1);
        CHECK(d->dtype == t->dtype && d->ndim == 1 && d->shape[0] == n);
        free(back);
    }
    kvp_tensor_free(d);
}

/* Prefill sends a big and a small device tensor; decode puts them on its
 * device and sends them back from there; prefill checks what returns. */
static int send_side(kvp_pipe *pipe, int rank)
{
    (void)rank;
    kvp_tensor big, small;
    device_tensor(&big, BIG, 1);
    device_tensor(&small, SMALL, 2);
    CHECK_OK(kvp_pipe_send(pipe, &big));
    CHECK_OK(kvp_pipe_send(pipe, &small));
    kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
    CHECK(t && kvpt_verify(t->data, t->nbytes, 1) == (size_t)-1 && t->nbytes == (size_t)BIG);
    kvp_tensor_free(t);
    t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
    CHECK(t && kvpt_verify(t->data, t->nbytes, 2) == (size_t)-1 && t->nbytes == (size_t)SMALL);
    kvp_tensor_free(t);
    return 0;
}

static int echo_side(kvp_pipe *pipe, int rank)
{
    (void)rank;
    int64_t sizes[2] = {BIG, SMALL};
    for (int i = 0; i < 2; i++) {
        kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
        check_and_move(t, sizes[i], (uint64_t)i + 1);
        kvp_tensor *d = NULL;
        if (t) CHECK_OK(kvp_tensor_to_cuda(t, DEV, &d));
        if (d) CHECK_OK(kvp_pipe_send(pipe, d)); /* device to host into the message */
        kvp_tensor_free(d);
        kvp_tensor_free(t);
    }
    return 0;
}

static void device_tensors_both_ways(void)
{
    kvpt_pipe_run(1, send_side, echo_side);
}

/* Errors without a peer: nothing is sent, the pipe stays usable. */
static void send_errors(void)
{
    kvp_pipe *pipe = kvpt_pipe_alone(NULL, NULL);
    REQUIRE(pipe != NULL);

    /* Neither host nor device memory: refused, named. */
    void *hole = mmap(NULL, 1 << 16, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(hole != MAP_FAILED);
    int64_t n = 1 << 16;
    kvp_tensor t;
    REQUIRE_OK(kvp_tensor_init(&t, KVP_DTYPE_U8, 1, &n, hole));
    CHECK_ST(kvp_pipe_send(pipe, &t), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "CUDA driver does not know it") != NULL);
    munmap(hole, 1 << 16);

    /* Device memory whose copy fails: KVP_EIO naming the device; nothing left. */
    kvp_tensor dev;
    device_tensor(&dev, BIG, 5);
    fc.fail_copy(1);
    CHECK_ST(kvp_pipe_send(pipe, &dev), KVP_EIO);
    CHECK(strstr(kvp_last_error(), "device 1") != NULL);
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.sent == 0 && st.inflight_count == 0 && st.inflight_bytes == 0);
    CHECK(kvp_pipe_usable(pipe));

    /* kvp_tensor_to_cuda's errors. */
    uint8_t host[16] = {0};
    int64_t sixteen = 16;
    kvp_tensor h, *out = (kvp_tensor *)&out;
    REQUIRE_OK(kvp_tensor_init(&h, KVP_DTYPE_U8, 1, &sixteen, host));
    CHECK_ST(kvp_tensor_to_cuda(&h, -1, &out), KVP_EINVAL);
    CHECK_ST(kvp_tensor_to_cuda(&dev, DEV, &out), KVP_EINVAL); /* the source is on a device */
    CHECK(out == (kvp_tensor *)&out);                          /* untouched on failure */
    kvp_pipe_close(pipe);
}

/* No driver: a device tensor cannot be made, and the error says why. */
static void no_driver(void)
{
    setenv("KVPIPE_LIBCUDA", "/nonexistent/libcuda.so.1", 1);
    uint8_t host[16] = {0};
    int64_t sixteen = 16;
    kvp_tensor h, *out = NULL;
    REQUIRE_OK(kvp_tensor_init(&h, KVP_DTYPE_U8, 1, &sixteen, host));
    CHECK_ST(kvp_tensor_to_cuda(&h, 0, &out), KVP_ENOTSUP);
    CHECK(strstr(kvp_last_error(), "/nonexistent/libcuda.so.1") != NULL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    setenv("KVPIPE_LIBCUDA", KVPT_FAKECUDA_PATH, 1);
    load_double();
    RUN(device_tensors_both_ways);
    RUN(send_errors);
    RUN(no_driver);
    return kvpt_summary();
}
