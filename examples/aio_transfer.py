"""aio_transfer: many transfers awaited at once on one asyncio loop.

    python3 examples/aio_transfer.py [N]

Two kvpipe engines in this process (P2PHANDSHAKE, no metadata store): the
target fills a managed buffer; the initiator READs it in N pieces (default
64) with N concurrent `await engine.transfer_aio(...)`, all waited for by one
reader of the engine's completion fd (no thread per wait), then WRITEs them
back with one `batch_transfer_aio` and shows a cancelled await. Needs the
kvpipe module (pip install ., or PYTHONPATH=build/python).
"""
import asyncio
import sys

import kvpipe

READ, WRITE = kvpipe.TransferOpcode.Read, kvpipe.TransferOpcode.Write


def engine():
    e = kvpipe.TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:  # a free port
        sys.exit("initialize: %s" % kvpipe.last_error())
    return e


async def main(n):
    target, initiator = engine(), engine()
    name = target.get_segment_name()
    piece = 4096
    src = target.allocate_managed_buffer(n * piece)
    data = bytes(i % 251 for i in range(n * piece))
    target.write_bytes_to_buffer(src, data, len(data))
    dst = initiator.allocate_managed_buffer(n * piece)

    # N awaits in flight at once.
    results = await asyncio.gather(*(
        initiator.transfer_aio(name, dst + i * piece, src + i * piece, piece, READ)
        for i in range(n)))
    assert results == [0] * n, kvpipe.last_error()
    assert initiator.read_bytes_from_buffer(dst, len(data)) == data
    print("%d concurrent READs of %d bytes: ok" % (n, piece))

    # One batch, written back reversed.
    r = await initiator.batch_transfer_aio(name, [dst + i * piece for i in range(n)],
                                           [src + (n - 1 - i) * piece for i in range(n)],
                                           [piece] * n, WRITE)
    assert r == 0, kvpipe.last_error()
    print("a batch of %d WRITEs: ok" % n)

    # Cancelling the awaiting task cancels the batch; CancelledError comes
    # once kvpipe no longer touches the memory.
    task = asyncio.create_task(initiator.batch_transfer_aio(
        name, [dst] * n, [src] * n, [piece] * n, READ))
    await asyncio.sleep(0)
    task.cancel()
    try:
        await task
        print("the batch finished before the cancel took effect")
    except asyncio.CancelledError:
        print("cancelled: the batch is done with the memory")
    initiator.close()
    target.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 64))
