"""TransferEngine's awaitable transfers (transfer_aio, batch_transfer_aio)
under asyncio, against a peer engine in another process: many awaits on one
loop without a thread per wait, failures as Mooncake's ints, cancellation
with kvpipe's guarantee, closing with awaits pending; and the synchronous
calls' wait on the completion callback's eventfd, which Ctrl-C ends."""
import asyncio
import os
import signal
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import kvpipe  # noqa: E402

SIZE = 1 << 20
READ, WRITE = kvpipe.TransferOpcode.Read, kvpipe.TransferOpcode.Write


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


class AsyncioTests(unittest.TestCase):
    def setUp(self):
        self.saved_env = os.environ.get("KVPIPE_DISABLE_SHM")
        os.environ["KVPIPE_DISABLE_SHM"] = "1"  # tcp: a stopped peer stalls it
        self.target = "%s:%d" % (tu.HOST, tu.free_port())
        self.peer = tu.python_child("engine_peer.py", self.target, "P2PHANDSHAKE", SIZE)
        words = self.peer.readline().split()
        self.assertEqual(words[0], "READY", " ".join(words))
        self.peer_managed, self.peer_region = int(words[2]), int(words[3])
        self.eng = kvpipe.TransferEngine()
        self.assertEqual(self.eng.initialize("%s:%d" % (tu.HOST, tu.free_port()), "P2PHANDSHAKE",
                                             "tcp", ""), 0, kvpipe.last_error())
        self.local = self.eng.allocate_managed_buffer(SIZE)
        self.assertNotEqual(self.local, 0)

    def tearDown(self):
        if self.saved_env is None:
            os.environ.pop("KVPIPE_DISABLE_SHM", None)
        else:
            os.environ["KVPIPE_DISABLE_SHM"] = self.saved_env
        os.kill(self.peer.proc.pid, signal.SIGCONT)
        self.eng.close()
        if self.peer.proc.poll() is None:
            self.peer.send("EXIT")
            self.peer.wait()
        self.peer.close()

    def stop_peer(self):
        """SIGSTOP the peer and wait until it is stopped (a transfer sent
        the moment after the signal may still be served otherwise)."""
        pid = self.peer.proc.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.001)
        self.fail("the peer did not stop")

    def peer_bytes(self, addr, n):
        self.peer.send("HEX %d %d" % (addr, n))
        return bytes.fromhex(self.peer.readline())

    def reader_count(self, loop):
        """How many fds the loop's selector watches (the reader, or not)."""
        return len(loop._selector.get_map())

    def test_many_concurrent_awaits(self):
        e, n, piece = self.eng, 200, SIZE // 256
        threads_before = threading.active_count()

        async def main():
            loop = asyncio.get_running_loop()
            idle = self.reader_count(loop)
            futs = [e.transfer_aio(self.target, self.local + i * piece,
                                   self.peer_managed + i * piece, piece, READ) for i in range(n)]
            # Every await is pending on one reader of the completion fd.
            self.assertEqual(self.reader_count(loop), idle + 1)
            results = await asyncio.gather(*futs)
            self.assertEqual(self.reader_count(loop), idle)  # gone with the last
            return results

        results = asyncio.run(main())
        self.assertEqual(results, [0] * n, kvpipe.last_error())
        self.assertEqual(e.read_bytes_from_buffer(self.local, n * piece),
                         pattern(1, SIZE)[:n * piece])
        # No thread per wait (the engine's own may have started a few).
        self.assertLess(threading.active_count() - threads_before, 8)

    def test_batches_failures_and_awaits_in_tasks(self):
        e = self.eng
        mine = pattern(5, 3 * 4096)
        e.write_bytes_to_buffer(self.local, mine, len(mine))

        async def main():
            w = await e.batch_transfer_aio(self.target, [self.local + i * 4096 for i in range(3)],
                                           [self.peer_region + i * 8192 for i in range(3)],
                                           [4096] * 3, WRITE)
            # A range past the peer's buffer: a negative int, as transfer_sync's.
            bad = await e.transfer_aio(self.target, self.local, self.peer_region + SIZE, 64, READ)
            why = kvpipe.last_error()
            # Awaited from tasks of their own, with a timeout that does not fire.
            tasks = [asyncio.create_task(asyncio.wait_for(
                e.transfer_aio(self.target, self.local + SIZE // 2 + i * 64,
                               self.peer_managed + i * 64, 64, READ), 30)) for i in range(20)]
            return w, bad, why, await asyncio.gather(*tasks)

        w, bad, why, got = asyncio.run(main())
        self.assertEqual(w, 0, kvpipe.last_error())
        for i in range(3):
            self.assertEqual(self.peer_bytes(self.peer_region + i * 8192, 4096),
                             mine[i * 4096:(i + 1) * 4096])
        self.assertEqual(bad, -kvpipe.ERANGE)
        self.assertIn("outside", why)
        self.assertEqual(got, [0] * 20)
        self.assertEqual(e.read_bytes_from_buffer(self.local + SIZE // 2, 20 * 64),
                         pattern(1, SIZE)[:20 * 64])

    def test_no_running_loop(self):
        with self.assertRaises(RuntimeError):
            self.eng.transfer_aio(self.target, self.local, self.peer_managed, 64, READ)

    def test_cancel_waits_for_the_batch(self):
        """Cancelling the awaiting task cancels the batch; the task raises
        CancelledError only once the batch completed (here: once the stopped
        peer resumes and what had started finishes), never before."""
        e = self.eng
        self.assertEqual(e.transfer_sync_read(self.target, self.local, self.peer_managed, 64), 0)
        n, piece = 128, SIZE // 128

        async def main():
            loop = asyncio.get_running_loop()
            idle = self.reader_count(loop)
            self.stop_peer()
            task = asyncio.create_task(e.batch_transfer_aio(
                self.target, [self.local + i * piece for i in range(n)],
                [self.peer_managed + i * piece for i in range(n)], [piece] * n, READ))
            await asyncio.sleep(0.3)
            self.assertFalse(task.done())
            resumed = []

            def resume():
                resumed.append(time.monotonic())
                os.kill(self.peer.proc.pid, signal.SIGCONT)

            loop.call_later(0.7, resume)
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await task
            ended = time.monotonic()
            self.assertEqual(self.reader_count(loop), idle)
            return resumed, ended

        resumed, ended = asyncio.run(main())
        self.assertEqual(len(resumed), 1, "the task ended before the peer resumed")
        self.assertGreaterEqual(ended, resumed[0])
        # The engine goes on: the next transfer works.
        async def again():
            return await e.transfer_aio(self.target, self.local, self.peer_managed, 4096, READ)
        self.assertEqual(asyncio.run(again()), 0, kvpipe.last_error())

    def test_close_with_awaits_pending(self):
        e = self.eng
        self.assertEqual(e.transfer_sync_read(self.target, self.local, self.peer_managed, 64), 0)

        async def main():
            self.stop_peer()
            fut = asyncio.ensure_future(
                e.transfer_aio(self.target, self.local, self.peer_managed, SIZE, READ))
            await asyncio.sleep(0.2)
            os.kill(self.peer.proc.pid, signal.SIGCONT)
            e.close()  # cancels, waits for the batch, resolves the future
            return await asyncio.wait_for(fut, 30)

        self.assertEqual(asyncio.run(main()), -kvpipe.ECLOSED)

    def test_ctrl_c_interrupts_a_sync_wait(self):
        """batch_transfer_sync waits on its callback's eventfd, without 100 ms
        slices: a SIGINT ends the wait at once (the peer is stopped), the
        call cancels its batch - what had not started never runs - and raises
        KeyboardInterrupt once what had started finished (the peer resumed)."""
        e, n, mib = self.eng, 16, 1 << 20
        local = e.allocate_managed_buffer(n * mib)
        e.write_bytes_to_buffer(local, b"\xee" * (n * mib), n * mib)
        self.assertEqual(e.transfer_sync_read(self.target, self.local, self.peer_managed, 64), 0)
        self.stop_peer()
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        # Resumed later: the interrupted call frees its batch, which waits for
        # what had started (kvpipe's cancel guarantee).
        resume = threading.Timer(1.0, os.kill, (self.peer.proc.pid, signal.SIGCONT))
        timer.start()
        resume.start()
        try:
            with self.assertRaises(KeyboardInterrupt):
                # 16 requests of 1 MiB: at most 4 run at once on one peer.
                e.batch_transfer_sync_read(self.target, [local + i * mib for i in range(n)],
                                           [self.peer_managed] * n, [mib] * n)
        finally:
            timer.cancel()
            resume.join()
        # The last requests were cancelled, not run: their memory is untouched.
        self.assertEqual(e.read_bytes_from_buffer(local + (n - 1) * mib, 64), b"\xee" * 64)
        self.assertEqual(e.transfer_sync_read(self.target, self.local, self.peer_managed, 64), 0,
                         kvpipe.last_error())


class ExampleTests(unittest.TestCase):
    def test_aio_transfer_example(self):
        here = os.path.dirname(os.path.abspath(__file__))
        example = os.path.join(here, os.pardir, os.pardir, "examples", "aio_transfer.py")
        if not os.path.isfile(example):
            self.skipTest("no source tree")
        import subprocess
        out = subprocess.run([sys.executable, example, "50"], capture_output=True, text=True,
                             timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("50 concurrent READs of 4096 bytes: ok", out.stdout)


if __name__ == "__main__":
    tu.main()
