"""The kvpipe module is one abi3 module (CPython's stable ABI, 3.11 and up):
prove it in every CPython found here. Two ctests run this file:

  abi3.py --interpreters MODULE_DIR   python_abi3_interpreters
      finds the CPythons on this machine (Debian's /usr/bin/python3*, pyenv's
      versions, python3.N on PATH, and the paths in $KVPY_ABI3_PYTHONS,
      colon-separated) and runs `abi3.py --round-trip` under each >= 3.11 with
      MODULE_DIR first on sys.path: it imports kvpipe.abi3.so and moves bytes
      through two engines and through a pipe, without numpy (bytearray,
      memoryview, array). An interpreter older than 3.11 must refuse the
      module with an ImportError (it lacks symbols the module imports), not
      crash. Exit 77 (skipped) where fewer than two versions >= 3.11 are found:
      nothing to compare.
  abi3.py --symbols MODULE_DIR        python_abi3_symbols
      every symbol of CPython the module imports (nm -D) must be in the stable
      ABI of 3.11: the list CPython 3.11 ships as
      test/test_stable_abi_ctypes.py (SYMBOL_NAMES, generated from its
      Misc/stable_abi.toml), taken from a 3.11 interpreter here (Debian's
      with libpython3.11-testsuite, or pyenv's), or the file
      $KVPY_STABLE_ABI_LIST names. Exit 77 where no such list is here.
"""
import ast
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = "kvpipe.abi3.so"
TIMEOUT = 120
# In the stable ABI since 3.2 and 3.5 (Misc/stable_abi.toml), but left out of
# the SYMBOL_NAMES of 3.11 and 3.12 (a Py_TRACE_REFS build renames them; 3.13
# lists them). PyModule_Create() is PyModule_Create2() in the limited API.
LISTED_FROM_3_13 = {"PyModule_Create2", "PyModule_FromDefAndSpec2"}


# ------------------------------------------------------------ the driver ---

def candidates():
    paths = glob.glob("/usr/bin/python3.[0-9]*")
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    paths += glob.glob(os.path.join(root, "versions", "*", "bin", "python3"))
    for d in os.environ.get("PATH", "").split(os.pathsep):
        paths += glob.glob(os.path.join(d, "python3.[0-9]*"))
    paths += [p for p in os.environ.get("KVPY_ABI3_PYTHONS", "").split(":") if p]
    seen, out = set(), []
    for p in paths:
        if p.endswith("-config") or not os.access(p, os.X_OK) or "shims" in p:
            continue
        real = os.path.realpath(p)
        if real in seen:
            continue
        seen.add(real)
        out.append(p)
    return out


def interpreter_info(py):
    """(version tuple, implementation, stdlib dir) or None."""
    try:
        r = subprocess.run([py, "-I", "-c", "import sys, sysconfig; print(sys.implementation.name,"
                            " *sys.version_info[:3], sysconfig.get_path('stdlib'))"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = r.stdout.split()
    if r.returncode != 0 or len(parts) != 5:
        return None
    return tuple(int(x) for x in parts[1:4]), parts[0], parts[4]


def run_interpreters(module_dir):
    found, failed, versions = [], 0, set()
    for py in candidates():
        info = interpreter_info(py)
        if not info or info[1] != "cpython":
            continue
        found.append((info[0], py))
    found.sort()
    env = dict(os.environ, PYTHONPATH=module_dir, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONHOME", None)
    for version, py in found:
        v = "%d.%d.%d" % version
        try:
            r = subprocess.run([py, os.path.abspath(__file__), "--round-trip"], env=env,
                               capture_output=True, text=True, timeout=TIMEOUT)
            rc, out = r.returncode, (r.stdout + r.stderr).strip()
        except subprocess.TimeoutExpired:
            rc, out = -1, "timed out after %d s" % TIMEOUT
        if version >= (3, 11, 0):
            if rc == 0 and out.endswith("round trip ok"):
                print("ok: %s (%s): %s" % (py, v, out.splitlines()[-1]))
                versions.add(version[:2])
            else:
                failed += 1
                print("FAIL: %s (%s): exit %d\n%s" % (py, v, rc, out))
        else:
            # Older interpreters must refuse the module cleanly.
            if rc == 3 and "ImportError" in out:
                print("ok: %s (%s) refuses it: %s" % (py, v, out.splitlines()[-1]))
            else:
                failed += 1
                print("FAIL: %s (%s) should refuse kvpipe.abi3.so with an ImportError: exit %d\n%s"
                      % (py, v, rc, out))
    if failed:
        print("FAIL: %d interpreter(s)" % failed)
        return 1
    if len(versions) < 2:
        print("SKIP: the module ran in %s only: no second CPython >= 3.11 found here "
              "(set KVPY_ABI3_PYTHONS)" % sorted(versions))
        return 77
    print("PASS: one kvpipe.abi3.so in CPython %s" %
          ", ".join("%d.%d" % v for v in sorted(versions)))
    return 0


def stable_abi_list():
    """(SYMBOL_NAMES of CPython 3.11's test_stable_abi_ctypes.py, its path) or (None, why)."""
    path = os.environ.get("KVPY_STABLE_ABI_LIST")
    if not path:
        for py in candidates():
            info = interpreter_info(py)
            if info and info[1] == "cpython" and info[0][:2] == (3, 11):
                p = os.path.join(info[2], "test", "test_stable_abi_ctypes.py")
                if os.path.exists(p):
                    path = p
                    break
    if not path:
        return None, ("no CPython 3.11 here ships test/test_stable_abi_ctypes.py "
                      "(apt-get install libpython3.11-testsuite, or set KVPY_STABLE_ABI_LIST)")
    names = set()
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AugAssign):
            target = node.target
        if isinstance(target, ast.Name) and target.id == "SYMBOL_NAMES":
            names.update(ast.literal_eval(node.value))
    if len(names) < 500:
        return None, "%s: SYMBOL_NAMES has %d names, expected hundreds" % (path, len(names))
    return names, path


def run_symbols(module_dir):
    module = os.path.join(module_dir, MODULE)
    if not os.path.exists(module):
        print("FAIL: %s is missing" % module)
        return 1
    names, where = stable_abi_list()
    if names is None:
        print("SKIP: %s" % where)
        return 77
    r = subprocess.run(["nm", "-D", "--undefined-only", module], capture_output=True, text=True)
    if r.returncode != 0:
        print("FAIL: nm -D %s: %s" % (module, r.stderr.strip()))
        return 1
    imported = [line.split()[-1].split("@")[0] for line in r.stdout.splitlines() if line.strip()]
    python = sorted(s for s in imported if s.startswith(("Py", "_Py")))
    outside = [s for s in python if s not in names and s not in LISTED_FROM_3_13]
    if not python:
        print("FAIL: %s imports no CPython symbol: is it the module?" % module)
        return 1
    if outside:
        print("FAIL: %s imports %d symbol(s) outside CPython 3.11's stable ABI (%s): %s"
              % (module, len(outside), where, " ".join(outside)))
        return 1
    print("PASS: the %d CPython symbols %s imports are all in the stable ABI of 3.11 (%s)"
          % (len(python), MODULE, where))
    return 0


# ------------------------------------------------- under each interpreter ---

def round_trip():
    try:
        import kvpipe
    except ImportError as e:
        print("ImportError: %s" % e)
        return 3
    import array
    sys.path.insert(0, HERE)
    import kvpy_testutil as tu

    assert os.path.basename(kvpipe.__file__) == MODULE, kvpipe.__file__
    n = 300 * 1024 + 7
    payload = bytes((i * 7 + 3) % 251 for i in range(n))

    # Two engines, P2PHANDSHAKE over tcp: a READ, a WRITE and a batch with a
    # notification, bytes checked through the managed buffers.
    a, b = kvpipe.TransferEngine(), kvpipe.TransferEngine()
    for eng in (a, b):
        assert eng.initialize(tu.HOST, "P2PHANDSHAKE", "tcp", "") == 0, kvpipe.last_error()
    src = b.allocate_managed_buffer(n)
    dst = a.allocate_managed_buffer(n)
    assert src and dst
    assert b.write_bytes_to_buffer(src, payload, n) == 0
    peer = b.get_segment_name()
    assert a.transfer_sync_read(peer, dst, src, n) == 0, kvpipe.last_error()
    assert a.read_bytes_from_buffer(dst, n) == payload
    back = payload[::-1]
    assert a.write_bytes_to_buffer(dst, back, n) == 0
    half = n // 2
    assert a.batch_transfer_sync_write(peer, [dst, dst + half], [src, src + half],
                                       [half, n - half],
                                       notify=kvpipe.TransferNotify("abi3", "done")) == 0, \
        kvpipe.last_error()
    assert b.read_bytes_from_buffer(src, n) == back
    assert b.get_notifies() == [kvpipe.TransferNotify("abi3", "done")]
    try:
        a.transfer_sync_read(peer, "not an int", src, 1)
        raise AssertionError("a str address was accepted")
    except TypeError as e:
        assert "must be an int, not str" in str(e), e
    a.close()
    b.close()

    # A pipe in this process: a bytearray, a typed memoryview, None, and a
    # tensor of alloc_tensor() filled through the buffer protocol and taken.
    floats = array.array("f", [i / 4 for i in range(1000)])
    cfg = tu.pipe_config()
    with kvpipe.Pipe(cfg, 0, 0) as prefill, kvpipe.Pipe(cfg, 0, 1) as decode:
        prefill.send_tensor(bytearray(payload))
        prefill.send_tensor(memoryview(floats))
        prefill.send_tensor(None)
        t = prefill.alloc_tensor((4, 8), "int32")
        view = memoryview(t)
        assert view.format == "i" and view.shape == (4, 8), (view.format, view.shape)
        view.cast("B")[:] = bytes(range(128))
        view.release()
        prefill.send_tensor_take(t)

        got = decode.recv_tensor(timeout=30)
        assert (got.dtype, got.shape) == ("uint8", (n,)), got
        assert memoryview(got).tobytes() == payload
        got = decode.recv_tensor(timeout=30)
        assert (got.dtype, got.shape) == ("float32", (1000,)), got
        assert memoryview(got).tolist() == floats.tolist()
        capsule = got.__dlpack__()
        assert type(capsule).__name__ == "PyCapsule"
        del capsule
        assert decode.recv_tensor(timeout=30) is None
        got = decode.recv_tensor(timeout=30)
        assert (got.dtype, got.shape) == ("int32", (4, 8)), got
        assert memoryview(got).cast("B").tobytes() == bytes(range(128))
        prefill.flush(timeout=30)
        sent = prefill.stats()["sent"]
        assert sent == 4, sent
    print("CPython %d.%d.%d: engine READ/WRITE/batch+notify and pipe (4 tensors) "
          "round trip ok" % sys.version_info[:3])
    return 0


def main():
    if sys.argv[1:] == ["--round-trip"]:
        return round_trip()
    if len(sys.argv) == 3 and sys.argv[1] == "--interpreters":
        return run_interpreters(os.path.abspath(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "--symbols":
        return run_symbols(os.path.abspath(sys.argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
