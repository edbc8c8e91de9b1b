"""Compatibility package: Mooncake's ``mooncake.engine`` served by kvpipe.

Installed only on request (``cmake --install build --component mooncake``), so
that it never shadows a real Mooncake installation by accident. Only the
transfer engine is provided; ``mooncake.store`` and the rest of Mooncake's
wheel are not.
"""

__all__ = ["engine"]
