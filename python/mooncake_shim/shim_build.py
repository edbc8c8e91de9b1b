"""PEP 517 backend of the `mooncake` shim: a pure-Python wheel of mooncake/.

It shares the wheel writer of kvpipe's backend (../build_backend, so it builds
from a kvpipe source tree) and takes kvpipe's version, which it also requires:
the shim is only ever a face of the kvpipe beside it."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, os.pardir, os.pardir))
sys.path.insert(0, os.path.join(ROOT, "python", "build_backend"))
import wheel_writer  # noqa: E402

NAME = "kvpipe_mooncake_shim"


def _version():
    return wheel_writer.project_version(os.path.join(ROOT, "CMakeLists.txt"))


def _metadata(version):
    return wheel_writer.metadata_text([
        ("Name", "kvpipe-mooncake-shim"), ("Version", version),
        ("Summary", "mooncake.engine served by kvpipe (shadows a real Mooncake)"),
        ("License", "MIT"), ("Requires-Python", ">=3.8"),
        ("Requires-Dist", "kvpipe (==%s)" % version)])


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = _version()
    pkg = os.path.join(HERE, "mooncake")
    files = [("mooncake/" + f, os.path.join(pkg, f)) for f in sorted(os.listdir(pkg))
             if f.endswith(".py")]
    files.append(("%s-%s.dist-info/LICENSE" % (NAME, version), os.path.join(ROOT, "LICENSE")))
    return wheel_writer.write_wheel(wheel_directory, NAME, version, "py3-none-any", files,
                                    _metadata(version), purelib=True)


def build_sdist(sdist_directory, config_settings=None):
    # A shim sdist would lose the kvpipe tree it takes its version from.
    raise NotImplementedError("the mooncake shim is built from a kvpipe source tree; "
                              "build kvpipe's sdist (python3 -m build --sdist) instead")
