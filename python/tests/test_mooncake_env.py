"""Deployments as Mooncake users run them: MC_FORCE_TCP with stacks that pass
"rdma", the error that says how to run over TCP, and registration against a
metadata server with Mooncake's rules (kvpipe's own `metadata-server`, which
refuses a second PUT of an rpc_meta key), including a restart after SIGKILL
under the same name."""
import ctypes
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import kvpipe  # noqa: E402

SIZE = 64 << 10


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


class EnvCase(unittest.TestCase):
    """Restores the variables a case sets."""

    names = ("MC_FORCE_TCP", "KVPIPE_PROTOCOL")

    def setUp(self):
        self.saved = {n: os.environ.get(n) for n in self.names}
        for n in self.names:
            os.environ.pop(n, None)

    def tearDown(self):
        for n, v in self.saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


class ForceTcpTests(EnvCase):
    def test_rdma_without_force_says_how_to_run_over_tcp(self):
        for value in (None, "0", "false", "off"):
            if value is None:
                os.environ.pop("MC_FORCE_TCP", None)
            else:
                os.environ["MC_FORCE_TCP"] = value
            eng = kvpipe.TransferEngine()
            self.assertEqual(eng.initialize(tu.HOST, "P2PHANDSHAKE", "rdma", "mlx5_0"),
                             -kvpipe.ENOTSUP, value)
            msg = kvpipe.last_error()
            self.assertIn("'rdma'", msg)
            self.assertIn("protocol 'tcp'", msg)
            self.assertIn("MC_FORCE_TCP=1", msg)

    def test_force_tcp_serves_rdma_across_processes(self):
        # The peer, a process of its own, also asks for rdma under MC_FORCE_TCP.
        os.environ["MC_FORCE_TCP"] = "1"
        target = "%s:%d" % (tu.HOST, tu.free_port())
        peer = tu.python_child("engine_peer.py", target, "P2PHANDSHAKE", SIZE, "rdma")
        try:
            words = peer.readline().split()
            self.assertEqual(words[0], "READY", " ".join(words))
            managed = int(words[2])
            eng = kvpipe.TransferEngine()
            self.assertEqual(eng.initialize(tu.HOST, "P2PHANDSHAKE", "rdma", "mlx5_0"), 0,
                             kvpipe.last_error())
            local = eng.allocate_managed_buffer(SIZE)
            self.assertNotEqual(local, 0)
            self.assertEqual(eng.transfer_sync_read(target, local, managed, SIZE), 0,
                             kvpipe.last_error())
            self.assertEqual(eng.read_bytes_from_buffer(local, SIZE), pattern(1, SIZE))
            self.assertIn(eng.segment_transport(target), ("tcp", "shm"))
            eng.close()
            peer.send("EXIT")
            self.assertEqual(peer.wait(), 0)
        finally:
            peer.close()

    def test_force_tcp_pipe_config_rdma(self):
        # No such device here: rdma cannot run, whether kvpipe has UCX or not.
        cfg = tu.pipe_config(protocol="rdma", device_name="mlx5_0")
        with self.assertRaises(kvpipe.Error) as cm:
            kvpipe.Pipe(cfg, 0, 0)
        self.assertEqual(cm.exception.status, kvpipe.ENOTSUP)
        self.assertIn('"protocol": "tcp"', str(cm.exception))
        self.assertIn("MC_FORCE_TCP=1", str(cm.exception))
        os.environ["MC_FORCE_TCP"] = "1"
        with kvpipe.Pipe(cfg, 0, 0) as prefill, kvpipe.Pipe(cfg, 0, 1) as decode:
            prefill.send_tensor(None)
            self.assertIsNone(decode.recv_tensor(timeout=30))


class MooncakeServerRulesTests(unittest.TestCase):
    """Mooncake's server refuses a second PUT of rpc_meta: registration must
    rewrite only the descriptor (issue 10: every register_memory returned -10
    and allocate_managed_buffer 0 against it)."""

    def test_register_and_restart_after_kill(self):
        with tu.MetadataServer() as md:
            target = "%s:%d" % (tu.HOST, tu.free_port())
            peer = tu.python_child("engine_peer.py", target, md.url, SIZE)
            try:
                words = peer.readline().split()
                self.assertEqual(words[0], "READY", " ".join(words))
                eng = kvpipe.TransferEngine()
                name = "%s:%d" % (tu.HOST, tu.free_port())
                self.assertEqual(eng.initialize(name, md.url, "tcp", ""), 0, kvpipe.last_error())
                bufs = [ctypes.create_string_buffer(4096) for _ in range(3)]
                for b in bufs:
                    self.assertEqual(eng.register_memory(ctypes.addressof(b), 4096), 0,
                                     kvpipe.last_error())
                local = eng.allocate_managed_buffer(SIZE)
                self.assertNotEqual(local, 0, kvpipe.last_error())
                self.assertEqual(eng.unregister_memory(ctypes.addressof(bufs[0])), 0)
                self.assertEqual(eng.transfer_sync_read(target, local, int(words[2]), SIZE), 0,
                                 kvpipe.last_error())
                self.assertEqual(eng.read_bytes_from_buffer(local, SIZE), pattern(1, SIZE))
                # The peer dies without cleaning up; its replacement, with the
                # same name, comes back over the stale keys by itself.
                peer.kill()
                peer.close()
                peer = tu.python_child("engine_peer.py", target, md.url, SIZE)
                words = peer.readline().split()
                self.assertEqual(words[0], "READY", " ".join(words))
                managed = int(words[2])
                ret = eng.transfer_sync_read(target, local, managed, SIZE)
                if ret != 0:  # the cached descriptor was the dead process's: looked up again
                    ret = eng.transfer_sync_read(target, local, managed, SIZE)
                self.assertEqual(ret, 0, kvpipe.last_error())
                self.assertEqual(eng.read_bytes_from_buffer(local, SIZE), pattern(1, SIZE))
                # A second live engine with the name is refused, and says so.
                twin = kvpipe.TransferEngine()
                self.assertEqual(twin.initialize(target, md.url, "tcp", ""), -kvpipe.EBUSY)
                self.assertIn("in use", kvpipe.last_error())
                eng.close()
                peer.send("EXIT")
                self.assertEqual(peer.wait(), 0)
            finally:
                peer.close()


if __name__ == "__main__":
    tu.main()
