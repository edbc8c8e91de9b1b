"""``from mooncake.engine import TransferEngine`` yields kvpipe's TransferEngine.

Same method names, argument order, defaults and return conventions as
Mooncake's binding (see docs/python.md for the few differences).
"""

from kvpipe import Read, TransferEngine, TransferNotify, TransferOpcode, Write  # noqa: F401

# Capability flags Mooncake's module exports; kvpipe has no GPU transports.
SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False

# Marks the implementation for code that wants to know.
BACKEND = "kvpipe"

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "Read", "Write"]
