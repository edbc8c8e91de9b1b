"""kvpipe.Pipe: round trips of numpy arrays, None, DLPack producers; zero copy;
sending in place (alloc_tensor + send_tensor_take); errors; Ctrl-C; a Python pipe
talking to a C pipe and to another Python process."""
import _thread
import asyncio
import ctypes
import os
import sys
import threading
import time
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


def fill_bytes(t, rng):
    """Fill t with random bytes through a numpy view (dropped again); return them."""
    raw = rng.integers(0, 256, size=t.nbytes, dtype=np.uint8)
    np.asarray(t).reshape(-1).view(np.uint8)[:] = raw
    return raw.tobytes()


def as_numpy(t):
    """The received tensor as a numpy array, without a copy."""
    try:
        return np.from_dlpack(t)
    except (BufferError, TypeError, RuntimeError):
        # older numpy cannot take bool through DLPack; the buffer protocol can
        return np.asarray(t)


def check_received(case, got, want):
    """got is what want was sent as: None; a numpy array; a DLPackBox (bfloat16); or,
    for a tensor sent in place, its (dtype, shape, bytes)."""
    if want is None:
        case.assertIsNone(got)
    elif isinstance(want, tuple):
        case.assertEqual((got.dtype, got.shape, bytes(memoryview(got))), want)
    elif isinstance(want, DLPackBox):
        case.assertEqual((got.dtype, bytes(memoryview(got))), ("bfloat16", want.raw.raw))
    else:
        case.assertEqual(got.shape, want.shape)
        np.testing.assert_array_equal(as_numpy(got), want)


def exchange(case, src, dst, sent):
    """Send every message of sent from src, then receive and check each at dst."""
    for m in sent:
        src.send_tensor(m)
    for m in sent:
        check_received(case, dst.recv_tensor(timeout=30), m)


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

class PipePairCase(unittest.TestCase):
    """Both sides in this process: prefill (kv_rank 0) and decode (kv_rank 1)."""

    seed = 7

    def setUp(self):
        self.cfg = tu.pipe_config()
        self.prefill = kvpipe.Pipe(self.cfg, 0, 0)
        self.decode = kvpipe.Pipe(self.cfg, 0, 1)
        self.rng = np.random.default_rng(self.seed)

    def tearDown(self):
        self.prefill.close()
        self.decode.close()


class PairTests(PipePairCase):
    """send_tensor / recv_tensor between the two sides."""

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

    def send_written_after(self, src, dst):
        """A tensor whose buffer src writes after handing it over; dst's recv."""
        # Digests travel once the sender has read the receiver's descriptor.
        src.send_tensor(None)
        self.assertIsNone(dst.recv_tensor(timeout=30))
        deadline = time.time() + 10
        while src.stats()["peer_lookups"] < 1 and time.time() < deadline:
            time.sleep(0.01)
        t = src.alloc_tensor((1 << 20,), "uint8")  # announced: READ later
        view = np.asarray(t)
        view[:] = 7
        addr = view.ctypes.data
        del view
        src.send_tensor_take(t)
        ctypes.memset(addr + 12345, 8, 1)  # the buffer is the pipe's now: written too late
        return dst.recv_tensor(timeout=30)

    def test_integrity_catches_a_buffer_written_after_send(self):
        cfg = tu.pipe_config()
        with kvpipe.Pipe(cfg, 0, 0, integrity=True) as p, \
                kvpipe.Pipe(cfg, 0, 1, integrity=True) as d:
            with self.assertRaises(kvpipe.Error) as cm:
                self.send_written_after(p, d)
            self.assertEqual(cm.exception.status, kvpipe.ECORRUPT)
            self.assertIn("arrived corrupted", str(cm.exception))
            p.send_tensor(np.arange(4))
            np.testing.assert_array_equal(as_numpy(d.recv_tensor(timeout=30)), np.arange(4))
            self.assertIn("kvpipe_pipe_corrupt_total 1", d.stats(prometheus=True))

    def test_integrity_is_off_by_default(self):
        got = as_numpy(self.send_written_after(self.prefill, self.decode))  # unchecked
        self.assertEqual(int(got[12345]), 8)
        self.assertIn("kvpipe_pipe_corrupt_total 0", self.decode.stats(prometheus=True))

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
            exchange(self, src, dst, sent)

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
        with self.assertRaises(ValueError):  # OpenCL: neither CPU nor CUDA memory
            self.prefill.send_tensor(DLPackBox(b"\0" * 8, 2, 32, (2,), device_type=4))
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


class SendTakeTests(PipePairCase):
    """alloc_tensor + send_tensor_take: sending from registered memory, no copy."""

    seed = 5

    def take(self, shape, dtype, pipe=None):
        """Allocate, fill with random bytes, send in place; return what the peer must get."""
        pipe = pipe or self.prefill
        t = pipe.alloc_tensor(shape, dtype)
        raw = fill_bytes(t, self.rng)
        pipe.send_tensor_take(t)
        return (dtype, tuple(shape), raw)

    def test_alloc_shapes_and_dtypes(self):
        t = self.prefill.alloc_tensor([])
        self.assertEqual((t.dtype, t.shape, t.ndim, t.nbytes), ("uint8", (), 0, 1))
        t = self.prefill.alloc_tensor((2, 0, 3), "float16")
        self.assertEqual((t.shape, t.nbytes, memoryview(t).nbytes), ((2, 0, 3), 0, 0))
        t = self.prefill.alloc_tensor(np.array([3, 4]), np.dtype("float32"))
        self.assertEqual((t.dtype, t.shape, t.nbytes), ("float32", (3, 4), 48))
        self.assertEqual(t.data_ptr() % 256, 0)
        a = np.asarray(t)  # writable, and the tensor's own memory
        self.assertTrue(a.flags.writeable)
        self.assertEqual((a.dtype, a.ctypes.data), (np.float32, t.data_ptr()))
        a[...] = 1.5
        np.testing.assert_array_equal(np.from_dlpack(t), np.full((3, 4), 1.5, np.float32))
        for dtype in NUMPY_DTYPES + ["bfloat16", "float8_e4m3fn", "float8_e5m2"]:
            self.assertEqual(self.prefill.alloc_tensor((2,), dtype).dtype, dtype)
        self.assertEqual(self.prefill.alloc_tensor((2,), np.dtype(bool)).dtype, "bool")
        self.assertEqual(self.prefill.alloc_tensor((2,), dtype="torch.int16").dtype, "int16")

    def test_alloc_rejects(self):
        for dtype in ("complex64", np.dtype("complex64"), np.dtype(">f4"), "float", "f4x"):
            with self.subTest(dtype=dtype):
                with self.assertRaises(ValueError) as cm:
                    self.prefill.alloc_tensor((2,), dtype)
                self.assertIn(str(dtype), str(cm.exception))
        with self.assertRaises(TypeError):
            self.prefill.alloc_tensor(5)
        with self.assertRaises(TypeError):
            self.prefill.alloc_tensor(["a"])
        with self.assertRaises(ValueError):
            self.prefill.alloc_tensor((4, -1))
        with self.assertRaises(ValueError):
            self.prefill.alloc_tensor((1,) * 33)
        with self.assertRaises(kvpipe.Error) as cm:  # the library's size check
            self.prefill.alloc_tensor((1 << 62, 1 << 62))
        self.assertEqual(cm.exception.status, kvpipe.EINVAL)

    def test_take_interleaved_with_copies(self):
        p, want = self.prefill, []
        want.append(self.take((4, 33), "float32"))
        x = np.arange(10, dtype=np.int16)
        p.send_tensor(x)
        want.append(("int16", (10,), x.tobytes()))
        p.send_tensor(None)
        want.append(None)
        want.append(self.take((), "float64"))
        want.append(self.take((0, 7), "int32"))
        want.append(self.take((3, 5), "bfloat16"))
        # send_tensor copies an allocated tensor and leaves it usable: take it after
        c = p.alloc_tensor((6,), "int64")
        np.asarray(c)[...] = np.arange(6)
        p.send_tensor(c)
        want.append(("int64", (6,), np.arange(6, dtype=np.int64).tobytes()))
        np.asarray(c)[...] = -np.arange(6)
        p.send_tensor_take(c)
        want.append(("int64", (6,), (-np.arange(6, dtype=np.int64)).tobytes()))
        want.append(self.take((8,), "float8_e4m3fn"))
        want.append(self.take((3,), "bool"))
        p.send_tensor(None)
        want.append(None)
        want.append(self.take((512, 1024), "uint8"))  # 512 KiB
        for w in want:
            check_received(self, self.decode.recv_tensor(timeout=30), w)
        p.flush(timeout=30)
        st = p.stats()
        self.assertEqual((st["sent"], st["acks"], st["inflight_count"]), (len(want),) * 2 + (0,))
        # and the other way round
        w = self.take((2, 2), "uint16", self.decode)
        check_received(self, p.recv_tensor(timeout=30), w)

    def test_live_buffer_exports_refuse_the_take(self):
        t = self.prefill.alloc_tensor((16,), "int32")
        view = np.asarray(t)
        view[...] = np.arange(16)
        m = memoryview(t)
        with self.assertRaises(BufferError) as cm:
            self.prefill.send_tensor_take(t)
        self.assertIn("2 export", str(cm.exception))
        self.assertIn("send_tensor()", str(cm.exception))
        part = m[4:]  # a slice of a memoryview shares its export
        del m
        with self.assertRaises(BufferError):
            self.prefill.send_tensor_take(t)
        del part
        tail = view[3:]  # so does an array made from the array
        del view
        with self.assertRaises(BufferError) as cm:
            self.prefill.send_tensor_take(t)
        self.assertIn("1 export", str(cm.exception))
        # refused: nothing sent, the tensor intact and still writable
        self.assertEqual(self.prefill.stats()["sent"], 0)
        np.testing.assert_array_equal(np.asarray(t), np.arange(16))
        tail[0] = 99
        del tail
        self.prefill.send_tensor_take(t)
        want = np.arange(16, dtype=np.int32)
        want[3] = 99
        np.testing.assert_array_equal(as_numpy(self.decode.recv_tensor(timeout=30)), want)

    def test_live_dlpack_exports_refuse_the_take(self):
        t = self.prefill.alloc_tensor((5,), "float32")
        np.asarray(t)[...] = [1, 2, 3, 4, 5]
        cap = t.__dlpack__()  # an unconsumed capsule
        with self.assertRaises(BufferError):
            self.prefill.send_tensor_take(t)
        del cap
        vcap = t.__dlpack__(max_version=(1, 0))
        with self.assertRaises(BufferError):
            self.prefill.send_tensor_take(t)
        del vcap
        a = np.from_dlpack(t)  # a consumed one, released with the array
        with self.assertRaises(BufferError):
            self.prefill.send_tensor_take(t)
        del a
        self.prefill.send_tensor_take(t)
        np.testing.assert_array_equal(as_numpy(self.decode.recv_tensor(timeout=30)),
                                      [1, 2, 3, 4, 5])

    @unittest.skipUnless(torch is not None, "torch is not installed")
    def test_torch_export_refuses_the_take(self):
        t = self.prefill.alloc_tensor((2, 3), torch.bfloat16)
        self.assertEqual(t.dtype, "bfloat16")
        x = torch.from_dlpack(t)
        self.assertEqual(x.data_ptr(), t.data_ptr())
        x.fill_(1.5)
        y = x[1:]
        del x
        with self.assertRaises(BufferError):
            self.prefill.send_tensor_take(t)
        del y
        self.prefill.send_tensor_take(t)
        got = torch.from_dlpack(self.decode.recv_tensor(timeout=30))
        self.assertTrue(torch.equal(got, torch.full((2, 3), 1.5, dtype=torch.bfloat16)))

    def test_taken_tensor_is_spent(self):
        t = self.prefill.alloc_tensor((2, 3), "float32")
        np.asarray(t)[...] = 7
        self.prefill.send_tensor_take(t)
        self.assertEqual((t.shape, t.dtype, t.ndim, t.nbytes), ((2, 3), "float32", 2, 24))
        for name, use in (("memoryview", memoryview),
                          ("__dlpack__", lambda x: x.__dlpack__()),
                          ("__dlpack__ 1.0", lambda x: x.__dlpack__(max_version=(1, 0))),
                          ("numpy.from_dlpack", np.from_dlpack),
                          ("data_ptr", lambda x: x.data_ptr())):
            with self.subTest(use=name):
                with self.assertRaisesRegex(ValueError, "was sent"):
                    use(t)
        with self.assertRaisesRegex(ValueError, "sent already"):
            self.prefill.send_tensor_take(t)
        with self.assertRaises(ValueError):
            self.prefill.send_tensor(t)  # the copying send cannot read it either
        np.testing.assert_array_equal(as_numpy(self.decode.recv_tensor(timeout=30)),
                                      np.full((2, 3), 7, np.float32))
        self.prefill.flush(timeout=30)  # the ACK freed the memory: the Tensor must not
        del t
        self.assertEqual(self.prefill.stats()["sent"], 1)

    def test_take_rejects_other_objects(self):
        p, d = self.prefill, self.decode
        for obj in (np.zeros(3, np.uint8), None, b"abc"):
            with self.subTest(obj=type(obj).__name__):
                with self.assertRaises(TypeError):
                    p.send_tensor_take(obj)
        d.send_tensor(np.arange(3, dtype=np.uint8))
        received = p.recv_tensor(timeout=30)
        with self.assertRaisesRegex(ValueError, "alloc_tensor"):
            p.send_tensor_take(received)
        other = d.alloc_tensor((3,), "uint8")
        np.asarray(other)[...] = [7, 8, 9]
        with self.assertRaisesRegex(ValueError, "another Pipe"):
            p.send_tensor_take(other)
        # nothing of the above was sent; the other pipe's tensor is still good there
        p.send_tensor(np.array([1], dtype=np.uint8))
        np.testing.assert_array_equal(as_numpy(d.recv_tensor(timeout=30)), [1])
        d.send_tensor_take(other)
        np.testing.assert_array_equal(as_numpy(p.recv_tensor(timeout=30)), [7, 8, 9])

    def test_failed_take_leaves_the_tensor_usable(self):
        cfg = tu.pipe_config()
        with kvpipe.Pipe(cfg, 0, 0, send_timeout=0.3) as lone:
            t = lone.alloc_tensor((1000,), "int64")
            np.asarray(t)[...] = np.arange(1000)
            with self.assertRaises(kvpipe.Error) as cm:  # no peer takes the announcement
                lone.send_tensor_take(t)
            self.assertEqual(cm.exception.status, kvpipe.ETIMEDOUT)
            self.assertEqual(lone.stats()["sent"], 0)
            np.testing.assert_array_equal(np.asarray(t), np.arange(1000))
            self.assertEqual(t.data_ptr() % 256, 0)
            with kvpipe.Pipe(cfg, 0, 1) as peer:
                # the same tensor goes through once the peer has connected
                for _ in range(100):
                    try:
                        lone.send_tensor_take(t)
                        break
                    except kvpipe.Error as e:
                        self.assertEqual(e.status, kvpipe.ETIMEDOUT)
                np.testing.assert_array_equal(as_numpy(peer.recv_tensor(timeout=30)),
                                              np.arange(1000))
                lone.flush(timeout=30)
            with self.assertRaises(ValueError):
                memoryview(t)

    def test_tensor_being_sent_by_another_thread(self):
        cfg = tu.pipe_config()
        with kvpipe.Pipe(cfg, 0, 0, send_timeout=3.0) as lone:
            t = lone.alloc_tensor((8,), "uint8")
            np.asarray(t)[...] = np.arange(8)
            start = threading.Barrier(3)
            outcomes = []

            def take():
                start.wait()
                try:
                    lone.send_tensor_take(t)  # no peer: times out after 3 s
                    outcomes.append("sent")
                except kvpipe.Error as e:
                    outcomes.append(kvpipe.strerror(e.status))
                except ValueError as e:
                    outcomes.append(str(e))

            threads = [threading.Thread(target=take) for _ in range(2)]
            for th in threads:
                th.start()
            start.wait()
            time.sleep(1.0)  # one take is waiting for the peer now
            with self.assertRaisesRegex(BufferError, "another thread"):
                memoryview(t)
            with self.assertRaisesRegex(kvpipe.Error, "another thread"):
                lone.close()
            for th in threads:
                th.join(30)
            self.assertEqual(sorted(outcomes),
                             sorted([kvpipe.strerror(kvpipe.ETIMEDOUT),
                                     "send_tensor_take: this kvpipe.Tensor is being sent by "
                                     "another thread"]))
            np.testing.assert_array_equal(np.asarray(t), np.arange(8))  # usable again

    def test_closed_pipe(self):
        t = self.prefill.alloc_tensor((4,), "uint8")
        np.asarray(t)[...] = [1, 2, 3, 4]
        self.prefill.close()
        with self.assertRaises(kvpipe.Error):
            self.prefill.alloc_tensor((4,))
        with self.assertRaises(kvpipe.Error):
            self.prefill.send_tensor_take(t)
        # reopened, it is another pipe: the old tensor is not its to take
        self.prefill.__init__(tu.pipe_config(), 0, 0)
        with self.assertRaisesRegex(ValueError, "another Pipe"):
            self.prefill.send_tensor_take(t)
        self.assertEqual(bytes(memoryview(t)), b"\x01\x02\x03\x04")

    def test_unsent_tensors_outlive_close(self):
        vals = self.rng.standard_normal((64, 64)).astype(np.float32)
        t = self.prefill.alloc_tensor((64, 64), "float32")
        np.asarray(t)[...] = vals
        a = np.asarray(t)
        u = self.decode.alloc_tensor((8,), "uint8")
        np.asarray(u)[...] = np.arange(8)
        self.prefill.close()
        self.decode.close()
        np.testing.assert_array_equal(np.asarray(t), vals)
        del t  # the array still holds the memory
        a[0, 0] = 5.0
        np.testing.assert_array_equal(a[1:], vals[1:])
        self.assertEqual(a[0, 0], 5.0)
        del a
        np.asarray(u)[...] += 1
        np.testing.assert_array_equal(np.asarray(u), np.arange(1, 9))
        del u


class AsyncTests(PipePairCase):
    """recv_tensor_async / send_tensor_async on one asyncio loop: no thread
    per wait, the loop stays free while a side waits, order kept, timeouts
    as kvpipe.ETIMEDOUT, and a cancelled await takes nothing."""

    def run_loop(self, coro):
        threads = threading.active_count()
        loop = asyncio.new_event_loop()
        try:
            watched = len(loop._selector.get_map())
            result = loop.run_until_complete(asyncio.wait_for(coro, 60))
            # every add_reader was taken back, and no thread was started
            self.assertEqual(len(loop._selector.get_map()), watched)
            self.assertEqual(threading.active_count(), threads)
            return result
        finally:
            loop.close()

    def test_stream_both_sides_on_one_loop(self):
        count = 300
        arrays = [np.full(1000 + i, i % 251, dtype=np.uint8) for i in range(count)]
        ticks = []

        async def send_all():
            for a in arrays:
                await self.prefill.send_tensor_async(a)
            await self.prefill.send_tensor_async(None)

        async def recv_all():
            got = []
            while True:
                t = await self.decode.recv_tensor_async(timeout=30)
                if t is None:
                    return got
                got.append(as_numpy(t).copy())

        async def ticker():
            while True:
                ticks.append(1)
                await asyncio.sleep(0.001)

        async def main():
            tick = asyncio.ensure_future(ticker())
            got, _ = await asyncio.gather(recv_all(), send_all())
            tick.cancel()
            return got

        got = self.run_loop(main())
        self.assertEqual(len(got), count)
        for i, a in enumerate(got):
            np.testing.assert_array_equal(a, arrays[i])
        self.assertGreater(len(ticks), 1)  # the loop ran beside the waits

    def test_send_waits_for_room_without_blocking_the_loop(self):
        cfg = tu.pipe_config()
        block = np.ones(1 << 16, dtype=np.uint8)
        with kvpipe.Pipe(cfg, 0, 0, kv_buffer_size=3 * block.nbytes, send_timeout=30.0) as p, \
                kvpipe.Pipe(cfg, 0, 1) as d:
            order = []

            async def sender():
                for i in range(8):
                    await p.send_tensor_async(block * i)
                    order.append("sent %d" % i)

            async def receiver():
                await asyncio.sleep(0.3)  # the sender fills kv_buffer_size meanwhile
                order.append("receiving")
                for i in range(8):
                    t = await d.recv_tensor_async(timeout=30)
                    self.assertEqual(int(as_numpy(t)[0]), i % 256)

            async def both():
                await asyncio.gather(sender(), receiver())

            self.run_loop(both())
            first = order.index("receiving")
            self.assertGreaterEqual(first, 1)   # some went before any room was freed
            self.assertLessEqual(first, 4)      # and the rest waited for room
            self.assertEqual(len(order), 9)

    def test_recv_timeout_then_the_tensor(self):
        async def main():
            t0 = time.monotonic()
            with self.assertRaises(kvpipe.Error) as cm:
                await self.decode.recv_tensor_async(timeout=0.2)
            self.assertEqual(cm.exception.status, kvpipe.ETIMEDOUT)
            self.assertGreaterEqual(time.monotonic() - t0, 0.15)
            self.assertEqual(self.decode.stats()["recv_timeouts"], 1)  # one, not one per look
            await self.prefill.send_tensor_async(np.arange(4, dtype=np.int16))
            return await self.decode.recv_tensor_async(timeout=30)

        np.testing.assert_array_equal(as_numpy(self.run_loop(main())),
                                      np.arange(4, dtype=np.int16))

    def test_cancelled_recv_takes_nothing(self):
        async def main():
            waiting = asyncio.ensure_future(self.decode.recv_tensor_async())
            await asyncio.sleep(0.05)
            waiting.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await waiting
            await self.prefill.send_tensor_async(np.arange(3, dtype=np.int64))

        self.run_loop(main())
        np.testing.assert_array_equal(as_numpy(self.decode.recv_tensor(timeout=30)),
                                      np.arange(3, dtype=np.int64))

    def test_send_without_peer_times_out(self):
        with kvpipe.Pipe(tu.pipe_config(), 0, 0, send_timeout=0.3) as lone:
            async def main():
                with self.assertRaises(kvpipe.Error) as cm:
                    await lone.send_tensor_async(np.arange(3, dtype=np.int8))
                self.assertEqual(cm.exception.status, kvpipe.ETIMEDOUT)

            self.run_loop(main())
            self.assertEqual(lone.stats()["sent"], 0)


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


class PathTests(unittest.TestCase):
    """The inline path between two kvpipe pipes, and the pipe's options."""

    def wait_lookup(self, pipe):
        deadline = time.monotonic() + 20
        while pipe.stats()["peer_lookups"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return pipe.stats()

    def pair(self, decode_opts):
        cfg = tu.pipe_config()
        return kvpipe.Pipe(cfg, 0, 0, inline_max_bytes=65536), kvpipe.Pipe(cfg, 0, 1, **decode_opts)

    def send_some(self, a, b):
        rng = np.random.default_rng(5)
        sent = [random_array("float32", (8, 8), rng), None,
                random_array("uint8", (70000,), rng),  # above 65536: announced
                random_array("int64", (3,), rng)]
        exchange(self, a, b, sent)
        a.flush(timeout=30)
        return a.stats(), b.stats()

    def test_pair_takes_the_inline_path(self):
        a, b = self.pair({})
        with a, b:
            st = self.wait_lookup(a)
            self.assertEqual(st["peer_inline_max"], 131072)  # decode's default
            sa, sb = self.send_some(a, b)
            # three of the four are at most 64 KiB: inline; ACKed as the rest
            self.assertEqual((sa["sent"], sa["acks"], sa["inline_sent"]), (4, 4, 3))
            self.assertEqual((sb["received"], sb["inline_received"]), (4, 3))

    def test_inline_path_turned_off(self):
        a, b = self.pair({"inline_max_bytes": 0})
        with a, b:
            st = self.wait_lookup(a)
            self.assertEqual(st["peer_inline_max"], 0)
            sa, sb = self.send_some(a, b)
            self.assertEqual((sa["sent"], sa["acks"], sa["inline_sent"]), (4, 4, 0))
            self.assertEqual((sb["received"], sb["inline_received"]), (4, 0))

    def test_options(self):
        cfg = tu.pipe_config()
        opts = dict(inline_max_bytes=1024, recv_window=4, recv_window_bytes=1 << 20,
                    max_control_frame=8192, redial_min=0.1, redial_max=2.0, ack_timeout=1.0,
                    ack_linger=0.2, ack_delay_us=0, zmq_hwm=100, busy_poll_us=0)
        with kvpipe.Pipe(cfg, 0, 0, **opts) as a, kvpipe.Pipe(cfg, 0, 1, **opts) as b:
            self.send_some(a, b)
        for bad in (dict(recv_window=0), dict(redial_min=0.0), dict(redial_max=0.05),
                    dict(max_control_frame=4), dict(zmq_hwm=-1), dict(busy_poll_us=-1),
                    dict(inline_max_bytes=(1 << 30) + 1), dict(ack_delay_us=-1)):
            with self.subTest(bad=bad):
                with self.assertRaises(kvpipe.Error) as cm:
                    kvpipe.Pipe(tu.pipe_config(), 0, 0, **bad)
                self.assertEqual(cm.exception.status, kvpipe.EINVAL)
                self.assertIn("pipe option", str(cm.exception))
        with self.assertRaises(ValueError):
            kvpipe.Pipe(tu.pipe_config(), 0, 0, ack_timeout=-1.0)
        with self.assertRaises(TypeError):
            kvpipe.Pipe(tu.pipe_config(), 0, 0, no_such_option=1)


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

    def run_with_peer(self, argv_of, metadata="P2PHANDSHAKE"):
        cfg = tu.pipe_config(metadata)
        path = tu.write_config(cfg)
        msgs = self.messages()
        peer = tu.Child(argv_of(path, len(msgs)))
        try:
            self.assertEqual(peer.readline(), "ready")
            with kvpipe.Pipe(path, 0, 0) as pipe:
                exchange(self, pipe, pipe, msgs)
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

    def test_take_to_c_pipe(self):
        cfg = tu.pipe_config()
        path = tu.write_config(cfg)
        rng = np.random.default_rng(13)
        shapes = [((256, 1024), "float32"), None, ((7,), "bfloat16"), ((), "int64"),
                  ((0, 5), "float16"), ((33,), "float8_e5m2")]
        try:
            peer = tu.Child(self.c_peer(path, len(shapes)))
            try:
                self.assertEqual(peer.readline(), "ready")
                with kvpipe.Pipe(path, 0, 0) as pipe:
                    want = []
                    for s in shapes:
                        if s is None:
                            pipe.send_tensor(None)
                            want.append(None)
                            continue
                        t = pipe.alloc_tensor(*s)
                        want.append((s[1], s[0], fill_bytes(t, rng)))
                        pipe.send_tensor_take(t)
                    for w in want:
                        check_received(self, pipe.recv_tensor(timeout=30), w)
                    pipe.flush(timeout=30)
                    self.assertEqual(peer.wait(), 0, peer.stderr())
            finally:
                peer.close()
        finally:
            os.unlink(path)

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
