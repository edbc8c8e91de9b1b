"""Write a wheel (PEP 427) and an sdist: what kvpipe's two build backends share.

A wheel is a zip of the files to install plus a NAME-VERSION.dist-info folder
holding METADATA, WHEEL and RECORD (each file's sha256 and size), which is what
pip needs to list (`pip show`) and remove (`pip uninstall`) a package. Written
here with the standard library only, so that building needs nothing from an
index (see kvpipe_build.py).
"""
import base64
import hashlib
import os
import re
import tarfile
import zipfile

GENERATOR = "kvpipe_build"


def project_version(cmakelists):
    """The version in CMakeLists.txt's project() call: the one place it lives."""
    with open(cmakelists, encoding="utf-8") as f:
        m = re.search(r"project\(\s*kvpipe\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if not m:
        raise RuntimeError("no 'project(kvpipe VERSION x.y.z' in %s" % cmakelists)
    return m.group(1)


def metadata_text(fields, description=""):
    """Core metadata 2.1: fields is a list of (name, value) pairs."""
    lines = ["Metadata-Version: 2.1"] + ["%s: %s" % kv for kv in fields]
    text = "\n".join(lines) + "\n"
    if description:
        text += "\n" + description
    return text


def _record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (arcname, digest, len(data))


def write_wheel(wheel_dir, name, version, tag, files, metadata, purelib):
    """Write NAME-VERSION-TAG.whl into wheel_dir and return its file name.

    files: (archive name, path on disk) pairs; metadata: the METADATA text."""
    dist_info = "%s-%s.dist-info" % (name, version)
    wheel_text = "Wheel-Version: 1.0\nGenerator: %s\nRoot-Is-Purelib: %s\nTag: %s\n" % (
        GENERATOR, "true" if purelib else "false", tag)
    entries = []
    for arcname, path in files:
        with open(path, "rb") as f:
            entries.append((arcname, f.read(), os.stat(path).st_mode))
    entries.append((dist_info + "/METADATA", metadata.encode(), 0o644))
    entries.append((dist_info + "/WHEEL", wheel_text.encode(), 0o644))
    record = [_record_line(a, d) for a, d, _ in entries] + [dist_info + "/RECORD,,"]
    entries.append((dist_info + "/RECORD", ("\n".join(record) + "\n").encode(), 0o644))

    filename = "%s-%s-%s.whl" % (name, version, tag)
    tmp = os.path.join(wheel_dir, filename + ".part")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data, mode in entries:
            info = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (mode & 0o777 | 0o100000) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    os.replace(tmp, os.path.join(wheel_dir, filename))
    return filename


def write_sdist(sdist_dir, name, version, root, paths, metadata):
    """Write NAME-VERSION.tar.gz holding root's paths (files or folders) and
    PKG-INFO; return its file name. __pycache__ and build folders stay out."""
    base = "%s-%s" % (name, version)
    filename = base + ".tar.gz"

    def keep(info):
        parts = info.name.split("/")
        if any(p == "__pycache__" or p.startswith("build") and p != "build_backend" for p in parts[1:]):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    tmp = os.path.join(sdist_dir, filename + ".part")
    with tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for p in paths:
            tar.add(os.path.join(root, p), arcname=base + "/" + p, filter=keep)
        pkg_info = os.path.join(sdist_dir, base + ".PKG-INFO.part")
        with open(pkg_info, "w", encoding="utf-8") as f:
            f.write(metadata)
        tar.add(pkg_info, arcname=base + "/PKG-INFO", filter=keep)
        os.unlink(pkg_info)
    os.replace(tmp, os.path.join(sdist_dir, filename))
    return filename
