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


# ---- the pipe ----------------------------------------------------------------
#
# Pipe.recv_tensor_async() and send_tensor_async(): tries that never wait
# (Pipe._aio_recv, _aio_send: kvp_pipe_recv / kvp_pipe_send_timeout with 0),
# and between them a wait on the pipe's descriptor for that direction
# (kvp_pipe_recv_fd, kvp_pipe_send_fd) with the running loop's add_reader.
# Awaits of one pipe on one loop share one reader per descriptor. A task
# cancelled while it waits took nothing from the pipe (a receive) or sent
# nothing (a send).

class _Readers:
    """The awaits of one descriptor on one loop: one add_reader for all."""

    def __init__(self):
        self.waiting = {}  # (loop, fd) -> set of futures

    def wait(self, loop, fd):
        fut = loop.create_future()
        key = (loop, fd)
        futs = self.waiting.get(key)
        if futs is None:
            futs = self.waiting[key] = set()
            loop.add_reader(fd, self._ready, key)
        futs.add(fut)
        return fut

    def _ready(self, key):
        for fut in self.waiting.pop(key, ()):
            if not fut.done():
                fut.set_result(None)
        key[0].remove_reader(key[1])

    def forget(self, loop, fd, fut):
        key = (loop, fd)
        futs = self.waiting.get(key)
        if futs is None:
            return
        futs.discard(fut)
        if not futs:
            del self.waiting[key]
            loop.remove_reader(fd)


_readers = _Readers()


async def _wait_readable(fd, timeout):
    loop = asyncio.get_running_loop()
    fut = _readers.wait(loop, fd)
    try:
        if timeout is None:
            await fut
        else:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        pass
    finally:
        _readers.forget(loop, fd, fut)


def _timed_out(text):
    import kvpipe
    err = kvpipe.Error(text)
    err.status = kvpipe.ETIMEDOUT
    return err


async def pipe_recv(pipe, fd, timeout, device):
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    last = False
    while True:
        ready, tensor = pipe._aio_recv(device, last)
        if ready:
            return tensor
        if last:
            raise _timed_out("recv_tensor_async: nothing arrived within the timeout")
        left = None if deadline is None else deadline - loop.time()
        last = left is not None and left <= 0
        if not last:
            await _wait_readable(fd, left)


async def pipe_send(pipe, fd, obj, timeout):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pipe._aio_send(obj):
        left = deadline - loop.time()
        if left <= 0:
            raise _timed_out("send_tensor_async: the peer took nothing within send_timeout "
                             "(no room under kv_buffer_size, or not connected)")
        # Room comes with an ACK (the descriptor); a peer connecting is not
        # told by it: look again after 10 ms at the latest.
        await _wait_readable(fd, min(left, 0.01))
