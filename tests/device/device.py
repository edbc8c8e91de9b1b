"""The figures of the GPU device script (tests/device/run.sh): one JSON line per
figure on stdout, diagnostics on stderr. run.sh runs each subcommand as a step
with its own timeout; it also runs here, on the CUDA driver's test double
(run.sh --double), where the figures mean nothing.

    device.py machine                    the machine: GPU, driver, CPUs, kernel, glibc, torch
    device.py info --kvpipe BIN          kvpipe info: the memory kinds (cuda and its driver)
    device.py vllm --transport tcp|shm   vLLM v1's MooncakeConnector pattern
    device.py pipe --transport tcp|shm   a MooncakePipe request with device tensors
    device.py scaling                    kvpipe bench vs raw TCP / memcpy, 1..16 threads
    device.py rxe                        ucx over soft-RoCE (rxe), or why not

Device memory comes from a backend: "torch" (PyTorch CUDA tensors: the real
thing, what vLLM registers) or "driver" (the CUDA driver API through ctypes,
python/tests/cuda_mem.py: the test double, or a real driver without torch).
--backend auto takes torch where it imports with CUDA, else the driver.
Every byte is checked on the device (torch: compared there) or read back by
the driver (driver backend). Every rate is given with a baseline measured in
the same run and their ratio.
"""
import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GB = 1e9


def emit(obj):
    print(json.dumps(obj), flush=True)


def prog_env(extra=None):
    """The environment for the bundle's programs: its lib/ on LD_LIBRARY_PATH
    (run.sh passes it as KVPIPE_BUNDLE_LD_LIBRARY_PATH; the Python processes
    themselves run without, so that the interpreter and PyTorch keep the
    machine's libraries)."""
    env = dict(os.environ, **(extra or {}))
    lib = os.environ.get("KVPIPE_BUNDLE_LD_LIBRARY_PATH")
    if lib:
        env["LD_LIBRARY_PATH"] = lib
    return env


def log(msg):
    print("device.py: %s" % msg, file=sys.stderr, flush=True)


def rate(nbytes, seconds):
    return round(nbytes / seconds / GB, 3) if seconds > 0 else None


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def percentile(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p / 100))] if s else None


def host_pattern(seed, n):
    """The test pattern: byte i is (7 i + 13 seed) mod 251, period 251."""
    base = bytes((i * 7 + seed * 13) % 251 for i in range(251))
    return (base * (n // 251 + 1))[:n]


# ---------------------------------------------------------------- backends ---

class TorchBackend:
    """PyTorch CUDA tensors (uint8), checked on the device."""
    name = "torch"

    def __init__(self, device):
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch %s: CUDA is not available" % torch.__version__)
        self.torch = torch
        self.index = device
        self.dev = torch.device("cuda", device)
        torch.cuda.set_device(self.dev)
        self.version = torch.__version__

    def alloc(self, n):
        return self.torch.empty(n, dtype=self.torch.uint8, device=self.dev)

    def ptr(self, buf):
        return buf.data_ptr()

    def _pattern(self, seed, n):
        t = self.torch
        base = ((t.arange(251, device=self.dev, dtype=t.int64) * 7 + seed * 13) % 251).to(t.uint8)
        return base.repeat(n // 251 + 1)[:n]

    def fill(self, buf, seed):
        buf.copy_(self._pattern(seed, buf.numel()))
        self.torch.cuda.synchronize()

    def zero(self, buf):
        buf.zero_()
        self.torch.cuda.synchronize()

    def mismatch(self, buf, seed):
        """None when buf holds pattern(seed), else the first wrong byte's index."""
        flat = buf.reshape(-1).view(self.torch.uint8) if buf.dtype != self.torch.uint8 else buf.reshape(-1)
        bad = (flat != self._pattern(seed, flat.numel())).nonzero()
        return None if bad.numel() == 0 else int(bad[0].item())

    def tensor(self, shape, dtype_name, seed):
        """A device tensor of shape and dtype holding pattern(seed)."""
        t = self.torch
        dtype = getattr(t, dtype_name)
        n = 1
        for d in shape:
            n *= d
        nbytes = n * t.empty((), dtype=dtype).element_size()
        raw = self.alloc(nbytes)
        self.fill(raw, seed)
        return raw.view(dtype).reshape(shape)

    def received(self, kv_tensor):
        """A torch view of a kvpipe.Tensor on the device (DLPack, no copy)."""
        return self.torch.from_dlpack(kv_tensor)

    def d2d_gbps(self, n, reps=5):
        a, b = self.alloc(n), self.alloc(n)
        b.copy_(a)
        self.torch.cuda.synchronize()
        best = None
        for _ in range(reps):
            t0 = time.perf_counter()
            b.copy_(a)
            self.torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            best = dt if best is None or dt < best else best
        return rate(n, best)

    def d2h_gbps(self, n, reps=5):
        a = self.alloc(n)
        h = self.torch.empty(n, dtype=self.torch.uint8, pin_memory=True)
        h.copy_(a)
        best = None
        for _ in range(reps):
            t0 = time.perf_counter()
            h.copy_(a, non_blocking=True)
            self.torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            best = dt if best is None or dt < best else best
        return rate(n, best)


class DriverBackend:
    """The CUDA driver API through ctypes (cuda_mem): device memory as ints,
    checked by copying it back to the host with the driver."""
    name = "driver"

    def __init__(self, device):
        os.environ["KVPT_CUDA_DEVICE"] = str(device)
        import cuda_mem
        self.dev = cuda_mem.open_driver()
        if self.dev is None:
            raise RuntimeError("no CUDA driver with a device here (libcuda.so.1, KVPT_FAKECUDA)")
        self.index = device
        self.version = None
        lib = self.dev.lib
        lib.cuMemcpyDtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t]

    def alloc(self, n):
        return self.dev.alloc(n)

    def ptr(self, buf):
        return buf

    def fill_n(self, ptr, n, seed):
        self.dev.write(ptr, host_pattern(seed, n))

    def zero_n(self, ptr, n):
        self.dev.write(ptr, bytes(n))

    def mismatch_n(self, ptr, n, seed):
        got, want = self.dev.read(ptr, n), host_pattern(seed, n)
        if got == want:
            return None
        return next(i for i in range(n) if got[i] != want[i])

    def _check(self, r, what):
        self.dev._check(r, what)

    def d2d_gbps(self, n, reps=5):
        a, b = self.alloc(n), self.alloc(n)
        best = None
        for _ in range(reps + 1):
            self.dev._current()
            t0 = time.perf_counter()
            self._check(self.dev.lib.cuMemcpyDtoD_v2(b, a, n), "cuMemcpyDtoD_v2")
            self._check(self.dev.lib.cuCtxSynchronize(), "cuCtxSynchronize")
            dt = time.perf_counter() - t0
            best = dt if best is None or dt < best else best
        self.dev.free(a)
        self.dev.free(b)
        return rate(n, best)

    def d2h_gbps(self, n, reps=5):
        a = self.alloc(n)
        h = ctypes.c_void_p()
        self._check(self.dev.lib.cuMemHostAlloc(ctypes.byref(h), n, 0), "cuMemHostAlloc")
        best = None
        for _ in range(reps + 1):
            self.dev._current()
            t0 = time.perf_counter()
            self._check(self.dev.lib.cuMemcpyDtoH_v2(h, a, n), "cuMemcpyDtoH_v2")
            dt = time.perf_counter() - t0
            best = dt if best is None or dt < best else best
        self.dev.free(a)
        return rate(n, best)


def open_backend(kind, device):
    """(backend, why_not_torch)."""
    why = None
    if kind in ("auto", "torch"):
        try:
            return TorchBackend(device), None
        except Exception as e:  # no torch, or no CUDA in it
            why = "%s: %s" % (type(e).__name__, e)
            if kind == "torch":
                raise
    return DriverBackend(device), why


# ---------------------------------------------------------------- machine ---

def cmd_machine(args):
    facts = {"kernel": " ".join(platform.uname()[2:3] + platform.uname()[4:5]),
             "cpus": os.cpu_count(), "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
             "python": "%s %s" % (platform.python_implementation(), platform.python_version()),
             "python_path": sys.executable}
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            facts["memory_gib"] = round(int(f.readline().split()[1]) / 1048576, 1)
    except OSError:
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,pci.bus_id",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        facts["gpus"] = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()] if r.returncode == 0 \
            else "nvidia-smi failed: %s" % (r.stderr.strip() or r.returncode)
    except (OSError, subprocess.TimeoutExpired) as e:
        facts["gpus"] = "no nvidia-smi: %s" % e
    try:
        import torch
        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
        facts["torch_cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            facts["torch_device"] = torch.cuda.get_device_name(args.device)
    except Exception as e:
        facts["torch"] = "not importable: %s: %s" % (type(e).__name__, e)
    emit({"machine": facts})
    return 0


def cmd_info(args):
    """kvpipe info --json, the parts that matter here; fails where kvpipe
    cannot use CUDA memory."""
    r = subprocess.run([args.kvpipe, "info", "--json"], capture_output=True, text=True, timeout=60,
                       env=prog_env())
    if r.returncode != 0:
        log("kvpipe info: exit %d: %s" % (r.returncode, r.stderr.strip()))
        return 1
    info = json.loads(r.stdout)
    mem = info.get("memory", [])
    cuda = next((m for m in mem if m.get("name") == "cuda"), {})
    emit({"figure": "kvpipe_info", "version": info.get("version"), "memory": mem,
          "transports": [t["name"] for t in info.get("transports", []) if t.get("available")],
          "ok": bool(cuda.get("available"))})
    return 0 if cuda.get("available") else 1


# ------------------------------------------------------------- vLLM v1 ---

def engine_env(transport):
    """tcp: as vLLM users between hosts (MC_FORCE_TCP=1; KVPIPE_DISABLE_SHM=1
    so that a same-host peer is not given shm); shm: as the engine chooses."""
    if transport == "tcp":
        os.environ["MC_FORCE_TCP"] = "1"
        os.environ["KVPIPE_DISABLE_SHM"] = "1"
    else:
        os.environ.pop("MC_FORCE_TCP", None)
        os.environ["KVPIPE_DISABLE_SHM"] = "0"


def vllm_protocol(transport):
    # vLLM's MooncakeConnector asks for "rdma"; MC_FORCE_TCP=1 runs it over tcp.
    return "rdma" if transport == "tcp" else "tcp"


class Mem:
    """Blocks of device memory of one backend, with the pattern calls both need."""

    def __init__(self, backend, count, size):
        self.b, self.size = backend, size
        self.bufs = [backend.alloc(size) for _ in range(count)]
        self.ptrs = [backend.ptr(x) for x in self.bufs]

    def fill(self, i, seed):
        if self.b.name == "torch":
            self.b.fill(self.bufs[i], seed)
        else:
            self.b.fill_n(self.ptrs[i], self.size, seed)

    def zero(self, i):
        if self.b.name == "torch":
            self.b.zero(self.bufs[i])
        else:
            self.b.zero_n(self.ptrs[i], self.size)

    def mismatch(self, i, seed):
        if self.b.name == "torch":
            return self.b.mismatch(self.bufs[i], seed)
        return self.b.mismatch_n(self.ptrs[i], self.size, seed)


def cmd_vllm_peer(args):
    """The decode side of the vLLM pattern: device KV blocks registered with
    batch_register_memory; answers CHECK SEED (every block b holds
    pattern(SEED + b)?) and EXIT on stdin."""
    engine_env(args.transport)
    backend, _ = open_backend(args.backend, args.device)
    from mooncake.engine import TransferEngine  # kvpipe's, through the shim
    import kvpipe
    mem = Mem(backend, args.blocks, args.block_bytes)
    for i in range(args.blocks):
        mem.zero(i)
    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", vllm_protocol(args.transport), "") != 0:
        print("FAILED initialize: %s" % kvpipe.last_error(), flush=True)
        return 1
    if eng.batch_register_memory(mem.ptrs, [args.block_bytes] * args.blocks) != 0:
        print("FAILED batch_register_memory: %s" % kvpipe.last_error(), flush=True)
        return 1
    print("READY %s %s" % (eng.get_segment_name(), " ".join(map(str, mem.ptrs))), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["CHECK"]:
            seed = int(words[1])
            bad = [(b, mem.mismatch(b, seed + b)) for b in range(args.blocks)]
            bad = [(b, at) for b, at in bad if at is not None]
            print("OK" if not bad else "BAD %d blocks, first block %d at byte %d" %
                  (len(bad), bad[0][0], bad[0][1]), flush=True)
        elif words[:1] == ["EXIT"]:
            break
    eng.close()
    return 0


def raw_tcp_gbps(raw_tcp, streams, block, span, duration):
    if not raw_tcp:
        return None
    got = run_json([raw_tcp, "--streams", str(streams), "--block-size", str(block), "--send-span",
                    str(span), "--recv-span", str(span), "--duration", str(duration)], duration + 60)
    return got["gbps"] if got else None


def cmd_vllm(args):
    engine_env(args.transport)
    backend, why = open_backend(args.backend, args.device)
    if why:
        log("no torch CUDA tensors (%s): device memory from the driver API instead" % why)
    from mooncake.engine import TransferEngine
    import kvpipe
    threads, per = args.threads, args.blocks_per_thread
    blocks, size = threads * per, args.block_bytes
    peer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "vllm-peer",
                             "--transport", args.transport, "--backend", backend.name,
                             "--device", str(args.device), "--blocks", str(blocks),
                             "--block-bytes", str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        words = peer.stdout.readline().split()
        if words[:1] != ["READY"]:
            log("the peer did not start: %s" % " ".join(words))
            return 1
        target, remote = words[1], [int(w) for w in words[2:]]
        mem = Mem(backend, blocks, size)
        for i in range(blocks):
            mem.fill(i, i)
        eng = TransferEngine()
        if eng.initialize("127.0.0.1", "P2PHANDSHAKE", vllm_protocol(args.transport), "") != 0:
            log("initialize: %s" % kvpipe.last_error())
            return 1
        if eng.batch_register_memory(mem.ptrs, [size] * blocks) != 0:
            log("batch_register_memory: %s" % kvpipe.last_error())
            return 1
        # Thread t writes its blocks, each in two halves (a layer's K and V),
        # one batch_transfer_sync_write per call, as the connector does.
        lat, rets, errors = [[] for _ in range(threads)], [0] * threads, []
        start = threading.Barrier(threads + 1)

        def call(t):
            src, dst, lens = [], [], []
            for b in range(t * per, (t + 1) * per):
                for half in (0, size // 2):
                    src.append(mem.ptrs[b] + half)
                    dst.append(remote[b] + half)
                    lens.append(size // 2 if half == 0 else size - size // 2)
            return eng.batch_transfer_sync_write(target, src, dst, lens)

        def writer(t):
            rets[t] = call(t)  # warm-up: the segment, the connections, an IPC mapping
            start.wait()
            for _ in range(args.calls):
                t0 = time.perf_counter()
                r = call(t)
                lat[t].append(time.perf_counter() - t0)
                if r != 0 and not errors:
                    errors.append("thread %d: %d: %s" % (t, r, kvpipe.last_error()))
                rets[t] = rets[t] or r

        ths = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
        for th in ths:
            th.start()
        start.wait()
        t0 = time.perf_counter()
        for th in ths:
            th.join()
        wall = time.perf_counter() - t0
        transport = eng.segment_transport(target)
        peer.stdin.write("CHECK 0\n")
        peer.stdin.flush()
        check = peer.stdout.readline().strip()
        ok = rets == [0] * threads and check == "OK"
        moved = threads * args.calls * per * size
        gbps = rate(moved, wall)
        all_lat = [x * 1e3 for t in lat for x in t]
        if args.transport == "tcp":
            base_name = "raw_tcp_%d_streams" % threads
            base = raw_tcp_gbps(args.raw_tcp, threads, size // 2, per * size, args.baseline_seconds)
        else:
            base_name = "device_to_device_copy"
            base = backend.d2d_gbps(per * size)
        emit({"figure": "vllm_v1_write", "transport_asked": args.transport, "transport": transport,
              "backend": backend.name, "threads": threads, "calls_per_thread": args.calls,
              "blocks": blocks, "block_bytes": size, "bytes_per_call": per * size, "bytes": moved,
              "seconds": round(wall, 3), "GBps": gbps,
              "p50_ms": round(percentile(all_lat, 50), 3), "p99_ms": round(percentile(all_lat, 99), 3),
              "baseline": base_name, "baseline_GBps": base, "ratio": ratio(gbps, base),
              "checked": "every block on the peer's device: %s" % check, "ok": ok,
              **({"error": errors[0]} if errors else {})})
        eng.close()
        return 0 if ok else 1
    except BaseException:
        peer.kill()
        raise
    finally:
        if peer.poll() is None:
            try:
                peer.stdin.write("EXIT\n")
                peer.stdin.flush()
                peer.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                peer.kill()


# ------------------------------------------------------------------ pipe ---

def request_shape(tokens, layers=32, kv_heads=8, head_dim=128, hidden=4096):
    """MooncakePipe's tensors for one request of a Llama-3-8B (kvpipe demo's
    shape): input tokens, roi, keys, values, hidden states."""
    return [("input_tokens", (tokens,), "int64", "<i8"),
            ("roi", (tokens,), "bool", "|b1"),
            ("keys", (layers, tokens, kv_heads, head_dim), "bfloat16", "<u2"),
            ("values", (layers, tokens, kv_heads, head_dim), "bfloat16", "<u2"),
            ("hidden", (tokens, hidden), "bfloat16", "<u2")]


ITEM = {"int64": 8, "bool": 1, "bfloat16": 2}


def nbytes_of(shape, dtype):
    n = ITEM[dtype]
    for d in shape:
        n *= d
    return n


class DeviceBox:
    """Device memory with __cuda_array_interface__ only (as a Numba array):
    how the driver backend hands device memory to send_tensor."""

    def __init__(self, ptr, typestr, shape):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": None}


def pipe_config(transport):
    import kvpy_testutil as tu
    return tu.pipe_config(protocol="tcp")


def cmd_pipe_peer(args):
    """The decode side: recv_tensor(device="cuda:N") of each tensor, checked on
    the device; prints one line per tensor and DONE <monotonic time>."""
    backend, _ = open_backend(args.backend, args.device)
    import kvpipe
    cfg = json.loads(args.config)
    pipe = kvpipe.Pipe(cfg, 0, 1, disable_shm=args.transport == "tcp")
    print("READY", flush=True)
    bad = 0
    for r in range(args.requests):
        for k, (name, shape, dtype, _) in enumerate(request_shape(args.tokens)):
            t = pipe.recv_tensor(timeout=120, device="cuda:%d" % args.device)
            if tuple(t.shape) != tuple(shape) or t.device != "cuda:%d" % args.device:
                print("BAD %s: %s on %s" % (name, t.shape, t.device), flush=True)
                bad += 1
                continue
            seed = 10 * r + k
            if backend.name == "torch":
                at = backend.mismatch(backend.received(t), seed)
            else:
                ptr = t.__cuda_array_interface__["data"][0]
                at = backend.mismatch_n(ptr, t.nbytes, seed)
            if at is not None:
                bad += 1
            print("%s %s %d bytes%s" % ("OK" if at is None else "BAD", name, t.nbytes,
                                        "" if at is None else ", first wrong byte %d" % at), flush=True)
            del t
    print("DONE %.6f %d" % (time.monotonic(), bad), flush=True)
    pipe.close()
    return 0


def cmd_pipe(args):
    backend, why = open_backend(args.backend, args.device)
    if why:
        log("no torch CUDA tensors (%s): device memory from the driver API instead" % why)
    import kvpipe
    cfg = pipe_config(args.transport)
    peer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "pipe-peer",
                             "--transport", args.transport, "--backend", backend.name,
                             "--device", str(args.device), "--tokens", str(args.tokens),
                             "--requests", str(args.requests), "--config", json.dumps(cfg)],
                            stdout=subprocess.PIPE, text=True)
    try:
        pipe = kvpipe.Pipe(cfg, 0, 0, disable_shm=args.transport == "tcp")
        if peer.stdout.readline().strip() != "READY":
            log("the decode side did not start")
            return 1
        shape = request_shape(args.tokens)
        tensors, total = [], 0
        for r in range(args.requests):
            for k, (name, shp, dtype, typestr) in enumerate(shape):
                n = nbytes_of(shp, dtype)
                total += n
                if backend.name == "torch":
                    tensors.append(backend.tensor(shp, dtype, 10 * r + k))
                else:
                    p = backend.alloc(n)
                    backend.fill_n(p, n, 10 * r + k)
                    tensors.append(DeviceBox(p, typestr, shp))
        t0 = time.monotonic()
        for x in tensors:
            pipe.send_tensor(x)
        pipe.flush(timeout=120)
        lines = []
        while True:
            line = peer.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("DONE"):
                break
        done = lines[-1].split() if lines and lines[-1].startswith("DONE") else None
        wall = float(done[1]) - t0 if done else None
        bad = [x for x in lines if x.startswith("BAD")]
        ok = done is not None and done[2] == "0" and not bad
        gbps = rate(total, wall) if wall else None
        base = backend.d2h_gbps(min(total, 256 << 20))
        emit({"figure": "pipe_request", "transport_asked": args.transport,
              "backend": backend.name, "tokens": args.tokens, "requests": args.requests,
              "tensors": [s[0] for s in shape], "bytes": total,
              "seconds": round(wall, 3) if wall else None, "GBps": gbps,
              "baseline": "pinned_device_to_host_copy", "baseline_GBps": base, "ratio": ratio(gbps, base),
              "checked": "every tensor on the receiver's device (recv_tensor(device='cuda:%d')): %d ok, %d bad"
                         % (args.device, sum(1 for x in lines if x.startswith("OK")), len(bad)),
              "ok": ok, **({"bad": bad[:3]} if bad else {})})
        pipe.close()
        return 0 if ok else 1
    except BaseException:
        peer.kill()  # it would wait for tensors that will not come
        raise
    finally:
        try:
            peer.wait(60)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()


# --------------------------------------------------------------- scaling ---

def run_json(argv, timeout, env=None):
    """The last JSON line of argv's stdout (a program of the bundle, with env
    added to its environment), or None (logged)."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=prog_env(env))
    except subprocess.TimeoutExpired:
        log("%s: timed out after %d s" % (" ".join(argv), timeout))
        return None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        log("%s: exit %d: %s" % (" ".join(argv), r.returncode, (r.stderr or r.stdout).strip()[-500:]))
        return None
    return json.loads(lines[-1])


def cmd_scaling(args):
    sizes = [int(x) for x in args.sizes.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    failed = 0
    for size in sizes:
        batch = max(1, (16 << 20) // size)  # 16 MiB a batch per thread
        span = batch * size
        for transport in args.transports.split(","):
            for t in threads:
                if transport == "tcp":
                    base = run_json([args.raw_tcp, "--streams", str(t), "--block-size", str(size),
                                     "--send-span", str(span), "--recv-span", str(span),
                                     "--duration", str(args.duration)], args.duration + 60)
                    base_name = "raw_tcp_streams"
                else:
                    base = run_json([args.memcpy, "--size", str(size), "--threads", str(t),
                                     "--duration", str(args.duration)], args.duration + 60)
                    base_name = "memcpy_threads"
                base_gbps = base["gbps"] if base else None
                for op in args.ops.split(","):
                    argv = [args.kvpipe, "bench", "--operation", op, "--block-size", str(size),
                            "--batch-size", str(batch), "--threads", str(t), "--duration", str(args.duration),
                            "--json"]
                    argv += ["--protocol", "tcp", "--no-shm"] if transport == "tcp" else ["--protocol", "shm"]
                    got = run_json(argv, args.duration + 90)
                    ok = bool(got) and got.get("errors") == 0 and got.get("mismatches") == 0
                    failed += not ok
                    gbps = got["gbps"] if got else None
                    emit({"figure": "scaling", "transport": transport, "op": op, "block_bytes": size,
                          "batch": batch, "threads": t, "GBps": gbps,
                          "p50_ms": got.get("p50_ms") if got else None,
                          "p99_ms": got.get("p99_ms") if got else None,
                          "baseline": base_name, "baseline_GBps": base_gbps, "ratio": ratio(gbps, base_gbps),
                          "errors": got.get("errors") if got else None, "ok": ok})
    return 1 if failed else 0


# ------------------------------------------------------------ soft-RoCE ---

def sh(argv, timeout=30):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=prog_env())
        return r.returncode, (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)


def ucx_bench(args, op, env, device_name=None):
    argv = [args.kvpipe, "bench", "--protocol", "rdma", "--no-shm", "--operation", op, "--block-size",
            "1M", "--batch-size", "8", "--threads", "1", "--duration", str(args.duration), "--verify",
            "--json"]
    if device_name:
        argv += ["--device-name", device_name]
    return run_json(argv, args.duration + 90, env=env)


def cmd_rxe(args):
    base = raw_tcp_gbps(args.raw_tcp, 1, 1 << 20, 8 << 20, args.duration)
    if args.rehearse:
        # The ucx transport from the bundle (its libraries and modules), over
        # UCX's tcp: no device is added to this machine.
        env = {"UCX_TLS": "tcp,self"}
        emit({"soft_roce": "not tried", "why": "--double: the rehearsal adds no RDMA device to this "
              "machine; ucx runs over UCX's tcp instead, to prove the bundle's UCX loads"})
        fails = 0
        for op in ("read", "write"):
            got = ucx_bench(args, op, env)
            ok = bool(got) and got.get("errors") == 0 and got.get("mismatches") == 0 and \
                got.get("transport") == "ucx"
            fails += not ok
            gbps = got["gbps"] if got else None
            emit({"figure": "ucx_rehearsal", "tls": "tcp", "op": op,
                  "transport": got.get("transport") if got else None, "GBps": gbps,
                  "baseline": "raw_tcp_1_stream", "baseline_GBps": base, "ratio": ratio(gbps, base),
                  "verified": ok})
        return 1 if fails else 0
    rdma, ip = args.rdma or "rdma", args.ip or "ip"
    steps = []
    rc, out = sh([rdma, "link", "show"])
    if rc != 0:
        emit({"soft_roce": "not possible", "why": "`rdma link show` failed: %s" % out[-300:]})
        return 77
    sh(["modprobe", "rdma_rxe"])
    added, netdev = None, None
    for dev in ("lo", "kvprxe0"):
        if dev != "lo":
            rc, out2 = sh([ip, "link", "add", dev, "type", "dummy"])
            if rc != 0:
                steps.append("a dummy netdev: %s" % out2[-200:])
                break
            netdev = dev
            sh([ip, "addr", "add", "10.213.77.1/24", "dev", dev])
            sh([ip, "link", "set", dev, "up"])
        rc, out = sh([rdma, "link", "add", "kvprxe", "type", "rxe", "netdev", dev])
        steps.append("rxe on %s: %s" % (dev, "ok" if rc == 0 else out[-200:]))
        if rc == 0:
            added, netdev = "kvprxe", dev
            break
    # (netdev: the device to remove afterwards, the dummy one even when rxe failed on it)
    try:
        if not added:
            emit({"soft_roce": "not possible", "why": "; ".join(steps)})
            return 77
        env = {"UCX_TLS": "rc_verbs,ud_verbs,self", "UCX_NET_DEVICES": "kvprxe:1"}
        fails = 0
        for op in ("read", "write"):
            got = ucx_bench(args, op, env, "kvprxe:1")
            ok = bool(got) and got.get("errors") == 0 and got.get("mismatches") == 0 and \
                got.get("transport") == "ucx"
            fails += not ok
            gbps = got["gbps"] if got else None
            emit({"figure": "ucx_soft_roce", "netdev": netdev, "tls": env["UCX_TLS"], "op": op,
                  "transport": got.get("transport") if got else None, "GBps": gbps,
                  "baseline": "raw_tcp_1_stream", "baseline_GBps": base, "ratio": ratio(gbps, base),
                  "verified": ok})
        return 1 if fails else 0
    finally:
        if added:
            sh([rdma, "link", "delete", added])
        if netdev and netdev != "lo":
            sh([ip, "link", "delete", netdev])


# ------------------------------------------------------------------ main ---

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--device", type=int, default=0)
        p.add_argument("--backend", choices=("auto", "torch", "driver"), default="auto")

    p = sub.add_parser("machine")
    p.add_argument("--device", type=int, default=0)
    p = sub.add_parser("info")
    p.add_argument("--kvpipe", required=True)
    def with_transport(name):
        p = sub.add_parser(name)
        common(p)
        p.add_argument("--transport", choices=("tcp", "shm"), required=True)
        return p

    for name in ("vllm", "vllm-peer"):
        p = with_transport(name)
        p.add_argument("--threads", type=int, default=10)
        p.add_argument("--blocks-per-thread", type=int, default=4)
        p.add_argument("--blocks", type=int, default=0)
        p.add_argument("--block-bytes", type=int, default=512 << 10)
        p.add_argument("--calls", type=int, default=50)
        p.add_argument("--raw-tcp")
        p.add_argument("--baseline-seconds", type=float, default=2)
    for name in ("pipe", "pipe-peer"):
        p = with_transport(name)
        p.add_argument("--tokens", type=int, default=8192)
        p.add_argument("--requests", type=int, default=1)
        p.add_argument("--config")
    p = sub.add_parser("scaling")
    p.add_argument("--kvpipe", required=True)
    p.add_argument("--raw-tcp", required=True)
    p.add_argument("--memcpy", required=True)
    p.add_argument("--sizes", default="1048576,16777216")
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--transports", default="tcp,shm")
    p.add_argument("--ops", default="read,write")
    p.add_argument("--duration", type=float, default=1)
    p = sub.add_parser("rxe")
    p.add_argument("--kvpipe", required=True)
    p.add_argument("--raw-tcp")
    p.add_argument("--rdma")
    p.add_argument("--ip")
    p.add_argument("--duration", type=float, default=2)
    p.add_argument("--rehearse", action="store_true")
    args = ap.parse_args()
    fn = {"machine": cmd_machine, "info": cmd_info, "vllm": cmd_vllm, "vllm-peer": cmd_vllm_peer, "pipe": cmd_pipe,
          "pipe-peer": cmd_pipe_peer, "scaling": cmd_scaling, "rxe": cmd_rxe}[args.cmd]
    return fn(args)


if __name__ == "__main__":
    sys.exit(main())
