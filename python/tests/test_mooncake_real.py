"""kvpipe's `mooncake.engine` against Mooncake's own Transfer Engine, in two
processes and both ways, over P2PHANDSHAKE and tcp: READ and WRITE, single
and batched, each checked byte for byte; then again with kvpipe's integrity
on (KVPIPE_INTEGRITY=1): Mooncake keeps its wire, and kvpipe says once that
the peer is not checked (docs/reliability.md, "Integrity").

Skipped unless KVPIPE_MOONCAKE_PYTHONPATH names a folder that holds
Mooncake's own `mooncake` package (its `engine` module built for this
interpreter, and the libraries it loads). The children that play Mooncake
run with that PYTHONPATH alone, so they never see kvpipe; this process and
the kvpipe children use kvpipe's `mooncake` shim. docs/python.md, "Against a
real Mooncake", says how such a folder is made.

    python3 test_mooncake_real.py                 the tests
    python3 test_mooncake_real.py target          a Mooncake target (a child)
    python3 test_mooncake_real.py initiator NAME MANAGED REGISTERED
                                                  a Mooncake initiator (a child)
"""
import ctypes
import hashlib
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvpy_testutil as tu  # noqa: E402

SIZE = 1 << 20


def pattern(seed, n):
    """engine_peer.py's pattern: its managed buffer holds seed 1, its
    registered one seed 2."""
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


# ---- the children that play Mooncake (run with Mooncake's PYTHONPATH) ----

def mooncake_engine():
    from mooncake.engine import TransferEngine
    eng = TransferEngine()
    if eng.initialize(tu.HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        print("FAILED initialize", flush=True)
        sys.exit(1)
    return eng


def child_target():
    """Register SIZE bytes of pattern(1); print READY <port> <addr>; answer
    SHA <addr> <len> and EXIT."""
    eng = mooncake_engine()
    buf = ctypes.create_string_buffer(pattern(1, SIZE), SIZE)
    if eng.register_memory(ctypes.addressof(buf), SIZE) != 0:
        print("FAILED register_memory", flush=True)
        return 1
    print("READY", eng.get_rpc_port(), ctypes.addressof(buf), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "SHA":
            data = ctypes.string_at(int(words[1]), int(words[2]))
            print(hashlib.sha256(data).hexdigest(), flush=True)
        elif words and words[0] == "EXIT":
            break
    eng.unregister_memory(ctypes.addressof(buf))
    return 0


def child_initiator(target, managed, registered):
    """Against a kvpipe target (engine_peer.py): READ both of its buffers and
    check them, WRITE pattern(3) to the registered one (single, then batched in
    halves), and print OK, or FAIL and why."""
    eng = mooncake_engine()
    local = ctypes.create_string_buffer(SIZE)
    addr = ctypes.addressof(local)
    if eng.register_memory(addr, SIZE) != 0:
        print("FAIL register_memory", flush=True)
        return 1
    for remote, seed in ((managed, 1), (registered, 2)):
        rc = eng.transfer_sync_read(target, addr, remote, SIZE)
        if rc != 0 or local.raw != pattern(seed, SIZE):
            print("FAIL transfer_sync_read of seed %d: rc %d" % (seed, rc), flush=True)
            return 1
    ctypes.memmove(addr, pattern(3, SIZE), SIZE)
    rc = eng.transfer_sync_write(target, addr, registered, SIZE)
    if rc != 0:
        print("FAIL transfer_sync_write: rc %d" % rc, flush=True)
        return 1
    print("WROTE", flush=True)
    if sys.stdin.readline().strip() != "AGAIN":
        return 1
    ctypes.memmove(addr, pattern(4, SIZE), SIZE)
    half = SIZE // 2
    rc = eng.batch_transfer_sync_write(target, [addr, addr + half],
                                       [registered, registered + half], [half, half])
    if rc != 0:
        print("FAIL batch_transfer_sync_write: rc %d" % rc, flush=True)
        return 1
    rc = eng.batch_transfer_sync_read(target, [addr, addr + half],
                                      [managed, managed + half], [half, half])
    if rc != 0 or local.raw != pattern(1, SIZE):
        print("FAIL batch_transfer_sync_read: rc %d" % rc, flush=True)
        return 1
    eng.unregister_memory(addr)
    print("OK", flush=True)
    return 0


# ---- the tests ----

def mooncake_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    env["PYTHONPATH"] = os.environ["KVPIPE_MOONCAKE_PYTHONPATH"]
    return env


def sha(seed):
    return hashlib.sha256(pattern(seed, SIZE)).hexdigest()


class RealMooncake(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        path = os.environ.get("KVPIPE_MOONCAKE_PYTHONPATH")
        if not path:
            raise unittest.SkipTest("no real Mooncake: set KVPIPE_MOONCAKE_PYTHONPATH to a "
                                    "folder holding Mooncake's mooncake package "
                                    "(docs/python.md)")
        probe = tu.Child([sys.executable, "-c",
                          "import mooncake.engine as m; print(getattr(m, 'BACKEND', 'mooncake'))"],
                         env=mooncake_env())
        try:
            backend = probe.readline()
        finally:
            probe.close()
        if backend != "mooncake":
            raise AssertionError("KVPIPE_MOONCAKE_PYTHONPATH's mooncake.engine is %r, not "
                                 "Mooncake's own" % backend)

    def setUp(self):
        os.environ.pop("KVPIPE_INTEGRITY", None)

    def tearDown(self):
        os.environ.pop("KVPIPE_INTEGRITY", None)

    def kvpipe_initiator(self, integrity):
        """This process (kvpipe's shim) against a Mooncake target."""
        import kvpipe
        if integrity:
            os.environ["KVPIPE_INTEGRITY"] = "1"
        said = []
        kvpipe.set_log_handler(lambda level, subsys, msg: said.append(msg))
        target = tu.Child([sys.executable, os.path.abspath(__file__), "target"],
                          env=mooncake_env())
        try:
            words = target.readline().split()
            self.assertEqual(words[0], "READY", " ".join(words) + target.stderr())
            name, remote = "%s:%s" % (tu.HOST, words[1]), int(words[2])
            from mooncake.engine import TransferEngine
            eng = TransferEngine()
            self.assertEqual(eng.initialize("%s:%d" % (tu.HOST, tu.free_port()),
                                            "P2PHANDSHAKE", "tcp", ""), 0)
            local = ctypes.create_string_buffer(SIZE)
            addr = ctypes.addressof(local)
            self.assertEqual(eng.register_memory(addr, SIZE), 0)
            self.assertEqual(eng.transfer_sync_read(name, addr, remote, SIZE), 0)
            self.assertEqual(local.raw, pattern(1, SIZE))
            ctypes.memmove(addr, pattern(3, SIZE), SIZE)
            self.assertEqual(eng.transfer_sync_write(name, addr, remote, SIZE), 0)
            target.send("SHA %d %d" % (remote, SIZE))
            self.assertEqual(target.readline(), sha(3))
            ctypes.memmove(addr, pattern(4, SIZE), SIZE)
            half = SIZE // 2
            self.assertEqual(eng.batch_transfer_sync_write(
                name, [addr, addr + half], [remote, remote + half], [half, half]), 0)
            target.send("SHA %d %d" % (remote, SIZE))
            self.assertEqual(target.readline(), sha(4))
            ctypes.memset(addr, 0, SIZE)
            self.assertEqual(eng.batch_transfer_sync_read(
                name, [addr, addr + half], [remote, remote + half], [half, half]), 0)
            self.assertEqual(local.raw, pattern(4, SIZE))
            self.assertEqual(eng.unregister_memory(addr), 0)
            del eng
            target.finish()
        finally:
            target.close()
            kvpipe.set_log_handler(None)
        unchecked = [m for m in said if "does not check integrity" in m]
        if integrity:
            self.assertEqual(len(unchecked), 1, said)
            self.assertIn(name, unchecked[0])
        else:
            self.assertEqual(unchecked, [], said)

    def mooncake_initiator(self, integrity):
        """A Mooncake initiator against a kvpipe target (engine_peer.py)."""
        env = dict(os.environ)
        if integrity:
            env["KVPIPE_INTEGRITY"] = "1"
        peer = tu.Child([sys.executable, os.path.join(HERE, "engine_peer.py"),
                         "%s:%d" % (tu.HOST, tu.free_port()), "P2PHANDSHAKE", str(SIZE)],
                        env=env)
        try:
            words = peer.readline().split()
            self.assertEqual(words[0], "READY", " ".join(words) + peer.stderr())
            port, managed, registered = words[1], words[2], words[3]
            mc = tu.Child([sys.executable, os.path.abspath(__file__), "initiator",
                           "%s:%s" % (tu.HOST, port), managed, registered], env=mooncake_env())
            try:
                self.assertEqual(mc.readline(), "WROTE")
                peer.send("SHA %s %d" % (registered, SIZE))
                self.assertEqual(peer.readline(), sha(3))
                mc.send("AGAIN")
                self.assertEqual(mc.readline(), "OK")
                self.assertEqual(mc.wait(), 0)
            finally:
                mc.close()
            peer.send("SHA %s %d" % (registered, SIZE))
            self.assertEqual(peer.readline(), sha(4))
            peer.finish()
        finally:
            peer.close()

    def test_kvpipe_initiator_mooncake_target(self):
        self.kvpipe_initiator(integrity=False)

    def test_kvpipe_initiator_mooncake_target_integrity_on(self):
        self.kvpipe_initiator(integrity=True)

    def test_mooncake_initiator_kvpipe_target(self):
        self.mooncake_initiator(integrity=False)

    def test_mooncake_initiator_kvpipe_target_integrity_on(self):
        self.mooncake_initiator(integrity=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "target":
        sys.exit(child_target())
    if len(sys.argv) > 4 and sys.argv[1] == "initiator":
        sys.exit(child_initiator(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    tu.main()
