"""kvpipe.TransferEngine: Mooncake's Python API, in one process and across two."""
import ctypes
import os
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import kvpipe  # noqa: E402

SIZE = 256 * 1024


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


class LocalTests(unittest.TestCase):
    def test_methods_before_initialize_raise(self):
        eng = kvpipe.TransferEngine()
        with self.assertRaises(kvpipe.Error):
            eng.get_rpc_port()
        with self.assertRaises(kvpipe.Error):
            eng.allocate_managed_buffer(4096)
        self.assertTrue(issubclass(kvpipe.Error, RuntimeError))

    def test_initialize_host_port(self):
        port = tu.free_port()
        eng = kvpipe.TransferEngine()
        self.assertEqual(eng.initialize("%s:%d" % (tu.HOST, port), "P2PHANDSHAKE", "tcp", ""), 0)
        self.assertEqual(eng.get_rpc_port(), port)
        self.assertEqual(eng.get_segment_name(), "%s:%d" % (tu.HOST, port))
        # A second initialize is refused with a negative status, as an int.
        ret = eng.initialize("%s:%d" % (tu.HOST, port), "P2PHANDSHAKE", "tcp", "")
        self.assertEqual(ret, -kvpipe.EBUSY)
        self.assertIn("already", kvpipe.last_error())
        eng.close()
        with self.assertRaises(kvpipe.Error):
            eng.get_rpc_port()

    def test_initialize_bare_host_picks_port(self):
        # SGLang and vLLM's MooncakeConnector pass a bare host and then ask.
        eng = tu.new_engine(host=tu.HOST)
        port = eng.get_rpc_port()
        self.assertGreater(port, 0)
        self.assertEqual(eng.get_segment_name(), "%s:%d" % (tu.HOST, port))
        self.assertFalse(tu.port_free(port))  # the engine really listens there
        eng.close()

    def test_bare_ipv6_host(self):
        import socket
        try:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::1", 0))
        except OSError:
            self.skipTest("no IPv6 loopback")
        a, b = tu.new_engine(host="::1"), tu.new_engine(host="[::1]")
        self.assertEqual(b.get_segment_name(), "[::1]:%d" % b.get_rpc_port())
        src = b.allocate_managed_buffer(64)
        b.write_bytes_to_buffer(src, b"over v6", 7)
        dst = a.allocate_managed_buffer(64)
        self.assertEqual(a.transfer_sync_read(b.get_segment_name(), dst, src, 7), 0,
                         kvpipe.last_error())
        self.assertEqual(a.read_bytes_from_buffer(dst, 7), b"over v6")

    def test_initialize_unreachable_metadata(self):
        dead = tu.free_port()
        eng = kvpipe.TransferEngine()
        ret = eng.initialize("%s:%d" % (tu.HOST, tu.free_port()),
                             "http://%s:%d/metadata" % (tu.HOST, dead), "tcp", "")
        self.assertLess(ret, 0)
        self.assertIn(str(dead), kvpipe.last_error())
        with self.assertRaises(kvpipe.Error):
            eng.get_rpc_port()  # still not initialized

    def test_initialize_ext_builds_scheme(self):
        dead = tu.free_port()
        eng = kvpipe.TransferEngine()
        ret = eng.initialize_ext("%s:%d" % (tu.HOST, tu.free_port()), "%s:%d" % (tu.HOST, dead),
                                 "tcp", "", "redis")
        self.assertLess(ret, 0)
        self.assertIn(str(dead), kvpipe.last_error())
        with tu.MetadataServer() as md:
            eng = kvpipe.TransferEngine()
            ret = eng.initialize_ext("%s:%d" % (tu.HOST, tu.free_port()),
                                     "%s:%d/metadata" % (tu.HOST, md.port), "tcp", "", "http")
            self.assertEqual(ret, 0, kvpipe.last_error())
            eng.close()
        # P2PHANDSHAKE in lower case gets no scheme: the engine says what was meant.
        eng = kvpipe.TransferEngine()
        ret = eng.initialize_ext("%s:%d" % (tu.HOST, tu.free_port()), "p2phandshake", "tcp", "",
                                 "etcd")
        self.assertLess(ret, 0)
        self.assertIn("did you mean 'P2PHANDSHAKE'", kvpipe.last_error())

    def test_managed_buffer_bytes(self):
        eng = tu.new_engine()
        addr = eng.allocate_managed_buffer(SIZE)
        self.assertNotEqual(addr, 0)
        data = pattern(3, SIZE)
        self.assertEqual(eng.write_bytes_to_buffer(addr, data, SIZE), 0)
        self.assertEqual(eng.read_bytes_from_buffer(addr, SIZE), data)
        self.assertEqual(eng.read_bytes_from_buffer(addr + 100, 50), data[100:150])
        self.assertEqual(eng.write_bytes_to_buffer(addr + 10, "héllo", 3), 0)  # str, as pybind
        self.assertEqual(eng.read_bytes_from_buffer(addr + 10, 3), "héllo".encode()[:3])
        # Outside the buffer: a negative status / an exception, never a crash.
        self.assertEqual(eng.write_bytes_to_buffer(addr + SIZE - 4, b"12345678", 8),
                         -kvpipe.ERANGE)
        self.assertEqual(eng.write_bytes_to_buffer(addr, b"abc", 10), -kvpipe.EINVAL)
        with self.assertRaises(kvpipe.Error) as cm:
            eng.read_bytes_from_buffer(addr + SIZE - 1, 2)
        self.assertIn("not inside", str(cm.exception))
        self.assertEqual(eng.free_managed_buffer(addr, SIZE), 0)
        with self.assertRaises(kvpipe.Error):
            eng.read_bytes_from_buffer(addr, 1)
        self.assertLess(eng.free_managed_buffer(12345, 8), 0)
        self.assertEqual(eng.allocate_managed_buffer(0), 0)  # Mooncake: 0 on failure
        eng.close()

    def test_register_unregister(self):
        eng = tu.new_engine()
        a = ctypes.create_string_buffer(8192)
        b = ctypes.create_string_buffer(8192)
        pa, pb = ctypes.addressof(a), ctypes.addressof(b)
        self.assertEqual(eng.register_memory(pa, 8192), 0)
        self.assertLess(eng.register_memory(pa + 4096, 100), 0)  # overlaps
        self.assertEqual(eng.write_bytes_to_buffer(pa + 1, b"xyz", 3), 0)
        self.assertEqual(a.raw[1:4], b"xyz")
        self.assertEqual(eng.unregister_memory(pa), 0)
        self.assertLess(eng.unregister_memory(pa), 0)
        self.assertEqual(eng.write_bytes_to_buffer(pa, b"x", 1), -kvpipe.ERANGE)
        # batch: all or nothing
        self.assertEqual(eng.register_memory(pb, 8192), 0)
        self.assertLess(eng.batch_register_memory([pa, pb + 16], [8192, 16]), 0)
        self.assertEqual(eng.register_memory(pa, 8192), 0)  # pa was rolled back
        self.assertEqual(eng.batch_unregister_memory([pa, pb]), 0)
        self.assertEqual(eng.batch_register_memory([pa, pb], [8192, 8192]), 0)
        self.assertEqual(eng.batch_unregister_memory([pa, pb]), 0)
        with self.assertRaises(ValueError):
            eng.batch_register_memory([pa, pb], [8192])
        eng.close()

    def test_opcode_enum(self):
        self.assertEqual(int(kvpipe.TransferOpcode.Read), 0)
        self.assertEqual(int(kvpipe.TransferOpcode.Write), 1)
        self.assertIs(kvpipe.TransferEngine.TransferOpcode, kvpipe.TransferOpcode)
        self.assertEqual(kvpipe.Write, kvpipe.TransferOpcode.Write)


class TwoProcessTests(unittest.TestCase):
    metadata_mode = "p2p"
    transport = None  # default: the engine picks (shm for a same-host peer, when built)

    def setUp(self):
        self.saved_env = os.environ.get("KVPIPE_DISABLE_SHM")
        if self.transport == "tcp":
            os.environ["KVPIPE_DISABLE_SHM"] = "1"
        else:
            os.environ.pop("KVPIPE_DISABLE_SHM", None)
        self.md = None
        if self.metadata_mode == "http":
            self.md = tu.MetadataServer().__enter__()
            self.metadata = self.md.url
        else:
            self.metadata = "P2PHANDSHAKE"
        self.target = "%s:%d" % (tu.HOST, tu.free_port())
        self.peer = tu.python_child("engine_peer.py", self.target, self.metadata, SIZE)
        words = self.peer.readline().split()
        self.assertEqual(words[0], "READY", " ".join(words))
        self.peer_managed, self.peer_region = int(words[2]), int(words[3])
        self.eng = tu.new_engine(self.metadata)
        self.local = self.eng.allocate_managed_buffer(SIZE)
        self.assertNotEqual(self.local, 0)

    def tearDown(self):
        tu.restore_env("KVPIPE_DISABLE_SHM", self.saved_env)
        self.eng.close()
        self.peer.finish()
        if self.md:
            self.md.__exit__(None, None, None)

    def peer_bytes(self, addr, n):
        self.peer.send("HEX %d %d" % (addr, n))
        return bytes.fromhex(self.peer.readline())

    def local_bytes(self, n, off=0):
        return self.eng.read_bytes_from_buffer(self.local + off, n)

    def test_sync_read_write(self):
        e = self.eng
        self.assertEqual(e.transfer_sync_read(self.target, self.local, self.peer_managed, SIZE), 0,
                         kvpipe.last_error())
        self.assertEqual(self.local_bytes(SIZE), pattern(1, SIZE))
        used = e.segment_transport(self.target)
        self.assertIn(used, ("tcp", "shm"))
        if self.transport:
            self.assertEqual(used, self.transport)
        ret = e.transfer_sync(self.target, self.local, self.peer_region + 64, 4096,
                              kvpipe.TransferOpcode.Read)
        self.assertEqual(ret, 0, kvpipe.last_error())
        self.assertEqual(self.local_bytes(4096), pattern(2, SIZE)[64:64 + 4096])
        mine = pattern(9, 8192)
        e.write_bytes_to_buffer(self.local, mine, 8192)
        self.assertEqual(e.transfer_sync_write(self.target, self.local, self.peer_managed + 100,
                                               8192), 0, kvpipe.last_error())
        self.assertEqual(self.peer_bytes(self.peer_managed + 100, 8192), mine)
        # transfer_sync with opcode Write, keyword arguments as Mooncake names them
        ret = e.transfer_sync(target_hostname=self.target, buffer=self.local,
                              peer_buffer_address=self.peer_region, length=1000,
                              opcode=kvpipe.TransferOpcode.Write)
        self.assertEqual(ret, 0, kvpipe.last_error())
        self.assertEqual(self.peer_bytes(self.peer_region, 1000), mine[:1000])
        # untouched bytes around the write stayed as they were
        self.assertEqual(self.peer_bytes(self.peer_managed, 100), pattern(1, 100))

    def test_batches(self):
        e = self.eng
        chunk = 16 * 1024
        offs = [0, 3 * chunk, 5 * chunk, 10 * chunk]
        ret = e.batch_transfer_sync_read(self.target, [self.local + i * chunk for i in range(4)],
                                         [self.peer_managed + o for o in offs], [chunk] * 4)
        self.assertEqual(ret, 0, kvpipe.last_error())
        want = pattern(1, SIZE)
        for i, o in enumerate(offs):
            self.assertEqual(self.local_bytes(chunk, i * chunk), want[o:o + chunk])
        mine = pattern(5, 2 * chunk)
        e.write_bytes_to_buffer(self.local, mine, 2 * chunk)
        ret = e.batch_transfer_sync_write(self.target, [self.local, self.local + chunk],
                                          [self.peer_region, self.peer_region + 8 * chunk],
                                          [chunk, chunk])
        self.assertEqual(ret, 0, kvpipe.last_error())
        self.assertEqual(self.peer_bytes(self.peer_region, chunk), mine[:chunk])
        self.assertEqual(self.peer_bytes(self.peer_region + 8 * chunk, chunk), mine[chunk:])
        # async: ids are positive, status collects them once
        b1 = e.batch_transfer_async_write(self.target, [self.local], [self.peer_managed], [chunk])
        b2 = e.batch_transfer_async_read(self.target, [self.local + 4 * chunk],
                                         [self.peer_region + 8 * chunk], [chunk])
        self.assertGreater(b1, 0, kvpipe.last_error())
        self.assertGreater(b2, 0, kvpipe.last_error())
        self.assertNotEqual(b1, b2)
        self.assertEqual(e.get_batch_transfer_status([b1, b2]), 0, kvpipe.last_error())
        self.assertEqual(self.peer_bytes(self.peer_managed, chunk), mine[:chunk])
        self.assertEqual(self.local_bytes(chunk, 4 * chunk), mine[chunk:])
        self.assertLess(e.get_batch_transfer_status([b1]), 0)  # spent
        b3 = e.batch_transfer_async(self.target, [self.local], [self.peer_region], [chunk],
                                    kvpipe.TransferOpcode.Read)
        self.assertGreater(b3, 0)
        self.assertEqual(e.get_batch_transfer_status([b3]), 0)
        self.assertEqual(self.local_bytes(chunk), mine[:chunk])
        # submit + poll
        bid = e.transfer_submit_write(self.target, self.local, self.peer_managed + chunk, 64)
        self.assertGreater(bid, 0)
        # poll until done; the deadline only bounds a hang, it is no speed check
        deadline = time.monotonic() + 20
        while (st := e.transfer_check_status(bid)) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        self.assertEqual(st, 1, kvpipe.last_error())
        self.assertEqual(self.peer_bytes(self.peer_managed + chunk, 64), mine[:64])
        self.assertEqual(e.transfer_check_status(bid), -1)  # spent
        # an empty batch completes
        self.assertEqual(e.batch_transfer_sync_read(self.target, [], [], []), 0)

    def test_errors(self):
        e = self.eng
        # outside the peer's registered memory (the ctypes region is registered
        # exactly; a managed buffer lies inside a larger pool chunk): refused,
        # and the peer keeps serving
        ret = e.transfer_sync_read(self.target, self.local, self.peer_region + SIZE - 8, 64)
        self.assertEqual(ret, -kvpipe.ERANGE)
        self.assertIn("outside", kvpipe.last_error())
        ret = e.transfer_sync_write(self.target, self.local, 4096, 64)
        self.assertEqual(ret, -kvpipe.ERANGE)
        self.assertEqual(e.transfer_sync_read(self.target, self.local, self.peer_managed, 64), 0,
                         kvpipe.last_error())
        # no such segment
        dead = "%s:%d" % (tu.HOST, tu.free_port())
        self.assertLess(e.transfer_sync_read(dead, self.local, self.peer_managed, 64), 0)
        self.assertNotEqual(kvpipe.last_error(), "")
        self.assertEqual(e.batch_transfer_async_read(dead, [self.local], [0], [8]), 0)
        # argument errors raise, as pybind would
        with self.assertRaises(ValueError):
            e.batch_transfer_sync_read(self.target, [self.local], [1, 2], [8])
        with self.assertRaises(ValueError):
            e.transfer_sync(self.target, self.local, self.peer_managed, 8, 7)
        with self.assertRaises(TypeError):
            e.transfer_sync_read(self.target, "x", self.peer_managed, 8)
        with self.assertRaises(OverflowError):
            e.transfer_sync_read(self.target, -1, self.peer_managed, 8)
        self.assertLess(e.get_batch_transfer_status([987654321]), 0)
        self.assertEqual(e.transfer_check_status(987654321), -1)

    def test_peer_killed(self):
        e = self.eng
        self.assertEqual(e.transfer_sync_read(self.target, self.local, self.peer_managed, 64), 0,
                         kvpipe.last_error())
        self.peer.kill()
        # bounded by the engine's I/O timeout; a hang would trip the test timeout
        self.assertLess(e.transfer_sync_read(self.target, self.local, self.peer_managed, 4096), 0)
        self.assertLess(e.batch_transfer_sync_write(self.target, [self.local],
                                                    [self.peer_managed], [4096]), 0)


class TwoProcessHttpTests(TwoProcessTests):
    metadata_mode = "http"


class TwoProcessTcpTests(TwoProcessTests):
    transport = "tcp"


class TwoProcessHttpTcpTests(TwoProcessTests):
    metadata_mode = "http"
    transport = "tcp"


if __name__ == "__main__":
    tu.main()
