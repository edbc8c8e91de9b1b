/* The C side of the Python-to-C pipe test: open one side of a pipe, receive
 * COUNT messages and send each one straight back (None as None), then wait for
 * the last ACK and exit.
 *
 *   kvpy_pipe_peer CONFIG KV_RANK COUNT
 *
 * Prints "ready" once the pipe is open. Exit 0 on success, 1 with a message on
 * stderr on any failure.
 */
#include <stdio.h>
#include <stdlib.h>

#include "kvpipe/pipe.h"

static int fail(const char *what, kvp_status st)
{
    fprintf(stderr, "kvpy_pipe_peer: %s: %s: %s\n", what, kvp_strerror(st), kvp_last_error());
    return 1;
}

static int echo(kvp_pipe *pipe, long count)
{
    for (long i = 0; i < count; i++) {
        kvp_tensor *t = NULL;
        kvp_status st = kvp_pipe_recv(pipe, 30000, &t);
        if (st) return fail("recv", st);
        st = kvp_pipe_send(pipe, t);
        kvp_tensor_free(t);
        if (st) return fail("send", st);
    }
    kvp_status st = kvp_pipe_flush(pipe, 30000);
    return st ? fail("flush", st) : 0;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: kvpy_pipe_peer CONFIG KV_RANK COUNT\n");
        return 2;
    }
    kvp_pipe_config *cfg = NULL;
    kvp_status st = kvp_pipe_config_load(argv[1], &cfg);
    if (st) return fail("config", st);
    kvp_pipe *pipe = NULL;
    st = kvp_pipe_open(cfg, 0, atoi(argv[2]), NULL, &pipe);
    if (st) {
        kvp_pipe_config_free(cfg);
        return fail("open", st);
    }
    printf("ready\n");
    fflush(stdout);
    int rc = echo(pipe, atol(argv[3]));
    kvp_pipe_close(pipe);
    kvp_pipe_config_free(cfg);
    return rc;
}
