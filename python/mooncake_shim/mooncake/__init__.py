"""Compatibility package: Mooncake's ``mooncake.engine`` served by kvpipe.

A package of its own, installed only on request (``pip install
./python/mooncake_shim``, or ``cmake --install build --component mooncake``), so
that it never shadows a real Mooncake installation by accident. Only the
transfer engine is provided; ``mooncake.store`` and the rest of Mooncake's
wheel are not.
"""

__all__ = ["engine"]
