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

    def test_signatures_match_the_method_table(self):
        """Each method's parameters, as the C method table's docstring spells
        them on its first line ("name(a, b=..., ...) -> ..."), are the stub's,
        in order, with the same ones optional: the table and the .pyi cannot
        drift apart."""
        import re
        checked = 0
        for cname, node in self.classes.items():
            cls = getattr(kvpipe, cname)
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                    continue
                if any(isinstance(d, ast.Name) and d.id in ("property", "overload")
                       for d in fn.decorator_list):
                    continue
                doc = (getattr(getattr(cls, fn.name), "__doc__", None) or "").split("\n")[0]
                m = re.match(r"%s\((.*?)\)" % re.escape(fn.name), doc)
                if not m:
                    continue  # no signature line (Python's own, or a property)
                runtime = [p.strip() for p in m.group(1).split(",") if p.strip()]
                runtime = [(p.split("=")[0].strip(), "=" in p) for p in runtime
                           if p.strip() not in ("/", "*")]
                args = fn.args.args[1:] if fn.args.args and fn.args.args[0].arg == "self" \
                    else fn.args.args
                first_default = len(args) - len(fn.args.defaults)
                stub = [(a.arg, i >= first_default) for i, a in enumerate(args)]
                stub += [(a.arg, d is not None) for a, d in zip(fn.args.kwonlyargs,
                                                                   fn.args.kw_defaults)]
                self.assertEqual(runtime, stub, "%s.%s: the method table says %r"
                                 % (cname, fn.name, doc))
                checked += 1
        self.assertGreater(checked, 30)

    def test_opcode_values(self):
        node = self.classes["TransferOpcode"]
        for a in node.body:
            if isinstance(a, ast.Assign):
                self.assertEqual(int(getattr(kvpipe.TransferOpcode, a.targets[0].id)), a.value.value)


if __name__ == "__main__":
    tu.main()
