"""The .pyi stubs (python/kvpipe.pyi, installed as kvpipe-stubs) name exactly
what the kvpipe module has: every stubbed name exists, every public name is
stubbed, class by class."""
import ast
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvpy_testutil as tu  # noqa: E402

import kvpipe  # noqa: E402


def stub_path():
    """The installed stubs when kvpipe is installed, else the source tree's."""
    for d in sys.path:
        p = os.path.join(d, "kvpipe-stubs", "__init__.pyi")
        if d and os.path.isfile(p):
            return p
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "kvpipe.pyi")


def names_in(body):
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_") or n.startswith("__")}


def public(names):
    return {n for n in names if not n.startswith("_")}


class StubTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(stub_path()) as f:
            cls.tree = ast.parse(f.read())
        cls.classes = {n.name: n for n in cls.tree.body if isinstance(n, ast.ClassDef)}

    def test_module_names_match(self):
        stubbed = public(names_in(self.tree.body))
        runtime = public(dir(kvpipe))
        self.assertEqual(sorted(stubbed - runtime), [], "stubbed but not in the module")
        self.assertEqual(sorted(runtime - stubbed), [], "in the module but not stubbed")

    def test_class_members_match(self):
        for name, node in self.classes.items():
            cls = getattr(kvpipe, name)
            if issubclass(cls, BaseException):
                continue  # .status is set on each instance; the rest is RuntimeError's
            stubbed = names_in(node.body)
            for member in stubbed:
                self.assertTrue(hasattr(cls, member), "%s.%s is stubbed but missing" % (name, member))
            runtime = public(vars(cls))
            self.assertEqual(sorted(runtime - stubbed), [], "%s: members not stubbed" % name)

    def test_opcode_values(self):
        node = self.classes["TransferOpcode"]
        for a in node.body:
            if isinstance(a, ast.Assign):
                self.assertEqual(int(getattr(kvpipe.TransferOpcode, a.targets[0].id)), a.value.value)


if __name__ == "__main__":
    tu.main()
