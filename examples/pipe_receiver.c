/* pipe_receiver: the decode side of a tensor pipe (vLLM's MooncakePipe).
 *
 *   pipe_receiver CONFIG.json COUNT
 *
 * Receives COUNT tensors from pipe_sender (same CONFIG.json), checks each one's
 * dtype, shape and every element, then expects None. */
#include <stdlib.h>

#include "common.h"

#define RECV_TIMEOUT_MS 30000

static int check(const kvp_tensor *t, long i)
{
    if (t->dtype != KVP_DTYPE_I32 || t->ndim != 2 || t->shape[0] != 4 || t->shape[1] != 256) {
        fprintf(stderr, "tensor %ld: wrong dtype or shape\n", i);
        return 0;
    }
    const int32_t *v = t->data;
    for (int j = 0; j < 4 * 256; j++)
        if (v[j] != (int32_t)(i * 1000 + j)) {
            fprintf(stderr, "tensor %ld: element %d is %d\n", i, j, (int)v[j]);
            return 0;
        }
    return 1;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: pipe_receiver CONFIG.json COUNT\n");
        return 2;
    }
    long count = strtol(argv[2], NULL, 10);
    kvp_pipe_config *cfg;
    kvp_status st = kvp_pipe_config_load(argv[1], &cfg);
    if (st) return example_fail(argv[1], st);

    kvp_pipe *pipe; /* kv_rank 1: decode */
    st = kvp_pipe_open(cfg, 0, 1, NULL, &pipe);
    kvp_pipe_config_free(cfg);
    if (st) return example_fail("kvp_pipe_open", st);

    int ok = 1;
    for (long i = 0; i < count && ok; i++) {
        kvp_tensor *t = NULL;
        /* The tensor's data lies in the engine's registered memory (no copy
         * out); freeing the tensor gives that memory back. */
        if ((st = kvp_pipe_recv(pipe, RECV_TIMEOUT_MS, &t)))
            ok = !example_fail("kvp_pipe_recv", st);
        else
            ok = t && check(t, i);
        kvp_tensor_free(t);
    }
    kvp_tensor *none = NULL;
    if (ok && (st = kvp_pipe_recv(pipe, RECV_TIMEOUT_MS, &none)))
        ok = !example_fail("kvp_pipe_recv (None)", st);
    else if (ok && none) {
        fprintf(stderr, "expected None after %ld tensors\n", count);
        kvp_tensor_free(none);
        ok = 0;
    }
    if (ok) printf("received %ld tensors intact, then None\n", count);
    kvp_pipe_close(pipe);
    return ok ? 0 : 1;
}
