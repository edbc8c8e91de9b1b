"""TransferEngine.stats() and Pipe.stats(): the engine's and the pipe's metrics
counted exactly against a target in another process, as dicts and as
Prometheus text; the endpoint of a child started with KVPIPE_METRICS_PORT."""
import math
import os
import sys
import time
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import kvpipe  # noqa: E402

SIZE = 1 << 20
BLOCK = 4096


def scrape(port):
    with urllib.request.urlopen("http://%s:%d/metrics" % (tu.HOST, port), timeout=10) as r:
        return r.headers.get("Content-Type", ""), r.read().decode()


def sample(text, name, **labels):
    """The value of the first sample `name{...}` carrying every label given."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        base = series.split("{", 1)[0]
        if base != name:
            continue
        if all('%s="%s"' % kv in series for kv in labels.items()):
            return float(value)
    return None


class EngineStatsTests(unittest.TestCase):
    """This process reads and writes a target engine in a child process,
    which serves its metrics on an endpoint (env KVPIPE_METRICS_PORT)."""

    def setUp(self):
        self.metrics_port = tu.free_port()
        self.target = "%s:%d" % (tu.HOST, tu.free_port())
        env = dict(os.environ, KVPIPE_METRICS_PORT=str(self.metrics_port),
                   KVPIPE_DISABLE_SHM="1")
        here = os.path.dirname(os.path.abspath(__file__))
        self.peer = tu.Child([sys.executable, os.path.join(here, "engine_peer.py"), self.target,
                              "P2PHANDSHAKE", str(SIZE)], env=env)
        words = self.peer.readline().split()
        self.assertEqual(words[0], "READY", " ".join(words))
        self.peer_managed, self.peer_region = int(words[2]), int(words[3])
        self.eng = kvpipe.TransferEngine()
        name = "%s:%d" % (tu.HOST, tu.free_port())
        saved = os.environ.get("KVPIPE_DISABLE_SHM")
        os.environ["KVPIPE_DISABLE_SHM"] = "1"  # tcp, not the same-host transport
        try:
            self.assertEqual(self.eng.initialize(name, "P2PHANDSHAKE", "tcp", ""), 0,
                             kvpipe.last_error())
        finally:
            if saved is None:
                os.environ.pop("KVPIPE_DISABLE_SHM")
            else:
                os.environ["KVPIPE_DISABLE_SHM"] = saved
        self.local = self.eng.allocate_managed_buffer(SIZE)
        self.assertNotEqual(self.local, 0)

    def tearDown(self):
        self.eng.close()
        self.peer.finish()

    def test_counts_exactly(self):
        before = self.eng.stats()
        self.assertEqual(before["requests_total"]["read"]["tcp"], 0)
        self.assertEqual(before["inflight_requests"], 0)
        for i in range(6):
            self.assertEqual(self.eng.transfer_sync_read(
                self.target, self.local + i * BLOCK, self.peer_managed + i * BLOCK, BLOCK), 0,
                kvpipe.last_error())
        self.assertEqual(self.eng.transfer_sync_write(
            self.target, self.local, self.peer_region, 3 * BLOCK), 0, kvpipe.last_error())
        # Past the end of the peer's region: refused before anything is sent.
        self.assertLess(self.eng.transfer_sync_read(
            self.target, self.local, self.peer_region + SIZE - 8, 64), 0)
        tr = self.eng.segment_transport(self.target)
        self.assertEqual(tr, "tcp")
        s = self.eng.stats()
        self.assertEqual(s["requests_total"]["read"]["tcp"], 6)
        self.assertEqual(s["bytes_total"]["read"]["tcp"], 6 * BLOCK)
        self.assertEqual(s["bytes_total"]["write"]["tcp"], 3 * BLOCK)
        self.assertEqual(s["requests_total"]["read"]["shm"], 0)
        self.assertEqual(s["errors_total"]["read"]["ERANGE"], 1)
        self.assertEqual(s["errors_total"]["read"]["ETIMEDOUT"], 0)
        h = s["request_duration_seconds"]["read"]
        self.assertEqual(h["count"], 6)
        self.assertGreater(h["sum"], 0)
        counts = [n for _, n in h["buckets"]]
        self.assertEqual(counts, sorted(counts))  # cumulative
        self.assertTrue(math.isinf(h["buckets"][-1][0]))
        self.assertEqual(h["buckets"][-1][1], 6)
        self.assertEqual(s["inflight_bytes"], 0)
        self.assertGreaterEqual(s["pool_bytes"], SIZE)
        self.assertEqual(s["pool_free_bytes"], s["pool_bytes"] - SIZE)
        self.assertGreaterEqual(s["descriptor_lookups_total"], 1)
        # The same as Prometheus text.
        text = self.eng.stats(prometheus=True)
        self.assertIn("# TYPE kvpipe_engine_bytes_total counter\n", text)
        self.assertEqual(sample(text, "kvpipe_engine_bytes_total", op="read", transport="tcp"),
                         6 * BLOCK)
        self.assertEqual(sample(text, "kvpipe_engine_request_duration_seconds_bucket", op="read",
                                le="+Inf"), 6)
        # The target's endpoint, in its own process: what it served.
        ctype, served = scrape(self.metrics_port)
        self.assertIn("version=0.0.4", ctype)
        self.assertEqual(sample(served, "kvpipe_engine_served_bytes_total", op="read",
                                transport="tcp", engine=self.target), 6 * BLOCK)
        self.assertEqual(sample(served, "kvpipe_engine_served_bytes_total", op="write",
                                transport="tcp"), 3 * BLOCK)
        self.assertEqual(sample(served, "kvpipe_engine_registered_regions"), 2)

    def test_closed_engine(self):
        self.eng.close()
        with self.assertRaises(kvpipe.Error):
            self.eng.stats()


class PipeStatsTests(unittest.TestCase):
    def setUp(self):
        self.cfg = tu.pipe_config()
        # announced and READ (not inline), so that the engine counts the READs
        self.prefill = kvpipe.Pipe(self.cfg, 0, 0, inline_max_bytes=0)
        self.decode = kvpipe.Pipe(self.cfg, 0, 1, inline_max_bytes=0)

    def tearDown(self):
        self.prefill.close()
        self.decode.close()

    def test_counts_and_timeouts(self):
        data = bytearray(range(256)) * 40
        for _ in range(3):
            self.prefill.send_tensor(data)
        for _ in range(3):
            self.assertEqual(len(bytes(memoryview(self.decode.recv_tensor(timeout=30)))),
                             len(data))
        self.prefill.flush(timeout=30)
        with self.assertRaises(kvpipe.Error):
            self.decode.recv_tensor(timeout=0.01)
        s = self.prefill.stats()
        self.assertEqual((s["sent"], s["acks"], s["inflight_count"]), (3, 3, 0))
        self.assertEqual((s["send_timeouts"], s["recv_timeouts"]), (0, 0))
        d = self.decode.stats()
        self.assertEqual((d["received"], d["recv_timeouts"]), (3, 1))
        self.assertGreater(d["bytes_received"], 3 * len(data))
        # Its engine READ the three messages.
        self.assertEqual(sum(d["engine"]["requests_total"]["read"].values()), 3)
        self.assertGreater(d["engine"]["pool_bytes"], 0)
        text = self.decode.stats(prometheus=True)
        self.assertEqual(sample(text, "kvpipe_pipe_timeouts_total", op="recv"), 1)
        self.assertEqual(sample(text, "kvpipe_pipe_messages_total", direction="received"), 3)
        self.assertIsNotNone(sample(text, "kvpipe_engine_pool_bytes"))


if __name__ == "__main__":
    tu.main()
