"""The prefill side of test_gpu_vllm.py: KV blocks in GPU memory, registered
as vLLM v1's MooncakeConnector does.

    gpu_peer.py LOCAL_NAME BLOCKS BLOCK_BYTES

Allocates BLOCKS device blocks through cuda_mem (the real driver, or the
double KVPT_FAKECUDA names), fills block i with pattern(100 + i), registers
them with batch_register_memory, prints

    READY <rpc_port> <addr0> <addr1> ...

and serves commands from stdin, one per line:

    HEX <addr> <length>   the bytes at addr, copied device to host by the driver
    EXIT                  close the engine and exit 0
"""
import sys

import cuda_mem

DEV = cuda_mem.open_driver()  # before kvpipe: it loads the same driver
import kvpipe  # noqa: E402


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


def main():
    name, blocks, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if DEV is None:
        print("FAILED no CUDA driver with a device here", flush=True)
        return 1
    eng = kvpipe.TransferEngine()
    if eng.initialize(name, "P2PHANDSHAKE", "tcp", "") != 0:
        print("FAILED", kvpipe.last_error(), flush=True)
        return 1
    addrs = [DEV.alloc(size) for _ in range(blocks)]
    for i, a in enumerate(addrs):
        DEV.write(a, pattern(100 + i, size))
    if eng.batch_register_memory(addrs, [size] * blocks) != 0:
        print("FAILED", kvpipe.last_error(), flush=True)
        return 1
    print("READY", eng.get_rpc_port(), " ".join(str(a) for a in addrs), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "HEX":
            print(DEV.read(int(words[1]), int(words[2])).hex(), flush=True)
        elif words and words[0] == "EXIT":
            break
    eng.close()
    for a in addrs:
        DEV.free(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
