"""Tensors on a GPU through kvpipe.Pipe, on the CUDA driver's test double
(tests/support/fake_cuda): its memory is PROT_NONE to the CPU, so a CPU access
by kvpipe crashes the process; its test helpers allocate, read and write that
memory. The double only: no real GPU is involved (docs/gpu.md). The vLLM v1
pattern through mooncake.engine, which runs on a real driver too, is
test_gpu_vllm.py."""
import ctypes
import os
import sys
import unittest

import kvpy_testutil as tu

FAKE = os.environ.get("KVPT_FAKECUDA")
if FAKE:
    os.environ["KVPIPE_LIBCUDA"] = FAKE
import kvpipe  # noqa: E402


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


def load_double():
    """The double's test helpers: allocate, read and write its device memory."""
    cuda = ctypes.CDLL(FAKE)
    cuda.fakecuda_alloc.restype = ctypes.c_void_p
    cuda.fakecuda_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t]
    cuda.fakecuda_poke.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    cuda.fakecuda_peek.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return cuda


class DeviceBox:
    """An object on a CUDA device that only has __cuda_array_interface__ (as a
    Numba device array has), over the double's device memory."""

    def __init__(self, ptr, typestr, shape, stream=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": stream}


@unittest.skipUnless(FAKE, "KVPT_FAKECUDA does not name the CUDA driver's test double")
class PipeDeviceTensors(unittest.TestCase):
    """kvpipe.Pipe with tensors on a "device": sent from device memory (DLPack
    of a received device tensor, and __cuda_array_interface__), received onto a
    device (recv_tensor(device=...) and the Pipe's device=), across two
    processes, every byte read back through the double."""

    def setUp(self):
        self.cuda = load_double()

    def device_bytes(self, addr, n):
        buf = ctypes.create_string_buffer(n)
        self.assertEqual(self.cuda.fakecuda_peek(buf, addr, n), 0)
        return buf.raw

    def on_device(self, data, device=1):
        ptr = self.cuda.fakecuda_alloc(device, len(data))
        self.cuda.fakecuda_poke(ptr, data, len(data))
        return ptr

    def test_device_tensors_both_ways(self):
        cfg = tu.pipe_config()
        path = tu.write_config(cfg)
        here = os.path.dirname(os.path.abspath(__file__))
        sizes = [3 << 20, 1000, 0]  # announced, inline, empty
        peer = tu.Child([sys.executable, os.path.join(here, "pipe_echo.py"), path, "1",
                         str(len(sizes)), "cuda:1"])
        try:
            self.assertEqual(peer.readline(), "ready", peer.stderr())
            with kvpipe.Pipe(path, 0, 0, device="cuda:0") as pipe:
                for i, n in enumerate(sizes):
                    ptr = self.on_device(pattern(i, n)) if n else 0
                    pipe.send_tensor(DeviceBox(ptr, "<f4", (n // 4,)) if n % 4 == 0
                                     else DeviceBox(ptr, "|u1", (n,)))
                for i, n in enumerate(sizes):
                    got = pipe.recv_tensor(timeout=30, device="cuda:1" if i == 0 else None)
                    want_dev = 1 if i == 0 else 0
                    self.assertEqual(got.device, "cuda:%d" % want_dev)
                    self.assertEqual(got.__dlpack_device__(), (2, want_dev))
                    self.assertEqual(got.nbytes, n)
                    cai = got.__cuda_array_interface__
                    self.assertEqual(cai["shape"], got.shape)
                    if n:
                        self.assertEqual(cai["data"][0], got.data_ptr())
                        self.assertEqual(self.device_bytes(got.data_ptr(), n), pattern(i, n))
                    with self.assertRaises(BufferError):
                        memoryview(got)
                pipe.flush(timeout=30)
                self.assertEqual(peer.wait(), 0, peer.stderr())
        finally:
            peer.close()
            os.unlink(path)

    def test_errors_lose_nothing(self):
        cfg = tu.pipe_config()
        path = tu.write_config(cfg)
        here = os.path.dirname(os.path.abspath(__file__))
        peer = tu.Child([sys.executable, os.path.join(here, "pipe_echo.py"), path, "1", "1"])
        try:
            self.assertEqual(peer.readline(), "ready", peer.stderr())
            with kvpipe.Pipe(path, 0, 0) as pipe:
                ptr = self.on_device(pattern(9, 4096))
                with self.assertRaisesRegex(ValueError, "stream"):
                    pipe.send_tensor(DeviceBox(ptr, "|u1", (4096,), stream=7))
                with self.assertRaisesRegex(TypeError, "typestr"):
                    pipe.send_tensor(DeviceBox(ptr, ">f4", (1024,)))
                with self.assertRaisesRegex(ValueError, "device"):
                    pipe.recv_tensor(timeout=1, device="tpu:0")
                pipe.send_tensor(DeviceBox(ptr, "|u1", (4096,)))
                # A device that does not exist is refused before a tensor is taken...
                with self.assertRaises(kvpipe.Error):
                    pipe.recv_tensor(timeout=30, device="cuda:7")
                # ...so the tensor is still there.
                got = pipe.recv_tensor(timeout=30)
                self.assertEqual(got.device, "cpu")
                self.assertEqual(bytes(memoryview(got)), pattern(9, 4096))
                pipe.flush(timeout=30)
                self.assertEqual(peer.wait(), 0, peer.stderr())
        finally:
            peer.close()
            os.unlink(path)


if __name__ == "__main__":
    tu.main()
