/* Sending without a copy (kvp_pipe_tensor_alloc + kvp_pipe_send_take) across
 * two processes on loopback, on every row (support/peer.h): a sequence of
 * in-place and copied sends of every size, the misuses refused, over tcp and
 * the same-host transport, and without a peer. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "peer.h"
#include "test.h"

/* ------------------------------------------ sending without a copy --- */

#define INPLACE_N 40

/* Message i of the in-place sequence: its shape (the size varies, 0-d and
 * zero-size included) and whether it goes in place or by copy. */
static void inplace_spec(int i, kvp_dtype *dt, int *ndim, int64_t *shape, int *in_place)
{
    static const kvp_dtype dts[] = {KVP_DTYPE_BF16, KVP_DTYPE_F32, KVP_DTYPE_U8, KVP_DTYPE_I64};
    *dt = dts[i % 4];
    *in_place = i % 5 != 4;
    if (i == 7) {
        *ndim = 0;
    } else if (i == 11) {
        *ndim = 2;
        shape[0] = 3;
        shape[1] = 0;
    } else {
        *ndim = 3;
        shape[0] = 2;
        shape[1] = 1 + i % 8;
        shape[2] = (int64_t)(1 + (i * 7919) % 70000);
    }
}

/* The sender's misuses of send_take: each is refused with KVP_EINVAL and the
 * tensor stays usable (then sent below, or freed). */
static void inplace_misuse(kvp_pipe *pipe)
{
    int64_t four = 4;
    float v[4] = {0};
    kvp_tensor stack;
    kvp_tensor_init(&stack, KVP_DTYPE_F32, 1, &four, v);
    CHECK_ST(kvp_pipe_send_take(pipe, &stack), KVP_EINVAL);
    CHECK(strstr(kvp_last_error(), "kvp_pipe_tensor_alloc") != NULL);
    kvp_tensor *heap;
    REQUIRE_OK(kvp_tensor_alloc(KVP_DTYPE_F32, 1, &four, &heap));
    CHECK_ST(kvp_pipe_send_take(pipe, heap), KVP_EINVAL);
    kvp_tensor_free(heap);
    CHECK_ST(kvp_pipe_send_take(pipe, NULL), KVP_EINVAL);

    kvp_tensor *t;
    REQUIRE_OK(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_F32, 1, &four, &t));
    CHECK(((uintptr_t)t->data & 255) == 0 && t->nbytes == 16);
    void *data = t->data;
    t->data = (char *)data + 4; /* moved */
    CHECK_ST(kvp_pipe_send_take(pipe, t), KVP_EINVAL);
    t->data = data;
    t->shape[0] = 5; /* larger than allocated */
    t->nbytes = 20;
    CHECK_ST(kvp_pipe_send_take(pipe, t), KVP_EINVAL);
    t->shape[0] = 3; /* shape and nbytes disagree */
    t->nbytes = 16;
    CHECK_ST(kvp_pipe_send_take(pipe, t), KVP_EINVAL);
    kvp_tensor_free(t);
    /* Allocation errors. */
    int64_t neg = -1;
    CHECK_ST(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_F32, 1, &neg, &t), KVP_EINVAL);
    CHECK_ST(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_COUNT, 1, &four, &t), KVP_EINVAL);
    int64_t huge = INT64_MAX / 2;
    CHECK_ST(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_F32, 1, &huge, &t), KVP_EINVAL);
}

static void inplace_send(kvp_pipe *pipe)
{
    inplace_misuse(pipe);
    for (int i = 0; i < INPLACE_N; i++) {
        kvp_dtype dt;
        int ndim, in_place;
        int64_t shape[3];
        inplace_spec(i, &dt, &ndim, shape, &in_place);
        if (i == 20) CHECK_OK(kvp_pipe_send(pipe, NULL));
        kvp_tensor *t;
        if (!in_place) {
            REQUIRE_OK(kvp_tensor_alloc(dt, ndim, shape, &t));
            kvpt_fill(t->data, t->nbytes, (uint64_t)i);
            CHECK_OK(kvp_pipe_send(pipe, t));
            kvp_tensor_free(t);
            continue;
        }
        /* Allocated larger and reshaped down before sending. */
        int64_t alloc_shape[3] = {shape[0], shape[1], shape[2] + 3};
        REQUIRE_OK(kvp_pipe_tensor_alloc(pipe, dt, ndim, ndim == 3 ? alloc_shape : shape, &t));
        if (ndim == 3) {
            t->shape[2] = shape[2];
            t->nbytes = kvp_dtype_size(dt) * (size_t)(shape[0] * shape[1] * shape[2]);
        }
        kvpt_fill(t->data, t->nbytes, (uint64_t)i);
        kvp_status st = kvp_pipe_send_take(pipe, t);
        CHECK_OK(st);
        if (st) kvp_tensor_free(t);
    }
}

static void inplace_recv(kvp_pipe *pipe)
{
    for (int i = 0; i < INPLACE_N; i++) {
        kvp_dtype dt;
        int ndim, in_place;
        int64_t shape[3];
        inplace_spec(i, &dt, &ndim, shape, &in_place);
        if (i == 20) kvpt_pipe_expect(pipe, NULL);
        kvp_tensor *t = kvpt_pipe_recv(pipe, KVPT_RECV_TIMEOUT);
        CHECK(t && t->dtype == dt && t->ndim == ndim);
        for (int d = 0; t && d < ndim && d < t->ndim; d++)
            CHECK(t->shape[d] == shape[d]);
        CHECK(t && kvpt_verify(t->data, t->nbytes, (uint64_t)i) == (size_t)-1);
        kvp_tensor_free(t);
    }
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.received == INPLACE_N + 1 && st.bad_messages == 0);
}

static int inplace_side(kvp_pipe *pipe, int rank)
{
    if (rank == 0)
        inplace_send(pipe);
    else
        inplace_recv(pipe);
    return 0;
}

static void test_send_in_place_tcp(void)
{
    kvpt_pipe_setup s;
    REQUIRE(kvpt_pipe_setup_make(&s, 0) == 0);
    kvp_pipe_opts o = kvpt_pipe_tcp_opts();
    o.kv_buffer_size = 1u << 20; /* the larger messages wait for ACKs */
    kvpt_pipe_run_pair(&s, &o, &o, inplace_side, inplace_side);
}

static void test_send_in_place_shm(void)
{
    kvpt_pipe_run_same_host(inplace_side, 1u << 20);
}

/* Without a peer: a failed send_take leaves the tensor with its caller, data
 * intact, and an unsent tensor outlives kvp_pipe_close(). */
static void test_send_in_place_no_peer(void)
{
    kvp_pipe *pipe = kvpt_pipe_alone(NULL, NULL);
    REQUIRE(pipe != NULL);
    int64_t n = 100000;
    kvp_tensor *t;
    REQUIRE_OK(kvp_pipe_tensor_alloc(pipe, KVP_DTYPE_U8, 1, &n, &t));
    kvpt_fill(t->data, t->nbytes, 9);
    CHECK_ST(kvp_pipe_send_take(pipe, t), KVP_ETIMEDOUT);
    CHECK_ST(kvp_pipe_send_take(pipe, t), KVP_ETIMEDOUT); /* again: still ours */
    CHECK(kvpt_verify(t->data, t->nbytes, 9) == (size_t)-1);
    kvp_pipe_stats st;
    kvp_pipe_get_stats(pipe, &st);
    CHECK(st.inflight_count == 0 && st.inflight_bytes == 0 && st.sent == 0);
    kvp_pipe_close(pipe);
    /* The engine lives on until the tensor is freed. */
    kvpt_fill(t->data, t->nbytes, 10);
    CHECK(kvpt_verify(t->data, t->nbytes, 10) == (size_t)-1);
    kvp_tensor_free(t);
}

static const kvpt_pipe_case cases[] = {
    KVPT_PIPE_CASE(test_send_in_place_tcp, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_send_in_place_shm, 120, KVPT_AUTH),
    KVPT_PIPE_CASE(test_send_in_place_no_peer, 60, 0),
};

int main(int argc, char **argv)
{
    return kvpt_pipe_main(argc, argv, cases, sizeof cases / sizeof cases[0]);
}
