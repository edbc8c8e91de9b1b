"""Status codes: the Python module's constants and texts are the C table's
(KVP_STATUS_LIST in include/kvpipe/status.h), every one of them."""
import os
import re
import unittest

import kvpipe

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                      "include", "kvpipe", "status.h")


def table():
    """[(name, value, text)] from the header's X-macro table."""
    with open(HEADER, encoding="utf-8") as f:
        text = f.read()
    return [(m.group(1), int(m.group(2)), m.group(3))
            for m in re.finditer(r'X\((KVP_\w+), (\d+), "([^"]*)"\)', text)]


class StatusTable(unittest.TestCase):
    def setUp(self):
        if not os.path.isfile(HEADER):
            self.skipTest("no source tree here: " + HEADER)
        self.rows = table()

    def test_constants_and_texts(self):
        self.assertGreaterEqual(len(self.rows), 18)
        for i, (name, value, text) in enumerate(self.rows):
            self.assertEqual(value, i, name)  # append-only: no holes, no renumbering
            short = name[len("KVP_"):]
            self.assertEqual(getattr(kvpipe, short), value, short)
            self.assertEqual(kvpipe.strerror(value), text, short)
            self.assertEqual(kvpipe.strerror(-value), text, short)  # Mooncake's negative ints

    def test_no_other_constants(self):
        names = {name[len("KVP_"):] for name, _, _ in self.rows}
        ours = {n for n in dir(kvpipe)
                if re.fullmatch(r"E[A-Z]+|OK", n) and isinstance(getattr(kvpipe, n), int)}
        self.assertEqual(ours, names)

    def test_unknown(self):
        self.assertEqual(kvpipe.strerror(len(self.rows)), "unknown status")


if __name__ == "__main__":
    unittest.main()
