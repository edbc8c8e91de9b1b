"""The Python end of the cross-process pipe tests (the C end is kvpy_pipe_peer).

    pipe_echo.py CONFIG KV_RANK COUNT [DEVICE]

Receives COUNT messages and sends each straight back (the received
kvpipe.Tensor itself, through DLPack; None as None), flushes, exits 0. With
DEVICE (e.g. cuda:1) the Pipe puts what it receives on that device, and sends
it back from there.
"""
import sys

import kvpipe


def main():
    config, kv_rank, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) > 4 else None
    with kvpipe.Pipe(config, 0, kv_rank, device=device) as pipe:
        print("ready", flush=True)
        for _ in range(count):
            pipe.send_tensor(pipe.recv_tensor(timeout=30))
        pipe.flush(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
