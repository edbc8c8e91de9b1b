"""The callers' patterns, replayed through `mooncake.engine` (kvpipe's drop-in)
against a peer in another process, host memory, every byte checked, with each
call's latency reported (p50/p99).

vLLM v1 (MooncakeConnector): initialize(host, "P2PHANDSHAKE", "tcp", ""),
get_rpc_port(), batch_register_memory of the KV cache (a tensor per layer, K
and V), then, per request, ten threads of batch_transfer_sync_write with
thousands of block descriptors each. Its ZMQ side channel (the decode side's
block addresses) is replaced by the simplest stand-in: the peer prints them.

SGLang (Mooncake backend): register_memory / transfer_sync_write /
unregister_memory per request; after the peer restarts under the same name,
send_probe and the next transfer succeed without restarting the engine.

    python3 test_replay.py                      # the CI form (small counts)
    KVPT_REPLAY_REQUESTS=50 python3 test_replay.py   # longer; prints the table

No Mooncake build exists on the machine this was written on, so there are no
figures on Mooncake to put next to these (docs/python.md says how to run it
against one: the calls are Mooncake's own)."""
import ctypes
import hashlib
import os
import threading
import time
import unittest

import kvpy_testutil as tu
from mooncake.engine import TransferEngine

LAYERS = 32                       # K and V of each: 64 registered tensors
BLOCK = 4096                      # bytes of one block of one tensor
BLOCKS = 32                       # blocks per tensor per thread
THREADS = 10
PER_CALL = LAYERS * 2 * BLOCKS    # 2048 descriptors in each call
TENSOR = THREADS * BLOCKS * BLOCK  # bytes of each registered tensor (1.25 MiB)
REQUESTS = int(os.environ.get("KVPT_REPLAY_REQUESTS", "3"))


def fill(seed, n):
    return hashlib.shake_256(b"%d" % seed).digest(n)


def percentiles(samples):
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return pick(0.5) * 1e3, pick(0.99) * 1e3


class Peer:
    """engine_peer.py with a registered region of size bytes."""

    def __init__(self, name, size):
        self.child = tu.python_child("engine_peer.py", name, "P2PHANDSHAKE", size)
        words = self.child.readline().split()
        if words[0] != "READY":
            raise RuntimeError(" ".join(words))
        self.region = int(words[3])

    def sha(self, addr, n):
        self.child.send("SHA %d %d" % (addr, n))
        return self.child.readline()

    def close(self):
        self.child.finish()


class Report:
    lines = []

    @classmethod
    def add(cls, what, samples):
        p50, p99 = percentiles(samples)
        cls.lines.append("%-48s %6d calls  p50 %8.2f ms  p99 %8.2f ms" % (what, len(samples), p50,
                                                                          p99))


class VllmV1(unittest.TestCase):
    def test_ten_threads_of_batch_writes(self):
        name = "%s:%d" % (tu.HOST, tu.free_port())
        peer = Peer(name, LAYERS * 2 * TENSOR)
        try:
            eng = TransferEngine()
            self.assertEqual(eng.initialize(tu.HOST, "P2PHANDSHAKE", "tcp", ""), 0)
            self.assertGreater(eng.get_rpc_port(), 0)
            kv = [ctypes.create_string_buffer(TENSOR) for _ in range(LAYERS * 2)]
            ptrs = [ctypes.addressof(b) for b in kv]
            t0 = time.perf_counter()
            self.assertEqual(eng.batch_register_memory(ptrs, [TENSOR] * len(ptrs)), 0)
            Report.add("vLLM v1 batch_register_memory (64 tensors)", [time.perf_counter() - t0])
            remote = [peer.region + i * TENSOR for i in range(LAYERS * 2)]
            lat = []
            lock = threading.Lock()
            for r in range(REQUESTS):
                for i, b in enumerate(kv):
                    ctypes.memmove(b, fill(r * 1000 + i, TENSOR), TENSOR)
                rets = [None] * THREADS

                def writer(t):
                    src, dst = [], []
                    for i in range(LAYERS * 2):
                        for k in range(BLOCKS):
                            off = (t * BLOCKS + k) * BLOCK
                            src.append(ptrs[i] + off)
                            dst.append(remote[i] + off)
                    s = time.perf_counter()
                    rets[t] = eng.batch_transfer_sync_write(name, src, dst, [BLOCK] * PER_CALL)
                    with lock:
                        lat.append(time.perf_counter() - s)

                threads = [threading.Thread(target=writer, args=(t,)) for t in range(THREADS)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                self.assertEqual(rets, [0] * THREADS)
                for i in (0, LAYERS, LAYERS * 2 - 1):  # three tensors of the request, whole
                    self.assertEqual(peer.sha(remote[i], TENSOR),
                                     hashlib.sha256(fill(r * 1000 + i, TENSOR)).hexdigest())
            Report.add("vLLM v1 batch_transfer_sync_write (%d descs)" % PER_CALL, lat)
            self.assertEqual(eng.batch_unregister_memory(ptrs), 0)
        finally:
            peer.close()


class SGLang(unittest.TestCase):
    def test_register_per_request_and_probe_after_restart(self):
        port = tu.free_port()
        name = "%s:%d" % (tu.HOST, port)
        size = 4 << 20
        peer = Peer(name, size)
        eng = TransferEngine()
        try:
            self.assertEqual(eng.initialize(tu.HOST, "P2PHANDSHAKE", "tcp", ""), 0)
            reg, xfer, unreg = [], [], []
            for r in range(REQUESTS * 10):
                if r == REQUESTS * 5:  # the decode instance restarts under its name
                    peer.close()
                    peer = Peer(name, size)
                    s = time.perf_counter()
                    self.assertEqual(eng.send_probe(name), 0)
                    Report.add("SGLang send_probe after the peer restarted",
                               [time.perf_counter() - s])
                n = 256 << 10
                buf = ctypes.create_string_buffer(fill(r, n), n)
                ptr = ctypes.addressof(buf)
                s = time.perf_counter()
                self.assertEqual(eng.register_memory(ptr, n), 0)
                reg.append(time.perf_counter() - s)
                dst = peer.region + (r % 16) * n
                s = time.perf_counter()
                self.assertEqual(eng.transfer_sync_write(name, ptr, dst, n), 0)
                xfer.append(time.perf_counter() - s)
                s = time.perf_counter()
                self.assertEqual(eng.unregister_memory(ptr), 0)
                unreg.append(time.perf_counter() - s)
                self.assertEqual(peer.sha(dst, n), hashlib.sha256(fill(r, n)).hexdigest())
            Report.add("SGLang register_memory (256 KiB)", reg)
            Report.add("SGLang transfer_sync_write (256 KiB)", xfer)
            Report.add("SGLang unregister_memory", unreg)
        finally:
            peer.close()


def print_report():
    print("\nper-call latency on kvpipe (host memory, tcp, loopback; %d requests):" % REQUESTS)
    for line in Report.lines:
        print("  " + line)


if __name__ == "__main__":
    import atexit
    atexit.register(print_report)
    tu.main()
