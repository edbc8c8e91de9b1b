"""GPU device memory for the tests, through the CUDA driver API alone (ctypes;
no toolkit, no torch), on the real driver or on its test double.

    dev = cuda_mem.open_driver()   # None: no driver with a device here
    p = dev.alloc(n)               # cuMemAlloc_v2 on dev.device
    dev.write(p, data)             # cuMemcpyHtoD_v2
    dev.read(p, n)                 # cuMemcpyDtoH_v2 -> bytes
    dev.free(p)                    # cuMemFree_v2

Which driver: KVPT_FAKECUDA (the double, tests/support/fake_cuda) when set,
else libcuda.so.1. The process's kvpipe loads the same one: open_driver()
sets KVPIPE_LIBCUDA to the double, so call it before importing kvpipe. The
device is the driver's last (device 1 of the double's two, so that a device
other than 0 is exercised; device 0 on a one-GPU machine), or
KVPT_CUDA_DEVICE. KVPT_REQUIRE_CUDA=1 makes a missing
driver or device an error instead of a reason to skip.
"""
import ctypes
import os

CUdeviceptr = ctypes.c_ulonglong


class DriverError(RuntimeError):
    pass


class Device:
    def __init__(self, lib, path, double):
        self.lib, self.path, self.double = lib, path, double
        self._check(lib.cuInit(0), "cuInit")
        count = ctypes.c_int()
        self._check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        if count.value < 1:
            raise DriverError("%s: no CUDA device" % path)
        self.device = int(os.environ.get("KVPT_CUDA_DEVICE", count.value - 1))
        dev = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), self.device), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev),
                    "cuDevicePrimaryCtxRetain")

    def _check(self, r, what):
        if r != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(r, ctypes.byref(msg))
            raise DriverError("%s: %s failed: %s (%d)" % (self.path, what,
                              (msg.value or b"?").decode(), r))

    def _current(self):
        # The context is per thread: make it current on the calling one.
        self._check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def alloc(self, n):
        self._current()
        p = CUdeviceptr()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc_v2")
        return p.value

    def write(self, ptr, data):
        self._current()
        self._check(self.lib.cuMemcpyHtoD_v2(CUdeviceptr(ptr), data, ctypes.c_size_t(len(data))),
                    "cuMemcpyHtoD_v2")

    def read(self, ptr, n):
        self._current()
        buf = ctypes.create_string_buffer(n)
        self._check(self.lib.cuMemcpyDtoH_v2(buf, CUdeviceptr(ptr), ctypes.c_size_t(n)),
                    "cuMemcpyDtoH_v2")
        return buf.raw

    def free(self, ptr):
        self._current()
        self._check(self.lib.cuMemFree_v2(CUdeviceptr(ptr)), "cuMemFree_v2")


def open_driver():
    """The Device of this process, or None when no driver with a device is
    here (DriverError instead under KVPT_REQUIRE_CUDA=1)."""
    fake = os.environ.get("KVPT_FAKECUDA")
    path = fake or "libcuda.so.1"
    if fake:
        os.environ["KVPIPE_LIBCUDA"] = fake
    try:
        return Device(ctypes.CDLL(path), path, bool(fake))
    except (OSError, DriverError):
        if os.environ.get("KVPT_REQUIRE_CUDA") == "1":
            raise
        return None
