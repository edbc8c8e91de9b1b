"""kvpipe's PEP 517 build backend: `pip install .` and `python -m build`.

It builds the extension module with kvpipe's own CMake build (the python/
target, which links libkvpipe.a in, so the wheel needs only Debian's shared
libraries: libzmq5, libcurl4, ...) with the headers of the interpreter that
runs it (CPython >= 3.11), and packs it with its type stubs into a wheel. The
module is kvpipe.abi3.so, built against CPython's stable ABI: the wheel is
tagged cp311-abi3-<platform> and installs in every CPython >= 3.11.

Why not setuptools: pip builds in an isolated environment and fetches the
backend's requirements from an index first; with requires = [] and this backend
in the tree, `pip install .` works offline, for any interpreter (Debian's, a
pyenv one, a venv), with nothing but CMake and a C compiler.

Config settings (pip -C / --config-settings, build -C):
  build-dir=DIR      the CMake build folder (default: build-wheel/<tag>-<id> in the
                     source tree, kept between builds so a rebuild is quick)
  cmake-args=ARGS    more arguments for CMake's configure step (also env
                     KVPIPE_CMAKE_ARGS), e.g. "-DKVP_WITH_REDIS=OFF"
"""
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import wheel_writer  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
NAME = "kvpipe"
# What the sdist carries: everything the CMake build of the module reads.
SDIST_PATHS = ["CMakeLists.txt", "cmake", "compat", "include", "src", "tools", "bench", "python", "docs",
               "examples", "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"]


def _project_table():
    """[project] of pyproject.toml: tomllib where the interpreter has it, else
    the simple `key = "value"` lines this file uses."""
    path = os.path.join(ROOT, "pyproject.toml")
    try:
        import tomllib
        with open(path, "rb") as f:
            return tomllib.load(f).get("project", {})
    except ImportError:
        table, section = {}, None
        with open(path, encoding="utf-8") as f:
            for line in f:
                m = re.match(r"\s*\[([^\]]+)\]", line)
                if m:
                    section = m.group(1).strip()
                    continue
                m = re.match(r'\s*([A-Za-z-]+)\s*=\s*"([^"]*)"', line)
                if section == "project" and m:
                    table[m.group(1)] = m.group(2)
        return table


def _metadata(version):
    p = _project_table()
    license_ = p.get("license", "")
    if isinstance(license_, dict):
        license_ = license_.get("text", "")
    fields = [("Name", NAME), ("Version", version), ("Summary", p.get("description", "")),
              ("License", license_), ("Requires-Python", p.get("requires-python", ">=3.11"))]
    desc = ("kvpipe moves KV-cache tensors between the prefill and decode instances of a "
            "disaggregated LLM server.\n\n`kvpipe.TransferEngine` serves Mooncake's "
            "TransferEngine API and `kvpipe.Pipe` vLLM's MooncakePipe. The `mooncake` "
            "compatibility package is separate (python/mooncake_shim).\n")
    fields.append(("Description-Content-Type", "text/markdown"))
    return wheel_writer.metadata_text(fields, desc)


# The module is built against CPython's stable ABI of 3.11 (python/kvpy.h:
# Py_LIMITED_API), whatever interpreter builds it: one wheel for every CPython
# >= 3.11.
ABI3_FLOOR = (3, 11)


def _tag():
    """cp311-abi3-<platform>: the module is kvpipe.abi3.so (PEP 425, PEP 384)."""
    if sys.implementation.name != "cpython" or sys.version_info[:2] < ABI3_FLOOR:
        raise RuntimeError("kvpipe builds an abi3 module for CPython >= %d.%d; this is %s %d.%d"
                           % (ABI3_FLOOR + (sys.implementation.name,) + sys.version_info[:2]))
    plat = re.sub(r"[-.]", "_", sysconfig.get_platform())
    return "cp%d%d-abi3-%s" % (ABI3_FLOOR + (plat,))


def _interpreter_id():
    """Names the interpreter (a venv's base one: the same headers) for the build
    folder, so that two interpreters of one tag do not share a CMake cache."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return hashlib.sha256(exe.encode()).hexdigest()[:8]


def _setting(config_settings, key, env=None):
    value = (config_settings or {}).get(key)
    if value is None and env:
        value = os.environ.get(env)
    return value


def _run(cmd):
    print("kvpipe_build: " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def _build_module(build_dir, stage, cmake_args):
    """Configure and build the python target; install its component into stage."""
    _run(["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
          "-DKVP_TESTS=OFF", "-DKVP_PYTHON=ON", "-DPython3_EXECUTABLE=" + sys.executable,
          "-DKVP_PYTHON_INSTALL_DIR=."] + cmake_args)
    _run(["cmake", "--build", build_dir, "--target", "kvpipe_python",
          "-j%d" % max(1, min(os.cpu_count() or 1, 8))])
    _run(["cmake", "--install", build_dir, "--component", "python", "--prefix", stage])
    built = [f for f in os.listdir(stage) if f.startswith(NAME + ".") and f.endswith(".so")]
    if built != [NAME + ".abi3.so"]:
        raise RuntimeError("expected kvpipe.abi3.so from the build, found %s" % built)
    return os.path.join(stage, built[0])


# ---------------------------------------------------------------- PEP 517 ---

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = wheel_writer.project_version(os.path.join(ROOT, "CMakeLists.txt"))
    tag = _tag()
    build_dir = _setting(config_settings, "build-dir") or os.path.join(
        ROOT, "build-wheel", "%s-%s" % (tag, _interpreter_id()))
    cmake_args = shlex.split(_setting(config_settings, "cmake-args", "KVPIPE_CMAKE_ARGS") or "")
    stage = tempfile.mkdtemp(prefix="kvpipe-wheel-")
    try:
        module = _build_module(os.path.abspath(build_dir), stage, cmake_args)
        files = [(os.path.basename(module), module),
                 # PEP 561 stub-only package: type checkers find it beside the module.
                 ("kvpipe-stubs/__init__.pyi", os.path.join(ROOT, "python", "kvpipe.pyi")),
                 ("%s-%s.dist-info/LICENSE" % (NAME, version), os.path.join(ROOT, "LICENSE"))]
        return wheel_writer.write_wheel(wheel_directory, NAME, version, tag, files,
                                        _metadata(version), purelib=False)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def build_sdist(sdist_directory, config_settings=None):
    version = wheel_writer.project_version(os.path.join(ROOT, "CMakeLists.txt"))
    return wheel_writer.write_sdist(sdist_directory, NAME, version, ROOT, SDIST_PATHS,
                                    _metadata(version))
