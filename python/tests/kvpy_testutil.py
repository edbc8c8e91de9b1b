"""Shared helpers of the kvpipe Python tests: free ports, a real metadata
server, pipe configs, child processes with timeouts, and a unittest runner that
prints a one-line summary."""

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import unittest

HOST = "127.0.0.1"
CHILD_TIMEOUT = 60  # seconds; every wait on a child is bounded


def cli_path():
    path = os.environ.get("KVPIPE_CLI")
    if not path or not os.access(path, os.X_OK):
        raise unittest.SkipTest("KVPIPE_CLI does not name the built kvpipe CLI")
    return path


def port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port():
    return free_port_block(1)


def _port_registry():
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", "kvpipe-test-ports")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def free_port_block(span):
    """A base port such that base .. base+span-1 are all free now, below
    Linux's ephemeral range (32768 and up), which every bind to port 0 and
    every outgoing connection of the tests running beside this one draws
    from. The block is recorded, as the C tests' kvpt_free_port_block records
    theirs, in a registry file of "port pid" lines rewritten under flock, so
    that no test running beside this one is handed these ports while this
    process lives."""
    import fcntl
    with open(_port_registry(), "a+") as reg:
        fcntl.flock(reg, fcntl.LOCK_EX)
        reg.seek(0)
        claims = []
        for line in reg.read().split("\n"):
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() \
                    and _alive(int(parts[1])):
                claims.append((int(parts[0]), int(parts[1])))
        claimed = {port for port, _ in claims}
        for _ in range(200):
            base = random.randint(20000, 32000 - span)
            ports = range(base, base + span)
            if all(p not in claimed and port_free(p) for p in ports):
                claims += [(p, os.getpid()) for p in ports]
                reg.seek(0)
                reg.truncate()
                reg.write("".join("%d %d\n" % c for c in claims))
                return base
    raise RuntimeError("no block of %d free ports" % span)


def wait_port(port, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError("nothing listens on %s:%d" % (HOST, port))


class MetadataServer:
    """`kvpipe metadata-server` on a free loopback port, stopped on exit."""

    def __enter__(self):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [cli_path(), "metadata-server", "--host", HOST, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_port(self.port)
        self.url = "http://%s:%d/metadata" % (HOST, self.port)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc.stderr.close()


def pipe_config(metadata="P2PHANDSHAKE", **extra):
    """A mooncake config dict on two free port blocks (engine, ZeroMQ ports)."""
    prefill = free_port_block(16)
    decode = free_port_block(16)
    cfg = {"prefill_url": "%s:%d" % (HOST, prefill), "decode_url": "%s:%d" % (HOST, decode),
           "metadata_server": metadata, "protocol": "tcp", "device_name": ""}
    cfg.update(extra)
    return cfg


def write_config(cfg):
    fd, path = tempfile.mkstemp(prefix="kvpy-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)
    return path


class Child:
    """A child process speaking a line protocol on stdin/stdout."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)

    def readline(self, timeout=CHILD_TIMEOUT):
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise TimeoutError("child printed nothing in %ss" % timeout)
        finally:
            sel.close()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("child exited: rc=%s stderr=%s" % (self.proc.poll(), self.stderr()))
        return line.strip()

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr(self):
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read()

    def wait(self, timeout=CHILD_TIMEOUT):
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def finish(self):
        """Ask a child that takes commands to EXIT (when it still runs), wait, close."""
        if self.proc.poll() is None:
            self.send("EXIT")
            self.wait()
        self.close()

    def close(self):
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass


def new_engine(metadata="P2PHANDSHAKE", host=None):
    """A kvpipe.TransferEngine over tcp on host (default HOST and a free port)."""
    import kvpipe
    eng = kvpipe.TransferEngine()
    name = host or "%s:%d" % (HOST, free_port())
    ret = eng.initialize(name, metadata, "tcp", "")
    if ret != 0:
        raise AssertionError("initialize(%s) = %d: %s" % (name, ret, kvpipe.last_error()))
    return eng


def restore_env(name, value):
    """Set environment variable name back to value, as os.environ.get gave it."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def python_child(script, *args):
    """Run a helper script of this directory under the same interpreter."""
    here = os.path.dirname(os.path.abspath(__file__))
    return Child([sys.executable, os.path.join(here, script)] + [str(a) for a in args])


def main():
    """Run the calling module's tests; print a summary; exit non-zero on failure."""
    prog = unittest.main(exit=False, verbosity=2)
    r = prog.result
    print("SUMMARY: %d run, %d failed, %d errors, %d skipped"
          % (r.testsRun, len(r.failures), len(r.errors), len(r.skipped)))
    sys.exit(0 if r.wasSuccessful() else 1)
