"""GPU KV caches through kvpipe's mooncake.engine, the way vLLM v1's
MooncakeConnector uses it: P2PHANDSHAKE, batch_register_memory of device KV
blocks (tensor.data_ptr() ints), ten threads of batch_transfer_sync_write, every
byte checked on the peer's device; a READ into device memory. Over shm (CUDA
IPC) and over tcp (staged).

Device memory comes from cuda_mem (the CUDA driver API through ctypes): on the
real driver where one with a device is present, on the
driver's test double when KVPT_FAKECUDA names it (ctest; its memory is
PROT_NONE to the CPU, so a CPU access by kvpipe crashes the process);
otherwise the tests are skipped (docs/gpu.md)."""
import os
import threading
import unittest

import cuda_mem
import kvpy_testutil as tu

DEV = cuda_mem.open_driver()  # before kvpipe: it loads the same driver
import kvpipe  # noqa: E402

BLOCKS = 20
BLOCK = 64 * 1024


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


@unittest.skipUnless(DEV, "no CUDA driver with a device (libcuda.so.1), and KVPT_FAKECUDA "
                     "does not name the driver's test double")
class VllmV1Pattern(unittest.TestCase):
    """Same host, as the engine chooses by default: shm, the target's device
    memory reached by CUDA IPC (staged where the driver refuses it)."""
    no_shm = False

    def setUp(self):
        # Read by initialize() here and in the peer (which inherits it).
        self.saved_env = os.environ.get("KVPIPE_DISABLE_SHM")
        os.environ["KVPIPE_DISABLE_SHM"] = "1" if self.no_shm else "0"
        self.target = "%s:%d" % (tu.HOST, tu.free_port())
        self.peer = tu.python_child("gpu_peer.py", self.target, BLOCKS, BLOCK)
        words = self.peer.readline().split()
        self.assertEqual(words[0] if words else "", "READY",
                         " ".join(words) + self.peer.stderr())
        self.remote = [int(w) for w in words[2:]]
        self.eng = kvpipe.TransferEngine()
        name = "%s:%d" % (tu.HOST, tu.free_port())
        self.assertEqual(self.eng.initialize(name, "P2PHANDSHAKE", "tcp", ""), 0,
                         kvpipe.last_error())
        self.local = [DEV.alloc(BLOCK) for _ in range(BLOCKS)]
        for i, a in enumerate(self.local):
            DEV.write(a, pattern(i, BLOCK))

    def tearDown(self):
        tu.restore_env("KVPIPE_DISABLE_SHM", self.saved_env)
        self.eng.close()
        self.peer.finish()
        for a in self.local:
            DEV.free(a)

    def peer_bytes(self, addr, n):
        self.peer.send("HEX %d %d" % (addr, n))
        return bytes.fromhex(self.peer.readline())

    def test_ten_threads_write_device_blocks(self):
        e = self.eng
        self.assertEqual(e.batch_register_memory(self.local, [BLOCK] * BLOCKS), 0,
                         kvpipe.last_error())
        # Each thread writes two of its blocks, in halves, as a layer's K and V.
        rets = [None] * 10

        def writer(t):
            src, dst, lens = [], [], []
            for b in (2 * t, 2 * t + 1):
                for half in (0, BLOCK // 2):
                    src.append(self.local[b] + half)
                    dst.append(self.remote[b] + half)
                    lens.append(BLOCK // 2)
            rets[t] = e.batch_transfer_sync_write(self.target, src, dst, lens)

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(10)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        self.assertEqual(rets, [0] * 10, kvpipe.last_error())
        for b in range(BLOCKS):
            self.assertEqual(self.peer_bytes(self.remote[b], BLOCK), pattern(b, BLOCK), b)

    def test_read_into_device_and_cpu_copies_refused(self):
        e = self.eng
        self.assertEqual(e.register_memory(self.local[0], BLOCK * 1), 0, kvpipe.last_error())
        self.assertEqual(e.transfer_sync_read(self.target, self.local[0], self.remote[3], BLOCK),
                         0, kvpipe.last_error())
        self.assertEqual(DEV.read(self.local[0], BLOCK), pattern(103, BLOCK))
        # The CPU cannot copy GPU memory: an error, not a crash.
        with self.assertRaises(kvpipe.Error):
            e.read_bytes_from_buffer(self.local[0], 16)
        self.assertNotEqual(e.write_bytes_to_buffer(self.local[0], b"x" * 16, 16), 0)


class VllmV1PatternTcp(VllmV1Pattern):
    """The same over tcp (KVPIPE_DISABLE_SHM=1), as between hosts: device
    memory staged through pinned bounce buffers on both sides."""
    no_shm = True


if __name__ == "__main__":
    tu.main()
