"""The target side of the two-process engine tests.

    engine_peer.py LOCAL_NAME METADATA SIZE [PROTOCOL]

Starts a TransferEngine (PROTOCOL defaults to tcp), allocates a managed buffer of SIZE bytes and registers
a ctypes buffer of SIZE bytes, fills both with pattern(seed 1 / seed 2), prints

    READY <rpc_port> <managed_addr> <registered_addr>

and then serves commands from stdin, one per line:

    HEX <addr> <length>   print the bytes at addr as hex
    SHA <addr> <length>   print the sha256 of the bytes at addr
    WAITNOTIFY <name> <addr> <length>
                          poll get_notifies() until a notification of that name
                          arrives (10 s at most), then at once print
                          "GOT <msg> <sha256 of the bytes at addr>", or "NONE";
                          other notifications are printed as "OTHER <name> <msg>"
    EXIT                  close the engine and exit 0
"""
import ctypes
import hashlib
import sys
import time

import kvpipe


def pattern(seed, n):
    return bytes((i * 7 + seed * 13) % 251 for i in range(n))


def main():
    name, metadata, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    protocol = sys.argv[4] if len(sys.argv) > 4 else "tcp"
    eng = kvpipe.TransferEngine()
    if eng.initialize(name, metadata, protocol, "") != 0:
        print("FAILED", kvpipe.last_error(), flush=True)
        return 1
    managed = eng.allocate_managed_buffer(size)
    region = ctypes.create_string_buffer(size)
    if not managed or eng.register_memory(ctypes.addressof(region), size) != 0:
        print("FAILED", kvpipe.last_error(), flush=True)
        return 1
    eng.write_bytes_to_buffer(managed, pattern(1, size), size)
    eng.write_bytes_to_buffer(ctypes.addressof(region), pattern(2, size), size)
    print("READY", eng.get_rpc_port(), managed, ctypes.addressof(region), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words and words[0] == "HEX":
            data = eng.read_bytes_from_buffer(int(words[1]), int(words[2]))
            print(data.hex(), flush=True)
        elif words and words[0] == "SHA":
            data = eng.read_bytes_from_buffer(int(words[1]), int(words[2]))
            print(hashlib.sha256(data).hexdigest(), flush=True)
        elif words and words[0] == "WAITNOTIFY":
            want, addr, n = words[1], int(words[2]), int(words[3])
            deadline, reply = time.monotonic() + 10, "NONE"
            while reply == "NONE" and time.monotonic() < deadline:
                for note in eng.get_notifies():
                    if note.name == want:
                        digest = hashlib.sha256(eng.read_bytes_from_buffer(addr, n)).hexdigest()
                        reply = "GOT %s %s" % (note.msg, digest)
                    else:
                        print("OTHER", note.name, note.msg, flush=True)
                if reply == "NONE":
                    time.sleep(0.0005)
            print(reply, flush=True)
        elif words and words[0] == "EXIT":
            break
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
