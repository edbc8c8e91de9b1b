"""The `mooncake` compatibility package: `from mooncake.engine import TransferEngine`
gives kvpipe's engine, usable as Mooncake's."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402


class ShimTests(unittest.TestCase):
    def test_import_gives_kvpipe_engine(self):
        import kvpipe
        from mooncake.engine import TransferEngine, TransferOpcode
        import mooncake.engine as me
        self.assertIs(TransferEngine, kvpipe.TransferEngine)
        self.assertIs(TransferOpcode, kvpipe.TransferOpcode)
        self.assertEqual(me.BACKEND, "kvpipe")
        self.assertFalse(me.SUPPORT_CUDA)

    def test_vllm_v0_call_sequence(self):
        # What vLLM's MooncakePipe does with the engine: initialize (or
        # initialize_ext with a backend), allocate, write bytes, read them back
        # from a peer, free.
        from mooncake.engine import TransferEngine
        a, b = TransferEngine(), TransferEngine()
        name_a = "%s:%d" % (tu.HOST, tu.free_port())
        name_b = "%s:%d" % (tu.HOST, tu.free_port())
        self.assertEqual(a.initialize(name_a, "P2PHANDSHAKE", "tcp", ""), 0)
        self.assertEqual(b.initialize(name_b, "P2PHANDSHAKE", "tcp", ""), 0)
        payload = os.urandom(5000)
        src = a.allocate_managed_buffer(len(payload))
        self.assertNotEqual(src, 0)
        self.assertEqual(a.write_bytes_to_buffer(src, payload, len(payload)), 0)
        dst = b.allocate_managed_buffer(len(payload))
        self.assertEqual(b.transfer_sync_read(name_a, dst, src, len(payload)), 0)
        self.assertEqual(b.read_bytes_from_buffer(dst, len(payload)), payload)
        self.assertEqual(a.free_managed_buffer(src, len(payload)), 0)
        self.assertEqual(b.free_managed_buffer(dst, len(payload)), 0)

    def test_sglang_call_sequence(self):
        # SGLang / vLLM's MooncakeConnector: bare hostname + P2PHANDSHAKE, the
        # session id is host:get_rpc_port(), memory registered in a batch,
        # batch_transfer_sync_write into the peer's registered memory.
        import ctypes
        from mooncake.engine import TransferEngine
        os.environ["KVPIPE_PROTOCOL"] = "tcp"  # SGLang hard-codes "rdma"
        try:
            a, b = TransferEngine(), TransferEngine()
            self.assertEqual(a.initialize(tu.HOST, "P2PHANDSHAKE", "rdma", "mlx5_0"), 0)
            self.assertEqual(b.initialize(tu.HOST, "P2PHANDSHAKE", "rdma", "mlx5_0"), 0)
        finally:
            del os.environ["KVPIPE_PROTOCOL"]
        session_b = "%s:%d" % (tu.HOST, b.get_rpc_port())
        bufs = [ctypes.create_string_buffer(4096) for _ in range(4)]
        ptrs = [ctypes.addressof(x) for x in bufs]
        self.assertEqual(a.batch_register_memory(ptrs[:2], [4096, 4096]), 0)
        self.assertEqual(b.batch_register_memory(ptrs[2:], [4096, 4096]), 0)
        bufs[0].raw = b"A" * 4096
        bufs[1].raw = b"B" * 4096
        ret = a.batch_transfer_sync_write(session_b, ptrs[:2], ptrs[2:], [4096, 4096])
        self.assertEqual(ret, 0)
        self.assertEqual(bufs[2].raw, b"A" * 4096)
        self.assertEqual(bufs[3].raw, b"B" * 4096)
        self.assertEqual(a.batch_unregister_memory(ptrs[:2]), 0)
        self.assertEqual(b.batch_unregister_memory(ptrs[2:]), 0)


if __name__ == "__main__":
    tu.main()
