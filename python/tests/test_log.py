"""kvpipe.set_log_handler / set_log_level: kvpipe's lines reach a Python callable,
also from kvpipe's own threads; a slow handler never stalls kvpipe; exceptions go
to sys.unraisablehook; the handler survives fork and is removed cleanly at exit."""
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import kvpipe  # noqa: E402

WAIT = 20.0  # seconds; generous, every wait succeeds at once when the code is right


def bad_handshake(port):
    """A handshake frame of length 0: the engine's server thread refuses it (and
    logs that) and closes the connection. Returns the seconds that took."""
    start = time.monotonic()
    with socket.create_connection((tu.HOST, port), timeout=WAIT) as s:
        s.sendall(b"\0" * 9)
        while s.recv(64):
            pass
    return time.monotonic() - start


def wait_for(cond, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class Collector:
    """A log handler that keeps every line; with hold, each call first waits (at
    most WAIT * 2 s) for that event to be set."""

    def __init__(self, hold=None):
        self.lines = []
        self.threads = set()
        self.lock = threading.Lock()
        self.hold = hold

    def __call__(self, level, subsystem, message):
        if self.hold:
            self.hold.wait(WAIT * 2)
        with self.lock:
            self.lines.append((level, subsystem, message))
            self.threads.add(threading.get_ident())

    def having(self, text):
        with self.lock:
            return [ln for ln in self.lines if text in ln[2]]


class LogTests(unittest.TestCase):
    def tearDown(self):
        kvpipe.set_log_handler(None)
        kvpipe.set_log_level("warn")

    def stuck_engine(self):
        """An engine, with debug lines going to a handler stuck until the returned
        event is set."""
        release = threading.Event()
        got = Collector(hold=release)
        eng = tu.new_engine()
        kvpipe.set_log_level("debug")
        kvpipe.set_log_handler(got)
        return eng, got, release

    def test_lines_reach_the_handler(self):
        got = Collector()
        kvpipe.set_log_handler(got)
        kvpipe.set_log_level("INFO")
        eng = tu.new_engine()
        # None delivers what is queued before it returns.
        kvpipe.set_log_handler(None)
        # The engine's line (a ucx server, where built, says it serves too).
        serving = [ln for ln in got.having("serving") if ln[1] == "engine"]
        self.assertEqual(len(serving), 1, got.lines)
        self.assertEqual(serving[0][0], 20)
        # Delivered by the module's thread, not the caller's.
        self.assertNotIn(threading.get_ident(), got.threads)
        eng.close()

    def test_lines_from_kvpipe_threads(self):
        eng = tu.new_engine()
        got = Collector()
        kvpipe.set_log_handler(got)
        bad_handshake(eng.get_rpc_port())
        self.assertTrue(wait_for(lambda: got.having("handshake server")), got.lines)
        level, subsystem, message = got.having("handshake server")[0]
        self.assertEqual((level, subsystem), (30, "p2p"))
        self.assertIn("frame length 0", message)
        eng.close()

    def test_threshold(self):
        got = Collector()
        kvpipe.set_log_handler(got)
        kvpipe.set_log_level("error")
        eng = tu.new_engine()
        bad_handshake(eng.get_rpc_port())
        kvpipe.set_log_handler(None)
        self.assertEqual(got.lines, [])
        eng.close()

    def test_blocked_handler_never_stalls_kvpipe(self):
        """The server thread logs a line per refused connection; with the handler
        stuck, it must still serve every connection at once."""
        eng, got, release = self.stuck_engine()
        try:
            for _ in range(20):
                self.assertLess(bad_handshake(eng.get_rpc_port()), WAIT / 2)
            # And from a thread of ours while kvpipe's lock-taking calls run.
            eng2 = tu.new_engine()
            eng2.close()
        finally:
            release.set()
        kvpipe.set_log_handler(None)
        self.assertGreaterEqual(len(got.having("handshake server")), 20)
        eng.close()

    def test_overflow_is_counted(self):
        eng, got, release = self.stuck_engine()
        for _ in range(1100):
            bad_handshake(eng.get_rpc_port())
        release.set()
        kvpipe.set_log_handler(None)
        dropped = got.having("log lines were dropped")
        self.assertEqual(len(dropped), 1, got.lines[-3:])
        self.assertLessEqual(len(got.lines), 1024 + 64 + 1)
        eng.close()

    def test_handler_exception_is_unraisable(self):
        seen = []
        old_hook = sys.unraisablehook
        sys.unraisablehook = lambda u: seen.append(u.exc_type)

        def broken(level, subsystem, message):
            raise ValueError("handler bug")

        try:
            kvpipe.set_log_level("info")
            kvpipe.set_log_handler(broken)
            a, b = tu.new_engine(), tu.new_engine()
            kvpipe.set_log_handler(None)
        finally:
            sys.unraisablehook = old_hook
        # Every line raised; the handler stayed in place for all of them.
        self.assertGreaterEqual(seen.count(ValueError), 4)
        a.close()
        b.close()

    def test_levels(self):
        for name, want in [("DEBUG", 10), ("Info", 20), ("warning", 30), ("error", 40),
                           ("trace", 10), (10, 10), (20, 20), (30, 30), (40, 40), (50, 40),
                           (5, 10)]:
            kvpipe.set_log_level(name)
            self.assertEqual(kvpipe.get_log_level(), want, name)
        with self.assertRaisesRegex(ValueError, "loud.*debug"):
            kvpipe.set_log_level("loud")
        with self.assertRaises(TypeError):
            kvpipe.set_log_level(1.5)
        with self.assertRaises(TypeError):
            kvpipe.set_log_handler(42)

    @unittest.skipIf("libtsan" in os.environ.get("LD_PRELOAD", ""),
                     "ThreadSanitizer cannot start threads in a child forked "
                     "from a process with threads")
    def test_handler_in_forked_child(self):
        got = Collector()
        kvpipe.set_log_handler(got)
        kvpipe.set_log_level("info")
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                eng = tu.new_engine()
                kvpipe.set_log_handler(None)
                code = 0 if got.having("serving") else 3
                eng.close()
            finally:
                os._exit(code)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            self.fail("the forked child hung")
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)


CHILD = textwrap.dedent("""
    import atexit, os, socket, sys, threading, time
    sys.path.insert(0, %(here)r)
    import kvpy_testutil as tu

    def after_kvpipe():
        # Runs after kvpipe's own exit hook (atexit is last-in, first-out): its
        # lines go to stderr.
        kvpipe.set_log_level("info")
        kvpipe.TransferEngine().initialize("%%s:%%d" %% (tu.HOST, tu.free_port()),
                                           "P2PHANDSHAKE", "tcp", "")
    atexit.register(after_kvpipe)

    import kvpipe
    kvpipe.set_log_level("debug")
    got = []
    def slow(level, subsystem, message):
        time.sleep(0.001)
        got.append(message)
    kvpipe.set_log_handler(slow)
    eng = kvpipe.TransferEngine()
    eng.initialize("%%s:%%d" %% (tu.HOST, tu.free_port()), "P2PHANDSHAKE", "tcp", "")
    port = eng.get_rpc_port()

    def flood():
        while True:
            try:
                with socket.create_connection((tu.HOST, port), timeout=5) as s:
                    s.sendall(b"\\0" * 9)
                    while s.recv(64):
                        pass
            except OSError:
                return
    for _ in range(2):
        threading.Thread(target=flood, daemon=True).start()
    time.sleep(0.5)
    print("delivered", len(got), flush=True)
    %(ending)s
""")


class ExitTests(unittest.TestCase):
    def run_child(self, ending):
        here = os.path.dirname(os.path.abspath(__file__))
        script = CHILD % {"here": here, "ending": ending}
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=WAIT * 3)
        return p

    def test_exit_with_handler_and_busy_kvpipe_threads(self):
        p = self.run_child("sys.exit(0)")
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("delivered", p.stdout)
        self.assertGreater(int(p.stdout.split()[-1]), 0)
        self.assertNotIn("Fatal Python error", p.stderr)
        # After kvpipe's exit hook, lines go to stderr again.
        self.assertIn("engine: engine", p.stderr)

    def test_none_restores_stderr(self):
        p = self.run_child("kvpipe.set_log_handler(None)\n"
                           "kvpipe.set_log_level('info')\n"
                           "kvpipe.TransferEngine().initialize('127.0.0.1:%d' % "
                           "tu.free_port(), 'P2PHANDSHAKE', 'tcp', '')")
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        self.assertIn("engine: engine", p.stderr)


if __name__ == "__main__":
    tu.main()
