"""Both sides of a disaggregated request from Python: a prefill process sends
a request's KV blocks through a kvpipe.Pipe, a decode process receives them
and checks every byte.

    PYTHONPATH=build/python /usr/bin/python3 examples/pipe_pair.py

(the module in build/python is built for /usr/bin/python3; `pip install .`
installs it into any interpreter, docs/python.md).

The config is MooncakePipe's (a dict here; a path to the JSON file works
too). Each side binds its url's port and a few above it (docs/pipe.md).
"""
import multiprocessing
import random
import socket

import numpy

import kvpipe

LAYERS, TOKENS, HIDDEN = 4, 256, 1024  # a small shape: 512 KiB a layer


def port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pipe_base():
    """A base port whose pipe ports are all free now: each side binds its
    url's port, +9 and +10, and decode's are 100 above prefill's (both urls
    name one host). Drawn below Linux's ephemeral ports (32768 and up), which
    any outgoing connection on the host may take meanwhile."""
    for _ in range(200):
        base = random.randint(20000, 30000)
        if all(port_free(base + d) for d in (0, 9, 10, 100, 109, 110)):
            return base
    raise RuntimeError("no free pipe ports on 127.0.0.1 between 20000 and 30110")


def block(layer):
    """The KV block of one layer, bfloat16-sized values built from its index."""
    return numpy.arange(TOKENS * HIDDEN, dtype=numpy.uint16).reshape(TOKENS, HIDDEN) + layer


def prefill(config):
    with kvpipe.Pipe(config, 0, 0) as pipe:
        for layer in range(LAYERS):
            pipe.send_tensor(block(layer))
        pipe.send_tensor(None)  # end of request
        pipe.flush(timeout=30)  # every tensor acknowledged before closing


def decode(config, result):
    with kvpipe.Pipe(config, 0, 1) as pipe:
        layer = 0
        while (t := pipe.recv_tensor(timeout=30)) is not None:
            got = numpy.from_dlpack(t).view(numpy.uint16).reshape(TOKENS, HIDDEN)
            assert (got == block(layer)).all(), "layer %d differs" % layer
            layer += 1
        result.put(layer)


def main():
    port = pipe_base()
    # One url for both: on one host decode's ports are 100 above (vLLM's rule).
    config = {"prefill_url": "127.0.0.1:%d" % port, "decode_url": "127.0.0.1:%d" % port,
              "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "device_name": ""}
    result = multiprocessing.Queue()
    sides = [multiprocessing.Process(target=prefill, args=(config,)),
             multiprocessing.Process(target=decode, args=(config, result))]
    for p in sides:
        p.start()
    for p in sides:
        p.join(60)
    if any(p.exitcode != 0 for p in sides):
        raise SystemExit("a side failed: exit codes %s" % [p.exitcode for p in sides])
    print("decode received %d KV blocks of %d bytes, every byte checked"
          % (result.get(timeout=5), TOKENS * HIDDEN * 2))


if __name__ == "__main__":
    main()
