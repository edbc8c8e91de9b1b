"""The prefill side of test_gpu_double.py: KV blocks in "GPU memory" of the CUDA
driver's test double, registered as vLLM v1's MooncakeConnector does.

    gpu_peer.py LOCAL_NAME BLOCKS BLOCK_BYTES

Allocates BLOCKS device blocks on device 1 (KVPT_FAKECUDA names the double,
which kvpipe loads through KVPIPE_LIBCUDA), fills block i with pattern(100 + i),
registers them with batch_register_memory, prints

    READY <rpc_port> <addr0> <addr1> ...

and serves commands from stdin, one per line:

    HEX <addr> <length>   the bytes at addr, through the double (not the CPU)
    EXIT                  close the engine and exit 0
"""
import ctypes
import os
import sys

os.environ["KVPIPE_LIBCUDA"] = os.environ["KVPT_FAKECUDA"]
import kvpipe  # noqa: E402


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


def main():
    name, blocks, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cuda = ctypes.CDLL(os.environ["KVPT_FAKECUDA"])
    cuda.fakecuda_alloc.restype = ctypes.c_void_p
    cuda.fakecuda_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t]
    cuda.fakecuda_poke.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    cuda.fakecuda_peek.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    eng = kvpipe.TransferEngine()
    if eng.initialize(name, "P2PHANDSHAKE", "tcp", "") != 0:
        print("FAILED", kvpipe.last_error(), flush=True)
        return 1
    addrs = [cuda.fakecuda_alloc(1, size) for _ in range(blocks)]
    for i, a in enumerate(addrs):
        cuda.fakecuda_poke(a, pattern(100 + i, size), size)
    if eng.batch_register_memory(addrs, [size] * blocks) != 0:
        print("FAILED", kvpipe.last_error(), flush=True)
        return 1
    print("READY", eng.get_rpc_port(), " ".join(str(a) for a in addrs), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "HEX":
            n = int(words[2])
            buf = ctypes.create_string_buffer(n)
            cuda.fakecuda_peek(buf, int(words[1]), n)
            print(buf.raw.hex(), flush=True)
        elif words and words[0] == "EXIT":
            break
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
