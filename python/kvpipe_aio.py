"""kvpipe's asyncio glue: what TransferEngine.transfer_async() and
batch_transfer_async() return, and how their batches are waited for.

This file is compiled into the extension module (python/embed.cmake turns it
into a C string; kvpipe_module.c runs it once at import), so the wheel, the
installed module and the device bundle carry it without a package around
kvpipe.abi3.so. It only uses asyncio; the C side (engine_py.c) submits the
batches with kvp_batch_opts.reap and reaps them.

Waiting: one reader per (engine, event loop) on the engine's completion fd
(kvp_engine_completion_fd, level-triggered), added while that loop awaits a
batch of the engine and removed when it awaits none: never a thread per
wait. The reader reaps every completed batch and resolves its future, on the
future's own loop.

Cancelling: BatchFuture.cancel() cancels the batch (kvp_batch_cancel) and
returns False: the future resolves only once the batch completed, so a task
awaiting it raises CancelledError only when nothing of kvpipe touches the
requests' memory any more (docs/reliability.md, "Cancel").
"""
import asyncio


class BatchFuture(asyncio.Future):
    """The future of one awaited batch: its result is 0, or a negative
    status (Mooncake's convention; kvpipe.last_error() has the detail)."""

    _kvp_engine = None
    _kvp_op = None

    def cancel(self, msg=None):
        if self.done():
            return False
        engine, op = self._kvp_engine, self._kvp_op
        if engine is None:  # never submitted
            return super().cancel(msg=msg)
        # Once. _kvp_op stays: it owns the C side's record of the batch,
        # which the engine's list holds until the batch is reaped.
        self._kvp_engine = None
        engine._aio_cancel(op)
        # Not cancelled yet: it resolves when the batch completed, and a task
        # awaiting it then raises CancelledError (Task.cancel's rule when the
        # awaited future does not cancel at once).
        return False


class State:
    """One engine's waiting: its completion fd and the loops reading it."""

    def __init__(self, fd):
        self.fd = fd
        self.loops = {}  # loop -> batches it awaits


def new_future():
    loop = asyncio.get_running_loop()
    return BatchFuture(loop=loop)


async def wait(fut):
    """What the transfer_aio methods return: a coroutine, so that
    asyncio.create_task() takes it; its batch was submitted already."""
    return await fut


def watch(engine, state, fut):
    """fut's batch was submitted: its loop reads the fd until it completes."""
    loop = fut.get_loop()
    n = state.loops.get(loop, 0)
    if n == 0:
        loop.add_reader(state.fd, _ready, engine, state, loop)
    state.loops[loop] = n + 1


def _ready(engine, state, loop):
    for fut, value in engine._aio_reap():
        owner = fut.get_loop()
        if owner is loop:
            _resolve(state, fut, value)
        else:
            owner.call_soon_threadsafe(_resolve, state, fut, value)


def _resolve(state, fut, value):
    if not fut.done():
        fut.set_result(value)
    loop = fut.get_loop()
    n = state.loops.get(loop, 0) - 1
    if n > 0:
        state.loops[loop] = n
    elif state.loops.pop(loop, None) is not None:
        loop.remove_reader(state.fd)


def close(state, pending):
    """The engine closes: its readers go before its fd does; futures still
    pending (their batches cancelled and freed already) resolve with value."""
    for loop in list(state.loops):
        try:
            loop.remove_reader(state.fd)
        except Exception:  # a closed loop
            pass
    state.loops.clear()
    for fut, value in pending:
        try:
            fut.get_loop().call_soon_threadsafe(_settle, fut, value)
        except RuntimeError:  # its loop is closed
            pass


def _settle(fut, value):
    if not fut.done():
        fut.set_result(value)
