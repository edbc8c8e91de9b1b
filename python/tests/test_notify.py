"""Notifications, send_probe and the rest of Mooncake's TransferEngine surface.

notify= sends a TransferNotify to the target once the transfer completed;
the target's get_notifies() returns it, and by then the data is in its
memory. send_probe(peer) refreshes the session to a restarted peer, as SGLang
uses it."""
import hashlib
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import kvpipe  # noqa: E402

BIG = 8 << 20  # large enough that a notification sent early beats the data


def pattern(seed, n):
    block = bytes((i * 7 + seed * 13) % 251 for i in range(65536))
    return (block * (n // len(block) + 1))[:n]


class TransferNotifyTests(unittest.TestCase):
    def test_class(self):
        n = kvpipe.TransferNotify("req-1", "done")
        self.assertEqual((n.name, n.msg), ("req-1", "done"))
        self.assertEqual(kvpipe.TransferNotify(name="a", msg="b"), kvpipe.TransferNotify("a", "b"))
        empty = kvpipe.TransferNotify()  # Mooncake's default constructor
        self.assertEqual((empty.name, empty.msg), ("", ""))
        empty.name, empty.msg = "x", "y"
        self.assertEqual(repr(empty), "TransferNotify(name='x', msg='y')")
        with self.assertRaises(TypeError):
            empty.msg = 3
        with self.assertRaises(TypeError):
            kvpipe.TransferNotify("only-name")
        from mooncake.engine import TransferNotify

        self.assertIs(TransferNotify, kvpipe.TransferNotify)

    def test_surface_without_peer(self):
        eng = kvpipe.TransferEngine()
        self.assertLess(eng.send_probe("127.0.0.1:1"), 0)  # before initialize: as Mooncake
        eng = tu.new_engine()
        self.assertEqual(eng.get_notifies(), [])
        self.assertEqual(eng.get_local_topology(), "{}")
        self.assertEqual(eng.get_local_topology("mlx5_0"), "{}")
        self.assertEqual(eng.warmup_efa_segment("127.0.0.1:1"), 0)
        for method in (eng.get_engine, eng.get_engine_ptr):
            with self.assertRaises(NotImplementedError) as ctx:
                method()
            self.assertIn("mooncake::TransferEngine", str(ctx.exception))
        self.assertLess(eng.send_probe("127.0.0.1:1"), 0)
        self.assertIn("127.0.0.1:1", kvpipe.last_error())
        self.assertEqual(eng.get_first_buffer_address("127.0.0.1:1"), 0)
        # notify must carry str name and msg
        with self.assertRaises(TypeError):
            eng.transfer_sync_write("127.0.0.1:1", 0, 0, 0, notify=object())
        eng.close()
        import mooncake.engine as me

        for flag in ("SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL",
                     "SUPPORT_MUSA", "SUPPORT_INTRA_NVLINK"):
            self.assertIs(getattr(me, flag), False, flag)


class NotifyTwoProcessTests(unittest.TestCase):
    def start_peer(self, target):
        peer = tu.python_child("engine_peer.py", target, "P2PHANDSHAKE", BIG, "tcp")
        words = peer.readline().split()
        self.assertEqual(words[0], "READY", " ".join(words))
        return peer, int(words[2])

    def setUp(self):
        os.environ["KVPIPE_DISABLE_SHM"] = "1"
        self.target = "%s:%d" % (tu.HOST, tu.free_port())
        self.peer, self.peer_managed = self.start_peer(self.target)
        self.eng = tu.new_engine()
        self.local = self.eng.allocate_managed_buffer(BIG)
        self.assertNotEqual(self.local, 0)

    def tearDown(self):
        os.environ.pop("KVPIPE_DISABLE_SHM", None)
        self.eng.close()
        self.peer.finish()

    def wait_notify(self, name, n=BIG):
        self.peer.send("WAITNOTIFY %s %d %d" % (name, self.peer_managed, n))
        return self.peer.readline().split()

    def watch(self, name, n=BIG):
        """Have the peer poll for the notification from now on, while the
        transfer runs; its answer is read afterwards."""
        self.peer.send("WAITNOTIFY %s %d %d" % (name, self.peer_managed, n))
        return lambda: self.peer.readline().split()

    def test_notify_arrives_after_the_data(self):
        # Each call: the peer polls get_notifies() and hashes its buffer the
        # moment the notification is there; the bytes must already be in place.
        calls = [
            lambda data, n: self.eng.transfer_sync_write(
                self.target, self.local, self.peer_managed, BIG, notify=n),
            lambda data, n: self.eng.transfer_sync(
                self.target, self.local, self.peer_managed, BIG, kvpipe.TransferOpcode.Write, n),
            lambda data, n: self.eng.batch_transfer_sync_write(
                self.target, [self.local, self.local + BIG // 2],
                [self.peer_managed, self.peer_managed + BIG // 2], [BIG // 2, BIG // 2],
                notify=n),
            lambda data, n: self.eng.batch_transfer_sync(
                self.target, [self.local], [self.peer_managed], [BIG], kvpipe.Write, notify=n),
        ]
        for i, call in enumerate(calls):
            data = pattern(10 + i, BIG)
            self.eng.write_bytes_to_buffer(self.local, data, BIG)
            note = kvpipe.TransferNotify("call-%d" % i, "kv-ready-%d" % i)
            answer = self.watch("call-%d" % i)
            self.assertEqual(call(data, note), 0, kvpipe.last_error())
            got = answer()
            self.assertEqual(got[:2], ["GOT", "kv-ready-%d" % i], got)
            self.assertEqual(got[2], hashlib.sha256(data).hexdigest(), "call %d: data not in place" % i)
        stats = self.eng.stats()
        self.assertEqual(stats["notifies_sent_total"], len(calls))

    def test_read_with_notify_and_failure_sends_none(self):
        # A READ with notify: the peer hears of it after the read completed.
        self.assertEqual(self.eng.transfer_sync_read(
            self.target, self.local, self.peer_managed, 4096,
            notify=kvpipe.TransferNotify("read", "done")), 0, kvpipe.last_error())
        self.assertEqual(self.wait_notify("read", 16)[:2], ["GOT", "done"])
        # A transfer that fails (outside the peer's memory) sends no notification.
        self.assertLess(self.eng.transfer_sync_write(
            self.target, self.local, 16, 4096, notify=kvpipe.TransferNotify("bad", "x")), 0)
        self.assertEqual(self.eng.transfer_sync_write(
            self.target, self.local, self.peer_managed, 16,
            notify=kvpipe.TransferNotify("good", "y")), 0)
        got = self.wait_notify("good", 16)
        self.assertEqual(got[:2], ["GOT", "y"])  # "bad" never came (it would print OTHER first)

    def test_get_first_buffer_address(self):
        first = self.eng.get_first_buffer_address(self.target)
        self.assertNotEqual(first, 0, kvpipe.last_error())
        self.assertLessEqual(first, self.peer_managed)

    def test_send_probe_after_peer_restart(self):
        # SGLang's recovery: the peer dies, probes fail; it comes back (same
        # name, new buffers and data port), the probe succeeds, and the very
        # next transfer works on the new peer.
        data = pattern(3, 4096)
        self.eng.write_bytes_to_buffer(self.local, data, 4096)
        self.assertEqual(self.eng.send_probe(self.target), 0, kvpipe.last_error())
        self.assertEqual(self.eng.transfer_sync_write(
            self.target, self.local, self.peer_managed, 4096), 0)
        self.peer.kill()
        self.peer.wait()
        self.peer.close()
        self.assertLess(self.eng.send_probe(self.target), 0)
        self.peer, self.peer_managed = self.start_peer(self.target)
        lookups = self.eng.stats()["descriptor_lookups_total"]
        self.assertEqual(self.eng.send_probe(self.target), 0, kvpipe.last_error())
        # The probe looked the peer up anew: the transfer below needs no lookup.
        self.assertEqual(self.eng.stats()["descriptor_lookups_total"], lookups + 1)
        self.assertEqual(self.eng.transfer_sync_write(
            self.target, self.local, self.peer_managed, 4096,
            notify=kvpipe.TransferNotify("after-restart", "ok")), 0, kvpipe.last_error())
        got = self.wait_notify("after-restart", 4096)
        self.assertEqual(self.eng.stats()["descriptor_lookups_total"], lookups + 1)
        self.assertEqual(got[:2], ["GOT", "ok"])
        self.assertEqual(got[2], hashlib.sha256(data).hexdigest())


if __name__ == "__main__":
    tu.main()
