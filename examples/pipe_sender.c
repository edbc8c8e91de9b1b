/* pipe_sender: the prefill side of a tensor pipe (vLLM's MooncakePipe).
 *
 *   pipe_sender CONFIG.json COUNT
 *
 * CONFIG.json is a mooncake config, as vLLM reads from MOONCAKE_CONFIG_PATH:
 *   {"prefill_url": "127.0.0.1:20000", "decode_url": "127.0.0.1:20100",
 *    "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}
 * Sends COUNT int32 tensors of shape [4, 256] whose element j of tensor i is
 * i * 1000 + j, then None, waits until the receiver has taken them all, and
 * closes. */
#include <stdlib.h>

#include "common.h"

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: pipe_sender CONFIG.json COUNT\n");
        return 2;
    }
    long count = strtol(argv[2], NULL, 10);
    kvp_pipe_config *cfg;
    kvp_status st = kvp_pipe_config_load(argv[1], &cfg);
    if (st) return example_fail(argv[1], st);

    /* kv_rank 0 is prefill; local_rank 0 the first (here: only) worker. */
    kvp_pipe *pipe;
    st = kvp_pipe_open(cfg, 0, 0, NULL, &pipe);
    kvp_pipe_config_free(cfg);
    if (st) return example_fail("kvp_pipe_open", st);

    const int64_t shape[2] = {4, 256};
    int32_t data[4 * 256];
    for (long i = 0; i < count && st == KVP_OK; i++) {
        for (int j = 0; j < 4 * 256; j++)
            data[j] = (int32_t)(i * 1000 + j);
        /* A stack tensor that borrows data; send copies it once, so data may
         * be reused as soon as send returns. */
        kvp_tensor t;
        if ((st = kvp_tensor_init(&t, KVP_DTYPE_I32, 2, shape, data)) == KVP_OK)
            st = kvp_pipe_send(pipe, &t);
    }
    if (st == KVP_OK) st = kvp_pipe_send(pipe, NULL); /* None: "no more" */
    /* Closing frees buffers the receiver may still be reading: flush first. */
    if (st == KVP_OK) st = kvp_pipe_flush(pipe, 30000);
    if (st) {
        example_fail("pipe_sender", st);
        kvp_pipe_close(pipe);
        return 1;
    }
    printf("sent %ld tensors and None\n", count);
    kvp_pipe_close(pipe);
    return 0;
}
