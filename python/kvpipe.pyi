# Type stubs for the kvpipe extension module (python/*.c). Installed with the
# wheel as the stub package kvpipe-stubs (PEP 561); python/tests/test_stubs.py
# checks them against the module.
import enum
import os
from types import TracebackType
from typing import (Any, Awaitable, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, Type,
                    Union, overload)

__version__: str

OK: int
EINVAL: int
ENOMEM: int
ETIMEDOUT: int
ECONNREFUSED: int
ECONNRESET: int
ERANGE: int
ENOTFOUND: int
EPROTO: int
ENOTSUP: int
EMETADATA: int
EIO: int
EBUSY: int
ECONFIG: int
ECANCELED: int
EINPROGRESS: int
ECLOSED: int
EINTR: int
EAUTH: int
ECORRUPT: int

class Error(RuntimeError):
    """A kvpipe operation failed; str(e) says what and why."""

    status: int

def last_error() -> str: ...
def strerror(code: int) -> str: ...
def set_log_handler(handler: Optional[Callable[[int, str, str], Any]]) -> None: ...
def set_log_level(level: Union[str, int]) -> None: ...
def get_log_level() -> int: ...

class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1

Read: TransferOpcode
Write: TransferOpcode

class TransferNotify:
    name: str
    msg: str
    @overload
    def __init__(self) -> None: ...
    @overload
    def __init__(self, name: str, msg: str) -> None: ...

class TransferEngine:
    """Mooncake's TransferEngine API over kvpipe's engine; call initialize() first.

    Methods return Mooncake's int conventions (0 success, negative failure;
    batch ids 0 on failure) and set last_error()."""

    TransferOpcode: Type[TransferOpcode]
    def __init__(self) -> None: ...
    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str = ..., device_name: str = ...
    ) -> int: ...
    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def get_segment_name(self) -> str: ...
    def segment_transport(self, target_hostname: str) -> Optional[str]: ...
    def stats(self, prometheus: bool = ...) -> Union[Dict[str, Any], str]: ...
    def allocate_managed_buffer(self, length: int) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int: ...
    def register_memory(self, buffer_addr: int, capacity: int, location: str = ...) -> int: ...
    def unregister_memory(self, buffer_addr: int) -> int: ...
    def batch_register_memory(
        self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = ...
    ) -> int: ...
    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int: ...
    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: int,
        notify: Optional[TransferNotify] = ...,
        transport_hint: str = ...,
    ) -> int: ...
    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
        notify: Optional[TransferNotify] = ...,
    ) -> int: ...
    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
        notify: Optional[TransferNotify] = ...,
    ) -> int: ...
    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = ...,
    ) -> int: ...
    def transfer_check_status(self, batch_id: int) -> int: ...
    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
        notify: Optional[TransferNotify] = ...,
        transport_hint: str = ...,
    ) -> int: ...
    def transfer_aio(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: int,
    ) -> Awaitable[int]: ...
    def batch_transfer_aio(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
    ) -> Awaitable[int]: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
        notify: Optional[TransferNotify] = ...,
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
        notify: Optional[TransferNotify] = ...,
    ) -> int: ...
    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: int,
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
    ) -> int: ...
    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = ...,
    ) -> int: ...
    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int: ...
    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes: ...
    def get_notifies(self) -> List[TransferNotify]: ...
    def send_probe(self, peer_server_name: str) -> int: ...
    def get_first_buffer_address(self, segment_name: str) -> int: ...
    def get_local_topology(self, device_name: Optional[str] = ...) -> str: ...
    def warmup_efa_segment(self, segment_name: str) -> int: ...
    def get_engine(self) -> NoReturn: ...
    def get_engine_ptr(self) -> NoReturn: ...
    def close(self) -> None: ...

class Tensor:
    """A tensor from Pipe.recv_tensor() or Pipe.alloc_tensor(), in CPU memory or,
    from recv_tensor() with a device, on a CUDA device.

    Take it without a copy with torch.from_dlpack(t); in CPU memory also
    numpy.from_dlpack(t) or memoryview(t)."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]: ...
    def data_ptr(self) -> int: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = ...,
        max_version: Optional[Tuple[int, int]] = ...,
        dl_device: Optional[Tuple[int, int]] = ...,
        copy: Optional[bool] = ...,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

# What send_tensor() takes: a kvpipe.Tensor, or any object with __dlpack__ (in
# CPU or CUDA memory), __cuda_array_interface__ or the buffer protocol (a torch
# tensor, a numpy array, bytes).
_TensorLike = Any

class Pipe:
    """One side of a tensor pipe (vLLM's MooncakePipe wire); kv_rank 0 is
    prefill, 1 decode. config: the mooncake JSON's path, a dict of it, or None
    for $MOONCAKE_CONFIG_PATH."""

    def __init__(
        self,
        config: Union[str, "os.PathLike[str]", Dict[str, Any], None],
        local_rank: int,
        kv_rank: int,
        *,
        kv_buffer_size: Union[int, float] = ...,
        send_timeout: float = ...,
        io_timeout: float = ...,
        max_message_bytes: int = ...,
        disable_shm: bool = ...,
        inline_max_bytes: int = ...,
        recv_window: int = ...,
        recv_window_bytes: int = ...,
        max_control_frame: int = ...,
        redial_min: float = ...,
        redial_max: float = ...,
        ack_timeout: float = ...,
        ack_linger: float = ...,
        ack_delay_us: int = ...,
        zmq_hwm: int = ...,
        busy_poll_us: int = ...,
        device: Optional[Any] = ...,
        integrity: Optional[bool] = ...,
    ) -> None: ...
    @property
    def segment_name(self) -> str: ...
    @property
    def usable(self) -> bool: ...
    def send_tensor(self, tensor: Optional[_TensorLike]) -> None: ...
    def alloc_tensor(self, shape: Sequence[int], dtype: Any = ...) -> Tensor: ...
    def send_tensor_take(self, tensor: Tensor) -> None: ...
    def recv_tensor(
        self, timeout: Optional[float] = ..., device: Optional[Any] = ...
    ) -> Optional[Tensor]: ...
    def recv_tensor_async(
        self, timeout: Optional[float] = ..., device: Optional[Any] = ...
    ) -> Awaitable[Optional[Tensor]]: ...
    def send_tensor_async(self, tensor: Optional[_TensorLike]) -> Awaitable[None]: ...
    def flush(self, timeout: float = ...) -> None: ...
    def stats(self, prometheus: bool = ...) -> Union[Dict[str, Any], str]: ...
    def close(self) -> None: ...
    def __enter__(self) -> "Pipe": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None: ...
