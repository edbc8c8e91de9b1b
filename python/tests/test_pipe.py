"""kvpipe.Pipe: round trips of numpy arrays, None, DLPack producers; zero copy;
errors; Ctrl-C; a Python pipe talking to a C pipe and to another Python process."""
import _thread
import ctypes
import os
import sys
import threading
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import numpy as np  # noqa: E402

import kvpipe  # noqa: E402

try:
    import torch
except ImportError:
    torch = None

NUMPY_DTYPES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64"]


def random_array(dtype, shape, rng):
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith("float"):
        return rng.standard_normal(size=shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def as_numpy(t):
    """The received tensor as a numpy array, without a copy."""
    try:
        return np.from_dlpack(t)
    except (BufferError, TypeError, RuntimeError):
        # older numpy cannot take bool through DLPack; the buffer protocol can
        return np.asarray(t)


# ---- a DLPack producer written with ctypes, for dtypes numpy lacks ----------------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = b"dltensor"  # the capsule keeps a pointer to this name

DL_BFLOAT, DL_F8_E4M3FN, DL_F8_E5M2 = 4, 10, 12


class DLPackBox:
    """Exports raw bytes as a CPU tensor of any DLPack dtype (no deleter)."""

    def __init__(self, raw, code, bits, shape, device_type=1, strides=None):
        self.raw = ctypes.create_string_buffer(raw, len(raw))
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        self.mt = DLManagedTensor()
        t = self.mt.dl_tensor
        t.data = ctypes.addressof(self.raw)
        t.device = DLDevice(device_type, 0)
        t.ndim = len(shape)
        t.dtype = DLDataType(code, bits, 1)
        t.shape = self.shape
        t.strides = self.strides
        t.byte_offset = 0

    def __dlpack_device__(self):
        return (self.mt.dl_tensor.device.device_type, 0)

    def __dlpack__(self, stream=None):
        return _capsule_new(ctypes.addressof(self.mt), _DLTENSOR, None)


# ---- tests ---------------------------------------------------------------------------------

class PairTests(unittest.TestCase):
    """Both sides in this process: prefill (kv_rank 0) and decode (kv_rank 1)."""

    def setUp(self):
        self.cfg = tu.pipe_config()
        self.prefill = kvpipe.Pipe(self.cfg, 0, 0)
        self.decode = kvpipe.Pipe(self.cfg, 0, 1)
        self.rng = np.random.default_rng(7)

    def tearDown(self):
        self.prefill.close()
        self.decode.close()

    def roundtrip(self, obj, src=None, dst=None):
        (src or self.prefill).send_tensor(obj)
        return (dst or self.decode).recv_tensor(timeout=30)

    def test_numpy_dtypes_both_ways(self):
        for dtype in NUMPY_DTYPES:
            for src, dst in ((self.prefill, self.decode), (self.decode, self.prefill)):
                with self.subTest(dtype=dtype, src=src.segment_name):
                    arr = random_array(dtype, (3, 5), self.rng)
                    t = self.roundtrip(arr, src, dst)
                    self.assertEqual(t.dtype, dtype)
                    self.assertEqual(t.shape, (3, 5))
                    self.assertEqual(t.nbytes, arr.nbytes)
                    got = as_numpy(t)
                    self.assertEqual(got.dtype, arr.dtype)
                    np.testing.assert_array_equal(got, arr)

    def test_none_scalars_empty_and_plain_buffers(self):
        self.assertIsNone(self.roundtrip(None))
        t = self.roundtrip(np.array(3.25, dtype=np.float64))
        self.assertEqual(t.shape, ())
        self.assertEqual(as_numpy(t)[()], 3.25)
        t = self.roundtrip(np.zeros((0, 4), dtype=np.int32))
        self.assertEqual((t.shape, t.nbytes, t.dtype), ((0, 4), 0, "int32"))
        self.assertEqual(as_numpy(t).shape, (0, 4))
        t = self.roundtrip(b"hello")  # bytes: a uint8 vector
        self.assertEqual((t.dtype, t.shape, bytes(memoryview(t))), ("uint8", (5,), b"hello"))
        t = self.roundtrip(memoryview(np.arange(6, dtype=np.int32).reshape(2, 3)))
        np.testing.assert_array_equal(as_numpy(t), np.arange(6, dtype=np.int32).reshape(2, 3))
        self.assertIsNone(self.roundtrip(None))

    def test_zero_copy_and_lifetime(self):
        arr = random_array("float32", (64, 33), self.rng)
        t = self.roundtrip(arr)
        a = np.from_dlpack(t)
        self.assertEqual(a.ctypes.data, t.data_ptr())
        b = np.asarray(t)
        self.assertEqual(b.ctypes.data, t.data_ptr())
        m = memoryview(t)
        self.assertEqual((m.format, m.shape, m.strides, m.itemsize), ("f", (64, 33), (132, 4), 4))
        self.assertFalse(m.readonly)
        b[0, 0] = 42.0  # the arrays share the received buffer (from_dlpack's is read-only)
        self.assertEqual(a[0, 0], 42.0)
        m.release()
        del t, b, m
        # the array keeps the buffer alive after the tensor and the pipes are gone
        self.prefill.close()
        self.decode.close()
        np.testing.assert_array_equal(a[1:], arr[1:])
        self.assertEqual(a[0, 0], 42.0)

    def test_vllm_pipe_semantics(self):
        # vLLM's pipe test, shortened: fixed tensors, then rounds of
        # (matrix, mean, std) with some all-None rounds, switching direction.
        t = self.roundtrip(np.array([1], dtype=np.int64))
        np.testing.assert_array_equal(as_numpy(t), [1])
        t = self.roundtrip(np.array([[2, 3, 4, 8]], dtype=np.float32))
        np.testing.assert_array_equal(as_numpy(t), [[2, 3, 4, 8]])
        for i in range(24):
            src, dst = ((self.prefill, self.decode) if (i // 6) % 2 == 0
                        else (self.decode, self.prefill))
            if i % 7 == 3:
                sent = [None, None, None]
            else:
                x = self.rng.standard_normal(
                    (int(self.rng.integers(90, 100)), int(self.rng.integers(90, 100))),
                    dtype=np.float32)
                sent = [x, x.mean(keepdims=True), x.std(keepdims=True)]
            for s in sent:
                src.send_tensor(s)
            for s in sent:
                got = dst.recv_tensor(timeout=30)
                if s is None:
                    self.assertIsNone(got)
                else:
                    np.testing.assert_array_equal(as_numpy(got), s)

    def test_dlpack_dtypes_numpy_lacks(self):
        bits = np.arange(6, dtype=np.uint16) * 4099
        for code, bits_per, name, fmt in ((DL_BFLOAT, 16, "bfloat16", "H"),
                                          (DL_F8_E4M3FN, 8, "float8_e4m3fn", "B"),
                                          (DL_F8_E5M2, 8, "float8_e5m2", "B")):
            with self.subTest(dtype=name):
                raw = bits.tobytes() if bits_per == 16 else bits.astype(np.uint8).tobytes()
                t = self.roundtrip(DLPackBox(raw, code, bits_per, (2, 3)))
                self.assertEqual((t.dtype, t.shape), (name, (2, 3)))
                self.assertEqual(memoryview(t).format, fmt)
                self.assertEqual(bytes(memoryview(t)), raw)
                # the received tensor is itself a DLPack producer: send it on
                t2 = self.roundtrip(t, self.decode, self.prefill)
                self.assertEqual((t2.dtype, bytes(memoryview(t2))), (name, raw))

    def test_dlpack_capsule_versions(self):
        t = self.roundtrip(np.arange(4, dtype=np.int16))
        self.assertEqual(t.__dlpack_device__(), (1, 0))
        base = sys.getrefcount(t)
        cap = t.__dlpack__()
        self.assertIn('"dltensor"', repr(cap))
        vcap = t.__dlpack__(max_version=(1, 0))
        self.assertIn('"dltensor_versioned"', repr(vcap))
        self.assertEqual(sys.getrefcount(t), base + 2)  # each capsule holds the tensor
        with self.assertRaises(BufferError):
            t.__dlpack__(dl_device=(2, 0))
        del cap, vcap  # unconsumed capsules release their reference
        self.assertEqual(sys.getrefcount(t), base)
        a = np.from_dlpack(t)  # a consumed capsule: released with the array
        self.assertEqual(sys.getrefcount(t), base + 1)
        del a
        self.assertEqual(sys.getrefcount(t), base)

    def test_send_rejects(self):
        with self.assertRaises(TypeError):
            self.prefill.send_tensor(5)
        with self.assertRaises(TypeError):
            self.prefill.send_tensor(np.zeros(3, dtype=np.complex64))
        with self.assertRaises(ValueError):
            self.prefill.send_tensor(np.arange(12).reshape(3, 4)[:, ::2])  # not contiguous
        with self.assertRaises((TypeError, ValueError, BufferError)):
            self.prefill.send_tensor(np.arange(4, dtype=">i4"))  # big-endian
        with self.assertRaises(ValueError):
            self.prefill.send_tensor(DLPackBox(b"\0" * 8, 2, 32, (2,), device_type=2))
        with self.assertRaises(ValueError):
            self.prefill.send_tensor(DLPackBox(b"\0" * 32, 2, 32, (2, 2), strides=(1, 2)))
        # nothing of the above was sent
        self.prefill.send_tensor(np.array([9], dtype=np.uint8))
        np.testing.assert_array_equal(as_numpy(self.decode.recv_tensor(timeout=30)), [9])

    def test_recv_timeout_and_closed(self):
        with self.assertRaises(kvpipe.Error) as cm:
            self.decode.recv_tensor(timeout=0.3)
        self.assertEqual(cm.exception.status, kvpipe.ETIMEDOUT)
        self.prefill.send_tensor(None)  # a timed-out recv consumed nothing
        self.assertIsNone(self.decode.recv_tensor(timeout=30))
        self.decode.close()
        with self.assertRaises(kvpipe.Error):
            self.decode.recv_tensor(timeout=0.1)

    def test_ctrl_c_interrupts_recv(self):
        timer = threading.Timer(0.5, _thread.interrupt_main)
        timer.start()
        try:
            with self.assertRaises(KeyboardInterrupt):
                self.decode.recv_tensor()  # no timeout: only Ctrl-C ends it
        finally:
            timer.cancel()
        self.prefill.send_tensor(np.array([1, 2], dtype=np.int8))
        np.testing.assert_array_equal(as_numpy(self.decode.recv_tensor(timeout=30)), [1, 2])

    @unittest.skipUnless(torch is not None, "torch is not installed")
    def test_torch(self):
        x = torch.randn(4, 8).to(torch.bfloat16)
        t = self.roundtrip(x)
        self.assertEqual(t.dtype, "bfloat16")
        y = torch.from_dlpack(t)
        self.assertEqual(y.data_ptr(), t.data_ptr())
        self.assertTrue(torch.equal(x, y))


class ConfigTests(unittest.TestCase):
    def test_config_errors(self):
        with self.assertRaises(kvpipe.Error) as cm:
            kvpipe.Pipe("/nonexistent/kvpipe.json", 0, 0)
        self.assertEqual(cm.exception.status, kvpipe.ECONFIG)
        self.assertIn("/nonexistent/kvpipe.json", str(cm.exception))
        cfg = tu.pipe_config()
        del cfg["prefill_url"]
        with self.assertRaises(kvpipe.Error) as cm:
            kvpipe.Pipe(cfg, 0, 0)
        self.assertEqual(cm.exception.status, kvpipe.ECONFIG)
        self.assertIn("prefill_url", str(cm.exception))
        with self.assertRaises(kvpipe.Error):
            kvpipe.Pipe(tu.pipe_config(), 0, 5)  # kv_rank is 0 or 1
        with self.assertRaises(TypeError):
            kvpipe.Pipe(12, 0, 0)

    def test_config_file_env_and_options(self):
        cfg = tu.pipe_config()
        path = tu.write_config(cfg)
        old = os.environ.get("MOONCAKE_CONFIG_PATH")
        os.environ["MOONCAKE_CONFIG_PATH"] = path
        try:
            with kvpipe.Pipe(path, 0, 0, kv_buffer_size=1e9, send_timeout=10.0) as a, \
                    kvpipe.Pipe(None, 0, 1, io_timeout=5.0) as b:
                self.assertEqual(a.segment_name, cfg["prefill_url"])
                a.send_tensor(np.arange(3, dtype=np.float64))
                np.testing.assert_array_equal(as_numpy(b.recv_tensor(timeout=30)), [0, 1, 2])
                a.flush(timeout=10)
                st = a.stats()
                self.assertEqual((st["sent"], st["acks"], st["inflight_count"]), (1, 1, 0))
                self.assertTrue(a.usable)
        finally:
            if old is None:
                os.environ.pop("MOONCAKE_CONFIG_PATH", None)
            else:
                os.environ["MOONCAKE_CONFIG_PATH"] = old
            os.unlink(path)


class CrossProcessTests(unittest.TestCase):
    """This process is prefill; the peer process (C or Python) echoes."""

    def messages(self):
        rng = np.random.default_rng(11)
        msgs = [random_array(d, (17, 9), rng) for d in NUMPY_DTYPES]
        msgs += [None, np.array(7, dtype=np.int64), np.zeros((3, 0), dtype=np.float32), None,
                 random_array("float32", (512, 1024), rng)]  # 2 MiB
        msgs.append(DLPackBox((np.arange(10, dtype=np.uint16) * 77).tobytes(), DL_BFLOAT, 16,
                              (10,)))
        return msgs

    def check_echo(self, pipe, msgs):
        for m in msgs:
            pipe.send_tensor(m)
        for m in msgs:
            got = pipe.recv_tensor(timeout=30)
            if m is None:
                self.assertIsNone(got)
            elif isinstance(m, DLPackBox):
                self.assertEqual((got.dtype, bytes(memoryview(got))), ("bfloat16", m.raw.raw))
            else:
                self.assertEqual(got.shape, m.shape)
                np.testing.assert_array_equal(as_numpy(got), m)

    def run_with_peer(self, argv_of, metadata="P2PHANDSHAKE"):
        cfg = tu.pipe_config(metadata)
        path = tu.write_config(cfg)
        msgs = self.messages()
        peer = tu.Child(argv_of(path, len(msgs)))
        try:
            self.assertEqual(peer.readline(), "ready")
            with kvpipe.Pipe(path, 0, 0) as pipe:
                self.check_echo(pipe, msgs)
                pipe.flush(timeout=30)
                self.assertEqual(peer.wait(), 0, peer.stderr())
        finally:
            peer.close()
            os.unlink(path)

    def c_peer(self, path, n):
        exe = os.environ.get("KVPY_PIPE_PEER")
        if not exe or not os.access(exe, os.X_OK):
            self.skipTest("KVPY_PIPE_PEER does not name the built kvpy_pipe_peer")
        return [exe, path, "1", str(n)]

    def py_peer(self, path, n):
        here = os.path.dirname(os.path.abspath(__file__))
        return [sys.executable, os.path.join(here, "pipe_echo.py"), path, "1", str(n)]

    def test_python_to_c_pipe(self):
        self.run_with_peer(self.c_peer)

    def test_python_to_python_process_http_metadata(self):
        with tu.MetadataServer() as md:
            self.run_with_peer(self.py_peer, md.url)

    def test_peer_killed(self):
        cfg = tu.pipe_config()
        path = tu.write_config(cfg)
        peer = tu.Child(self.py_peer(path, 1000))
        try:
            self.assertEqual(peer.readline(), "ready")
            with kvpipe.Pipe(path, 0, 0, send_timeout=3.0, io_timeout=2.0) as pipe:
                pipe.send_tensor(np.arange(5, dtype=np.int32))
                np.testing.assert_array_equal(as_numpy(pipe.recv_tensor(timeout=30)),
                                              np.arange(5, dtype=np.int32))
                peer.kill()
                # The echo never comes: recv ends with a timeout, not a hang.
                with self.assertRaises(kvpipe.Error) as cm:
                    pipe.recv_tensor(timeout=1.0)
                self.assertEqual(cm.exception.status, kvpipe.ETIMEDOUT)
        finally:
            peer.close()
            os.unlink(path)


if __name__ == "__main__":
    tu.main()
